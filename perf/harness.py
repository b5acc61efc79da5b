"""What the benchmark scripts share: timing, failure bookkeeping, anchors, files and tables.

perf/bench.py (the dense sweep), perf/bench_features.py (GQA, window, varlen) and
perf/variants.py (forward schedule A/B) keep only their shapes, cases, anchors and command
lines; the rest is here and is not run on its own:

- timing: every implementation runs once (compile, autotune), then all of them are timed in
  interleaved rounds, each round one triton.testing.do_bench median (warmup 25 ms, rep
  100 ms) per implementation with the order rotated by the round; the record is the median
  of rounds (`run_rounds`, `time_interleaved`). The backward times torch.autograd.grad of an
  `out` built once (`make_timer`).
- failures: an implementation that does not import, does not support a case or raises is a
  recorded skip with its reason, and the run goes on unless the CUDA context broke.
- anchors: FA4, cuDNN and FA2 through torch SDPA, and cute_attn itself, on dense
  (batch, seqlen, nheads, headdim) tensors (`DENSE_LOADERS`).
- files: perf/results/<device-slug>-<fwd|bwd|features|variants>.json, JSON documents with
  the software versions, text tables with the cute_attn/fa4 and cute_attn/cudnn ratios, and
  the TFLOP/s-vs-seqlen plot.

Nothing at import time needs a GPU, triton, matplotlib or cute_attn (each is imported where
it is used); the pure helpers are tested on the CPU by tests/test_harness_cpu.py.
"""

import argparse
import contextlib
import dataclasses
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
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    # So `import cute_attn` picks up the working tree, not an installed copy.
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_RESULTS_DIR = REPO_ROOT / "perf" / "results"

# do_bench budgets (ms), per round. One do_bench takes ~0.15-0.2 s of wall time (its L2
# flush, the warmup and the host loop around 125 ms of GPU time).
WARMUP_MS = 25
REP_MS = 100

PASSES = ("fwd", "bwd")
# Backward FLOPs per forward FLOP: the forward does two GEMMs (QK^T, PV), the backward five
# (QK^T recomputed, dP = dO V^T, dV = P^T dO, dK = dS^T Q, dQ = dS K).
BWD_FLOP_FACTOR = 2.5

# The FlashAttention-3 paper's sweep: batch * seqlen and nheads * headdim fixed.
TOKENS = 16384
HIDDEN = 2048

# The two anchors every ratio is taken against, with their column labels.
RATIO_ANCHORS = (("fa4", "cute_attn/fa4"), ("sdpa_cudnn", "cute_attn/cudnn"))
RATIO_LABELS = tuple(label for _, label in RATIO_ANCHORS)

# What every result file starts with (build_results).
RESULT_KEYS = ("device", "date", "torch", "cutlass_dsl", "cuda", "records")
# The results file of each script: <device-slug>-<kind>.json (the dense sweep: one per pass).
RESULT_KINDS = (*PASSES, "features", "variants", "fp8", "masks", "sinks", "dropout", "cp")

# Host-overhead probe: a problem so small that the GPU finishes before the host issues the
# next call, so wall time per call is host time (shared/NOTES.md uses the same shape).
HOST_SHAPE = {"batch": 1, "seqlen": 128, "nheads": 16, "headdim": 128, "causal": True}
HOST_CALLS = 2000
HOST_WARMUP_CALLS = 50


# ----------------------------------------------------------------------------------------
# Pure helpers (no GPU; tested on the CPU)
# ----------------------------------------------------------------------------------------

