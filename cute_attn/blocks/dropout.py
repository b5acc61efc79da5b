"""Dropout on a score tile in registers: Philox4x32 bytes per element, drawn from the
element's coordinates (cute_attn/dropout.py holds the counter layout, units and groups,
and the same mask in torch, which the tests hold the kernels to).

A WGMMA accumulator fragment ((2, 2, V), M, N) gives each thread, per 64-row block and
16-column group, rows {r, r + 8} x columns {c, c + 1, c + 8, c + 9}: two units. The
forward (queries on rows) holds the 4 units of a group in two neighbouring 16-column
blocks and draws one Philox call per 16 elements; the backward (keys on rows) holds one
unit per group and uses one word of its call, so two lanes share each call (one
computes it, a shuffle passes the other its word): a call per 8 elements per lane.

Cost: PHILOX_ROUNDS rounds of 2 wide multiplies and 2 three-way XORs per call. The
backward then decides per element (a shift, mask, compare and select on fp32 P). The
forward decides per word and applies per pair of 16-bit P values: keep_flags turns a
word's 4 bytes into 4 keep bits (3 instructions), and apply_to_pairs ANDs each packed
bf16/fp16 pair of P with a mask that one byte permute builds from two flag words (one
prmt and one AND per 2 elements, against 4 instructions per element on fp32 P).
perf/NOTES.md has the measurements.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, Uint64

from cute_attn.blocks.fp8_operand import byte_perm
from cute_attn.blocks.staged import Staged
from cute_attn.dropout import PHILOX_M, PHILOX_ROUNDS, PHILOX_W


class DropoutArgs(NamedTuple):
    """A call's dropout as the kernels receive it (launcher: from RunArgs)."""

    seed: cute.Tensor  # (2,) int32: the Philox key, on the device
    threshold: Int32  # dropout.threshold(p), 0..255: a byte below it drops
    inv_keep: Float32  # dropout.keep_scale(p), the kept probabilities' scale

    @staticmethod
    def unread(int32_tensor: cute.Tensor) -> "DropoutArgs":
        """The stand-in of a kernel without dropout (AttnFeatures.dropout False): any
        int32 tensor it already takes as the seed, never read."""
        return DropoutArgs(int32_tensor, Int32(0), Float32(1.0))


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


@cute.jit
def _pick(words, i: Uint32) -> Uint32:
    """words[i] for a run-time i in 0..3 (three selects)."""
    low = words[1] if (i & Uint32(1)) != Uint32(0) else words[0]
    high = words[3] if (i & Uint32(1)) != Uint32(0) else words[2]
    return high if i >= Uint32(2) else low


