"""Compiles kernel specialisations once, caches them, and launches them on torch tensors.

The compile key holds only static properties (dtype, head dim, causal, tile config, arch):
batch, sequence lengths, heads and every stride except the last are symbolic, so a new
shape never recompiles. Kernels are compiled through the DSL's TVM-FFI path: the compiled
function takes torch tensors directly and launches on torch's current CUDA stream, which
keeps the per-call host work to argument checking plus one launch (perf/NOTES.md has the
measured cost).

Compiling needs no GPU: set CUTE_DSL_ARCH=sm_90a (see `compile_fwd` and cute_attn.ptx).
"""

import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from cute_attn.config import (
    BWD_HEAD_DIMS,
    UNBOUNDED,
    AttnFeatures,
    BwdConfig,
    FwdConfig,
    bwd_config_for,
    choose_fwd_config,
    choose_pack_gqa,
)

ARCH = "sm_90a"
_TORCH_TO_DSL = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class FwdKey:
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    features: AttnFeatures
    config: FwdConfig
    arch: str = ARCH


@dataclass(frozen=True)
class RunArgs:
    """The run-time values of one call beyond its tensors (none of them is in a key)."""

    softmax_scale: float
    softcap: float = 0.0  # 0: off
    window: tuple = (UNBOUNDED, UNBOUNDED)  # (left, right) of a "local" mask
    cu_seqlens_q: Optional[torch.Tensor] = None  # varlen only
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


def _dsl_dtype(name: str):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[name]


def _fake_bshd(dtype, batch, seqlen, heads, head_dim: int, name: str):
    """(batch, seqlen, heads, head_dim) with head_dim contiguous; the other strides are
    64-bit and declared multiples of 8 elements (16 bytes, as TMA requires; validation
    checks it before a call); the pointer 16-byte aligned."""
    import cutlass.cute as cute

    strides = tuple(cute.sym_int64(divisibility=8, symbol=f"{name}_stride{i}") for i in range(3))
    return cute.runtime.make_fake_tensor(
        dtype, (batch, seqlen, heads, head_dim), stride=(*strides, 1), assumed_align=16
    )


