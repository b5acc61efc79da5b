"""The small kernels around the Hopper backward (kernels/bwd_sm90.py).

BwdPreprocess, one warp per query row (memory-bound, a few percent of the backward):
  D[b, h, i]    = sum_d dO[b, i, h, d] * O[b, i, h, d]     (fp32)
  LSE2[b, h, i] = LSE[b, h, i] * log2(e)
for i < seqlen_q rounded up to the backward's tile_m, so the main kernel loads whole tiles
as one aligned chunk. Padding rows and rows that saw no key (LSE = -inf) get LSE2 = +inf,
which makes their recomputed P exactly 0 (exp2(S - inf)); padding rows get D = 0.

BwdPostprocess, one CTA per query tile: dQ = softmax_scale * dQ_accum in the input dtype.
dQ_accum holds each tile in the dQ WGMMA's fragment order (bwd_sm90.dq_accum_offset), so
this kernel partitions the tile with the same tiled MMA to find each value's (row, col).
"""

import math
from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_attn.kernels.bwd_sm90 import dq_accum_offset, make_dq_mma

_ROWS_PER_WARP = 16


class BwdPreprocess:
    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, tile_m: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        assert tile_m % _ROWS_PER_WARP == 0 and head_dim % 32 == 0
        self.num_warps = tile_m // _ROWS_PER_WARP

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q)
        mLSE2: cute.Tensor,  # (batch, heads, seqlen_q_rounded)
        mD: cute.Tensor,  # (batch, heads, seqlen_q_rounded)
        stream,
    ):
        grid = (
            cute.ceil_div(cute.size(mLSE2.shape[2]), self.tile_m),
            cute.size(mLSE2.shape[1]),
            cute.size(mLSE2.shape[0]),
        )
        self.kernel(mO, mdO, mLSE, mLSE2, mD).launch(
            grid=grid, block=[32 * self.num_warps, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor):
        m_block, head, batch = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        seqlen_q = mO.shape[1]
        for i in cutlass.range(_ROWS_PER_WARP, unroll=1):
            row = m_block * self.tile_m + warp * _ROWS_PER_WARP + i
            dot = Float32(0.0)
            lse2 = Float32.inf
            if row < seqlen_q:
                # lanes read adjacent elements: each load instruction covers 64 bytes
                for j in cutlass.range_constexpr(self.head_dim // 32):
                    col = lane + 32 * j
                    dot += Float32(mO[batch, row, head, col]) * Float32(mdO[batch, row, head, col])
                dot = cute.arch.warp_reduction_sum(dot)
                lse = mLSE[batch, head, row]
                lse2 = Float32.inf if lse == -Float32.inf else lse * math.log2(math.e)
            if lane == 0:
                mD[batch, head, row] = dot
                mLSE2[batch, head, row] = lse2


class BwdPostprocess:
    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, tile_m: int, dq_warpgroups: int, d_slice: int):
        self.dtype = dtype
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
        softmax_scale: Float32,
        stream,
    ):
        tiled_mma_dq = make_dq_mma(self.dtype, self.d_slice, self.dq_wgs)
        grid = (
            cute.ceil_div(cute.size(mdQ.shape[1]), self.tile_m) * self.num_d_slices,
            cute.size(mdQ.shape[2]),
            cute.size(mdQ.shape[0]),
        )
        self.kernel(mdQaccum, mdQ, softmax_scale, tiled_mma_dq).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32, tiled_mma_dq: cute.TiledMma):
        tile_idx, head, batch = cute.arch.block_idx()
        m_block, d_block = tile_idx // self.num_d_slices, tile_idx % self.num_d_slices
        tidx, _, _ = cute.arch.thread_idx()
        seqlen_q = mdQ.shape[1]
        tCcC = tiled_mma_dq.get_slice(tidx).partition_C(
            cute.make_identity_tensor((self.tile_m, self.d_slice))
        )
        base = tile_idx * (self.tile_m * self.d_slice)
        for i in cutlass.range_constexpr(cute.size(tCcC)):
            row = m_block * self.tile_m + tCcC[i][0]
            if row < seqlen_q:
                value = mdQaccum[batch, head, base + dq_accum_offset(i, tidx, self.num_threads)]
                col = d_block * self.d_slice + tCcC[i][1]
                mdQ[batch, row, head, col] = (value * softmax_scale).to(self.dtype)
