"""Plain-torch KV-cache attention (FlashAttention's `flash_attn_with_kvcache`), the ground
truth for the decode kernels of issue 12. Runs on any device; nothing in `mha` calls it.

A decode step appends the new tokens' keys and values to each sequence's cache, then
attends over everything the sequence holds. The reference does exactly that, in two
visible steps, so a test can check each one:

1. `append_to_cache`: copies of the caches with k_new / v_new written at logical positions
   cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of batch entry b.
2. `gather_sequence`: entry b's seqlen_k[b] = cache_seqlens[b] + seqlen_new keys and values
   read back in logical order, then `reference.attention_ref` on them, one entry at a time
   (each entry has its own seqlen_k, hence its own bottom-right alignment of the masks).

Contiguous and paged caches go through one code path: a contiguous cache
(batch, seqlen_cache, nheads_kv, headdim) is a paged one whose page b is entry b's whole
row, page_size = seqlen_cache and page_table[b] = [b]. A paged cache is
(num_pages, page_size, nheads_kv, headdim) with an int32 page_table (batch, max_pages):
logical position p of entry b lives in page page_table[b, p // page_size], row
p % page_size. Only the pages an entry uses are looked up, so the rest of its page-table
row may hold anything.
"""

import torch

from cute_attn.kvcache_checks import check_kvcache_values
from cute_attn.reference import attention_ref


def kvcache_attention_ref(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *,
                          page_table=None, causal=False, window_size=(-1, -1), softcap=0.0,
                          softmax_scale=None):
    """Return (out, lse, k_cache_after, v_cache_after) of one KV-cache attention step.

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch, seqlen_cache,
    nheads_kv, headdim), or (num_pages, page_size, nheads_kv, headdim) with page_table
    (batch, max_pages) int32. cache_seqlens: int32 (batch,), the keys each entry already
    holds. k_new, v_new: None or (batch, seqlen_new, nheads_kv, headdim), both or neither.

    The new keys and values are written into copies of the caches first (the inputs are
    left alone), then query i of entry b attends over that entry's
    seqlen_k = cache_seqlens[b] + seqlen_new keys with the masks of
    `reference.attention_ref` aligned bottom-right per entry: causal, query i sees key j
    iff j <= i + seqlen_k - seqlen_q; the window and softcap as there. GQA: query head h
    reads KV head h // (nheads // nheads_kv). A query that sees no key gets out = 0,
    lse = -inf.

    Returns out float32 (batch, seqlen_q, nheads, headdim), lse float32
    (batch, nheads, seqlen_q) (natural log), and the caches after the append (their
    dtype and layout). Computed in float32 from upcast inputs (attention_ref's upcast
    path). Reads cache_seqlens and page_table on the host (a device sync on a GPU):
    a test helper.
    """
    k_after, v_after = append_to_cache(k_cache, v_cache, cache_seqlens, k_new, v_new, page_table)
    rows = _page_table(k_cache, page_table).tolist()
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    outs, lses = [], []
    for b, cached in enumerate(cache_seqlens.tolist()):
        seqlen_k = cached + seqlen_new
        k_b = gather_sequence(k_after, rows[b], seqlen_k)
        v_b = gather_sequence(v_after, rows[b], seqlen_k)
        out_b, lse_b = attention_ref(
            q[b:b + 1], k_b.unsqueeze(0), v_b.unsqueeze(0), causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        )
        outs.append(out_b)
        lses.append(lse_b)
    if not outs:  # batch 0
        batch, seqlen_q, nheads, _ = q.shape
        return (q.new_zeros(q.shape, dtype=torch.float32),
                q.new_zeros((batch, nheads, seqlen_q), dtype=torch.float32), k_after, v_after)
    return torch.cat(outs), torch.cat(lses), k_after, v_after


def append_to_cache(k_cache, v_cache, cache_seqlens, k_new, v_new, page_table=None):
    """Copies of (k_cache, v_cache) with k_new / v_new written at positions
    cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of each entry b (step 1 of
    kvcache_attention_ref, on its own for tests of the append)."""
    table = _page_table(k_cache, page_table)
    seqlen_new = _seqlen_new(k_new, v_new)
    page_size = k_cache.shape[1]
    check_kvcache_values(cache_seqlens, seqlen_new, table.shape[1] * page_size, table,
                         k_cache.shape[0])
    lengths, rows = cache_seqlens.tolist(), table.tolist()
    return _append(k_cache, rows, lengths, k_new), _append(v_cache, rows, lengths, v_new)


def append_in_place(k, v, k_cache, v_cache, cache_seqlens, page_table=None):
    """The append of kernels/kv_append.py in torch ops, on the device, with its clamping:
    k, v written in place at each entry's positions clamp(cache_seqlens[b], 0, capacity)
    + j, clamped to capacity - 1, page indices clamped into [0, num_pages); returns the
    new lengths, int32. The CPU tests' stand-in launchers append with it."""
    batch, seqlen_new = k.shape[0], k.shape[1]
    page_size = k_cache.shape[1]
    capacity = page_size if page_table is None else page_table.shape[1] * page_size
    start = cache_seqlens.long().clamp(0, capacity)
    positions = (start[:, None] + torch.arange(seqlen_new, device=k.device)).clamp_(max=capacity - 1)
    if page_table is None:
        index = (torch.arange(batch, device=k.device)[:, None].expand(batch, seqlen_new), positions)
    else:
        pages = page_table.long().gather(1, positions // page_size).clamp_(0, k_cache.shape[0] - 1)
        index = (pages, positions % page_size)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)
    return (start + seqlen_new).clamp_(max=capacity).to(torch.int32)


def gather_sequence(pages, page_row, seqlen):
    """The first seqlen logical positions of one entry, (seqlen, nheads_kv, headdim):
    pages (num_pages, page_size, nheads_kv, headdim), page_row the entry's page-table row
    (a list of page indices; only the first ceil(seqlen / page_size) are read)."""
    used = -(-seqlen // pages.shape[1]) if seqlen else 0  # page_size 0: an empty cache
    index = torch.tensor(page_row[:used], dtype=torch.long, device=pages.device)
    return pages[index].flatten(0, 1)[:seqlen]


def _page_table(cache, page_table):
    """The page table of a cache: a paged cache's own, or for a contiguous one (each
    entry's row one page) the identity [[0], [1], ...]."""
    if page_table is not None:
        return page_table
    return torch.arange(cache.shape[0], dtype=torch.int32, device=cache.device).unsqueeze(1)


def _seqlen_new(k_new, v_new):
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (both None, or both tensors)")
    if k_new is None:
        return 0
    if k_new.shape != v_new.shape:
        raise ValueError(f"v_new shape must equal k_new shape {tuple(k_new.shape)}, got {tuple(v_new.shape)}")
    return k_new.shape[1]


def _append(pages, rows, lengths, new):
    """A copy of pages with new[b] written at entry b's positions [lengths[b], + seqlen_new)."""
    pages = pages.clone()
    if new is None or new.shape[1] == 0:
        return pages
    page_size = pages.shape[1]
    for b, start in enumerate(lengths):
        positions = range(start, start + new.shape[1])
        page_index = torch.tensor([rows[b][p // page_size] for p in positions], dtype=torch.long,
                                  device=pages.device)
        row_index = torch.tensor([p % page_size for p in positions], dtype=torch.long,
                                 device=pages.device)
        pages[page_index, row_index] = new[b].to(pages.dtype)
    return pages