def check_pass(pass_name: str) -> str:
    if pass_name not in PASSES:
        raise ValueError(f"pass_name must be one of {PASSES}, got {pass_name!r}")
    return pass_name


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int,
                    causal: bool, pass_name: str = "fwd") -> float:
    """Forward FLOPs: 4*b*h*sq*sk*d (two GEMMs, 2 FLOPs per MAC), halved for causal.

    Causal is bottom-right aligned, so "halved" holds for sq == sk only (every dense sweep
    here); otherwise the area the mask leaves visible: sq*sk - sq^2/2 when sq <= sk (a
    decode query sees every key), sk^2/2 when sq > sk (the first sq - sk rows see none).
    Both are the papers' s^2/2 at sq == sk and within half a pair per row of the exact count.

    pass_name="bwd": BWD_FLOP_FACTOR (2.5) times that, the FA2/FA3 papers' convention.
    """
    check_pass(pass_name)
    pairs = float(seqlen_q) * seqlen_k
    if causal:
        pairs = pairs - seqlen_q * seqlen_q / 2 if seqlen_q <= seqlen_k else seqlen_k * seqlen_k / 2
    flops = 4.0 * batch * nheads * pairs * headdim
    return flops * BWD_FLOP_FACTOR if pass_name == "bwd" else flops


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s from a FLOP count and a time in milliseconds."""
    if not ms > 0:
        raise ValueError(f"ms must be positive, got {ms!r}")
    return flops / (ms * 1e-3) / 1e12


def sweep_shape(seqlen: int, headdim: int, tokens: int = TOKENS,
                hidden: int = HIDDEN) -> tuple[int, int]:
    """(batch, nheads) for one sweep point: batch*seqlen = tokens, nheads*headdim = hidden."""
    if seqlen <= 0 or tokens % seqlen:
        raise ValueError(f"seqlen must divide {tokens}, got {seqlen}")
    if headdim <= 0 or hidden % headdim:
        raise ValueError(f"headdim must divide {hidden}, got {headdim}")
    return tokens // seqlen, hidden // headdim


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (runs of non-alnum -> one '-')."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


def result_path(directory: Path, slug: str, kind: str, suffix: str = ".json") -> Path:
    """<directory>/<slug>-<kind><suffix>; kind is one of RESULT_KINDS."""
    if kind not in RESULT_KINDS:
        raise ValueError(f"kind must be one of {RESULT_KINDS}, got {kind!r}")
    return Path(directory) / f"{slug}-{kind}{suffix}"


def output_dirs(out: Path | None, quick: bool = False) -> list[Path]:
    """Where a run writes: perf/results/ (except for a --quick run) and the --out DIR."""
    dirs = [] if quick else [DEFAULT_RESULTS_DIR]
    return dirs + ([Path(out)] if out is not None else [])


def write_json(doc: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def build_results(device: str, records: list[dict], *, torch_version: str | None,
                  cutlass_dsl: str | None, cuda: str | None, date: str | None = None,
                  host: dict | None = None, **extra) -> dict:
    """The JSON document: RESULT_KEYS first, then `host` (when measured) and the extras."""
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


def timing_method(rounds: int, per: str) -> str:
    """The `method.timing` text of a results file."""
    return (f"{rounds} interleaved rounds per {per} (order rotated per round), each a "
            f"triton.testing.do_bench median, warmup={WARMUP_MS} ms, rep={REP_MS} ms; "
            "ms = median of rounds, ms_rounds = every round")


def parse_int_list(text: str) -> list[int]:
    """'512, 1024,2048' -> [512, 1024, 2048]; for argparse."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_flag_list(text: str) -> list[int]:
    """'0,1' -> [0, 1] (causal off / on); for argparse."""
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values or any(v not in ("0", "1") for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of 0 and 1, got {text!r}")
    return [int(v) for v in values]


def parse_positive_int(text: str) -> int:
    """'5' -> 5; for argparse (--rounds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_names(text: str, choices: Sequence[str], given_order: bool = False) -> list[str]:
    """'fa4, cute_attn' -> the names, each one of `choices`; for argparse. In the order of
    `choices` (duplicates dropped), or as given when given_order."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in choices]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown name(s) {unknown or text!r}; choose from {','.join(choices)}")
    return names if given_order else [c for c in choices if c in names]


def add_impls_and_rounds(parser: argparse.ArgumentParser, impls: Sequence[str], *,
                         rounds: int, quick_rounds: int, per: str,
                         given_order: bool = False) -> None:
    """--impls (default: all) and --rounds (default None: the caller picks rounds or
    quick_rounds by --quick)."""
    parser.add_argument("--impls", default=list(impls),
                        type=functools.partial(parse_names, choices=impls,
                                               given_order=given_order),
                        help=f"comma list from {','.join(impls)} (default: all that import)")
    parser.add_argument("--rounds", type=parse_positive_int, default=None,
                        help=f"interleaved timing rounds per {per}; the record is their "
                             f"median (default {rounds}; --quick: {quick_rounds})")


