"""Public entry points: check inputs on the host, then hand off to the launcher; under
autograd, a torch.autograd.Function runs the backward kernels."""

import dataclasses
import inspect
import math
import numbers
from typing import Callable, Literal, Optional, Sequence, Union, overload

import torch
from torch import Tensor
from torch.autograd import forward_ad as _forward_ad
from torch.autograd.function import once_differentiable

from cute_attn.block_mask import BlockMask
from cute_attn.bounded_cache import remember
from cute_attn.config import CAUSAL, DENSE, DTYPE_OF_INPUT, FP8, FP8_POLICY_OF_OUTPUT, UNBOUNDED, AttnFeatures, RunArgs, attn_features
from cute_attn.validation import (
    _is_compiling,
    memory_problem,
    pointer_unknown,
    prepare_dout,
    validate_flags,
    validate_fp8_fwd_inputs,
    validate_fwd_inputs,
    validate_softcap,
    validate_varlen_fwd_inputs,
    validate_window_size,
)


_NO_WINDOW = (-1, -1)

# (out, lse): what the entry points return with return_lse=True
_TensorPair = tuple[Tensor, Tensor]


@overload
def mha(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = ..., softmax_scale: Optional[float] = ...,
        window_size: tuple[int, int] = ..., softcap: float = ..., return_lse: Literal[False] = ...,
        deterministic: bool = ..., q_descale: Optional[Tensor] = ..., k_descale: Optional[Tensor] = ...,
        v_descale: Optional[Tensor] = ..., out_dtype: Optional[torch.dtype] = ...,
        mask_mod: Optional[Callable] = ..., score_mod: Optional[Callable] = ..., aux_tensors: Sequence[Tensor] = ...,
        block_mask: Optional[BlockMask] = ..., learnable_sink: Optional[Tensor] = ...,
        dropout_p: float = ..., dropout_seed: Optional[Tensor] = ...) -> Tensor: ...
@overload
def mha(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = ..., softmax_scale: Optional[float] = ...,
        window_size: tuple[int, int] = ..., softcap: float = ..., return_lse: Literal[True],
        deterministic: bool = ..., q_descale: Optional[Tensor] = ..., k_descale: Optional[Tensor] = ...,
        v_descale: Optional[Tensor] = ..., out_dtype: Optional[torch.dtype] = ...,
        mask_mod: Optional[Callable] = ..., score_mod: Optional[Callable] = ..., aux_tensors: Sequence[Tensor] = ...,
        block_mask: Optional[BlockMask] = ..., learnable_sink: Optional[Tensor] = ...,
        dropout_p: float = ..., dropout_seed: Optional[Tensor] = ...) -> _TensorPair: ...
@overload
def mha(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = ..., softmax_scale: Optional[float] = ...,
        window_size: tuple[int, int] = ..., softcap: float = ..., return_lse: bool,
        deterministic: bool = ..., q_descale: Optional[Tensor] = ..., k_descale: Optional[Tensor] = ...,
        v_descale: Optional[Tensor] = ..., out_dtype: Optional[torch.dtype] = ...,
        mask_mod: Optional[Callable] = ..., score_mod: Optional[Callable] = ..., aux_tensors: Sequence[Tensor] = ...,
        block_mask: Optional[BlockMask] = ..., learnable_sink: Optional[Tensor] = ...,
        dropout_p: float = ..., dropout_seed: Optional[Tensor] = ...) -> Union[Tensor, _TensorPair]: ...


