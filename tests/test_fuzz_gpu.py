"""Seeded fuzz test on an sm_90 GPU (skipped without one): N random problems (tests/fuzz.py:
shapes with 1 and primes, strided and sliced views, both dtypes, every head dim, GQA and
MQA, every mask kind and window shape, softcaps, custom scales, varlen batches with empty
sequences, deterministic backward), each run forward and backward and held to the rule of
tests/gpu_checks.py (the feature tests' rule) on NaN-poisoned outputs.

Options (tests/conftest.py): --fuzz-n N (default fuzz.DEFAULT_N, about 2 minutes),
--fuzz-seed S (default fuzz.DEFAULT_SEED), --fuzz-shard i/n (each compile specialisation
runs in one shard, so n processes compile disjoint kernels), --fuzz-case SPEC (one case).
A failing case's message starts with the command line that runs it alone.
"""

import pytest
from fuzz import FuzzCase, draw_cases, in_shard, inputs
from gpu_checks import check_case
from gpu_helpers import exact_fp32_matmul  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


def pytest_generate_tests(metafunc):
    """One item per case of this run: the drawn cases of this shard, or the --fuzz-case one.
    Ids name the specialisation and the case's index in the whole draw."""
    if "fuzz_case" not in metafunc.fixturenames:
        return
    option = metafunc.config.getoption
    if option("--fuzz-case"):
        case = FuzzCase.parse(option("--fuzz-case"))
        metafunc.parametrize("fuzz_case", [case], ids=[case.test_id("case")])
        return
    i, n = option("--fuzz-shard")
    picked = [(index, case) for index, case in enumerate(draw_cases(option("--fuzz-seed"), option("--fuzz-n")))
              if in_shard(case, i, n)]
    metafunc.parametrize("fuzz_case", [case for _, case in picked],
                         ids=[case.test_id(index) for index, case in picked])


def test_fuzz(fuzz_case):
    try:
        check_case(fuzz_case.problem(), *inputs(fuzz_case, "cuda"))
    except Exception as e:  # a failed check, or the kernel raising: either way, the repro
        raise AssertionError(f"{fuzz_case.repro()}\n{type(e).__name__}: {e}") from e

