"""The autograd wiring of cute_attn.mha, checked without a GPU: the launcher is replaced
by a stand-in that computes with the fp32 reference on the CPU, so these tests see what
the autograd Function saves, passes and returns, not the kernels' numerics."""

import pytest
import torch

import cute_attn
import cute_attn.api as api
from cpu_standin import ref_kwargs, reference_grads
from cute_attn.reference import attention_ref
from cute_attn.validation import prepare_dout


class FakeLauncher:
    def __init__(self):
        self.bwd_calls = []

    def run_fwd(self, q, k, v, features, args, config=None, need_lse=True):
        kwargs = ref_kwargs(features, args)
        out, lse = attention_ref(q, k, v, **kwargs)
        return out.to(q.dtype), lse

    def run_bwd(self, dout, q, k, v, out, lse, features, args, deterministic=False, config=None):
        kwargs = ref_kwargs(features, args)
        self.bwd_calls.append(dict(dout=dout, out=out, lse=lse, causal=kwargs["causal"],
                                   softmax_scale=args.softmax_scale, deterministic=deterministic,
                                   kwargs=kwargs))
        return reference_grads(q, k, v, dout, kwargs)


@pytest.fixture
def fake(monkeypatch):
    launcher = FakeLauncher()
    monkeypatch.setattr(api, "_launcher_module", launcher)
    monkeypatch.setattr(api, "validate_fwd_inputs", lambda *a: None)  # CPU tensors
    return launcher


def _inputs(requires_grad=True):
    torch.manual_seed(0)
    return tuple(torch.randn(2, s, 3, 64, dtype=torch.float32).requires_grad_(requires_grad)
                 for s in (5, 7, 7))