def mha(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
        return_lse: bool = False, deterministic: bool = False, **options):
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
        causal: (bool) mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. A query that sees no key (seqlen_q >
            seqlen_k) gets out = 0 and lse = -inf, and zero gradients.
        softmax_scale: multiplies q k^T before the softmax; default 1/sqrt(headdim).
            Accepted in validation.FOLD_MIN..FOLD_MAX (about 1.2e-38 to 2.4e38): the
            kernel folds log2(e) into it in float32, which must stay normal and finite.
        window_size: (left, right) sliding window, FlashAttention's: query i sees key j
            iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right;
            -1 leaves a side unbounded, and so does any side >= config.UNBOUNDED (2**30;
            no sequence that fits on a GPU is that long): (2**40, 0) is causal.
            causal=True sets right = 0. KV blocks outside every row's window are never
            loaded.
        softcap: > 0 caps the scores, softcap * tanh(softmax_scale * q k^T / softcap)
            (Gemma 2); 0 is off. Same float32 range as softmax_scale, and
            softmax_scale / softcap must be a normal, finite float32 too.
        return_lse: (bool) also return the log-sum-exp of each row (not differentiable).
        deterministic: (bool) make the backward's dQ accumulation order fixed, so
            gradients are bit-identical run to run. On as well when
            torch.use_deterministic_algorithms(True) is on at this call.
        q_descale, k_descale, v_descale: FP8 only. With q, k, v in torch.float8_e4m3fn
            (cute_attn.quantize_fp8 makes them), float32 (batch, nheads_kv) factors,
            FlashAttention-3's convention: the real value is the stored value times its
            descale (q's per KV head: the query heads of a GQA group share one). None
            means 1. The FP8 forward has no backward.
        out_dtype: FP8 only: torch.bfloat16 (None) or torch.float16.
        mask_mod, score_mod: programmable masks and score modifications (cute_attn.masks
            has the contract and built-ins: block_diffusion, prefix_lm, document, causal,
            sliding_window, alibi), compiled into the forward kernel: a new mod function
            compiles once, new lengths or aux values never recompile. A mod replaces
            causal / window_size / softcap (write them as mods: masks.causal(),
            masks.and_masks(...)). Forward and backward (the backward differentiates
            score_mod itself, masks.Dual; deterministic=True orders dQ by the block
            mask's turns); packed batches in mha_varlen.
        aux_tensors: tensors a plain-function mod reads as seq.aux[i] (the built-ins
            carry their own); on q's device.
        block_mask: cute_attn.create_block_mask(mask_mod, ...) for this shape, built
            once and reused; None builds one per (mask, shape) on the GPU and caches it.
        learnable_sink: attention sinks (gpt-oss): a (nheads,) float tensor on q's
            device, one logit per query head that joins every row's softmax denominator:
            out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} + e^{sink_h}), lse likewise (a row
            that sees no key gets out = 0, lse = sink). Differentiable (its gradient is
            -sum_i e^{sink - lse_i} dO_i . O_i). Works with causal, window_size, softcap
            or the mods; no packed GQA or split-KV (the mods' forward kernel). With FP8
            inputs too (forward only: a sink that requires grad is refused there).
        dropout_p: drop probability of attention dropout on the softmax's P (kept ones
            scaled by 1 / (1 - dropout_p), p taken to 1/256; lse stays the undropped one), forward and
            backward, from a counter-based Philox generator (cute_attn/dropout.py):
            the backward regenerates the forward's mask. Works with causal, window_size,
            softcap, the mods and a sink, and in mha_varlen; not with FP8 or KV caches
            yet.
        dropout_seed: the call's Philox key, an int32 (2,) tensor on q's device; None
            draws one from torch's CUDA generator (reproducible after torch.manual_seed,
            no host sync, CUDA-graph safe). cute_attn.dropout_mask(seed, ...) gives the
            pairs a call with that seed kept.

    Returns:
        out, shaped and typed like q (same stride order), or (out, lse) with lse
        float32 of shape (batch, nheads, seqlen_q), natural log.

    Empty calls launch nothing and compile nothing: batch, seqlen_q or nheads 0 returns
    empty out and lse of those shapes; seqlen_k 0 (every query sees no key) returns
    out = 0 and lse = -inf. Under autograd their gradients are zeros of the inputs'
    shapes.

    Under autograd (any input requires grad and grad mode is on) the forward saves
    q, k, v, out and lse, nothing of size seqlen^2, for the backward kernels.

    Raises TypeError/ValueError naming the bad argument before any kernel runs.
    """
    if _forward_ad._current_level >= 0 or _functorch_active():
        _refuse_transforms(q, k, v, *options.values())
    # The plain call (16-bit tensors, causal or not, no option of the other fourteen) of a
    # signature seen before: one dict lookup replaces the checks and plans (_PlainCall).
    # The options come as **options so that "nothing else set" is one empty-dict test, not
    # fourteen default comparisons (~1 us of a ~15 us call; perf/NOTES.md, host path);
    # mha.__signature__ still shows every argument. The identity tests keep a 1 or a
    # numpy bool from matching a True key (validation refuses them).
    plain = not options and not _is_compiling() and type(q) is Tensor and type(k) is Tensor \
        and type(v) is Tensor and (causal is True or causal is False) \
        and (return_lse is True or return_lse is False) and (deterministic is True or deterministic is False) \
        and (softmax_scale is None or type(softmax_scale) is float)
    if plain:
        call = _plain_calls.get(_plain_signature(q, k, v, causal, softmax_scale))
        # what a signature leaves open: the addresses (TMA needs 16-byte ones; every 16-bit
        # policy's align_bytes) and a negative-bit view of the same layout
        if call is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 \
                and not (q.is_neg() or k.is_neg() or v.is_neg()):
            return call(q, k, v, return_lse, deterministic)
    return _mha(q, k, v, plain, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                deterministic=deterministic, **options)


# (aliased: the check runs on every call, fast path included, ~60 ns)
_functorch_active = torch._C._are_functorch_transforms_active


def _refuse_transforms(*tensors):
    """torch.func transforms and forward-mode AD reach no kernel: a functorch wrapper has
    no memory to read, and a dual tensor's tangent would be dropped (a silent zero jvp)."""
    if _functorch_active():
        raise NotImplementedError("cute_attn has no torch.func support (grad, vmap, jvp, jacrev, ...): "
                                  "differentiate with torch.autograd (loss.backward(), torch.autograd.grad)")
    if any(isinstance(t, Tensor) and _forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError("forward-mode AD (torch.autograd.forward_ad dual tensors) is not supported: "
                                  "the kernels would drop the tangent")


def _plain_signature(q, k, v, causal, softmax_scale):
    # every input of validate_fwd_inputs but the addresses; get_device() (an int) is ~3x
    # cheaper than .device (a new torch.device per read), and with is_cuda it names the
    # device (another accelerator's index 0 is not cuda:0)
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), q.is_cuda and k.is_cuda and v.is_cuda,
            causal, softmax_scale)


