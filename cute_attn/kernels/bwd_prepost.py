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
this kernel partitions the tile with the same tiled MMA to find each value's (row, col).
"""

import math
from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

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
        if cutlass.const_expr(self.varlen):
            num_m_blocks = cute.ceil_div(max_seqlen_q, self.tile_m)
            batch = cute.size(mCuSeqlensQ.shape[0]) - 1
        else:
            num_m_blocks = cute.ceil_div(cute.size(mdQ.shape[1]), self.tile_m)
            batch = cute.size(mdQ.shape[0])
        grid = (num_m_blocks * self.num_d_slices, cute.size(mdQ.shape[2]), batch)
        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, softmax_scale, tiled_mma_dq).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
        softmax_scale: Float32, tiled_mma_dq: cute.TiledMma,
    ):
        bid, head, batch = cute.arch.block_idx()
        m_block, d_block = bid // self.num_d_slices, bid % self.num_d_slices
        tidx, _, _ = cute.arch.thread_idx()
        seqlen = SeqlenInfo(
            batch, mdQ.shape[1], mdQ.shape[1], mCuSeqlensQ, mCuSeqlensQ, self.varlen, tile_m_padded=self.tile_m
        )
        b = seqlen.batch
        tCcC = tiled_mma_dq.get_slice(tidx).partition_C(
            cute.make_identity_tensor((self.tile_m, self.d_slice))
        )
        # the main kernel's chunk of this (query block, head_dim slice)
        tile_idx = (seqlen.padded_m_block_offset + m_block) * self.num_d_slices + d_block
        base = tile_idx * (self.tile_m * self.d_slice)
        for i in cutlass.range_constexpr(cute.size(tCcC)):
            row = m_block * self.tile_m + tCcC[i][0]
            if row < seqlen.seqlen_q:
                value = mdQaccum[b, head, base + dq_accum_offset(i, tidx, self.num_threads)]
                col = d_block * self.d_slice + tCcC[i][1]
                mdQ[b, seqlen.offset_q + row, head, col] = (value * softmax_scale).to(self.dtype)
