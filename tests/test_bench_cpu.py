"""CPU tests of perf/bench.py's pure helpers: FLOPs, slug, table, records, JSON, the check.

Loads the script by path, so it needs neither a GPU, triton nor `perf` being a package.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH_PATH = Path(__file__).resolve().parents[1] / "perf" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("perf_bench_under_test", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_import_needs_no_gpu_stack():
    # Importing (and --help) must work where triton, matplotlib and cute_attn are absent:
    # block them in a fresh interpreter, where a blocked import raises ImportError.
    code = (
        "import sys, importlib.util\n"
        "for name in ('triton', 'matplotlib', 'cute_attn', 'flash_attn'):\n"
        "    sys.modules[name] = None\n"
        f"spec = importlib.util.spec_from_file_location('b', {str(BENCH_PATH)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert m.attention_flops(1, 1, 2, 2, 4, False) == 64\n"
        "m.parse_args(['--help'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--host-overhead" in proc.stdout


@pytest.mark.parametrize("b,h,s,d", [(8, 16, 2048, 128), (1, 3, 77, 64)])
def test_flops_formula(bench, b, h, s, d):
    full = bench.attention_flops(b, h, s, s, d, causal=False)
    assert full == 4 * b * h * s * s * d
    assert bench.attention_flops(b, h, s, s, d, causal=True) == full / 2


def test_flops_rectangular(bench):
    assert bench.attention_flops(2, 4, 100, 300, 64, causal=False) == 4 * 2 * 4 * 100 * 300 * 64


def test_tflops(bench):
    # 1e12 FLOPs in 1 ms is 1000 TFLOP/s.
    assert bench.tflops(1e12, 1.0) == pytest.approx(1000.0)
    with pytest.raises(ValueError):
        bench.tflops(1e12, 0.0)


def test_hdim128_seqlen8k_flops_matches_notes(bench):
    # perf/NOTES.md quotes this number for batch 2, 16 heads, seqlen 8192, headdim 128.
    assert bench.attention_flops(2, 16, 8192, 8192, 128, causal=False) == 1099511627776


@pytest.mark.parametrize("name,slug", [
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
    ("NVIDIA H200", "nvidia-h200"),
    ("  NVIDIA H100 PCIe (MIG 1g.10gb) ", "nvidia-h100-pcie-mig-1g-10gb"),
    ("", "unknown-device"),
])
def test_device_slug(bench, name, slug):
    assert bench.device_slug(name) == slug


def test_sweep_shapes(bench):
    assert bench.sweep_shape(512, 64) == (32, 32)
    assert bench.sweep_shape(16384, 128) == (1, 16)
    for s in bench.SEQLENS:
        for d in bench.HEADDIMS:
            b, h = bench.sweep_shape(s, d)
            assert b * s == 16384 and h * d == 2048
    with pytest.raises(ValueError, match="seqlen"):
        bench.sweep_shape(3000, 128)
    with pytest.raises(ValueError, match="headdim"):
        bench.sweep_shape(1024, 96)


def test_make_record_schema(bench):
    rec = bench.make_record("cute_attn", "bf16", 128, True, 2, 16, 8192, 8192, ms=1.0)
    assert set(rec) == set(bench.RECORD_KEYS)
    assert rec["pass"] == "fwd" and rec["causal"] is True
    assert rec["tflops"] == pytest.approx(1099511627776 / 2 / 1e-3 / 1e12)


def test_ratio(bench):
    assert bench.ratio(300.0, 600.0) == pytest.approx(0.5)
    assert bench.ratio(None, 600.0) is None
    assert bench.ratio(300.0, None) is None
    assert bench.ratio(300.0, 0.0) is None


def _records(bench):
    recs = []
    for impl, scale in [("cute_attn", 0.9), ("fa4", 1.0), ("sdpa_cudnn", 0.95)]:
        for s in (1024, 4096):
            b, h = bench.sweep_shape(s, 128)
            flops = bench.attention_flops(b, h, s, s, 128, causal=False)
            ms = flops / (600e12 * scale) * 1e3  # so tflops = 600 * scale
            recs.append(bench.make_record(impl, "bf16", 128, False, b, h, s, s, ms))
    return recs


def test_table_has_impls_and_ratios(bench):
    recs = _records(bench)
    impls = ["cute_attn", "fa4", "sdpa_cudnn", "sdpa_flash"]
    table = bench.format_table(recs, 128, False, impls)
    lines = table.splitlines()
    header = lines[1].split()
    assert header == ["seqlen", *impls, "cute_attn/fa4", "cute_attn/cudnn"]
    row_4k = next(line.split() for line in lines if line.split()[:1] == ["4096"])
    assert row_4k[1] == "540.0" and row_4k[2] == "600.0" and row_4k[3] == "570.0"
    assert row_4k[4] == "-"  # sdpa_flash not measured
    assert float(row_4k[5]) == pytest.approx(0.9, abs=1e-3)
    assert float(row_4k[6]) == pytest.approx(0.9 / 0.95, abs=1e-3)
    # The other config has no data: the table says so rather than printing nothing.
    assert "no measurements" in bench.format_table(recs, 128, True, impls)


def test_table_ratio_missing_anchor(bench):
    recs = [r for r in _records(bench) if r["impl"] != "fa4"]
    table = bench.format_table(recs, 128, False, ["cute_attn", "sdpa_cudnn"])
    row = next(line.split() for line in table.splitlines() if line.split()[:1] == ["1024"])
    assert row[-2] == "-" and row[-1] != "-"


def test_results_json_schema(bench):
    recs = _records(bench)
    host = {"impls": {"cute_attn": {"us_per_call": 7.0, "first_call_s": 1.5}}}
    res = bench.build_results("NVIDIA H100 80GB HBM3", recs, torch_version="2.11.0",
                              cutlass_dsl=None, cuda="13.0", host=host, skipped=[])
    for key in bench.RESULT_KEYS:
        assert key in res
    assert res["host"] == host
    assert res["date"][:2] == "20" and "T" in res["date"]
    round_trip = json.loads(json.dumps(res))
    for rec in round_trip["records"]:
        assert set(bench.RECORD_KEYS) <= set(rec)
    assert "host" not in bench.build_results("x", [], torch_version=None, cutlass_dsl=None,
                                             cuda=None)


def test_result_paths(bench, tmp_path):
    j, p = bench.result_paths(tmp_path, "nvidia-h200")
    assert j.name == "nvidia-h200-fwd.json" and p.name == "nvidia-h200-fwd.png"


def test_parse_args_modes(bench):
    quick = bench.parse_args(["--quick"])
    assert quick.seqlens == [1024, 4096] and quick.headdims == [128]
    full = bench.parse_args([])
    assert full.seqlens == list(bench.SEQLENS) and full.headdims == [64, 128]
    assert full.impls == list(bench.IMPLS) and full.out is None
    some = bench.parse_args(["--impls", "cute_attn,sdpa_flash", "--causal", "yes",
                             "--seqlens", "512,2048"])
    assert some.impls == ["cute_attn", "sdpa_flash"] and some.seqlens == [512, 2048]
    assert bench.causal_modes(some.causal) == [True]
    with pytest.raises(SystemExit):
        bench.parse_args(["--impls", "cute_attn,nope"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--seqlens", "3000"])  # does not divide 16384


def test_bwd_not_implemented(bench):
    with pytest.raises(SystemExit, match="backward benchmark not implemented yet"):
        bench.main(["--bwd"])


# --- the correctness check bites ----------------------------------------------------------

def _attention(q, k, v, causal, scale=None, top_left=False):
    """Plain attention on (b, s, h, d); bottom-right causal unless top_left."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        offset = 0 if top_left else sk - sq
        row = torch.arange(sq)[:, None]
        col = torch.arange(sk)[None, :]
        scores = scores.masked_fill(col > row + offset, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


@pytest.fixture(scope="module")
def qkv():
    gen = torch.Generator().manual_seed(0)
    shape_q, shape_k = (2, 37, 3, 64), (2, 53, 3, 64)
    q = torch.randn(shape_q, generator=gen)
    k = torch.randn(shape_k, generator=gen)
    v = torch.randn(shape_k, generator=gen)
    return q, k, v


def test_check_accepts_correctly_rounded(bench, qkv):
    q, k, v = qkv
    ref = _attention(q, k, v, causal=True)
    lowp = _attention(*(t.bfloat16() for t in qkv), causal=True)
    c = bench.check_error(ref.bfloat16(), ref, lowp)
    assert c["ok"], c


@pytest.mark.parametrize("wrong", ["missing_scale", "top_left", "non_causal", "nan"])
def test_check_catches_wrong_answers(bench, qkv, wrong):
    q, k, v = qkv
    ref = _attention(q, k, v, causal=True)
    lowp = _attention(*(t.bfloat16() for t in qkv), causal=True)
    if wrong == "missing_scale":
        bad = _attention(q, k, v, causal=True, scale=1.0)
    elif wrong == "top_left":
        bad = _attention(q, k, v, causal=True, top_left=True)
    elif wrong == "non_causal":
        bad = _attention(q, k, v, causal=False)
    else:
        bad = ref.clone()
        bad[0, 0, 0, 0] = float("nan")
    c = bench.check_error(bad.bfloat16(), ref, lowp)
    assert not c["ok"], c


def test_check_catches_lse_base2(bench, qkv):
    q, k, v = qkv
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 64 ** -0.5
    lse = scores.logsumexp(-1)
    lse_lowp = scores.bfloat16().float().logsumexp(-1)
    assert bench.check_error(lse, lse, lse_lowp, floor=1e-3)["ok"]
    assert not bench.check_error(lse / math.log(2), lse, lse_lowp, floor=1e-3)["ok"]


def test_check_shape_mismatch(bench, qkv):
    q, k, v = qkv
    ref = _attention(q, k, v, causal=False)
    c = bench.check_error(ref.transpose(1, 2), ref, ref)
    assert not c["ok"] and "shape" in c["why"]


def test_plot_is_small(bench, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed on this machine")
    recs = []
    for d in (64, 128):
        for causal in (False, True):
            for impl in bench.IMPLS:
                for s in bench.SEQLENS:
                    b, h = bench.sweep_shape(s, d)
                    recs.append(bench.make_record(impl, "bf16", d, causal, b, h, s, s,
                                                  ms=1.0 + s / 1e4))
    path = tmp_path / "plot.png"
    bench.plot_results(recs, path, "NVIDIA H100 80GB HBM3", list(bench.IMPLS))
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert path.stat().st_size < 100_000
