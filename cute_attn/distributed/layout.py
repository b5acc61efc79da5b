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
    if world_size < 1 or not 0 <= rank < world_size:
        # (zigzag would take rank W + r as chunks W + r and W - 1 - r: another rank's, silently)
        raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank {rank} of {world_size}")
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
    _check_equal_shards(shards, dim, None)
    stacked = torch.cat(shards, dim=dim)
    seqlen = stacked.shape[dim]
    order = torch.cat([global_positions(seqlen, world_size, layout, r) for r in range(world_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seqlen)
    return stacked.index_select(dim, inverse.to(stacked.device))


def _check_equal_shards(shards: list, dim: int, rows: Optional[int]) -> None:
    """Every shard the same length along dim (rows, when given): the positions assume it,
    and unequal shards of a divisible total would be put back in the wrong places."""
    lengths = [s.shape[dim] for s in shards]
    if len(set(lengths)) > 1 or (rows is not None and lengths and lengths[0] != rows):
        want = f" ({rows} each)" if rows is not None else ""
        raise ValueError(f"every rank's shard must hold the same number of rows along dim {dim}{want}, "
                         f"got {lengths}")


# ----------------------------------------------------------------------------------------
# Packed variable-length batches: every document split the same way, one per rank
# ----------------------------------------------------------------------------------------
# A packed batch of documents (cu_seqlens over the whole batch) is sharded document by
# document: each document of length L gives each rank L / W tokens, in the layout above
# applied to that document alone (zigzag: chunks r and 2W - 1 - r of the document's 2W).
# Every rank then holds every document, each L / W long, so every rank's local cu_seqlens
# are the global ones divided by W, and a ring step's task applies per document.


def check_varlen_lengths(cu_seqlens: list, world_size: int, layout: str) -> None:
    check_layout(layout, 0)  # the name (varlen_task takes any other for zigzag); lengths below
    parts = world_size * (2 if layout == "zigzag" else 1)
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    bad = [i for i, n in enumerate(lengths) if n % parts]
    if bad:
        raise ValueError(f"every document's length must divide by {parts} ({'2 x ' if layout == 'zigzag' else ''}"
                         f"world size, layout {layout!r}); documents {bad[:8]} have lengths "
                         f"{[lengths[i] for i in bad[:8]]} (pad them)")


def varlen_positions(cu_seqlens: list, world_size: int, layout: str, rank: int) -> torch.Tensor:
    """The packed-batch rows rank holds, in its local order (int64, on the CPU)."""
    check_varlen_lengths(cu_seqlens, world_size, layout)
    return torch.cat([start + global_positions(end - start, world_size, layout, rank) if end > start
                      else torch.zeros(0, dtype=torch.int64)
                      for start, end in zip(cu_seqlens, cu_seqlens[1:])])


def shard_varlen(x: torch.Tensor, cu_seqlens: list, rank: int, world_size: int, layout: str = "zigzag",
                 dim: int = 0) -> torch.Tensor:
    """Rank's rows of a packed batch x (documents at cu_seqlens, along dim)."""
    if x.shape[dim] != cu_seqlens[-1]:  # index_select would take a prefix silently
        raise ValueError(f"x holds {x.shape[dim]} rows along dim {dim}; cu_seqlens ends at {cu_seqlens[-1]}")
    return x.index_select(dim, varlen_positions(cu_seqlens, world_size, layout, rank).to(x.device)).contiguous()


def unshard_varlen(shards: list, cu_seqlens: list, layout: str = "zigzag", dim: int = 0) -> torch.Tensor:
    """The packed batch from every rank's shard (shards[r] of rank r)."""
    world_size = len(shards)
    _check_equal_shards(shards, dim, cu_seqlens[-1] // max(world_size, 1))
    order = torch.cat([varlen_positions(cu_seqlens, world_size, layout, r) for r in range(world_size)])
    stacked = torch.cat(shards, dim=dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return stacked.index_select(dim, inverse.to(stacked.device))


class VarlenTask(NamedTuple):
    """A ring step over a packed batch: one varlen call on all local query rows and all
    local keys, its sequences built from block_task per document. A document's query
    rows that see none of the step's keys become a sequence with no keys (out 0, lse
    -inf: weight 0 in the merge); keys no query of the step sees become a sequence with
    no queries, so that each sequence's keys stay contiguous."""

    cu_seqlens_q: list
    cu_seqlens_k: list
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool


def varlen_task(layout: str, causal: bool, rank: int, src: int, local_cu_seqlens: list) -> Optional[VarlenTask]:
    """The varlen call of rank's step against shard src (every document split alike)."""
    cu_q, cu_k = [0], [0]
    for start, end in zip(local_cu_seqlens, local_cu_seqlens[1:]):
        n = end - start
        task = block_task(layout, causal, rank, src, n) if n else None
        if task is None:  # nothing of this document: its queries see no key, its keys no query
            pieces = [(n, 0), (0, n)]
        else:
            q_before, k_before = task.q_rows.start, task.k_rows.start
            q_len, k_len = task.q_rows.stop - q_before, task.k_rows.stop - k_before
            pieces = [(q_before, 0), (0, k_before), (q_len, k_len), (n - q_before - q_len, n - k_before - k_len)]
        for dq, dk in pieces:
            if dq or dk:
                cu_q.append(cu_q[-1] + dq)
                cu_k.append(cu_k[-1] + dk)
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:])] or [0]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:])] or [0]
    if not any(dq and dk for dq, dk in zip(lengths_q, lengths_k)):
        return None
    # block_task's mask is the same for every document: causal exactly on the diagonal step
    return VarlenTask(cu_q, cu_k, max(lengths_q), max(lengths_k), causal and src == rank)
