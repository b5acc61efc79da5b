"""Non-tensor bulk copies (cp.async.bulk): contiguous byte ranges moved by the TMA engine
without a tensor map. The backward uses them for the short per-row statistics (LSE and
D = rowsum(dO * O), one float per query row, stored padded so a tile is one aligned
chunk) and for adding a finished dQ tile into the fp32 accumulator in global memory.

Both need 16-byte aligned addresses and a size that is a multiple of 16 bytes.
"""

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def bulk_load(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, mbar_ptr: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """Global -> shared; completion is counted on the mbarrier's transaction bytes, so the
    producer adds num_bytes to that stage's expected tx count."""
    llvm.inline_asm(
        None,
        [
            gmem_ptr.toint(loc=loc, ip=ip).ir_value(),
            smem_ptr.toint(loc=loc, ip=ip).ir_value(),
            mbar_ptr.toint(loc=loc, ip=ip).ir_value(),
            Int32(num_bytes).ir_value(),
        ],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$1], [$0], $3, [$2];",
        "l,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


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
