"""CPU tests of perf/harness.py's pieces that tests/test_bench_cpu.py and
tests/test_bench_features_cpu.py do not reach through the scripts: the text table, result
files and the JSON round trip, the name parsers, skip bookkeeping and the exit status, and
the timing loop around first calls (do_bench stubbed out).

Imports perf/harness.py from perf/ as the scripts do; needs neither a GPU nor triton.
"""

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PERF = Path(__file__).resolve().parents[1] / "perf"
NO_GPU_STACK = ("triton", "matplotlib", "cute_attn", "flash_attn")


@pytest.fixture(scope="module")
def harness():
    # The scripts import it as the top-level `harness` from perf/: the same module here,
    # so what a test patches on it is what the scripts see.
    if str(PERF) not in sys.path:
        sys.path.insert(0, str(PERF))
    return importlib.import_module("harness")


def test_import_needs_no_gpu_stack():
    # harness, and variants on top of it, import where none of NO_GPU_STACK is installed
    # (a module set to None in sys.modules raises ImportError when imported).
    code = (f"import sys; sys.modules.update(dict.fromkeys({NO_GPU_STACK!r})); "
            f"sys.path.insert(0, {str(PERF)!r}); import variants; "
            "assert variants.harness.tflops(2e12, 1.0) == 2000.0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


def test_text_table_aligns(harness):
    table = harness.text_table("title", ["name", "shape", "x", "ratio"],
                               [["a", "2x19", "1.0", "0.900"], ["long-name", "1", "-", "-"]],
                               left=2)
    lines = table.splitlines()
    assert lines[0] == "title"
    # widths 9, 5, 3, 5; the first two columns flush left, the others flush right
    assert lines[1] == "name       shape    x  ratio"
    assert lines[2] == "---------  -----  ---  -----"
    assert lines[3] == "a          2x19   1.0  0.900"
    assert lines[4] == "long-name  1        -      -"
    # All flush right by default; the empty-table line says so.
    empty = harness.text_table("t", ["seqlen", "cute_attn"], []).splitlines()
    assert empty == ["t", "seqlen  cute_attn", "------  ---------", "(no measurements)"]
    assert harness.text_table("t", ["a"], [], empty="(no cases)").endswith("(no cases)")


def test_table_cells(harness):
    assert harness.tflops_cell(None) == "-" and harness.tflops_cell(512.04) == "512.0"
    tf = {"cute_attn": 450.0, "fa4": 500.0}
    assert harness.ratio_cells(tf.get) == ["0.900", "-"]
    assert harness.ratio_cells({}.get) == ["-", "-"]
    assert harness.RATIO_LABELS == ("cute_attn/fa4", "cute_attn/cudnn")


def test_results_json_round_trip(harness, tmp_path):
    recs = [{"impl": "cute_attn", "pass": "fwd", "ms": 1.25, "ms_rounds": [1.3, 1.25, 1.2]}]
    doc = harness.build_results("NVIDIA H200", recs, torch_version="2.11.0", cutlass_dsl=None,
                                cuda="13.0", date="2026-01-01T00:00:00+00:00",
                                host={"calls": 2000}, cudnn=91900, skipped=[])
    assert list(doc)[:len(harness.RESULT_KEYS)] == list(harness.RESULT_KEYS)
    assert list(doc)[len(harness.RESULT_KEYS):] == ["host", "cudnn", "skipped"]
    slug = harness.device_slug(doc["device"])
    path = harness.write_json(doc, harness.result_path(tmp_path / "new", slug, "fwd"))
    assert path == tmp_path / "new" / "nvidia-h200-fwd.json"
    text = path.read_text()
    assert text.endswith("}\n") and json.loads(text) == doc


def test_result_files_and_dirs(harness, tmp_path):
    for kind in ("fwd", "bwd", "features", "variants"):
        assert harness.result_path(tmp_path, "x", kind).name == f"x-{kind}.json"
    assert harness.result_path(tmp_path, "x", "bwd", ".png").name == "x-bwd.png"
    with pytest.raises(ValueError, match="kind"):
        harness.result_path(tmp_path, "x", "dense")
    assert harness.output_dirs(None) == [harness.DEFAULT_RESULTS_DIR]
    assert harness.output_dirs(tmp_path) == [harness.DEFAULT_RESULTS_DIR, tmp_path]
    assert harness.output_dirs(tmp_path, quick=True) == [tmp_path]
    assert harness.output_dirs(None, quick=True) == []
    assert harness.DEFAULT_RESULTS_DIR == PERF / "results"
    assert "5 interleaved rounds per shape" in harness.timing_method(5, "shape")


def test_parse_names(harness):
    choices = ("a", "b", "c")
    assert harness.parse_names("c, a", choices) == ["a", "c"]
    assert harness.parse_names("c,a,c", choices) == ["a", "c"]
    assert harness.parse_names("c, a", choices, given_order=True) == ["c", "a"]
    for bad in ("", " , ", "a,d"):
        with pytest.raises(argparse.ArgumentTypeError, match="choose from a,b,c"):
            harness.parse_names(bad, choices)
    assert harness.parse_int_list("512, 1024,") == [512, 1024]
    for bad in ("", "1,x", "0", "-4"):
        with pytest.raises(argparse.ArgumentTypeError):
            harness.parse_int_list(bad)
    p = argparse.ArgumentParser()
    harness.add_impls_and_rounds(p, choices, rounds=5, quick_rounds=3, per="shape")
    args = p.parse_args(["--impls", "b,a", "--rounds", "2"])
    assert args.impls == ["a", "b"] and args.rounds == 2
    assert p.parse_args([]).impls == list(choices) and p.parse_args([]).rounds is None


def test_skips_and_exit_status(harness, capsys):
    skipped = []
    harness.record_skip(skipped, {"impl": "fa4", "case": "c", "reason": "R: x"}, "on c")
    harness.record_skip(skipped, {"impl": "cute_attn", "case": "c", "reason": "N: y"}, "on c",
                        unsupported=True)
    assert skipped == [{"impl": "fa4", "case": "c", "reason": "R: x"},
                       {"impl": "cute_attn", "case": "c", "reason": "N: y",
                        "unsupported": True}]
    out = capsys.readouterr().out
    assert "  [skip] fa4 on c: R: x" in out and "  [n/a] cute_attn on c: N: y" in out
    # An unsupported cute_attn is a note, an anchor's failure is neither; exit 0.
    assert harness.finish([], skipped, ["cute_attn", "fa4"], ["first"]) == 0
    out = capsys.readouterr().out
    assert "NOTE: first" in out and "NOTE: cute_attn not measured (1 skip(s)): N: y" in out
    broken = skipped + [{"impl": "cute_attn", "reason": "RuntimeError: z"}]
    assert harness.finish(["CUDA context broke"], broken, ["cute_attn"]) == 1
    assert ("FINISHED WITH PROBLEMS: CUDA context broke; cute_attn skipped 1 time(s)"
            in capsys.readouterr().out)
    assert harness.reason(ValueError("first\nsecond")) == "ValueError: first"
    assert len(harness.reason(RuntimeError("x" * 1000))) == 300


def test_load_impls_records_what_does_not_import(harness):
    def broken():
        raise ImportError("no module named flash_attn")

    loaders = {"ok": lambda: harness.Impl("ok", None, version="1.0"), "bad": broken}
    impls, skipped = harness.load_impls(["ok", "bad"], loaders, blank_keys=("case", "pass"))
    assert list(impls) == ["ok"] and impls["ok"].import_s >= 0
    assert skipped == [{"impl": "bad", "case": None, "pass": None,
                        "reason": "ImportError: no module named flash_attn"}]
    assert harness.impl_versions(impls) == {
        "ok": {"version": "1.0", "import_s": impls["ok"].import_s}}


@pytest.fixture
def stub_gpu(harness, monkeypatch):
    """do_bench = one plain call returning 1.0 + the call count; CUDA healthy unless told."""
    calls, state = [], {"healthy": True}

    def fake_do_bench(fn):
        fn()
        calls.append(1)
        return 1.0 + len(calls)

    monkeypatch.setattr(harness, "do_bench", fake_do_bench)
    monkeypatch.setattr(harness, "cuda_is_healthy", lambda: state["healthy"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return state


def test_time_interleaved(harness, stub_gpu):
    ran = []

    def first_call(name, fail_at=None):
        def timer_fn():
            ran.append(name)
            if len([n for n in ran if n == name]) == fail_at:
                raise RuntimeError(f"{name} broke")
        return harness.make_timer(timer_fn, "fwd")

    def no_compile():
        raise NotImplementedError("not here")

    skips = []
    ms, healthy = harness.time_interleaved(
        {"a": lambda: first_call("a"), "b": no_compile,
         "c": lambda: first_call("c", fail_at=3)},
        rounds=3, skip=lambda name, exc: skips.append((name, harness.reason(exc))))
    assert healthy and list(ms) == ["a"] and len(ms["a"]) == 3
    assert skips == [("b", "NotImplementedError: not here"), ("c", "RuntimeError: c broke")]
    # A first call that breaks the CUDA context stops the shape at once.
    stub_gpu["healthy"] = False
    ms, healthy = harness.time_interleaved({"b": no_compile, "a": lambda: first_call("a")},
                                           rounds=2, skip=lambda name, exc: None)
    assert (ms, healthy) == ({}, False)


def test_make_timer_checks_the_pass(harness, stub_gpu):
    with pytest.raises(ValueError, match="pass_name"):
        harness.make_timer(lambda: None, "both")
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(harness.BackwardUnsupported, match="probe returned"):
        harness.make_timer(lambda: x.detach() * 2, "bwd", leaves=(x,), dout=torch.ones(3),
                           name="probe")
    assert harness.make_timer(lambda: x * 2, "bwd", leaves=(x,), dout=torch.ones(3))() > 0


def test_host_us_per_call(harness, stub_gpu):
    calls = []
    us = harness.host_us_per_call(lambda: calls.append(1), calls=20, warmup=5)
    assert len(calls) == 25 and us > 0


def test_config_variant_applies_each_part(harness):
    """perf/ab_*_configs.py variant names: prefix + integer parts joined by '+', flags as
    bools; an unknown prefix or a part without a number is refused."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        tile_n: int = 128
        pingpong: bool = True

    fields, flags = {"n": "tile_n", "pp": "pingpong"}, ("pingpong",)
    assert harness.config_variant(Cfg(), "n192+pp0", fields, flags) == Cfg(tile_n=192, pingpong=False)
    assert harness.config_variant(Cfg(), "pp1", fields, flags).pingpong is True
    for bad in ("x3", "n", "n192+late1"):
        with pytest.raises(ValueError, match="unknown variant"):
            harness.config_variant(Cfg(), bad, fields, flags)


def test_results_name_the_tree_by_its_kernel_sources(harness):
    """The version a results file records for cute_attn carries the kernel sources'
    fingerprint: a device copy of a working tree reports its base commit as HEAD, so the
    commit alone does not say which kernels ran."""
    from cute_attn.compile_cache import source_fingerprint

    version = harness.tree_version()
    assert version.endswith(f"sources {source_fingerprint()[:16]}")


def test_round_ratio_range_pairs_rounds_and_refuses_unequal_counts(harness):
    # a's speed over b's per round: b took 2.0 / 1.0 = 2x, then 3.0 / 2.0 = 1.5x as long
    assert harness.round_ratio_range([1.0, 2.0], [2.0, 3.0]) == (1.5, 2.0)
    with pytest.raises(ValueError, match="equal count"):
        harness.round_ratio_range([1.0], [1.0, 2.0])
