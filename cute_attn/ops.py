"""The kernels as torch.library custom ops, for torch.compile, torch.export and FakeTensorMode.

Eleven ops in the namespace `cute_attn`, each with a fake (meta) implementation that only
allocates outputs shaped and laid out as the launcher's, and the 16-bit forwards
differentiable through `register_autograd`:

    cute_attn::fwd(Tensor q, Tensor k, Tensor v, str mask, float softmax_scale,
                   float softcap, SymInt window_left, SymInt window_right,
                   bool deterministic) -> (Tensor out, Tensor lse)
    cute_attn::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                   <the same six>) -> (Tensor dq, Tensor dk, Tensor dv)
    cute_attn::fwd_varlen(q, k, v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
                          SymInt max_seqlen_q, SymInt max_seqlen_k, <the same six>)
    cute_attn::bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, <the same six>)
    cute_attn::fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlens_k,
                           Tensor? page_table, <the first five of the six>,
                           int num_splits) -> (out, lse)
    cute_attn::kv_append(Tensor k, Tensor v, Tensor(a2!) k_cache, Tensor(a3!) v_cache,
                         Tensor cache_seqlens, Tensor? page_table) -> Tensor new_lengths
    cute_attn::fwd_mods(q, k, v, Tensor[] aux, Tensor[] block_mask, Tensor? sink,
                        Tensor? dropout_seed, float dropout_p, str mods, <the six>)
                        -> (out, lse)
    cute_attn::bwd_mods(dout, q, k, v, out, lse, Tensor[] aux, Tensor? sink,
                        Tensor? dropout_seed, float dropout_p, str mods, <the six>)
                        -> (dq, dk, dv, dsink)
    cute_attn::fwd_varlen_mods(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, Tensor[] aux, Tensor? sink,
                               Tensor? dropout_seed, float dropout_p, str mods,
                               <the six>) -> (out, lse)
    cute_attn::bwd_varlen_mods(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, Tensor[] aux, Tensor? sink,
                               Tensor? dropout_seed, float dropout_p, str mods,
                               <the six>) -> (dq, dk, dv, dsink)
    cute_attn::fwd_fp8(q, k, v, Tensor? q_descale, Tensor? k_descale, Tensor? v_descale,
                       Tensor? sink, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q,
                       SymInt max_seqlen_k, ScalarType out_dtype, <the first five of the six>)
                       -> (out, lse)

The mods' ops (mask/score mods, attention sinks) name their mods by the digests of their
specs, "mask/score" ("" for none): a mod is a compile-time constant of its kernel, not a
tensor, so the op carries a string and the real implementation finds the function again
(masks.Modifier.by_digest) and binds it to the aux tensors it receives (the mask mod's
first). block_mask is a BlockMask's four lists (checked against the call while tracing)
or empty (the launcher builds and caches one); sink the (heads,) float32 logits or None;
bwd_mods returns the sink's gradient (empty without a sink: an op returns no None);
dropout_seed the Philox key (int32 (2,)) with dropout_p > 0, else None. The varlen mods'
ops take no block mask: their real implementations build (and cache) the per-sequence one
from the offsets they receive, which a traced call cannot read (attention_mods refuses a
user's block_mask there).

fwd_fp8 is the e4m3 forward, dense (no offsets: the max_seqlen arguments unread) or
packed varlen, forward only (validation refuses autograd for FP8 inputs); sink the (heads,)
float32 logits of an attention sink or None; out_dtype is the output's (bfloat16 or
float16).

The six trailing arguments are a call's (AttnFeatures, RunArgs), as api._features_and_args
builds them, in primitive form: mask (AttnFeatures.mask), softmax_scale, softcap (0: off),
the window's sides (RunArgs.window: config.UNBOUNDED for an unbounded side) and
deterministic, which only the backward reads (the forward carries it to its autograd
formula). The ops trust their arguments as the launcher does: `mha` / `mha_varlen` here
validate first. Validation runs on fake tensors too (no data_ptr read there:
validation.pointer_unknown); the pointers' alignment is then checked by the real
implementations, which see real tensors.

`cute_attn.mha` and `mha_varlen` go through these ops while torch.compile traces them or
on fake tensors (api._traced); eager calls launch directly, because an op's dispatch adds
host time to every call (perf/NOTES.md). Importing this module registers the ops and
imports no DSL; the launcher is imported on the first real call.
"""

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from cute_attn import api
from cute_attn.config import DTYPE_OF_INPUT, FP8, FP8_POLICY_OF_OUTPUT, AttnFeatures, DtypePolicy, RunArgs, attn_features
from cute_attn import validation
from cute_attn.validation import _layout_problem, prepare_dout

