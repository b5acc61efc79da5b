"""What a call compiles, and the policies every kernel family reads.

- `AttnFeatures`: what a call needs beyond dense softmax attention (mask kind, softcap,
  varlen), static; `RunArgs`: the run-time values that go with it (scale, window sides,
  offsets). The API builds both once; the launcher, the config heuristics and the
  kernels read those same objects (nothing downstream re-derives a `causal` flag).
- `DtypePolicy` / `DTYPES`: the element types of a specialisation (input, P, output,
  accumulator) and the alignment TMA needs, read by validation, the launcher and the
  kernels instead of lists of their own.
- `CAPABILITIES`: head dims and dtypes per kernel family, read by validation, the ptx
  command line and the API docs.
- `REGISTER_BUDGETS`: setmaxnreg budgets per warp role.
- Frozen tile configs (`FwdConfig`, `BwdConfig`) and the one heuristic per family that
  picks them (`fwd_config_for`, `bwd_config_for`).

A config is static: it is part of the compile-cache key, so everything in it selects a
different kernel, while sequence lengths, batch and heads stay dynamic.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

MASK_KINDS = ("none", "causal", "local")
# An unbounded side of a local window on the device: far beyond any sequence length, yet
# i + offset +- UNBOUNDED stays within an Int32 for sequences below 2^29.
UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class AttnFeatures:
    """What a call needs beyond dense softmax attention, as far as it changes the kernel
    code (each combination is one compiled specialisation). The values behind them (the
    window's sides, the softcap, the sequence offsets) are run-time arguments, and GQA
    needs no flag at all: the kernels read each head's KV head as head // (heads_q //
    heads_kv) from the tensor shapes."""

    mask: str = "none"  # "none" | "causal" | "local" (sliding window), see blocks/mask.py
    softcap: bool = False  # scores = softcap * tanh(scale * q k^T / softcap)
    varlen: bool = False  # packed sequences with cu_seqlens offsets, see blocks/seqlen.py
    # dense batch whose entries use only their first seqlens_k[b] keys (a KV cache's
    # filled length): an int32 (batch,) device tensor in the kernels' cu_seqlens_k slot
    kv_lengths: bool = False
    # programmable masks (masks.py): the mods' static parts (masks.ModSpec), compiled into
    # the kernel; their aux tensors and the block mask are run-time arguments. A mask mod
    # replaces the mask kind (which stays "none": causal is masks.causal())
    mask_mod: Optional[object] = None
    score_mod: Optional[object] = None
    # attention sinks (gpt-oss): a learnable per-head logit that joins every row's softmax
    # denominator (a float32 (heads,) run-time tensor); the mods' entry point carries it
    sink: bool = False
    # dropout on P (cute_attn/dropout.py: Philox keyed by a per-call seed); the mods' entry
    # points carry its seed and rate, forward and backward
    dropout: bool = False

    def __post_init__(self):
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask must be one of {MASK_KINDS}, got {self.mask!r}")
        if self.kv_lengths and self.varlen:
            raise ValueError("kv_lengths is for dense (batch, seqlen) caches, not packed varlen batches")
        if self.has_mods and (self.mask != "none" or self.softcap or self.kv_lengths):
            raise ValueError("mask/score mods take the place of the mask kind and the softcap (write them as "
                             "mods), and are not for KV caches")

    @property
    def has_mods(self) -> bool:
        return self.mask_mod is not None or self.score_mod is not None

    @property
    def mod_kernel(self) -> bool:
        """The kernels run the mods' entry points (kernels/fwd_sm90.FlashFwdSm90Mods,
        bwd_sm90.FlashBwdSm90Mods), which also carry the sink and dropout."""
        return self.has_mods or self.sink or self.dropout

    @property
    def causal_like(self) -> bool:
        """The mask bounds the right side (causal or a window): a query tile's work
        shrinks toward the start of the sequence, so tile order and tile shape care."""
        return self.mask != "none"

    @property
    def local(self) -> bool:
        return self.mask == "local"


# The two plain specialisations, shared so that the common call builds no object.
DENSE = AttnFeatures()
CAUSAL = AttnFeatures(mask="causal")

_interned: dict = {(f.mask, f.softcap, f.varlen, f.kv_lengths): f for f in (DENSE, CAUSAL)}


def attn_features(mask: str = "none", softcap: bool = False, varlen: bool = False,
                  kv_lengths: bool = False) -> AttnFeatures:
    """The one shared AttnFeatures of this combination (DENSE and CAUSAL for the plain
    ones): every entry point (api, ops, kvcache) asks here, so a call builds no object
    and the launcher's per-features lookups hash an object seen before."""
    if torch.compiler.is_compiling():
        # traced: dynamo would guard on the cache dict (its length changes when a new
        # combination is interned, which recompiled the caller); build the object instead
        return AttnFeatures(mask=mask, softcap=bool(softcap), varlen=bool(varlen), kv_lengths=bool(kv_lengths))
    key = (mask, bool(softcap), bool(varlen), bool(kv_lengths))
    features = _interned.get(key)
    if features is None:  # AttnFeatures rejects an unknown mask
        features = _interned[key] = AttnFeatures(mask=mask, softcap=key[1], varlen=key[2], kv_lengths=key[3])
    return features


class RunArgs(NamedTuple):
    """The run-time values of one call beyond its tensors (none of them is in a compile
    key, so a new value never recompiles)."""

    softmax_scale: float
    softcap: float = 0.0  # 0: off
    window: tuple = (UNBOUNDED, UNBOUNDED)  # (left, right) of a "local" mask
    cu_seqlens_q: Optional[torch.Tensor] = None  # varlen only
    cu_seqlens_k: Optional[torch.Tensor] = None  # varlen; with kv_lengths: keys per entry
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    page_table: Optional[torch.Tensor] = None  # paged KV (FwdConfig.page_size): (batch, max_pages) int32
    dropout_p: float = 0.0  # AttnFeatures.dropout: the drop probability
    dropout_seed: Optional[torch.Tensor] = None  # and its Philox key, int32 (2,) on the device


# ----------------------------------------------------------------------------------------
# Dtypes and capabilities
# ----------------------------------------------------------------------------------------

_DSL_TYPE_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}
FP8 = getattr(torch, "float8_e4m3fn", None)  # None in torch builds without FP8
if FP8 is not None:
    _DSL_TYPE_NAMES[FP8] = "Float8E4M3FN"


