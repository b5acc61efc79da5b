"""Forward and backward benchmark of `cute_attn.mha` against anchors measured in the same process.

The sweep is the FlashAttention-3 paper's: bf16, batch * seqlen = 16384 tokens, hidden size
2048 (so nheads = 2048 / headdim), seqlen 512 ... 16K, headdim 64 and 128, causal and not.
Every shape gets fresh random-normal q, k, v (never zeros: zeros make the softmax trivial and
the tensor cores' power draw unrealistically low).

    FLOPs   = 4 * batch * nheads * seqlen_q * seqlen_k * headdim   (QK^T and PV, 2 per MAC)
              halved when causal (the FA2/FA3 papers' convention, not the exact masked count)
    bwd     = 2.5 * the forward FLOPs (five GEMMs: S recomputed, dP, dV, dK, dQ, vs two)
    TFLOP/s = FLOPs / (ms * 1e-3) / 1e12

Timing (the GPUs are shared: one do_bench median drifts +-10% between consecutive calls, see
perf/NOTES.md). For each shape every implementation first runs once (compile, autotune),
then all of them are timed in `--rounds` interleaved rounds: in round r each implementation
gets one triton.testing.do_bench median (warmup 25 ms, rep 100 ms), the order rotated by r
so no one always runs first or after the same neighbour. The recorded `ms` is the median
over rounds; `ms_rounds` keeps every round's value. A drift then moves all implementations of
a round together instead of flipping a ratio.

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

The helpers above the "GPU side" line are pure and are tested on the CPU by
tests/test_bench_cpu.py; nothing at import time needs a GPU, triton or matplotlib.
"""

import argparse
import contextlib
import datetime
import functools
import importlib.metadata
import json
import math
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    # So `import cute_attn` picks up the working tree, not an installed copy.
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_RESULTS_DIR = REPO_ROOT / "perf" / "results"

TOKENS = 16384  # batch * seqlen, fixed across the sweep (FA3 paper)
HIDDEN = 2048  # nheads * headdim
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEADDIMS = (64, 128)
QUICK_SEQLENS = (1024, 4096)
QUICK_HEADDIMS = (128,)
IMPLS = ("cute_attn", "fa4", "sdpa_cudnn", "sdpa_flash")
DTYPES = ("bf16", "fp16")

# do_bench budgets (ms), per round. One do_bench takes ~0.15-0.2 s of wall time (its L2
# flush, the warmup and the host loop around 125 ms of GPU time), so a round of the four
# implementations is ~0.7 s per shape. The 24-shape sweep at 5 rounds is then ~1.5 min of
# timing plus ~1 min of first-call compiles: ~2.5 min on an H200 (1 round was ~1 min).
WARMUP_MS = 25
REP_MS = 100
ROUNDS = 5
QUICK_ROUNDS = 3

# Backward FLOPs per forward FLOP: the forward does two GEMMs (QK^T, PV), the backward five
# (QK^T recomputed, dP = dO V^T, dV = P^T dO, dK = dS^T Q, dQ = dS K).
BWD_FLOP_FACTOR = 2.5
PASSES = ("fwd", "bwd")

# Host-overhead probe: a problem so small that the GPU finishes before the host issues the
# next call, so wall time per call is host time (shared/NOTES.md uses the same shape).
HOST_SHAPE = {"batch": 1, "seqlen": 128, "nheads": 16, "headdim": 128, "causal": True}
HOST_CALLS = 2000
HOST_WARMUP_CALLS = 50

RESULT_KEYS = ("device", "date", "torch", "cutlass_dsl", "cuda", "records")
RECORD_KEYS = (
    "impl", "pass", "dtype", "headdim", "causal", "batch", "nheads",
    "seqlen_q", "seqlen_k", "ms", "tflops",
)
# Written by this version on top of RECORD_KEYS: the per-round medians behind `ms`.
ROUND_KEYS = ("ms_rounds",)

# The two anchors the ratios are taken against, with their column labels.
RATIO_ANCHORS = (("fa4", "cute_attn/fa4"), ("sdpa_cudnn", "cute_attn/cudnn"))


