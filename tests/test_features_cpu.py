"""Argument checks of cute_attn.mha and cute_attn.mha_varlen for GQA/MQA, sliding windows,
softcap and variable-length batches (issue 4), on CPU tensors: no GPU needed.

The rule: a bad argument raises TypeError (wrong kind of thing) or ValueError (right kind,
wrong value) whose message names the argument, before anything is compiled or launched.
Every test runs with the launcher's compile and launch entry points replaced by a trap
(the autouse `no_kernels` fixture; pytest.fail is no Exception, so no pytest.raises can
swallow it), and asserts on the message of the specific error, so that any other check
firing first fails the test.

Each bad argument is tried in two device setups:
- "cpu": plain CPU tensors. Everything that can be judged on a CPU tensor is judged before
  the device checks (cute_attn/validation.py's order), so the error under test must come
  before "q is on cpu; cute_attn needs CUDA tensors".
- "sm90": CPU tensors that report cuda:0, on a device whose capability is monkeypatched to
  sm_90: the device checks pass, which isolates the check under test.
The values of cu_seqlens (start at 0, non-decreasing, end at the totals, max_seqlen at
least the longest sequence) are read on the host by default, last, after every other
check: with CPU tensors the device error comes first, so those cases run in the "sm90"
setup only. check_cu_seqlens=False, or a CUDA graph being captured, skips the read
(test_cu_seqlens_values_not_read_when_told_or_capturing).
"""

import re

import numpy as np
import pytest
import torch

from cpu_standin import FakeCuda as _FakeCuda
from cpu_standin import fake_cuda as _fake_cuda
import cute_attn
from cute_attn import api, launcher, validation

CPU_ERROR = "q is on cpu; cute_attn needs CUDA tensors"
SETUPS = ["cpu", "sm90"]




class _NoHostRead(_FakeCuda):
    """A fake CUDA tensor whose values must not be read on the host (a sync on a GPU)."""

    def _read(self, *args, **kwargs):
        raise AssertionError("cu_seqlens values read on the host for a GPU call")

    tolist = item = cpu = numpy = __int__ = __index__ = __bool__ = __iter__ = _read


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    def trap(*args, **kwargs):
        pytest.fail("reached the launcher: the inputs should have been rejected first")

    for name in ("run_fwd", "run_bwd", "compile_fwd", "compile_bwd", "get_fwd_kernel",
                 "get_bwd_kernels"):
        monkeypatch.setattr(launcher, name, trap, raising=False)
    # mha caches the launcher module after its first use; make it this (trapped) one
    monkeypatch.setattr(api, "_launcher_module", launcher, raising=False)
    compiled = dict(launcher._cache)
    yield
    assert launcher._cache == compiled, "something was compiled"


def _on(setup, monkeypatch, *tensors):
    """The tensors as the setup wants them (see the module docstring)."""
    if setup == "cpu":
        return tensors
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    return tuple(_fake_cuda(t) if isinstance(t, torch.Tensor) else t for t in tensors)


# ------------------------------------------------------------------------------------ mha

def _qkv(b=2, sq=16, sk=24, h=8, h_k=2, h_v=None, d=64, dtype=torch.bfloat16, q_dims=4):
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, dtype=dtype)
    if q_dims == 3:
        q = q[0]
    elif q_dims == 5:
        q = q[None]
    k = torch.randn(b, sk, h_k, d, dtype=dtype)
    v = torch.randn(b, sk, h_k if h_v is None else h_v, d, dtype=dtype)
    return q, k, v


