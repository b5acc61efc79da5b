"""The mods' custom ops (cute_attn::fwd_mods / bwd_mods) on the CPU: schemas, opcheck,
torch.compile(fullgraph=True) of mha with a mask mod (with an aux tensor), a user's block
mask and a learnable sink, and the op path equal to the direct one. The real
implementations run behind a stand-in launcher computing the fp32 reference with the
mods (mask_reference.attention_ref_mod) and its gradients in closed form from the saved
lse, the way the kernels do."""

import dataclasses

import pytest
import torch

import cute_attn.api as api
import cute_attn.launcher as launcher_module
import cute_attn.ops as ops
import cute_attn.validation as validation
from cute_attn import block_mask as bm
from cute_attn import masks
from cute_attn.dropout import dropout_mask, keep_scale
from cute_attn.mask_reference import attention_ref_mod, dense_mask
from cute_attn.reference import grads_from_lse
from test_ops_cpu import OPCHECK_UTILS, SIX, CountingBackend, assert_bitwise_twins, assert_one_graph_calling, ops_mha


class ModsStandIn:
    """run_fwd_mods / run_bwd(mods=) by the fp32 reference (dense mask kinds as mods)."""

    def __init__(self):
        self.fwd_calls, self.bwd_calls = [], []

    @staticmethod
    def _mask(features, mask_mod):
        if mask_mod is not None:
            return mask_mod
        assert features.mask in ("none", "causal") and not features.softcap, "the stand-in covers these"
        return masks.causal() if features.mask == "causal" else None

    def run_fwd_mods(self, q, k, v, features, args, mask_mod, score_mod, block_mask=None, need_lse=True, sink=None):
        assert score_mod is None, "the stand-in's backward has no score-mod derivative"
        self.fwd_calls.append(dict(features=features, args=args, mask=mask_mod, block_mask=block_mask, sink=sink))
        if features.varlen:
            return self._varlen_fwd(q, k, v, features, args, sink, mask_mod)
        if block_mask is not None:
            config = __import__("cute_attn.config", fromlist=["x"]).mod_fwd_config_for(q.shape[-1])
            bm.check_block_mask(block_mask, mask_mod, q.shape[0], q.shape[2], q.shape[1], k.shape[1],
                                config.tile_m, config.tile_n)
        o, lse = attention_ref_mod(q, k, v, mask_mod=self._mask(features, mask_mod), softmax_scale=args.softmax_scale,
                                   sink=sink, dropout_keep=_keep(q, k, args), dropout_p=args.dropout_p)
        out = torch.empty_like(q)
        out.copy_(o)
        return out, lse.contiguous()

    def run_bwd(self, dout, q, k, v, out, lse, features, args, deterministic=False, config=None, mods=None,
                sink=None):
        self.bwd_calls.append(dict(features=features, mods=mods, sink=sink))
        if features.varlen:
            return self._varlen_bwd(dout, q, k, v, out, lse, features, args, sink, None if mods is None else mods[0])
        mask_mod = self._mask(features, None if mods is None else mods[0])
        grads = _grads_from_lse(dout, q, k, v, out, lse, args.softmax_scale, mask_mod, _keep(q, k, args),
                                args.dropout_p)
        if sink is None:
            return grads
        # launcher._sink_grad on the D the preprocess kernel would compute
        d = (dout.float() * out.float()).sum(-1).transpose(1, 2)
        return (*grads, launcher_module._sink_grad(d, lse, sink))


    @staticmethod
    def _sequences(args):
        """Per packed sequence b: (b, query rows, key rows) as slices (the stand-in reads the
        offsets; the kernels take them on the device)."""
        cu_q, cu_k = args.cu_seqlens_q.tolist(), args.cu_seqlens_k.tolist()
        return [(b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)]

    def _varlen_fwd(self, q, k, v, features, args, sink, mask_mod=None):
        """mha_varlen's mods, sink and dropout, one sequence at a time (the mods see global
        indices and b = the sequence); sequence b draws dropout_mask's entry b."""
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
        for b, rq, rk in self._sequences(args):
            qb, kb, vb = q[rq][None], k[rk][None], v[rk][None]
            o, l = attention_ref_mod(qb, kb, vb, mask_mod=self._mask(features, mask_mod), softmax_scale=args.softmax_scale,
                                     sink=sink, dropout_keep=_keep(qb, kb, args, b), dropout_p=args.dropout_p,
                                     offset_q=rq.start, offset_k=rk.start, first_batch=b)
            out[rq] = o[0].to(out.dtype)
            lse[:, rq] = l[0]
        return out, lse

    def _varlen_bwd(self, dout, q, k, v, out, lse, features, args, sink, mask_mod=None):
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for b, rq, rk in self._sequences(args):
            per_seq = _grads_from_lse(dout[rq][None], q[rq][None], k[rk][None], v[rk][None], out[rq][None],
                                      lse[:, rq][None], args.softmax_scale, self._mask(features, mask_mod),
                                      _keep(q[rq][None], k[rk][None], args, b), args.dropout_p,
                                      place=(rq.start, rk.start, b))
            for g, part, r in zip(grads, per_seq, (rq, rk, rk)):
                g[r] = part[0]
        if sink is None:
            return tuple(grads)
        d = (dout.float() * out.float()).sum(-1).t()  # (heads, total_q), the preprocess kernel's D
        return (*grads, launcher_module._sink_grad(d[None], lse[None], sink))


