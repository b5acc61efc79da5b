"""cute_attn.mha_with_kvcache without a GPU: the append (in place, on the device, clamped
into the cache), what reaches the launcher (kv_lengths features, the per-entry key counts
in the cu_seqlens_k slot, the page table, the split count), and what is refused.
The launcher is a stand-in that records its call; validation runs with every check but
the device's (CPU tensors)."""

import pytest
import torch

import cute_attn
import cute_attn.api as api
from cpu_standin import LauncherTrap
import cute_attn.validation as validation
from cute_attn.config import UNBOUNDED


class Recorder:
    def __init__(self):
        self.calls = []

    @staticmethod
    def run_append(*args):
        from cute_attn.kvcache_reference import append_in_place

        return append_in_place(*args)

    def run_fwd(self, q, k, v, features, args, config=None, need_lse=True, num_splits=None):
        self.calls.append(dict(k=k, v=v, features=features, args=args, need_lse=need_lse, num_splits=num_splits))
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1]) if need_lse else None
        return torch.zeros_like(q), lse


@pytest.fixture
def launcher(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(api, "_launcher_module", rec)
    monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
    return rec


def _inputs(batch=3, seqlen_q=2, capacity=64, heads=8, heads_kv=2, d=64, seqlen_new=2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch, capacity, heads_kv, d, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, seqlen_new, heads_kv, d, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k_cache, v_cache, k, v


def test_append_and_lengths(launcher):
    q, k_cache, v_cache, k, v = _inputs()
    before = k_cache.clone()
    lengths = torch.tensor([0, 10, 62], dtype=torch.int32)
    out, lse = cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                          window_size=(30, -1), softcap=5.0, return_lse=True, num_splits=3)
    for b, n in enumerate((0, 10, 62)):
        assert torch.equal(k_cache[b, n:n + 2], k[b]) and torch.equal(v_cache[b, n:n + 2], v[b])
        assert torch.equal(k_cache[b, :n], before[b, :n]) and torch.equal(k_cache[b, n + 2:], before[b, n + 2:])
    (call,) = launcher.calls
    assert call["k"] is k_cache and call["v"] is v_cache
    f, args = call["features"], call["args"]
    assert f.kv_lengths and f.mask == "local" and f.softcap and not f.varlen
    assert args.window == (30, 0) and args.softcap == 5.0 and args.softmax_scale == 64 ** -0.5
    assert args.cu_seqlens_k.dtype == torch.int32 and args.cu_seqlens_k.tolist() == [2, 12, 64]
    assert call["num_splits"] == 3 and call["need_lse"]


def test_no_new_tokens_and_defaults(launcher):
    q, k_cache, v_cache, _, _ = _inputs()
    lengths = torch.tensor([5, 0, 64], dtype=torch.int32)
    before = k_cache.clone()
    out = cute_attn.mha_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    assert torch.equal(k_cache, before) and out.shape == q.shape
    (call,) = launcher.calls
    assert call["args"].cu_seqlens_k is lengths and call["num_splits"] is None and not call["need_lse"]
    assert call["features"].mask == "none" and call["args"].window == (UNBOUNDED, UNBOUNDED)


def test_out_of_range_positions_are_clamped_into_the_cache(launcher):
    q, k_cache, v_cache, k, v = _inputs(capacity=16)
    lengths = torch.tensor([15, -4, 16], dtype=torch.int32)  # past the end, negative, full
    cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
    # 15 and 16 -> slot 15 (which of the two tokens lands there is index_put_'s choice)
    assert torch.equal(k_cache[0, 15], k[0, 0]) or torch.equal(k_cache[0, 15], k[0, 1])
    assert torch.equal(k_cache[1, 0:2], k[1])  # -4 -> 0
    assert launcher.calls[0]["args"].cu_seqlens_k.tolist() == [16, 2, 16]
    with pytest.raises(ValueError, match="batch entry 1"):
        cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, check_inputs=True)


