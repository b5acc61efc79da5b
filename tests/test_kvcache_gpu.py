"""cute_attn.mha_with_kvcache on the GPU against the fp32 KV-cache reference
(cute_attn.kvcache_reference), per batch entry: cache lengths that differ (0 and full
included), the in-place append (the cache contents checked after the call), GQA groups,
1-16 queries with causal / window / softcap, forced and automatic split counts, and a
CUDA graph replayed with new lengths and tokens.

Tolerance: the forward rule of tests/gpu_checks.py (2 x the error of the same attention in
the input dtype, + a floor) with the torch computation done per entry on the gathered keys."""

import pytest
import torch

import cute_attn
from cute_attn import kvcache
from cute_attn.kvcache_reference import kvcache_attention_ref
from gpu_helpers import exact_fp32_matmul, forget_bound_launches, poison_allocator, validation_spy  # noqa: F401

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _inputs(batch, seqlen_q, capacity, heads, heads_kv, d, seqlen_new, lengths, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(BF16)

    q = rand(batch, seqlen_q, heads, d)
    k_cache, v_cache = rand(batch, capacity, heads_kv, d), rand(batch, capacity, heads_kv, d)
    k_new = rand(batch, seqlen_new, heads_kv, d) if seqlen_new else None
    v_new = rand(batch, seqlen_new, heads_kv, d) if seqlen_new else None
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, k_new, v_new, cache_seqlens


def _reference_low(q, k_after, v_after, lengths, seqlen_new, **kw):
    """The same attention in bf16 (attention_ref(upcast=False)) per entry: the yardstick."""
    outs = []
    for b, n in enumerate(lengths):
        keys = n + seqlen_new
        o, _ = cute_attn.reference.attention_ref(q[b:b + 1], k_after[b:b + 1, :keys], v_after[b:b + 1, :keys],
                                                 upcast=False, **kw)
        outs.append(o)
    return torch.cat(outs)


CASES = [
    # (batch, seqlen_q, capacity, heads, heads_kv, d, seqlen_new, lengths, kwargs)
    (4, 1, 3000, 32, 8, 128, 1, (0, 2999, 1234, 77), dict(causal=True)),
    (3, 4, 2048, 16, 16, 128, 4, (100, 0, 2044), dict(causal=True)),
    (2, 16, 4500, 64, 4, 128, 16, (4484, 1000), dict(causal=True, softcap=30.0)),
    (2, 8, 5000, 16, 1, 64, 0, (4999, 3333), dict(window_size=(511, 0))),
    (3, 2, 1500, 32, 8, 256, 2, (1, 700, 1498), dict()),
    (1, 1, 65536, 32, 8, 128, 1, (65000,), dict(causal=True)),
    (2, 1, 3000, 64, 8, 64, 1, (2999, 1500), dict(causal=True)),  # config.split_decode_config's tile
    # head dims whose 16-byte chunks per token (12, 24) do not divide 128 threads: the
    # append's CTAs take 120 (session 32: they failed an assert before)
    (2, 3, 2000, 16, 4, 96, 3, (0, 1995), dict(causal=True)),
    (2, 1, 2000, 16, 2, 192, 1, (1999, 640), dict(causal=True)),
]


def _assert_close_to_reference(out, lse, ref_out, ref_lse, low, kw):
    """out within twice the error of the same-precision torch computation (low) against
    the fp32 reference; lse's -inf rows exactly those of the reference, the rest close."""
    err = (out.float() - ref_out).abs().max().item()
    err_torch = (low.float() - ref_out).abs().max().item()
    assert err <= 2 * err_torch + 1e-5, (err, err_torch)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (lse[~empty] - ref_lse[~empty]).abs().max().item() <= 1e-3 + 2 * kw.get("softcap", 0.0) * 2 ** -11


@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}q{c[1]}cap{c[2]}h{c[3]}kv{c[4]}d{c[5]}new{c[6]}")
def test_matches_reference_and_appends(case, num_splits):
    batch, sq, cap, h, hkv, d, new, lengths, kw = case
    q, k_cache, v_cache, k_new, v_new, seqlens = _inputs(batch, sq, cap, h, hkv, d, new, lengths, seed=sum(lengths))
    ref_out, ref_lse, k_after, v_after = kvcache_attention_ref(q, k_cache, v_cache, seqlens, k_new, v_new, **kw)
    poison_allocator(q.numel() * 2, q.numel() // d * 4)
    out, lse = cute_attn.mha_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                          num_splits=num_splits, return_lse=True, **kw)
    # the append happened in place, and nothing else in the caches moved
    assert torch.equal(k_cache, k_after) and torch.equal(v_cache, v_after)
    assert out.shape == q.shape and not out.isnan().any() and not lse.isnan().any()
    low = _reference_low(q, k_after, v_after, lengths, new, **kw)
    _assert_close_to_reference(out, lse, ref_out, ref_lse, low, kw)