def _mha(q: Tensor, k: Tensor, v: Tensor, plain: bool, *, causal: bool = False,
        softmax_scale: Optional[float] = None, window_size: tuple[int, int] = _NO_WINDOW,
        softcap: float = 0.0, return_lse: bool = False,
        deterministic: bool = False, q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
        v_descale: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
        mask_mod: Optional[Callable] = None, score_mod: Optional[Callable] = None,
        aux_tensors: Sequence[Tensor] = (), block_mask: Optional[BlockMask] = None,
        learnable_sink: Optional[Tensor] = None, dropout_p: float = 0.0,
        dropout_seed: Optional[Tensor] = None) -> Union[Tensor, _TensorPair]:
    """mha with every argument named (the public mha's slow path; its docstring). plain:
    mha's test that this call may take its fast path next time (then it is remembered)."""
    causal, return_lse, deterministic = _checked_flags(causal, return_lse, deterministic)
    window, softcap = _window_and_softcap(window_size, softcap)
    dropout_p = _checked_dropout_p(dropout_p, dropout_seed)
    if q_descale is not None or k_descale is not None or v_descale is not None \
            or getattr(q, "dtype", None) is FP8:
        _refuse_fp8_extras(dropout_p, mask_mod, score_mod, aux_tensors, block_mask)
        descales = (q_descale, k_descale, v_descale)
        policy, no_kernel = validate_fp8_fwd_inputs(q, k, v, descales, out_dtype, softmax_scale, softcap)
        sink = _checked_fp8_sink(learnable_sink, q)
        scale = float(softmax_scale) if softmax_scale is not None else _default_scale(q)
        features, run_args = _features_and_args(causal, window, softcap, scale)
        return _run_fp8(q, k, v, descales, policy, features, run_args, return_lse, no_kernel, sink)
    if out_dtype is not None:
        raise ValueError("out_dtype is for FP8 inputs; a 16-bit call returns q's dtype")
    no_kernel = validate_fwd_inputs(q, k, v, softmax_scale, softcap)
    scale = float(softmax_scale) if softmax_scale is not None else _default_scale(q)
    if mask_mod is not None or score_mod is not None or block_mask is not None or aux_tensors \
            or learnable_sink is not None or dropout_p:
        return _run_mods(q, k, v, causal, window, softcap, scale, mask_mod, score_mod, aux_tensors, block_mask,
                         return_lse, deterministic, no_kernel, learnable_sink, (dropout_p, dropout_seed))
    features, run_args = _features_and_args(causal, window, softcap, scale)
    if plain and not no_kernel and q.is_cuda:  # (CPU tests stub the validation)
        _remember_plain_call(_plain_signature(q, k, v, causal, softmax_scale), q, k, features, run_args)
    return _run(q, k, v, features, run_args, deterministic, return_lse, no_kernel)


# help(mha) and inspect show every argument, not **options (nor _mha's plain)
_full_signature = inspect.signature(_mha)
mha.__signature__ = _full_signature.replace(
    parameters=[p for p in _full_signature.parameters.values() if p.name != "plain"])


class _PlainCall:
    """A validated signature of mha's plain call, and how to run it: every check of
    validate_fwd_inputs is a function of the signature (shapes, strides, dtypes, devices,
    causal, softmax_scale) but the addresses' alignment and a negative-bit view, which mha
    tests per call. Host time of the tiny call: perf/NOTES.md, host path."""

    __slots__ = ("features", "run_args", "launch")

    def __init__(self, features, run_args, launch):
        self.features, self.run_args, self.launch = features, run_args, launch

    def __call__(self, q, k, v, return_lse, deterministic):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            settings = _AttentionSettings(self.features, self.run_args,
                                          deterministic or _deterministic_algorithms())
            out, lse = _AttentionFunction.apply(q, k, v, settings)
        else:
            out, lse = self.launch(q, k, v, return_lse)
        return (out, lse) if return_lse else out


# signature -> _PlainCall (mha's fast path); bounded like the launcher's plans
_plain_calls: dict = {}


def _remember_plain_call(signature, q, k, features, run_args):
    launch = _launcher().bind_fwd(q, k, features, run_args)
    if launch is None:  # a CUDA graph capturing: run_fwd each call
        return
    remember(_plain_calls, signature, _PlainCall(features, run_args, launch))


def _refuse_fp8_extras(dropout_p, mask_mod=None, score_mod=None, aux_tensors=(), block_mask=None):
    """The FP8 forward is the dense kernel's (with a sink): what only the mods' kernel has
    is an error there, never silently dropped."""
    extras = {"dropout_p": bool(dropout_p), "mask_mod": mask_mod is not None, "score_mod": score_mod is not None,
              "aux_tensors": bool(aux_tensors), "block_mask": block_mask is not None}
    named = [name for name, given in extras.items() if given]
    if named:
        raise NotImplementedError(f"{', '.join(named)}: no FP8 kernel yet (the FP8 forward is the dense one)")


