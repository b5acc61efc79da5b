"""CPU tests of perf/bench.py's pure helpers and of the perf/harness.py ones it runs on:
FLOPs, slug, table, records, JSON, the check, the interleaved timing rounds, and the
backward timer and sweep run on CPU tensors (with do_bench and CUDA synchronisation stubbed
out). tests/test_harness_cpu.py has the rest of perf/harness.py.

Loads the script by path, so it needs neither a GPU, triton nor `perf` being a package.
"""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch

PERF = Path(__file__).resolve().parents[1] / "perf"
BENCH_PATH = PERF / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("perf_bench_under_test", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def harness(bench):
    return bench.harness  # perf/harness.py, as bench.py imported it


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
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--host-overhead", "--bwd", "--rounds"):
        assert flag in proc.stdout


def _notebook_names(module):
    """The attributes of `module` (bench, variants) that the notebooks' code cells use."""
    names = set()
    for path in (PERF.parent / "notebooks").glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                names |= set(re.findall(rf"\b{module}\.(\w+)", "".join(cell["source"])))
    return names - {"py"}  # "perf/bench.py" in a comment


def test_notebook_names_stay(bench):
    # notebooks/01, 04, 05 and 06 use bench's helpers, most of them in perf/harness.py now
    names = _notebook_names("bench")
    assert {"check_error", "format_table", "run_sweep", "load_impls"} <= names
    assert [n for n in sorted(names) if not hasattr(bench, n)] == []
    spec = importlib.util.spec_from_file_location("perf_variants_under_test",
                                                  PERF / "variants.py")
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)
    assert "variants_for" in _notebook_names("variants")
    assert [n for n in sorted(_notebook_names("variants")) if not hasattr(variants, n)] == []


@pytest.mark.parametrize("b,h,s,d", [(8, 16, 2048, 128), (1, 3, 77, 64)])
def test_flops_formula(harness, b, h, s, d):
    full = harness.attention_flops(b, h, s, s, d, causal=False)
    assert full == 4 * b * h * s * s * d
    assert harness.attention_flops(b, h, s, s, d, causal=True) == full / 2


def test_flops_rectangular(harness):
    assert (harness.attention_flops(2, 4, 100, 300, 64, causal=False)
            == 4 * 2 * 4 * 100 * 300 * 64)


def test_tflops(harness):
    # 1e12 FLOPs in 1 ms is 1000 TFLOP/s.
    assert harness.tflops(1e12, 1.0) == pytest.approx(1000.0)
    with pytest.raises(ValueError):
        harness.tflops(1e12, 0.0)


def test_hdim128_seqlen8k_flops_matches_notes(harness):
    # perf/NOTES.md quotes this number for batch 2, 16 heads, seqlen 8192, headdim 128.
    assert harness.attention_flops(2, 16, 8192, 8192, 128, causal=False) == 1099511627776


@pytest.mark.parametrize("name,slug", [
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
    ("NVIDIA H200", "nvidia-h200"),
    ("  NVIDIA H100 PCIe (MIG 1g.10gb) ", "nvidia-h100-pcie-mig-1g-10gb"),
    ("", "unknown-device"),
])
def test_device_slug(harness, name, slug):
    assert harness.device_slug(name) == slug


def test_sweep_shapes(bench, harness):
    assert harness.sweep_shape(512, 64) == (32, 32)
    assert harness.sweep_shape(16384, 128) == (1, 16)
    for s in bench.SEQLENS:
        for d in bench.HEADDIMS:
            b, h = harness.sweep_shape(s, d)
            assert b * s == 16384 and h * d == 2048
    with pytest.raises(ValueError, match="seqlen"):
        harness.sweep_shape(3000, 128)
    with pytest.raises(ValueError, match="headdim"):
        harness.sweep_shape(1024, 96)


def test_make_record_schema(bench):
    rec = bench.make_record("cute_attn", "bf16", 128, True, 2, 16, 8192, 8192, ms=1.0)
    assert set(rec) == set(bench.RECORD_KEYS)
    assert rec["pass"] == "fwd" and rec["causal"] is True
    assert rec["tflops"] == pytest.approx(1099511627776 / 2 / 1e-3 / 1e12)


