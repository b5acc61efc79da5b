"""WGMMA building blocks for Hopper: tiled MMAs, swizzled shared-memory layouts, the
asynchronous GEMM issue, and views of the accumulator registers.

A warpgroup's accumulator fragment for a 64 x N WGMMA has the layout ((2, 2, N/8), M, N'):
mode 0 holds 2 adjacent columns (mode 0.0), 2 rows 8 apart (mode 0.1) and N/8 column
groups 8 apart (mode 0.2). The helpers below re-view those registers as a (row, col)
matrix (for the softmax and the masks) or as the A operand of the next WGMMA (for P @ V
with P kept in registers) without moving any data.
"""

from typing import Optional, Type

import cutlass
import cutlass._mlir.dialects.cute_nvgpu as cute_nvgpu_ir
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import builtin, llvm
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op


def make_tiled_mma(
    dtype: Type[cutlass.Numeric],
    b_major: OperandMajorMode,
    tile_n: int,
    num_warpgroups: int,
    a_in_registers: bool = False,
    a_major: OperandMajorMode = OperandMajorMode.K,
    warpgroups_along_n: bool = False,
) -> cute.TiledMma:
    """A 64 x tile_n WGMMA per warpgroup, fp32 accumulation. Warpgroups are stacked along
    M (each owns 64 rows) or, with warpgroups_along_n, side by side along N (each owns
    tile_n columns of a 64-row tile)."""
    atom_layout = (1, num_warpgroups, 1) if warpgroups_along_n else (num_warpgroups, 1, 1)
    return sm90_helpers.make_trivial_tiled_mma(
        dtype,
        dtype,
        a_major,
        b_major,
        Float32,
        atom_layout_mnk=atom_layout,
        tiler_mn=(64, tile_n),
        a_source=warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM,
    )


def make_smem_layout(
    dtype: Type[cutlass.Numeric], rows: int, cols: int, stages: Optional[int] = None, atom_cols: Optional[int] = None
):
    """A row-major (rows, cols[, stages]) tile with the widest swizzle the row allows
    (128 B for head dims >= 64): conflict-free for TMA writes and WGMMA reads."""
    atom_kind = sm90_helpers.get_smem_layout_atom(
        cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols
    )
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes (no data movement): V (n, d) seen as V^T (d, n)."""
    modes = [1, 0] + list(range(2, cute.rank(t)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


@cute.jit
def gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA,
    tCrB,
    zero_init: cutlass.Constexpr[bool] = False,
    wait_groups: cutlass.Constexpr[int] = 0,
):
    """Issue acc (+)= A @ B as one WGMMA group over the K blocks. tCrA, tCrB: fragments
    (K blocks in mode 2), or pinned_k_blocks tuples (one view per K block). wait_groups
    >= 0 waits until at most that many WGMMA groups are still in flight; -1 returns at
    once."""
    warpgroup.fence()
    mma_atom = cute.make_mma_atom(tiled_mma.op)
    mma_atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    num_k = len(tCrA) if isinstance(tCrA, tuple) else cute.size(tCrA.shape[2])
    num_k_b = len(tCrB) if isinstance(tCrB, tuple) else cute.size(tCrB.shape[2])
    if cutlass.const_expr(num_k != num_k_b):  # (trace time) a partial GEMM would be silently wrong
        raise ValueError(f"A has {num_k} K blocks, B {num_k_b}")
    for k in cutlass.range_constexpr(num_k):
        a = tCrA[k] if isinstance(tCrA, tuple) else tCrA[None, None, k]
        b = tCrB[k] if isinstance(tCrB, tuple) else tCrB[None, None, k]
        cute.gemm(mma_atom, acc, a, b, acc)
        mma_atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wait_groups >= 0):
        warpgroup.wait_group(wait_groups)


@dsl_user_op
def _true_in_whole_warp(x, *, loc=None, ip=None) -> Int32:
    """A warp-uniform test of x (a Float32, or an Int32's bits read as one): 1 when it is
    >= 0 or NaN in every lane, i.e. its sign bit is clear or it is a NaN; else 0."""
    value, constraint = (Float32(x), "f") if isinstance(x, Float32) else (Int32(x), "r")
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [value.ir_value(loc=loc, ip=ip)],
            "{ .reg .pred p; setp.geu.f32 p, $1, 0f00000000; vote.sync.all.pred p, p, 0xffffffff;"
            " selp.u32 $0, 1, 0, p; }",
            "=r," + constraint,
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def _wait_all_groups_other_path(*, loc=None, ip=None):
    """wgmma.wait_group 0 as an asm statement of its own: the never-taken side of
    wait_all_groups_after's branch, which must not look like the taken side (LLVM would
    hoist two identical waits above the branch, undoing it)."""
    llvm.inline_asm(None, [], "wgmma.wait_group.sync.aligned 0; // the other path", "",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def wait_all_groups_after(value):
    """Wait for every WGMMA group in flight, no earlier than value (a Float32 or an Int32)
    is computed.

    ptxas 13 schedules `wgmma.wait_group` freely among register-only work: in the forward
    it lifted the wait on PV(j-1) above all of softmax(j)'s exp2s, so the softmax never ran
    under PV (perf/NOTES.md, session 24). A branch on a value computed from the exp2s pins
    the wait below them. Both sides wait, so the test's outcome never matters for
    correctness (ptxas also serialises every WGMMA when a path lacks the wait). vote.all
    makes it uniform within each warp; the .aligned wait also wants every warp of the
    warpgroup at the same instruction, so callers pass a value for which the test always
    holds: a sum of exp2s (>= 0 or NaN), or an OR of words of non-negative floats (sign
    bit clear)."""
    if _true_in_whole_warp(value) != 0:
        warpgroup.wait_group(0)
    else:
        _wait_all_groups_other_path()


def as_words(t: cute.Tensor) -> cute.Tensor:
    """A compact register tensor of 8- or 16-bit values seen as 32-bit words, in the
    tensor's own value order (4 or 2 values per word)."""
    flat = cute.make_tensor(t.iterator, cute.make_layout(cute.size(t)))
    return cute.recast_tensor(flat, Int32)


