"""How a sequence is split over the ranks of a context-parallel group, and which part of
each (query shard x key shard) block a ring step computes.

Two layouts of a sequence of length S over W ranks, each rank holding S / W tokens:
  * "contiguous": rank r holds tokens [r S/W, (r + 1) S/W).
  * "zigzag": the sequence cut into 2W chunks of S / 2W; rank r holds chunks r and
    2W - 1 - r, in that order. Under a causal mask every rank then does the same work
    (an early chunk sees few keys, its partner late chunk many), where the contiguous
    layout leaves rank 0 with 1 block of work and rank W - 1 with W.

A ring step pairs a rank's queries with the keys of shard `src`; the kernels see local
indices only, so a step names local rows. What it computes, by the global positions:
  * not causal: every query against every key.
  * causal, src == rank: the shard against itself under the causal mask. For zigzag
    this is right too: in the local order [chunk r, chunk 2W-1-r] every query comes
    after the keys it may see, and chunk r sees none of chunk 2W-1-r.
  * causal, contiguous: src < rank all of it without a mask; src > rank nothing.
  * causal, zigzag (n = S / 2W): src < rank: all queries against the first half of the
    keys (chunk src precedes both of the rank's chunks; chunk 2W-1-src follows both);
    src > rank: the second half of the queries (chunk 2W-1-rank) against all keys
    (chunks src and 2W-1-src both precede it; chunk rank precedes both of them).
So with zigzag every off-diagonal step is half a block, and no step is skipped.
"""

from typing import NamedTuple, Optional

import torch

LAYOUTS = ("contiguous", "zigzag")


class BlockTask(NamedTuple):
    """The rows of the local queries and keys a step attends, and whether under the
    causal mask (the local indices then align top-left: the slices have equal length)."""

    q_rows: slice
    k_rows: slice
    causal: bool


def block_task(layout: str, causal: bool, rank: int, src: int, local_len: int) -> Optional[BlockTask]:
    """What rank computes against shard src's keys (see the module docstring); None: nothing."""
    everything = slice(0, local_len)
    if not causal:
        return BlockTask(everything, everything, False)
    if src == rank:
        return BlockTask(everything, everything, True)
    if layout == "contiguous":
        return BlockTask(everything, everything, False) if src < rank else None
    half = local_len // 2
    if src < rank:
        return BlockTask(everything, slice(0, half), False)
    return BlockTask(slice(half, local_len), everything, False)


def check_layout(layout: str, local_len: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and local_len % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank: the local sequence length "
                         f"({local_len}) must be even")


def global_positions(seqlen: int, world_size: int, layout: str, rank: int) -> torch.Tensor:
    """The global token indices rank holds, in its local order (int64, on the CPU)."""
    if seqlen % world_size or (layout == "zigzag" and seqlen % (2 * world_size)):
        raise ValueError(f"a sequence of {seqlen} tokens does not split evenly over {world_size} ranks "
                         f"({'2 x ' if layout == 'zigzag' else ''}world size must divide it)")
    check_layout(layout, seqlen // world_size)
    if layout == "contiguous":
        n = seqlen // world_size
        return torch.arange(rank * n, (rank + 1) * n)
    n = seqlen // (2 * world_size)
    late = 2 * world_size - 1 - rank
    return torch.cat([torch.arange(rank * n, (rank + 1) * n), torch.arange(late * n, (late + 1) * n)])


def shard(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Rank's shard of the whole sequence x along dim (a copy, contiguous)."""
    index = global_positions(x.shape[dim], world_size, layout, rank).to(x.device)
    return x.index_select(dim, index).contiguous()


def unshard(shards: list, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (shards[r] of rank r, as from all_gather)."""
    world_size = len(shards)
    stacked = torch.cat(shards, dim=dim)
    seqlen = stacked.shape[dim]
    order = torch.cat([global_positions(seqlen, world_size, layout, r) for r in range(world_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seqlen)
    return stacked.index_select(dim, inverse.to(stacked.device))