# ----------------------------------------------------------------------------------------
# Pure helpers (no GPU; tested on the CPU)
# ----------------------------------------------------------------------------------------

def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    causal: bool, pass_name: str = "fwd") -> float:
    """Forward FLOPs: 4*b*h*sq*sk*d (two GEMMs, 2 FLOPs per MAC), halved for causal.

    pass_name="bwd": BWD_FLOP_FACTOR (2.5) times that, the FA2/FA3 papers' convention.
    """
    if pass_name not in PASSES:
        raise ValueError(f"pass_name must be one of {PASSES}, got {pass_name!r}")
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        flops /= 2
    return flops * BWD_FLOP_FACTOR if pass_name == "bwd" else flops


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s from a FLOP count and a time in milliseconds."""
    if not ms > 0:
        raise ValueError(f"ms must be positive, got {ms!r}")
    return flops / (ms * 1e-3) / 1e12


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (runs of non-alnum -> one '-')."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


def sweep_shape(seqlen: int, headdim: int, tokens: int = TOKENS,
                hidden: int = HIDDEN) -> tuple[int, int]:
    """(batch, nheads) for one sweep point: batch*seqlen = tokens, nheads*headdim = hidden."""
    if seqlen <= 0 or tokens % seqlen:
        raise ValueError(f"seqlen must divide {tokens}, got {seqlen}")
    if headdim <= 0 or hidden % headdim:
        raise ValueError(f"headdim must divide {hidden}, got {headdim}")
    return tokens // seqlen, hidden // headdim


def parse_int_list(text: str) -> list[int]:
    """'512, 1024,2048' -> [512, 1024, 2048]; for argparse."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_positive_int(text: str) -> int:
    """'5' -> 5; for argparse (--rounds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_impls(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown impl(s) {unknown or text!r}; choose from {','.join(IMPLS)}")
    return names


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
        ms = median_ms(ms_rounds)
    flops = attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, pass_name)
    record = {
        "impl": impl, "pass": pass_name, "dtype": dtype, "headdim": headdim,
        "causal": bool(causal), "batch": batch, "nheads": nheads,
        "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
        "ms": ms, "tflops": tflops(flops, ms),
    }
    if ms_rounds is not None:
        record["ms_rounds"] = [float(x) for x in ms_rounds]
    return record


def median_ms(ms_rounds: Sequence[float]) -> float:
    """The recorded time of a shape: the median of its per-round medians."""
    if not ms_rounds:
        raise ValueError("median_ms needs at least one round")
    return float(statistics.median(ms_rounds))


def round_spread(ms_rounds: Sequence[float]) -> float:
    """(max - min) / median of the rounds: 0.1 means the rounds span 10% of the median."""
    return (max(ms_rounds) - min(ms_rounds)) / median_ms(ms_rounds)


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The order of round `round_index`: `names` rotated left by round_index.

    Over len(names) consecutive rounds every implementation runs once in every position, so
    none always goes first (cold clocks) or always follows the same neighbour.
    """
    names = list(names)
    if not names:
        return []
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def run_rounds(timers: dict[str, Callable[[], float]], rounds: int,
               on_error: Callable[[str, BaseException], bool] | None = None,
               ) -> tuple[dict[str, list[float]], dict[str, BaseException]]:
    """Call every timer once per round, in round_order; returns (ms_rounds, errors).

    A timer returns one measurement in ms. One that raises is dropped from the later rounds
    and lands in `errors` (its earlier rounds are discarded: a record is either every round
    or nothing). `on_error(name, exc)` returning True stops all timing at once (a broken
    CUDA context); the impls that had not finished every round then get no record either.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(timers)
    ms_rounds = {name: [] for name in names}
    errors = {}
    stop = False
    for r in range(rounds):
        for name in round_order(names, r):
            if name in errors:
                continue
            try:
                ms_rounds[name].append(float(timers[name]()))
            except Exception as exc:  # noqa: BLE001 - reported to the caller, per impl
                errors[name] = exc
                if on_error is not None and on_error(name, exc):
                    stop = True
                    break
        if stop:
            break
    complete = {name: ms for name, ms in ms_rounds.items()
                if name not in errors and len(ms) == rounds}
    return complete, errors


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either side is missing or not positive."""
    if numerator is None or denominator is None or not denominator > 0:
        return None
    return numerator / denominator


