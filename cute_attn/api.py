"""Public entry points: check inputs on the host, then hand off to the launcher; under
autograd, a torch.autograd.Function runs the backward kernels."""

import torch

from cute_attn.config import CAUSAL, DENSE, UNBOUNDED, AttnFeatures, RunArgs
from cute_attn.validation import (
    prepare_dout,
    validate_fwd_inputs,
    validate_softcap,
    validate_varlen_fwd_inputs,
    validate_window_size,
)


_NO_WINDOW = (-1, -1)


def mha(q, k, v, *, causal=False, softmax_scale=None, window_size=_NO_WINDOW, softcap=0.0,
        return_lse=False, deterministic=False):
    """Multi-head attention on an sm_90 (Hopper) GPU, differentiable.

    Args:
        q: (batch, seqlen_q, nheads, headdim) CUDA tensor, float16 or bfloat16.
        k, v: (batch, seqlen_k, nheads_kv, headdim), same dtype and device as q, with
            nheads_kv dividing nheads: query head h reads KV head h // (nheads /
            nheads_kv) (GQA; nheads_kv = 1 is MQA). Layout is FlashAttention's
            (sequence before heads). Strides are free as long as the last dim is
            contiguous and the others are multiples of 8 elements, so a .transpose(1, 2)
            view of a (b, h, s, d) tensor works. headdim must be one of
            config.CAPABILITIES["fwd"].head_dims (the backward: ["bwd"]).
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. A query that sees no key (seqlen_q >
            seqlen_k) gets out = 0 and lse = -inf, and zero gradients.
        softmax_scale: multiplies q k^T before the softmax; default 1/sqrt(headdim).
        window_size: (left, right) sliding window, FlashAttention's: query i sees key j
            iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right;
            -1 leaves a side unbounded. causal=True sets right = 0. KV blocks outside
            every row's window are never loaded.
        softcap: > 0 caps the scores, softcap * tanh(softmax_scale * q k^T / softcap)
            (Gemma 2); 0 is off.
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
    window, softcap = _window_and_softcap(window_size, softcap)
    validate_fwd_inputs(q, k, v, softmax_scale)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[3] ** -0.5
    features, run_args = _features_and_args(causal, window, softcap, scale)
    return _run(q, k, v, features, run_args, deterministic, return_lse)


def mha_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
               causal=False, window_size=_NO_WINDOW, softmax_scale=None, softcap=0.0,
               return_lse=False, deterministic=False, check_cu_seqlens=None):
    """mha over a packed batch of variable-length sequences, differentiable.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim): the batch's
            sequences concatenated (no padding). Sequence b is rows
            cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1]
            of k and v; a sequence may be empty.
        cu_seqlens_q, cu_seqlens_k: torch.int32, (batch + 1,), on q's device, starting
            at 0, non-decreasing, ending at total_q / total_k.
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence (they
            size the grid).
        check_cu_seqlens: None (default) checks the values above before the launch by
            reading both offset tensors to the host (one small copy, which waits for the
            GPU's queued work), once per tensor and version: a model that passes the same
            offsets to every layer pays for the first call only. Skipped while a CUDA
            graph is being captured. True: the same, an error under capture; False:
            never, and offsets that break these rules leave rows of out unwritten or
            mix sequences.
        Everything else as in `mha`; masks are bottom-right aligned per sequence.

    Returns:
        out (total_q, nheads, headdim) like q, or (out, lse) with lse float32
        (nheads, total_q) (FlashAttention's varlen layout).

    The kernels take cu_seqlens and max_seqlen at run time: a new batch of lengths
    never recompiles.
    """
    window, softcap = _window_and_softcap(window_size, softcap)
    validate_varlen_fwd_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, check_cu_seqlens)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[2] ** -0.5
    features, run_args = _features_and_args(
        causal, window, softcap, scale, varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    )
    return _run(q, k, v, features, run_args, deterministic, return_lse)


def _window_and_softcap(window_size, softcap):
    """Checked (left, right) and softcap, before the tensor checks reach the device: the
    defaults skip the checks, so the common call pays nothing."""
    if window_size is not _NO_WINDOW:
        window_size = validate_window_size(window_size)
    if not (softcap == 0.0 and type(softcap) is float):
        softcap = validate_softcap(softcap)
    return window_size, softcap


def _features_and_args(causal, window, softcap, scale, varlen=None):
    """(AttnFeatures, RunArgs) of a call: the one place where the arguments
    become the features every later layer reads. Plain attention (causal or not) takes
    the shared DENSE / CAUSAL objects, the shortest host path. A window equal to causal
    becomes causal; -1 sides become config.UNBOUNDED."""

    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        mask = "none"
    elif left < 0 and right == 0:
        mask = "causal"
    else:
        mask = "local"
    if mask != "local" and softcap == 0.0 and varlen is None:
        return (CAUSAL if mask == "causal" else DENSE), RunArgs(scale)
    window = (UNBOUNDED if left < 0 else left, UNBOUNDED if right < 0 else right)
    features = AttnFeatures(mask=mask, softcap=softcap > 0, varlen=varlen is not None)
    if varlen is None:
        return features, RunArgs(scale, softcap, window)
    cu_q, cu_k, max_q, max_k = varlen
    return features, RunArgs(scale, softcap, window, cu_q, cu_k, int(max_q), int(max_k))


def _run(q, k, v, features, run_args, deterministic, return_lse):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        settings = _AttentionSettings(features, run_args, bool(deterministic))
        out, lse = _AttentionFunction.apply(q, k, v, settings)
    else:
        out, lse = _launcher().run_fwd(q, k, v, features, run_args)
    return (out, lse) if return_lse else out


class _AttentionSettings:
    """The non-tensor arguments of one attention call, carried to the backward."""

    __slots__ = ("features", "run_args", "deterministic")

    def __init__(self, features: AttnFeatures, run_args, deterministic: bool):
        self.features = features
        self.run_args = run_args
        self.deterministic = deterministic


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, settings):
        out, lse = _launcher().run_fwd(q, k, v, settings.features, settings.run_args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = settings
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        s = ctx.settings
        dq, dk, dv = _launcher().run_bwd(
            prepare_dout(dout, out), q, k, v, out, lse, s.features, s.run_args,
            deterministic=s.deterministic,
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
