"""Which tiles a CTA visits, and which of them need a mask (the rule is mask.Window).

Forward: a query tile visits the KV blocks [n_min, n_max) that hold a key some row of it
sees; blocks outside are never loaded. Of those, the blocks that cut the right edge of the
window (the causal diagonal) or its left edge are masked; the ones between are not.
Backward, the other way round: a KV tile visits the query blocks [m_min, m_max) that see
one of its keys, masked likewise near both edges.

Split-KV (the forward with FwdConfig.split_kv): split s of a query tile walks the s-th of
num_splits equal slices of [n_min, n_max) (the last ones may be short or empty).

Bottom-right alignment throughout: with offset = seqlen_k - seqlen_q, query i sees key j
iff i + offset - left <= j <= i + offset + right (each side only if the kind bounds it).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_attn.blocks.mask import Window
from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.staged import Staged


class BlockRange(Staged):
    def __init__(self, tile_m: int, tile_n: int, window: Window, pack_gqa: int = 1, split_kv: bool = False,
                 num_splits=1):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.window = window
        # forward with packed GQA: a tile's row r is query r // pack_gqa (see FwdConfig)
        self.pack_gqa = pack_gqa
        # forward split-KV: num_splits (a run-time Int32) CTAs per query tile, each
        # taking a slice of its KV blocks
        self.split_kv = split_kv
        self.num_splits = num_splits

    def _first_query(self, m_block):
        return m_block * self.tile_m // self.pack_gqa

    def _last_query(self, seqlen: SeqlenInfo, m_block):
        return (cutlass.min((m_block + 1) * self.tile_m, seqlen.seqlen_q * self.pack_gqa) - 1) // self.pack_gqa

    # -- forward: one query block, a range of KV blocks ------------------------------------

    @cute.jit
    def n_block_min_max(self, seqlen: SeqlenInfo, m_block: Int32, split: Int32 = 0):
        """[n_min, n_max): the KV blocks that hold at least one key visible to the tile,
        clipped to this split's slice of them."""
        w = self.window
        offset = seqlen.seqlen_k - seqlen.seqlen_q
        n_block_max = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
        if cutlass.const_expr(w.has_right):
            last_row = self._last_query(seqlen, m_block)
            # keys [0, end) are visible to the tile's last row
            end = cutlass.max(last_row + 1 + offset + w.right_extent(), 0)
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(end, self.tile_n))
        n_block_min = Int32(0)
        if cutlass.const_expr(w.has_left):
            first_key = cutlass.max(self._first_query(m_block) + offset - w.left, 0)
            n_block_min = cutlass.min(first_key // self.tile_n, n_block_max)
        if cutlass.const_expr(self.split_kv):
            per_split = cute.ceil_div(n_block_max - n_block_min, self.num_splits)
            n_block_min = n_block_min + split * per_split
            n_block_max = cutlass.min(n_block_min + per_split, n_block_max)
            n_block_min = cutlass.min(n_block_min, n_block_max)
        return n_block_min, n_block_max

    @cute.jit
    def n_block_right_mask_start(self, seqlen: SeqlenInfo, m_block: Int32, n_block_min: Int32, n_block_max: Int32):
        """Blocks in [this, n_max) may cut the window's right edge (the causal diagonal)
        for some row; the last block (end of the keys) is always masked, so this is at
        most n_max - 1. Result in [n_min, n_max - 1]."""
        start = n_block_max - 1
        if cutlass.const_expr(self.window.has_right):
            # the tile's first row sees keys [.., end): blocks wholly before end are safe
            end = self._first_query(m_block) + 1 + seqlen.seqlen_k - seqlen.seqlen_q + self.window.right_extent()
            start = cutlass.min(start, cutlass.max(end, 0) // self.tile_n)
        return cutlass.max(start, n_block_min)

    @cute.jit
    def n_block_left_mask_end(self, seqlen: SeqlenInfo, m_block: Int32, n_block_min: Int32, right_mask_start: Int32):
        """Blocks in [n_min, this) may cut the window's left edge for some row. Result in
        [n_min, right_mask_start]."""
        end = n_block_min
        if cutlass.const_expr(self.window.has_left):
            last_row = self._last_query(seqlen, m_block)
            # the tile's last row sees keys from `first` on: blocks starting there are safe
            first = cutlass.max(last_row + seqlen.seqlen_k - seqlen.seqlen_q - self.window.left, 0)
            end = cutlass.max(end, cute.ceil_div(first, self.tile_n))
        return cutlass.min(end, right_mask_start)

    # -- backward: one KV block, a range of query blocks -----------------------------------

    @cute.jit
    def m_block_min_max(self, seqlen: SeqlenInfo, n_block: Int32):
        """[m_min, m_max): the query blocks that see at least one key of this KV block."""
        w = self.window
        offset = seqlen.seqlen_k - seqlen.seqlen_q
        m_block_max = cute.ceil_div(seqlen.seqlen_q, self.tile_m)
        if cutlass.const_expr(w.has_left):
            last_key = cutlass.min((n_block + 1) * self.tile_n, seqlen.seqlen_k) - 1
            # queries [.., end) see the block's last key
            end = cutlass.max(last_key - offset + w.left + 1, 0)
            m_block_max = cutlass.min(m_block_max, cute.ceil_div(end, self.tile_m))
        m_block_min = Int32(0)
        if cutlass.const_expr(w.has_right):
            # the block's first key is visible from query (key - offset - right) on
            first_query = n_block * self.tile_n - offset - w.right_extent()
            m_block_min = cutlass.max(first_query, 0) // self.tile_m
        return cutlass.min(m_block_min, m_block_max), m_block_max

    @cute.jit
    def m_block_right_mask_end(self, seqlen: SeqlenInfo, n_block: Int32, m_block_min: Int32, m_block_max: Int32):
        """Query blocks in [m_min, this) may cut the right edge (the diagonal) for some
        key of the block; from here on they see every key of it from that side."""
        end = m_block_min
        if cutlass.const_expr(self.window.has_right):
            last_key_first_query = (
                (n_block + 1) * self.tile_n - 1 - seqlen.seqlen_k + seqlen.seqlen_q - self.window.right_extent()
            )
            end = cute.ceil_div(cutlass.max(last_key_first_query, 0), self.tile_m)
        return cutlass.max(cutlass.min(end, m_block_max), m_block_min)

    @cute.jit
    def m_block_left_mask_start(self, seqlen: SeqlenInfo, n_block: Int32, right_mask_end: Int32, m_block_max: Int32):
        """Query blocks in [this, m_max) may cut the left edge for some key of the block."""
        start = m_block_max
        if cutlass.const_expr(self.window.has_left):
            # queries [.., end) see the block's first key
            end = n_block * self.tile_n - seqlen.seqlen_k + seqlen.seqlen_q + self.window.left + 1
            start = cutlass.max(end, 0) // self.tile_m
        return cutlass.max(cutlass.min(start, m_block_max), right_mask_end)
