"""The small kernels around the Hopper backward (kernels/bwd_sm90.py).

BwdPreprocess, one CTA per query tile (memory-bound):
  D[b, h, i]    = sum_d dO[b, i, h, d] * O[b, i, h, d]     (fp32)
  LSE2[b, h, i] = LSE[b, h, i] * log2(e)
  dQ_accum[b, h, the tile's chunk] = 0
for i < seqlen_q rounded up to the backward's tile_m, so the main kernel loads whole tiles
as one aligned chunk. Padding rows and rows that saw no key (LSE = -inf) get LSE2 = +inf,
which makes their recomputed P exactly 0 (exp2(S - inf)); padding rows get D = 0. Packed
(varlen) batches pad each sequence to whole tiles (blocks/seqlen.py): the padding rows
then stand for the next sequence's queries, which a tile loads, and +inf keeps them out.

BwdPostprocess, one CTA per query tile: dQ = softmax_scale * dQ_accum in the input dtype.
dQ_accum holds each tile in the dQ WGMMA's fragment order (blocks/dq_accum.py), so this
kernel reads it back into that fragment, then writes it out as the forward writes O:
stmatrix into a swizzled shared tile, and 16-byte stores of whole rows.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32

from cute_attn.blocks import dq_accum, epilogue, mma_sm90
from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.tile_scheduler import TileScheduler
from cute_attn.blocks.views import bshd_as_sdhb, rowwise_as_rhb
from cute_attn.config import AttnFeatures, BwdConfig, DtypePolicy

# Threads of a preprocess CTA (fewer where tile_m has no multiple of 256 / threads-per-row
# rows: head dim 96 at tile_m 80). At head dim 64 / 128 the default tiles take 52
# registers; 128 threads took 92 (20 warps an SM) and ran 82.7 us against 72.9 at
# b32 x 512 x 32 heads (H200, perf/NOTES.md session 30)
_THREADS = 256


class BwdPreprocess:
    def __init__(self, dtypes: DtypePolicy, head_dim: int, config: BwdConfig, features: AttnFeatures):
        self.dtype = dtypes.dsl("input")
        self.head_dim = head_dim
        self.tile_m = config.tile_m
        self.varlen = features.varlen
        assert self.tile_m % 16 == 0 and head_dim % 32 == 0
        # rows of O and dO move 16 bytes per thread and load (epilogue.row_copy); a pass of
        # the CTA covers whole rows, and the tile a whole number of passes
        tpr = self.threads_per_row = epilogue.threads_per_row(self.dtype, head_dim)
        self.num_threads = math.gcd(self.tile_m, _THREADS // tpr) * tpr
        self.scheduler = TileScheduler(self.tile_m, self.varlen)

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q)
        mLSE2: cute.Tensor,  # (batch, heads, padded rows)
        mD: cute.Tensor,  # (batch, heads, padded rows)
        mdQaccum: cute.Tensor,  # (batch, heads, m_blocks * tile_m * head_dim), float32
        mCuSeqlensQ: cute.Tensor,  # varlen only
        max_seqlen_q: Int32,  # varlen only
        stream,
    ):
        mO, mdO = bshd_as_sdhb(mO), bshd_as_sdhb(mdO)
        grid = self.scheduler.grid(mO, mCuSeqlensQ, max_seqlen_q)
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mdQaccum, mCuSeqlensQ).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
        mD: cute.Tensor, mdQaccum: cute.Tensor, mCuSeqlensQ: cute.Tensor,
    ):
        m_block, head, batch, _ = self.scheduler.tile()
        tidx, _, _ = cute.arch.thread_idx()
        seqlen = SeqlenInfo(
            batch, mO.shape[0], mO.shape[0], mCuSeqlensQ, mCuSeqlensQ, self.varlen, tile_m_padded=self.tile_m
        )
        b = seqlen.batch
        # varlen: tiles past this sequence's padded end belong to no one
        if not self.varlen or m_block * self.tile_m < seqlen.seqlen_q:
            tile = (self.tile_m, self.head_dim)
            copy_atom, tiled_copy = epilogue.row_copy(self.dtype, self.head_dim, self.num_threads)
            thr_copy = tiled_copy.get_slice(tidx)
            tOgO = thr_copy.partition_S(cute.local_tile(seqlen.rows_q(mO, head), tile, (m_block, 0)))
            tOgdO = thr_copy.partition_S(cute.local_tile(seqlen.rows_q(mdO, head), tile, (m_block, 0)))
            tOcO = thr_copy.partition_S(cute.make_identity_tensor(tile))
            tOrO = cute.make_rmem_tensor_like(tOgO)
            tOrdO = cute.make_rmem_tensor_like(tOgdO)
            passes = cute.size(tOgO.shape[1])
            lse = cute.make_rmem_tensor((passes,), Float32)
            mLSE_rows = seqlen.stats_q(rowwise_as_rhb(mLSE), head)
            rows_left = seqlen.seqlen_q - m_block * self.tile_m
            # every load first (the rows' LSEs too), so a CTA waits for memory about once: a
            # load after each row's D store waits a round trip per pass (the stores may alias)
            for m in cutlass.range_constexpr(passes):
                row = tOcO[0, m, 0][0]
                if row < rows_left:
                    cute.copy(copy_atom, tOgO[None, m, None], tOrO[None, m, None])
                    cute.copy(copy_atom, tOgdO[None, m, None], tOrdO[None, m, None])
                    lse[m] = mLSE_rows[m_block * self.tile_m + row]
            # the stores drain while the loads are in flight
            self._zero_dq_accum(mdQaccum, b, head, dq_accum.chunk_index(seqlen.padded_m_block_offset, m_block), tidx)
            tpr = self.threads_per_row
            first_row = (seqlen.padded_m_block_offset + m_block) * self.tile_m
            for m in cutlass.range_constexpr(passes):
                row = tOcO[0, m, 0][0]
                dot = Float32(0.0)
                lse2 = Float32.inf
                if row < rows_left:
                    o = tOrO[None, m, None].load().to(Float32)
                    do = tOrdO[None, m, None].load().to(Float32)
                    dot = (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    if lse[m] != -Float32.inf:
                        lse2 = lse[m] * math.log2(math.e)
                # the row's threads are adjacent lanes: reduce over them (all lanes take part)
                dot = cute.arch.warp_reduction_sum(dot, threads_in_group=tpr)
                if tidx % tpr == 0:
                    mD[b, head, first_row + row] = dot
                    mLSE2[b, head, first_row + row] = lse2

    @cute.jit
    def _zero_dq_accum(self, mdQaccum: cute.Tensor, b, head, chunk, tidx):
        """Zero this query block's dQ_accum chunk (the main kernel adds into it): one pass
        over the buffer instead of a torch.zeros launch before this kernel, 16-byte stores."""
        size = self.tile_m * self.head_dim
        gZ = cute.local_tile(mdQaccum[b, head, None], (size,), (chunk,))
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        zero_copy = cute.make_tiled_copy_tv(atom, cute.make_layout(self.num_threads), cute.make_layout(4))
        tZgZ = zero_copy.get_slice(tidx).partition_D(gZ)
        zeros = cute.make_rmem_tensor_like(tZgZ[None, 0])
        zeros.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(tZgZ.shape[1])):
            cute.copy(atom, zeros, tZgZ[None, i])


class BwdPostprocess:
    def __init__(self, dtypes: DtypePolicy, head_dim: int, config: BwdConfig, features: AttnFeatures):
        self.dtype = dtypes.dsl("input")  # of the dQ MMA whose fragment order dQ_accum has
        self.out_dtype = dtypes.dsl("output")
        self.varlen = features.varlen
        self.head_dim = head_dim
        self.tile_m = config.tile_m
        self.split_d = config.split_d
        self.dq_wgs = config.dq_warpgroups  # the main kernel's dQ layout: see BwdConfig.dq_warpgroups
        self.dq_swapped = config.dq_swapped  # its dQ^T fragment order: see BwdConfig.dq_swapped
        self.num_threads = 128 * self.dq_wgs
        self.scheduler = TileScheduler(self.tile_m, self.varlen)

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # (batch, heads, m_blocks * tile_m * head_dim), float32
        mdQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mCuSeqlensQ: cute.Tensor,  # varlen only
        max_seqlen_q: Int32,  # varlen only
        softmax_scale: Float32,
        stream,
    ):
        d = self.head_dim
        tiled_mma_dq = dq_accum.make_dq_mma(self.dtype, d, self.dq_wgs, self.tile_m, self.dq_swapped)
        sdQ_layout = mma_sm90.make_smem_layout(self.out_dtype, self.tile_m, d,
                                               atom_cols=d // self.dq_wgs if self.split_d else None)

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cute.cosize(sdQ_layout)], 1024]

        self.shared_storage = SharedStorage
        # the kernel's view: (seqlen, head_dim, heads, batch), as the other kernels see it
        mdQ = bshd_as_sdhb(mdQ)
        grid = self.scheduler.grid(mdQ, mCuSeqlensQ, max_seqlen_q)
        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, softmax_scale, tiled_mma_dq, sdQ_layout).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
        softmax_scale: Float32, tiled_mma_dq: cute.TiledMma, sdQ_layout: cute.ComposedLayout,
    ):
        m_block, head, batch, _ = self.scheduler.tile()
        tidx, _, _ = cute.arch.thread_idx()
        seqlen = SeqlenInfo(
            batch, mdQ.shape[0], mdQ.shape[0], mCuSeqlensQ, mCuSeqlensQ, self.varlen, tile_m_padded=self.tile_m
        )
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        # varlen: the grid covers the longest sequence
        if not self.varlen or m_block * self.tile_m < seqlen.seqlen_q:
            # the main kernel's chunk of this query block, in the dQ
            # WGMMA's fragment order: read back into that fragment, each load coalesced
            chunk = dq_accum.chunk_index(seqlen.padded_m_block_offset, m_block)
            base = chunk * (self.tile_m * self.head_dim)
            acc = cute.make_rmem_tensor(
                tiled_mma_dq.get_slice(tidx).partition_shape_C(
                    dq_accum.mma_shape(self.tile_m, self.head_dim, self.dq_swapped)), Float32
            )
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = mdQaccum[seqlen.batch, head, base + dq_accum.offset(i, tidx, cute.size(acc))]
            # then out like the forward's O: scaled, converted, stmatrix to shared memory,
            # and 16-byte row stores (2-byte scattered stores from the fragment ran at a
            # fifth of the memory bandwidth: 315 us for 200 MB on an H100); a dQ^T fragment
            # (dq_swapped) goes in by stmatrix .trans through sdQ's transposed view
            sdQ_mma = mma_sm90.transpose_view(sdQ) if cutlass.const_expr(self.dq_swapped) else sdQ
            epilogue.acc_to_smem(acc, sdQ_mma, tiled_mma_dq, tidx, self.out_dtype, scale=softmax_scale,
                                 transpose=self.dq_swapped)
            cute.arch.sync_threads()
            gdQ = cute.local_tile(seqlen.rows_q(mdQ, head), (self.tile_m, self.head_dim), (m_block, 0))
            epilogue.store_rows(sdQ, gdQ, seqlen.seqlen_q - m_block * self.tile_m, tidx, self.num_threads)
