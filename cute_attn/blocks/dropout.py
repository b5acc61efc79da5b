"""Dropout on a score tile in registers: Philox4x32 words per element, drawn from the
element's coordinates (cute_attn/dropout.py holds the counter layout and the same mask in
torch, which the tests hold the kernels to).

A WGMMA accumulator fragment ((2, 2, V), M, N) gives each thread, per 64-row block and
16-column group, rows {r, r + 8} x columns {c, c + 1, c + 8, c + 9}: two Philox units
(columns c and c + 1 each with c + 8, rows r and r + 8). So a thread evaluates one Philox
call per 4 of its elements and uses every word, in the forward's S (queries on rows) and
in the backward's S^T (keys on rows): the unit is symmetric, only the word order swaps.

Cost: 10 rounds of 2 wide multiplies and 2 three-way XORs per 4 elements, plus the
compare, on the integer pipe beside the tensor cores (perf/NOTES.md has the measurement).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, Uint64

from cute_attn.blocks.staged import Staged
from cute_attn.dropout import PHILOX_M, PHILOX_ROUNDS, PHILOX_W


class DropoutArgs(NamedTuple):
    """A call's dropout as the kernels receive it (launcher: from RunArgs)."""

    seed: cute.Tensor  # (2,) int32: the Philox key, on the device
    threshold: Int32  # floor(p * 2^32) as a 32-bit pattern: a word below it (unsigned) drops
    inv_keep: Float32  # 1 / (1 - p), the kept probabilities' scale


@cute.jit
def philox(c0: Uint32, c1: Uint32, c2: Uint32, c3: Uint32, k0: Uint32, k1: Uint32):
    """Philox4x32-PHILOX_ROUNDS: 4 words from a 4-word counter and a 2-word key (the
    round of dropout.philox4x32, whose known-answer vectors tests/test_dropout_cpu.py
    checks)."""
    for r in cutlass.range_constexpr(PHILOX_ROUNDS):
        if cutlass.const_expr(r > 0):
            k0 = k0 + Uint32(PHILOX_W[0])
            k1 = k1 + Uint32(PHILOX_W[1])
        p0 = Uint64(c0) * Uint64(PHILOX_M[0])  # mul.wide.u32
        p1 = Uint64(c2) * Uint64(PHILOX_M[1])
        hi0, lo0 = Uint32(p0 >> Uint64(32)), Uint32(p0)
        hi1, lo1 = Uint32(p1 >> Uint64(32)), Uint32(p1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


class Dropout(Staged):
    """The dropout of one work tile: batch entry `batch`, query head `head`."""

    def __init__(self, args: DropoutArgs, batch: Int32, head: Int32):
        self.k0 = Uint32(args.seed[0])
        self.k1 = Uint32(args.seed[1])
        self.threshold = Uint32(args.threshold)
        self.inv_keep = args.inv_keep
        self.batch = Uint32(batch)
        self.head = Uint32(head)

    @cute.jit
    def apply(self, acc: cute.Tensor, tScS: cute.Tensor, row_base: Int32, col_base: Int32,
              keys_on_rows: cutlass.Constexpr[bool] = False, negate: cutlass.Constexpr[bool] = False):
        """Drop elements of acc (a P tile, raw accumulator layout ((2, 2, V), M, N)):
        zero them, or with negate flip their sign (the backward: |P| still gives dS's
        -P D term, the sign says dropped). tScS: this thread's (row, col) coordinates,
        partitioned like acc; row_base, col_base: the tile's first row and column in the
        sequence (queries or keys, as keys_on_rows says)."""
        v = cute.size(acc.shape[0][2])
        for mi in cutlass.range_constexpr(cute.size(acc.shape[1])):
            for ni in cutlass.range_constexpr(cute.size(acc.shape[2])):
                for pair in cutlass.range_constexpr(v // 2):
                    for e in cutlass.range_constexpr(2):
                        # the unit's 4 elements: rows +0 / +8 (mode 0.1), column groups
                        # 2 pair and 2 pair + 1, 8 apart (mode 0.2)
                        base = ((e, 0, 2 * pair), mi, ni)
                        row = row_base + tScS[base][0]
                        col = col_base + tScS[base][1]
                        q0, k0 = (col, row) if cutlass.const_expr(keys_on_rows) else (row, col)
                        words = philox(Uint32(q0), Uint32(k0), self.head, self.batch, self.k0, self.k1)
                        for rh in cutlass.range_constexpr(2):
                            for kh in cutlass.range_constexpr(2):
                                # word (q // 8 % 2) * 2 + (k // 8 % 2)
                                word = words[kh * 2 + rh] if cutlass.const_expr(keys_on_rows) else words[rh * 2 + kh]
                                idx = ((e, rh, 2 * pair + kh), mi, ni)
                                if cutlass.const_expr(negate):
                                    acc[idx] = acc[idx] if word >= self.threshold else -acc[idx]
                                else:
                                    acc[idx] = acc[idx] if word >= self.threshold else Float32(0.0)
