"""The split-KV combine: merges the partial results of a forward whose KV range was split
over `num_splits` CTAs (the work tile's split, clipped by blocks/block_range.py) into the
output and its LSE (launcher._run_fwd_split; reference: cute_attn.reference.combine_splits).

Split s of a query row saw only its share of the keys, so it holds
    lse_s = log sum_{j in s} exp(x_j)           (natural log, -inf if it saw no key)
    O_s   = sum_{j in s} exp(x_j - lse_s) v_j   (fp32, normalised within the split)
and the whole row is their LSE-weighted mean:
    lse = m + log sum_s exp(lse_s - m),   m = max_s lse_s
    O   = sum_s exp(lse_s - lse) O_s
A split that saw no key (lse_s = -inf) has weight 0; the forward still writes its rows
(O_s = 0), which lets the combine read every split without a branch. A row no split saw
gets O = 0 and lse = -inf, the rule for rows that see no key.

Layouts (the split forward's partials, the splits stacked on the batch mode: split s of
batch entry b at index s * batch + b):
    O_partial   (num_splits * batch, seqlen_q, heads, head_dim)  fp32
    LSE_partial (num_splits * batch, heads, seqlen_q)            fp32
    O           (batch, seqlen_q, heads, head_dim)              the input dtype
    LSE         (batch, heads, seqlen_q)                        fp32
Packed (varlen) batches pass batch = 1 and cu_seqlens_q, as the other kernels do
(blocks/seqlen.py).

Memory-bound and small: one warp per query row, lanes across head_dim (each load covers
128 contiguous bytes of one split's row), `_ROWS_PER_WARP` rows per warp, one CTA per
query tile of a (head, batch), the grid from blocks/tile_scheduler.py. num_splits is a
run-time value: a new split count never recompiles.
Read the PTX without a GPU: tests/test_compile.py::test_split_combine_compiles.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_attn.blocks.seqlen import SeqlenInfo
from cute_attn.blocks.tile_scheduler import TileScheduler
from cute_attn.blocks.views import bshd_as_sdhb
from cute_attn.config import AttnFeatures, DtypePolicy

_ROWS_PER_WARP = 4
_NUM_WARPS = 4
_UNROLL = 4  # splits whose loads are issued together
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


class SplitCombine:
    def __init__(self, dtypes: DtypePolicy, head_dim: int, features: AttnFeatures):
        self.out_dtype = dtypes.dsl("output")
        self.head_dim = head_dim
        self.varlen = features.varlen
        assert head_dim % 32 == 0, "lanes split head_dim in 32 columns"
        self.tile_m = _ROWS_PER_WARP * _NUM_WARPS
        self.scheduler = TileScheduler(self.tile_m, self.varlen)

    @cute.jit
    def __call__(
        self,
        mOpart: cute.Tensor,  # (num_splits * batch, seqlen_q, heads, head_dim) fp32
        mLSEpart: cute.Tensor,  # (num_splits * batch, heads, seqlen_q) fp32
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) fp32
        mCuSeqlensQ: cute.Tensor,  # varlen only
        max_seqlen_q: Int32,  # varlen only
        stream,
    ):
        grid = self.scheduler.grid(bshd_as_sdhb(mO), mCuSeqlensQ, max_seqlen_q)
        self.kernel(mOpart, mLSEpart, mO, mLSE, mCuSeqlensQ).launch(
            grid=grid, block=[32 * _NUM_WARPS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor,
    ):
        m_block, head, batch, _ = self.scheduler.tile()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        seqlen = SeqlenInfo(batch, mO.shape[1], mO.shape[1], mCuSeqlensQ, mCuSeqlensQ, self.varlen)
        b = seqlen.batch
        batches = mO.shape[0]  # split s of entry b is partial s * batches + b
        num_splits = mLSEpart.shape[0] // batches
        cols = self.head_dim // 32
        acc = cute.make_rmem_tensor((cols,), Float32)
        for i in cutlass.range(_ROWS_PER_WARP, unroll=1):
            row = m_block * self.tile_m + warp * _ROWS_PER_WARP + i
            if row < seqlen.seqlen_q:
                src = seqlen.offset_q + row
                # m = max_s lse_s (every lane reads the same few floats: one broadcast
                # each). The split loops are unrolled so that their independent loads are in
                # flight together: rolled, each split cost a full load latency (ncu: 9 us
                # for 8 splits of 32 rows, H100)
                lse_max = -Float32.inf
                for s in cutlass.range(num_splits, unroll=_UNROLL):
                    lse_max = cute.arch.fmax(lse_max, mLSEpart[s * batches + b, head, src])
                # Every split wrote every row it owns (one that saw no key: O_s = 0,
                # lse_s = -inf), so all are read, branch-free: exp2(-inf) = 0 weighs an
                # empty split out. A row no split saw (m = -inf) is shifted by 0 instead,
                # which keeps its exponents at -inf rather than NaN.
                shift = lse_max
                if lse_max == -Float32.inf:
                    shift = Float32(0.0)
                acc.fill(0.0)
                weight_sum = Float32(0.0)
                for s in cutlass.range(num_splits, unroll=_UNROLL):
                    part = s * batches + b
                    w = cute.math.exp2((mLSEpart[part, head, src] - shift) * _LOG2E, fastmath=True)
                    weight_sum += w
                    for j in cutlass.range_constexpr(cols):
                        acc[j] += w * mOpart[part, src, head, lane + 32 * j]
                lse = -Float32.inf
                inv_sum = Float32(0.0)
                if weight_sum > 0.0:
                    inv_sum = 1.0 / weight_sum
                    lse = lse_max + cute.math.log2(weight_sum, fastmath=True) * _LN2
                for j in cutlass.range_constexpr(cols):
                    mO[b, src, head, lane + 32 * j] = self.out_dtype(acc[j] * inv_sum)
                if lane == 0:
                    mLSE[b, head, src] = lse