def _keep(q, k, args, entry=None):
    """The dropout mask of a call (None without dropout); entry: a packed sequence's
    index (q, k its rows as a batch of one), whose mask is dropout_mask's entry b."""
    if args.dropout_seed is None:
        return None
    if entry is None:
        return dropout_mask(args.dropout_seed, q.shape[0], q.shape[2], q.shape[1], k.shape[1], args.dropout_p)
    full = dropout_mask(args.dropout_seed, entry + 1, q.shape[2], q.shape[1], k.shape[1], args.dropout_p)
    return full[entry:entry + 1]


def _grads_from_lse(dout, q, k, v, out, lse, scale, mask_mod, keep=None, dropout_p=0.0, place=(0, 0, 0)):
    """The kernels' backward in closed form (reference.grads_from_lse) with the mod's
    dense mask and dropout's keep / (1 - p); a sink is in lse. Not autograd: an op's
    kernel runs below the autograd key. place: a packed sequence's (offset_q, offset_k,
    index), as the mods see it."""
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    visible = None if mask_mod is None else dense_mask(mask_mod, b, h, sq, k.shape[1], None, *place)
    factor = None if keep is None else keep * keep_scale(dropout_p)
    grads = grads_from_lse(dout, q, k, v, out, lse, softmax_scale=scale, visible=visible, keep_factor=factor)
    return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, (q, k, v)))


_registered = []


@pytest.fixture
def stand_in(monkeypatch):
    if not _registered:
        for name, impl in (("fwd_mods", ops._fwd_mods_impl), ("bwd_mods", ops._bwd_mods_impl),
                           ("fwd_varlen_mods", ops._fwd_varlen_mods_impl),
                           ("bwd_varlen_mods", ops._bwd_varlen_mods_impl)):
            torch.library.register_kernel(f"cute_attn::{name}", "cpu", impl)
        _registered.append(True)
    launcher = ModsStandIn()
    monkeypatch.setattr(api, "_launcher_module", launcher)
    monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
    return launcher


def _qkv(b, s, h, h_kv, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(b, s, n, d, generator=g) * 0.7).to(dtype) for n in (h, h_kv, h_kv))


