"""Sliding windows across ranks: each rank fetches only the key shards its queries' windows
reach (a halo: with a window shorter than a shard, the one or two neighbours) and runs
one windowed kernel call over them; the ranks the window does not reach exchange nothing.

Contiguous layout, rank r's queries at global [qa, qa + n). With the window (left,
right), its keys are global [ka, kb) = [qa - left, qa + n + right) clipped to [0, S), so
the shards from ka // n to (kb - 1) // n. The kernel aligns masks bottom-right: on
(n queries, kb - ka keys) the window (L, R) lets local query i see local key j iff
i + (kb - ka - n) - L <= j <= i + (kb - ka - n) + R, and the global window is
qa + i - left <= ka + j <= qa + i + right; they agree for
    L = left + (kb - qa - n),   R = right - (kb - qa - n),
both >= 0 because kb lies in [qa + n, qa + n + right] (an unbounded side stays -1).

Backward: the same call's dK, dV over [ka, kb) go back to the shards' owners (the
reverse exchange) and are summed there in fp32.
"""

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


def window_keys(rank: int, world_size: int, local_len: int, window: tuple):
    """(first shard, last shard, ka, kb): the global keys [ka, kb) rank's queries may see
    under window (left, right) (-1: unbounded), and the shards holding them."""
    n, seqlen = local_len, local_len * world_size
    left, right = window
    qa = rank * n
    ka = 0 if left < 0 else max(0, qa - left)
    kb = seqlen if right < 0 else min(seqlen, qa + n + right)
    return ka // n, (kb - 1) // n, ka, kb


def kernel_window(rank: int, world_size: int, local_len: int, window: tuple) -> tuple:
    """The window (L, R) that, aligned bottom-right on (local_len queries, kb - ka keys),
    is the global window (the module docstring's formula)."""
    left, right = window
    extra = window_keys(rank, world_size, local_len, window)[3] - (rank + 1) * local_len
    return (-1 if left < 0 else left + extra, -1 if right < 0 else right - extra)


def readers(rank: int, world_size: int, local_len: int, window: tuple) -> list:
    """The other ranks whose windows reach rank's shard."""
    return [r for r in range(world_size)
            if r != rank and window_keys(r, world_size, local_len, window)[0] <= rank
            <= window_keys(r, world_size, local_len, window)[1]]


class Halo:
    """Who sends which shard to whom, for one (group, shard length, window)."""

    def __init__(self, group, local_len: int, window: tuple):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.n = local_len
        self.window = window
        self.first, self.last, self.ka, self.kb = window_keys(self.rank, self.world_size, local_len, window)

    def kernel_window(self) -> tuple:
        return kernel_window(self.rank, self.world_size, self.n, self.window)

    def readers(self) -> list:
        return readers(self.rank, self.world_size, self.n, self.window)

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The keys [ka, kb) along dim 2 of (2, batch, n, ...) K/V shards."""
        parts = {self.rank: shard}
        ops = [dist.P2POp(dist.isend, shard, self._peer(r), self.group) for r in self.readers()]
        for src in range(self.first, self.last + 1):
            if src != self.rank:
                parts[src] = torch.empty_like(shard)
                ops.append(dist.P2POp(dist.irecv, parts[src], self._peer(src), self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        keys = torch.cat([parts[s] for s in range(self.first, self.last + 1)], dim=2)
        start = self.ka - self.first * self.n
        return keys[:, :, start:start + self.kb - self.ka]

    def scatter_add(self, grads: torch.Tensor) -> torch.Tensor:
        """The reverse of gather: (2, batch, kb - ka, ...) gradients of the gathered keys
        back to their shards' owners; returns this shard's sum, fp32."""
        n, start = self.n, self.ka - self.first * self.n
        padded = grads.new_zeros((grads.shape[0], grads.shape[1], (self.last - self.first + 1) * n, *grads.shape[3:]))
        padded[:, :, start:start + grads.shape[2]] = grads
        pieces = {s: padded[:, :, (s - self.first) * n:(s - self.first + 1) * n].contiguous()
                  for s in range(self.first, self.last + 1)}
        total = pieces.pop(self.rank).clone()
        ops, received = [], []
        for dst, piece in pieces.items():
            ops.append(dist.P2POp(dist.isend, piece, self._peer(dst), self.group))
        for r in self.readers():
            buf = torch.empty_like(total)
            received.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, self._peer(r), self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for buf in received:
            total += buf
        return total


class HaloAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, halo: Halo, local, scale, softcap):
        kv = halo.gather(torch.stack([k, v]))
        window = halo.kernel_window()
        out, lse = local.block_forward(q, kv[0], kv[1], False, scale, softcap, window)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.settings = (halo, local, scale, softcap, window)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable  # as mha's: the exchanges build no graph; refuse a double backward
    def backward(ctx, dout, _dlse):
        q, kv, out, lse = ctx.saved_tensors
        halo, local, scale, softcap, window = ctx.settings
        dq, dk, dv = local.block_backward(dout, q, kv[0], kv[1], out, lse, False, scale, softcap, window)
        dkv = halo.scatter_add(torch.stack([dk, dv]).float())
        return dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None, None
