"""Attention backward for Hopper (sm_90a): warp-specialized TMA + WGMMA, FlashAttention-3 style.

Given Q, K, V, dO and the forward's LSE, computes dK and dV for one (n_block, head, batch)
tile of keys per CTA, and adds that tile's share of dQ into an fp32 accumulator. Three
kernels run in order (the other two are in kernels/bwd_prepost.py):
  1. preprocess: D = rowsum(dO * O) and LSE * log2(e), padded to whole query tiles, and
     each query tile's dQ_accum chunk zeroed;
  2. this kernel;
  3. postprocess: dQ = softmax_scale * dQ_accum, converted to the input dtype.

Everything is computed transposed, keys on rows, so that the two products that need P and
dS as their A operand (dV += P^T dO and dK += dS^T Q) take them straight from registers:
  S^T  = K Q^T          (A = K from smem, B = Q)        P^T  = exp2(S^T * scale_log2 - LSE2)
  dP^T = V dO^T         (A = V,           B = dO)       dS^T = P^T * (dP^T - D)
  dV  += P^T dO         (A = P^T registers, B = dO^T view of the dO tile)
  dK  += dS^T Q         (A = dS^T registers, B = Q^T view)
  dQ   = dS K           (A = dS^T written to smem, read MN-major; B = K^T view)
LSE2 and D are per query, i.e. per column of the S^T tile. BwdConfig.dq_swapped (head
dim 128, no mask or causal: 80 queries per step, which dQ's M cannot take) computes dQ^T = K^T dS^T
instead (A = K^T view, B = dS written to smem queries x keys by stmatrix .trans), and
dQ_accum holds the dQ^T fragment's order (blocks/dq_accum.py).

Warp roles (128 * (1 + BwdConfig.num_mma_warpgroups) threads):
  * warpgroup 0, the producer (setmaxnreg 24): warp 0 issues the TMA loads (K and V once;
    then per query block Q with its LSE2 chunk, and dO with its D chunk, into
    `num_stages`-deep rings); warp 1 is the dQ writer (absent with dq_atomic): it adds each
    finished dQ tile from shared memory to global memory with one bulk reduce-add
    (cp.reduce.async.bulk .add.f32).
  * warpgroups 1.. (setmaxnreg 240): each owns 64 keys of the tile (split_d: the tile's
    64 keys and half the head dim) and keeps their dK and dV accumulators in registers
    across the whole loop over query blocks.

Barrier protocol per query block (named barriers, see blocks/barriers.py):
  consumers: ... wait DQ_EMPTY (the writer is done reading sdQ, and so every warpgroup has
             finished the previous dQ WGMMA that read sdS) -> write dS^T to sdS -> DS_READY
             (all rows of dS are in smem) -> dQ WGMMA -> write dQ to sdQ -> arrive DQ_FULL
  writer:    wait DQ_FULL -> bulk reduce-add sdQ into dQ_accum -> wait until read -> arrive
             DQ_EMPTY
  With two sdS buffers (BwdConfig.ds_stages, indexed by Q's stage) the consumers write
  dS^T without the DQ_EMPTY wait (the buffer's last reader, the dQ two steps back, has
  completed in every warpgroup before the DS_READY in between) and wait there just before
  the sdQ stores. With BwdConfig.dq_handoff_per_wg on top, each warpgroup waits and arrives
  on a DQ_EMPTY / DQ_FULL pair of its own (128 + 32 threads), and the writer reduce-adds
  the two halves of sdQ one after the other (dq_accum's chunk is warpgroup-major).
dQ_accum is laid out per query tile in the order of the dQ WGMMA's accumulator fragments
(blocks/dq_accum.py), so each thread's stores to sdQ are conflict-free and the reduce is
one contiguous chunk; the postprocess undoes the permutation.
BwdConfig.dq_atomic (head dims 192/256, not deterministic) drops sdQ and the writer: each
consumer thread adds its dQ registers into the same chunk layout with 8-byte vector
atomics while its dK WGMMA runs, and the consumers alone agree that sdS (and sP) may be
rewritten (DS_FREE, a consumer-only barrier, in place of the writer's DQ_EMPTY).

deterministic=True: the dQ writer of KV block n waits, per query block, until KV blocks
0..n-1 have added theirs (a turn counter in global memory, blocks/semaphore.py), so the
fp32 sums happen in one order. The CTAs of one head then run in lockstep on dQ; the cost
is measured in perf/NOTES.md.

Masks (blocks/mask.py, blocks/block_range.py): query blocks that see no key of this tile
are never loaded; only the query blocks that cut the window's right edge (the causal
diagonal) or its left edge and, in the last KV tile, the keys past seqlen_k are masked.
Keys past seqlen_k (zero-filled by TMA, or the next sequence's when packed) must still be
masked: their P = exp2(-LSE2) is finite but can overflow to inf, and 0 * inf would reach dQ
as NaN. Query rows past seqlen_q have LSE2 = +inf (the preprocess pads so), hence P = 0.

GQA / MQA: a CTA owns a KV block of one KV head and walks the query blocks of every query
head of its group (heads_q / heads_kv of them) in turn, so dK and dV are summed over the
group in registers, with no extra pass over memory; dQ goes per query head as before.

Softcap: S^T <- tanh(S^T * scale / softcap) before the mask, P from it with scale_log2 =
softcap * log2(e), and dS^T picks up the tanh's derivative 1 - tanh^2 (folded into
dP^T - D once both GEMMs are done, which gives up overlapping the exp2s with the dP WGMMA
but needs no registers beyond S^T and dP^T: keeping 1 - tanh^2 spilled ~240 bytes).

Mask and score mods (FlashBwdSm90Mods, cute_attn/masks.py): a mask mod's CTA walks its KV
tile's query blocks from a transposed block mask (block_mask.py, built at this kernel's
tiles): PARTIAL blocks get the mod per element (blocks/mods.ModTile), FULL ones nothing,
EMPTY ones are never loaded; the producer, the dQ writer and the consumers walk the same
lists (q_blocks). A score mod rewrites S^T like the softcap and folds its derivative,
traced from the same body on a masks.Dual, into dP^T - D.

Dropout (the same entry point, AttnFeatures.dropout): the forward's mask again from the
element's coordinates (blocks/dropout.py), kept as the sign of P^T (no register per
element): dS^T = P^T (dP^T / (1 - p) - D) where kept, -P^T D where dropped, and dV takes
P^T / (1 - p) or 0. A sink needs nothing here: it is inside the forward's LSE (its own
gradient is the launcher's, from D).

Varlen (blocks/seqlen.py): tiles past a sequence's keys exit at once; LSE2, D and dQ_accum
are padded per sequence to whole query tiles; dK and dV leave row by row (not by TMA) so
a partial tile never writes into the next sequence.

Work tiles (blocks/tile_scheduler.py): block = the KV block, head = the KV head.

Constraints: config.CAPABILITIES["bwd"]: head dims 64, 96, 128 as described (at 96
warpgroup 0 alone computes dQ, see BwdConfig.dq_warpgroups) and 192, 256 with the two
warpgroups splitting the head dim (BwdConfig.split_d: 64-key tiles, P^T and dS^T through
shared memory; at 256 dQ by atomics unless deterministic, BwdConfig.dq_atomic); fp16 or
bf16 in, fp32 accumulation (config.DtypePolicy).
Read the PTX without a GPU: python -m cute_attn ptx --kernel bwd --headdim 128 [--causal]
[--seqlen-q N] (the default config for N query rows: with --causal, 64 rows below 2K and
80 from there; without a mask, 80 at every length)
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from cute_attn.blocks import dq_accum, epilogue, mma_sm90, semaphore
from cute_attn.blocks.barriers import NamedBarrier
from cute_attn.blocks.block_range import BlockRange
from cute_attn.blocks.bulk_copy import bulk_reduce_add_f32
from cute_attn.blocks.mask import AttentionMask, Window
from cute_attn.blocks.dropout import Dropout, DropoutArgs
from cute_attn.blocks.mods import BlockList, ModTile
from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.softmax import ColumnStat, ScoreScale, fold_score_scale, probs_from_lse, softcap_scores
from cute_attn.blocks.tile_scheduler import TileScheduler, WorkTile
from cute_attn.blocks.tma_pipeline import (
    TmaTensor,
    make_tma_pipeline,
    make_tma_tensor,
    prefetch_descriptors,
    release_after_loads,
    tma_partition,
)
from cute_attn.blocks.views import bshd_as_sdhb, rowwise_as_rhb
from cute_attn.config import SM90_SMEM_BYTES, AttnFeatures, BwdConfig, DtypePolicy


class BwdGlobals(NamedTuple):
    """Global memory as the kernel sees it (kernel-side views, see blocks/views.py)."""

    q: TmaTensor
    k: TmaTensor
    v: TmaTensor
    do: TmaTensor
    dk: TmaTensor  # TMA stores of dense tiles
    dv: TmaTensor
    dk_rows: cute.Tensor  # dK, dV as plain tensors: varlen tiles leave row by row
    dv_rows: cute.Tensor
    lse2: TmaTensor  # (padded rows, heads, batch) float32: LSE * log2(e), 1-D TMA tiles
    dsum: TmaTensor  # D = rowsum(dO * O), same shape
    dq_accum: cute.Tensor  # (padded rows * head_dim, heads, batch) float32, blocks/dq_accum.py
    dq_semaphore: cute.Tensor  # (padded m_blocks * d slices, heads, batch); deterministic only
    cu_seqlens_q: cute.Tensor  # (batch + 1,) int32; varlen only
    cu_seqlens_k: cute.Tensor
    # mask mods: the transposed block mask's (partial_count, partial_idx, full_count,
    # full_idx), blocks/mods.BlockList (else stand-ins, unread)
    sparse: tuple
    aux: tuple  # the mods' aux tensors (masks.SeqInfo.aux); else a stand-in, unread
    dropout: DropoutArgs  # AttnFeatures.dropout only; else stand-ins, unread


class BwdLayouts(NamedTuple):
    """The static shared-memory layouts and tiled MMAs."""

    sQ: cute.ComposedLayout  # (tile_m, head_dim, stages)
    sdO: cute.ComposedLayout  # (tile_m, head_dim, dO stages): BwdConfig.do_stages
    sK: cute.ComposedLayout  # (tile_n, head_dim), also V's
    sdS: cute.ComposedLayout  # (tile_n, tile_m): dS^T, queries contiguous
    sdKV: cute.ComposedLayout  # (tile_n, head_dim): dK, dV staged over sK, sV
    mma_sdp: cute.TiledMma  # S^T = K Q^T and dP^T = V dO^T
    mma_dkv: cute.TiledMma  # dV += P^T dO, dK += dS^T Q (A from registers)
    mma_dq: cute.TiledMma  # dQ = dS K


class BwdPipelines(NamedTuple):
    kv: pipeline.PipelineTmaAsync  # K and V, loaded once
    q: pipeline.PipelineTmaAsync  # Q with its LSE2 chunk, per query block
    do: pipeline.PipelineTmaAsync  # dO with its D chunk


class BwdSmem(NamedTuple):
    q: cute.Tensor
    do: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    ds: cute.Tensor
    lse2: cute.Tensor  # (tile_m, stages)
    dsum: cute.Tensor
    dq: cute.Tensor  # one dQ tile (fp32) on its way to the dQ writer; None with dq_atomic
    dk: cute.Tensor  # the epilogue's views of sK and sV
    dv: cute.Tensor
    p: cute.Tensor  # split_d: P^T, like ds


class StepOperands(NamedTuple):
    """A consumer warpgroup's WGMMA fragments and accumulators for the whole loop."""

    tSrK: cute.Tensor
    tSrQ: cute.Tensor
    tdPrV: cute.Tensor
    tdPrdO: cute.Tensor
    tdVrdO: cute.Tensor
    tdKrQ: cute.Tensor
    tdQrdS: cute.Tensor
    tdQrK: cute.Tensor
    acc_dV: cute.Tensor
    acc_dK: cute.Tensor
    tdVrP: object = None  # split_d: SS A fragments of P^T and dS^T
    tdKrdS: object = None


