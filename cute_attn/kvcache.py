"""`mha_with_kvcache`: attention of a few new queries against a KV cache, with the new keys
and values appended in place first, so that one call is one decode step
(FlashAttention's `flash_attn_with_kvcache` semantics).

The kernel is the forward with AttnFeatures.kv_lengths: entry b attends to its first
cache_seqlens[b] + seqlen_new keys, read from a device tensor (blocks/seqlen.py), so a
decode step never reads lengths on the host and can be captured in a CUDA graph and
replayed with new lengths. Small grids (batch 1, one query) take split-KV like `mha`
(launcher.choose_splits). A paged cache (page_table) is read page by page: the kernel's
producer assembles each KV block from TMA boxes of one page each (FwdConfig.page_size).
"""

from typing import Optional, Union

import torch
from torch import Tensor

from cute_attn import api
from cute_attn.bounded_cache import remember
from cute_attn.config import RunArgs, attn_features
from cute_attn.kvcache_checks import refuse_grad, separate_caches, validate_kvcache_inputs

_TensorPair = tuple[Tensor, Tensor]


def mha_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                     v: Optional[Tensor] = None, *, cache_seqlens: Tensor, page_table: Optional[Tensor] = None,
                     causal: bool = False, window_size: tuple[int, int] = api._NO_WINDOW, softcap: float = 0.0,
                     softmax_scale: Optional[float] = None, num_splits: int = 0, return_lse: bool = False,
                     check_inputs: bool = False) -> Union[Tensor, _TensorPair]:
    """Attention of q against a KV cache, after appending k, v to it (not differentiable).

    Args:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on an sm_90 GPU.
        k_cache, v_cache: (batch, seqlen_cache, nheads_kv, headdim), q's dtype, nheads_kv
            dividing nheads (GQA/MQA: the group's query heads share one tile). Written in
            place when k, v are given. Slots past an entry's filled length that share its
            last KV tile are read and masked out (P = 0), so they must hold finite values:
            allocate caches with torch.zeros, not torch.empty.
        k, v: None, or (batch, seqlen_new, nheads_kv, headdim): written into the caches at
            positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of entry b.
        cache_seqlens: int32 (batch,) on q's device: the keys already in each entry.
        page_table: None for a contiguous cache; for a paged one, (num_pages, page_size,
            nheads_kv, headdim) caches with page_size in kvcache_checks.PAGE_SIZES, the
            int32 (batch, max_pages) table: key p of entry b is row p % page_size of page
            page_table[b, p // page_size]. Entries may share pages.
        causal, window_size, softcap, softmax_scale: as in `mha`, aligned bottom-right to
            each entry's cache_seqlens[b] + seqlen_new keys.
        num_splits: split-KV CTAs per query tile; 0 chooses (launcher.choose_splits).
        return_lse: also return the float32 (batch, nheads, seqlen_q) log-sum-exp.
        check_inputs: read cache_seqlens to the host once and raise ValueError naming the
            entry whose cache_seqlens[b] + seqlen_new is outside [0, seqlen_cache] (a
            device sync; an error under CUDA graph capture). Without it such values are
            clamped into the cache (positions below 0 to 0, above the end to its last
            slot), so nothing outside the cache is read or written, but that entry's
            result and its last slot are wrong.

    Returns out (batch, seqlen_q, nheads, headdim) like q, or (out, lse).
    """
    if api._forward_ad._current_level >= 0 or api._functorch_active():
        api._refuse_transforms(q, k_cache, v_cache, k, v)
    # a decode step whose signature was seen before: one dict lookup replaces the checks
    # and the plans (_DecodeStep)
    plain = not api._is_compiling() and check_inputs is False and window_size is api._NO_WINDOW \
        and type(softcap) is float and softcap == 0.0 and type(num_splits) is int \
        and (causal is True or causal is False) and (return_lse is True or return_lse is False) \
        and (softmax_scale is None or type(softmax_scale) is float) \
        and type(q) is Tensor and type(k_cache) is Tensor and type(v_cache) is Tensor \
        and type(cache_seqlens) is Tensor and (k is None or type(k) is Tensor) \
        and (v is None or type(v) is Tensor) and (page_table is None or type(page_table) is Tensor)
    if plain:
        signature = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
                     k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
                     cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device,
                     _layout(k), _layout(v), _layout(page_table), causal, softmax_scale, num_splits)
        step = _decode_steps.get(signature)
        # what a signature leaves open: the addresses (TMA needs 16-byte ones; an append
        # into caches at one address), a negative-bit view of the same layout, and grad
        if step is not None and not (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()
                                     | (0 if k is None else k.data_ptr() | v.data_ptr())) & 15 \
                and not (q.is_neg() or k_cache.is_neg() or v_cache.is_neg()
                         or (k is not None and (k.is_neg() or v.is_neg()))) \
                and (k is None or separate_caches(k_cache, v_cache, k, v)):
            refuse_grad(q, k_cache, v_cache, k, v)
            return step(q, k_cache, v_cache, k, v, cache_seqlens, page_table, return_lse)
    problem = validate_kvcache_inputs(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, page_table=page_table, causal=causal,
        window_size=window_size, softcap=softcap, softmax_scale=softmax_scale, num_splits=num_splits,
        return_lse=return_lse, check_inputs=check_inputs)
    lengths = cache_seqlens
    traced = api._traced(q)
    if problem.seqlen_new and problem.batch and problem.nheads_kv:
        # one kernel writes k, v into the caches and returns the new lengths (device-side);
        # an empty batch or no heads has nothing to write (and no grid to launch)
        if traced:
            from cute_attn import ops

            lengths = ops.kv_append(k, v, k_cache, v_cache, cache_seqlens, page_table)
        else:
            lengths = api._launcher().run_append(k, v, k_cache, v_cache, cache_seqlens, page_table)
    scale = float(softmax_scale) if softmax_scale is not None else problem.head_dim ** -0.5
    features, run_args = _features_and_args(problem, scale, lengths, page_table)
    if problem.batch == 0 or problem.seqlen_q == 0 or problem.nheads == 0:
        out, lse = api._outputs_without_kernel(q, features)
        return (out, lse) if problem.return_lse else out
    if traced:
        # torch.compile / FakeTensorMode: the attention through its custom op (like the
        # append above, whose op declares that it mutates the caches)
        from cute_attn import ops

        out, lse = ops.attention_kvcache(q, k_cache, v_cache, features, run_args, problem.num_splits)
    else:
        out, lse = api._launcher().run_fwd(q, k_cache, v_cache, features, run_args, need_lse=problem.return_lse,
                                           num_splits=problem.num_splits or None)
        if plain and q.is_cuda:
            launch = api._launcher().bind_fwd(q, k_cache, features, run_args, problem.num_splits or None)
            if launch is not None:  # (None while a CUDA graph captures)
                remember(_decode_steps, signature, _DecodeStep(problem.seqlen_new > 0, launch))
    return (out, lse) if problem.return_lse else out