@dataclass(frozen=True)
class DtypePolicy:
    """The element types one specialisation computes with. Validation checks inputs
    against `input` and `align_bytes`; the launcher allocates `output`; the kernels build
    their MMAs from `input` (operands), `p` (the P operand of O += P V) and `accumulator`."""

    name: str  # its name in compile keys and on the command line
    input: torch.dtype  # q, k, v (and dout)
    p: torch.dtype  # P as the A operand of the PV WGMMA (and P^T, dS^T in the backward)
    output: torch.dtype  # out, dq, dk, dv
    accumulator: torch.dtype = torch.float32  # WGMMA accumulators, LSE, dQ_accum
    # TMA descriptors need every non-unit global stride, and the base address, to be a
    # multiple of 16 bytes
    align_bytes: int = 16
    # align_bytes in elements of `input`; derived (a field, not a property: validation
    # reads it on every call)
    align_elems: int = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "align_elems", self.align_bytes // self.input.itemsize)

    def dsl(self, which: str = "input"):
        """The CuTe DSL type of one of the fields above (imports the DSL)."""
        import cutlass

        return getattr(cutlass, _DSL_TYPE_NAMES[getattr(self, which)])


DTYPES = {
    p.name: p
    for p in (
        DtypePolicy("fp16", torch.float16, torch.float16, torch.float16),
        DtypePolicy("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16),
    )
}
# the per-call lookup: input dtype -> policy (16-bit inputs; FP8 below)
DTYPE_OF_INPUT = {p.input: p for p in DTYPES.values()}
# FP8 (e4m3) forward: q, k, v in e4m3 with float32 descales (cute_attn/fp8.py), P rounded
# to e4m3 for the PV WGMMA, fp32 accumulators; the output is 16-bit, so one policy per
# output dtype. Looked up by output dtype (FP8_POLICY_OF_OUTPUT), never by input.
if FP8 is not None:
    for _p in (DtypePolicy("e4m3", FP8, FP8, torch.bfloat16), DtypePolicy("e4m3_fp16", FP8, FP8, torch.float16)):
        DTYPES[_p.name] = _p
FP8_POLICY_OF_OUTPUT = {DTYPES[n].output: DTYPES[n] for n in ("e4m3", "e4m3_fp16") if n in DTYPES}


@dataclass(frozen=True)
class Capability:
    """What one kernel family accepts."""

    head_dims: tuple
    dtypes: tuple  # DTYPES names


CAPABILITIES = {
    "fwd": Capability(head_dims=(64, 96, 128, 192, 256), dtypes=("fp16", "bf16")),
    # FP8 WGMMA steps K by 32 keys for P V: the KV block (tile_n) must be a multiple of 32
    # (fp8_fwd_config_for); V arrives transposed (launcher.transpose_v_fp8)
    "fwd_fp8": Capability(head_dims=(64, 128, 256), dtypes=("e4m3", "e4m3_fp16")),
    # Each consumer warpgroup keeps a 64 x head_dim dK and dV accumulator in registers
    # (head_dim registers per thread for the two), which leaves room for the S, dP and dQ
    # tiles only up to head dim 128; beyond, see BwdConfig.split_d.
    "bwd": Capability(head_dims=(64, 96, 128, 192, 256), dtypes=("fp16", "bf16")),
}


# ----------------------------------------------------------------------------------------
# Register budgets
# ----------------------------------------------------------------------------------------

# Registers per thread after setmaxnreg, (producer warpgroup, each consumer warpgroup), by
# the number of consumer warpgroups: 128 * (producer + n * consumer) must stay within the
# SM's 64K registers, and setmaxnreg takes multiples of 8.
REGISTER_BUDGETS = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
# A paged forward whose KV blocks span several pages issues a TMA box per page from
# page-table words it shuffles across the producer warp: at 24 registers that spilled 20
# bytes (ptxas, head dim 128, page 16); 40 spill nothing, and its consumers need no more
# than 232 (decode: one query tile, no spill at 232 either).
PAGED_REGISTER_BUDGETS = {**REGISTER_BUDGETS, 2: (40, 232)}


class _WarpSpecialized:
    """Thread count and register budget of a kernel with one producer warpgroup and
    num_mma_warpgroups consumer warpgroups."""

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_mma_warpgroups + 1)

    @property
    def registers(self) -> tuple:
        """(producer, consumer) registers per thread after setmaxnreg."""
        return REGISTER_BUDGETS[self.num_mma_warpgroups]


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FwdConfig(_WarpSpecialized):
    tile_m: int  # query rows per CTA: 64 per consumer warpgroup (WGMMA's M)
    tile_n: int  # keys per mainloop step
    num_stages: int  # depth of the K and V shared-memory rings
    intra_wg_overlap: bool = True  # softmax of block j overlaps QK^T of block j+1, PV of j-1
    pingpong: bool = True  # consumer warpgroups take turns issuing WGMMAs (named barriers)
    # GQA with short seqlen_q: the pack_gqa query heads sharing a KV head fill one tile's
    # rows (row r = query r // pack_gqa of head r % pack_gqa), so the KV head is read once
    # per group instead of once per query head. 1: off. See choose_pack_gqa.
    pack_gqa: int = 1
    # Split-KV: num_splits CTAs (a run-time count) share one query tile, each walking a
    # slice of its KV blocks (blocks/block_range.py) and writing its normalised O in fp32
    # and its LSE to partial buffers that the tile's last split merges. For grids too small
    # for the GPU (decode, short prefill against long caches): launcher.choose_splits.
    split_kv: bool = False
    # Paged KV cache (with AttnFeatures.kv_lengths): K and V arrive as (num_pages,
    # page_size, heads_kv, head_dim) and entry b's key p lies in row p % page_size of page
    # page_table[b, p // page_size]. The producer loads a KV block as kv_box_rows-row TMA
    # boxes, each from the page the table names: one box per block when a page holds whole
    # blocks, tile_n / page_size boxes when a block spans pages. 0: contiguous.
    page_size: int = 0
    # The softmax's row sums as pairwise trees (blocks/softmax.OnlineSoftmax.step) instead
    # of the ordered reduction's chain of dependent adds, and the row max as an FMNMX tree
    # instead of the NaN-propagating reduction. Measured per head dim and mask
    # (_fwd_tile_config): ptxas hides the chain behind the exp2s in most kernels.
    tree_row_sums: bool = False
    # FP8 with intra_wg_overlap: two register buffers for P, so that block j's P is
    # converted to e4m3 while block j-1's PV WGMMA still reads the other one (the bulk of
    # unmasked blocks, taken in pairs); off: the conversion waits for that WGMMA.
    p_double_buffer: bool = False
    # A persistent grid of this many CTAs (the GPU's SM count: one CTA fills an SM), each
    # looping over work tiles (blocks/tile_scheduler.py), so that a tile's epilogue runs
    # while the next tile's K, V and Q load; 0: one tile per CTA. O gets a shared buffer
    # of its own (it no longer aliases Q, whose next tile may be landing). Dense 16-bit
    # batches only: no varlen, split-KV, paged cache or packed GQA.
    persistent_ctas: int = 0
    # Persistent: after its first tile (its CTA index), a CTA takes each next one from an
    # atomic counter in global memory, one at a time as it asks (tiles of unequal cost:
    # causal masks, mask mods), instead of the fixed round robin. The counter travels in
    # the cu_seqlens_q slot, which a dense batch does not read (launcher._tile_queue);
    # each launch leaves it zero.
    tile_queue: bool = False
    # Split-KV with 2..MAX_CLUSTER_SPLITS splits: a tile's splits launch as one
    # thread-block cluster and merge through distributed shared memory
    # (fwd_sm90.merge_in_cluster) instead of fp32 partials in global memory and a counter
    # (merge_if_last). cluster_splits_fit says when the partial tile fits the K/V rings.
    cluster_splits: bool = False
    # A mask mod's PARTIAL tiles (intra_wg_overlap): the mod evaluated into one bit per
    # score before the K wait and the WGMMA turn (blocks/mods.ModTile.visible_bits), the
    # bits applied after the QK^T wait; off: the mod evaluated after that wait, on the
    # softmax's path.
    mask_before_scores: bool = False
    # intra_wg_overlap: the wait on PV(j-1) pinned below softmax(j)'s exp2s (mma_sm90.
    # wait_all_groups_after), so the softmax runs under PV, instead of where ptxas puts it
    # (above them). Not with p_double_buffer (ptxas serialised the WGMMAs: registers).
    pv_wait_after_softmax: bool = False

    @property
    def kv_box_rows(self) -> int:
        """Rows of one K/V TMA box: the whole block, or one page of a block that spans
        several pages (fwd_sm90.FlashFwdSm90.load_kv_paged)."""
        return min(self.page_size, self.tile_n) if self.page_size else self.tile_n

    @property
    def num_mma_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def registers(self) -> tuple:
        if self.kv_box_rows < self.tile_n:
            return PAGED_REGISTER_BUDGETS[self.num_mma_warpgroups]
        return REGISTER_BUDGETS[self.num_mma_warpgroups]

    def __post_init__(self):
        if self.tile_m % 64 or not 1 <= self.tile_m // 64 <= 3:
            raise ValueError(f"tile_m must be 64, 128 or 192, got {self.tile_m}")
        if self.tile_n % 16:
            raise ValueError(f"tile_n must be a multiple of 16, got {self.tile_n}")
        if self.persistent_ctas < 0:
            raise ValueError(f"persistent_ctas must be >= 0, got {self.persistent_ctas}")
        if self.pv_wait_after_softmax and self.p_double_buffer:
            raise ValueError("pv_wait_after_softmax and p_double_buffer exclude each other")
        if self.pv_wait_after_softmax and not self.intra_wg_overlap:
            raise ValueError("pv_wait_after_softmax needs intra_wg_overlap (PV in flight beside the softmax)")
        if self.tile_queue and not self.persistent_ctas:
            raise ValueError("tile_queue needs a persistent grid (persistent_ctas > 0)")
        if self.persistent_ctas and self.split_kv:
            raise ValueError("a split-KV grid is sized per call: not persistent (split_config)")
        if self.page_size and (self.page_size % 8 or (self.page_size % self.tile_n and self.tile_n % self.page_size)):
            # a box of whole 8-row swizzle atoms, nested with the block: see paged_tile_n
            raise ValueError(f"page_size must be 0, or a multiple of 8 that divides tile_n ({self.tile_n}) "
                             f"or is a multiple of it, got {self.page_size}")


