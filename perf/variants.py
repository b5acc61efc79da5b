"""A/B the forward kernel's schedule choices against its default, with the anchors timed in
the same process, and break the per-call host time into its parts.

Each variant is a FwdConfig differing from config.fwd_config_for() in one field, so a row
says what that one feature is worth (perf/NOTES.md records the prediction made before each
run). Shapes, FLOPs, timing (one do_bench median per variant after a first call) and the
anchors are perf/harness.py's; the rows go to perf/results/<device-slug>-variants.json.

    python3 perf/variants.py [--seqlens 8192,16384] [--headdims 64,128] [--out DIR]
"""

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # perf/, when loaded by path
import harness  # noqa: E402
from harness import log  # noqa: E402

ANCHORS = ("fa4", "sdpa_cudnn")


def _features(causal: bool):
    from cute_attn.config import AttnFeatures

    return AttnFeatures(mask="causal" if causal else "none")


def variants_for(head_dim: int, causal: bool) -> dict:
    from cute_attn.config import fwd_config_for

    base = fwd_config_for(head_dim, _features(causal))
    out = {
        "default": base,
        "flip_pingpong": dataclasses.replace(base, pingpong=not base.pingpong),
        "no_intra_wg_overlap": dataclasses.replace(base, intra_wg_overlap=False),
        "stages_3": dataclasses.replace(base, num_stages=3),
    }
    if head_dim == 128:
        out["tile_n_176"] = dataclasses.replace(base, tile_n=176)
        out["tile_n_96"] = dataclasses.replace(base, tile_n=96)
    if head_dim == 64:
        out["tile_m_128"] = dataclasses.replace(base, tile_m=128)
    return out


def run_variants(seqlens, head_dims, dtype):
    from cute_attn import launcher

    impls, _ = harness.load_impls(ANCHORS)
    rows = []
    for d in head_dims:
        for causal in (False, True):
            features, args = _features(causal), launcher.RunArgs(softmax_scale=d**-0.5)
            for s in seqlens:
                b, h = harness.sweep_shape(s, d)
                q, k, v = harness.random_qkv(b, s, h, d, dtype)
                flops = harness.attention_flops(b, h, s, s, d, causal)
                row = {"headdim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h}
                for name, cfg in variants_for(d, causal).items():
                    fn = functools.partial(launcher.run_fwd, q, k, v, features, args, cfg)
                    try:
                        ms = harness.make_timer(fn, "fwd")()
                        row[name] = round(harness.tflops(flops, ms), 1)
                    except Exception as e:  # a variant that does not fit (smem, registers)
                        row[name] = f"error: {harness.reason(e)}"
                for name, impl in impls.items():
                    ms = harness.time_impl(impl, q, k, v, causal)
                    row[name] = round(harness.tflops(flops, ms), 1)
                log(json.dumps(row))
                rows.append(row)
    return rows


def host_breakdown(dtype):
    """us per call of each piece of the mha call path on harness.HOST_SHAPE (b1 s128 h16
    d128 causal), host loops of 2000 calls with a sync only at the ends."""
    import torch

    import cute_attn
    from cute_attn import launcher, validation
    from cute_attn.config import fwd_config_for

    shape = harness.HOST_SHAPE
    b, s, h, d = (shape[key] for key in ("batch", "seqlen", "nheads", "headdim"))
    q, k, v = harness.random_qkv(b, s, h, d, dtype)
    features, args = _features(shape["causal"]), launcher.RunArgs(softmax_scale=d**-0.5)
    out, lse = launcher.run_fwd(q, k, v, features, args)
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    fn = launcher.get_fwd_kernel(
        launcher.FwdKey(dtype_name, d, features, fwd_config_for(d, features)))
    cu, page_table = launcher._unused_cu_seqlens(q.device), launcher._unused_page_table(q.device)
    pieces = {
        "validate_fwd_inputs": lambda: validation.validate_fwd_inputs(q, k, v, None),
        "alloc out+lse": lambda: (torch.empty_like(q),
                                  torch.empty((b, h, s), dtype=torch.float32, device=q.device)),
        "compiled kernel call": lambda: fn(q, k, v, out, lse, cu, cu, page_table, 0, 0.088, 0.0, 0, 0, 1),
        "launcher.run_fwd": lambda: launcher.run_fwd(q, k, v, features,
                                                     launcher.RunArgs(softmax_scale=0.088)),
        "cute_attn.mha": lambda: cute_attn.mha(q, k, v, causal=shape["causal"]),
    }
    res = {}
    for name, f in pieces.items():
        res[name] = round(harness.host_us_per_call(f), 2)
        log(f"  {name:24s} {res[name]:7.2f} us/call")
    return res


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=harness.parse_int_list, default=[8192, 16384])
    p.add_argument("--headdims", type=harness.parse_int_list, default=[128, 64])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--skip-host", action="store_true")
    args = p.parse_args(argv)

    import torch

    dtype = torch.bfloat16
    result = {"device": harness.cuda_setup("perf/variants.py"),
              "date": time.strftime("%Y-%m-%d")}
    if not args.skip_host:
        result["host_us"] = host_breakdown(dtype)
    result["tflops"] = run_variants(args.seqlens, args.headdims, dtype)
    slug = harness.device_slug(result["device"])
    for directory in harness.output_dirs(args.out):
        harness.write_json(result, harness.result_path(directory, slug, "variants"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