def _fake_rowwise(batch, heads, n, name, align=4, divisibility=1):
    """(batch, heads, n) float32 with the last dim contiguous."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(
        cutlass.Float32, (batch, heads, n),
        stride=(cute.sym_int64(divisibility=divisibility, symbol=f"{name}_stride0"),
                cute.sym_int64(divisibility=divisibility, symbol=f"{name}_stride1"), 1),
        assumed_align=align,
    )


def _fake_cu_seqlens(name):
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(
        cutlass.Int32, (cute.sym_int32(symbol=f"{name}_len"),), assumed_align=4
    )


def _fake_scalars():
    """(softmax_scale, softcap, window_left, window_right) stand-ins."""
    import cutlass

    return cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0)


def _fake_fwd_args(key: FwdKey):
    """Symbolic stand-ins for the forward's arguments that fix only what the key fixes
    (see _fake_bshd for the strides and alignment). Varlen calls pass (1, total, ...)
    views of the packed tensors, so batch, seqlen and heads stay symbols either way."""
    import cutlass
    import cutlass.cute as cute

    dtype = _dsl_dtype(key.dtype)
    batch = cute.sym_int32(symbol="batch")
    heads, heads_kv = cute.sym_int32(symbol="heads"), cute.sym_int32(symbol="heads_kv")
    seqlen_q, seqlen_k = cute.sym_int32(symbol="seqlen_q"), cute.sym_int32(symbol="seqlen_k")
    d = key.head_dim
    q, o = (_fake_bshd(dtype, batch, seqlen_q, heads, d, n) for n in ("q", "o"))
    k, v = (_fake_bshd(dtype, batch, seqlen_k, heads_kv, d, n) for n in ("k", "v"))
    lse = _fake_rowwise(batch, heads, seqlen_q, "lse")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (
        q, k, v, o, lse, _fake_cu_seqlens("cu_seqlens_q"), _fake_cu_seqlens("cu_seqlens_k"),
        cutlass.Int32(0), *_fake_scalars(), stream,
    )


def compile_fwd(key: FwdKey, extra_options: str = ""):
    """Compile one forward specialisation; returns the TVM-FFI callable
    f(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, softcap,
    window_left, window_right)."""
    import cutlass.cute as cute

    from cute_attn.kernels.fwd_sm90 import FlashFwdSm90

    os.environ.setdefault("CUTE_DSL_ARCH", key.arch)
    kernel = FlashFwdSm90(_dsl_dtype(key.dtype), key.head_dim, key.features, key.config)
    options = ("--enable-tvm-ffi " + extra_options).strip()
    return cute.compile(kernel, *_fake_fwd_args(key), options=options)


_cache: dict = {}
_cache_lock = threading.Lock()
# (torch dtype, head_dim, features) -> kernel of the default config: the per-call lookup
# then hashes three plain values instead of building and hashing config dataclasses
_default_kernels: dict = {}


def _cached(key, compile_fn):
    """The compiled function(s) of key, compiled on first use (once across threads)."""
    fn = _cache.get(key)
    if fn is None:
        with _cache_lock:
            fn = _cache.get(key)
            if fn is None:
                fn = _cache[key] = compile_fn(key)
    return fn


def _raw(compiled):
    # the tvm_ffi.Function underneath the DSL's keyword-argument wrapper: a cheaper call
    raw = getattr(compiled, "__tvm_ffi_object__", None)
    return (raw() if raw is not None else None) or compiled


def get_fwd_kernel(key: FwdKey):
    return _cached(key, lambda k: _raw(compile_fwd(k)))


_DENSE = AttnFeatures()
_DENSE_CAUSAL = AttnFeatures(mask="causal")


def run_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float,
    features: Optional[AttnFeatures] = None,
    args: Optional[RunArgs] = None,
    config: Optional[FwdConfig] = None,
):
    """Launch the forward on validated inputs; returns (out, lse). out has q's dtype and
    dimension order (empty_like keeps a transposed view's strides); lse is float32
    (batch, heads, seqlen_q), or (heads, total_q) for varlen.

    features=None is plain attention (causal or not); otherwise `args` carries the
    run-time values that go with the features (its softmax_scale wins)."""
    if features is None:
        features = _DENSE_CAUSAL if causal else _DENSE
    if args is None:
        args = RunArgs(softmax_scale)
    head_dim = q.shape[-1]
    # packed GQA (FwdConfig.pack_gqa) for short query sequences; the group size is static
    group = q.shape[-2] // k.shape[-2]
    pack = 1 if group == 1 or features.varlen else _pack_for(q.shape[1], group, head_dim, features)
    if config is None:
        fn = _default_kernels.get((q.dtype, head_dim, features, pack))
        if fn is None:
            cfg = choose_fwd_config(head_dim, features.causal_like, features.mask == "local")
            cfg = dataclasses.replace(cfg, pack_gqa=pack)
            fn = get_fwd_kernel(FwdKey(_TORCH_TO_DSL[q.dtype], head_dim, features, cfg))
            fn = _default_kernels.setdefault((q.dtype, head_dim, features, pack), fn)
    else:
        fn = get_fwd_kernel(FwdKey(_TORCH_TO_DSL[q.dtype], head_dim, features, config))
    out = torch.empty_like(q)
    if features.varlen:
        total_q, heads, _ = q.shape
        lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
        # the kernels see a packed batch as one (1, total, heads, head_dim) sequence
        q4, k4, v4, out4, lse3 = q[None], k[None], v[None], out[None], lse[None]
        cu_q, cu_k = args.cu_seqlens_q, args.cu_seqlens_k
    else:
        batch, seqlen_q, heads, _ = q.shape
        lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
        q4, k4, v4, out4, lse3 = q, k, v, out, lse
        cu_q = cu_k = _unused_cu_seqlens(q.device)
    fn(q4, k4, v4, out4, lse3, cu_q, cu_k, args.max_seqlen_q, args.softmax_scale,
       args.softcap, args.window[0], args.window[1])
    return out, lse


def _pack_for(seqlen_q: int, group: int, head_dim: int, features: AttnFeatures) -> int:
    tile_m = choose_fwd_config(head_dim, features.causal_like, features.mask == "local").tile_m
    return choose_pack_gqa(seqlen_q, group, tile_m, features.varlen)


_unused_cu_seqlens_per_device: dict = {}


def _unused_cu_seqlens(device):
    # dense kernels never read it; one per device avoids a per-call allocation
    t = _unused_cu_seqlens_per_device.get(device)
    if t is None:
        t = _unused_cu_seqlens_per_device[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return t


# ----------------------------------------------------------------------------------------
# Backward: preprocess (D, LSE2) -> main kernel (dK, dV, dQ_accum) -> postprocess (dQ)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BwdKey:
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    features: AttnFeatures
    config: BwdConfig
    deterministic: bool = False
    arch: str = ARCH


def _fake_bwd_args(key: BwdKey):
    """Symbolic stand-ins for the three backward kernels' arguments:
    (pre_args, main_args, post_args)."""
    import cutlass
    import cutlass.cute as cute

    dtype = _dsl_dtype(key.dtype)
    d = key.head_dim
    batch = cute.sym_int32(symbol="batch")
    heads, heads_kv = cute.sym_int32(symbol="heads"), cute.sym_int32(symbol="heads_kv")
    seqlen_q, seqlen_k = cute.sym_int32(symbol="seqlen_q"), cute.sym_int32(symbol="seqlen_k")
    # padded query rows (whole tiles: per batch entry, or per sequence when packed)
    rows_pad = cute.sym_int32(divisibility=key.config.tile_m, symbol="rows_pad")
    accum_len = cute.sym_int32(divisibility=key.config.tile_m * d, symbol="dq_accum_len")

    q, dq, o, do = (_fake_bshd(dtype, batch, seqlen_q, heads, d, n) for n in ("q", "dq", "o", "do"))
    k, v, dk, dv = (_fake_bshd(dtype, batch, seqlen_k, heads_kv, d, n) for n in ("k", "v", "dk", "dv"))
    lse = _fake_rowwise(batch, heads, seqlen_q, "lse")
    # 16-byte aligned chunks: the bulk copies of the main kernel need it
    lse2 = _fake_rowwise(batch, heads, rows_pad, "lse2", align=16, divisibility=4)
    dsum = _fake_rowwise(batch, heads, rows_pad, "dsum", align=16, divisibility=4)
    dq_accum = _fake_rowwise(batch, heads, accum_len, "dq_accum", align=16, divisibility=4)
    # its own symbols: a 1-element dummy is passed when not deterministic
    semaphore = cute.runtime.make_fake_tensor(
        cutlass.Int32,
        tuple(cute.sym_int32(symbol=f"sem_dim{i}") for i in range(3)),
        stride=(cute.sym_int64(symbol="sem_stride0"), cute.sym_int64(symbol="sem_stride1"), 1),
        assumed_align=4,
    )
    cu_q, cu_k = _fake_cu_seqlens("cu_seqlens_q"), _fake_cu_seqlens("cu_seqlens_k")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    max_seqlen = cutlass.Int32(0)
    scale, softcap, wl, wr = _fake_scalars()
    return (
        (o, do, lse, lse2, dsum, cu_q, max_seqlen, stream),
        (q, k, v, do, lse2, dsum, dq_accum, dk, dv, semaphore, cu_q, cu_k, max_seqlen,
         scale, softcap, wl, wr, stream),
        (dq_accum, dq, cu_q, max_seqlen, scale, stream),
    )


def compile_bwd(key: BwdKey, extra_options: str = ""):
    """Compile the three backward kernels of one specialisation; returns the TVM-FFI
    callables (preprocess, main, postprocess)."""
    import cutlass.cute as cute

    from cute_attn.kernels.bwd_prepost import BwdPostprocess, BwdPreprocess
    from cute_attn.kernels.bwd_sm90 import FlashBwdSm90

    if key.head_dim not in BWD_HEAD_DIMS:
        raise NotImplementedError(
            f"cute_attn's backward supports head dims {BWD_HEAD_DIMS}, got {key.head_dim}"
        )
    os.environ.setdefault("CUTE_DSL_ARCH", key.arch)
    dtype, cfg, varlen = _dsl_dtype(key.dtype), key.config, key.features.varlen
    options = ("--enable-tvm-ffi " + extra_options).strip()
    pre_args, main_args, post_args = _fake_bwd_args(key)
    pre = cute.compile(BwdPreprocess(dtype, key.head_dim, cfg.tile_m, varlen), *pre_args, options=options)
    main = cute.compile(
        FlashBwdSm90(dtype, key.head_dim, key.features, cfg, key.deterministic), *main_args, options=options
    )
    post = cute.compile(
        BwdPostprocess(dtype, key.head_dim, cfg.tile_m, cfg.dq_warpgroups, cfg.d_slice or key.head_dim, varlen),
        *post_args, options=options,
    )
    return pre, main, post


def get_bwd_kernels(key: BwdKey):
    return _cached(key, lambda k: tuple(_raw(f) for f in compile_bwd(k)))


def run_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float,
    features: Optional[AttnFeatures] = None,
    args: Optional[RunArgs] = None,
    deterministic: bool = False,
    config: Optional[BwdConfig] = None,
):
    """Gradients (dq, dk, dv) of the forward that produced (out, lse), each laid out like
    its input. dout must be TMA-addressable like q (validation.prepare_dout). features and
    args as for run_fwd."""
    if features is None:
        features = _DENSE_CAUSAL if causal else _DENSE
    if args is None:
        args = RunArgs(softmax_scale)
    head_dim = q.shape[-1]
    if config is None:
        config = bwd_config_for(head_dim, features)
    pre, main, post = get_bwd_kernels(
        BwdKey(_TORCH_TO_DSL[q.dtype], head_dim, features, config, bool(deterministic))
    )
    tile_m = config.tile_m
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if features.varlen:
        total_q, heads, _ = q.shape
        batch = args.cu_seqlens_q.shape[0] - 1
        # each sequence padded to whole query tiles (blocks/seqlen.py): room for all
        rows = (total_q + batch * tile_m + tile_m - 1) // tile_m * tile_m
        stats_batch = 1
        q, k, v, out, dout, dq, dk, dv = (t[None] for t in (q, k, v, out, dout, dq, dk, dv))
        lse = lse[None]
        cu_q, cu_k = args.cu_seqlens_q, args.cu_seqlens_k
    else:
        batch, seqlen_q, heads, _ = q.shape
        rows = (seqlen_q + tile_m - 1) // tile_m * tile_m
        stats_batch = batch
        cu_q = cu_k = _unused_cu_seqlens(q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    lse2 = torch.empty((stats_batch, heads, rows), **f32)
    dsum = torch.empty((stats_batch, heads, rows), **f32)
    # bulk reduce-adds accumulate into it, so it starts at zero
    dq_accum = torch.zeros((stats_batch, heads, rows * head_dim), **f32)
    if deterministic:
        # one turn counter per (batch, head, query block, head_dim slice)
        slices = head_dim // (config.d_slice or head_dim)
        semaphore = torch.zeros((stats_batch, heads, rows // tile_m * slices), dtype=torch.int32, device=q.device)
    else:
        semaphore = _unused_semaphore(q.device)
    pre(out, dout, lse, lse2, dsum, cu_q, args.max_seqlen_q)
    main(q, k, v, dout, lse2, dsum, dq_accum, dk, dv, semaphore, cu_q, cu_k, args.max_seqlen_k,
         args.softmax_scale, args.softcap, args.window[0], args.window[1])
    post(dq_accum, dq, cu_q, args.max_seqlen_q, args.softmax_scale)
    if features.varlen:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv


_unused_semaphores: dict = {}


def _unused_semaphore(device):
    # the non-deterministic kernel never reads it; one per device avoids a per-call memset
    t = _unused_semaphores.get(device)
    if t is None:
        t = _unused_semaphores[device] = torch.zeros((1, 1, 1), dtype=torch.int32, device=device)
    return t
