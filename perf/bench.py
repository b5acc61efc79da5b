"""Forward and backward benchmark of `cute_attn.mha` against anchors measured in the same process.

The sweep is the FlashAttention-3 paper's: bf16, batch * seqlen = 16384 tokens, hidden size
2048 (so nheads = 2048 / headdim), seqlen 512 ... 16K, headdim 64 and 128, causal and not.
Every shape gets fresh random-normal q, k, v.

    FLOPs   = 4 * batch * nheads * seqlen_q * seqlen_k * headdim   (QK^T and PV, 2 per MAC)
              halved when causal (the FA2/FA3 papers' convention, not the exact masked count)
    bwd     = 2.5 * the forward FLOPs (five GEMMs: S recomputed, dP, dV, dK, dQ, vs two)
    TFLOP/s = FLOPs / (ms * 1e-3) / 1e12

Timing (the GPUs are shared: one do_bench median drifts +-10% between consecutive calls, see
perf/NOTES.md), as perf/harness.py does it: for each shape every implementation first runs
once (compile, autotune), then all of them are timed in `--rounds` interleaved rounds, each
one triton.testing.do_bench median (warmup 25 ms, rep 100 ms) per implementation, the order
rotated by the round. The recorded `ms` is the median over rounds; `ms_rounds` keeps every
round's value. A drift then moves all implementations of a round together instead of
flipping a ratio.

--bwd times only the backward: `out` is built once per shape from inputs with
requires_grad, then each iteration is torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True). `dout` is random-normal, laid out like each implementation's out.

Implementations (`--impls`, default: every one that imports):
    cute_attn   cute_attn.mha, the kernel under test (never replaced by an anchor)
    fa4         FlashAttention-4's CuTe-DSL kernel, flash_attn.cute.flash_attn_func
    sdpa_cudnn  torch SDPA forced to SDPBackend.CUDNN_ATTENTION
    sdpa_flash  torch SDPA forced to SDPBackend.FLASH_ATTENTION (FA2)
An implementation that does not import, or raises on a shape, is recorded as skipped with the
reason; the run goes on. For --bwd, an implementation whose backward raises
NotImplementedError (or whose output has no grad_fn) is skipped without failing the run.

Outputs: a table per (headdim, causal) with ratios cute_attn/fa4 and cute_attn/cudnn, and
perf/results/<device-slug>-<fwd|bwd>.json plus a 2x2 plot <device-slug>-<fwd|bwd>.png (and a
copy of both under --out DIR). --quick checks correctness first (forward: out and lse; --bwd:
dq, dk, dv) and writes files only with --out.

Run from the repo root (on the GPU machine, after `source .devbundle/install.sh`):
    python3 perf/bench.py                      # forward sweep, 5 rounds: ~2.5 min on an H200
    python3 perf/bench.py --bwd                # backward sweep, same shapes: ~3 min
    python3 perf/bench.py --quick              # check + hdim 128, seqlen 1K/4K, 3 rounds
    python3 perf/bench.py --bwd --quick        # gradient check + the same timings, backward
    python3 perf/bench.py --host-overhead --out $OUT
    python3 perf/bench.py --dtype fp8          # the FP8 forward: perf/bench_fp8.py

The helpers above the "GPU side" line are pure and are tested on the CPU by
tests/test_bench_cpu.py; nothing at import time needs a GPU, triton or matplotlib.
"""

import argparse
import functools
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # perf/, when loaded by path
import harness  # noqa: E402
from harness import log  # noqa: E402

# The notebooks (01, 04, 05, 06) call these as bench.<name>; they live in perf/harness.py.
from harness import (  # noqa: E402, F401
    Impl,
    attention_flops,
    check_error,
    load_impls,
    make_bwd_timer,
    median_ms,
    random_qkv,
    run_rounds,
    seqlen_label,
    sweep_shape,
    tflops,
)
from harness import reason as _reason  # noqa: E402, F401

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEADDIMS = (64, 128)
QUICK_SEQLENS = (1024, 4096)
QUICK_HEADDIMS = (128,)
IMPLS = ("cute_attn", "fa4", "sdpa_cudnn", "sdpa_flash")  # loaders: harness.DENSE_LOADERS
DTYPES = ("bf16", "fp16")

# A round of the four implementations is ~0.7 s per shape, so the 24-shape sweep at 5
# rounds is ~1.5 min of timing plus ~1 min of first-call compiles: ~2.5 min on an H200
# (1 round was ~1 min).
ROUNDS = 5
QUICK_ROUNDS = 3

