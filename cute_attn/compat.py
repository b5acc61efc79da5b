"""Drop-in entry points with the argument conventions of FlashAttention 2
(`flash_attn_func`, `flash_attn_varlen_func`, `flash_attn_with_kvcache`) and of PyTorch's
`torch.nn.functional.scaled_dot_product_attention` (`sdpa`), computed by `cute_attn.mha` /
`cute_attn.mha_varlen` / `cute_attn.mha_with_kvcache`.

Only what those kernels compute is accepted: an argument asking for something else
(ALiBi, a paged varlen cache, an arbitrary attention mask) raises
NotImplementedError naming it, rather than being ignored. Everything else is checked by
mha / mha_varlen (dtype, device, head dims, strides, scale), which raise TypeError /
ValueError naming their own argument (`softmax_scale` for SDPA's `scale`).

Importing this module does not import the CuTe DSL.
"""

import numbers
from typing import Literal, Optional, Union, overload

import torch
from torch import Tensor

from cute_attn.api import _NO_WINDOW, mha, mha_varlen
from cute_attn.config import UNBOUNDED
from cute_attn.validation import _BOOL_TYPES

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "sdpa"]

# FlashAttention 2's (out, softmax_lse, S_dmask) with return_attn_probs=True; S_dmask is
# always None here (see flash_attn_func)
_WithProbs = tuple[Tensor, Tensor, None]


# ----------------------------------------------------------------------------------------
# FlashAttention 2
# ----------------------------------------------------------------------------------------


@overload
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = ...,
                    softmax_scale: Optional[float] = ..., causal: bool = ...,
                    window_size: tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Optional[Tensor] = ..., deterministic: bool = ...,
                    return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = ...,
                    softmax_scale: Optional[float] = ..., causal: bool = ...,
                    window_size: tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Optional[Tensor] = ..., deterministic: bool = ..., *,
                    return_attn_probs: Literal[True]) -> _WithProbs: ...
@overload
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = ...,
                    softmax_scale: Optional[float] = ..., causal: bool = ...,
                    window_size: tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Optional[Tensor] = ..., deterministic: bool = ...,
                    return_attn_probs: bool = ...) -> Union[Tensor, _WithProbs]: ...


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: tuple[int, int] = _NO_WINDOW, softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> Union[Tensor, _WithProbs]:
    """FlashAttention 2's `flash_attn_func` (same arguments, order and defaults),
    computed by `cute_attn.mha`.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    nheads_kv dividing nheads (GQA/MQA). causal and window_size are bottom-right aligned,
    as in FlashAttention 2 and `mha`; softcap > 0 caps the scores; deterministic makes
    the backward bit-reproducible.

    Returns out, like q; with return_attn_probs=True, (out, softmax_lse, None):
    softmax_lse float32 (batch, nheads, seqlen_q), natural log, not differentiable; a row
    that sees no key has -inf (FlashAttention 3's value; FlashAttention 2's non-split
    kernels write +inf there). The third item is None, as FlashAttention 2's is without
    dropout: the probabilities S are never materialised (nothing of size seqlen^2 exists
    in the kernels), so return_attn_probs with dropout_p > 0, where FlashAttention 2
    returns S_dmask, is refused. dropout_p > 0 runs mha's dropout (its seed drawn from
    torch's generator; cute_attn.dropout_mask recomputes a mask from a seed passed to mha
    itself).

    Raises NotImplementedError for alibi_slopes other than None and for
    return_attn_probs with dropout_p > 0; TypeError / ValueError (from mha) for what mha
    rejects.
    """
    _reject_unsupported(dropout_p, alibi_slopes)
    with_probs = _checked_bool("return_attn_probs", return_attn_probs)
    _reject_dropout_mask(with_probs, dropout_p)
    result = mha(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=with_probs,
                 deterministic=deterministic, **_set_options(window_size, softcap, dropout_p))
    return _fa2_result(result, with_probs)


