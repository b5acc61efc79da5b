"""The per-process caches of the host path (launch plans, bound signatures, workspace
views, rank orders) grow with every new shape a program uses; `remember` bounds them.
A device buffer a cache keeps must come from the allocator's default pool
(`outside_private_pools`)."""

DEFAULT_LIMIT = 4096


def remember(cache: dict, key, value, limit: int = DEFAULT_LIMIT):
    """cache[key] = value, emptying the cache first once it holds `limit` keys: a program
    that keeps meeting new shapes (varied prefill lengths, varlen maxima) rebuilds its
    entries rather than holding every one it ever saw. Returns value."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


def outside_private_pools(*tensors) -> bool:
    """Whether buffers just allocated for a cache (kept across calls) lie outside every
    private memory pool. Allocations are routed to one outside capture too: torch.compile's
    CUDA graph trees warm a new graph up in theirs (the whole thread, not capturing), and
    before their next recording reset it to a checkpoint, freeing every block allocated
    since (torch's setCheckpointPoolState). A buffer kept from such a warm-up would then
    overlap their tensors: a counter no longer zero, partials written into live data. A
    memory snapshot, so for a cache miss only; without one (a CPU build, another
    allocator) the buffers are kept, as before."""
    import torch

    try:
        segments = torch.cuda.memory_snapshot()
    except (AttributeError, RuntimeError):
        return True
    for t in tensors:
        ptr = t.data_ptr()
        for segment in segments:
            if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
                if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
                    return False
                break
    return True
