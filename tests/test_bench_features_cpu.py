"""CPU tests of perf/bench_features.py: the exact FLOP counter, the varlen length generator,
the case list, the support matrix, records, ratios and the table, the padding helpers, and
the orchestration (binders, timers, rounds, the correctness check) on CPU tensors with the
SDPA binders running torch's math backend and do_bench stubbed out.

Loads the script by path, so it needs neither a GPU, triton nor `perf` being a package.
"""

import contextlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cute_attn.reference import attention_ref, attention_ref_varlen, visible_keys

PERF = Path(__file__).resolve().parents[1] / "perf"
FEATURES_PATH = PERF / "bench_features.py"


@pytest.fixture(scope="module")
def bf():
    spec = importlib.util.spec_from_file_location("perf_bench_features_under_test",
                                                  FEATURES_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_import_needs_no_gpu_stack():
    code = (
        "import sys, importlib.util\n"
        "for name in ('triton', 'matplotlib', 'cute_attn', 'flash_attn'):\n"
        "    sys.modules[name] = None\n"
        f"spec = importlib.util.spec_from_file_location('f', {str(FEATURES_PATH)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert m.visible_pairs(4, 4, causal=True) == 10\n"
        "assert len(m.build_cases()) == 5\n"
        "m.parse_args(['--help'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--quick", "--bwd", "--fwd", "--rounds", "--cases", "--no-cudnn-nested"):
        assert flag in proc.stdout


# --- FLOPs ---------------------------------------------------------------------------------

def _brute_pairs(sq, sk, causal, window):
    left, right = window
    if causal:
        right = 0
    shift = sk - sq
    return sum(1 for i in range(sq) for j in range(sk)
               if (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right))


WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (0, 5), (4, 4), (7, -1), (-1, 2), (100, 100)]


@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (13, 29), (29, 13), (0, 5), (5, 0),
                                   (64, 64)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_matches_reference_mask(bf, sq, sk, window, causal):
    got = bf.visible_pairs(sq, sk, causal, window)
    assert got == _brute_pairs(sq, sk, causal, window)
    mask = visible_keys(sq, sk, causal=causal, window_size=window)
    assert got == (sq * sk if mask is None else int(mask.sum()))


def test_visible_pairs_by_hand(bf):
    assert bf.visible_pairs(4, 4) == 16
    assert bf.visible_pairs(4, 4, causal=True) == 4 + 3 + 2 + 1
    # Bottom-right: sq < sk, query 0 sees keys 0..2, then 0..3, 0..4.
    assert bf.visible_pairs(3, 5, causal=True) == 3 + 4 + 5
    # sq > sk: the first two queries see no key at all.
    assert bf.visible_pairs(5, 3, causal=True) == 0 + 0 + 1 + 2 + 3
    # (1, 1) on 5 x 5: a band of width 3, clipped at both ends.
    assert bf.visible_pairs(5, 5, window_size=(1, 1)) == 2 + 3 + 3 + 3 + 2
    # causal overrides the right side.
    assert bf.visible_pairs(6, 6, True, (2, 9)) == bf.visible_pairs(6, 6, False, (2, 0))
    with pytest.raises(ValueError):
        bf.visible_pairs(-1, 3)
    with pytest.raises(ValueError):
        bf.visible_pairs(3, 3, window_size=(-2, 0))


def test_window_16k_exact(bf):
    # (4096, 0) causal-local on 16384: query i sees min(i, 4096) + 1 keys.
    expected = 4096 * 4097 // 2 + (16384 - 4096) * 4097
    assert bf.visible_pairs(16384, 16384, True, (4096, 0)) == expected == 58734592
    # (2048, 2048): 4097 keys in the middle, fewer within 2048 of either end.
    edge = sum(2049 + i for i in range(2048))
    assert bf.visible_pairs(16384, 16384, False, (2048, 2048)) == (
        2 * edge + (16384 - 2 * 2048) * 4097)