def test_paged_cache_appends_through_its_table_and_reaches_the_launcher(launcher):
    q, _, _, k, v = _inputs()
    g = torch.Generator().manual_seed(1)
    pages_k = torch.randn(12, 16, 2, 64, generator=g).to(torch.bfloat16)
    pages_v = torch.randn(12, 16, 2, 64, generator=g).to(torch.bfloat16)
    table = torch.randperm(12, generator=g).to(torch.int32).view(3, 4)
    lengths = torch.tensor([15, 0, 62], dtype=torch.int32)  # entry 0 crosses a page
    before = pages_k.clone()
    cute_attn.mha_with_kvcache(q, pages_k, pages_v, k, v, cache_seqlens=lengths, page_table=table, causal=True)
    for b, n in enumerate((15, 0, 62)):
        for t in range(2):
            page, row = int(table[b, (n + t) // 16]), (n + t) % 16
            assert torch.equal(pages_k[page, row], k[b, t]) and torch.equal(pages_v[page, row], v[b, t])
            before[page, row] = k[b, t]
    assert torch.equal(pages_k, before)  # nothing else written
    (call,) = launcher.calls
    assert call["k"] is pages_k and call["args"].page_table is table
    assert call["args"].cu_seqlens_k.tolist() == [17, 2, 64]


def test_flash_attn_with_kvcache_is_the_same_call(launcher):
    q, k_cache, v_cache, k, v = _inputs()
    twin_k, twin_v = k_cache.clone(), v_cache.clone()
    lengths = torch.tensor([3, 0, 40], dtype=torch.int32)
    out, lse = cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                                 return_softmax_lse=True)
    cute_attn.mha_with_kvcache(q, twin_k, twin_v, k, v, cache_seqlens=lengths, causal=True, return_lse=True)
    assert torch.equal(k_cache, twin_k) and torch.equal(v_cache, twin_v)
    a, b = launcher.calls
    assert a["features"] == b["features"] and a["args"][:3] == b["args"][:3]
    assert a["args"].cu_seqlens_k.tolist() == b["args"].cu_seqlens_k.tolist() == [5, 2, 42]
    # an int or None: every entry holds that many keys (None: full)
    cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7)
    cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache)
    assert launcher.calls[2]["args"].cu_seqlens_k.tolist() == [7, 7, 7]
    assert launcher.calls[3]["args"].cu_seqlens_k.tolist() == [64, 64, 64]


@pytest.mark.parametrize("name", ["rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad", "alibi_slopes"])
def test_flash_attn_with_kvcache_refuses_what_it_cannot_do(launcher, name):
    q, k_cache, v_cache, _, _ = _inputs()
    with pytest.raises(NotImplementedError, match=name):
        cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, **{name: torch.zeros(3)})
    assert launcher.calls == []


