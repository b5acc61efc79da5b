"""Attention forward for Hopper (sm_90a): warp-specialized TMA + WGMMA, FlashAttention-3 style.

Computes O = softmax(Q K^T * scale) V and LSE = logsumexp(Q K^T * scale) per query row for
one (m_block, head, batch) tile per CTA, or with a persistent grid (FwdConfig.
persistent_ctas) for each tile a CTA takes in turn (run_persistent). Tensors arrive in the
FlashAttention layout (batch, seqlen, heads, head_dim), head_dim contiguous, other strides
free (multiples of 16 B).

Warp roles (128 * (1 + num_mma_warpgroups) threads):
  * warpgroup 0, the producer: registers cut to 24-32 with setmaxnreg; its warp 0 issues
    every TMA load: Q once, then K and V block by block into `num_stages`-deep rings.
  * warpgroups 1.., the consumers: registers raised to 160-240; each owns 64 query rows of
    the tile (WGMMA's M) and runs S = Q K^T, the online softmax, O += P V with P kept in
    registers, and the epilogue.

Pipelines (mbarrier rings, cutlass.pipeline.PipelineTmaAsync):
  * Q: one stage; the TMA's transaction count completes the full barrier.
  * K and V: separate rings sharing one stage index. The producer issues K[j] before
    V[j+1] because the consumers need them in that order (see below); a consumer warp's
    lane 0 releases a stage once its WGMMAs that read it have completed.

Mainloop schedule per consumer warpgroup, KV blocks walked from the last one down (the
first block visited is the only one that can be partial, and with causal the diagonal
blocks come first, so masked steps are a short prefix of the loop):
  first block:  S = Q K^T; mask; softmax -> P (registers, bf16/fp16)
  each next j:  [wait my turn] issue S_j = Q K_j^T and O += P_{j+1} V_{j+1} [pass the turn]
                wait S_j; mask if needed; softmax (overlaps the PV WGMMA: intra-warpgroup
                overlap); wait PV; rescale O; P = S_j
  last:         O += P V
The turn barriers (named barriers WG_TURN_i) make warpgroups alternate on the tensor cores,
so one warpgroup's softmax runs while the other's GEMMs execute (ping-pong).

Epilogue: normalise O by the row sums, write O to shared memory (aliasing Q; with FP8 or a
persistent grid a buffer of its own) with stmatrix,
then one warp stores it with a TMA bulk copy (clipped to seqlen_q by the tensor map); LSE
goes straight from registers to global memory.

Features (config.AttnFeatures, one specialisation each; their values are run-time):
  * GQA / MQA: query head h reads KV head h // (heads_q / heads_kv).
  * masks (blocks/mask.py): none, causal, or a sliding window; KV blocks that no row of
    the tile sees are never loaded, and only blocks cutting a window edge are masked: the
    loop runs the masked blocks at the right edge, the unmasked bulk, then the masked
    blocks at the left edge.
  * softcap: S <- tanh(S * scale / softcap) before the mask, softmax scaled by softcap.
  * kv_lengths: a KV cache, whose entry b uses its first cu_seqlens_k[b] keys (the
    argument slot holds those lengths, blocks/seqlen.py); masks align to that length.
    With FwdConfig.page_size the cache is paged, (num_pages, page_size, heads_kv,
    head_dim): the producer assembles each KV block from TMA boxes of kv_box_rows rows,
    each read from the page page_table names (load_kv_paged).
  * varlen: packed sequences located by cu_seqlens (blocks/seqlen.py); tiles past a
    sequence's end exit at once, and O leaves row by row instead of by TMA so that a
    partial tile never writes into the next sequence.
  * mask / score mods, sinks, dropout (the FlashFwdSm90Mods entry point): a block mask's
    tile lists and per-element mods (blocks/mods.py); a sink's term joins each row's sum
    at the end (OnlineSoftmax.finalize_with_sink); dropout zeroes P after the softmax
    step from Philox bytes (blocks/dropout.py) and scales O by 1 / (1 - p) at the end.

Split-KV (config.FwdConfig.split_kv, the FlashFwdSm90SplitKV entry point; num_splits a
run-time argument): num_splits CTAs share a query tile, the work tile carries the split
index and blocks/block_range.py clips the tile's KV range to that split's slice. Each
split writes its O (normalised within the split) in fp32 and its LSE straight from
registers into partial buffers whose batch mode stacks the splits (index split * batch +
b); a split that sees no key writes O = 0, LSE = -inf (weight 0 in the merge). The last
split of a tile to finish merges them into O and LSE (merge_if_last, blocks/lse_combine.py):
each split counts itself done on the tile's counter in global memory (release), and the
one that brings it to num_splits sees every other split's partials (acquire), merges,
and sets the counter back to 0 for the next call. No second kernel, so no second launch
and no gap between them (a separate combine kernel cost 7.6-8.1 us per decode step).
With FwdConfig.cluster_splits (short splits, launcher._cluster_merge) a tile's splits are
one thread-block cluster instead and merge on chip (merge_in_cluster): the partials stay
in each CTA's shared memory and split 0 reads them through distributed shared memory.

Constraints: config.CAPABILITIES["fwd"] (head dims 64-256; fp16 or bf16 in, fp32
accumulation: config.DtypePolicy).
Read the PTX without a GPU: python -m cute_attn ptx --dtype bf16 --headdim 128 [--causal]
"""

from typing import NamedTuple

import math

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from cute_attn.blocks import epilogue, fp8_operand, lse_combine, mma_sm90
from cute_attn.blocks.mods import BlockList, ModTile
from cute_attn.blocks.barriers import NamedBarrier
from cute_attn.blocks.block_range import BlockRange
from cute_attn.blocks.dropout import Dropout, DropoutArgs
from cute_attn.blocks.mask import AttentionMask, Window
from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.softmax import OnlineSoftmax, ScoreScale, fold_score_scale, softcap_scores
from cute_attn.blocks.tile_scheduler import TileScheduler, WorkTile
from cute_attn.blocks.tma_pipeline import (
    TmaTensor,
    make_tma_pipeline,
    make_tma_tensor,
    prefetch_descriptors,
    tma_partition,
)
from cute_attn.blocks.views import bshd_as_sdhb, pack_heads_into_rows, rowwise_as_rhb
from cute_attn.config import AttnFeatures, DtypePolicy, FwdConfig


# FP8: P leaves the softmax scaled by 2^8 (OnlineSoftmax.p_log2_offset), so the e4m3 values
# of probabilities down to 2^-14 stay normal (FlashAttention-3's choice of scale)
FP8_P_LOG2_OFFSET = 8.0


class SplitBuffers(NamedTuple):
    """Split-KV: the partials and the outputs they merge into, in the callers' layouts
    (blocks/lse_combine.py), and one int32 counter per work tile (zero between calls).
    With FwdConfig.cluster_splits the partials and counters are unread placeholders
    (the splits merge in shared memory, merge_in_cluster)."""

    o_part: cute.Tensor  # (num_splits * batch, seqlen_q, heads, head_dim) fp32
    lse_part: cute.Tensor  # (num_splits * batch, heads, seqlen_q) fp32
    o: cute.Tensor  # (batch, seqlen_q, heads, head_dim)
    lse: cute.Tensor  # (batch, heads, seqlen_q) fp32
    tile_counters: cute.Tensor  # (query tiles x KV-head tiles x batch,) int32


class FwdGlobals(NamedTuple):
    """Global memory as the kernel sees it (kernel-side views, see blocks/views.py)."""

    q: TmaTensor
    k: TmaTensor
    v: TmaTensor
    o: TmaTensor  # the TMA store of dense tiles (split-KV: unused, a stand-in)
    o_rows: cute.Tensor  # O as a plain tensor: varlen tiles leave row by row; split-KV: the
    # fp32 partials (seqlen_q, head_dim, heads, num_splits * batch)
    lse: cute.Tensor  # (seqlen_q, heads, batch) float32
    cu_seqlens_q: cute.Tensor  # (batch + 1,) int32; varlen only (else unread)
    cu_seqlens_k: cute.Tensor
    page_table: cute.Tensor  # (batch, max_pages) int32; paged KV only (else unread)
    split: SplitBuffers  # split-KV only (else stand-ins, unread)
    descale: tuple  # FP8: (q, k, v) descales, (batch, heads_kv) float32 (else stand-ins, unread)
    # mask mods: the block mask's (partial_count, partial_idx, full_count, full_idx),
    # blocks/mods.BlockList (else stand-ins, unread)
    sparse: tuple
    aux: tuple  # the mods' aux tensors (masks.SeqInfo.aux); else a stand-in, unread
    sink: cute.Tensor  # (heads,) float32 attention-sink logits; AttnFeatures.sink only
    dropout: DropoutArgs  # AttnFeatures.dropout only; else stand-ins, unread


