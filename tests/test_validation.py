"""Input checks of cute_attn.mha, on CPU tensors (no GPU needed).

The last two checks (same CUDA device, sm_90) need CUDA tensors. Without a GPU we
feed `_FakeCuda` tensors: CPU tensors whose `.device` says cuda:N. validation only
reads `.device` for those checks, so this tests the decision logic honestly; the
real `_device_capability` is covered by the gpu-marked test at the end.
"""

import dataclasses
import inspect
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from cpu_standin import FakeCuda as _FakeCuda
from cpu_standin import fake_cuda as _fake_cuda
import cute_attn
from cute_attn import config, validation
from cute_attn.validation import (
    validate_fwd_inputs,
    validate_gqa_heads,
    validate_softcap,
    validate_varlen_fwd_inputs,
    validate_varlen_inputs,
    validate_window_size,
)

CPU_ERROR = r"is on cpu; cute_attn needs CUDA tensors on an sm_90 GPU"




def _qkv(b=2, sq=16, sk=24, h=4, d=64, dtype=torch.bfloat16):
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, dtype=dtype)
    k = torch.randn(b, sk, h, d, dtype=dtype)
    v = torch.randn(b, sk, h, d, dtype=dtype)
    return q, k, v


def _replace(qkv, name, value):
    q, k, v = qkv
    return {"q": (value, k, v), "k": (q, value, v), "v": (q, k, value)}[name]


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [[1.0, 2.0], np.zeros((2, 16, 4, 64), np.float16)])
def test_not_a_tensor(name, bad):
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got (list|ndarray)"):
        validate_fwd_inputs(*_replace(_qkv(), name, bad), None)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(16, 4, 64), (2, 16, 4, 64, 1)])
def test_wrong_rank(name, shape):
    bad = torch.zeros(shape, dtype=torch.bfloat16)
    msg = f"{name} must have shape (batch, seqlen, nheads, headdim), got shape {shape}"
    with pytest.raises(ValueError, match=re.escape(msg)):
        validate_fwd_inputs(*_replace(_qkv(), name, bad), None)


def test_fp32_rejected_with_cast_hint():
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match=r"q must be torch.float16 or torch.bfloat16, got torch.float32; cast"):
        validate_fwd_inputs(q, k, v, None)


def test_batch_and_heads_past_the_launch_grid_are_refused():
    """Heads and batch entries ride grid.y and grid.z (65535 at most): a call past them is
    a ValueError naming the dimension, not a launch error after a compile."""
    from cute_attn.validation import GRID_YZ_MAX

    q = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16).expand(GRID_YZ_MAX + 1, 1, 1, 64)
    with pytest.raises(ValueError, match=rf"batch must be at most {GRID_YZ_MAX} .* got {GRID_YZ_MAX + 1}"):
        validate_fwd_inputs(q, q, q, None)
    q = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16).expand(1, 1, GRID_YZ_MAX + 1, 64)
    k = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"nheads must be at most {GRID_YZ_MAX}"):
        validate_fwd_inputs(q, k, k, None)
    q = torch.zeros(GRID_YZ_MAX + 1, 1, 64, dtype=torch.bfloat16)
    cu = torch.arange(GRID_YZ_MAX + 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"the number of sequences must be at most {GRID_YZ_MAX}"):
        validate_varlen_inputs(q, q, q, cu, cu)