def _run_mods(q, k, v, causal, window, softcap, scale, mask_mod, score_mod, aux_tensors, block_mask, return_lse,
              deterministic, no_kernel, sink=None, dropout=(0.0, None), varlen=None):
    """Attention with mask/score mods, a sink and/or dropout (kernels/fwd_sm90.
    FlashFwdSm90Mods, and under autograd kernels/bwd_sm90.FlashBwdSm90Mods). dropout:
    (dropout_p, dropout_seed) as _checked_dropout_p left them; varlen: mha_varlen's
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    from cute_attn.masks import Modifier

    has_mods = mask_mod is not None or score_mod is not None
    if has_mods and (causal or window != _NO_WINDOW or softcap != 0.0):
        raise ValueError("mask_mod/score_mod replace causal, window_size and softcap: write them as mods "
                         "(cute_attn.masks.causal(), sliding_window(), and_masks(...))")
    if not has_mods and (aux_tensors or block_mask is not None):
        raise ValueError("aux_tensors and block_mask go with a mask_mod or score_mod")
    if sink is not None:
        sink = _checked_sink(sink, q)
    if not isinstance(aux_tensors, (tuple, list)):
        raise TypeError(f"aux_tensors must be a tuple or list of tensors, got {type(aux_tensors).__name__}")
    # aux_tensors belong to the one plain-function mod (a Modifier carries its own)
    plain = [m for m in (mask_mod, score_mod) if m is not None and not isinstance(m, Modifier)]
    if aux_tensors and len(plain) != 1:
        raise ValueError("aux_tensors goes with exactly one plain-function mod; bind tensors to a function with "
                         "cute_attn.masks.Modifier('mask' | 'score', fn, aux)")
    mask = Modifier.of("mask", mask_mod, aux_tensors if plain and plain[0] is mask_mod else ())
    score = Modifier.of("score", score_mod, aux_tensors if plain and plain[0] is score_mod else ())
    if block_mask is not None and mask is None:
        raise ValueError("block_mask goes with a mask_mod")
    batch = q.shape[0] if varlen is None else varlen[0].shape[0] - 1  # varlen: the sequences
    for mod in (mask, score):
        for i, t in enumerate(() if mod is None else mod.aux):
            if t.device != q.device:
                raise ValueError(f"{mod.name}'s aux tensor {i} is on {t.device}, q on {q.device}")
        if mod is not None:  # positions run over the sequence (varlen: the totals)
            mod.check_extents(batch, q.shape[-2], q.shape[-3], k.shape[-3])
    # the mods replace the mask kind (then "none"); a sink alone keeps causal/window/softcap
    features, run_args = _features_and_args(causal, window, softcap, scale, varlen)
    dropout_p, dropout_seed = dropout
    features = with_extras(features, mask, score, sink is not None, dropout_p > 0)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                              or (sink is not None and sink.requires_grad))
    if torch.is_grad_enabled() and any(t.requires_grad for mod in (mask, score) if mod is not None for t in mod.aux):
        # the kernels differentiate the score, not the mods' tensors: never a silent None
        raise NotImplementedError("a mod's aux tensors get no gradient (ALiBi slopes, document ids...): "
                                  "pass them detached (or under torch.no_grad())")
    if dropout_p:
        if dropout_seed is None:
            from cute_attn.dropout import new_seed, refuse_recomputed_draw

            if _is_compiling():
                refuse_recomputed_draw()
            dropout_seed = new_seed(q.device)
        elif dropout_seed.device != q.device:
            raise ValueError(f"dropout_seed is on {dropout_seed.device}, q on {q.device}")
        run_args = run_args._replace(dropout_p=dropout_p, dropout_seed=dropout_seed)
    if not no_kernel and _traced(q):
        from cute_attn import ops

        out, lse = ops.attention_mods(q, k, v, features, run_args, deterministic, mask, score, block_mask, sink)
        return (out, lse) if return_lse else out
    settings = _AttentionSettings(features, run_args, deterministic, no_kernel, mods=(mask, score, block_mask))
    if needs_grad:
        out, lse = _AttentionFunction.apply(q, k, v, settings, sink)
        return (out, lse) if return_lse else out
    out, lse = _mods_forward(q, k, v, settings, sink, need_lse=return_lse)
    return (out, lse) if return_lse else out


def with_extras(features: AttnFeatures, mask_mod, score_mod, sink: bool, dropout: bool) -> AttnFeatures:
    """features (the mask kind, softcap: "none" and off under mods) with the mods' specs
    (masks.Modifier or None), the sink's and dropout's flags: what _run_mods and the
    custom op (ops._unpack_mods) both compile."""
    return dataclasses.replace(features, mask_mod=None if mask_mod is None else mask_mod.spec,
                               score_mod=None if score_mod is None else score_mod.spec, sink=sink, dropout=dropout)


def _checked_dropout_p(dropout_p, dropout_seed) -> float:
    """dropout_p as a float in [0, 1), and dropout_seed an int32 (2,) tensor or None."""
    if dropout_seed is None and type(dropout_p) is float and dropout_p == 0.0:  # (type first: no tensor ==)
        return 0.0  # the common call: nothing more to check on the per-call path
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__} {dropout_p!r}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    from cute_attn.dropout import threshold

    if 0.0 < dropout_p and threshold(dropout_p) == 0:
        # the kernels drop by an 8-bit threshold (cute_attn/dropout.py): p is taken to 1/256
        raise ValueError(f"dropout_p={dropout_p!r} rounds to no dropout (the kernels take p in steps of 1/256); "
                         "pass 0.0, or more than 1/512")
    if dropout_seed is not None:
        if not isinstance(dropout_seed, Tensor):
            raise TypeError(f"dropout_seed must be a torch.Tensor, got {type(dropout_seed).__name__}")
        if dropout_seed.dtype != torch.int32 or tuple(dropout_seed.shape) != (2,):
            raise ValueError(f"dropout_seed must be an int32 tensor of shape (2,), got {dropout_seed.dtype} "
                             f"{tuple(dropout_seed.shape)}")
        if dropout_seed.stride(0) != 1:  # the kernels read it as a compact pair
            raise ValueError(f"dropout_seed must be contiguous, got stride {dropout_seed.stride(0)}; "
                             "call .contiguous()")
        if not dropout_p:
            raise ValueError("dropout_seed goes with dropout_p > 0")
    return dropout_p


def _checked_sink(sink, q):
    """learnable_sink as the kernel reads it: float32 (heads,) on q's device (a cast of
    a 16-bit parameter stays differentiable)."""
    if not isinstance(sink, Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor, got {type(sink).__name__}")
    heads = q.shape[-2]  # (batch, seqlen, heads, d), or varlen's (total, heads, d)
    if sink.dim() != 1 or sink.shape[0] != heads:
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({heads},), got {tuple(sink.shape)}")
    if sink.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"learnable_sink must be float32, bfloat16 or float16, got {sink.dtype}")
    if sink.device != q.device:
        raise ValueError(f"learnable_sink is on {sink.device}, q on {q.device}")
    # (a negative-bit view is resolved, differentiably; a wrapper subclass has no memory)
    sink = sink.float().contiguous().resolve_neg()
    problem = memory_problem("learnable_sink", sink)
    if problem:
        raise ValueError(problem)
    return sink


def _checked_fp8_sink(sink, q):
    """learnable_sink of an FP8 call (None stays None): _checked_sink's rules, and no
    gradient to ask for (the FP8 forward has no backward, like its other inputs)."""
    if sink is None:
        return None
    if torch.is_grad_enabled() and isinstance(sink, Tensor) and sink.requires_grad:
        raise NotImplementedError("the FP8 forward has no backward: call it under torch.no_grad() or with a "
                                  "learnable_sink that does not require grad")
    return _checked_sink(sink, q)


def _sink_only_lse(lse, sink, varlen):
    """The lse of rows that see no key but a sink: the sink's logit, per head."""
    if sink is None or not lse.numel():
        return lse
    per_head = sink.detach()[:, None] if varlen else sink.detach()[None, :, None]
    return per_head.expand_as(lse).contiguous()