class FwdLayouts(NamedTuple):
    """The static shared-memory layouts and tiled MMAs (built on the host for the TMA
    atoms, handed to the kernel)."""

    sQ: cute.ComposedLayout
    sK: cute.ComposedLayout
    sV: cute.ComposedLayout  # (tile_n, head_dim, stages); FP8: keys contiguous (V arrives transposed)
    sO: cute.ComposedLayout  # the output tile: sQ's layout, or (FP8) its own 16-bit one
    mma_qk: cute.TiledMma  # S = Q K^T, both operands from smem
    mma_pv: cute.TiledMma  # O += P V, P from registers


class FwdPipelines(NamedTuple):
    q: pipeline.PipelineTmaAsync
    k: pipeline.PipelineTmaAsync
    v: pipeline.PipelineTmaAsync


class FwdSmem(NamedTuple):
    q: cute.Tensor
    o: cute.Tensor  # O's staging buffer in the epilogue: Q's buffer, or (FP8, persistent) its own
    k: cute.Tensor  # (tile_n, head_dim, stages)
    v: cute.Tensor
    tile_is_last: cute.Tensor  # (1,) int32, split-KV: the merge_if_last broadcast
    row_lse: cute.Tensor  # (tile_m,) fp32, split-KV: the merge's row LSEs (cluster_splits: this split's own)
    next_tile: cute.Tensor  # (2,) int32, tile queue: the next tile's index, by tile parity
    o_part: cute.Tensor  # (tile_m, head_dim) fp32 over the K/V rings, cluster_splits: this split's O (else None)


class MainloopOperands(NamedTuple):
    """A consumer warpgroup's WGMMA operands and accumulators for the whole mainloop."""

    acc_O: cute.Tensor
    tOrP: cute.Tensor  # P as the A operand of PV (registers)
    tOrP_next: cute.Tensor  # FwdConfig.p_double_buffer's second P (else tOrP itself)
    tSrQ: object  # a descriptor fragment, or its mma_sm90.pinned_k_blocks tuple
    tSrK: object  # likewise, with a stage mode (mma_sm90.at_stage)
    tOrVt: cute.Tensor
    tScS: cute.Tensor  # (row, col) of each score this thread holds, for the mask
    acc_S_shape: tuple


