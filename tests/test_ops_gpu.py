"""The PyTorch-ecosystem contract on the GPU: the custom ops (cute_attn.ops) under opcheck,
torch.compile with inductor (fullgraph, dynamic sequence lengths, no recompile) giving
the eager results, and CUDA-graph capture and replay of the forward and the backward."""

import pytest
import torch

import cute_attn
import cute_attn.api as api
import cute_attn.ops as ops
from gpu_helpers import exact_fp32_matmul  # noqa: F401  (autouse)

pytestmark = pytest.mark.gpu

DT = torch.bfloat16


def _rand(*shape, seed, scale=1.0, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, device="cuda", generator=g, dtype=torch.float32) * scale
    return t.to(DT).requires_grad_(requires_grad)


def _qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, d, seed, requires_grad=False):
    return (_rand(batch, seqlen_q, heads, d, seed=seed, requires_grad=requires_grad),
            _rand(batch, seqlen_k, heads_kv, d, seed=seed + 1, requires_grad=requires_grad),
            _rand(batch, seqlen_k, heads_kv, d, seed=seed + 2, requires_grad=requires_grad))


def _params(head_dim, causal=False, window=(-1, -1), softcap=0.0, varlen=None, deterministic=False):
    window, softcap = api._window_and_softcap(window, softcap)
    features, run_args = api._features_and_args(causal, window, softcap, head_dim ** -0.5, varlen=varlen)
    return (*ops._pack(features, run_args), deterministic)


# ----------------------------------------------------------------------------------------
# opcheck on every op, with the real kernels
# ----------------------------------------------------------------------------------------

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
CASES = [dict(), dict(causal=True), dict(window=(37, 5)), dict(causal=True, softcap=4.0)]


