"""Shared test setup: detect an sm_90 GPU and skip `gpu`-marked tests without one."""

import pytest
import torch

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
