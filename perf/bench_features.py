"""Forward and backward benchmark of cute_attn's features (issue 4) against FA4 and cuDNN,
timed side by side in one process: GQA, variable-length batches, sliding windows.

Cases (bf16, random-normal inputs, headdim 128; `build_cases`):
    gqa-b2-s8192     Llama-3-8B-like GQA: 32 query heads, 8 KV heads, causal, batch 2 x 8192
    gqa-b8-s2048     the same heads, batch 8 x 2048
    window-4096-0    sliding window, causal-local: batch 1 x 16384, 16 heads,
                     window_size=(4096, 0) (each query sees itself and the 4096 keys before)
    window-2048-2048 symmetric window, not causal: batch 1 x 16384, 16 heads, (2048, 2048)
    varlen-16docs    16 documents, log-uniform lengths in [128, 8192] (fixed seed; the draw
                     is repeated until the total is 44000..56000 tokens: 47379 tokens,
                     lengths 197..7985), 16 heads, causal, packed (total, nheads, headdim)
                     with int32 cu_seqlens (mha_varlen)
--quick keeps gqa-b8-s2048, window-4096-0 and varlen-16docs. varlen runs last: its cuDNN
anchor is torch's experimental nested-tensor path (see below).

FLOPs, exact count of the (query, key) pairs that are visible (`visible_pairs`):

    pairs(sq, sk) = #{(i, j) : 0 <= i < sq, 0 <= j < sk,
                      i + sk - sq - left <= j <= i + sk - sq + right}
        bottom-right aligned (FlashAttention's and cute_attn's convention); a side that is -1
        is unbounded; causal sets right = 0 (so causal alone is the window (-1, 0)).
    forward FLOPs  = 4 * headdim * nheads * sum over sequences of pairs(sq_b, sk_b)
        (QK^T and PV, 2 FLOPs per multiply-add; nheads counts query heads: GQA shares K/V
        memory, not GEMM work)
    backward FLOPs = 2.5 * forward FLOPs (five GEMMs instead of two, as perf/bench.py)
    TFLOP/s        = FLOPs / (ms * 1e-3) / 1e12

Against perf/bench.py's convention (4*b*h*sq*sk*d, halved when causal): identical when not
causal; for dense causal with sq == sk the exact count is s(s+1)/2 pairs, not s^2/2, i.e.
(1 + 1/s) times bench.py's (+0.05% at 2K, +0.012% at 8K), so the same time reads that much
higher here. Windows and varlen have no "halved" shortcut, hence the exact count for all.
Work a kernel spends on masked parts of tiles earns nothing; the two labelled cuDNN extras
below are charged the same visible pairs, so their TFLOP/s is useful throughput.

Implementations (`--impls`):
    cute_attn          cute_attn.mha / cute_attn.mha_varlen (default, non-deterministic bwd;
                       varlen's offsets checked on the first call, cached after)
    fa4                FlashAttention-4 (flash_attn.cute): flash_attn_func(causal=,
                       window_size=) with K/V of fewer heads for GQA; flash_attn_varlen_func
                       (cu_seqlens_q/k, max_seqlen_q/k) for varlen. Read from its
                       interface.py (flash-attn-4 4.0.0b36): nothing rejects GQA, window or
                       varlen on sm90, forward or backward (the backward runs GQA unpacked,
                       needs head_dim == head_dim_v and 2 MMA warpgroups: hdim 128 has them).
    sdpa_cudnn         torch SDPA under sdpa_kernel(SDPBackend.CUDNN_ATTENTION); GQA through
                       enable_gqa=True. No window argument: recorded unsupported for windows.
                       varlen: torch routes jagged nested tensors to cuDNN's ragged (cu_seqlens)
                       kernel only when TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1 (experimental;
                       this script sets it unless --no-cudnn-nested) and only without grad:
                       forward timed, backward recorded unsupported.
    sdpa_cudnn_padded  extra, NOT an anchor: the varlen batch padded to (16, max_len) dense,
                       cuDNN causal (right padding needs no mask under a causal mask: a real
                       query never sees a padded key); what varlen saves over padding.
    sdpa_cudnn_masked  extra, NOT an anchor: the window as an explicit additive mask over the
                       dense 16K x 16K problem; cuDNN then does the dense work.
The ratios cute_attn/fa4 and cute_attn/cudnn use only fa4 and sdpa_cudnn. An implementation
that does not import, does not support a case (the reason is recorded), or raises is
skipped; the run goes on.

Timing is perf/harness.py's, as for perf/bench.py: per case and pass, every implementation
runs once (compile), then `--rounds` interleaved rounds (order rotated per round, each a
triton do_bench median, warmup 25 ms, rep 100 ms); the record is the median of rounds.
Backward: `out` built once from leaves with requires_grad, then torch.autograd.grad(out,
leaves, dout, retain_graph=True) per iteration, dout random-normal laid out like out.

Outputs: a table per pass and perf/results/<device-slug>-features.json (one file, both passes,
every round, the cases with their lengths, skips with reasons, the ratios), plus a copy under
--out DIR. --quick: 1 round and three cases, after a correctness check of cute_attn (and,
for information, of each anchor) against cute_attn.reference.attention_ref /
attention_ref_varlen on a small version of each case: forward out, and dq/dk/dv when the
backward is timed; exits 1 if cute_attn is wrong. --quick writes files only with --out.

Run from the repo root on the GPU machine (after `source .devbundle/install.sh`):
    python3 perf/bench_features.py                # fwd + bwd, 5 cases, 3 rounds: ~2-3 min
    python3 perf/bench_features.py --quick --out $OUT
    python3 perf/bench_features.py --fwd --cases gqa,window

Everything above the "GPU side" line is pure and tested on the CPU by
tests/test_bench_features_cpu.py; importing this file needs no GPU, triton or cute_attn.
"""

