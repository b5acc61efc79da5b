"""The small kernels around the Hopper backward (kernels/bwd_sm90.py).

BwdPreprocess, one warp per query row (memory-bound, a few percent of the backward):
  D[b, h, i]    = sum_d dO[b, i, h, d] * O[b, i, h, d]     (fp32)
  LSE2[b, h, i] = LSE[b, h, i] * log2(e)
for i < seqlen_q rounded up to the backward's tile_m, so the main kernel loads whole tiles
as one aligned chunk. Padding rows and rows that saw no key (LSE = -inf) get LSE2 = +inf,
which makes their recomputed P exactly 0 (exp2(S - inf)); padding rows get D = 0. Packed
(varlen) batches pad each sequence to whole tiles (blocks/seqlen.py): the padding rows
then stand for the next sequence's queries, which a tile loads, and +inf keeps them out.

BwdPostprocess, one CTA per query tile: dQ = softmax_scale * dQ_accum in the input dtype.
dQ_accum holds each tile in the dQ WGMMA's fragment order (bwd_sm90.dq_accum_offset), so
this kernel reads it back into that fragment, then writes it out as the forward writes O:
stmatrix into a swizzled shared tile, and 16-byte stores of whole rows.
"""

import math
from typing import Type

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32

from cute_attn.blocks import epilogue, mma_sm90
from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.kernels.bwd_sm90 import dq_accum_offset, make_dq_mma

_ROWS_PER_WARP = 16


