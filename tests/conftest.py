"""Shared test setup: detect an sm_90 GPU and skip `gpu`-marked tests without one."""

import os
import tempfile

import pytest
import torch

# The compile tests keep PTX/cubin (--keep-ptx); the DSL writes them to its dump directory,
# fixed when it is first imported, and by default the working directory: not the checkout.
os.environ.setdefault("CUTE_DSL_DUMP_DIR", os.path.join(tempfile.gettempdir(), "cute_attn_dump"))
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