@cute.jit
def or_of_words(t: cute.Tensor) -> Int32:
    """The bitwise OR of a register tensor's words (as_words): one value that depends on
    every element (for wait_all_groups_after: with non-negative 16-bit floats in t, its
    sign bit is clear)."""
    words = as_words(t)
    total = words[0]
    for i in cutlass.range_constexpr(1, cute.size(words)):
        total = total | words[i]
    return total


def acc_layout_rows_cols(layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, M), (2, V, N)): rows first, columns second."""
    s, d = layout.shape, layout.stride
    return cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )


def acc_as_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_layout_rows_cols(acc.layout))


def acc_layout_as_operand_a(layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) accumulator of one GEMM -> ((2, 2, 2), M, (V/2, N)) A operand of
    the next: each 16-wide K slice of a 16-bit WGMMA A fragment is two 8-column groups."""
    s, d = layout.shape, layout.stride
    assert s[0][2] % 2 == 0, "tile_n must be a multiple of 16"
    return cute.make_layout(
        ((s[0][0], s[0][1], 2), s[1], (s[0][2] // 2, s[2])),
        stride=((d[0][0], d[0][1], d[0][2]), d[1], (d[0][2] * 2, d[2])),
    )


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_layout_as_operand_a(acc.layout))


@cute.jit
def acc_to_operand_a(acc: cute.Tensor, dst: cute.Tensor):
    """Convert an fp32 accumulator (or a 16-bit copy of one in its layout) into the next
    WGMMA's 16-bit A fragment (dst), one K block of 8 registers at a time. A whole-tile conversion vectorises to cvt.rn.bf16x2
    only when the K-block count is a power of two: 144- and 176-key blocks (9 and 11 K
    blocks) got scalar cvts plus packing movs between the PV WGMMAs, which ptxas then
    serialised (C7519, ptxas -v)."""
    src = acc_as_operand_a(acc)
    for k in cutlass.range_constexpr(cute.size(src.shape[2])):
        dst[None, None, k].store(src[None, None, k].load().to(dst.element_type))


# Pinned descriptors. A WGMMA shared-memory operand (make_fragment_A/B of a shared tensor)
# is a view on a start descriptor; each WGMMA's descriptor is that value plus an offset (a
# constant, or a stage's). In the persistent forwards' PTX, LLVM re-derived the
# descriptors from the shared address inside every mainloop step (16-bit: 15-43 uniform
# instructions of a 422-491 instruction step; FP8: 21-45 of 568-637). Passing the start
# value through an asm move makes it opaque to LLVM, so it is computed where the pinning
# runs and the steps only add offsets. The values are unchanged (same PTX without the
# move). Fewer instructions did not always mean faster: FlashFwdSm90.pin_descriptors says
# where it measured so (perf/NOTES.md, sessions 26-27).


@dsl_user_op
def pinned_descriptors(t: cute.Tensor, *, loc=None, ip=None) -> cute.Tensor:
    """t, a WGMMA descriptor view, rebuilt on its start descriptor passed through an asm
    move (same layout, same values): the move is where the descriptor is computed."""
    base = builtin.unrealized_conversion_cast([Int64.mlir_type], [t.iterator], loc=loc, ip=ip)
    base = llvm.inline_asm(Int64.mlir_type, [base], "mov.b64 $0, $1;", "=l,l", has_side_effects=False,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    desc = builtin.unrealized_conversion_cast([cute_nvgpu_ir.SmemDescType.get()], [base], loc=loc, ip=ip)
    return cute.make_tensor(desc, t.layout)


def pinned_k_blocks(t: cute.Tensor) -> tuple:
    """A descriptor fragment (MMA, M or N, K blocks[, stages]) as one pinned view per K
    block (each keeps its stage mode): every WGMMA's descriptor computed once, or once
    plus its stage's offset. gemm takes the tuple in place of the fragment; at_stage
    slices a staged one."""
    stage_mode = (None,) * (cute.rank(t) - 3)  # a ring of stages: each K block keeps it
    return tuple(pinned_descriptors(t[(None, None, k, *stage_mode)]) for k in range(cute.size(t.shape[2])))


def at_stage(t, stage):
    """Stage `stage` of a staged operand: a fragment's [None, None, None, stage], or each
    K block of a pinned_k_blocks tuple at that stage."""
    if isinstance(t, tuple):
        return tuple(block[None, None, stage] for block in t)
    return t[None, None, None, stage]
