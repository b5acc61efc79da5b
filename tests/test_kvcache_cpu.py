"""KV-cache attention groundwork (issue 12) on the CPU: the reference
(cute_attn.kvcache_reference) against an independent float64 loop, the host checks of
the future mha_with_kvcache (cute_attn.kvcache_checks), and the split heuristic
(cute_attn.split_heuristic).

The naive implementation shares nothing with the reference: it reads each entry's keys
position by position (old ones through the page table from the cache as given, new ones
from k_new), and applies the mask with explicit index bounds. The caches it is compared on
are built so that the append never touches a slot another entry reads, which is what
check_kvcache_values demands; then "all writes, then all reads" (the reference) and
"old keys from the old cache" (the naive loop) must agree.
"""

import math
import re
import zlib

import pytest
import torch

from cpu_standin import fake_cuda as _fake_cuda
from cute_attn import kvcache_checks, split_heuristic, validation
from cute_attn.config import split_decode_config
from cute_attn.kvcache_checks import PAGE_SIZES, check_kvcache_values, validate_kvcache_inputs
from cute_attn.kvcache_reference import append_to_cache, kvcache_attention_ref
from cute_attn.split_heuristic import MIN_BLOCKS_PER_SHORT_SPLIT, MIN_BLOCKS_PER_SPLIT, SHORT_KEY_SPLITS, choose_num_splits

TOL = 1e-5  # fp32 reference vs float64 on O(1) values of these small shapes
HEAD_DIM = 8
NHEADS_KV = 2
BATCH = 3
PAGE_SIZE = 4  # the reference takes any page size; the checks take PAGE_SIZES
MAX_PAGES = 5
CAPACITY = PAGE_SIZE * MAX_PAGES
GARBAGE_PAGE = 10**6  # in page-table slots no entry uses: must never be read


# ----------------------------------------------------------------------------------------
# The naive implementation
# ----------------------------------------------------------------------------------------