@overload
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = ..., softmax_scale: Optional[float] = ...,
                           causal: bool = ..., window_size: tuple[int, int] = ...,
                           softcap: float = ..., alibi_slopes: Optional[Tensor] = ...,
                           deterministic: bool = ..., return_attn_probs: Literal[False] = ...,
                           block_table: Optional[Tensor] = ...) -> Tensor: ...
@overload
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = ..., softmax_scale: Optional[float] = ...,
                           causal: bool = ..., window_size: tuple[int, int] = ...,
                           softcap: float = ..., alibi_slopes: Optional[Tensor] = ...,
                           deterministic: bool = ..., *, return_attn_probs: Literal[True],
                           block_table: Optional[Tensor] = ...) -> _WithProbs: ...
@overload
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = ..., softmax_scale: Optional[float] = ...,
                           causal: bool = ..., window_size: tuple[int, int] = ...,
                           softcap: float = ..., alibi_slopes: Optional[Tensor] = ...,
                           deterministic: bool = ..., return_attn_probs: bool = ...,
                           block_table: Optional[Tensor] = ...) -> Union[Tensor, _WithProbs]: ...


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                           causal: bool = False, window_size: tuple[int, int] = _NO_WINDOW,
                           softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Optional[Tensor] = None) -> Union[Tensor, _WithProbs]:
    """FlashAttention 2's `flash_attn_varlen_func` (same arguments, order and defaults,
    the trailing `block_table` included), computed by `cute_attn.mha_varlen`.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); cu_seqlens_q /
    cu_seqlens_k: int32 (batch + 1,) offsets; max_seqlen_q / max_seqlen_k: Python ints.
    Masks are bottom-right aligned per sequence. mha_varlen checks the offsets once per
    tensor version by default (its check_cu_seqlens=None); call mha_varlen directly with
    check_cu_seqlens=False to skip that.

    Returns out (total_q, nheads, headdim), or with return_attn_probs=True
    (out, softmax_lse, None) with softmax_lse float32 (nheads, total_q) (FlashAttention 2's
    varlen layout; -inf for rows that see no key); None for S_dmask as in
    `flash_attn_func`.

    dropout_p > 0 runs mha_varlen's dropout as flash_attn_func runs mha's (sequence b
    draws the mask of batch entry b). Raises NotImplementedError for alibi_slopes or
    block_table (a paged KV cache) other than None, and for return_attn_probs with
    dropout_p > 0 (S_dmask).
    """
    _reject_unsupported(dropout_p, alibi_slopes)
    if block_table is not None:
        raise NotImplementedError(
            "flash_attn_varlen_func: block_table (a paged KV cache) is not supported by "
            "cute_attn; pass block_table=None with k, v packed as (total_k, nheads_kv, headdim)"
        )
    with_probs = _checked_bool("return_attn_probs", return_attn_probs)
    _reject_dropout_mask(with_probs, dropout_p)
    result = mha_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        causal=causal, window_size=window_size, softmax_scale=softmax_scale,
                        softcap=softcap, return_lse=with_probs, deterministic=deterministic,
                        dropout_p=dropout_p)
    return _fa2_result(result, with_probs)


