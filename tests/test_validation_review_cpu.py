"""Review of mha / mha_varlen input checks with unusual-but-plausible tensors, on the CPU.

Each call either raises a TypeError/ValueError naming the argument before the launcher is
reached, or reaches a stand-in launcher; the signature fast path (api._plain_calls) must
never answer a call that the full checks would refuse. Devices are faked as in
tests/test_validation.py (cpu_standin.FakeCuda, capability monkeypatched to sm_90).
"""

import sys
import types

import numpy as np
import pytest
import torch

import cute_attn
from cpu_standin import LauncherTrap, fake_cuda
from test_validation import _varlen  # a packed batch with an empty sequence
from cute_attn import api, validation


@pytest.fixture
def sm90(monkeypatch):
    """Every CUDA device is an sm_90 one; the launcher fails the test when reached."""
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    trap = LauncherTrap(" for inputs that should have been refused")
    monkeypatch.setitem(sys.modules, "cute_attn.launcher", trap)
    monkeypatch.setattr(api, "_launcher_module", trap)
    monkeypatch.setattr(api, "_plain_calls", {})


def _qkv(b=2, sq=16, sk=24, h=4, h_kv=4, d=64, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, h_kv, d, dtype=dtype),
            torch.randn(b, sk, h_kv, d, dtype=dtype))


def _cuda(*tensors):
    return tuple(fake_cuda(t) for t in tensors)


class _Wrapper(torch.Tensor):
    """A wrapper tensor subclass (DTensor's kind): metadata on cuda:0, data in an inner
    tensor, no storage of its own; any op on it fails (nothing may dispatch on it)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device="cuda:0")

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} dispatched on a wrapper subclass")


# --- findings fixed in this review ------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_wrapper_subclass_without_storage_is_refused(sm90, name):
    """Its data pointer reads 0, which passed the alignment test: the launcher got a null
    address (an illegal memory access on a GPU, FA would dispatch it to the subclass)."""
    tensors = dict(zip("qkv", _cuda(*_qkv())))
    tensors[name] = _Wrapper(tensors[name].as_subclass(torch.Tensor))
    assert tensors[name].data_ptr() == 0 and tensors[name].device.type == "cuda"
    with pytest.raises(ValueError, match=rf"^{name} has no memory of its own \(data pointer 0 .*_Wrapper.*to_local"):
        cute_attn.mha(*tensors.values())


def test_wrapper_subclass_refused_by_mha_varlen(sm90):
    q, k, v, cu_q, cu_k = _cuda(*_varlen())
    with pytest.raises(ValueError, match=r"^k has no memory of its own"):
        cute_attn.mha_varlen(q, _Wrapper(k.as_subclass(torch.Tensor)), v, cu_q, cu_k, 5, 5)


def test_empty_wrapper_subclass_still_needs_no_kernel(sm90):
    """No elements: a null address is what an empty tensor has, and no kernel reads it."""
    q, k, v = _cuda(*_qkv(b=0))
    assert validation.validate_fwd_inputs(_Wrapper(q.as_subclass(torch.Tensor)), k, v, None) is True


def _jagged(lens=(16, 9), h=4, d=64):
    return torch.nested.nested_tensor([torch.randn(n, h, d, dtype=torch.bfloat16) for n in lens],
                                      layout=torch.jagged)


def test_jagged_nested_tensor_is_refused_with_the_varlen_hint(sm90):
    """A jagged nested tensor (what SDPA takes for packed batches) passed the rank and
    shape checks and failed inside torch's symbolic sizes (AttributeError 'NestedIntNode')."""
    q = _jagged()
    k = _jagged((24, 5))
    with pytest.raises(TypeError, match=r"^q is a nested tensor \(layout torch.jagged\); .*mha_varlen"):
        cute_attn.mha(q, q, q)
    with pytest.raises(TypeError, match=r"^k is a nested tensor"):
        cute_attn.mha(_cuda(*_qkv(b=2))[0], k, k)
    _, _, _, cu_q, cu_k = _varlen()
    with pytest.raises(TypeError, match=r"^q is a nested tensor .*\.values\(\)"):
        cute_attn.mha_varlen(q, q, q, cu_q, cu_k, 16, 16)


