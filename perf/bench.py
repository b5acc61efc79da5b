"""Forward benchmark of `cute_attn.mha` against anchors measured in the same process.

The sweep is the FlashAttention-3 paper's: bf16, batch * seqlen = 16384 tokens, hidden size
2048 (so nheads = 2048 / headdim), seqlen 512 ... 16K, headdim 64 and 128, causal and not.
Every shape gets fresh random-normal q, k, v (never zeros: zeros make the softmax trivial and
the tensor cores' power draw unrealistically low).

    FLOPs   = 4 * batch * nheads * seqlen_q * seqlen_k * headdim   (QK^T and PV, 2 per MAC)
              halved when causal (the FA2/FA3 papers' convention, not the exact masked count)
    TFLOP/s = FLOPs / (median_ms * 1e-3) / 1e12       (triton.testing.do_bench, median)

Implementations (`--impls`, default: every one that imports):
    cute_attn   cute_attn.mha, the kernel under test (never replaced by an anchor)
    fa4         FlashAttention-4's CuTe-DSL kernel, flash_attn.cute.flash_attn_func
    sdpa_cudnn  torch SDPA forced to SDPBackend.CUDNN_ATTENTION
    sdpa_flash  torch SDPA forced to SDPBackend.FLASH_ATTENTION (FA2)
An implementation that does not import, or raises on a shape, is recorded as skipped with the
reason; the run goes on.

Outputs: a table per (headdim, causal) with ratios cute_attn/fa4 and cute_attn/cudnn, and
perf/results/<device-slug>-fwd.json plus a 2x2 plot <device-slug>-fwd.png (and a copy of both
under --out DIR). --quick checks correctness first and writes files only with --out.

Run from the repo root (on the GPU machine, after `source .devbundle/install.sh`):
    python3 perf/bench.py                          # full sweep, ~1 minute on an H100
    python3 perf/bench.py --quick                  # check + hdim 128, seqlen 1K/4K
    python3 perf/bench.py --host-overhead --out $OUT

The helpers above the "GPU side" line are pure and are tested on the CPU by
tests/test_bench_cpu.py; nothing at import time needs a GPU, triton or matplotlib.
"""

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Sequence

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

# do_bench budgets (ms). 25/100 keeps one shape at ~0.2-0.3 s including do_bench's L2 flush,
# so the 96-point sweep is about a minute plus first-call compiles.
WARMUP_MS = 25
REP_MS = 100

# Host-overhead probe: a problem so small that the GPU finishes before the host issues the
# next call, so wall time per call is host time (shared/NOTES.md uses the same shape).
HOST_SHAPE = dict(batch=1, seqlen=128, nheads=16, headdim=128, causal=True)
HOST_CALLS = 2000
HOST_WARMUP_CALLS = 50

RESULT_KEYS = ("device", "date", "torch", "cutlass_dsl", "cuda", "records")
RECORD_KEYS = (
    "impl", "pass", "dtype", "headdim", "causal", "batch", "nheads",
    "seqlen_q", "seqlen_k", "ms", "tflops",
)

# The two anchors the ratios are taken against, with their column labels.
RATIO_ANCHORS = (("fa4", "cute_attn/fa4"), ("sdpa_cudnn", "cute_attn/cudnn"))


# ----------------------------------------------------------------------------------------
# Pure helpers (no GPU; tested on the CPU)
# ----------------------------------------------------------------------------------------

def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    causal: bool) -> float:
    """Forward FLOPs: 4*b*h*sq*sk*d (two GEMMs, 2 FLOPs per MAC), halved for causal."""
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    return flops / 2 if causal else flops


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
                seqlen_q: int, seqlen_k: int, ms: float) -> dict:
    """One JSON record; the FLOP count and TFLOP/s are derived here, next to each other."""
    flops = attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal)
    return {
        "impl": impl, "pass": "fwd", "dtype": dtype, "headdim": headdim,
        "causal": bool(causal), "batch": batch, "nheads": nheads,
        "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
        "ms": ms, "tflops": tflops(flops, ms),
    }


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
    title = (f"headdim {headdim}, {'causal' if causal else 'non-causal'} "
             f"{dtype} fwd, TFLOP/s (batch*seqlen={TOKENS}, nheads={HIDDEN // headdim})")
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


