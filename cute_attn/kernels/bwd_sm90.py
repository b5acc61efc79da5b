"""Attention backward for Hopper (sm_90a): warp-specialized TMA + WGMMA, FlashAttention-3 style.

Given Q, K, V, dO and the forward's LSE, computes dK and dV for one (n_block, head, batch)
tile of keys per CTA, and adds that tile's share of dQ into an fp32 accumulator. Three
kernels run in order (the other two are in kernels/bwd_prepost.py):
  1. preprocess: D = rowsum(dO * O) and LSE * log2(e), padded to whole query tiles;
  2. this kernel;
  3. postprocess: dQ = softmax_scale * dQ_accum, converted to the input dtype.

Everything is computed transposed, keys on rows, so that the two products that need P and
dS as their A operand (dV += P^T dO and dK += dS^T Q) take them straight from registers:
  S^T  = K Q^T          (A = K from smem, B = Q)        P^T  = exp2(S^T * scale_log2 - LSE2)
  dP^T = V dO^T         (A = V,           B = dO)       dS^T = P^T * (dP^T - D)
  dV  += P^T dO         (A = P^T registers, B = dO^T view of the dO tile)
  dK  += dS^T Q         (A = dS^T registers, B = Q^T view)
  dQ   = dS K           (A = dS^T written to smem, read MN-major; B = K^T view)
LSE2 and D are per query, i.e. per column of the S^T tile.

Warp roles (128 * (1 + tile_n / 64) threads):
  * warpgroup 0, the producer (setmaxnreg 24): warp 0 issues the TMA loads (K and V once;
    then per query block Q with its LSE2 chunk, and dO with its D chunk, into
    `num_stages`-deep rings); warp 1 is the dQ writer: it adds each finished dQ tile from
    shared memory to global memory with one bulk reduce-add (cp.reduce.async.bulk .add.f32).
  * warpgroups 1.. (setmaxnreg 240): each owns 64 keys of the tile and keeps their dK and
    dV accumulators in registers across the whole loop over query blocks.

Barrier protocol per query block (named barriers, see blocks/barriers.py):
  consumers: ... wait DQ_EMPTY (the writer is done reading sdQ, and so every warpgroup has
             finished the previous dQ WGMMA that read sdS) -> write dS^T to sdS -> DS_READY
             (all rows of dS are in smem) -> dQ WGMMA -> write dQ to sdQ -> arrive DQ_FULL
  writer:    wait DQ_FULL -> bulk reduce-add sdQ into dQ_accum -> wait until read -> arrive
             DQ_EMPTY
dQ_accum is laid out per query tile in the order of the dQ WGMMA's accumulator fragments
(see `dq_accum_offset`), so each thread's stores to sdQ are conflict-free and the reduce
is one contiguous chunk; the postprocess undoes the permutation.

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

Varlen (blocks/seqlen.py): tiles past a sequence's keys exit at once; LSE2, D and dQ_accum
are padded per sequence to whole query tiles; dK and dV leave row by row (not by TMA) so
a partial tile never writes into the next sequence.

Constraints: head_dim in {64, 96, 128} (at 96 warpgroup 0 alone computes dQ, see
BwdConfig.dq_warpgroups); fp16 or bf16 in, fp32 accumulation.
Read the PTX without a GPU: python -m cute_attn ptx --kernel bwd --headdim 128 [--causal]
"""

import math
from typing import Type

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from cute_attn.blocks import epilogue, mma_sm90, semaphore
from cute_attn.blocks.barriers import NamedBarrier
from cute_attn.blocks.block_range import BlockRange
from cute_attn.blocks.bulk_copy import bulk_load, bulk_reduce_add_f32
from cute_attn.blocks.mask import AttentionMask, Window
from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.softmax import ColumnStat, probs_from_lse, softcap_scores
from cute_attn.blocks.tile_scheduler import SingleTileScheduler
from cute_attn.blocks.tma_pipeline import make_tma_pipeline
from cute_attn.config import AttnFeatures, BwdConfig

_PRODUCER_REGS, _MMA_REGS = 24, 240