def test_other_fp8_format_rejected_with_the_fp8_path_named():
    q, k, v = (t.to(torch.float8_e5m2) for t in _qkv())
    with pytest.raises(TypeError, match=r"got torch.float8_e5m2; the FP8 forward takes torch.float8_e4m3fn"):
        validate_fwd_inputs(q, k, v, None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_other_dtypes_rejected(dtype):
    q, k, v = (t.to(dtype) for t in _qkv())
    with pytest.raises(TypeError, match=rf"q must be torch.float16 or torch.bfloat16, got {dtype}"):
        validate_fwd_inputs(q, k, v, None)


@pytest.mark.parametrize("name", ["k", "v"])
def test_mixed_dtypes(name):
    qkv = _qkv(dtype=torch.bfloat16)
    other = dict(zip("qkv", qkv))[name].half()
    with pytest.raises(TypeError, match=rf"{name} must have the same dtype as q \(torch.bfloat16\), got torch.float16"):
        validate_fwd_inputs(*_replace(qkv, name, other), None)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("axis, label", [(0, "batch"), (3, "headdim")])
def test_mismatched_dims(name, axis, label):
    qkv = _qkv(b=2, h=4, d=64)
    shape = list(dict(zip("qkv", qkv))[name].shape)
    shape[axis] = {0: 3, 3: 128}[axis]
    bad = torch.zeros(shape, dtype=torch.bfloat16)
    q_size = qkv[0].shape[axis]
    with pytest.raises(ValueError, match=rf"{name} {label} must equal q {label} \({q_size}\), got {shape[axis]}"):
        validate_fwd_inputs(*_replace(qkv, name, bad), None)


@pytest.mark.parametrize("h_k, h_v, msg", [
    (3, 3, r"k nheads must divide q nheads \(4\): .*GQA/MQA\), got 3"),
    (2, 4, r"v nheads must equal k nheads \(2\), got 4"),
    (4, 2, r"v nheads must equal k nheads \(4\), got 2"),
])
def test_gqa_head_counts_rejected(h_k, h_v, msg):
    q, _, _ = _qkv(b=2, h=4, d=64)
    k = torch.zeros(2, 24, h_k, 64, dtype=torch.bfloat16)
    v = torch.zeros(2, 24, h_v, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=msg):
        validate_fwd_inputs(q, k, v, None)


@pytest.mark.parametrize("h_kv", [1, 2, 4])
def test_gqa_head_counts_reach_device_check(h_kv):
    q, _, _ = _qkv(b=2, h=4, d=64)
    k = v = torch.zeros(2, 24, h_kv, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        validate_fwd_inputs(q, k, v, None)


def test_kv_seqlen_mismatch():
    q, k, v = _qkv(sk=24)
    with pytest.raises(ValueError, match=r"v seqlen must equal k seqlen \(24\), got 23"):
        validate_fwd_inputs(q, k, v[:, :23], None)


EMPTY_SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
    (0, 16, 24, 4, 4), (2, 0, 24, 4, 2), (2, 16, 0, 4, 1), (2, 16, 24, 0, 4), (2, 16, 24, 0, 0), (0, 0, 0, 0, 0),
]


def _empty_qkv(b, sq, sk, h, h_k, d=64, dtype=torch.bfloat16):
    q = torch.zeros(b, sq, h, d, dtype=dtype)
    k, v = (torch.zeros(b, sk, h_k, d, dtype=dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("b, sq, sk, h, h_k", EMPTY_SHAPES)
def test_empty_dims_pass_and_need_no_kernel(monkeypatch, b, sq, sk, h, h_k):
    """Zero batch, sequence lengths or heads are accepted (issue 17: FlashAttention and
    SDPA return empty outputs); the device check still applies, and on sm_90 the call is
    reported as needing no kernel."""
    q, k, v = _empty_qkv(b, sq, sk, h, h_k)
    with pytest.raises(ValueError, match=r"q " + CPU_ERROR):
        validate_fwd_inputs(q, k, v, None)
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    assert validate_fwd_inputs(*(_fake_cuda(t) for t in (q, k, v)), None) is True
    assert validate_fwd_inputs(*(_fake_cuda(t) for t in _qkv()), None) is None  # non-empty


@pytest.mark.parametrize("case, exc, msg", [
    ("fp32", TypeError, r"q must be torch.float16 or torch.bfloat16, got torch.float32; cast"),
    ("headdim", ValueError, r"q headdim must be one of \(.*\), got 80"),
    ("rank", ValueError, r"k must have shape \(batch, seqlen, nheads, headdim\), got shape \(0, 4, 64\)"),
    ("batch", ValueError, r"k batch must equal q batch \(0\), got 2"),
    ("kv-heads-0", ValueError, r"k nheads must divide q nheads \(4\): .* got 0"),
    ("stride", ValueError, r"q strides must be multiples of 8 elements"),
    ("scale", ValueError, r"softmax_scale must be a finite positive number .*, got -1.0"),
])
def test_empty_inputs_get_the_other_checks(case, exc, msg):
    q, k, v = _empty_qkv(0, 16, 24, 4, 4)
    scale = None
    if case == "fp32":
        q, k, v = (t.float() for t in (q, k, v))
    elif case == "headdim":
        q, k, v = _empty_qkv(0, 16, 24, 4, 4, d=80)
    elif case == "rank":
        k = k.flatten(0, 1)
    elif case == "batch":
        k = v = torch.zeros(2, 24, 4, 64, dtype=torch.bfloat16)
    elif case == "kv-heads-0":
        q, k, v = _empty_qkv(2, 0, 24, 4, 0)
    elif case == "stride":
        q = torch.zeros(0, 16, 4, 65, dtype=torch.bfloat16)[..., :64]
    elif case == "scale":
        scale = -1.0
    with pytest.raises(exc, match=msg):
        validate_fwd_inputs(q, k, v, scale)


@pytest.mark.parametrize("d", [32, 80, 160, 512])
def test_unsupported_head_dim(d):
    with pytest.raises(ValueError, match=rf"q headdim must be one of \(.*\), got {d}"):
        validate_fwd_inputs(*_qkv(d=d), None)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_last_dim_not_contiguous(name):
    qkv = _qkv()
    t = dict(zip("qkv", qkv))[name]
    bad = torch.cat([t, t], dim=-1)[..., ::2]  # same shape, last stride 2
    with pytest.raises(ValueError, match=rf"{name} must be contiguous in the last dimension, got strides \(.*, 2\); call .contiguous\(\)"):
        validate_fwd_inputs(*_replace(qkv, name, bad), None)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_misaligned_stride(name):
    qkv = _qkv()
    t = dict(zip("qkv", qkv))[name]
    b, s, h, d = t.shape
    # Rows of 65 elements: a (b, s, h, 65) buffer viewed as [..., :64] via as_strided.
    buf = torch.zeros(b * s * h * (d + 1), dtype=t.dtype)
    bad = buf.as_strided((b, s, h, d), (s * h * (d + 1), h * (d + 1), d + 1, 1))
    with pytest.raises(ValueError, match=rf"{name} strides must be multiples of 8 elements \(16 bytes, a TMA requirement\), got strides \({s * h * (d + 1)}, {h * (d + 1)}, {d + 1}, 1\)"):
        validate_fwd_inputs(*_replace(qkv, name, bad), None)


def test_misaligned_pointer():
    q, k, v = _qkv()
    buf = torch.zeros(q.numel() + 1, dtype=q.dtype)
    bad = buf[1:].view(q.shape)  # 2-byte offset, strides fine
    with pytest.raises(ValueError, match=r"q data pointer must be 16-byte aligned .* \(storage offset 1\)"):
        validate_fwd_inputs(bad, k, v, None)


@pytest.mark.parametrize("scale, exc, msg", [
    (torch.tensor(0.1), TypeError, r"softmax_scale must be None or a Python float/int, got Tensor"),
    ("0.1", TypeError, r"softmax_scale must be None or a Python float/int, got str"),
    (True, TypeError, r"softmax_scale must be None or a Python float/int, got bool"),
    (float("nan"), ValueError, r"softmax_scale must be a finite positive number .*, got nan"),
    (float("inf"), ValueError, r"softmax_scale must be a finite positive number .*, got inf"),
    (0.0, ValueError, r"softmax_scale must be a finite positive number .*, got 0.0"),
    (-0.3, ValueError, r"softmax_scale must be a finite positive number .*, got -0.3"),
])
def test_bad_softmax_scale(scale, exc, msg):
    with pytest.raises(exc, match=msg):
        validate_fwd_inputs(*_qkv(), scale)


@pytest.mark.parametrize("scale", [None, 0.125, 2, np.float32(0.5)])
def test_good_softmax_scale_reaches_device_check(scale):
    with pytest.raises(ValueError, match=CPU_ERROR):
        validate_fwd_inputs(*_qkv(), scale)


@pytest.mark.parametrize("d", config.CAPABILITIES["fwd"].head_dims)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_tensors_rejected(d, dtype):
    with pytest.raises(ValueError, match=r"q " + CPU_ERROR):
        validate_fwd_inputs(*_qkv(d=d, dtype=dtype), None)


def test_transposed_bhsd_view_passes_layout_checks():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, s, 64, dtype=torch.bfloat16).transpose(1, 2) for s in (16, 24, 24))
    assert q.shape == (2, 16, 4, 64) and not q.is_contiguous()
    with pytest.raises(ValueError, match=r"q " + CPU_ERROR):  # the device error, not a stride error
        validate_fwd_inputs(q, k, v, None)


def test_devices_must_match():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"k is on cuda:1 but q is on cuda:0"):
        validate_fwd_inputs(_fake_cuda(q, 0), _fake_cuda(k, 1), _fake_cuda(v, 0), None)


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_wrong_compute_capability(monkeypatch, cap):
    monkeypatch.setattr(validation, "_device_capability", lambda device: cap)
    q, k, v = (_fake_cuda(t) for t in _qkv())
    with pytest.raises(ValueError, match=rf"q is on cuda:0 with compute capability sm_{cap[0]}{cap[1]}; cute_attn needs an sm_90"):
        validate_fwd_inputs(q, k, v, None)


def test_sm90_passes(monkeypatch):
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    q, k, v = (_fake_cuda(t) for t in _qkv())
    assert validate_fwd_inputs(q, k, v, 0.1) is None


def _fake_launcher(monkeypatch, run_fwd):
    """Make `from cute_attn import launcher` (inside mha) return a stub module."""
    stub = types.ModuleType("cute_attn.launcher")
    stub.run_fwd = run_fwd
    monkeypatch.setitem(sys.modules, "cute_attn.launcher", stub)
    monkeypatch.setattr(cute_attn, "launcher", stub, raising=False)
    # mha caches the launcher module after its first import
    monkeypatch.setattr(cute_attn.api, "_launcher_module", stub)