def test_paged_append_writes_through_the_page_table():
    """kvcache_reference.append_in_place (the append kernel's reference) with a page table:
    positions land in the pages the table names, the rest of the pages is untouched,
    and the new lengths are cache_seqlens + seqlen_new."""
    from cute_attn.kvcache_reference import append_in_place, append_to_cache

    g = torch.Generator().manual_seed(1)
    pages_k = torch.randn(10, 16, 2, 64, generator=g).to(torch.bfloat16)
    pages_v = torch.randn(10, 16, 2, 64, generator=g).to(torch.bfloat16)
    table = torch.tensor([[7, 2, 9, 0], [4, 1, 3, 5]], dtype=torch.int32)
    lengths = torch.tensor([15, 33], dtype=torch.int32)  # entry 0 crosses a page boundary
    k, v = (torch.randn(2, 3, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    ref_k, ref_v = append_to_cache(pages_k, pages_v, lengths, k, v, page_table=table)
    new = append_in_place(k, v, pages_k, pages_v, lengths, page_table=table)
    assert torch.equal(pages_k, ref_k) and torch.equal(pages_v, ref_v)
    assert new.tolist() == [18, 36] and new.dtype == torch.int32
    assert torch.equal(pages_k[7, 15], k[0, 0]) and torch.equal(pages_k[2, 0], k[0, 1])


# ----------------------------------------------------------------------------------------
# cute_attn::fwd_kvcache: the custom op mha_with_kvcache takes while traced
# ----------------------------------------------------------------------------------------


class ReferenceLauncher:
    """run_fwd for kv_lengths features by the KV-cache reference (lengths in the
    cu_seqlens_k slot), allocated like the real launcher's; run_append by the append
    kernel's reference."""

    def __init__(self):
        self.calls = 0

    run_append = staticmethod(Recorder.run_append)

    def run_fwd(self, q, k, v, features, args, config=None, need_lse=True, num_splits=None):
        from cpu_standin import ref_kwargs

        from cute_attn.kvcache_reference import kvcache_attention_ref

        assert features.kv_lengths
        self.calls += 1
        out, lse, _, _ = kvcache_attention_ref(q, k, v, args.cu_seqlens_k, page_table=args.page_table,
                                               **ref_kwargs(features, args))
        result = torch.empty_like(q)
        result.copy_(out)
        return result, lse.float().contiguous()


_registered = []


@pytest.fixture
def reference_op(monkeypatch):
    import cute_attn.ops as ops

    if not _registered:
        torch.library.register_kernel("cute_attn::fwd_kvcache", "cpu", ops._fwd_kvcache_impl)
        torch.library.register_kernel("cute_attn::kv_append", "cpu", ops._kv_append_impl)
        _registered.append(True)
    rec = ReferenceLauncher()
    monkeypatch.setattr(api, "_launcher_module", rec)
    monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
    return rec


def test_fwd_kvcache_schema_and_opcheck(reference_op):
    schema = str(torch.ops.cute_attn.fwd_kvcache.default._schema)
    assert schema == ("cute_attn::fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlens_k, Tensor? page_table, "
                      "str mask, "
                      "float softmax_scale, float softcap, SymInt window_left, SymInt window_right, "
                      "SymInt num_splits) -> (Tensor, Tensor)")
    q, k_cache, v_cache, _, _ = _inputs()
    args = (q.float(), k_cache.float(), v_cache.float(), torch.tensor([5, 0, 64], dtype=torch.int32), None, "causal",
            0.125, 0.0, UNBOUNDED, 0, 0)
    torch.library.opcheck(torch.ops.cute_attn.fwd_kvcache.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("paged", [False, True])
def test_kv_append_schema_and_opcheck(reference_op, paged):
    """cute_attn::kv_append declares its in-place writes (Tensor(a2!) k_cache,
    Tensor(a3!) v_cache) and passes opcheck, contiguous and paged."""
    schema = str(torch.ops.cute_attn.kv_append.default._schema)
    assert schema == ("cute_attn::kv_append(Tensor k, Tensor v, Tensor(a2!) k_cache, Tensor(a3!) v_cache, "
                      "Tensor cache_seqlens, Tensor? page_table) -> Tensor")
    _, k_cache, v_cache, k, v = _inputs()
    table = None
    if paged:
        k_cache, v_cache = (c.reshape(12, 16, *c.shape[2:]) for c in (k_cache, v_cache))
        table = torch.tensor([[3, 1, 7, 0], [11, 2, 5, 4], [6, 8, 9, 10]], dtype=torch.int32)
    lengths = torch.tensor([5, 0, 62], dtype=torch.int32)
    torch.library.opcheck(torch.ops.cute_attn.kv_append.default, (k, v, k_cache, v_cache, lengths, table),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_fake_tensors_take_the_op(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    # fake CPU tensors (a CPU-only torch cannot make fake CUDA ones with arange), with the
    # device check off: the point is that the launcher is never reached
    monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
    monkeypatch.setattr(api, "_launcher_module", LauncherTrap(" with fake tensors"))
    with FakeTensorMode():
        q = torch.empty(3, 4, 16, 128, dtype=torch.bfloat16)
        k_cache, v_cache = (torch.empty(3, 1000, 4, 128, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.empty(3, 4, 4, 128, dtype=torch.bfloat16) for _ in range(2))
        lengths = torch.empty(3, dtype=torch.int32)
        out, lse = cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                              return_lse=True)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (3, 16, 4)


def test_compiled_decode_step_equals_eager(reference_op):
    """A decode step (append + attention) under torch.compile(fullgraph, dynamic) with
    aot_eager: no graph break, the same caches and outputs as eager, and new lengths do
    not recompile."""
    torch._dynamo.reset()
    compiles = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        cid = torch._guards.CompileContext.current_compile_id()
        compiles.append((cid.frame_id, cid.frame_compile_id))
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    def step(q, k_cache, v_cache, k, v, lengths):
        return cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    try:
        for lengths in ([0, 10, 62], [5, 40, 1]):
            q, k_cache, v_cache, k, v = _inputs()
            twins = (k_cache.clone(), v_cache.clone())
            seqlens = torch.tensor(lengths, dtype=torch.int32)
            out = compiled(q, k_cache, v_cache, k, v, seqlens)
            expected = step(q, *twins, k, v, seqlens)
            assert torch.equal(k_cache, twins[0]) and torch.equal(v_cache, twins[1])
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
        # one compile (dynamo may hand a first compile over twice under one id when it
        # restarts its analysis; a recompile would have a new id)
        assert set(compiles) == {(0, 0)}, compiles
    finally:
        torch._dynamo.reset()


def test_flash_attn_with_kvcache_host_lengths_are_checked(launcher):
    """cache_seqlens as an int or None is checked on the host against the capacity and
    the new tokens: None (every entry full) leaves no room for k, v; an int past the room
    left, a negative one or a bool is an error; a paged cache's capacity is its pages per
    entry times the page size (not the page size)."""
    q, k_cache, v_cache, k, v = _inputs()
    with pytest.raises(ValueError, match="cache_seqlens=None means every entry is full"):
        cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v)
    for bad in (63, 100, -3):  # 64 keys, 2 new
        with pytest.raises(ValueError, match=f"cache_seqlens={bad} with 2 new tokens does not fit"):
            cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=bad)
    with pytest.raises(TypeError, match="got bool"):
        cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=True)
    with pytest.raises(TypeError, match="q must be a 4-D torch.Tensor"):
        cute_attn.flash_attn_with_kvcache([[1.0]], k_cache, v_cache, cache_seqlens=3)
    assert launcher.calls == []
    cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=62)
    assert launcher.calls[-1]["args"].cu_seqlens_k.tolist() == [64, 64, 64]
    pages = torch.zeros(12, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    cute_attn.flash_attn_with_kvcache(q, pages, pages.clone(), block_table=table)
    assert launcher.calls[-1]["args"].cu_seqlens_k.tolist() == [64, 64, 64]  # 4 pages of 16


@pytest.mark.parametrize("case", ["no-pages", "no-rows", "strided-lengths", "num-splits"])
def test_caches_with_no_room_strided_lengths_and_too_many_splits_are_refused(launcher, case):
    """Before any kernel: a paged cache with no page (the append kernel would clamp a page
    index to -1 and write before the cache), a contiguous cache with no row, a strided
    cache_seqlens (the kernels read a compact vector), num_splits past MAX_SPLITS."""
    from cute_attn.split_heuristic import MAX_SPLITS

    q, k_cache, v_cache, k, v = _inputs()
    lengths = torch.zeros(3, dtype=torch.int32)
    kwargs = dict(cache_seqlens=lengths)
    if case == "no-pages":
        k_cache = v_cache = torch.zeros(0, 16, 2, 64, dtype=torch.bfloat16)
        kwargs["page_table"] = torch.zeros(3, 2, dtype=torch.int32)
        match = "needs at least one page"
    elif case == "no-rows":
        k_cache = v_cache = torch.zeros(3, 0, 2, 64, dtype=torch.bfloat16)
        k = v = None
        match = "holds no keys"
    elif case == "strided-lengths":
        kwargs["cache_seqlens"] = torch.zeros(6, dtype=torch.int32)[::2]
        match = "cache_seqlens must be contiguous"
    else:
        kwargs["num_splits"] = MAX_SPLITS + 1
        match = rf"num_splits must be in \[0, {MAX_SPLITS}\]"
    with pytest.raises(ValueError, match=match):
        cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert launcher.calls == []


def test_per_stream_scratch_is_one_per_stream_and_fresh_under_capture(monkeypatch):
    """launcher._stream_key: the tile queue's counter (and the split workspace) is one per
    (device, stream), reused by that stream's calls, and a CUDA graph's capture gets a
    fresh zeroed one (its replays may run beside eager calls on the captured stream)."""
    from cute_attn import launcher

    stream, capturing = [1], [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    # (a CPU build of torch has no _cuda_getCurrentRawStream)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream[0], raising=False)
    monkeypatch.setattr(launcher, "_tile_queues", {})
    device = torch.device("cpu")
    first = launcher._tile_queue(device)
    assert first is launcher._tile_queue(device) and torch.equal(first, torch.zeros(2, dtype=torch.int32))
    stream[0] = 2
    assert launcher._tile_queue(device) is not first
    capturing[0] = True
    captured = launcher._tile_queue(device)
    assert captured is not launcher._tile_queue(device) and len(launcher._tile_queues) == 2
    capturing[0] = False
    parts = launcher._split_workspace(device, 2, 3, 4, 8, 5)
    assert parts is launcher._split_workspace(device, 2, 3, 4, 8, 5) and not parts[2].any()


def test_an_empty_batch_or_no_heads_never_launches_the_append(launcher, monkeypatch):
    """Nothing to write, and no grid to launch: the append kernel is not called (its grid
    would have a zero extent), the result is the empty call's."""
    appended = []
    monkeypatch.setattr(launcher, "run_append", lambda *a: appended.append(a), raising=False)
    for batch, heads, heads_kv in ((0, 8, 2), (2, 0, 0)):
        q, k_cache, v_cache, k, v = _inputs(batch=batch, heads=heads, heads_kv=heads_kv, seqlen_q=1, seqlen_new=1)
        out = cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v,
                                         cache_seqlens=torch.zeros(batch, dtype=torch.int32))
        assert out.shape == q.shape
    assert appended == [] and launcher.calls == []


def test_an_append_into_caches_at_one_address_is_refused(launcher):
    """k_cache and v_cache at one address with new k, v: the append would write v over k
    (then attend with K = V). The same tensor, or another view of the same memory; the
    decode fast path checks it too. k is v (the same new tokens) is consistent: allowed."""
    q, k_cache, _, k, v = _inputs()
    lengths = torch.zeros(3, dtype=torch.int32)
    for v_cache in (k_cache, k_cache[:]):
        with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):
            cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
    assert launcher.calls == []
    cute_attn.mha_with_kvcache(q, k_cache, k_cache, k, k, cache_seqlens=lengths)
    cute_attn.mha_with_kvcache(q, k_cache, k_cache, cache_seqlens=lengths)  # no append
    assert len(launcher.calls) == 2


def test_inputs_that_require_grad_are_refused(launcher):
    """No backward: never a silently non-differentiable output. Under no_grad it runs."""
    q, k_cache, v_cache, k, v = _inputs()
    lengths = torch.zeros(3, dtype=torch.int32)
    for name in ("q", "k_cache", "k"):
        tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
        tensors[name] = tensors[name].clone().requires_grad_()
        with pytest.raises(NotImplementedError, match="mha_with_kvcache has no backward"):
            cute_attn.mha_with_kvcache(tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["k"],
                                       tensors["v"], cache_seqlens=lengths)
        with torch.no_grad():
            cute_attn.mha_with_kvcache(tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["k"],
                                       tensors["v"], cache_seqlens=lengths)
    assert len(launcher.calls) == 3


def test_more_queries_than_the_cache_holds_with_new_keys_is_refused(launcher):
    """FlashAttention's rule (flash_api.cpp: seqlen_q <= seqlen_k when k is supplied)."""
    q, k_cache, v_cache, k, v = _inputs(seqlen_q=80, capacity=64)
    with pytest.raises(ValueError, match="q seqlen_q must be <= the cache capacity"):
        cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.zeros(3, dtype=torch.int32))