# Bad feature keywords, shared by mha and mha_varlen: (id, kwargs, exception, message).
BAD_KWARGS = [
    ("window-None", dict(window_size=None), TypeError,
     r"window_size must be a \(left, right\) tuple of ints, -1 for unbounded, got NoneType"),
    ("window-int", dict(window_size=8), TypeError, r"window_size must be a \(left, right\) tuple .*got int"),
    ("window-str", dict(window_size="-1,-1"), TypeError, r"window_size must be a \(left, right\) tuple .*got str"),
    ("window-3-entries", dict(window_size=(1, 2, 3)), ValueError,
     r"window_size must have 2 entries \(left, right\), got 3"),
    ("window-1-entry", dict(window_size=(4,)), ValueError, r"window_size must have 2 entries \(left, right\), got 1"),
    ("window-float", dict(window_size=(1.0, 2)), TypeError,
     r"window_size left must be an int \(-1 for unbounded\), got float"),
    ("window-bool", dict(window_size=(1, True)), TypeError, r"window_size right must be an int .*got bool"),
    ("window-tensor", dict(window_size=(torch.tensor(3), 0)), TypeError,
     r"window_size left must be an int .*got Tensor"),
    ("window-left-below-1", dict(window_size=(-2, 0)), ValueError,
     r"window_size left must be >= -1 \(-1 for unbounded\), got -2"),
    ("window-right-below-1", dict(window_size=(0, -5)), ValueError,
     r"window_size right must be >= -1 \(-1 for unbounded\), got -5"),
    # causal overrides right, but the given window is still checked
    ("window-bad-right-with-causal", dict(window_size=(4, -3), causal=True), ValueError,
     r"window_size right must be >= -1 .*got -3"),
    ("softcap-negative", dict(softcap=-1.0), ValueError,
     r"softcap must be 0 \(off\) or a finite positive number, got -1.0"),
    ("softcap-negative-int", dict(softcap=-2), ValueError, r"softcap must be 0 \(off\) or a finite positive number, got -2"),
    ("softcap-nan", dict(softcap=float("nan")), ValueError, r"softcap must be 0 \(off\) .*got nan"),
    ("softcap-inf", dict(softcap=float("inf")), ValueError, r"softcap must be 0 \(off\) .*got inf"),
    ("softcap-str", dict(softcap="30"), TypeError, r"softcap must be a Python float/int \(0 for off\), got str"),
    ("softcap-bool", dict(softcap=True), TypeError, r"softcap must be a Python float/int .*got bool"),
    ("softcap-tensor", dict(softcap=torch.tensor(30.0)), TypeError, r"softcap must be a Python float/int .*got Tensor"),
    ("softcap-None", dict(softcap=None), TypeError, r"softcap must be a Python float/int .*got NoneType"),
]
BAD_KWARGS = [pytest.param(kw, exc, msg, id=i) for i, kw, exc, msg in BAD_KWARGS]

# Bad tensors for mha: (id, _qkv arguments, exception, message).
BAD_MHA_TENSORS = [
    ("nheads-not-divisible", dict(h=8, h_k=3), ValueError,
     r"k nheads must divide q nheads \(8\): .*GQA/MQA\), got 3"),
    ("more-kv-heads-than-q", dict(h=4, h_k=8), ValueError, r"k nheads must divide q nheads \(4\): .*got 8"),
    ("k-v-heads-differ", dict(h=8, h_k=2, h_v=4), ValueError, r"v nheads must equal k nheads \(2\), got 4"),
    ("k-v-heads-differ-mqa", dict(h=8, h_k=1, h_v=2), ValueError, r"v nheads must equal k nheads \(1\), got 2"),
    ("q-3d", dict(q_dims=3), ValueError,
     re.escape("q must have shape (batch, seqlen, nheads, headdim), got shape (16, 8, 64) (3 dims)")),
    ("q-5d", dict(q_dims=5), ValueError, r"q must have shape \(batch, seqlen, nheads, headdim\), got shape \(1, 2, 16, 8, 64\)"),
]
BAD_MHA_TENSORS = [pytest.param(args, exc, msg, id=i) for i, args, exc, msg in BAD_MHA_TENSORS]


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("kwargs, exc, msg", BAD_KWARGS)
def test_mha_bad_feature_argument(monkeypatch, setup, kwargs, exc, msg):
    q, k, v = _on(setup, monkeypatch, *_qkv())
    with pytest.raises(exc, match=msg):
        cute_attn.mha(q, k, v, **kwargs)


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("args, exc, msg", BAD_MHA_TENSORS)
def test_mha_bad_tensors(monkeypatch, setup, args, exc, msg):
    q, k, v = _on(setup, monkeypatch, *_qkv(**args))
    with pytest.raises(exc, match=msg):
        cute_attn.mha(q, k, v, window_size=(8, 0), softcap=5.0)