def config_variant(base, name: str, fields: dict, flags: Sequence[str] = ()):
    """base (a config dataclass) with the changes a variant name spells: parts joined by
    '+', each a prefix from fields and an integer (n192+pp0: tile_n=192, pingpong=False);
    a field named in flags takes the integer as a bool."""
    changes = {}
    for part in name.split("+"):
        prefix = part.rstrip("0123456789")
        if prefix not in fields or prefix == part:
            raise ValueError(f"unknown variant {part!r}: expected one of {sorted(fields)} followed by a number")
        field = fields[prefix]
        value = int(part[len(prefix):])
        changes[field] = bool(value) if field in flags else value
    return dataclasses.replace(base, **changes)


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


def round_ratio_range(ms_a: Sequence[float], ms_b: Sequence[float]) -> tuple[float, float]:
    """(lowest, highest) over rounds of a's speed over b's, ms_b[r] / ms_a[r] (run_rounds
    times round r of every implementation back to back). A ratio of medians hides this
    spread: session 31 read +5-9% for three variants in a 5-round A/B that a 9-round rerun
    put at 1.00 (perf/NOTES.md). A range that straddles 1 is noise."""
    if len(ms_a) != len(ms_b) or not ms_a:
        raise ValueError(f"round_ratio_range needs rounds of equal count, got {len(ms_a)} and {len(ms_b)}")
    ratios = [b / a for a, b in zip(ms_a, ms_b)]
    return min(ratios), max(ratios)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either side is missing or not positive."""
    if numerator is None or denominator is None or not denominator > 0:
        return None
    return numerator / denominator


def tflops_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def ratio_cells(tflops_of: Callable[[str], float | None]) -> list[str]:
    """The cute_attn/fa4 and cute_attn/cudnn cells of a table row ('-': an anchor is missing);
    tflops_of(impl) is the row's TFLOP/s of impl, or None."""
    cute = tflops_of("cute_attn")
    cells = []
    for anchor, _ in RATIO_ANCHORS:
        r = ratio(cute, tflops_of(anchor))
        cells.append("-" if r is None else f"{r:.3f}")
    return cells