class FlashFwdSm90:
    def __init__(self, dtypes: DtypePolicy, head_dim: int, features: AttnFeatures, config: FwdConfig):
        self.dtype = dtypes.dsl("input")
        # FP8 (e4m3) operands: V transposed, P permuted into the FP8 A layout, descales;
        # the 16-bit output tile needs its own shared buffer (twice Q's bytes)
        self.fp8 = dtypes.input.itemsize == 1
        # persistent: the next tile's Q may land while this tile's O is stored, so O gets
        # a buffer of its own (FwdConfig.persistent_ctas)
        self.persistent = config.persistent_ctas > 0
        self.o_aliases_q = dtypes.output.itemsize == dtypes.input.itemsize and not self.persistent
        self.p_dtype = dtypes.dsl("p")
        self.out_dtype = dtypes.dsl("output")
        self.head_dim = head_dim
        self.features = features
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.num_stages = config.num_stages
        self.intra_wg_overlap = config.intra_wg_overlap
        self.num_mma_wg = config.num_mma_warpgroups
        self.pingpong = config.pingpong and self.num_mma_wg > 1
        self.num_threads = config.num_threads
        self.num_mma_threads = 128 * self.num_mma_wg
        self.producer_regs, self.mma_regs = config.registers
        self.pack_gqa = config.pack_gqa
        self.split_kv = config.split_kv
        self.cluster_splits = config.cluster_splits
        assert not self.cluster_splits or self.split_kv
        self.page_size = config.page_size
        self.tree_row_sums = config.tree_row_sums
        self.p_double_buffer = config.p_double_buffer
        assert not self.p_double_buffer or (self.fp8 and self.intra_wg_overlap)
        self.kv_box_rows = config.kv_box_rows
        # only a mask mod's ModTile packs its verdicts into bits
        self.mask_before_scores = config.mask_before_scores and features.mask_mod is not None
        self.pv_wait_after_softmax = config.pv_wait_after_softmax and self.intra_wg_overlap
        assert self.page_size == 0 or features.kv_lengths, "a paged cache needs kv_lengths"
        assert not self.fp8 or (self.page_size == 0 and not self.split_kv and self.tile_n % 32 == 0)
        assert self.pack_gqa == 1 or (not features.varlen and self.tile_m % self.pack_gqa == 0)
        # causal-like masks: the last query blocks see the most keys, so they go first
        self.scheduler = TileScheduler(
            self.tile_m, features.varlen, longest_first=features.causal_like, runtime_splits=config.split_kv,
            persistent_ctas=config.persistent_ctas, tile_queue=config.tile_queue,
        )
        self.tile_queue = config.tile_queue
        # WGMMA descriptors pinned once per tile (mma_sm90.pinned_k_blocks) where that
        # measured faster: the 16-bit persistent forwards at head dim <= 64, +1.5-1.8% at
        # 4K / 16K keys without a mask in two runs (1K level, causal -0.7..+1.5%; H100,
        # perf/NOTES.md session 27; SASS step 422 -> 407). At head dim 128 the shorter step
        # (causal 491 -> 448 instructions) ran 1.8-3.5% slower causal; FP8, hd 128's one-tile
        # kernel and the backward were level. Mods kernels: not measured.
        self.pin_descriptors = self.persistent and head_dim <= 64 and not self.fp8 and not features.has_mods
        assert not self.tile_queue or not features.varlen  # the queue's counter takes cu_seqlens_q's slot

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim); varlen: (1, total_q, ...)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim); paged: (num_pages, page_size, ...)
        mV: cute.Tensor,  # like mK
        mO: cute.Tensor,  # like mQ
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q), float32; varlen: (1, heads, total_q)
        mCuSeqlensQ: cute.Tensor,  # (batch + 1,) int32; varlen only (else unread)
        mCuSeqlensK: cute.Tensor,
        mPageTable: cute.Tensor,  # paged KV: (batch, max_pages) int32 (else unread)
        max_seqlen_q: Int32,  # varlen: the longest query sequence (sizes the grid)
        softmax_scale: Float32,
        softcap: Float32,  # with features.softcap
        window_left: Int32,  # with mask "local": config.UNBOUNDED for an open side
        window_right: Int32,
        stream,
    ):
        # the split and descale stand-ins are never read (split_kv and fp8 are False)
        split = SplitBuffers(mO, mLSE, mO, mLSE, mCuSeqlensK)
        self.launch(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mPageTable, split, (mLSE, mLSE, mLSE),
                    max_seqlen_q, softmax_scale, softcap, window_left, window_right, Int32(1), stream)

    @cute.jit
    def launch(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mPageTable: cute.Tensor, split: SplitBuffers,
        descale: tuple, max_seqlen_q: Int32, softmax_scale: Float32, softcap: Float32, window_left: Int32,
        window_right: Int32, num_splits: Int32, stream, sparse: tuple = None, aux: tuple = None,
        sink: cute.Tensor = None, dropout: DropoutArgs = None,
    ):
        """mO, mLSE: what the tiles write (split-KV: the partials). sparse, aux, sink,
        dropout: the mod entry point's block mask, aux tensors, sink logits and dropout
        (others: None, stand-ins are used)."""
        if cutlass.const_expr(sink is None):
            sink = mLSE
        if cutlass.const_expr(dropout is None):
            dropout = DropoutArgs.unread(mCuSeqlensQ)
        if cutlass.const_expr(sparse is None):
            sparse = (mLSE, mLSE, mLSE, mLSE)
        if cutlass.const_expr(aux is None):
            aux = (mLSE,)
        mQ, mK, mV, mO = [bshd_as_sdhb(t) for t in (mQ, mK, mV, mO)]
        mLSE = rowwise_as_rhb(mLSE)
        if cutlass.const_expr(self.pack_gqa > 1):
            # packed GQA: the group's query heads become rows, ((group, seqlen), ..., heads_kv)
            mQ, mO = [pack_heads_into_rows(t, self.pack_gqa, head_mode=2) for t in (mQ, mO)]
            mLSE = pack_heads_into_rows(mLSE, self.pack_gqa, head_mode=1)

        d = self.head_dim
        sK_layout = mma_sm90.make_smem_layout(self.dtype, self.tile_n, d, self.num_stages)
        sV_layout = sK_layout
        # P @ V: A = P from registers, B = V^T (head_dim, keys); its contiguous dim is N
        # (head_dim), or with FP8, whose WGMMA takes only K-major operands, K (keys): V
        # arrives transposed in global memory and its stages are V^T tiles seen as (keys,
        # head_dim)
        pv_b_major = OperandMajorMode.MN
        if cutlass.const_expr(self.fp8):
            sV_layout = cute.select(
                mma_sm90.make_smem_layout(self.dtype, d, self.tile_n, self.num_stages), mode=[1, 0, 2]
            )
            pv_b_major = OperandMajorMode.K
        sQ_layout = mma_sm90.make_smem_layout(self.dtype, self.tile_m, d)
        layouts = FwdLayouts(
            sQ=sQ_layout,
            sK=sK_layout,
            sV=sV_layout,
            sO=sQ_layout if self.o_aliases_q else mma_sm90.make_smem_layout(self.out_dtype, self.tile_m, d),
            mma_qk=mma_sm90.make_tiled_mma(self.dtype, OperandMajorMode.K, self.tile_n, self.num_mma_wg),
            mma_pv=mma_sm90.make_tiled_mma(self.p_dtype, pv_b_major, d, self.num_mma_wg, a_in_registers=True),
        )
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        kv_stage = cute.select(sK_layout, mode=[0, 1])
        # K and V boxes: a whole stage, or (paged, pages shorter than a block) one page's
        # rows of it, whose swizzle atoms (8 rows) line up with the stage's (load_kv_paged)
        kv_box = kv_stage
        if cutlass.const_expr(self.kv_box_rows < self.tile_n):
            kv_box = mma_sm90.make_smem_layout(self.dtype, self.kv_box_rows, d)
        v_box = cute.select(sV_layout, mode=[0, 1]) if cutlass.const_expr(self.fp8) else kv_box
        q_tma = make_tma_tensor(load_op, mQ, layouts.sQ, (self.tile_m, d))
        g = FwdGlobals(
            q=q_tma,
            k=make_tma_tensor(load_op, mK, kv_box, (self.kv_box_rows, d)),
            v=make_tma_tensor(load_op, mV, v_box, (self.kv_box_rows, d)),
            o=self._o_store(mO, layouts.sO, q_tma),
            o_rows=mO, lse=mLSE, cu_seqlens_q=mCuSeqlensQ, cu_seqlens_k=mCuSeqlensK, page_table=mPageTable,
            split=split, descale=descale, sparse=sparse, aux=aux, sink=sink, dropout=dropout,
        )
        self.tma_bytes_q = cute.size_in_bytes(self.dtype, layouts.sQ)
        self.tma_bytes_kv = cute.size_in_bytes(self.dtype, kv_stage)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            tile_is_last: cute.struct.MemRange[Int32, 1]  # split-KV: this CTA merges the tile
            row_lse: cute.struct.MemRange[Float32, self.tile_m]  # split-KV: the merged LSEs
            next_tile: cute.struct.MemRange[Int32, 2]  # tile queue: the producer's tickets
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.sQ)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.sK)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layouts.sV)], 1024]
            if cutlass.const_expr(not self.o_aliases_q):
                sO: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(layouts.sO)], 1024]

        self.shared_storage = SharedStorage
        if cutlass.const_expr(self.cluster_splits):
            # merge_in_cluster's partial tile spans the K and V rings (config.cluster_splits_fit)
            k_bytes = cute.cosize(layouts.sK) * self.dtype.width // 8
            assert k_bytes % 1024 == 0 and self.tile_m * self.head_dim * 4 <= 2 * k_bytes

        score = fold_score_scale(softmax_scale, softcap, self.features.softcap, self.features.score_mod is not None)
        self.kernel(g, layouts, score, window_left, window_right, num_splits).launch(
            grid=self.scheduler.grid(mQ, mCuSeqlensQ, max_seqlen_q, num_splits),
            block=[self.num_threads, 1, 1],
            # a tile's splits are grid neighbours (TileScheduler.tile): one cluster each
            cluster=[num_splits, 1, 1] if cutlass.const_expr(self.cluster_splits) else None,
            stream=stream,
            # a register cap at entry is what lets ptxas honour setmaxnreg (else C7508)
            min_blocks_per_mp=1,
        )

    def _o_store(self, mO: cute.Tensor, sQ_layout, q_tma: TmaTensor) -> TmaTensor:
        """O's TMA store: through shared memory laid out like Q (Q's buffer, or with FP8 or
        a persistent grid one of its own).
        The split-KV partials leave from registers instead, and Q's descriptor stands in
        (plain Python: runs while tracing)."""
        if self.split_kv:
            return q_tma
        return make_tma_tensor(cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (self.tile_m, self.head_dim))

    @cute.kernel
    def kernel(
        self, g: FwdGlobals, layouts: FwdLayouts, score: ScoreScale, window_left: Int32, window_right: Int32,
        num_splits: Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            prefetch_descriptors(g)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipes = FwdPipelines(
            q=make_tma_pipeline(storage.mbar_q.data_ptr(), 1, self.tma_bytes_q, self.num_mma_threads),
            k=make_tma_pipeline(storage.mbar_k.data_ptr(), self.num_stages, self.tma_bytes_kv, self.num_mma_threads),
            v=make_tma_pipeline(storage.mbar_v.data_ptr(), self.num_stages, self.tma_bytes_kv, self.num_mma_threads),
        )
        pipeline_init_arrive(is_relaxed=True)

        sQ = storage.sQ.get_tensor(layouts.sQ.outer, swizzle=layouts.sQ.inner)
        smem = FwdSmem(
            q=sQ,
            o=sQ if self.o_aliases_q else storage.sO.get_tensor(layouts.sO.outer, swizzle=layouts.sO.inner),
            k=storage.sK.get_tensor(layouts.sK.outer, swizzle=layouts.sK.inner),
            v=storage.sV.get_tensor(layouts.sV.outer, swizzle=layouts.sV.inner),
            tile_is_last=storage.tile_is_last.get_tensor(cute.make_layout(1)),
            row_lse=storage.row_lse.get_tensor(cute.make_layout(self.tile_m)),
            next_tile=storage.next_tile.get_tensor(cute.make_layout(2)),
            # K's ring then V's: sK's bytes are a multiple of sV's 1024-byte alignment
            # (launch asserts it), so the two are one contiguous buffer
            o_part=(cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), dtype=Float32),
                                     cute.make_layout((self.tile_m, self.head_dim), stride=(self.head_dim, 1)))
                    if cutlass.const_expr(self.cluster_splits) else None),
        )

        window = Window(self.features.mask, window_left, window_right)
        block_range = BlockRange(self.tile_m, self.tile_n, window, self.pack_gqa, self.split_kv, num_splits)
        pipeline_init_wait()

        if cutlass.const_expr(self.persistent):
            self.run_persistent(g, layouts, smem, pipes, block_range, window, score, warp_idx, tidx)
        else:
            tile = self.scheduler.tile(num_splits)
            seqlen = self.seqlen_info(g, tile)
            # varlen: the grid covers the longest sequence; a tile past this one's end has
            # no rows (uniform across the CTA, so no barrier is left waiting)
            if not self.features.varlen or tile.block * self.tile_m < seqlen.seqlen_q:
                if warp_idx < 4:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    if warp_idx == 0:
                        self.produce(g, smem, pipes, tile, block_range, seqlen,
                                     pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1),
                                     pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                                  self.num_stages))
                else:
                    cute.arch.setmaxregister_increase(self.mma_regs)
                    self.consume(g, layouts, smem, pipes, tile, block_range, seqlen, window, score, tidx - 128,
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1),
                                 pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                              self.num_stages))

    @cute.jit
    def seqlen_info(self, g: FwdGlobals, tile: WorkTile) -> SeqlenInfo:
        """The lengths and offsets of the tile's sequence (batch entry)."""
        mQ, mK = g.q.tensor, g.k.tensor
        # packed GQA: the row mode is (group, seqlen_q); the sequence is its second part
        seqlen_q = mQ.shape[0][1] if cutlass.const_expr(self.pack_gqa > 1) else mQ.shape[0]
        # the keys an entry can hold: the cache's rows, or its page-table row's pages
        capacity_k = mK.shape[0]
        if cutlass.const_expr(self.page_size > 0):
            capacity_k = g.page_table.shape[1] * self.page_size
        return SeqlenInfo(
            tile.batch, seqlen_q, capacity_k, g.cu_seqlens_q, g.cu_seqlens_k, self.features.varlen,
            kv_lengths=self.features.kv_lengths,
        )

    @cute.jit
    def run_persistent(self, g: FwdGlobals, layouts: FwdLayouts, smem: FwdSmem, pipes: FwdPipelines,
                       block_range: BlockRange, window: Window, score: ScoreScale, warp_idx, tidx):
        """Persistent grid (FwdConfig.persistent_ctas): the producer and the consumers each
        walk the CTA's work tiles (blocks/tile_scheduler.py) in the same order, their
        pipeline states running on from tile to tile, so the producer's loads of the next
        tile (K first, then Q once every consumer is done with this tile's Q) overlap the
        consumers' last block and epilogue.

        With the tile queue the producer warp takes the next tile's ticket once it has
        issued a tile's loads, writes it to next_tile[parity] and arrives on
        NEXT_TILE_<parity>; the consumers, done with the tile, wait there, read it and
        arrive on TILE_SLOT_FREE_<parity>, where the producer waits before it writes that
        slot again (from its third ticket on; after its last ticket it waits once per slot
        it wrote, so every barrier phase completes). The wait never stalls in practice:
        the producer gets two tiles ahead only through Q's stage, which the consumers
        release after the read. It is there because the memory model (and racecheck)
        orders the consumers' reads before the producer's next write only through a
        barrier both sides name: through Q's mbarrier only lane 0 of each warp is ordered,
        and racecheck reported the other lanes' reads as write-after-read hazards."""
        tiles = self.scheduler.work_tiles(g.q.tensor, None, None)
        num_tiles = tiles[0] * tiles[1] * tiles[2]
        index = self.scheduler.first_index()
        parity = Int32(0)
        tickets = Int32(0)  # the producer's tickets so far (slot writes)
        next_tile_threads = 32 + self.num_mma_threads
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                while index < num_tiles:
                    tile = self.scheduler.tile_at(index, tiles)
                    q_state, kv_state = self.produce(g, smem, pipes, tile, block_range, self.seqlen_info(g, tile),
                                                     q_state, kv_state)
                    if cutlass.const_expr(self.tile_queue):
                        # the dense kernels' cu_seqlens_q slot carries the counter
                        index = self.scheduler.take_ticket(g.cu_seqlens_q, num_tiles)
                        if tickets >= 2:
                            cute.arch.barrier(barrier_id=int(NamedBarrier.TILE_SLOT_FREE_0) + parity,
                                              number_of_threads=next_tile_threads)
                        if cute.arch.lane_idx() == 0:
                            smem.next_tile[parity] = index
                        cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.NEXT_TILE_0) + parity,
                                                 number_of_threads=next_tile_threads)
                        parity = parity ^ 1
                        tickets = tickets + 1
                    else:
                        index = self.scheduler.next_index(index)
                if cutlass.const_expr(self.tile_queue):
                    # the consumers' arrives after their last reads of each slot written
                    for slot in cutlass.range_constexpr(2):
                        if tickets > slot:
                            cute.arch.barrier(barrier_id=int(NamedBarrier.TILE_SLOT_FREE_0) + slot,
                                              number_of_threads=next_tile_threads)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            tidx = tidx - 128
            if cutlass.const_expr(self.pingpong):
                if tidx // 128 == 0:
                    # warpgroup 0 takes the first turn of the first tile; each later tile's
                    # first turn is the last warpgroup's pass at the end of the one before
                    # (every warpgroup takes the same number of turns per tile)
                    cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.WG_TURN_0), number_of_threads=256)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            while index < num_tiles:
                tile = self.scheduler.tile_at(index, tiles)
                q_state, kv_state = self.consume(g, layouts, smem, pipes, tile, block_range, self.seqlen_info(g, tile),
                                                 window, score, tidx, q_state, kv_state)
                if cutlass.const_expr(self.tile_queue):
                    cute.arch.barrier(barrier_id=int(NamedBarrier.NEXT_TILE_0) + parity,
                                      number_of_threads=next_tile_threads)
                    index = smem.next_tile[parity]
                    cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TILE_SLOT_FREE_0) + parity,
                                             number_of_threads=next_tile_threads)
                    parity = parity ^ 1
                else:
                    index = self.scheduler.next_index(index)

    # ------------------------------------------------------------------------------------
    # Producer: one warp, TMA only
    # ------------------------------------------------------------------------------------
    @cute.jit
    def produce(
        self, g: FwdGlobals, smem: FwdSmem, pipes: FwdPipelines, tile: WorkTile,
        block_range: BlockRange, seqlen: SeqlenInfo, q_state, kv_state,
    ):
        """One tile's loads, from the Q and K/V ring positions q_state and kv_state;
        returns both advanced past this tile's stages (persistent grids walk on)."""
        m_block, head = tile.block, tile.head
        # GQA / MQA: a group of heads_q / heads_kv query heads shares one KV head
        head_kv = head // (g.q.tensor.shape[2] // g.k.tensor.shape[2])
        d = self.head_dim
        gQ = cute.local_tile(seqlen.rows_q(g.q.tensor, head), (self.tile_m, d), (m_block, 0))
        tQsQ, tQgQ = tma_partition(g.q, smem.q, gQ)
        if cutlass.const_expr(not self.persistent):
            self.load_q(g, tQgQ, tQsQ, pipes.q, q_state)

        if cutlass.const_expr(self.page_size > 0):
            # (box, stage-slot, 1, stages) and (box, box-in-page, 1, page): a block is
            # tile_n / kv_box_rows boxes, each one from a page the table names
            box = (self.kv_box_rows, d)
            sK, sV = (cute.tiled_divide(t, box) for t in (smem.k, smem.v))
            gK, gV = (cute.tiled_divide(t.tensor[None, None, head_kv, None], box) for t in (g.k, g.v))
            tKsK, tKgK = tma_partition(g.k, sK, gK, tile_rank=1)
            tVsV, tVgV = tma_partition(g.v, sV, gV, tile_rank=1)
        else:
            gK = cute.local_tile(seqlen.rows_k(g.k.tensor, head_kv), (self.tile_n, d), (None, 0))
            gV = cute.local_tile(seqlen.rows_k(g.v.tensor, head_kv), (self.tile_n, d), (None, 0))
            if cutlass.const_expr(self.fp8 and self.features.varlen):
                # FP8 varlen: V^T is dense per sequence (kernels/v_transpose.py says why)
                gV = cute.local_tile(g.v.tensor[None, None, head_kv, tile.batch], (self.tile_n, d), (None, 0))
            tKsK, tKgK = tma_partition(g.k, smem.k, gK)
            tVsV, tVgV = tma_partition(g.v, smem.v, gV)

        blocks, n_block_max, count = self.kv_blocks(g, tile, block_range, seqlen)
        load_k = (g, seqlen, g.k.atom, tKgK, tKsK, pipes.k)
        load_v = (g, seqlen, g.v.atom, tVgV, tVsV, pipes.v)
        if cutlass.const_expr(self.persistent):
            # the first K block's stage frees during this CTA's previous tile; Q's buffer
            # only once every consumer warp has finished that tile's mainloop: K goes first
            if count > 0:
                self.load_kv(*load_k, kv_state, self.kv_block(blocks, n_block_max, 0))
            self.load_q(g, tQgQ, tQsQ, pipes.q, q_state)
            q_state.advance()
        if count > 0:
            prev_block = self.kv_block(blocks, n_block_max, 0)
            if cutlass.const_expr(not self.persistent):
                self.load_kv(*load_k, kv_state, prev_block)
            if cutlass.const_expr(not self.intra_wg_overlap):
                self.load_kv(*load_v, kv_state, prev_block)
            for i in cutlass.range(count - 1, unroll=1):
                n_block = self.kv_block(blocks, n_block_max, i + 1)
                prev_state = kv_state.clone()
                kv_state.advance()
                self.load_kv(*load_k, kv_state, n_block)
                if cutlass.const_expr(self.intra_wg_overlap):
                    # V runs one block behind K, matching the consumers' order
                    self.load_kv(*load_v, prev_state, prev_block)
                else:
                    self.load_kv(*load_v, kv_state, n_block)
                prev_block = n_block
            if cutlass.const_expr(self.intra_wg_overlap):
                self.load_kv(*load_v, kv_state, prev_block)
            kv_state.advance()
        return q_state, kv_state

    @cute.jit
    def load_q(self, g: FwdGlobals, tQgQ, tQsQ, pipeline_q, q_state):
        """The tile's Q into its one-stage buffer, once the consumers have released it."""
        pipeline_q.producer_acquire(q_state)
        cute.copy(g.q.atom, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))

    @cute.jit
    def kv_blocks(self, g: FwdGlobals, tile: WorkTile, block_range: BlockRange, seqlen: SeqlenInfo):
        """(blocks, n_block_max, count): the KV blocks this tile visits, as count steps
        i = 0 .. count - 1 (kv_block). A mask mod: the block mask's lists (blocks); else
        the range [n_min, n_max) of block_range, last block first."""
        blocks = None
        if cutlass.const_expr(self.features.mask_mod is not None):
            blocks = BlockList(g.sparse, tile.batch, tile.head, tile.block)
            n_block_max, count = Int32(0), blocks.count
        else:
            n_block_min, n_block_max = block_range.n_block_min_max(seqlen, tile.block, tile.split)
            count = n_block_max - n_block_min
        return blocks, n_block_max, count

    @cute.jit
    def kv_block(self, blocks, n_block_max: Int32, i: Int32) -> Int32:
        """The KV block of step i (see kv_blocks)."""
        if cutlass.const_expr(blocks is not None):
            n_block = blocks.block(i)
        else:
            n_block = n_block_max - 1 - i
        return n_block

    @cute.jit
    def load_kv(self, g: FwdGlobals, seqlen: SeqlenInfo, tma_atom, tXgX, tXsX, pipeline_x, state, n_block):
        """Block n_block of K or V into stage state.index, once the stage is free."""
        if cutlass.const_expr(self.page_size > 0):
            self.load_kv_paged(g, seqlen, tma_atom, tXgX, tXsX, pipeline_x, state, n_block)
        else:
            pipeline_x.producer_acquire(state)
            cute.copy(
                tma_atom, tXgX[None, n_block], tXsX[None, state.index],
                tma_bar_ptr=pipeline_x.producer_get_barrier(state),
            )

    @cute.jit
    def load_kv_paged(self, g: FwdGlobals, seqlen: SeqlenInfo, tma_atom, tXgX, tXsX, pipeline_x, state, n_block):
        """Logical block n_block of entry seqlen.batch from a paged cache: box j of the
        block (kv_box_rows keys) is logical box L = n_block * boxes_per_block + j, found
        in page page_table[batch, L / boxes_per_page] at box L mod boxes_per_page.

        Lane j of the producer warp looks up box j (one coalesced load for the block),
        before the wait for a free stage so that its latency hides behind the wait; the
        elected lane then takes each box's page from lane j by a shuffle (the producer
        has 24-32 registers: a page per box held by every lane spilled at 8 boxes).
        Boxes past the entry's last key repeat its last box: their rows are masked like
        any key past the length, and no page-table slot past the entry's pages is read.
        Page indices are not range-checked: TMA clips coordinates outside the cache
        (zero fill), so a bad index reads nothing outside it (check_inputs reports it)."""
        boxes_per_block = self.tile_n // self.kv_box_rows
        boxes_per_page = self.page_size // self.kv_box_rows
        last_box = (seqlen.seqlen_k - 1) // self.kv_box_rows
        box = n_block * boxes_per_block
        if cutlass.const_expr(boxes_per_block > 1):
            box += cute.arch.lane_idx()
        box = cutlass.min(box, last_box)
        page = g.page_table[seqlen.batch, box // boxes_per_page]
        box_in_page = box % boxes_per_page
        pipeline_x.producer_acquire(state)
        for j in cutlass.range_constexpr(boxes_per_block):
            page_j, box_in_page_j = page, box_in_page
            if cutlass.const_expr(boxes_per_block > 1):
                page_j = cute.arch.shuffle_sync(page, j)
                box_in_page_j = Int32(0)  # a box per page: pages shorter than a block
            cute.copy(
                tma_atom, tXgX[None, box_in_page_j, 0, page_j], tXsX[None, j, 0, state.index],
                tma_bar_ptr=pipeline_x.producer_get_barrier(state),
            )

    # ------------------------------------------------------------------------------------
    # Consumers: WGMMA + online softmax + epilogue
    # ------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self, g: FwdGlobals, layouts: FwdLayouts, smem: FwdSmem, pipes: FwdPipelines, tile: WorkTile,
        block_range: BlockRange, seqlen: SeqlenInfo, window: Window, score: ScoreScale, tidx, q_state, kv_state,
    ):
        """One tile from the Q and K/V ring positions q_state and kv_state; returns both
        advanced past this tile's stages (persistent grids walk on)."""
        tiled_mma_qk, tiled_mma_pv = layouts.mma_qk, layouts.mma_pv
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_first_thread = cute.make_layout(self.num_mma_wg, stride=128)(wg_idx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_first_thread)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_first_thread)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        sVt = mma_sm90.transpose_view(smem.v)
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(smem.q))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(smem.k))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        if cutlass.const_expr(self.pin_descriptors):
            # descriptors computed once per tile, not in every mainloop step (mma_sm90's
            # pinned descriptors), one per K block
            tSrQ, tSrK = mma_sm90.pinned_k_blocks(tSrQ), mma_sm90.pinned_k_blocks(tSrK)
            tOrVt = mma_sm90.pinned_descriptors(tOrVt)
        ops = MainloopOperands(
            acc_O=cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32),
            tOrP=tOrP,
            tOrP_next=(wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
                       if cutlass.const_expr(self.p_double_buffer) else tOrP),
            tSrQ=tSrQ,
            tSrK=tSrK,
            tOrVt=tOrVt,
            tScS=thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))),
            acc_S_shape=wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n)),
        )
        acc_O, tOrP = ops.acc_O, ops.tOrP
        acc_O.fill(0.0)

        v_descale = None
        p_log2_offset = 0.0
        if cutlass.const_expr(self.fp8):
            score, v_descale = self.fold_descales(g, score, tile)
            p_log2_offset = FP8_P_LOG2_OFFSET
        softmax = OnlineSoftmax(
            score.scale_log2, num_rows=cute.size(acc_O.shape[0][1]) * cute.size(acc_O.shape[1]),
            p_log2_offset=p_log2_offset, tree_row_sums=self.tree_row_sums,
        )
        softmax.row_max.fill(-Float32.inf)
        softmax.row_sum.fill(0.0)

        m_block = tile.block
        mask = AttentionMask(self.tile_m, self.tile_n, seqlen, window, self.pack_gqa)
        mods = None
        if cutlass.const_expr(self.features.has_mods):
            mods = ModTile(self.features.mask_mod, self.features.score_mod, self.tile_m, self.tile_n, seqlen,
                           tile.batch, tile.head, g.aux, score.softmax_scale)
            if cutlass.const_expr(self.features.mask_mod is not None):
                mask = mods  # masks blocks by the mod (and the end of the keys)
        dropout = None
        if cutlass.const_expr(self.features.dropout):
            # one query head per tile (no packed GQA with dropout, config.pack_gqa_for)
            dropout = Dropout(g.dropout, tile.batch, tile.head)
        blocks, n_block_max, count = self.kv_blocks(g, tile, block_range, seqlen)
        if cutlass.const_expr(self.pingpong and not self.persistent):
            if wg_idx == 0:
                # warpgroup 0 takes the first turn (persistent: once, run_persistent)
                cute.arch.barrier_arrive(
                    barrier_id=int(NamedBarrier.WG_TURN_0), number_of_threads=256
                )

        # Q must have landed even when no key is visible: sO below overwrites its buffer
        # (persistent: the phases of Q's ring stay in step with the producer's)
        pipes.q.consumer_wait(q_state)

        # O's rescale by the latest row-max change, applied just before the next PV WGMMA
        pending_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        if count > 0:
            # First block: the only one that can be partial (end of keys); masked always.
            n_first = self.kv_block(blocks, n_block_max, 0)
            acc_S = cute.make_rmem_tensor(ops.acc_S_shape, Float32)
            pipes.k.consumer_wait(kv_state)
            mma_sm90.gemm(
                tiled_mma_qk, acc_S, ops.tSrQ, mma_sm90.at_stage(ops.tSrK, kv_state.index),
                zero_init=True, wait_groups=0,
            )
            pipes.k.consumer_release(kv_state)
            if cutlass.const_expr(self.features.softcap):
                softcap_scores(acc_S, score.softcap_pre)
            if cutlass.const_expr(self.features.score_mod is not None):
                mods.apply_score(acc_S, ops.tScS, m_block, n_first)
            mask.apply(acc_S, ops.tScS, m_block, n_first)
            pending_scale.store(softmax.step(acc_S, is_first=True).load())
            drops = self.draw_drops(dropout, acc_S, ops.tScS, m_block, n_first)
            self.scores_to_p(acc_S, tOrP, dropout, drops)
            if cutlass.const_expr(not self.intra_wg_overlap):
                kv_state = self.pv_step(tiled_mma_pv, ops, pipes.v, kv_state)

            step = (ops, layouts, pipes, softmax, mask, mods, dropout, m_block, wg_idx, pending_scale,
                    score.softcap_pre)
            if cutlass.const_expr(blocks is not None):
                # a block mask: its PARTIAL tiles (the mod evaluated per element), then
                # its FULL ones (no mask); step 0 above was the first of either list
                for i in cutlass.range(cutlass.max(blocks.num_partial - 1, 0), unroll=1):
                    kv_state = self.mainloop_step(blocks.block(i + 1), kv_state, *step, masked=True)
                first_full = cutlass.max(blocks.num_partial, 1)
                for i in cutlass.range(count - first_full, unroll=1):
                    kv_state = self.mainloop_step(blocks.block(first_full + i), kv_state, *step, masked=False)
            else:
                # Blocks cutting the window's right edge (the causal diagonal), the
                # unmasked bulk, then blocks cutting its left edge (sliding windows only).
                n_block_min = n_block_max - count
                right_start = block_range.n_block_right_mask_start(seqlen, m_block, n_block_min, n_block_max)
                left_end = block_range.n_block_left_mask_end(seqlen, m_block, n_block_min, right_start)
                for i in cutlass.range(n_block_max - 1 - right_start, unroll=1):
                    kv_state = self.mainloop_step(n_block_max - 2 - i, kv_state, *step, masked=True)
                if cutlass.const_expr(self.p_double_buffer):
                    # pairs: P lives in tOrP between pairs, in tOrP_next inside one
                    bulk = right_start - left_end
                    for i in cutlass.range(bulk // 2, unroll=1):
                        n = right_start - 1 - 2 * i
                        kv_state = self.mainloop_step(n, kv_state, *step, masked=False, p_read=ops.tOrP,
                                                      p_write=ops.tOrP_next)
                        kv_state = self.mainloop_step(n - 1, kv_state, *step, masked=False,
                                                      p_read=ops.tOrP_next, p_write=ops.tOrP)
                    for i in cutlass.range(bulk % 2, unroll=1):
                        kv_state = self.mainloop_step(left_end, kv_state, *step, masked=False)
                else:
                    for i in cutlass.range(right_start - left_end, unroll=1):
                        kv_state = self.mainloop_step(right_start - 1 - i, kv_state, *step, masked=False)
                if cutlass.const_expr(window.has_left):
                    for i in cutlass.range(left_end - n_block_min, unroll=1):
                        kv_state = self.mainloop_step(left_end - 1 - i, kv_state, *step, masked=True)
            if cutlass.const_expr(self.intra_wg_overlap):
                softmax.rescale(acc_O, pending_scale)
                kv_state = self.pv_step(tiled_mma_pv, ops, pipes.v, kv_state)
        if cutlass.const_expr(self.persistent):
            # this warpgroup's QK^T WGMMAs have completed: Q's buffer may take the next tile
            pipes.q.consumer_release(q_state)
            q_state.advance()

        lse = cute.make_rmem_tensor_like(softmax.row_sum, Float32)
        sink_log2 = None
        if cutlass.const_expr(self.features.sink):
            # one query head per tile (no packed GQA with a sink, config.pack_gqa_for)
            sink_log2 = g.sink[tile.head] * math.log2(math.e)
        out_scale = v_descale
        if cutlass.const_expr(self.features.dropout):
            out_scale = dropout.inv_keep  # the kept P's 1 / (1 - p), once per row (no FP8 with dropout)
        softmax.finalize(acc_O, lse, out_scale, sink_log2)
        if cutlass.const_expr(self.cluster_splits):
            self.merge_in_cluster(acc_O, lse, g, smem, tiled_mma_pv, tidx, tile, seqlen, block_range.num_splits)
        elif cutlass.const_expr(self.split_kv):
            self.store_partials(acc_O, lse, g, tiled_mma_pv, tidx, tile, seqlen)
            self.merge_if_last(g, smem, tile, seqlen, block_range.num_splits, tidx)
        else:
            self.epilogue(acc_O, lse, g, smem.o, tiled_mma_pv, tidx, tile, seqlen)
        return q_state, kv_state

    @cute.jit
    def mainloop_step(
        self, n_block, kv_state, ops: MainloopOperands, layouts: FwdLayouts, pipes: FwdPipelines,
        softmax: OnlineSoftmax, mask, mods, dropout, m_block, wg_idx, pending_scale, softcap_pre,
        masked: cutlass.Constexpr[bool], p_read=None, p_write=None,
    ):
        """One KV block. mask: an AttentionMask, or with a mask mod the ModTile (mods),
        which also applies a score mod to every block. p_read / p_write (intra-warpgroup
        overlap, FwdConfig.p_double_buffer): the P buffer the previous block's PV reads
        and the other one, which this block's P is converted into before that PV is waited
        for; None: ops.tOrP for both, converted after the wait."""
        tiled_mma_qk, tiled_mma_pv = layouts.mma_qk, layouts.mma_pv
        acc_S = cute.make_rmem_tensor(ops.acc_S_shape, Float32)
        if cutlass.const_expr(self.intra_wg_overlap):
            # S_j = Q K_j^T and O += P_{j+1} V_{j+1} in flight together; the softmax of S_j
            # runs while the PV WGMMA still executes.
            v_state = kv_state.clone()
            kv_state.advance()
            # a mask mod's verdicts, before the K wait and the turn (mask_before_scores):
            # evaluated there, not under the QK^T WGMMA, they spill nothing (ptxas)
            early_mask = masked and self.mask_before_scores
            visible = None
            if cutlass.const_expr(early_mask):
                visible = mask.visible_bits(ops.tScS, m_block, n_block)
            pipes.k.consumer_wait(kv_state)
            self.wait_turn(wg_idx)
            mma_sm90.gemm(
                tiled_mma_qk, acc_S, ops.tSrQ, mma_sm90.at_stage(ops.tSrK, kv_state.index),
                zero_init=True, wait_groups=-1,
            )
            # Rescale O here, under the QK^T WGMMA, not after the softmax: touching O's
            # registers there made ptxas hoist the wait on the PV WGMMA above the exp2s,
            # which serialised the softmax behind PV (seen in SASS).
            softmax.rescale(ops.acc_O, pending_scale)
            pipes.v.consumer_wait(v_state)
            mma_sm90.gemm(
                tiled_mma_pv, ops.acc_O, ops.tOrP if p_read is None else p_read,
                ops.tOrVt[None, None, None, v_state.index], wait_groups=-1,
            )
            self.pass_turn(wg_idx)
            warpgroup.wait_group(1)
            pipes.k.consumer_release(kv_state)
            if cutlass.const_expr(self.features.softcap):
                softcap_scores(acc_S, softcap_pre)
            if cutlass.const_expr(self.features.score_mod is not None):
                mods.apply_score(acc_S, ops.tScS, m_block, n_block)
            if cutlass.const_expr(early_mask):
                mask.apply_bits(acc_S, visible)
            elif cutlass.const_expr(masked):
                mask.apply(acc_S, ops.tScS, m_block, n_block)
            pending_scale.store(softmax.step(acc_S, is_first=False).load())
            # dropout's Philox words drawn before the PV WGMMA's wait (the compiler may
            # still move the arithmetic below it)
            drops = self.draw_drops(dropout, acc_S, ops.tScS, m_block, n_block)
            if cutlass.const_expr(p_write is not None):
                self.scores_to_p(acc_S, p_write, dropout, drops)  # beside the PV WGMMA, which reads p_read
                self.wait_pv(softmax)
                pipes.v.consumer_release(v_state)
            else:
                self.wait_pv(softmax)
                pipes.v.consumer_release(v_state)
                self.scores_to_p(acc_S, ops.tOrP, dropout, drops)
        else:
            pipes.k.consumer_wait(kv_state)
            self.wait_turn(wg_idx)
            mma_sm90.gemm(
                tiled_mma_qk, acc_S, ops.tSrQ, mma_sm90.at_stage(ops.tSrK, kv_state.index),
                zero_init=True, wait_groups=-1,
            )
            self.pass_turn(wg_idx)
            warpgroup.wait_group(0)
            pipes.k.consumer_release(kv_state)
            if cutlass.const_expr(self.features.softcap):
                softcap_scores(acc_S, softcap_pre)
            if cutlass.const_expr(self.features.score_mod is not None):
                mods.apply_score(acc_S, ops.tScS, m_block, n_block)
            if cutlass.const_expr(masked):
                mask.apply(acc_S, ops.tScS, m_block, n_block)
            row_scale = softmax.step(acc_S, is_first=False)
            softmax.rescale(ops.acc_O, row_scale)
            drops = self.draw_drops(dropout, acc_S, ops.tScS, m_block, n_block)
            self.scores_to_p(acc_S, ops.tOrP, dropout, drops)
            kv_state = self.pv_step(tiled_mma_pv, ops, pipes.v, kv_state)
        return kv_state

    @cute.jit
    def wait_pv(self, softmax: OnlineSoftmax):
        """Intra-warpgroup overlap: wait for the PV WGMMA issued beside this block's QK^T;
        with pv_wait_after_softmax, below the softmax's last exp2 (its row sums depend on
        every one)."""
        if cutlass.const_expr(self.pv_wait_after_softmax):
            row_sums = softmax.row_sum
            total = row_sums[0]
            for r in cutlass.range_constexpr(1, cute.size(row_sums)):
                total = total + row_sums[r]
            mma_sm90.wait_all_groups_after(total)
        else:
            warpgroup.wait_group(0)

    @cute.jit
    def draw_drops(self, dropout, acc_S, tScS, m_block, n_block):
        """Dropout's keep flags for this block's P (blocks/dropout.py draw_pair_flags),
        or None without dropout. Drawn after the softmax step (the row sums are the
        undropped ones) and applied by scores_to_p."""
        drops = None
        if cutlass.const_expr(dropout is not None):
            drops = dropout.draw_pair_flags(acc_S, tScS, m_block * self.tile_m, n_block * self.tile_n)
        return drops

    @cute.jit
    def scores_to_p(self, acc_S, tOrP, dropout=None, drops=None):
        """The softmax's P (fp32, in acc_S) into the PV WGMMA's A operand in registers;
        with dropout, its dropped elements zeroed in 16 bits (pairs of P per AND)."""
        if cutlass.const_expr(self.fp8):
            fp8_operand.scores_to_fp8_operand_a(acc_S, tOrP)
        elif cutlass.const_expr(dropout is not None):
            p = cute.make_rmem_tensor_like(acc_S, tOrP.element_type)
            mma_sm90.acc_to_operand_a(acc_S, mma_sm90.acc_as_operand_a(p))  # per K block (its docstring)
            dropout.apply_to_pairs(p, drops)
            mma_sm90.acc_to_operand_a(p, tOrP)
        else:
            mma_sm90.acc_to_operand_a(acc_S, tOrP)

    @cute.jit
    def fold_descales(self, g: FwdGlobals, score: ScoreScale, tile: WorkTile):
        """FP8: real q k^T = stored q k^T * q_descale * k_descale, folded into the score's
        one multiply (the tanh's pre-scale with a softcap, whose exp2 scale is the
        softcap's own); V's descale goes to the final normalisation (returned). One value
        per (batch entry, KV head): a CTA's rows all share it, packed GQA included."""
        head_kv = tile.head // (g.q.tensor.shape[2] // g.k.tensor.shape[2])
        mq, mk, mv = g.descale
        b = tile.batch  # the sequence's index (varlen too: seqlen.batch is 0 there)
        qk = mq[b, head_kv] * mk[b, head_kv]
        if cutlass.const_expr(self.features.softcap):
            score = ScoreScale(score.softmax_scale, score.scale_log2, score.softcap_pre * qk)
        else:
            score = ScoreScale(score.softmax_scale, score.scale_log2 * qk, score.softcap_pre)
        return score, mv[b, head_kv]

    @cute.jit
    def pv_step(self, tiled_mma_pv, ops: MainloopOperands, pipeline_v, kv_state):
        pipeline_v.consumer_wait(kv_state)
        mma_sm90.gemm(
            tiled_mma_pv, ops.acc_O, ops.tOrP, ops.tOrVt[None, None, None, kv_state.index], wait_groups=0
        )
        pipeline_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def wait_turn(self, wg_idx):
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(
                barrier_id=int(NamedBarrier.WG_TURN_0) + wg_idx, number_of_threads=256
            )

    @cute.jit
    def pass_turn(self, wg_idx):
        if cutlass.const_expr(self.pingpong):
            next_wg = wg_idx + 1
            if next_wg == self.num_mma_wg:
                next_wg = 0
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrier.WG_TURN_0) + next_wg, number_of_threads=256
            )

    @cute.jit
    def epilogue(
        self, acc_O, lse, g: FwdGlobals, sO, tiled_mma_pv, tidx, tile: WorkTile, seqlen: SeqlenInfo,
    ):
        m_block, head = tile.block, tile.head
        # sO is Q's buffer (16-bit, one tile per CTA): Q is dead once every warpgroup passed
        # the barrier below; every warpgroup's last QK^T WGMMA must have read sQ before sO
        # overwrites it. Persistent (sO its own buffer): the previous tile's TMA store
        # has read sO (its warp waited before arriving here) before it is rewritten.
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        epilogue.acc_to_smem(acc_O, sO, tiled_mma_pv, tidx, self.out_dtype)
        # generic-proxy smem writes must be visible to the TMA (async proxy) that reads them
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        d = self.head_dim
        if cutlass.const_expr(self.features.varlen):
            gO = cute.local_tile(seqlen.rows_q(g.o_rows, head), (self.tile_m, d), (m_block, 0))
            epilogue.store_rows(sO, gO, seqlen.seqlen_q - m_block * self.tile_m, tidx, self.num_mma_threads)
        else:
            if tidx // 32 == 0:
                gO = cute.local_tile(seqlen.rows_q(g.o.tensor, head), (self.tile_m, d), (m_block, 0))
                epilogue.tma_store_tile(g.o.atom, sO, gO)

        self.store_lse(lse, g, tiled_mma_pv, tidx, tile, seqlen, seqlen.batch)

    @cute.jit
    def store_lse(self, lse, g: FwdGlobals, tiled_mma_pv, tidx, tile: WorkTile, seqlen: SeqlenInfo, batch):
        """The quad's column-0 thread writes its rows' LSE, clipped to seqlen_q, at this
        batch index of g.lse."""
        thr_mma = tiled_mma_pv.get_slice(tidx)
        tOcO = mma_sm90.acc_as_rows_cols(
            thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        )
        mLSE_cur = seqlen.stats_q(g.lse, tile.head, batch)
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tile.block * self.tile_m + tOcO[r, 0][0]
                if row < seqlen.seqlen_q * self.pack_gqa:
                    mLSE_cur[row] = lse[r]

    @cute.jit
    def store_partials(self, acc_O, lse, g: FwdGlobals, tiled_mma_pv, tidx, tile: WorkTile, seqlen: SeqlenInfo):
        """Split-KV epilogue: this split's normalised O (fp32) and LSE, from registers
        into the partial buffers at batch index split * batch + b (varlen: batch 1, so
        the split). No shared memory: an fp32 tile is twice Q's buffer, and the partials
        of a decode tile are a few KB against the megabytes of keys it reads."""
        part = tile.split * g.q.tensor.shape[3] + seqlen.batch
        gO = cute.local_tile(seqlen.rows_q(g.o_rows, tile.head, part), (self.tile_m, self.head_dim), (tile.block, 0))
        self.store_o_rows(acc_O, tiled_mma_pv, tidx, gO, seqlen.seqlen_q * self.pack_gqa - tile.block * self.tile_m)
        self.store_lse(lse, g, tiled_mma_pv, tidx, tile, seqlen, part)

    @cute.jit
    def store_o_rows(self, acc_O, tiled_mma_pv, tidx, dst: cute.Tensor, rows=None):
        """This thread's fp32 O accumulator into the (tile_m, head_dim) tile dst, element
        by element from registers; rows: only tile rows below it (None: every row)."""
        thr_mma = tiled_mma_pv.get_slice(tidx)
        tOcO = mma_sm90.acc_as_rows_cols(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim))))
        acc = mma_sm90.acc_as_rows_cols(acc_O)
        for r in cutlass.range_constexpr(cute.size(acc.shape[0])):
            if cutlass.const_expr(rows is None) or tOcO[r, 0][0] < rows:
                for c in cutlass.range_constexpr(cute.size(acc.shape[1])):
                    dst[tOcO[r, c]] = acc[r, c]

    @cute.jit
    def merge_if_last(self, g: FwdGlobals, smem: FwdSmem, tile: WorkTile, seqlen: SeqlenInfo, num_splits, tidx):
        """Split-KV: count this split done on its tile's counter; the split that completes
        the count merges the tile's partials into O and LSE and resets the counter.

        The protocol (threadfence-reduction style): every consumer thread fences its
        partial stores at GPU scope, the consumers meet at a barrier, then one thread adds
        1 with acq_rel semantics: release publishes this CTA's partials, acquire makes
        every earlier split's visible to this CTA. The splits of a tile run concurrently
        and never wait for each other, so no order of scheduling can deadlock."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        grid_x, grid_y, _ = cute.arch.grid_dim()
        num_blocks = grid_x // num_splits
        counter = tile.block + num_blocks * (tile.head + grid_y * tile.batch)
        if tidx == 0:
            done = cute.arch.atomic_add(
                g.split.tile_counters.iterator + counter, Int32(1), sem="acq_rel", scope="gpu"
            )
            is_last = Int32(0)
            if done == num_splits - 1:
                is_last = Int32(1)
                # every split of the tile has counted: the next call starts from 0
                g.split.tile_counters[counter] = Int32(0)
            smem.tile_is_last[0] = is_last
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        if smem.tile_is_last[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            self.merge_tile(g, smem, tile, seqlen, num_splits, tidx)

    @cute.jit
    def merge_tile(self, g: FwdGlobals, smem: FwdSmem, tile: WorkTile, seqlen: SeqlenInfo, num_splits, tidx):
        """The tile's rows merged by all consumer threads (blocks/lse_combine.py)."""

        def sync():
            cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)

        rows, row_coord = self.merge_rows(tile, seqlen)
        merge = lse_combine.SplitMerge(self.head_dim, self.out_dtype, self.num_mma_threads, self.tile_m)
        merge.merge_tile(g.split.o_part, g.split.lse_part, g.split.o, g.split.lse, smem.row_lse, num_splits,
                         seqlen.batch, rows, row_coord, tidx, sync)

    def merge_rows(self, tile: WorkTile, seqlen: SeqlenInfo):
        """(rows, row_coord): the tile's rows that hold queries, and row r's (query row,
        query head) in the outputs' indexing. Packed GQA: row r of KV head h's tile is
        query r // pack_gqa of query head h * pack_gqa + r % pack_gqa (blocks/views.py).
        (Plain Python: runs while tracing.)"""
        first = tile.block * self.tile_m
        rows = cutlass.min(self.tile_m, seqlen.seqlen_q * self.pack_gqa - first)

        def row_coord(r):
            row = first + r
            if cutlass.const_expr(self.pack_gqa > 1):
                return seqlen.offset_q + row // self.pack_gqa, tile.head * self.pack_gqa + row % self.pack_gqa
            return seqlen.offset_q + row, tile.head

        return rows, row_coord

    @cute.jit
    def merge_in_cluster(self, acc_O, lse, g: FwdGlobals, smem: FwdSmem, tiled_mma_pv, tidx, tile: WorkTile,
                         seqlen: SeqlenInfo, num_splits):
        """FwdConfig.cluster_splits: the tile's num_splits CTAs are one thread-block
        cluster, split s its CTA s. Each keeps its normalised O (fp32) and LSEs in its own
        shared memory (O over the K and V rings, free once every consumer warpgroup's
        last WGMMA has completed; the LSEs in row_lse), the cluster meets at a barrier (arrive releases
        this CTA's stores, wait acquires every split's), split 0 merges the tile from the
        others' shared memory (blocks/dsmem.py) into O and LSE, and a second cluster
        barrier keeps the other CTAs, and their shared memory, alive until it has read.
        Against merge_if_last: no fp32 partials in global memory, no fence, no counter
        (and so no zeroed workspace), no L2 round trip; both barriers are on chip."""
        # every consumer warpgroup is past its last WGMMA: the K and V rings are free
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        sO = smem.o_part
        self.store_o_rows(acc_O, tiled_mma_pv, tidx, sO)
        thr_mma = tiled_mma_pv.get_slice(tidx)
        tOcO = mma_sm90.acc_as_rows_cols(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim))))
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                smem.row_lse[tOcO[r, 0][0]] = lse[r]
        # Every consumer thread of every split arrives; the producer warpgroup's threads
        # have exited by then (warp 0 after its last load, which the consumers waited
        # for), and a cluster barrier waits for non-exited threads only. A producer that
        # outlived its loads (a persistent loop) would have to arrive here too.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if cute.arch.block_in_cluster_idx()[0] == 0:
            rows, row_coord = self.merge_rows(tile, seqlen)
            merge = lse_combine.SplitMerge(self.head_dim, self.out_dtype, self.num_mma_threads, self.tile_m)
            merge.merge_tile_from_cluster(sO, smem.row_lse, g.split.o, g.split.lse, num_splits, seqlen.batch, rows,
                                          row_coord, tidx)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


