"""Context parallelism: one sequence's attention over the GPUs of a torch.distributed
group (NCCL on GPUs; gloo runs the same logic on CPUs with the reference standing in).

Each rank holds a shard of the sequence, (batch, seqlen / W, heads, head_dim), in one of
two layouts (layout.py): "contiguous", or "zigzag" (two chunks per rank, one early and one
late, so that causal work is equal on every rank). `shard` and `unshard` convert.

Two variants:
  * ring_mha (ring.py): K/V shards travel around the ring with P2P sends overlapped with
    the local kernels; partial outputs merge by LSE (kernels/combine.py). Any head count;
    causal or not, softcap, GQA. Each step moves 2 x heads_kv x head_dim x seqlen / W
    elements per rank, W - 1 times forward (twice that, plus fp32 gradients, backward).
    With a sliding window (contiguous layout) the ranks the window does not reach are
    skipped: each rank fetches only the neighbouring shards its window covers and runs
    one windowed call (halo.py). ring_mha_varlen: packed documents, each split over the
    ranks, one varlen call per step (layout.varlen_task).
  * ulysses_mha (ulysses.py): all-to-all re-shards to whole sequences of heads / W heads,
    whole attention runs locally, with every feature of `mha` (windows included). Moves
    about (q + k + v + out) x (W - 1) / W of the local shard per forward, independent of
    the sequence's length in steps, but needs heads divisible by W (heads_kv divisible by
    W, or dividing it: then KV heads are copied per rank) and a whole sequence's K/V per
    rank.
Which to pick (`choose_variant`): a window shorter than a shard, the ring (its halo moves
one or two neighbours' K/V, less than Ulysses' all-to-alls); otherwise Ulysses when it
takes the head counts (fewer bytes moved, one kernel launch per pass); the
ring otherwise, or when one rank cannot hold the whole sequence of its heads. Measured
(perf/results/*-cp.json, 2 x H100, 256K causal): both at 0.96-0.98 forward+backward
parallel efficiency.
"""

from collections.abc import Iterable
from typing import Optional

import torch

from cute_attn.api import _default_scale
from cute_attn.distributed.layout import (
    LAYOUTS,
    block_task,
    check_layout,
    check_varlen_lengths,
    global_positions,
    shard,
    shard_varlen,
    unshard,
    unshard_varlen,
)
from cute_attn.distributed.local import KernelAttention, ReferenceAttention
from cute_attn.validation import (
    _check_is_tensor,
    _check_offsets,
    _check_rank,
    _check_shapes,
    _is_int,
    validate_flags,
    validate_fwd_inputs,
    validate_softcap,
    validate_window_size,
)

__all__ = ["ring_mha", "ring_mha_varlen", "ulysses_mha", "choose_variant", "shard", "unshard", "shard_varlen",
           "unshard_varlen", "global_positions", "block_task", "KernelAttention", "ReferenceAttention", "LAYOUTS"]


def choose_variant(nheads: int, nheads_kv: int, world_size: int, seqlen_local: int,
                   window_size=(-1, -1)) -> str:
    """The module docstring's rule: "ring" for a window within one shard's length on
    either side, else "ulysses" when ulysses_mha takes the head counts, else "ring"."""
    left, right = window_size
    if 0 <= left <= seqlen_local and 0 <= right <= seqlen_local:
        return "ring"
    if nheads % world_size == 0 and (nheads_kv % world_size == 0 or world_size % nheads_kv == 0):
        return "ulysses"
    return "ring"


def _world_size(group) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cute_attn.distributed needs torch.distributed initialised (init_process_group)")
    # new_group hands the ranks outside it a sentinel (an int) whose world size reads -1: a
    # ring of -1 steps would return uninitialised memory as out
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("group: this rank is not a member of the process group it passed (new_group's "
                         "non-member sentinel); call only on the group's ranks")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None (the world), got "
                        f"{type(group).__name__}")
    return dist.get_world_size(group)