def _mods_forward(q, k, v, settings, sink, need_lse=True):
    """(out, lse) of the mods' forward; with no keys (no kernel) every row sees only the
    sink: out = 0, lse = sink."""
    if settings.no_kernel:
        out, lse = _outputs_without_kernel(q, settings.features)
        return out, _sink_only_lse(lse, sink, settings.features.varlen)
    mask, score, block_mask = settings.mods
    return _launcher().run_fwd_mods(q, k, v, settings.features, settings.run_args, mask, score, block_mask,
                                    need_lse=need_lse, sink=sink)


@overload
def mha_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = ...,
               window_size: tuple[int, int] = ..., softmax_scale: Optional[float] = ...,
               softcap: float = ..., return_lse: Literal[False] = ..., deterministic: bool = ...,
               check_cu_seqlens: Optional[bool] = ..., q_descale: Optional[Tensor] = ...,
               k_descale: Optional[Tensor] = ..., v_descale: Optional[Tensor] = ...,
               out_dtype: Optional[torch.dtype] = ..., learnable_sink: Optional[Tensor] = ...,
               dropout_p: float = ..., dropout_seed: Optional[Tensor] = ...,
               mask_mod: Optional[Callable] = ..., score_mod: Optional[Callable] = ...,
               aux_tensors: Sequence[Tensor] = ..., block_mask: Optional[BlockMask] = ...) -> Tensor: ...
@overload
def mha_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = ...,
               window_size: tuple[int, int] = ..., softmax_scale: Optional[float] = ...,
               softcap: float = ..., return_lse: Literal[True], deterministic: bool = ...,
               check_cu_seqlens: Optional[bool] = ..., q_descale: Optional[Tensor] = ...,
               k_descale: Optional[Tensor] = ..., v_descale: Optional[Tensor] = ...,
               out_dtype: Optional[torch.dtype] = ..., learnable_sink: Optional[Tensor] = ...,
               dropout_p: float = ..., dropout_seed: Optional[Tensor] = ...,
               mask_mod: Optional[Callable] = ..., score_mod: Optional[Callable] = ...,
               aux_tensors: Sequence[Tensor] = ..., block_mask: Optional[BlockMask] = ...) -> _TensorPair: ...
