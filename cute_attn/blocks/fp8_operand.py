"""P from the QK^T accumulator into the A operand of an FP8 PV WGMMA, in registers.

With 16-bit P the accumulator's registers already are the A operand (mma_sm90.
acc_as_operand_a). FP8 WGMMA (k = 32) wants another register layout. For one row of
one 32-key slice, thread t of a quad holds (accumulator, 8-column groups g = 0..3):

    keys 8g + 2t, 8g + 2t + 1            (a pair per group: 8 values)

while the FP8 A fragment wants thread t to hold

    keys 4t .. 4t + 3 (one 32-bit word)  and  16 + 4t .. 16 + 4t + 3 (another)

so half of each thread's pairs live in another lane of its quad. Thread t needs the
group-(t // 2) pairs of lanes 2t mod 4 and 2t + 1 mod 4 (and the same of groups 2, 3 for
the upper half). Pairing the sources so that each lane feeds exactly one destination per
shuffle lets a source pre-select what its destination wants from its own lane parity:

    shuffle 1: t <- 0, 2, 1, 3   (lane t reads lane 2t, or 2t + 1 for t >= 2)
    shuffle 2: t <- 1, 3, 0, 2

and each shuffled 32-bit word carries a pair for the lower and one for the upper 16 keys.
Per row and 32 keys: 2 shuffles and 6 byte permutes (prmt) after the conversion, against
16 exp2 and 16 FMAs of the softmax for the same values (scores_to_fp8_operand_a).

Or V's keys are permuted instead (scores_to_fp8_operand_a_v_permuted): the PV GEMM sums
over its K positions, so any order of the keys serves if P and V agree on it. Let thread
t's own words be the A operand as they stand: position 4t + 2a + b of each aligned 16-key
group then holds key 2t + b + 8a (V_PERMUTATION), and V^T's columns are written in that
order by the transpose that FP8 needs anyway (kernels/v_transpose.py), per sequence and
from each sequence's first key, so the groups line up with every KV block (tile_n is a
multiple of 32). No shuffle: 2 byte permutes per row and 32 keys.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# prmt selectors: the 16-bit halves (lo, lo) / (hi, hi) of two words, and swapped
_LO_LO, _HI_HI, _LO_LO_SWAPPED, _HI_HI_SWAPPED = 0x5410, 0x7632, 0x1054, 0x3276

# The key order of V^T that scores_to_fp8_operand_a_v_permuted expects: within each aligned
# group of 16 keys, column c holds key V_PERMUTATION[c] (c = 4t + 2a + b -> 2t + b + 8a).
V_PERMUTATION = tuple(2 * (c // 4) + c % 2 + 8 * ((c // 2) % 2) for c in range(16))


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: Int32, *, loc=None, ip=None) -> Int32:
    """PTX prmt.b32: byte i of the result is byte selector[4i:4i+4] of the 8-byte (b, a)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip),
             Int32(selector).ir_value(loc=loc, ip=ip)],
            "prmt.b32 $0, $1, $2, $3;",
            "=r,r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def _words(t: cute.Tensor) -> cute.Tensor:
    """A compact register tensor of 8-bit values seen as 32-bit words, 4 values each, in
    the tensor's own value order."""
    flat = cute.make_tensor(t.iterator, cute.make_layout(cute.size(t)))
    return cute.recast_tensor(flat, Int32)


@cute.jit
def scores_to_fp8_operand_a(acc_S: cute.Tensor, tOrP: cute.Tensor):
    """P (the softmax's fp32 values in acc_S, a ((2, 2, V), 1, 1) accumulator of one
    warpgroup) rounded to tOrP's dtype (e4m3) into tOrP, the ((4, 2, 2), 1, V / 4) A
    fragment of the PV WGMMA: word h + 2 * half + 4 * kb holds row half h, keys
    32 kb + 16 half + 4t .. + 3."""
    p8 = cute.make_rmem_tensor_like(acc_S, tOrP.element_type)
    p8.store(acc_S.load().to(tOrP.element_type))
    src = _words(p8)  # word g: (row r, row r + 8) x (key 8g + 2t, + 1)
    dst = _words(tOrP)
    lane = cute.arch.lane_idx()
    t = lane % 4
    quad = lane - t
    upper, odd = t // 2, t % 2  # 0 or 1: selectors below are arithmetic, not branches
    # the sources of the two shuffles (see the module docstring) and what each lane sends
    src1 = quad + (2 * t + upper) % 4
    src2 = quad + (2 * t + 1 - upper) % 4
    send1 = _LO_LO + odd * (_HI_HI - _LO_LO)
    send2 = _HI_HI - odd * (_HI_HI - _LO_LO)
    take_lo = _LO_LO - upper * (_LO_LO - _LO_LO_SWAPPED)
    take_hi = _HI_HI - upper * (_HI_HI - _HI_HI_SWAPPED)
    for kb in cutlass.range_constexpr(cute.size(dst) // 4):
        for h in cutlass.range_constexpr(2):
            row_half = _LO_LO if h == 0 else _HI_HI
            # this row's pairs of groups (0, 1) and (2, 3) of the 32-key slice
            x = byte_perm(src[4 * kb], src[4 * kb + 1], Int32(row_half))
            y = byte_perm(src[4 * kb + 2], src[4 * kb + 3], Int32(row_half))
            got1 = cute.arch.shuffle_sync(byte_perm(x, y, send1), src1)
            got2 = cute.arch.shuffle_sync(byte_perm(x, y, send2), src2)
            dst[h + 4 * kb] = byte_perm(got1, got2, take_lo)
            dst[h + 2 + 4 * kb] = byte_perm(got1, got2, take_hi)


@cute.jit
def scores_to_fp8_operand_a_v_permuted(acc_S: cute.Tensor, tOrP: cute.Tensor):
    """As scores_to_fp8_operand_a, for a V^T whose keys are in V_PERMUTATION's order: word
    h + 2 * half + 4 * kb of tOrP holds row half h, this thread's own pairs of key groups
    (2 half, 2 half + 1) of the 32-key slice kb, i.e. A positions 32 kb + 16 half + 4t ..
    + 3 = keys 32 kb + 16 half + (2t, 2t + 1, 8 + 2t, 9 + 2t)."""
    p8 = cute.make_rmem_tensor_like(acc_S, tOrP.element_type)
    p8.store(acc_S.load().to(tOrP.element_type))
    src = _words(p8)  # word g: (row r, row r + 8) x (key 8g + 2t, + 1)
    dst = _words(tOrP)
    for kb in cutlass.range_constexpr(cute.size(dst) // 4):
        for h in cutlass.range_constexpr(2):
            row_half = Int32(_LO_LO if h == 0 else _HI_HI)
            dst[h + 4 * kb] = byte_perm(src[4 * kb], src[4 * kb + 1], row_half)
            dst[h + 2 + 4 * kb] = byte_perm(src[4 * kb + 2], src[4 * kb + 3], row_half)
