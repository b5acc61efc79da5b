"""Tile configurations for the Hopper forward kernel, one heuristic per head dim.

A config is static: it is part of the compile-cache key, so everything in it selects a
different kernel, while sequence lengths, batch and heads stay dynamic.
"""

from dataclasses import dataclass

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

    def __post_init__(self):
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask must be one of {MASK_KINDS}, got {self.mask!r}")

    @property
    def causal_like(self) -> bool:
        # the tile heuristics treat any window like causal: work shrinks per tile
        return self.mask != "none"


@dataclass(frozen=True)
class FwdConfig:
    tile_m: int  # query rows per CTA: 64 per consumer warpgroup (WGMMA's M)
    tile_n: int  # keys per mainloop step
    num_stages: int  # depth of the K and V shared-memory rings
    intra_wg_overlap: bool = True  # softmax of block j overlaps QK^T of block j+1, PV of j-1
    pingpong: bool = True  # consumer warpgroups take turns issuing WGMMAs (named barriers)
    # GQA with short seqlen_q: the pack_gqa query heads sharing a KV head fill one tile's
    # rows (row r = query r // pack_gqa of head r % pack_gqa), so the KV head is read once
    # per group instead of once per query head. 1: off. See choose_pack_gqa.
    pack_gqa: int = 1

    @property
    def num_mma_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def num_threads(self) -> int:
        # one producer warpgroup + the consumer warpgroups
        return 128 * (self.num_mma_warpgroups + 1)

    def __post_init__(self):
        if self.tile_m % 64 or not 1 <= self.tile_m // 64 <= 3:
            raise ValueError(f"tile_m must be 64, 128 or 192, got {self.tile_m}")
        if self.tile_n % 16:
            raise ValueError(f"tile_n must be a multiple of 16, got {self.tile_n}")


def choose_fwd_config(head_dim: int, causal: bool, local: bool = False) -> FwdConfig:
    """The forward tile shape per head dim (FlashAttention-3's choices as a starting point;
    perf/NOTES.md records what was measured here). causal: any mask that bounds the right
    side (causal or a sliding window); local: a sliding window."""
    if head_dim <= 64:
        if local:
            # three consumer warpgroups have 160 registers each: the window's two-sided
            # mask and its third loop spilled 272 bytes there (ptxas); two do not spill
            return FwdConfig(tile_m=128, tile_n=128, num_stages=2)
        return FwdConfig(tile_m=192, tile_n=128, num_stages=2)
    if head_dim <= 128:
        # Ping-pong for every mask. Causal without it once measured equal or better on an
        # H200 (8K: 647/601 vs 572/583 TF/s); with the window-aware mainloop on an H100 it
        # lost 13-16% (causal 4K: 484 vs 558, 8K: 501 vs 582; GQA 32/8 at 8K: 542 vs 611,
        # same process as FA4 at 581 / 609 / 617). perf/NOTES.md has the A/B.
        return FwdConfig(tile_m=128, tile_n=128, num_stages=2)
    if head_dim <= 192:
        return FwdConfig(tile_m=128, tile_n=96, num_stages=2)
    return FwdConfig(tile_m=128, tile_n=80, num_stages=2)


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


@dataclass(frozen=True)
class BwdConfig:
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
    # 0: a CTA produces all head_dim columns of dK, dV (and its dQ share). Otherwise it
    # produces d_slice of them and head_dim / d_slice CTAs share one KV block, each
    # recomputing S and dP in full: the dK/dV accumulators of head dims 192 and 256 do not
    # fit in registers next to S and dP.
    d_slice: int = 0

    @property
    def num_mma_warpgroups(self) -> int:
        return self.tile_n // 64

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_mma_warpgroups + 1)

    def __post_init__(self):
        if self.tile_n % 64 or not 1 <= self.tile_n // 64 <= 2:
            raise ValueError(f"tile_n must be 64 or 128, got {self.tile_n}")
        if self.tile_m % 16 or not 16 <= self.tile_m <= 128:
            raise ValueError(f"tile_m must be a multiple of 16 in [16, 128], got {self.tile_m}")
        if self.dq_warpgroups not in (1, self.num_mma_warpgroups):
            raise ValueError(f"dq_warpgroups must be 1 or {self.num_mma_warpgroups}, got {self.dq_warpgroups}")


# Head dims the backward supports. Each consumer warpgroup keeps a 64 x head_dim dK and dV
# accumulator in registers (head_dim registers per thread for the two), which leaves room
# for the S, dP and dQ tiles only up to head dim 128; beyond, see BwdConfig.d_slice.
BWD_HEAD_DIMS = (64, 96, 128, 192, 256)


def bwd_config_for(head_dim: int, features: AttnFeatures) -> BwdConfig:
    """choose_bwd_config for a call's compiled features."""
    return choose_bwd_config(head_dim, features.causal_like, features.mask == "local",
                             features.softcap)


def choose_bwd_config(head_dim: int, causal: bool, local: bool = False,
                      softcap: bool = False) -> BwdConfig:
    """FlashAttention-3's Hopper choice as a start: 64 x 128 tiles, 2 stages. At head dim
    96 one warpgroup computes dQ: a 48-column half would straddle the 32-column swizzle
    atoms of the 96-wide K tile, which WGMMA's B operand cannot address. At head dim 64
    the dK/dV accumulators are small enough for 128 query rows per step (S^T and dP^T of
    64 x 128 per warpgroup), which halves the per-step barriers and waits against the
    GEMM work; the window's second masked loop and the softcap's tanh spill there
    (36-108 bytes, ptxas), so those keep 64 rows. perf/NOTES.md has the A/B."""
    if head_dim <= 64 and not (local or softcap):
        return BwdConfig(tile_m=128, tile_n=128, num_stages=2)
    if head_dim > 128:
        # Correct, not fast: head_dim / 64 CTAs per KV block each recompute S and dP
        # (9/5 of the FLOPs at 192, 11/5 at 256). One stage keeps full-width Q, dO, K, V
        # tiles within shared memory; 64-column slices are one swizzle atom, so one
        # warpgroup takes dQ (half an atom cannot be a WGMMA B operand).
        return BwdConfig(tile_m=64, tile_n=128, num_stages=1, dq_warpgroups=1, d_slice=64)
    return BwdConfig(tile_m=64, tile_n=128, num_stages=2, dq_warpgroups=1 if head_dim == 96 else 2)
