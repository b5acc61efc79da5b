"""KVAppend: writes a decode step's new keys and values into a KV cache, in place, and the
entries' new lengths (mha_with_kvcache's append, cute_attn/kvcache.py), in one launch.

Entry b's new token j goes to position p = clamp(cache_seqlens[b], 0, capacity) + j of
the entry, clamped to capacity - 1. A contiguous cache (batch, capacity, heads_kv,
head_dim) holds it in row p of entry b; a paged one (num_pages, page_size, heads_kv,
head_dim) in row p % page_size of page page_table[b, p // page_size], that index clamped
to [0, num_pages). So no value of cache_seqlens or page_table can make it write outside
the cache (check_inputs reports such values instead). The new lengths,
min(clamp(cache_seqlens[b], 0, capacity) + seqlen_new, capacity), go to new_lengths[b]:
the attention that follows reads them on the device (AttnFeatures.kv_lengths).

Memory-bound and tiny (a decode step moves batch x heads_kv x head_dim x 4 bytes): each
thread copies one 16-byte chunk of K and of V; a CTA covers MAX_THREADS // (head_dim / 8)
whole tokens of one KV head of one entry (the work tile of blocks/tile_scheduler.py: block
= token block, head, batch), with as many threads as those tokens' chunks (120 at head
dims 96 and 192, whose 12 and 24 chunks per token do not divide 128). The reference is kvcache_reference.append_in_place.
Read the PTX without a GPU: tests/test_compile.py::test_kv_append_compiles.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_attn.blocks.tile_scheduler import TileScheduler
from cute_attn.blocks.views import bshd_as_sdhb
from cute_attn.config import DtypePolicy

MAX_THREADS = 128


class KVAppend:
    def __init__(self, dtypes: DtypePolicy, head_dim: int, paged: bool):
        self.dtype = dtypes.dsl("input")
        self.head_dim = head_dim
        self.paged = paged
        self.vec = dtypes.align_elems  # elements per 16-byte chunk
        assert head_dim % self.vec == 0 and head_dim // self.vec <= MAX_THREADS
        self.tokens_per_cta = MAX_THREADS // (head_dim // self.vec)
        self.threads = self.tokens_per_cta * (head_dim // self.vec)  # whole tokens per CTA
        self.scheduler = TileScheduler(self.tokens_per_cta, varlen=False)

    @cute.jit
    def __call__(
        self,
        mK: cute.Tensor,  # (batch, seqlen_new, heads_kv, head_dim): the new keys
        mV: cute.Tensor,  # like mK
        mKCache: cute.Tensor,  # (batch, capacity, heads_kv, head_dim); paged: (num_pages, page_size, ...)
        mVCache: cute.Tensor,  # like mKCache
        mCacheSeqlens: cute.Tensor,  # (batch,) int32: the keys already in each entry
        mPageTable: cute.Tensor,  # paged: (batch, max_pages) int32 (else unread)
        mNewLengths: cute.Tensor,  # (batch,) int32, written
        stream,
    ):
        grid = self.scheduler.grid(bshd_as_sdhb(mK), mCacheSeqlens, Int32(0))
        self.kernel(mK, mV, mKCache, mVCache, mCacheSeqlens, mPageTable, mNewLengths).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, mK: cute.Tensor, mV: cute.Tensor, mKCache: cute.Tensor, mVCache: cute.Tensor,
        mCacheSeqlens: cute.Tensor, mPageTable: cute.Tensor, mNewLengths: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token_block, head, b, _ = self.scheduler.tile()
        seqlen_new = mK.shape[1]
        capacity = mKCache.shape[1]
        if cutlass.const_expr(self.paged):
            capacity = mPageTable.shape[1] * mKCache.shape[1]
        start = cutlass.min(cutlass.max(mCacheSeqlens[b], 0), capacity)
        if token_block == 0 and head == 0 and tidx == 0:
            mNewLengths[b] = cutlass.min(start + seqlen_new, capacity)
        per_row = self.head_dim // self.vec
        j = token_block * self.tokens_per_cta + tidx // per_row
        col = tidx % per_row
        if j < seqlen_new:
            pos = cutlass.min(start + j, capacity - 1)
            page, slot = b, pos
            if cutlass.const_expr(self.paged):
                page_size = mKCache.shape[1]
                page = cutlass.min(cutlass.max(mPageTable[b, pos // page_size], 0), mKCache.shape[0] - 1)
                slot = pos % page_size
            for src, dst in ((mK, mKCache), (mV, mVCache)):
                s = cute.zipped_divide(src[b, j, head, None], (self.vec,))
                d = cute.zipped_divide(dst[page, slot, head, None], (self.vec,))
                d[None, col].store(s[None, col].load())