class Dropout(Staged):
    """The dropout of one work tile: batch entry `batch`, query head `head`."""

    def __init__(self, args: DropoutArgs, batch: Int32, head: Int32):
        self.k0 = Uint32(args.seed[0])
        self.k1 = Uint32(args.seed[1])
        self.threshold = Uint32(args.threshold)
        self.inv_keep = args.inv_keep
        self.batch = Uint32(batch)
        self.head = Uint32(head)
        # keep_flags' operands: the threshold's low 7 bits in every byte, and all ones
        # when its top bit is clear (else 0)
        self.low_threshold = (self.threshold & Uint32(0x7F)) * Uint32(0x01010101)
        self.top_clear = Uint32(0) - (Uint32(1) - (self.threshold >> Uint32(7)))

    @cute.jit
    def _keep(self, word: Uint32, byte: cutlass.Constexpr[int]):
        return ((word >> Uint32(8 * byte)) & Uint32(0xFF)) >= self.threshold

    @cute.jit
    def keep_flags(self, word: Uint32) -> Uint32:
        """Bit 7 of byte i set iff byte i of word >= threshold (the other bits are noise):
        (w | 0x80) - (t & 0x7F) per byte never borrows across bytes and sets bit 7 iff the
        byte's low 7 bits are >= t's; the bytes' own top bits then decide by t's: with it
        clear a set top bit keeps (w | x), with it set both must hold (w & x), which is
        the majority of (w, x, top_clear), one LOP3."""
        x = (word | Uint32(0x80808080)) - self.low_threshold
        return (word & x) | ((word | x) & self.top_clear)

    @cute.jit
    def _group_words(self, q0: Int32, k0: Int32):
        """The 4 words of the group of unit (q0, k0)."""
        group = Uint32(k0) & Uint32(0xFFFFFFEE)  # bits 0 and 4 cleared
        return philox(Uint32(q0), group, self.head, self.batch, self.k0, self.k1)

    @cute.jit
    def apply(self, acc: cute.Tensor, tScS: cute.Tensor, row_base: Int32, col_base: Int32,
              negate: cutlass.Constexpr[bool] = False):
        """The backward's dropout on a P^T tile (keys on rows, raw accumulator layout
        ((2, 2, V), M, N)): zero the dropped elements, or with negate flip their sign
        (|P| still gives dS's -P D term, the sign says dropped). tScS: this thread's
        (row, col) coordinates, partitioned like acc; row_base, col_base: the tile's
        first key and query in the sequence."""
        v = cute.size(acc.shape[0][2])
        for mi in cutlass.range_constexpr(cute.size(acc.shape[1])):
            for ni in cutlass.range_constexpr(cute.size(acc.shape[2])):
                self._apply_keys_on_rows(acc, tScS, row_base, col_base, mi, ni, v, negate)

    @cute.jit
    def _drop(self, acc, idx, keep, negate: cutlass.Constexpr[bool]):
        if cutlass.const_expr(negate):
            acc[idx] = acc[idx] if keep else -acc[idx]
        else:
            acc[idx] = acc[idx] if keep else Float32(0.0)

    @cute.jit
    def _apply_keys_on_rows(self, acc, tScS, row_base, col_base, mi: cutlass.Constexpr[int],
                            ni: cutlass.Constexpr[int], v: cutlass.Constexpr[int], negate: cutlass.Constexpr[bool]):
        """The backward's S^T: the thread's key pair fixes the word of every group it
        touches; each unit (query pair q0, q0 + 8) is a call of its own, which the two
        lanes holding keys k and k + 1 (lane and lane ^ 4: rows lane / 4 of the
        accumulator) both need, one word each. So of a block's two units (queries c and
        c + 1) the even-key lane computes the first call and the odd-key lane the second,
        and each passes the other the word it needs: half the Philox work of one call
        per unit, for one shuffle per pair."""
        k0 = row_base + tScS[((0, 0, 0), mi, ni)][0]
        kb = Uint32(k0)
        odd_key = (kb & Uint32(1)) != Uint32(0)
        word_index = ((kb >> Uint32(4)) & Uint32(1)) * Uint32(2) + (kb & Uint32(1))
        for blk in cutlass.range_constexpr(v // 2):
            q_first = col_base + tScS[((0, 0, 2 * blk), mi, ni)][1]  # query c's unit
            q_second = col_base + tScS[((1, 0, 2 * blk), mi, ni)][1]  # query c + 1's
            words = self._group_words(q_second if odd_key else q_first, k0)
            mine = _pick(words, word_index)
            theirs = Uint32(cute.arch.shuffle_sync_bfly(Int32(_pick(words, word_index ^ Uint32(1))), offset=4))
            for e in cutlass.range_constexpr(2):
                # e = 0 (query c): the even-key lane's call; e = 1 (query c + 1): the odd one's
                if cutlass.const_expr(e == 0):
                    word = theirs if odd_key else mine
                else:
                    word = mine if odd_key else theirs
                for rh in cutlass.range_constexpr(2):  # key + 8 (k_hi)
                    for qh in cutlass.range_constexpr(2):  # query + 8 (q_hi)
                        idx = ((e, rh, 2 * blk + qh), mi, ni)
                        self._drop(acc, idx, self._keep(word, qh * 2 + rh), negate)

    @cute.jit
    def draw_pair_flags(self, acc: cute.Tensor, tScS: cute.Tensor, row_base: Int32, col_base: Int32):
        """The forward's keep flags for acc's elements (a P tile ((2, 2, V), M, N), queries
        on rows), drawn ahead of their use (the call site sits before the PV WGMMA's wait;
        the compiler may still sink the arithmetic below it, perf/NOTES.md): for each
        (mi, ni, block of 16 columns), the flag words of its two key parities e = 0, 1
        (key k0 + e), whose byte rh * 2 + kh decides element ((e, rh, 2 blk + kh), mi, ni).
        A 16-column block's column groups are j = 2 blk, 2 blk + 1 (8 apart: keys k0 and
        k0 + 8), and two neighbouring blocks share a group when the tile's first column is
        32-aligned and it has an even number of blocks (static); otherwise each block
        draws its own call and picks its words at run time. A Python list in static order
        (apply_to_pairs walks it the same way)."""
        v = cute.size(acc.shape[0][2])
        blocks = v // 2
        paired = blocks % 2 == 0  # col_base is a multiple of the tile width: 32-aligned when this holds
        step = 2 if paired else 1
        pairs = []
        for mi in cutlass.range_constexpr(cute.size(acc.shape[1])):
            for ni in cutlass.range_constexpr(cute.size(acc.shape[2])):
                for blk0 in cutlass.range_constexpr(0, blocks, step):
                    base = ((0, 0, 2 * blk0), mi, ni)
                    q0 = row_base + tScS[base][0]
                    k0 = col_base + tScS[base][1]
                    words = self._group_words(q0, k0)
                    for b in cutlass.range_constexpr(step):
                        if cutlass.const_expr(paired):
                            pairs.append((self.keep_flags(words[2 * b]), self.keep_flags(words[2 * b + 1])))
                        else:
                            picked = []
                            for e in cutlass.range_constexpr(2):
                                kb = Uint32(k0 + e)
                                word = _pick(words, ((kb >> Uint32(4)) & Uint32(1)) * Uint32(2) + (kb & Uint32(1)))
                                picked.append(self.keep_flags(word))
                            pairs.append((picked[0], picked[1]))
        return pairs

    @cute.jit
    def apply_to_pairs(self, p: cute.Tensor, pairs):
        """Zero the dropped elements of p, P in 16 bits laid out like the accumulator it
        came from ((2, 2, V), M, N), compact: an element pair (e = 0, 1) of one row and
        column block is one 32-bit word (e = 0 in its low half). pairs: draw_pair_flags'.
        Per word one prmt builds the AND mask, each half the sign of its flag byte."""
        words = cute.recast_tensor(cute.make_tensor(p.iterator, cute.make_layout(cute.size(p))), Uint32)
        pair = cute.crd2idx(((0, 0, 0), 0, 0), p.layout), cute.crd2idx(((1, 0, 0), 0, 0), p.layout)
        assert pair == (0, 1), f"p's key pairs must be adjacent 16-bit halves, got layout {p.layout}"
        v = cute.size(p.shape[0][2])
        i = 0
        for mi in cutlass.range_constexpr(cute.size(p.shape[1])):
            for ni in cutlass.range_constexpr(cute.size(p.shape[2])):
                for blk in cutlass.range_constexpr(v // 2):
                    flag_e0, flag_e1 = pairs[i]
                    i += 1
                    for rh in cutlass.range_constexpr(2):
                        for kh in cutlass.range_constexpr(2):
                            byte = rh * 2 + kh
                            # result bytes 0, 1: byte `byte` of flag_e0 sign-replicated (prmt
                            # selector bit 3); bytes 2, 3: the same byte of flag_e1 (4 + byte)
                            sel = (8 | byte) | (8 | byte) << 4 | (12 | byte) << 8 | (12 | byte) << 12
                            mask = byte_perm(Int32(flag_e0), Int32(flag_e1), Int32(sel))
                            g = cute.crd2idx(((0, rh, 2 * blk + kh), mi, ni), p.layout) // 2
                            words[g] = words[g] & Uint32(mask)
