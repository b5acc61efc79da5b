"""cute_attn.ops (the torch.library custom ops) checked without a GPU.

The ops' real implementations run on CUDA tensors only; here the same functions
(ops._fwd_impl, ...) are registered for the CPU too, and the launcher they call is a
stand-in that computes with cute_attn.reference and allocates its outputs as the real
launcher does (out like q, lse float32 contiguous, dq/dk/dv like q/k/v). So opcheck,
torch.compile and autograd see the ops' registrations (schema, fake implementations,
autograd formula) and the entry points' validation, not the kernels' numerics.
FakeTensorMode makes fake CUDA tensors without a GPU: the fake implementations and the
validation on fake tensors run as they would under torch.compile on the GPU machine.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_attn.api as api
import cute_attn.ops as ops
import cute_attn.validation as validation
from cpu_standin import LauncherTrap, ref_kwargs
from cute_attn.reference import attention_ref, attention_ref_varlen, grads_from_lse

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


# ----------------------------------------------------------------------------------------
# CPU stand-in: the real implementations registered for the CPU, a reference launcher
# ----------------------------------------------------------------------------------------


class StandInLauncher:
    """run_fwd / run_bwd computed by the fp32 reference, allocated like the launcher's."""

    def __init__(self):
        self.fwd_calls, self.bwd_calls = [], []

    @staticmethod
    def _attention(q, k, v, features, args):
        kwargs = ref_kwargs(features, args)
        if features.varlen:
            return attention_ref_varlen(q, k, v, args.cu_seqlens_q, args.cu_seqlens_k, **kwargs)
        return attention_ref(q, k, v, **kwargs)

    def run_fwd(self, q, k, v, features, args, config=None, need_lse=True):
        self.fwd_calls.append(dict(features=features, args=args))
        o, l = self._attention(q, k, v, features, args)
        out = torch.empty_like(q)  # q's stride order, as launcher.run_fwd
        out.copy_(o)
        lse = torch.empty(l.shape, dtype=torch.float32)
        lse.copy_(l)
        return out, lse

    def run_bwd(self, dout, q, k, v, out, lse, features, args, deterministic=False, config=None):
        self.bwd_calls.append(dict(features=features, args=args, deterministic=deterministic,
                                   dout_stride=dout.stride(), dout_aligned=dout.data_ptr() % 16 == 0))
        kwargs = ref_kwargs(features, args)
        if features.varlen:
            cu_q, cu_k = args.cu_seqlens_q.tolist(), args.cu_seqlens_k.tolist()
            parts = [_ref_grads(*(t[a:b][None] for t, a, b in ((dout, q0, q1), (q, q0, q1), (k, k0, k1), (v, k0, k1))), **kwargs)
                     for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
            grads = [torch.cat([p[i][0] for p in parts]) for i in range(3)]
        else:
            grads = _ref_grads(dout, q, k, v, **kwargs)
        result = []
        for t, g in zip((q, k, v), grads):
            like = torch.empty_like(t)  # as launcher.run_bwd
            like.copy_(g)
            result.append(like)
        return tuple(result)


def _ref_grads(dout, q, k, v, *, causal, softmax_scale, window_size, softcap):
    """attention_ref's (dq, dk, dv) in closed form, in float32 (reference.grads_from_lse
    on attention_ref's out and lse). Not autograd: a kernel may run below the autograd
    dispatch key (AOT's compiled backward), where no graph is recorded."""
    kwargs = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    out, lse = attention_ref(q, k, v, **kwargs)
    return grads_from_lse(dout, q, k, v, out, lse, **kwargs)


_registered_for_cpu = []


def _register_cpu_kernels():
    if _registered_for_cpu:
        return
    for name, impl in (("fwd", ops._fwd_impl), ("bwd", ops._bwd_impl),
                       ("fwd_varlen", ops._fwd_varlen_impl), ("bwd_varlen", ops._bwd_varlen_impl)):
        torch.library.register_kernel(f"cute_attn::{name}", "cpu", impl)
    _registered_for_cpu.append(True)


@pytest.fixture
def stand_in(monkeypatch):
    """CPU kernels, the reference launcher, and validation with every check but the
    device's (CPU tensors)."""
    _register_cpu_kernels()
    launcher = StandInLauncher()
    monkeypatch.setattr(api, "_launcher_module", launcher)
    monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
    return launcher




@pytest.fixture
def fake_sm90(monkeypatch):
    """Fake CUDA tensors pass the device check as an sm_90 GPU; no launcher may run."""
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(api, "_launcher_module", LauncherTrap())


@pytest.fixture
def no_data_ptr(monkeypatch):
    """Any Tensor.data_ptr() read (FakeTensor's included) fails the test."""

    monkeypatch.setattr(torch.Tensor, "data_ptr", _no_data_ptr)


def _no_data_ptr(self):
    raise AssertionError("data_ptr read on a fake tensor")


def _bshd(batch, seqlen, heads, dim=64, dtype=torch.bfloat16, seed=0, requires_grad=False, device=None):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(batch, seqlen, heads, dim, generator=g).to(dtype)
    if device is not None:
        t = t.to(device)
    return t.requires_grad_(requires_grad)


# every mask kind (none, causal, local) and the softcap, as mha keywords
FEATURE_CASES = [
    dict(),
    dict(causal=True),
    dict(window_size=(5, 2)),
    dict(causal=True, softcap=3.0),
]


# ----------------------------------------------------------------------------------------
# Schemas and opcheck
# ----------------------------------------------------------------------------------------

SIX = "str mask, float softmax_scale, float softcap, SymInt window_left, SymInt window_right, bool deterministic"
VARLEN = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k"


def test_schemas():
    schemas = {name: str(getattr(torch.ops.cute_attn, name).default._schema)
               for name in ("fwd", "bwd", "fwd_varlen", "bwd_varlen")}
    grads = "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse"
    assert schemas == {
        "fwd": f"cute_attn::fwd(Tensor q, Tensor k, Tensor v, {SIX}) -> (Tensor, Tensor)",
        "bwd": f"cute_attn::bwd({grads}, {SIX}) -> (Tensor, Tensor, Tensor)",
        "fwd_varlen": f"cute_attn::fwd_varlen(Tensor q, Tensor k, Tensor v, {VARLEN}, {SIX}) -> (Tensor, Tensor)",
        "bwd_varlen": f"cute_attn::bwd_varlen({grads}, {VARLEN}, {SIX}) -> (Tensor, Tensor, Tensor)",
    }


def _six(kwargs, head_dim=64, varlen=None, deterministic=False):
    window = api._window_and_softcap(kwargs.get("window_size", api._NO_WINDOW), kwargs.get("softcap", 0.0))
    features, run_args = api._features_and_args(kwargs.get("causal", False), *window,
                                                head_dim ** -0.5, varlen=varlen)
    return (*ops._pack(features, run_args), deterministic)


@pytest.mark.parametrize("kwargs", FEATURE_CASES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd_transposed"])
def test_opcheck_dense(stand_in, kwargs, layout):
    if layout == "bshd":
        q, k, v = (_bshd(2, s, h, dtype=torch.float32, seed=i, requires_grad=True)
                   for i, (s, h) in enumerate(((9, 4), (11, 2), (11, 2))))
    else:  # (b, h, s, d) storage seen as (b, s, h, d): out and the grads keep that order
        q, k, v = (_bshd(2, h, s, dtype=torch.float32, seed=i).transpose(1, 2).requires_grad_()
                   for i, (s, h) in enumerate(((9, 4), (11, 2), (11, 2))))
    six = _six(kwargs)
    torch.library.opcheck(torch.ops.cute_attn.fwd.default, (q, k, v, *six), test_utils=OPCHECK_UTILS)
    out, lse = torch.ops.cute_attn.fwd(q.detach(), k.detach(), v.detach(), *six)
    assert out.stride() == q.stride() and lse.shape == (2, 4, 9)
    # the backward has no derivative of its own (no double backward): plain tensors
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cute_attn.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, *six),
                          test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("kwargs", FEATURE_CASES)
def test_opcheck_varlen(stand_in, kwargs):
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(10, 4, 64, generator=g).requires_grad_()
    k, v = (torch.randn(12, 2, 64, generator=g).requires_grad_() for _ in range(2))
    varlen = (cu_q, cu_k, 7, 5)
    six = _six(kwargs, varlen=varlen)
    args = (q, k, v, *varlen, *six)
    torch.library.opcheck(torch.ops.cute_attn.fwd_varlen.default, args, test_utils=OPCHECK_UTILS)
    out, lse = torch.ops.cute_attn.fwd_varlen(q.detach(), k.detach(), v.detach(), *varlen, *six)
    assert out.shape == q.shape and lse.shape == (4, 10)
    torch.library.opcheck(torch.ops.cute_attn.bwd_varlen.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                           *varlen, *six),
                          test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("kwargs", FEATURE_CASES)
def test_stand_in_gradients_are_the_references(kwargs):
    """The closed-form gradients of the stand-in against autograd through attention_ref."""
    q, k, v = (_bshd(2, s, h, dtype=torch.float32, seed=i, requires_grad=True)
               for i, (s, h) in enumerate(((9, 4), (11, 2), (11, 2))))
    window, softcap = api._window_and_softcap(kwargs.get("window_size", api._NO_WINDOW),
                                              kwargs.get("softcap", 0.0))
    features, run_args = api._features_and_args(kwargs.get("causal", False), window, softcap, 0.3)
    ref = ref_kwargs(features, run_args)
    out, _ = attention_ref(q, k, v, **ref)
    dout = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), dout)
    for g, e in zip(_ref_grads(dout, q, k, v, **ref), expected):
        torch.testing.assert_close(g, e)