def fwd_config_for(head_dim: int, features: AttnFeatures, pack_gqa: int = 1, page_size: int = 0) -> FwdConfig:
    """The forward tile shape per head dim (FlashAttention-3's choices as a starting point;
    perf/NOTES.md records what was measured here), with pack_gqa rows per query and, for a
    paged KV cache, its page size (paged_tile_n)."""
    cfg = _fwd_tile_config(head_dim, features)
    if page_size:
        cfg = dataclasses.replace(cfg, tile_n=paged_tile_n(cfg.tile_n, page_size), page_size=page_size)
    return cfg if pack_gqa == 1 else dataclasses.replace(cfg, pack_gqa=pack_gqa)


@functools.lru_cache(maxsize=256)  # run_fwd_fp8 asks on every call
def fp8_fwd_config_for(head_dim: int, features: AttnFeatures, pack_gqa: int = 1) -> FwdConfig:
    """The FP8 forward's tiles. KV blocks are multiples of 32 keys (the FP8 WGMMA's K).
    Operands take half the bytes of 16-bit ones, so blocks can be longer than the 16-bit
    forward's, which spreads each block's fixed costs (row max, barriers, O rescale) over
    more keys; shared memory also holds the 16-bit output tile beside Q (fwd_sm90's
    epilogue). Measured on an H100, 16K tokens, TF/s with the V transpose included
    (perf/NOTES.md, session 9):
      head dim 128: 128 x 224 798 non-causal (128 x 128: 767, 192: 791, 256 spills: 755);
                    causal 128 x 128 748 (224: 722: the diagonal's masked blocks cost more);
                    since session 25 (the softmax under PV) 192 keys, unmasked and causal
      head dim 256: 128 x 128 1068 / 953 causal (64: 874 / 809, 96: 967 / 896)
      head dim 64:  192 x 160 576 non-causal, 192 x 128 527 causal (128 x 128: 456 / 444)"""
    if head_dim <= 64:
        # three consumer warpgroups have 160 registers: a window's two-sided mask with a
        # softcap spilled 36 bytes there (ptxas), two warpgroups do not
        if features.local:
            cfg = FwdConfig(tile_m=128, tile_n=128, num_stages=2)
        else:
            cfg = FwdConfig(tile_m=192, tile_n=128 if features.causal_like else 160, num_stages=2)
    elif head_dim <= 128:
        # 192 keys since the softmax runs under PV (pv_wait_after_softmax), H100 4K / 16K:
        # +2.2 / +1.6% over 224 unmasked, +2.2 / +0.8% over 128 causal (160: -2..-5%;
        # perf/NOTES.md, session 25). A window keeps 128 (not measured at 192)
        cfg = FwdConfig(tile_m=128, tile_n=128 if features.local else 192, num_stages=2)
        if features.mask == "none" and not (features.softcap or features.varlen or features.kv_lengths):
            # +4.4% and +4.8% in two H100 A/Bs at 16K (session 15); causal -4.4..-3.8%,
            # head dims 64 and 256 within +-1.5%: there the bulk has too few block pairs.
            # A persistent grid drops it (fp8_with_persistent_grid: it spilled there)
            cfg = dataclasses.replace(cfg, p_double_buffer=True)
    if head_dim <= 128:
        cfg = dataclasses.replace(cfg, pv_wait_after_softmax=fp8_late_pv_wait(head_dim, cfg.p_double_buffer))
    else:
        # a window with a softcap spilled 252 bytes at 128 keys per block (ptxas)
        cfg = FwdConfig(tile_m=128, tile_n=64 if features.local else 128, num_stages=2)
    return cfg if pack_gqa == 1 else dataclasses.replace(cfg, pack_gqa=pack_gqa)