@overload
def mha_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = ...,
               window_size: tuple[int, int] = ..., softmax_scale: Optional[float] = ...,
               softcap: float = ..., return_lse: bool, deterministic: bool = ...,
               check_cu_seqlens: Optional[bool] = ..., q_descale: Optional[Tensor] = ...,
               k_descale: Optional[Tensor] = ..., v_descale: Optional[Tensor] = ...,
               out_dtype: Optional[torch.dtype] = ..., learnable_sink: Optional[Tensor] = ...,
               dropout_p: float = ..., dropout_seed: Optional[Tensor] = ...,
               mask_mod: Optional[Callable] = ..., score_mod: Optional[Callable] = ...,
               aux_tensors: Sequence[Tensor] = ..., block_mask: Optional[BlockMask] = ...) -> Union[Tensor, _TensorPair]: ...


def mha_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
               window_size: tuple[int, int] = _NO_WINDOW, softmax_scale: Optional[float] = None,
               softcap: float = 0.0, return_lse: bool = False, deterministic: bool = False,
               check_cu_seqlens: Optional[bool] = None, q_descale: Optional[Tensor] = None,
               k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
               out_dtype: Optional[torch.dtype] = None, learnable_sink: Optional[Tensor] = None,
               dropout_p: float = 0.0, dropout_seed: Optional[Tensor] = None,
               mask_mod: Optional[Callable] = None, score_mod: Optional[Callable] = None,
               aux_tensors: Sequence[Tensor] = (), block_mask: Optional[BlockMask] = None
               ) -> Union[Tensor, _TensorPair]:
    """mha over a packed batch of variable-length sequences, differentiable.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim): the batch's
            sequences concatenated (no padding). Sequence b is rows
            cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1]
            of k and v; a sequence may be empty.
        cu_seqlens_q, cu_seqlens_k: torch.int32, (batch + 1,), on q's device, starting
            at 0, non-decreasing, ending at total_q / total_k.
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence (they
            size the grid). Values above q's / k's total tokens are taken as the total
            (the grid never needs more), so any int fits the kernels' Int32.
        check_cu_seqlens: None (default) checks the values above before the launch by
            reading both offset tensors to the host (one small copy, which waits for the
            GPU's queued work), once per tensor and version: a model that passes the same
            offsets to every layer pays for the first call only. Skipped while a CUDA
            graph is being captured. True: read on every call (even when remembered),
            an error under capture; False: never. In every mode a max_seqlen below
            total tokens / sequences is refused on the host. Offsets that break these rules can leave rows of out unwritten or mix
            sequences; the kernels clamp each sequence's span into the packed tensors,
            so no access leaves q, k, v, out, lse, the backward's buffers or the mods'
            aux tensors (perf/sanitize.py's varlen-bad-offsets cases). The once-per-version check does not
            see writes that bypass torch's version counter (.data, numpy or DLPack
            aliases, other kernels, a CUDA graph's replays into a static buffer): after
            such writes pass check_cu_seqlens=True for a clear error.
        learnable_sink, dropout_p, dropout_seed: as in `mha`, forward and backward; the
            dropout mask of sequence b is the one `mha` draws for batch entry b with the
            same seed (dropout_mask(seed, b, ...), positions counted within the sequence).
            Traced by torch.compile through cute_attn::fwd_varlen_mods; not with FP8.
        mask_mod, score_mod, aux_tensors: as in `mha`, forward and backward, with the
            packed batch's indices: b is the sequence's index and q_idx / kv_idx are
            global (rows of the packed q / k: the sequence's offset added), so an aux
            tensor over the packed tokens is indexed directly (masks.document with
            (total,) ids); seq.seqlen_q / seqlen_k are the sequence's lengths and
            seq.offset_q / offset_k its offsets, which the built-ins use to align
            per sequence (masks.causal() is bottom-right aligned per sequence).
        block_mask: cute_attn.create_varlen_block_mask(mask_mod, cu_seqlens_q,
            cu_seqlens_k, nheads, head_dim=...) for this batch of lengths, built once and
            passed to every layer (checked against the call's offsets once per offsets
            tensor and version); None builds one per (mask, offsets) and caches it while
            the same offset and aux tensors live unmodified. Both read the offsets to
            the host once (a small copy that waits for the GPU's queued work), so a
            CUDA-graph capture needs the block masks built before it (a warm-up call,
            forward and backward: the backward builds its own transposed one), and a
            replay must keep the offsets they were built for (new lengths in the same
            offsets tensor would meet a stale mask, and a sequence longer than any it
            was built for would send the kernel past its lists). Under torch.compile pass none (a traced call cannot check one
            against the offsets: NotImplementedError); the op builds and caches it.
        Everything else as in `mha` (FP8 too: descales (batch, nheads_kv) with batch the
            number of sequences); masks are bottom-right aligned per sequence.

    Returns:
        out (total_q, nheads, headdim) like q, or (out, lse) with lse float32
        (nheads, total_q) (FlashAttention's varlen layout). total_q or nheads 0: empty
        outputs; total_k 0: out = 0, lse = -inf; no kernel either way (as in `mha`).

    The kernels take cu_seqlens and max_seqlen at run time: a new batch of lengths
    never recompiles.
    """
    if _forward_ad._current_level >= 0 or _functorch_active():
        _refuse_transforms(q, k, v, learnable_sink, q_descale, k_descale, v_descale)
    causal, return_lse, deterministic = _checked_flags(causal, return_lse, deterministic)
    window, softcap = _window_and_softcap(window_size, softcap)
    dropout_p = _checked_dropout_p(dropout_p, dropout_seed)
    if check_cu_seqlens is not False and _without_values(cu_seqlens_q, cu_seqlens_k):
        # traced (torch.compile) or fake offsets have no values to read
        if check_cu_seqlens:
            raise ValueError(
                "check_cu_seqlens=True reads cu_seqlens on the host, which traced (torch.compile) "
                "or fake tensors cannot do; check them outside and pass check_cu_seqlens=False "
                "(or None)"
            )
        check_cu_seqlens = False
    descales = (q_descale, k_descale, v_descale)
    fp8 = any(d is not None for d in descales) or getattr(q, "dtype", None) is FP8
    if fp8:
        _refuse_fp8_extras(dropout_p, mask_mod, score_mod, aux_tensors, block_mask)
    validate_varlen_fwd_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, check_cu_seqlens, softcap=softcap,
                               fp8=(descales, out_dtype) if fp8 else None)
    if not fp8 and out_dtype is not None:
        raise ValueError("out_dtype is for FP8 inputs; a 16-bit call returns q's dtype")
    scale = float(softmax_scale) if softmax_scale is not None else _default_scale(q)
    # the grid never needs more than the total tokens (and they fit an Int32 on any GPU)
    total_q, total_k = q.shape[0], k.shape[0]
    max_seqlen_q, max_seqlen_k = min(max_seqlen_q, total_q), min(max_seqlen_k, total_k)
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    no_kernel = total_q == 0 or total_k == 0 or q.shape[1] == 0
    if not fp8 and (mask_mod is not None or score_mod is not None or block_mask is not None or aux_tensors
                    or learnable_sink is not None or dropout_p):  # the mods' kernels build their own features
        return _run_mods(q, k, v, causal, window, softcap, scale, mask_mod, score_mod, aux_tensors, block_mask,
                         return_lse, deterministic, no_kernel, learnable_sink, (dropout_p, dropout_seed),
                         varlen=varlen)
    features, run_args = _features_and_args(causal, window, softcap, scale, varlen=varlen)
    if fp8:
        policy = FP8_POLICY_OF_OUTPUT[out_dtype or torch.bfloat16]
        sink = _checked_fp8_sink(learnable_sink, q)
        return _run_fp8(q, k, v, descales, policy, features, run_args, return_lse, no_kernel, sink)
    return _run(q, k, v, features, run_args, deterministic, return_lse, no_kernel)