RECORD_KEYS = (
    "impl", "pass", "dtype", "headdim", "causal", "batch", "nheads",
    "seqlen_q", "seqlen_k", "ms", "tflops",
)
# Written by this version on top of RECORD_KEYS: the per-round medians behind `ms`.
ROUND_KEYS = ("ms_rounds",)


# ----------------------------------------------------------------------------------------
# Pure helpers (no GPU; tested on the CPU)
# ----------------------------------------------------------------------------------------

def causal_modes(choice: str) -> list[bool]:
    return {"both": [False, True], "yes": [True], "no": [False]}[choice]


def make_record(impl: str, dtype: str, headdim: int, causal: bool, batch: int, nheads: int,
                seqlen_q: int, seqlen_k: int, ms: float | None = None, *,
                pass_name: str = "fwd", ms_rounds: Sequence[float] | None = None) -> dict:
    """One JSON record; the FLOP count and TFLOP/s are derived here, next to each other.

    Give `ms_rounds` (one median per round) and `ms` defaults to their median; the rounds
    are kept in the record. FLOPs follow `pass_name` (bwd: 2.5x the forward's).
    """
    if ms is None:
        if ms_rounds is None:
            raise ValueError("make_record needs ms or ms_rounds")
        ms = harness.median_ms(ms_rounds)
    flops = harness.attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal,
                                    pass_name)
    record = {
        "impl": impl, "pass": pass_name, "dtype": dtype, "headdim": headdim,
        "causal": bool(causal), "batch": batch, "nheads": nheads,
        "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
        "ms": ms, "tflops": harness.tflops(flops, ms),
    }
    if ms_rounds is not None:
        record["ms_rounds"] = [float(x) for x in ms_rounds]
    return record


def format_table(records: Sequence[dict], headdim: int, causal: bool,
                 impls: Sequence[str]) -> str:
    """Rows: seqlen; columns: each impl's TFLOP/s, then cute_attn/fa4 and cute_attn/cudnn."""
    cell = harness.tflops_by_seqlen(records, headdim, causal)
    rows = []
    for s in sorted({s for (_, s) in cell}):
        rows.append([str(s)] + [harness.tflops_cell(cell.get((impl, s))) for impl in impls]
                    + harness.ratio_cells(lambda impl, s=s: cell.get((impl, s))))
    dtype = next((r["dtype"] for r in records if r["headdim"] == headdim), "")
    pass_name = next((r["pass"] for r in records if r["headdim"] == headdim), "fwd")
    title = (f"headdim {headdim}, {'causal' if causal else 'non-causal'} "
             f"{dtype} {pass_name}, TFLOP/s (batch*seqlen={harness.TOKENS}, "
             f"nheads={harness.HIDDEN // headdim})")
    return harness.text_table(title, ["seqlen", *impls, *harness.RATIO_LABELS], rows)


# ----------------------------------------------------------------------------------------
# GPU side
# ----------------------------------------------------------------------------------------

def measure_host(impls: dict[str, harness.Impl], dtype) -> dict:
    """Per-call host time on a tiny problem (harness.HOST_SHAPE), plus each impl's
    first-call time.

    Run before anything else touches the impls, so cute_attn's first call is a fresh
    specialisation: its time is the JIT compile (cute.compile keeps no on-disk cache, per
    shared/NOTES.md; if one is added, this becomes the cache-load time).
    """
    import torch

    shape = harness.HOST_SHAPE
    q, k, v = harness.random_qkv(shape["batch"], shape["seqlen"], shape["nheads"],
                                 shape["headdim"], dtype, seed=1)
    calls, warmup = harness.HOST_CALLS, harness.HOST_WARMUP_CALLS
    host = {"shape": dict(shape), "calls": calls, "warmup_calls": warmup,
            "method": "wall clock of a host loop, torch.cuda.synchronize before and after",
            "impls": {}}
    log(f"\nHost overhead: {shape}, {calls} calls after {warmup} warm-up")
    for name, impl in impls.items():
        call = functools.partial(impl.fn, q, k, v, shape["causal"])
        try:
            with impl.context():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                us = harness.host_us_per_call(call, calls, warmup)
        except Exception as exc:  # noqa: BLE001
            why = harness.reason(exc)
            log(f"  {name:<11} skipped: {why}")
            host["impls"][name] = {"skipped": why}
            if not harness.cuda_is_healthy():
                log("  CUDA context is broken; stopping the host measurement here.")
                host["cuda_broken"] = True
                break
            continue
        host["impls"][name] = {"us_per_call": us, "first_call_s": first_s}
        label = " (compile of a fresh specialisation)" if name == "cute_attn" else ""
        log(f"  {name:<11} {us:8.1f} us/call   first call {first_s:7.3f} s{label}")
    if "cute_attn" in host["impls"] and "first_call_s" in host["impls"]["cute_attn"]:
        host["cute_attn_compile_s"] = host["impls"]["cute_attn"]["first_call_s"]
    return host


