"""The mbarrier rings between the TMA producer warp and the consumer warpgroups, as both
kernels build them: one producer thread arms each stage with its expected transaction
bytes and issues the copies; each consumer warp releases a stage with one arrive once
its WGMMAs that read the stage have completed."""

import cutlass.pipeline as pipeline


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
