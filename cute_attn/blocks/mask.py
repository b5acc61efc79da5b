"""Attention masks: which keys a query may see, applied to a score tile in registers.

One rule, FlashAttention's bottom-right aligned window: with offset = seqlen_k - seqlen_q,
query i sees key j iff j < seqlen_k and

    i + offset - left <= j <= i + offset + right

where a side that is not bounded drops out. The mask kinds (static, part of the compile
key) say which sides exist: "none" (only the end of the keys), "causal" (right = 0, no
left bound) and "local" (a sliding window; left and right are run-time values, so a new
window size never recompiles; an open side is config.UNBOUNDED). `Window` holds that
rule; `AttentionMask` applies it to a tile; blocks/block_range.py uses the same `Window`
to skip tiles no query sees and to decide which tiles need the mask at all.

The forward holds S = Q K^T (queries on rows); the backward holds S^T = K Q^T (keys on
rows, see kernels/bwd_sm90.py). Masked scores become -inf before the softmax.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_attn.blocks.mma_sm90 import acc_as_rows_cols
from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.staged import Staged
from cute_attn.config import MASK_KINDS


class Window(Staged):
    """The mask rule of one kernel: kind is static, the local window's sides are Int32."""

    def __init__(self, kind: str, left: Int32, right: Int32):
        assert kind in MASK_KINDS, kind
        self.kind = kind
        self.left = left
        self.right = right

    @property
    def has_right(self) -> bool:
        return self.kind != "none"

    @property
    def has_left(self) -> bool:
        return self.kind == "local"

    def right_extent(self):
        """How far right of the diagonal a query sees (0 for causal)."""
        return Int32(0) if cutlass.const_expr(self.kind == "causal") else self.right


class AttentionMask(Staged):
    def __init__(self, tile_m: int, tile_n: int, seqlen: SeqlenInfo, window: Window, pack_gqa: int = 1):
        self.tile_m = tile_m  # queries per tile (rows: packed GQA puts pack_gqa rows per query)
        self.tile_n = tile_n  # keys per tile
        self.seqlen = seqlen
        self.window = window
        self.pack_gqa = pack_gqa

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        tScS: cute.Tensor,
        m_block: Int32,
        n_block: Int32,
        keys_on_rows: cutlass.Constexpr[bool] = False,
    ):
        """Set the scores of invisible (query, key) pairs to -inf. tScS: this thread's
        (row, col) coordinates of the tile, partitioned like acc_S."""
        S = acc_as_rows_cols(acc_S)
        coords = acc_as_rows_cols(tScS)
        w = self.window
        offset = self.seqlen.seqlen_k - self.seqlen.seqlen_q
        if cutlass.const_expr(not keys_on_rows):
            col_base = n_block * self.tile_n
            for r in cutlass.range_constexpr(cute.size(S.shape[0])):
                row = (m_block * self.tile_m + coords[r, 0][0]) // self.pack_gqa
                # keys visible to this row: [lo, hi) in global key index
                hi = self.seqlen.seqlen_k
                if cutlass.const_expr(w.has_right):
                    hi = cutlass.min(row + offset + w.right_extent() + 1, hi)
                hi_in_tile = hi - col_base
                if cutlass.const_expr(w.has_left):
                    lo_in_tile = row + offset - w.left - col_base
                    for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                        col = coords[r, c][1]
                        S[r, c] = -Float32.inf if col >= hi_in_tile or col < lo_in_tile else S[r, c]
                else:
                    for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                        # a select per element; an `if` here would carry the whole tile
                        # through every branch (measured: ~2000 extra selp per block)
                        S[r, c] = -Float32.inf if coords[r, c][1] >= hi_in_tile else S[r, c]
        else:
            col_base = m_block * self.tile_m
            for r in cutlass.range_constexpr(cute.size(S.shape[0])):
                key = n_block * self.tile_n + coords[r, 0][0]
                # queries that see this key: [lo, hi) in global query index; a key past
                # the end is seen by none
                lo = Int32(0)
                if cutlass.const_expr(w.has_right):
                    lo = key - offset - w.right_extent()
                lo = lo if key < self.seqlen.seqlen_k else Int32(0x7FFFFFFF)
                lo_in_tile = lo - col_base
                if cutlass.const_expr(w.has_left):
                    hi_in_tile = key - offset + w.left + 1 - col_base
                    for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                        col = coords[r, c][1]
                        S[r, c] = -Float32.inf if col < lo_in_tile or col >= hi_in_tile else S[r, c]
                else:
                    for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                        S[r, c] = -Float32.inf if coords[r, c][1] < lo_in_tile else S[r, c]
