"""Public entry point: check inputs on the host, then hand off to the launcher; under
autograd, a torch.autograd.Function runs the backward kernels."""

import torch

from cute_attn.validation import prepare_dout, validate_fwd_inputs


def mha(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, deterministic=False):
    """Multi-head attention on an sm_90 (Hopper) GPU, differentiable.

    Args:
        q: (batch, seqlen_q, nheads, headdim) CUDA tensor, float16 or bfloat16.
        k, v: (batch, seqlen_k, nheads, headdim), same dtype and device as q.
            Layout is FlashAttention's (sequence before heads). Strides are free
            as long as the last dim is contiguous and the others are multiples of
            8 elements, so a .transpose(1, 2) view of a (b, h, s, d) tensor works.
            headdim must be one of validation.SUPPORTED_HEAD_DIMS (the backward:
            config.BWD_HEAD_DIMS).
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. A query that sees no key (seqlen_q >
            seqlen_k) gets out = 0 and lse = -inf, and zero gradients.
        softmax_scale: multiplies q k^T before the softmax; default 1/sqrt(headdim).
        return_lse: also return the log-sum-exp of each row (not differentiable).
        deterministic: make the backward's dQ accumulation order fixed, so gradients
            are bit-identical run to run.

    Returns:
        out, shaped and typed like q (same stride order), or (out, lse) with lse
        float32 of shape (batch, nheads, seqlen_q), natural log.

    Under autograd (any input requires grad and grad mode is on) the forward saves
    q, k, v, out and lse, nothing of size seqlen^2, for the backward kernels.

    Raises TypeError/ValueError naming the bad argument before any kernel runs.
    """
    validate_fwd_inputs(q, k, v, softmax_scale)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[3] ** -0.5
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        settings = _AttentionSettings(bool(causal), scale, bool(deterministic))
        out, lse = _AttentionFunction.apply(q, k, v, settings)
    else:
        out, lse = _launcher().run_fwd(q, k, v, causal=bool(causal), softmax_scale=scale)
    return (out, lse) if return_lse else out


class _AttentionSettings:
    """The non-tensor arguments of one attention call, carried to the backward."""

    __slots__ = ("causal", "softmax_scale", "deterministic")

    def __init__(self, causal: bool, softmax_scale: float, deterministic: bool):
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.deterministic = deterministic


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, settings):
        out, lse = _launcher().run_fwd(
            q, k, v, causal=settings.causal, softmax_scale=settings.softmax_scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = settings
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        s = ctx.settings
        dq, dk, dv = _launcher().run_bwd(
            prepare_dout(dout, out), q, k, v, out, lse,
            causal=s.causal, softmax_scale=s.softmax_scale, deterministic=s.deterministic,
        )
        return dq, dk, dv, None


_launcher_module = None


def _launcher():
    # imported on first use so that `import cute_attn` stays fast and needs no CuTe DSL
    global _launcher_module
    if _launcher_module is None:
        from cute_attn import launcher

        _launcher_module = launcher
    return _launcher_module
