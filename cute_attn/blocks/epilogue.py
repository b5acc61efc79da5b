"""Writing a finished accumulator tile out: registers -> shared memory (stmatrix) -> global
memory (one TMA bulk store, clipped to the tensor's bounds by the tensor map). Used for O
in the forward and for dK, dV in the backward (whose dS tile also goes to shared memory
through regs_to_smem). The barriers around these steps belong to
the kernels: they know who else reads the shared buffer."""

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync


@cute.jit
def acc_to_smem(
    acc: cute.Tensor,
    sX: cute.Tensor,
    tiled_mma: cute.TiledMma,
    tidx,
    dtype: cutlass.Constexpr,
    scale: Optional[Float32] = None,
    transpose: cutlass.Constexpr[bool] = False,
):
    """Convert this thread's fp32 accumulator slice (times scale) to dtype and store it
    into the row-major swizzled tile sX with stmatrix (transpose: see regs_to_smem). The
    caller fences (fence_view_async_shared) and synchronises before a TMA or WGMMA reads sX."""
    rX = cute.make_rmem_tensor_like(acc, dtype)
    if cutlass.const_expr(scale is None):
        rX.store(acc.load().to(dtype))
    else:
        rX.store((acc.load() * scale).to(dtype))
    regs_to_smem(rX, sX, tiled_mma, tidx, transpose)


@cute.jit
def regs_to_smem(
    rX: cute.Tensor, sX: cute.Tensor, tiled_mma: cute.TiledMma, tidx, transpose: cutlass.Constexpr[bool] = False
):
    """Store registers already in the tile's dtype, laid out like tiled_mma's accumulator,
    into the row-major swizzled tile sX with stmatrix. transpose: sX is the (M, N) view of
    a tile stored the other way round, M contiguous (mma_sm90.transpose_view of a row-major
    N x M tile), written with stmatrix .trans."""
    layout = cutlass.tensor_utils.LayoutEnum.COL_MAJOR if transpose else cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
    store_atom = sm90_helpers.get_smem_store_op(layout, rX.element_type, Float32)
    thr_store = cute.make_tiled_copy_C(store_atom, tiled_mma).get_slice(tidx)
    cute.copy(store_atom, thr_store.retile(rX), thr_store.partition_D(sX))


@cute.jit
def tma_store_tile(tma_atom: cute.CopyAtom, sX: cute.Tensor, gX: cute.Tensor):
    """One thread's worth of work (call it from a single warp): issue the TMA store of
    the shared tile sX to gX and wait until it has read shared memory."""
    tXsX, tXgX = cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
    )
    cute.copy(tma_atom, tXsX, tXgX)
    cute.arch.cp_async_bulk_commit_group()
    cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def store_rows(sX: cute.Tensor, gX: cute.Tensor, num_rows, tidx, num_threads: cutlass.Constexpr[int]):
    """Copy the first num_rows rows of the shared tile sX to gX, 16 bytes per thread and
    instruction, by all num_threads threads. For packed variable-length batches, where a
    TMA store of the whole tile would run into the next sequence's rows. The caller
    synchronises the threads that wrote sX before, and those that reuse it after."""
    rows, cols = cute.size(sX.shape[0]), cute.size(sX.shape[1])
    copy_atom, tiled_copy = row_copy(sX.element_type, cols, num_threads)
    thr_copy = tiled_copy.get_slice(tidx)
    tXsX = thr_copy.partition_S(sX)
    tXgX = thr_copy.partition_D(gX)
    tXcX = thr_copy.partition_S(cute.make_identity_tensor((rows, cols)))
    for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
        if tXcX[0, m, 0][0] < num_rows:
            cute.copy(copy_atom, tXsX[None, m, None], tXgX[None, m, None])


def row_copy(dtype, cols: int, num_threads: int):
    """(copy atom, tiled copy) moving rows of `cols` elements 16 bytes per thread and
    instruction: threads side by side on a row (a power of two dividing the row's 16-byte
    chunks: head dim 96 has 12, so 4 threads take 3 chunks each), so each pass of
    num_threads threads covers whole rows. Plain Python, run while tracing."""
    elems = 128 // dtype.width
    tpr = threads_per_row(dtype, cols)
    copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    thr_layout = cute.make_ordered_layout((num_threads // tpr, tpr), order=(1, 0))
    return copy_atom, cute.make_tiled_copy_tv(copy_atom, thr_layout, cute.make_layout((1, elems)))


def threads_per_row(dtype, cols: int) -> int:
    """row_copy's threads per row: the largest power of two (at most a warp) dividing the
    row's 16-byte chunks. A loop in a @cute.jit body would be staged: plain Python here."""
    chunks, p = cols // (128 // dtype.width), 1
    while chunks % (2 * p) == 0 and 2 * p <= 32:
        p *= 2
    return p
