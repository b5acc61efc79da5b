"""Loads from another CTA's shared memory in the same thread-block cluster (distributed
shared memory, sm_90): the address of a local shared-memory element mapped into CTA
`rank`'s window (mapa), then ld.shared::cluster. The DSL's tensors cannot load from the
cluster window (4.8.1 refuses load/store on dsmem pointers), hence these two helpers.
The caller orders the loads after the owner's stores with a cluster barrier
(barrier.cluster.arrive has release semantics, .wait acquire)."""

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _cluster_address(ptr: cute.Pointer, rank, loc, ip):
    return Int32(cute.arch.map_dsmem_ptr(ptr, rank, loc=loc, ip=ip).toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip)


@dsl_user_op
def load_f32(ptr: cute.Pointer, rank: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 at ptr (this CTA's shared memory) in CTA `rank` of the cluster."""
    return Float32(llvm.inline_asm(
        T.f32(), [_cluster_address(ptr, rank, loc, ip)], "ld.shared::cluster.f32 $0, [$1];", "=f,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def load_f32x4(ptr: cute.Pointer, rank: Int32, *, loc=None, ip=None) -> tuple:
    """The four fp32 at ptr (16-byte aligned) in CTA `rank` of the cluster."""
    words = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4), [_cluster_address(ptr, rank, loc, ip)],
        "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), words, [i], loc=loc, ip=ip)) for i in range(4))