# ----------------------------------------------------------------------------------------
# FakeTensorMode: fake CUDA tensors (no GPU needed), no data_ptr read
# ----------------------------------------------------------------------------------------


# Autograd on fake CUDA tensors is out of reach on a CPU-only torch build: recording a
# graph node for one aborts the process (C++ "PyTorch is not linked with support for cuda
# devices", in torch 2.13's InputMetadata), so the CUDA tests call the ops without
# autograd and the autograd formula runs on fake CPU tensors (the same fake
# implementations and validation; only the device check is patched out).


def _fake_bhsd_as_bshd(batch, seqlen, heads, dim, dtype, device, requires_grad=False):
    # (b, h, s, d) storage seen as (b, s, h, d): out and the grads keep this stride order
    t = torch.empty(batch, heads, seqlen, dim, dtype=dtype, device=device).transpose(1, 2)
    return t.requires_grad_(requires_grad)


@pytest.mark.parametrize("kwargs", FEATURE_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_cuda_forward_and_backward_ops(fake_sm90, no_data_ptr, kwargs, dtype):
    with FakeTensorMode():
        q = _fake_bhsd_as_bshd(2, 300, 8, 128, dtype, "cuda")  # GQA 8 / 2
        k = _fake_bhsd_as_bshd(2, 500, 2, 128, dtype, "cuda")
        v = torch.empty(2, 500, 2, 128, dtype=dtype, device="cuda")
        out, lse = api.mha(q, k, v, return_lse=True, **kwargs)
        assert (out.shape, out.stride(), out.dtype, out.device) == (q.shape, q.stride(), dtype, q.device)
        assert (lse.shape, lse.dtype, lse.device, lse.is_contiguous()) == ((2, 8, 300), torch.float32, q.device, True)
        # what the autograd formula does: an expanded dout (after .sum()) packed, then bwd
        dout = validation.prepare_dout(torch.ones((), dtype=dtype, device="cuda").expand(out.shape), out)
        assert dout.is_contiguous()
        grads = torch.ops.cute_attn.bwd(dout, q, k, v, out, lse, *_six(kwargs, head_dim=128))
        for t, g in zip((q, k, v), grads):
            assert (g.shape, g.stride(), g.dtype, g.device) == (t.shape, t.stride(), dtype, t.device)


@pytest.mark.parametrize("kwargs", FEATURE_CASES)
def test_fake_autograd(monkeypatch, no_data_ptr, kwargs):
    """mha's autograd formula through the ops on fake tensors: setup_context, prepare_dout, bwd's fake."""
    monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
    monkeypatch.setattr(api, "_launcher_module", LauncherTrap())
    with FakeTensorMode():
        q = _fake_bhsd_as_bshd(2, 300, 8, 128, torch.bfloat16, "cpu", requires_grad=True)
        k = _fake_bhsd_as_bshd(2, 500, 2, 128, torch.bfloat16, "cpu", requires_grad=True)
        v = torch.empty(2, 500, 2, 128, dtype=torch.bfloat16, requires_grad=True)
        out, lse = api.mha(q, k, v, return_lse=True, deterministic=True, **kwargs)
        assert out.requires_grad and not lse.requires_grad
        assert (out.shape, out.stride()) == (q.shape, q.stride())
        out.sum().backward()  # an expanded dout, packed by prepare_dout on a fake tensor
        for t in (q, k, v):
            assert (t.grad.shape, t.grad.stride(), t.grad.dtype) == (t.shape, t.stride(), t.dtype)


def test_fake_varlen_sink_and_dropout_reach_the_varlen_mods_op(fake_sm90, no_data_ptr):
    """mha_varlen with a sink or dropout on fake tensors: the varlen mods' fake
    implementation, (heads, total_q) lse, no launcher."""
    with FakeTensorMode():
        q = torch.empty(700, 8, 64, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(900, 4, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        cu_q, cu_k = (torch.empty(4, dtype=torch.int32, device="cuda") for _ in range(2))
        sink = torch.empty(8, device="cuda")
        seed = torch.empty(2, dtype=torch.int32, device="cuda")
        for kwargs in (dict(learnable_sink=sink), dict(dropout_p=0.1, dropout_seed=seed)):
            out, lse = api.mha_varlen(q, k, v, cu_q, cu_k, 400, 500, causal=True, return_lse=True, **kwargs)
            assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (8, 700), torch.float32)


def test_fake_varlen(fake_sm90, no_data_ptr):
    with FakeTensorMode():
        q = torch.empty(700, 8, 64, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(900, 4, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        cu_q, cu_k = (torch.empty(4, dtype=torch.int32, device="cuda") for _ in range(2))
        # check_cu_seqlens=None would read the offsets: skipped on fake tensors
        out, lse = api.mha_varlen(q, k, v, cu_q, cu_k, 400, 500, causal=True, return_lse=True)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (8, 700), torch.float32)
        six = _six(dict(causal=True), varlen=(cu_q, cu_k, 400, 500))
        grads = torch.ops.cute_attn.bwd_varlen(torch.empty_like(out), q, k, v, out, lse, cu_q, cu_k, 400, 500, *six)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        with pytest.raises(ValueError, match="check_cu_seqlens=True reads cu_seqlens"):
            api.mha_varlen(q, k, v, cu_q, cu_k, 400, 500, check_cu_seqlens=True)


def test_fake_varlen_autograd(monkeypatch, no_data_ptr):
    monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
    monkeypatch.setattr(api, "_launcher_module", LauncherTrap())
    with FakeTensorMode():
        q = torch.empty(700, 8, 64, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(900, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        cu_q, cu_k = (torch.empty(4, dtype=torch.int32) for _ in range(2))
        out = api.mha_varlen(q, k, v, cu_q, cu_k, 400, 500, window_size=(30, 0), softcap=5.0)
        out.sum().backward()
        assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def test_fake_tensors_still_get_every_other_check(fake_sm90, no_data_ptr):
    with FakeTensorMode():
        q = torch.empty(2, 64, 4, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 64, 3, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="k nheads must divide q nheads"):
            api.mha(q, k, k)
        with pytest.raises(ValueError, match="q strides must be multiples of 8"):
            # (views of fake CUDA tensors need a CUDA build; empty_strided does not)
            bad = torch.empty_strided((2, 64, 4, 64), (64 * 4 * 66, 4 * 66, 66, 1),
                                      dtype=torch.bfloat16, device="cuda")
            api.mha(bad, q, q)
        with pytest.raises(TypeError, match="q must be torch.float16 or torch.bfloat16"):
            api.mha(q.float(), q, q)


def test_pointer_check_is_skipped_for_fake_tensors_only(monkeypatch):
    """Validation reads no address of a fake tensor, and still rejects a real misaligned
    one (tests/test_validation.py has the rest)."""
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    with FakeTensorMode():  # views of fake CUDA tensors need a CUDA build: a fake CPU one
        q = torch.empty(2 * 64 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64, 4, 64)
        assert q.storage_offset() == 1 and validation.pointer_unknown(q)
        monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
        monkeypatch.setattr(torch.Tensor, "data_ptr", _no_data_ptr)
        assert validation.validate_fwd_inputs(q, q, q, None) is None  # no address to check
    monkeypatch.undo()
    assert validation.pointer_unknown(torch.empty(2, device="meta"))
    real = torch.zeros(2 * 64 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64, 4, 64)
    assert not validation.pointer_unknown(real)
    with pytest.raises(ValueError, match=r"q data pointer must be 16-byte aligned"):
        validation.validate_fwd_inputs(real, real, real, None)


# ----------------------------------------------------------------------------------------
# torch.compile: a transformer block, fullgraph, dynamic sequence length
# ----------------------------------------------------------------------------------------


class CountingBackend:
    """aot_eager (AOT autograd traces the forward and, through the autograd formula, the
    backward, on fake tensors) recording each compile that dynamo hands over. A first
    compile may call the backend twice under one compile id: dynamo restarts its analysis
    once when a traced Python float (here the default softmax_scale of the symbolic head
    dim) is specialised; that is one compile, not a recompile."""

    def __init__(self):
        self.compile_ids = []
        self.ops = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        compile_id = torch._guards.CompileContext.current_compile_id()
        self.compile_ids.append((compile_id.frame_id, compile_id.frame_compile_id))

        def compiler(graph, _inputs):
            self.ops.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
            return make_boxed_func(graph.forward)

        return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)(gm, example_inputs)


def assert_one_graph_calling(backend: CountingBackend, *ops):
    """One dynamo compile (no graph break under fullgraph, no recompile) whose forward
    and backward graphs call these cute_attn ops."""
    assert set(backend.compile_ids) == {(0, 0)}, backend.compile_ids
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for op in ops:
        assert f"cute_attn.{op}.default" in backend.ops, f"no cute_attn::{op} in the graphs"


def _block(x, w_qkv, w_out, heads, mha):
    """qkv projection, causal attention, output projection, residual."""
    b, s, dim = x.shape
    q, k, v = (x @ w_qkv).view(b, s, 3, heads, dim // heads).unbind(2)
    o = mha(q, k, v, causal=True)
    return x + o.reshape(b, s, dim) @ w_out


def _block_inputs(seqlen, dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, seqlen, dim, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    w_qkv = (torch.randn(dim, 3 * dim, generator=g) / dim ** 0.5).to(torch.bfloat16).requires_grad_()
    w_out = (torch.randn(dim, dim, generator=g) / dim ** 0.5).to(torch.bfloat16).requires_grad_()
    return x, w_qkv, w_out


def test_compile_fullgraph_dynamic_no_recompile(stand_in):
    """A transformer block through cute_attn.mha under torch.compile(fullgraph=True,
    dynamic=True): validation and the entry point trace without a graph break (fullgraph
    would raise), the graph calls cute_attn::fwd and its backward cute_attn::bwd, and
    sequence lengths 80 and 96 reuse the graph compiled for 64. Results and gradients
    equal eager mha's (the direct path, the same CPU stand-in behind both)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = CountingBackend()
    compiled = torch.compile(lambda x, w1, w2: _block(x, w1, w2, 2, api.mha),
                             backend=backend, fullgraph=True, dynamic=True)
    try:
        for seqlen in (64, 80, 96):
            x, w_qkv, w_out = _block_inputs(seqlen, seed=seqlen)
            y = compiled(x, w_qkv, w_out)
            dy = torch.randn_like(y)
            y.backward(dy)
            grads = [t.grad for t in (x, w_qkv, w_out)]
            # eager, through the same ops and stand-in
            x2, w_qkv2, w_out2 = (t.detach().clone().requires_grad_() for t in (x, w_qkv, w_out))
            y2 = _block(x2, w_qkv2, w_out2, 2, api.mha)
            y2.backward(dy)
            torch.testing.assert_close(y, y2)
            for g, g2 in zip(grads, (x2.grad, w_qkv2.grad, w_out2.grad)):
                torch.testing.assert_close(g, g2)
        # one dynamo graph for three sequence lengths: no graph break (fullgraph), no
        # recompile; its forward and backward call the ops
        assert_one_graph_calling(backend, "fwd", "bwd")
        assert len(stand_in.fwd_calls) == 6 and len(stand_in.bwd_calls) == 6
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
@pytest.mark.parametrize("dynamic", [None, True], ids=["auto", "dynamic"])
def test_compile_fullgraph_with_a_float_argument(stand_in, name, dynamic):
    """A softmax_scale or softcap passed into the compiled function (a SymFloat under
    automatic or forced dynamic shapes) traces without a graph break: the checks compare
    instead of calling math.isfinite / struct. Each new value specialises the graph (the
    kernels take it as a float); results equal eager mha's."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 9, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    compiled = torch.compile(lambda q, k, v, x: api.mha(q, k, v, **{name: x}), backend="aot_eager",
                             fullgraph=True, dynamic=dynamic)
    try:
        for x in (0.1, 0.2, 0.3) if name == "softmax_scale" else (10.0, 20.0, 30.0):
            torch.testing.assert_close(compiled(q, k, v, x), api.mha(q, k, v, **{name: x}))
    finally:
        torch._dynamo.reset()


def test_compile_varlen_fullgraph(stand_in):
    """mha_varlen under torch.compile(fullgraph=True, dynamic=True): the offsets' values
    are not read while tracing (check_cu_seqlens=None skips them there), and new totals
    reuse the graph."""
    torch._dynamo.reset()
    backend = CountingBackend()

    def attend(q, k, v, cu, max_seqlen):
        return api.mha_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)

    compiled = torch.compile(attend, backend=backend, fullgraph=True, dynamic=True)
    try:
        for lengths in ((5, 11, 7), (9, 3, 20), (30, 2, 2)):
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            q, k, v = (_bshd(1, int(cu[-1]), 4, seed=i)[0].requires_grad_() for i in range(3))
            out = compiled(q, k, v, cu, max(lengths))
            out.sum().backward()
            q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
            out2 = attend(q2, k2, v2, cu, max(lengths))
            out2.sum().backward()
            torch.testing.assert_close(out, out2)
            for g, g2 in zip((q.grad, k.grad, v.grad), (q2.grad, k2.grad, v2.grad)):
                torch.testing.assert_close(g, g2)
        assert set(backend.compile_ids) == {(0, 0)}
        assert "cute_attn.fwd_varlen.default" in backend.ops and "cute_attn.bwd_varlen.default" in backend.ops
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------
# Eager: the op path (what a traced call takes) equals the direct path of cute_attn.mha
# ----------------------------------------------------------------------------------------


def _forced_through_ops(fn):
    """fn (api.mha / api.mha_varlen) with api._traced forced true: an eager call then
    takes the custom ops, as a traced one does."""

    def call(*args, **kwargs):
        saved = api._traced
        api._traced = lambda q: True
        try:
            return fn(*args, **kwargs)
        finally:
            api._traced = saved

    return call


ops_mha, ops_mha_varlen = _forced_through_ops(api.mha), _forced_through_ops(api.mha_varlen)


def assert_bitwise_twins(out_lse, out_lse2, leaves, twins):
    """Two (out, lse) of the same call on twin leaves are equal bit for bit, and so are
    the leaves' gradients after the same random dout."""
    out, out2 = out_lse[0], out_lse2[0]
    dout = torch.randn_like(out)
    out.backward(dout)
    out2.backward(dout)
    torch.testing.assert_close(out_lse, out_lse2, rtol=0, atol=0)
    for t, t2 in zip(leaves, twins):
        torch.testing.assert_close(t.grad, t2.grad, rtol=0, atol=0)


def test_eager_calls_launch_directly_traced_ones_through_the_op(stand_in, monkeypatch):
    q, k, v = (_bshd(1, 9, 2, seed=i) for i in range(3))
    calls = []
    monkeypatch.setattr(ops, "attention", lambda *a: calls.append(a) or (torch.empty_like(q), None))
    api.mha(q, k, v)
    assert calls == [] and len(stand_in.fwd_calls) == 1
    ops_mha(q, k, v)
    assert len(calls) == 1 and len(stand_in.fwd_calls) == 1


@pytest.mark.parametrize("kwargs", FEATURE_CASES + [dict(softmax_scale=0.3, deterministic=True)])
def test_ops_mha_matches_api_mha(stand_in, kwargs):
    """Same validation, same (features, run args) to the launcher, same results and
    gradients as cute_attn.mha with the same stand-in behind both."""
    inputs = [(_bshd(2, s, h, seed=i, requires_grad=True)) for i, (s, h) in enumerate(((9, 4), (11, 2), (11, 2)))]
    twins = [t.detach().clone().requires_grad_() for t in inputs]
    assert_bitwise_twins(ops_mha(*inputs, return_lse=True, **kwargs), api.mha(*twins, return_lse=True, **kwargs),
                         inputs, twins)
    fwd_a, fwd_b = stand_in.fwd_calls
    assert fwd_a["features"] == fwd_b["features"] and fwd_a["args"] == fwd_b["args"]
    bwd_a, bwd_b = stand_in.bwd_calls
    assert bwd_a["features"] == bwd_b["features"] and bwd_a["args"] == bwd_b["args"]
    assert bwd_a["deterministic"] is bwd_b["deterministic"] is kwargs.get("deterministic", False)
    # the expanded dout of .sum() is packed before the kernel, as api's
    ops_mha(*inputs).sum().backward()
    assert stand_in.bwd_calls[-1]["dout_stride"] == (9 * 4 * 64, 4 * 64, 64, 1)


def test_ops_mha_varlen_matches_api(stand_in):
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
    q = _bshd(1, 10, 4, seed=0)[0].requires_grad_()
    k, v = (_bshd(1, 12, 2, seed=i)[0].requires_grad_() for i in (1, 2))
    out, lse = ops_mha_varlen(q, k, v, cu_q, cu_k, 7, 5, window_size=(2, 1), return_lse=True)
    ref, ref_lse = attention_ref_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, window_size=(2, 1))
    torch.testing.assert_close(out, ref.to(out.dtype))
    torch.testing.assert_close(lse, ref_lse)
    args = stand_in.fwd_calls[0]["args"]
    assert (args.max_seqlen_q, args.max_seqlen_k, args.window) == (7, 5, (2, 1))
    with pytest.raises(ValueError, match="cu_seqlens_q must end at q's total tokens"):
        ops_mha_varlen(q, k, v, torch.tensor([0, 3, 3, 9], dtype=torch.int32), cu_k, 7, 5)


def test_empty_calls_stay_outside_the_op(stand_in, monkeypatch):
    monkeypatch.setattr(api, "_launcher_module", LauncherTrap())
    q = _bshd(2, 9, 4, requires_grad=True)
    k, v = (_bshd(2, 0, 2, seed=i, requires_grad=True) for i in (1, 2))
    out, lse = ops_mha(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.equal(lse, torch.full((2, 4, 9), float("-inf")))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_real_implementation_checks_pointers(stand_in):
    """What validation skipped while tracing, the real implementation checks: a
    misaligned q is rejected, a misaligned dout (autograd's) is packed."""
    q, k, v = (_bshd(2, 9, 4, seed=i) for i in range(3))
    bad = torch.zeros(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    with pytest.raises(ValueError, match=r"q data pointer must be 16-byte aligned .*storage offset 1"):
        torch.ops.cute_attn.fwd(bad, k, v, *_six({}))
    out, lse = torch.ops.cute_attn.fwd(q, k, v, *_six({}))
    dout = torch.zeros(out.numel() + 1, dtype=out.dtype)[1:].view(out.shape)
    dout.copy_(torch.randn(out.shape))
    grads = torch.ops.cute_attn.bwd(dout, q, k, v, out, lse, *_six({}))
    expected = torch.ops.cute_attn.bwd(dout.clone(), q, k, v, out, lse, *_six({}))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert stand_in.bwd_calls[0]["dout_aligned"] and stand_in.bwd_calls[0]["dout_stride"] == out.stride()


# ----------------------------------------------------------------------------------------
# The FP8 forward's op (cute_attn::fwd_fp8)
# ----------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


def test_fp8_schema():
    schema = str(torch.ops.cute_attn.fwd_fp8.default._schema)
    assert schema == ("cute_attn::fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor? q_descale, Tensor? k_descale, "
                      "Tensor? v_descale, Tensor? sink, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
                      "SymInt max_seqlen_k, ScalarType out_dtype, str mask, float softmax_scale, float softcap, "
                      "SymInt window_left, SymInt window_right) -> (Tensor, Tensor)")


@pytest.mark.parametrize("out_dtype", [None, torch.float16])
def test_fake_fp8_forward_dense_and_varlen(fake_sm90, no_data_ptr, out_dtype):
    """mha / mha_varlen on fake e4m3 CUDA tensors reach cute_attn::fwd_fp8's fake
    implementation (no launcher, no data_ptr): out in the output dtype and q's stride
    order, lse float32 as the 16-bit forwards'."""
    want = out_dtype or torch.bfloat16
    with FakeTensorMode():
        q = _fake_bhsd_as_bshd(2, 300, 8, 128, FP8, "cuda")
        k, v = (torch.empty(2, 500, 2, 128, dtype=FP8, device="cuda") for _ in range(2))
        descale = torch.empty(2, 2, device="cuda")
        out, lse = api.mha(q, k, v, causal=True, return_lse=True, q_descale=descale, k_descale=descale,
                           v_descale=descale, out_dtype=out_dtype)
        assert (out.shape, out.stride(), out.dtype) == (q.shape, q.stride(), want)
        assert (lse.shape, lse.dtype) == ((2, 8, 300), torch.float32)
        qp = torch.empty(700, 8, 128, dtype=FP8, device="cuda")
        kp, vp = (torch.empty(900, 2, 128, dtype=FP8, device="cuda") for _ in range(2))
        cu_q, cu_k = (torch.empty(4, dtype=torch.int32, device="cuda") for _ in range(2))
        out, lse = api.mha_varlen(qp, kp, vp, cu_q, cu_k, 400, 500, return_lse=True, out_dtype=out_dtype)
        assert (out.shape, out.dtype, lse.shape) == (qp.shape, want, (8, 700))
        sink = torch.empty(8, device="cuda")
        out, lse = api.mha(q, k, v, return_lse=True, q_descale=descale, learnable_sink=sink, out_dtype=out_dtype)
        assert (out.shape, out.dtype, lse.shape) == (q.shape, want, (2, 8, 300))


class _Fp8StandIn(StandInLauncher):
    """run_fwd_fp8 by the FP8 emulation (cute_attn.fp8), allocated like the launcher's."""

    def run_fwd_fp8(self, q, k, v, descales, policy, features, args, need_lse=True, sink=None):
        from cute_attn.fp8 import fp8_attention_emulated

        self.fwd_calls.append(dict(features=features, args=args, sink=sink))
        ref = ref_kwargs(features, args)
        o, l = fp8_attention_emulated(q, k, v, *descales, causal=ref["causal"], window_size=ref["window_size"],
                                      softcap=ref["softcap"], softmax_scale=ref["softmax_scale"], sink=sink)
        out = torch.empty_like(q, dtype=policy.output)
        out.copy_(o)
        lse = torch.empty(l.shape, dtype=torch.float32)
        lse.copy_(l)
        return out, lse


def test_compile_fp8_fullgraph_dynamic(monkeypatch):
    """An FP8 call under torch.compile(fullgraph=True, dynamic=True): no graph break, one
    graph calling cute_attn::fwd_fp8 for two sequence lengths, results equal eager mha's
    (the same CPU stand-in behind both)."""
    torch.library.register_kernel("cute_attn::fwd_fp8", "cpu", ops._fwd_fp8_impl)
    launcher = _Fp8StandIn()
    monkeypatch.setattr(api, "_launcher_module", launcher)
    monkeypatch.setattr(validation, "_check_devices", lambda tensors: None)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = CountingBackend()

    def attend(q, k, v, qd, kd, vd, sink):
        return api.mha(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, learnable_sink=sink)

    compiled = torch.compile(attend, backend=backend, fullgraph=True, dynamic=True)
    try:
        for seqlen in (48, 80):
            g = torch.Generator().manual_seed(seqlen)
            q, k, v = (torch.randn(2, seqlen, h, 64, generator=g).to(FP8) for h in (4, 2, 2))
            qd, kd, vd = (torch.rand(2, 2, generator=g) + 0.5 for _ in range(3))
            sink = torch.randn(4, generator=g)  # an attention sink through the op too
            with torch.no_grad():
                torch.testing.assert_close(compiled(q, k, v, qd, kd, vd, sink), attend(q, k, v, qd, kd, vd, sink))
        assert_one_graph_calling(backend, "fwd_fp8")
        assert launcher.fwd_calls[-1]["sink"] is not None and launcher.fwd_calls[-1]["features"].sink
    finally:
        torch._dynamo.reset()