@pytest.mark.parametrize("kwargs", [
    dict(h=8, h_k=8), dict(h=8, h_k=4), dict(h=8, h_k=1), dict(h=6, h_k=3),
], ids=["mha", "gqa2", "mqa", "gqa-odd"])
@pytest.mark.parametrize("features", [
    dict(), dict(causal=True), dict(window_size=(5, 7)), dict(window_size=[0, 0]),
    dict(window_size=(np.int64(256), -1), causal=True), dict(window_size=(-1, 33)),
    dict(softcap=30.0), dict(softcap=5), dict(softcap=np.float32(5.0), window_size=(64, 64)),
    dict(softcap=0), dict(deterministic=True, return_lse=True, window_size=(3, 0)),
], ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "defaults")
def test_mha_valid_features_reach_the_device_check(kwargs, features):
    """Accepted arguments are not rejected by the feature checks: with CPU tensors, the
    device check is the one error left."""
    q, k, v = _qkv(**kwargs)
    with pytest.raises(ValueError, match=CPU_ERROR):
        cute_attn.mha(q, k, v, **features)


# ----------------------------------------------------------------------------- mha_varlen

LENS_Q, LENS_K = (3, 0, 5), (4, 2, 5)  # totals 8 and 11, batch 3, longest 5 and 5


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


def _varlen(h=8, h_kv=2, d=64):
    """Valid mha_varlen arguments, as a dict (CPU tensors)."""
    torch.manual_seed(0)
    total_q, total_k = sum(LENS_Q), sum(LENS_K)
    return dict(
        q=torch.randn(total_q, h, d, dtype=torch.bfloat16),
        k=torch.randn(total_k, h_kv, d, dtype=torch.bfloat16),
        v=torch.randn(total_k, h_kv, d, dtype=torch.bfloat16),
        cu_seqlens_q=_cu([0, 3, 3, 8]),
        cu_seqlens_k=_cu([0, 4, 6, 11]),
        max_seqlen_q=max(LENS_Q),
        max_seqlen_k=max(LENS_K),
    )


_VARLEN_ORDER = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _call_varlen(args, **kwargs):
    return cute_attn.mha_varlen(*(args[n] for n in _VARLEN_ORDER), **kwargs)


