"""The online softmax, in base 2 with the softmax scale folded into one FFMA.

Each thread owns whole rows' worth of a warpgroup accumulator slice: a row's 128 (tile_n)
columns are spread over the 4 threads of a quad, so a row reduction is a thread-local
reduction plus two butterfly shuffles.

Rows that see no key at all (causal with seqlen_q > seqlen_k) keep max = -inf; the
exponent then uses 0 instead of -inf so that (-inf) - (-inf) never makes a NaN, every P
is exp2(-inf) = 0, the row sum stays 0, and finalize() returns out = 0 and lse = -inf.
"""

import math
import operator
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_attn.blocks.mma_sm90 import acc_as_rows_cols
from cute_attn.blocks.staged import Staged


def tree_reduce(values: list, combine):
    """Pairwise reduction (plain Python, unrolled at trace time): depth log2(n) instead of
    the n-long chain of dependent ops that an ordered vector reduction compiles to."""
    while len(values) > 1:
        paired = [combine(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = paired + values[len(paired) * 2:]
    return values[0]


def tree_sum(values: list):
    return tree_reduce(values, operator.add)


def quad_max(x: Float32) -> Float32:
    """A row's max across the 4 threads of a quad: two butterfly shuffles and FMNMX."""
    for offset in (2, 1):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset))
    return x


class ScoreScale(NamedTuple):
    """How raw scores S = q k^T become the exponent of exp2, shared by every kernel that
    forms a softmax (forward, backward, decode): the natural-log scale folded into one
    log2(e) multiply, and with a softcap the tanh's pre-scale."""

    softmax_scale: Float32  # the user's scale (the backward scales dK and dQ by it)
    scale_log2: Float32  # exp2(S' * scale_log2 - max) with S' = S, or tanh(...) with softcap
    softcap_pre: Float32  # softcap only: S' = tanh(S * softcap_pre)


def fold_score_scale(softmax_scale: Float32, softcap: Float32, has_softcap: bool,
                     has_score_mod: bool = False) -> ScoreScale:
    """softmax(scale * S) = exp2(S * scale * log2(e) - ...); with a softcap the scores are
    softcap * tanh(scale * S / softcap): tanh first (softcap_pre = scale / softcap), then
    softcap * log2(e) in the exp2 (see softcap_scores). A score mod rewrites the scaled
    score itself (blocks/mods.py multiplies by the scale first): the exp2 scale is log2(e)."""
    if cutlass.const_expr(has_score_mod):
        return ScoreScale(softmax_scale, Float32(math.log2(math.e)), Float32(1.0))
    if cutlass.const_expr(has_softcap):
        return ScoreScale(softmax_scale, softcap * math.log2(math.e), softmax_scale / softcap)
    return ScoreScale(softmax_scale, softmax_scale * math.log2(math.e), Float32(1.0))