def _checked_flags(causal, return_lse, deterministic):
    """The three flags as bools. Identity tests against True/False first: the cheapest
    check of the common call; numpy bools and everything else go to validate_flags (a
    TypeError unless a bool). deterministic is also on under
    torch.use_deterministic_algorithms(True), as torch's own kernels read it."""
    if not ((causal is True or causal is False) and (return_lse is True or return_lse is False)
            and (deterministic is True or deterministic is False)):
        causal, return_lse, deterministic = validate_flags(causal, return_lse, deterministic)
    return causal, return_lse, deterministic or _deterministic_algorithms()


_deterministic_algorithms = torch.are_deterministic_algorithms_enabled


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
    becomes causal; a side >= config.UNBOUNDED is unbounded like -1 (the same mask
    kind: (2**40, 0) is causal, (2**40, 2**40) no mask); unbounded sides become
    config.UNBOUNDED, so every window side fits the kernels' Int32."""

    left, right = window
    if causal:
        right = 0
    if left >= UNBOUNDED:
        left = -1
    if right >= UNBOUNDED:
        right = -1
    if left < 0 and right < 0:
        mask = "none"
    elif left < 0 and right == 0:
        mask = "causal"
    else:
        mask = "local"
    if mask != "local" and softcap == 0.0 and varlen is None:
        return (CAUSAL if mask == "causal" else DENSE), RunArgs(scale)
    window = (UNBOUNDED if left < 0 else left, UNBOUNDED if right < 0 else right)
    features = attn_features(mask, softcap > 0, varlen is not None)
    if varlen is None:
        return features, RunArgs(scale, softcap, window)
    cu_q, cu_k, max_q, max_k = varlen
    return features, RunArgs(scale, softcap, window, cu_q, cu_k, int(max_q), int(max_k))


def _without_values(*tensors):
    # (non-tensors are left to validation, which names them)
    return any(isinstance(t, torch.Tensor) and pointer_unknown(t) for t in tensors)


def _default_scale(q):
    # int(): the head dim is one of the capability table's (validation checked it), so a
    # call traced with dynamic shapes still gets a Python float, not a symbolic one
    return int(q.shape[-1]) ** -0.5


def _traced(q):
    """True while torch.compile traces the call (dynamo, or AOT autograd's fake tensors)
    or under FakeTensorMode: the kernels then run through the custom ops of
    cute_attn.ops, which those tracers understand. Eager calls launch directly: an op's
    dispatch adds host time to every call (perf/NOTES.md, host path)."""
    return _is_compiling() or (type(q) is not torch.Tensor and pointer_unknown(q))