# (id, argument ("kv": k and v), replacement (a value or a function of the valid one),
#  exception, message,
#  values: True when the check needs the values of cu_seqlens, read last)
BAD_VARLEN = [
    ("q-4d", "q", lambda t: t[None], ValueError,
     r"q must have shape \(total_tokens, nheads, headdim\) for varlen, got shape \(1, 8, 8, 64\) \(4 dims\)", False),
    ("k-4d", "k", lambda t: t[None], ValueError, r"k must have shape \(total_tokens, nheads, headdim\) for varlen", False),
    ("q-2d", "q", lambda t: t[:, 0], ValueError, r"q must have shape \(total_tokens, nheads, headdim\) for varlen, got shape \(8, 64\)", False),
    ("nheads-not-divisible", "kv", lambda t: torch.zeros(11, 3, 64, dtype=t.dtype), ValueError,
     r"k nheads must divide q nheads \(8\): .*GQA/MQA\), got 3", False),
    ("more-kv-heads-than-q", "kv", lambda t: torch.zeros(11, 16, 64, dtype=t.dtype), ValueError,
     r"k nheads must divide q nheads \(8\): .*got 16", False),
    ("k-v-heads-differ", "v", lambda t: torch.zeros(11, 4, 64, dtype=t.dtype), ValueError,
     r"v nheads must equal k nheads \(2\), got 4", False),
    ("cu_q-list", "cu_seqlens_q", [0, 3, 3, 8], TypeError, r"cu_seqlens_q must be a torch.Tensor, got list", False),
    ("cu_q-int64", "cu_seqlens_q", lambda t: t.long(), TypeError,
     r"cu_seqlens_q must be torch.int32, got torch.int64; cast with .to\(torch.int32\)", False),
    ("cu_k-int64", "cu_seqlens_k", lambda t: t.long(), TypeError, r"cu_seqlens_k must be torch.int32, got torch.int64", False),
    ("cu_k-2d", "cu_seqlens_k", lambda t: t[None], ValueError,
     r"cu_seqlens_k must be 1-D \(batch \+ 1 offsets\), got shape \(1, 4\)", False),
    ("cu_q-2d", "cu_seqlens_q", lambda t: torch.stack([t, t]), ValueError, r"cu_seqlens_q must be 1-D .*got shape \(2, 4\)", False),
    ("cu_q-length-1", "cu_seqlens_q", lambda t: t[:1], ValueError,
     r"cu_seqlens_q must have length batch \+ 1 >= 2, got length 1", False),
    ("cu_k-shorter-than-cu_q", "cu_seqlens_k", lambda t: t[:3], ValueError,
     r"cu_seqlens_k must have the same length as cu_seqlens_q \(batch \+ 1 = 4\), got 3", False),
    ("cu_k-longer-than-cu_q", "cu_seqlens_k", _cu([0, 4, 6, 11, 11]), ValueError,
     r"cu_seqlens_k must have the same length as cu_seqlens_q \(batch \+ 1 = 4\), got 5", False),
    ("max_q-negative", "max_seqlen_q", -1, ValueError, r"max_seqlen_q must be >= 0, got -1", False),
    ("max_k-negative", "max_seqlen_k", -5, ValueError, r"max_seqlen_k must be >= 0, got -5", False),
    ("max_q-float", "max_seqlen_q", 5.0, TypeError, r"max_seqlen_q must be a Python int, got float", False),
    ("max_k-str", "max_seqlen_k", "5", TypeError, r"max_seqlen_k must be a Python int, got str", False),
    ("max_q-bool", "max_seqlen_q", True, TypeError, r"max_seqlen_q must be a Python int, got bool", False),
    ("max_k-tensor", "max_seqlen_k", torch.tensor(5), TypeError, r"max_seqlen_k must be a Python int, got Tensor", False),
    ("max_q-None", "max_seqlen_q", None, TypeError, r"max_seqlen_q must be a Python int", False),
    # the values: read on the host after every other check
    ("cu_q-not-from-0", "cu_seqlens_q", _cu([1, 3, 3, 8]), ValueError, r"cu_seqlens_q must start at 0, got 1", True),
    ("cu_k-not-from-0", "cu_seqlens_k", _cu([2, 4, 6, 11]), ValueError, r"cu_seqlens_k must start at 0, got 2", True),
    ("cu_q-decreasing", "cu_seqlens_q", _cu([0, 5, 3, 8]), ValueError,
     r"cu_seqlens_q must be non-decreasing, got 5 then 3 at index 1", True),
    ("cu_k-decreasing", "cu_seqlens_k", _cu([0, 4, 11, 6]), ValueError,
     r"cu_seqlens_k must be non-decreasing, got 11 then 6 at index 2", True),
    ("cu_q-wrong-total", "cu_seqlens_q", _cu([0, 3, 3, 9]), ValueError,
     r"cu_seqlens_q must end at q's total tokens \(8\), got 9", True),
    ("cu_k-wrong-total", "cu_seqlens_k", _cu([0, 4, 6, 10]), ValueError,
     r"cu_seqlens_k must end at k's total tokens \(11\), got 10", True),
    ("max_q-below-longest", "max_seqlen_q", 4, ValueError,
     r"max_seqlen_q must be >= the longest sequence in cu_seqlens_q \(5\), got 4", True),
    ("max_k-zero", "max_seqlen_k", 0, ValueError,
     r"max_seqlen_k must be >= the longest sequence in cu_seqlens_k \(5\), got 0", True),
]
BAD_VARLEN = [pytest.param(name, new, exc, msg, values, id=i)
              for i, name, new, exc, msg, values in BAD_VARLEN]


def _varlen_on(setup, monkeypatch, args):
    """args with q, k, v and cu_seqlens as the setup wants them (max_seqlen untouched)."""
    tensors = _VARLEN_ORDER[:5]
    return {**args, **dict(zip(tensors, _on(setup, monkeypatch, *(args[n] for n in tensors))))}