# Shared memory one CTA may take on sm_90 (227 KB), and what a forward kernel takes
# besides its tiles (mbarriers, the split merge's row statistics, alignment padding)
SM90_SMEM_BYTES = 227 * 1024
FWD_SMEM_OVERHEAD = 2 * 1024


def fwd_smem_bytes(config: FwdConfig, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of a 16-bit forward with this config: Q, the K and V rings, and an O
    tile of its own when persistent (fwd_sm90: one tile per CTA writes O over Q)."""
    tiles = config.tile_m * head_dim + 2 * config.num_stages * config.tile_n * head_dim
    if config.persistent_ctas:
        tiles += config.tile_m * head_dim
    return tiles * itemsize + FWD_SMEM_OVERHEAD


# Head dims 65-128 without a mask: from this many keys on, one tile per CTA beats the
# persistent grid (with_persistent_grid; perf/NOTES.md, session 26).
ONE_TILE_PER_CTA_FROM_KEYS = 4096


def long_unmasked_tiles(head_dim: int, features: AttnFeatures, seqlen_k: Optional[int]) -> bool:
    """Whether with_persistent_grid keeps one tile per CTA for this key length: an H100
    A/B (perf/ab_fwd_configs.py --base mha --variants p0, 7 rounds) of one tile per CTA
    against the persistent grid at head dim 128 without a mask gave 0.963 / 1.007 / 1.018
    at 1K / 4K / 16K keys (session 17, the other way round: 1.038 / 0.986 / 0.989). The
    persistent kernel re-derives its WGMMA descriptors every step (a 467-instruction step
    against the one-tile kernel's 438, perf/sass_events.py), which a long tile pays on
    every block and a short one repays through the epilogue overlap.
    None (unknown length): False."""
    return (seqlen_k is not None and seqlen_k >= ONE_TILE_PER_CTA_FROM_KEYS and 64 < head_dim <= 128
            and features.mask == "none" and not features.mod_kernel)


@functools.lru_cache(maxsize=256)  # run_fwd_mods asks on every call
def with_persistent_grid(config: FwdConfig, head_dim: int, features: AttnFeatures,
                         num_sms: Optional[int], seqlen_k: Optional[int] = None) -> FwdConfig:
    """The 16-bit forward's config with a persistent grid of num_sms CTAs where that
    measured faster at short sequences and level at long ones, else unchanged (None:
    no GPU to size it, the CPU compiles). seqlen_k: the call's key length, None where
    unknown (long_unmasked_tiles: head dims 65-128 without a mask from 4K keys on keep one
    tile per CTA).

    Measured on an H100 (perf/NOTES.md, session 17; perf/ab_fwd_configs.py, 5 rounds,
    16K tokens, the default timed twice for the noise, which was within 1.6%),
    persistent / one tile per CTA at 1K / 4K / 16K keys:
      no mask, round robin: head dim 64 1.070 / 1.006 / 1.011, 128 1.038 / 0.986 / 0.989
      causal, tile queue:   head dim 64 1.095 / 1.017 / 0.996, 128 1.076 / 1.022 / 1.007
      (causal by round robin: 0.63-0.95, its CTAs drew unequal work)
      mask mods, tile queue (perf/ab_mods_configs.py): BD3LM L 1K 1.040-1.072, L 4K
      0.985-1.011; 16 documents in 16K 1.014
    Short tiles gain: a tile's epilogue overlaps the next one's first loads; long ones
    are level. So unmasked, causal and mask/score-mod dense batches take it (no window,
    varlen, KV cache, sink or dropout, packed GQA or split-KV: not measured, or their
    kernels pass other tensors in the queue's slot), where O's own tile fits in shared
    memory beside Q and the K/V rings (head dims up to 128)."""
    # (a sink or dropout, alone or beside mods, ran no GPU test on a persistent grid)
    mods = (features.mask_mod is not None or features.score_mod is not None) and not (features.sink or features.dropout)
    eligible = (num_sms and (features.mask in ("none", "causal") and not features.mod_kernel or mods)
                and not features.varlen and not features.kv_lengths and config.pack_gqa == 1
                and not config.split_kv and config.page_size == 0 and head_dim <= 128)
    if not eligible or long_unmasked_tiles(head_dim, features, seqlen_k):
        return config
    persistent = dataclasses.replace(config, persistent_ctas=num_sms, tile_queue=features.mask == "causal" or mods)
    return persistent if fwd_smem_bytes(persistent, head_dim) <= SM90_SMEM_BYTES else config


def fp8_late_pv_wait(head_dim: int, p_double_buffer: bool) -> bool:
    """FwdConfig.pv_wait_after_softmax for the FP8 forward. Measured on an H100 (perf/NOTES.md,
    session 25; perf/ab_fp8_configs.py 5 128,256,64 pvlate), 16K / 4K tokens: head dim 128
    +4.5 / +4.4%, causal +1.9 / +0.9%; head dim 64 +3.0 / +3.0%, causal level; head dim 256
    level (the 16-bit forward lost 1-3% with it). Not with two P buffers: ptxas ran out of
    registers for both and serialised the WGMMAs (C7512)."""
    return head_dim <= 128 and not p_double_buffer


@functools.lru_cache(maxsize=256)  # run_fwd_fp8 asks on every call
def fp8_with_persistent_grid(config: FwdConfig, head_dim: int, features: AttnFeatures,
                             num_sms: Optional[int]) -> FwdConfig:
    """The FP8 forward's config (fp8_fwd_config_for) with a persistent grid of num_sms CTAs
    where that measured faster, else unchanged (None: no GPU to size it).

    Measured on an H100 (perf/NOTES.md, session 24; perf/ab_fp8_configs.py 5 ... persist,
    16K tokens), persistent / one tile per CTA at 4K / 16K keys:
      head dim 128: 1.014 / 0.997 no mask, 1.046 / 1.010 causal (tile queue)
      head dim 256: 1.049 / 1.002 no mask, 1.033 / 1.018 causal
      head dim 64:  1.001 / 0.946 no mask, 0.994 / 0.941 causal
    A tile's epilogue (its 16-bit O through shared memory) overlaps the next tile's first
    loads, which matters where the tiles are short. Head dim 64's three consumer warpgroups
    lose. The double-buffered P is dropped at hd 128: with the persistent loop's state it
    spilled 268 bytes (ptxas), so no mask at hd 128 compares one P buffer persistent
    against two without. Dense unmasked and causal batches only (no window, varlen, sink,
    softcap or packed GQA: not measured; a softcap also spilled 4 bytes at hd 128 x 224)."""
    eligible = (num_sms and features.mask in ("none", "causal") and not features.varlen
                and not features.sink and not features.softcap and config.pack_gqa == 1 and head_dim >= 128)
    if not eligible:
        return config
    return dataclasses.replace(config, persistent_ctas=num_sms, tile_queue=features.mask == "causal",
                               p_double_buffer=False, pv_wait_after_softmax=fp8_late_pv_wait(head_dim, False))


# The portable cluster size limit on sm_90 (16 needs a non-portable opt-in)
MAX_CLUSTER_SPLITS = 8


def cluster_splits_fit(config: FwdConfig, head_dim: int, elem_bytes: int = 2) -> bool:
    """Whether a split tile's fp32 O fits the K and V rings' shared memory, which it takes
    once the mainloop is done (FwdConfig.cluster_splits): the rings must also be one
    contiguous buffer, i.e. K's ring a whole number of V's 1024-byte alignment units."""
    k_bytes = config.tile_n * head_dim * config.num_stages * elem_bytes
    return k_bytes % 1024 == 0 and config.tile_m * head_dim * 4 <= 2 * k_bytes


def cluster_merge_rows_fit(config: FwdConfig, packed_rows: int, head_dim: int) -> bool:
    """Whether a cluster merge of config's tile gives each merging thread at most one
    (row, 16-byte chunk) item: with more, split 0 walks its items one distributed-shared-
    memory round trip after the other (8 queries x 64/8 heads: do_bench 0.942x, graph
    1.014x; perf/NOTES.md session 22). Decode's few packed rows fit."""
    return packed_rows * head_dim // 4 <= 128 * config.num_mma_warpgroups


def split_config(config: FwdConfig) -> FwdConfig:
    """The split-KV forward of a config (launcher._split_kernel, warmup): a split grid
    is sized to fill the GPU already, so it is never persistent."""
    return dataclasses.replace(config, split_kv=True, persistent_ctas=0, tile_queue=False)


def paged_tile_n(tile_n: int, page_size: int) -> int:
    """The KV block of a paged cache: the head dim's own when pages and blocks nest (one
    divides the other: a block is whole boxes of one page each), else 64, which nests with
    every page size of kvcache_checks.PAGE_SIZES (head dims 192 and 256, blocks of 96 and
    80 keys: 64-key blocks cost their mainloops more barrier steps per key, but decode is
    bound by memory, not by the mainloop)."""
    if page_size % tile_n == 0 or tile_n % page_size == 0:
        return tile_n
    return 64


def unsplit_decode_config(config: FwdConfig, head_dim: int, packed_rows: int) -> FwdConfig:
    """The config an unsplit launch of config runs: a packed-GQA decode tile whose rows
    (seqlen_q x group) fit one consumer warpgroup takes 64-row tiles, half the WGMMA rows
    for the same keys. Measured on an H200 (perf/NOTES.md, session 20; 64/8 heads, head
    dim 128, one query, contiguous cache, no split; scratch A/B of tile configs, then the
    committed change against its parent through mha_with_kvcache): batch 128 x 2K keys
    259.8 vs 275.4 us and 255.4 vs 266.3; 8K 976 vs 1028 and 958.6 vs 993.3. Split tiles
    keep 128 rows (64 lost 2-6% at batch 1: a split's time is not its MMA work), and so
    do paged caches and other head dims (not measured)."""
    # pack_gqa > 1 only where a call packs GQA (never varlen, mods, a sink or dropout:
    # pack_gqa_for); the tile is the measured one as a whole (128 keys, 2 stages, no tree
    # row sums), not the default with fewer rows
    if (config.pack_gqa > 1 and config.tile_m == 128 and packed_rows <= 64 and head_dim == 128
            and config.page_size == 0 and not config.split_kv):
        return FwdConfig(tile_m=64, tile_n=128, num_stages=2, pack_gqa=config.pack_gqa)
    return config


def split_decode_config(config: FwdConfig, head_dim: int, packed_rows: int, in_cluster: bool) -> FwdConfig:
    """The tile a split decode launch of config runs (one query tile of packed_rows rows;
    in_cluster: its splits would merge in a cluster, launcher._cluster_merge).

    Head dims <= 64, at most 64 rows: 64 rows and four stages of 128 keys instead of the
    dense default's 192 rows and two. A memory-bound CTA draws bandwidth by the bytes it
    has in flight: two stages of 128 keys at head dim 64 are 64 KB, four are 128 KB (head
    dim 128's two), and 64 rows leave the shared memory for them. Measured on an H100
    (perf/NOTES.md, session 23; CUDA graphs, 64/8 heads, one query, causal, forced splits,
    default tile -> this one): batch 1 x 32K keys 52.0 -> 30.7 us (8 splits), 8K 18.4 ->
    12.1 (8), 128K 182.4 -> 98.6 (16); batch 2 x 32K 99.4 -> 57.9 (16). Six stages
    measured the same as four.

    Head dim 128 with rows that one warpgroup merges (rows x 32 16-byte chunks <= 128
    threads: 32/8 heads, one query) whose splits merge in a cluster: 64 rows and three
    stages. Measured the same way (32/8 heads, automatic splits, all cluster merges):
    batch 1 x 2K 12.0 -> 9.2 us, 8K 20.8 -> 17.5, 16K 32.2 -> 29.4; with the global merge
    (32K keys, 8 splits of 2 MB) it lost, 53.6 -> 60.5 (not understood), so it stays
    with the cluster."""
    if packed_rows > 64 or config.tile_n != 128 or config.split_kv:
        return config
    if head_dim <= 64:
        stages = 4
    elif head_dim == 128 and in_cluster:
        stages = 3
    else:
        return config
    tile = FwdConfig(tile_m=64, tile_n=128, num_stages=stages, pack_gqa=config.pack_gqa, page_size=config.page_size)
    # head dim 128's tile only where it keeps the cluster merge
    return tile if head_dim <= 64 or cluster_merge_rows_fit(tile, packed_rows, head_dim) else config


def mod_fwd_config_for(head_dim: int) -> FwdConfig:
    """The forward's tiles with mask/score mods (the block mask is built at these): two
    consumer warpgroups at every head dim, so a mod's per-element work has the 240-register
    budget (three warpgroups get 160), and the head dim's KV block of _fwd_tile_config."""
    tile_n = 128 if head_dim <= 128 else 96 if head_dim <= 192 else 80
    return FwdConfig(tile_m=128, tile_n=tile_n, num_stages=2)


def _fwd_tile_config(head_dim: int, features: AttnFeatures) -> FwdConfig:
    # a sink alone keeps the dense tiles: it only adds a term to each row's sum at the end
    # (head dim 64 causal: 128-row tiles cost the sink 9% over the dense kernel's 192, H100)
    if features.has_mods:
        # a mask mod reading per-token aux tensors (documents) evaluated before the scores:
        # documents 16 in 16K causal hd 128 1.042x / 1.049x in two H100 runs; BD3LM (index
        # arithmetic only) 0.98-1.02x, prefix-LM 0.98x, so the others keep it off
        # (perf/NOTES.md, session 22)
        early = features.mask_mod is not None and features.mask_mod.token_aux
        return dataclasses.replace(mod_fwd_config_for(head_dim), mask_before_scores=early)
    if head_dim <= 64:
        if features.local:
            # three consumer warpgroups have 160 registers each: the window's two-sided
            # mask and its third loop spilled 272 bytes there (ptxas); two do not spill.
            # (Dropout at 4 elements per Philox call spilled 60 bytes there; at 16, none.)
            cfg = FwdConfig(tile_m=128, tile_n=128, num_stages=2)
        else:
            cfg = FwdConfig(tile_m=192, tile_n=128, num_stages=2)
    elif head_dim <= 128:
        # Ping-pong for every mask. Causal without it once measured equal or better on an
        # H200 (8K: 647/601 vs 572/583 TF/s); with the window-aware mainloop on an H100 it
        # lost 13-16% (causal 4K: 484 vs 558, 8K: 501 vs 582; GQA 32/8 at 8K: 542 vs 611,
        # same process as FA4 at 581 / 609 / 617). perf/NOTES.md has the A/B.
        # Tree row sums: +2.6 / +3.0 / +5.7% at 16K without a mask in three H100 runs,
        # -0.5..+1.3% causal; hd 64 lost 1-4% with them, hd 256 and FP8 moved +-2%
        # (perf/NOTES.md, session 13). Their FMNMX row max (session 26): without a mask
        # +1.3 / +2.3% more (4K / 16K), causal -3.8 / -3.0%, hence unmasked only.
        cfg = FwdConfig(tile_m=128, tile_n=128, num_stages=2, tree_row_sums=features.mask == "none")
    elif head_dim <= 192:
        cfg = FwdConfig(tile_m=128, tile_n=96, num_stages=2)
    else:
        cfg = FwdConfig(tile_m=128, tile_n=80, num_stages=2)
    return cfg


def pack_gqa_for(head_dim: int, features: AttnFeatures, seqlen_q: int, group: int) -> int:
    """The pack_gqa of a call with this query length and GQA group (see choose_pack_gqa)."""
    if group == 1 or features.varlen or features.mod_kernel:  # one query head per tile
        return 1
    return choose_pack_gqa(seqlen_q, group, fwd_config_for(head_dim, features).tile_m, False)


def choose_pack_gqa(seqlen_q: int, group: int, tile_m: int, varlen: bool) -> int:
    """Pack a GQA group into the tile rows when that saves at least a quarter of the tiles,
    hence of the KV reads (each tile walks its KV head once): seqlen_q short against tile_m
    (decode, chunked prefill), where per-head tiles are mostly padding. Long sequences fill
    their tiles either way and stay unpacked. Not for varlen (its rows are offset per
    sequence), nor when the group does not divide tile_m."""
    if varlen or group <= 1 or tile_m % group:
        return 1
    per_head_tiles = -(-seqlen_q // tile_m)
    packed_tiles = -(-(seqlen_q * group) // tile_m)
    return group if 4 * packed_tiles <= 3 * group * per_head_tiles else 1


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------


DQ_ORDERS = ("after_dkv", "after_dv", "before_dk")  # BwdConfig.dq_order


@dataclass(frozen=True)
class BwdConfig(_WarpSpecialized):
    """Tile shape of the Hopper backward (kernels/bwd_sm90.py). A CTA owns tile_n keys (64
    per consumer warpgroup, which holds their dK and dV accumulators in registers for the
    whole kernel) and walks query blocks of tile_m rows through num_stages-deep Q and dO
    rings."""

    tile_m: int = 64  # query rows per mainloop step (the N of S^T = K Q^T)
    tile_n: int = 128  # keys per CTA: 64 per consumer warpgroup
    num_stages: int = 2  # depth of the Q (+LSE) and dO (+D) rings
    # consumer warpgroups that compute dQ = dS K: all of them, each owning a slice of
    # head_dim, or 1 when head_dim / 2 would not fall on the K tile's swizzle atoms
    dq_warpgroups: int = 2
    # Head dims 192 and 256, whose dK/dV accumulators over the whole head dim do not fit a
    # warpgroup's registers next to S^T and dP^T (FA4's Hopper choice there, in this
    # kernel's transposed orientation): tile_n = 64 keys, two consumer warpgroups that
    # split S^T and dP^T by queries (64 keys x tile_m / 2 each) and dK, dV and dQ by head
    # dim (d / 2 columns each), so P^T and dS^T pass through shared memory and dV, dK are
    # SS WGMMAs. Q, dO, K, V use swizzle atoms of d / 2 columns so each half is whole
    # atoms. Measured 1.26-1.73x the split it replaced (head_dim / 64 CTAs per KV block,
    # each recomputing S and dP) at 4K/16K (perf/NOTES.md, session 15).
    split_d: bool = False
    # dQ leaves each step as vector atomics (red.global.add.v2.f32) from the consumers'
    # accumulators into dQ_accum (blocks/dq_accum.add_from_registers) instead of through
    # an fp32 sdQ tile and the dQ writer warp's bulk reduce-add (FlashAttention-3's choice
    # at head dim 256). It frees tile_m * head_dim * 4 bytes of shared memory (64 KB at
    # 256: room for a second Q/dO stage) and the DQ_FULL / DQ_EMPTY hand-off. Atomics land
    # in no fixed order, so the deterministic backward never takes it (bwd_config_for).
    dq_atomic: bool = False
    # sdS buffers (1 or 2, the second indexed like Q's ring: num_stages 2). With one, a
    # step waits at DQ_EMPTY before writing dS^T (the previous step's dQ WGMMAs may still
    # read it); with two, the buffer a step writes was last read two steps back, which
    # the DS_READY barrier of the step between already ordered, so the step meets the
    # dQ writer only before its sdQ stores (FlashAttention-4's Hopper choice; +16 KB at
    # head dim 128, +32 KB at 64). bwd_config_for says where it is taken.
    ds_stages: int = 1
    # The wait on dP^T pinned below the exp2s of P^T (mma_sm90.wait_all_groups_after, on
    # P^T's bf16 words converted before it), so they run under the dP^T WGMMA; ptxas
    # otherwise puts it among them. Without dropout or a score derivative (their paths
    # wait for dP^T first). Off: slower on an H100 at hd 128 16K, -3.5% / -5.2% causal
    # (perf/NOTES.md, session 25); kept as a knob for the other head dims and tiles.
    dp_wait_after_exp2: bool = False
    # With two sdS buffers: each consumer warpgroup hands its half of sdQ to the dQ writer
    # on a barrier pair of its own (its 128 threads and the writer's 32), and the writer
    # reduce-adds the halves one after the other, so the warpgroups no longer meet the
    # writer together at every step's end (FlashAttention-4's Hopper hand-off). Not with
    # the deterministic backward (its turn counters order whole chunks).
    dq_handoff_per_wg: bool = False
    # dQ computed transposed, dQ^T = K^T dS^T (M = head_dim, 64 rows per dQ warpgroup;
    # N = tile_m; K = the tile's keys), so tile_m need not be a multiple of 64: 80 queries
    # per step make S^T, dP^T and dQ^T m64n80 WGMMAs (FlashAttention-4's Hopper choice at
    # head dim 128 without a mask). sdS then holds dS (queries x keys, keys contiguous: a
    # K-major B operand), written from the S^T-shaped registers by stmatrix .trans; dQ_accum
    # keeps the dQ^T accumulator's fragment order (blocks/dq_accum.py). No mask or causal
    # only (FlashBwdSm90 refuses a window, softcap and the mods' kernel: mods, dropout, a
    # sink in the features; a sink's backward still takes it, run_bwd dropping the sink),
    # head dims a multiple of 64 per dQ warpgroup. bwd_config_for takes it at head dim 128
    # (swapped_dq_bwd_config; measured, perf/NOTES.md session 29).
    dq_swapped: bool = False
    # With dq_swapped: where dQ^T's WGMMA goes among dV's and dK's (both issued after the
    # step's dS^T; perf/NOTES.md sessions 28-29: "before_dk" measured fastest). P^T (dV's A), dS^T (dK's A),
    # dV, dK and dQ^T's accumulator cannot all be held at once without spilling.
    #   "after_dkv"  dV, dK; wait for both; dQ^T; wait; dQ^T to sdQ (nothing overlaps the
    #                dQ^T store)
    #   "after_dv"   dV, dK; wait for dV; dQ^T (issued under dK); wait; dQ^T to sdQ
    #   "before_dk"  dV; wait for dV; dQ^T; dK; wait for dQ^T; dQ^T to sdQ under dK
    # (FlashAttention-4's Hopper order, dQ^T issued before dV's wait with P^T still held,
    # made ptxas 13.0 serialise every WGMMA of the kernel, C7512: perf/NOTES.md session 28)
    dq_order: str = "after_dkv"
    # Depth of the dO (+D) ring; 0: num_stages, as Q's. One stage frees tile_m * head_dim * 2
    # bytes (32 KB at head dim 256: the room a 2-CTA dS exchange would need, perf/NOTES.md
    # session 31); its stage is then released as soon as dV's WGMMA, its last reader, has
    # retired, so the next block's dO loads under the step's dQ and dK WGMMAs. split_d only.
    do_stages: int = 0

    @property
    def num_mma_warpgroups(self) -> int:
        return 2 if self.split_d else self.tile_n // 64

    @property
    def do_ring(self) -> int:
        """The dO ring's depth (do_stages, or Q's num_stages)."""
        return self.do_stages or self.num_stages

    def __post_init__(self):
        if self.tile_n % 64 or not 1 <= self.tile_n // 64 <= 2:
            raise ValueError(f"tile_n must be 64 or 128, got {self.tile_n}")
        if self.tile_m % 16 or not 16 <= self.tile_m <= 128:
            raise ValueError(f"tile_m must be a multiple of 16 in [16, 128], got {self.tile_m}")
        if self.tile_m % 64 and not self.dq_swapped:
            raise ValueError(f"tile_m {self.tile_m} is not a multiple of 64, the M of dQ = dS K per "
                             "warpgroup: it needs dq_swapped (dQ^T = K^T dS^T)")
        if self.dq_order not in DQ_ORDERS:
            raise ValueError(f"dq_order must be one of {DQ_ORDERS}, got {self.dq_order!r}")
        if self.dq_order != "after_dkv" and not self.dq_swapped:
            raise ValueError(f"dq_order {self.dq_order!r} orders dQ^T's WGMMA: it needs dq_swapped")
        if self.dq_swapped and (self.split_d or self.dq_atomic):
            raise ValueError("dq_swapped takes the sdQ tile and whole-head-dim warpgroups (no split_d, no dq_atomic)")
        if self.dq_warpgroups not in (1, self.num_mma_warpgroups):
            raise ValueError(f"dq_warpgroups must be 1 or {self.num_mma_warpgroups}, got {self.dq_warpgroups}")
        if self.split_d and (self.tile_n != 64 or self.dq_warpgroups != 2):
            raise ValueError("split_d takes tile_n 64 and both warpgroups on dQ, got "
                             f"tile_n {self.tile_n}, dq_warpgroups {self.dq_warpgroups}")
        if self.ds_stages not in (1, 2):
            raise ValueError(f"ds_stages must be 1 or 2, got {self.ds_stages}")
        if self.ds_stages == 2 and (self.num_stages != 2 or self.split_d or self.dq_atomic
                                    or self.dq_warpgroups != self.num_mma_warpgroups):
            raise ValueError("ds_stages 2 takes num_stages 2, the sdQ tile (no dq_atomic, no split_d) "
                             "and every warpgroup on dQ")
        if self.dq_handoff_per_wg and (self.ds_stages != 2 or self.num_mma_warpgroups != 2):
            raise ValueError("dq_handoff_per_wg takes ds_stages 2 and two consumer warpgroups")
        if self.do_stages and (not 1 <= self.do_stages < self.num_stages or not self.split_d):
            raise ValueError(f"do_stages must be 0 (num_stages) or in [1, num_stages) with split_d, got "
                             f"{self.do_stages} (num_stages {self.num_stages}, split_d {self.split_d})")


def split_d_bwd_config(head_dim: int, dq_atomic: bool) -> BwdConfig:
    """BwdConfig.split_d's tiles for head dims 192 and 256: 64 x 64, two stages where the
    shared memory holds them: always with dQ by atomics (256: ~210 KB), at 192 with the
    sdQ tile too; at 256 the sdQ tile (64 KB) leaves room for one (two would need ~273 KB)."""
    stages = 2 if dq_atomic or head_dim <= 192 else 1
    return BwdConfig(tile_m=64, tile_n=64, num_stages=stages, dq_warpgroups=2, split_d=True, dq_atomic=dq_atomic)


# Query rows from which the 64-row backward hands dQ to its writer per warpgroup
# (BwdConfig.dq_handoff_per_wg; head dim 128 without a mask, and causal from
# SWAPPED_DQ_CAUSAL_FROM_QUERIES, take swapped_dq_bwd_config instead). H200, session 28, two A/B runs (perf/ab_bwd_configs.py 5
# ... dqwg,copy; 16K tokens): +1..+5% at 4K-16K queries for head dims 64 and 128, causal
# or not; at 1K -1..-6% (2K mixed, -1..+3%), where a CTA has few steps to hide the
# writer's two serial half-reduces after the last one.
DQ_HANDOFF_PER_WG_FROM_QUERIES = 4096


# Causal head dim 128 takes swapped_dq_bwd_config from this many query rows (max_seqlen_q):
# at 512 it measured -6% against the 64-row config, level at 1K, +1.5-5.5% from 2K (H200).
SWAPPED_DQ_CAUSAL_FROM_QUERIES = 2048


def swapped_dq_bwd_config() -> BwdConfig:
    """Head dim 128 without a mask or causal: 80 query rows per step with dQ^T = K^T dS^T
    (dq_swapped), dQ^T issued before dK so its store to sdQ runs under dK ("before_dk"),
    two sdS buffers and the per-warpgroup dQ hand-off. Measured against the 64-row
    default it replaced (H200, 16K tokens, 5 interleaved rounds, perf/NOTES.md session
    29), at 1K / 2K / 4K / 8K / 16K: no mask +3.5 / +7 / +3 / +6 / +10%, causal +1.3 / +5
    / +1.5 / +3 / +5.5% (the noise floor 0-2%; a second 1K run: level); at 512, no mask
    level, causal -6% (SWAPPED_DQ_CAUSAL_FROM_QUERIES). Not with a window, softcap, mods or
    dropout (FlashBwdSm90 refuses them with dq_swapped), nor deterministic (its turns order
    whole dQ chunks; not measured). A sink's backward takes it: run_bwd drops the sink from
    the features, the kernel never sees it."""
    return BwdConfig(tile_m=80, tile_n=128, num_stages=2, ds_stages=2, dq_swapped=True, dq_order="before_dk",
                     dq_handoff_per_wg=True)


def bwd_config_for(head_dim: int, features: AttnFeatures, deterministic: bool = False,
                   max_seqlen_q: int = 0) -> BwdConfig:
    """FlashAttention-3's Hopper choice as a start: 64 x 128 tiles, 2 stages. At head dim
    96 one warpgroup computes dQ: a 48-column half would straddle the 32-column swizzle
    atoms of the 96-wide K tile, which WGMMA's B operand cannot address. At head dim 64
    the dK/dV accumulators are small enough for 128 query rows per step (S^T and dP^T of
    64 x 128 per warpgroup), which halves the per-step barriers and waits against the
    GEMM work; the window's second masked loop and the softcap's tanh spill there
    (36-108 bytes, ptxas), so those and the mods and dropout (per-element work of the
    same kind) keep 64 rows. Head dims 192 and 256 split the head dim between the two
    warpgroups (split_d_bwd_config). perf/NOTES.md has the A/Bs.

    Head dim 128 without a mask (every length), and causal from
    SWAPPED_DQ_CAUSAL_FROM_QUERIES query rows, take 80 query rows per step with dQ
    transposed instead (swapped_dq_bwd_config: two sdS buffers, per-warpgroup dQ), unless
    deterministic; the rest of this docstring is about the 64-row tiles.

    Two sdS buffers (ds_stages) where they were measured to help (H200, 1K-16K, session
    19): head dim 64's 128-row tiles +0-4% (causal or not), head dim 128 without a mask
    +1-3%; at 128 causal they measured -1 to +1%, so not there, nor where no one
    measured them (96, the window, softcap, mods, dropout). A sink never reaches this
    function from the launcher: run_bwd drops it from the features (it enters only through
    the forward's lse), so a sink's backward takes the sink-free config. Varlen and the
    deterministic backward take them (the same mainloop; GPU-tested and sanitized, not
    timed apart).

    From DQ_HANDOFF_PER_WG_FROM_QUERIES query rows (max_seqlen_q; 0: unknown, short), head
    dims 64 and 128 in those same plain cases hand dQ over per warpgroup, with two sdS
    buffers (at 128 causal too: today unreached, swapped_dq_bwd_config starting below
    4K); never deterministic (its turns order whole dQ chunks).
    Varlen passes its max_seqlen_q, a bound the caller chooses: a packed batch of short
    documents with a large bound takes the long-query config (correct, up to a few percent
    slower where the sequences are short)."""
    plain = not (features.local or features.softcap or features.has_mods or features.dropout)
    sds_buffers = 2 if plain and not features.sink else 1
    swapped_mask = features.mask == "none" or (
        features.mask == "causal" and max_seqlen_q >= SWAPPED_DQ_CAUSAL_FROM_QUERIES)
    if head_dim == 128 and swapped_mask and sds_buffers == 2 and not deterministic:
        return swapped_dq_bwd_config()
    per_wg = (head_dim in (64, 128) and sds_buffers == 2 and not deterministic
              and max_seqlen_q >= DQ_HANDOFF_PER_WG_FROM_QUERIES)
    if per_wg:
        return dataclasses.replace(bwd_config_for(head_dim, features, deterministic), ds_stages=2,
                                   dq_handoff_per_wg=True)
    if head_dim <= 64 and plain:
        return BwdConfig(tile_m=128, tile_n=128, num_stages=2, ds_stages=sds_buffers if head_dim == 64 else 1)
    if head_dim > 128:
        # split_d measured 1.26-1.58x the recomputing head-dim slices it replaced at 256
        # and 1.48-1.73x at 192; dQ by atomics (its second stage) 1.29-1.37x the sdQ
        # tile at 256, 0.93-0.99x at 192, where sdQ leaves room for two stages anyway
        # (H100, 4K and 16K, causal or not; perf/NOTES.md, session 15). Atomics have no
        # order: never deterministic.
        return split_d_bwd_config(head_dim, dq_atomic=head_dim > 192 and not deterministic)
    return BwdConfig(tile_m=64, tile_n=128, num_stages=2, dq_warpgroups=1 if head_dim == 96 else 2,
                     ds_stages=sds_buffers if head_dim == 128 and features.mask == "none" else 1)