class OnlineSoftmax(Staged):
    """p_log2_offset: P comes out as exp2(... + offset), i.e. scaled by 2^offset, for an
    FP8 P operand (e4m3 keeps probabilities below 2^-6 only as subnormals; scaled by 2^8
    they stay normal down to 2^-14). The row sums carry the same factor, so O's
    normalisation cancels it; the LSE takes it back out."""

    def __init__(self, scale_log2: Float32, num_rows: int, p_log2_offset: cutlass.Constexpr[float] = 0.0,
                 tree_row_sums: cutlass.Constexpr[bool] = False):
        self.scale_log2 = scale_log2
        self.p_log2_offset = p_log2_offset
        self.tree_row_sums = tree_row_sums  # see step
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turn raw scores S (in place) into P = exp2(S * scale_log2 - max) and return, per
        row, the factor by which the O accumulated so far must be rescaled.

        tree_row_sums: a row's sum as a pairwise tree (depth log2 n) rather than the
        vector reduction, which compiles to n dependent adds in order (perf/NOTES.md,
        session 13, has what each form measured); and its max as a tree of fmax (FMNMX)
        rather than the vector reduction's NaN-propagating max (FMNMX.NAN, and per shuffle
        step FSETP.NAN + FSETP.GTU + FSEL, whose NaN tests spill predicates to registers:
        ~100 fewer SASS instructions in the bf16 hd 128 forward; session 26). fmax skips a
        NaN score (as FlashAttention's row max does); its P is NaN and reaches O through the
        PV GEMM, unless dropout drops it (then the row's NaN sum makes finalize treat the
        row as empty)."""
        S = acc_as_rows_cols(acc_S)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            s_row = S[r, None].load()
            if cutlass.const_expr(self.tree_row_sums):
                values = [S[r, c] for c in range(cute.size(S.shape[1]))]
                if cutlass.const_expr(not is_first):
                    values.append(self.row_max[r])
                new_max = quad_max(tree_reduce(values, cute.arch.fmax))
            else:
                init = -Float32.inf if cutlass.const_expr(is_first) else self.row_max[r]
                new_max = s_row.reduce(cute.ReductionOp.MAX, init, 0)
                new_max = cute.arch.warp_reduction_max(new_max, threads_in_group=4)
            # a row with no visible key yet: exponentiate against 0, not -inf
            safe_max = 0.0 if new_max == -Float32.inf else new_max
            max_scaled = safe_max * self.scale_log2
            if cutlass.const_expr(self.p_log2_offset != 0.0):
                max_scaled = max_scaled - self.p_log2_offset
            p_row = cute.math.exp2(s_row * self.scale_log2 - max_scaled, fastmath=True)
            S[r, None].store(p_row)
            if cutlass.const_expr(is_first):
                row_scale[r] = 1.0
            else:
                # an old max of -inf (nothing seen yet) gives exp2(-inf) = 0 exactly; using
                # the safe 0 there would overflow to inf when the new max is very negative,
                # and inf * (sum 0) = NaN
                row_scale[r] = cute.math.exp2((self.row_max[r] - safe_max) * self.scale_log2, fastmath=True)
            if cutlass.const_expr(self.tree_row_sums):
                total = tree_sum([S[r, c] for c in range(cute.size(S.shape[1]))])
                if cutlass.const_expr(is_first):
                    self.row_sum[r] = total
                else:
                    self.row_sum[r] = self.row_sum[r] * row_scale[r] + total
            elif cutlass.const_expr(is_first):
                self.row_sum[r] = p_row.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            else:
                self.row_sum[r] = p_row.reduce(cute.ReductionOp.ADD, self.row_sum[r] * row_scale[r], 0)
            self.row_max[r] = new_max
        return row_scale

    @cute.jit
    def rescale(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        O = acc_as_rows_cols(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            O[r, None].store(O[r, None].load() * row_scale[r])

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, lse: cute.Tensor, out_scale=None, sink_log2=None):
        """Normalise O by the row sums (summed across the quad first), times out_scale if
        given (FP8: V's descale), and write the natural-log LSE per row:
        lse = max * scale + ln(sum). sink_log2: an attention sink's logit times log2(e),
        one more term of every row's sum (finalize_with_sink)."""
        if cutlass.const_expr(sink_log2 is not None):
            self.finalize_with_sink(acc_O, lse, out_scale, sink_log2)
            return
        O = acc_as_rows_cols(acc_O)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            empty = total == 0.0 or total != total
            inv = 0.0 if empty else 1.0 / total
            if cutlass.const_expr(out_scale is not None):
                inv = inv * out_scale
            O[r, None].store(O[r, None].load() * inv)
            ln2 = math.log(2.0)
            log2_sum = cute.math.log2(total, fastmath=True)
            if cutlass.const_expr(self.p_log2_offset != 0.0):
                log2_sum = log2_sum - self.p_log2_offset
            lse[r] = -Float32.inf if empty else (self.row_max[r] * self.scale_log2 + log2_sum) * ln2

    @cute.jit
    def finalize_with_sink(self, acc_O: cute.Tensor, lse: cute.Tensor, out_scale, sink_log2: Float32):
        """finalize with 2^sink_log2 added to each row's sum: out = sum_j p_j v_j / (sum_j
        p_j + e^sink), lse = ln(sum_j e^s_j + e^sink). The sum is re-based on
        top = max(row max, sink) so that neither term can overflow however far the sink
        lies above the scores; a row that sees no key gets out = 0 and lse = sink."""
        O = acc_as_rows_cols(acc_O)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            safe_max = 0.0 if self.row_max[r] == -Float32.inf else self.row_max[r]
            max_scaled = safe_max * self.scale_log2  # the exponent the row's p were taken against
            if cutlass.const_expr(self.p_log2_offset != 0.0):
                max_scaled = max_scaled - self.p_log2_offset
            top = max_scaled if max_scaled > sink_log2 else sink_log2
            rebase = cute.math.exp2(max_scaled - top, fastmath=True)
            total = total * rebase + cute.math.exp2(sink_log2 - top, fastmath=True)  # >= 1
            inv = rebase / total
            if cutlass.const_expr(out_scale is not None):
                inv = inv * out_scale
            O[r, None].store(O[r, None].load() * inv)
            lse[r] = (top + cute.math.log2(total, fastmath=True)) * math.log(2.0)


@cute.jit
def probs_from_lse(acc_S: cute.Tensor, lse_log2_cols: cute.Tensor, scale_log2: Float32):
    """The backward's softmax: recompute P = exp2(S * scale_log2 - LSE * log2(e)) in place
    from the forward's saved LSE, for an S^T tile (keys on rows, queries on columns), so
    lse_log2_cols gives one value per column of this thread (a register tensor, or a
    ColumnStat reading shared memory). Masked scores (-inf) and rows
    whose LSE was stored as +inf (no visible key, or padding) give P = 0."""
    S = acc_as_rows_cols(acc_S)
    # column-major walk: each column's LSE is used by its rows at once and is then dead,
    # so a per-use read (see ColumnStat) need not stay in a register
    for c in cutlass.range_constexpr(cute.size(S.shape[1])):
        lse_c = lse_log2_cols[c]
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse_c, fastmath=True)


@cute.jit
def softcap_scores(acc_S: cute.Tensor, pre_scale: Float32):
    """Gemma 2's logit softcap, first half: S <- tanh(S * softmax_scale / softcap) in place.
    The kernels then run the softmax with scale_log2 = softcap * log2(e), which makes the
    scores softcap * tanh(scale * S / softcap) without another multiply per element."""
    acc_S.store(cute.math.tanh(acc_S.load() * pre_scale, fastmath=True))


class ColumnStat:
    """A per-query statistic of the backward (LSE * log2(e), or D = rowsum(dO * O)) for
    this thread's columns of an S^T tile, read from the stage's shared-memory chunk at each
    use. Holding them in registers costs one register per column and statistic (16 each
    at 64 query columns, 32 at 128), which the dK/dV accumulators cannot spare at every
    head dim (session 18-19: loading them early spilled at head dim 64 and measured 0-1%
    at 128, so they are read at each use)."""

    def __init__(self, smem: cute.Tensor, cols: cute.Tensor, stage):
        self.smem, self.cols, self.stage = smem, cols, stage

    def __getitem__(self, c):
        return self.smem[self.cols[0, c][1], self.stage]
