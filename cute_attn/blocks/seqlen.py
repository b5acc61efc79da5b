"""Sequence bounds of the batch entry a CTA works on, and views of its rows.

Dense batches read the lengths off the tensor shapes and index the batch mode; with
kv_lengths (a KV cache) each entry's key count comes from a device tensor instead,
clamped to the cache's rows, so no key past the tensor is ever loaded. Variable-
length (packed) batches arrive as (1, total, heads, head_dim) tensors with cu_seqlens
offsets: sequence b is rows cu_seqlens[b]:cu_seqlens[b+1], reached by offsetting the
tensor's domain, so the kernels see the same 2-D (seqlen, head_dim) tiles either way and
never compute sequence bounds themselves.

A packed tile that runs past its sequence reads the next sequence's rows (TMA clips only
at the end of the whole tensor). That is harmless for loads, whose extra rows the masks
and the +inf LSE padding neutralise, but a store must stop at the sequence's end: the
kernels store packed tiles row by row (blocks/epilogue.py).

The offsets are clamped to the packed tensor's rows (packed_span): the host checks them
once per tensor version (api.mha_varlen), but offsets rewritten behind torch's version
counter (`.data`, DLPack aliases, another kernel, a graph replay) reach the kernels
unchecked, and a bad one must cost a wrong sequence, never a row outside the tensor.

The backward's per-row statistics and dQ accumulator are padded per sequence to whole
query tiles: sequence b starts at row (cu_seqlens_q[b] + b * tile_m) // tile_m * tile_m,
which leaves room for every sequence's last partial tile without overlap (the buffer holds
total_q + batch * tile_m rows).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_attn.blocks.staged import Staged


@cute.jit
def packed_span(mCuSeqlens: cute.Tensor, batch, total_rows):
    """(offset, length) of sequence `batch` in a packed tensor of total_rows rows, from its
    cu_seqlens, clamped into the tensor: identical for valid offsets (0 <= cu[b] <=
    cu[b+1] <= total), a shorter or empty sequence for bad ones."""
    start = cutlass.min(cutlass.max(mCuSeqlens[batch], Int32(0)), total_rows)
    end = cutlass.min(cutlass.max(mCuSeqlens[batch + 1], start), total_rows)
    return start, end - start


class SeqlenInfo(Staged):
    def __init__(
        self,
        batch: Int32,
        seqlen_q_dense: Int32,
        seqlen_k_dense: Int32,
        mCuSeqlensQ: cute.Tensor,
        mCuSeqlensK: cute.Tensor,
        varlen: bool,
        tile_m_padded: int = 0,
        kv_lengths: bool = False,
    ):
        self.varlen = varlen
        # the tensors' rows (varlen: all sequences'), the bound of every global index
        self.total_q, self.total_k = seqlen_q_dense, seqlen_k_dense
        if cutlass.const_expr(varlen):
            # the dense lengths are the packed tensors' total rows here
            self.offset_q, self.seqlen_q = packed_span(mCuSeqlensQ, batch, seqlen_q_dense)
            self.offset_k, self.seqlen_k = packed_span(mCuSeqlensK, batch, seqlen_k_dense)
            # the tensors' batch mode has size 1
            self.batch = Int32(0)
            self.padded_m_block_offset = Int32(0)
            if cutlass.const_expr(tile_m_padded > 0):
                self.padded_m_block_offset = (self.offset_q + batch * tile_m_padded) // tile_m_padded
        else:
            self.offset_q = Int32(0)
            self.offset_k = Int32(0)
            self.seqlen_q = seqlen_q_dense
            self.seqlen_k = seqlen_k_dense
            if cutlass.const_expr(kv_lengths):
                # a KV cache: this entry's filled length, at most the tensor's rows
                self.seqlen_k = cutlass.min(mCuSeqlensK[batch], seqlen_k_dense)
            self.batch = batch
            self.padded_m_block_offset = Int32(0)

    def global_q(self, i):
        """Row i of this sequence as a row of the (packed) tensor, clamped into the
        sequence, and into the tensor for an empty one: what index-taking code (the
        mods) may read at, whatever the tile's rows past the sequence."""
        return self._global(i, self.seqlen_q, self.offset_q, self.total_q)

    def global_k(self, j):
        """As global_q for the keys."""
        return self._global(j, self.seqlen_k, self.offset_k, self.total_k)

    def _global(self, i, length, offset, total):
        return cutlass.max(cutlass.min(cutlass.min(i, length - 1) + offset, total - 1), Int32(0))

    def rows_q(self, mX: cute.Tensor, head, batch=None):
        """(seqlen, head_dim, heads, batch) tensor -> this sequence's (seqlen_q, head_dim)
        rows of one head (a TMA coordinate tensor or a plain one). batch: another index
        of the batch mode than this entry's (the split-KV partials stack the splits
        there)."""
        b = self.batch if batch is None else batch
        return self._rows(mX[None, None, head, b], self.offset_q)

    def rows_k(self, mX: cute.Tensor, head, batch=None):
        """As rows_q for the keys; batch: another index of the batch mode (a paged cache
        is one sequence of pages, batch 0)."""
        b = self.batch if batch is None else batch
        return self._rows(mX[None, None, head, b], self.offset_k)

    def stats_q(self, mX: cute.Tensor, head, batch=None):
        """(seqlen, heads, batch) per-row tensor (the forward's LSE) -> this sequence's
        seqlen_q entries of one head (batch: as in rows_q)."""
        b = self.batch if batch is None else batch
        return self._rows(mX[None, head, b], self.offset_q)

    def _rows(self, t: cute.Tensor, offset):
        if cutlass.const_expr(not self.varlen):
            return t
        coord = (offset,) + (0,) * (cute.rank(t) - 1)
        return cute.domain_offset(coord, t)