@pytest.mark.parametrize("b,h,s,d", [(2, 32, 8192, 128), (8, 32, 2048, 128), (3, 5, 77, 64)])
def test_flops_vs_bench_convention(bf, b, h, s, d):
    bench = bf.harness  # perf/bench.py's FLOP convention, in perf/harness.py
    seqs = [(s, s)] * b
    assert bf.feature_flops(d, h, seqs) == bench.attention_flops(b, h, s, s, d, False)
    # Causal: exact s(s+1)/2 pairs vs bench.py's s^2/2, i.e. (1 + 1/s) more.
    exact = bf.feature_flops(d, h, seqs, causal=True)
    assert exact == 4 * d * h * b * s * (s + 1) // 2
    assert exact / bench.attention_flops(b, h, s, s, d, True) == pytest.approx((s + 1) / s)
    assert bf.feature_flops(d, h, seqs, True, pass_name="bwd") == 2.5 * exact
    assert bench.attention_flops(b, h, s, s, d, True, "bwd") * (s + 1) / s == pytest.approx(
        bf.feature_flops(d, h, seqs, True, pass_name="bwd"))
    with pytest.raises(ValueError, match="pass_name"):
        bf.feature_flops(d, h, seqs, pass_name="backward")


def test_flops_rectangular_and_varlen(bf):
    # sq != sk, not causal: every pair.
    assert bf.feature_flops(64, 2, [(100, 300)]) == 4 * 64 * 2 * 100 * 300
    # varlen: the sum over documents, each its own causal triangle.
    lengths = [5, 1, 7, 0]
    got = bf.feature_flops(128, 16, [(n, n) for n in lengths], causal=True)
    assert got == 4 * 128 * 16 * sum(n * (n + 1) // 2 for n in lengths)
    # A window on varlen is per document too.
    got = bf.feature_flops(8, 1, [(5, 5), (3, 3)], window_size=(1, 0))
    assert got == 4 * 8 * ((1 + 2 + 2 + 2 + 2) + (1 + 2 + 2))


# --- varlen lengths ------------------------------------------------------------------------

def test_varlen_lengths_deterministic_and_in_bounds(bf):
    a = bf.varlen_lengths()
    assert a == bf.varlen_lengths()
    assert len(a) == 16 and all(128 <= n <= 8192 for n in a)
    assert 44000 <= sum(a) <= 56000
    assert (sum(a), min(a), max(a)) == (47379, 197, 7985)  # as the module docstring says
    assert all(isinstance(n, int) for n in a)
    assert len(set(a)) > 8  # mixed, not one length repeated
    other = bf.varlen_lengths(seed=1)
    assert other != a and 44000 <= sum(other) <= 56000
    small = bf.varlen_lengths(5, 17, 400, seed=1, total_range=(300, 1500))
    assert len(small) == 5 and all(17 <= n <= 400 for n in small)
    assert 300 <= sum(small) <= 1500


def test_varlen_lengths_rejects_impossible(bf):
    with pytest.raises(ValueError, match="unreachable"):
        bf.varlen_lengths(4, 10, 20, total_range=(100, 200))
    with pytest.raises(ValueError):
        bf.varlen_lengths(4, 30, 20)
    with pytest.raises(ValueError, match="tries"):
        bf.varlen_lengths(2, 1, 1000, total_range=(1999, 2000), max_tries=3)


def test_cu_seqlens(bf):
    assert bf.cu_seqlens([3, 0, 5]) == [0, 3, 3, 8]
    assert bf.cu_seqlens([]) == [0]
    with pytest.raises(ValueError):
        bf.cu_seqlens([2, -1])


# --- cases ---------------------------------------------------------------------------------

def test_case_list(bf):
    cases = bf.build_cases()
    names = [c.name for c in cases]
    assert names == ["gqa-b2-s8192", "gqa-b8-s2048", "window-4096-0", "window-2048-2048",
                     "varlen-16docs"]
    assert all(c.headdim == 128 for c in cases)
    gqa = [c for c in cases if c.group == "gqa"]
    assert {(c.batch, c.seqlen) for c in gqa} == {(2, 8192), (8, 2048)}
    assert all(c.nheads == 32 and c.nheads_kv == 8 and c.causal and c.gqa for c in gqa)
    assert all(not c.has_window and not c.varlen for c in gqa)
    local, sym = (c for c in cases if c.group == "window")
    assert (local.batch, local.seqlen, local.nheads, local.window, local.causal) == (
        1, 16384, 16, (4096, 0), True)
    assert (sym.window, sym.causal) == ((2048, 2048), False)
    assert local.has_window and sym.has_window
    varlen = cases[-1]
    assert varlen.varlen and varlen.causal and len(varlen.seqlens) == 16
    assert varlen.num_seqs == 16 and varlen.tokens == sum(varlen.seqlens)
    assert varlen.max_seqlen == max(varlen.seqlens)
    assert 40000 <= varlen.tokens <= 60000
    # FLOPs of each case agree with the per-sequence count.
    for c in cases:
        assert c.flops() == bf.feature_flops(c.headdim, c.nheads, c.sequences(), c.causal,
                                             c.window)
        assert c.flops("bwd") == 2.5 * c.flops()
        assert json.loads(json.dumps(c.describe()))["visible_pairs"] == c.pairs()
    quick = bf.build_cases(quick=True)
    assert [c.name for c in quick] == ["gqa-b8-s2048", "window-4096-0", "varlen-16docs"]
    assert [c.group for c in bf.build_cases(groups=["window"])] == ["window", "window"]


def test_case_validation(bf):
    with pytest.raises(ValueError, match="divide"):
        bf.Case("x", "gqa", 32, 6, 128, True, seqlen=128)
    with pytest.raises(ValueError, match="either"):
        bf.Case("x", "gqa", 4, 4, 128, True)
    with pytest.raises(ValueError, match="either"):
        bf.Case("x", "varlen", 4, 4, 128, True, seqlen=5, seqlens=(3, 4))
    with pytest.raises(ValueError, match="group"):
        bf.Case("x", "dense", 4, 4, 128, True, seqlen=5)
    plain = bf.Case("x", "gqa", 4, 4, 64, True, window=(-1, 0), seqlen=8)
    assert not plain.has_window  # (-1, 0) is just causal
    assert "causal" in plain.label() and "h4 " in plain.label()


def test_small_versions_keep_the_features(bf):
    for case in bf.build_cases():
        small = bf.small_version(case)
        assert small.group == case.group and small.headdim == case.headdim
        assert small.causal == case.causal and small.varlen == case.varlen
        assert small.nheads // small.nheads_kv == case.nheads // case.nheads_kv
        assert small.has_window == case.has_window
        assert [w < 0 for w in small.window] == [w < 0 for w in case.window]
        assert [w == 0 for w in small.window] == [w == 0 for w in case.window]
        assert small.tokens < 2000
        if case.has_window:
            assert small.seqlen > 2 * max(small.window)  # the window is a real band


def test_support_matrix(bf):
    cases = {c.name: c for c in bf.build_cases()}
    gqa, local, varlen = cases["gqa-b2-s8192"], cases["window-4096-0"], cases["varlen-16docs"]
    for case in cases.values():
        for p in ("fwd", "bwd"):
            assert bf.unsupported_reason("cute_attn", case, p) is None
            assert bf.unsupported_reason("fa4", case, p) is None
    assert bf.unsupported_reason("sdpa_cudnn", gqa, "bwd") is None
    assert "window" in bf.unsupported_reason("sdpa_cudnn", local, "fwd")
    assert bf.unsupported_reason("sdpa_cudnn", varlen, "fwd") is None
    assert "backward" in bf.unsupported_reason("sdpa_cudnn", varlen, "bwd")
    assert "no-cudnn-nested" in bf.unsupported_reason("sdpa_cudnn", varlen, "fwd",
                                                      cudnn_nested=False)
    assert [bf.applies("sdpa_cudnn_padded", c) for c in (gqa, local, varlen)] == [
        False, False, True]
    assert [bf.applies("sdpa_cudnn_masked", c) for c in (gqa, local, varlen)] == [
        False, True, False]
    assert "does not apply" in bf.unsupported_reason("sdpa_cudnn_masked", gqa, "fwd")
    assert bf.fa4_window((4096, 0)) == (4096, 0)
    assert bf.fa4_window((-1, 7)) == (None, 7)


# --- records, ratios, table ----------------------------------------------------------------

def _fake_records(bf, cases, tflops_by_impl, pass_name="fwd"):
    recs = []
    for case in cases:
        for impl, tf in tflops_by_impl.items():
            if not bf.applies(impl, case):
                continue
            ms = case.flops(pass_name) / (tf * 1e12) * 1e3
            recs.append(bf.make_feature_record(impl, case, pass_name, [ms * 1.1, ms, ms]))
    return recs


def test_make_feature_record(bf):
    case = bf.build_cases()[0]
    rec = bf.make_feature_record("fa4", case, "bwd", [2.0, 1.0, 1.5])
    assert tuple(rec) == bf.RECORD_KEYS
    assert rec["ms"] == 1.5 and rec["ms_rounds"] == [2.0, 1.0, 1.5]
    assert rec["flops"] == case.flops("bwd")
    assert rec["tflops"] == pytest.approx(case.flops("bwd") / 1.5e-3 / 1e12)
    assert rec["anchor"] is True and rec["seqlens"] is None and rec["batch"] == 2
    assert bf.make_feature_record("sdpa_cudnn_padded", case, "fwd", [1.0])["anchor"] is False
    varlen = bf.build_cases()[-1]
    vrec = bf.make_feature_record("cute_attn", varlen, "fwd", [1.0])
    assert vrec["seqlens"] == list(varlen.seqlens) and vrec["tokens"] == varlen.tokens
    assert vrec["seqlen_q"] == max(varlen.seqlens)
    assert json.loads(json.dumps(vrec)) == vrec


def test_ratios_and_table(bf):
    cases = bf.build_cases()
    recs = _fake_records(bf, cases, {"cute_attn": 450.0, "fa4": 500.0,
                                     "sdpa_cudnn_padded": 100.0, "sdpa_cudnn_masked": 90.0})
    # cuDNN only on the GQA cases and varlen (fwd); the window cases say unsupported.
    recs += [r for r in _fake_records(bf, cases, {"sdpa_cudnn": 400.0})
             if "window" not in r["case"]]
    skipped = [{"impl": "sdpa_cudnn", "case": c.name, "pass": "fwd", "unsupported": True,
                "reason": bf.unsupported_reason("sdpa_cudnn", c, "fwd")}
               for c in cases if c.has_window]
    ratios = {r["case"]: r for r in bf.case_ratios(recs, skipped)}
    assert set(ratios) == {c.name for c in cases}
    assert ratios["gqa-b2-s8192"]["cute_attn/fa4"] == pytest.approx(0.9)
    assert ratios["gqa-b2-s8192"]["cute_attn/cudnn"] == pytest.approx(450 / 400)
    win = ratios["window-4096-0"]
    assert win["cute_attn/cudnn"] is None and "window" in win["cute_attn/cudnn why"]
    assert "cute_attn/fa4 why" not in win
    # The extras never enter a ratio.
    assert all(set(r) <= {"case", "pass", "cute_attn/fa4", "cute_attn/cudnn",
                          "cute_attn/fa4 why", "cute_attn/cudnn why"} for r in ratios.values())

    impls = list(bf.IMPLS)
    table = bf.format_features_table(recs, skipped, cases, "fwd", impls)
    lines = table.splitlines()
    assert "fwd" in lines[0] and "TFLOP/s" in lines[0]
    assert lines[1].split()[:2] == ["case", "shape"]
    assert lines[1].split()[-2:] == ["cute_attn/fa4", "cute_attn/cudnn"]
    row = {line.split()[0]: line for line in lines[3:3 + len(cases)]}
    assert set(row) == {c.name for c in cases}
    assert row["gqa-b2-s8192"].split()[-2:] == ["0.900", "1.125"]
    assert "n/a" in row["window-4096-0"] and row["window-4096-0"].split()[-1] == "-"
    assert "90.0" in row["window-4096-0"] and "100.0" in row["varlen-16docs"]
    assert "not in the ratios" in table and "sdpa_cudnn_padded" in table
    # bwd: nothing measured yet -> '-' everywhere, and the title says bwd.
    bwd = bf.format_features_table(recs, skipped, cases, "bwd", impls)
    assert "bf16 bwd" in bwd and "450.0" not in bwd


def test_result_path_and_args(bf, tmp_path):
    path = bf.harness.result_path(tmp_path, "nvidia-h200", "features")
    assert path.name == "nvidia-h200-features.json"
    full = bf.parse_args([])
    assert full.passes == ["fwd", "bwd"] and full.rounds == 3 and not full.quick
    assert full.impls == list(bf.IMPLS) and full.cases == list(bf.GROUPS)
    assert full.cudnn_nested
    quick = bf.parse_args(["--quick", "--bwd"])
    assert quick.rounds == 1 and quick.passes == ["bwd"]
    assert bf.parse_args(["--fwd", "--rounds", "5"]).passes == ["fwd"]
    some = bf.parse_args(["--cases", "varlen,gqa", "--impls", "fa4,cute_attn",
                          "--no-cudnn-nested"])
    assert some.cases == ["gqa", "varlen"] and some.impls == ["cute_attn", "fa4"]
    assert not some.cudnn_nested
    for bad in (["--fwd", "--bwd"], ["--cases", "dense"], ["--impls", "sdpa_flash"],
                ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bf.parse_args(bad)


# --- tensor helpers and the SDPA binders on CPU (math backend) -------------------------------

def test_pad_unpad_round_trip(bf):
    lengths = [3, 0, 5, 1]
    x = torch.randn(sum(lengths), 2, 4)
    padded = bf.pad_packed(x, lengths, 6)
    assert padded.shape == (4, 6, 2, 4)
    assert torch.equal(padded[2, :5], x[3:8]) and torch.all(padded[2, 5:] == 0)
    assert torch.all(padded[1] == 0)
    assert torch.equal(bf.unpad(padded, lengths), x)


@pytest.fixture
def cpu_sdpa(bf, monkeypatch):
    """The SDPA binders without the cuDNN backend forced (CPU: the math backend)."""
    monkeypatch.setattr(bf, "_sdpa_backend_context", lambda *a: contextlib.nullcontext)


def _tiny(bf, group):
    if group == "gqa":
        return bf.Case("t-gqa", "gqa", 4, 2, 16, True, batch=2, seqlen=19)
    if group == "window":
        return bf.Case("t-win", "window", 2, 2, 16, False, window=(3, 2), seqlen=23)
    return bf.Case("t-var", "varlen", 2, 2, 16, True, seqlens=(7, 1, 12))


def _ref(case, inp):
    q, k, v = (t.detach().float() for t in (inp.q, inp.k, inp.v))
    if case.varlen:
        cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()],
                          dtype=torch.int32)
        return attention_ref_varlen(q, k, v, cu, cu, causal=case.causal)[0]
    return attention_ref(q, k, v, causal=case.causal, window_size=case.window)[0]