def _check_shards(q, k, v, layout, local, softmax_scale, softcap, window_size=(-1, -1)):
    """Checks that need no communication, before any: the local kernel's (for the kernel
    backend) and the layout's. Every rank must hold the same shard length (not checked:
    it would cost a collective per call)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_is_tensor(name, t)
        _check_rank(name, t, 4, "(batch, seqlen_local, heads, head_dim)")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"q, k and v must hold the same shard of the sequence: local lengths "
                         f"{q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    # mha's shape checks, for every backend: what a rank's first kernel would otherwise find
    # only after the first exchange is posted
    _check_shapes(q, k, v)
    if q.shape[2] == 0:  # mha's checks let an empty call through; the ring and all-to-all have none
        raise ValueError(f"q must have at least one head, got shape {tuple(q.shape)}")
    check_layout(layout, q.shape[1])
    window_size = validate_window_size(window_size)
    if isinstance(local, KernelAttention):
        validate_fwd_inputs(q, k, v, softmax_scale, validate_softcap(softcap))
    return window_size


def ring_mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
             softmax_scale: Optional[float] = None, window_size=(-1, -1), softcap: float = 0.0,
             layout: str = "zigzag", return_lse: bool = False, local=None):
    """Ring attention over the ranks of `group` (default: the world).

    q (batch, seqlen / W, heads, head_dim) and k, v (batch, seqlen / W, heads_kv,
    head_dim): this rank's shard of one sequence in `layout` ("zigzag" or "contiguous",
    cute_attn.distributed.shard makes them); every rank calls with the same shapes.
    causal and window_size (left, right; -1 unbounded) follow the global positions; a
    window other than causal's needs layout="contiguous" (halo.py), and one with an
    unbounded side other than causal's gathers every shard on that side (memory: the
    whole sequence's K/V on the end ranks). Returns this rank's
    out (like q; float32 from
    the reference), or (out, lse) with lse float32 (batch, heads, seqlen / W).
    Differentiable in q, k, v. local: the per-rank attention (KernelAttention, the
    default; ReferenceAttention for CPU tests).
    """
    causal, return_lse, _ = validate_flags(causal, return_lse, False)  # "no" is not False
    world_size = _world_size(group)
    local = KernelAttention() if local is None else local
    left, right = _check_shards(q, k, v, layout, local, softmax_scale, softcap, window_size)
    scale = float(softmax_scale) if softmax_scale is not None else _default_scale(q)
    right = 0 if causal else right
    # a side that reaches past the whole sequence is unbounded (as mha takes 2**40): no halo for it
    seqlen = q.shape[1] * world_size
    left, right = (-1 if side >= seqlen - 1 else side for side in (left, right))
    if left < 0 and right in (-1, 0):  # no window, or causal's: the ring
        from cute_attn.distributed.ring import DenseSteps, Ring, RingAttention

        ring = Ring(group)
        steps = DenseSteps(local, layout, right == 0, scale, float(softcap), ring.rank, q.shape[1])
        out, lse = RingAttention.apply(q, k, v, ring, steps)
    else:
        if layout != "contiguous":
            raise ValueError(f"a sliding window across ranks needs layout='contiguous' (got {layout!r}): its "
                             "ranks then exchange only neighbouring shards")
        from cute_attn.distributed.halo import Halo, HaloAttention

        out, lse = HaloAttention.apply(q, k, v, Halo(group, q.shape[1], (left, right)), local, scale,
                                       float(softcap))
    return (out, lse) if return_lse else out


def ring_mha_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, group=None, *,
                    causal: bool = False, softmax_scale: Optional[float] = None, softcap: float = 0.0,
                    layout: str = "zigzag", return_lse: bool = False, local=None):
    """Ring attention over a packed batch of documents split over the ranks.

    cu_seqlens: the whole batch's document offsets (a list of ints or an int tensor read
    once on the host; every rank passes the same), each document's length divisible by
    the world size (by twice it for zigzag): each rank holds 1 / W of every document, in
    `layout` applied per document (shard_varlen makes the shards). q (total / W, heads,
    head_dim), k, v (total / W, heads_kv, head_dim): this rank's rows. Returns out like
    q, or (out, lse) with lse float32 (heads, total / W) (mha_varlen's layout).
    Differentiable in q, k, v.
    """
    causal, return_lse, _ = validate_flags(causal, return_lse, False)  # "no" is not False
    world_size = _world_size(group)
    local = KernelAttention() if local is None else local
    if isinstance(cu_seqlens, torch.Tensor):
        cu = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
    else:
        cu = list(cu_seqlens) if isinstance(cu_seqlens, Iterable) else None
    # ints only: int() would truncate 8.5 to 8 (another split of the documents) without a word
    if cu is None or not all(_is_int(x) for x in cu):
        if isinstance(cu_seqlens, torch.Tensor):
            got = f"a {cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}"
        else:
            got = type(cu_seqlens).__name__ if cu is None else f"{next(x for x in cu if not _is_int(x))!r} among them"
        raise TypeError(f"cu_seqlens must be a 1-D list or integer tensor of document offsets, got {got}")
    cu = [int(x) for x in cu]
    if not cu:
        raise ValueError("cu_seqlens must start at 0, got no offsets")
    # start at 0, non-decreasing; its end (the batch's total) is checked against the rows below
    _check_offsets("cu_seqlens", cu, "the batch", cu[-1], None, None)
    check_varlen_lengths(cu, world_size, layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_is_tensor(name, t)
        _check_rank(name, t, 3, "(total_tokens / world_size, heads, head_dim)")
        if t.shape[0] != cu[-1] // world_size:
            raise ValueError(f"{name} holds {t.shape[0]} rows; this rank's share of cu_seqlens is {cu[-1] // world_size}")
    _check_shards(q[None], k[None], v[None], "contiguous", local, softmax_scale, softcap)
    scale = float(softmax_scale) if softmax_scale is not None else _default_scale(q)
    from cute_attn.distributed.ring import Ring, RingAttention, VarlenSteps

    ring = Ring(group)
    steps = VarlenSteps(local, layout, bool(causal), scale, float(softcap), ring.rank, world_size,
                        [x // world_size for x in cu], q.device)
    out, lse = RingAttention.apply(q[None], k[None], v[None], ring, steps)
    return (out[0], lse[0]) if return_lse else out[0]


def ulysses_mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
                softmax_scale: Optional[float] = None, window_size=(-1, -1), softcap: float = 0.0,
                layout: str = "zigzag", return_lse: bool = False, local=None):
    """All-to-all (Ulysses) attention over the ranks of `group`: arguments and results as
    ring_mha's (window_size too). nheads must divide by the world size, and nheads_kv
    divide by it or divide it (fewer KV heads than ranks: each rank gets a copy of the
    KV head its query heads read)."""
    causal, return_lse, _ = validate_flags(causal, return_lse, False)  # "no" is not False
    world_size = _world_size(group)
    local = KernelAttention() if local is None else local
    window_size = _check_shards(q, k, v, layout, local, softmax_scale, softcap, window_size)
    heads, heads_kv = q.shape[2], k.shape[2]
    if heads % world_size or (heads_kv % world_size and world_size % heads_kv):
        raise ValueError(f"ulysses_mha needs nheads ({heads}) divisible by the world size ({world_size}), and "
                         f"nheads_kv ({heads_kv}) divisible by it or dividing it; ring_mha takes any head count")
    if heads_kv % world_size:
        # fewer KV heads than ranks: each rank's query heads share one KV head, so every
        # rank gets a copy of its own (the gradient of the copies sums back)
        k, v = (t.repeat_interleave(world_size // heads_kv, dim=2) for t in (k, v))
    scale = float(softmax_scale) if softmax_scale is not None else _default_scale(q)
    from cute_attn.distributed.ulysses import ulysses_forward

    out, lse = ulysses_forward(q, k, v, group, local, layout, bool(causal), scale, tuple(window_size), float(softcap),
                               need_lse=bool(return_lse))
    return (out, lse) if return_lse else out
