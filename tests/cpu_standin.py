"""What the CPU tests' stand-ins share: how the launcher's (features, run args) translate
back into the reference's keywords, so a stand-in launcher computes what the kernel was
asked to compute (tests/test_autograd_cpu.py, tests/test_compat_cpu.py); a launcher that
fails the test when reached; and CPU tensors that report a CUDA device, for the device
checks of validation (which only read .device)."""

import pytest
import torch

from cute_attn.config import UNBOUNDED


class FakeCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device; validation only reads .device for the
    device checks, so this exercises their decisions honestly."""

    @property
    def device(self):
        return self._fake_device


def fake_cuda(t, index=0, cls=FakeCuda):
    """t as a cls (a FakeCuda) on cuda:index."""
    t = t.as_subclass(cls)
    t._fake_device = torch.device("cuda", index)
    return t


class LauncherTrap:
    """A launcher module that fails the test when any of its functions is reached."""

    def __init__(self, why=""):
        self.why = why

    def __getattr__(self, name):
        pytest.fail(f"launcher.{name} reached{self.why}")


def ref_kwargs(features, args):
    """attention_ref's keywords for what the launcher was asked to compute."""
    left, right = (-1 if w == UNBOUNDED else w for w in args.window)
    window = (left, right) if features.mask == "local" else (-1, -1)
    return dict(causal=features.mask == "causal", softmax_scale=args.softmax_scale,
                window_size=window, softcap=args.softcap)


def reference_grads(q, k, v, dout, kwargs):
    """(dq, dk, dv) of attention_ref(q, k, v, **kwargs) for dout, computed in fp32 and
    returned in q's dtype: what a stand-in's run_bwd returns."""
    import torch

    from cute_attn.reference import attention_ref

    with torch.enable_grad():
        q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
        o, _ = attention_ref(q2, k2, v2, **kwargs)
        grads = torch.autograd.grad(o, (q2, k2, v2), dout.float())
    return tuple(g.to(q.dtype) for g in grads)