@pytest.mark.parametrize("impl,group", [("sdpa_cudnn", "gqa"),
                                        ("sdpa_cudnn_padded", "varlen"),
                                        ("sdpa_cudnn_masked", "window")])
def test_sdpa_binders_compute_the_case(bf, cpu_sdpa, impl, group):
    case = _tiny(bf, group)
    inp = bf.make_inputs(case, torch.float32, "cpu", requires_grad=False, seed=3)
    bound = bf.BINDERS[impl](case, inp)
    out = bound.unpack(bound.fn())
    torch.testing.assert_close(out, _ref(case, inp), atol=2e-5, rtol=2e-5)


def test_padded_binder_grads(bf, cpu_sdpa):
    case = _tiny(bf, "varlen")
    inp = bf.make_inputs(case, torch.float32, "cpu", requires_grad=True, seed=4)
    bound = bf.BINDERS["sdpa_cudnn_padded"](case, inp)
    got = bf._grads_of(bound, inp.dout)
    ref = bf._reference_grads(case, inp.q, inp.k, inp.v, inp.dout, upcast=True)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, atol=2e-5, rtol=2e-5)


def test_make_inputs(bf):
    case = _tiny(bf, "varlen")
    inp = bf.make_inputs(case, torch.bfloat16, "cpu", requires_grad=True)
    assert inp.q.shape == (20, 2, 16) and inp.k.shape == (20, 2, 16)
    assert inp.cu.dtype == torch.int32 and inp.cu.tolist() == [0, 7, 8, 20]
    assert inp.q.requires_grad and inp.dout.shape == inp.q.shape
    gqa = bf.make_inputs(_tiny(bf, "gqa"), torch.bfloat16, "cpu", requires_grad=False)
    assert gqa.q.shape == (2, 19, 4, 16) and gqa.k.shape == (2, 19, 2, 16)
    assert gqa.dout is None and gqa.cu is None and not gqa.q.requires_grad
    again = bf.make_inputs(_tiny(bf, "gqa"), torch.bfloat16, "cpu", requires_grad=False)
    assert torch.equal(gqa.q, again.q)