class BwdPreprocess:
    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, tile_m: int, varlen: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.varlen = varlen
        assert tile_m % _ROWS_PER_WARP == 0 and head_dim % 32 == 0
        self.num_warps = tile_m // _ROWS_PER_WARP

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q)
        mLSE2: cute.Tensor,  # (batch, heads, padded rows)
        mD: cute.Tensor,  # (batch, heads, padded rows)
        mCuSeqlensQ: cute.Tensor,  # varlen only
        max_seqlen_q: Int32,  # varlen only
        stream,
    ):
        if cutlass.const_expr(self.varlen):
            num_m_blocks = cute.ceil_div(max_seqlen_q, self.tile_m)
            batch = cute.size(mCuSeqlensQ.shape[0]) - 1
        else:
            num_m_blocks = cute.ceil_div(cute.size(mLSE2.shape[2]), self.tile_m)
            batch = cute.size(mLSE2.shape[0])
        grid = (num_m_blocks, cute.size(mLSE2.shape[1]), batch)
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mCuSeqlensQ).launch(
            grid=grid, block=[32 * self.num_warps, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
        mD: cute.Tensor, mCuSeqlensQ: cute.Tensor,
    ):
        m_block, head, batch = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        seqlen = SeqlenInfo(
            batch, mO.shape[1], mO.shape[1], mCuSeqlensQ, mCuSeqlensQ, self.varlen, tile_m_padded=self.tile_m
        )
        b = seqlen.batch
        first_row = (seqlen.padded_m_block_offset + m_block) * self.tile_m
        # varlen: tiles past this sequence's padded end belong to no one
        if not self.varlen or m_block * self.tile_m < seqlen.seqlen_q:
            for i in cutlass.range(_ROWS_PER_WARP, unroll=1):
                row = m_block * self.tile_m + warp * _ROWS_PER_WARP + i
                dot = Float32(0.0)
                lse2 = Float32.inf
                if row < seqlen.seqlen_q:
                    src = seqlen.offset_q + row
                    # lanes read adjacent elements: each load instruction covers 64 bytes
                    for j in cutlass.range_constexpr(self.head_dim // 32):
                        col = lane + 32 * j
                        dot += Float32(mO[b, src, head, col]) * Float32(mdO[b, src, head, col])
                    dot = cute.arch.warp_reduction_sum(dot)
                    lse = mLSE[b, head, src]
                    lse2 = Float32.inf if lse == -Float32.inf else lse * math.log2(math.e)
                if lane == 0:
                    dst = first_row + warp * _ROWS_PER_WARP + i
                    mD[b, head, dst] = dot
                    mLSE2[b, head, dst] = lse2


class BwdPostprocess:
    def __init__(
        self, dtype: Type[cutlass.Numeric], head_dim: int, tile_m: int, dq_warpgroups: int, d_slice: int,
        varlen: bool = False,
    ):
        self.dtype = dtype
        self.varlen = varlen
        self.head_dim = head_dim
        # one dQ_accum chunk per (query block, head_dim slice), as the main kernel writes them
        self.d_slice = d_slice
        self.num_d_slices = head_dim // d_slice
        self.tile_m = tile_m
        self.dq_wgs = dq_warpgroups  # the main kernel's dQ layout: see BwdConfig.dq_warpgroups
        self.num_threads = 128 * dq_warpgroups

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
        tiled_mma_dq = make_dq_mma(self.dtype, self.d_slice, self.dq_wgs)
        sdQ_layout = mma_sm90.make_smem_layout(self.dtype, self.tile_m, self.d_slice)

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)], 1024]

        self.shared_storage = SharedStorage
        if cutlass.const_expr(self.varlen):
            num_m_blocks = cute.ceil_div(max_seqlen_q, self.tile_m)
            batch = cute.size(mCuSeqlensQ.shape[0]) - 1
        else:
            num_m_blocks = cute.ceil_div(cute.size(mdQ.shape[1]), self.tile_m)
            batch = cute.size(mdQ.shape[0])
        grid = (num_m_blocks * self.num_d_slices, cute.size(mdQ.shape[2]), batch)
        # the kernel's view: (seqlen, head_dim, heads, batch), as the other kernels see it
        mdQ = cute.make_tensor(mdQ.iterator, cute.select(mdQ.layout, mode=[1, 3, 2, 0]))
        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, softmax_scale, tiled_mma_dq, sdQ_layout).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
        softmax_scale: Float32, tiled_mma_dq: cute.TiledMma, sdQ_layout: cute.ComposedLayout,
    ):
        bid, head, batch = cute.arch.block_idx()
        m_block, d_block = bid // self.num_d_slices, bid % self.num_d_slices
        tidx, _, _ = cute.arch.thread_idx()
        seqlen = SeqlenInfo(
            batch, mdQ.shape[0], mdQ.shape[0], mCuSeqlensQ, mCuSeqlensQ, self.varlen, tile_m_padded=self.tile_m
        )
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        # varlen: the grid covers the longest sequence
        if not self.varlen or m_block * self.tile_m < seqlen.seqlen_q:
            # the main kernel's chunk of this (query block, head_dim slice), in the dQ
            # WGMMA's fragment order: read back into that fragment, each load coalesced
            tile_idx = (seqlen.padded_m_block_offset + m_block) * self.num_d_slices + d_block
            base = tile_idx * (self.tile_m * self.d_slice)
            acc = cute.make_rmem_tensor(
                tiled_mma_dq.get_slice(tidx).partition_shape_C((self.tile_m, self.d_slice)), Float32
            )
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = mdQaccum[seqlen.batch, head, base + dq_accum_offset(i, tidx, self.num_threads)]
            # then out like the forward's O: scaled, converted, stmatrix to shared memory,
            # and 16-byte row stores (2-byte scattered stores from the fragment ran at a
            # fifth of the memory bandwidth: 315 us for 200 MB on an H100)
            epilogue.acc_to_smem(acc, sdQ, tiled_mma_dq, tidx, self.dtype, scale=softmax_scale)
            cute.arch.sync_threads()
            gdQ = cute.local_tile(seqlen.rows_q(mdQ, head), (self.tile_m, self.d_slice), (m_block, d_block))
            epilogue.store_rows(sdQ, gdQ, seqlen.seqlen_q - m_block * self.tile_m, tidx, self.num_threads)