def test_gradients_flow_to_q_k_v_with_the_call_settings(fake):
    q, k, v = _inputs()
    out = cute_attn.mha(q, k, v, causal=True, softmax_scale=0.3, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    (call,) = fake.bwd_calls
    assert call["causal"] is True and call["softmax_scale"] == 0.3 and call["deterministic"] is True
    assert torch.equal(call["dout"], dout)
    # saved tensors are the forward's own out and lse, not recomputed
    assert call["out"].shape == q.shape and call["lse"].shape == (2, 3, 5)
    q_ref, k_ref, v_ref = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o_ref, _ = attention_ref(q_ref, k_ref, v_ref, causal=True, softmax_scale=0.3)
    o_ref.backward(dout)
    for g, g_ref in zip((q.grad, k.grad, v.grad), (q_ref.grad, k_ref.grad, v_ref.grad)):
        torch.testing.assert_close(g, g_ref)


def test_double_backward_is_refused(fake):
    """The kernels' gradients are not differentiable: create_graph's second backward raises
    (once_differentiable), never a silently dropped second-order term."""
    q, k, v = _inputs()
    out = cute_attn.mha(q, k, v, causal=True)
    # dout = 2 out requires grad under create_graph: dq must carry the refusal, or the
    # sum below would silently lose dq's second-order term and keep q.sum()'s
    (dq,) = torch.autograd.grad((out ** 2).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (dq.sum() + q.sum()).backward()


def test_default_scale_is_inverse_sqrt_headdim(fake):
    q, k, v = _inputs()
    cute_attn.mha(q, k, v).sum().backward()
    assert fake.bwd_calls[0]["softmax_scale"] == 64 ** -0.5


def test_expanded_dout_is_packed_before_the_kernels(fake):
    q, k, v = _inputs()
    cute_attn.mha(q, k, v).sum().backward()  # autograd hands over a stride-0 dout
    dout = fake.bwd_calls[0]["dout"]
    assert dout.stride()[-1] == 1 and all(s % 8 == 0 for s in dout.stride()[:3])
    assert torch.equal(dout, torch.ones_like(dout))


def test_lse_is_returned_but_not_differentiable(fake):
    q, k, v = _inputs()
    out, lse = cute_attn.mha(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad


def test_no_autograd_node_without_requires_grad(fake):
    q, k, v = _inputs(requires_grad=False)
    out = cute_attn.mha(q, k, v)
    assert out.grad_fn is None
    q, k, v = _inputs()
    with torch.no_grad():
        assert cute_attn.mha(q, k, v).grad_fn is None


def test_dout_that_does_not_match_out_is_rejected():
    out = torch.zeros(2, 5, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dout"):
        prepare_dout(torch.zeros(2, 5, 3, 64, dtype=torch.float16), out)
    with pytest.raises(ValueError, match="dout"):
        prepare_dout(torch.zeros(2, 5, 3, 32, dtype=torch.bfloat16), out)
    ok = torch.zeros(2, 5, 3, 64, dtype=torch.bfloat16)
    assert prepare_dout(ok, out) is ok  # already TMA-addressable: no copy


@pytest.mark.parametrize("kwargs, expected", [
    (dict(window_size=(3, 0)), dict(causal=False, window_size=(3, 0), softcap=0.0)),
    (dict(window_size=(3, 5), causal=True), dict(causal=False, window_size=(3, 0), softcap=0.0)),
    (dict(window_size=(-1, 0)), dict(causal=True, window_size=(-1, -1), softcap=0.0)),
    (dict(softcap=5.0, causal=True), dict(causal=True, window_size=(-1, -1), softcap=5.0)),
    (dict(window_size=(-1, 2), softcap=2), dict(causal=False, window_size=(-1, 2), softcap=2.0)),
])
def test_window_and_softcap_reach_the_backward(fake, kwargs, expected):
    """The features of the call travel through autograd to the backward unchanged; a
    window that is causal becomes the causal kernel, causal clips the window's right."""
    q, k, v = _inputs()
    out = cute_attn.mha(q, k, v, softmax_scale=0.3, **kwargs)
    dout = torch.randn_like(out)
    out.backward(dout)
    (call,) = fake.bwd_calls
    assert call["kwargs"] == dict(expected, softmax_scale=0.3)
    q_ref, k_ref, v_ref = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o_ref, _ = attention_ref(q_ref, k_ref, v_ref, softmax_scale=0.3, **expected)
    o_ref.backward(dout)
    torch.testing.assert_close(out, o_ref)
    for g, g_ref in zip((q.grad, k.grad, v.grad), (q_ref.grad, k_ref.grad, v_ref.grad)):
        torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_forward_mode_ad_is_refused_not_dropped(fake, requires_grad):
    """A dual tensor's tangent never reaches the kernels (they read memory): refused, never
    a silent zero jvp (without requires_grad the call used to return out with no tangent)."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = _inputs(requires_grad=requires_grad)
    with fwAD.dual_level():
        qd = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode"):
            cute_attn.mha(qd, k, v)


def test_torch_func_transforms_are_refused_clearly(fake):
    """torch.func.grad / vmap wrap tensors without storage: a clear NotImplementedError,
    not 'Cannot access data pointer of Tensor that doesn't have storage'."""
    q, k, v = _inputs(requires_grad=False)
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.grad(lambda q: cute_attn.mha(q, k, v).sum())(q)
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.vmap(lambda q: cute_attn.mha(q[None], k[:1], v[:1])[0])(q)


def test_use_deterministic_algorithms_makes_the_backward_deterministic(fake, monkeypatch):
    """torch.use_deterministic_algorithms(True) turns deterministic on for the backward, as
    torch's own kernels read that flag; both the first call and the signature fast path."""
    monkeypatch.setattr(api, "_deterministic_algorithms", lambda: True)
    for _ in range(2):
        q, k, v = _inputs()
        cute_attn.mha(q, k, v, causal=True).float().sum().backward()
    assert [call["deterministic"] for call in fake.bwd_calls] == [True, True]
    monkeypatch.setattr(api, "_deterministic_algorithms", lambda: False)
    q, k, v = _inputs()
    cute_attn.mha(q, k, v, causal=True).float().sum().backward()
    assert fake.bwd_calls[-1]["deterministic"] is False