def text_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], *,
               left: int = 0, empty: str = "(no measurements)") -> str:
    """Title, header, a dashed rule and the rows in columns two spaces apart; the first
    `left` columns flush left, the rest flush right; `empty` when there is no row."""
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]

    def fmt(line):
        return "  ".join(text.ljust(w) if i < left else text.rjust(w)
                         for i, (text, w) in enumerate(zip(line, widths)))

    lines = [title, fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    if not rows:
        lines.append(empty)
    return "\n".join(lines)


def tflops_by_seqlen(records: Iterable[dict], headdim: int, causal: bool) -> dict:
    """{(impl, seqlen_q): tflops} of the dense records of one (headdim, causal) config."""
    return {(r["impl"], r["seqlen_q"]): r["tflops"] for r in records
            if r["headdim"] == headdim and r["causal"] == causal}


def seqlen_label(seqlen: int) -> str:
    return f"{seqlen // 1024}K" if seqlen >= 1024 and seqlen % 1024 == 0 else str(seqlen)


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


# check_agreement's rule, elementwise |a - b| <= atol + rtol * |b| (torch.allclose's): two
# bf16 kernels on the same problem differ by an ulp or two of the output (~1e-2 at |out| ~ 1,
# a few 1e-2 on the rare |out| ~ 4 of rows that see a handful of keys); a different mask,
# alignment or sink moves the rows it touches by O(0.1-1)
AGREE_ATOL = 0.02
AGREE_RTOL = 0.02


def check_agreement(forwards: dict[str, Callable], tensors: Sequence,
                    pairs: dict[str, str]) -> tuple[dict[str, str], dict[str, float]]:
    """Before timing: does each forwards[name](*tensors) compute what forwards[ref] does,
    for name, ref in pairs (both present; no grad)? Returns ({name: reason} of those that
    differ beyond AGREE_ATOL + AGREE_RTOL * |ref| somewhere or raise, to be left out of
    the timing and recorded; {name: max |out - ref out|}). A reference that raises checks
    nothing (its own timing records the error)."""
    import torch

    bad, diffs, refs = {}, {}, {}
    for name, ref in pairs.items():
        if name not in forwards or ref not in forwards:
            continue
        if ref not in refs:
            try:
                with torch.no_grad():
                    refs[ref] = forwards[ref](*tensors).float()
            except Exception:  # noqa: BLE001
                refs[ref] = None
        if refs[ref] is None:
            continue
        try:
            with torch.no_grad():
                out = forwards[name](*tensors).float()
            gap = (out - refs[ref]).abs()
            diffs[name] = gap.max().item()
            if not bool((gap <= AGREE_ATOL + AGREE_RTOL * refs[ref].abs()).all()):
                bad[name] = (f"differs from {ref} (max |diff| {diffs[name]:.3g}): computes "
                             "another problem; not timed")
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            bad[name] = reason(exc)
    return bad, diffs


def check_line(label: str, check: dict) -> str:
    """One log line of a check_error result."""
    c = check
    return (f"  {label} max err {c['err']:.3e}  tol {c['tol']:.3e} "
            f"(= 2*{c['ref_err']:.3e} + {c['floor']:.1e})  {'ok' if c['ok'] else 'FAIL'} "
            f"{c['why']}")


def log(*args) -> None:
    print(*args, flush=True)


def reason(exc: BaseException) -> str:
    """The first line of 'Type: message', at most 300 characters: a skip's recorded reason."""
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:300]


class BackwardUnsupported(RuntimeError):
    """An implementation's output cannot be differentiated (it has no grad_fn)."""


def is_unsupported(exc: BaseException) -> bool:
    """A skip that says "not implemented" rather than "broken": it does not fail the run."""
    return isinstance(exc, (NotImplementedError, BackwardUnsupported))


def record_skip(skipped: list[dict], entry: dict, where: str,
                unsupported: bool = False) -> None:
    """Append a skip (`entry`: impl, what was skipped, reason) and log it; an unsupported
    one is marked so (it does not fail the run, see summarize_skips)."""
    if unsupported:
        entry = {**entry, "unsupported": True}
    skipped.append(entry)
    log(f"  [{'n/a' if unsupported else 'skip'}] {entry['impl']} {where}: {entry['reason']}")


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


def finish(failed: list[str], skipped: Sequence[dict], requested: Sequence[str],
           notes: Sequence[str] = ()) -> int:
    """The end of a run: log the notes and the problems (`failed` plus cute_attn's broken
    skips); the exit status, 1 when there is a problem."""
    notes = list(notes)
    failed = list(failed) + summarize_skips(skipped, requested, notes)
    for note in notes:
        log("NOTE: " + note)
    if failed:
        log("\nFINISHED WITH PROBLEMS: " + "; ".join(failed))
        return 1
    return 0


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def tree_version() -> str:
    """The cute_attn version a results file records: git_describe, and the kernel sources'
    fingerprint (compile_cache.source_fingerprint), which names the tree even where the
    checkout's HEAD does not (the device's copy of a working tree reads as its base commit,
    '-dirty'). Recompute it for a commit with `git worktree add` and source_fingerprint()."""
    from cute_attn.compile_cache import source_fingerprint

    return f"{git_describe()} sources {source_fingerprint()[:16]}"


def git_describe() -> str | None:
    """Short HEAD of this checkout, '-dirty' when cute_attn/ has uncommitted changes."""
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