# --- orchestration on CPU ------------------------------------------------------------------

def _ref_binder(bf, wrong=False):
    """A binder running the reference on the shared tensors (wrong=True: drops the mask)."""
    def bind(case, inp):
        def fn():
            q, k, v = inp.q, inp.k, inp.v
            if case.varlen:
                cu = torch.tensor(bf.cu_seqlens(case.seqlens), dtype=torch.int32)
                return attention_ref_varlen(q, k, v, cu, cu, causal=case.causal and not wrong,
                                            upcast=False)[0]
            return attention_ref(q, k, v, causal=case.causal and not wrong,
                                 window_size=(-1, -1) if wrong else case.window,
                                 upcast=False)[0]
        return bf.Bound(fn, (inp.q, inp.k, inp.v))
    return bind


@pytest.fixture
def cpu_run(bf, monkeypatch, cpu_sdpa):
    """do_bench = two plain calls (recorded), CUDA always healthy, cute_attn and fa4 bound to
    the reference (fa4 raising on varlen)."""
    timed = []

    def fake_do_bench(fn):
        for _ in range(2):
            timed.append(fn())
        return 0.5 + 0.01 * len(timed)

    def fa4_binder(case, inp):
        if case.varlen:
            raise RuntimeError("pretend FA4 broke on varlen")
        return _ref_binder(bf)(case, inp)

    monkeypatch.setattr(bf.harness, "do_bench", fake_do_bench)
    monkeypatch.setattr(bf.harness, "cuda_is_healthy", lambda: True)
    monkeypatch.setitem(bf.BINDERS, "cute_attn", _ref_binder(bf))
    monkeypatch.setitem(bf.BINDERS, "fa4", fa4_binder)
    return timed