def test_empty_cache_and_no_new_tokens_give_zero_rows():
    q, k_cache, v_cache, _, _, seqlens = _inputs(2, 3, 256, 8, 8, 128, 0, (0, 0), seed=1)
    out, lse = cute_attn.mha_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_out_of_range_lengths_are_clamped_or_rejected():
    q, k_cache, v_cache, k_new, v_new, _ = _inputs(2, 1, 512, 8, 8, 128, 1, (0, 0), seed=2)
    bad = torch.tensor([512, 5], dtype=torch.int32, device="cuda")  # entry 0 is full
    with pytest.raises(ValueError, match="entry 0|batch entry 0|\\[0\\]"):
        cute_attn.mha_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=bad, check_inputs=True)
    k_before = k_cache.clone()
    out = cute_attn.mha_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=bad)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    # entry 0's token went to its last slot (clamped), entry 1's to position 5
    assert torch.equal(k_cache[0, 511], k_new[0, 0]) and torch.equal(k_cache[1, 5], k_new[1, 0])
    assert torch.equal(k_cache[0, :511], k_before[0, :511])


def _replays_like_eager(step, seqlens, inputs, k_cache, v_cache, between=lambda: None):
    """Capture step() in a CUDA graph; replay it twice with new lengths (101/5001, then
    7000/0), fresh random inputs and whatever between() changes, and compare each replay
    (its output and the caches it appended to) with an eager step() on the same state."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ((101, 5001), (7000, 0)):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        between()
        for t in inputs:
            t.copy_(torch.randn_like(t))
        k_snapshot, v_snapshot = k_cache.clone(), v_cache.clone()
        out.fill_(float("nan"))
        graph.replay()
        k_replayed, v_replayed, out_replayed = k_cache.clone(), v_cache.clone(), out.clone()
        k_cache.copy_(k_snapshot)
        v_cache.copy_(v_snapshot)
        expected = step()
        assert torch.equal(k_replayed, k_cache) and torch.equal(v_replayed, v_cache)
        assert torch.equal(out_replayed, expected)


def test_decode_step_in_a_cuda_graph():
    """Capture one decode step; replay it with new lengths and new tokens copied into the
    captured tensors: the result equals an eager call on the same state."""
    q, k_cache, v_cache, k_new, v_new, seqlens = _inputs(2, 1, 8192, 32, 8, 128, 1, (100, 5000), seed=3)

    def step():
        return cute_attn.mha_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True)

    _replays_like_eager(step, seqlens, (q, k_new, v_new), k_cache, v_cache)


# ----------------------------------------------------------------------------------------
# Paged caches: (num_pages, page_size, heads_kv, d) with a random page table
# ----------------------------------------------------------------------------------------

PAGE_SIZES = (16, 32, 64, 128, 256)
# forced and automatic split counts, spread over the page sizes
SPLITS_BY_PAGE_SIZE = {16: 0, 32: 1, 64: 3, 128: 0, 256: 5}
UNUSED_SLOT = 2**30  # page-table slots past an entry's pages: never looked up

PAGED_CASES = [
    # (batch, seqlen_q, capacity, heads, heads_kv, d, seqlen_new, lengths, kwargs)
    (4, 1, 4096, 32, 8, 128, 1, (0, 4095, 1234, 77), dict(causal=True)),
    (2, 16, 4096, 64, 4, 128, 16, (4080, 1000), dict(causal=True, softcap=30.0)),
    (2, 8, 4096, 16, 1, 64, 0, (4095, 3333), dict(window_size=(511, 0))),
    (3, 2, 1024, 32, 8, 256, 2, (1, 700, 1022), dict()),
    (2, 1, 4096, 64, 8, 64, 1, (4095, 1500), dict(causal=True)),
]


def _paged(k_cache, v_cache, lengths, seqlen_new, page_size, seed):
    """The contiguous caches cut into pages, scattered by a random permutation into a
    larger pool (more pages than the entries use; the spare pages hold random values too),
    with the first page of entry 0 also listed by entry 1 when both only read it (a shared
    prefix), and UNUSED_SLOT in the slots past each entry's pages."""
    batch, capacity, heads_kv, d = k_cache.shape
    max_pages = capacity // page_size
    num_pages = batch * max_pages + 5
    g = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.randperm(num_pages, device="cuda", generator=g)[:batch * max_pages].view(batch, max_pages)
    table = table.to(torch.int32)
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.randn(num_pages, page_size, heads_kv, d, device="cuda", generator=g).to(cache.dtype)
        pool[table.flatten().long()] = cache.reshape(batch * max_pages, page_size, heads_kv, d)
        pools.append(pool)
    if batch > 1 and min(lengths[0], lengths[1]) >= page_size:
        table[1, 0] = table[0, 0]
        for pool, cache in zip(pools, (k_cache, v_cache)):
            cache[1, :page_size] = pool[table[0, 0]]  # what entry 1 now reads
    for b, n in enumerate(lengths):
        table[b, -(-(n + seqlen_new) // page_size) or 1:] = UNUSED_SLOT
    return pools[0], pools[1], table


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: f"b{c[0]}q{c[1]}cap{c[2]}h{c[3]}kv{c[4]}d{c[5]}new{c[6]}")
def test_paged_matches_reference_and_appends(case, page_size):
    batch, sq, cap, h, hkv, d, new, lengths, kw = case
    seed = sum(lengths) + page_size
    q, k_cache, v_cache, k_new, v_new, seqlens = _inputs(batch, sq, cap, h, hkv, d, new, lengths, seed=seed)
    pages_k, pages_v, table = _paged(k_cache, v_cache, lengths, new, page_size, seed)
    ref_out, ref_lse, k_after, v_after = kvcache_attention_ref(q, pages_k, pages_v, seqlens, k_new, v_new,
                                                               page_table=table, **kw)
    # the same attention on the contiguous caches, in bf16: the yardstick
    _, _, k_flat, v_flat = kvcache_attention_ref(q, k_cache, v_cache, seqlens, k_new, v_new, **kw)
    low = _reference_low(q, k_flat, v_flat, lengths, new, **kw)
    poison_allocator(q.numel() * 2, q.numel() // d * 4)
    out, lse = cute_attn.mha_with_kvcache(q, pages_k, pages_v, k_new, v_new, cache_seqlens=seqlens,
                                          page_table=table, num_splits=SPLITS_BY_PAGE_SIZE[page_size],
                                          return_lse=True, **kw)
    assert torch.equal(pages_k, k_after) and torch.equal(pages_v, v_after)
    assert out.shape == q.shape and not out.isnan().any() and not lse.isnan().any()
    _assert_close_to_reference(out, lse, ref_out, ref_lse, low, kw)


def test_paged_bad_page_index_is_rejected_or_reads_nothing_outside():
    q, k_cache, v_cache, k_new, v_new, seqlens = _inputs(2, 1, 512, 8, 8, 128, 1, (300, 20), seed=4)
    pages_k, pages_v, table = _paged(k_cache, v_cache, (300, 20), 1, 16, seed=4)
    table[0, 3] = pages_k.shape[0] + 1000  # a page that does not exist, read by entry 0
    with pytest.raises(ValueError, match="entry 0|batch entry 0|\\[0"):
        cute_attn.mha_with_kvcache(q, pages_k, pages_v, k_new, v_new, cache_seqlens=seqlens, page_table=table,
                                   check_inputs=True)
    out = cute_attn.mha_with_kvcache(q, pages_k, pages_v, cache_seqlens=seqlens, page_table=table)
    torch.cuda.synchronize()  # an out-of-bounds read would fault here (the sanitizer run checks the rest)
    assert not out.isnan().any()


def test_paged_decode_step_in_a_cuda_graph():
    """A paged decode step captured once and replayed with new lengths, new tokens and a
    new page table (copied into the captured tensors)."""
    q, k_cache, v_cache, k_new, v_new, seqlens = _inputs(2, 1, 8192, 32, 8, 128, 1, (100, 5000), seed=5)
    pages_k, pages_v, table = _paged(k_cache, v_cache, (100, 5000), 1, 16, seed=5)
    table.copy_(torch.where(table == UNUSED_SLOT, 0, table))  # every slot usable by the replays

    def step():
        return cute_attn.mha_with_kvcache(q, pages_k, pages_v, k_new, v_new, cache_seqlens=seqlens,
                                          page_table=table, causal=True)

    _replays_like_eager(step, seqlens, (q, k_new, v_new), pages_k, pages_v,
                        between=lambda: table.copy_(table.flip(0)))


def test_fast_validation_agrees_with_the_detailed_checks(monkeypatch):
    """kvcache_checks._plainly_valid (the per-call fast path) accepts the common decode
    steps with the same KvcacheProblem as the detailed checks, and leaves every odd call
    to them."""
    from cute_attn import kvcache_checks as kc

    q, k_cache, v_cache, k_new, v_new, seqlens = _inputs(2, 1, 4096, 32, 8, 128, 1, (100, 4000), seed=6)
    pages_k, pages_v, table = _paged(k_cache, v_cache, (100, 4000), 1, 16, seed=6)
    calls = [
        dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, cache_seqlens=seqlens),
        dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, causal=True, softcap=5.0),
        dict(q=q, k_cache=pages_k, v_cache=pages_v, k=k_new, v=v_new, cache_seqlens=seqlens, page_table=table),
    ]
    fast = [kc.validate_kvcache_inputs(**c) for c in calls]
    for c in calls:
        assert kc._plainly_valid(c["q"], c["k_cache"], c["v_cache"], c.get("k"), c.get("v"), c["cache_seqlens"],
                                 c.get("page_table"), None)
    monkeypatch.setattr(kc, "_plainly_valid", lambda *args: False)
    assert fast == [kc.validate_kvcache_inputs(**c) for c in calls]
    monkeypatch.undo()
    odd = [
        (q, k_cache, v_cache, k_new, v_new, seqlens.long(), None),  # int64 lengths
        (q, k_cache, v_cache, k_new, None, seqlens, None),  # k without v
        (q, k_cache[:, :1].expand_as(k_cache), v_cache, None, None, seqlens, None),  # an expanded cache
        (q, k_cache.float(), v_cache, None, None, seqlens, None),  # dtype mismatch
        (q, pages_k, pages_v, None, None, seqlens, table.long()),  # int64 page table
        (q, pages_k, pages_v, None, None, seqlens, None),  # pages without a table
        (q, k_cache, v_cache, k_new[:, :, :4], v_new[:, :, :4], seqlens, None),  # new tokens' heads
        (q.cpu(), k_cache, v_cache, None, None, seqlens, None),  # q on the host
    ]
    for args in odd:
        assert not kc._plainly_valid(*args, None)