def plot_sweep(records: Sequence[dict], path: Path, device: str, impls: Sequence[str],
               palette: Sequence[str] = ()) -> None:
    """TFLOP/s vs seqlen of dense records (bench.py's), one line per impl, a subplot per
    (headdim, causal); a small PNG. An impl's colour is its place in `palette`, so it is
    the same in every plot whichever impls ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    headdims = sorted({r["headdim"] for r in records})
    causals = sorted({r["causal"] for r in records})
    if not headdims:
        return
    fig, axes = plt.subplots(len(headdims), len(causals), squeeze=False,
                             figsize=(4.6 * len(causals), 3.3 * len(headdims)), dpi=80)
    for i, headdim in enumerate(headdims):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            cell = tflops_by_seqlen(records, headdim, causal)
            seqlens = sorted({s for (_, s) in cell})
            for impl in impls:
                points = [(s, cell[(impl, s)]) for s in seqlens if (impl, s) in cell]
                if points:
                    xs, ys = zip(*points)
                    color = f"C{list(palette).index(impl)}" if impl in palette else None
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
    fig.suptitle(f"{device}: {records[0]['dtype']} attention {records[0]['pass']}, "
                 f"batch*seqlen={TOKENS}, hidden {HIDDEN}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------------------
# GPU side
# ----------------------------------------------------------------------------------------

def cuda_setup(script: str) -> str:
    """The GPU's name, after creating the CUDA context (kept out of first-call times);
    exits with a message where there is no GPU."""
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.ones(1, device="cuda")
    return torch.cuda.get_device_name()


def run_info() -> dict:
    """The software a run measured with, as build_results' keyword arguments."""
    import torch

    return {"torch_version": torch.__version__,
            "cutlass_dsl": package_version("nvidia-cutlass-dsl"),
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


def describe_run(device: str, info: dict) -> str:
    """The first log line of a run: the GPU and run_info()."""
    return (f"{device} | torch {info['torch_version']} | CUDA {info['cuda']} | cuDNN "
            f"{info['cudnn']} | cutlass-dsl {info['cutlass_dsl']}")


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


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


def random_tensors(shapes: Iterable[Sequence[int]], dtype, device="cuda", seed: int = 0):
    """Random-normal tensors of `shapes`, drawn in turn from one generator seeded `seed`.
    Never zeros: zeros make the softmax trivial and the tensor cores' power draw
    unrealistically low."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, device=device, dtype=dtype, generator=gen) for shape in shapes]


def random_qkv(batch, seqlen, nheads, headdim, dtype, seed=0, device="cuda"):
    """q, k, v of shape (batch, seqlen, nheads, headdim)."""
    return random_tensors([(batch, seqlen, nheads, headdim)] * 3, dtype, device, seed)


def do_bench(fn) -> float:
    """One round of one implementation: triton's do_bench median in ms."""
    from triton.testing import do_bench as triton_do_bench

    return triton_do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def pass_call(direction: str, fwd: Callable, tensors: Sequence) -> Callable[[], object]:
    """The call to time for one pass: the forward fwd(*tensors) under no_grad, or the
    backward alone (one forward keeping its graph, then autograd.grad of a fixed random
    dout over it, retained), with respect to every tensor the graph reaches (a sink that
    one implementation ignores is left out for it)."""
    import torch

    if direction == "fwd":
        def call():
            with torch.no_grad():
                return fwd(*tensors)
        return call
    leaves = tuple(t.detach().requires_grad_() for t in tensors)
    out = fwd(*leaves)
    require_grad_fn(out)
    reached = _graph_leaves(out)
    inputs = tuple(t for t in leaves if t in reached)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def _graph_leaves(out) -> set:
    """The leaf tensors out's autograd graph reaches."""
    found, seen, stack = set(), set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if getattr(fn, "variable", None) is not None:
            found.add(fn.variable)
        stack.extend(f for f, _ in fn.next_functions)
    return found


def time_passes(makers: dict[str, Callable[[], Callable]], rounds: int, rec: dict, prefix: str) -> dict[str, float]:
    """Interleaved rounds over the implementations of one pass: makers maps a name to a
    function building the call to time (pass_call); the call runs once before timing. A
    maker or a call that raises is recorded in rec["errors"][prefix + name] and left out.
    rec[prefix + "ms_rounds"] gets every round; returns {name: median ms}."""
    calls = {}
    for name, make in makers.items():
        try:
            calls[name] = make()
            calls[name]()
        except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
            rec["errors"][prefix + name] = reason(exc)
            calls.pop(name, None)
    synchronize()
    timers = {name: (lambda fn=fn: do_bench(fn)) for name, fn in calls.items()}
    ms_rounds, errors = run_rounds(timers, rounds)
    rec["errors"].update({prefix + n: reason(e) for n, e in errors.items()})
    rec[prefix + "ms_rounds"] = ms_rounds
    return {name: median_ms(r) for name, r in ms_rounds.items()}


def dout_like(out, dout):
    """dout copied into a tensor laid out like `out` (an SDPA anchor returns a transposed
    view), as the gradient of a real model's next layer would be."""
    import torch

    return torch.empty_like(out).copy_(dout)


def require_grad_fn(out, name: str = "the implementation") -> None:
    if out.grad_fn is None:
        raise BackwardUnsupported(f"{name} returned an output with no grad_fn (its forward "
                                  "is not differentiable)")


def grads_of(out, leaves, dout, name: str = "the implementation"):
    """torch.autograd.grad(out, leaves, dout); BackwardUnsupported when out has no grad_fn."""
    import torch

    require_grad_fn(out, name)
    return torch.autograd.grad(out, leaves, dout)


def make_timer(fn: Callable, pass_name: str, *,
               context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
               leaves: Sequence = (), dout=None, dout_for: Callable = dout_like,
               name: str = "the implementation") -> Callable[[], float]:
    """Make the first call now (the compile; its errors surface here) and return a timer of
    one round, `context` entered around it.

    "fwd" times fn(). "bwd" builds out = fn() once, from `leaves` with requires_grad, and
    times torch.autograd.grad(out, leaves, dout_for(out, dout), retain_graph=True) alone.
    """
    import torch

    check_pass(pass_name)
    with context():
        if pass_name == "fwd":
            timed = fn
        else:
            out = fn()
            require_grad_fn(out, name)
            grad_out = dout_for(out, dout)

            def timed():
                return torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
        timed()
        synchronize()

    def one_round() -> float:
        with context():
            return do_bench(timed)

    return one_round


def time_interleaved(first_calls: dict[str, Callable[[], Callable[[], float]]], rounds: int,
                     skip: Callable[[str, BaseException], None],
                     ) -> tuple[dict[str, list[float]], bool]:
    """Time one shape: first_calls[name]() makes each implementation's first call and
    returns its one-round timer (make_timer), then `rounds` interleaved rounds (run_rounds).

    A failure goes to skip(name, exc) and the others go on, unless the CUDA context broke.
    Returns ({name: ms per round}, cuda_still_healthy).
    """
    timers = {}
    for name, first_call in first_calls.items():
        try:
            timers[name] = first_call()
        except Exception as exc:  # noqa: BLE001 - skip this point, keep going
            skip(name, exc)
            if not cuda_is_healthy():
                return {}, False
    healthy = True

    def stop_if_broken(name: str, exc: BaseException) -> bool:
        nonlocal healthy
        healthy = cuda_is_healthy()
        return not healthy

    ms_rounds, errors = run_rounds(timers, rounds, stop_if_broken)
    for name, exc in errors.items():
        skip(name, exc)
    return ms_rounds, healthy


def host_us_per_call(fn: Callable, calls: int = HOST_CALLS,
                     warmup: int = HOST_WARMUP_CALLS) -> float:
    """Microseconds per call of a host loop of `calls` calls after `warmup` ones, with a
    CUDA synchronize only at the ends: on a tiny problem (HOST_SHAPE), host time."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


@dataclass
class Impl:
    """An attention forward on dense (batch, seqlen, nheads, headdim) tensors.

    The backward differentiates its output with torch.autograd (every anchor here is an
    autograd op, and so is cute_attn.mha). `context` is entered around a whole measurement
    (not per call), so the backend selection of the SDPA anchors is not part of their
    per-call host time; the backward is dispatched from the graph the forward recorded, so
    it follows the same backend.
    """
    name: str
    fn: Callable  # (q, k, v, causal) -> out, same layout as q
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    version: str | None = None
    import_s: float = 0.0


def load_cute_attn() -> Impl:
    import cute_attn

    with contextlib.suppress(ImportError):
        # `import cute_attn` leaves the DSL to the first call; load it here so that the
        # first-call time measures the compile, not the DSL's import.
        import cutlass.cute  # noqa: F401

    def fn(q, k, v, causal):
        return cute_attn.mha(q, k, v, causal=causal)

    return Impl("cute_attn", fn, version=tree_version())


def load_fa4() -> Impl:
    from flash_attn.cute import flash_attn_func

    def fn(q, k, v, causal):
        out = flash_attn_func(q, k, v, causal=causal)
        # Some versions return (out, lse).
        return out[0] if isinstance(out, tuple) else out

    return Impl("fa4", fn, version=package_version("flash-attn-4"))


def load_sdpa(name: str, backend_name: str) -> Impl:
    """torch SDPA forced to SDPBackend.<backend_name>, on (b, s, h, d) tensors."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v, causal):
        # SDPA takes (b, h, s, d): transposed views, no copies. Its is_causal is top-left
        # aligned; cute_attn and FA4 are bottom-right. The two agree when seqlen_q ==
        # seqlen_k, which holds for every dense shape the scripts run; otherwise SDPA
        # would time another problem, so it is an unsupported case.
        if causal and q.shape[1] != k.shape[1]:
            raise NotImplementedError(
                f"SDPA's is_causal is top-left aligned, cute_attn's bottom-right: they differ "
                f"at seqlen_q {q.shape[1]} != seqlen_k {k.shape[1]}")
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)

    version = (f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}"
               if backend_name == "CUDNN_ATTENTION" else f"torch {torch.__version__}")
    return Impl(name, fn, context=lambda: sdpa_kernel(backend), version=version)


