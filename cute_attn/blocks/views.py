"""Views of the kernels' global tensors (no data moves).

Tensors arrive in the FlashAttention layout, (batch, seqlen, heads, head_dim) with
head_dim contiguous, and per-row statistics as (batch, heads, rows). Every kernel works
on the transposed-mode view (seqlen, head_dim, heads, batch) / (rows, heads, batch), so
that a CTA's slice [None, None, head, batch] is a 2-D (seqlen, head_dim) matrix for TMA
and WGMMA and a statistic's slice [None, head, batch] a 1-D row vector.
"""

import cutlass.cute as cute


def bshd_as_sdhb(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, head_dim) -> (seqlen, head_dim, heads, batch)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def rowwise_as_rhb(t: cute.Tensor) -> cute.Tensor:
    """(batch, heads, rows) -> (rows, heads, batch): LSE, D, dQ_accum, semaphores."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))


def pack_heads_into_rows(t: cute.Tensor, group: int, head_mode: int) -> cute.Tensor:
    """Packed GQA view of a kernel-side tensor (row mode first): mode 0 (seqlen) becomes
    (group, seqlen) and the heads mode becomes heads / group, so row r of a KV head's tile
    is query r // group of query head kv_head * group + r % group. TMA addresses the
    2-level row mode."""
    shape, stride = list(t.shape), list(t.stride)
    shape[0], stride[0] = (group, shape[0]), (stride[head_mode], stride[0])
    shape[head_mode], stride[head_mode] = shape[head_mode] // group, stride[head_mode] * group
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))