def _append_destinations(lengths, seqlen_new, capacity, table, page_size, num_pages):
    """(page or entry, row) of each new token (b, j) by the append's clamping rule
    (kernels/kv_append.py), computed independently on the host."""
    dest = {}
    for b, n in enumerate(lengths):
        for j in range(seqlen_new):
            pos = min(min(max(n, 0), capacity) + j, capacity - 1)
            if table is None:
                dest[b, j] = (b, pos)
            else:
                dest[b, j] = (min(max(table[b][pos // page_size], 0), num_pages - 1), pos % page_size)
    return dest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, seqlen_new, page_size", [(128, 1, 0), (64, 5, 0), (256, 3, 0), (128, 1, 16),
                                                      (128, 7, 64), (64, 2, 256), (96, 11, 0), (192, 6, 16)])
def test_append_kernel_clamps_bad_values_into_the_cache(d, seqlen_new, page_size, dtype):
    """kernels/kv_append.py on lengths that are negative, 0, mid, near and past the
    capacity and (paged) page indices that are negative or past the pool: every token
    lands where the clamping rule puts it (each 16-byte chunk of a slot that several
    tokens clamp to holds that chunk of one of them), nothing else in the cache changes, and the new lengths are
    min(clamp(length, 0, capacity) + seqlen_new, capacity)."""
    from cute_attn import launcher

    g = torch.Generator(device="cuda").manual_seed(d + seqlen_new + page_size)
    batch, heads_kv, capacity = 6, 4, 512
    rand = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype)  # noqa: E731
    k, v = rand(batch, seqlen_new, heads_kv, d), rand(batch, seqlen_new, heads_kv, d)
    host_lengths = [-3, 0, 200, capacity - 1, capacity, capacity + 40]
    lengths = torch.tensor(host_lengths, dtype=torch.int32, device="cuda")
    table, num_pages = None, batch
    if page_size:
        num_pages = batch * capacity // page_size
        k_cache, v_cache = rand(num_pages, page_size, heads_kv, d), rand(num_pages, page_size, heads_kv, d)
        table = torch.randperm(num_pages, device="cuda", generator=g).to(torch.int32).view(batch, -1)
        table[1, 0], table[2, 200 // page_size] = -7, num_pages + 3  # out of range both ways
    else:
        k_cache, v_cache = rand(batch, capacity, heads_kv, d), rand(batch, capacity, heads_kv, d)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    new_lengths = launcher.run_append(k, v, k_cache, v_cache, lengths, table)
    expected = [min(min(max(n, 0), capacity) + seqlen_new, capacity) for n in host_lengths]
    assert new_lengths.tolist() == expected
    dest = _append_destinations(host_lengths, seqlen_new, capacity, None if table is None else table.tolist(),
                                page_size, num_pages)
    writers = {}
    for token, slot in dest.items():
        writers.setdefault(slot, []).append(token)
    for cache, before, new in ((k_cache, before_k, k), (v_cache, before_v, v)):
        untouched = torch.ones(cache.shape[:2], dtype=torch.bool, device="cuda")
        for (page, row), tokens in writers.items():
            untouched[page, row] = False
            # each 16-byte chunk from one of the tokens clamped here (threads copy chunks)
            chunks = cache[page, row].view(heads_kv, -1, 16 // cache.element_size())
            candidates = torch.stack([new[b, j].view(heads_kv, -1, 16 // cache.element_size()) for b, j in tokens])
            assert (candidates == chunks).all(-1).any(0).all(), (page, row, tokens)
        assert torch.equal(cache[untouched], before[untouched])


@pytest.mark.parametrize("page_size,num_splits,append", [(None, 0, True), (16, 0, True), (None, 3, False)],
                         ids=["contiguous-append", "paged16-append", "contiguous-3splits"])
def test_decode_steps_of_one_signature_take_the_fast_path(page_size, num_splits, append, monkeypatch):
    """Decode steps that repeat a signature skip the checks (kvcache._DecodeStep): after the
    first, four steps (new lengths, new tokens, a new page table) never reach validation,
    yet match the reference and append in place, with lse and (attend-only) without it; a
    q off TMA's 16-byte alignment, or a negative-bit view of a cache, does reach it and
    is refused."""
    batch, cap, h, hkv, d, kw = 3, 2048, 32, 8, 128, dict(causal=True, num_splits=num_splits)
    new = 1 if append else 0
    lengths = [5, 1500, 700]
    forget_bound_launches(monkeypatch)
    checks = None
    for step in range(5):
        q, k_cache, v_cache, k_new, v_new, seqlens = _inputs(batch, 1, cap, h, hkv, d, new, lengths, seed=40 + step)
        caches, table = (k_cache, v_cache), None
        if page_size:
            *caches, table = _paged(k_cache, v_cache, lengths, new, page_size, seed=40 + step)
        ref_kw = dict(causal=True)
        ref_out, ref_lse, k_after, v_after = kvcache_attention_ref(q, *caches, seqlens, k_new, v_new,
                                                                   page_table=table, **ref_kw)
        _, _, k_flat, v_flat = kvcache_attention_ref(q, k_cache, v_cache, seqlens, k_new, v_new, **ref_kw)
        low = _reference_low(q, k_flat, v_flat, lengths, new, **ref_kw)
        poison_allocator(q.numel() * 2, q.numel() // d * 4)
        out, lse = cute_attn.mha_with_kvcache(q, *caches, k_new, v_new, cache_seqlens=seqlens, page_table=table,
                                              return_lse=True, **kw)
        assert torch.equal(caches[0], k_after) and torch.equal(caches[1], v_after)
        _assert_close_to_reference(out, lse, ref_out, ref_lse, low, ref_kw)
        if not append:  # the same step again without lse: the launch's shared LSE sink
            assert torch.equal(cute_attn.mha_with_kvcache(q, *caches, cache_seqlens=seqlens, page_table=table, **kw),
                               out)
        if step == 0:  # the signature is bound from here on
            checks = validation_spy(monkeypatch, kvcache, "validate_kvcache_inputs")
        lengths = [n + 37 * (step + 1) for n in lengths]
    assert not checks, "a bound signature went through validation"
    buffer = torch.randn(q.numel() + 1, device="cuda").to(BF16)
    q_off = buffer[1:].view(q.shape)  # 2 bytes past an aligned address
    with pytest.raises(ValueError, match="aligned"):
        cute_attn.mha_with_kvcache(q_off, *caches, k_new, v_new, cache_seqlens=seqlens, page_table=table, **kw)
    with pytest.raises(ValueError, match="resolve_neg"):
        cute_attn.mha_with_kvcache(q, torch._neg_view(caches[0]), caches[1], k_new, v_new, cache_seqlens=seqlens,
                                   page_table=table, **kw)
    assert len(checks) == 2