def _fail_if_called(*args, **kwargs):
    pytest.fail("launcher.run_fwd was called with inputs that should have been rejected")


@pytest.mark.parametrize("case", ["fp32", "headdim", "cpu", "scale", "capability"])
def test_mha_raises_before_launcher(monkeypatch, case):
    _fake_launcher(monkeypatch, _fail_if_called)
    monkeypatch.setattr(validation, "_device_capability", lambda device: (8, 0))
    q, k, v = _qkv()
    scale = None
    if case == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "headdim":
        q, k, v = _qkv(d=80)
    elif case == "scale":
        scale = float("nan")
    elif case == "capability":
        q, k, v = (_fake_cuda(t) for t in (q, k, v))
    with pytest.raises((TypeError, ValueError)):
        cute_attn.mha(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("causal", [False, True, np.False_, np.True_])
@pytest.mark.parametrize("scale", [None, 0.25, 2])
def test_mha_calls_launcher(monkeypatch, causal, scale):
    calls = []

    def run_fwd(q, k, v, features, args, config=None, need_lse=True):
        calls.append((features.mask == "causal", args.softmax_scale))
        return "out", "lse"

    _fake_launcher(monkeypatch, run_fwd)
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    q, k, v = (_fake_cuda(t) for t in _qkv(d=128))
    assert cute_attn.mha(q, k, v, causal=causal, softmax_scale=scale) == "out"
    assert cute_attn.mha(q, k, v, causal=causal, softmax_scale=scale, return_lse=True) == ("out", "lse")
    expected = (bool(causal), 128 ** -0.5 if scale is None else float(scale))
    assert calls == [expected, expected]
    assert all(type(c) is bool and type(s) is float for c, s in calls)


def test_import_does_not_load_the_dsl():
    # (torch itself imports cuda.bindings, so only the DSL and TVM-FFI are checked.)
    code = ("import sys, cute_attn; "
            "assert cute_attn.__version__ == '0.1.0'; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cutlass', 'tvm_ffi')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
def test_real_device_capability_on_gpu():
    q, k, v = (t.cuda() for t in _qkv())
    assert validation._device_capability(q.device) == (9, 0)
    assert validate_fwd_inputs(q, k, v, None) is None


# --- GQA/MQA, window, softcap and varlen checks (issue 4; not yet called by mha) ----------

@pytest.mark.parametrize("window, expected", [
    ((-1, -1), (-1, -1)), ((0, 0), (0, 0)), ([128, 0], (128, 0)), ((np.int64(4), -1), (4, -1)),
])
def test_window_size_accepted(window, expected):
    got = validate_window_size(window)
    assert got == expected and all(type(x) is int for x in got)


@pytest.mark.parametrize("window, exc, msg", [
    (None, TypeError, r"window_size must be a \(left, right\) tuple of ints, -1 for unbounded, got NoneType"),
    (8, TypeError, r"window_size must be a \(left, right\) tuple of ints, .* got int"),
    ("-1,-1", TypeError, r"window_size must be a \(left, right\) tuple .* got str"),
    ((1, 2, 3), ValueError, r"window_size must have 2 entries \(left, right\), got 3"),
    ((4,), ValueError, r"window_size must have 2 entries \(left, right\), got 1"),
    ((1.0, 2), TypeError, r"window_size left must be an int \(-1 for unbounded\), got float"),
    ((1, True), TypeError, r"window_size right must be an int .*, got bool"),
    ((1, torch.tensor(2)), TypeError, r"window_size right must be an int .*, got Tensor"),
    ((-2, 0), ValueError, r"window_size left must be >= -1 \(-1 for unbounded\), got -2"),
    ((0, -7), ValueError, r"window_size right must be >= -1 \(-1 for unbounded\), got -7"),
])
def test_window_size_rejected(window, exc, msg):
    with pytest.raises(exc, match=msg):
        validate_window_size(window)


@pytest.mark.parametrize("softcap", [0, 0.0, 30, 50.0, np.float32(15.0)])
def test_softcap_accepted(softcap):
    got = validate_softcap(softcap)
    assert type(got) is float and got == float(softcap)


@pytest.mark.parametrize("softcap, exc, msg", [
    ("30", TypeError, r"softcap must be a Python float/int \(0 for off\), got str"),
    (True, TypeError, r"softcap must be a Python float/int .*, got bool"),
    (torch.tensor(30.0), TypeError, r"softcap must be a Python float/int .*, got Tensor"),
    (-1.0, ValueError, r"softcap must be 0 \(off\) or a finite positive number, got -1.0"),
    (float("nan"), ValueError, r"softcap must be 0 \(off\) or a finite positive number, got nan"),
    (float("inf"), ValueError, r"softcap must be .*, got inf"),
])
def test_softcap_rejected(softcap, exc, msg):
    with pytest.raises(exc, match=msg):
        validate_softcap(softcap)


@pytest.mark.parametrize("h, h_kv", [(8, 8), (8, 4), (8, 1), (32, 8), (6, 3)])
@pytest.mark.parametrize("varlen", [False, True])
def test_gqa_heads_accepted(h, h_kv, varlen):
    lead = (20,) if varlen else (2, 10)
    q = torch.zeros(*lead, h, 64)
    k = v = torch.zeros(*lead, h_kv, 64)
    assert validate_gqa_heads(q, k, v) == h // h_kv


@pytest.mark.parametrize("h, h_k, h_v, msg", [
    (8, 3, 3, r"k nheads must divide q nheads \(8\): .*GQA/MQA\), got 3"),
    (4, 8, 8, r"k nheads must divide q nheads \(4\): .* got 8"),
    (8, 0, 0, r"k nheads must divide q nheads \(8\): .* got 0"),
    (8, 2, 4, r"v nheads must equal k nheads \(2\), got 4"),
    (0, 1, 2, r"v nheads must equal k nheads \(1\), got 2"),
])
def test_gqa_heads_rejected(h, h_k, h_v, msg):
    q, k, v = (torch.zeros(2, 10, n, 64) for n in (h, h_k, h_v))
    with pytest.raises(ValueError, match=msg):
        validate_gqa_heads(q, k, v)


@pytest.mark.parametrize("h_kv", [0, 1, 4])
def test_gqa_no_query_heads_is_an_empty_group(h_kv):
    q = torch.zeros(2, 10, 0, 64)
    k = v = torch.zeros(2, 10, h_kv, 64)
    assert validate_gqa_heads(q, k, v) == 0


def test_gqa_heads_needs_tensors_with_heads():
    q, k, v = (torch.zeros(2, 10, 4, 64) for _ in range(3))
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor, got list"):
        validate_gqa_heads(q, [1, 2], v)
    with pytest.raises(ValueError, match=r"v must have a heads dimension \(dim -2\), got shape \(64,\)"):
        validate_gqa_heads(q, k, torch.zeros(64))


class _NoHostRead(_FakeCuda):
    """A fake CUDA tensor whose values must not be read on the host (a sync on a GPU)."""

    def tolist(self):
        raise AssertionError("cu_seqlens read on the host without check_values=True")


def _varlen(lens_q=(3, 0, 5), lens_k=(4, 2, 5), h=8, h_kv=2, d=64):
    q = torch.zeros(sum(lens_q), h, d, dtype=torch.bfloat16)
    k = torch.zeros(sum(lens_k), h_kv, d, dtype=torch.bfloat16)
    v = torch.zeros(sum(lens_k), h_kv, d, dtype=torch.bfloat16)

    def cu(lens):
        return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)

    return q, k, v, cu(lens_q), cu(lens_k)


def test_varlen_accepted():
    q, k, v, cu_q, cu_k = _varlen()
    assert validate_varlen_inputs(q, k, v, cu_q, cu_k) == 3
    assert validate_varlen_inputs(q, k, v, cu_q, cu_k, 5, 5) == 3
    assert validate_varlen_inputs(q, k, v, cu_q, cu_k, max_seqlen_q=np.int32(9)) == 3
    # one sequence, and an all-empty batch
    q1, k1, v1, cu_q1, cu_k1 = _varlen((7,), (1,))
    assert validate_varlen_inputs(q1, k1, v1, cu_q1, cu_k1, 7, 1) == 1
    q0, k0, v0, cu_q0, cu_k0 = _varlen((0, 0), (0, 0))
    assert validate_varlen_inputs(q0, k0, v0, cu_q0, cu_k0, 0, 0) == 2


def _with(case):
    """(args, kwargs) of validate_varlen_inputs with one thing broken."""
    q, k, v, cu_q, cu_k = _varlen()
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    kwargs = {}
    name, value = case
    if name in args:
        args[name] = value(args[name]) if callable(value) else value
    else:
        kwargs[name] = value
    return list(args.values()), kwargs


@pytest.mark.parametrize("case, exc, msg", [
    (("q", [1.0]), TypeError, r"q must be a torch.Tensor, got list"),
    (("k", lambda t: t[None]), ValueError, r"k must have shape \(total_tokens, nheads, headdim\) for varlen, got shape \(1, 11, 2, 64\) \(4 dims\)"),
    (("v", lambda t: t[:-1]), ValueError, r"v total tokens must equal k total tokens \(11\), got 10"),
    (("v", lambda t: t[..., :32]), ValueError, r"v headdim must equal q headdim \(64\), got 32"),
    (("q", lambda t: torch.zeros(8, 7, 64)), ValueError, r"k nheads must divide q nheads \(7\)"),
    (("k", lambda t: torch.zeros(11, 3, 64)), ValueError, r"v nheads must equal k nheads \(3\), got 2"),
    (("cu_seqlens_q", [0, 3, 3, 8]), TypeError, r"cu_seqlens_q must be a torch.Tensor, got list"),
    (("cu_seqlens_q", lambda t: t.long()), TypeError, r"cu_seqlens_q must be torch.int32, got torch.int64; cast with .to\(torch.int32\)"),
    (("cu_seqlens_k", lambda t: t.float()), TypeError, r"cu_seqlens_k must be torch.int32, got torch.float32"),
    (("cu_seqlens_k", lambda t: t[None]), ValueError, r"cu_seqlens_k must be 1-D \(batch \+ 1 offsets\), got shape \(1, 4\)"),
    (("cu_seqlens_q", lambda t: t[:1]), ValueError, r"cu_seqlens_q must have length batch \+ 1 >= 2, got length 1"),
    (("cu_seqlens_k", lambda t: torch.stack([t, t], 1)[:, 0]), ValueError, r"cu_seqlens_k must be contiguous, got stride 2"),
    (("cu_seqlens_k", lambda t: t[:3]), ValueError, r"cu_seqlens_k must have the same length as cu_seqlens_q \(batch \+ 1 = 4\), got 3"),
    (("max_seqlen_q", 5.0), TypeError, r"max_seqlen_q must be a Python int, got float"),
    (("max_seqlen_k", True), TypeError, r"max_seqlen_k must be a Python int, got bool"),
    (("max_seqlen_k", -1), ValueError, r"max_seqlen_k must be >= 0, got -1"),
    (("cu_seqlens_q", lambda t: torch.tensor([1, 3, 3, 8], dtype=torch.int32)), ValueError, r"cu_seqlens_q must start at 0, got 1"),
    (("cu_seqlens_q", lambda t: torch.tensor([0, 3, 2, 8], dtype=torch.int32)), ValueError, r"cu_seqlens_q must be non-decreasing, got 3 then 2 at index 1"),
    (("cu_seqlens_k", lambda t: torch.tensor([0, 4, 6, 10], dtype=torch.int32)), ValueError, r"cu_seqlens_k must end at k's total tokens \(11\), got 10"),
    (("cu_seqlens_q", lambda t: torch.tensor([0, 3, 3, 9], dtype=torch.int32)), ValueError, r"cu_seqlens_q must end at q's total tokens \(8\), got 9"),
    (("max_seqlen_q", 4), ValueError, r"max_seqlen_q must be >= the longest sequence in cu_seqlens_q \(5\), got 4"),
    (("max_seqlen_k", 0), ValueError, r"max_seqlen_k must be >= the longest sequence in cu_seqlens_k \(5\), got 0"),
])
def test_varlen_rejected(case, exc, msg):
    args, kwargs = _with(case)
    with pytest.raises(exc, match=msg):
        validate_varlen_inputs(*args, **kwargs)


def test_varlen_cu_seqlens_on_another_device():
    q, k, v, cu_q, cu_k = _varlen()
    q = _fake_cuda(q)
    with pytest.raises(ValueError, match=r"cu_seqlens_q is on cpu but q is on cuda:0; cu_seqlens must be on q's device"):
        validate_varlen_inputs(q, k, v, cu_q, _fake_cuda(cu_k))
    with pytest.raises(ValueError, match=r"cu_seqlens_k is on cuda:1 but q is on cuda:0"):
        validate_varlen_inputs(q, k, v, _fake_cuda(cu_q), _fake_cuda(cu_k, 1))


def test_varlen_values_on_gpu_only_when_asked():
    """On a GPU the offsets' values would need a device sync: by default they are not read
    (the launch path stays sync-free); check_values=True reads them anyway."""
    q, k, v, _, cu_k = _varlen()
    bad_q = torch.tensor([0, 5, 3, 8], dtype=torch.int32)  # decreasing

    def on_gpu(t):
        t = t.as_subclass(_NoHostRead)
        t._fake_device = torch.device("cuda", 0)
        return t

    q = _fake_cuda(q)
    assert validate_varlen_inputs(q, k, v, on_gpu(bad_q), on_gpu(cu_k)) == 3
    assert validate_varlen_inputs(q, k, v, on_gpu(bad_q), on_gpu(cu_k), check_values=False) == 3
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
        validate_varlen_inputs(q, k, v, _fake_cuda(bad_q), _fake_cuda(cu_k), check_values=True)
    # and on the CPU, check_values=False skips them there too
    q_cpu, k, v, _, cu_k = _varlen()
    assert validate_varlen_inputs(q_cpu, k, v, bad_q, cu_k, check_values=False) == 3
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
        validate_varlen_inputs(q_cpu, k, v, bad_q, cu_k)


# --- what is accepted comes from cute_attn.config, for mha and mha_varlen alike -----------

def _fwd_inputs(varlen, d=64, dtype=torch.bfloat16, pad=0):
    """validate_fwd_inputs's or validate_varlen_fwd_inputs's arguments (CPU tensors, rows
    of d + pad elements), as a function of the scale."""
    if varlen:
        q, k, v, cu_q, cu_k = _varlen(d=d + pad)
        q, k, v = (t.to(dtype)[..., :d] for t in (q, k, v))
        return lambda scale: validate_varlen_fwd_inputs(q, k, v, cu_q, cu_k, 5, 5, scale)
    q, k, v = (t.to(dtype)[..., :d] for t in _qkv(d=d + pad))
    return lambda scale: validate_fwd_inputs(q, k, v, scale)


@pytest.mark.parametrize("varlen", [False, True])
def test_dtypes_and_head_dims_come_from_the_capability_table(monkeypatch, varlen):
    monkeypatch.setitem(config.CAPABILITIES, "fwd", config.Capability(head_dims=(128,), dtypes=("bf16",)))
    with pytest.raises(TypeError, match=r"q must be torch.bfloat16, got torch.float16$"):
        _fwd_inputs(varlen, d=128, dtype=torch.float16)(None)
    with pytest.raises(ValueError, match=re.escape("q headdim must be one of (128,), got 64")):
        _fwd_inputs(varlen, d=64)(None)
    with pytest.raises(ValueError, match=CPU_ERROR):
        _fwd_inputs(varlen, d=128)(None)


@pytest.mark.parametrize("varlen", [False, True])
def test_alignment_in_elements_follows_the_dtype(monkeypatch, varlen):
    """16 bytes are 8 elements of a 2-byte dtype and 16 of a 1-byte one: with an FP8
    policy in the table, rows of 72 elements are TMA-aligned in bf16 but not in FP8."""
    assert all(p.align_elems * p.input.itemsize == p.align_bytes == 16 for p in config.DTYPES.values())
    fp8 = config.DtypePolicy("fp8", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16)
    monkeypatch.setitem(config.DTYPES, "fp8", fp8)
    monkeypatch.setitem(config.DTYPE_OF_INPUT, fp8.input, fp8)
    fwd = config.CAPABILITIES["fwd"]
    monkeypatch.setitem(config.CAPABILITIES, "fwd", dataclasses.replace(fwd, dtypes=(*fwd.dtypes, "fp8")))
    with pytest.raises(ValueError, match=CPU_ERROR):
        _fwd_inputs(varlen, pad=8)(None)
    with pytest.raises(ValueError, match=r"q strides must be multiples of 16 elements \(16 bytes, a TMA requirement\)"):
        _fwd_inputs(varlen, dtype=torch.float8_e4m3fn, pad=8)(None)
    with pytest.raises(ValueError, match=CPU_ERROR):
        _fwd_inputs(varlen, dtype=torch.float8_e4m3fn, pad=16)(None)
    with pytest.raises(TypeError, match=r"q must be torch.float16 or torch.bfloat16 or torch.float8_e4m3fn, got torch.float32"):
        _fwd_inputs(varlen, dtype=torch.float32)(None)


# --- issue 17: no silent acceptance of values the kernels cannot carry --------------------
# Each value below once passed every host check and reached the kernel unverified.

def _trap_launcher(monkeypatch, run_fwd=_fail_if_called):
    """A stub launcher whose forward is run_fwd and whose backward fails the test."""
    _fake_launcher(monkeypatch, run_fwd)

    def run_bwd(*args, **kwargs):
        pytest.fail("launcher.run_bwd was called for a call that needs no kernel")

    sys.modules["cute_attn.launcher"].run_bwd = run_bwd


def _sm90(monkeypatch, *tensors):
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    return tuple(_fake_cuda(t) for t in tensors)


def _plain(t):
    """A _FakeCuda result as a plain CPU tensor (its .device would need _fake_device)."""
    return t.as_subclass(torch.Tensor)


def _varlen_call(q, k, v, cu_q, cu_k, max_q=5, max_k=5, **kwargs):
    return cute_attn.mha_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


# 1. softmax_scale: float32, with log2(e) folded in (blocks/softmax.py, fold_score_scale)

def test_fold_range_is_what_float32_carries():
    f32, log2e = np.float32, np.float32(np.log2(np.e))
    assert validation.FOLD_MIN == float(np.finfo(np.float32).tiny)  # smallest normal
    top = f32(validation.FOLD_MAX)
    assert float(top) == validation.FOLD_MAX and np.isfinite(top * log2e)
    with np.errstate(over="ignore"):
        assert np.isinf(np.nextafter(top, f32(np.inf)) * log2e)


FOLD_RANGE = r"\[1.175494e-38, 2.358657e\+38\]"


@pytest.mark.parametrize("scale", [1e39, 3e38, 2.36e38, 1e-39, 1e-45, 5e-324, 10 ** 39, 10 ** 400])
@pytest.mark.parametrize("varlen", [False, True])
def test_softmax_scale_beyond_float32_fold_rejected(scale, varlen):
    msg = (rf"softmax_scale must be in {FOLD_RANGE}, where it and softmax_scale \* log2\(e\) "
           rf"\(which the kernel computes\) are normal, finite float32 numbers, got {re.escape(str(scale))}$")
    with pytest.raises(ValueError, match=msg):
        _fwd_inputs(varlen)(scale)


@pytest.mark.parametrize("scale", [validation.FOLD_MIN, validation.FOLD_MAX, 1e-30, 1e30, np.float32(2e38)])
@pytest.mark.parametrize("varlen", [False, True])
def test_softmax_scale_at_the_fold_bounds_accepted(scale, varlen):
    with pytest.raises(ValueError, match=CPU_ERROR):
        _fwd_inputs(varlen)(scale)


def test_mha_rejects_unfoldable_scale_before_launcher(monkeypatch):
    _trap_launcher(monkeypatch)
    q, k, v = _sm90(monkeypatch, *_qkv())
    with pytest.raises(ValueError, match=r"softmax_scale must be in .*got 1e\+39"):
        cute_attn.mha(q, k, v, softmax_scale=1e39)


# 2. softcap: float32, softcap * log2(e) and softmax_scale / softcap

@pytest.mark.parametrize("softcap", [1e39, 3e38, 1e-39, 1e-45, 10 ** 39, 10 ** 400])
def test_softcap_beyond_float32_fold_rejected(softcap):
    msg = (rf"softcap must be 0 \(off\) or in {FOLD_RANGE}, where it and softcap \* log2\(e\) "
           rf"\(which the kernel computes\) are normal, finite float32 numbers, got {re.escape(str(softcap))}$")
    with pytest.raises(ValueError, match=msg):
        validate_softcap(softcap)


@pytest.mark.parametrize("softcap", [validation.FOLD_MIN, validation.FOLD_MAX, 1e-30, 1e30])
def test_softcap_at_the_fold_bounds_accepted(softcap):
    assert validate_softcap(softcap) == softcap


RATIO_MSG = (r"softcap must keep softmax_scale / softcap a normal, finite float32 \(in "
             r"\[1.175494e-38, 3.402823e\+38\]; the kernel computes tanh\(scores \* "
             r"softmax_scale / softcap\) in float32\), got softcap={softcap} with "
             r"softmax_scale={scale}{default}: softmax_scale / softcap = {ratio}")


@pytest.mark.parametrize("softcap, scale, ratio", [
    (1e-30, 1e10, r"1e\+40"),  # the reciprocal overflows
    (2e-38, 1e10, r"5e\+47"),
    (1e30, 1e-10, r"1e-40"),  # subnormal: flushed to 0, every score tanh(0)
    (1e20, None, r"1.25e-21"),  # fine: reaches the device check
])
@pytest.mark.parametrize("varlen", [False, True])
def test_softmax_scale_over_softcap_must_stay_a_normal_float32(monkeypatch, softcap, scale, ratio, varlen):
    if varlen:
        q, k, v, cu_q, cu_k = _varlen()
        call = lambda: cute_attn.mha_varlen(q, k, v, cu_q, cu_k, 5, 5, softcap=softcap,  # noqa: E731
                                            softmax_scale=scale)
    else:
        q, k, v = _qkv()
        call = lambda: cute_attn.mha(q, k, v, softcap=softcap, softmax_scale=scale)  # noqa: E731
    _trap_launcher(monkeypatch)
    if scale is None:  # 1e20 / 8: a normal float32
        with pytest.raises(ValueError, match=CPU_ERROR):
            call()
        return
    msg = RATIO_MSG.format(softcap=re.escape(repr(softcap)), scale=re.escape(repr(scale)), default="",
                           ratio=ratio)
    with pytest.raises(ValueError, match=msg):  # before the device check
        call()


def test_softcap_over_default_scale_names_the_default():
    q, k, v = _qkv(d=64)
    msg = RATIO_MSG.format(softcap=r"1e\+38", scale="0.125", default=re.escape(" (the default, 1/sqrt(headdim))"),
                           ratio=r"1.25e-39")
    with pytest.raises(ValueError, match=msg):
        validate_fwd_inputs(q, k, v, None, 1e38)


def test_softcap_ratio_checked_on_the_fast_path_too(monkeypatch):
    """A GPU call takes _plainly_valid's early return: the ratio check must be there too."""
    monkeypatch.setattr(validation, "_plainly_valid", lambda *args: True)
    q, k, v = _qkv()
    assert validate_fwd_inputs(q, k, v, 1e10, 1e-20) is None
    with pytest.raises(ValueError, match=r"softcap must keep softmax_scale / softcap"):
        validate_fwd_inputs(q, k, v, 1e10, 1e-30)


# 3. window sides past config.UNBOUNDED are unbounded, with the mask kind of -1

@pytest.mark.parametrize("causal, window, same_as", [
    (False, (2 ** 40, 0), (-1, 0)),
    (False, (2 ** 40, 2 ** 40), (-1, -1)),
    (False, (config.UNBOUNDED, config.UNBOUNDED), (-1, -1)),
    (False, (-1, 2 ** 40), (-1, -1)),
    (False, (2 ** 40, 5), (-1, 5)),
    (False, (3, 2 ** 40), (3, -1)),
    (False, (3, 2 ** 63), (3, -1)),
    (True, (2 ** 40, 7), (-1, 0)),
    (True, (2 ** 40, 2 ** 40), (-1, -1)),
])
@pytest.mark.parametrize("softcap, varlen", [(0.0, None), (5.0, None), (0.0, ("cu_q", "cu_k", 9, 9))])
def test_huge_window_sides_are_unbounded(causal, window, same_as, softcap, varlen):
    got = cute_attn.api._features_and_args(causal, window, softcap, 0.1, varlen)
    assert got == cute_attn.api._features_and_args(causal, same_as, softcap, 0.1, varlen)
    features, args = got
    expected_mask = {(-1, -1): "none", (-1, 0): "causal"}.get((same_as[0], 0 if causal else same_as[1]), "local")
    assert features.mask == expected_mask
    assert all(0 <= side <= config.UNBOUNDED < 2 ** 31 for side in args.window)  # Int32 kernel args


def test_window_side_just_below_unbounded_stays_a_window():
    features, args = cute_attn.api._features_and_args(False, (config.UNBOUNDED - 1, 0), 0.0, 0.1)
    assert features.mask == "local" and args.window == (config.UNBOUNDED - 1, 0)


def test_mha_with_huge_window_runs_the_causal_kernel(monkeypatch):
    calls = []
    _trap_launcher(monkeypatch, lambda q, k, v, features, args, config=None, need_lse=True: calls.append(features) or ("o", "l"))
    q, k, v = _sm90(monkeypatch, *_qkv(d=128))
    cute_attn.mha(q, k, v, window_size=(2 ** 40, 0))
    cute_attn.mha(q, k, v, window_size=(2 ** 40, 2 ** 40))
    assert calls == [config.CAUSAL, config.DENSE]


# 4. max_seqlen above the total tokens is the total (an Int32 kernel argument)

@pytest.mark.parametrize("check", [None, False])
def test_huge_max_seqlen_is_clamped_to_the_total_tokens(monkeypatch, check):
    calls = []
    _trap_launcher(monkeypatch, lambda q, k, v, features, args, config=None, need_lse=True: calls.append(args) or ("o", "l"))
    q, k, v, cu_q, cu_k = _sm90(monkeypatch, *_varlen())  # totals 8 and 11, longest 5 and 5
    _varlen_call(q, k, v, cu_q, cu_k, 10 ** 12, np.int64(2 ** 40), check_cu_seqlens=check)
    _varlen_call(q, k, v, cu_q, cu_k, 6, 7, check_cu_seqlens=check)
    assert [(a.max_seqlen_q, a.max_seqlen_k) for a in calls] == [(8, 11), (6, 7)]
    assert all(type(a.max_seqlen_q) is int and type(a.max_seqlen_k) is int for a in calls)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be >= the longest sequence in cu_seqlens_q \(5\), got 4"):
        _varlen_call(q, k, v, cu_q, cu_k, 4, 10 ** 12)


# 5. causal, return_lse, deterministic are booleans

@pytest.mark.parametrize("name", ["causal", "return_lse", "deterministic"])
@pytest.mark.parametrize("value, shown", [
    ("no", "str 'no'"), (0, "int 0"), (1, "int 1"), (None, "NoneType None"), (1.0, "float 1.0"),
    (torch.tensor(True), "Tensor tensor(True)"), (np.int64(1), f"int64 {np.int64(1)!r}"),
])
@pytest.mark.parametrize("varlen", [False, True])
def test_flags_must_be_booleans(monkeypatch, name, value, shown, varlen):
    _trap_launcher(monkeypatch)
    msg = rf"{name} must be a bool \(True or False\), got {re.escape(shown)}$"
    with pytest.raises(TypeError, match=msg):  # CPU tensors: before the device check
        if varlen:
            _varlen_call(*_varlen(), **{name: value})
        else:
            cute_attn.mha(*_qkv(), **{name: value})


@pytest.mark.parametrize("value", [True, False, np.True_, np.False_])
def test_flags_accept_python_and_numpy_bools(value):
    assert validation.validate_flags(value, value, value) == (bool(value),) * 3
    assert all(type(f) is bool for f in validation.validate_flags(value, value, value))


# 6. stride 0 (an expanded tensor) on a dim of size > 1

@pytest.mark.parametrize("name, dim, label, size, gqa_hint", [
    ("k", 2, "nheads", 4, True), ("v", 2, "nheads", 4, True), ("q", 2, "nheads", 4, False),
    ("k", 1, "seqlen", 24, False), ("q", 0, "batch", 2, False), ("v", 0, "batch", 2, False),
])
def test_expanded_operand_rejected(monkeypatch, name, dim, label, size, gqa_hint):
    qkv = _qkv(h=4)
    t = dict(zip("qkv", qkv))[name]
    index = [slice(None)] * 4
    index[dim] = slice(0, 1)
    shape = [-1] * 4
    shape[dim] = size
    bad = t[tuple(index)].expand(*shape)
    assert bad.shape == t.shape and bad.stride()[dim] == 0
    hint = (rf"pass {name} unexpanded, with fewer heads: nheads_kv dividing nheads is supported natively "
            r"\(GQA/MQA\)" if gqa_hint else re.escape(validation._COPY_HINT))
    msg = (rf"{name} strides must be nonzero on every dim of size > 1, got stride 0 on dim {dim} \({label}, "
           rf"size {size}\), strides {re.escape(str(bad.stride()))}: an expanded \(broadcast\) tensor, which "
           rf"TMA cannot read .*; {hint}")
    for setup in ("cpu", "sm90"):
        args = _replace(qkv, name, bad)
        if setup == "sm90":
            args = _sm90(monkeypatch, *args)
        with pytest.raises(ValueError, match=msg):
            validate_fwd_inputs(*args, None)


@pytest.mark.parametrize("name, dim, label, gqa_hint", [
    ("k", 1, "nheads", True), ("q", 0, "total_tokens", False), ("v", 0, "total_tokens", False),
])
def test_expanded_varlen_operand_rejected(name, dim, label, gqa_hint):
    q, k, v, cu_q, cu_k = _varlen(h=8, h_kv=2)
    t = {"q": q, "k": k, "v": v}[name]
    index = [slice(None)] * 3
    index[dim] = slice(0, 1)
    shape = [-1] * 3
    shape[dim] = t.shape[dim]
    bad = t[tuple(index)].expand(*shape)
    tensors = {"q": q, "k": k, "v": v, name: bad}
    msg = rf"{name} strides must be nonzero on every dim of size > 1, got stride 0 on dim {dim} \({label}, "
    msg += r".*nheads_kv dividing nheads" if gqa_hint else r".*\.clone\(memory_format"
    with pytest.raises(ValueError, match=msg):
        validate_varlen_fwd_inputs(tensors["q"], tensors["k"], tensors["v"], cu_q, cu_k, 5, 5, None)


def test_stride_0_on_a_dim_of_size_1_still_accepted():
    q, k, v = _qkv(h=4)
    k1 = torch.zeros(2, 24, 1, 64, dtype=torch.bfloat16)
    k1 = k1.as_strided(k1.shape, (24 * 64, 64, 0, 1))
    v1 = torch.zeros(1, 24, 1, 64, dtype=torch.bfloat16).expand(2, -1, -1, -1).clone()
    with pytest.raises(ValueError, match=r"q " + CPU_ERROR):
        validate_fwd_inputs(q, k1, v1, None)
    q0 = torch.zeros(1, 16, 4, 64, dtype=torch.bfloat16)
    q0 = q0.as_strided(q0.shape, (0, 256, 64, 1))  # batch 1 of stride 0
    with pytest.raises(ValueError, match=r"q " + CPU_ERROR):
        validate_fwd_inputs(q0, k1[:1], v1[:1], None)


# 7. empty inputs: empty outputs (or out = 0, lse = -inf without keys), no kernel

@pytest.mark.parametrize("b, sq, sk, h, h_k", EMPTY_SHAPES)
@pytest.mark.parametrize("grad", [False, True])
def test_empty_mha_returns_empty_outputs_without_a_kernel(monkeypatch, b, sq, sk, h, h_k, grad):
    _trap_launcher(monkeypatch)
    q, k, v = _sm90(monkeypatch, *_empty_qkv(b, sq, sk, h, h_k))
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
    out, lse = cute_attn.mha(q, k, v, causal=True, return_lse=True, window_size=(4, 0), softcap=3.0)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == q.stride()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert torch.equal(_plain(out), torch.zeros(q.shape, dtype=q.dtype))
    assert torch.equal(_plain(lse), torch.full((b, h, sq), -torch.inf))
    assert not lse.requires_grad and out.requires_grad == grad
    if grad:
        dout = torch.randn(q.shape, dtype=q.dtype)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        for g, t in zip(grads, (q, k, v)):
            assert g.shape == t.shape and g.dtype == t.dtype
            assert not _plain(g).any()


def test_no_keys_gives_zero_out_and_minus_inf_lse(monkeypatch):
    """seqlen_k = 0 with queries: every row sees no key, so out = 0, lse = -inf, the
    documented rule for such rows; the gradient of q is 0 and those of k, v are empty."""
    _trap_launcher(monkeypatch)
    q, k, v = _sm90(monkeypatch, *_empty_qkv(2, 16, 0, 4, 2))
    q.requires_grad_()
    out, lse = cute_attn.mha(q, k, v, return_lse=True)
    assert out.shape == (2, 16, 4, 64) and not _plain(out).any()
    assert lse.shape == (2, 4, 16) and bool((_plain(lse) == -torch.inf).all())
    (dq,) = torch.autograd.grad(out.float().sum(), (q,))
    assert dq.shape == q.shape and not _plain(dq).any()


def test_empty_output_keeps_q_stride_order(monkeypatch):
    _trap_launcher(monkeypatch)
    q = torch.zeros(2, 4, 16, 64, dtype=torch.bfloat16).transpose(1, 2)  # (2, 16, 4, 64) view
    k = v = torch.zeros(2, 0, 4, 64, dtype=torch.bfloat16)
    q, k, v = _sm90(monkeypatch, q, k, v)
    out = cute_attn.mha(q, k, v)
    assert out.stride() == q.stride()


@pytest.mark.parametrize("lens_q, lens_k, h, h_kv, zero_out", [
    ((0, 0), (0, 0), 8, 2, False),  # no tokens at all
    ((0, 0), (3, 4), 8, 2, False),  # no queries
    ((3, 5), (0, 0), 8, 2, True),  # no keys: out = 0, lse = -inf
    ((3, 5), (3, 4), 0, 0, False),  # no heads
])
@pytest.mark.parametrize("grad", [False, True])
def test_empty_varlen_returns_empty_outputs_without_a_kernel(monkeypatch, lens_q, lens_k, h, h_kv, zero_out, grad):
    _trap_launcher(monkeypatch)
    q, k, v, cu_q, cu_k = _sm90(monkeypatch, *_varlen(lens_q, lens_k, h=h, h_kv=h_kv))
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
    out, lse = _varlen_call(q, k, v, cu_q, cu_k, 5, 5, return_lse=True, causal=True)
    total_q = sum(lens_q)
    assert out.shape == (total_q, h, 64) and lse.shape == (h, total_q)
    assert not _plain(out).any() and bool((_plain(lse) == -torch.inf).all())
    assert zero_out == (out.numel() > 0)
    if grad:
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]
        assert not any(_plain(g).any() for g in grads)