def test_sparse_tensors_are_refused_by_layout(sm90):
    """torch reports a sparse tensor's strides as zeros: it was refused as an "expanded
    (broadcast)" tensor, and sparse offsets as "not contiguous, stride 0"."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^q must be a dense \(torch.strided\) tensor, got layout "
                                        r"torch.sparse_coo; call .to_dense\(\)"):
        cute_attn.mha(q.to_sparse(), k, v)
    q, k, v, cu_q, cu_k = _varlen()
    with pytest.raises(TypeError, match=r"^cu_seqlens_k must be a dense \(torch.strided\) tensor"):
        cute_attn.mha_varlen(*_cuda(q, k, v, cu_q), cu_k.to_sparse(), 5, 5)


# --- unusual inputs that were already handled (regression guards) --------------------

@pytest.mark.parametrize("case, exc, msg", [
    ("expand k heads (MQA broadcast)", ValueError, r"^k strides must be nonzero .*nheads.*GQA/MQA"),
    ("expand v batch", ValueError, r"^v strides must be nonzero .*dim 0 \(batch"),
    ("expand k seqlen", ValueError, r"^k strides must be nonzero .*dim 1 \(seqlen"),
    ("neg view", ValueError, r"^k is a negative-bit view"),
    ("row stride 68", ValueError, r"^q strides must be multiples of 8 elements"),
    ("size-1 batch, odd stride", ValueError, r"^q strides must be multiples of 8 elements"),
    ("offset 1", ValueError, r"^q data pointer must be 16-byte aligned .*storage offset 1"),
    ("last dim strided", ValueError, r"^q must be contiguous in the last dimension"),
    ("float32", TypeError, r"^q must be torch.float16 or torch.bfloat16, got torch.float32; cast"),
    ("float64", TypeError, r"^q must be torch.float16 or torch.bfloat16, got torch.float64"),
    ("int32", TypeError, r"^q must be torch.float16 or torch.bfloat16, got torch.int32"),
    ("v float16", TypeError, r"^v must have the same dtype as q \(torch.bfloat16\), got torch.float16"),
    ("headdim 0", ValueError, r"^q headdim must be one of"),
])
def test_unusual_dense_inputs_are_named_before_the_launch(sm90, case, exc, msg):
    q, k, v = _qkv()
    if case.startswith("expand k heads"):
        k = k[:, :, :1].expand(-1, -1, 4, -1)
    elif case == "expand v batch":
        v = v[:1].expand(2, -1, -1, -1)
    elif case == "expand k seqlen":
        k = k[:, :1].expand(-1, 24, -1, -1)
    elif case == "neg view":
        k = torch._neg_view(k)
    elif case == "row stride 68":
        q = torch.randn(2, 16, 4, 68, dtype=torch.bfloat16)[..., :64]
    elif case == "size-1 batch, odd stride":
        q, k, v = q[:1].as_strided((1, 16, 4, 64), (3, 256, 64, 1)), k[:1], v[:1]
    elif case == "offset 1":
        q = torch.randn(q.numel() + 8, dtype=torch.bfloat16)[1:1 + q.numel()].view(q.shape)
    elif case == "last dim strided":
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif case in ("float32", "float64", "int32"):
        q, k, v = (t.to(getattr(torch, case)) for t in (q, k, v))
    elif case == "v float16":
        v = v.half()
    elif case == "headdim 0":
        q, k, v = _qkv(d=0)
    with pytest.raises(exc, match=msg):
        cute_attn.mha(*_cuda(q, k, v))


def test_float32_under_autocast_is_still_refused(sm90):
    """mha does not autocast (neither does FlashAttention): a float32 call is a TypeError."""
    q, k, v = _cuda(*(t.float() for t in _qkv()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"^q must be torch.float16 or torch.bfloat16, got torch.float32"):
            cute_attn.mha(q, k, v)


@pytest.mark.parametrize("case, exc, msg", [
    ("cu int64", TypeError, r"^cu_seqlens_q must be torch.int32, got torch.int64"),
    ("cu on cpu", ValueError, r"^cu_seqlens_q is on cpu but q is on cuda:0"),
    ("cu on cuda:1", ValueError, r"^cu_seqlens_k is on cuda:1 but q is on cuda:0"),
    ("cu strided", ValueError, r"^cu_seqlens_q must be contiguous, got stride 2"),
    ("cu lengths differ", ValueError, r"^cu_seqlens_k must have the same length as cu_seqlens_q"),
    ("max_seqlen_q short", ValueError, r"^max_seqlen_q must be >= the longest sequence in cu_seqlens_q \(5\), got 4"),
    ("max_seqlen_k short", ValueError, r"^max_seqlen_k must be >= the longest sequence in cu_seqlens_k \(5\), got 4"),
    ("total_q mismatch", ValueError, r"^cu_seqlens_q must end at q's total tokens \(7\), got 8"),
    ("max_seqlen tensor", TypeError, r"^max_seqlen_q must be a Python int, got Tensor"),
])
def test_unusual_varlen_inputs_are_named_before_the_launch(sm90, case, exc, msg):
    q, k, v, cu_q, cu_k = _varlen()
    max_q = max_k = 5
    devices = {}
    if case == "cu int64":
        cu_q = cu_q.long()
    elif case == "cu on cpu":
        devices["cu_seqlens_q"] = None
    elif case == "cu on cuda:1":
        devices["cu_seqlens_k"] = 1
    elif case == "cu strided":
        cu_q = torch.stack([cu_q, cu_q], 1)[:, 0]
    elif case == "cu lengths differ":
        cu_q = cu_q[:3]
    elif case == "max_seqlen_q short":
        max_q = 4
    elif case == "max_seqlen_k short":
        max_k = 4
    elif case == "total_q mismatch":
        q = q[:-1]
    elif case == "max_seqlen tensor":
        max_q = torch.tensor(5)
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    for name, t in args.items():
        index = devices.get(name, 0)
        args[name] = t if index is None else fake_cuda(t, index)
    with pytest.raises(exc, match=msg):
        cute_attn.mha_varlen(*args.values(), max_q, max_k)


# --- the signature fast path: what a signature leaves open is tested per call ----------

@pytest.fixture
def cached(monkeypatch):
    """A valid plain call's signature in api._plain_calls (CPU tensors: the tests reach
    the stored entry directly), answering "fast"; the full path's checks fail on the CPU
    device unless they refuse the call first."""
    q, k, v = _qkv()
    answered = []
    monkeypatch.setattr(api, "_plain_calls", {})
    api._plain_calls[api._plain_signature(q, k, v, False, None)] = lambda *args: answered.append(args) or "fast"
    assert cute_attn.mha(q, k, v) == "fast"
    return q, k, v, answered


def _misaligned(t, elems):
    flat = torch.randn(t.numel() + 16, dtype=t.dtype)
    return flat[elems:elems + t.numel()].view(t.shape)


@pytest.mark.parametrize("case, msg", [
    ("k 2 bytes off", r"^k data pointer must be 16-byte aligned"),
    ("v 8 bytes off", r"^v data pointer must be 16-byte aligned"),
    ("neg view of q", r"^q is a negative-bit view"),
    ("v float16", r"^v must have the same dtype as q"),
    ("k expanded on heads", r"^k strides must be nonzero"),
])
def test_fast_path_never_answers_a_call_the_checks_refuse(cached, case, msg):
    q, k, v, answered = cached
    if case == "k 2 bytes off":
        k = _misaligned(k, 1)
    elif case == "v 8 bytes off":
        v = _misaligned(v, 4)
    elif case == "neg view of q":
        q = torch._neg_view(q)
    elif case == "v float16":
        v = v.half()
    elif case == "k expanded on heads":
        k = k[:, :, :1].expand(-1, -1, 4, -1)
    assert (q.shape, k.shape, v.shape) == (answered[0][0].shape, answered[0][1].shape, answered[0][2].shape)
    with pytest.raises((TypeError, ValueError), match=msg):
        cute_attn.mha(q, k, v)
    assert len(answered) == 1


def test_fast_path_key_names_the_device_index():
    """Another GPU with the same shapes is another signature (get_device() and is_cuda
    are in the key): a CPU tensor's key differs from a CUDA-tagged one only there."""
    q, k, v = _qkv()
    key = api._plain_signature(q, k, v, False, None)
    assert key[9:13] == (-1, -1, -1, False)


