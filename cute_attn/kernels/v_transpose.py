"""TransposeV: V (batch, seqlen, heads, head_dim) -> V^T (batch, heads, head_dim, seqlen_padded),
the layout the FP8 forward reads V in (launcher.transpose_v_fp8).

FP8 WGMMA takes both operands K-major, and the K of O += P V is the key: V's tiles must be
key-contiguous in shared memory. This kernel moves 1-byte elements, so it is memory-bound:
each CTA stages a block of KEYS keys x head_dim through shared memory (rows in with 16-byte
loads, one key's head-dim chunk per thread; columns out as 16 keys per thread and 16-byte
store, two lanes per 32-byte sector), which keeps both global sides in whole 16-byte
accesses and whole sectors. A torch copy through a
permuted view moved 8-bit elements one at a time: 229 us for 32 MiB on an H100, about a
tenth of copy bandwidth (perf/NOTES.md, session 9).

Shared rows are padded by 16 bytes (the row writes stay 16-byte aligned); a warp's column
reads touch 8 words in 4 banks (16 rows: 4 words of each key row; the lane pair's two key
chunks: the same bank), a 2-way conflict on byte loads that are not what binds.

Packed variable-length batches (varlen) come out as a dense (batch, heads, head_dim,
max_seqlen_padded) V^T, sequence b's keys from column 0 of entry b: TMA reads a box at a
key coordinate only if its start is 16-byte aligned along the contiguous dim, which a
packed sequence's offset need not be (an unaligned start raised "illegal instruction" on
an H100). This costs batch x max_seqlen_k key columns instead of the total.

Each aligned group of 16 key columns holds its keys in blocks/fp8_operand.V_PERMUTATION's
order: the order in which the QK^T accumulator's registers already are the FP8 PV WGMMA's
A operand, so that P needs no shuffle in the forward. The groups count from each
sequence's first key (column 0 of its entry), as the forward's KV blocks do. The thread
writing a 16-key chunk reads its 16 bytes from shared memory in that order (byte-wise
column reads either way).

Keys past seqlen are not loaded but written as zeros, up to the next multiple of 16 (the
padded stride). The forward reads every column up to that padded length (the permutation
puts some of a last group's keys in columns past seqlen and zeros in columns before it),
and in a varlen V^T also the columns between a sequence's length and the longest; it
multiplies those zero rows by P = 0: zeros keep that 0, garbage could be NaN.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_attn.blocks.fp8_operand import V_PERMUTATION
from cute_attn.blocks.seqlen import packed_span
from cute_attn.blocks.tile_scheduler import TileScheduler

KEYS = 64  # keys per CTA: four 16-key column chunks, written by lane pairs (two per sector)
THREADS = 128
CHUNK = 16  # bytes per global access


class TransposeV:
    def __init__(self, head_dim: int, varlen: bool):
        assert head_dim % 32 == 0
        self.head_dim = head_dim
        self.varlen = varlen
        self.pitch = head_dim + CHUNK
        self.scheduler = TileScheduler(KEYS, varlen=False)  # blocks of V^T's key columns

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,  # (batch, seqlen, heads, head_dim) uint8, head_dim contiguous; varlen: (1, total, ...)
        mVt: cute.Tensor,  # (batch, heads, head_dim, seqlen_padded) uint8, contiguous
        mCuSeqlensK: cute.Tensor,  # varlen: (batch + 1,) int32 (else unread)
        stream,
    ):
        @cute.struct
        class SharedStorage:
            tile: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, KEYS * self.pitch], 16]

        self.shared_storage = SharedStorage
        # V^T as (keys, head_dim, heads, batch): the scheduler's row-major view
        grid = self.scheduler.grid(cute.make_tensor(mVt.iterator, cute.select(mVt.layout, mode=[3, 2, 1, 0])),
                                   mCuSeqlensK, Int32(0))
        self.kernel(mV, mVt, mCuSeqlensK).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mVt: cute.Tensor, mCuSeqlensK: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, b, _ = self.scheduler.tile()
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sT = storage.tile.get_tensor(cute.make_layout((KEYS, self.head_dim), stride=(self.pitch, 1)))
        seqlen, padded = mV.shape[1], mVt.shape[3]
        src_batch, offset = b, Int32(0)
        if cutlass.const_expr(self.varlen):
            src_batch = Int32(0)
            offset, seqlen = packed_span(mCuSeqlensK, b, seqlen)
        first = block * KEYS
        per_key = self.head_dim // CHUNK
        # rows in: consecutive threads read consecutive 16-byte chunks of a key's row
        for j in cutlass.range_constexpr(KEYS * per_key // THREADS):
            idx = tidx + j * THREADS
            key, c = idx // per_key, idx % per_key
            staged = cute.zipped_divide(sT[key, None], (CHUNK,))
            if first + key < seqlen:
                src = cute.zipped_divide(mV[src_batch, offset + first + key, head, None], (CHUNK,))
                staged[None, c].store(src[None, c].load())
            else:
                # zeros, not garbage: a varlen sequence's columns past its length lie inside
                # the dense V^T that TMA reads, and P = 0 times a NaN would still be NaN
                zero = cute.make_rmem_tensor((CHUNK,), cutlass.Uint8)
                zero.fill(0)
                staged[None, c].store(zero.load())
        cute.arch.sync_threads()
        # columns out: a lane pair writes 32 keys of one head-dim row (a whole 32-byte
        # sector: lanes writing 16 bytes of 32 different rows each made every L2 write a
        # half sector, and the kernel L2-bound, ncu session 24), a warp 16 rows at a time
        for j in cutlass.range_constexpr(self.head_dim * KEYS // CHUNK // THREADS):
            idx = tidx + j * THREADS
            rest = idx // 2
            row = rest % self.head_dim
            chunk_idx = 2 * (rest // self.head_dim) + idx % 2  # which 16 keys of the CTA's KEYS
            key0 = first + chunk_idx * CHUNK
            if key0 < padded:
                column = cute.zipped_divide(sT[None, row], (CHUNK,))
                dst = cute.zipped_divide(mVt[b, head, row, None], (CHUNK,))
                chunk = cute.make_rmem_tensor((CHUNK,), cutlass.Uint8)
                for c in cutlass.range_constexpr(CHUNK):
                    chunk[c] = column[V_PERMUTATION[c], chunk_idx]
                dst[None, key0 // CHUNK].store(chunk.load())
