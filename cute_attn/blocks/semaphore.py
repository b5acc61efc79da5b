"""A global-memory turn counter that orders work across CTAs (the backward's deterministic
dQ accumulation: the CTAs that add into one dQ tile take turns in a fixed order).

    wait_turn(ptr, turn)   spin until *ptr >= turn (acquire), then order the caller's later
                           async-proxy (TMA/bulk) operations after it. With valid turns the
                           counter never passes a waiter's turn, so >= is ==; turns that
                           collide (two CTAs given one, from corrupted varlen offsets whose
                           clamped spans overlap) then cost a wrong order, not a hang.
    pass_turn(ptr)         after the caller's bulk operations have completed: make them
                           visible, then *ptr += 1 (release)

Both are issued by a single thread. Deadlock freedom rests on the CTA that holds turn t
having been launched no later than the one waiting for turn t + 1 (lower block index).
"""

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def wait_turn(ptr: cute.Pointer, turn: Int32, *, loc=None, ip=None):
    llvm.inline_asm(
        None,
        [ptr.llvm_ptr, Int32(turn).ir_value(loc=loc, ip=ip)],
        "{\n"
        ".reg .pred p;\n"
        ".reg .b32 v;\n"
        "SPIN:\n"
        "ld.acquire.gpu.global.b32 v, [$0];\n"
        "setp.lt.s32 p, v, $1;\n"
        "@p bra.uni SPIN;\n"
        "fence.proxy.async.global;\n"
        "}",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def pass_turn(ptr: cute.Pointer, *, loc=None, ip=None):
    llvm.inline_asm(
        None,
        [ptr.llvm_ptr],
        "fence.proxy.async.global;\nred.release.gpu.global.add.s32 [$0], 1;",
        "l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
