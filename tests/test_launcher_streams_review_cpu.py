"""The launcher's state kept across calls (review of streams, devices and CUDA graphs),
on the CPU: torch.cuda's capture status, current stream and memory snapshot are faked.

A buffer that a cache keeps (the tile queue's counter, the split workspace, the LSE
sink) must come from the caching allocator's default pool. torch.compile's CUDA graph
trees warm a new graph up with the thread's allocations routed to their private pool,
outside capture, and reset that pool to a checkpoint before their next recording,
freeing every block allocated since: a counter kept from such a warm-up would be handed
to their tensors (bounded_cache.outside_private_pools)."""

import torch

from cute_attn import bounded_cache, launcher
from cute_attn.config import AttnFeatures, RunArgs

DEFAULT, PRIVATE = (0, 0), (3, 1)
CPU = torch.device("cpu")


def _fake_cuda(monkeypatch, pool, capturing=None, stream=None):
    """Every address in one segment of pool[0]'s; the capture status capturing[0]; the
    current raw stream stream[0]. Returns the list of snapshot calls."""
    snapshots = []

    def snapshot():
        snapshots.append(pool[0])
        return [{"address": 0, "total_size": 1 << 64, "segment_pool_id": pool[0]}]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    capturing = capturing or [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    stream = stream or [7]
    # (a CPU build of torch has no _cuda_getCurrentRawStream)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream[0], raising=False)
    return snapshots


def test_outside_private_pools_reads_each_buffers_segment(monkeypatch):
    a, b = torch.zeros(4), torch.zeros(4)
    segments = [{"address": a.data_ptr(), "total_size": 16, "segment_pool_id": DEFAULT},
                {"address": b.data_ptr(), "total_size": 16, "segment_pool_id": PRIVATE}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert bounded_cache.outside_private_pools(a)
    assert not bounded_cache.outside_private_pools(b) and not bounded_cache.outside_private_pools(a, b)
    assert bounded_cache.outside_private_pools(torch.zeros(4))  # in no segment: not the allocator's
    assert bounded_cache.outside_private_pools()

    def unavailable():
        raise RuntimeError("snapshot is not supported by this allocator")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", unavailable)
    assert bounded_cache.outside_private_pools(b)  # no snapshot: kept, as before


def test_a_tile_queue_counter_from_a_private_pool_is_not_kept(monkeypatch):
    """The counter a persistent forward takes from its stream's cache: one allocated in a
    private pool (a graph tree's warm-up on its stream) is the call's own; the next call
    outside the pool allocates and keeps one, and later hits take no snapshot."""
    pool = [PRIVATE]
    snapshots = _fake_cuda(monkeypatch, pool)
    monkeypatch.setattr(launcher, "_tile_queues", {})
    first = launcher._tile_queue(CPU)
    assert torch.equal(first, torch.zeros(2, dtype=torch.int32)) and launcher._tile_queues == {}
    assert launcher._tile_queue(CPU) is not first
    pool[0] = DEFAULT
    kept = launcher._tile_queue(CPU)
    assert launcher._tile_queues == {(CPU, 7): kept}
    calls = len(snapshots)
    pool[0] = PRIVATE  # a later warm-up on the stream reuses the default pool's counter
    assert launcher._tile_queue(CPU) is kept and len(snapshots) == calls


def test_a_split_workspace_grown_in_a_private_pool_is_not_kept(monkeypatch):
    """The split workspace's buffers and views: a growth in a private pool serves that
    call only (zeroed counters, nothing appended nor remembered); outside it they are
    kept; a private pool's call that needs no growth takes the kept ones, no snapshot."""
    pool = [PRIVATE]
    snapshots = _fake_cuda(monkeypatch, pool)
    monkeypatch.setattr(launcher, "_workspace_buffers", {})
    monkeypatch.setattr(launcher, "_workspace_views", {})
    o_part, lse_part, counters = launcher._split_workspace(CPU, 2, 3, 4, 8, 5)
    assert o_part.shape == (2, 3, 4, 8) and lse_part.shape == (2, 4, 3) and not counters.any()
    assert launcher._workspace_buffers[(CPU, 7)] == ([], []) and launcher._workspace_views == {}

    pool[0] = DEFAULT
    kept = launcher._split_workspace(CPU, 2, 3, 4, 8, 5)
    floats, zeros = launcher._workspace_buffers[(CPU, 7)]
    assert len(floats) == len(zeros) == 1 and launcher._split_workspace(CPU, 2, 3, 4, 8, 5) is kept

    pool[0] = PRIVATE
    calls = len(snapshots)
    small = launcher._split_workspace(CPU, 1, 2, 2, 8, 3)  # fits the kept buffers: no growth
    assert small[0].data_ptr() == floats[0].data_ptr() and len(snapshots) == calls
    big = launcher._split_workspace(CPU, 2, 3, 4, 8, 5000)  # more counters: a private growth
    assert not big[2].any() and big[0].data_ptr() == floats[0].data_ptr()
    assert big[2].data_ptr() != zeros[0].data_ptr()
    assert len(floats) == len(zeros) == 1 and (CPU, 7, 2, 3, 4, 8, 5000) not in launcher._workspace_views


def _launch(lse_shape):
    """A FwdLaunch of an unsplit dense forward whose kernel is a recorder."""
    launch = launcher.FwdLaunch()
    launch.fn = lambda *args: None
    launch.device, launch.lse_shape, launch.sink = CPU, lse_shape, None
    launch.placeholder = launch.page_table = torch.zeros(2, dtype=torch.int32)
    launch.scalars = (0, 1.0, 0.0, -1, -1)
    launch.num_splits, launch.tile_queue, launch.workspace, launch.partials = 1, False, None, None
    return launch


def test_an_lse_sink_grown_in_a_private_pool_is_kept_by_neither_the_sinks_nor_a_launch(monkeypatch):
    """Calls that discard lse write it into a shared sink: one grown in a private pool
    (or a capture) is the call's own, and a bound launch (api's fast path) keeps only
    the sink that _lse_sink kept."""
    pool, capturing = [PRIVATE], [False]
    _fake_cuda(monkeypatch, pool, capturing)
    monkeypatch.setattr(launcher, "_lse_sinks", {})
    monkeypatch.setattr(launcher, "_lse_sink_views", {})
    shape = (2, 4, 3)
    assert launcher._lse_sink(CPU, shape).shape == shape
    assert launcher._lse_sinks[CPU] == [] and launcher._lse_sink_views == {}

    q = torch.zeros(2, 3, 4, 8)
    launch = _launch(shape)
    out, lse = launch(q, q, q, need_lse=False)
    assert lse is None and launch.sink is None and launcher._lse_sinks[CPU] == []

    capturing[0], pool[0] = True, DEFAULT  # a capture: the graph's pool, not kept either
    launch(q, q, q, need_lse=False)
    assert launch.sink is None and launcher._lse_sinks[CPU] == []

    capturing[0] = False
    launch(q, q, q, need_lse=False)
    assert launch.sink is launcher._lse_sink_views[(CPU, shape)]
    assert launch.sink.data_ptr() == launcher._lse_sinks[CPU][0].data_ptr()


def test_a_block_mask_built_in_a_private_pool_is_not_cached(monkeypatch):
    """The block-mask cache keeps the tile lists the mods' kernels read: a mask built
    during a graph tree's warm-up (its private pool) must be rebuilt by the next call,
    not served from memory the pool's reset freed."""
    from cute_attn import block_mask, masks

    pool = [PRIVATE]
    _fake_cuda(monkeypatch, pool)
    monkeypatch.setattr(block_mask, "_cache", type(block_mask._cache)())
    built = []
    real_build = block_mask.build_block_mask

    def build(*args, **kwargs):  # on the CPU, reported as the GPU's
        built.append(1)
        kwargs["device"] = CPU
        return real_build(*args[:7], **kwargs)

    monkeypatch.setattr(block_mask, "build_block_mask", build)
    mod = masks.Modifier.of("mask", masks.causal())
    cuda = torch.device("cuda", 0)
    first = block_mask.cached_block_mask(mod, 1, 1, 256, 256, 128, 128, cuda)
    block_mask.cached_block_mask(mod, 1, 1, 256, 256, 128, 128, cuda)
    assert len(built) == 2 and not block_mask._cache  # the private pool's: never kept
    pool[0] = DEFAULT
    kept = block_mask.cached_block_mask(mod, 1, 1, 256, 256, 128, 128, cuda)
    assert block_mask.cached_block_mask(mod, 1, 1, 256, 256, 128, 128, cuda) is kept and len(built) == 3
    assert torch.equal(first.partial_count, kept.partial_count)


def test_placeholders_and_unused_partials_from_a_private_pool_are_not_kept_nor_bound(monkeypatch):
    """The tensors a kernel takes but never reads (cu_seqlens, page table, a cluster
    merge's partials) are cached too: made during a graph tree's warm-up they belong to
    its pool, which torch.compile checks holds nothing but tracked outputs (session 32:
    'Detected 3 tensor(s) in the cudagraph pool not tracked as outputs' from the kept
    partials). So neither cache keeps them, and bind_fwd binds no launch holding them;
    outside the pool both are kept and the launch binds."""
    pool = [PRIVATE]
    _fake_cuda(monkeypatch, pool)
    for cache in ("_placeholders", "_unused_partial_buffers", "_lse_sinks", "_lse_sink_views"):
        monkeypatch.setattr(launcher, cache, {})
    plan = launcher._Plan(fn=lambda *args: None, num_splits=4, tile_queue=False, tiles=2, cluster_merge=True)
    monkeypatch.setattr(launcher, "_plan", lambda *args: plan)
    monkeypatch.setattr(launcher, "DTYPE_OF_INPUT", {torch.float32: type("P", (), {"output": torch.float32})})
    q = torch.zeros(1, 1, 4, 8)
    features = AttnFeatures()
    args = RunArgs(softmax_scale=1.0, max_seqlen_q=1)

    assert launcher._unused_cu_seqlens(CPU).shape == (2,) and launcher._placeholders == {}
    assert len(launcher._unused_partials(CPU, 1, 4, 8)) == 3 and launcher._unused_partial_buffers == {}
    assert launcher.bind_fwd(q, q, features, args) is None

    pool[0] = DEFAULT
    launch = launcher.bind_fwd(q, q, features, args)
    assert launch is not None and launch.placeholder is launcher._placeholders[(CPU, (2,))]
    assert launch.partials is launcher._unused_partial_buffers[(CPU, 1, 4, 8)]
