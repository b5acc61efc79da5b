"""Helpers shared by the GPU test modules (test_mha_gpu.py, test_mha_bwd_gpu.py, and through
gpu_checks.py test_features_gpu.py and test_fuzz_gpu.py).

Import the fixture into a test module to apply it there (it is autouse per module).
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def exact_fp32_matmul():
    # The fp32 reference must not silently run its matmuls in TF32.
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


def poison_allocator(*nbytes):
    """Make the next CUDA allocations of these byte sizes come back full of NaN.

    The kernel's outputs come from torch.empty, so an element it never writes would
    hold whatever the caching allocator's block held before. The allocator serves a
    request from the best-fitting free block and a free merges the block back, so
    allocating, filling and freeing blocks of the output sizes leaves the free list
    as it was, with the very bytes the next same-sized requests will get now 0xFF:
    a NaN as fp16, bf16 and fp32 alike. Both orders are poisoned because we do not
    rely on the launcher allocating out before lse.
    """
    torch.cuda.empty_cache()
    for order in (nbytes, nbytes[::-1]):
        bufs = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in order]
        del bufs


class hang_guard:
    """Fail a test that hangs instead of waiting forever: a deterministic backward whose
    dQ turn is read wrong spins on a counter that never comes (blocks/semaphore.py), and a
    spinning kernel cannot be interrupted from Python. After `seconds` the process prints
    the test's name and exits with status 1 (the pytest run then reports the crash)."""

    def __init__(self, what: str, seconds: float = 300.0):
        self.what, self.seconds = what, seconds

    def __enter__(self):
        import os
        import sys
        import threading

        def fire():
            print(f"\nhang_guard: {self.what} still running after {self.seconds:.0f} s: a kernel spins "
                  "(a deterministic dQ turn that never comes?)", file=sys.stderr, flush=True)
            os._exit(1)

        self.timer = threading.Timer(self.seconds, fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        return False


def forget_bound_launches(monkeypatch):
    """Empty every cache that binds a call to a kernel, for a test that changes how the
    launcher chooses one (forced split counts, counted compiles): the launcher's plans
    and the entry points' signature fast paths (api._plain_calls, kvcache._decode_steps),
    which would otherwise replay what an earlier test bound."""
    from cute_attn import api, kvcache, launcher

    monkeypatch.setattr(launcher, "_plans", {})
    monkeypatch.setattr(api, "_plain_calls", {})
    monkeypatch.setattr(kvcache, "_decode_steps", {})


def validation_spy(monkeypatch, module, name):
    """Wrap module.name (a validation entry point) to count its calls: the signature fast
    paths must reach it only for a signature they have not bound. Returns the list of
    calls."""
    real, seen = getattr(module, name), []

    def spy(*args, **kwargs):
        seen.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen
