"""Host-side checks of KV-cache attention inputs (issue 12: the future `mha_with_kvcache`,
FlashAttention's `flash_attn_with_kvcache` semantics), before anything is compiled or
launched.

The rules mha already enforces (accepted dtypes, head dims, TMA layouts, softmax_scale,
softcap, window, devices) are imported from cute_attn.validation, one copy of each; this
module adds only what a cache brings: the cache's two layouts, the appended tokens, the
per-entry lengths and the page table. As in validation.py, a failure raises TypeError
(wrong kind of thing) or ValueError (right kind, wrong value) whose message names the
argument, the value received and what is accepted, and everything that can be judged on
a CPU tensor comes before the device checks.

Two levels, as for mha_varlen's offsets:
- `validate_kvcache_inputs`: types, shapes, strides and devices only. It never reads a
  tensor's values, so it never waits for the GPU (unless asked with check_inputs=True).
- `check_kvcache_values`: the values of cache_seqlens and page_table, read to the host in
  one copy. The kernel trusts them: a length past the capacity, or a page index out of
  range, would read or write memory outside the cache.
"""

from typing import NamedTuple, Optional

import torch

from cute_attn.api import _NO_WINDOW
from cute_attn.config import CAPABILITIES, DTYPE_OF_INPUT
from cute_attn.split_heuristic import MAX_SPLITS
from cute_attn.validation import (
    FOLD_MAX,
    FOLD_MIN,
    GRID_YZ_MAX,
    _BOOL_TYPES,
    _capturing_cuda_graph,
    _check_softcap_scale,
    _device_capability,
    _is_compiling,
    plainly_tma_operands,
    pointer_unknown,
    _check_dtypes,
    _check_equal,
    _check_grid_extents,
    _check_is_tensor,
    _check_operands,
    _check_rank,
    _is_int,
    validate_flags,
    validate_gqa_heads,
    validate_softcap,
    validate_window_size,
)

# Rows per page of a paged cache. Powers of two from 16 to 256: the sizes issue 12 plans
# the paged loads for (a KV block of 128 keys then lies within one page or spans whole
# pages). One tuple to widen once the kernel is written and measured.
PAGE_SIZES = (16, 32, 64, 128, 256)

_Q_SHAPE = "(batch, seqlen_q, nheads, headdim)"
_CACHE_SHAPE = "(batch, seqlen_cache, nheads_kv, headdim)"
_PAGED_CACHE_SHAPE = "(num_pages, page_size, nheads_kv, headdim) with a page_table"
_NEW_SHAPE = "(batch, seqlen_new, nheads_kv, headdim)"


class KvcacheProblem(NamedTuple):
    """What validate_kvcache_inputs learned about a call: its sizes, and its scalar
    arguments in checked form."""

    batch: int
    seqlen_q: int
    nheads: int
    nheads_kv: int
    head_dim: int
    seqlen_new: int  # tokens appended per entry (0: no k, v)
    capacity: int  # keys an entry can hold: seqlen_cache, or max_pages * page_size
    page_size: Optional[int]  # None: contiguous cache
    num_pages: Optional[int]  # None: contiguous cache
    causal: bool
    return_lse: bool
    window_size: tuple  # (left, right), -1 unbounded
    softcap: float
    num_splits: int  # 0: chosen by split_heuristic.choose_num_splits


