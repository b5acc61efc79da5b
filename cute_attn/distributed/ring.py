"""Ring attention: each rank keeps its shard of the queries and passes the keys and values
around the ring of the group, one shard per step, so after W steps (W = world size)
every query has met every key (layout.py says which part of each block a step computes).

Forward, per step: start sending the K/V shard held now to the next rank (and receiving
the previous rank's), run the local attention on the held shard, wait for the exchange.
The transfer (NCCL's own stream) overlaps the kernel. Partials merge into a running
(out, lse) in fp32 with the LSE combine (kernels/combine.py, local.py's merge), in place:
two fp32 slots, the running result and the step's partial, whatever W.

Backward, per step: the same K/V pass, plus each K/V shard's gradient accumulators (fp32)
travelling with it: a rank adds its block's dK, dV to the accumulators it received and
sends them on, so after W sends they are home. dQ stays local. Each step recomputes the
block from the merged out and lse (local.py: block_backward).
"""

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from cute_attn.distributed.layout import block_task, varlen_task
from cute_attn.validation import _capturing_cuda_graph


class Ring:
    """Point-to-point exchange with the ring's neighbours in one batched P2P call."""

    def __init__(self, group):
        self.group = group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world_size)

    def start(self, send: torch.Tensor):
        """Send to the next rank, receive the same shape from the previous one; returns
        (the receive buffer, the pending works)."""
        recv = torch.empty_like(send)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group),
                                        dist.P2POp(dist.irecv, recv, self.prev, self.group)])
        return recv, works

    @staticmethod
    def wait(works):
        for work in works:
            work.wait()


class DenseSteps:
    """The ring steps of (batch, seqlen, heads, head_dim) shards: layout.block_task's part
    of each block through the per-rank attention `local` (local.py)."""

    def __init__(self, local, layout: str, causal: bool, scale: float, softcap: float, rank: int, seqlen: int):
        self.local, self.layout, self.causal, self.scale, self.softcap = local, layout, causal, scale, softcap
        self.rank, self.seqlen = rank, seqlen

    def forward(self, q, k, v, src):
        """None (nothing to compute), or (query rows, their out, their lse)."""
        task = block_task(self.layout, self.causal, self.rank, src, self.seqlen)
        if task is None:
            return None
        out, lse = self.local.block_forward(q[:, task.q_rows], k[:, task.k_rows], v[:, task.k_rows], task.causal,
                                            self.scale, self.softcap)
        return task.q_rows, out, lse

    def backward(self, dout, q, k, v, out, lse, src):
        """None, or (query rows, key rows, dq, dk, dv) of those rows."""
        task = block_task(self.layout, self.causal, self.rank, src, self.seqlen)
        if task is None:
            return None
        rows, keys = task.q_rows, task.k_rows
        grads = self.local.block_backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                          lse[:, :, rows], task.causal, self.scale, self.softcap)
        return (rows, keys, *grads)


class VarlenSteps:
    """The ring steps of packed batches, seen as (1, total, heads, head_dim) shards whose
    documents are all split alike (layout.varlen_task): one varlen call per step over
    every local row, its cu_seqlens built once per call: every step's offsets in one
    host-to-device copy from pinned memory, which does not wait for the stream (a copy
    from pageable memory does: one stall per step and direction before)."""

    def __init__(self, local, layout: str, causal: bool, scale: float, softcap: float, rank: int, world_size: int,
                 local_cu_seqlens: list, device):
        self.local, self.scale, self.softcap = local, scale, softcap
        self.tasks = {src: varlen_task(layout, causal, rank, src, local_cu_seqlens) for src in range(world_size)}
        offsets = [cu for task in self.tasks.values() if task is not None
                   for cu in (task.cu_seqlens_q, task.cu_seqlens_k)]
        host = torch.tensor([x for cu in offsets for x in cu], dtype=torch.int32)
        if torch.device(device).type == "cuda":
            if _capturing_cuda_graph():
                # a captured copy would replay from a pinned buffer reused since
                raise RuntimeError("ring_mha_varlen builds its steps' offsets on the host per call: it cannot be "
                                   "captured in a CUDA graph")
            host = host.pin_memory()
        views = iter(host.to(device, non_blocking=True).split([len(cu) for cu in offsets]))
        self.cu = {src: (next(views), next(views)) for src, task in self.tasks.items() if task is not None}

    def forward(self, q, k, v, src):
        task = self.tasks[src]
        if task is None:
            return None
        out, lse = self.local.varlen_forward(q[0], k[0], v[0], *self.cu[src], task.max_seqlen_q, task.max_seqlen_k,
                                             task.causal, self.scale, self.softcap)
        return slice(0, q.shape[1]), out[None], lse[None]

    def backward(self, dout, q, k, v, out, lse, src):
        task = self.tasks[src]
        if task is None:
            return None
        grads = self.local.varlen_backward(dout[0], q[0], k[0], v[0], out[0], lse[0], *self.cu[src],
                                           task.max_seqlen_q, task.max_seqlen_k, task.causal, self.scale,
                                           self.softcap)
        everything = slice(0, q.shape[1])
        return (everything, everything, *(g[None] for g in grads))


