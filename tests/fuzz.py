"""Seeded random attention problems for the fuzz test (tests/test_fuzz_gpu.py): what to
draw, how to name and reproduce a case, and how to split a run into shards. Pure Python
and torch: importable, and its inputs buildable, without a GPU (tests/test_fuzz_cpu.py).

Only what the API accepts is drawn (a case it would reject is never drawn, so nothing is
skipped): head dims and dtypes that both the forward and the backward support, nheads_kv
dividing nheads, sequences >= 1 (varlen: empty ones too, but never an empty batch),
strides and alignment that TMA takes.

The compile specialisation of a case (spec_key: dtype, head dim, mask kind, softcap,
varlen) is drawn stratified: every block of len(COMBOS) = 120 consecutive cases holds each
combination once, in a seeded order, so any run of N >= 120 covers all of them whatever
the seed; the rest of a case (shapes, heads, window, cap, scale, layout, ...) is drawn
independently. draw_cases(seed, n) is a prefix of draw_cases(seed, m) for n < m.
"""

import argparse
import itertools
import random
import zlib
from dataclasses import dataclass
from typing import Optional

from cute_attn.config import CAPABILITIES, DTYPES, AttnFeatures, pack_gqa_for

# A fixed seed, so that a plain run is reproducible (CI-style); --fuzz-seed changes it.
DEFAULT_SEED = 17
# Default --fuzz-n: what one process runs in about 2 minutes on an H100, compiles included.
# The draw is stratified, so the first 16 cases are 16 distinct spec_keys: at ~5 s to
# compile a forward + backward specialisation there, ~80 s (at the default seed none of the
# 16 needs a second forward, packed GQA, or backward, deterministic=True: ~2.5 s each);
# plus ~0.3 s of kernels, references and checks per case and ~10 s of start-up: ~95 s.
# tests/test_fuzz_cpu.py holds the default seed to this compile budget.
DEFAULT_N = 16

# Both families must take it: every case runs forward and backward.
HEAD_DIMS = tuple(d for d in CAPABILITIES["fwd"].head_dims if d in CAPABILITIES["bwd"].head_dims)
DTYPE_NAMES = tuple(n for n in CAPABILITIES["fwd"].dtypes if n in CAPABILITIES["bwd"].dtypes)
MASKS = ("none", "causal", "local")
COMBOS = tuple(itertools.product(DTYPE_NAMES, HEAD_DIMS, MASKS, (False, True), (False, True)))

# Lengths: 1, primes, a tile and its neighbours, a few more; small enough (<= 600) that the
# fp32 reference stays fast. A quarter of the draws take any length in [1, MAX_SEQLEN].
SEQLENS = (1, 2, 3, 7, 17, 61, 127, 128, 129, 257, 383, 500, 600)
MAX_SEQLEN = 600
# Window sides: 0, narrower than a tile, a tile and its neighbours, wider than any sequence.
WINDOW_SIDES = (0, 1, 3, 17, 63, 128, 129, 300, 1000)
SOFTCAPS = (5.0, 30.0)
SCALES = (0.03125, 0.25)  # besides the default 1/sqrt(d); powers of two repr exactly
# Storage of q, k, v and dout, all accepted by the API (16-byte aligned, strides multiples of
# 8 elements): "contig" packed (b, s, h, d) / (total, h, d); "bhsd" a .transpose view of
# packed (b, h, s, d) / (h, total, d); "slice" heads 1..h and the first d columns of a
# (..., h + 2, d + 8) tensor whose other elements are NaN (a read outside the view shows).
LAYOUTS = ("contig", "bhsd", "slice")


def mask_kind(causal, window):
    """"none", "causal" or "local": the kernel a call takes (as cute_attn.api decides it:
    causal sets right = 0, and a window (-1, 0) is causal)."""
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return "none"
    if left < 0 and right == 0:
        return "causal"
    return "local"