def test_fast_path_takes_no_subclass(cached):
    """A subclass (Parameter, a wrapper) never matches: the full path checks it."""
    q, k, v, answered = cached
    with pytest.raises(ValueError, match=r"^q is on cpu"):
        cute_attn.mha(torch.nn.Parameter(q), k, v)
    with pytest.raises(ValueError, match=r"^k has no memory of its own"):
        cute_attn.mha(q, _Wrapper(k), v)
    assert len(answered) == 1


def test_grad_inputs_under_no_grad_and_inference_mode_launch_plain(monkeypatch):
    """requires_grad under no_grad / inference_mode: a forward launch, no autograd node."""
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    stub = types.ModuleType("cute_attn.launcher")
    launched = []

    def run_fwd(q, k, v, features, args, config=None, need_lse=True):
        launched.append(need_lse)
        return torch.zeros(q.shape, dtype=q.dtype), None

    stub.run_fwd = run_fwd
    monkeypatch.setitem(sys.modules, "cute_attn.launcher", stub)
    monkeypatch.setattr(api, "_launcher_module", stub)
    q, k, v = _cuda(*_qkv())
    q.requires_grad_()
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            out = cute_attn.mha(q, q, q)  # aliased inputs too (self-attention on one tensor)
        assert out.grad_fn is None
    assert launched == [False, False]