def check_correctness(dtype, dtype_name: str, headdim: int, sweep_seqlen: int) -> bool:
    """mha vs attention_ref: a small odd case (out and lse) and one sweep shape (out)."""
    import torch

    from cute_attn import mha
    from cute_attn.reference import attention_ref

    batch, nheads = harness.sweep_shape(sweep_seqlen, headdim)
    cases = [  # (label, batch, seqlen, nheads, want lse)
        ("small", 2, 300, 3, True),
        (f"sweep seqlen {sweep_seqlen}", batch, sweep_seqlen, nheads, False),
    ]
    log(f"\nCorrectness: mha vs attention_ref ({dtype_name}, headdim {headdim}); "
        "pass if max err <= 2 * err(torch in same precision) + rounding floor")
    all_ok = True
    for label, b, s, h, want_lse in cases:
        for causal in (False, True):
            q, k, v = harness.random_qkv(b, s, h, headdim, dtype, seed=2)
            name = f"{label} b={b} s={s} h={h} causal={causal!s:<5}"
            try:
                ref, ref_lse = attention_ref(q, k, v, causal=causal)
                ref_lp, ref_lse_lp = attention_ref(q, k, v, causal=causal, upcast=False)
                checks = [("out", harness.check_error(mha(q, k, v, causal=causal), ref,
                                                      ref_lp))]
                if want_lse:
                    out, lse = mha(q, k, v, causal=causal, return_lse=True)
                    checks.append(("out(return_lse)", harness.check_error(out, ref, ref_lp)))
                    # lse is fp32 in both: no rounding floor of its own, so allow 1e-3.
                    checks.append(("lse", harness.check_error(lse, ref_lse, ref_lse_lp,
                                                              floor=1e-3)))
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a crash is a failed check, loudly
                log(f"  {name}: RAISED\n{traceback.format_exc()}")
                all_ok = False
                if not harness.cuda_is_healthy():
                    return False
                continue
            for what, c in checks:
                log(harness.check_line(f"{name} {what:<15}", c))
                all_ok &= c["ok"]
            del q, k, v, ref, ref_lp
    return all_ok


