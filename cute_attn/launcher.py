"""Compiles kernel specialisations once, caches them, and launches them on torch tensors.

The compile key holds only static properties (dtype, head dim, causal, tile config, arch):
batch, sequence lengths, heads and every stride except the last are symbolic, so a new
shape never recompiles. Kernels are compiled through the DSL's TVM-FFI path: the compiled
function takes torch tensors directly and launches on torch's current CUDA stream, which
keeps the per-call host work to argument checking plus one launch (perf/NOTES.md has the
measured cost).

Compiling needs no GPU: set CUTE_DSL_ARCH=sm_90a (see `compile_fwd` and cute_attn.ptx).
"""

import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from cute_attn.config import FwdConfig, choose_fwd_config

ARCH = "sm_90a"
_TORCH_TO_DSL = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class FwdKey:
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    causal: bool
    config: FwdConfig
    arch: str = ARCH


def _dsl_dtype(name: str):
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[name]


def _fake_fwd_args(key: FwdKey):
    """Symbolic stand-ins for (q, k, v, out, lse, scale, stream) that fix only what the
    key fixes. Strides are 64-bit and declared multiples of 8 elements (16 bytes, as TMA
    requires; validation checks it before a call); pointers 16-byte aligned."""
    import cutlass
    import cutlass.cute as cute

    dtype = _dsl_dtype(key.dtype)
    batch, heads = cute.sym_int32(symbol="batch"), cute.sym_int32(symbol="heads")
    seqlen_q, seqlen_k = cute.sym_int32(symbol="seqlen_q"), cute.sym_int32(symbol="seqlen_k")

    def bshd(seqlen, name):
        strides = tuple(cute.sym_int64(divisibility=8, symbol=f"{name}_stride{i}") for i in range(3))
        return cute.runtime.make_fake_tensor(
            dtype, (batch, seqlen, heads, key.head_dim), stride=(*strides, 1), assumed_align=16
        )

    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32,
        (batch, heads, seqlen_q),
        stride=(cute.sym_int64(symbol="lse_stride0"), cute.sym_int64(symbol="lse_stride1"), 1),
        assumed_align=4,
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (
        bshd(seqlen_q, "q"), bshd(seqlen_k, "k"), bshd(seqlen_k, "v"), bshd(seqlen_q, "o"),
        lse, cutlass.Float32(1.0), stream,
    )


def compile_fwd(key: FwdKey, extra_options: str = ""):
    """Compile one forward specialisation; returns the TVM-FFI callable
    f(q, k, v, out, lse, softmax_scale)."""
    import cutlass.cute as cute

    from cute_attn.kernels.fwd_sm90 import FlashFwdSm90

    os.environ.setdefault("CUTE_DSL_ARCH", key.arch)
    kernel = FlashFwdSm90(_dsl_dtype(key.dtype), key.head_dim, key.causal, key.config)
    options = ("--enable-tvm-ffi " + extra_options).strip()
    return cute.compile(kernel, *_fake_fwd_args(key), options=options)


_cache: dict = {}
_cache_lock = threading.Lock()
# (torch dtype, head_dim, causal) -> kernel of the default config: the per-call lookup
# then hashes three plain values instead of building and hashing config dataclasses
_default_kernels: dict = {}


def get_fwd_kernel(key: FwdKey):
    fn = _cache.get(key)
    if fn is None:
        with _cache_lock:
            fn = _cache.get(key)
            if fn is None:
                compiled = compile_fwd(key)
                # call the tvm_ffi.Function underneath the DSL's keyword-argument wrapper
                raw = getattr(compiled, "__tvm_ffi_object__", None)
                fn = (raw() if raw is not None else None) or compiled
                _cache[key] = fn
    return fn


def run_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    config: Optional[FwdConfig] = None,
):
    """Launch the forward on validated inputs; returns (out, lse). out has q's dtype and
    dimension order (empty_like keeps a transposed view's strides); lse is float32
    (batch, heads, seqlen_q)."""
    batch, seqlen_q, heads, head_dim = q.shape
    if config is None:
        fn = _default_kernels.get((q.dtype, head_dim, causal))
        if fn is None:
            key = FwdKey(_TORCH_TO_DSL[q.dtype], head_dim, causal, choose_fwd_config(head_dim, causal))
            fn = _default_kernels.setdefault((q.dtype, head_dim, causal), get_fwd_kernel(key))
    else:
        fn = get_fwd_kernel(FwdKey(_TORCH_TO_DSL[q.dtype], head_dim, causal, config))
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    fn(q, k, v, out, lse, softmax_scale)
    return out, lse