def validate_kvcache_inputs(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                            page_table=None, causal=False, window_size=_NO_WINDOW, softcap=0.0,
                            softmax_scale=None, num_splits=0, return_lse=False,
                            check_inputs=False):
    """Raise TypeError/ValueError if the arguments of mha_with_kvcache cannot go to the
    kernel; return a KvcacheProblem.

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch, seqlen_cache,
    nheads_kv, headdim), or with page_table (num_pages, page_size, nheads_kv, headdim),
    page_size one of PAGE_SIZES. k, v: None, or both (batch, seqlen_new, nheads_kv,
    headdim) with seqlen_new at most the capacity. All of q's dtype (float16 or
    bfloat16, config.CAPABILITIES["fwd"]) and TMA-addressable (validation._layout_problem).
    cache_seqlens: int32 (batch,); page_table: int32 (batch, max_pages), last dim
    contiguous; both on q's device. num_splits: an int >= 0 (0: heuristic).
    check_inputs=True also reads cache_seqlens and page_table (check_kvcache_values; a
    device sync, an error under CUDA graph capture).
    """
    causal, return_lse, _ = validate_flags(causal, return_lse, False)
    refuse_grad(q, k_cache, v_cache, k, v)
    if not isinstance(check_inputs, _BOOL_TYPES):
        raise TypeError(f"check_inputs must be a bool (True or False), got {type(check_inputs).__name__} {check_inputs!r}")
    # the defaults skip their checks, as in api._window_and_softcap: the common call pays
    # nothing, and torch.compile need not trace math.isfinite on them
    window = window_size if window_size is _NO_WINDOW else validate_window_size(window_size)
    softcap = softcap if (type(softcap) is float and softcap == 0.0) else validate_softcap(softcap)
    _check_num_splits(num_splits)

    if not check_inputs and _plainly_valid(q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale):
        # the common decode step: every rule below holds (checked in a few attribute reads)
        if softcap:
            _check_softcap_scale(softcap, softmax_scale, q.shape[3])
        batch, seqlen_q, nheads, head_dim = q.shape
        page_size = None if page_table is None else k_cache.shape[1]
        capacity = k_cache.shape[1] if page_table is None else page_table.shape[1] * page_size
        return KvcacheProblem(batch, seqlen_q, nheads, k_cache.shape[2], head_dim, 0 if k is None else k.shape[1],
                              capacity, page_size, None if page_table is None else k_cache.shape[0], causal,
                              return_lse, window, softcap, num_splits)

    tensors = _check_tensors(q, k_cache, v_cache, k, v, paged=page_table is not None)
    policy = _check_same_dtype(tensors)
    batch, seqlen_q, nheads, head_dim = q.shape
    capacity, page_size, num_pages = _check_caches(q, k_cache, v_cache, page_table)
    nheads_kv = k_cache.shape[2]
    seqlen_new = _check_new_tokens(q, k_cache, v_cache, k, v, capacity, paged=page_table is not None)
    _check_cache_seqlens(cache_seqlens, q)

    metadata = {"cache_seqlens": cache_seqlens}
    if page_table is not None:
        metadata["page_table"] = page_table
    # head dim, TMA layouts, softmax_scale (and / softcap), then every tensor's device
    _check_operands(tensors, policy, softmax_scale, softcap, **metadata)

    if check_inputs:
        if pointer_unknown(cache_seqlens):
            raise ValueError(
                "check_inputs=True reads cache_seqlens and page_table on the host, which cannot "
                "happen on fake tensors (torch.compile's tracing, FakeTensorMode); check them "
                "outside the compiled function and pass check_inputs=False inside it"
            )
        if _capturing_cuda_graph():
            raise ValueError(
                "check_inputs=True reads cache_seqlens and page_table on the host, which "
                "cannot happen while a CUDA graph is being captured; check them before "
                "capture and pass check_inputs=False inside it"
            )
        check_kvcache_values(cache_seqlens, seqlen_new, capacity, page_table, num_pages)
    return KvcacheProblem(batch, seqlen_q, nheads, nheads_kv, head_dim, seqlen_new, capacity,
                          page_size, num_pages, causal, return_lse, window, softcap, num_splits)


