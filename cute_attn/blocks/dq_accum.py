"""The backward's fp32 dQ accumulator: the contract between the preprocess, which zeroes
each query tile's chunk (kernels/bwd_prepost.py; the launcher allocates the buffer
unset), the main kernel, which adds each query tile's dQ into it (kernels/bwd_sm90.py:
bulk reduce-adds of an sdQ tile by the dQ writer warp, or with BwdConfig.dq_atomic vector
atomics straight from the consumers' registers, `add_from_registers`), and the
postprocess, which reads it back and writes dQ (kernels/bwd_prepost.py). The preprocess
and the postprocess cover the same chunks (the same grid and guard); chunks neither
covers (varlen padding past a sequence's tiles) stay unset and are never read.

Layout: per (batch, head), one chunk of tile_m * head_dim floats per query block, in
query block order. Varlen batches pad each sequence to whole query tiles
(blocks/seqlen.py: SeqlenInfo.padded_m_block_offset). Inside a chunk, the values are in
the register order of the dQ WGMMA's accumulator fragment (`offset`), so each thread's
stores are conflict-free and a warp's stores fill contiguous bytes. With
BwdConfig.dq_swapped that WGMMA computes dQ^T (`mma_shape`): the chunk holds the dQ^T
fragment's order, and the postprocess, building the same MMA, stores it transposed.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cutlass_dsl import dsl_user_op

from cute_attn.blocks import mma_sm90


def make_dq_mma(dtype, head_dim: int, num_warpgroups: int, tile_m: int, swapped: bool = False) -> cute.TiledMma:
    """dQ = dS K for one query tile: M = tile_m, N = head_dim, K = tile_n; A (dS) is
    MN-major in smem, B (K^T) MN-major. With 64 query rows per warpgroup the warpgroups
    stack along M, each a whole-head-dim WGMMA; otherwise they split N (head_dim /
    num_warpgroups columns each). At head dim 64 the N split ran 64 x 32 WGMMAs, which
    read their smem operands for half the work of 64 x 64 ones (FlashAttention-4 splits
    the queries there).

    swapped (BwdConfig.dq_swapped): dQ^T = K^T dS^T, M = head_dim (the warpgroups stacked,
    64 rows each, head_dim / (64 * num_warpgroups) M repeats), N = tile_m, any multiple of
    8; A (K^T) MN-major, B (dS, queries x keys) K-major."""
    if swapped:
        return mma_sm90.make_tiled_mma(dtype, OperandMajorMode.K, tile_m, num_warpgroups, a_major=OperandMajorMode.MN)
    if num_warpgroups > 1 and tile_m == 64 * num_warpgroups:
        return mma_sm90.make_tiled_mma(dtype, OperandMajorMode.MN, head_dim, num_warpgroups,
                                       a_major=OperandMajorMode.MN)
    return mma_sm90.make_tiled_mma(
        dtype, OperandMajorMode.MN, head_dim // num_warpgroups, num_warpgroups,
        a_major=OperandMajorMode.MN, warpgroups_along_n=True,
    )


def mma_shape(tile_m: int, head_dim: int, swapped: bool) -> tuple:
    """(M, N) of make_dq_mma's product: dQ's (tile_m, head_dim), or dQ^T's when swapped."""
    return (head_dim, tile_m) if swapped else (tile_m, head_dim)


def offset(i: int, tidx, regs: int):
    """Where accumulator register i (of `regs` per thread) of thread tidx lives in a chunk:
    each warpgroup's registers fill 128 * regs contiguous floats (so a warpgroup's part of
    sdQ can go to dQ_accum alone, BwdConfig.dq_handoff_per_wg), and within them pairs of
    registers (adjacent columns) are interleaved across the warpgroup's threads, so a
    warp's 8-byte stores fill 256 contiguous bytes."""
    return (tidx // 128) * (128 * regs) + (i // 2) * 256 + (tidx % 128) * 2 + (i % 2)


def chunk_index(padded_m_block_offset, m_block):
    """The chunk of a query block within its (batch, head) row."""
    return padded_m_block_offset + m_block


@dsl_user_op
def red_add_f32x2(ptr: cute.Pointer, a: Float32, b: Float32, *, loc=None, ip=None):
    """global[0:2] += (a, b): one fire-and-forget vector reduction (sm_90), performed in L2,
    unordered between threads and CTAs. ptr must be 8-byte aligned."""
    llvm.inline_asm(
        None,
        [ptr.llvm_ptr, Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def add_from_registers(acc: cute.Tensor, chunk: cute.Tensor, tidx):
    """chunk += this thread's dQ accumulator fragment, in the chunk's register order
    (`offset`): each register pair is one 8-byte vector atomic, and a warp's pairs cover
    256 contiguous bytes, so the reductions coalesce like the sdQ stores they replace."""
    for i in cutlass.range_constexpr(0, cute.size(acc), 2):
        red_add_f32x2(chunk.iterator + offset(i, tidx, cute.size(acc)), acc[i], acc[i + 1])
