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

Two modes:
  * one tile per CTA (grid = blocks * splits x heads x batch; `tile`). Causal tiles
    differ in cost: the last query blocks see the most keys, so `longest_first` launches
    them first (longest-processing-time order) to shorten the tail. Variable-length
    batches size the block mode by the longest sequence; the kernels skip tiles past a
    shorter one's end.
  * persistent (`persistent_ctas` > 0, the GPU's SM count): min(tiles, persistent_ctas)
    CTAs, CTA i taking tiles i, i + grid, i + 2 grid, ... in the one-tile grid's order
    (block fastest, then head, then batch: the order the hardware launches that grid,
    which keeps a head's K and V in L2 while its query blocks run). A CTA's loop lets
    its producer load the next tile's K, V and Q while the consumers still finish the
    last one (`first_index` / `next_index` / `tile_at`). Static round robin for tiles of
    equal cost (no causal mask); with `tile_queue`, tiles past the first grid's come one
    at a time from an atomic counter (`take_ticket`), so a CTA that drew short tiles
    takes more of them (causal: the queue hands them out longest first within a head).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32


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
                 runtime_splits: bool = False, persistent_ctas: int = 0, tile_queue: bool = False):
        self.tile_size = tile_size  # rows (or keys) per block
        self.varlen = varlen
        self.num_splits = num_splits
        self.longest_first = longest_first
        self.runtime_splits = runtime_splits
        self.persistent_ctas = persistent_ctas
        self.tile_queue = tile_queue
        # the persistent loop decodes tiles from the tensors' shapes in the kernel, which
        # has no max_seqlen for a varlen grid and no run-time split count
        assert not persistent_ctas or not (varlen or runtime_splits or num_splits > 1)

    def work_tiles(self, mX: cute.Tensor, cu_seqlens: cute.Tensor, max_seqlen, num_splits=None):
        """(blocks * splits, heads, batch): the work tiles over the tensor whose rows the
        blocks tile, in the kernel-side view (seqlen, head_dim, heads, batch)
        (blocks/views.py). Dense: seqlen and batch from its shape. Varlen: the blocks of
        the longest sequence (max_seqlen) for each of the len(cu_seqlens) - 1 sequences.
        num_splits: the run-time count (runtime_splits)."""
        if cutlass.const_expr(self.varlen):
            num_blocks = cute.ceil_div(max_seqlen, self.tile_size)
            batch = cute.size(cu_seqlens.shape[0]) - 1
        else:
            num_blocks = cute.ceil_div(cute.size(mX.shape[0]), self.tile_size)
            batch = cute.size(mX.shape[3])
        splits = num_splits if cutlass.const_expr(self.runtime_splits) else self.num_splits
        return (num_blocks * splits, cute.size(mX.shape[2]), batch)

    def grid(self, mX: cute.Tensor, cu_seqlens: cute.Tensor, max_seqlen, num_splits=None):
        """The launch grid: the work tiles (work_tiles), or persistent, one CTA per SM at
        most."""
        tiles = self.work_tiles(mX, cu_seqlens, max_seqlen, num_splits)
        if cutlass.const_expr(self.persistent_ctas > 0):
            return (cutlass.min(tiles[0] * tiles[1] * tiles[2], self.persistent_ctas), 1, 1)
        return tiles

    @cute.jit
    def tile(self, num_splits=None) -> WorkTile:
        bid, head, batch = cute.arch.block_idx()
        num_blocks = cute.arch.grid_dim()[0]
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

    # ---- persistent: a CTA loops `index = first_index(); while index < count: ...;
    # index = next_index(index)` over work tiles (work_tiles in the kernel's view) ----
    @cute.jit
    def first_index(self) -> Int32:
        bid, _, _ = cute.arch.block_idx()
        return Int32(bid)

    @cute.jit
    def next_index(self, index: Int32) -> Int32:
        grid_x, _, _ = cute.arch.grid_dim()
        return index + Int32(grid_x)

    @cute.jit
    def tile_at(self, index: Int32, tiles) -> WorkTile:
        """Work tile number index of the (blocks, heads, batch) grid `tiles`, block
        fastest: the tile a one-tile-per-CTA grid gives its CTA number index."""
        num_blocks, heads = tiles[0], tiles[1]
        block = index % num_blocks
        rest = index // num_blocks
        if cutlass.const_expr(self.longest_first):
            block = num_blocks - 1 - block
        return WorkTile(Int32(block), Int32(rest % heads), Int32(rest // heads), Int32(0))

    @cute.jit
    def take_ticket(self, counter: cute.Tensor, num_tiles) -> Int32:
        """tile_queue, one warp: the index of this CTA's next tile, from the launch's
        counter (int32, zero at launch). Lane 0 takes a ticket and the warp shares it.
        Every CTA takes one ticket per tile it runs, the last one past the end, so the
        tickets of a launch are 0 .. num_tiles - 1 and the holder of the last one is the
        last to touch the counter: it sets it back to zero for the next launch.
        A grid with a CTA per tile (num_tiles <= the grid, grid() then has num_tiles
        CTAs) has no next tile and touches no counter: the host passes none there
        (launcher.uses_tile_queue), which saves a small call its per-stream lookup."""
        grid_x, _, _ = cute.arch.grid_dim()
        ticket = Int32(0)
        if num_tiles > Int32(grid_x):
            if cute.arch.lane_idx() == 0:
                ticket = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
                if ticket == num_tiles - 1:
                    counter[0] = Int32(0)
            ticket = cute.arch.shuffle_sync(ticket, 0)
        return ticket + Int32(grid_x)