def _plainly_valid(q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale):
    """validation._plainly_valid for a decode step: the common case in as few attribute
    reads as possible (a decode call's host time is its budget: issue 12 asks <= 20 us).
    False means "look closer", never "invalid": the detailed checks then name the problem.
    Nonempty calls only (batch, seqlen_q, heads and the cache at least 1)."""
    tensor = torch.Tensor
    if type(q) is not tensor or type(k_cache) is not tensor or type(v_cache) is not tensor:
        return False
    if type(cache_seqlens) is not tensor or cache_seqlens.dtype is not torch.int32:
        return False
    qs, cs = q.shape, k_cache.shape
    if len(qs) != 4 or len(cs) != 4 or v_cache.shape != cs:
        return False
    dtype, fwd = q.dtype, CAPABILITIES["fwd"]
    policy = DTYPE_OF_INPUT.get(dtype)
    if policy is None or policy.name not in fwd.dtypes or k_cache.dtype is not dtype or v_cache.dtype is not dtype:
        return False
    b, sq, h, d = qs
    hkv = cs[2]
    if b < 1 or sq < 1 or h < 1 or hkv < 1 or h % hkv or cs[3] != d or d not in fwd.head_dims or cs[1] < 1:
        return False
    if b > GRID_YZ_MAX or h > GRID_YZ_MAX:
        return False
    if cache_seqlens.shape != (b,) or (b > 1 and cache_seqlens.stride(0) != 1):
        return False
    if page_table is None:
        if cs[0] != b:
            return False
        capacity = cs[1]
    else:
        if type(page_table) is not tensor or page_table.dtype is not torch.int32 or cs[1] not in PAGE_SIZES:
            return False
        ps = page_table.shape
        if len(ps) != 2 or ps[0] != b or ps[1] < 1 or cs[0] < 1 or (ps[1] > 1 and page_table.stride(1) != 1):
            return False
        capacity = ps[1] * cs[1]
    if not plainly_tma_operands(policy, q, k_cache, v_cache):
        return False
    if (k is None) != (v is None):
        return False
    if k is not None:
        if type(k) is not tensor or type(v) is not tensor or k.dtype is not dtype or v.dtype is not dtype:
            return False
        ns = k.shape
        if len(ns) != 4 or v.shape != ns or ns[0] != b or ns[2] != hkv or ns[3] != d or ns[1] > capacity:
            return False
        if sq > capacity or _appends_into_one_cache(k_cache, v_cache, k, v):
            return False
        if not plainly_tma_operands(policy, k, v, v):
            return False
    if softmax_scale is not None and not (type(softmax_scale) is float and FOLD_MIN <= softmax_scale <= FOLD_MAX):
        return False
    if not q.is_cuda:
        return False
    device = q.device
    if k_cache.device != device or v_cache.device != device or cache_seqlens.device != device:
        return False
    if page_table is not None and page_table.device != device:
        return False
    if k is not None and (k.device != device or v.device != device):
        return False
    return _is_compiling() or _device_capability(device) == (9, 0)


# ----------------------------------------------------------------------------------------
# The steps of validate_kvcache_inputs
# ----------------------------------------------------------------------------------------


def _check_num_splits(num_splits):
    if not _is_int(num_splits):
        raise TypeError(
            "num_splits must be an int (0: chosen by the heuristic, 1: no split, n > 1: n "
            f"splits of the keys), got {type(num_splits).__name__} {num_splits!r}"
        )
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(
            f"num_splits must be in [0, {MAX_SPLITS}] (0: chosen by the heuristic; more splits than "
            f"{MAX_SPLITS} only add partials to merge), got {num_splits}"
        )


def _check_tensors(q, k_cache, v_cache, k, v, paged):
    """Every tensor argument a tensor of rank 4, k and v given together; returns them by
    name (k and v only when given), q first."""
    if (k is None) != (v is None):
        given, missing = ("k", "v") if v is None else ("v", "k")
        raise TypeError(
            f"{missing} must be given with {given} (both None, or both {_NEW_SHAPE} "
            f"tensors of the new tokens), got {missing}=None"
        )
    cache_shape = _PAGED_CACHE_SHAPE if paged else _CACHE_SHAPE
    shapes = {"q": _Q_SHAPE, "k_cache": cache_shape, "v_cache": cache_shape, "k": _NEW_SHAPE,
              "v": _NEW_SHAPE}
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k is not None:
        tensors.update(k=k, v=v)
    for name, t in tensors.items():
        _check_is_tensor(name, t)
    for name, t in tensors.items():
        _check_rank(name, t, 4, shapes[name])
    return tensors


