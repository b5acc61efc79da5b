"""Public entry point: check inputs on the host, then hand off to the launcher."""

from cute_attn.validation import validate_fwd_inputs


def mha(q, k, v, *, causal=False, softmax_scale=None, return_lse=False):
    """Multi-head attention forward on an sm_90 (Hopper) GPU.

    Args:
        q: (batch, seqlen_q, nheads, headdim) CUDA tensor, float16 or bfloat16.
        k, v: (batch, seqlen_k, nheads, headdim), same dtype and device as q.
            Layout is FlashAttention's (sequence before heads). Strides are free
            as long as the last dim is contiguous and the others are multiples of
            8 elements, so a .transpose(1, 2) view of a (b, h, s, d) tensor works.
            headdim must be one of validation.SUPPORTED_HEAD_DIMS.
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. A query that sees no key (seqlen_q >
            seqlen_k) gets out = 0 and lse = -inf.
        softmax_scale: multiplies q k^T before the softmax; default 1/sqrt(headdim).
        return_lse: also return the log-sum-exp of each row.

    Returns:
        out, shaped and typed like q (same stride order), or (out, lse) with lse
        float32 of shape (batch, nheads, seqlen_q), natural log.

    Raises TypeError/ValueError naming the bad argument before any kernel runs.
    """
    validate_fwd_inputs(q, k, v, softmax_scale)
    scale = softmax_scale if softmax_scale is not None else q.shape[3] ** -0.5
    out, lse = _launcher().run_fwd(q, k, v, causal=bool(causal), softmax_scale=float(scale))
    return (out, lse) if return_lse else out


_launcher_module = None


def _launcher():
    # imported on first use so that `import cute_attn` stays fast and needs no CuTe DSL
    global _launcher_module
    if _launcher_module is None:
        from cute_attn import launcher

        _launcher_module = launcher
    return _launcher_module
