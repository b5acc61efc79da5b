"""All-to-all (Ulysses) attention: re-shard q, k, v from "a part of the sequence, every
head" to "the whole sequence, a part of the heads" with one all-to-all each, run whole
attention locally (every mask and feature of `mha`: windows, softcap, GQA), and re-shard
the output back. The backward is the same exchanges in reverse around mha's own backward.

Rank r gets heads [r H/W, (r + 1) H/W) (and the matching KV heads: a KV head's query
heads stay together when both head counts divide by W). The gathered sequence arrives
in rank order; for the zigzag layout it is permuted back into the global order before
attention (and the output's gradient likewise), so causal masks see true positions.
"""

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from cute_attn.bounded_cache import remember
from cute_attn.distributed.layout import global_positions
from cute_attn.validation import _capturing_cuda_graph


# (seqlen, world_size, layout, device) -> (order, inverse): every exchange of every layer
# asks for the same few, so they are built once
_orders: dict = {}


def _rank_order(seqlen: int, world_size: int, layout: str, device, inverse: bool = False) -> torch.Tensor:
    """Global position of each row of the rank-order concatenation of the shards; inverse:
    the row of each global position. Not to be written to: the tensors are shared."""
    key = (seqlen, world_size, layout, device)
    orders = _orders.get(key)
    if orders is None:
        order = torch.cat([global_positions(seqlen, world_size, layout, r) for r in range(world_size)]).to(device)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=device)
        orders = (order, back)
        # made during a CUDA graph's capture, they live in the graph's private pool: not to keep
        if not _capturing_cuda_graph():
            remember(_orders, key, orders, limit=256)
    return orders[1] if inverse else orders[0]


def seq_to_heads(x: torch.Tensor, group, layout: str) -> torch.Tensor:
    """(batch, seqlen / W, heads, ...) sequence shard -> (batch, seqlen, heads / W, ...)."""
    world_size = dist.get_world_size(group)
    batch, local_len, heads = x.shape[:3]
    rest = x.shape[3:]
    # split the heads into W groups, group j to rank j
    send = x.reshape(batch, local_len, world_size, heads // world_size, *rest).movedim(2, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j]: rank j's sequence shard of this rank's heads
    gathered = recv.movedim(0, 1).reshape(batch, world_size * local_len, heads // world_size, *rest)
    if layout == "contiguous":
        return gathered
    return gathered.index_select(1, _rank_order(world_size * local_len, world_size, layout, x.device, inverse=True))


def heads_to_seq(x: torch.Tensor, group, layout: str) -> torch.Tensor:
    """The inverse of seq_to_heads: (batch, seqlen, heads / W, ...) -> (batch, seqlen / W, heads, ...)."""
    world_size = dist.get_world_size(group)
    batch, seqlen, local_heads = x.shape[:3]
    rest = x.shape[3:]
    if layout != "contiguous":
        x = x.index_select(1, _rank_order(seqlen, world_size, layout, x.device))
    local_len = seqlen // world_size
    send = x.reshape(batch, world_size, local_len, local_heads, *rest).movedim(1, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j]: this rank's sequence shard of rank j's heads
    return recv.movedim(0, 2).reshape(batch, local_len, world_size * local_heads, *rest)


class Reshard(torch.autograd.Function):
    """One of the two exchanges, differentiable: the gradient takes the other one."""

    @staticmethod
    def forward(ctx, x, exchange, inverse, group, layout):
        ctx.settings = (inverse, group, layout)
        return exchange(x, group, layout)

    @staticmethod
    @once_differentiable  # as mha's: the exchanges build no graph; refuse a double backward
    def backward(ctx, grad):
        inverse, group, layout = ctx.settings
        return inverse(grad.contiguous(), group, layout), None, None, None, None


def ulysses_forward(q, k, v, group, local, layout, causal, scale, window_size, softcap, need_lse=True):
    """(out, lse) of this rank's shard, differentiable in q, k, v through the exchanges
    (lse None unless need_lse: its exchange is skipped)."""
    qh, kh, vh = (Reshard.apply(t, seq_to_heads, heads_to_seq, group, layout) for t in (q, k, v))
    out, lse = local.attention(qh, kh, vh, causal, scale, window_size, softcap)
    out = Reshard.apply(out, heads_to_seq, seq_to_heads, group, layout)
    if not need_lse:
        return out, None
    # lse (batch, heads / W, seqlen) through the same exchange as a (batch, seqlen, heads / W) tensor
    lse = heads_to_seq(lse.detach().transpose(1, 2).contiguous(), group, layout).transpose(1, 2).contiguous()
    return out, lse