def _check_same_dtype(tensors):
    """q's dtype one the forward takes, every other tensor the same; returns its policy."""
    q = tensors["q"]
    if any(t.dtype == torch.float8_e4m3fn for t in tensors.values()):
        # (validation's dtype message would point at q/k/v_descale, which this entry lacks)
        raise NotImplementedError("mha_with_kvcache has no FP8 path yet (issue 13): pass 16-bit caches, or "
                                  "dequantise; cute_attn.mha and mha_varlen take e4m3 with descales")
    # validation's own check of q's dtype (the k/v it compares are q itself here: the
    # other tensors have names of their own, compared below)
    policy = _check_dtypes(q, q, q)
    for name, t in tensors.items():
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
    return policy


def _check_caches(q, k_cache, v_cache, page_table):
    """The cache's layout (contiguous, or paged with its page table), v_cache shaped like
    k_cache, nheads_kv dividing nheads; returns (capacity, page_size, num_pages), the
    last two None for a contiguous cache."""
    if page_table is None:
        capacity, page_size, num_pages = _check_contiguous_cache(q, k_cache), None, None
    else:
        page_size, num_pages = _check_paged_cache(q, k_cache, page_table)
        capacity = page_table.shape[1] * page_size
    _check_equal("v_cache", "shape", tuple(v_cache.shape), tuple(k_cache.shape), ref="k_cache")
    validate_gqa_heads(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    _check_grid_extents(q.shape[0], q.shape[2])
    return capacity, page_size, num_pages


def _check_contiguous_cache(q, k_cache):
    """A (batch, seqlen_cache, nheads_kv, headdim) cache; returns its capacity."""
    for axis, label in ((0, "batch"), (3, "headdim")):
        _check_equal("k_cache", label, k_cache.shape[axis], q.shape[axis], shapes=(q, k_cache))
    if k_cache.shape[1] < 1:
        raise ValueError(f"k_cache holds no keys (seqlen_cache 0), shape {tuple(k_cache.shape)}")
    return k_cache.shape[1]


def _check_paged_cache(q, k_cache, page_table):
    """A (num_pages, page_size, nheads_kv, headdim) cache and its (batch, max_pages) int32
    page table; returns (page_size, num_pages)."""
    _check_equal("k_cache", "headdim", k_cache.shape[3], q.shape[3], shapes=(q, k_cache))
    page_size = k_cache.shape[1]
    if page_size not in PAGE_SIZES:
        raise ValueError(
            f"k_cache page_size (dim 1 of a paged cache) must be one of {PAGE_SIZES}, got "
            f"{page_size} (k_cache shape {tuple(k_cache.shape)})"
        )
    _check_is_tensor("page_table", page_table)
    _check_int32("page_table", page_table)
    if page_table.dim() != 2:
        raise ValueError(
            f"page_table must have shape (batch, max_pages), got shape {tuple(page_table.shape)}"
        )
    _check_equal("page_table", "batch", page_table.shape[0], q.shape[0])
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(
            f"page_table must be contiguous in the last dimension (each entry's pages in a "
            f"row), got strides {page_table.stride()}; call .contiguous()"
        )
    _check_same_device("page_table", page_table, q)
    if k_cache.shape[0] < 1:  # the append kernel clamps page indices into the pool
        raise ValueError(f"a paged k_cache needs at least one page, got shape {tuple(k_cache.shape)}")
    return page_size, k_cache.shape[0]


def _check_new_tokens(q, k_cache, v_cache, k, v, capacity, paged):
    """k, v (when given) shaped (batch, seqlen_new, nheads_kv, headdim), seqlen_new within
    the capacity; returns seqlen_new (0 without them)."""
    if k is None:
        return 0
    _check_equal("k", "batch", k.shape[0], q.shape[0], shapes=(q, k))
    _check_equal("k", "nheads", k.shape[2], k_cache.shape[2], ref="k_cache", shapes=(k_cache, k))
    _check_equal("k", "headdim", k.shape[3], q.shape[3], shapes=(q, k))
    _check_equal("v", "shape", tuple(v.shape), tuple(k.shape), ref="k")
    seqlen_new = k.shape[1]
    if seqlen_new > capacity:
        raise ValueError(
            f"k seqlen_new must be <= the cache capacity ({capacity} keys per entry: "
            f"{_capacity_terms(k_cache, capacity, paged)}), got {seqlen_new}"
        )
    if q.shape[1] > capacity:  # FlashAttention's rule when new keys are given
        raise ValueError(
            f"with k and v given, q seqlen_q must be <= the cache capacity ({capacity} keys per entry: "
            f"{_capacity_terms(k_cache, capacity, paged)}), got {q.shape[1]}"
        )
    if _appends_into_one_cache(k_cache, v_cache, k, v):
        raise ValueError(
            "k_cache and v_cache are the same memory: the new v would overwrite the new k "
            "in it (the append writes both); pass separate caches (or k is v)"
        )
    return seqlen_new


def _appends_into_one_cache(k_cache, v_cache, k, v) -> bool:
    """The validation's test of separate_caches: the same tensor always, the same address
    where pointers are real (not on fake tensors or while dynamo traces)."""
    if k is v or not k_cache.numel():
        return False
    return k_cache is v_cache or (not (pointer_unknown(k_cache) or pointer_unknown(v_cache))
                                  and not separate_caches(k_cache, v_cache, k, v))


def separate_caches(k_cache, v_cache, k, v) -> bool:
    """False when an append would write k and v into the same memory (the caches at one
    address, unless k is v; empty caches have none): real pointers only (the decode fast
    path reads them too)."""
    return k is v or k_cache.data_ptr() != v_cache.data_ptr() or not k_cache.numel()


def refuse_grad(*tensors) -> None:
    """mha_with_kvcache has no backward: an input that requires grad is an error, never a
    silently non-differentiable output (as the FP8 forward)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise NotImplementedError(
            "mha_with_kvcache has no backward: call it under torch.no_grad() (or "
            "torch.inference_mode()) or with tensors that do not require grad"
        )


def _capacity_terms(k_cache, capacity, paged):
    if not paged:
        return "k_cache seqlen_cache"
    page_size = k_cache.shape[1]
    return f"page_table max_pages x k_cache page_size = {capacity // page_size} x {page_size}"


def _check_cache_seqlens(cache_seqlens, q):
    _check_is_tensor("cache_seqlens", cache_seqlens)
    _check_int32("cache_seqlens", cache_seqlens)
    if tuple(cache_seqlens.shape) != (q.shape[0],):
        raise ValueError(
            f"cache_seqlens must have shape (batch,) = ({q.shape[0]},), one length per "
            f"entry, got shape {tuple(cache_seqlens.shape)}"
        )
    if cache_seqlens.stride(0) != 1 and q.shape[0] > 1:  # the kernels read it as a compact vector
        raise ValueError(f"cache_seqlens must be contiguous, got stride {cache_seqlens.stride(0)}; "
                         "call .contiguous()")
    _check_same_device("cache_seqlens", cache_seqlens, q)


def _check_int32(name, t):
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {t.dtype}; cast with .to(torch.int32)")


def _check_same_device(name, t, q):
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; {name} must be on q's device")


# ----------------------------------------------------------------------------------------
# Values
# ----------------------------------------------------------------------------------------


def check_kvcache_values(cache_seqlens, seqlen_new, capacity, page_table=None, num_pages=None):
    """Raise ValueError naming the batch entry if the kernel could not trust these values:

    - cache_seqlens[b] < 0, or cache_seqlens[b] + seqlen_new > capacity (the append would
      run past the cache);
    - (paged) a page index out of [0, num_pages) among the pages entry b uses, the first
      ceil((cache_seqlens[b] + seqlen_new) / page_size) of its row (the rest of the row is
      never read and may hold anything);
    - (paged) a page entry b appends to is also used by another entry, or twice by entry b
      (listed twice in its row): the kernel writes and reads the cache in parallel, so
      what such a page holds would depend on timing. Pages shared read-only between
      entries (a common prefix) are fine.

    capacity: seqlen_cache (contiguous) or max_pages * page_size (paged); num_pages is
    required with a page_table. Both tensors are read to the host in one copy (a device
    sync on a GPU).
    """
    batch = cache_seqlens.shape[0]
    if page_table is None:
        lengths = torch.tensor(cache_seqlens.tolist(), dtype=torch.int64)
        table = None
    else:
        if num_pages is None:
            raise TypeError("num_pages must be given with page_table (k_cache.shape[0])")
        # one device-to-host copy of both; a plain CPU int64 tensor from here on
        host = torch.tensor(torch.cat((cache_seqlens, page_table.flatten())).tolist(), dtype=torch.int64)
        lengths, table = host[:batch], host[batch:].view(tuple(page_table.shape))
    _check_lengths(lengths, seqlen_new, capacity)
    if table is not None and capacity > 0:
        page_size = capacity // table.shape[1]
        used = (lengths + seqlen_new + page_size - 1) // page_size
        _check_page_indices(table, used, num_pages)
        if seqlen_new:
            _check_append_targets(table, lengths, seqlen_new, page_size, num_pages)


def _first(mask):
    """The first index (row-major, as a tuple of ints) where mask is true, or None."""
    hits = mask.nonzero()
    return tuple(hits[0].tolist()) if len(hits) else None


def _check_lengths(lengths, seqlen_new, capacity):
    b = _first(lengths < 0)
    if b is not None:
        raise ValueError(
            f"cache_seqlens[{b[0]}] must be >= 0 (the keys batch entry {b[0]} holds), "
            f"got {int(lengths[b])}"
        )
    b = _first(lengths + seqlen_new > capacity)
    if b is not None:
        held = int(lengths[b])
        raise ValueError(
            f"cache_seqlens[{b[0]}] + seqlen_new must be <= the cache capacity ({capacity}), "
            f"got {held} + {seqlen_new} = {held + seqlen_new} for batch entry {b[0]}"
        )


def _check_page_indices(table, used, num_pages):
    in_use = torch.arange(table.shape[1])[None, :] < used[:, None]
    bad = _first(in_use & ((table < 0) | (table >= num_pages)))
    if bad is not None:
        b, i = bad
        raise ValueError(
            f"page_table[{b}, {i}] must be a page index in [0, num_pages = {num_pages}), got "
            f"{int(table[b, i])} (batch entry {b} uses page_table[{b}, :{int(used[b])}])"
        )


def _check_append_targets(table, lengths, seqlen_new, page_size, num_pages):
    """A page an entry appends to must appear once among all the pages in use.

    Entry b uses rows [0, u) of each page it lists and appends to the last of them. If a
    page it appends to has a second use (another entry, or its own row listing the page
    twice), the two collide whatever the rows: the second use reads the page's first row
    at least, and if it ends before b's append starts, its own append (the same
    seqlen_new >= 1 tokens at the end of its keys) lands in rows b reads. So the rule is
    per page, not per row."""
    seqlen_k = lengths + seqlen_new
    index = torch.arange(table.shape[1])[None, :]
    in_use = index < ((seqlen_k + page_size - 1) // page_size)[:, None]
    writes = in_use & (index >= (lengths // page_size)[:, None])
    uses = torch.bincount(table[in_use], minlength=num_pages)
    shared = _first(writes & (uses[table.clamp(0, num_pages - 1)] > 1))
    if shared is None:
        return
    b, i = shared
    page = int(table[b, i])
    others = [(ob, oi) for ob, oi in (in_use & (table == page)).nonzero().tolist() if (ob, oi) != (b, i)]
    ob, oi = others[0]
    raise ValueError(
        f"page_table[{b}, {i}] = {page} is appended to by batch entry {b} and also used by "
        f"batch entry {ob} (page_table[{ob}, {oi}]): a page an entry appends to must be "
        "its own and listed once (pages shared read-only, such as a common prefix, are fine)"
    )