# the cases that need cu_seqlens' values run in the "sm90" setup only (module docstring)
@pytest.mark.parametrize("setup, name, new, exc, msg", [
    pytest.param(setup, *case.values[:4], id=f"{setup}-{case.id}")
    for setup in SETUPS for case in BAD_VARLEN if setup == "sm90" or not case.values[4]
])
def test_mha_varlen_bad_argument(monkeypatch, setup, name, new, exc, msg):
    args = _varlen()
    for n in ("k", "v") if name == "kv" else (name,):  # "kv": both k and v
        args[n] = new(args[n]) if callable(new) else new
    args = _varlen_on(setup, monkeypatch, args)
    with pytest.raises(exc, match=msg):
        _call_varlen(args, causal=True, window_size=(8, 0), softcap=5.0)


def _rows_of(t, width):
    """t's values in rows of width elements (a view of a wider buffer)."""
    buf = torch.zeros(*t.shape[:-1], width, dtype=t.dtype)
    buf[..., :t.shape[-1]] = t
    return buf[..., :t.shape[-1]]


def _shifted(t):
    """t's values at a 2-byte storage offset (strides unchanged)."""
    return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)


# The checks mha_varlen shares with mha (one copy in validation), on packed tensors:
# (id, edit of the valid arguments, mha_varlen keywords, exception, message).
BAD_VARLEN_OPERANDS = [
    ("q-fp32", dict(q=lambda t: t.float()), {}, TypeError,
     r"q must be torch.float16 or torch.bfloat16, got torch.float32; cast"),
    ("v-fp16", dict(v=lambda t: t.half()), {}, TypeError,
     r"v must have the same dtype as q \(torch.bfloat16\), got torch.float16"),
    ("headdim-80", {n: (lambda t: t.new_zeros(*t.shape[:-1], 80)) for n in "qkv"}, {}, ValueError,
     r"q headdim must be one of \(64, 96, 128, 192, 256\), got 80"),
    ("k-last-dim-strided", dict(k=lambda t: torch.cat([t, t], -1)[..., ::2]), {}, ValueError,
     r"k must be contiguous in the last dimension, got strides \(.*, 2\)"),
    ("q-rows-of-68", dict(q=lambda t: _rows_of(t, 68)), {}, ValueError,
     r"q strides must be multiples of 8 elements \(16 bytes, a TMA requirement\), got strides \(544, 68, 1\)"),
    ("v-misaligned", dict(v=_shifted), {}, ValueError, r"v data pointer must be 16-byte aligned"),
    ("scale-nan", {}, dict(softmax_scale=float("nan")), ValueError,
     r"softmax_scale must be a finite positive number .*, got nan"),
    ("scale-str", {}, dict(softmax_scale="0.1"), TypeError,
     r"softmax_scale must be None or a Python float/int, got str"),
]
BAD_VARLEN_OPERANDS = [pytest.param(edit, kw, exc, msg, id=i) for i, edit, kw, exc, msg in BAD_VARLEN_OPERANDS]


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("edit, kwargs, exc, msg", BAD_VARLEN_OPERANDS)
def test_mha_varlen_bad_operands(monkeypatch, setup, edit, kwargs, exc, msg):
    args = _varlen()
    for name, f in edit.items():
        args[name] = f(args[name])
    args = _varlen_on(setup, monkeypatch, args)
    with pytest.raises(exc, match=msg):
        _call_varlen(args, causal=True, **kwargs)


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("kwargs, exc, msg", BAD_KWARGS)
def test_mha_varlen_bad_feature_argument(monkeypatch, setup, kwargs, exc, msg):
    args = _varlen_on(setup, monkeypatch, _varlen())
    with pytest.raises(exc, match=msg):
        _call_varlen(args, **kwargs)


def test_mha_varlen_cu_seqlens_on_another_device(monkeypatch):
    args = _varlen()
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    for name in ("q", "k", "v", "cu_seqlens_k"):
        args[name] = _fake_cuda(args[name])
    with pytest.raises(ValueError, match=r"cu_seqlens_q is on cpu but q is on cuda:0"):
        _call_varlen(args)


@pytest.mark.parametrize("h, h_kv", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("features", [
    dict(), dict(causal=True), dict(window_size=(5, 7)), dict(window_size=(3, -1), causal=True),
    dict(softcap=30.0), dict(softcap=5.0, window_size=[100, 100], deterministic=True, return_lse=True),
], ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()) or "defaults")
def test_mha_varlen_valid_arguments_reach_the_device_check(h, h_kv, features):
    """A batch with an empty sequence, max_seqlen above the longest, GQA/MQA and every
    feature passes the varlen checks: with CPU tensors the device error is the one left."""
    args = _varlen(h=h, h_kv=h_kv)
    args["max_seqlen_q"] = 1000
    with pytest.raises(ValueError, match=CPU_ERROR):
        _call_varlen(args, **features)