@pytest.mark.parametrize("kw", CASES, ids=["dense", "causal", "window", "causal-softcap"])
def test_opcheck_fwd_and_bwd(kw):
    q, k, v = _qkv(2, 200, 333, 4, 2, 128, seed=1, requires_grad=True)
    params = _params(128, **kw)
    torch.library.opcheck(torch.ops.cute_attn.fwd.default, (q, k, v, *params), test_utils=OPCHECK_UTILS)
    out, lse = torch.ops.cute_attn.fwd(q.detach(), k.detach(), v.detach(), *params)
    dout = _rand(*out.shape, seed=9)
    torch.library.opcheck(torch.ops.cute_attn.bwd.default, (dout, q.detach(), k.detach(), v.detach(), out, lse, *params),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_opcheck_varlen():
    lengths_q, lengths_k = [77, 0, 130], [50, 201, 129]
    cu_q = torch.tensor([0, 77, 77, 207], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 50, 251, 380], dtype=torch.int32, device="cuda")
    q = _rand(sum(lengths_q), 4, 64, seed=3, requires_grad=True)
    k = _rand(sum(lengths_k), 2, 64, seed=4, requires_grad=True)
    v = _rand(sum(lengths_k), 2, 64, seed=5, requires_grad=True)
    varlen = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    params = _params(64, causal=True, varlen=varlen)
    args = (q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), *params)
    torch.library.opcheck(torch.ops.cute_attn.fwd_varlen.default, args, test_utils=OPCHECK_UTILS)
    out, lse = torch.ops.cute_attn.fwd_varlen(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    dout = _rand(*out.shape, seed=6)
    torch.library.opcheck(
        torch.ops.cute_attn.bwd_varlen.default,
        (dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, max(lengths_q), max(lengths_k), *params),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_opcheck_fp8(varlen):
    """cute_attn::fwd_fp8 (forward only) with the real kernel (dense: with a sink): no input
    mutated or aliased (the schema's claims), fake vs real outputs, AOT dispatch with
    dynamic shapes."""
    g = torch.Generator(device="cuda").manual_seed(7)
    if varlen:
        cu_q = torch.tensor([0, 77, 77, 207], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 50, 251, 380], dtype=torch.int32, device="cuda")
        q = torch.randn(207, 4, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
        k, v = (torch.randn(380, 2, 128, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(2))
        offsets, batch = (cu_q, cu_k, 130, 201), 3
        five = _params(128, causal=True, varlen=offsets)[:-1]  # the six but deterministic
        sink = None
    else:
        q = torch.randn(2, 200, 4, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
        k, v = (torch.randn(2, 333, 2, 128, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(2))
        offsets, batch = (None, None, 0, 0), 2
        five = _params(128, causal=True)[:-1]
        sink = torch.randn(4, device="cuda", generator=g)  # an attention sink's logits
    descales = [torch.rand(batch, 2, device="cuda", generator=g) + 0.5 for _ in range(3)]
    args = (q, k, v, *descales, sink, *offsets, torch.bfloat16, *five)
    # opcheck's test_schema cannot run on e4m3 inputs (its checker multiplies them and torch
    # has no e4m3 mul), so its two claims are checked here by hand: the op mutates no input
    # and returns nothing that aliases one
    before = [t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone()
              for t in args if isinstance(t, torch.Tensor)]
    outs = torch.ops.cute_attn.fwd_fp8.default(*args)
    after = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in args if isinstance(t, torch.Tensor)]
    assert all(torch.equal(b, a) for b, a in zip(before, after)), "fwd_fp8 wrote to an input"
    inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    assert not any(o.untyped_storage().data_ptr() in inputs for o in outs), "an output aliases an input"
    torch.library.opcheck(torch.ops.cute_attn.fwd_fp8.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_compiled_fp8_equals_eager(fresh_dynamo):
    """mha on e4m3 inputs traced with fullgraph=True and dynamic shapes calls the same
    kernel as eager: bit-identical out and lse at two sequence lengths, one compile."""
    recorder = _Recorder()

    def attend(q, k, v, qd, kd, vd):
        return cute_attn.mha(q, k, v, causal=True, return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd)

    compiled = torch.compile(attend, backend=recorder, fullgraph=True, dynamic=True)
    for seqlen in (300, 517):
        g = torch.Generator(device="cuda").manual_seed(seqlen)
        q = torch.randn(2, seqlen, 8, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
        k, v = (torch.randn(2, seqlen, 2, 128, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(2))
        descales = [torch.rand(2, 2, device="cuda", generator=g) + 0.5 for _ in range(3)]
        with torch.no_grad():
            out, lse = compiled(q, k, v, *descales)
            out2, lse2 = attend(q, k, v, *descales)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert len({cid for cid in recorder.compile_ids}) == 1, recorder.compile_ids


# ----------------------------------------------------------------------------------------
# torch.compile (inductor): fullgraph, dynamic sequence lengths, eager results
# ----------------------------------------------------------------------------------------


class _Recorder:
    """Counts dynamo's compiles (frame, compile id) of the inductor backend."""

    def __init__(self):
        self.compile_ids = []

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        cid = torch._guards.CompileContext.current_compile_id()
        self.compile_ids.append((cid.frame_id, cid.frame_compile_id))
        return compile_fx(gm, example_inputs)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_attention_equals_eager_bitwise(fresh_dynamo):
    """mha (causal, GQA) traced with fullgraph=True and dynamic shapes: the compiled
    forward and backward run the same kernels on the same inputs as eager, so out, lse
    and the gradients are bit-identical (deterministic: dq's accumulation order is fixed);
    three sequence lengths, one compile."""
    recorder = _Recorder()

    def attend(q, k, v):
        out, lse = cute_attn.mha(q, k, v, causal=True, return_lse=True, deterministic=True)
        return out * 1.0, lse

    compiled = torch.compile(attend, backend=recorder, fullgraph=True, dynamic=True)
    for i, seqlen in enumerate((300, 517, 1024)):
        q, k, v = _qkv(2, seqlen, seqlen, 8, 2, 128, seed=10 * i, requires_grad=True)
        twins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = compiled(q, k, v)
        out2, lse2 = attend(*twins)
        dout = _rand(*out.shape, seed=99 + i)
        out.backward(dout)
        out2.backward(dout)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        for t, t2 in zip((q, k, v), twins):
            assert torch.equal(t.grad, t2.grad)
        # and it is attention: against the fp32 reference
        ref, _ = cute_attn.reference.attention_ref(q.detach(), k.detach(), v.detach(), causal=True)
        assert (out.float() - ref).abs().max() < 2e-2
    assert set(recorder.compile_ids) == {(0, 0)}, recorder.compile_ids


def _block(x, w_qkv, w_out, heads):
    b, s, dim = x.shape
    q, k, v = (x @ w_qkv).view(b, s, 3, heads, dim // heads).unbind(2)
    o = cute_attn.mha(q, k, v, causal=True)
    return x + torch.nn.functional.gelu(o.reshape(b, s, dim) @ w_out)


def test_compiled_transformer_block_fullgraph_no_recompile(fresh_dynamo):
    """A block (projections, attention, gelu, residual) under inductor: no graph break
    (fullgraph), one compile for four sequence lengths, and results within bf16 rounding
    of eager (inductor fuses the pointwise ops differently, the attention is the same)."""
    recorder = _Recorder()
    compiled = torch.compile(_block, backend=recorder, fullgraph=True, dynamic=True)
    dim, heads = 512, 4
    for i, seqlen in enumerate((256, 300, 777, 1500)):
        x = _rand(2, seqlen, dim, seed=i, scale=0.5, requires_grad=True)
        w_qkv = _rand(dim, 3 * dim, seed=100 + i, scale=dim ** -0.5, requires_grad=True)
        w_out = _rand(dim, dim, seed=200 + i, scale=dim ** -0.5, requires_grad=True)
        twins = [t.detach().clone().requires_grad_() for t in (x, w_qkv, w_out)]
        y = compiled(x, w_qkv, w_out, heads)
        y2 = _block(*twins, heads)
        dy = _rand(*y.shape, seed=300 + i)
        y.backward(dy)
        y2.backward(dy)
        for a, b in [(y, y2)] + [(t.grad, t2.grad) for t, t2 in zip((x, w_qkv, w_out), twins)]:
            scale = b.float().abs().max().item()
            assert scale > 0
            assert (a.float() - b.float()).abs().max().item() <= 2e-2 * scale
    assert set(recorder.compile_ids) == {(0, 0)}, recorder.compile_ids


def test_compiled_varlen_fullgraph(fresh_dynamo):
    recorder = _Recorder()

    def attend(q, k, v, cu, max_seqlen):
        return cute_attn.mha_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, window_size=(64, 0),
                                    deterministic=True)

    compiled = torch.compile(attend, backend=recorder, fullgraph=True, dynamic=True)
    for i, lengths in enumerate(((100, 7, 300), (1, 500, 64), (250, 250, 3))):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        total = sum(lengths)
        q, k, v = (_rand(total, 4, 64, seed=10 * i + j, requires_grad=True) for j in range(3))
        twins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = compiled(q, k, v, cu, max(lengths))
        out2 = attend(*twins, cu, max(lengths))
        out.float().square().sum().backward()
        out2.float().square().sum().backward()
        assert torch.equal(out, out2)
        for t, t2 in zip((q, k, v), twins):
            assert torch.equal(t.grad, t2.grad)
    assert set(recorder.compile_ids) == {(0, 0)}, recorder.compile_ids


# ----------------------------------------------------------------------------------------
# The mods' ops (mask/score mods, sinks): opcheck and torch.compile with inductor
# ----------------------------------------------------------------------------------------


def _mods_params(head_dim, mask_mod=None, sink=None, causal=False, lists=()):
    aux = [] if mask_mod is None else list(mask_mod.aux)
    mods = f"{'' if mask_mod is None else mask_mod.spec.digest}/"
    return aux, list(lists), sink, None, 0.0, mods, *_params(head_dim, causal=causal)


@pytest.mark.parametrize("case", ["document", "sink-causal"])
def test_opcheck_mods(case):
    from cute_attn import masks

    q, k, v = _qkv(2, 300, 300, 4, 2, 128, seed=7, requires_grad=True)
    if case == "document":
        ids = (torch.arange(300, device="cuda")[None] * 5 // 300 + torch.arange(2, device="cuda")[:, None]).int()
        params = _mods_params(128, masks.document(ids.contiguous(), causal=True))
    else:
        params = _mods_params(128, sink=torch.randn(4, device="cuda", requires_grad=True), causal=True)
    torch.library.opcheck(torch.ops.cute_attn.fwd_mods.default, (q, k, v, *params), test_utils=OPCHECK_UTILS)
    out, lse = (t.detach() for t in torch.ops.cute_attn.fwd_mods(q.detach(), k.detach(), v.detach(), *params))
    aux, _lists, sink, *rest = params
    sink = None if sink is None else sink.detach()
    torch.library.opcheck(torch.ops.cute_attn.bwd_mods.default,
                          (_rand(*out.shape, seed=8), q.detach(), k.detach(), v.detach(), out, lse, aux, sink, *rest),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compiled_mods_and_sink_equal_eager(fresh_dynamo):
    """mha with a BD3LM mask (a new Modifier per step, as a model passes it in) and a
    learnable sink under inductor, fullgraph and dynamic: three lengths, one compile; the
    same kernels run, so out, lse, dk and dv are bit-identical to eager; dq (atomic
    accumulation) and the sink's gradient (a reduction inductor fuses its own way) agree
    to rounding; and it is attention with the sink, against the fp32 reference."""
    from cute_attn import masks
    from cute_attn.mask_reference import attention_ref_mod

    recorder = _Recorder()

    def attend(q, k, v, sink, mask_mod):
        out, lse = cute_attn.mha(q, k, v, mask_mod=mask_mod, learnable_sink=sink, return_lse=True)
        return out * 1.0, lse

    compiled = torch.compile(attend, backend=recorder, fullgraph=True, dynamic=True)
    for i, half in enumerate((150, 259, 512)):
        q, k, v = _qkv(2, 2 * half, 2 * half, 4, 2, 128, seed=20 * i, requires_grad=True)
        sink = (torch.randn(4, device="cuda") * 2).requires_grad_()
        mod = masks.block_diffusion(16)
        leaves = (q, k, v, sink)
        twins = [t.detach().clone().requires_grad_() for t in leaves]
        out, lse = compiled(*leaves, mod)
        out2, lse2 = attend(*twins, mod)
        dout = _rand(*out.shape, seed=77 + i)
        out.backward(dout)
        out2.backward(dout)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        assert torch.equal(k.grad, twins[1].grad) and torch.equal(v.grad, twins[2].grad)
        torch.testing.assert_close(q.grad, twins[0].grad, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(sink.grad, twins[3].grad, rtol=1e-4, atol=1e-4)
        ref, _ = attention_ref_mod(q.detach(), k.detach(), v.detach(), mask_mod=mod, sink=sink.detach())
        assert (out.float() - ref).abs().max() < 2e-2
    assert set(recorder.compile_ids) == {(0, 0)}, recorder.compile_ids


def _packed_qkv(lengths_q, lengths_k, heads, heads_kv, d, seed, requires_grad=False):
    cu_q, cu_k = (torch.tensor([0] + n, device="cuda").cumsum(0).to(torch.int32) for n in (lengths_q, lengths_k))
    return (_rand(sum(lengths_q), heads, d, seed=seed, requires_grad=requires_grad),
            _rand(sum(lengths_k), heads_kv, d, seed=seed + 1, requires_grad=requires_grad),
            _rand(sum(lengths_k), heads_kv, d, seed=seed + 2, requires_grad=requires_grad), cu_q, cu_k)


def test_opcheck_varlen_mods():
    """cute_attn::fwd_varlen_mods / bwd_varlen_mods (mha_varlen with a sink and dropout, no
    mods: aux [] and mods "/") under opcheck with the real kernels."""
    lengths_q, lengths_k = [77, 0, 130], [50, 201, 129]
    q, k, v, cu_q, cu_k = _packed_qkv(lengths_q, lengths_k, 4, 2, 64, seed=31, requires_grad=True)
    sink = torch.randn(4, device="cuda", requires_grad=True)
    seed = torch.tensor([11, 12], dtype=torch.int32, device="cuda")
    varlen = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    args = (q, k, v, *varlen, [], sink, seed, 0.2, "/", *_params(64, causal=True, varlen=varlen))
    torch.library.opcheck(torch.ops.cute_attn.fwd_varlen_mods.default, args, test_utils=OPCHECK_UTILS)
    out, lse = torch.ops.cute_attn.fwd_varlen_mods(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    assert lse.shape == (4, q.shape[0])
    bwd_args = (_rand(*out.shape, seed=32), q.detach(), k.detach(), v.detach(), out, lse, *varlen, [],
                sink.detach(), *args[9:])
    torch.library.opcheck(torch.ops.cute_attn.bwd_varlen_mods.default, bwd_args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


VARLEN_BATCHES = ([300, 17], [5, 0, 411], [129, 128, 257, 64])


def _compiled_varlen_equals_eager(attend, make_extra, seed):
    """attend(q, k, v, cu_q, cu_k, max_q, max_k, extra) under inductor (fullgraph, dynamic)
    against eager over VARLEN_BATCHES: one compile; out, dk and dv bit for bit, dq (its dQ
    sums land in another order) to rounding. make_extra(lengths) gives the last argument;
    one that requires grad gets an eager twin, and its gradient (a reduction inductor fuses
    its own way) is compared to rounding too."""
    recorder = _Recorder()
    compiled = torch.compile(attend, backend=recorder, fullgraph=True, dynamic=True)
    for i, lengths in enumerate(VARLEN_BATCHES):
        q, k, v, cu_q, cu_k = _packed_qkv(lengths, lengths, 4, 2, 128, seed=seed + i, requires_grad=True)
        extra = make_extra(lengths)
        differentiable = isinstance(extra, torch.Tensor) and extra.requires_grad
        leaves = (q, k, v, extra) if differentiable else (q, k, v)
        twins = [t.detach().clone().requires_grad_() for t in leaves]
        offsets = (cu_q, cu_k, max(lengths), max(lengths))
        out = compiled(q, k, v, *offsets, extra)
        out2 = attend(*twins[:3], *offsets, twins[3] if differentiable else extra)
        dout = _rand(*out.shape, seed=seed + 10 + i)
        out.backward(dout)
        out2.backward(dout)
        assert torch.equal(out, out2)
        assert torch.equal(k.grad, twins[1].grad) and torch.equal(v.grad, twins[2].grad)
        torch.testing.assert_close(q.grad, twins[0].grad, rtol=1e-2, atol=1e-2)
        if differentiable:
            torch.testing.assert_close(extra.grad, twins[3].grad, rtol=1e-4, atol=1e-4)
    assert set(recorder.compile_ids) == {(0, 0)}, recorder.compile_ids


def test_compiled_varlen_sink_and_dropout_equal_eager(fresh_dynamo):
    """mha_varlen with a learnable sink and dropout (a given seed: inductor draws its own
    random numbers) under inductor: _compiled_varlen_equals_eager, the sink's gradient too."""
    seed = torch.tensor([21, -4], dtype=torch.int32, device="cuda")

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, sink):
        return cute_attn.mha_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, learnable_sink=sink,
                                    dropout_p=0.15, dropout_seed=seed, check_cu_seqlens=False) * 1.0

    _compiled_varlen_equals_eager(attend, lambda lengths: (torch.randn(4, device="cuda") * 2).requires_grad_(), 40)


def test_compiled_varlen_document_mask_equals_eager(fresh_dynamo):
    """mha_varlen with a packed document mask (made outside the compiled function, a new
    one per batch) under inductor: _compiled_varlen_equals_eager."""
    from cute_attn import masks

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, mod):
        return cute_attn.mha_varlen(q, k, v, cu_q, cu_k, max_q, max_k, mask_mod=mod, check_cu_seqlens=False) * 1.0

    def document(lengths):
        ids = torch.cat([torch.arange(n, device="cuda") * 3 // max(n, 1) + 10 * b for b, n in enumerate(lengths)])
        return masks.document(ids.to(torch.int32), causal=True)

    _compiled_varlen_equals_eager(attend, document, 60)


# ----------------------------------------------------------------------------------------
# CUDA graphs: capture once, replay on new values
# ----------------------------------------------------------------------------------------


def _capture(fn):
    """fn() captured in a CUDA graph after warm-up calls on a side stream (kernels
    loaded, per-device constants allocated), as torch's docs prescribe."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


@pytest.mark.parametrize("kw, shape", [
    (dict(causal=True), (2, 333, 600, 8, 4, 128)),
    (dict(window_size=(100, 20), softcap=5.0), (2, 333, 600, 8, 4, 128)),
    # 512 tiles on at most 132 SMs: the persistent forward's tile queue under capture and
    # replay (its counter must be zero at every replay, else tiles are skipped: NaN)
    (dict(causal=True), (4, 1000, 1000, 16, 4, 128)),
], ids=["causal", "window-softcap", "causal-tile-queue"])
def test_cuda_graph_forward_replays_new_inputs(kw, shape):
    q, k, v = _qkv(*shape, seed=1)
    graph, (out, lse) = _capture(lambda: cute_attn.mha(q, k, v, return_lse=True, **kw))
    for seed in (5, 6):
        for t, new in zip((q, k, v), _qkv(*shape, seed=seed)):
            t.copy_(new)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        ref_out, ref_lse = cute_attn.mha(q, k, v, return_lse=True, **kw)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_graph_forward_and_backward(deterministic):
    """One graph holds the forward, the backward (preprocess, main, postprocess) and
    their workspaces (dq_accum, the semaphores of the deterministic order)."""
    q, k, v = _qkv(2, 257, 257, 4, 4, 64, seed=2, requires_grad=True)
    dout = _rand(2, 257, 4, 64, seed=3)

    def step():
        out = cute_attn.mha(q, k, v, causal=True, deterministic=deterministic)
        return torch.autograd.grad(out, (q, k, v), dout)

    graph, grads = _capture(step)
    for seed in (11, 12):
        with torch.no_grad():
            for t, new in zip((q, k, v, dout), _qkv(2, 257, 257, 4, 4, 64, seed=seed) + (_rand(2, 257, 4, 64, seed=seed + 50),)):
                t.copy_(new)
        for g in grads:
            g.fill_(float("nan"))
        graph.replay()
        expected = step()
        for g, e in zip(grads, expected):
            if deterministic:
                assert torch.equal(g, e)
            else:  # dq is accumulated in a run-dependent order
                torch.testing.assert_close(g, e, atol=2e-3, rtol=1e-2)


def test_cuda_graph_varlen_skips_the_offsets_check():
    """check_cu_seqlens=None is skipped under capture (no host read); new offsets in the
    same tensor are read by the replay."""
    total = 400
    q, k, v = (_rand(total, 4, 64, seed=j) for j in range(3))
    cu = torch.tensor([0, 100, 250, 400], dtype=torch.int32, device="cuda")
    graph, out = _capture(lambda: cute_attn.mha_varlen(q, k, v, cu, cu, 400, 400, causal=True))
    cu.copy_(torch.tensor([0, 10, 390, 400], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    expected = cute_attn.mha_varlen(q, k, v, cu, cu, 400, 400, causal=True, check_cu_seqlens=False)
    assert torch.equal(out, expected)


# ----------------------------------------------------------------------------------------
# The LSE sink of calls that discard lse (launcher._lse_sink)
# ----------------------------------------------------------------------------------------


def test_discarded_lse_shares_a_sink_and_out_is_unchanged():
    """Calls without return_lse write lse into a shared, growing sink: out is the same
    as with return_lse, whatever the order of shapes (the sink grows, shrinks back to a
    view), and inside a CUDA graph capture too."""
    from cute_attn import launcher

    for i, (b, s, h) in enumerate(((1, 64, 2), (2, 3000, 8), (1, 100, 2), (4, 5000, 16), (2, 3000, 8))):
        q, k, v = _qkv(b, s, s + 7, h, h // 2, 64, seed=40 + i)
        out = cute_attn.mha(q, k, v, causal=True)
        expected, lse = cute_attn.mha(q, k, v, causal=True, return_lse=True)
        assert torch.equal(out, expected) and torch.isfinite(lse).all()
    assert len(launcher._lse_sinks[q.device]) >= 2
    q, k, v = _qkv(8, 4000, 4000, 16, 16, 64, seed=50)  # larger than every sink: allocated in the capture
    graph, out = _capture(lambda: cute_attn.mha(q, k, v))
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, cute_attn.mha(q, k, v, return_lse=True)[0])


def _pool_of(t, segments):
    """The memory pool id of the allocator segment holding t (None: in none)."""
    for s in segments:
        if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]:
            return tuple(s.get("segment_pool_id", (0, 0)))
    return None


def test_reduce_overhead_graphs_leave_no_kept_buffer_in_their_pool(fresh_dynamo):
    """torch.compile(mode="reduce-overhead") warms each new graph up in its private
    memory pool (not capturing) and resets the pool before recording, freeing what the
    warm-up allocated: a buffer the launcher keeps across calls (the persistent grid's
    tile-queue counter, the split-KV workspace) must come from the default pool
    (bounded_cache.outside_private_pools), or later calls write into the graphs' tensors.
    A persistent causal forward, then split-KV decode steps at three batch sizes (each a
    new graph, warmed up after the first one was recorded), against eager."""
    from cute_attn import launcher

    for cache in (launcher._tile_queues, launcher._workspace_buffers, launcher._workspace_views):
        cache.clear()
    prefill = torch.compile(lambda q, k, v: cute_attn.mha(q, k, v, causal=True), mode="reduce-overhead",
                            fullgraph=True)
    q, k, v = _qkv(2, 4096, 4096, 16, 16, 128, seed=3)
    for _ in range(3):
        out = prefill(q, k, v).clone()  # a graph's output is overwritten by its next replay
    assert torch.equal(out, cute_attn.mha(q, k, v, causal=True))

    def step(q1, k_cache, v_cache, lengths):
        return cute_attn.mha_with_kvcache(q1, k_cache, v_cache, cache_seqlens=lengths, num_splits=4)

    decode = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for batch in (1, 2, 4):
        k_cache, v_cache = (_rand(batch, 8192, 4, 128, seed=20 + batch + i) for i in (0, 1))
        lengths = torch.arange(batch, device="cuda", dtype=torch.int32) * 1000 + 5000
        q1 = _rand(batch, 1, 16, 128, seed=30 + batch)
        for _ in range(3):
            got = decode(q1, k_cache, v_cache, lengths).clone()
        want = step(q1, k_cache, v_cache, lengths)
        assert (got.float() - want.float()).abs().max().item() < 1e-2, batch
    segments = torch.cuda.memory_snapshot()
    kept = list(launcher._tile_queues.values()) + [t for floats, zeros in launcher._workspace_buffers.values()
                                                    for t in (*floats, *zeros)]
    assert kept, "nothing was kept: this shape no longer takes the tile queue or the split path"
    assert all(_pool_of(t, segments) == (0, 0) for t in kept), [_pool_of(t, segments) for t in kept]