__all__ = ["attention", "attention_fp8", "attention_kvcache", "attention_mods", "fwd", "bwd", "fwd_varlen", "bwd_varlen",
           "fwd_kvcache", "kv_append", "fwd_mods", "bwd_mods", "fwd_varlen_mods", "bwd_varlen_mods", "fwd_fp8"]


# ----------------------------------------------------------------------------------------
# (AttnFeatures, RunArgs) <-> the ops' primitive arguments
# ----------------------------------------------------------------------------------------


def _pack(features: AttnFeatures, run_args: RunArgs):
    """The (mask, softmax_scale, softcap, window_left, window_right) of a call."""
    left, right = run_args.window
    return features.mask, run_args.softmax_scale, run_args.softcap, left, right


def _unpack(mask, softmax_scale, softcap, window_left, window_right, varlen=None):
    """_pack's inverse: the (AttnFeatures, RunArgs) that _features_and_args built.
    varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) or None."""
    features = attn_features(mask, softcap > 0, varlen is not None)
    window = (window_left, window_right)
    if varlen is None:
        return features, RunArgs(softmax_scale, softcap, window)
    cu_q, cu_k, max_q, max_k = varlen
    return features, RunArgs(softmax_scale, softcap, window, cu_q, cu_k, max_q, max_k)


def _check_pointers(*named):
    """The checks that validation skips while tracing (validation.pointer_unknown), on the
    real tensors a real implementation receives: the GPU's compute capability, and the
    alignment by one OR of the addresses (the alignment is a power of two); the detailed
    message only on failure."""
    q = named[1]
    if q.is_cuda and validation._device_capability(q.device) != (9, 0):
        validation._check_devices(dict(zip(named[::2], named[1::2])))
    policy = _policy(q.dtype)
    address_bits = 0
    for t in named[1::2]:
        address_bits |= t.data_ptr()
    if address_bits % policy.align_bytes:
        for name, t in zip(named[::2], named[1::2]):
            if t.data_ptr() % policy.align_bytes:
                raise ValueError(_layout_problem(name, t, policy))


def _policy(dtype):
    # e4m3 inputs: either FP8 policy (they differ only in the output); a stand-in
    # launcher's dtype (float32 in the CPU tests) gets the default policy, as in
    # validation.prepare_dout
    if dtype is FP8:
        return FP8_POLICY_OF_OUTPUT[torch.bfloat16]
    return DTYPE_OF_INPUT.get(dtype) or DtypePolicy("", dtype, dtype, dtype)


def _aligned_dout(dout, align_like):
    """dout packed into a fresh copy when its address is off (the rest of prepare_dout's
    rule ran before the op, perhaps on a fake tensor): it is autograd's, not the user's."""
    if dout.data_ptr() % _policy(align_like.dtype).align_bytes:
        return dout.clone(memory_format=torch.contiguous_format)
    return dout


# ----------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------