@pytest.mark.parametrize("pass_name", ["fwd", "bwd"])
def test_run_cases_on_cpu(bf, cpu_run, pass_name):
    cases = [_tiny(bf, g) for g in bf.GROUPS]
    skipped = []
    records, healthy = bf.run_cases(cases, list(bf.IMPLS), [pass_name], torch.float32, "cpu",
                                    skipped, rounds=3)
    assert healthy
    got = {(r["case"], r["impl"]) for r in records}
    expected = {("t-gqa", "cute_attn"), ("t-gqa", "fa4"), ("t-gqa", "sdpa_cudnn"),
                ("t-win", "cute_attn"), ("t-win", "fa4"), ("t-win", "sdpa_cudnn_masked"),
                ("t-var", "cute_attn"), ("t-var", "sdpa_cudnn_padded")}
    if pass_name == "fwd":
        # The nested (jagged) cuDNN varlen path: on the CPU it runs or raises; either way it
        # is a record or a skip, never a crash.
        assert ("t-var", "sdpa_cudnn") in got or any(
            s["impl"] == "sdpa_cudnn" and s["case"] == "t-var" for s in skipped)
        got.discard(("t-var", "sdpa_cudnn"))
    assert got == expected
    for rec in records:
        assert tuple(rec) == bf.RECORD_KEYS and rec["pass"] == pass_name
        assert len(rec["ms_rounds"]) == 3
    reasons = {(s["case"], s["impl"]): s for s in skipped}
    assert "pretend FA4 broke" in reasons[("t-var", "fa4")]["reason"]
    assert not reasons[("t-var", "fa4")].get("unsupported")
    assert reasons[("t-win", "sdpa_cudnn")]["unsupported"]
    if pass_name == "bwd":
        assert reasons[("t-var", "sdpa_cudnn")]["unsupported"]
        # What the backward timed is the gradients of out, three of them per call.
        assert all(isinstance(t, tuple) and len(t) == 3 for t in cpu_run)
    # The extras are silent where they do not apply.
    assert ("t-gqa", "sdpa_cudnn_padded") not in reasons
    assert bf.harness.summarize_skips(skipped, bf.IMPLS, []) == []