import argparse
import contextlib
import functools
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # perf/, when loaded by path
import harness  # noqa: E402
from harness import log  # noqa: E402

IMPLS = ("cute_attn", "fa4", "sdpa_cudnn", "sdpa_cudnn_padded", "sdpa_cudnn_masked")
EXTRAS = {
    "sdpa_cudnn_padded": "cuDNN on the varlen batch padded to (ndocs, max_len), dense causal; "
                         "charged the real tokens' pairs only; not an anchor",
    "sdpa_cudnn_masked": "cuDNN with the window as an explicit additive mask (dense work); "
                         "charged the visible pairs only; not an anchor",
}
GROUPS = ("gqa", "window", "varlen")
ROUNDS = 3
QUICK_ROUNDS = 1
DTYPE_NAME = "bf16"

UNBOUNDED = -1  # a window side of -1 is unbounded (FlashAttention's convention)
NO_WINDOW = (UNBOUNDED, UNBOUNDED)

# varlen: 16 documents, log-uniform in [128, 8192], total 44000..56000 tokens (~50K).
VARLEN_DOCS = 16
VARLEN_MIN, VARLEN_MAX = 128, 8192
VARLEN_TOTAL = (44000, 56000)
VARLEN_SEED = 0

CUDNN_NESTED_ENV = "TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED"

RECORD_KEYS = (
    "impl", "pass", "case", "group", "dtype", "headdim", "nheads", "nheads_kv", "batch",
    "seqlen_q", "seqlen_k", "seqlens", "causal", "window", "tokens", "visible_pairs",
    "flops", "ms", "ms_rounds", "tflops", "anchor",
)


# ----------------------------------------------------------------------------------------
# Pure helpers (no GPU; tested on the CPU)
# ----------------------------------------------------------------------------------------

def effective_window(causal: bool, window_size: Sequence[int] = NO_WINDOW) -> tuple[int, int]:
    """(left, right) with -1 for an unbounded side; causal sets right = 0."""
    left, right = (int(x) for x in window_size)
    if left < UNBOUNDED or right < UNBOUNDED:
        raise ValueError(f"window sides must be >= -1, got {tuple(window_size)}")
    return left, (0 if causal else right)


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False,
                  window_size: Sequence[int] = NO_WINDOW) -> int:
    """Number of (query, key) pairs that may attend, bottom-right aligned (module docstring).

    Query i sees keys j in [i + shift - left, i + shift + right] intersected with [0, sk),
    shift = seqlen_k - seqlen_q; a query may see none (causal with sq > sk).
    """
    if seqlen_q < 0 or seqlen_k < 0:
        raise ValueError(f"sequence lengths must be >= 0, got {seqlen_q}, {seqlen_k}")
    return _visible_pairs(int(seqlen_q), int(seqlen_k), *effective_window(causal, window_size))


@functools.lru_cache(maxsize=4096)
def _visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    shift = seqlen_k - seqlen_q
    total = 0
    for i in range(seqlen_q):
        lo = 0 if left == UNBOUNDED else max(0, i + shift - left)
        hi = seqlen_k - 1 if right == UNBOUNDED else min(seqlen_k - 1, i + shift + right)
        total += max(0, hi - lo + 1)
    return total


def feature_flops(headdim: int, nheads: int, seqlens: Iterable[tuple[int, int]],
                  causal: bool = False, window_size: Sequence[int] = NO_WINDOW,
                  pass_name: str = "fwd") -> float:
    """4 * headdim * nheads * sum of visible_pairs over the (seqlen_q, seqlen_k) sequences;
    2.5x that for pass_name "bwd"."""
    harness.check_pass(pass_name)
    pairs = sum(visible_pairs(sq, sk, causal, window_size) for sq, sk in seqlens)
    flops = 4.0 * headdim * nheads * pairs
    return flops * harness.BWD_FLOP_FACTOR if pass_name == "bwd" else flops


def varlen_lengths(n_docs: int = VARLEN_DOCS, lo: int = VARLEN_MIN, hi: int = VARLEN_MAX,
                   seed: int = VARLEN_SEED, total_range: tuple[int, int] = VARLEN_TOTAL,
                   max_tries: int = 10000) -> list[int]:
    """n_docs lengths, log-uniform in [lo, hi], summing to within total_range (inclusive).

    Draw k (k = 0, 1, ...) uses random.Random(seed * 1_000_003 + k), Python's own generator
    (stable across versions and machines, no torch); the first draw whose total lands in
    total_range is returned, so the list is a pure function of the arguments.
    """
    if not (0 < lo <= hi) or n_docs <= 0:
        raise ValueError(f"need 0 < lo <= hi and n_docs > 0, got {lo}, {hi}, {n_docs}")
    t_lo, t_hi = total_range
    if t_lo > n_docs * hi or t_hi < n_docs * lo or t_lo > t_hi:
        raise ValueError(f"total_range {total_range} unreachable with {n_docs} docs in "
                         f"[{lo}, {hi}]")
    log_lo, log_hi = math.log(lo), math.log(hi)
    for k in range(max_tries):
        rng = random.Random(seed * 1_000_003 + k)
        lengths = [min(hi, max(lo, round(math.exp(rng.uniform(log_lo, log_hi)))))
                   for _ in range(n_docs)]
        if t_lo <= sum(lengths) <= t_hi:
            return lengths
    raise ValueError(f"no draw of {n_docs} lengths in [{lo}, {hi}] summed to {total_range} "
                     f"in {max_tries} tries")