def _lookup(records: Iterable[dict], headdim: int, causal: bool) -> dict:
    """{(impl, seqlen_q): tflops} for one (headdim, causal) config."""
    return {(r["impl"], r["seqlen_q"]): r["tflops"] for r in records
            if r["headdim"] == headdim and r["causal"] == causal}


def format_table(records: Sequence[dict], headdim: int, causal: bool,
                 impls: Sequence[str]) -> str:
    """Rows: seqlen; columns: each impl's TFLOP/s, then cute_attn/fa4 and cute_attn/cudnn."""
    cell = _lookup(records, headdim, causal)
    seqlens = sorted({s for (_, s) in cell})
    header = ["seqlen"] + list(impls) + [label for _, label in RATIO_ANCHORS]
    rows = []
    for s in seqlens:
        row = [str(s)]
        for impl in impls:
            value = cell.get((impl, s))
            row.append("-" if value is None else f"{value:.1f}")
        for anchor, _ in RATIO_ANCHORS:
            r = ratio(cell.get(("cute_attn", s)), cell.get((anchor, s)))
            row.append("-" if r is None else f"{r:.3f}")
        rows.append(row)
    widths = [max(len(line[i]) for line in [header] + rows) for i in range(len(header))]

    def fmt(line):
        return "  ".join(text.rjust(w) for text, w in zip(line, widths))

    dtype = next((r["dtype"] for r in records if r["headdim"] == headdim), "")
    pass_name = next((r["pass"] for r in records if r["headdim"] == headdim), "fwd")
    title = (f"headdim {headdim}, {'causal' if causal else 'non-causal'} "
             f"{dtype} {pass_name}, TFLOP/s (batch*seqlen={TOKENS}, "
             f"nheads={HIDDEN // headdim})")
    lines = [title, fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    if not rows:
        lines.append("(no measurements)")
    return "\n".join(lines)


def build_results(device: str, records: list[dict], *, torch_version: str | None,
                  cutlass_dsl: str | None, cuda: str | None, date: str | None = None,
                  host: dict | None = None, **extra) -> dict:
    """The JSON document: required keys first, then `host` (when measured) and extras."""
    results = {
        "device": device,
        "date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "torch": torch_version,
        "cutlass_dsl": cutlass_dsl,
        "cuda": cuda,
        "records": list(records),
    }
    if host is not None:
        results["host"] = host
    results.update(extra)
    return results


def result_paths(directory: Path, slug: str, pass_name: str = "fwd") -> tuple[Path, Path]:
    if pass_name not in PASSES:
        raise ValueError(f"pass_name must be one of {PASSES}, got {pass_name!r}")
    stem = f"{slug}-{pass_name}"
    return Path(directory) / f"{stem}.json", Path(directory) / f"{stem}.png"


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_error(out, ref, ref_lowp, floor: float | None = None) -> dict:
    """Is `out` as close to the fp32 `ref` as the same computation done by torch in low precision?

    Passes when max|out - ref| <= 2 * max|ref_lowp - ref| + floor. The default floor is the
    error of storing the exact answer in out's dtype (its rounding), so a bit-exact-rounded
    answer always passes. NaN/inf or a shape mismatch fails.
    """
    if tuple(out.shape) != tuple(ref.shape):
        return {"ok": False, "err": math.inf, "ref_err": math.nan, "floor": math.nan,
                "tol": math.nan,
                "why": f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"}
    ref = ref.float()
    err = (out.float() - ref).abs().max().item()
    ref_err = (ref_lowp.float() - ref).abs().max().item()
    if floor is None:
        floor = (ref.to(out.dtype).float() - ref).abs().max().item()
    tol = 2 * ref_err + floor
    ok = math.isfinite(err) and err <= tol
    return {"ok": ok, "err": err, "ref_err": ref_err, "floor": floor, "tol": tol, "why": ""}


def seqlen_label(seqlen: int) -> str:
    return f"{seqlen // 1024}K" if seqlen >= 1024 and seqlen % 1024 == 0 else str(seqlen)


def plot_results(records: Sequence[dict], path: Path, device: str,
                 impls: Sequence[str]) -> None:
    """TFLOP/s vs seqlen, one line per impl, a subplot per (headdim, causal); small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    headdims = sorted({r["headdim"] for r in records})
    causals = sorted({r["causal"] for r in records})
    if not headdims:
        return
    dtype = records[0]["dtype"]
    pass_name = records[0]["pass"]
    fig, axes = plt.subplots(len(headdims), len(causals), squeeze=False,
                             figsize=(4.6 * len(causals), 3.3 * len(headdims)), dpi=80)
    for i, headdim in enumerate(headdims):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            cell = _lookup(records, headdim, causal)
            seqlens = sorted({s for (_, s) in cell})
            for impl in impls:
                points = [(s, cell[(impl, s)]) for s in seqlens if (impl, s) in cell]
                if points:
                    xs, ys = zip(*points)
                    color = f"C{IMPLS.index(impl)}" if impl in IMPLS else None
                    ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=impl,
                            color=color)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [seqlen_label(s) for s in seqlens])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"hdim {headdim}, {'causal' if causal else 'non-causal'}",
                         fontsize=10)
            ax.set_xlabel("seqlen", fontsize=9)
            ax.set_ylabel("TFLOP/s", fontsize=9)
            ax.tick_params(labelsize=8)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{device}: {dtype} attention {pass_name}, batch*seqlen={TOKENS}, "
                 f"hidden {HIDDEN}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def log(*args) -> None:
    print(*args, flush=True)


class BackwardUnsupported(RuntimeError):
    """An implementation's output cannot be differentiated (it has no grad_fn)."""


def is_unsupported(exc: BaseException) -> bool:
    """A skip that says "not implemented" rather than "broken": it does not fail the run."""
    return isinstance(exc, (NotImplementedError, BackwardUnsupported))


def summarize_skips(skipped: Sequence[dict], requested: Sequence[str],
                    notes: list[str]) -> list[str]:
    """The run's failures from its skips: cute_attn (when requested) skipped for a reason
    other than "unsupported". Unsupported skips of cute_attn are appended to `notes`."""
    if "cute_attn" not in requested:
        return []
    mine = [entry for entry in skipped if entry["impl"] == "cute_attn"]
    broken = [entry for entry in mine if not entry.get("unsupported")]
    unsupported = [entry for entry in mine if entry.get("unsupported")]
    if unsupported:
        notes.append(f"cute_attn not measured ({len(unsupported)} skip(s)): "
                     f"{unsupported[0]['reason']}")
    return [f"cute_attn skipped {len(broken)} time(s)"] if broken else []


# ----------------------------------------------------------------------------------------
# GPU side
# ----------------------------------------------------------------------------------------

@dataclass
class Impl:
    """An attention forward on (batch, seqlen, nheads, headdim) tensors.

    --bwd differentiates its output with torch.autograd (every anchor here is an autograd
    op; cute_attn.mha is a torch.autograd.Function once its backward exists).
    `context` is entered around a whole measurement (not per call), so the backend selection
    of the SDPA anchors is not part of their per-call host time; the backward is dispatched
    from the graph the forward recorded, so it follows the same backend.
    """
    name: str
    fn: Callable  # (q, k, v, causal) -> out, same layout as q
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    version: str | None = None
    import_s: float = 0.0


def _load_cute_attn() -> Impl:
    import cute_attn

    try:
        # `import cute_attn` leaves the DSL to the first call; load it here so that the
        # first-call time measures the compile, not the DSL's import.
        import cutlass.cute  # noqa: F401
    except ImportError:
        pass

    def fn(q, k, v, causal):
        return cute_attn.mha(q, k, v, causal=causal)

    return Impl("cute_attn", fn, version=_git_describe())


def _load_fa4() -> Impl:
    from flash_attn.cute import flash_attn_func

    def fn(q, k, v, causal):
        out = flash_attn_func(q, k, v, causal=causal)
        # Some versions return (out, lse).
        return out[0] if isinstance(out, tuple) else out

    return Impl("fa4", fn, version=package_version("flash-attn-4"))


def _load_sdpa(name: str, backend_name: str) -> Impl:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v, causal):
        # SDPA takes (b, h, s, d): transposed views, no copies. Its is_causal is top-left
        # aligned; cute_attn and FA4 are bottom-right. The two agree when seqlen_q ==
        # seqlen_k, which holds for every shape this script runs.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    version = (f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}"
               if backend_name == "CUDNN_ATTENTION" else f"torch {torch.__version__}")
    return Impl(name, fn, context=lambda: sdpa_kernel(backend), version=version)