def _fwd_impl(q: Tensor, k: Tensor, v: Tensor, mask: str, softmax_scale: float, softcap: float,
        window_left: int, window_right: int, deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of validated dense inputs; see the module docstring."""
    _check_pointers("q", q, "k", k, "v", v)
    features, run_args = _unpack(mask, softmax_scale, softcap, window_left, window_right)
    return api._launcher().run_fwd(q, k, v, features, run_args)


def _bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: str,
        softmax_scale: float, softcap: float, window_left: int, window_right: int,
        deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of fwd's (out, lse); dout as validation.prepare_dout leaves it."""
    _check_pointers("q", q, "k", k, "v", v, "out", out)
    features, run_args = _unpack(mask, softmax_scale, softcap, window_left, window_right)
    return api._launcher().run_bwd(_aligned_dout(dout, q), q, k, v, out, lse, features, run_args,
                                   deterministic=deterministic)


def _fwd_varlen_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, mask: str, softmax_scale: float,
               softcap: float, window_left: int, window_right: int,
               deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of a validated packed batch; lse is (heads, total_q)."""
    _check_pointers("q", q, "k", k, "v", v)
    features, run_args = _unpack(mask, softmax_scale, softcap, window_left, window_right,
                                 (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return api._launcher().run_fwd(q, k, v, features, run_args)


def _bwd_varlen_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
               mask: str, softmax_scale: float, softcap: float, window_left: int,
               window_right: int, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of fwd_varlen's (out, lse)."""
    _check_pointers("q", q, "k", k, "v", v, "out", out)
    features, run_args = _unpack(mask, softmax_scale, softcap, window_left, window_right,
                                 (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return api._launcher().run_bwd(_aligned_dout(dout, q), q, k, v, out, lse, features, run_args,
                                   deterministic=deterministic)


def _fwd_kvcache_impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens_k: Tensor,
                      page_table: Optional[Tensor], mask: str, softmax_scale: float, softcap: float,
                      window_left: int, window_right: int, num_splits: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of mha_with_kvcache's attention (after its append, kv_append): entry b attends to its first seqlens_k[b] keys of the cache, contiguous or
    paged (page_table); num_splits 0 lets the launcher choose."""
    _check_pointers("q", q, "k_cache", k_cache, "v_cache", v_cache)
    features = attn_features(mask, softcap > 0, kv_lengths=True)
    run_args = RunArgs(softmax_scale, softcap, (window_left, window_right), None, seqlens_k,
                       page_table=page_table)
    return api._launcher().run_fwd(q, k_cache, v_cache, features, run_args, num_splits=num_splits or None)


def _kv_append_impl(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                    page_table: Optional[Tensor]) -> Tensor:
    """mha_with_kvcache's append: k, v written into the caches in place at cache_seqlens
    (kernels/kv_append.py); returns the new lengths."""
    _check_pointers("k", k, "v", v, "k_cache", k_cache, "v_cache", v_cache)
    return api._launcher().run_append(k, v, k_cache, v_cache, cache_seqlens, page_table)


def _unpack_mods(mods: str, aux, sink, dropout_seed, dropout_p, mask, softmax_scale, softcap, window_left,
                 window_right, varlen=None):
    """(features, run_args, mask_mod, score_mod) of a mods op: _unpack's, with the mods
    found by their digests (masks.Modifier.by_digest) and bound to aux (the mask mod's
    first), the sink's flag and the dropout; as api._run_mods built them. varlen: as
    _unpack's (the varlen mods' ops)."""
    from cute_attn.masks import Modifier

    features, run_args = _unpack(mask, softmax_scale, softcap, window_left, window_right, varlen)
    mask_digest, score_digest = mods.split("/")
    bound, start = [], 0
    for digest in (mask_digest, score_digest):
        if not digest:
            bound.append(None)
            continue
        template = Modifier.by_digest(digest)
        count = len(template.spec.aux_signature)
        bound.append(template.rebound(aux[start:start + count]))
        start += count
    mask_mod, score_mod = bound
    features = api.with_extras(features, mask_mod, score_mod, sink is not None, dropout_seed is not None)
    if dropout_seed is not None:
        run_args = run_args._replace(dropout_p=dropout_p, dropout_seed=dropout_seed)
    return features, run_args, mask_mod, score_mod


def _fwd_mods_impl(q: Tensor, k: Tensor, v: Tensor, aux: list[Tensor], block_mask: list[Tensor],
                   sink: Optional[Tensor], dropout_seed: Optional[Tensor], dropout_p: float, mods: str, mask: str,
                   softmax_scale: float, softcap: float, window_left: int, window_right: int,
                   deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of validated dense inputs with mods and/or a sink."""
    from cute_attn.block_mask import BlockMask
    from cute_attn.config import mod_fwd_config_for

    _check_pointers("q", q, "k", k, "v", v)
    features, run_args, mask_mod, score_mod = _unpack_mods(mods, aux, sink, dropout_seed, dropout_p, mask,
                                                           softmax_scale, softcap, window_left, window_right)
    prebuilt = None
    if block_mask:  # checked against this call's shape and mask while tracing (attention_mods)
        config = mod_fwd_config_for(q.shape[-1])
        prebuilt = BlockMask(*block_mask, q.shape[0], q.shape[2], q.shape[1], k.shape[1], config.tile_m,
                             config.tile_n, mask_mod.key)
    return api._launcher().run_fwd_mods(q, k, v, features, run_args, mask_mod, score_mod, prebuilt, sink=sink)


def _bwd_mods_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: list[Tensor],
                   sink: Optional[Tensor], dropout_seed: Optional[Tensor], dropout_p: float, mods: str, mask: str,
                   softmax_scale: float, softcap: float, window_left: int, window_right: int,
                   deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsink) of fwd_mods's (out, lse); dsink is empty when sink is None
    (an op returns tensors, not None)."""
    features, run_args, mask_mod, score_mod = _unpack_mods(mods, aux, sink, dropout_seed, dropout_p, mask,
                                                           softmax_scale, softcap, window_left, window_right)
    return _mods_backward(dout, q, k, v, out, lse, features, run_args, deterministic, (mask_mod, score_mod), sink)


def _mods_backward(dout, q, k, v, out, lse, features, run_args, deterministic, mods, sink):
    """The mods' ops' backward (dense and varlen): (dq, dk, dv, dsink), dsink empty
    without a sink (an op returns tensors, not None)."""
    _check_pointers("q", q, "k", k, "v", v, "out", out)
    grads = api._launcher().run_bwd(_aligned_dout(dout, q), q, k, v, out, lse, features, run_args,
                                    deterministic=deterministic, mods=mods, sink=sink)
    return (*grads, lse.new_empty(0)) if sink is None else grads


def _fwd_varlen_mods_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, aux: list[Tensor], sink: Optional[Tensor],
                          dropout_seed: Optional[Tensor], dropout_p: float, mods: str, mask: str,
                          softmax_scale: float, softcap: float, window_left: int, window_right: int,
                          deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of a validated packed batch with mods, a sink and/or dropout; lse
    (heads, total_q). A mask mod's block mask is built here, per sequence."""
    _check_pointers("q", q, "k", k, "v", v)
    features, run_args, mask_mod, score_mod = _unpack_mods(
        mods, aux, sink, dropout_seed, dropout_p, mask, softmax_scale, softcap, window_left, window_right,
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return api._launcher().run_fwd_mods(q, k, v, features, run_args, mask_mod, score_mod, sink=sink)


def _bwd_varlen_mods_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          aux: list[Tensor], sink: Optional[Tensor], dropout_seed: Optional[Tensor], dropout_p: float,
                          mods: str, mask: str, softmax_scale: float, softcap: float, window_left: int,
                          window_right: int, deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsink) of fwd_varlen_mods's (out, lse); dsink empty without a sink."""
    features, run_args, mask_mod, score_mod = _unpack_mods(
        mods, aux, sink, dropout_seed, dropout_p, mask, softmax_scale, softcap, window_left, window_right,
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    return _mods_backward(dout, q, k, v, out, lse, features, run_args, deterministic, (mask_mod, score_mod), sink)


def _fwd_fp8_impl(q: Tensor, k: Tensor, v: Tensor, q_descale: Optional[Tensor], k_descale: Optional[Tensor],
                  v_descale: Optional[Tensor], sink: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                  cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, out_dtype: torch.dtype,
                  mask: str, softmax_scale: float, softcap: float, window_left: int,
                  window_right: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of validated e4m3 inputs, dense or packed (cu_seqlens given), with an
    attention sink when sink is given."""
    _check_pointers("q", q, "k", k, "v", v)
    varlen = None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    features, run_args = _unpack(mask, softmax_scale, softcap, window_left, window_right, varlen)
    if sink is not None:
        features = dataclasses.replace(features, sink=True)
    return api._launcher().run_fwd_fp8(q, k, v, (q_descale, k_descale, v_descale), FP8_POLICY_OF_OUTPUT[out_dtype],
                                       features, run_args, sink=sink)


# The ops run their real implementations on CUDA tensors only (the CPU tests register
# the same functions for the CPU, with a stand-in launcher)
fwd = torch.library.custom_op("cute_attn::fwd", _fwd_impl, mutates_args=(), device_types="cuda")
bwd = torch.library.custom_op("cute_attn::bwd", _bwd_impl, mutates_args=(), device_types="cuda")
fwd_varlen = torch.library.custom_op("cute_attn::fwd_varlen", _fwd_varlen_impl, mutates_args=(),
                                     device_types="cuda")
bwd_varlen = torch.library.custom_op("cute_attn::bwd_varlen", _bwd_varlen_impl, mutates_args=(),
                                     device_types="cuda")
fwd_kvcache = torch.library.custom_op("cute_attn::fwd_kvcache", _fwd_kvcache_impl, mutates_args=(),
                                      device_types="cuda")
kv_append = torch.library.custom_op("cute_attn::kv_append", _kv_append_impl, mutates_args=("k_cache", "v_cache"),
                                    device_types="cuda")
# The mods' ops build their block masks from the aux tensors' (and varlen offsets') values
# when they run (varlen reads offsets on the host): a CUDA graph replay would keep the
# masks of its capture, so inductor's CUDA graphs (mode="reduce-overhead") must leave them out
_GRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
fwd_mods = torch.library.custom_op("cute_attn::fwd_mods", _fwd_mods_impl, mutates_args=(), device_types="cuda",
                                   tags=_GRAPH_UNSAFE)
bwd_mods = torch.library.custom_op("cute_attn::bwd_mods", _bwd_mods_impl, mutates_args=(), device_types="cuda",
                                   tags=_GRAPH_UNSAFE)
fwd_varlen_mods = torch.library.custom_op("cute_attn::fwd_varlen_mods", _fwd_varlen_mods_impl, mutates_args=(),
                                          device_types="cuda", tags=_GRAPH_UNSAFE)
bwd_varlen_mods = torch.library.custom_op("cute_attn::bwd_varlen_mods", _bwd_varlen_mods_impl, mutates_args=(),
                                          device_types="cuda", tags=_GRAPH_UNSAFE)
fwd_fp8 = torch.library.custom_op("cute_attn::fwd_fp8", _fwd_fp8_impl, mutates_args=(), device_types="cuda")


# ----------------------------------------------------------------------------------------
# Fake implementations: launcher.run_fwd / run_bwd's allocations, nothing read
# ----------------------------------------------------------------------------------------


def _fake_out(q):
    # run_fwd: empty_like keeps q's stride order; the dtype is the policy's output
    policy = DTYPE_OF_INPUT.get(q.dtype)
    return torch.empty_like(q, dtype=policy.output if policy is not None else q.dtype)


@fwd.register_fake
def _(q, k, v, mask, softmax_scale, softcap, window_left, window_right, deterministic):
    batch, seqlen_q, heads, _ = q.shape
    return _fake_out(q), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@fwd_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, softmax_scale,
      softcap, window_left, window_right, deterministic):
    total_q, heads, _ = q.shape
    return _fake_out(q), q.new_empty((heads, total_q), dtype=torch.float32)


@fwd_fp8.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      out_dtype, mask, softmax_scale, softcap, window_left, window_right):
    # run_fwd_fp8: out like q in the output dtype, lse as the 16-bit forwards'
    out = torch.empty_like(q, dtype=out_dtype)
    if cu_seqlens_q is None:
        batch, seqlen_q, heads, _ = q.shape
        return out, q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    total_q, heads, _ = q.shape
    return out, q.new_empty((heads, total_q), dtype=torch.float32)


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, seqlens_k, page_table, mask, softmax_scale, softcap, window_left, window_right,
      num_splits):
    batch, seqlen_q, heads, _ = q.shape
    return _fake_out(q), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@fwd_mods.register_fake
def _(q, k, v, aux, block_mask, sink, dropout_seed, dropout_p, mods, mask, softmax_scale, softcap, window_left,
      window_right, deterministic):
    batch, seqlen_q, heads, _ = q.shape
    return _fake_out(q), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@fwd_varlen_mods.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, aux, sink, dropout_seed, dropout_p, mods,
      mask, softmax_scale, softcap, window_left, window_right, deterministic):
    total_q, heads, _ = q.shape
    return _fake_out(q), q.new_empty((heads, total_q), dtype=torch.float32)


@kv_append.register_fake
def _(k, v, k_cache, v_cache, cache_seqlens, page_table):
    return torch.empty_like(cache_seqlens)


def _fake_grads(dout, q, k, v, *rest):
    # run_bwd: dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


bwd.register_fake(_fake_grads)
bwd_varlen.register_fake(_fake_grads)


@bwd_mods.register_fake
def _(dout, q, k, v, out, lse, aux, sink, dropout_seed, dropout_p, mods, *six):
    dsink = lse.new_empty(0) if sink is None else torch.empty_like(sink)
    return (*_fake_grads(dout, q, k, v), dsink)


@bwd_varlen_mods.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, aux, sink, dropout_seed,
      dropout_p, mods, *six):
    dsink = lse.new_empty(0) if sink is None else torch.empty_like(sink)
    return (*_fake_grads(dout, q, k, v), dsink)


# ----------------------------------------------------------------------------------------
# Autograd: the forwards save q, k, v, out, lse (and the offsets) and call the backwards
# ----------------------------------------------------------------------------------------

_DENSE_TENSORS = 3  # q, k, v; then the six primitive arguments
_VARLEN_TENSORS = 5  # q, k, v, cu_seqlens_q, cu_seqlens_k; then max_seqlen_q/k and the six


def _setup_fwd(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = inputs[_DENSE_TENSORS:]
    ctx.mark_non_differentiable(lse)


def _backward_fwd(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd(prepare_dout(dout, out), q, k, v, out, lse, *ctx.params)
    return (dq, dk, dv) + (None,) * len(ctx.params)


def _setup_fwd_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k = inputs[:_VARLEN_TENSORS]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.params = inputs[_VARLEN_TENSORS:]
    ctx.mark_non_differentiable(lse)


def _backward_fwd_varlen(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = bwd_varlen(prepare_dout(dout, out), q, k, v, out, lse, cu_q, cu_k, *ctx.params)
    return (dq, dk, dv, None, None) + (None,) * len(ctx.params)


_MODS_TENSORS = 6  # q, k, v, aux, block_mask, sink; then dropout_seed, dropout_p, mods and the six


def _setup_fwd_mods(ctx, inputs, output):
    q, k, v, aux, block_mask, sink, dropout_seed = inputs[:_MODS_TENSORS + 1]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sink, dropout_seed, *aux)
    ctx.params = inputs[_MODS_TENSORS + 1:]
    ctx.lists = (len(aux), len(block_mask))  # their gradients: lists of None as long
    ctx.mark_non_differentiable(lse)


def _backward_fwd_mods(ctx, dout, _dlse):
    q, k, v, out, lse, sink, dropout_seed, *aux = ctx.saved_tensors
    want_sink = sink is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dsink = bwd_mods(prepare_dout(dout, out), q, k, v, out, lse, aux, sink if want_sink else None,
                                 dropout_seed, *ctx.params)
    if not want_sink:
        dsink = None
    no_aux, no_lists = ([None] * n for n in ctx.lists)
    return (dq, dk, dv, no_aux, no_lists, dsink, None) + (None,) * len(ctx.params)


_VARLEN_MODS_TENSORS = 9  # q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, aux, sink; then the rest


def _setup_fwd_varlen_mods(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, aux, sink, dropout_seed = inputs[:_VARLEN_MODS_TENSORS + 1]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sink, dropout_seed, *aux)
    ctx.maxima = (max_q, max_k)
    ctx.params = inputs[_VARLEN_MODS_TENSORS + 1:]
    ctx.num_aux = len(aux)
    ctx.mark_non_differentiable(lse)


def _backward_fwd_varlen_mods(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, sink, dropout_seed, *aux = ctx.saved_tensors
    want_sink = sink is not None and ctx.needs_input_grad[8]
    dq, dk, dv, dsink = bwd_varlen_mods(prepare_dout(dout, out), q, k, v, out, lse, cu_q, cu_k, *ctx.maxima, aux,
                                        sink if want_sink else None, dropout_seed, *ctx.params)
    return (dq, dk, dv, None, None, None, None, [None] * ctx.num_aux, dsink if want_sink else None, None) \
        + (None,) * len(ctx.params)


fwd.register_autograd(_backward_fwd, setup_context=_setup_fwd)
fwd_mods.register_autograd(_backward_fwd_mods, setup_context=_setup_fwd_mods)
fwd_varlen.register_autograd(_backward_fwd_varlen, setup_context=_setup_fwd_varlen)
fwd_varlen_mods.register_autograd(_backward_fwd_varlen_mods, setup_context=_setup_fwd_varlen_mods)


# ----------------------------------------------------------------------------------------
# The call api._run makes while traced
# ----------------------------------------------------------------------------------------


def attention_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, features: AttnFeatures, run_args: RunArgs,
                      num_splits: int) -> tuple[Tensor, Tensor]:
    """mha_with_kvcache's attention through cute_attn::fwd_kvcache (the key counts per
    entry ride in run_args.cu_seqlens_k, as the launcher takes them)."""
    left, right = run_args.window
    return fwd_kvcache(q, k_cache, v_cache, run_args.cu_seqlens_k, run_args.page_table, features.mask,
                       run_args.softmax_scale, run_args.softcap, left, right, num_splits)


def attention(q: Tensor, k: Tensor, v: Tensor, features: AttnFeatures, run_args: RunArgs,
              deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of a validated call through cute_attn::fwd or cute_attn::fwd_varlen,
    differentiable through their registered autograd."""
    params = (*_pack(features, run_args), deterministic)
    if features.varlen:
        return fwd_varlen(q, k, v, run_args.cu_seqlens_q, run_args.cu_seqlens_k, run_args.max_seqlen_q,
                          run_args.max_seqlen_k, *params)
    return fwd(q, k, v, *params)


def attention_fp8(q: Tensor, k: Tensor, v: Tensor, descales, policy: DtypePolicy, features: AttnFeatures,
                  run_args: RunArgs, sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of a validated FP8 call through cute_attn::fwd_fp8 (descales: the three
    descale tensors or None; policy: the output's, config.FP8_POLICY_OF_OUTPUT; sink: the
    (heads,) float32 sink logits or None)."""
    window_left, window_right = run_args.window
    varlen = (run_args.cu_seqlens_q, run_args.cu_seqlens_k, run_args.max_seqlen_q, run_args.max_seqlen_k) \
        if features.varlen else (None, None, 0, 0)
    return fwd_fp8(q, k, v, *descales, sink, *varlen, policy.output, features.mask, run_args.softmax_scale,
                   run_args.softcap, window_left, window_right)


def attention_mods(q: Tensor, k: Tensor, v: Tensor, features: AttnFeatures, run_args: RunArgs,
                   deterministic: bool, mask_mod, score_mod, block_mask, sink: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(out, lse) of a validated call with mods and/or a sink through cute_attn::fwd_mods
    (mask_mod, score_mod masks.Modifier or None; block_mask a BlockMask, checked here
    against this call, or None), differentiable through its registered autograd."""
    from cute_attn import block_mask as bm
    from cute_attn.config import mod_fwd_config_for

    mods = "/".join("" if m is None else m.spec.digest for m in (mask_mod, score_mod))
    aux = [t for m in (mask_mod, score_mod) if m is not None for t in m.aux]
    if features.varlen:
        if block_mask is not None:
            raise NotImplementedError("mha_varlen's block_mask cannot be checked against the offsets while traced "
                                      "(their values are not known): pass block_mask=None under torch.compile; the "
                                      "op builds and caches the per-sequence block mask itself")
        return fwd_varlen_mods(q, k, v, run_args.cu_seqlens_q, run_args.cu_seqlens_k, run_args.max_seqlen_q,
                               run_args.max_seqlen_k, aux, sink, run_args.dropout_seed, run_args.dropout_p, mods,
                               *_pack(features, run_args), deterministic)
    lists = []
    if block_mask is not None:
        config = mod_fwd_config_for(q.shape[-1])
        bm.check_block_mask(block_mask, mask_mod, q.shape[0], q.shape[2], q.shape[1], k.shape[1], config.tile_m,
                            config.tile_n)
        lists = [block_mask.partial_count, block_mask.partial_idx, block_mask.full_count, block_mask.full_idx]
    return fwd_mods(q, k, v, aux, lists, sink, run_args.dropout_seed, run_args.dropout_p, mods,
                    *_pack(features, run_args), deterministic)
