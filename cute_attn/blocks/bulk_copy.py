"""Non-tensor bulk copies (cp.async.bulk): contiguous byte ranges moved by the TMA engine
without a tensor map. The backward's dQ writer adds each finished dQ tile (fp32, laid
out as one contiguous chunk, blocks/dq_accum.py) into the accumulator in global memory
with one bulk reduce-add. (Loads into shared memory go through tensor maps instead, even
1-D ones: see FlashBwdSm90's per-row statistics.)

Addresses must be 16-byte aligned and the size a multiple of 16 bytes.
"""

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def bulk_reduce_add_f32(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """global[i] += shared[i] for num_bytes / 4 floats, performed in L2 (atomic per element,
    unordered between CTAs). Tracked by the issuing thread's bulk async-group: commit, then
    wait (read) before the shared buffer is rewritten."""
    llvm.inline_asm(
        None,
        [
            gmem_ptr.llvm_ptr,
            smem_ptr.toint(loc=loc, ip=ip).ir_value(),
            Int32(num_bytes).ir_value(),
        ],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