def test_bwd_timer_differentiates_the_leaves(bf, cpu_run):
    case = _tiny(bf, "gqa")
    inp = bf.make_inputs(case, torch.float32, "cpu", requires_grad=True, seed=2)
    calls = []

    def fn():
        calls.append(1)
        return _ref_binder(bf)(case, inp).fn()

    timer = bf.make_timer(bf.Bound(fn, (inp.q, inp.k, inp.v)), "bwd", inp.dout)
    assert len(calls) == 1
    timer()
    assert len(calls) == 1  # the timed part runs no forward
    expected = torch.autograd.grad(fn(), (inp.q, inp.k, inp.v), inp.dout)
    for got in cpu_run:
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    assert inp.q.grad is None
    with pytest.raises(bf.harness.BackwardUnsupported):
        bf.make_timer(bf.Bound(lambda: inp.q.detach() * 1, (inp.q,)), "bwd", inp.dout)


@pytest.mark.parametrize("with_bwd", [False, True])
def test_check_case_catches_a_wrong_impl(bf, cpu_run, monkeypatch, with_bwd):
    monkeypatch.setitem(bf.BINDERS, "fa4", _ref_binder(bf, wrong=True))
    passes = ["fwd", "bwd"] if with_bwd else ["fwd"]
    for group in ("gqa", "window"):
        status = bf.check_case(_tiny(bf, group), list(bf.IMPLS), passes, torch.bfloat16,
                               "cpu")
        assert status["cute_attn"] == "ok", status
        assert status["fa4"] == "FAIL", status
        if group == "gqa":
            assert status["sdpa_cudnn"] == "ok" and "sdpa_cudnn_masked" not in status
        else:
            assert status["sdpa_cudnn"].startswith("n/a")
            assert status["sdpa_cudnn_masked"] == "ok"
    status = bf.check_case(_tiny(bf, "varlen"), list(bf.IMPLS), passes, torch.bfloat16, "cpu")
    assert status["cute_attn"] == "ok" and status["fa4"] == "FAIL"
    assert status["sdpa_cudnn_padded"] == "ok", status


