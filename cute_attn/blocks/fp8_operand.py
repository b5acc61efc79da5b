"""P from the QK^T accumulator into the A operand of an FP8 PV WGMMA, in registers.

With 16-bit P the accumulator's registers already are the A operand (mma_sm90.
acc_as_operand_a). FP8 WGMMA (k = 32) wants another register layout. For one row of
one 32-key step, thread t of a quad holds (accumulator, 8-column groups g = 0..3):

    keys 8g + 2t, 8g + 2t + 1            (a pair per group: 8 values)

while the FP8 A fragment has thread t hold K positions

    4t .. 4t + 3 (one 32-bit word)  and  16 + 4t .. 16 + 4t + 3 (another).

The PV GEMM sums over its K positions, so the keys may sit at any positions as long as
V's rows sit at the same ones. So each thread keeps its own pairs: groups (0, 1) form its
first word and groups (2, 3) its second, which puts key 2t + b + 8a at position 4t + 2a + b
of each aligned 16-key group (V_PERMUTATION), and V^T's columns are written in that
order by the transpose the FP8 forward needs anyway (kernels/v_transpose.py). Per row and
32 keys: 2 byte permutes (prmt) after the e4m3 conversion.

Keys in order instead would move half of each thread's pairs to another lane of its quad:
2 shuffles and 6 byte permutes per row and 32 keys. Measured against that (H100, 16K
tokens, perf/NOTES.md session 24): +1.8% / +0.5% at head dim 128 (non-causal / causal),
+0.4% / +2.0% at 256, +8.6% / +4.0% at 64, outputs bit-identical.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from cute_attn.blocks.mma_sm90 import as_words

# prmt selectors: the low / high 16-bit halves of two words
_LO_LO, _HI_HI = 0x5410, 0x7632

# The key order of V^T's columns: within each aligned group of 16 keys, column c holds key
# V_PERMUTATION[c] (c = 4t + 2a + b -> 2t + b + 8a).
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


@cute.jit
def scores_to_fp8_operand_a(acc_S: cute.Tensor, tOrP: cute.Tensor):
    """P (the softmax's fp32 values in acc_S, a ((2, 2, V), 1, 1) accumulator of one
    warpgroup) rounded to tOrP's dtype (e4m3) into tOrP, the ((4, 2, 2), 1, V / 4) A
    fragment of the PV WGMMA, for a V^T in V_PERMUTATION's order: word h + 2 * half + 4 * kb
    holds row half h, this thread's pairs of key groups (2 half, 2 half + 1) of the 32-key
    step kb, i.e. positions 32 kb + 16 half + 4t .. + 3 = keys 32 kb + 16 half + (2t,
    2t + 1, 8 + 2t, 9 + 2t)."""
    p8 = cute.make_rmem_tensor_like(acc_S, tOrP.element_type)
    p8.store(acc_S.load().to(tOrP.element_type))
    src = as_words(p8)  # word g: (row r, row r + 8) x (key 8g + 2t, + 1)
    dst = as_words(tOrP)
    for kb in cutlass.range_constexpr(cute.size(dst) // 4):
        for h in cutlass.range_constexpr(2):
            row_half = Int32(_LO_LO if h == 0 else _HI_HI)
            dst[h + 4 * kb] = byte_perm(src[4 * kb], src[4 * kb + 1], row_half)
            dst[h + 2 + 4 * kb] = byte_perm(src[4 * kb + 2], src[4 * kb + 3], row_half)