def ring_forward(q, kv, ring: Ring, steps):
    """(out, lse) of this rank's queries over the whole sequence: out in q's dtype, lse
    float32 (batch, heads, seqlen_local). kv: this rank's K and V stacked, (2, batch,
    seqlen_local, heads_kv, head_dim): one message per step."""
    batch, seqlen, heads, head_dim = q.shape
    # slot 0 (rows 0..batch-1): the running result; slot 1: the step's partial
    o_part = q.new_empty((2 * batch, seqlen, heads, head_dim), dtype=torch.float32)
    lse_part = q.new_empty((2 * batch, heads, seqlen), dtype=torch.float32)
    lse_merged = q.new_empty((batch, heads, seqlen), dtype=torch.float32)
    for step in range(ring.world_size):
        pending = ring.start(kv) if step + 1 < ring.world_size else None
        result = steps.forward(q, kv[0], kv[1], (ring.rank - step) % ring.world_size)
        if result is not None:
            rows, out, lse = result
            if step == 0:  # the diagonal block: every row, the first partial
                o_part[:batch].copy_(out)
                lse_part[:batch].copy_(lse)
            else:
                o_part[batch:, rows].copy_(out)
                lse_part[batch:, :, rows].copy_(lse)
                steps.local.merge(o_part[:, rows], lse_part[:, :, rows], o_part[:batch, rows],
                                  lse_merged[:, :, rows])
                # needed: the combine's lse may not alias lse_part (kernels/combine.py), and the next merge reads slot 0
                lse_part[:batch, :, rows].copy_(lse_merged[:, :, rows])
        if pending is not None:
            kv, works = pending
            ring.wait(works)
    # a copy either way (a float32 view would keep both slots alive)
    return o_part[:batch].to(q.dtype, copy=True), lse_part[:batch].clone()


def ring_backward(dout, q, kv, out, lse, ring: Ring, steps):
    """(dq, dk, dv) of this rank's shards, in their dtypes (kv as ring_forward's)."""
    dq = torch.zeros_like(q, dtype=torch.float32)
    dkv = torch.zeros_like(kv, dtype=torch.float32)  # the held K/V shard's accumulators
    dkv_pending = None
    for step in range(ring.world_size):
        kv_pending = ring.start(kv) if step + 1 < ring.world_size else None
        grads = steps.backward(dout, q, kv[0], kv[1], out, lse, (ring.rank - step) % ring.world_size)
        if dkv_pending is not None:  # the accumulators of the shard now held, from the previous rank
            dkv, works = dkv_pending
            ring.wait(works)
        if grads is not None:
            rows, keys, dq_step, dk_step, dv_step = grads
            dq[:, rows] += dq_step
            dkv[0][:, keys] += dk_step
            dkv[1][:, keys] += dv_step
        if ring.world_size > 1:  # (one rank: its own accumulators, nothing to send)
            dkv_pending = ring.start(dkv)
        if kv_pending is not None:
            kv, works = kv_pending
            ring.wait(works)
    if dkv_pending is not None:  # this rank's own shard's, after a full turn
        dkv, works = dkv_pending
        ring.wait(works)
    return dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, steps):
        kv = torch.stack([k, v])  # stacked once, kept for the backward
        out, lse = ring_forward(q, kv, ring, steps)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.settings = (ring, steps)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable  # as mha's: the exchanges build no graph; refuse a double backward
    def backward(ctx, dout, _dlse):
        q, kv, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, kv, out, lse, *ctx.settings)
        return dq, dk, dv, None, None