def cu_seqlens(lengths: Sequence[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]: the cumulative offsets of a packed batch."""
    out = [0]
    for length in lengths:
        if length < 0:
            raise ValueError(f"lengths must be >= 0, got {length}")
        out.append(out[-1] + int(length))
    return out


@dataclass(frozen=True)
class Case:
    """One benchmark problem. Dense: `batch` sequences of `seqlen` (q and k alike);
    varlen: one packed batch of `seqlens` (q and k alike)."""
    name: str
    group: str  # one of GROUPS
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool
    window: tuple[int, int] = NO_WINDOW
    batch: int = 1
    seqlen: int = 0
    seqlens: tuple[int, ...] = field(default=())

    def __post_init__(self):
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {self.group!r}")
        if self.nheads <= 0 or self.nheads_kv <= 0 or self.nheads % self.nheads_kv:
            raise ValueError(f"nheads_kv must divide nheads, got {self.nheads}, "
                             f"{self.nheads_kv}")
        effective_window(self.causal, self.window)  # validates
        if self.varlen == (self.seqlen > 0):
            raise ValueError("give either seqlen (dense) or seqlens (varlen)")

    @property
    def varlen(self) -> bool:
        return bool(self.seqlens)

    @property
    def has_window(self) -> bool:
        """A window that is not plain causal / full attention."""
        left, right = effective_window(self.causal, self.window)
        return left != UNBOUNDED or right not in (UNBOUNDED, 0)

    @property
    def gqa(self) -> bool:
        return self.nheads != self.nheads_kv

    def sequences(self) -> list[tuple[int, int]]:
        """(seqlen_q, seqlen_k) of each sequence."""
        if self.varlen:
            return [(s, s) for s in self.seqlens]
        return [(self.seqlen, self.seqlen)] * self.batch

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens) if self.varlen else self.batch

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens) if self.varlen else self.seqlen

    @property
    def tokens(self) -> int:
        return sum(sq for sq, _ in self.sequences())

    def pairs(self) -> int:
        return sum(visible_pairs(sq, sk, self.causal, self.window)
                   for sq, sk in self.sequences())

    def flops(self, pass_name: str = "fwd") -> float:
        return feature_flops(self.headdim, self.nheads, self.sequences(), self.causal,
                             self.window, pass_name)

    def label(self) -> str:
        """Short shape description for the table."""
        heads = f"h{self.nheads}/{self.nheads_kv}" if self.gqa else f"h{self.nheads}"
        if self.varlen:
            shape = f"{len(self.seqlens)} docs, {self.tokens} tok"
        else:
            shape = f"{self.batch}x{self.seqlen}"
        mask = "causal" if self.causal else "full"
        if self.has_window:
            left, right = effective_window(self.causal, self.window)
            mask = f"win({left},{right})"
        return f"{shape} {heads} d{self.headdim} {mask}"

    def describe(self) -> dict:
        """JSON-friendly description (with the varlen lengths and the FLOP count)."""
        return {
            "name": self.name, "group": self.group, "nheads": self.nheads,
            "nheads_kv": self.nheads_kv, "headdim": self.headdim, "causal": self.causal,
            "window": list(self.window), "batch": self.num_seqs,
            "seqlen": self.seqlen if not self.varlen else None,
            "seqlens": list(self.seqlens) if self.varlen else None,
            "tokens": self.tokens, "visible_pairs": self.pairs(),
            "flops_fwd": self.flops("fwd"), "label": self.label(),
        }


def build_cases(quick: bool = False, groups: Sequence[str] = GROUPS) -> list[Case]:
    """The benchmark's cases, in run order (varlen last: its cuDNN path is experimental)."""
    d = 128
    cases = [
        Case("gqa-b2-s8192", "gqa", 32, 8, d, causal=True, batch=2, seqlen=8192),
        Case("gqa-b8-s2048", "gqa", 32, 8, d, causal=True, batch=8, seqlen=2048),
        Case("window-4096-0", "window", 16, 16, d, causal=True, window=(4096, 0), batch=1,
             seqlen=16384),
        Case("window-2048-2048", "window", 16, 16, d, causal=False, window=(2048, 2048),
             batch=1, seqlen=16384),
        Case("varlen-16docs", "varlen", 16, 16, d, causal=True,
             seqlens=tuple(varlen_lengths())),
    ]
    if quick:
        keep = {"gqa-b8-s2048", "window-4096-0", "varlen-16docs"}
        cases = [c for c in cases if c.name in keep]
    return [c for c in cases if c.group in groups]


def small_version(case: Case) -> Case:
    """A small problem with the same features, for the correctness check: odd lengths, the
    same GQA ratio, headdim, causality, and the window scaled down 32x."""
    group = case.nheads // case.nheads_kv
    nheads_kv = min(case.nheads_kv, 2)
    window = tuple(w if w <= 0 else max(1, w // 32) for w in case.window)
    common = dict(name=case.name + "-small", group=case.group, nheads=nheads_kv * group,
                  nheads_kv=nheads_kv, headdim=case.headdim, causal=case.causal,
                  window=window)
    if case.varlen:
        return Case(**common, seqlens=tuple(varlen_lengths(5, 17, 400, seed=1,
                                                           total_range=(300, 1500))))
    return Case(**common, batch=min(case.batch, 2), seqlen=600 if case.has_window else 333)


def applies(impl: str, case: Case) -> bool:
    """The extras belong to one kind of case each; the other impls are tried on every case."""
    if impl == "sdpa_cudnn_padded":
        return case.varlen and case.causal and not case.has_window
    if impl == "sdpa_cudnn_masked":
        return case.has_window and not case.varlen
    return True


def unsupported_reason(impl: str, case: Case, pass_name: str,
                       cudnn_nested: bool = True) -> str | None:
    """Why `impl` is not timed on this case and pass (None: it is tried). Known limits only;
    anything else is found out by running it (and a raise is recorded as a skip)."""
    if not applies(impl, case):
        return f"{impl} does not apply to a {case.group} case"
    if impl == "sdpa_cudnn":
        if case.has_window:
            return ("SDPA has no window argument; a window needs an explicit attn_mask, a "
                    "dense masked computation (timed separately as sdpa_cudnn_masked, not "
                    "an anchor)")
        if case.varlen:
            if not cudnn_nested:
                return (f"SDPA's cuDNN backend takes varlen only as jagged nested tensors, "
                        f"behind {CUDNN_NESTED_ENV}=1, which is off in this run "
                        f"(--no-cudnn-nested, or the variable set to something else)")
            if pass_name == "bwd":
                return ("SDPA's experimental cuDNN nested-tensor (varlen) path has no "
                        "backward (torch sdp_utils check_for_nested_inputs)")
    return None


def make_feature_record(impl: str, case: Case, pass_name: str, ms_rounds: Sequence[float],
                        dtype: str = DTYPE_NAME) -> dict:
    """One JSON record: the case's shape, the exact FLOP count, every round and TFLOP/s."""
    ms = harness.median_ms(ms_rounds)
    flops = case.flops(pass_name)
    return {
        "impl": impl, "pass": pass_name, "case": case.name, "group": case.group,
        "dtype": dtype, "headdim": case.headdim, "nheads": case.nheads,
        "nheads_kv": case.nheads_kv, "batch": case.num_seqs, "seqlen_q": case.max_seqlen,
        "seqlen_k": case.max_seqlen, "seqlens": list(case.seqlens) if case.varlen else None,
        "causal": case.causal, "window": list(case.window), "tokens": case.tokens,
        "visible_pairs": case.pairs(), "flops": flops, "ms": ms,
        "ms_rounds": [float(x) for x in ms_rounds], "tflops": harness.tflops(flops, ms),
        "anchor": impl in dict(harness.RATIO_ANCHORS),
    }


def _cell(records: Iterable[dict]) -> dict:
    return {(r["case"], r["pass"], r["impl"]): r["tflops"] for r in records}


def case_ratios(records: Sequence[dict], skipped: Sequence[dict] = ()) -> list[dict]:
    """Per (case, pass) with a cute_attn record: cute_attn/fa4 and cute_attn/cudnn TFLOP/s
    ratios (None when the anchor was not measured, with its skip reason when one exists)."""
    cell = _cell(records)
    reasons = {(s.get("case"), s.get("pass"), s["impl"]): s["reason"] for s in skipped}
    out = []
    seen = []
    for r in records:
        key = (r["case"], r["pass"])
        if r["impl"] != "cute_attn" or key in seen:
            continue
        seen.append(key)
        entry = {"case": r["case"], "pass": r["pass"]}
        for anchor, label in harness.RATIO_ANCHORS:
            value = harness.ratio(cell.get((*key, "cute_attn")), cell.get((*key, anchor)))
            entry[label] = value
            if value is None:
                entry[label + " why"] = reasons.get((*key, anchor), "not measured")
        out.append(entry)
    return out


def format_features_table(records: Sequence[dict], skipped: Sequence[dict],
                          cases: Sequence[Case], pass_name: str,
                          impls: Sequence[str]) -> str:
    """Rows: cases; columns: each impl's TFLOP/s ('n/a': not supported, '-': not measured),
    then cute_attn/fa4 and cute_attn/cudnn."""
    cell = _cell(records)
    unsupported = {(s.get("case"), s.get("pass"), s["impl"]) for s in skipped
                   if s.get("unsupported")}
    rows = []
    for case in cases:
        row = [case.name, case.label()]
        for impl in impls:
            key = (case.name, pass_name, impl)
            if not applies(impl, case):
                row.append("")
            else:
                value = cell.get(key)
                row.append("n/a" if value is None and key in unsupported
                           else harness.tflops_cell(value))
        rows.append(row + harness.ratio_cells(
            lambda impl, name=case.name: cell.get((name, pass_name, impl))))
    title = (f"{DTYPE_NAME} {pass_name}, TFLOP/s (exact visible-pair FLOPs"
             f"{', x2.5' if pass_name == 'bwd' else ''})")
    lines = [harness.text_table(title, ["case", "shape", *impls, *harness.RATIO_LABELS],
                                rows, left=2, empty="(no cases)")]
    notes = [f"  {name}: {text}" for name, text in EXTRAS.items() if name in impls]
    if notes:
        lines.append("n/a = not supported (reason in the JSON), - = not measured, blank = "
                     "does not apply; extras, not in the ratios:")
        lines += notes
    return "\n".join(lines)


def fa4_window(window_size: Sequence[int]) -> tuple[int | None, int | None]:
    """FA4 spells an unbounded side None, not -1."""
    left, right = (int(x) for x in window_size)
    return (None if left < 0 else left, None if right < 0 else right)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark of cute_attn's GQA, varlen and sliding-window attention, "
                    "forward and backward, against FA4 and cuDNN (SDPA) in one process.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--fwd", action="store_true", help="forward only")
    which.add_argument("--bwd", action="store_true",
                       help="backward only (torch.autograd.grad of out, as bench.py --bwd)")
    p.add_argument("--cases", type=functools.partial(harness.parse_names, choices=GROUPS),
                   default=list(GROUPS),
                   help=f"comma list of case groups from {','.join(GROUPS)} (default all)")
    harness.add_impls_and_rounds(p, IMPLS, rounds=ROUNDS, quick_rounds=QUICK_ROUNDS,
                                 per="case")
    p.add_argument("--quick", action="store_true",
                   help="correctness check vs attention_ref first (exit 1 if cute_attn is "
                        "wrong), then 1 round of 3 cases; files only with --out")
    p.add_argument("--no-cudnn-nested", dest="cudnn_nested", action="store_false",
                   help=f"do not set {CUDNN_NESTED_ENV}=1 (cuDNN's experimental varlen "
                        "path); cuDNN is then recorded unsupported on varlen")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the JSON here (with --quick: only here)")
    args = p.parse_args(argv)
    args.passes = ["fwd"] if args.fwd else ["bwd"] if args.bwd else list(harness.PASSES)
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else ROUNDS
    return args


# ----------------------------------------------------------------------------------------
# Tensor helpers (torch, any device; tested on the CPU)
# ----------------------------------------------------------------------------------------

def _pad_index(lengths: Sequence[int], max_len: int, device=None):
    import torch

    parts = [torch.arange(n, device=device) + b * max_len for b, n in enumerate(lengths)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def pad_packed(x, lengths: Sequence[int], max_len: int):
    """(total, h, d) packed -> (len(lengths), max_len, h, d), zeros in the padding."""
    index = _pad_index(lengths, max_len, x.device)
    flat = x.new_zeros(len(lengths) * max_len, *x.shape[1:])
    flat.index_copy_(0, index, x)
    return flat.view(len(lengths), max_len, *x.shape[1:])


def unpad(x, lengths: Sequence[int]):
    """(batch, max_len, h, d) -> (total, h, d): the inverse of pad_packed on real rows."""
    index = _pad_index(lengths, x.shape[1], x.device)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, index)


def window_bias(case: Case, dtype, device=None):
    """Additive (1, 1, s, s) mask of the case's window: 0 where visible, -inf elsewhere."""
    import torch

    from cute_attn.reference import visible_keys

    visible = visible_keys(case.seqlen, case.seqlen, causal=case.causal,
                           window_size=case.window, device=device)
    bias = torch.zeros(case.seqlen, case.seqlen, dtype=dtype, device=device)
    if visible is not None:
        bias.masked_fill_(~visible, float("-inf"))
    return bias[None, None]


@dataclass
class Inputs:
    """A case's shared tensors: q (b, s, h, d) or packed (total, h, d), k, v likewise with
    nheads_kv; cu (int32, on q's device) for varlen; dout like q."""
    q: object
    k: object
    v: object
    dout: object = None
    cu: object = None


@dataclass
class Bound:
    """One implementation bound to one case's inputs.

    fn() runs the forward and returns out; `leaves` are what the backward differentiates
    (the shared q, k, v, or this impl's own padded copies); dout_for(out, dout) lays the
    shared dout out like this impl's out; unpack maps an out- or leaf-shaped tensor back to
    the shared layout (identity except for the padded extra); `context` is entered around a
    whole measurement (the SDPA backend choice).
    """
    fn: Callable
    leaves: tuple
    dout_for: Callable = None
    unpack: Callable = None
    context: Callable = contextlib.nullcontext

    def __post_init__(self):
        if self.dout_for is None:
            self.dout_for = harness.dout_like
        if self.unpack is None:
            self.unpack = lambda t: t


def _sdpa_backend_context(backend_name: str = "CUDNN_ATTENTION"):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    return lambda: sdpa_kernel(backend)


def _sdpa(q, k, v, **kwargs):
    """SDPA on (b, s, h, d) tensors through (b, h, s, d) views; out back as (b, s, h, d)."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), **kwargs)
    return out.transpose(1, 2)


def bind_sdpa_cudnn(case: Case, inp: Inputs) -> Bound:
    """cuDNN via SDPA: dense (GQA through enable_gqa), or varlen as jagged nested tensors."""
    import torch

    ctx = _sdpa_backend_context()
    if not case.varlen:
        gqa = {"enable_gqa": True} if case.gqa else {}
        return Bound(lambda: _sdpa(inp.q, inp.k, inp.v, is_causal=case.causal, **gqa),
                     (inp.q, inp.k, inp.v), context=ctx)
    # Jagged (b, j, h, d) views of the packed tensors; min/max given so that no call syncs.
    offsets = torch.tensor(cu_seqlens(case.seqlens), dtype=torch.int64, device=inp.q.device)

    def nested(x):
        return torch.nested.nested_tensor_from_jagged(
            x, offsets, min_seqlen=min(case.seqlens), max_seqlen=max(case.seqlens))

    # Forward only (no backward on this path): built from detached tensors.
    qn, kn, vn = (nested(t.detach()) for t in (inp.q, inp.k, inp.v))
    # SDPA's is_causal is top-left aligned: the same as bottom-right since sq == sk per doc.
    return Bound(lambda: _sdpa(qn, kn, vn, is_causal=case.causal).values(),
                 (inp.q, inp.k, inp.v), context=ctx)


def bind_sdpa_cudnn_padded(case: Case, inp: Inputs) -> Bound:
    """Extra: the packed batch padded to (ndocs, max_len) and run dense causal. Right padding
    needs no mask under causal: real query i sees keys <= i, all real."""
    import torch

    lengths, max_len = case.seqlens, case.max_seqlen
    grad = inp.q.requires_grad
    with torch.no_grad():
        leaves = tuple(pad_packed(t.detach(), lengths, max_len).requires_grad_(grad)
                       for t in (inp.q, inp.k, inp.v))
    qp, kp, vp = leaves
    gqa = {"enable_gqa": True} if case.gqa else {}
    return Bound(
        lambda: _sdpa(qp, kp, vp, is_causal=True, **gqa), leaves,
        dout_for=lambda out, dout: harness.dout_like(out, pad_packed(dout, lengths, max_len)),
        unpack=lambda t: unpad(t, lengths), context=_sdpa_backend_context())


def bind_sdpa_cudnn_masked(case: Case, inp: Inputs) -> Bound:
    """Extra: the window as an additive mask over the dense problem."""
    bias = window_bias(case, inp.q.dtype, inp.q.device)
    gqa = {"enable_gqa": True} if case.gqa else {}
    return Bound(lambda: _sdpa(inp.q, inp.k, inp.v, attn_mask=bias, **gqa),
                 (inp.q, inp.k, inp.v), context=_sdpa_backend_context())


def bind_cute_attn(case: Case, inp: Inputs) -> Bound:
    import cute_attn

    kwargs = {"causal": case.causal}
    if tuple(case.window) != NO_WINDOW:
        kwargs["window_size"] = tuple(case.window)
    if case.varlen:
        # the default path: cu_seqlens are read on the host at the first call only (the
        # check is cached per tensor version; README's varlen note has its cost)
        m = case.max_seqlen
        return Bound(lambda: cute_attn.mha_varlen(inp.q, inp.k, inp.v, inp.cu, inp.cu, m, m,
                                                  **kwargs), (inp.q, inp.k, inp.v))
    return Bound(lambda: cute_attn.mha(inp.q, inp.k, inp.v, **kwargs), (inp.q, inp.k, inp.v))


def bind_fa4(case: Case, inp: Inputs) -> Bound:
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    kwargs = {"causal": case.causal}
    if tuple(case.window) != NO_WINDOW:
        kwargs["window_size"] = fa4_window(case.window)

    def first(out):  # 4.0.0b36 returns (out, lse)
        return out[0] if isinstance(out, tuple) else out

    if case.varlen:
        m = case.max_seqlen
        return Bound(lambda: first(flash_attn_varlen_func(
            inp.q, inp.k, inp.v, cu_seqlens_q=inp.cu, cu_seqlens_k=inp.cu, max_seqlen_q=m,
            max_seqlen_k=m, **kwargs)), (inp.q, inp.k, inp.v))
    return Bound(lambda: first(flash_attn_func(inp.q, inp.k, inp.v, **kwargs)),
                 (inp.q, inp.k, inp.v))


BINDERS = {
    "cute_attn": bind_cute_attn,
    "fa4": bind_fa4,
    "sdpa_cudnn": bind_sdpa_cudnn,
    "sdpa_cudnn_padded": bind_sdpa_cudnn_padded,
    "sdpa_cudnn_masked": bind_sdpa_cudnn_masked,
}


def make_inputs(case: Case, dtype, device, *, requires_grad: bool, seed: int = 0) -> Inputs:
    """Random-normal q, k, v (+ dout), and int32 cu_seqlens for varlen."""
    import torch

    lead = (case.tokens,) if case.varlen else (case.batch, case.seqlen)
    shape_q = (*lead, case.nheads, case.headdim)
    shape_kv = (*lead, case.nheads_kv, case.headdim)
    shapes = [shape_q, shape_kv, shape_kv] + ([shape_q] if requires_grad else [])
    q, k, v, *dout = harness.random_tensors(shapes, dtype, device, seed)
    q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
    dout = dout[0] if dout else None
    cu = (torch.tensor(cu_seqlens(case.seqlens), dtype=torch.int32, device=device)
          if case.varlen else None)
    return Inputs(q, k, v, dout, cu)


def reference_out(case: Case, q, k, v, *, upcast: bool):
    """cute_attn.reference on the case's features (packed varlen or dense)."""
    import torch

    from cute_attn.reference import attention_ref, attention_ref_varlen

    kwargs = {"causal": case.causal, "window_size": tuple(case.window), "upcast": upcast}
    if case.varlen:
        cu = torch.tensor(cu_seqlens(case.seqlens), dtype=torch.int32, device=q.device)
        return attention_ref_varlen(q, k, v, cu, cu, **kwargs)[0]
    return attention_ref(q, k, v, **kwargs)[0]


# ----------------------------------------------------------------------------------------
# GPU side
# ----------------------------------------------------------------------------------------

def _load_fa4() -> harness.Impl:
    from flash_attn.cute import flash_attn_varlen_func  # noqa: F401  (bind_fa4's varlen call)

    return harness.load_fa4()


# Only the versions and import times of what loads are used: the calls are BINDERS'.
LOADERS = {"cute_attn": harness.load_cute_attn, "fa4": _load_fa4}
LOADERS.update({name: functools.partial(harness.load_sdpa, name, "CUDNN_ATTENTION")
                for name in IMPLS if name.startswith("sdpa_cudnn")})


def load_backends(names: Sequence[str]) -> tuple[dict[str, harness.Impl], list[dict]]:
    """Import what each implementation needs; a failure is a skip (recorded), not a crash."""
    return harness.load_impls(names, LOADERS, blank_keys=("case", "pass"))


def make_timer(bound: Bound, pass_name: str, dout=None,
               name: str = "the implementation") -> Callable[[], float]:
    """harness.make_timer of a bound implementation: first call now, then a one-round timer;
    the backward times autograd.grad of an out built once with respect to bound.leaves."""
    return harness.make_timer(bound.fn, pass_name, context=bound.context,
                              leaves=bound.leaves, dout=dout, dout_for=bound.dout_for,
                              name=name)


def _is_unsupported(exc: BaseException) -> bool:
    """NotImplementedError / no grad_fn (harness.is_unsupported), or SDPA refusing the inputs
    under the forced backend ("No available kernel"; jagged: "No viable backend")."""
    text = str(exc)
    return (harness.is_unsupported(exc) or "No available kernel" in text
            or "No viable backend" in text)


def time_case(case: Case, impls: Sequence[str], pass_name: str, inputs: Inputs,
              skipped: list[dict], *, rounds: int,
              cudnn_nested: bool = True) -> tuple[dict[str, list[float]], bool]:
    """Bind and first-call every impl that applies and is not known to be unsupported, then
    `rounds` interleaved rounds (harness.time_interleaved). Returns ({impl: ms per round},
    cuda_still_healthy); skips go to `skipped`."""
    where = f"on {case.name} {pass_name}"

    def skip(name: str, why: str, unsupported: bool) -> None:
        harness.record_skip(skipped, {"impl": name, "case": case.name, "pass": pass_name,
                                      "reason": why}, where, unsupported)

    def first_call(name: str) -> Callable[[], float]:
        return make_timer(BINDERS[name](case, inputs), pass_name, inputs.dout, name)

    first_calls = {}
    for name in [n for n in impls if applies(n, case)]:
        why = unsupported_reason(name, case, pass_name, cudnn_nested)
        if why is not None:
            skip(name, why, unsupported=True)
            continue
        first_calls[name] = functools.partial(first_call, name)
    return harness.time_interleaved(
        first_calls, rounds, lambda name, exc: skip(name, harness.reason(exc),
                                                    _is_unsupported(exc)))


def run_cases(cases: Sequence[Case], impls: Sequence[str], passes: Sequence[str], dtype,
              device, skipped: list[dict], *, rounds: int,
              cudnn_nested: bool = True) -> tuple[list[dict], bool]:
    """Every case, then every pass of it (fresh inputs per pass); returns (records, healthy)."""
    records = []
    for index, case in enumerate(cases):
        for pass_name in passes:
            log(f"\n== {case.name} ({case.label()}), {pass_name}, {rounds} round(s) ==")
            inputs = make_inputs(case, dtype, device, requires_grad=pass_name == "bwd",
                                 seed=index)
            ms_rounds, healthy = time_case(case, impls, pass_name, inputs, skipped,
                                           rounds=rounds, cudnn_nested=cudnn_nested)
            parts = []
            for name in impls:
                if name in ms_rounds:
                    rec = make_feature_record(name, case, pass_name, ms_rounds[name])
                    records.append(rec)
                    parts.append(f"{name} {rec['tflops']:.0f} "
                                 f"(spread {harness.round_spread(rec['ms_rounds']):.0%})")
            log("  TFLOP/s: " + (", ".join(parts) or "nothing measured"))
            del inputs
            if not healthy:
                log("  CUDA context is broken; stopping here.")
                return records, False
    return records, True


def _grads_of(bound: Bound, dout):
    out = bound.fn()
    grads = harness.grads_of(out, bound.leaves, bound.dout_for(out, dout))
    return [bound.unpack(g) for g in grads]


def _reference_grads(case: Case, q, k, v, dout, *, upcast: bool):
    import torch

    leaves = [t.detach().float().requires_grad_() if upcast else t.detach().requires_grad_()
              for t in (q, k, v)]
    out = reference_out(case, *leaves, upcast=upcast)
    return torch.autograd.grad(out, leaves, dout.float() if upcast else dout)


def check_case(case: Case, impls: Sequence[str], passes: Sequence[str], dtype, device,
               cudnn_nested: bool = True) -> dict[str, str]:
    """Each impl vs the reference on `case` (meant for a small_version): forward out, and
    dq/dk/dv when "bwd" is in passes. Returns {impl: "ok" | "FAIL" | "n/a: why" |
    "raised: why"}; the pass rule is harness.check_error's."""
    with_grad = "bwd" in passes
    impls = [name for name in impls if applies(name, case)]
    inputs = make_inputs(case, dtype, device, requires_grad=with_grad, seed=7)
    q, k, v = (t.detach() for t in (inputs.q, inputs.k, inputs.v))
    ref = reference_out(case, q, k, v, upcast=True)
    ref_lp = reference_out(case, q, k, v, upcast=False)
    if with_grad:
        ref_g = _reference_grads(case, q, k, v, inputs.dout, upcast=True)
        lp_g = _reference_grads(case, q, k, v, inputs.dout, upcast=False)
    status = {}
    for name in impls:
        reason = unsupported_reason(name, case, "fwd", cudnn_nested)
        if reason is not None:
            status[name] = f"n/a: {reason}"
            continue
        try:
            bound = BINDERS[name](case, inputs)
            with bound.context():
                out = bound.unpack(bound.fn())
                checks = [("out", harness.check_error(out.detach(), ref, ref_lp))]
                if with_grad and unsupported_reason(name, case, "bwd", cudnn_nested) is None:
                    grads = _grads_of(bound, inputs.dout)
                    checks += [(w, harness.check_error(g, r, lp)) for w, g, r, lp in
                               zip(("dq", "dk", "dv"), grads, ref_g, lp_g)]
            harness.synchronize()
        except Exception as exc:  # noqa: BLE001
            status[name] = f"raised: {harness.reason(exc)}"
            detail = traceback.format_exc() if name == "cute_attn" else status[name]
            log(f"  {name:<17} {case.name}: RAISED\n{detail}")
            if not harness.cuda_is_healthy():
                status["cuda_broken"] = "yes"
                return status
            continue
        ok = all(c["ok"] for _, c in checks)
        status[name] = "ok" if ok else "FAIL"
        for what, c in checks:
            log(harness.check_line(f"{name:<17} {case.name} {what:<3}", c))
    return status


DEVICE = "cuda"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cudnn_nested:
        # Read once by torch at the first SDPA dispatch: set before anything runs.
        os.environ.setdefault(CUDNN_NESTED_ENV, "1")
    import torch

    device_name = harness.cuda_setup("perf/bench_features.py")
    dtype = torch.bfloat16
    cudnn_nested = args.cudnn_nested and os.environ.get(CUDNN_NESTED_ENV) == "1"
    info = harness.run_info()
    log(f"{harness.describe_run(device_name, info)} | passes {','.join(args.passes)}, "
        f"{args.rounds} round(s) | {CUDNN_NESTED_ENV}={os.environ.get(CUDNN_NESTED_ENV)}")

    backends, skipped = load_backends(args.impls)
    impls = [n for n in IMPLS if n in backends]
    cases = build_cases(args.quick, args.cases)
    failed, notes, checks = [], [], {}

    if args.quick:
        if "cute_attn" not in backends:
            log("\nFAILED: --quick needs cute_attn, which did not import (see above)")
            return 1
        log("\nCorrectness on small versions of each case, vs cute_attn.reference (pass if "
            "max err <= 2 * err(torch in bf16) + rounding floor); anchors for information")
        for case in cases:
            small = small_version(case)
            checks[small.name] = check_case(small, impls, args.passes, dtype, DEVICE,
                                            cudnn_nested)
            if checks[small.name].get("cuda_broken"):
                break
        bad = [c for c, s in checks.items() if s.get("cute_attn") != "ok"]
        for c, s in checks.items():
            for name, st in s.items():
                if name != "cute_attn" and st not in ("ok",) and not st.startswith("n/a"):
                    notes.append(f"anchor {name} on {c}: {st}")
        if bad:
            log(f"\nFAILED: cute_attn is wrong or raised on {bad}: "
                f"{[checks[c].get('cute_attn') for c in bad]}; not timing.")
            return 1
        log("correctness: cute_attn ok on every case")

    t0 = time.perf_counter()
    records, healthy = run_cases(cases, impls, args.passes, dtype, DEVICE, skipped,
                                 rounds=args.rounds, cudnn_nested=cudnn_nested)
    run_s = time.perf_counter() - t0
    log(f"\ntimed in {run_s:.0f} s")
    if not healthy:
        failed.append("CUDA context broke")
    for pass_name in args.passes:
        log("\n" + format_features_table(records, skipped, cases, pass_name, impls))

    results = harness.build_results(
        device_name, records, **info, impls=harness.impl_versions(backends), extras=EXTRAS,
        cases=[c.describe() for c in cases], ratios=case_ratios(records, skipped),
        skipped=skipped, checks=checks or None,
        method={
            "flops": "fwd = 4 * headdim * nheads * sum over sequences of visible (query, key) "
                     "pairs, bottom-right aligned, window (left, right), causal -> right = 0;"
                     f" bwd = {harness.BWD_FLOP_FACTOR} * fwd",
            "timing": harness.timing_method(args.rounds, "case and pass"),
            "bwd_timed": "torch.autograd.grad(out, leaves, dout, retain_graph=True), out "
                         "built once",
            "passes": args.passes, "rounds": args.rounds, "quick": args.quick,
            "run_s": run_s, "dtype": DTYPE_NAME, "cute_attn_deterministic": False,
            CUDNN_NESTED_ENV: os.environ.get(CUDNN_NESTED_ENV),
        },
    )
    slug = harness.device_slug(device_name)
    for directory in harness.output_dirs(args.out, args.quick):
        path = harness.write_json(results, harness.result_path(directory, slug, "features"))
        log(f"wrote {path}")
    return harness.finish(failed, skipped, args.impls, notes)


if __name__ == "__main__":
    sys.exit(main())
