"""The backward's fp32 dQ accumulator: the contract between the main kernel, which adds
each query tile's dQ into it with bulk reduce-adds (kernels/bwd_sm90.py), and the
postprocess, which reads it back and writes dQ (kernels/bwd_prepost.py).

Layout: per (batch, head), one chunk of tile_m * d_slice floats per (query block, head_dim
slice), query block major. Varlen batches pad each sequence to whole query tiles
(blocks/seqlen.py: SeqlenInfo.padded_m_block_offset). Inside a chunk, the values are in
the register order of the dQ WGMMA's accumulator fragment (`offset`), so each thread's
stores are conflict-free and a warp's stores fill contiguous bytes.
"""

import cutlass.cute as cute
from cutlass.cute.nvgpu import OperandMajorMode

from cute_attn.blocks import mma_sm90


def make_dq_mma(dtype, d_slice: int, num_warpgroups: int) -> cute.TiledMma:
    """dQ = dS K for one query tile: M = tile_m (64), N = d_slice split across the
    warpgroups, K = tile_n; A (dS) is MN-major in smem, B (K^T) MN-major."""
    return mma_sm90.make_tiled_mma(
        dtype, OperandMajorMode.MN, d_slice // num_warpgroups, num_warpgroups,
        a_major=OperandMajorMode.MN, warpgroups_along_n=True,
    )


def offset(i: int, tidx, num_threads: int):
    """Where accumulator register i of thread tidx lives in a chunk: pairs of registers
    (adjacent columns) are interleaved across threads, so a warp's 8-byte stores fill 256
    contiguous bytes."""
    return (i // 2) * (2 * num_threads) + tidx * 2 + (i % 2)


def chunk_index(padded_m_block_offset, m_block, d_block, num_d_slices: int):
    """The chunk of (query block, head_dim slice) within its (batch, head) row."""
    return (padded_m_block_offset + m_block) * num_d_slices + d_block
