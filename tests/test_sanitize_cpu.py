"""perf/sanitize.py's pure parts on the CPU: the summary parsing that decides pass/fail,
the grouping of cases into child processes, and the command line of each child."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "perf" / "sanitize.py"
_spec = importlib.util.spec_from_file_location("sanitize", _PATH)
sanitize = importlib.util.module_from_spec(_spec)
sys.modules["sanitize"] = sanitize
_spec.loader.exec_module(sanitize)


def test_clean_memcheck_summary_is_zero():
    text = "case dense done\n========= ERROR SUMMARY: 0 errors\n"
    assert sanitize.parse_report("memcheck", text) == (0, None)


def test_memcheck_errors_are_counted():
    text = ("========= Invalid __global__ read of size 4 bytes\n"
            "=========     at kernel_cutlass_kernel_cute_attnkernelsfwd_sm90...\n"
            "========= ERROR SUMMARY: 3 errors\n")
    assert sanitize.parse_report("memcheck", text) == (3, None)


def test_racecheck_warnings_count_as_reports():
    text = "========= RACECHECK SUMMARY: 32768 hazards displayed (0 errors, 32768 warnings)\n"
    assert sanitize.parse_report("racecheck", text) == (32768, None)
    text = "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n"
    assert sanitize.parse_report("racecheck", text) == (2, None)


def test_racecheck_clean_run():
    for text in ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n",
                 "========= ERROR SUMMARY: 0 errors\n"):
        assert sanitize.parse_report("racecheck", text) == (0, None)


@pytest.mark.parametrize("tool", sanitize.TOOLS)
def test_missing_summary_is_a_problem_not_a_pass(tool):
    reports, problem = sanitize.parse_report(tool, "Segmentation fault (core dumped)\n")
    assert problem is not None


def test_a_run_passes_only_with_every_case_finished_and_nothing_reported():
    log = "case a done\ncase b done\n========= ERROR SUMMARY: 0 errors\n"
    good = sanitize.RunResult("memcheck", ["a", "b"], 0, 0, None, 1.0, log)
    assert good.ok
    assert not sanitize.RunResult("memcheck", ["a", "b", "c"], 0, 0, None, 1.0, log).ok
    assert not sanitize.RunResult("memcheck", ["a", "b"], 1, 0, None, 1.0, log).ok
    assert not sanitize.RunResult("memcheck", ["a", "b"], 0, 1, None, 1.0, log).ok
    assert not sanitize.RunResult("memcheck", ["a", "b"], 0, 0, "no summary", 1.0, log).ok


def test_groups_partition_the_cases():
    names = [c.name for c in sanitize.CASES]
    gs = sanitize.groups(names, 3)
    assert len(gs) == 3 and sorted(sum(gs, [])) == sorted(names)
    assert sanitize.groups(names[:2], 5) == [[names[0]], [names[1]]]


def test_command_hides_only_host_api_reports():
    cmd = sanitize.sanitizer_command("racecheck", ["dense", "hd64"], python="python3")
    assert cmd[:3] == ["compute-sanitizer", "--tool", "racecheck"]
    assert "--report-api-errors" in cmd and cmd[cmd.index("--report-api-errors") + 1] == "no"
    assert "--racecheck-report" in cmd and cmd[cmd.index("--racecheck-report") + 1] == "hazard"
    assert cmd[-2:] == ["--child", "dense,hd64"]
    with pytest.raises(ValueError):
        sanitize.sanitizer_command("leakcheck", ["dense"])


def test_every_kernel_family_and_path_has_a_case():
    cases = sanitize.CASES
    assert {c.head_dim for c in cases} >= {64, 96, 128, 256}
    assert any(c.lengths and any(lq == 0 for lq, _ in c.lengths) for c in cases)
    assert any(c.deterministic and c.backward for c in cases)
    assert any(c.softcap for c in cases) and any(c.window_size != (-1, -1) for c in cases)
    assert any(c.nheads_kv < c.nheads and c.seqlen_q < 16 for c in cases)  # packed GQA
    assert any(c.dtype == "fp16" for c in cases)
    assert len(sanitize.CASE_BY_NAME) == len(cases)
