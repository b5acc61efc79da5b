"""What the CPU tests' stand-in launchers share: how the launcher's (features, run args)
translate back into the reference's keywords, so a stand-in computes what the kernel
was asked to compute (tests/test_autograd_cpu.py, tests/test_compat_cpu.py)."""

from cute_attn.config import UNBOUNDED


def ref_kwargs(features, args):
    """attention_ref's keywords for what the launcher was asked to compute."""
    left, right = (-1 if w == UNBOUNDED else w for w in args.window)
    window = (left, right) if features.mask == "local" else (-1, -1)
    return dict(causal=features.mask == "causal", softmax_scale=args.softmax_scale,
                window_size=window, softcap=args.softcap)