def _gpu_varlen_with_bad_offsets(monkeypatch):
    """Valid arguments on a "GPU" whose offsets are wrong in value and must not be read."""
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    args = _varlen()
    for name in ("q", "k", "v"):
        args[name] = _fake_cuda(args[name])
    args["cu_seqlens_q"] = _fake_cuda(_cu([0, 5, 3, 8]), cls=_NoHostRead)  # decreasing
    args["cu_seqlens_k"] = _fake_cuda(_cu([0, 4, 6, 11]), cls=_NoHostRead)
    return args


@pytest.mark.parametrize("how", ["check_cu_seqlens=False", "capturing"])
def test_cu_seqlens_values_not_read_when_told_or_capturing(monkeypatch, how):
    """check_cu_seqlens=False, or the default while a CUDA graph is being captured, never
    reads the offsets on the host (no synchronisation): even offsets that are wrong in
    value reach the launcher unread."""
    launched = []
    monkeypatch.setattr(launcher, "run_fwd", lambda *a, **kw: launched.append(kw) or ("out", "lse"))
    args = _gpu_varlen_with_bad_offsets(monkeypatch)
    kwargs = dict(causal=True, window_size=(8, 0), softcap=5.0)
    if how == "capturing":
        monkeypatch.setattr(validation, "_capturing_cuda_graph", lambda: True)
    else:
        kwargs["check_cu_seqlens"] = False
    assert _call_varlen(args, **kwargs) == "out"
    assert len(launched) == 1


def test_check_cu_seqlens_true_under_capture_is_an_error(monkeypatch):
    args = _gpu_varlen_with_bad_offsets(monkeypatch)
    monkeypatch.setattr(validation, "_capturing_cuda_graph", lambda: True)
    with pytest.raises(ValueError, match=r"check_cu_seqlens=True reads cu_seqlens on the host"):
        _call_varlen(args, check_cu_seqlens=True)


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_check_cu_seqlens_must_be_none_or_bool(value):
    with pytest.raises(TypeError, match=r"check_cu_seqlens must be None, True or False, got"):
        _call_varlen(_varlen(), check_cu_seqlens=value)


def test_cu_seqlens_values_read_once_after_the_other_checks(monkeypatch):
    """By default the offsets are read in one host copy, and only once everything else
    holds: a wrong offset on a "GPU" raises naming it, before the launcher."""
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    stacks = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **kw: stacks.append(len(ts)) or real_stack(ts, *a, **kw))
    args = _varlen_on("sm90", monkeypatch, _varlen())
    args["cu_seqlens_k"] = _fake_cuda(_cu([0, 4, 11, 6]))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be non-decreasing, got 11 then 6"):
        _call_varlen(args, causal=True)
    assert stacks == [2]


def test_cu_seqlens_checked_once_per_tensor_version(monkeypatch):
    """A model passes one offsets tensor to every layer: the default check reads it on the
    first call only. An in-place write (a new version) or a new max_seqlen reads it again,
    and a bad value written in place is caught."""
    launched = []
    monkeypatch.setattr(launcher, "run_fwd", lambda *a, **kw: launched.append(kw) or ("out", "lse"))
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    reads = []
    real_check = validation.check_cu_seqlens_values
    monkeypatch.setattr(validation, "check_cu_seqlens_values",
                        lambda *a: reads.append(1) or real_check(*a))
    args = _varlen_on("sm90", monkeypatch, _varlen())
    for _ in range(3):
        assert _call_varlen(args, causal=True) == "out"
    assert len(reads) == 1
    args["max_seqlen_q"] += 1
    assert _call_varlen(args, causal=True) == "out"
    assert len(reads) == 2
    args["cu_seqlens_k"][2] = 12  # in place: 0, 4, 12, 11
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be non-decreasing, got 12 then 11"):
        _call_varlen(args, causal=True)
    assert len(reads) == 3 and len(launched) == 4