def _doc_ids(b, s):
    return (torch.arange(s)[None, :] * 3 // s + torch.arange(b)[:, None]).to(torch.int32).contiguous()


def test_schemas():
    fwd = str(torch.ops.cute_attn.fwd_mods.default._schema)
    bwd = str(torch.ops.cute_attn.bwd_mods.default._schema)
    dropout = "Tensor? dropout_seed, float dropout_p"
    assert fwd == ("cute_attn::fwd_mods(Tensor q, Tensor k, Tensor v, Tensor[] aux, Tensor[] block_mask, "
                   f"Tensor? sink, {dropout}, str mods, {SIX}) -> (Tensor, Tensor)")
    assert bwd == ("cute_attn::bwd_mods(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                   f"Tensor[] aux, Tensor? sink, {dropout}, str mods, {SIX}) -> (Tensor, Tensor, Tensor, Tensor)")


def test_digest_finds_the_mod_and_rebinds_its_aux():
    ids = _doc_ids(2, 10)
    doc = masks.document(ids, causal=True)
    template = masks.Modifier.by_digest(doc.spec.digest)
    assert template.spec == doc.spec and template.aux == ()
    other = _doc_ids(2, 10).flip(1).contiguous()
    rebound = template.rebound((other,))
    assert torch.equal(dense_mask(rebound, 2, 1, 10, 10), dense_mask(masks.document(other, causal=True), 2, 1, 10, 10))
    with pytest.raises(KeyError, match="no mask/score mod"):
        masks.Modifier.by_digest("0" * 16)


def _mods_args(mask_mod=None, sink=None, lists=(), scale=64 ** -0.5, causal=False, dropout=(None, 0.0)):
    features, run_args = api._features_and_args(causal, api._NO_WINDOW, 0.0, scale)
    mods = f"{'' if mask_mod is None else mask_mod.spec.digest}/"
    aux = [] if mask_mod is None else list(mask_mod.aux)
    return aux, list(lists), sink, *dropout, mods, *ops._pack(features, run_args), False


@pytest.mark.parametrize("case", ["document_aux", "sink_causal", "block_diffusion_user_block_mask", "dropout_causal"])
def test_opcheck_mods(stand_in, case):
    b, s, h, h_kv = 2, 11, 4, 2
    q, k, v = (t.requires_grad_() for t in _qkv(b, s, h, h_kv, seed=1))
    if case == "document_aux":
        args = _mods_args(masks.document(_doc_ids(b, s), causal=True))
    elif case == "sink_causal":
        args = _mods_args(sink=torch.randn(h).requires_grad_(), causal=True)
    elif case == "dropout_causal":
        args = _mods_args(causal=True, dropout=(torch.tensor([5, -9], dtype=torch.int32), 0.25))
    else:
        mod = masks.block_diffusion(3)
        built = bm.create_block_mask(mod, b, h, s, s, head_dim=64)
        args = _mods_args(mod, lists=(built.partial_count, built.partial_idx, built.full_count, built.full_idx))
    torch.library.opcheck(torch.ops.cute_attn.fwd_mods.default, (q, k, v, *args), test_utils=OPCHECK_UTILS)
    out, lse = (t.detach() for t in torch.ops.cute_attn.fwd_mods(q.detach(), k.detach(), v.detach(), *args))
    assert out.shape == q.shape and lse.shape == (b, h, s)
    aux, _lists, sink, *rest = args
    sink = None if sink is None else sink.detach()
    torch.library.opcheck(torch.ops.cute_attn.bwd_mods.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, aux, sink, *rest),
                          test_utils=OPCHECK_UTILS)


