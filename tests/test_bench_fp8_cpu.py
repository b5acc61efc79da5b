"""CPU tests of the FP8 benchmark's cuDNN anchor (perf/cudnn_fp8.py) and of what
perf/bench_fp8.py does around it: the per-tensor quantisation and scales it hands cuDNN,
the recorded skip when nvidia-cudnn-frontend is missing, and the output check that keeps a
wrong anchor out of the timings. The graph itself needs a GPU (tests with -m gpu run it
through perf/bench_fp8.py on the device)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PERF = Path(__file__).resolve().parents[1] / "perf"


def _load(name):
    if str(PERF) not in sys.path:
        sys.path.insert(0, str(PERF))
    spec = importlib.util.spec_from_file_location(f"perf_{name}_under_test", PERF / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cudnn_fp8():
    return _load("cudnn_fp8")


@pytest.fixture(scope="module")
def bench_fp8():
    return _load("bench_fp8")


def test_per_tensor_quantisation_round_trips_within_e4m3(cudnn_fp8):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 4, 64, generator=gen).to(torch.bfloat16) * 7
    x8, descale = cudnn_fp8.quantize_per_tensor(x)
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (1, 1, 1, 1)
    back = x8.float() * descale
    assert back.abs().max() <= cudnn_fp8.E4M3_MAX * descale.max() * (1 + 1e-6)
    assert x8.float().abs().max() == cudnn_fp8.E4M3_MAX  # the largest value maps to e4m3's max
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values
    normal = x.float().abs() > 2 ** -6 * descale
    assert ((back - x.float()).abs()[normal] <= 2 ** -4 * x.float().abs()[normal] + 1e-6).all()


def test_prepare_gives_cudnn_consistent_scales(cudnn_fp8):
    q, k, v = (torch.randn(1, 64, 2, 64, dtype=torch.bfloat16) * s for s in (1, 3, 0.5))
    q8, k8, v8, scales = cudnn_fp8.prepare(q, k, v)
    assert set(scales) == set(cudnn_fp8.CudnnFp8Attention.SCALES)
    assert all(t.shape == (1, 1, 1, 1) and t.dtype == torch.float32 for t in scales.values())
    assert torch.allclose(scales["scale_s"] * scales["descale_s"], torch.ones(1))
    assert torch.allclose(scales["scale_o"] * scales["descale_v"], torch.ones(1))
    assert torch.allclose(v8.float() * scales["descale_v"], v.float(), rtol=2 ** -4, atol=1e-3)


def test_missing_frontend_is_a_recorded_skip(cudnn_fp8, bench_fp8, monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn -> ImportError
    assert "not importable" in cudnn_fp8.unavailable()
    monkeypatch.setattr(bench_fp8, "cudnn_fp8", cudnn_fp8)
    anchor, skip = bench_fp8.cudnn_anchor()
    assert anchor is None and "not importable" in skip


def test_output_check_times_only_an_anchor_that_computes_attention(cudnn_fp8, bench_fp8):
    from cute_attn.reference import attention_ref

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 96, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    expected, _ = attention_ref(q, k, v, causal=True)
    inputs = cudnn_fp8.prepare(q, k, v)

    def faithful(q8, k8, v8, scales, causal):  # attention on the dequantised inputs, O as cuDNN scales it
        deq = [t.float() * scales[f"descale_{n}"] for t, n in zip((q8, k8, v8), "qkv")]
        out, _ = attention_ref(*deq, causal=causal)
        return (out * scales["scale_o"]).to(torch.float8_e4m3fn)

    def transposed_mask(q8, k8, v8, scales, causal):  # a plausible bug: the mask flipped
        return faithful(q8.flip(1), k8.flip(1), v8.flip(1), scales, causal).flip(1)

    assert bench_fp8.cudnn_error(faithful, inputs, True, expected) <= bench_fp8.MAX_ANCHOR_REL_RMSE / 2
    assert bench_fp8.cudnn_error(transposed_mask, inputs, True, expected) > bench_fp8.MAX_ANCHOR_REL_RMSE
