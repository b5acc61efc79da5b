"""Merging partial attention results by their log-sum-exp: the one implementation of the
LSE combine (the forward's split-KV tiles merge here; reference:
cute_attn.reference.combine_splits).

Split s of a query row saw only its share of the keys, so it holds
    lse_s = log sum_{j in s} exp(x_j)           (natural log, -inf if it saw no key)
    O_s   = sum_{j in s} exp(x_j - lse_s) v_j   (fp32, normalised within the split)
and the whole row is their LSE-weighted mean:
    lse = m + log sum_s exp(lse_s - m),   m = max_s lse_s
    O   = sum_s exp(lse_s - lse) O_s
A split that saw no key (lse_s = -inf) has weight 0; the forward still writes its rows
(O_s = 0), which lets the merge read every split without a branch. A row no split saw
gets O = 0 and lse = -inf, the rule for rows that see no key.

Layouts (the splits stacked on the batch mode: split s of batch entry b at s * batches + b):
    O_partial   (num_splits * batches, seqlen_q, heads, head_dim)  fp32
    LSE_partial (num_splits * batches, heads, seqlen_q)            fp32
    O           (batches, seqlen_q, heads, head_dim)              the output dtype
    LSE         (batches, heads, seqlen_q)                        fp32
Packed (varlen) batches are one entry (batches = 1) whose rows are the sequences' rows.

How a CTA merges a tile (SplitMerge.merge_tile):
- Few rows (decode: a query's group of heads; rows x head_dim / 4 <= threads): a thread
  per (row, 16-byte column chunk) loads SPLITS_IN_FLIGHT splits' LSEs and O chunks before
  it uses any, folds them into a running max, sum and weighted O (the online softmax's
  rescale), and divides once at the end. Each chunk thread of a row computes the row's
  LSE itself (a few exp2s) instead of sharing it through shared memory: one L2 round trip
  per SPLITS_IN_FLIGHT splits and no barrier. The merge ends the kernel, so its latency is
  the call's (perf/NOTES.md, session 21: the two-phase merge below took ~2-3 us there).
- Otherwise two phases:
  1. a thread per row: lse = log sum_s exp(lse_s) in one pass over the splits (a running
     max and a rescaled sum), into shared memory and the LSE output;
  2. every thread takes (row, chunk) items, ITEMS_IN_FLIGHT at a time:
     O = sum_s exp(lse_s - lse) O_s (the weights sum to 1, so no division).
The partials were written moments ago by the tile's CTAs, so they come from L2 and the
merge is latency-bound: phase 2 issues the loads of all its items for a split together
(ITEMS_IN_FLIGHT x 16 bytes per thread per split) instead of one row per warp, which
serialised a 128-row tile into 16 dependent rows per warp (+12 us at 16 queries x 8
heads, H100).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_attn.blocks import dsmem

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_FP32_CHUNK = 4  # fp32 elements per 16-byte load
ITEMS_IN_FLIGHT = 8
SPLITS_IN_FLIGHT = 16


@cute.jit
def row_lse(mLSEpart: cute.Tensor, num_splits: Int32, batches: Int32, b: Int32, row: Int32, head: Int32) -> Float32:
    """log sum_s exp(lse_s) of one row over its splits (-inf if no split saw a key)."""
    run_max = -Float32.inf
    run_sum = Float32(0.0)  # sum_s exp(lse_s - run_max)
    for s in cutlass.range(num_splits, unroll=8):
        lse_s = mLSEpart[s * batches + b, head, row]
        new_max = cute.arch.fmax(run_max, lse_s)
        # an all -inf prefix: shift by 0, so that exp2(-inf - -inf) never makes a NaN
        shift = new_max
        if new_max == -Float32.inf:
            shift = Float32(0.0)
        run_sum = run_sum * cute.math.exp2((run_max - shift) * _LOG2E, fastmath=True) + cute.math.exp2(
            (lse_s - shift) * _LOG2E, fastmath=True)
        run_max = new_max
    lse = -Float32.inf
    if run_sum > 0.0:
        lse = run_max + cute.math.log2(run_sum, fastmath=True) * _LN2
    return lse


class SplitMerge:
    """Merges the split partials of one tile of up to max_rows rows with num_threads
    threads. row_coord(r) maps the tile's row r to its (query row, head) in the
    partials' and outputs' indexing (packed GQA, varlen offsets: the kernel's business)."""

    def __init__(self, head_dim: int, out_dtype, num_threads: int, max_rows: int):
        self.head_dim = head_dim
        self.out_dtype = out_dtype
        self.num_threads = num_threads
        self.max_rows = max_rows
        self.chunks_per_row = head_dim // _FP32_CHUNK
        items = -(-max_rows * self.chunks_per_row // num_threads)
        self.groups = -(-items // ITEMS_IN_FLIGHT)

    @cute.jit
    def merge_tile(
        self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        sRowLse: cute.Tensor, num_splits: Int32, b: Int32, rows: Int32, row_coord, tidx, sync,
    ):
        """Rows [0, rows) of the tile into mO and mLSE (entry b of batches mO.shape[0]);
        sRowLse: max_rows fp32 of shared memory; sync(): a barrier of the num_threads."""
        batches = mO.shape[0]
        num_items = rows * self.chunks_per_row
        if num_items <= self.num_threads:
            if tidx < num_items:
                self._merge_one_chunk(mOpart, mLSEpart, mO, mLSE, num_splits, batches, b, row_coord, tidx)
        else:
            self._merge_in_two_phases(mOpart, mLSEpart, mO, mLSE, sRowLse, num_splits, batches, b, rows, num_items,
                                      row_coord, tidx, sync)

    @cute.jit
    def _merge_one_chunk(self, mOpart, mLSEpart, mO, mLSE, num_splits, batches, b, row_coord, tidx):
        """Item tidx = (row, 16-byte chunk) merged over every split from the global
        partials (module docstring: few rows)."""
        r = tidx // self.chunks_per_row
        chunk = tidx % self.chunks_per_row
        query, head = row_coord(r)

        def load(s, lse_s, o_s, j):
            part = s * batches + b
            lse_s[j] = mLSEpart[part, head, query]
            o_s[j, None].store(cute.zipped_divide(mOpart[part, query, head, None], (_FP32_CHUNK,))[None, chunk].load())

        acc, lse = self._merge_item(load, num_splits)
        self._store_item(acc, lse, mO, mLSE, b, query, head, chunk)

    @cute.jit
    def merge_tile_from_cluster(self, sOpart: cute.Tensor, sLSEpart: cute.Tensor, mO: cute.Tensor,
                                mLSE: cute.Tensor, num_splits: Int32, b: Int32, rows: Int32, row_coord, tidx):
        """Rows [0, rows) of the tile from partials that stay in the splits' shared
        memory: split s is CTA s of the caller's thread-block cluster, its O (tile_m,
        head_dim) in sOpart and its LSEs (tile_m,) in sLSEpart at the same addresses in
        every CTA (blocks/dsmem.py). Each thread takes (row, chunk) items in turn: no
        global round trip, so no need to batch items."""
        for item in cutlass.range(tidx, rows * self.chunks_per_row, self.num_threads, unroll=1):
            r = item // self.chunks_per_row
            chunk = item % self.chunks_per_row
            lse_ptr = sLSEpart.iterator + r
            o_ptr = (sOpart.iterator + (r * self.head_dim + chunk * _FP32_CHUNK)).align(16)

            def load(s, lse_s, o_s, j):
                lse_s[j] = dsmem.load_f32(lse_ptr, s)
                o = dsmem.load_f32x4(o_ptr, s)
                for c in cutlass.range_constexpr(_FP32_CHUNK):
                    o_s[j, c] = o[c]

            acc, lse = self._merge_item(load, num_splits)
            query, head = row_coord(r)
            self._store_item(acc, lse, mO, mLSE, b, query, head, chunk)

    @cute.jit
    def _merge_item(self, load, num_splits):
        """(O chunk, lse) of one (row, chunk) item over num_splits splits: load(s, lse_s,
        o_s, j) puts split s's LSE and O chunk in slot j, SPLITS_IN_FLIGHT splits loaded
        before any is used, folded into a running max, sum and weighted O (the online
        softmax's rescale) and divided once at the end."""
        lse_s = cute.make_rmem_tensor((SPLITS_IN_FLIGHT,), Float32)
        o_s = cute.make_rmem_tensor((SPLITS_IN_FLIGHT, _FP32_CHUNK), Float32)
        acc = cute.make_rmem_tensor((_FP32_CHUNK,), Float32)
        acc.fill(0.0)
        run_max = -Float32.inf
        run_sum = Float32(0.0)  # sum_s exp(lse_s - run_max)
        for first in cutlass.range(0, num_splits, SPLITS_IN_FLIGHT, unroll=1):
            for j in cutlass.range_constexpr(SPLITS_IN_FLIGHT):
                lse_s[j] = -Float32.inf
                o_s[j, None].fill(0.0)
                if first + j < num_splits:
                    load(first + j, lse_s, o_s, j)
            new_max = run_max
            for j in cutlass.range_constexpr(SPLITS_IN_FLIGHT):
                new_max = cute.arch.fmax(new_max, lse_s[j])
            # all -inf so far: shift by 0, so that exp2(-inf - -inf) never makes a NaN
            shift = new_max
            if new_max == -Float32.inf:
                shift = Float32(0.0)
            rescale = cute.math.exp2((run_max - shift) * _LOG2E, fastmath=True)
            run_sum = run_sum * rescale
            for c in cutlass.range_constexpr(_FP32_CHUNK):
                acc[c] = acc[c] * rescale
            for j in cutlass.range_constexpr(SPLITS_IN_FLIGHT):
                w = cute.math.exp2((lse_s[j] - shift) * _LOG2E, fastmath=True)
                run_sum = run_sum + w
                for c in cutlass.range_constexpr(_FP32_CHUNK):
                    acc[c] = acc[c] + w * o_s[j, c]
            run_max = new_max
        # a row no split saw: run_sum 0, O = 0 and lse = -inf
        lse = -Float32.inf
        inv_sum = Float32(0.0)
        if run_sum > 0.0:
            lse = run_max + cute.math.log2(run_sum, fastmath=True) * _LN2
            inv_sum = cute.arch.rcp_approx(run_sum)
        for c in cutlass.range_constexpr(_FP32_CHUNK):
            acc[c] = acc[c] * inv_sum
        return acc, lse

    @cute.jit
    def _store_item(self, acc, lse, mO, mLSE, b, query, head, chunk):
        cute.zipped_divide(mO[b, query, head, None], (_FP32_CHUNK,))[None, chunk].store(acc.load().to(self.out_dtype))
        if chunk == 0:
            mLSE[b, head, query] = lse

    @cute.jit
    def _merge_in_two_phases(self, mOpart, mLSEpart, mO, mLSE, sRowLse, num_splits, batches, b, rows, num_items,
                             row_coord, tidx, sync):
        """Many rows: the row LSEs first (a thread per row, through sRowLse), then the
        (row, chunk) items ITEMS_IN_FLIGHT at a time (module docstring)."""
        for i in cutlass.range_constexpr(-(-self.max_rows // self.num_threads)):
            r = tidx + i * self.num_threads
            if r < rows:
                query, head = row_coord(r)
                lse = row_lse(mLSEpart, num_splits, batches, b, query, head)
                sRowLse[r] = lse
                mLSE[b, head, query] = lse
        sync()
        for g in cutlass.range_constexpr(self.groups):
            if g * ITEMS_IN_FLIGHT * self.num_threads < num_items:
                self._merge_items(mOpart, mLSEpart, mO, sRowLse, num_splits, batches, b, num_items,
                                  row_coord, tidx, g)

    @cute.jit
    def _merge_items(self, mOpart, mLSEpart, mO, sRowLse, num_splits, batches, b, num_items, row_coord, tidx, g):
        # ITEMS_IN_FLIGHT items per thread, the split loop unrolled by 2.
        # item i of group g: (row, chunk) of index (g * items + i) * threads + tidx, so a
        # warp's lanes read consecutive 16-byte chunks of a row. Items past the tile read
        # row 0's (valid) addresses and store nothing.
        items = ITEMS_IN_FLIGHT
        queries = cute.make_rmem_tensor((items,), Int32)
        heads = cute.make_rmem_tensor((items,), Int32)
        chunks = cute.make_rmem_tensor((items,), Int32)
        shifts = cute.make_rmem_tensor((items,), Float32)
        acc = cute.make_rmem_tensor((items, _FP32_CHUNK), Float32)
        acc.fill(0.0)
        for i in cutlass.range_constexpr(items):
            item = (g * items + i) * self.num_threads + tidx
            r = item // self.chunks_per_row
            if item >= num_items:
                r = Int32(0)
            queries[i], heads[i] = row_coord(r)
            chunks[i] = item % self.chunks_per_row
            lse = sRowLse[r]
            # a row no split saw: weights exp2(-inf - 0) = 0, O = 0
            if lse == -Float32.inf:
                lse = Float32(0.0)
            shifts[i] = lse
        for s in cutlass.range(num_splits, unroll=2):
            part = s * batches + b
            for i in cutlass.range_constexpr(items):
                w = cute.math.exp2((mLSEpart[part, heads[i], queries[i]] - shifts[i]) * _LOG2E, fastmath=True)
                o_row = cute.zipped_divide(mOpart[part, queries[i], heads[i], None], (_FP32_CHUNK,))
                o = o_row[None, chunks[i]].load()
                for c in cutlass.range_constexpr(_FP32_CHUNK):
                    acc[i, c] += w * o[c]
        for i in cutlass.range_constexpr(items):
            item = (g * items + i) * self.num_threads + tidx
            if item < num_items:
                out_row = cute.zipped_divide(mO[b, queries[i], heads[i], None], (_FP32_CHUNK,))
                out_row[None, chunks[i]].store(acc[i, None].load().to(self.out_dtype))