DENSE_LOADERS = {
    "cute_attn": load_cute_attn,
    "fa4": load_fa4,
    "sdpa_cudnn": functools.partial(load_sdpa, "sdpa_cudnn", "CUDNN_ATTENTION"),
    "sdpa_flash": functools.partial(load_sdpa, "sdpa_flash", "FLASH_ATTENTION"),
}


def load_impls(names: Sequence[str], loaders: dict[str, Callable[[], Impl]] = DENSE_LOADERS,
               blank_keys: Sequence[str] = ("shape",)) -> tuple[dict[str, Impl], list[dict]]:
    """{name: Impl} of each name that imports, and the skips of those that do not (their
    `blank_keys` None: nothing was measured)."""
    impls, skipped = {}, []
    for name in names:
        t0 = time.perf_counter()
        try:
            impl = loaders[name]()
        except Exception as exc:  # noqa: BLE001 - any import failure is a skip, not a crash
            why = reason(exc)
            log(f"[skip] {name}: not available ({why})")
            skipped.append({"impl": name, **dict.fromkeys(blank_keys), "reason": why})
            continue
        impl.import_s = time.perf_counter() - t0
        impls[name] = impl
        log(f"[ok]   {name}: {impl.version or ''} (import {impl.import_s:.2f} s)")
    return impls, skipped


def impl_versions(impls: dict[str, Impl]) -> dict:
    """The `impls` entry of a results file."""
    return {name: {"version": impl.version, "import_s": impl.import_s}
            for name, impl in impls.items()}


def make_impl_timer(impl: Impl, pass_name: str, q, k, v, causal: bool,
                    dout=None) -> Callable[[], float]:
    """make_timer of a dense impl.fn(q, k, v, causal); "bwd" differentiates it with
    respect to (q, k, v), requires_grad leaves, for dout (laid out like out)."""
    return make_timer(functools.partial(impl.fn, q, k, v, causal), pass_name,
                      context=impl.context, leaves=(q, k, v), dout=dout, name=impl.name)


def make_bwd_timer(impl: Impl, q, k, v, dout, causal: bool) -> Callable[[], float]:
    return make_impl_timer(impl, "bwd", q, k, v, causal, dout)


def time_impl(impl: Impl, q, k, v, causal: bool) -> float:
    """Median ms of one forward call after a first call; one round."""
    return make_impl_timer(impl, "fwd", q, k, v, causal)()