@pytest.fixture
def cpu_main(bf, cpu_run, monkeypatch, tmp_path):
    """main() on the CPU: no CUDA set-up, every backend 'imported', tiny cases."""
    monkeypatch.setattr(bf.harness, "cuda_setup", lambda script: "Fake GPU 80GB")
    monkeypatch.setattr(bf, "DEVICE", "cpu")
    monkeypatch.setattr(bf.harness, "DEFAULT_RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(bf, "load_backends", lambda names: (
        {n: bf.harness.Impl(n, None, version="test") for n in names}, []))
    monkeypatch.setattr(bf, "build_cases", lambda quick=False, groups=bf.GROUPS: [
        _tiny(bf, g) for g in groups])
    monkeypatch.setenv(bf.CUDNN_NESTED_ENV, "1")
    return tmp_path


def test_main_end_to_end_on_cpu(bf, cpu_main):
    out_dir = cpu_main / "out"
    assert bf.main(["--rounds", "2", "--out", str(out_dir)]) == 0
    written = cpu_main / "results" / "fake-gpu-80gb-features.json"
    assert written.exists() and (out_dir / written.name).read_text() == written.read_text()
    doc = json.loads(written.read_text())
    for key in ("device", "date", "torch", "records", "cases", "ratios", "skipped",
                "method", "extras", "impls"):
        assert key in doc
    assert {r["pass"] for r in doc["records"]} == {"fwd", "bwd"}
    assert [c["name"] for c in doc["cases"]] == ["t-gqa", "t-win", "t-var"]
    assert all(len(r["ms_rounds"]) == 2 for r in doc["records"])
    ratio = {(r["case"], r["pass"]): r for r in doc["ratios"]}
    assert ratio[("t-gqa", "bwd")]["cute_attn/cudnn"] is not None
    assert "window" in ratio[("t-win", "fwd")]["cute_attn/cudnn why"]
    assert doc["checks"] is None and doc["method"]["rounds"] == 2


def test_main_quick_checks_and_writes_only_with_out(bf, cpu_main, monkeypatch):
    assert bf.main(["--quick", "--fwd", "--cases", "gqa"]) == 0
    assert not (cpu_main / "results").exists()
    # A wrong cute_attn fails the check: exit 1 before any timing.
    monkeypatch.setitem(bf.BINDERS, "cute_attn", _ref_binder(bf, wrong=True))
    assert bf.main(["--quick", "--bwd", "--out", str(cpu_main / "q")]) == 1
    assert not (cpu_main / "q").exists()
