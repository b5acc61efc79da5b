"""Attention masks applied to a score tile in registers.

The mask object knows the rules (the end of the keys; bottom-right causal; sliding windows
and custom masks later); the kernels only say which block they are on and whether the
causal rule can bite there (see block_range.py). Masked scores become -inf before the
softmax.

The forward holds S = Q K^T (queries on rows); the backward holds S^T = K Q^T (keys on
rows, see kernels/bwd_sm90.py). Both go through `apply`, which evaluates the one rule
"key j is visible to query i iff j < seqlen_k and j <= i + seqlen_k - seqlen_q".
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_attn.blocks.mma_sm90 import acc_as_rows_cols
from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.staged import Staged


class AttentionMask(Staged):
    def __init__(self, tile_m: int, tile_n: int, seqlen: SeqlenInfo, causal: bool):
        self.tile_m = tile_m  # queries per tile
        self.tile_n = tile_n  # keys per tile
        self.seqlen = seqlen
        self.causal = causal

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        tScS: cute.Tensor,
        m_block: Int32,
        n_block: Int32,
        mask_causal: cutlass.Constexpr[bool],
        keys_on_rows: cutlass.Constexpr[bool] = False,
    ):
        """tScS: this thread's (row, col) coordinates of the score tile, partitioned like
        acc_S. Keys at or past the end of the sequence are always masked."""
        S = acc_as_rows_cols(acc_S)
        coords = acc_as_rows_cols(tScS)
        # key j sees queries i >= j - offset; query i sees keys j <= i + offset
        offset = self.seqlen.seqlen_k - self.seqlen.seqlen_q
        if cutlass.const_expr(not keys_on_rows):
            col_base = n_block * self.tile_n
            for r in cutlass.range_constexpr(cute.size(S.shape[0])):
                # keys visible to this row: [0, col_limit) in global key index
                col_limit = self.seqlen.seqlen_k
                if cutlass.const_expr(mask_causal and self.causal):
                    row = m_block * self.tile_m + coords[r, 0][0]
                    col_limit = cutlass.min(row + 1 + offset, col_limit)
                limit_in_tile = col_limit - col_base
                for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                    # a select per element; an `if` here would carry the whole tile through
                    # every branch (measured: ~2000 extra selp per block)
                    S[r, c] = -Float32.inf if coords[r, c][1] >= limit_in_tile else S[r, c]
        else:
            col_base = m_block * self.tile_m
            for r in cutlass.range_constexpr(cute.size(S.shape[0])):
                key = n_block * self.tile_n + coords[r, 0][0]
                # queries that see this key: [col_start, inf) in global query index; a key
                # past the end is seen by none
                col_start = Int32(0)
                if cutlass.const_expr(mask_causal and self.causal):
                    col_start = key - offset
                col_start = col_start if key < self.seqlen.seqlen_k else Int32(0x7FFFFFFF)
                start_in_tile = col_start - col_base
                for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                    S[r, c] = -Float32.inf if coords[r, c][1] < start_in_tile else S[r, c]
