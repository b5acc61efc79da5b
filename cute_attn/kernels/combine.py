"""LseCombine: merges partial attention results stacked on the batch mode into one, as a
kernel of its own (the split-KV forward merges inside its last split instead).

Its caller is context parallelism (cute_attn/distributed/ring.py): each step of the ring
gives a rank's queries their attention over one block of keys, and the steps merge by
LSE. The merge is blocks/lse_combine.py's SplitMerge, the split-KV forward's, over a
work tile of ROWS query rows of one head (blocks/tile_scheduler.py: block = query
block, head, batch), with ROWS threads.

Layouts (blocks/lse_combine.py): partials (num_splits * batch, seqlen, heads, head_dim)
fp32 with split s of entry b at s * batch + b, their LSE (num_splits * batch, heads,
seqlen); out (batch, seqlen, heads, head_dim) of out_dtype, lse (batch, heads, seqlen)
fp32. out may be split 0's rows of the partials themselves (an in-place running merge):
SplitMerge reads every split of a (row, chunk) item and then writes it from the same
thread, and no other item reads it. lse may not (the rows' LSEs are written before the
items read split 0's).
Read the PTX without a GPU: tests/test_compile.py::test_lse_combine_compiles.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_attn.blocks.lse_combine import SplitMerge
from cute_attn.blocks.tile_scheduler import TileScheduler
from cute_attn.blocks.views import bshd_as_sdhb

ROWS = 128  # query rows per CTA, one thread each for the rows' LSEs
THREADS = 128


class LseCombine:
    def __init__(self, head_dim: int, out_dtype):
        self.head_dim = head_dim
        self.merge = SplitMerge(head_dim, out_dtype, THREADS, ROWS)
        self.scheduler = TileScheduler(ROWS, varlen=False)

    @cute.jit
    def __call__(
        self,
        mOpart: cute.Tensor,  # (num_splits * batch, seqlen, heads, head_dim) fp32
        mLSEpart: cute.Tensor,  # (num_splits * batch, heads, seqlen) fp32
        mO: cute.Tensor,  # (batch, seqlen, heads, head_dim) out_dtype
        mLSE: cute.Tensor,  # (batch, heads, seqlen) fp32
        num_splits: Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            row_lse: cute.struct.Align[cute.struct.MemRange[Float32, ROWS], 16]

        self.shared_storage = SharedStorage
        # (the cu_seqlens argument is read only by a varlen scheduler)
        grid = self.scheduler.grid(bshd_as_sdhb(mO), mLSE, Int32(0))
        self.kernel(mOpart, mLSEpart, mO, mLSE, num_splits).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               num_splits: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, b, _ = self.scheduler.tile()
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        row_lse = storage.row_lse.get_tensor(cute.make_layout(ROWS))
        first = block * ROWS
        rows = cutlass.min(ROWS, mO.shape[1] - first)

        def row_coord(r):
            return first + r, head

        def sync():
            cute.arch.sync_threads()

        self.merge.merge_tile(mOpart, mLSEpart, mO, mLSE, row_lse, num_splits, b, rows, row_coord, tidx, sync)