def _grads(fn, q, k, v, dout):
    """(dq, dk, dv) of fn(q, k, v) for cotangent dout, on fresh leaves."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return harness.grads_of(fn(*leaves), leaves, dout)


def _ref_out(q, k, v, *, causal: bool, upcast: bool):
    from cute_attn.reference import attention_ref

    return attention_ref(q, k, v, causal=causal, upcast=upcast)[0]


def check_bwd_correctness(dtype, dtype_name: str, headdim: int) -> tuple[str, str]:
    """Gradients of mha vs autograd through the fp32 attention_ref, on two small shapes.

    Returns ("ok", ""), ("fail", "") or ("unsupported", reason) when mha's backward raises
    NotImplementedError or its output has no grad_fn (then the anchors still get timed).
    Pass rule as in the forward: max err <= 2 * err(torch in the input dtype) + the rounding
    floor of the fp32 gradient in the input dtype. The second shape has seqlen_q > seqlen_k,
    so with causal its first rows see no key: their dq must be 0, never NaN.
    """
    import torch

    from cute_attn import mha

    cases = [(2, 300, 300, 3), (1, 200, 130, 2)]  # (batch, seqlen_q, seqlen_k, nheads)
    log(f"\nBackward correctness: grads of mha vs autograd through attention_ref "
        f"({dtype_name}, headdim {headdim}); pass if max err <= 2 * err(torch in same "
        "precision) + rounding floor")
    all_ok = True
    for b, sq, sk, h in cases:
        for causal in (False, True):
            q, k, v, dout = harness.random_tensors(
                [(b, sq, h, headdim), (b, sk, h, headdim), (b, sk, h, headdim),
                 (b, sq, h, headdim)], dtype, seed=3)
            name = f"b={b} sq={sq} sk={sk} h={h} causal={causal!s:<5}"
            try:
                got = _grads(functools.partial(mha, causal=causal), q, k, v, dout)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                if harness.is_unsupported(exc):
                    return "unsupported", harness.reason(exc)
                log(f"  {name}: RAISED\n{traceback.format_exc()}")
                all_ok = False
                if not harness.cuda_is_healthy():
                    return "fail", ""
                continue
            ref = _grads(functools.partial(_ref_out, causal=causal, upcast=True),
                         q.float(), k.float(), v.float(), dout.float())
            lowp = _grads(functools.partial(_ref_out, causal=causal, upcast=False),
                          q, k, v, dout)
            for what, g, r, lp in zip(("dq", "dk", "dv"), got, ref, lowp):
                c = harness.check_error(g, r, lp)
                log(harness.check_line(f"{name} {what}", c))
                all_ok &= c["ok"]
    return ("ok" if all_ok else "fail"), ""


def run_sweep(impls: dict[str, harness.Impl], dtype, dtype_name: str, headdims, causals,
              seqlens, skipped: list[dict], *, pass_name: str = "fwd",
              rounds: int = ROUNDS) -> tuple[list[dict], bool]:
    """Times every impl on every shape in interleaved rounds (harness.time_interleaved);
    returns (records, cuda_still_healthy). pass_name "bwd" times torch.autograd.grad alone."""
    records = []
    for headdim in headdims:
        for causal in causals:
            log(f"\n== {pass_name}, headdim {headdim}, causal={causal}, {rounds} round(s) ==")
            for seqlen in seqlens:
                batch, nheads = harness.sweep_shape(seqlen, headdim)
                shape = {"headdim": headdim, "causal": causal, "batch": batch,
                         "nheads": nheads, "seqlen": seqlen}
                q, k, v = harness.random_qkv(batch, seqlen, nheads, headdim, dtype,
                                             seed=seqlen)
                dout = None
                if pass_name == "bwd":
                    q, k, v = (t.requires_grad_() for t in (q, k, v))
                    dout = harness.random_qkv(batch, seqlen, nheads, headdim, dtype,
                                              seed=seqlen + 1)[0]
                first_calls = {name: functools.partial(harness.make_impl_timer, impl,
                                                       pass_name, q, k, v, causal, dout)
                               for name, impl in impls.items()}

                def skip(name, exc, shape=shape):
                    harness.record_skip(
                        skipped, {"impl": name, "shape": shape, "reason": harness.reason(exc)},
                        f"seqlen {shape['seqlen']}", harness.is_unsupported(exc))

                ms_rounds, healthy = harness.time_interleaved(first_calls, rounds, skip)
                parts = []
                for name, ms in ms_rounds.items():
                    rec = make_record(name, dtype_name, headdim, causal, batch, nheads,
                                      seqlen, seqlen, pass_name=pass_name, ms_rounds=ms)
                    records.append(rec)
                    parts.append(f"{name} {rec['tflops']:.0f} "
                                 f"(rounds spread {harness.round_spread(ms):.0%})")
                log(f"  seqlen {seqlen:>5} (b={batch}, h={nheads}): " + ", ".join(parts))
                if not healthy:
                    log("  CUDA context is broken; stopping the sweep here.")
                    return records, False
                del q, k, v, dout, first_calls
    return records, True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Attention benchmark, forward or (--bwd) backward: cute_attn.mha vs FA4 "
                    "and torch SDPA (FA3-paper sweep: batch*seqlen=16384, hidden 2048), "
                    "implementations interleaved over --rounds rounds per shape.")
    p.add_argument("--headdims", type=harness.parse_int_list, default=None,
                   help="comma list (default 64,128; --quick: 128)")
    p.add_argument("--seqlens", type=harness.parse_int_list, default=None,
                   help="comma list, each dividing 16384 (default 512,...,16384; "
                        "--quick: 1024,4096)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    harness.add_impls_and_rounds(p, IMPLS, rounds=ROUNDS, quick_rounds=QUICK_ROUNDS,
                                 per="shape", given_order=True)
    p.add_argument("--out", type=Path, default=None,
                   help="also write the JSON and PNG here (with --quick: only here)")
    p.add_argument("--quick", action="store_true",
                   help="check mha against attention_ref (exit 1 if wrong), then time "
                        "hdim 128 at seqlen 1024,4096; writes files only with --out")
    p.add_argument("--host-overhead", action="store_true",
                   help="first measure per-call host time on batch 1, seqlen 128, 16 heads, "
                        "hdim 128, causal, and cute_attn's first-call compile time "
                        "(forward only)")
    p.add_argument("--bwd", action="store_true",
                   help="time the backward (torch.autograd.grad of out) instead of the "
                        "forward; TFLOP/s from 2.5x the forward FLOPs; writes *-bwd.json")
    args = p.parse_args(argv)
    if args.bwd and args.host_overhead:
        p.error("--host-overhead measures the forward call; run it without --bwd")
    args.pass_name = "bwd" if args.bwd else "fwd"
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else ROUNDS
    if args.headdims is None:
        args.headdims = list(QUICK_HEADDIMS if args.quick else HEADDIMS)
    if args.seqlens is None:
        args.seqlens = list(QUICK_SEQLENS if args.quick else SEQLENS)
    for s in args.seqlens:
        for d in args.headdims:
            try:
                harness.sweep_shape(s, d)
            except ValueError as exc:
                p.error(str(exc))
    return args


def _quick_check(impls: dict, skipped: list[dict], args, dtype) -> bool:
    """--quick's correctness check of cute_attn; False: wrong, do not time. A backward that
    is not implemented takes cute_attn out of `impls` (the anchors are still timed)."""
    if args.bwd:
        status, why = check_bwd_correctness(dtype, args.dtype, args.headdims[0])
        if status == "fail":
            log("\nFAILED: cute_attn's gradients do not match attention_ref's; not timing it.")
            return False
        if status == "unsupported":
            log(f"  cute_attn backward unavailable, skipped: {why}")
            log("  (timing the anchors only)")
            impls.pop("cute_attn")
            skipped.append({"impl": "cute_attn", "shape": None, "reason": why,
                            "unsupported": True})
        else:
            log("backward correctness: all ok")
        return True
    if not check_correctness(dtype, args.dtype, args.headdims[0], args.seqlens[0]):
        log("\nFAILED: cute_attn.mha does not match attention_ref; not timing it.")
        return False
    log("correctness: all ok")
    return True


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dtype=fp8" in argv or any(a == "--dtype" and b == "fp8" for a, b in zip(argv, argv[1:])):
        # the FP8 forward has its own sweep, anchors and accuracy table: perf/bench_fp8.py
        import bench_fp8

        return bench_fp8.main([a for i, a in enumerate(argv) if a not in ("--dtype", "--dtype=fp8")
                               and not (a == "fp8" and i and argv[i - 1] == "--dtype")])
    args = parse_args(argv)

    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = harness.cuda_setup("perf/bench.py")
    info = harness.run_info()
    log(f"{harness.describe_run(device, info)} | {args.pass_name}, {args.rounds} round(s) "
        "per shape")

    impls, skipped = harness.load_impls(args.impls)
    order = [name for name in IMPLS if name in impls]
    failed = []

    # Host overhead first: cute_attn's first call must be a fresh specialisation.
    host = None
    if args.host_overhead:
        host = measure_host(impls, dtype)
        if host.get("cuda_broken"):
            failed.append("CUDA context broke in the host measurement")

    if args.quick and not failed:
        if "cute_attn" not in impls:
            log("\nFAILED: --quick needs cute_attn, which did not import (see above)")
            return 1
        if not _quick_check(impls, skipped, args, dtype):
            return 1

    records, sweep_s = [], None
    if not failed:
        t0 = time.perf_counter()
        records, healthy = run_sweep(impls, dtype, args.dtype, args.headdims,
                                     causal_modes(args.causal), args.seqlens, skipped,
                                     pass_name=args.pass_name, rounds=args.rounds)
        sweep_s = time.perf_counter() - t0
        log(f"\nsweep took {sweep_s:.0f} s")
        if not healthy:
            failed.append("CUDA context broke mid-sweep")
    for headdim in args.headdims:
        for causal in causal_modes(args.causal):
            log("\n" + format_table(records, headdim, causal, order))

    flops_rule = "4*b*h*sq*sk*d, halved for causal"
    if args.bwd:
        flops_rule = f"{harness.BWD_FLOP_FACTOR} * ({flops_rule})"
    timed = ("torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), out built once"
             if args.bwd else "one forward call")
    results = harness.build_results(
        device, records, **info, host=host, impls=harness.impl_versions(impls),
        skipped=skipped,
        method={
            "flops": flops_rule, "timing": harness.timing_method(args.rounds, "shape"),
            "timed": timed, "rounds": args.rounds, "sweep_s": sweep_s,
            "shapes": f"batch*seqlen={harness.TOKENS}, nheads={harness.HIDDEN}/headdim, "
                      "sq == sk",
            "quick": args.quick,
        },
    )
    slug = harness.device_slug(device)
    for directory in harness.output_dirs(args.out, args.quick):
        json_path = harness.write_json(results,
                                       harness.result_path(directory, slug, args.pass_name))
        png_path = json_path.with_suffix(".png")
        try:
            harness.plot_sweep(records, png_path, device, order, palette=IMPLS)
            log(f"wrote {json_path} and {png_path.name}")
        except Exception as exc:  # noqa: BLE001 - the JSON is the record; the plot is a view
            log(f"wrote {json_path}; plot failed: {harness.reason(exc)}")
    return harness.finish(failed, skipped, args.impls)


if __name__ == "__main__":
    sys.exit(main())