def test_check_cu_seqlens_true_reads_the_offsets_again(monkeypatch):
    """check_cu_seqlens=True is the way to catch offsets rewritten behind torch's version
    counter (through .data, or by a kernel): it must read them even when this tensor, at
    this version, was checked before."""
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    q, k, v = (fake_cuda(torch.randn(10, 2, 64, dtype=torch.bfloat16)) for _ in range(3))
    cu = fake_cuda(torch.tensor([0, 5, 10], dtype=torch.int32))
    validation.validate_varlen_fwd_inputs(q, k, v, cu, cu, 5, 5, None, None)
    cu.data[1] = 99  # no version bump
    validation.validate_varlen_fwd_inputs(q, k, v, cu, cu, 5, 5, None, None)  # remembered: not read
    with pytest.raises(ValueError, match="non-decreasing"):
        validation.validate_varlen_fwd_inputs(q, k, v, cu, cu, 5, 5, None, True)


@pytest.mark.parametrize("check", [False, None])
def test_a_max_seqlen_below_total_over_batch_is_refused_without_reading_offsets(monkeypatch, check):
    """10 tokens in 2 sequences: one is at least 5 long, so max_seqlen_q 4 (or 0) is wrong
    whatever the offsets; refused on the host even when the offsets are not read (under
    capture, or check_cu_seqlens=False), where it would leave rows of out unwritten."""
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(validation, "_capturing_cuda_graph", lambda: True)
    q, k, v = (fake_cuda(torch.randn(10, 2, 64, dtype=torch.bfloat16)) for _ in range(3))
    cu = fake_cuda(torch.tensor([0, 5, 10], dtype=torch.int32))
    validation.validate_varlen_fwd_inputs(q, k, v, cu, cu, 5, 5, None, check)
    for bad in (dict(max_seqlen_q=4), dict(max_seqlen_k=0)):
        args = {"max_seqlen_q": 5, "max_seqlen_k": 5, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            validation.validate_varlen_fwd_inputs(q, k, v, cu, cu, args["max_seqlen_q"], args["max_seqlen_k"],
                                                  None, check)