def result_paths(directory: Path, slug: str) -> tuple[Path, Path]:
    return Path(directory) / f"{slug}-fwd.json", Path(directory) / f"{slug}-fwd.png"


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
        return dict(ok=False, err=math.inf, ref_err=math.nan, floor=math.nan, tol=math.nan,
                    why=f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    ref = ref.float()
    err = (out.float() - ref).abs().max().item()
    ref_err = (ref_lowp.float() - ref).abs().max().item()
    if floor is None:
        floor = (ref.to(out.dtype).float() - ref).abs().max().item()
    tol = 2 * ref_err + floor
    ok = math.isfinite(err) and err <= tol
    return dict(ok=ok, err=err, ref_err=ref_err, floor=floor, tol=tol, why="")


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
    fig.suptitle(f"{device}: {dtype} attention fwd, batch*seqlen={TOKENS}, "
                 f"hidden {HIDDEN}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def log(*args) -> None:
    print(*args, flush=True)


# ----------------------------------------------------------------------------------------
# GPU side
# ----------------------------------------------------------------------------------------

@dataclass
class Impl:
    """A forward attention on (batch, seqlen, nheads, headdim) tensors.

    `context` is entered around a whole measurement (not per call), so the backend selection
    of the SDPA anchors is not part of their per-call host time.
    """
    name: str
    fn: Callable  # (q, k, v, causal) -> out, same layout as q
    context: Callable[[], ContextManager] = contextlib.nullcontext
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
                              capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cute_attn"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
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
            skipped.append(dict(impl=name, shape=None, reason=reason))
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


def time_impl(impl: Impl, q, k, v, causal: bool) -> float:
    """Median ms of one call, after a first call (compile) whose errors surface here."""
    import torch
    from triton.testing import do_bench

    with impl.context():
        impl.fn(q, k, v, causal)
        torch.cuda.synchronize()
        return do_bench(lambda: impl.fn(q, k, v, causal), warmup=WARMUP_MS, rep=REP_MS,
                        return_mode="median")


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
    host = dict(shape=dict(shape), calls=HOST_CALLS, warmup_calls=HOST_WARMUP_CALLS,
                method="wall clock of a host loop, torch.cuda.synchronize before and after",
                impls={})
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
            host["impls"][name] = dict(skipped=reason)
            if not cuda_is_healthy():
                log("  CUDA context is broken; stopping the host measurement here.")
                host["cuda_broken"] = True
                break
            continue
        host["impls"][name] = dict(us_per_call=us, first_call_s=first_s)
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


def run_sweep(impls: dict[str, Impl], dtype, dtype_name: str, headdims, causals, seqlens,
              skipped: list[dict]) -> tuple[list[dict], bool]:
    """Times every impl on every shape; returns (records, cuda_still_healthy)."""
    records = []
    for headdim in headdims:
        for causal in causals:
            log(f"\n== headdim {headdim}, causal={causal} ==")
            for seqlen in seqlens:
                batch, nheads = sweep_shape(seqlen, headdim)
                q, k, v = random_qkv(batch, seqlen, nheads, headdim, dtype, seed=seqlen)
                parts = []
                for name, impl in impls.items():
                    try:
                        ms = time_impl(impl, q, k, v, causal)
                    except Exception as exc:  # noqa: BLE001 - skip this point, keep going
                        reason = _reason(exc)
                        shape = dict(headdim=headdim, causal=causal, batch=batch,
                                     nheads=nheads, seqlen=seqlen)
                        skipped.append(dict(impl=name, shape=shape, reason=reason))
                        log(f"  [skip] {name} seqlen {seqlen}: {reason}")
                        if not cuda_is_healthy():
                            log("  CUDA context is broken; stopping the sweep here.")
                            return records, False
                        continue
                    rec = make_record(name, dtype_name, headdim, causal, batch, nheads,
                                      seqlen, seqlen, ms)
                    records.append(rec)
                    parts.append(f"{name} {rec['tflops']:.0f}")
                log(f"  seqlen {seqlen:>5} (b={batch}, h={nheads}): " + ", ".join(parts))
                del q, k, v
    return records, True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Forward attention benchmark: cute_attn.mha vs FA4 and torch SDPA "
                    "(FA3-paper sweep: batch*seqlen=16384, hidden 2048).")
    p.add_argument("--headdims", type=parse_int_list, default=None,
                   help="comma list (default 64,128; --quick: 128)")
    p.add_argument("--seqlens", type=parse_int_list, default=None,
                   help="comma list, each dividing 16384 (default 512,...,16384; "
                        "--quick: 1024,4096)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--impls", type=parse_impls, default=list(IMPLS),
                   help=f"comma list from {','.join(IMPLS)} (default: all that import)")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the JSON and PNG here (with --quick: only here)")
    p.add_argument("--quick", action="store_true",
                   help="check mha against attention_ref (exit 1 if wrong), then time "
                        "hdim 128 at seqlen 1024,4096; writes files only with --out")
    p.add_argument("--host-overhead", action="store_true",
                   help="first measure per-call host time on batch 1, seqlen 128, 16 heads, "
                        "hdim 128, causal, and cute_attn's first-call compile time")
    p.add_argument("--bwd", action="store_true", help="backward (not implemented yet)")
    args = p.parse_args(argv)
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
    if args.bwd:
        sys.exit("backward benchmark not implemented yet")

    import torch

    if not torch.cuda.is_available():
        sys.exit("perf/bench.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.cuda.get_device_name()
    slug = device_slug(device)
    log(f"{device} | torch {torch.__version__} | CUDA {torch.version.cuda} | "
        f"cutlass-dsl {package_version('nvidia-cutlass-dsl')}")
    torch.ones(1, device="cuda")  # CUDA context init, kept out of first-call timings

    impls, skipped = load_impls(args.impls)
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
        if not check_correctness(dtype, args.dtype, args.headdims[0], args.seqlens[0]):
            log("\nFAILED: cute_attn.mha does not match attention_ref; not timing it.")
            return 1
        log("correctness: all ok")

    records, healthy = [], not failed
    if healthy:
        records, healthy = run_sweep(impls, dtype, args.dtype, args.headdims,
                                     causal_modes(args.causal), args.seqlens, skipped)
        if not healthy:
            failed.append("CUDA context broke mid-sweep")
    order = [name for name in IMPLS if name in impls]
    for headdim in args.headdims:
        for causal in causal_modes(args.causal):
            log("\n" + format_table(records, headdim, causal, order))

    results = build_results(
        device, records, torch_version=torch.__version__,
        cutlass_dsl=package_version("nvidia-cutlass-dsl"), cuda=torch.version.cuda,
        host=host, cudnn=torch.backends.cudnn.version(),
        impls={n: dict(version=i.version, import_s=i.import_s) for n, i in impls.items()},
        skipped=skipped,
        method=dict(flops="4*b*h*sq*sk*d, halved for causal",
                    timing=f"triton.testing.do_bench median, warmup={WARMUP_MS} ms, "
                           f"rep={REP_MS} ms",
                    shapes=f"batch*seqlen={TOKENS}, nheads={HIDDEN}/headdim, sq == sk",
                    quick=args.quick),
    )
    dirs = [] if args.quick else [DEFAULT_RESULTS_DIR]
    if args.out is not None:
        dirs.append(args.out)
    for directory in dirs:
        directory.mkdir(parents=True, exist_ok=True)
        json_path, png_path = result_paths(directory, slug)
        json_path.write_text(json.dumps(results, indent=1) + "\n")
        try:
            plot_results(records, png_path, device, order)
            log(f"wrote {json_path} and {png_path.name}")
        except Exception as exc:  # noqa: BLE001 - the JSON is the record; the plot is a view
            log(f"wrote {json_path}; plot failed: {_reason(exc)}")

    cute_skips = [s for s in skipped if s["impl"] == "cute_attn"]
    if "cute_attn" in args.impls and cute_skips:
        failed.append(f"cute_attn skipped {len(cute_skips)} time(s)")
    if failed:
        log("\nFINISHED WITH PROBLEMS: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