class DqHandoff(NamedTuple):
    """One part of sdQ handed from the consumers to the dQ writer: its DQ_FULL and DQ_EMPTY
    barrier ids and the threads that meet on them."""

    full: object  # an int, or an Int32 where the part is the run-time warpgroup index
    empty: object
    threads: int


class FlashBwdSm90:
    def __init__(
        self, dtypes: DtypePolicy, head_dim: int, features: AttnFeatures, config: BwdConfig,
        deterministic: bool = False,
    ):
        self.dtype = dtypes.dsl("input")
        self.p_dtype = dtypes.dsl("p")
        self.out_dtype = dtypes.dsl("output")
        self.deterministic = deterministic
        self.head_dim = head_dim
        self.features = features
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.num_stages = config.num_stages
        self.num_mma_wg = config.num_mma_warpgroups
        self.num_threads = config.num_threads
        self.num_mma_threads = 128 * self.num_mma_wg
        self.producer_regs, self.mma_regs = config.registers
        self.dq_wgs = config.dq_warpgroups
        self.num_dq_threads = 128 * self.dq_wgs
        self.dq_atomic = config.dq_atomic  # see BwdConfig.dq_atomic
        if self.dq_atomic and deterministic:
            raise ValueError("the deterministic backward orders its dQ reduce-adds: dq_atomic cannot serve it")
        self.split_d = config.split_d  # see BwdConfig.split_d
        self.ds_stages = config.ds_stages  # see BwdConfig.ds_stages
        self.do_stages = config.do_ring  # see BwdConfig.do_stages
        # a dO ring shallower than Q's: a pipeline state of its own, and its stage freed once
        # dV's WGMMA retired; else dO's stage is Q's (one state: no second bookkeeping)
        self.own_do_ring = self.do_stages != self.num_stages
        self.dp_wait_after_exp2 = config.dp_wait_after_exp2  # see BwdConfig.dp_wait_after_exp2
        self.dq_handoff_per_wg = config.dq_handoff_per_wg  # see BwdConfig.dq_handoff_per_wg
        if self.dq_handoff_per_wg and deterministic:
            raise ValueError("the deterministic backward orders whole dQ chunks: no dq_handoff_per_wg")
        self.dq_swapped = config.dq_swapped  # see BwdConfig.dq_swapped
        self.dq_order = config.dq_order  # see BwdConfig.dq_order (dq_swapped only)
        if self.dq_swapped:
            # the per-element paths of a window, softcap, mods and dropout and the mods'
            # kernel (a sink too) are not tested with it: no mask or causal only
            if features.mask == "local" or features.softcap or features.mod_kernel:
                raise ValueError(f"dq_swapped takes no mask or the causal mask, without a window, softcap, mods, "
                                 f"dropout or a sink in the features; got {features}")
            if head_dim % (64 * self.dq_wgs):
                raise ValueError(f"dq_swapped needs head_dim a multiple of 64 per dQ warpgroup (the M of "
                                 f"dQ^T), got head_dim {head_dim} with {self.dq_wgs} dQ warpgroups")
        # LSE2 and D chunks: each stage's at a 128-byte boundary (a TMA destination)
        self.stats_stride = -(-self.tile_m // 32) * 32
        # one CTA per (KV block, KV head, batch). n_block 0 sees the most
        # query blocks under a causal mask, and grid order already launches it first.
        self.scheduler = TileScheduler(self.tile_n, features.varlen)

    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
        mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdQsemaphore: cute.Tensor,
        mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, max_seqlen_k: Int32, softmax_scale: Float32,
        softcap: Float32, window_left: Int32, window_right: Int32, stream,
    ):
        self.launch(mQ, mK, mV, mdO, mLSE2, mD, mdQaccum, mdK, mdV, mdQsemaphore, mCuSeqlensQ, mCuSeqlensK,
                    max_seqlen_k, softmax_scale, softcap, window_left, window_right, stream)

    @cute.jit
    def launch(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim); varlen (1, total_q, ...)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # like mQ
        mLSE2: cute.Tensor,  # (batch, heads, padded rows: see blocks/seqlen.py), float32
        mD: cute.Tensor,  # same shape as mLSE2
        mdQaccum: cute.Tensor,  # (batch, heads, padded rows * head_dim), float32
        mdK: cute.Tensor,  # like mK
        mdV: cute.Tensor,
        mdQsemaphore: cute.Tensor,  # (batch, heads, padded m_blocks) int32; deterministic only
        mCuSeqlensQ: cute.Tensor,  # (batch + 1,) int32; varlen only
        mCuSeqlensK: cute.Tensor,
        max_seqlen_k: Int32,  # varlen: the longest key sequence (sizes the grid)
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
        sparse: tuple = None,
        aux: tuple = None,
        dropout: DropoutArgs = None,
    ):
        """sparse, aux, dropout: the mod entry point's transposed block mask, aux tensors
        and dropout (otherwise None: stand-ins are passed, never read)."""
        if cutlass.const_expr(sparse is None):
            sparse = (mCuSeqlensQ,) * 4
        if cutlass.const_expr(dropout is None):
            dropout = DropoutArgs.unread(mCuSeqlensQ)
        if cutlass.const_expr(aux is None):
            aux = (mCuSeqlensQ,)
        mQ, mK, mV, mdO, mdK, mdV = [bshd_as_sdhb(t) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSE2, mD, mdQaccum, mdQsemaphore = [rowwise_as_rhb(t) for t in (mLSE2, mD, mdQaccum, mdQsemaphore)]
        d, wgs = self.head_dim, self.num_mma_wg
        # split_d: each warpgroup's d / 2 columns of Q, dO, K, V (B operands of dK, dV, dQ)
        # must be whole swizzle atoms (192: 96-column halves straddle the 128-byte atom)
        half_atoms = d // wgs if self.split_d else None
        sQ = mma_sm90.make_smem_layout(self.dtype, self.tile_m, d, self.num_stages, atom_cols=half_atoms)
        layouts = BwdLayouts(
            sQ=sQ,
            sdO=sQ if not self.own_do_ring else mma_sm90.make_smem_layout(self.dtype, self.tile_m, d, self.do_stages,
                                                                          atom_cols=half_atoms),
            sK=mma_sm90.make_smem_layout(self.dtype, self.tile_n, d, atom_cols=half_atoms),
            # dS^T stored keys x queries with queries contiguous: read back MN-major as dS's A;
            # dq_swapped: dS stored queries x keys, keys contiguous, dQ^T's K-major B (a row
            # of 80 queries would take only 32-byte swizzle atoms)
            sdS=mma_sm90.make_smem_layout(self.p_dtype, *self.sds_shape(),
                                          self.ds_stages if self.ds_stages > 1 else None),
            # dK / dV leave through sK / sV, seen as tile_n x head_dim tiles
            sdKV=mma_sm90.make_smem_layout(self.out_dtype, self.tile_n, d, atom_cols=half_atoms),
            # S^T = K Q^T and dP^T = V dO^T: each warpgroup 64 keys x tile_m queries (split_d:
            # the two warpgroups side by side on the queries, tile_m / 2 each)
            mma_sdp=mma_sm90.make_tiled_mma(self.dtype, OperandMajorMode.K,
                                            self.tile_m // wgs if self.split_d else self.tile_m, wgs,
                                            warpgroups_along_n=self.split_d),
            # dV += P^T dO and dK += dS^T Q: A from registers, B = dO^T / Q^T (head_dim
            # contiguous); split_d: A from shared memory (sP, sdS), each warpgroup d / 2 columns
            mma_dkv=mma_sm90.make_tiled_mma(
                self.p_dtype, OperandMajorMode.MN, d // wgs if self.split_d else d, wgs,
                a_in_registers=not self.split_d, warpgroups_along_n=self.split_d,
            ),
            mma_dq=dq_accum.make_dq_mma(self.p_dtype, d, self.dq_wgs, self.tile_m, self.dq_swapped),
        )
        load_op, store_op = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        q_tile = cute.select(layouts.sQ, mode=[0, 1])
        dkv_tile = (self.tile_n, d)
        stats_tile = cute.make_layout(self.tile_m)
        g = BwdGlobals(
            q=make_tma_tensor(load_op, mQ, q_tile, (self.tile_m, d)),
            k=make_tma_tensor(load_op, mK, layouts.sK, (self.tile_n, d)),
            v=make_tma_tensor(load_op, mV, layouts.sK, (self.tile_n, d)),
            do=make_tma_tensor(load_op, mdO, q_tile, (self.tile_m, d)),
            dk=make_tma_tensor(store_op, mdK, layouts.sdKV, dkv_tile),
            dv=make_tma_tensor(store_op, mdV, layouts.sdKV, dkv_tile),
            # per-query statistics: tile_m floats per query block, by descriptor-based TMA
            # like the tiles (a raw cp.async.bulk would do as well, but compute-sanitizer's
            # racecheck cannot see the mbarrier ordering of a raw bulk copy's smem write
            # after the consumers' loads and reports every stage refill as a WAR hazard)
            lse2=make_tma_tensor(load_op, mLSE2, stats_tile, (self.tile_m,)),
            dsum=make_tma_tensor(load_op, mD, stats_tile, (self.tile_m,)),
            dk_rows=mdK, dv_rows=mdV, dq_accum=mdQaccum, dq_semaphore=mdQsemaphore,
            cu_seqlens_q=mCuSeqlensQ, cu_seqlens_k=mCuSeqlensK, sparse=sparse, aux=aux, dropout=dropout,
        )
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, q_tile) + self.tile_m * 4
        self.tma_bytes_kv = 2 * cute.size_in_bytes(self.dtype, layouts.sK)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_do: cute.struct.MemRange[cutlass.Int64, self.do_stages * 2]
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, self.stats_stride * self.num_stages], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, self.stats_stride * self.do_stages], 128]
            if cutlass.const_expr(not self.dq_atomic):  # dQ atomics need no staging tile
                sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.head_dim], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.sQ)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.sdO)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.sK)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.sK)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.p_dtype, cute.cosize(layouts.sdS)], 1024]
            if cutlass.const_expr(self.split_d):  # P^T (keys x queries, like sdS); no bytes otherwise
                sP: cute.struct.Align[cute.struct.MemRange[self.p_dtype, cute.cosize(layouts.sdS)], 1024]

        self.shared_storage = SharedStorage
        if cutlass.const_expr(SharedStorage.size_in_bytes() > SM90_SMEM_BYTES):  # the launch would fail
            raise ValueError(f"the backward's shared memory ({SharedStorage.size_in_bytes()} bytes) exceeds "
                             f"the {SM90_SMEM_BYTES} of a CTA: fewer stages or sdS buffers")

        score = fold_score_scale(softmax_scale, softcap, self.features.softcap, self.features.score_mod is not None)
        # one CTA per KV block: the grid tiles K's rows
        grid = self.scheduler.grid(mK, mCuSeqlensQ, max_seqlen_k)
        self.kernel(g, layouts, score, window_left, window_right).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(
        self, g: BwdGlobals, layouts: BwdLayouts, score: ScoreScale, window_left: Int32, window_right: Int32
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            prefetch_descriptors(g)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipes = BwdPipelines(
            kv=make_tma_pipeline(storage.mbar_kv.data_ptr(), 1, self.tma_bytes_kv, self.num_mma_threads),
            q=make_tma_pipeline(storage.mbar_q.data_ptr(), self.num_stages, self.tma_bytes_q, self.num_mma_threads),
            do=make_tma_pipeline(storage.mbar_do.data_ptr(), self.do_stages, self.tma_bytes_q, self.num_mma_threads),
        )
        pipeline_init_arrive(is_relaxed=True)

        stats_layout = cute.make_layout((self.tile_m, self.num_stages), stride=(1, self.stats_stride))
        do_stats_layout = stats_layout
        if cutlass.const_expr(self.own_do_ring):
            do_stats_layout = cute.make_layout((self.tile_m, self.do_stages), stride=(1, self.stats_stride))
        sQ_l, sdO_l, sK_l, sdS_l, sdKV_l = layouts.sQ, layouts.sdO, layouts.sK, layouts.sdS, layouts.sdKV
        smem = BwdSmem(
            q=storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner),
            do=storage.sdO.get_tensor(sdO_l.outer, swizzle=sdO_l.inner),
            k=storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner),
            v=storage.sV.get_tensor(sK_l.outer, swizzle=sK_l.inner),
            ds=self.keys_by_queries(storage.sdS.get_tensor(sdS_l.outer, swizzle=sdS_l.inner)),
            lse2=storage.sLSE2.get_tensor(stats_layout),
            dsum=storage.sD.get_tensor(do_stats_layout),
            dq=None if self.dq_atomic else storage.sdQ.get_tensor(cute.make_layout(self.tile_m * self.head_dim)),
            # the epilogue's views of the K and V buffers
            dk=storage.sK.get_tensor(sdKV_l.outer, swizzle=sdKV_l.inner),
            dv=storage.sV.get_tensor(sdKV_l.outer, swizzle=sdKV_l.inner),
            p=storage.sP.get_tensor(sdS_l.outer, swizzle=sdS_l.inner) if self.split_d else None,
        )

        tile = self.scheduler.tile()
        mQ, mK = g.q.tensor, g.k.tensor
        seqlen = SeqlenInfo(
            tile.batch, mQ.shape[0], mK.shape[0], g.cu_seqlens_q, g.cu_seqlens_k, self.features.varlen,
            tile_m_padded=self.tile_m,
        )
        window = Window(self.features.mask, window_left, window_right)
        block_range = BlockRange(self.tile_m, self.tile_n, window)
        # GQA: the query heads head_kv * group + [0, group) share this KV head
        group = mQ.shape[2] // mK.shape[2]
        pipeline_init_wait()

        # varlen: the grid covers the longest key sequence; a tile past this one's end
        # has no keys (uniform across the CTA)
        if not self.features.varlen or tile.block * self.tile_n < seqlen.seqlen_k:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.produce(g, smem, pipes, tile, group, block_range, seqlen)
                if cutlass.const_expr(not self.dq_atomic):
                    if warp_idx == 1:
                        self.write_dq(g, smem.dq, tile, group, block_range, seqlen)
            else:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.consume(g, layouts, smem, pipes, tile, group, block_range, seqlen, window, score, tidx - 128)

    # ------------------------------------------------------------------------------------
    # Producer warp: TMA loads
    # ------------------------------------------------------------------------------------
    @cute.jit
    def produce(
        self, g: BwdGlobals, smem: BwdSmem, pipes: BwdPipelines, tile: WorkTile, group,
        block_range: BlockRange, seqlen: SeqlenInfo,
    ):
        n_block, head_kv = tile.block, tile.head
        d = self.head_dim
        gK = cute.local_tile(seqlen.rows_k(g.k.tensor, head_kv), (self.tile_n, d), (n_block, 0))
        gV = cute.local_tile(seqlen.rows_k(g.v.tensor, head_kv), (self.tile_n, d), (n_block, 0))
        tKsK, tKgK = tma_partition(g.k, smem.k, gK)
        tVsV, tVgV = tma_partition(g.v, smem.v, gV)
        # the padded per-row statistics: this sequence's query blocks start here
        stats_block0 = seqlen.padded_m_block_offset

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipes.kv.producer_acquire(kv_state)
        kv_bar = pipes.kv.producer_get_barrier(kv_state)
        cute.copy(g.k.atom, tKgK, tKsK, tma_bar_ptr=kv_bar)
        cute.copy(g.v.atom, tVgV, tVsV, tma_bar_ptr=kv_bar)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        # (None: dO's stage is Q's. Never an alias of `state`: the DSL carries each name
        # through its loops apart, so an alias would not advance with it)
        do_state = None
        if cutlass.const_expr(self.own_do_ring):
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        for i in cutlass.range(group, unroll=1):
            head = head_kv * group + i
            blocks, m_first, count = self.q_blocks(g, tile, head, block_range, seqlen)
            gQ = cute.local_tile(seqlen.rows_q(g.q.tensor, head), (self.tile_m, d), (None, 0))
            gdO = cute.local_tile(seqlen.rows_q(g.do.tensor, head), (self.tile_m, d), (None, 0))
            tQsQ, tQgQ = tma_partition(g.q, smem.q, gQ)
            tdOsdO, tdOgdO = tma_partition(g.do, smem.do, gdO)
            gLSE2 = cute.local_tile(g.lse2.tensor[None, head, seqlen.batch], (self.tile_m,), (None,))
            gD = cute.local_tile(g.dsum.tensor[None, head, seqlen.batch], (self.tile_m,), (None,))
            tLsL, tLgL = tma_partition(g.lse2, smem.lse2, gLSE2, tile_rank=1)
            tDsD, tDgD = tma_partition(g.dsum, smem.dsum, gD, tile_rank=1)
            for j in cutlass.range(count, unroll=1):
                m_block = self.q_block(blocks, m_first, j)
                pipes.q.producer_acquire(state)
                bar = pipes.q.producer_get_barrier(state)
                cute.copy(g.q.atom, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar)
                cute.copy(g.lse2.atom, tLgL[None, stats_block0 + m_block], tLsL[None, state.index], tma_bar_ptr=bar)
                do_ring = state if cutlass.const_expr(do_state is None) else do_state
                pipes.do.producer_acquire(do_ring)
                bar = pipes.do.producer_get_barrier(do_ring)
                cute.copy(g.do.atom, tdOgdO[None, m_block], tdOsdO[None, do_ring.index], tma_bar_ptr=bar)
                cute.copy(g.dsum.atom, tDgD[None, stats_block0 + m_block], tDsD[None, do_ring.index], tma_bar_ptr=bar)
                state.advance()
                if cutlass.const_expr(self.own_do_ring):
                    do_state.advance()

    @cute.jit
    def q_blocks(self, g: BwdGlobals, tile: WorkTile, head, block_range: BlockRange, seqlen: SeqlenInfo):
        """(blocks, m_first, count): the query blocks of head `head` this KV tile visits,
        as steps j = 0 .. count - 1 (q_block), in the consumers' order. A mask mod: the
        transposed block mask's lists, PARTIAL then FULL (blocks); else the range
        [m_first, m_first + count) of block_range."""
        blocks = None
        if cutlass.const_expr(self.features.mask_mod is not None):
            # per batch entry, or per packed sequence (tile.batch; seqlen.batch is 0 there)
            blocks = BlockList(g.sparse, tile.batch, head, tile.block)
            m_first, count = Int32(0), blocks.count
        else:
            m_first, m_block_max = block_range.m_block_min_max(seqlen, tile.block)
            count = m_block_max - m_first
        return blocks, m_first, count

    @cute.jit
    def q_block(self, blocks, m_first: Int32, j: Int32) -> Int32:
        """The query block of step j (see q_blocks)."""
        if cutlass.const_expr(blocks is not None):
            m_block = blocks.block(j)
        else:
            m_block = m_first + j
        return m_block

    # ------------------------------------------------------------------------------------
    # dQ writer warp: adds each query block's dQ tile into dQ_accum
    # ------------------------------------------------------------------------------------
    @property
    def dq_parts(self) -> int:
        """The parts of sdQ handed over apart: one (all consumers with the writer), or with
        BwdConfig.dq_handoff_per_wg one per warpgroup (dq_accum.offset is warpgroup-major)."""
        return 2 if self.dq_handoff_per_wg else 1

    def dq_handoff(self, part) -> DqHandoff:
        """The barriers of sdQ's part `part`: the joint DQ_FULL / DQ_EMPTY with every
        consumer and the writer, or warpgroup `part`'s pair (0: the joint ids, 1: the _WG1
        twins) with its 128 threads and the writer's 32."""
        if not self.dq_handoff_per_wg:
            return DqHandoff(int(NamedBarrier.DQ_FULL), int(NamedBarrier.DQ_EMPTY), self.num_mma_threads + 32)
        step = int(NamedBarrier.DQ_FULL_WG1 - NamedBarrier.DQ_FULL)
        assert step == NamedBarrier.DQ_EMPTY_WG1 - NamedBarrier.DQ_EMPTY
        return DqHandoff(int(NamedBarrier.DQ_FULL) + part * step, int(NamedBarrier.DQ_EMPTY) + part * step, 160)

    @cute.jit
    def write_dq(self, g: BwdGlobals, sdQ, tile: WorkTile, group, block_range: BlockRange, seqlen: SeqlenInfo):
        n_block, head_kv = tile.block, tile.head
        chunk = self.tile_m * self.head_dim
        lane = cute.arch.lane_idx()
        total = Int32(0)
        for i in cutlass.range(group, unroll=1):
            _, _, count = self.q_blocks(g, tile, head_kv * group + i, block_range, seqlen)
            total += count
        if total > 0:
            # sdQ (and sdS) start out free
            for w in cutlass.range_constexpr(self.dq_parts):
                part = self.dq_handoff(w)
                cute.arch.barrier_arrive(barrier_id=part.empty, number_of_threads=part.threads)
        # the consumers' order: every query block of the group's first head, then the next
        done = Int32(0)
        for i in cutlass.range(group, unroll=1):
            head = head_kv * group + i
            blocks, m_first, count = self.q_blocks(g, tile, head, block_range, seqlen)
            for j in cutlass.range(count, unroll=1):
                m_block = self.q_block(blocks, m_first, j)
                tile_idx = dq_accum.chunk_index(seqlen.padded_m_block_offset, m_block)
                gdQaccum = cute.local_tile(g.dq_accum[None, head, seqlen.batch], (chunk,), (None,))
                # each part as it comes (per warpgroup: the halves one after the other)
                for w in cutlass.range_constexpr(self.dq_parts):
                    self.reduce_chunk(g, sdQ, gdQaccum, tile, head, blocks, block_range, seqlen, m_block, tile_idx,
                                      lane, w)
                    if done + 1 < total:
                        part = self.dq_handoff(w)
                        cute.arch.barrier_arrive(barrier_id=part.empty, number_of_threads=part.threads)
                done += 1
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def reduce_chunk(self, g: BwdGlobals, sdQ, gdQaccum, tile: WorkTile, head, blocks, block_range: BlockRange,
                     seqlen: SeqlenInfo, m_block, tile_idx, lane, w: cutlass.Constexpr[int]):
        """Once part w of sdQ is stored (its DQ_FULL: the whole tile, or with the
        per-warpgroup hand-off warpgroup w's half), lane 0 reduce-adds it into the same
        part of the query block's dQ_accum chunk (with the deterministic backward, whose
        sdQ is one part, in its KV block's turn)."""
        n_block = tile.block
        size = self.tile_m * self.head_dim // self.dq_parts
        part = self.dq_handoff(w)
        cute.arch.barrier(barrier_id=part.full, number_of_threads=part.threads)
        if lane == 0:
            if self.in_sequence(m_block, seqlen):
                if cutlass.const_expr(self.deterministic):
                    # KV blocks add into a dQ tile in increasing n_block order; the ones
                    # that visit a query block are a contiguous range from the forward's
                    # n_block_min (0 unless a sliding window bounds the left side), or
                    # with a mask mod the ones its block mask lists (their count below
                    # n_block: the transposed mask's dq_turn)
                    turn_ptr = g.dq_semaphore[None, head, seqlen.batch].iterator + tile_idx
                    if cutlass.const_expr(blocks is not None):
                        turn = g.sparse[4][tile.batch, head, n_block, m_block]
                    else:
                        first_n_block, _ = block_range.n_block_min_max(seqlen, m_block)
                        turn = n_block - first_n_block
                    semaphore.wait_turn(turn_ptr, turn)
                bulk_reduce_add_f32(sdQ.iterator + w * size, gdQaccum[None, tile_idx].iterator + w * size, size * 4)
                cute.arch.cp_async_bulk_commit_group()
                if cutlass.const_expr(self.deterministic):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    semaphore.pass_turn(turn_ptr)
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    # ------------------------------------------------------------------------------------
    # Consumers: the five GEMMs, P and dS in registers, dK/dV epilogue
    # ------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self, g: BwdGlobals, layouts: BwdLayouts, smem: BwdSmem, pipes: BwdPipelines, tile: WorkTile,
        group, block_range: BlockRange, seqlen: SeqlenInfo, window: Window, score: ScoreScale, tidx,
    ):
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_first_thread = cute.make_layout(self.num_mma_wg, stride=128)(wg_idx)
        wg_mma_sdp = layouts.mma_sdp.get_slice(wg_first_thread)
        wg_mma_dkv = layouts.mma_dkv.get_slice(wg_first_thread)
        # with a single dQ warpgroup only warpgroup 0 uses these partitions
        wg_mma_dq = layouts.mma_dq.get_slice(wg_first_thread if self.dq_wgs > 1 else 0)

        n_block, head_kv = tile.block, tile.head
        dkv_shape = wg_mma_dkv.partition_shape_C((self.tile_n, self.head_dim))
        ops = StepOperands(
            tSrK=wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(smem.k)),
            tSrQ=wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(smem.q)),
            tdPrV=wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(smem.v)),
            tdPrdO=wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(smem.do)),
            # B operands of dV, dK and dQ: dO^T, Q^T and K^T
            tdVrdO=wg_mma_dkv.make_fragment_B(wg_mma_dkv.partition_B(mma_sm90.transpose_view(smem.do))),
            tdKrQ=wg_mma_dkv.make_fragment_B(wg_mma_dkv.partition_B(mma_sm90.transpose_view(smem.q))),
            # (with ds_stages 2, a last mode for the sdS buffer: indexed by the step's stage)
            # dQ's A = dS and B = K^T; dq_swapped: dQ^T's A = K^T and B = dS (step swaps them)
            tdQrdS=self.dq_fragment(wg_mma_dq, mma_sm90.transpose_view(smem.ds), is_a=not self.dq_swapped),
            tdQrK=self.dq_fragment(wg_mma_dq, mma_sm90.transpose_view(smem.k), is_a=self.dq_swapped),
            acc_dV=cute.make_rmem_tensor(dkv_shape, Float32),
            acc_dK=cute.make_rmem_tensor(dkv_shape, Float32),
            tdVrP=wg_mma_dkv.make_fragment_A(wg_mma_dkv.partition_A(smem.p)) if self.split_d else None,
            tdKrdS=wg_mma_dkv.make_fragment_A(wg_mma_dkv.partition_A(smem.ds)) if self.split_d else None,
        )
        acc_dV, acc_dK = ops.acc_dV, ops.acc_dK
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)

        mask = AttentionMask(self.tile_m, self.tile_n, seqlen, window)
        m_block_min, m_block_max = block_range.m_block_min_max(seqlen, n_block)
        # masked steps: the query blocks cutting the window's right edge (the diagonal),
        # then unmasked ones, then those cutting its left edge; all of them in the KV tile
        # that runs past seqlen_k
        right_end = block_range.m_block_right_mask_end(seqlen, n_block, m_block_min, m_block_max)
        if (n_block + 1) * self.tile_n > seqlen.seqlen_k:
            right_end = m_block_max
        left_start = block_range.m_block_left_mask_start(seqlen, n_block, right_end, m_block_max)

        pipes.kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        do_state = None  # dO's stage is Q's; else its own ring's state (as produce's)
        if cutlass.const_expr(self.own_do_ring):
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        step = (n_block, ops, layouts, smem, pipes, score.scale_log2, score.softcap_pre, tidx)
        # dK and dV sum over the group's query heads right here, in the accumulators
        for i in cutlass.range(group, unroll=1):
            dq_dest = None
            if cutlass.const_expr(self.dq_atomic):
                # this head's dQ_accum chunks, and the first of this sequence's query blocks
                chunks = cute.local_tile(g.dq_accum[None, head_kv * group + i, seqlen.batch],
                                         (self.tile_m * self.head_dim,), (None,))
                dq_dest = (chunks, dq_accum.chunk_index(seqlen.padded_m_block_offset, 0), seqlen)
            dropout = None
            if cutlass.const_expr(self.features.dropout):
                # the sequence's index, as the forward's tile.batch (seqlen.batch is 0 for varlen)
                dropout = Dropout(g.dropout, tile.batch, head_kv * group + i)
            mods = None
            if cutlass.const_expr(self.features.has_mods):
                # b: the sequence's index for varlen too, as in the forward
                mods = ModTile(self.features.mask_mod, self.features.score_mod, self.tile_m, self.tile_n, seqlen,
                               tile.batch, head_kv * group + i, g.aux, score.softmax_scale)
            if cutlass.const_expr(self.features.mask_mod is not None):
                # the block mask's PARTIAL query blocks take the mod per element; FULL
                # ones (never the KV tile cut by seqlen_k, block_mask.py) none
                blocks, _, count = self.q_blocks(g, tile, head_kv * group + i, block_range, seqlen)
                for j in cutlass.range(blocks.num_partial, unroll=1):
                    self.step(blocks.block(j), state, do_state, *step, mods, mods, dropout, dq_dest, masked=True)
                    state.advance()
                    if cutlass.const_expr(self.own_do_ring):
                        do_state.advance()
                for j in cutlass.range(blocks.num_partial, count, unroll=1):
                    self.step(blocks.block(j), state, do_state, *step, mods, mods, dropout, dq_dest, masked=False)
                    state.advance()
                    if cutlass.const_expr(self.own_do_ring):
                        do_state.advance()
            else:
                for m_block in cutlass.range(m_block_min, right_end, unroll=1):
                    self.step(m_block, state, do_state, *step, mask, mods, dropout, dq_dest, masked=True)
                    state.advance()
                    if cutlass.const_expr(self.own_do_ring):
                        do_state.advance()
                for m_block in cutlass.range(right_end, left_start, unroll=1):
                    self.step(m_block, state, do_state, *step, mask, mods, dropout, dq_dest, masked=False)
                    state.advance()
                    if cutlass.const_expr(self.own_do_ring):
                        do_state.advance()
                if cutlass.const_expr(window.has_left):
                    for m_block in cutlass.range(left_start, m_block_max, unroll=1):
                        self.step(m_block, state, do_state, *step, mask, mods, dropout, dq_dest, masked=True)
                        state.advance()
                        if cutlass.const_expr(self.own_do_ring):
                            do_state.advance()

        # Epilogue: dV and dK leave through sV and sK, which every warpgroup must be done
        # reading (its last dP and dQ WGMMAs) before they are overwritten.
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        epilogue.acc_to_smem(acc_dV, smem.dv, layouts.mma_dkv, tidx, self.out_dtype)
        epilogue.acc_to_smem(acc_dK, smem.dk, layouts.mma_dkv, tidx, self.out_dtype, scale=score.softmax_scale)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        dkv_tile = (self.tile_n, self.head_dim)
        if cutlass.const_expr(self.features.varlen):
            gdV = cute.local_tile(seqlen.rows_k(g.dv_rows, head_kv), dkv_tile, (n_block, 0))
            gdK = cute.local_tile(seqlen.rows_k(g.dk_rows, head_kv), dkv_tile, (n_block, 0))
            keys_left = seqlen.seqlen_k - n_block * self.tile_n
            epilogue.store_rows(smem.dv, gdV, keys_left, tidx, self.num_mma_threads)
            epilogue.store_rows(smem.dk, gdK, keys_left, tidx, self.num_mma_threads)
        else:
            if tidx // 32 == 0:
                gdV = cute.local_tile(seqlen.rows_k(g.dv.tensor, head_kv), dkv_tile, (n_block, 0))
                gdK = cute.local_tile(seqlen.rows_k(g.dk.tensor, head_kv), dkv_tile, (n_block, 0))
                epilogue.tma_store_tile(g.dv.atom, smem.dv, gdV)
                epilogue.tma_store_tile(g.dk.atom, smem.dk, gdK)

    @cute.jit
    def step(
        self, m_block, state, do_state, n_block, ops: StepOperands, layouts: BwdLayouts, smem: BwdSmem,
        pipes: BwdPipelines, scale_log2, softcap_pre, tidx, mask, mods, dropout, dq_dest,
        masked: cutlass.Constexpr[bool],
    ):
        """One query block: the five GEMMs for this CTA's keys. mask: an AttentionMask, or
        with a mask mod the ModTile (mods), which also applies a score mod. dropout: a
        blocks/dropout.Dropout or None. dq_dest: with dq_atomic, (this head's dQ_accum
        chunks, the chunk of query block 0, the SeqlenInfo), else None."""
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = layouts.mma_sdp, layouts.mma_dkv, layouts.mma_dq
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_first_thread = cute.make_layout(self.num_mma_wg, stride=128)(wg_idx)
        wg_mma_sdp = tiled_mma_sdp.get_slice(wg_first_thread)
        wg_mma_dq = tiled_mma_dq.get_slice(wg_first_thread if self.dq_wgs > 1 else 0)
        thr_mma_sdp = tiled_mma_sdp.get_slice(tidx)
        do_ring = state if cutlass.const_expr(do_state is None) else do_state  # BwdConfig.do_stages
        stage, do_stage = state.index, do_ring.index
        acc_shape = wg_mma_sdp.partition_shape_C((self.tile_n, self.tile_m))

        # per-query statistics of this thread's columns, read from smem where used
        tScS = thr_mma_sdp.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m)))
        cols = mma_sm90.acc_as_rows_cols(tScS)
        num_cols = cute.size(cols.shape[1])
        lse2 = ColumnStat(smem.lse2, cols, stage)
        dsum = ColumnStat(smem.dsum, cols, do_stage)

        # S^T and dP^T in flight together
        acc_S = cute.make_rmem_tensor(acc_shape, Float32)
        acc_dP = cute.make_rmem_tensor(acc_shape, Float32)
        pipes.q.consumer_wait(state)
        mma_sm90.gemm(tiled_mma_sdp, acc_S, ops.tSrK, ops.tSrQ[None, None, None, stage], zero_init=True, wait_groups=-1)
        pipes.do.consumer_wait(do_ring)
        mma_sm90.gemm(tiled_mma_sdp, acc_dP, ops.tdPrV, ops.tdPrdO[None, None, None, do_stage], zero_init=True, wait_groups=-1)

        P = mma_sm90.acc_as_rows_cols(acc_S)
        dS = mma_sm90.acc_as_rows_cols(acc_dP)
        warpgroup.wait_group(1)
        # a softcap or a score mod rewrites S^T, and its derivative joins dS^T
        score_grad = self.features.softcap or self.features.score_mod is not None
        if cutlass.const_expr(dropout is not None and score_grad):
            # dropout with a score derivative: dP^T through the dropout mask first (dropped
            # 0, kept / (1 - p)), so the derivative folds into dP^T - D below as without
            # dropout; P^T takes the mask after dS^T = P^T * that (a second Philox pass)
            warpgroup.wait_group(0)
            dropout.apply(acc_dP, tScS, n_block * self.tile_n, m_block * self.tile_m)
            acc_dP.store(acc_dP.load() * dropout.inv_keep)
        if cutlass.const_expr(self.features.softcap):
            softcap_scores(acc_S, softcap_pre)
            warpgroup.wait_group(0)
            # fold the tanh's derivative 1 - tanh^2 into dP^T - D while S^T still holds the
            # tanh values (the mask turns them into -inf); no extra registers that way
            for c in cutlass.range_constexpr(num_cols):
                dsum_c = dsum[c]
                for r in cutlass.range_constexpr(cute.size(dS.shape[0])):
                    dS[r, c] = (dS[r, c] - dsum_c) * (1.0 - P[r, c] * P[r, c])
        if cutlass.const_expr(self.features.score_mod is not None):
            warpgroup.wait_group(0)
            mods.apply_score_grad(acc_S, acc_dP, dsum, tScS, m_block, n_block, keys_on_rows=True)
        if cutlass.const_expr(masked):
            mask.apply(acc_S, tScS, m_block, n_block, keys_on_rows=True)
        probs_from_lse(acc_S, lse2, scale_log2)
        if cutlass.const_expr(dropout is not None and not score_grad):
            # the forward's mask again, as a sign: P < 0 marks a dropped element
            dropout.apply(acc_S, tScS, n_block * self.tile_n, m_block * self.tile_m, negate=True)
        # dS^T = P^T * (dP^T - D) (* the softcap's or score mod's derivative, folded in above)
        rP = cute.make_rmem_tensor_like(acc_S, self.p_dtype)
        # P^T is final before dP^T is needed only on the plain path (BwdConfig.dp_wait_after_exp2)
        p_before_dp = dropout is None and not score_grad and self.dp_wait_after_exp2
        if cutlass.const_expr(dropout is not None and not score_grad):
            # dropout: dP^T reaches the kept P scaled by 1 / (1 - p), a dropped one not at
            # all; with the sign as the mask, dS = P (dP / (1 - p) - D) kept, (-P) D dropped
            warpgroup.wait_group(0)
            for c in cutlass.range_constexpr(num_cols):
                dsum_c = dsum[c]
                for r in cutlass.range_constexpr(cute.size(dS.shape[0])):
                    kept = P[r, c] >= 0.0
                    dS[r, c] = P[r, c] * (dS[r, c] * dropout.inv_keep - dsum_c) if kept else P[r, c] * dsum_c
                    P[r, c] = P[r, c] * dropout.inv_keep if kept else Float32(0.0)  # dV's P^T
        elif cutlass.const_expr(score_grad):
            for r in cutlass.range_constexpr(cute.size(dS.shape[0])):
                for c in cutlass.range_constexpr(num_cols):
                    dS[r, c] = P[r, c] * dS[r, c]
            if cutlass.const_expr(dropout is not None):
                # dV's P^T: the kept scaled by 1 / (1 - p), the dropped 0
                dropout.apply(acc_S, tScS, n_block * self.tile_n, m_block * self.tile_m)
                acc_S.store(acc_S.load() * dropout.inv_keep)
        else:
            if cutlass.const_expr(p_before_dp):
                # converted before the wait, P^T's words hold the wait below every exp2
                rP.store(acc_S.load().to(self.p_dtype))
                mma_sm90.wait_all_groups_after(mma_sm90.or_of_words(rP))
            else:
                warpgroup.wait_group(0)
            for c in cutlass.range_constexpr(num_cols):
                dsum_c = dsum[c]
                for r in cutlass.range_constexpr(cute.size(dS.shape[0])):
                    dS[r, c] = P[r, c] * (dS[r, c] - dsum_c)
        if cutlass.const_expr(not p_before_dp):
            rP.store(acc_S.load().to(self.p_dtype))
        rdS = cute.make_rmem_tensor_like(acc_dP, self.p_dtype)
        rdS.store(acc_dP.load().to(self.p_dtype))

        # dq_swapped's BwdConfig.dq_order: dK's WGMMA issued after dQ^T's (the store of
        # dQ^T to sdQ then runs under it)
        dk_after_dq = self.dq_swapped and self.dq_order == "before_dk"
        if cutlass.const_expr(self.split_d):
            # P^T and dS^T to smem: every warpgroup's dV/dK needs all keys x all queries
            self.wait_ds_free()
            epilogue.regs_to_smem(rP, smem.p, tiled_mma_sdp, tidx)
            epilogue.regs_to_smem(rdS, smem.ds, tiled_mma_sdp, tidx)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(NamedBarrier.DS_READY), number_of_threads=self.num_mma_threads)
            mma_sm90.gemm(tiled_mma_dkv, ops.acc_dV, ops.tdVrP, ops.tdVrdO[None, None, None, do_stage], wait_groups=-1)
        else:
            mma_sm90.gemm(tiled_mma_dkv, ops.acc_dV, mma_sm90.acc_as_operand_a(rP), ops.tdVrdO[None, None, None, do_stage], wait_groups=-1)
            if cutlass.const_expr(not dk_after_dq):
                self.mma_dk(ops, tiled_mma_dkv, rdS, stage)

            # dS^T to shared memory for dQ = dS K, which needs every warpgroup's keys
            sdS = smem.ds
            if cutlass.const_expr(self.ds_stages > 1):
                sdS = smem.ds[None, None, stage]  # free: read by the dQ of two steps back
            else:
                self.wait_ds_free()
            epilogue.regs_to_smem(rdS, sdS, tiled_mma_sdp, tidx, transpose=self.dq_swapped)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(NamedBarrier.DS_READY), number_of_threads=self.num_mma_threads)

        # with dq_swapped and every warpgroup computing dQ^T, no run-time branch: with it,
        # ptxas spilled 12 bytes for "after_dv" (a reload per step) and serialised every
        # WGMMA of the kernel for "before_dk" (C7512)
        is_dq_wg = wg_idx < self.dq_wgs
        if cutlass.const_expr(self.dq_swapped and self.dq_wgs == self.num_mma_wg):
            is_dq_wg = True
        if is_dq_wg:
            dq_shape = dq_accum.mma_shape(self.tile_m, self.head_dim, self.dq_swapped)
            acc_dQ = cute.make_rmem_tensor(wg_mma_dq.partition_shape_C(dq_shape), Float32)
            tdQrdS = ops.tdQrdS
            if cutlass.const_expr(self.ds_stages > 1):
                tdQrdS = ops.tdQrdS[None, None, None, stage]
            if cutlass.const_expr(self.split_d):
                mma_sm90.gemm(tiled_mma_dq, acc_dQ, tdQrdS, ops.tdQrK, zero_init=True, wait_groups=-1)
                mma_sm90.gemm(tiled_mma_dkv, ops.acc_dK, ops.tdKrdS, ops.tdKrQ[None, None, None, stage], wait_groups=1)
                if cutlass.const_expr(self.own_do_ring):
                    # dV's WGMMA (dO's last reader) retired, D was read for dS^T: the next
                    # block's dO loads under dK's WGMMA and the dQ reduction
                    release_after_loads((pipes.do, do_ring))
            elif cutlass.const_expr(self.dq_swapped and self.dq_order == "after_dkv"):
                # dV and dK have read P^T and dS^T before dQ^T's accumulator is live: with
                # P^T, dS^T (20 registers each at 80 queries), dK, dV (128) and dQ^T (40)
                # all held, ptxas serialised every WGMMA of the kernel (C7512)
                warpgroup.wait_group(0)
                mma_sm90.gemm(tiled_mma_dq, acc_dQ, ops.tdQrK, tdQrdS, zero_init=True, wait_groups=0)
            elif cutlass.const_expr(self.dq_swapped and self.dq_order == "after_dv"):
                warpgroup.wait_group(1)  # dV's: P^T free; dK still reads dS^T
                mma_sm90.gemm(tiled_mma_dq, acc_dQ, ops.tdQrK, tdQrdS, zero_init=True, wait_groups=0)
            elif cutlass.const_expr(self.dq_swapped):  # "before_dk"
                warpgroup.wait_group(0)  # dV's: P^T free before dQ^T's accumulator is live
                mma_sm90.gemm(tiled_mma_dq, acc_dQ, ops.tdQrK, tdQrdS, zero_init=True, wait_groups=-1)
                self.mma_dk(ops, tiled_mma_dkv, rdS, stage)
                warpgroup.wait_group(1)  # dQ^T's; dK runs under its store to sdQ
            else:
                mma_sm90.gemm(tiled_mma_dq, acc_dQ, tdQrdS, ops.tdQrK, zero_init=True, wait_groups=0)
            if cutlass.const_expr(self.ds_stages > 1):
                # only sdQ (this warpgroup's part of it) to wait for now
                own = self.dq_handoff(wg_idx if cutlass.const_expr(self.dq_handoff_per_wg) else 0)
                cute.arch.barrier(barrier_id=own.empty, number_of_threads=own.threads)
            if cutlass.const_expr(self.dq_atomic):
                chunks, chunk0, seqlen = dq_dest
                if self.in_sequence(m_block, seqlen):
                    dq_accum.add_from_registers(acc_dQ, chunks[None, chunk0 + m_block], tidx)
            else:
                for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                    smem.dq[dq_accum.offset(i, tidx, cute.size(acc_dQ))] = acc_dQ[i]
                cute.arch.fence_view_async_shared()
            if cutlass.const_expr(self.split_d or dk_after_dq):
                # dK's WGMMA reads this stage's Q and sdS: done before the stage
                # is released below and before sdS is rewritten (the local compile caught
                # its absence)
                warpgroup.wait_group(0)
        else:
            if cutlass.const_expr(dk_after_dq and self.dq_wgs < self.num_mma_wg):
                self.mma_dk(ops, tiled_mma_dkv, rdS, stage)
            warpgroup.wait_group(0)
        # every WGMMA reading this stage's Q and dO has completed, and this thread's loads
        # of its LSE2 and D are done (release_after_loads says why it syncs the warp)
        if cutlass.const_expr(self.own_do_ring):
            release_after_loads((pipes.q, state))
        else:
            release_after_loads((pipes.q, state), (pipes.do, do_ring))
        if cutlass.const_expr(not self.dq_atomic):
            own = self.dq_handoff(wg_idx if cutlass.const_expr(self.dq_handoff_per_wg) else 0)
            cute.arch.barrier_arrive(barrier_id=own.full, number_of_threads=own.threads)

    @staticmethod
    def mma_dk(ops: StepOperands, tiled_mma_dkv, rdS, stage):
        """dK += dS^T Q, dS^T from this warpgroup's registers, issued and committed."""
        mma_sm90.gemm(tiled_mma_dkv, ops.acc_dK, mma_sm90.acc_as_operand_a(rdS), ops.tdKrQ[None, None, None, stage], wait_groups=-1)

    def sds_shape(self) -> tuple:
        """sdS's stored (rows, cols): dS^T's (tile_n, tile_m), or with dq_swapped dS's."""
        return (self.tile_m, self.tile_n) if self.dq_swapped else (self.tile_n, self.tile_m)

    def keys_by_queries(self, sdS: cute.Tensor) -> cute.Tensor:
        """sdS as stored (sds_shape) seen as dS^T, (tile_n, tile_m[, buffers]), the shape
        its writes (regs_to_smem, transposed with dq_swapped) and reads partition."""
        return mma_sm90.transpose_view(sdS) if self.dq_swapped else sdS

    @staticmethod
    def dq_fragment(wg_mma_dq, t: cute.Tensor, is_a: bool) -> cute.Tensor:
        """A WGMMA descriptor fragment of the dQ MMA's A (is_a) or B operand from t."""
        if is_a:
            return wg_mma_dq.make_fragment_A(wg_mma_dq.partition_A(t))
        return wg_mma_dq.make_fragment_B(wg_mma_dq.partition_B(t))

    @cute.jit
    def in_sequence(self, m_block, seqlen: SeqlenInfo):
        """Whether query block m_block has rows in the sequence, i.e. its dQ_accum chunk
        (and turn counter) exist. Always, but for varlen with a mask mod whose block-mask
        lists outlived offsets rewritten behind torch's version counter (blocks/seqlen.py):
        such a step still runs, its dQ goes nowhere."""
        inside = True
        if cutlass.const_expr(self.features.varlen and self.features.mask_mod is not None):
            inside = m_block * self.tile_m < seqlen.seqlen_q
        return inside

    @cute.jit
    def wait_ds_free(self):
        """Before sdS (and sP) are rewritten: every warpgroup's WGMMAs of the previous step
        that read them have completed (each consumer waits on its own before arriving).
        The dQ writer's DQ_EMPTY also says sdQ is free again; with dQ atomics there is no
        sdQ and no writer, so the consumers meet among themselves. With two sdS buffers
        (BwdConfig.ds_stages) the consumers wait on their sdQ part's DQ_EMPTY (dq_handoff)
        before the sdQ stores instead."""
        if cutlass.const_expr(self.dq_atomic):
            cute.arch.barrier(barrier_id=int(NamedBarrier.DS_FREE), number_of_threads=self.num_mma_threads)
        else:
            joint = self.dq_handoff(0)  # (one sdS buffer: never the per-warpgroup hand-off)
            cute.arch.barrier(barrier_id=joint.empty, number_of_threads=joint.threads)


