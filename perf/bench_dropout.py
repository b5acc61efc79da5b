"""Attention-dropout benchmark (issue 14): what `dropout_p` costs cute_attn, against torch
SDPA's flash backend with dropout (FlashAttention-2's kernel; FlashAttention-4 has no
dropout on Hopper), in one process.

Cases as perf/bench_sinks.py (gpt-oss causal and 128-key window layers, 64/8 heads x 64;
a 16 x 128 causal layer; 2 x 8K tokens), dropout_p = 0.1, forward and backward:

- cute_attn_dropout: mha(..., dropout_p=0.1) (seed drawn per call from torch's generator);
- cute_attn: the same call without dropout: the dropout's cost;
- sdpa_flash_dropout: SDPA (FLASH_ATTENTION backend, dropout_p=0.1; causal layers only,
  GQA through enable_gqa).

    python3 perf/bench_dropout.py [--rounds 3] [--directions fwd,bwd] [--out DIR]
"""

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sinks  # noqa: E402  (its cases and pair count)
import harness  # noqa: E402
from harness import log  # noqa: E402

P = 0.1


def impls():
    """name -> forward(q, k, v, window) of the implementations."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cute_attn

    def sdpa(q, k, v, w):
        if w != (-1, 0):
            raise NotImplementedError("SDPA's flash backend has no sliding window")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 dropout_p=P, is_causal=True,
                                                 enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    return {
        "cute_attn_dropout": lambda q, k, v, w: cute_attn.mha(q, k, v, window_size=w, dropout_p=P),
        "cute_attn": lambda q, k, v, w: cute_attn.mha(q, k, v, window_size=w),
        "sdpa_flash_dropout": sdpa,
    }


def run_case(c, rounds, directions):
    import torch

    b, s, h, hk, d = c["batch"], c["seqlen"], c["nheads"], c["nheads_kv"], c["headdim"]
    q, = harness.random_tensors([(b, s, h, d)], torch.bfloat16, "cuda", seed=0)
    k, v = harness.random_tensors([(b, s, hk, d)] * 2, torch.bfloat16, "cuda", seed=1)
    pairs = bench_sinks.visible_pairs(s, c["window"]) * b * h
    rec = dict(c, dropout_p=P, errors={})
    for direction in directions:
        prefix = "" if direction == "fwd" else "bwd_"
        calls = {}
        for name, fwd in impls().items():
            try:
                calls[name] = _timed_call(direction, fwd, q, k, v, c["window"])
                calls[name]()
            except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
                rec["errors"][prefix + name] = harness.reason(exc)
                calls.pop(name, None)
        harness.synchronize()
        timers = {name: (lambda fn=fn: harness.do_bench(fn)) for name, fn in calls.items()}
        ms_rounds, errors = harness.run_rounds(timers, rounds)
        rec["errors"].update({prefix + n: harness.reason(e) for n, e in errors.items()})
        rec[prefix + "ms_rounds"] = ms_rounds
        flops = 4.0 * d * pairs * (1.0 if direction == "fwd" else 2.5)
        for name, r in ms_rounds.items():
            rec[f"{prefix}{name}_ms"] = harness.median_ms(r)
            rec[f"{prefix}{name}_tflops"] = harness.tflops(flops, rec[f"{prefix}{name}_ms"])
        mine = rec.get(f"{prefix}cute_attn_dropout_ms")
        if mine and rec.get(f"{prefix}cute_attn_ms"):
            rec[f"{prefix}dropout_cost"] = mine / rec[f"{prefix}cute_attn_ms"] - 1.0
        if mine and rec.get(f"{prefix}sdpa_flash_dropout_ms"):
            rec[f"{prefix}speedup_vs_sdpa_flash_dropout"] = rec[f"{prefix}sdpa_flash_dropout_ms"] / mine
        line = f"{direction} {c['case']:34s}"
        for name in ("cute_attn_dropout", "cute_attn", "sdpa_flash_dropout"):
            if f"{prefix}{name}_ms" in rec:
                line += f"  {name} {1e3 * rec[prefix + name + '_ms']:.0f} us {rec[prefix + name + '_tflops']:.0f} TF/s"
        line += f"  dropout cost {100 * rec.get(prefix + 'dropout_cost', float('nan')):+.1f}%"
        line += f"  vs sdpa {rec.get(prefix + 'speedup_vs_sdpa_flash_dropout', float('nan')):.2f}x"
        log(line)
    for name, why in rec["errors"].items():
        log(f"  {name}: {why}")
    return rec


def _timed_call(direction, fwd, q, k, v, window):
    import torch

    if direction == "fwd":
        def call():
            with torch.no_grad():
                return fwd(q, k, v, window)
        return call
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    out = fwd(*leaves, window)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--directions", type=lambda t: harness.parse_names(t, ("fwd", "bwd")), default=["fwd", "bwd"])
    p.add_argument("--rounds", type=harness.parse_positive_int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    device = torch.cuda.get_device_name()
    info = harness.run_info()
    log(harness.describe_run(device, info))
    records = [run_case(c, args.rounds, args.directions) for c in bench_sinks.CASES]
    doc = harness.build_results(device, records, timing=harness.timing_method(args.rounds, "case"), **info)
    slug = harness.device_slug(device)
    for directory in harness.output_dirs(args.out):
        log("wrote", harness.write_json(doc, harness.result_path(directory, slug, "dropout")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
