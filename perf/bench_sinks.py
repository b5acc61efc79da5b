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
Timing: perf/harness.py's interleaved rounds (pass_call, time_passes), median of rounds;
before it, fa4_sink's forward is compared with cute_attn_sink's (harness.check_agreement:
one that computes another problem is recorded in errors, not timed). Record keys:
<impl>_ms / _tflops, sink_cost (vs no sink), speedup_vs_fa4_sink, max_diff; bwd_
prefixed for the backward.

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


def impls(window):
    """name -> forward(q, k, v, sink) of the implementations present, for this window."""
    import cute_attn

    out = {
        "cute_attn_sink": lambda q, k, v, sink: cute_attn.mha(q, k, v, window_size=window, learnable_sink=sink),
        "cute_attn": lambda q, k, v, sink: cute_attn.mha(q, k, v, window_size=window),
    }
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v, sink):
            causal = window == (-1, 0)
            o = flash_attn_func(q, k, v, causal=causal, window_size=(None, None) if causal else window,
                                learnable_sink=sink)
            return o[0] if isinstance(o, tuple) else o

        out["fa4_sink"] = fa4
    except ImportError as exc:
        log(f"fa4_sink skipped: {harness.reason(exc)}")
    return out


def case_tensors(c):
    """q, k, v (bf16 normals) and a float32 sink per query head."""
    import torch

    b, s, h, hk, d = c["batch"], c["seqlen"], c["nheads"], c["nheads_kv"], c["headdim"]
    q, = harness.random_tensors([(b, s, h, d)], torch.bfloat16, "cuda", seed=0)
    k, v = harness.random_tensors([(b, s, hk, d)] * 2, torch.bfloat16, "cuda", seed=1)
    return q, k, v, torch.randn(h, device="cuda", dtype=torch.float32)


def measure_case(c, forwards, tensors, roles, rounds, directions, cost_key, *, agree=None, **extra):
    """Time forwards (name -> fn(*tensors)) on case c, forward and backward; roles =
    (the feature's call, the same call without it, the anchor): the record gets each
    one's ms and TF/s (visible pairs), the feature's cost and the speedup on the anchor.
    agree {name: ref}: before timing, name's forward must match ref's
    (harness.check_agreement) or it is recorded in errors and not timed."""
    mine, base, anchor = roles
    pairs = visible_pairs(c["seqlen"], c["window"]) * c["batch"] * c["nheads"]
    rec = dict(c, **extra, errors={})
    if agree:
        bad, rec["max_diff"] = harness.check_agreement(forwards, tensors, agree)
        rec["errors"].update(bad)
        forwards = {name: fwd for name, fwd in forwards.items() if name not in bad}
    for direction in directions:
        prefix = "" if direction == "fwd" else "bwd_"
        makers = {name: (lambda fwd=fwd: harness.pass_call(direction, fwd, tensors)) for name, fwd in forwards.items()}
        ms = harness.time_passes(makers, rounds, rec, prefix)
        flops = 4.0 * c["headdim"] * pairs * (1.0 if direction == "fwd" else 2.5)
        for name, t in ms.items():
            rec[f"{prefix}{name}_ms"] = t
            rec[f"{prefix}{name}_tflops"] = harness.tflops(flops, t)
        if mine in ms and base in ms:
            rec[f"{prefix}{cost_key}"] = ms[mine] / ms[base] - 1.0
        if mine in ms and anchor in ms:
            rec[f"{prefix}speedup_vs_{anchor}"] = ms[anchor] / ms[mine]
        line = f"{direction} {c['case']:34s}"
        for name in roles:
            if name in ms:
                line += f"  {name} {1e3 * ms[name]:.0f} us {rec[prefix + name + '_tflops']:.0f} TF/s"
        line += f"  {cost_key} {100 * rec.get(prefix + cost_key, float('nan')):+.1f}%"
        line += f"  vs {anchor} {rec.get(prefix + 'speedup_vs_' + anchor, float('nan')):.2f}x"
        log(line)
    for name, why in rec["errors"].items():
        log(f"  {name}: {why}")
    return rec


def run_case(c, rounds, directions):
    return measure_case(c, impls(c["window"]), case_tensors(c), ("cute_attn_sink", "cute_attn", "fa4_sink"),
                        rounds, directions, "sink_cost", agree={"fa4_sink": "cute_attn_sink"})


def cli(kind: str, run_case, argv=None) -> int:
    """The command line of this script and of bench_dropout.py: every case of CASES by
    run_case(c, rounds, directions), written as results kind `kind`."""
    p = argparse.ArgumentParser(description=(sys.modules["__main__"].__doc__ or __doc__).splitlines()[0])
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
        log("wrote", harness.write_json(doc, harness.result_path(directory, slug, kind)))
    return 0


def main(argv=None) -> int:
    return cli("sinks", run_case, argv)


if __name__ == "__main__":
    sys.exit(main())