def test_closed_form_grads_are_autograds():
    """The stand-in's backward (from lse) against autograd through attention_ref_mod,
    with a mask that leaves rows without keys and a sink."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, 9, 2, 1, seed=2))
    sink = torch.tensor([0.3, -1.0])
    mod = masks.and_masks(masks.causal(), masks.prefix_lm(torch.tensor([0], dtype=torch.int32)))
    out, lse = attention_ref_mod(q, k, v, mask_mod=mod, sink=sink)
    dout = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), dout)
    got = _grads_from_lse(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), 64 ** -0.5, mod)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def _block(x, w_qkv, w_out, heads, sink, mask_mod, block_mask=None):
    b, s, dim = x.shape
    q, k, v = (x @ w_qkv).view(b, s, 3, heads, dim // heads).unbind(2)
    o = api.mha(q, k, v, mask_mod=mask_mod, learnable_sink=sink, block_mask=block_mask)
    return x + o.reshape(b, s, dim) @ w_out


def _block_inputs(seqlen, heads, dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, seqlen, dim, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    w_qkv = (torch.randn(dim, 3 * dim, generator=g) / dim ** 0.5).to(torch.bfloat16).requires_grad_()
    w_out = (torch.randn(dim, dim, generator=g) / dim ** 0.5).to(torch.bfloat16).requires_grad_()
    sink = torch.randn(heads, generator=g).requires_grad_()
    return x, w_qkv, w_out, sink


def test_compile_fullgraph_mods_and_sink_no_recompile(stand_in):
    """A transformer block with a document mask (an aux tensor per length) and a learnable
    sink under torch.compile(fullgraph=True, dynamic=True): no graph break, the graph
    calls fwd_mods / bwd_mods, three sequence lengths share one compile, and outputs and
    gradients (the sink's too) equal eager mha's."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = CountingBackend()
    heads = 2

    def block(x, w1, w2, sink, mask_mod):
        return _block(x, w1, w2, heads, sink, mask_mod)

    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    try:
        for seqlen in (40, 56, 72):
            leaves = _block_inputs(seqlen, heads, seed=seqlen)
            ids = masks.document(_doc_ids(2, seqlen), causal=True)  # a new Modifier (and aux) per step
            y = compiled(*leaves, ids)
            dy = torch.randn_like(y)
            y.backward(dy)
            twins = [t.detach().clone().requires_grad_() for t in leaves]
            y2 = block(*twins, ids)
            y2.backward(dy)
            torch.testing.assert_close(y, y2)
            for t, t2 in zip(leaves, twins):
                torch.testing.assert_close(t.grad, t2.grad)
        assert_one_graph_calling(backend, "fwd_mods", "bwd_mods")
        # eager and compiled calls both reached the stand-in, forward and backward
        assert len(stand_in.fwd_calls) == 6 and len(stand_in.bwd_calls) == 6
    finally:
        torch._dynamo.reset()


def test_an_in_place_edit_of_the_dropout_key_before_the_backward_is_refused(stand_in):
    """The eager backward saves the dropout key with its other inputs (unused there), so
    autograd refuses a key edited between forward and backward (another mask), as the ops
    path does."""
    seed = torch.tensor([5, -9], dtype=torch.int32)
    q, k, v = (t.requires_grad_() for t in _qkv(2, 13, 2, 2, seed=3, dtype=torch.bfloat16))
    out = api.mha(q, k, v, causal=True, dropout_p=0.25, dropout_seed=seed)
    seed.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


def test_aux_tensors_that_require_grad_are_refused(stand_in):
    """The kernels differentiate the score, not a mod's tensors: ALiBi slopes that require
    grad are an error (never a silent None gradient); detached, the call runs."""
    q, k, v = (torch.randn(1, 40, 2, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    slopes = torch.rand(2).requires_grad_()
    with pytest.raises(NotImplementedError, match="aux tensors get no gradient"):
        api.mha(q, k, v, score_mod=masks.alibi(slopes))
    assert stand_in.fwd_calls == []  # refused before any kernel


def test_compile_with_a_user_block_mask(stand_in):
    """A block mask built outside the compiled function reaches the kernel as its lists
    (the stand-in checks it); a block mask of another shape is refused while tracing."""
    torch._dynamo.reset()
    heads, seqlen = 2, 48
    mod = masks.block_diffusion(4)
    built = bm.create_block_mask(mod, 2, heads, seqlen, seqlen, head_dim=64)
    compiled = torch.compile(lambda *t: _block(*t, heads, None, mod, built), backend="aot_eager", fullgraph=True)
    try:
        x, w1, w2, _ = _block_inputs(seqlen, heads)
        y = compiled(x, w1, w2)
        y2 = _block(x, w1, w2, heads, None, mod)
        torch.testing.assert_close(y, y2)
        assert stand_in.fwd_calls[0]["block_mask"] is not None
        wrong = bm.create_block_mask(mod, 2, heads, seqlen + 8, seqlen + 8, head_dim=64)
        with pytest.raises(Exception, match="block_mask was built for"):
            torch.compile(lambda *t: _block(*t, heads, None, mod, wrong), backend="aot_eager", fullgraph=True)(x, w1, w2)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("case", ["document", "sink_causal", "sink_and_mask"])
def test_op_path_equals_direct_path(stand_in, case):
    """api.mha with mods through the ops (as traced) and directly: same features to the
    launcher, same results and gradients."""
    b, s, h = 2, 13, 2
    ids = _doc_ids(b, s)
    kwargs = {"document": dict(mask_mod=masks.document(ids)),
              "sink_causal": dict(causal=True),
              "sink_and_mask": dict(mask_mod=masks.document(ids, causal=True))}[case]
    inputs = [t.requires_grad_() for t in _qkv(b, s, h, h, seed=3, dtype=torch.bfloat16)]
    if case != "document":
        inputs.append(torch.randn(h).requires_grad_())
    twins = [t.detach().clone().requires_grad_() for t in inputs]

    def call(fn, ts):
        sink = ts[3] if len(ts) > 3 else None
        return fn(*ts[:3], learnable_sink=sink, return_lse=True, **kwargs)

    assert_bitwise_twins(call(ops_mha, inputs), call(api.mha, twins), inputs, twins)
    fwd_a, fwd_b = stand_in.fwd_calls
    assert fwd_a["features"] == fwd_b["features"] and fwd_a["args"] == fwd_b["args"]
    # the backward's features, but for the sink flag (run_bwd drops it: the sink is in lse)
    bwd_a, bwd_b = (dataclasses.replace(c["features"], sink=False) for c in stand_in.bwd_calls)
    assert bwd_a == bwd_b


def test_a_mod_made_inside_the_compiled_function_is_refused_clearly(stand_in):
    """Making a mod reads its bytecode (its kernel's key), which dynamo cannot trace: the
    error says to make it outside."""
    torch._dynamo.reset()
    q, k, v = _qkv(1, 16, 2, 2, dtype=torch.bfloat16)
    ids = _doc_ids(1, 16)
    compiled = torch.compile(lambda q, k, v, ids: api.mha(q, k, v, mask_mod=masks.document(ids)),
                             backend="aot_eager", fullgraph=True)
    try:
        with pytest.raises(Exception, match="cannot be made inside a torch.compile'd function"):
            compiled(q, k, v, ids)
    finally:
        torch._dynamo.reset()


def test_fake_mods_forward_and_backward(monkeypatch):
    """On fake tensors mha with a mask mod (aux tensor) and a sink reaches only the fake
    implementations (no launcher, no data_ptr), forward and backward, the sink's gradient
    included (CPU fakes: the autograd engine wants a real device for CUDA ones)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cpu_standin import LauncherTrap

    monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
    monkeypatch.setattr(api, "_launcher_module", LauncherTrap())
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda self: pytest.fail("data_ptr read on a fake tensor"))
    with FakeTensorMode():
        q = torch.empty(2, 300, 8, 128, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(2, 500, 2, 128, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        sink = torch.empty(8, requires_grad=True)
        ids = torch.empty(2, 500, dtype=torch.int32)
        mod = masks.Modifier("mask", lambda b, h, q_idx, kv_idx, seq: seq.aux[0][b, kv_idx] >= 0, (ids,))
        out, lse = api.mha(q, k, v, mask_mod=mod, learnable_sink=sink, return_lse=True)
        assert (out.shape, out.dtype, lse.shape) == (q.shape, q.dtype, (2, 8, 300))
        out.sum().backward()
        for t in (q, k, v, sink):
            assert t.grad.shape == t.shape


def test_compile_fullgraph_dropout_equals_eager(stand_in):
    """Dropout under torch.compile(fullgraph=True): the seed is drawn from torch's
    generator inside the graph (torch.randint), so after the same manual_seed compiled
    and eager calls draw the same mask; outputs and gradients agree, one compile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = CountingBackend()

    def attend(q, k, v):
        return api.mha(q, k, v, causal=True, dropout_p=0.2)

    compiled = torch.compile(attend, backend=backend, fullgraph=True, dynamic=True)
    try:
        for s in (24, 40):
            leaves = [t.requires_grad_() for t in _qkv(2, s, 2, 2, seed=s, dtype=torch.bfloat16)]
            twins = [t.detach().clone().requires_grad_() for t in leaves]
            torch.manual_seed(123)
            out = compiled(*leaves)
            torch.manual_seed(123)
            out2 = attend(*twins)
            assert_bitwise_twins((out,), (out2,), leaves, twins)
            assert stand_in.fwd_calls[-1]["features"].dropout
        assert_one_graph_calling(backend, "fwd_mods", "bwd_mods")
    finally:
        torch._dynamo.reset()


def test_closed_form_grads_with_dropout_are_autograds():
    """The stand-in's backward with a dropout mask against autograd through
    attention_ref_mod with the same mask."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, 20, 2, 2, seed=4))
    keep = dropout_mask(torch.tensor([3, 4], dtype=torch.int32), 1, 2, 20, 20, 0.3)
    out, lse = attention_ref_mod(q, k, v, mask_mod=masks.causal(), dropout_keep=keep, dropout_p=0.3)
    dout = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), dout)
    got = _grads_from_lse(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), 64 ** -0.5,
                          masks.causal(), keep, 0.3)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# mha_varlen with a sink and/or dropout: cute_attn::fwd_varlen_mods / bwd_varlen_mods
# ----------------------------------------------------------------------------------------


def test_varlen_mods_schemas():
    fwd = str(torch.ops.cute_attn.fwd_varlen_mods.default._schema)
    bwd = str(torch.ops.cute_attn.bwd_varlen_mods.default._schema)
    varlen = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k"
    extras = "Tensor[] aux, Tensor? sink, Tensor? dropout_seed, float dropout_p, str mods"
    assert fwd == f"cute_attn::fwd_varlen_mods(Tensor q, Tensor k, Tensor v, {varlen}, {extras}, {SIX}) -> (Tensor, Tensor)"
    assert bwd == (f"cute_attn::bwd_varlen_mods(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                   f"{varlen}, {extras}, {SIX}) -> (Tensor, Tensor, Tensor, Tensor)")


def _packed(lengths_q, lengths_k, h, h_kv, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(sum(lengths_q), h, d, generator=g) * 0.7).to(dtype)
    k, v = ((torch.randn(sum(lengths_k), h_kv, d, generator=g) * 0.7).to(dtype) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0] + n).cumsum(0).to(torch.int32) for n in (lengths_q, lengths_k))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("case", ["sink_causal", "dropout", "sink_dropout_causal"])
def test_opcheck_varlen_mods(stand_in, case):
    h, h_kv = 4, 2
    q, k, v, cu_q, cu_k = _packed([3, 0, 9], [5, 2, 9], h, h_kv, seed=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sink = torch.randn(h).requires_grad_() if "sink" in case else None
    seed = torch.tensor([7, -3], dtype=torch.int32) if "dropout" in case else None
    features, run_args = api._features_and_args("causal" in case, api._NO_WINDOW, 0.0, 64 ** -0.5)
    args = (cu_q, cu_k, 9, 9, [], sink, seed, 0.25 if seed is not None else 0.0, "/", *ops._pack(features, run_args),
            False)
    torch.library.opcheck(torch.ops.cute_attn.fwd_varlen_mods.default, (q, k, v, *args), test_utils=OPCHECK_UTILS)
    out, lse = (t.detach() for t in torch.ops.cute_attn.fwd_varlen_mods(q.detach(), k.detach(), v.detach(), *args))
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    bwd_args = (*args[:5], None if sink is None else sink.detach(), *args[6:])
    torch.library.opcheck(torch.ops.cute_attn.bwd_varlen_mods.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, *bwd_args),
                          test_utils=OPCHECK_UTILS)


def _packed_doc_ids(lengths):
    """(total,) ids over a packed batch: two documents per sequence, none shared across."""
    return torch.tensor([2 * b + (i * 2 >= n) for b, n in enumerate(lengths) for i in range(n)], dtype=torch.int32)


@pytest.mark.parametrize("case", ["document_causal", "prefix_lm_sink"])
def test_opcheck_varlen_mask_mods(stand_in, case):
    """fwd_varlen_mods / bwd_varlen_mods with a mask mod and its aux tensor: the op builds
    the per-sequence block mask itself (none passed through the op)."""
    h, h_kv = 4, 2
    lengths = [3, 0, 9]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, h, h_kv, seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if case == "document_causal":
        mod, sink = masks.document(_packed_doc_ids(lengths), causal=True), None
    else:
        mod, sink = masks.prefix_lm([2, 0, 5]), torch.randn(h).requires_grad_()
    features, run_args = api._features_and_args(False, api._NO_WINDOW, 0.0, 64 ** -0.5)
    args = (cu_q, cu_k, 9, 9, list(mod.aux), sink, None, 0.0, mod.spec.digest + "/",
            *ops._pack(features, run_args), False)
    torch.library.opcheck(torch.ops.cute_attn.fwd_varlen_mods.default, (q, k, v, *args), test_utils=OPCHECK_UTILS)
    out, lse = (t.detach() for t in torch.ops.cute_attn.fwd_varlen_mods(q.detach(), k.detach(), v.detach(), *args))
    assert stand_in.fwd_calls[-1]["mask"] is not None and stand_in.fwd_calls[-1]["features"].mask_mod is not None
    bwd_args = (*args[:5], None if sink is None else sink.detach(), *args[6:])
    torch.library.opcheck(torch.ops.cute_attn.bwd_varlen_mods.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, *bwd_args),
                          test_utils=OPCHECK_UTILS)


def test_compile_fullgraph_varlen_document_mask_no_recompile(stand_in):
    """mha_varlen with a packed document mask under torch.compile(fullgraph=True,
    dynamic=True): one graph through fwd_varlen_mods / bwd_varlen_mods for three batches
    of lengths, outputs and gradients equal to eager calls, which equal the per-sequence
    reference (the stand-in's); a user block mask is refused while traced."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = CountingBackend()
    h = 2

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, mod):  # mods are made outside the compiled function
        return api.mha_varlen(q, k, v, cu_q, cu_k, max_q, max_k, mask_mod=mod, check_cu_seqlens=False)

    compiled = torch.compile(attend, backend=backend, fullgraph=True, dynamic=True)
    try:
        for lengths in ([5, 11], [7, 0, 13], [4, 9, 2, 6]):
            q, k, v, cu_q, cu_k = _packed(lengths, lengths, h, h, seed=len(lengths), dtype=torch.bfloat16)
            mod = masks.document(_packed_doc_ids(lengths), causal=True)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            twins = [t.detach().clone().requires_grad_() for t in leaves]
            offsets = (cu_q, cu_k, max(lengths), max(lengths))
            out = compiled(*leaves, *offsets, mod)
            out2 = attend(*twins, *offsets, mod)
            assert_bitwise_twins((out,), (out2,), leaves, twins)
            assert stand_in.fwd_calls[-1]["features"].varlen and stand_in.fwd_calls[-1]["mask"] is not None
        assert_one_graph_calling(backend, "fwd_varlen_mods", "bwd_varlen_mods")

        def with_block_mask(q, k, v, cu_q, cu_k, mod, block_mask):
            return api.mha_varlen(q, k, v, cu_q, cu_k, 9, 9, mask_mod=mod, block_mask=block_mask,
                                  check_cu_seqlens=False)

        lengths = [3, 9]
        q, k, v, cu_q, cu_k = _packed(lengths, lengths, h, h, dtype=torch.bfloat16)
        mod = masks.document(_packed_doc_ids(lengths))
        built = bm.create_varlen_block_mask(mod, cu_q, cu_k, h, head_dim=64)
        with pytest.raises(Exception, match="cannot be checked against the offsets while traced"):
            torch.compile(with_block_mask, backend="eager", fullgraph=True)(q, k, v, cu_q, cu_k, mod, built)
    finally:
        torch._dynamo.reset()


def test_compile_fullgraph_varlen_sink_and_dropout_no_recompile(stand_in):
    """mha_varlen with a learnable sink and dropout under torch.compile(fullgraph=True,
    dynamic=True): one graph calling fwd_varlen_mods / bwd_varlen_mods for three batches
    of lengths, outputs and gradients (the sink's too) bit-equal to eager calls after
    the same manual_seed (the seed is drawn inside the graph)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = CountingBackend()
    h = 2

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, sink):
        return api.mha_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, learnable_sink=sink, dropout_p=0.2,
                              check_cu_seqlens=False)

    compiled = torch.compile(attend, backend=backend, fullgraph=True, dynamic=True)
    try:
        for lengths in ([5, 11], [7, 0, 13], [4, 9, 2, 6]):
            q, k, v, cu_q, cu_k = _packed(lengths, lengths, h, h, seed=len(lengths), dtype=torch.bfloat16)
            leaves = [t.requires_grad_() for t in (q, k, v, torch.randn(h))]
            twins = [t.detach().clone().requires_grad_() for t in leaves]
            offsets = (cu_q, cu_k, max(lengths), max(lengths))
            torch.manual_seed(5)
            out = compiled(*leaves[:3], *offsets, leaves[3])
            torch.manual_seed(5)
            out2 = attend(*twins[:3], *offsets, twins[3])
            assert_bitwise_twins((out,), (out2,), leaves, twins)
            assert stand_in.fwd_calls[-1]["features"].varlen and stand_in.fwd_calls[-1]["features"].dropout
        assert_one_graph_calling(backend, "fwd_varlen_mods", "bwd_varlen_mods")
    finally:
        torch._dynamo.reset()


def test_varlen_stand_in_is_the_reference_per_sequence(stand_in):
    """The varlen stand-in's forward and closed-form backward against autograd through
    attention_ref_mod on each sequence (a sink, dropout, causal), so the op tests above
    compare against the right thing."""
    h = 2
    q, k, v, cu_q, cu_k = _packed([4, 7], [6, 7], h, h, seed=9)
    sink = torch.randn(h)
    seed = torch.tensor([2, 8], dtype=torch.int32)
    features, args = api._features_and_args(True, api._NO_WINDOW, 0.0, 64 ** -0.5, (cu_q, cu_k, 7, 7))
    features = api.with_extras(features, None, None, True, True)
    args = args._replace(dropout_p=0.3, dropout_seed=seed)
    out, lse = stand_in.run_fwd_mods(q, k, v, features, args, None, None, sink=sink)
    dout = torch.randn_like(out)
    got = stand_in.run_bwd(dout, q, k, v, out, lse, features, args, sink=sink)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    for b, rq, rk in ModsStandIn._sequences(args):
        keep = _keep(leaves[0][rq][None], leaves[1][rk][None], args, b)
        o, l = attention_ref_mod(leaves[0][rq][None], leaves[1][rk][None], leaves[2][rk][None], mask_mod=masks.causal(),
                                 sink=leaves[3], dropout_keep=keep, dropout_p=0.3)
        torch.testing.assert_close(out[rq], o[0].detach())
        torch.testing.assert_close(lse[:, rq], l[0].detach())
        (o[0] * dout[rq]).sum().backward()
    for g, leaf in zip(got, leaves):
        torch.testing.assert_close(g, leaf.grad, rtol=1e-4, atol=1e-5)


def _record_dropout_keys(stand_in):
    """The dropout keys the stand-in's forward and backward get, in call order."""
    keys = []
    fwd, bwd = stand_in.run_fwd_mods, stand_in.run_bwd

    def run_fwd_mods(q, k, v, features, args, *rest, **kw):
        keys.append(("fwd", args.dropout_seed.tolist()))
        return fwd(q, k, v, features, args, *rest, **kw)

    def run_bwd(dout, q, k, v, out, lse, features, args, *rest, **kw):
        keys.append(("bwd", args.dropout_seed.tolist()))
        return bwd(dout, q, k, v, out, lse, features, args, *rest, **kw)

    stand_in.run_fwd_mods, stand_in.run_bwd = run_fwd_mods, run_bwd
    return keys


def _compiled_dropout_backward(seed=None):
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda q, k, v: api.mha(q, k, v, causal=True, dropout_p=0.2, dropout_seed=seed),
                          backend="aot_eager", fullgraph=True)
        q, k, v = (t.requires_grad_() for t in _qkv(1, 24, 2, 2, dtype=torch.bfloat16))
        f(q, k, v).float().sum().backward()
    finally:
        torch._dynamo.reset()


def test_compiled_backward_reuses_the_forward_dropout_key(stand_in):
    """A compiled call draws its dropout key in the graph, and the backward must use that
    key, not a second draw (a fresh key regenerates another mask: gradients for dropout
    the forward never applied). The key comes from rand_like, which aot_eager's partitioner
    never recomputes."""
    keys = _record_dropout_keys(stand_in)
    _compiled_dropout_backward()
    assert keys[0][0] == "fwd" and keys[-1][0] == "bwd"
    assert all(key == keys[0][1] for _, key in keys), keys


@pytest.mark.parametrize("flag, value", [("aggressive_recomputation", True), ("activation_memory_budget", 0.1)])
def test_compiled_dropout_under_recomputation_needs_an_explicit_seed(stand_in, flag, value, monkeypatch):
    """With the partitioner told to recompute forward ops (these settings recomputed
    randint, and under inductor rand, in the backward graph: another mask), a call that
    would draw its own key is refused while tracing; an explicit dropout_seed (a graph
    input) reaches forward and backward unchanged, recomputed or not."""
    monkeypatch.setattr(torch._functorch.config, flag, value)
    with pytest.raises(Exception, match="pass dropout_seed"):
        _compiled_dropout_backward()
    keys = _record_dropout_keys(stand_in)
    seed = torch.tensor([123, -456], dtype=torch.int32)
    _compiled_dropout_backward(seed)
    assert keys and all(key == [123, -456] for _, key in keys), keys