class FlashFwdSm90SplitKV(FlashFwdSm90):
    """The split-KV forward's entry point (config.FwdConfig.split_kv): O and LSE as the
    dense forward's, plus the fp32 partials the splits write and the per-tile counters
    (zeros; the kernel leaves them zero) that elect the merging split (with
    cluster_splits, placeholders: the splits merge in a cluster)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mPageTable: cute.Tensor,
        mOpart: cute.Tensor,  # (num_splits * batch, seqlen_q, heads, head_dim) fp32
        mLSEpart: cute.Tensor,  # (num_splits * batch, heads, seqlen_q) fp32
        mTileCounters: cute.Tensor,  # (tiles,) int32, zero
        max_seqlen_q: Int32,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        num_splits: Int32,
        stream,
    ):
        split = SplitBuffers(mOpart, mLSEpart, mO, mLSE, mTileCounters)
        self.launch(mQ, mK, mV, mOpart, mLSEpart, mCuSeqlensQ, mCuSeqlensK, mPageTable, split,
                    (mLSE, mLSE, mLSE), max_seqlen_q, softmax_scale, softcap, window_left, window_right,
                    num_splits, stream)


class FlashFwdSm90Fp8(FlashFwdSm90):
    """The FP8 (e4m3) forward's entry point: q, k and V transposed in e4m3, each with its
    (batch, heads_kv) float32 descale (real = stored * descale), O in 16 bits.

    An attention sink (AttnFeatures.sink) is the dense kernel's: one more term of each
    row's sum at the end, in the same log2 units as the descaled scores.

    V arrives as V^T: the caller passes a (batch, seqlen_k, heads_kv, head_dim) view whose
    seqlen mode is contiguous (launcher.transpose_v_fp8), because FP8 WGMMA reads both
    operands K-major and the K of P V is the key. The kernel is the dense one otherwise:
    the same pipelines, masks and softmax, with P permuted into the FP8 A layout
    (blocks/fp8_operand.py) and the descales folded into the score scale and the final
    normalisation (fold_descales)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mVt: cute.Tensor,  # (batch, keys padded to 16, heads_kv, head_dim), keys contiguous and permuted
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mQDescale: cute.Tensor,  # (batch, heads_kv) float32
        mKDescale: cute.Tensor,
        mVDescale: cute.Tensor,
        mSink: cute.Tensor,  # (heads,) float32 sink logits (AttnFeatures.sink), else a stand-in
        max_seqlen_q: Int32,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
    ):
        split = SplitBuffers(mO, mLSE, mO, mLSE, mCuSeqlensK)  # unread stand-ins
        self.launch(mQ, mK, mVt, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mCuSeqlensK, split,
                    (mQDescale, mKDescale, mVDescale), max_seqlen_q, softmax_scale, softcap, window_left,
                    window_right, Int32(1), stream, sink=mSink)


