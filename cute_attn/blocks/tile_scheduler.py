"""Maps CTAs to work tiles: the one place that writes a grid.

Every kernel (forward, backward, its pre- and postprocess, and the decode and combine
kernels to come) builds a `TileScheduler` with its static shape of work and asks it for
the launch grid on the host (`grid`) and for the CTA's `WorkTile` on the device (`tile`).

A work tile is (block, head, batch, split):
  * block: the tile's index along the sequence it walks: a query block (m_block) in the
    forward, the preprocess and the postprocess; a KV block (n_block) in the backward.
  * head, batch: as the kernel indexes its tensors (the backward: the KV head).
  * split: which of `num_splits` CTAs sharing one block this is. The forward splits the
    block's KV range (split-KV, clipped by blocks/block_range.py); 0 when unsplit.

One tile per CTA for now (grid = blocks * splits x heads x batch). Causal tiles differ in
cost (the forward's last query blocks see the most keys, the backward's first KV blocks the
most queries), and the GPU dispatches CTAs roughly in grid order (x fastest) as SMs free
up. In plain grid order each head's blocks come in turn, so the last head's longest tile
starts near the end and runs past everyone else: a tail of up to one long tile. `lpt`
(longest-processing-time first) renumbers the CTAs so that every head's longest block goes
before any head's next-longest; `longest_first` says which end of the block range is the
long one. To keep the K/V (forward) or Q/dO (backward) that concurrent CTAs share in L2,
heads are taken in sections of `section` (head, batch) pairs (a run-time count from the
kernel: as many heads as fit a share of L2), LPT order inside each section. Variable-length
batches size the block mode by the longest sequence; the kernels skip tiles past a shorter
one's end. A persistent scheduler will replace this class without touching the kernels.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32


# The share of L2 (50 MB on the H100 and H200) that one LPT section's shared operand may
# take: about half, leaving the rest to the tiles streaming through and to the copies the
# two L2 partitions keep of the same lines.
L2_SECTION_BYTES = 24 * 1024 * 1024


@cute.jit
def section_pairs(rows, row_bytes: cutlass.Constexpr[int], heads_per_operand):
    """(head, batch) pairs per LPT section: as many shared operands (rows x row_bytes each:
    one KV head's K and V in the forward) as fit L2_SECTION_BYTES, at least one, times the
    grid heads that read the same one (a GQA group's query heads)."""
    operands = cutlass.max(Int32(L2_SECTION_BYTES // row_bytes) // rows, Int32(1))
    return operands * heads_per_operand


class WorkTile(NamedTuple):
    block: Int32
    head: Int32
    batch: Int32
    split: Int32


class TileScheduler:
    """num_splits: a static count, or with
    runtime_splits the count is a run-time value passed to grid() and tile() (the
    forward's split-KV, whose count the launcher picks per call without recompiling)."""

    def __init__(self, tile_size: int, varlen: bool, num_splits: int = 1, longest_first: bool = False,
                 runtime_splits: bool = False, lpt: bool = False):
        self.tile_size = tile_size  # rows (or keys) per block
        self.varlen = varlen
        self.num_splits = num_splits
        self.longest_first = longest_first  # the last block is the longest (else the first)
        self.runtime_splits = runtime_splits
        # block-major order across head sections (module docstring); not with splits (a
        # tile's splits stay neighbours) nor varlen (blocks differ in cost by sequence)
        self.lpt = lpt and not varlen and not runtime_splits and num_splits == 1

    def grid(self, mX: cute.Tensor, cu_seqlens: cute.Tensor, max_seqlen, num_splits=None):
        """Launch grid over the tensor whose rows the blocks tile, in the kernel-side view
        (seqlen, head_dim, heads, batch) (blocks/views.py). Dense: seqlen and batch from
        its shape. Varlen: the blocks of the longest sequence (max_seqlen) for each of the
        len(cu_seqlens) - 1 sequences. num_splits: the run-time count (runtime_splits)."""
        if cutlass.const_expr(self.varlen):
            num_blocks = cute.ceil_div(max_seqlen, self.tile_size)
            batch = cute.size(cu_seqlens.shape[0]) - 1
        else:
            num_blocks = cute.ceil_div(cute.size(mX.shape[0]), self.tile_size)
            batch = cute.size(mX.shape[3])
        splits = num_splits if cutlass.const_expr(self.runtime_splits) else self.num_splits
        return (num_blocks * splits, cute.size(mX.shape[2]), batch)

    @cute.jit
    def tile(self, num_splits=None, section=None) -> WorkTile:
        """This CTA's tile. section: (head, batch) pairs per L2 section (lpt only)."""
        bid, head, batch = cute.arch.block_idx()
        num_blocks = cute.arch.grid_dim()[0]
        if cutlass.const_expr(self.lpt):
            return self._lpt_tile(bid, head, batch, section)
        block, split = bid, Int32(0)
        if cutlass.const_expr(self.runtime_splits or self.num_splits > 1):
            # the splits of one block are neighbours in the grid: they run side by side
            splits = self.num_splits
            if cutlass.const_expr(self.runtime_splits):
                splits = num_splits
            block, split = bid // splits, bid % splits
            num_blocks = num_blocks // splits
        if cutlass.const_expr(self.longest_first):
            block = num_blocks - 1 - block
        return WorkTile(Int32(block), Int32(head), Int32(batch), Int32(split))

    @cute.jit
    def _lpt_tile(self, bid, head, batch, section) -> WorkTile:
        num_blocks, num_heads, num_batch = cute.arch.grid_dim()
        n = bid + num_blocks * (head + num_heads * batch)  # the CTA's place in grid order
        block, head, batch = lpt_order(n, num_blocks, num_heads, num_batch, section, self.longest_first)
        return WorkTile(Int32(block), Int32(head), Int32(batch), Int32(0))


def lpt_order(n, num_blocks, num_heads, num_batch, section, longest_last: bool):
    """CTA number n (grid order) -> (block, head, batch): section n // (blocks x section);
    inside it, rank r // width of the block range (the longest first: the last block when
    longest_last) for (head, batch) pair r % width, heads fastest (a GQA group's query heads
    side by side). The last section may be narrower. Plain arithmetic, so the same code
    runs in the kernel (Int32) and in the CPU tests (int)."""
    pairs = num_heads * num_batch
    per_section = num_blocks * section
    sec = n // per_section
    r = n - sec * per_section
    width = cutlass.min(section, pairs - sec * section)
    rank = r // width
    pair = sec * section + r - rank * width
    block = num_blocks - 1 - rank if longest_last else rank
    return block, pair % num_heads, pair // num_heads