def test_empty_varlen_still_checks_the_offsets(monkeypatch):
    _trap_launcher(monkeypatch)
    q, k, v, _, cu_k = _sm90(monkeypatch, *_varlen((0, 0), (0, 0)))
    bad = _fake_cuda(torch.tensor([0, 1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
        _varlen_call(q, k, v, bad, cu_k, 5, 5)


def test_empty_fp32_still_raises_the_dtype_error(monkeypatch):
    _trap_launcher(monkeypatch)
    q, k, v = _sm90(monkeypatch, *_empty_qkv(0, 16, 24, 4, 4, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"q must be torch.float16 or torch.bfloat16, got torch.float32"):
        cute_attn.mha(q, k, v)
    q, k, v, cu_q, cu_k = _varlen((0,), (0,))
    with pytest.raises(TypeError, match=r"q must be torch.float16 or torch.bfloat16, got torch.float32"):
        _varlen_call(q.float(), k.float(), v.float(), cu_q, cu_k)


def test_kv_without_heads_for_query_heads_is_still_an_error(monkeypatch):
    _trap_launcher(monkeypatch)
    q, k, v = _sm90(monkeypatch, *_empty_qkv(2, 16, 24, 4, 0))
    with pytest.raises(ValueError, match=r"k nheads must divide q nheads \(4\): .* got 0"):
        cute_attn.mha(q, k, v)


def test_signature_fast_path_takes_only_the_plain_call(monkeypatch):
    """mha's fast path (api._plain_calls) answers a repeated plain call and nothing else:
    a 1 for causal hashes like True but must reach validation's TypeError, an option set
    to its default value and an unknown keyword go to the full path."""
    from cute_attn import api

    q, k, v = _qkv()
    answered = []
    monkeypatch.setattr(api, "_plain_calls", {})
    api._plain_calls[api._plain_signature(q, k, v, True, None)] = lambda *args: answered.append(args) or "fast"
    assert cute_attn.mha(q, k, v, causal=True) == "fast" and len(answered) == 1
    with pytest.raises(TypeError, match="causal must be a bool"):
        cute_attn.mha(q, k, v, causal=1)
    with pytest.raises(ValueError, match=CPU_ERROR):  # the full path's checks ran
        cute_attn.mha(q, k, v, causal=True, window_size=(-1, -1))
    with pytest.raises(TypeError, match="bogus"):
        cute_attn.mha(q, k, v, causal=True, bogus=1)
    assert len(answered) == 1
    names = list(inspect.signature(cute_attn.mha).parameters)
    assert names[:3] == ["q", "k", "v"] and {"window_size", "dropout_seed", "mask_mod"} <= set(names)


# --- on an sm_90 GPU: the fast path and real CUDA outputs --------------------------------

def _cuda(*tensors):
    return tuple(t.cuda() for t in tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("b, sq, sk, h, h_k", EMPTY_SHAPES)
def test_empty_dense_call_on_gpu(b, sq, sk, h, h_k):
    q, k, v = (t.requires_grad_() for t in _cuda(*_empty_qkv(b, sq, sk, h, h_k)))
    out, lse = cute_attn.mha(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.device == q.device
    assert not out.any() and bool((lse == -torch.inf).all())
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v)] and not any(g.any() for g in grads)


@pytest.mark.gpu
def test_empty_varlen_call_on_gpu():
    q, k, v, cu_q, cu_k = _cuda(*_varlen((0, 0), (0, 0)))
    out, lse = cute_attn.mha_varlen(q, k, v, cu_q, cu_k, 0, 0, return_lse=True)
    assert out.shape == (0, 8, 64) and lse.shape == (8, 0) and out.is_cuda and lse.is_cuda
    q, k, v, cu_q, cu_k = _cuda(*_varlen((3, 5), (0, 0)))
    out, lse = cute_attn.mha_varlen(q, k, v, cu_q, cu_k, 5, 0, return_lse=True)
    assert out.shape == (8, 8, 64) and not out.any() and bool((lse == -torch.inf).all())


@pytest.mark.gpu
def test_no_keys_on_gpu_gives_zeros_minus_inf_and_zero_grads():
    q, k, v = (t.requires_grad_() for t in _cuda(*_empty_qkv(2, 16, 0, 4, 2)))
    out, lse = cute_attn.mha(q, k, v, return_lse=True)
    assert out.shape == q.shape and not out.any() and bool((lse == -torch.inf).all())
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not dq.any() and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.gpu
def test_fast_path_rejects_expanded_kv_and_unfoldable_scale_on_gpu():
    q, k, v = _cuda(*_qkv(h=8))
    k1, v1 = k[:, :, :1], v[:, :, :1]
    with pytest.raises(ValueError, match=r"k strides must be nonzero .* nheads_kv dividing nheads"):
        cute_attn.mha(q, k1.expand(-1, -1, 8, -1), v1.expand(-1, -1, 8, -1))
    assert cute_attn.mha(q, k1, v1).shape == q.shape  # MQA, unexpanded
    with pytest.raises(ValueError, match=r"softmax_scale must be in .*got 1e\+39"):
        cute_attn.mha(q, k, v, softmax_scale=1e39)
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        cute_attn.mha(q, k, v, causal="no")


def test_negative_bit_views_are_no_tma_operands():
    """A lazily negated view has its base's layout and address but holds -x in memory: the
    fast test sends it to the detailed checks, which name it (a kernel would read +x)."""
    policy = config.DTYPE_OF_INPUT[torch.bfloat16]
    q = torch.randn(1, 128, 2, 64, dtype=torch.bfloat16)
    neg = torch._neg_view(q)
    assert neg.stride() == q.stride() and neg.data_ptr() == q.data_ptr()
    assert validation._layout_problem("q", q, policy) is None
    assert "resolve_neg" in validation._layout_problem("k", neg, policy)
    assert validation.plainly_tma_operands(policy, q, q, q)
    assert not validation.plainly_tma_operands(policy, q, neg, q)
