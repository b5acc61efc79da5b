"""Per-kernel GPU time of one backward, cute_attn's and FlashAttention-4's side by side
(torch.profiler, CUDA activity): the main kernel against the preprocess, postprocess and
the memsets / fills around them, at the sweep's shape (16K tokens, 2048 / head dim heads;
perf/bench.py --bwd). Short sequences are where the backward trails FA4 (0.90-0.95x at
512-2K, perf/NOTES.md session 29) while the main loops are level at 16K; this says how
much of a call is outside the main kernel.

    python3 perf/bwd_kernel_times.py HEAD_DIM SEQLEN CAUSAL(0|1) [--iters 20]

Prints, per implementation, each kernel's name (shortened), calls per backward and mean
microseconds, and the sum per backward.
"""
import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def kernel_times(backward, iters: int) -> dict:
    """{kernel name: (calls per backward, mean us)} over `iters` profiled backwards."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            backward()
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total  # a kernel event: its own interval
            counts[event.name] += 1
    return {name: (counts[name] / iters, totals[name] / counts[name]) for name in totals}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("head_dim", type=int)
    p.add_argument("seqlen", type=int)
    p.add_argument("causal", type=int, choices=(0, 1))
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    b, h = harness.sweep_shape(args.seqlen, args.head_dim)
    q, k, v = harness.random_qkv(b, args.seqlen, h, args.head_dim, torch.bfloat16)
    causal = bool(args.causal)
    import cute_attn

    impls, _ = harness.load_impls(("fa4",))
    fwds = {"cute_attn": lambda q, k, v: cute_attn.mha(q, k, v, causal=causal)}
    if "fa4" in impls:
        fwds["fa4"] = lambda q, k, v: impls["fa4"].fn(q, k, v, causal)
    print(f"{torch.cuda.get_device_name()}: bf16 backward, hd {args.head_dim}, b{b} x {args.seqlen}, "
          f"{h} heads, causal {causal}, {args.iters} iterations")
    for name, fwd in fwds.items():
        times = kernel_times(harness.pass_call("bwd", fwd, (q, k, v)), args.iters)
        total = sum(calls * us for calls, us in times.values())
        print(f"\n{name}: {total:.1f} us of kernels per backward")
        for kernel, (calls, us) in sorted(times.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
            print(f"  {calls:4.1f} x {us:8.1f} us  {kernel[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