class FlashFwdSm90Mods(FlashFwdSm90):
    """The forward with mask and/or score mods (AttnFeatures.mask_mod / score_mod,
    cute_attn/masks.py): the dense kernel walking a block mask's tile lists (a mask mod)
    and applying the mods per element (blocks/mods.py). The mods' aux tensors arrive as
    one tuple, the mask mod's first; a call without aux tensors passes one stand-in.
    The same entry point carries attention sinks and dropout (AttnFeatures.sink /
    .dropout, with or without mods: then the mask kind, window and softcap are the dense
    kernel's)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        mPartialCount: cute.Tensor,  # (batch, heads, tiles_m) int32: block_mask.BlockMask
        mPartialIdx: cute.Tensor,  # (batch, heads, tiles_m, tiles_n) int32
        mFullCount: cute.Tensor,
        mFullIdx: cute.Tensor,
        aux: tuple,
        mSink: cute.Tensor,  # (heads,) float32 sink logits (AttnFeatures.sink), else a stand-in
        mDropoutSeed: cute.Tensor,  # (2,) int32 Philox key (AttnFeatures.dropout), else a stand-in
        dropout_threshold: Int32,
        dropout_inv_keep: Float32,
        max_seqlen_q: Int32,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
    ):
        split = SplitBuffers(mO, mLSE, mO, mLSE, mCuSeqlensK)  # unread stand-ins
        self.launch(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mCuSeqlensK, split, (mLSE, mLSE, mLSE),
                    max_seqlen_q, softmax_scale, softcap, window_left, window_right, Int32(1), stream,
                    sparse=(mPartialCount, mPartialIdx, mFullCount, mFullIdx), aux=aux, sink=mSink,
                    dropout=DropoutArgs(mDropoutSeed, dropout_threshold, dropout_inv_keep))
