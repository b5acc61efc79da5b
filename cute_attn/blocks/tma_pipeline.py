"""TMA loads into shared memory: the global-tensor handle (`TmaTensor`) and the mbarrier
rings between the TMA producer warp and the consumer warpgroups, as both
kernels build them: one producer thread arms each stage with its expected transaction
bytes and issues the copies; each consumer warp releases a stage with one arrive once
its WGMMAs that read the stage have completed."""

from typing import NamedTuple

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync


def make_tma_pipeline(barrier_storage, num_stages: int, tx_bytes: int, num_consumer_threads: int):
    """A num_stages-deep ring whose stages complete when tx_bytes have landed. Created
    with defer_sync: the kernel calls pipeline_init_arrive / pipeline_init_wait once for
    all its rings."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage,
        num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads // 32),
        tx_count=tx_bytes,
        defer_sync=True,
    )


class TmaTensor(NamedTuple):
    """A global tensor as the TMA unit sees it: the copy atom (its descriptor) and the
    coordinate tensor it is partitioned with. Travels to the kernel as one argument."""

    atom: cute.CopyAtom
    tensor: cute.Tensor


def make_tma_tensor(op, tensor: cute.Tensor, smem_layout, tile: tuple) -> TmaTensor:
    """One CTA's TMA for (tile)-shaped boxes of `tensor` landing in `smem_layout` (a
    single stage: select the stage mode away first)."""
    atom, coords = cpasync.make_tiled_tma_atom(op, tensor, smem_layout, tile, 1)
    return TmaTensor(atom, coords)


def tma_partition(tma: TmaTensor, s: cute.Tensor, g: cute.Tensor):
    """(shared, global) views of a 2-D tile (plus any trailing stage / block modes) for
    tma.atom, without multicast."""
    return cpasync.tma_partition(
        tma.atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
    )


def prefetch_descriptors(tensors: tuple):
    """Prefetch the TMA descriptor of every TmaTensor in `tensors` (a kernel's globals
    bundle; one warp calls it), so the first loads and stores do not wait on a
    descriptor fetch."""
    for t in tensors:
        if isinstance(t, TmaTensor):
            cpasync.prefetch_descriptor(t.atom)
