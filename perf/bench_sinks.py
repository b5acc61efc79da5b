"""Attention-sink benchmark (issue 14): what `learnable_sink` costs, and cute_attn against
FlashAttention-4's CuTe-DSL kernel with its own learnable_sink, in one process.

Cases: gpt-oss's attention (head dim 64, 64 query / 8 KV heads; its full causal layers
and its 128-key sliding-window layers) and a 16 x 128 causal layer, 2 x 8K tokens each.
Per case, forward and backward (autograd.grad of a fixed dout over one retained graph,
the sink's gradient included where it has one):

- cute_attn_sink: mha(..., learnable_sink=sink), the mods' forward entry point;
- cute_attn: the same call without a sink (the dense kernel): the sink's cost;
- fa4_sink: flash_attn.cute.flash_attn_func(..., learnable_sink=sink) where installed.

TFLOP/s count the visible pairs (causal: s(s+1)/2 per head; the window: its band).
Timing: perf/harness.py's interleaved rounds, median of rounds.

    python3 perf/bench_sinks.py [--rounds 3] [--directions fwd,bwd] [--out DIR]
"""

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import log  # noqa: E402

CASES = (
    {"case": "gpt-oss full causal 2x8K 64/8x64", "batch": 2, "seqlen": 8192, "nheads": 64, "nheads_kv": 8,
     "headdim": 64, "window": (-1, 0)},
    {"case": "gpt-oss window 128 2x8K 64/8x64", "batch": 2, "seqlen": 8192, "nheads": 64, "nheads_kv": 8,
     "headdim": 64, "window": (127, 0)},
    {"case": "causal 2x8K 16x128", "batch": 2, "seqlen": 8192, "nheads": 16, "nheads_kv": 16, "headdim": 128,
     "window": (-1, 0)},
)


def visible_pairs(seqlen: int, window) -> int:
    """Pairs (query, key) a query row sees, summed over rows (bottom-right, seqlen_q == seqlen_k)."""
    left = window[0]
    if left < 0:
        return seqlen * (seqlen + 1) // 2
    return sum(min(i, left) + 1 for i in range(seqlen))


def impls():
    """name -> forward(q, k, v, sink, window) of the implementations present."""
    import cute_attn

    out = {
        "cute_attn_sink": lambda q, k, v, sink, w: cute_attn.mha(q, k, v, window_size=w, learnable_sink=sink),
        "cute_attn": lambda q, k, v, sink, w: cute_attn.mha(q, k, v, window_size=w),
    }
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v, sink, w):
            o = flash_attn_func(q, k, v, causal=w == (-1, 0), window_size=w if w != (-1, 0) else (None, None),
                                learnable_sink=sink)
            return o[0] if isinstance(o, tuple) else o

        out["fa4_sink"] = fa4
    except ImportError as exc:
        log(f"fa4_sink skipped: {harness.reason(exc)}")
    return out


def run_case(c, rounds, directions):
    import torch

    b, s, h, hk, d = c["batch"], c["seqlen"], c["nheads"], c["nheads_kv"], c["headdim"]
    q, = harness.random_tensors([(b, s, h, d)], torch.bfloat16, "cuda", seed=0)
    k, v = harness.random_tensors([(b, s, hk, d)] * 2, torch.bfloat16, "cuda", seed=1)
    sink = torch.randn(h, device="cuda", dtype=torch.float32)
    pairs = visible_pairs(s, c["window"]) * b * h
    rec = dict(c, errors={})
    for direction in directions:
        prefix = "" if direction == "fwd" else "bwd_"
        calls = {}
        for name, fwd in impls().items():
            try:
                calls[name] = _timed_call(direction, fwd, q, k, v, sink, c["window"])
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
        mine = rec.get(f"{prefix}cute_attn_sink_ms")
        if mine and rec.get(f"{prefix}cute_attn_ms"):
            rec[f"{prefix}sink_cost"] = mine / rec[f"{prefix}cute_attn_ms"] - 1.0
        if mine and rec.get(f"{prefix}fa4_sink_ms"):
            rec[f"{prefix}speedup_vs_fa4_sink"] = rec[f"{prefix}fa4_sink_ms"] / mine
        line = f"{direction} {c['case']:34s}"
        for name in ("cute_attn_sink", "cute_attn", "fa4_sink"):
            if f"{prefix}{name}_ms" in rec:
                line += f"  {name} {1e3 * rec[prefix + name + '_ms']:.0f} us {rec[prefix + name + '_tflops']:.0f} TF/s"
        line += f"  sink cost {100 * rec.get(prefix + 'sink_cost', float('nan')):+.1f}%"
        line += f"  vs fa4 {rec.get(prefix + 'speedup_vs_fa4_sink', float('nan')):.2f}x"
        log(line)
    for name, why in rec["errors"].items():
        log(f"  {name}: {why}")
    return rec


def _timed_call(direction, fwd, q, k, v, sink, window):
    import torch

    if direction == "fwd":
        def call():
            with torch.no_grad():
                return fwd(q, k, v, sink, window)
        return call
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v, sink))
    out = fwd(*leaves, window)
    dout = torch.randn_like(out)
    # the sink-free call leaves the sink out of its graph: then q, k, v only
    inputs = leaves if _reaches(out, leaves[3]) else leaves[:3]
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def _reaches(out, leaf) -> bool:
    """Whether leaf is in out's autograd graph."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if getattr(fn, "variable", None) is leaf:
            return True
        stack.extend(f for f, _ in fn.next_functions)
    return False


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
    records = [run_case(c, args.rounds, args.directions) for c in CASES]
    doc = harness.build_results(device, records, timing=harness.timing_method(args.rounds, "case"), **info)
    slug = harness.device_slug(device)
    for directory in harness.output_dirs(args.out):
        log("wrote", harness.write_json(doc, harness.result_path(directory, slug, "sinks")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