LOADERS = {
    "cute_attn": _load_cute_attn,
    "fa4": _load_fa4,
    "sdpa_cudnn": lambda: _load_sdpa("sdpa_cudnn", "CUDNN_ATTENTION"),
    "sdpa_flash": lambda: _load_sdpa("sdpa_flash", "FLASH_ATTENTION"),
}


def _git_describe() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=10, check=False)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cute_attn"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
                               check=False)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:300]


def load_impls(names: Sequence[str]) -> tuple[dict[str, Impl], list[dict]]:
    impls, skipped = {}, []
    for name in names:
        t0 = time.perf_counter()
        try:
            impl = LOADERS[name]()
        except Exception as exc:  # noqa: BLE001 - any import failure is a skip, not a crash
            reason = _reason(exc)
            log(f"[skip] {name}: not available ({reason})")
            skipped.append({"impl": name, "shape": None, "reason": reason})
            continue
        impl.import_s = time.perf_counter() - t0
        impls[name] = impl
        log(f"[ok]   {name}: {impl.version or ''} (import {impl.import_s:.2f} s)")
    return impls, skipped


def cuda_is_healthy() -> bool:
    """False after a sticky CUDA error (illegal address, ...): nothing more can run."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def random_qkv(batch, seqlen, nheads, headdim, dtype, seed=0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, seqlen, nheads, headdim)
    return [torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(3)]


def _do_bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def make_fwd_timer(impl: Impl, q, k, v, causal: bool) -> Callable[[], float]:
    """Run the first call now (compile; its errors surface here); return a one-round timer."""
    import torch

    with impl.context():
        impl.fn(q, k, v, causal)
        torch.cuda.synchronize()

    def one_round() -> float:
        with impl.context():
            return _do_bench(lambda: impl.fn(q, k, v, causal))

    return one_round


def make_bwd_timer(impl: Impl, q, k, v, dout, causal: bool) -> Callable[[], float]:
    """Build `out` once from q, k, v (requires_grad leaves) and run one backward now (the
    compile; its errors surface here); return a timer of the backward alone.

    dout is copied into a tensor laid out like this impl's out (the SDPA anchors return a
    transposed view), as the gradient of a real model's next layer would be.
    """
    import torch

    with impl.context():
        out = impl.fn(q, k, v, causal)
        if out.grad_fn is None:
            raise BackwardUnsupported(
                f"{impl.name} returned an output with no grad_fn (its forward is not "
                "differentiable)")
        dout_like = torch.empty_like(out).copy_(dout)
        torch.autograd.grad(out, (q, k, v), dout_like, retain_graph=True)
        torch.cuda.synchronize()

    def backward():
        return torch.autograd.grad(out, (q, k, v), dout_like, retain_graph=True)

    def one_round() -> float:
        with impl.context():
            return _do_bench(backward)

    return one_round


def time_impl(impl: Impl, q, k, v, causal: bool) -> float:
    """Median ms of one forward call after a first call; one round (perf/variants.py)."""
    return make_fwd_timer(impl, q, k, v, causal)()


def measure_host(impls: dict[str, Impl], dtype) -> dict:
    """Per-call host time on a tiny problem, plus each impl's first-call time.

    Run before anything else touches the impls, so cute_attn's first call is a fresh
    specialisation: its time is the JIT compile (cute.compile keeps no on-disk cache, per
    shared/NOTES.md; if one is added, this becomes the cache-load time).
    """
    import torch

    shape = HOST_SHAPE
    q, k, v = random_qkv(shape["batch"], shape["seqlen"], shape["nheads"], shape["headdim"],
                         dtype, seed=1)
    causal = shape["causal"]
    host = {"shape": dict(shape), "calls": HOST_CALLS, "warmup_calls": HOST_WARMUP_CALLS,
            "method": "wall clock of a host loop, torch.cuda.synchronize before and after",
            "impls": {}}
    log(f"\nHost overhead: {shape}, {HOST_CALLS} calls after {HOST_WARMUP_CALLS} warm-up")
    for name, impl in impls.items():
        try:
            with impl.context():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                impl.fn(q, k, v, causal)
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                for _ in range(HOST_WARMUP_CALLS):
                    impl.fn(q, k, v, causal)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(HOST_CALLS):
                    impl.fn(q, k, v, causal)
                torch.cuda.synchronize()
                us = (time.perf_counter() - t0) / HOST_CALLS * 1e6
        except Exception as exc:  # noqa: BLE001
            reason = _reason(exc)
            log(f"  {name:<11} skipped: {reason}")
            host["impls"][name] = {"skipped": reason}
            if not cuda_is_healthy():
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

    batch, nheads = sweep_shape(sweep_seqlen, headdim)
    cases = [  # (label, batch, seqlen, nheads, want lse)
        ("small", 2, 300, 3, True),
        (f"sweep seqlen {sweep_seqlen}", batch, sweep_seqlen, nheads, False),
    ]
    log(f"\nCorrectness: mha vs attention_ref ({dtype_name}, headdim {headdim}); "
        "pass if max err <= 2 * err(torch in same precision) + rounding floor")
    all_ok = True
    for label, b, s, h, want_lse in cases:
        for causal in (False, True):
            q, k, v = random_qkv(b, s, h, headdim, dtype, seed=2)
            name = f"{label} b={b} s={s} h={h} causal={causal!s:<5}"
            try:
                ref, ref_lse = attention_ref(q, k, v, causal=causal)
                ref_lp, ref_lse_lp = attention_ref(q, k, v, causal=causal, upcast=False)
                checks = [("out", check_error(mha(q, k, v, causal=causal), ref, ref_lp))]
                if want_lse:
                    out, lse = mha(q, k, v, causal=causal, return_lse=True)
                    checks.append(("out(return_lse)", check_error(out, ref, ref_lp)))
                    # lse is fp32 in both: no rounding floor of its own, so allow 1e-3.
                    checks.append(("lse", check_error(lse, ref_lse, ref_lse_lp, floor=1e-3)))
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a crash is a failed check, loudly
                log(f"  {name}: RAISED\n{traceback.format_exc()}")
                all_ok = False
                if not cuda_is_healthy():
                    return False
                continue
            for what, c in checks:
                status = "ok" if c["ok"] else "FAIL"
                log(f"  {name} {what:<15} max err {c['err']:.3e}  tol {c['tol']:.3e} "
                    f"(= 2*{c['ref_err']:.3e} + {c['floor']:.1e})  {status} {c['why']}")
                all_ok &= c["ok"]
            del q, k, v, ref, ref_lp
    return all_ok


def _grads(fn, q, k, v, dout):
    """(dq, dk, dv) of fn(q, k, v) for cotangent dout, on fresh leaves."""
    import torch

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    if out.grad_fn is None:
        raise BackwardUnsupported("output has no grad_fn (the forward is not differentiable)")
    return torch.autograd.grad(out, leaves, dout)


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
            gen = torch.Generator(device="cuda").manual_seed(3)
            q, k, v, dout = (
                torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
                for shape in ((b, sq, h, headdim), (b, sk, h, headdim), (b, sk, h, headdim),
                              (b, sq, h, headdim)))
            name = f"b={b} sq={sq} sk={sk} h={h} causal={causal!s:<5}"
            try:
                got = _grads(functools.partial(mha, causal=causal), q, k, v, dout)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                if is_unsupported(exc):
                    return "unsupported", _reason(exc)
                log(f"  {name}: RAISED\n{traceback.format_exc()}")
                all_ok = False
                if not cuda_is_healthy():
                    return "fail", ""
                continue
            ref = _grads(functools.partial(_ref_out, causal=causal, upcast=True),
                         q.float(), k.float(), v.float(), dout.float())
            lowp = _grads(functools.partial(_ref_out, causal=causal, upcast=False),
                          q, k, v, dout)
            for what, g, r, lp in zip(("dq", "dk", "dv"), got, ref, lowp):
                c = check_error(g, r, lp)
                status = "ok" if c["ok"] else "FAIL"
                log(f"  {name} {what} max err {c['err']:.3e}  tol {c['tol']:.3e} "
                    f"(= 2*{c['ref_err']:.3e} + {c['floor']:.1e})  {status} {c['why']}")
                all_ok &= c["ok"]
    return ("ok" if all_ok else "fail"), ""


def _skip(skipped: list[dict], name: str, shape: dict, exc: BaseException) -> None:
    reason = _reason(exc)
    entry = {"impl": name, "shape": shape, "reason": reason}
    if is_unsupported(exc):
        entry["unsupported"] = True
    skipped.append(entry)
    log(f"  [skip] {name} seqlen {shape['seqlen']}: {reason}")


def time_shape(impls: dict[str, Impl], q, k, v, dout, causal: bool, shape: dict,
               skipped: list[dict], *, pass_name: str,
               rounds: int) -> tuple[dict[str, list[float]], bool]:
    """First calls, then `rounds` interleaved rounds on one shape.

    Returns ({impl: ms per round}, cuda_still_healthy); failures go to `skipped`.
    """
    timers = {}
    for name, impl in impls.items():
        try:
            if pass_name == "bwd":
                timers[name] = make_bwd_timer(impl, q, k, v, dout, causal)
            else:
                timers[name] = make_fwd_timer(impl, q, k, v, causal)
        except Exception as exc:  # noqa: BLE001 - skip this point, keep going
            _skip(skipped, name, shape, exc)
            if not cuda_is_healthy():
                return {}, False
    healthy = [True]

    def stop_if_broken(name: str, exc: BaseException) -> bool:
        healthy[0] = cuda_is_healthy()
        return not healthy[0]

    ms_rounds, errors = run_rounds(timers, rounds, stop_if_broken)
    for name, exc in errors.items():
        _skip(skipped, name, shape, exc)
    return ms_rounds, healthy[0]


def run_sweep(impls: dict[str, Impl], dtype, dtype_name: str, headdims, causals, seqlens,
              skipped: list[dict], *, pass_name: str = "fwd",
              rounds: int = ROUNDS) -> tuple[list[dict], bool]:
    """Times every impl on every shape in interleaved rounds (time_shape); returns
    (records, cuda_still_healthy). pass_name "bwd" times torch.autograd.grad alone."""
    records = []
    for headdim in headdims:
        for causal in causals:
            log(f"\n== {pass_name}, headdim {headdim}, causal={causal}, {rounds} round(s) ==")
            for seqlen in seqlens:
                batch, nheads = sweep_shape(seqlen, headdim)
                shape = {"headdim": headdim, "causal": causal, "batch": batch,
                         "nheads": nheads, "seqlen": seqlen}
                q, k, v = random_qkv(batch, seqlen, nheads, headdim, dtype, seed=seqlen)
                dout = None
                if pass_name == "bwd":
                    q, k, v = (t.requires_grad_() for t in (q, k, v))
                    dout = random_qkv(batch, seqlen, nheads, headdim, dtype,
                                      seed=seqlen + 1)[0]
                ms_rounds, healthy = time_shape(impls, q, k, v, dout, causal, shape, skipped,
                                                pass_name=pass_name, rounds=rounds)
                parts = []
                for name, ms in ms_rounds.items():
                    rec = make_record(name, dtype_name, headdim, causal, batch, nheads,
                                      seqlen, seqlen, pass_name=pass_name, ms_rounds=ms)
                    records.append(rec)
                    parts.append(f"{name} {rec['tflops']:.0f} "
                                 f"(rounds spread {round_spread(ms):.0%})")
                log(f"  seqlen {seqlen:>5} (b={batch}, h={nheads}): " + ", ".join(parts))
                if not healthy:
                    log("  CUDA context is broken; stopping the sweep here.")
                    return records, False
                del q, k, v, dout
    return records, True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Attention benchmark, forward or (--bwd) backward: cute_attn.mha vs FA4 "
                    "and torch SDPA (FA3-paper sweep: batch*seqlen=16384, hidden 2048), "
                    "implementations interleaved over --rounds rounds per shape.")
    p.add_argument("--headdims", type=parse_int_list, default=None,
                   help="comma list (default 64,128; --quick: 128)")
    p.add_argument("--seqlens", type=parse_int_list, default=None,
                   help="comma list, each dividing 16384 (default 512,...,16384; "
                        "--quick: 1024,4096)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--impls", type=parse_impls, default=list(IMPLS),
                   help=f"comma list from {','.join(IMPLS)} (default: all that import)")
    p.add_argument("--rounds", type=parse_positive_int, default=None,
                   help=f"interleaved timing rounds per shape; the record is their median "
                        f"(default {ROUNDS}; --quick: {QUICK_ROUNDS})")
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
                sweep_shape(s, d)
            except ValueError as exc:
                p.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        sys.exit("perf/bench.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.cuda.get_device_name()
    slug = device_slug(device)
    log(f"{device} | torch {torch.__version__} | CUDA {torch.version.cuda} | "
        f"cutlass-dsl {package_version('nvidia-cutlass-dsl')} | {args.pass_name}, "
        f"{args.rounds} round(s) per shape")
    torch.ones(1, device="cuda")  # CUDA context init, kept out of first-call timings

    impls, skipped = load_impls(args.impls)
    order = [name for name in IMPLS if name in impls]
    failed, notes = [], []

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
        if args.bwd:
            status, reason = check_bwd_correctness(dtype, args.dtype, args.headdims[0])
            if status == "fail":
                log("\nFAILED: cute_attn's gradients do not match attention_ref's; "
                    "not timing it.")
                return 1
            if status == "unsupported":
                log(f"  cute_attn backward unavailable, skipped: {reason}")
                log("  (timing the anchors only)")
                impls.pop("cute_attn")
                skipped.append({"impl": "cute_attn", "shape": None, "reason": reason,
                                "unsupported": True})
            else:
                log("backward correctness: all ok")
        else:
            if not check_correctness(dtype, args.dtype, args.headdims[0], args.seqlens[0]):
                log("\nFAILED: cute_attn.mha does not match attention_ref; not timing it.")
                return 1
            log("correctness: all ok")

    records, healthy = [], not failed
    sweep_s = None
    if healthy:
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
        flops_rule = f"{BWD_FLOP_FACTOR} * ({flops_rule})"
    timed = ("torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), out built once"
             if args.bwd else "one forward call")
    results = build_results(
        device, records, torch_version=torch.__version__,
        cutlass_dsl=package_version("nvidia-cutlass-dsl"), cuda=torch.version.cuda,
        host=host, cudnn=torch.backends.cudnn.version(),
        impls={n: {"version": i.version, "import_s": i.import_s} for n, i in impls.items()},
        skipped=skipped,
        method={
            "flops": flops_rule,
            "timing": f"{args.rounds} interleaved rounds per shape (order rotated per round), "
                      f"each a triton.testing.do_bench median, warmup={WARMUP_MS} ms, "
                      f"rep={REP_MS} ms; ms = median of rounds, ms_rounds = every round",
            "timed": timed, "rounds": args.rounds, "sweep_s": sweep_s,
            "shapes": f"batch*seqlen={TOKENS}, nheads={HIDDEN}/headdim, sq == sk",
            "quick": args.quick,
        },
    )
    dirs = [] if args.quick else [DEFAULT_RESULTS_DIR]
    if args.out is not None:
        dirs.append(args.out)
    for directory in dirs:
        directory.mkdir(parents=True, exist_ok=True)
        json_path, png_path = result_paths(directory, slug, args.pass_name)
        json_path.write_text(json.dumps(results, indent=1) + "\n")
        try:
            plot_results(records, png_path, device, order)
            log(f"wrote {json_path} and {png_path.name}")
        except Exception as exc:  # noqa: BLE001 - the JSON is the record; the plot is a view
            log(f"wrote {json_path}; plot failed: {_reason(exc)}")

    failed += summarize_skips(skipped, args.impls, notes)
    for note in notes:
        log("NOTE: " + note)
    if failed:
        log("\nFINISHED WITH PROBLEMS: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