def make_dq_mma(dtype, head_dim: int, num_warpgroups: int) -> cute.TiledMma:
    """dQ = dS K for one query tile: M = tile_m (64), N = head_dim split across the
    warpgroups, K = tile_n; A (dS) is MN-major in smem, B (K^T) MN-major."""
    return mma_sm90.make_tiled_mma(
        dtype, OperandMajorMode.MN, head_dim // num_warpgroups, num_warpgroups,
        a_major=OperandMajorMode.MN, warpgroups_along_n=True,
    )


def dq_accum_offset(i: int, tidx, num_threads: int):
    """Where accumulator register i of thread tidx lives in a dQ_accum tile chunk: pairs of
    registers (adjacent columns) are interleaved across threads, so a warp's 8-byte stores
    fill 256 contiguous bytes."""
    return (i // 2) * (2 * num_threads) + tidx * 2 + (i % 2)


def _tma_partition_one_cta(atom, s, g):
    """TMA partition of a 2-D tile (no multicast): (shared, global) views."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))


class FlashBwdSm90:
    def __init__(
        self, dtype: Type[cutlass.Numeric], head_dim: int, features: AttnFeatures, config: BwdConfig,
        deterministic: bool = False,
    ):
        self.dtype = dtype
        self.deterministic = deterministic
        self.head_dim = head_dim
        self.features = features
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.num_stages = config.num_stages
        self.num_mma_wg = config.num_mma_warpgroups
        self.num_threads = config.num_threads
        self.num_mma_threads = 128 * self.num_mma_wg
        self.dq_wgs = config.dq_warpgroups
        self.num_dq_threads = 128 * self.dq_wgs
        # the head_dim columns of dK, dV and dQ one CTA produces (see BwdConfig.d_slice)
        self.d_slice = config.d_slice or head_dim
        self.num_d_slices = head_dim // self.d_slice

    @cute.jit
    def __call__(
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
    ):
        to_sdhb = [1, 3, 2, 0]
        mQ, mK, mV, mdO, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=to_sdhb))
            for t in (mQ, mK, mV, mdO, mdK, mdV)
        ]
        mLSE2, mD, mdQaccum, mdQsemaphore = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))
            for t in (mLSE2, mD, mdQaccum, mdQsemaphore)
        ]
        d, wgs = self.head_dim, self.num_mma_wg
        # S^T = K Q^T and dP^T = V dO^T: each warpgroup 64 keys x tile_m queries
        tiled_mma_sdp = mma_sm90.make_tiled_mma(self.dtype, OperandMajorMode.K, self.tile_m, wgs)
        # dV += P^T dO and dK += dS^T Q: A from registers, B = dO^T / Q^T (head_dim contiguous)
        tiled_mma_dkv = mma_sm90.make_tiled_mma(
            self.dtype, OperandMajorMode.MN, self.d_slice, wgs, a_in_registers=True
        )
        tiled_mma_dq = make_dq_mma(self.dtype, self.d_slice, self.dq_wgs)

        sQ_layout = mma_sm90.make_smem_layout(self.dtype, self.tile_m, d, self.num_stages)
        sK_layout = mma_sm90.make_smem_layout(self.dtype, self.tile_n, d)
        # dS^T stored keys x queries with queries contiguous: read back MN-major as dS's A
        sdS_layout = mma_sm90.make_smem_layout(self.dtype, self.tile_n, self.tile_m)
        # dK / dV leave through sK / sV, seen as tile_n x d_slice tiles
        sdKV_layout = mma_sm90.make_smem_layout(self.dtype, self.tile_n, self.d_slice)

        load_op, store_op = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        q_tile = cute.select(sQ_layout, mode=[0, 1])
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, q_tile, (self.tile_m, d), 1)
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(load_op, mdO, q_tile, (self.tile_m, d), 1)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, sK_layout, (self.tile_n, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, sK_layout, (self.tile_n, d))
        dkv_tile = (self.tile_n, self.d_slice)
        tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(store_op, mdK, sdKV_layout, dkv_tile)
        tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(store_op, mdV, sdKV_layout, dkv_tile)
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, q_tile) + self.tile_m * 4
        self.tma_bytes_kv = 2 * cute.size_in_bytes(self.dtype, sK_layout)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_do: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.num_stages], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.num_stages], 128]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.d_slice], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]

        self.shared_storage = SharedStorage

        if cutlass.const_expr(self.features.varlen):
            num_n_blocks = cute.ceil_div(max_seqlen_k, self.tile_n)
            batch = cute.size(mCuSeqlensQ.shape[0]) - 1
        else:
            num_n_blocks = cute.ceil_div(cute.size(mK.shape[0]), self.tile_n)
            batch = cute.size(mK.shape[3])
        # one CTA per (KV block, head_dim slice, KV head, batch)
        grid = SingleTileScheduler.grid(num_n_blocks * self.num_d_slices, cute.size(mK.shape[2]), batch)
        if cutlass.const_expr(self.features.softcap):
            scale_log2 = softcap * math.log2(math.e)
            softcap_pre = softmax_scale / softcap
        else:
            scale_log2 = softmax_scale * math.log2(math.e)
            softcap_pre = Float32(1.0)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_dK, tma_dV, mdK, mdV, mLSE2, mD, mdQaccum, mdQsemaphore,
            mCuSeqlensQ, mCuSeqlensK,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_dK, tma_atom_dV,
            softmax_scale, scale_log2, softcap_pre, window_left, window_right,
            sQ_layout, sK_layout, sdS_layout, sdKV_layout, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
        mdK: cute.Tensor, mdV: cute.Tensor, mdK_rows: cute.Tensor, mdV_rows: cute.Tensor,
        mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdQsemaphore: cute.Tensor,
        mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
        tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
        tma_atom_dO: cute.CopyAtom, tma_atom_dK: cute.CopyAtom, tma_atom_dV: cute.CopyAtom,
        softmax_scale: Float32,
        scale_log2: Float32,
        softcap_pre: Float32,
        window_left: Int32,
        window_right: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdKV_layout: cute.ComposedLayout,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_dK, tma_atom_dV):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipeline_kv = make_tma_pipeline(storage.mbar_kv.data_ptr(), 1, self.tma_bytes_kv, self.num_mma_threads)
        pipeline_q = make_tma_pipeline(storage.mbar_q.data_ptr(), self.num_stages, self.tma_bytes_q, self.num_mma_threads)
        pipeline_do = make_tma_pipeline(storage.mbar_do.data_ptr(), self.num_stages, self.tma_bytes_q, self.num_mma_threads)
        pipeline_init_arrive(is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        stats_layout = cute.make_layout((self.tile_m, self.num_stages))
        sLSE2 = storage.sLSE2.get_tensor(stats_layout)
        sD = storage.sD.get_tensor(stats_layout)
        sdQ = storage.sdQ.get_tensor(cute.make_layout(self.tile_m * self.d_slice))
        # the epilogue's views of the K and V buffers
        sdK = storage.sK.get_tensor(sdKV_layout.outer, swizzle=sdKV_layout.inner)
        sdV = storage.sV.get_tensor(sdKV_layout.outer, swizzle=sdKV_layout.inner)

        # n_block 0 sees the most query blocks under a causal mask, and grid order already
        # launches it first, so no reordering
        scheduler = SingleTileScheduler(longest_first=False)
        tile = self.tile(scheduler)
        n_block, _, head_kv, batch = tile
        seqlen = SeqlenInfo(
            batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, self.features.varlen,
            tile_m_padded=self.tile_m,
        )
        window = Window(self.features.mask, window_left, window_right)
        block_range = BlockRange(self.tile_m, self.tile_n, window)
        # GQA: the query heads head_kv * group + [0, group) share this KV head
        group = mQ.shape[2] // mK.shape[2]
        pipeline_init_wait()

        # varlen: the grid covers the longest key sequence; a tile past this one's end
        # has no keys (uniform across the CTA)
        if not self.features.varlen or n_block * self.tile_n < seqlen.seqlen_k:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
                if warp_idx == 0:
                    self.produce(
                        mQ, mK, mV, mdO, mLSE2, mD, sQ, sK, sV, sdO, sLSE2, sD,
                        tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO,
                        pipeline_kv, pipeline_q, pipeline_do, tile, group, block_range, seqlen,
                    )
                if warp_idx == 1:
                    self.write_dq(mdQaccum, mdQsemaphore, sdQ, tile, group, block_range, seqlen)
            else:
                cute.arch.setmaxregister_increase(_MMA_REGS)
                self.consume(
                    mdK, mdV, mdK_rows, mdV_rows, sQ, sK, sV, sdO, sdS, sLSE2, sD, sdQ, sdK, sdV,
                    tma_atom_dK, tma_atom_dV, pipeline_kv, pipeline_q, pipeline_do,
                    tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, tile, group, block_range, seqlen,
                    window, softmax_scale, scale_log2, softcap_pre, tidx - 128,
                )

    # ------------------------------------------------------------------------------------
    # Producer warp: TMA loads
    # ------------------------------------------------------------------------------------
    @cute.jit
    def produce(
        self, mQ, mK, mV, mdO, mLSE2, mD, sQ, sK, sV, sdO, sLSE2, sD,
        tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO,
        pipeline_kv, pipeline_q, pipeline_do, tile, group, block_range, seqlen,
    ):
        n_block, _, head_kv, _ = tile
        d = self.head_dim
        partition = _tma_partition_one_cta
        gK = cute.local_tile(seqlen.rows_k(mK, head_kv), (self.tile_n, d), (n_block, 0))
        gV = cute.local_tile(seqlen.rows_k(mV, head_kv), (self.tile_n, d), (n_block, 0))
        tKsK, tKgK = partition(tma_atom_K, sK, gK)
        tVsV, tVgV = partition(tma_atom_V, sV, gV)
        stats_bytes = self.tile_m * 4
        # the padded per-row statistics: this sequence's query blocks start here
        stats_block0 = seqlen.padded_m_block_offset
        lane = cute.arch.lane_idx()

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipeline_kv.producer_acquire(kv_state)
        kv_bar = pipeline_kv.producer_get_barrier(kv_state)
        cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=kv_bar)
        cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=kv_bar)

        m_block_min, m_block_max = block_range.m_block_min_max(seqlen, n_block)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            gQ = cute.local_tile(seqlen.rows_q(mQ, head), (self.tile_m, d), (None, 0))
            gdO = cute.local_tile(seqlen.rows_q(mdO, head), (self.tile_m, d), (None, 0))
            tQsQ, tQgQ = partition(tma_atom_Q, sQ, gQ)
            tdOsdO, tdOgdO = partition(tma_atom_dO, sdO, gdO)
            gLSE2 = cute.local_tile(mLSE2[None, head, seqlen.batch], (self.tile_m,), (None,))
            gD = cute.local_tile(mD[None, head, seqlen.batch], (self.tile_m,), (None,))
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                pipeline_q.producer_acquire(state)
                bar = pipeline_q.producer_get_barrier(state)
                cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar)
                # one lane: every lane's copy would complete the barrier's bytes again
                if lane == 0:
                    bulk_load(gLSE2[None, stats_block0 + m_block].iterator, sLSE2[None, state.index].iterator, bar, stats_bytes)
                pipeline_do.producer_acquire(state)
                bar = pipeline_do.producer_get_barrier(state)
                cute.copy(tma_atom_dO, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=bar)
                if lane == 0:
                    bulk_load(gD[None, stats_block0 + m_block].iterator, sD[None, state.index].iterator, bar, stats_bytes)
                state.advance()

    # ------------------------------------------------------------------------------------
    # dQ writer warp: adds each query block's dQ tile into dQ_accum
    # ------------------------------------------------------------------------------------
    @cute.jit
    def write_dq(self, mdQaccum, mdQsemaphore, sdQ, tile, group, block_range, seqlen):
        n_block, d_block, head_kv, _ = tile
        chunk = self.tile_m * self.d_slice
        m_block_min, m_block_max = block_range.m_block_min_max(seqlen, n_block)
        num_m_blocks = m_block_max - m_block_min
        barrier_threads = self.num_mma_threads + 32
        lane = cute.arch.lane_idx()
        if num_m_blocks > 0:
            # sdQ (and sdS) start out free
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.DQ_EMPTY), number_of_threads=barrier_threads)
        # the consumers' order: every query block of the group's first head, then the next
        for it in cutlass.range(group * num_m_blocks, unroll=1):
            head = head_kv * group + it // num_m_blocks
            m_block = m_block_min + it % num_m_blocks
            cute.arch.barrier(barrier_id=int(NamedBarrier.DQ_FULL), number_of_threads=barrier_threads)
            # dQ_accum chunks: query block major (padded per sequence), head_dim slice minor
            tile_idx = (seqlen.padded_m_block_offset + m_block) * self.num_d_slices + d_block
            gdQaccum = cute.local_tile(mdQaccum[None, head, seqlen.batch], (chunk,), (None,))
            if lane == 0:
                if cutlass.const_expr(self.deterministic):
                    # KV blocks add into a dQ tile in increasing n_block order; the ones
                    # that visit a query block are a contiguous range from the forward's
                    # n_block_min (0 unless a sliding window bounds the left side)
                    turn_ptr = mdQsemaphore[None, head, seqlen.batch].iterator + tile_idx
                    first_n_block, _ = block_range.n_block_min_max(seqlen, m_block)
                    semaphore.wait_turn(turn_ptr, n_block - first_n_block)
                bulk_reduce_add_f32(sdQ.iterator, gdQaccum[None, tile_idx].iterator, chunk * 4)
                cute.arch.cp_async_bulk_commit_group()
                if cutlass.const_expr(self.deterministic):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    semaphore.pass_turn(turn_ptr)
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            if it + 1 < group * num_m_blocks:
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.DQ_EMPTY), number_of_threads=barrier_threads)
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    # ------------------------------------------------------------------------------------
    # Consumers: the five GEMMs, P and dS in registers, dK/dV epilogue
    # ------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self, mdK, mdV, mdK_rows, mdV_rows, sQ, sK, sV, sdO, sdS, sLSE2, sD, sdQ, sdK, sdV,
        tma_atom_dK, tma_atom_dV, pipeline_kv, pipeline_q, pipeline_do,
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, tile, group, block_range, seqlen,
        window, softmax_scale, scale_log2, softcap_pre, tidx,
    ):
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_first_thread = cute.make_layout(self.num_mma_wg, stride=128)(wg_idx)
        wg_mma_sdp = tiled_mma_sdp.get_slice(wg_first_thread)
        wg_mma_dkv = tiled_mma_dkv.get_slice(wg_first_thread)
        # with a single dQ warpgroup only warpgroup 0 uses these partitions
        wg_mma_dq = tiled_mma_dq.get_slice(wg_first_thread if self.dq_wgs > 1 else 0)

        tSrK = wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(sK))
        tSrQ = wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(sQ))
        tdPrV = wg_mma_sdp.make_fragment_A(wg_mma_sdp.partition_A(sV))
        tdPrdO = wg_mma_sdp.make_fragment_B(wg_mma_sdp.partition_B(sdO))
        n_block, d_block, head_kv, _ = tile
        # B operands of dV, dK and dQ: this CTA's head_dim slice of dO^T, Q^T and K^T
        tdVrdO = wg_mma_dkv.make_fragment_B(wg_mma_dkv.partition_B(self.d_rows(mma_sm90.transpose_view(sdO), d_block)))
        tdKrQ = wg_mma_dkv.make_fragment_B(wg_mma_dkv.partition_B(self.d_rows(mma_sm90.transpose_view(sQ), d_block)))
        tdQrdS = wg_mma_dq.make_fragment_A(wg_mma_dq.partition_A(mma_sm90.transpose_view(sdS)))
        tdQrK = wg_mma_dq.make_fragment_B(wg_mma_dq.partition_B(self.d_rows(mma_sm90.transpose_view(sK), d_block)))

        acc_dV = cute.make_rmem_tensor(wg_mma_dkv.partition_shape_C((self.tile_n, self.d_slice)), Float32)
        acc_dK = cute.make_rmem_tensor(wg_mma_dkv.partition_shape_C((self.tile_n, self.d_slice)), Float32)
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

        pipeline_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        operands = (tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO, tdKrQ, tdQrdS, tdQrK)
        step_args = (
            n_block, operands, acc_dV, acc_dK, sdS, sLSE2, sD, sdQ,
            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, pipeline_q, pipeline_do, mask,
            scale_log2, softcap_pre, tidx,
        )
        # dK and dV sum over the group's query heads right here, in the accumulators
        for _g in cutlass.range(group, unroll=1):
            for m_block in cutlass.range(m_block_min, right_end, unroll=1):
                self.step(m_block, state, *step_args, masked=True)
                state.advance()
            for m_block in cutlass.range(right_end, left_start, unroll=1):
                self.step(m_block, state, *step_args, masked=False)
                state.advance()
            if cutlass.const_expr(window.has_left):
                for m_block in cutlass.range(left_start, m_block_max, unroll=1):
                    self.step(m_block, state, *step_args, masked=True)
                    state.advance()

        # Epilogue: dV and dK leave through sV and sK, which every warpgroup must be done
        # reading (its last dP and dQ WGMMAs) before they are overwritten.
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        epilogue.acc_to_smem(acc_dV, sdV, tiled_mma_dkv, tidx, self.dtype)
        epilogue.acc_to_smem(acc_dK, sdK, tiled_mma_dkv, tidx, self.dtype, scale=softmax_scale)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        dkv_tile = (self.tile_n, self.d_slice)
        if cutlass.const_expr(self.features.varlen):
            gdV = cute.local_tile(seqlen.rows_k(mdV_rows, head_kv), dkv_tile, (n_block, d_block))
            gdK = cute.local_tile(seqlen.rows_k(mdK_rows, head_kv), dkv_tile, (n_block, d_block))
            keys_left = seqlen.seqlen_k - n_block * self.tile_n
            epilogue.store_rows(sdV, gdV, keys_left, tidx, self.num_mma_threads)
            epilogue.store_rows(sdK, gdK, keys_left, tidx, self.num_mma_threads)
        else:
            if tidx // 32 == 0:
                gdV = cute.local_tile(seqlen.rows_k(mdV, head_kv), dkv_tile, (n_block, d_block))
                gdK = cute.local_tile(seqlen.rows_k(mdK, head_kv), dkv_tile, (n_block, d_block))
                epilogue.tma_store_tile(tma_atom_dV, sdV, gdV)
                epilogue.tma_store_tile(tma_atom_dK, sdK, gdK)

    @cute.jit
    def tile(self, scheduler):
        """(n_block, d_block, head_kv, batch) of this CTA: grid x enumerates KV blocks, and
        within each, the head_dim slices of dK/dV/dQ it is split into (1 below hdim 192)."""
        bid, head, batch = scheduler.tile()
        return bid // self.num_d_slices, bid % self.num_d_slices, head, batch

    def d_rows(self, t: cute.Tensor, d_block):
        """Rows [d_block * d_slice, +d_slice) of a (head_dim, ...) smem view."""
        if cutlass.const_expr(self.num_d_slices == 1):
            return t
        tiler = (self.d_slice,) + tuple(t.shape[1:])
        return cute.local_tile(t, tiler, (d_block,) + (0,) * (cute.rank(t) - 1))

    @cute.jit
    def step(
        self, m_block, state, n_block, operands, acc_dV, acc_dK, sdS, sLSE2, sD, sdQ,
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, pipeline_q, pipeline_do, mask,
        scale_log2, softcap_pre, tidx, masked: cutlass.Constexpr[bool],
    ):
        """One query block: the five GEMMs for this CTA's keys."""
        tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO, tdKrQ, tdQrdS, tdQrK = operands
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_first_thread = cute.make_layout(self.num_mma_wg, stride=128)(wg_idx)
        wg_mma_sdp = tiled_mma_sdp.get_slice(wg_first_thread)
        wg_mma_dq = tiled_mma_dq.get_slice(wg_first_thread if self.dq_wgs > 1 else 0)
        thr_mma_sdp = tiled_mma_sdp.get_slice(tidx)
        stage = state.index
        acc_shape = wg_mma_sdp.partition_shape_C((self.tile_n, self.tile_m))

        # S^T and dP^T in flight together
        acc_S = cute.make_rmem_tensor(acc_shape, Float32)
        acc_dP = cute.make_rmem_tensor(acc_shape, Float32)
        pipeline_q.consumer_wait(state)
        mma_sm90.gemm(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, stage], zero_init=True, wait_groups=-1)
        pipeline_do.consumer_wait(state)
        mma_sm90.gemm(tiled_mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, stage], zero_init=True, wait_groups=-1)

        # per-query statistics of this thread's columns, read from smem where used
        tScS = thr_mma_sdp.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m)))
        cols = mma_sm90.acc_as_rows_cols(tScS)
        num_cols = cute.size(cols.shape[1])
        lse2 = ColumnStat(sLSE2, cols, stage)
        dsum = ColumnStat(sD, cols, stage)

        P = mma_sm90.acc_as_rows_cols(acc_S)
        dS = mma_sm90.acc_as_rows_cols(acc_dP)
        warpgroup.wait_group(1)
        if cutlass.const_expr(self.features.softcap):
            softcap_scores(acc_S, softcap_pre)
            warpgroup.wait_group(0)
            # fold the tanh's derivative 1 - tanh^2 into dP^T - D while S^T still holds the
            # tanh values (the mask turns them into -inf); no extra registers that way
            for c in cutlass.range_constexpr(num_cols):
                dsum_c = dsum[c]
                for r in cutlass.range_constexpr(cute.size(dS.shape[0])):
                    dS[r, c] = (dS[r, c] - dsum_c) * (1.0 - P[r, c] * P[r, c])
        if cutlass.const_expr(masked):
            mask.apply(acc_S, tScS, m_block, n_block, keys_on_rows=True)
        probs_from_lse(acc_S, lse2, scale_log2)
        # dS^T = P^T * (dP^T - D) (* the softcap's derivative, folded in above)
        if cutlass.const_expr(self.features.softcap):
            for r in cutlass.range_constexpr(cute.size(dS.shape[0])):
                for c in cutlass.range_constexpr(num_cols):
                    dS[r, c] = P[r, c] * dS[r, c]
        else:
            warpgroup.wait_group(0)
            for c in cutlass.range_constexpr(num_cols):
                dsum_c = dsum[c]
                for r in cutlass.range_constexpr(cute.size(dS.shape[0])):
                    dS[r, c] = P[r, c] * (dS[r, c] - dsum_c)
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))

        mma_sm90.gemm(tiled_mma_dkv, acc_dV, mma_sm90.acc_as_operand_a(rP), tdVrdO[None, None, None, stage], wait_groups=-1)
        mma_sm90.gemm(tiled_mma_dkv, acc_dK, mma_sm90.acc_as_operand_a(rdS), tdKrQ[None, None, None, stage], wait_groups=-1)

        # dS^T to shared memory for dQ = dS K, which needs every warpgroup's keys
        barrier_threads = self.num_mma_threads + 32
        cute.arch.barrier(barrier_id=int(NamedBarrier.DQ_EMPTY), number_of_threads=barrier_threads)
        epilogue.regs_to_smem(rdS, sdS, tiled_mma_sdp, tidx)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.DS_READY), number_of_threads=self.num_mma_threads)

        if wg_idx < self.dq_wgs:
            acc_dQ = cute.make_rmem_tensor(wg_mma_dq.partition_shape_C((self.tile_m, self.d_slice)), Float32)
            mma_sm90.gemm(tiled_mma_dq, acc_dQ, tdQrdS, tdQrK, zero_init=True, wait_groups=0)
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                sdQ[dq_accum_offset(i, tidx, self.num_dq_threads)] = acc_dQ[i]
            cute.arch.fence_view_async_shared()
        else:
            warpgroup.wait_group(0)
        # every WGMMA reading this stage's Q and dO has completed
        pipeline_q.consumer_release(state)
        pipeline_do.consumer_release(state)
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.DQ_FULL), number_of_threads=barrier_threads)

