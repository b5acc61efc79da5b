"""Which KV blocks a query tile visits, and which of them need a mask.

Causal masks are aligned to the bottom-right corner (FlashAttention's convention): query
row i sees key j iff j <= i + seqlen_k - seqlen_q. KV blocks wholly above the diagonal are
never visited (never loaded), and only the blocks that straddle the diagonal or the end of
the keys are masked.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.staged import Staged


class BlockRange(Staged):
    def __init__(self, tile_m: int, tile_n: int, causal: bool):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.causal = causal

    @cute.jit
    def n_block_min_max(self, seqlen: SeqlenInfo, m_block: Int32):
        """[n_min, n_max): the KV blocks that hold at least one visible key for this tile."""
        n_block_max = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
        if cutlass.const_expr(self.causal):
            last_row = cutlass.min((m_block + 1) * self.tile_m, seqlen.seqlen_q) - 1
            # keys [0, last_row + 1 + seqlen_k - seqlen_q) are visible to the tile's last row
            visible = cutlass.max(last_row + 1 + seqlen.seqlen_k - seqlen.seqlen_q, 0)
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(visible, self.tile_n))
        return Int32(0), n_block_max

    @cute.jit
    def n_block_min_causal_mask(self, seqlen: SeqlenInfo, m_block: Int32, n_block_min: Int32):
        """Blocks >= this index straddle the diagonal for some row of the tile and need the
        causal mask; blocks below it are fully visible to every row."""
        first_row_visible = m_block * self.tile_m + 1 + seqlen.seqlen_k - seqlen.seqlen_q
        return cutlass.max(n_block_min, cutlass.max(first_row_visible, 0) // self.tile_n)

    # The backward walks the other way: a CTA owns one KV block and visits query blocks.

    @cute.jit
    def m_block_min_max(self, seqlen: SeqlenInfo, n_block: Int32):
        """[m_min, m_max): the query blocks that see at least one key of this KV block."""
        m_block_max = cute.ceil_div(seqlen.seqlen_q, self.tile_m)
        m_block_min = Int32(0)
        if cutlass.const_expr(self.causal):
            # the block's first key is visible from query (key - seqlen_k + seqlen_q) on
            first_query = n_block * self.tile_n - seqlen.seqlen_k + seqlen.seqlen_q
            m_block_min = cutlass.min(cutlass.max(first_query, 0) // self.tile_m, m_block_max)
        return m_block_min, m_block_max

    @cute.jit
    def m_block_max_causal_mask(self, seqlen: SeqlenInfo, n_block: Int32, m_block_min: Int32, m_block_max: Int32):
        """Query blocks below this index straddle the diagonal for some key of the KV
        block and need the causal mask; blocks from it on see every key of the block."""
        last_key_first_query = (n_block + 1) * self.tile_n - 1 - seqlen.seqlen_k + seqlen.seqlen_q
        end = cute.ceil_div(cutlass.max(last_key_first_query, 0), self.tile_m)
        return cutlass.max(cutlass.min(end, m_block_max), m_block_min)
