"""The per-process caches of the host path (launch plans, bound signatures, workspace
views, rank orders) grow with every new shape a program uses; `remember` bounds them."""

DEFAULT_LIMIT = 4096


def remember(cache: dict, key, value, limit: int = DEFAULT_LIMIT):
    """cache[key] = value, emptying the cache first once it holds `limit` keys: a program
    that keeps meeting new shapes (varied prefill lengths, varlen maxima) rebuilds its
    entries rather than holding every one it ever saw. Returns value."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value