def _layout(t):
    """A signature's part for an optional tensor argument (None or a tensor)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


class _DecodeStep:
    """A validated signature of mha_with_kvcache (every tensor's shape, strides, dtype and
    device, and the scalar arguments) and how to run it: the append kernel when new
    tokens come, then the forward bound to this signature (launcher.FwdLaunch), with the
    call's own lengths and pages. Host time: perf/NOTES.md, session 14."""

    __slots__ = ("appends", "launch")

    def __init__(self, appends, launch):
        self.appends, self.launch = appends, launch

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, page_table, return_lse):
        lengths = cache_seqlens
        if self.appends:
            lengths = api._launcher().run_append(k, v, k_cache, v_cache, cache_seqlens, page_table)
        out, lse = self.launch(q, k_cache, v_cache, return_lse, lengths, page_table)
        return (out, lse) if return_lse else out


# signature -> _DecodeStep (mha_with_kvcache's fast path), bounded like the launcher's plans
_decode_steps: dict = {}


def _features_and_args(problem, scale, lengths, page_table):
    """api._features_and_args's (features, run args) with kv_lengths: the per-entry key
    counts ride in the cu_seqlens_k slot."""
    plain, run_args = api._features_and_args(problem.causal, problem.window_size, problem.softcap, scale)
    features = attn_features(plain.mask, plain.softcap, kv_lengths=True)
    return features, RunArgs(run_args.softmax_scale, run_args.softcap, run_args.window, None, lengths,
                             page_table=page_table)