def test_flash_attn_with_kvcache_makes_lengths_and_pages_contiguous(launcher):
    """As FlashAttention 2's maybe_contiguous: a strided cache_seqlens or block_table works."""
    q, k_cache, v_cache, k, v = _inputs()
    lengths = torch.tensor([0, 9, 1, 9, 5, 9], dtype=torch.int32)[::2]
    cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
    assert launcher.calls[-1]["args"].cu_seqlens_k.tolist() == [2, 3, 7]
    pages = torch.zeros(12, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(24, dtype=torch.int32).view(3, 8)[:, ::2] % 12
    cute_attn.flash_attn_with_kvcache(q, pages, pages.clone(), block_table=table,
                                      cache_seqlens=torch.zeros(3, dtype=torch.int32))
    assert launcher.calls[-1]["args"].page_table.is_contiguous()


def test_check_inputs_on_fake_tensors_is_a_clear_error(launcher):
    """check_inputs=True reads the lengths on the host: on fake tensors (torch.compile's
    tracing) that is a ValueError saying so, not a data-dependent-output exception."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tensors = (*_inputs(), torch.zeros(3, dtype=torch.int32))
    with FakeTensorMode() as mode:
        q, k_cache, v_cache, k, v, lengths = (mode.from_tensor(t) for t in tensors)
        with pytest.raises(ValueError, match="check_inputs=True reads cache_seqlens .* fake tensors"):
            cute_attn.mha_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, check_inputs=True)


def test_the_append_bumps_the_caches_version_counters(monkeypatch):
    """run_append writes the caches through raw pointers: it bumps their version counters
    so that an autograd graph that saved a cache raises torch's in-place error in its
    backward instead of using the appended values silently."""
    from cute_attn import launcher as real_launcher

    q, k_cache, v_cache, k, v = _inputs()
    monkeypatch.setitem(real_launcher._append_kernels, (k.dtype, k.shape[3], False), lambda *args: None)
    monkeypatch.setattr(real_launcher, "_unused_page_table", lambda device: None)
    w = torch.ones_like(k_cache, requires_grad=True)
    loss = (w * k_cache).sum()  # saves k_cache for w's gradient
    before = (k_cache._version, v_cache._version)
    real_launcher.run_append(k, v, k_cache, v_cache, torch.zeros(3, dtype=torch.int32))
    assert (k_cache._version, v_cache._version) == (before[0] + 1, before[1] + 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