def _slot(cache, page_table, b, p):
    """(index into dim 0, row) of logical position p of entry b."""
    if page_table is None:
        return b, p
    page_size = cache.shape[1]
    return int(page_table[b, p // page_size]), p % page_size


def _naive_keys(cache, page_table, b, cached, new):
    """Entry b's keys (or values) in logical order, float64: cached old ones, then new."""
    rows = []
    for p in range(cached):
        page, row = _slot(cache, page_table, b, p)
        rows.append(cache[page, row])
    if new is not None:
        rows.extend(new[b, t] for t in range(new.shape[1]))
    if not rows:
        return torch.zeros(0, *cache.shape[2:], dtype=torch.float64)
    return torch.stack(rows).double()


def _naive(q, k_cache, v_cache, cache_seqlens, k_new, v_new, page_table, *, causal=False,
           window_size=(-1, -1), softcap=0.0, softmax_scale=None):
    """(out, lse) one query row at a time in float64 over the keys the row sees."""
    batch, seqlen_q, nheads, d = q.shape
    group = nheads // k_cache.shape[2]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    out = torch.zeros(batch, seqlen_q, nheads, d, dtype=torch.float64)
    lse = torch.full((batch, nheads, seqlen_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        cached = int(cache_seqlens[b])
        keys = _naive_keys(k_cache, page_table, b, cached, k_new)
        values = _naive_keys(v_cache, page_table, b, cached, v_new)
        seqlen_k = keys.shape[0]
        for h in range(nheads):
            for i in range(seqlen_q):
                diagonal = i + seqlen_k - seqlen_q
                first = 0 if left < 0 else max(0, diagonal - left)
                last = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, diagonal + right)
                if last < first:
                    continue
                s = scale * (keys[first:last + 1, h // group] @ q[b, i, h].double())
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                m = s.max()
                w = torch.exp(s - m)
                out[b, i, h] = (w @ values[first:last + 1, h // group]) / w.sum()
                lse[b, h, i] = m + torch.log(w.sum())
    return out, lse


def _naive_append(cache, page_table, cache_seqlens, new):
    """The cache after the append, slot by slot."""
    after = cache.clone()
    if new is None:
        return after
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            page, row = _slot(cache, page_table, b, int(cache_seqlens[b]) + t)
            after[page, row] = new[b, t]
    return after


# ----------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------


def _cache_seqlens(gen, seqlen_new):
    """One entry full (cache_seqlens + seqlen_new = capacity), one empty, one in between
    holding at least a page (so that a paged case can share it), in random order."""
    full = CAPACITY - seqlen_new
    middle = int(torch.randint(min(PAGE_SIZE, full), full + 1, (1,), generator=gen))
    lengths = torch.tensor([full, 0, middle], dtype=torch.int32)
    return lengths[torch.randperm(BATCH, generator=gen)]


def _page_table(gen, cache_seqlens, seqlen_new):
    """Random distinct pages per entry from a permutation of more pages than needed; then
    the fully cached pages (never appended to) of the longest entry shared with the other
    entries as a common prefix; unused slots hold an index past the end."""
    num_pages = BATCH * MAX_PAGES + 3
    table = torch.randperm(num_pages, generator=gen)[:BATCH * MAX_PAGES].view(BATCH, MAX_PAGES)
    table = table.to(torch.int32)
    read_only = [int(n) // PAGE_SIZE for n in cache_seqlens]  # pages wholly before the append
    donor = max(range(BATCH), key=lambda b: read_only[b])
    for b in range(BATCH):
        shared = min(read_only[b], read_only[donor])
        table[b, :shared] = table[donor, :shared]
        used = -(-(int(cache_seqlens[b]) + seqlen_new) // PAGE_SIZE)
        table[b, used:] = GARBAGE_PAGE
    return table, num_pages


def _case(seed, *, paged, group, seqlen_q, seqlen_new):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cache_seqlens = _cache_seqlens(gen, seqlen_new)
    if paged:
        page_table, num_pages = _page_table(gen, cache_seqlens, seqlen_new)
        cache_shape = (num_pages, PAGE_SIZE, NHEADS_KV, HEAD_DIM)
    else:
        page_table, cache_shape = None, (BATCH, CAPACITY, NHEADS_KV, HEAD_DIM)
    q = torch.randn(BATCH, seqlen_q, NHEADS_KV * group, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    k_new = v_new = None
    if seqlen_new:
        k_new = torch.randn(BATCH, seqlen_new, NHEADS_KV, HEAD_DIM)
        v_new = torch.randn(BATCH, seqlen_new, NHEADS_KV, HEAD_DIM)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                k_new=k_new, v_new=v_new, page_table=page_table)


def _run_both(case, **masks):
    c = case
    ref = kvcache_attention_ref(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"],
                                c["k_new"], c["v_new"], page_table=c["page_table"], **masks)
    naive = _naive(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k_new"],
                   c["v_new"], c["page_table"], **masks)
    return ref, naive


MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window-2-0": dict(window_size=(2, 0)),
    "window-1-1": dict(window_size=(1, 1)),
    "window-3-unbounded": dict(window_size=(3, -1)),
    "softcap": dict(softcap=1.5, softmax_scale=0.7),
    "causal-softcap": dict(causal=True, softcap=0.8),
}


# ----------------------------------------------------------------------------------------
# The reference
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("seqlen_q", [1, 2, 5])
@pytest.mark.parametrize("seqlen_new", [0, 1, 3])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_reference_matches_naive(paged, group, seqlen_new, seqlen_q, mask):
    seed = zlib.crc32(repr((paged, group, seqlen_new, seqlen_q, mask)).encode())  # fixed per case
    case = _case(seed, paged=paged, group=group, seqlen_q=seqlen_q, seqlen_new=seqlen_new)
    (out, lse, _, _), (out_naive, lse_naive) = _run_both(case, **MASKS[mask])
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == case["q"].shape
    assert lse.shape == (BATCH, case["q"].shape[2], case["q"].shape[1])
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), out_naive, atol=TOL, rtol=TOL)
    # -inf where the naive loop saw no key, the same finite values elsewhere
    assert torch.equal(lse.isinf(), lse_naive.isinf())
    torch.testing.assert_close(lse.double(), lse_naive, atol=TOL, rtol=TOL)


def test_paged_cases_share_pages_and_leave_garbage_unread():
    """The paged cases are what the docstring of _page_table says: some page is listed by
    two entries, and unused slots hold an index no page has."""
    case = _case(3, paged=True, group=1, seqlen_q=2, seqlen_new=1)
    table = case["page_table"]
    used = table[table != GARBAGE_PAGE]
    assert used.unique().numel() < used.numel()  # a page shared between entries
    assert (table == GARBAGE_PAGE).any()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_rows_that_see_no_key_get_zero_and_minus_inf(paged):
    """Causal with more queries than keys: entry with cache_seqlens 0 and 2 new keys sees
    keys only from its query 3 of 5 on (j <= i + 2 - 5)."""
    case = _case(7, paged=paged, group=4, seqlen_q=5, seqlen_new=2)
    (out, lse, _, _), _ = _run_both(case, causal=True)
    empty = int((case["cache_seqlens"] == 0).nonzero()[0])
    assert torch.equal(out[empty, :3], torch.zeros_like(out[empty, :3]))
    assert torch.all(lse[empty, :, :3] == -math.inf)
    assert torch.all(torch.isfinite(lse[empty, :, 3:]))


def test_no_keys_at_all():
    """cache_seqlens 0 and nothing appended: every row sees no key."""
    case = _case(11, paged=False, group=1, seqlen_q=3, seqlen_new=0)
    case["cache_seqlens"] = torch.zeros(BATCH, dtype=torch.int32)
    (out, lse, _, _), _ = _run_both(case)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.all(lse == -math.inf)


@pytest.mark.parametrize("seqlen_new", [0, 1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_append_changes_only_the_new_positions(paged, seqlen_new):
    case = _case(5 + seqlen_new, paged=paged, group=1, seqlen_q=1, seqlen_new=seqlen_new)
    c = case
    before = (c["k_cache"].clone(), c["v_cache"].clone())
    _, _, k_after, v_after = kvcache_attention_ref(
        c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k_new"], c["v_new"],
        page_table=c["page_table"])
    # the inputs are left alone
    assert torch.equal(c["k_cache"], before[0]) and torch.equal(c["v_cache"], before[1])
    for cache, new, after in ((c["k_cache"], c["k_new"], k_after), (c["v_cache"], c["v_new"], v_after)):
        assert after.shape == cache.shape and after.dtype == cache.dtype
        assert torch.equal(after, _naive_append(cache, c["page_table"], c["cache_seqlens"], new))
        # exactly seqlen_new slots per entry differ from the cache (random data: no ties)
        changed = (after != cache).any(dim=(2, 3)).sum()
        assert int(changed) == BATCH * seqlen_new


def test_append_to_cache_alone_matches_the_full_step():
    c = _case(13, paged=True, group=1, seqlen_q=1, seqlen_new=2)
    k_after, v_after = append_to_cache(c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k_new"],
                                       c["v_new"], page_table=c["page_table"])
    _, _, k_full, v_full = kvcache_attention_ref(
        c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k_new"], c["v_new"],
        page_table=c["page_table"])
    assert torch.equal(k_after, k_full) and torch.equal(v_after, v_full)


def test_paged_and_contiguous_layouts_of_one_cache_agree():
    """A contiguous cache cut into pages and scattered by a page table holds the same
    logical keys: the same result, and the same cache after the append."""
    case = _case(17, paged=False, group=4, seqlen_q=2, seqlen_new=2)
    c = case
    gen = torch.Generator().manual_seed(17)
    order = torch.randperm(BATCH * MAX_PAGES, generator=gen)
    table = order.view(BATCH, MAX_PAGES).to(torch.int32)

    def scatter(cache):
        pages = torch.empty(BATCH * MAX_PAGES, PAGE_SIZE, NHEADS_KV, HEAD_DIM)
        pages[order] = cache.reshape(BATCH * MAX_PAGES, PAGE_SIZE, NHEADS_KV, HEAD_DIM)
        return pages

    contiguous = kvcache_attention_ref(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"],
                                       c["k_new"], c["v_new"], causal=True)
    paged = kvcache_attention_ref(c["q"], scatter(c["k_cache"]), scatter(c["v_cache"]),
                                  c["cache_seqlens"], c["k_new"], c["v_new"], page_table=table,
                                  causal=True)
    torch.testing.assert_close(paged[0], contiguous[0], atol=0, rtol=0)
    torch.testing.assert_close(paged[1], contiguous[1], atol=0, rtol=0)
    assert torch.equal(paged[2], scatter(contiguous[2]))
    assert torch.equal(paged[3], scatter(contiguous[3]))


def test_reference_rejects_an_append_past_the_capacity():
    c = _case(19, paged=False, group=1, seqlen_q=1, seqlen_new=2)
    c["cache_seqlens"] = torch.full((BATCH,), CAPACITY - 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] \+ seqlen_new must be <= the cache capacity"):
        kvcache_attention_ref(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k_new"], c["v_new"])


# ----------------------------------------------------------------------------------------
# validate_kvcache_inputs: one test per error (bf16 CPU tensors; the device checks come
# last, so a valid call reaches the "is on cpu" error)
# ----------------------------------------------------------------------------------------

CPU_ERROR = r"q is on cpu; cute_attn needs CUDA tensors on an sm_90 GPU"




def _call(paged=False, *, batch=2, seqlen_q=1, nheads=8, nheads_kv=2, d=64, seqlen_new=1,
          dtype=torch.bfloat16, page_size=16, max_pages=4):
    """Keyword arguments of a valid call (CPU tensors), to be broken one at a time."""
    torch.manual_seed(0)
    if paged:
        cache_shape = (batch * max_pages, page_size, nheads_kv, d)
        page_table = torch.arange(batch * max_pages, dtype=torch.int32).view(batch, max_pages)
    else:
        cache_shape, page_table = (batch, page_size * max_pages, nheads_kv, d), None
    kw = dict(q=torch.randn(batch, seqlen_q, nheads, d, dtype=dtype),
              k_cache=torch.randn(cache_shape, dtype=dtype),
              v_cache=torch.randn(cache_shape, dtype=dtype),
              k=torch.randn(batch, seqlen_new, nheads_kv, d, dtype=dtype),
              v=torch.randn(batch, seqlen_new, nheads_kv, d, dtype=dtype),
              cache_seqlens=torch.tensor([3, 0] + [1] * (batch - 2), dtype=torch.int32)[:batch],
              page_table=page_table)
    return kw


def _validate(kw, **changes):
    kw = {**kw, **changes}
    return validate_kvcache_inputs(kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"),
                                   kw.pop("k"), kw.pop("v"), **kw)


def _sm90(monkeypatch, kw):
    """kw with every tensor on a fake sm_90 cuda:0."""
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    return {name: _fake_cuda(t) if isinstance(t, torch.Tensor) else t for name, t in kw.items()}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_valid_call_reaches_the_device_check(paged):
    with pytest.raises(ValueError, match=CPU_ERROR):
        _validate(_call(paged))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_valid_call_on_sm90_passes(monkeypatch, paged):
    kw = _sm90(monkeypatch, _call(paged, seqlen_new=3))
    problem = _validate(kw, window_size=[4, 0], softcap=30, num_splits=0)
    capacity = 64
    assert problem == kvcache_checks.KvcacheProblem(
        batch=2, seqlen_q=1, nheads=8, nheads_kv=2, head_dim=64, seqlen_new=3,
        capacity=capacity, page_size=16 if paged else None, num_pages=8 if paged else None,
        causal=False, return_lse=False, window_size=(4, 0), softcap=30.0, num_splits=0)


def test_no_new_tokens_pass(monkeypatch):
    kw = _sm90(monkeypatch, _call(True))
    assert _validate(kw, k=None, v=None).seqlen_new == 0


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "k", "v"])
def test_not_a_tensor(name):
    with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor, got list"):
        _validate(_call(), **{name: [1.0]})


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "k", "v"])
def test_wrong_rank(name):
    kw = _call()
    with pytest.raises(ValueError, match=rf"^{name} must have shape \(.*\), got shape \(.*\) \(3 dims\)"):
        _validate(kw, **{name: kw[name][0]})


def test_paged_cache_rank_names_the_paged_shape():
    kw = _call(True)
    with pytest.raises(ValueError, match=r"^k_cache must have shape \(num_pages, page_size, nheads_kv, headdim\) with a page_table"):
        _validate(kw, k_cache=kw["k_cache"][0])


@pytest.mark.parametrize("name", ["k", "v"])
def test_new_tokens_come_in_pairs(name):
    other = "v" if name == "k" else "k"
    with pytest.raises(TypeError, match=rf"^{name} must be given with {other} .* got {name}=None"):
        _validate(_call(), **{name: None})


def test_q_dtype():
    kw = _call(dtype=torch.float32)
    with pytest.raises(TypeError, match=r"^q must be torch.float16 or torch.bfloat16, got torch.float32; cast"):
        _validate(kw)


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "k", "v"])
def test_dtype_must_match_q(name):
    kw = _call()
    with pytest.raises(TypeError, match=rf"^{name} must have the same dtype as q \(torch.bfloat16\), got torch.float16"):
        _validate(kw, **{name: kw[name].half()})


def test_unsupported_head_dim():
    with pytest.raises(ValueError, match=r"^q headdim must be one of \(.*\), got 80"):
        _validate(_call(d=80))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cache_head_dim_must_match_q(paged):
    kw = _call(paged)
    other = _call(paged, d=128)
    with pytest.raises(ValueError, match=r"^k_cache headdim must equal q headdim \(64\), got 128"):
        _validate(kw, k_cache=other["k_cache"], v_cache=other["v_cache"])


def test_contiguous_cache_batch_must_match_q():
    kw = _call(batch=2)
    other = _call(batch=3)
    with pytest.raises(ValueError, match=r"^k_cache batch must equal q batch \(2\), got 3"):
        _validate(kw, k_cache=other["k_cache"], v_cache=other["v_cache"])


def test_v_cache_shape_must_match_k_cache():
    kw = _call()
    with pytest.raises(ValueError, match=r"^v_cache shape must equal k_cache shape \(\(2, 64, 2, 64\)\), got \(2, 63, 2, 64\)"):
        _validate(kw, v_cache=kw["v_cache"][:, :63])


def test_cache_heads_must_divide_q_heads():
    kw = _call(nheads=8, nheads_kv=3)
    with pytest.raises(ValueError, match=r"^k_cache nheads must divide q nheads \(8\): .* got 3"):
        _validate(kw)


@pytest.mark.parametrize("axis, label, ref", [(0, "batch", "q"), (2, "nheads", "k_cache"), (3, "headdim", "q")])
def test_new_keys_shape(axis, label, ref):
    kw = _call()
    shape = list(kw["k"].shape)
    shape[axis] += 1 if axis != 3 else 64
    bad = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"^k {label} must equal {ref} {label}"):
        _validate(kw, k=bad, v=bad)


def test_new_values_shape_must_match_new_keys():
    kw = _call(seqlen_new=2)
    with pytest.raises(ValueError, match=r"^v shape must equal k shape \(\(2, 2, 2, 64\)\), got \(2, 1, 2, 64\)"):
        _validate(kw, v=kw["v"][:, :1])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_more_new_tokens_than_the_capacity(paged):
    kw = _call(paged, seqlen_new=65)
    with pytest.raises(ValueError, match=r"^k seqlen_new must be <= the cache capacity \(64 keys per entry: .*\), got 65"):
        _validate(kw)


@pytest.mark.parametrize("page_size", [8, 48, 512])
def test_page_size_must_be_supported(page_size):
    sizes = re.escape(str(PAGE_SIZES))
    with pytest.raises(ValueError, match=rf"^k_cache page_size \(dim 1 of a paged cache\) must be one of {sizes}, got {page_size}"):
        _validate(_call(True, page_size=page_size, max_pages=2))


def test_page_table_not_a_tensor():
    with pytest.raises(TypeError, match=r"^page_table must be a torch.Tensor, got list"):
        _validate(_call(True), page_table=[[0, 1, 2, 3], [4, 5, 6, 7]])


def test_page_table_dtype():
    kw = _call(True)
    with pytest.raises(TypeError, match=r"^page_table must be torch.int32, got torch.int64; cast"):
        _validate(kw, page_table=kw["page_table"].long())


def test_page_table_rank():
    kw = _call(True)
    with pytest.raises(ValueError, match=r"^page_table must have shape \(batch, max_pages\), got shape \(8,\)"):
        _validate(kw, page_table=kw["page_table"].flatten())


def test_page_table_batch():
    kw = _call(True)
    with pytest.raises(ValueError, match=r"^page_table batch must equal q batch \(2\), got 1"):
        _validate(kw, page_table=kw["page_table"][:1])


def test_page_table_last_dim_contiguous():
    kw = _call(True)
    strided = kw["page_table"].t().contiguous().t()
    with pytest.raises(ValueError, match=r"^page_table must be contiguous in the last dimension"):
        _validate(kw, page_table=strided)


def test_page_table_device(monkeypatch):
    kw = _sm90(monkeypatch, _call(True))
    with pytest.raises(ValueError, match=r"^page_table is on cpu but q is on cuda:0; page_table must be on q's device"):
        _validate(kw, page_table=kw["page_table"].as_subclass(torch.Tensor))


def test_cache_seqlens_not_a_tensor():
    with pytest.raises(TypeError, match=r"^cache_seqlens must be a torch.Tensor, got int"):
        _validate(_call(), cache_seqlens=3)


def test_cache_seqlens_dtype():
    kw = _call()
    with pytest.raises(TypeError, match=r"^cache_seqlens must be torch.int32, got torch.int64; cast"):
        _validate(kw, cache_seqlens=kw["cache_seqlens"].long())


def test_cache_seqlens_shape():
    with pytest.raises(ValueError, match=r"^cache_seqlens must have shape \(batch,\) = \(2,\), .* got shape \(3,\)"):
        _validate(_call(), cache_seqlens=torch.zeros(3, dtype=torch.int32))


def test_cache_seqlens_device(monkeypatch):
    kw = _sm90(monkeypatch, _call())
    with pytest.raises(ValueError, match=r"^cache_seqlens is on cpu but q is on cuda:0; cache_seqlens must be on q's device"):
        _validate(kw, cache_seqlens=kw["cache_seqlens"].as_subclass(torch.Tensor))


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_cache_last_dim_contiguous(name):
    kw = _call()
    t = kw[name]
    bad = torch.cat([t, t], dim=-1)[..., ::2]
    with pytest.raises(ValueError, match=rf"^{name} must be contiguous in the last dimension"):
        _validate(kw, **{name: bad})


def test_cache_strides_tma_aligned():
    kw = _call(True)
    pages, rows, heads, d = kw["k_cache"].shape
    buf = torch.zeros(pages * rows * heads * (d + 1), dtype=torch.bfloat16)
    bad = buf.as_strided((pages, rows, heads, d), (rows * heads * (d + 1), heads * (d + 1), d + 1, 1))
    with pytest.raises(ValueError, match=r"^k_cache strides must be multiples of 8 elements"):
        _validate(kw, k_cache=bad)


@pytest.mark.parametrize("value, exc, msg", [
    (-1, ValueError, r"^num_splits must be in \[0, 128\] \(0: chosen by the heuristic; .*\), got -1"),
    (129, ValueError, r"^num_splits must be in \[0, 128\] .* got 129"),
    (1.5, TypeError, r"^num_splits must be an int .* got float 1.5"),
    (True, TypeError, r"^num_splits must be an int .* got bool True"),
    (None, TypeError, r"^num_splits must be an int .* got NoneType None"),
])
def test_num_splits(value, exc, msg):
    with pytest.raises(exc, match=msg):
        _validate(_call(), num_splits=value)


@pytest.mark.parametrize("name", ["causal", "return_lse", "check_inputs"])
def test_flags_must_be_bools(name):
    with pytest.raises(TypeError, match=rf"^{name} must be a bool \(True or False\), got int 1"):
        _validate(_call(), **{name: 1})


def test_window_size_checked():
    with pytest.raises(ValueError, match=r"^window_size left must be >= -1"):
        _validate(_call(), window_size=(-2, 0))


def test_softcap_checked():
    with pytest.raises(ValueError, match=r"^softcap must be 0 \(off\) or a finite positive number, got -1.0"):
        _validate(_call(), softcap=-1.0)


def test_softmax_scale_checked():
    with pytest.raises(ValueError, match=r"^softmax_scale must be a finite positive number"):
        _validate(_call(), softmax_scale=0.0)


def test_devices_must_match():
    kw = _call()
    kw = {n: _fake_cuda(t, 1 if n == "v_cache" else 0) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    with pytest.raises(ValueError, match=r"^v_cache is on cuda:1 but q is on cuda:0"):
        _validate(kw)


def test_wrong_compute_capability(monkeypatch):
    kw = _sm90(monkeypatch, _call())
    monkeypatch.setattr(validation, "_device_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability sm_80; cute_attn needs an sm_90"):
        _validate(kw)


def test_check_inputs_reads_the_values(monkeypatch):
    kw = _sm90(monkeypatch, _call(True, seqlen_new=2))
    _validate(kw, check_inputs=True)  # cache_seqlens [3, 0] + 2 fit 64 keys
    full = _fake_cuda(torch.tensor([63, 0], dtype=torch.int32))
    _validate(kw, cache_seqlens=full)  # not read without check_inputs
    with pytest.raises(ValueError, match=r"^cache_seqlens\[0\] \+ seqlen_new must be <= the cache capacity \(64\), got 63 \+ 2 = 65"):
        _validate(kw, cache_seqlens=full, check_inputs=True)


def test_check_inputs_refused_under_graph_capture(monkeypatch):
    kw = _sm90(monkeypatch, _call())
    monkeypatch.setattr(kvcache_checks, "_capturing_cuda_graph", lambda: True)
    with pytest.raises(ValueError, match=r"^check_inputs=True reads cache_seqlens and page_table on the host"):
        _validate(kw, check_inputs=True)


# ----------------------------------------------------------------------------------------
# check_kvcache_values
# ----------------------------------------------------------------------------------------


def _lengths(*values):
    return torch.tensor(values, dtype=torch.int32)


def test_values_accepted():
    table = torch.tensor([[0, 1, -5], [2, 99, 99]], dtype=torch.int32)  # unused slots: anything
    check_kvcache_values(_lengths(20, 10), 1, 48, table, num_pages=3)
    check_kvcache_values(_lengths(0, 47), 1, 48)  # contiguous: 0 and full


def test_negative_cache_seqlens():
    with pytest.raises(ValueError, match=r"^cache_seqlens\[1\] must be >= 0 \(the keys batch entry 1 holds\), got -2"):
        check_kvcache_values(_lengths(0, -2), 1, 48)


def test_append_past_the_capacity_names_the_entry():
    with pytest.raises(ValueError, match=r"^cache_seqlens\[2\] \+ seqlen_new must be <= the cache capacity \(48\), got 46 \+ 3 = 49 for batch entry 2"):
        check_kvcache_values(_lengths(0, 45, 46), 3, 48)


@pytest.mark.parametrize("bad", [-1, 3])
def test_page_index_out_of_range(bad):
    table = torch.tensor([[0, 1, 99], [2, bad, 99]], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"^page_table\[1, 1\] must be a page index in \[0, num_pages = 3\), got {bad} \(batch entry 1 uses page_table\[1, :2\]\)"):
        check_kvcache_values(_lengths(20, 16), 1, 48, table, num_pages=3)


def test_page_table_needs_num_pages():
    with pytest.raises(TypeError, match=r"^num_pages must be given with page_table"):
        check_kvcache_values(_lengths(0), 1, 16, torch.zeros(1, 1, dtype=torch.int32))


def test_shared_read_only_prefix_accepted():
    """Entries 0 and 1 share page 0 (16 keys each fully cached), then append elsewhere."""
    table = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
    check_kvcache_values(_lengths(16, 20), 2, 32, table, num_pages=3)


@pytest.mark.parametrize("lengths, table, msg", [
    # both entries append into page 1
    ((18, 20), [[0, 1], [2, 1]], r"page_table\[0, 1\] = 1 is appended to by batch entry 0 and also used by batch entry 1 \(page_table\[1, 1\]\)"),
    # entry 0 appends at row 10 of page 0, which entry 1 reads (rows 0..15)
    ((10, 20), [[0, 1], [0, 2]], r"page_table\[0, 0\] = 0 is appended to by batch entry 0 and also used by batch entry 1 \(page_table\[1, 0\]\)"),
    # one entry listing the same page twice writes over what it reads
    ((18,), [[1, 1]], r"page_table\[0, 1\] = 1 is appended to by batch entry 0 and also used by batch entry 0 \(page_table\[0, 0\]\)"),
])
def test_append_into_a_page_another_use_reads(lengths, table, msg):
    with pytest.raises(ValueError, match="^" + msg):
        check_kvcache_values(_lengths(*lengths), 1, 32, torch.tensor(table, dtype=torch.int32), num_pages=3)


# ----------------------------------------------------------------------------------------
# choose_num_splits
# ----------------------------------------------------------------------------------------


def test_full_grid_is_not_split():
    # 106 tiles >= 0.8 x 132: no split however long the keys
    assert choose_num_splits(batch=106, nheads_kv=1, seqlen_q_tiles=1, kv_blocks=1024) == 1
    assert choose_num_splits(batch=4, nheads_kv=8, seqlen_q_tiles=4, kv_blocks=1024) == 1


def test_long_decode_fills_half_the_sms():
    """batch 1, 8 KV heads, one query (GQA packed into one tile), 128K keys: 8 tiles,
    memory-bound, so 8 splits = 64 CTAs, half of 132 SMs (measured faster than 16 on an
    H100: split_heuristic's docstring). Several query tiles per head (compute-bound) fill
    one whole wave, up to the cap."""
    assert choose_num_splits(batch=1, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=1024) == 8
    # 66 splits of 1024 blocks are 16 blocks each, as 64 splits are: the fewer
    assert choose_num_splits(batch=1, nheads_kv=1, seqlen_q_tiles=1, kv_blocks=1024) == 64
    assert choose_num_splits(batch=1, nheads_kv=1, seqlen_q_tiles=2, kv_blocks=1024) == 64  # 132 // 2 tiles
    assert choose_num_splits(batch=1, nheads_kv=1, seqlen_q_tiles=1, kv_blocks=1024, num_sms=400) == split_heuristic.MAX_SPLITS


def test_h200_decode_fills_every_sm():
    """At 4.8 TB/s (an H200) half the SMs cannot draw the bandwidth (split_heuristic,
    step 2b): batch 1 x 8 KV heads takes 16 splits (128 CTAs), batch 8 (64 tiles) 2, batch
    4 4 (the measured best of 1, 2 and 4), and 128 tiles (0.97 of the SMs) none."""
    h200 = dict(num_sms=132, hbm_gbs=4800.0)
    assert split_heuristic.memory_bound_ctas(132, 4800.0) == 132
    assert split_heuristic.memory_bound_ctas(132, 3350.0) == 66
    assert choose_num_splits(batch=1, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=1024, **h200) == 16
    assert choose_num_splits(batch=8, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=256, **h200) == 2
    assert choose_num_splits(batch=4, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=256, **h200) == 4
    assert choose_num_splits(batch=16, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=256, **h200) == 1
    # the H100 default keeps batch 8 unsplit (measured: 2 splits lost 4%)
    assert choose_num_splits(batch=8, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=256) == 1


def test_h100_decode_fills_every_sm_where_splits_stay_long():
    """split_heuristic step 2c: on an H100 a decode that half the SMs already split takes
    every SM where each split still reads >= 1 MB of K and V (kv_block_bytes per KV
    block), else half; the launcher asks it at head dim <= 64 only (choose_splits)."""
    hd128, hd64 = 2 * 128 * 128 * 2, 2 * 128 * 64 * 2  # K and V bytes of a 128-key block
    one = dict(batch=1, nheads_kv=8, seqlen_q_tiles=1)
    assert choose_num_splits(**one, kv_blocks=256, kv_block_bytes=hd128) == 16  # 32K: 1 MB per split
    assert choose_num_splits(**one, kv_blocks=1024, kv_block_bytes=hd128) == 16  # 128K
    assert choose_num_splits(**one, kv_blocks=64, kv_block_bytes=hd128) == 8  # 8K: 256 KB per split
    assert choose_num_splits(**one, kv_blocks=256, kv_block_bytes=hd64) == 8  # 32K at hd 64: 0.5 MB
    assert choose_num_splits(**one, kv_blocks=1024, kv_block_bytes=hd64) == 16  # 128K at hd 64: 2 MB
    assert choose_num_splits(batch=4, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=256, kv_block_bytes=hd64) == 4
    assert choose_num_splits(batch=4, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=256) == 2  # bytes unknown: half
    # a full grid stays unsplit, and an H200 already takes every SM
    assert choose_num_splits(batch=8, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=256, kv_block_bytes=hd128) == 1
    assert choose_num_splits(**one, kv_blocks=64, kv_block_bytes=hd128, hbm_gbs=4800.0) == 16
    # 34-59 tiles, which half the SMs leave unsplit, stay unsplit (unmeasured there)
    for batch in (5, 6, 7):
        assert choose_num_splits(batch=batch, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=256, kv_block_bytes=hd64) == 1


def test_choose_splits_takes_every_sm_at_head_dim_64_only():
    """launcher.choose_splits passes the KV block's bytes at head dim <= 64 (step 2c
    measured level or worse at 128): batch 1 x 128K keys, 8 KV heads."""
    from cute_attn import api, launcher

    for d, want in ((64, 16), (128, 8)):
        q = torch.empty(1, 1, 64, d, dtype=torch.bfloat16)
        k = torch.empty(1, 131072, 8, d, dtype=torch.bfloat16)
        features, args = api._features_and_args(True, (-1, -1), 0.0, d ** -0.5)
        assert launcher._plan(q, k, features, args, None, None).num_splits == want

def test_split_decode_tiles():
    """config.split_decode_config: few packed rows at head dim <= 64 take 64 rows and four
    stages of 128 keys (page size kept), merged in a cluster or not; head dim 128 takes 64
    rows and three stages only where the splits merge in a cluster and one warpgroup
    merges the rows (<= 4); more rows, 64-key windows and other head dims keep theirs."""
    from cute_attn.config import FwdConfig

    default = FwdConfig(tile_m=192, tile_n=128, num_stages=2, pack_gqa=8, page_size=16)
    for in_cluster in (False, True):
        tile = split_decode_config(default, 64, 8, in_cluster)
        assert (tile.tile_m, tile.tile_n, tile.num_stages, tile.pack_gqa, tile.page_size) == (64, 128, 4, 8, 16)
        assert split_decode_config(default, 64, 65, in_cluster) is default
    local = FwdConfig(tile_m=192, tile_n=64, num_stages=2, pack_gqa=8)
    assert split_decode_config(local, 64, 8, True) is local
    hd128 = FwdConfig(tile_m=128, tile_n=128, num_stages=2, pack_gqa=4)
    tile = split_decode_config(hd128, 128, 4, True)
    assert (tile.tile_m, tile.tile_n, tile.num_stages, tile.pack_gqa) == (64, 128, 3, 4)
    assert split_decode_config(hd128, 128, 4, False) is hd128
    assert split_decode_config(hd128, 128, 8, True) is hd128
    assert split_decode_config(hd128, 256, 4, True) is hd128


def test_cluster_merge_holds_at_most_half_the_sms():
    """split_heuristic.CLUSTER_MERGE_MAX_CTAS: 8 tiles x 8 splits merge in clusters, 16
    tiles x 8 do not (measured: clusters of 8 past 64 CTAs no longer all fit at once)."""
    block = 2 * 128 * 64 * 2
    assert split_heuristic.merge_in_cluster(8, 64, block, 8, tiles=8)
    assert not split_heuristic.merge_in_cluster(8, 64, block, 8, tiles=16)
    assert split_heuristic.merge_in_cluster(4, 64, block, 8, tiles=16)


def test_short_keys_are_not_split():
    assert choose_num_splits(batch=1, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=MIN_BLOCKS_PER_SPLIT * 2 - 1) == 1


def test_short_keys_take_up_to_eight_short_splits():
    """2K keys (16 blocks) at batch 1 x 8 KV heads: 8 splits of 2 blocks, not 4 of 4; 4K
    keys keep 8 splits of 4 (16 of 2 measured slower), 8K 16 of 4 (split_heuristic)."""
    h200 = dict(num_sms=132, hbm_gbs=4800.0)
    assert choose_num_splits(batch=1, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=16, **h200) == 8
    assert choose_num_splits(batch=1, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=32, **h200) == 8
    assert choose_num_splits(batch=1, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=64, **h200) == 16
    # below 16 blocks (not measured) the 4-block rule stands
    assert choose_num_splits(batch=1, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=8, **h200) == 2
    assert choose_num_splits(batch=1, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=0) == 1
    assert choose_num_splits(batch=0, nheads_kv=8, seqlen_q_tiles=1, kv_blocks=64) == 1


def test_cap_and_sm_count_are_parameters():
    assert choose_num_splits(1, 1, 1, 1024, max_splits=8) == 8
    assert choose_num_splits(1, 8, 1, 1024, num_sms=64) == 4


def _grid():
    for tiles in (1, 2, 3, 5, 8, 13, 33, 66, 105, 106, 200):
        for kv_blocks in range(0, 300, 7):
            yield tiles, kv_blocks, choose_num_splits(tiles, 1, 1, kv_blocks)


def test_split_invariants():
    """Over a grid of shapes: never more splits than KV blocks (or the cap), one wave at
    most, every split non-empty with at least MIN_BLOCKS_PER_SPLIT blocks (a tile of at
    least 16 blocks in up to SHORT_KEY_SPLITS splits: MIN_BLOCKS_PER_SHORT_SPLIT)."""
    for tiles, kv_blocks, splits in _grid():
        assert 1 <= splits <= max(kv_blocks, 1)
        assert splits <= split_heuristic.MAX_SPLITS
        if splits > 1:
            per_split = -(-kv_blocks // splits)  # the forward's slice (blocks/block_range.py)
            assert tiles * splits <= 132
            short = splits <= SHORT_KEY_SPLITS and kv_blocks >= MIN_BLOCKS_PER_SHORT_SPLIT * SHORT_KEY_SPLITS
            assert per_split >= (MIN_BLOCKS_PER_SHORT_SPLIT if short else MIN_BLOCKS_PER_SPLIT)
            assert (splits - 1) * per_split < kv_blocks, "an empty split"


def test_more_tiles_never_more_splits():
    for kv_blocks in (8, 64, 65, 257, 1024):
        counts = [choose_num_splits(batch, 4, 1, kv_blocks) for batch in range(1, 40)]
        assert counts == sorted(counts, reverse=True), (kv_blocks, counts)


def test_unsplit_packed_decode_takes_64_row_tiles():
    """A packed decode tile that runs unsplit, with rows for one warpgroup, takes 64-row
    tiles (config.unsplit_decode_config, measured at head dim 128); split, paged, wider
    and other-head-dim tiles keep the default's."""
    import dataclasses

    from cute_attn.config import AttnFeatures, fwd_config_for, unsplit_decode_config

    features = AttnFeatures(mask="causal", kv_lengths=True)
    base = fwd_config_for(128, features, pack_gqa=8)
    assert base.tile_m == 128
    decode = unsplit_decode_config(base, 128, 8)
    assert (decode.tile_m, decode.tile_n, decode.pack_gqa) == (64, 128, 8)
    assert unsplit_decode_config(base, 128, 64).tile_m == 64
    for config, head_dim, rows in ((base, 128, 65), (base, 64, 8), (dataclasses.replace(base, split_kv=True), 128, 8),
                                   (fwd_config_for(128, features, pack_gqa=8, page_size=16), 128, 8),
                                   (fwd_config_for(128, features), 128, 1)):
        assert unsplit_decode_config(config, head_dim, rows) is config


def test_unsplit_decode_kernel_compiles_spill_free():
    """The 64-row packed decode forward (one consumer warpgroup, KV lengths, causal)
    compiles for sm_90a without spills."""
    from cute_attn import ptx as ptx_tool
    from cute_attn.config import AttnFeatures, fwd_config_for, unsplit_decode_config

    features = AttnFeatures(mask="causal", kv_lengths=True)
    config = unsplit_decode_config(fwd_config_for(128, features, pack_gqa=8), 128, 8)
    art = ptx_tool.compile_fwd_artifacts("bf16", 128, features, config)
    assert "wgmma.mma_async" in art.ptx
    if "ptxas not found" not in art.ptxas_report:
        assert " 0 bytes spill stores" in art.ptxas_report, art.ptxas_report


def test_split_merge_in_a_cluster_where_splits_are_short():
    """split_heuristic.merge_in_cluster: 2..8 splits that each read at most 1 MiB merge in
    a thread-block cluster; longer splits, one split or more than 8 do not; and the
    cluster kernel (FwdConfig.cluster_splits) compiles spill-free with its distributed
    shared-memory loads and cluster barriers (sm_90a, CPU)."""
    import dataclasses

    from cute_attn import ptx as ptx_tool
    from cute_attn import split_heuristic
    from cute_attn.config import AttnFeatures, cluster_splits_fit, fwd_config_for, split_config

    block = 2 * 128 * 128 * 2  # a 128-key block of K and V at head dim 128, bf16
    assert split_heuristic.merge_in_cluster(8, 16, block, 8)  # 2K keys: 2 blocks per split
    assert split_heuristic.merge_in_cluster(8, 64, block, 8)  # 8K: 512 KB per split
    assert not split_heuristic.merge_in_cluster(8, 256, block, 8)  # 32K: 2 MB per split
    assert not split_heuristic.merge_in_cluster(1, 4, block, 8)
    assert not split_heuristic.merge_in_cluster(16, 16, block, 8)
    features = AttnFeatures(mask="causal", kv_lengths=True)
    config = dataclasses.replace(split_config(fwd_config_for(128, features, pack_gqa=4)), cluster_splits=True)
    assert cluster_splits_fit(config, 128)
    art = ptx_tool.compile_fwd_artifacts("bf16", 128, features, config)
    assert "ld.shared::cluster.v4.f32" in art.ptx and "barrier.cluster.wait" in art.ptx
    assert "atom.acq_rel" not in art.ptx  # no counter
    if "ptxas not found" not in art.ptxas_report:
        assert " 0 bytes spill stores" in art.ptxas_report, art.ptxas_report


@pytest.mark.parametrize("shape,cluster", [
    ((1, 1, 2048, 32, 8, 128), True),    # 8 splits of 2 blocks: one query, few rows
    ((1, 1, 8192, 64, 8, 64), True),     # head dim 64's 64-row tile: 8 rows x 16 chunks
    ((2, 1, 32768, 64, 8, 64), False),   # 4 splits of 2 MB
    ((1, 1, 32768, 32, 8, 128), False),  # 8 splits of 2 MB: the global merge streams faster
    ((1, 8, 8192, 64, 8, 128), False),   # 64 rows x 32 chunks: more than one item per thread
])
def test_launcher_merges_in_a_cluster_only_where_measured(shape, cluster):
    """launcher._cluster_merge on the automatic split count: short splits of a few packed
    rows merge in a cluster, long splits and many rows keep the global merge (the
    measurements in split_heuristic.CLUSTER_MERGE_MAX_SPLIT_BYTES and _cluster_merge)."""
    from cute_attn import api, launcher

    b, sq, sk, h, hkv, d = shape
    q = torch.empty(b, sq, h, d, dtype=torch.bfloat16)
    k = torch.empty(b, sk, hkv, d, dtype=torch.bfloat16)
    features, args = api._features_and_args(True, (-1, -1), 0.0, d ** -0.5)
    config = launcher._default_fwd_config(q, k, features)
    splits = launcher.choose_splits(q, k, features, args, config)
    assert splits > 1
    plan = launcher._make_plan(q, k, features, args, None, None)
    assert plan.num_splits == splits and plan.cluster_merge is cluster