def _reject_unsupported(dropout_p, alibi_slopes):
    """dropout_p's type (mha / mha_varlen check its value) and ALiBi, which cute_attn.mha
    takes as a score mod (masks.alibi), not as FlashAttention 2's argument."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__} {dropout_p!r}")
    if alibi_slopes is not None:
        raise NotImplementedError(
            "alibi_slopes is not supported: cute_attn has no ALiBi bias; pass alibi_slopes=None"
        )


def _reject_dropout_mask(with_probs: bool, dropout_p) -> None:
    """FlashAttention 2 returns S_dmask (the probabilities, the dropout pattern in their
    sign) for return_attn_probs with dropout: nothing here materialises it."""
    if with_probs and dropout_p > 0:
        raise NotImplementedError(
            "return_attn_probs=True with dropout_p > 0 (FlashAttention 2's S_dmask) is not "
            "supported: cute_attn never materialises the attention probabilities; pass "
            "return_attn_probs=False, or dropout_p=0 for (out, softmax_lse, None)"
        )


def _fa2_result(result, with_probs):
    if not with_probs:
        return result
    out, lse = result
    return out, lse, None


# ----------------------------------------------------------------------------------------
# FlashAttention 2's KV-cache entry point
# ----------------------------------------------------------------------------------------


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: tuple[int, int] = _NO_WINDOW,
                            softcap: float = 0.0, rotary_interleaved: bool = True,
                            alibi_slopes: Optional[Tensor] = None, num_splits: int = 0,
                            return_softmax_lse: bool = False):
    """FlashAttention 2's flash_attn_with_kvcache (names, order, defaults) over
    cute_attn.mha_with_kvcache. cache_seqlens: an int32 (batch,) tensor, an int (every
    entry holds that many keys) or None (every entry full: its rows, or its pages times
    the page size; then no new k, v fit). An int or None is checked on the host: the
    entry's keys plus the new tokens must fit the cache (a ValueError otherwise). block_table is the paged
    cache's page table (mha_with_kvcache's page_table); both are made contiguous, as
    FlashAttention 2 does. Returns out, or (out, softmax_lse) with return_softmax_lse=True. Raises NotImplementedError naming rotary_cos /
    rotary_sin, cache_batch_idx, cache_leftpad and alibi_slopes when given."""
    from cute_attn.kvcache import mha_with_kvcache

    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                        ("alibi_slopes", alibi_slopes)):
        if value is not None:
            raise NotImplementedError(f"flash_attn_with_kvcache: {name} is not supported by cute_attn; pass None")
    if cache_seqlens is None or isinstance(cache_seqlens, numbers.Integral):
        cache_seqlens = _host_cache_seqlens(q, k_cache, k, cache_seqlens, block_table)
    # FlashAttention 2 makes these small tensors contiguous (maybe_contiguous); so do we
    # (a no-op when they are; a device copy otherwise, no host sync)
    if isinstance(cache_seqlens, Tensor):
        cache_seqlens = cache_seqlens.contiguous()
    if isinstance(block_table, Tensor):
        block_table = block_table.contiguous()
    # FlashAttention's defaults written out ((-1, -1), softcap 0) as mha_with_kvcache's
    # own, which its decode fast path tests by identity (vLLM-style callers pass them)
    window_size = _NO_WINDOW if _is_default_window(window_size) else window_size
    softcap = 0.0 if _is_default_softcap(softcap) else softcap
    return mha_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, page_table=block_table,
                            causal=causal, window_size=window_size, softcap=softcap,
                            softmax_scale=softmax_scale, num_splits=num_splits,
                            return_lse=_checked_bool("return_softmax_lse", return_softmax_lse))


def _host_cache_seqlens(q, k_cache, k, filled, block_table) -> Tensor:
    """cache_seqlens given as an int (every entry holds that many keys) or None (every
    entry full) as the int32 (batch,) tensor mha_with_kvcache takes, checked on the host
    against the capacity (rows, or pages per entry x page size) and the new tokens."""
    for name, t in (("q", q), ("k_cache", k_cache)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise TypeError(f"flash_attn_with_kvcache: {name} must be a 4-D torch.Tensor, got "
                            f"{type(t).__name__}{'' if not isinstance(t, Tensor) else f' of shape {tuple(t.shape)}'}")
    paged = isinstance(block_table, Tensor) and block_table.dim() == 2
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    new = k.shape[1] if isinstance(k, Tensor) and k.dim() == 4 else 0
    if filled is None:
        if new:
            raise ValueError("flash_attn_with_kvcache: cache_seqlens=None means every entry is full "
                             f"({capacity} keys), which leaves no room for the {new} new tokens of k, v: "
                             "pass cache_seqlens")
        filled = capacity
    if isinstance(filled, bool):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor, got bool {filled!r}")
    filled = int(filled)
    if not 0 <= filled <= capacity - new:
        raise ValueError(f"cache_seqlens={filled} with {new} new tokens does not fit the cache's {capacity} keys "
                         "per entry")
    return torch.full((q.shape[0],), filled, dtype=torch.int32, device=q.device)


# ----------------------------------------------------------------------------------------
# torch.nn.functional.scaled_dot_product_attention
# ----------------------------------------------------------------------------------------


def sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
         dropout_p: float = 0.0, is_causal: bool = False, *, scale: Optional[float] = None,
         enable_gqa: bool = False) -> Tensor:
    """`torch.nn.functional.scaled_dot_product_attention`'s conventions, computed by
    `cute_attn.mha`.

    query: (batch, heads, seqlen_q, headdim); key, value: (batch, heads_kv, seqlen_k,
    headdim), exactly 4-D (torch also takes 3-D and extra leading dims; here they are a
    ValueError: reshape to 4-D). float16 / bfloat16 on an sm_90 GPU, as for mha. They
    reach mha as .transpose(1, 2) views, no copy; the result is mha's output transposed
    back, a (batch, heads, seqlen_q, headdim) view (contiguous when query is).

    is_causal=True is SDPA's TOP-LEFT aligned causal mask: query i sees key j iff j <= i,
    whatever seqlen_q and seqlen_k are (mha's causal is bottom-right aligned; the two
    agree only when seqlen_q == seqlen_k). It is computed exactly:
      - seqlen_q <= seqlen_k: keys j >= seqlen_q are seen by no query, so key and value
        are cut to their first seqlen_q keys (a view), where both alignments coincide;
        their gradients there are zero, as in torch;
      - seqlen_q > seqlen_k: the bottom-right window (left=-1, right=seqlen_q - seqlen_k),
        i.e. j <= i + (seqlen_k - seqlen_q) + (seqlen_q - seqlen_k) = i.
    scale: softmax scale, default 1/sqrt(headdim) (mha's checks, as softmax_scale).
    enable_gqa=True lets key/value have fewer heads than query (heads_kv dividing heads;
    query head h reads KV head h // (heads / heads_kv), as torch's); with False, key and
    value need query's head count or 1 (which torch broadcasts: MQA), anything else is a
    ValueError, as it is an error in torch.

    dropout_p > 0 runs mha's dropout (P's dropped entries zeroed, the kept ones scaled
    by 1 / (1 - p), as torch's), its seed drawn from torch's generator.

    Raises NotImplementedError for attn_mask other than None (no arbitrary mask);
    ValueError for inputs that are not 4-D, head counts that need enable_gqa, and what
    torch broadcasts but the kernels do not take: key and value with different head
    counts, a batch of 1 against a larger one, value's headdim unlike query's; the rest
    (dropout_p in [0, 1), dtypes, devices) as mha.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"sdpa: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"sdpa: {name} must be 4-D (batch, heads, seqlen, headdim), got {tensor.dim()}-D "
                f"shape {tuple(tensor.shape)}; torch's SDPA also takes 3-D and extra leading "
                "dims, cute_attn.sdpa takes exactly 4-D: reshape (or unsqueeze) to 4-D"
            )
    if attn_mask is not None:
        raise NotImplementedError(
            "sdpa: attn_mask is not supported (cute_attn has no arbitrary mask); pass "
            "attn_mask=None, with is_causal=True for a causal mask, or cute_attn.mha's "
            "window_size for a sliding window"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"sdpa: dropout_p must be a float, got {type(dropout_p).__name__} {dropout_p!r}")
    # mha's dropout (its checks: [0, 1)); the default passes nothing (_set_options)
    dropout_p = 0.0 if dropout_p == 0 else float(dropout_p)
    is_causal = _checked_bool("is_causal", is_causal)
    enable_gqa = _checked_bool("enable_gqa", enable_gqa)
    heads, heads_k, heads_v = query.shape[1], key.shape[1], value.shape[1]
    if not enable_gqa and (heads_k not in (heads, 1) or heads_v not in (heads, 1)):
        # torch broadcasts a heads dim of 1 (the same as MQA) and rejects other counts
        raise ValueError(
            f"sdpa: query has {heads} heads, key {heads_k} and value {heads_v}: with "
            "enable_gqa=False (the default) they must be equal (or 1, broadcast); pass "
            "enable_gqa=True for GQA (heads_kv dividing heads), as with torch's SDPA"
        )
    if heads_k != heads_v:
        # torch broadcasts or repeats key and value apart; mha reads one KV head count
        raise ValueError(
            f"sdpa: key has {heads_k} heads and value {heads_v}: cute_attn.sdpa needs them "
            "equal (torch's SDPA broadcasts them apart)"
        )
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        raise ValueError(
            f"sdpa: query, key and value must have the same batch (dim 0), got "
            f"{query.shape[0]}, {key.shape[0]}, {value.shape[0]} (torch's SDPA broadcasts a "
            "batch of 1; expand it first)"
        )
    if not query.shape[3] == key.shape[3] == value.shape[3]:
        raise ValueError(
            f"sdpa: query, key and value must have the same headdim (dim 3), got "
            f"{query.shape[3]}, {key.shape[3]}, {value.shape[3]} (torch's SDPA allows value's "
            "to differ; cute_attn's kernels do not)"
        )
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if value.shape[2] != seqlen_k:
        raise ValueError(
            f"sdpa: key and value must have the same seqlen (dim 2), got key "
            f"{tuple(key.shape)} and value {tuple(value.shape)}"
        )

    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    causal, window = False, _NO_WINDOW
    if is_causal:
        if seqlen_q <= seqlen_k:
            # top-left causal never reaches keys >= seqlen_q; without them the two
            # alignments are the same mask
            if seqlen_q < seqlen_k:
                k, v = k[:, :seqlen_q], v[:, :seqlen_q]
            causal = True
        else:
            right = seqlen_q - seqlen_k
            if right >= UNBOUNDED:  # mha would read it as unbounded: not the same mask
                raise ValueError(
                    f"sdpa: is_causal with seqlen_q - seqlen_k = {right} >= {UNBOUNDED} "
                    "(config.UNBOUNDED) cannot be expressed as a window"
                )
            window = (-1, right)
    out = mha(q, k, v, causal=causal, softmax_scale=scale, **_set_options(window, 0.0, dropout_p))
    return out.transpose(1, 2)


def _is_default_window(window_size) -> bool:
    """FlashAttention's no-window default, as given or written out: (-1, -1) of two ints
    (a tuple or a list; bools are not ints here, validation refuses them)."""
    return window_size is _NO_WINDOW or (
        isinstance(window_size, (tuple, list)) and len(window_size) == 2
        and all(type(w) is int and w == -1 for w in window_size))


def _is_default_softcap(softcap) -> bool:
    """softcap off: 0.0, or 0 written as an int (FlashAttention callers pass either)."""
    return type(softcap) in (float, int) and softcap == 0


def _set_options(window_size, softcap, dropout_p) -> dict:
    """The options of mha that differ from its defaults: a call that passes none takes
    mha's signature fast path (api.mha: one empty **options test), so a default must not be
    passed explicitly, nor FlashAttention's defaults written out ((-1, -1), softcap 0).
    What is passed is passed unchanged, for mha's own checks."""
    options = {}
    if not _is_default_window(window_size):
        options["window_size"] = window_size
    if not _is_default_softcap(softcap):
        options["softcap"] = softcap
    if not (type(dropout_p) is float and dropout_p == 0.0):
        options["dropout_p"] = dropout_p
    return options


def _checked_bool(name, value):
    if not isinstance(value, _BOOL_TYPES):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return bool(value)