class FlashBwdSm90Mods(FlashBwdSm90):
    """The backward with mask and/or score mods (AttnFeatures.mask_mod / score_mod,
    cute_attn/masks.py): the dense kernel walking a transposed block mask's query-tile
    lists (a mask mod), applying the mods per element and the score mod's derivative
    (blocks/mods.ModTile.apply_score_grad). The aux tensors arrive as one tuple, the mask
    mod's first; a call without aux tensors passes one stand-in."""

    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
        mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdQsemaphore: cute.Tensor,
        mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
        mPartialCount: cute.Tensor,  # (batch, heads, tiles_n) int32: a transposed block_mask.BlockMask
        mPartialIdx: cute.Tensor,  # (batch, heads, tiles_n, tiles_m) int32
        mFullCount: cute.Tensor,
        mFullIdx: cute.Tensor,
        mDqTurn: cute.Tensor,  # (batch, heads, tiles_n, tiles_m) int32: deterministic dQ turns
        aux: tuple,
        mDropoutSeed: cute.Tensor,  # (2,) int32 Philox key (AttnFeatures.dropout), else a stand-in
        dropout_threshold: Int32,
        dropout_inv_keep: Float32,
        max_seqlen_k: Int32,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
    ):
        self.launch(mQ, mK, mV, mdO, mLSE2, mD, mdQaccum, mdK, mdV, mdQsemaphore, mCuSeqlensQ, mCuSeqlensK,
                    max_seqlen_k, softmax_scale, softcap, window_left, window_right, stream,
                    sparse=(mPartialCount, mPartialIdx, mFullCount, mFullIdx, mDqTurn), aux=aux,
                    dropout=DropoutArgs(mDropoutSeed, dropout_threshold, dropout_inv_keep))
