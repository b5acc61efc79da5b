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


def tma_partition(tma: TmaTensor, s: cute.Tensor, g: cute.Tensor, tile_rank: int = 2):
    """(shared, global) views of a tile of tile_rank modes (a 2-D tile, or 1-D for per-row
    statistics), plus any trailing stage / block modes, for tma.atom, without multicast."""
    return cpasync.tma_partition(
        tma.atom, 0, cute.make_layout(1), cute.group_modes(s, 0, tile_rank), cute.group_modes(g, 0, tile_rank)
    )


def prefetch_descriptors(tensors: tuple):
    """Prefetch the TMA descriptor of every TmaTensor in `tensors` (a kernel's globals
    bundle; one warp calls it), so the first loads and stores do not wait on a
    descriptor fetch."""
    for t in tensors:
        if isinstance(t, TmaTensor):
            cpasync.prefetch_descriptor(t.atom)


def release_after_loads(*rings):
    """Release a stage of each ring, given as (pipeline, its consumer state) pairs, that
    this warp also read with ordinary shared-memory loads (not only through WGMMA): e.g.
    the backward's per-query LSE2 and D.

    A ring's stage is released by one arrive per warp, from lane 0 (PipelineTmaAsync's
    consumer_release). Lane 0's arrive orders lane 0's own reads before the producer's
    refill, not those of lanes 1-31: without a warp barrier nothing orders another lane's
    last load of the stage before the arrive, so the TMA refill may overwrite a value that
    lane is still to read (a write-after-read race, in the memory model and in
    compute-sanitizer's racecheck, even though the warp runs converged in practice).
    __syncwarp first orders every lane's loads before the arrive, which the producer's
    wait on the empty barrier then orders before its next TMA write into the stage."""
    cute.arch.sync_warp()
    for pipe, state in rings:
        pipe.consumer_release(state)
