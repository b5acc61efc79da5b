"""Shared test setup: detect an sm_90 GPU and skip `gpu`-marked tests without one; the
options of the fuzz test (tests/test_fuzz_gpu.py, tests/fuzz.py)."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# The compile tests keep PTX/cubin (--keep-ptx); the DSL writes them to its dump directory,
# fixed when it is first imported, and by default the working directory: not the checkout.
# One directory per test session: the files are named by kernel and argument signature,
# not by config, so two sessions sharing one read each other's PTX (seen: a split-KV
# compile test read the cluster-merge variant that another session had just written).
if "CUTE_DSL_DUMP_DIR" not in os.environ:
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="cute_attn_test_dump_")
    atexit.register(shutil.rmtree, os.environ["CUTE_DSL_DUMP_DIR"], ignore_errors=True)
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)

GPU_SKIP_REASON = "needs an sm_90 (H100/H200) GPU; none found"


def has_sm90_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(scope="session")
def sm90_gpu():
    """True when the current CUDA device is an sm_90 GPU."""
    return has_sm90_gpu()


def pytest_collection_modifyitems(config, items):
    if has_sm90_gpu():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    import fuzz  # tests/ is on sys.path here (pytest's rootdir-relative conftest import)

    group = parser.getgroup("fuzz", "seeded fuzz test (tests/test_fuzz_gpu.py)")
    group.addoption("--fuzz-n", type=int, default=fuzz.DEFAULT_N, metavar="N",
                    help=f"number of random cases (default {fuzz.DEFAULT_N}: about 2 minutes "
                         "on one H100 process, compiles included)")
    group.addoption("--fuzz-seed", type=int, default=fuzz.DEFAULT_SEED, metavar="S",
                    help=f"seed of the draw (default {fuzz.DEFAULT_SEED}, fixed so that runs repeat)")
    group.addoption("--fuzz-shard", type=fuzz.parse_shard, default=(0, 1), metavar="i/n",
                    help="run shard i of n (0 <= i < n): each compile specialisation in one shard")
    group.addoption("--fuzz-case", default=None, metavar="SPEC",
                    help="run exactly this case (the line a failing case prints)")


def pytest_collection_finish(session):
    """When the fuzz test is collected, say how its cases were drawn (under -q too, unlike a
    report header): the seed and how to change it."""
    items = [item for item in session.items if item.path.name == "test_fuzz_gpu.py"]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if not items or reporter is None:
        return
    option = session.config.getoption
    if option("--fuzz-case"):
        line = f"fuzz: one case, --fuzz-case '{option('--fuzz-case')}'"
    else:
        i, n = option("--fuzz-shard")
        line = (f"fuzz: seed {option('--fuzz-seed')} (change with --fuzz-seed S), "
                f"{len(items)} of {option('--fuzz-n')} cases (--fuzz-n N) in shard {i}/{n}")
    reporter.write_line(line)