def _run(q, k, v, features, run_args, deterministic, return_lse, no_kernel=False):
    if not no_kernel and _traced(q):
        from cute_attn import ops

        out, lse = ops.attention(q, k, v, features, run_args, deterministic)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        settings = _AttentionSettings(features, run_args, deterministic, no_kernel)
        out, lse = _AttentionFunction.apply(q, k, v, settings)
    elif no_kernel:
        out, lse = _outputs_without_kernel(q, features)
    else:
        out, lse = _launcher().run_fwd(q, k, v, features, run_args, need_lse=return_lse)
    return (out, lse) if return_lse else out


def _run_fp8(q, k, v, descales, policy, features, run_args, return_lse, no_kernel, sink=None):
    """The FP8 forward (forward only: validation refused autograd), with an attention
    sink when sink (float32 (heads,)) is given; traced calls go through cute_attn::fwd_fp8."""
    if sink is not None:
        features = dataclasses.replace(features, sink=True)
    if not no_kernel and _traced(q):
        from cute_attn import ops

        out, lse = ops.attention_fp8(q, k, v, descales, policy, features, run_args, sink)
    elif no_kernel:
        out, lse = _outputs_without_kernel(q, features, policy.output)
        lse = _sink_only_lse(lse, sink, features.varlen)
    else:
        out, lse = _launcher().run_fwd_fp8(q, k, v, descales, policy, features, run_args, need_lse=return_lse,
                                           sink=sink)
    return (out, lse) if return_lse else out


def _outputs_without_kernel(q, features, out_dtype=None):
    """(out, lse) of a call that needs no kernel, shaped and typed as the launcher's:
    q has no elements (both empty), or k has no keys, so every row sees no key and
    gets the rule for such rows, out = 0 and lse = -inf. Nothing is compiled or
    launched; the tensors are made like q (its device, its stride order for out)."""
    if out_dtype is None:
        policy = DTYPE_OF_INPUT.get(q.dtype)
        out_dtype = policy.output if policy is not None else q.dtype
    out = torch.zeros_like(q, dtype=out_dtype)
    if features.varlen:
        total_q, heads, _ = q.shape
        shape = (heads, total_q)
    else:
        batch, seqlen_q, heads, _ = q.shape
        shape = (batch, heads, seqlen_q)
    return out, q.new_full(shape, -math.inf, dtype=torch.float32)


class _AttentionSettings:
    """The non-tensor arguments of one attention call, carried to the backward."""

    __slots__ = ("features", "run_args", "deterministic", "no_kernel", "mods")

    def __init__(self, features: AttnFeatures, run_args, deterministic: bool, no_kernel=False, mods=None):
        self.features = features
        self.run_args = run_args
        self.deterministic = deterministic
        self.no_kernel = no_kernel  # empty q or no keys: _outputs_without_kernel
        self.mods = mods  # (mask_mod, score_mod, block_mask): masks.Modifier / BlockMask or None


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, settings, sink=None):
        if settings.mods is not None:
            out, lse = _mods_forward(q, k, v, settings, sink)
        elif settings.no_kernel:
            out, lse = _outputs_without_kernel(q, settings.features)
        else:
            out, lse = _launcher().run_fwd(q, k, v, settings.features, settings.run_args)
        # the other tensors the backward reads (offsets, the dropout key, the mods' aux
        # tensors) are saved too, unused: autograd then refuses an in-place edit of them
        # between the forward and the backward (a different mask), as the ops path does
        ctx.save_for_backward(q, k, v, out, lse, sink, *_tensors_read_again(settings))
        ctx.settings = settings
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable  # the kernels' gradients are not differentiable: refuse create_graph's double backward
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors[:6]
        s = ctx.settings
        want_sink = sink is not None and ctx.needs_input_grad[4]
        if s.no_kernel:
            # out is 0 (or empty) whatever q, k, v (and the sink) are: zero gradients
            dsink = torch.zeros_like(sink) if want_sink else None
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, dsink
        extra = {} if s.mods is None else {"mods": s.mods[:2]}
        if want_sink:
            extra["sink"] = sink  # run_bwd then returns dsink too
        grads = _launcher().run_bwd(
            prepare_dout(dout, out), q, k, v, out, lse, s.features, s.run_args,
            deterministic=s.deterministic, **extra,
        )
        return (*grads[:3], None, grads[3] if want_sink else None)


def _tensors_read_again(settings) -> tuple:
    """What the backward reads besides q, k, v, out, lse and the sink: the varlen offsets,
    the dropout key and the mods' aux tensors."""
    args = settings.run_args
    tensors = [t for t in (args.cu_seqlens_q, args.cu_seqlens_k, args.dropout_seed) if t is not None]
    for mod in (settings.mods or ())[:2]:
        if mod is not None:
            tensors.extend(mod.aux)
    return tuple(tensors)


_launcher_module = None


def _launcher():
    # imported on first use so that `import cute_attn` stays fast and needs no CuTe DSL
    global _launcher_module
    if _launcher_module is None:
        from cute_attn import launcher

        _launcher_module = launcher
    return _launcher_module
