"""Maps CTAs to (m_block, head, batch) work tiles.

One tile per CTA for now (grid = m_blocks x heads x batch). Causal tiles differ in cost:
the last query blocks see the most keys, so they are launched first (longest-processing-
time order) to shorten the tail. A persistent scheduler will replace this class without
touching the kernels: they only call `tile()`.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_attn.blocks.staged import Staged


class SingleTileScheduler(Staged):
    def __init__(self, longest_first: bool):
        self.longest_first = longest_first

    @staticmethod
    def grid(num_m_blocks, num_heads, batch):
        # variable-length batches size the first mode by the longest sequence; the
        # kernels skip the tiles past a shorter sequence's end
        return (num_m_blocks, num_heads, batch)

    @cute.jit
    def tile(self):
        bid_m, head, batch = cute.arch.block_idx()
        m_block = bid_m
        if cutlass.const_expr(self.longest_first):
            m_block = cute.arch.grid_dim()[0] - 1 - bid_m
        return Int32(m_block), Int32(head), Int32(batch)