@pytest.mark.parametrize("b,h,sq,sk,d", [(2, 16, 8192, 8192, 128), (3, 5, 77, 129, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_flops_formula(harness, b, h, sq, sk, d, causal):
    # causal is bottom-right: 77 queries against 129 keys see 129 * 77 - 77^2 / 2 pairs
    # (tests/test_perf_audit_cpu.py checks the rule against the exact pair count)
    fwd = 4 * b * h * (sq * sk - sq * sq / 2 if causal else sq * sk) * d
    assert harness.attention_flops(b, h, sq, sk, d, causal) == fwd
    assert harness.attention_flops(b, h, sq, sk, d, causal, "fwd") == fwd
    assert harness.attention_flops(b, h, sq, sk, d, causal, "bwd") == 2.5 * fwd
    with pytest.raises(ValueError, match="pass_name"):
        harness.attention_flops(b, h, sq, sk, d, causal, "backward")


def test_make_record_bwd_from_rounds(bench):
    rounds = [1.3, 1.0, 1.1, 5.0, 1.2]  # one outlier round; the median ignores it
    rec = bench.make_record("fa4", "bf16", 128, False, 2, 16, 8192, 8192, pass_name="bwd",
                            ms_rounds=rounds)
    assert set(bench.RECORD_KEYS) <= set(rec)
    assert set(rec) - set(bench.RECORD_KEYS) == set(bench.ROUND_KEYS)
    assert rec["pass"] == "bwd" and rec["ms"] == pytest.approx(1.2)
    assert rec["ms_rounds"] == rounds
    # 2.5 x 2^40 FLOPs in 1.2 ms
    assert rec["tflops"] == pytest.approx(2.5 * 1099511627776 / 1.2e-3 / 1e12)
    fwd = bench.make_record("fa4", "bf16", 128, False, 2, 16, 8192, 8192, ms=1.2)
    assert rec["tflops"] == pytest.approx(2.5 * fwd["tflops"])
    # An explicit ms wins over the rounds' median; neither is an error.
    assert bench.make_record("fa4", "bf16", 128, False, 2, 16, 8192, 8192, 2.0,
                             ms_rounds=rounds)["ms"] == 2.0
    with pytest.raises(ValueError, match="ms or ms_rounds"):
        bench.make_record("fa4", "bf16", 128, False, 2, 16, 8192, 8192)
    assert json.loads(json.dumps(rec)) == rec


def test_median_and_spread(harness):
    assert harness.median_ms([3.0, 1.0, 2.0]) == 2.0
    assert harness.median_ms([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert harness.median_ms([0.7]) == 0.7
    with pytest.raises(ValueError):
        harness.median_ms([])
    assert harness.round_spread([1.0, 1.1, 0.9]) == pytest.approx(0.2)
    assert harness.round_spread([2.0, 2.0]) == 0.0


def test_round_order_rotates(harness):
    names = ["a", "b", "c", "d"]
    assert harness.round_order(names, 0) == names
    assert harness.round_order(names, 1) == ["b", "c", "d", "a"]
    assert harness.round_order(names, 5) == harness.round_order(names, 1)
    assert harness.round_order([], 3) == []
    # Over len(names) rounds every name takes every position once.
    positions = {n: sorted(harness.round_order(names, r).index(n) for r in range(4))
                 for n in names}
    assert all(p == [0, 1, 2, 3] for p in positions.values())


def _recording_timers(names, calls, value=lambda name, i: 1.0):
    def timer(name):
        def run():
            calls.append(name)
            return value(name, len(calls) - 1)
        return run
    return {name: timer(name) for name in names}


def test_run_rounds_interleaves(harness):
    calls = []
    names = ["cute_attn", "fa4", "sdpa_cudnn"]
    ms, errors = harness.run_rounds(
        _recording_timers(names, calls, value=lambda name, i: float(i)), rounds=4)
    assert errors == {}
    # Every round times each impl once, in the rotated order, before the next round starts.
    assert calls == [n for r in range(4) for n in harness.round_order(names, r)]
    # Each impl's values are its own calls' results, in round order.
    for name in names:
        assert ms[name] == [float(i) for i, c in enumerate(calls) if c == name]
    assert list(ms) == names


def test_run_rounds_cancel_a_drift(harness):
    """A clock that drifts 3% per measurement: interleaved rounds keep the ratio of two impls
    close to the true 1.10, where timing one impl's rounds after the other's would not."""
    calls = []
    true_ms = {"a": 1.0, "b": 1.1}
    ms, _ = harness.run_rounds(_recording_timers(
        ["a", "b"], calls, value=lambda name, i: true_ms[name] * (1 + 0.03 * i)), rounds=5)
    interleaved = harness.median_ms(ms["b"]) / harness.median_ms(ms["a"])
    assert interleaved == pytest.approx(1.10, abs=0.04)
    # The same 10 measurements back to back (a's five, then b's five) read 1.10 * 1.15.
    back_to_back = (1.1 * (1 + 0.03 * 7)) / (1 + 0.03 * 2)
    assert abs(back_to_back - 1.10) > 3 * abs(interleaved - 1.10)


def test_run_rounds_drops_a_failing_impl(harness):
    calls = []

    def value(name, i):
        if name == "fa4" and calls.count("fa4") == 2:
            raise RuntimeError("boom in round 2")
        return 1.0

    ms, errors = harness.run_rounds(
        _recording_timers(["cute_attn", "fa4", "sdpa_flash"], calls, value), rounds=3,
        on_error=lambda name, exc: False)
    assert set(ms) == {"cute_attn", "sdpa_flash"}
    assert all(len(v) == 3 for v in ms.values())
    assert list(errors) == ["fa4"] and "boom" in str(errors["fa4"])
    assert calls.count("fa4") == 2  # not called again after it raised


def test_run_rounds_stop(harness):
    calls = []

    def value(name, i):
        if name == "b":
            raise RuntimeError("illegal memory access")
        return 1.0

    ms, errors = harness.run_rounds(_recording_timers(["a", "b", "c"], calls, value),
                                    rounds=3, on_error=lambda name, exc: True)
    assert ms == {} and list(errors) == ["b"]
    assert calls == ["a", "b"]  # stopped at once, "c" never ran
    with pytest.raises(ValueError, match="rounds"):
        harness.run_rounds({}, rounds=0)


def test_is_unsupported_and_skip_summary(bench, harness):
    assert harness.is_unsupported(NotImplementedError("no bwd"))
    assert harness.is_unsupported(harness.BackwardUnsupported("no grad_fn"))
    assert not harness.is_unsupported(RuntimeError("CUDA error"))
    notes = []
    unsupported = {"impl": "cute_attn", "shape": None, "reason": "NotImplementedError: bwd",
                   "unsupported": True}
    broken = {"impl": "cute_attn", "shape": {"seqlen": 1024}, "reason": "RuntimeError: x"}
    anchor = {"impl": "fa4", "shape": None, "reason": "ImportError: no flash_attn"}
    assert harness.summarize_skips([unsupported, anchor], bench.IMPLS, notes) == []
    assert len(notes) == 1 and "NotImplementedError: bwd" in notes[0]
    assert harness.summarize_skips([broken, unsupported], bench.IMPLS, []) == [
        "cute_attn skipped 1 time(s)"]
    assert harness.summarize_skips([broken], ["fa4"], []) == []


def test_ratio(harness):
    assert harness.ratio(300.0, 600.0) == pytest.approx(0.5)
    assert harness.ratio(None, 600.0) is None
    assert harness.ratio(300.0, None) is None
    assert harness.ratio(300.0, 0.0) is None


def _records(bench):
    harness = bench.harness
    recs = []
    for impl, scale in [("cute_attn", 0.9), ("fa4", 1.0), ("sdpa_cudnn", 0.95)]:
        for s in (1024, 4096):
            b, h = harness.sweep_shape(s, 128)
            flops = harness.attention_flops(b, h, s, s, 128, causal=False)
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


def test_results_json_schema(bench, harness):
    recs = _records(bench)
    host = {"impls": {"cute_attn": {"us_per_call": 7.0, "first_call_s": 1.5}}}
    res = harness.build_results("NVIDIA H100 80GB HBM3", recs, torch_version="2.11.0",
                                cutlass_dsl=None, cuda="13.0", host=host, skipped=[])
    for key in harness.RESULT_KEYS:
        assert key in res
    assert res["host"] == host
    assert res["date"][:2] == "20" and "T" in res["date"]
    round_trip = json.loads(json.dumps(res))
    for rec in round_trip["records"]:
        assert set(bench.RECORD_KEYS) <= set(rec)
    assert "host" not in harness.build_results("x", [], torch_version=None, cutlass_dsl=None,
                                               cuda=None)


def test_result_paths(harness, tmp_path):
    j = harness.result_path(tmp_path, "nvidia-h200", "fwd")
    p = harness.result_path(tmp_path, "nvidia-h200", "fwd", ".png")
    assert j.name == "nvidia-h200-fwd.json" and p.name == "nvidia-h200-fwd.png"
    j = harness.result_path(tmp_path, "nvidia-h200", "bwd")
    assert j.name == "nvidia-h200-bwd.json"
    assert j.with_suffix(".png").name == "nvidia-h200-bwd.png"
    assert j.parent == tmp_path
    with pytest.raises(ValueError):
        harness.result_path(tmp_path, "nvidia-h200", "both")


def test_table_title_names_the_pass(bench):
    recs = [dict(r, **{"pass": "bwd"}) for r in _records(bench)]
    assert "bf16 bwd, TFLOP/s" in bench.format_table(recs, 128, False, ["cute_attn"])
    assert "bf16 fwd, TFLOP/s" in bench.format_table(_records(bench), 128, False,
                                                      ["cute_attn"])


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


def test_parse_args_rounds_and_bwd(bench):
    full = bench.parse_args([])
    assert full.rounds == bench.ROUNDS == 5 and full.pass_name == "fwd" and not full.bwd
    quick = bench.parse_args(["--quick"])
    assert quick.rounds == bench.QUICK_ROUNDS == 3
    assert bench.parse_args(["--quick", "--rounds", "7"]).rounds == 7
    bwd = bench.parse_args(["--bwd"])
    assert bwd.pass_name == "bwd" and bwd.rounds == 5
    assert bwd.seqlens == list(bench.SEQLENS) and bwd.headdims == [64, 128]
    bwd_quick = bench.parse_args(["--bwd", "--quick"])
    assert bwd_quick.pass_name == "bwd" and bwd_quick.quick
    assert bwd_quick.seqlens == [1024, 4096] and bwd_quick.headdims == [128]
    assert bwd_quick.rounds == 3
    for bad in (["--rounds", "0"], ["--rounds", "-2"], ["--rounds", "two"],
                ["--bwd", "--host-overhead"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


# --- the backward timer and the sweep, on CPU tensors --------------------------------------

def _plain_attention(q, k, v, causal):
    return _attention(q, k, v, causal)


class _ProbeGradLayout(torch.autograd.Function):
    """Identity that records whether the gradient reaching it is contiguous."""
    seen: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _ProbeGradLayout.seen.append(grad.is_contiguous())
        return grad


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, dout):
        raise NotImplementedError("backward of this kernel is not written yet")


def _cpu_impls(harness, forward_calls):
    def counted(q, k, v, causal):
        forward_calls.append(1)
        return _plain_attention(q, k, v, causal)

    def transposed(q, k, v, causal):
        # Like the SDPA anchors: the kernel writes (b, h, s, d) memory and out is a
        # (b, s, h, d) view of it; the probe sees the gradient the kernel would get.
        out_bhsd = _ProbeGradLayout.apply(_attention(q, k, v, causal).transpose(1, 2)
                                          .contiguous())
        return out_bhsd.transpose(1, 2)

    return {
        "cute_attn": harness.Impl("cute_attn", counted),
        "sdpa_flash": harness.Impl("sdpa_flash", transposed),
        "fa4": harness.Impl("fa4", lambda q, k, v, causal: _NoBackward.apply(q, k, v)),
        "sdpa_cudnn": harness.Impl("sdpa_cudnn", lambda q, k, v, causal: q.detach() * 1),
    }


@pytest.fixture
def cpu_gpu_side(harness, monkeypatch):
    """Run the GPU-side helpers on CPU: no-op synchronize, do_bench = three plain calls."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    timed = []

    def fake_do_bench(fn):
        for _ in range(3):
            timed.append(fn())
        return 0.5 + 0.1 * len(timed)

    monkeypatch.setattr(harness, "do_bench", fake_do_bench)
    monkeypatch.setattr(harness, "cuda_is_healthy", lambda: True)

    def cpu_qkv(batch, seqlen, nheads, headdim, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, generator=gen)
                for _ in range(3)]

    monkeypatch.setattr(harness, "random_qkv", cpu_qkv)
    return timed


def test_bwd_timer_times_only_the_backward(harness, cpu_gpu_side):
    timed = cpu_gpu_side
    forward_calls = []
    impls = _cpu_impls(harness, forward_calls)
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 9, 3, 8, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    timer = harness.make_bwd_timer(impls["cute_attn"], q, k, v, dout, True)
    assert len(forward_calls) == 1  # out built once, at set-up
    ms = timer()
    assert ms > 0 and len(timed) == 3
    assert len(forward_calls) == 1  # the timed function ran no forward
    # What was timed is the gradient of out for dout, wrt (q, k, v), without accumulating.
    expected = torch.autograd.grad(_plain_attention(q, k, v, True), (q, k, v), dout)
    for got in timed:
        assert len(got) == 3
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    assert q.grad is None
    # An impl whose out is a transposed view gets dout with the same values, laid out like
    # its out: the (b, h, s, d) kernel sees a contiguous gradient.
    timed.clear()
    _ProbeGradLayout.seen.clear()
    harness.make_bwd_timer(impls["sdpa_flash"], q, k, v, dout, True)()
    for g, e in zip(timed[0], expected):
        torch.testing.assert_close(g, e)
    assert _ProbeGradLayout.seen and all(_ProbeGradLayout.seen)


def test_bwd_timer_unsupported(harness, cpu_gpu_side):
    impls = _cpu_impls(harness, [])
    q, k, v, dout = (torch.randn(1, 4, 2, 8) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with pytest.raises(NotImplementedError) as info:
        harness.make_bwd_timer(impls["fa4"], q, k, v, dout, False)
    assert harness.is_unsupported(info.value)
    with pytest.raises(harness.BackwardUnsupported, match="sdpa_cudnn .* no grad_fn"):
        harness.make_bwd_timer(impls["sdpa_cudnn"], q, k, v, dout, False)


@pytest.mark.parametrize("pass_name", ["fwd", "bwd"])
def test_sweep_on_cpu(bench, harness, cpu_gpu_side, monkeypatch, pass_name):
    impls = _cpu_impls(harness, [])
    skipped = []
    sweep_shape = harness.sweep_shape
    # Tiny shapes: batch * seqlen = 64, nheads * headdim = 128.
    monkeypatch.setattr(harness, "sweep_shape", lambda s, d: sweep_shape(s, d, 64, 128))
    records, healthy = bench.run_sweep(impls, torch.float32, "fp32", [64], [False, True],
                                       [16, 32], skipped, pass_name=pass_name, rounds=3)
    assert healthy
    measured = {"cute_attn", "sdpa_flash"} | ({"fa4", "sdpa_cudnn"} if pass_name == "fwd"
                                             else set())
    assert {r["impl"] for r in records} == measured
    assert len(records) == len(measured) * 2 * 2
    for rec in records:
        assert set(bench.RECORD_KEYS) <= set(rec) and rec["pass"] == pass_name
        assert len(rec["ms_rounds"]) == 3
        assert rec["ms"] == harness.median_ms(rec["ms_rounds"])
        assert rec["batch"] * rec["seqlen_q"] == 64 and rec["nheads"] == 2
    if pass_name == "bwd":
        # fa4 here raises NotImplementedError, sdpa_cudnn has no grad_fn: both unsupported,
        # once per shape, and neither fails the run.
        assert {s["impl"] for s in skipped} == {"fa4", "sdpa_cudnn"}
        assert len(skipped) == 2 * 2 * 2 and all(s["unsupported"] for s in skipped)
        assert harness.summarize_skips(skipped, bench.IMPLS, []) == []
    else:
        assert skipped == []


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


def test_check_accepts_correctly_rounded(harness, qkv):
    q, k, v = qkv
    ref = _attention(q, k, v, causal=True)
    lowp = _attention(*(t.bfloat16() for t in qkv), causal=True)
    c = harness.check_error(ref.bfloat16(), ref, lowp)
    assert c["ok"], c


@pytest.mark.parametrize("wrong", ["missing_scale", "top_left", "non_causal", "nan"])
def test_check_catches_wrong_answers(harness, qkv, wrong):
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
    c = harness.check_error(bad.bfloat16(), ref, lowp)
    assert not c["ok"], c


def test_check_catches_lse_base2(harness, qkv):
    q, k, _ = qkv
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 64 ** -0.5
    lse = scores.logsumexp(-1)
    lse_lowp = scores.bfloat16().float().logsumexp(-1)
    assert harness.check_error(lse, lse, lse_lowp, floor=1e-3)["ok"]
    assert not harness.check_error(lse / math.log(2), lse, lse_lowp, floor=1e-3)["ok"]


def test_check_shape_mismatch(harness, qkv):
    q, k, v = qkv
    ref = _attention(q, k, v, causal=False)
    c = harness.check_error(ref.transpose(1, 2), ref, ref)
    assert not c["ok"] and "shape" in c["why"]


def test_plot_is_small(bench, harness, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed on this machine")
    recs = []
    for d in (64, 128):
        for causal in (False, True):
            for impl in bench.IMPLS:
                for s in bench.SEQLENS:
                    b, h = harness.sweep_shape(s, d)
                    recs.append(bench.make_record(impl, "bf16", d, causal, b, h, s, s,
                                                  ms=1.0 + s / 1e4))
    path = tmp_path / "plot.png"
    harness.plot_sweep(recs, path, "NVIDIA H100 80GB HBM3", list(bench.IMPLS),
                       palette=bench.IMPLS)
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert path.stat().st_size < 100_000


def test_decode_graph_timing_rotates_enough_kv_copies():
    """perf/bench_decode.py --graph: the captured calls cycle through enough K/V copies that
    2 x L2 of other keys pass between two reads of one copy; one copy when K/V alone
    are that large, never more copies than calls."""
    spec = importlib.util.spec_from_file_location("perf_bench_decode_under_test", PERF / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    l2 = 50 << 20
    assert module.rotating_copies(8 << 20, l2) == 14  # b1 x 2K, 64/8 heads: 8 MiB of K/V
    assert module.rotating_copies(128 << 20, l2) == 1
    assert module.rotating_copies(1 << 10, l2) == module.GRAPH_CALLS
    assert module.rotating_copies(0, l2) == 1
    for kv in (1 << 20, 3 << 20, 33 << 20, 100 << 20):
        n = module.rotating_copies(kv, l2)
        assert (n - 1) * kv >= 2 * l2 or n == module.GRAPH_CALLS or (n == 1 and kv >= 2 * l2)


def test_decode_published_points_are_the_grids_points_with_a_cudnn_figure():
    """perf/bench_decode.py --grid --published: one query at batch 1 x 32K / 128K and batch 128
    at every key count (the issue gives batch 128's figure for all of them); nothing else."""
    spec = importlib.util.spec_from_file_location("perf_bench_decode_published", PERF / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    points = [s[:3] for s in module.GRID if module.published_gbs(*s[:3]) is not None]
    assert points == [(1, 1, 32768), (1, 1, 131072), (128, 1, 2048), (128, 1, 8192), (128, 1, 32768),
                      (128, 1, 131072)], points
    assert module.published_gbs(1, 8, 32768) is None and module.published_gbs(128, 1, 2048) == 4500


def test_bwd_cta_clocks_instruments_the_backward_without_spilling(monkeypatch):
    """perf/bwd_cta_clocks.py: the wrapped producer, consumer and step compile into the
    hd-64 causal backward with their clock reads and stores (two step bodies: a first-step
    and a last-step read of %globaltimer each), spill-free; the originals come back after."""
    import re

    from cute_attn import launcher, ptx as ptx_tool
    from cute_attn.config import AttnFeatures, bwd_config_for
    from cute_attn.kernels import bwd_sm90

    spec = importlib.util.spec_from_file_location("perf_bwd_cta_clocks", PERF / "bwd_cta_clocks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("produce", "consume", "step"):
        monkeypatch.setattr(bwd_sm90.FlashBwdSm90, name, getattr(bwd_sm90.FlashBwdSm90, name))
    monkeypatch.setenv("CUTE_ATTN_CACHE", "0")
    module.instrument(0x7F0000000000)
    features = AttnFeatures(mask="causal")
    key = launcher.BwdKey("bf16", 64, features, bwd_config_for(64, features, max_seqlen_q=512))
    text = launcher.compile_bwd(key, "--keep-ptx")[1].__ptx__
    assert text.count("%globaltimer") == 7 and text.count("st.global.u64") == 8 and "%smid" in text
    report = ptx_tool.ptxas_report(text)
    if "ptxas not found" not in report:
        m = re.search(r"(\d+) bytes spill stores", report)
        assert m and int(m.group(1)) == 0, report
