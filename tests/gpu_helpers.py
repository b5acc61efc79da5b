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


def backward_buffer_bytes(q, k, sequences: int = 1):
    """Byte sizes at least those of what a backward allocates, in its order: dq like q,
    dk and dv like k, two fp32 per-row statistics, then the fp32 dQ_accum, which
    torch.empty leaves unset and the preprocess must zero (so poisoned, a chunk it misses
    is a NaN gradient). The statistics and dQ_accum pad the queries to whole tiles per
    batch entry, or per sequence when q is packed (varlen: pass the number of
    sequences); 128 rows bound every tile_m."""
    d, h = q.shape[-1], q.shape[-2]
    if q.dim() == 4:
        rows = q.shape[0] * (-(-q.shape[1] // 128) + 1) * 128
    else:
        rows = q.shape[0] + (sequences + 1) * 128
    kv = k.numel() * k.element_size()
    return (q.numel() * q.element_size(), kv, kv, h * rows * 4, h * rows * 4, h * rows * d * 4)


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