@dataclass(frozen=True)
class FuzzCase:
    """One drawn problem, everything needed to rebuild it (seed: its random inputs).
    Dense: batch, seqlen_q, seqlen_k; varlen: lens, ((len_q, len_k), ...) per sequence, and
    batch = seqlen_q = seqlen_k = 0."""

    dtype: str  # a config.DTYPES name
    head_dim: int
    nheads: int
    nheads_kv: int
    batch: int = 0
    seqlen_q: int = 0
    seqlen_k: int = 0
    lens: Optional[tuple] = None
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    softmax_scale: Optional[float] = None
    layout: str = "contig"
    deterministic: bool = False
    seed: int = 0

    @property
    def varlen(self):
        return self.lens is not None

    @property
    def mask(self):
        return mask_kind(self.causal, self.window_size)

    def spec(self):
        """The case as one line of key=value tokens (defaults left out); parse() reads it."""
        parts = [f"dtype={self.dtype}", f"d={self.head_dim}", f"h={self.nheads}",
                 f"hkv={self.nheads_kv}"]
        if self.varlen:
            parts.append("lens=" + ",".join(f"{lq}:{lk}" for lq, lk in self.lens))
        else:
            parts += [f"b={self.batch}", f"sq={self.seqlen_q}", f"sk={self.seqlen_k}"]
        if self.causal:
            parts.append("causal=1")
        if self.window_size != (-1, -1):
            parts.append("window={},{}".format(*self.window_size))
        if self.softcap:
            parts.append(f"softcap={self.softcap!r}")
        if self.softmax_scale is not None:
            parts.append(f"scale={self.softmax_scale!r}")
        parts.append(f"layout={self.layout}")
        if self.deterministic:
            parts.append("det=1")
        parts.append(f"seed={self.seed}")
        return " ".join(parts)

    def repro(self):
        """The command line that runs this case alone."""
        return f"pytest tests/test_fuzz_gpu.py --fuzz-case '{self.spec()}'"

    @classmethod
    def parse(cls, spec):
        """The case of a spec() line."""
        known = {"dtype", "d", "h", "hkv", "b", "sq", "sk", "lens", "causal", "window",
                 "softcap", "scale", "layout", "det", "seed"}
        items = dict(token.split("=", 1) for token in spec.split())
        unknown = set(items) - known
        if unknown:
            raise ValueError(f"unknown fuzz-case keys {sorted(unknown)}; known: {sorted(known)}")
        lens = None
        if "lens" in items:
            lens = tuple(tuple(int(n) for n in pair.split(":")) for pair in items["lens"].split(","))
        return cls(
            dtype=items["dtype"], head_dim=int(items["d"]), nheads=int(items["h"]),
            nheads_kv=int(items["hkv"]), batch=int(items.get("b", 0)),
            seqlen_q=int(items.get("sq", 0)), seqlen_k=int(items.get("sk", 0)), lens=lens,
            causal=items.get("causal") == "1",
            window_size=tuple(int(n) for n in items.get("window", "-1,-1").split(",")),
            softcap=float(items.get("softcap", 0.0)),
            softmax_scale=float(items["scale"]) if "scale" in items else None,
            layout=items.get("layout", "contig"), deterministic=items.get("det") == "1",
            seed=int(items.get("seed", 0)),
        )

    def test_id(self, index):
        """Readable pytest id: the specialisation, -det, and the case's index in the draw."""
        return f"{spec_key(self)}{'-det' if self.deterministic else ''}-{index}"

    def problem(self):
        """The case as the shared checker's Case (tests/gpu_checks.py)."""
        from gpu_checks import Case

        lens_q = lens_k = None
        if self.varlen:
            lens_q, lens_k = (tuple(x) for x in zip(*self.lens))
        return Case(dtype=DTYPES[self.dtype].input, d=self.head_dim, h=self.nheads,
                    h_kv=self.nheads_kv, causal=self.causal, window=self.window_size,
                    softcap=self.softcap, b=self.batch, sq=self.seqlen_q, sk=self.seqlen_k,
                    lens_q=lens_q, lens_k=lens_k, softmax_scale=self.softmax_scale,
                    deterministic=self.deterministic)


# ------------------------------------------------------------------ specialisations, shards

def spec_key(case):
    """The feature specialisation a case compiles: dtype, head dim, mask kind, softcap on/off,
    varlen. Its forward may come in packed-GQA variants and its backward in a
    deterministic one (compile_keys); those stay in their spec_key's shard."""
    return _key(case.dtype, case.head_dim, case.mask, case.softcap > 0, case.varlen)


def _key(dtype, head_dim, mask, softcap, varlen):
    return "-".join([dtype, f"d{head_dim}", mask] + ["cap"] * softcap + ["varlen"] * varlen)


def spec_hash(case):
    """A hash of spec_key stable across processes and runs (hash() of a str is salted)."""
    return zlib.crc32(spec_key(case).encode())


def compile_keys(case):
    """(forward, backward) kernels the case compiles, as strings: the forward's packed-GQA
    rows (config.pack_gqa_for, dense GQA with short seqlen_q) and deterministic=True (the
    backward only) are static too."""
    features = AttnFeatures(mask=case.mask, softcap=case.softcap > 0, varlen=case.varlen)
    group = case.nheads // case.nheads_kv
    pack = pack_gqa_for(case.head_dim, features, case.seqlen_q, group)
    key = spec_key(case)
    return f"{key}-pack{pack}", f"{key}-det{int(case.deterministic)}"


# Every spec_key, ordered by its stable hash: shard_index deals them out round-robin, so n
# shards get len(COMBOS) / n spec_keys each (hash % n alone gave 10 to 19 of the 120 keys
# per shard at n = 8), in an order unrelated to the features.
_RANK = {key: rank for rank, key in enumerate(
    sorted((_key(*combo) for combo in COMBOS), key=lambda key: zlib.crc32(key.encode())))}


def shard_index(case, n):
    """The shard (of n) that runs a case: its spec_key's turn in the deal above (a key
    outside COMBOS, which draw_cases never makes: its hash mod n)."""
    return _RANK.get(spec_key(case), spec_hash(case)) % n


def in_shard(case, i, n):
    return shard_index(case, n) == i


def shard(cases, i, n):
    """The cases of shard i of n: all the cases of the spec_keys dealt to it, so that each
    specialisation compiles in one shard (process) only."""
    return [c for c in cases if in_shard(c, i, n)]


def parse_shard(text):
    """'i/n' -> (i, n), 0 <= i < n (the --fuzz-shard option)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fuzz-shard takes i/n, got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--fuzz-shard i/n needs 0 <= i < n, got {text!r}")
    return i, n


# ---------------------------------------------------------------------------------- drawing

def draw_cases(seed, n):
    """n cases, a function of (seed, n) only; stratified over COMBOS (module docstring)."""
    rng = random.Random(seed)
    cases, block = [], []
    for _ in range(n):
        if not block:
            block = list(COMBOS)
            rng.shuffle(block)
        cases.append(_draw_case(rng, *block.pop()))
    return cases


def _seqlen(rng, empty=0.0):
    if rng.random() < empty:
        return 0
    return rng.choice(SEQLENS) if rng.random() < 0.75 else rng.randint(1, MAX_SEQLEN)


def _side(rng):
    return -1 if rng.random() < 0.25 else rng.choice(WINDOW_SIDES)


def _mask_args(rng, mask):
    """(causal, window_size) of that mask kind, in the spellings the API accepts."""
    if mask == "none":
        return False, (-1, -1)
    if mask == "causal":
        spelling = rng.randrange(3)
        if spelling == 0:
            return True, (-1, -1)
        if spelling == 1:
            return False, (-1, 0)  # a window shaped like causal
        return True, (-1, _side(rng))  # causal overrides the right side
    causal = rng.random() < 0.25  # causal with a left side: local with right = 0
    while True:
        window = (rng.choice(WINDOW_SIDES) if causal else _side(rng), _side(rng))
        if mask_kind(causal, window) == "local":
            return causal, window


def _draw_case(rng, dtype, head_dim, mask, softcap, varlen):
    nheads_kv = rng.choice((1, 1, 2, 3, 5))
    group = rng.choice([g for g in (1, 2, 4, 8) if nheads_kv * g <= 16])
    shape = {}
    if varlen:
        while True:
            lens = tuple((_seqlen(rng, empty=0.2), _seqlen(rng, empty=0.2))
                         for _ in range(rng.randint(1, 5)))
            if sum(lq for lq, _ in lens) and sum(lk for _, lk in lens):
                break
        shape["lens"] = lens
    else:
        seqlen_q = _seqlen(rng)
        seqlen_k = seqlen_q if rng.random() < 0.2 else _seqlen(rng)
        shape.update(batch=rng.choice((1, 1, 2, 3)), seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    causal, window = _mask_args(rng, mask)
    return FuzzCase(
        dtype=dtype, head_dim=head_dim, nheads=nheads_kv * group, nheads_kv=nheads_kv,
        causal=causal, window_size=window, softcap=rng.choice(SOFTCAPS) if softcap else 0.0,
        softmax_scale=None if rng.random() < 0.7 else rng.choice(SCALES),
        layout=rng.choice(LAYOUTS), deterministic=rng.random() < 0.15,
        seed=rng.randrange(2 ** 31), **shape,
    )


# ----------------------------------------------------------------------------------- inputs

def relayout(t, layout):
    """t's values stored as LAYOUTS says (a view; "contig" returns t)."""
    if layout == "contig":
        return t
    if layout == "bhsd":
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)
    if layout == "slice":
        *lead, h, d = t.shape
        view = t.new_full((*lead, h + 2, d + 8), float("nan"))[..., 1:1 + h, :d]
        view.copy_(t)
        return view
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def inputs(case, device="cuda"):
    """q, k, v, dout in the case's layout and (cu_seqlens_q, cu_seqlens_k) or None, from
    the case's seed (gpu_checks.make_inputs: with a softcap, scaled so that it bites)."""
    from gpu_checks import make_inputs

    q, k, v, dout, cu = make_inputs(case.problem(), seed=case.seed, device=device)
    return (*(relayout(t, case.layout) for t in (q, k, v, dout)), cu)

