"""A/B the forward kernel's schedule choices against its default, with the anchors timed in
the same process, and break the per-call host time into its parts.

Each variant is a FwdConfig differing from choose_fwd_config() in one field, so a row says
what that one feature is worth (perf/NOTES.md records the prediction made before each run).

    python3 perf/variants.py [--seqlens 8192,16384] [--headdims 64,128] [--out DIR]
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (perf/bench.py: shapes, FLOPs, timing, anchors)


def variants_for(head_dim: int, causal: bool) -> dict:
    from cute_attn.config import choose_fwd_config

    base = choose_fwd_config(head_dim, causal)
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
    import torch
    from triton.testing import do_bench

    from cute_attn import launcher

    impls, _ = bench.load_impls(["fa4", "sdpa_cudnn"])
    rows = []
    for d in head_dims:
        for causal in (False, True):
            for s in seqlens:
                b, h = bench.sweep_shape(s, d)
                q, k, v = bench.random_qkv(b, s, h, d, dtype)
                flops = bench.attention_flops(b, h, s, s, d, causal)
                row = {"headdim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h}
                for name, cfg in variants_for(d, causal).items():
                    try:
                        fn = lambda: launcher.run_fwd(q, k, v, causal=causal, softmax_scale=d**-0.5, config=cfg)
                        fn()
                        torch.cuda.synchronize()
                        ms = do_bench(fn, warmup=bench.WARMUP_MS, rep=bench.REP_MS, return_mode="median")
                        row[name] = round(bench.tflops(flops, ms), 1)
                    except Exception as e:  # a variant that does not fit (smem, registers)
                        row[name] = f"error: {bench._reason(e)}"
                for name, impl in impls.items():
                    row[name] = round(bench.tflops(flops, bench.time_impl(impl, q, k, v, causal)), 1)
                bench.log(json.dumps(row))
                rows.append(row)
    return rows


def host_breakdown(dtype):
    """us per call of each piece of the mha call path on a tiny problem (b1 s128 h16 d128
    causal), host loops of 2000 calls with a sync only at the ends."""
    import torch

    import cute_attn
    from cute_attn import launcher, validation

    q, k, v = bench.random_qkv(1, 128, 16, 128, dtype)
    out, lse = launcher.run_fwd(q, k, v, causal=True, softmax_scale=128**-0.5)
    fn = launcher.get_fwd_kernel(
        launcher.FwdKey(launcher._TORCH_TO_DSL[dtype], 128, launcher.AttnFeatures(mask="causal"),
                        launcher.choose_fwd_config(128, True))
    )
    cu = launcher._unused_cu_seqlens(q.device)
    pieces = {
        "validate_fwd_inputs": lambda: validation.validate_fwd_inputs(q, k, v, None),
        "alloc out+lse": lambda: (torch.empty_like(q), torch.empty((1, 16, 128), dtype=torch.float32, device=q.device)),
        "compiled kernel call": lambda: fn(q, k, v, out, lse, cu, cu, 0, 0.088, 0.0, 0, 0),
        "launcher.run_fwd": lambda: launcher.run_fwd(q, k, v, causal=True, softmax_scale=0.088),
        "cute_attn.mha": lambda: cute_attn.mha(q, k, v, causal=True),
    }
    res = {}
    for name, f in pieces.items():
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            f()
        torch.cuda.synchronize()
        res[name] = round((time.perf_counter() - t) / 2000 * 1e6, 2)
        bench.log(f"  {name:24s} {res[name]:7.2f} us/call")
    return res


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=bench.parse_int_list, default=[8192, 16384])
    p.add_argument("--headdims", type=bench.parse_int_list, default=[128, 64])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--skip-host", action="store_true")
    args = p.parse_args(argv)

    import torch

    dtype = torch.bfloat16
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    if not args.skip_host:
        result["host_us"] = host_breakdown(dtype)
    result["tflops"] = run_variants(args.seqlens, args.headdims, dtype)
    slug = bench.device_slug(result["device"])
    for d in [bench.DEFAULT_RESULTS_DIR] + ([args.out] if args.out else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{slug}-variants.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
