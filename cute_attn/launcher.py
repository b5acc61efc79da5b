"""Compiles kernel specialisations once, caches them, and launches them on torch tensors.

The compile key holds only static properties (dtype, head dim, features, tile config, arch):
batch, sequence lengths, heads and every stride except the last are symbolic, so a new
shape never recompiles. Kernels are compiled through the DSL's TVM-FFI path: the compiled
function takes torch tensors directly and launches on torch's current CUDA stream, which
keeps the per-call host work to argument checking plus one launch (perf/NOTES.md has the
measured cost).

Compiling needs no GPU: every compile names its target, sm_90a, to the DSL (`_compile`),
whatever CUTE_DSL_ARCH says and whenever cutlass was imported (see cute_attn.ptx).
"""

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from cute_attn import split_heuristic
from cute_attn import dropout
from cute_attn.bounded_cache import outside_private_pools, remember
from cute_attn.config import (
    CAPABILITIES,
    DTYPE_OF_INPUT,
    DTYPES,
    MAX_CLUSTER_SPLITS,
    AttnFeatures,
    BwdConfig,
    FwdConfig,
    RunArgs,
    bwd_config_for,
    cluster_merge_rows_fit,
    cluster_splits_fit,
    fp8_fwd_config_for,
    fp8_with_persistent_grid,
    fwd_config_for,
    long_unmasked_tiles,
    pack_gqa_for,
    split_config,
    split_decode_config,
    unsplit_decode_config,
    with_persistent_grid,
)

ARCH = "sm_90a"


@dataclass(frozen=True)
class FwdKey:
    dtype: str  # a config.DTYPES name
    head_dim: int
    features: AttnFeatures
    config: FwdConfig
    arch: str = ARCH


# ----------------------------------------------------------------------------------------
# Symbolic stand-ins for compiling without tensors (and without a GPU)
# ----------------------------------------------------------------------------------------


class _Symbols:
    """The dynamic sizes every kernel shares, as DSL symbols."""

    def __init__(self):
        import cutlass.cute as cute

        self.batch = cute.sym_int32(symbol="batch")
        self.heads, self.heads_kv = cute.sym_int32(symbol="heads"), cute.sym_int32(symbol="heads_kv")
        self.seqlen_q, self.seqlen_k = cute.sym_int32(symbol="seqlen_q"), cute.sym_int32(symbol="seqlen_k")


def _fake_bshd(dtype_name: str, batch, seqlen, heads, head_dim: int, name: str, which: str = "input",
               seqlen_contiguous: bool = False):
    """(batch, seqlen, heads, head_dim) of the policy's `which` dtype with head_dim
    contiguous (or seqlen: FP8's transposed V); the other strides are 64-bit and declared
    multiples of 16 bytes, as TMA requires (validation checks it before a call); the
    pointer 16-byte aligned."""
    import cutlass.cute as cute

    policy = DTYPES[dtype_name]
    align_elems = policy.align_bytes // getattr(policy, which).itemsize
    strides = [cute.sym_int64(divisibility=align_elems, symbol=f"{name}_stride{i}") for i in range(3)]
    strides = (strides[0], 1, strides[1], strides[2]) if seqlen_contiguous else (*strides, 1)
    return cute.runtime.make_fake_tensor(
        policy.dsl(which), (batch, seqlen, heads, head_dim), stride=strides, assumed_align=policy.align_bytes,
    )


def _fake_rowwise(batch, heads, n, name, align=4, divisibility=1, dtype=None):
    """(batch, heads, n) float32 (or dtype) with the last dim contiguous."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(
        dtype or cutlass.Float32, (batch, heads, n),
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


def _fake_run_args():
    """(max_seqlen, softmax_scale, softcap, window_left, window_right) stand-ins."""
    import cutlass

    return cutlass.Int32(0), cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0)


def _fake_stream():
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def _fake_fwd_args(key: FwdKey):
    """Symbolic stand-ins for the forward's arguments that fix only what the key fixes
    (see _fake_bshd for the strides and alignment). Varlen calls pass (1, total, ...)
    views of the packed tensors, so batch, seqlen and heads stay symbols either way.
    Split-KV adds the fp32 partials, (num_splits * batch, ...) with a batch symbol of
    their own, the per-tile counters, and num_splits."""
    import cutlass
    import cutlass.cute as cute

    n, d = _Symbols(), key.head_dim
    if DTYPES[key.dtype].input.itemsize == 1:
        return _fake_fp8_fwd_args(key, n)
    if key.features.mod_kernel:
        return _fake_mod_fwd_args(key, n)
    q, k, v, o, lse = _fake_qkvo_lse(key, n)
    page_table = cute.runtime.make_fake_tensor(
        cutlass.Int32, (cute.sym_int32(symbol="pt_batch"), cute.sym_int32(symbol="max_pages")),
        stride=(cute.sym_int64(symbol="pt_stride0"), 1), assumed_align=4,
    )
    head = (q, k, v, o, lse, _fake_cu_seqlens("cu_seqlens_q"), _fake_cu_seqlens("cu_seqlens_k"), page_table)
    if not key.config.split_kv:
        return (*head, *_fake_run_args(), _fake_stream())
    o_part, lse_part = _fake_partials(n, d)
    return (*head, o_part, lse_part, _fake_cu_seqlens("tile_counters"), *_fake_run_args(), cutlass.Int32(1),
            _fake_stream())


def _fake_qkvo_lse(key: FwdKey, n: "_Symbols"):
    """The 16-bit forward's q, k, v, out and lse stand-ins (a paged cache's batch mode
    counts pages, not the queries' entries)."""
    import cutlass.cute as cute

    d = key.head_dim
    q = _fake_bshd(key.dtype, n.batch, n.seqlen_q, n.heads, d, "q")
    kv_batch = cute.sym_int32(symbol="num_pages") if key.config.page_size else n.batch
    k, v = (_fake_bshd(key.dtype, kv_batch, n.seqlen_k, n.heads_kv, d, name) for name in ("k", "v"))
    o = _fake_bshd(key.dtype, n.batch, n.seqlen_q, n.heads, d, "o")
    return q, k, v, o, _fake_rowwise(n.batch, n.heads, n.seqlen_q, "lse")


def _fake_fp8_fwd_args(key: FwdKey, n: "_Symbols"):
    """FlashFwdSm90Fp8's arguments: e4m3 q, k and transposed V (seqlen contiguous), a
    16-bit out, three (batch, heads_kv) float32 descales."""
    import cutlass
    import cutlass.cute as cute

    d = key.head_dim
    q = _fake_bshd(key.dtype, n.batch, n.seqlen_q, n.heads, d, "q")
    k = _fake_bshd(key.dtype, n.batch, n.seqlen_k, n.heads_kv, d, "k")
    # varlen: V^T is dense per sequence (kernels/v_transpose.py), its own batch and length
    v_t = _fake_bshd(key.dtype, cute.sym_int32(symbol="v_batch"), cute.sym_int32(symbol="v_seqlen"), n.heads_kv, d,
                     "v", seqlen_contiguous=True)
    o = _fake_bshd(key.dtype, n.batch, n.seqlen_q, n.heads, d, "o", which="output")
    lse = _fake_rowwise(n.batch, n.heads, n.seqlen_q, "lse")
    # their batch is the sequences' count: a varlen call's q has batch 1
    descale_batch = cute.sym_int32(symbol="descale_batch")
    descales = tuple(
        cute.runtime.make_fake_tensor(
            cutlass.Float32, (descale_batch, n.heads_kv),
            stride=(cute.sym_int64(symbol=f"{name}_descale_stride0"), cute.sym_int64(symbol=f"{name}_descale_stride1")),
            assumed_align=4,
        )
        for name in ("q", "k", "v")
    )
    return (q, k, v_t, o, lse, _fake_cu_seqlens("cu_seqlens_q"), _fake_cu_seqlens("cu_seqlens_k"), *descales,
            _fake_sink(), *_fake_run_args(), _fake_stream())


def _fake_sink():
    """The sink logits' stand-in: a float32 vector (heads, or one unread element)."""
    import cutlass
    import cutlass.cute as cute

    return cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(symbol="sink_len"),),
                                                 assumed_align=4)


def _fake_any_strides(dtype, shape, name, align=4):
    import cutlass.cute as cute

    strides = tuple(cute.sym_int64(symbol=f"{name}_stride{i}") for i in range(len(shape)))
    return cute.runtime.make_fake_tensor(dtype, shape, stride=strides, assumed_align=align)


def _fake_block_mask_and_aux(features: AttnFeatures, n: "_Symbols", transposed: bool = False):
    """The mod kernels' extra arguments: a block mask's four int32 lists (any strides: a
    mask that ignores the batch or head is expanded with stride 0; (batch, heads, outer
    tiles[, inner tiles]), forward or transposed alike), the backward's (transposed)
    fifth, its dQ turns (batch, heads, outer, inner), and the mods' aux tensors (the
    dtype and rank each mod was keyed with; one int32 stand-in when there are none)."""
    import cutlass
    import cutlass.cute as cute

    outer, inner = cute.sym_int32(symbol="tiles_outer"), cute.sym_int32(symbol="tiles_inner")
    # a packed varlen batch's lists have a row per sequence, while its q has batch 1
    batch = cute.sym_int32(symbol="sequences") if features.varlen else n.batch
    lists = (_fake_any_strides(cutlass.Int32, (batch, n.heads, outer), "partial_count"),
             _fake_any_strides(cutlass.Int32, (batch, n.heads, outer, inner), "partial_idx"),
             _fake_any_strides(cutlass.Int32, (batch, n.heads, outer), "full_count"),
             _fake_any_strides(cutlass.Int32, (batch, n.heads, outer, inner), "full_idx"))
    if transposed:
        lists += (_fake_any_strides(cutlass.Int32, (batch, n.heads, outer, inner), "dq_turn"),)
    signature = [sig for mod in (features.mask_mod, features.score_mod) if mod is not None
                 for sig in mod.aux_signature] or [(torch.int32, 1)]
    aux = tuple(
        _fake_any_strides(getattr(cutlass, _dsl_type_name(dtype)),
                          tuple(cute.sym_int32(symbol=f"aux{i}_dim{j}") for j in range(ndim)), f"aux{i}", dtype.itemsize)
        for i, (dtype, ndim) in enumerate(signature)
    )
    return lists, aux


def _fake_mod_fwd_args(key: FwdKey, n: "_Symbols"):
    """FlashFwdSm90Mods's arguments: the dense forward's tensors, then the block mask and
    the aux tensors (_fake_block_mask_and_aux), the sink logits (a float32 vector), the
    run-time scalars."""
    import cutlass
    import cutlass.cute as cute

    q, k, v, o, lse = _fake_qkvo_lse(key, n)
    lists, aux = _fake_block_mask_and_aux(key.features, n)
    max_seqlen, scale, softcap, wl, wr = _fake_run_args()
    return (q, k, v, o, lse, _fake_cu_seqlens("cu_seqlens_q"), _fake_cu_seqlens("cu_seqlens_k"), *lists, aux,
            _fake_sink(), *_fake_dropout_args(), max_seqlen, scale, softcap, wl, wr, _fake_stream())


def _fake_dropout_args():
    """The mods' entry points' dropout: Philox key (int32 (2,)), threshold, 1 / (1 - p)."""
    import cutlass
    import cutlass.cute as cute

    seed = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (2,), assumed_align=4)
    return seed, cutlass.Int32(0), cutlass.Float32(1.0)


def _dropout_arguments(device, args: RunArgs):
    """(seed, threshold, inv_keep) of a call for the mods' entry points (stand-ins when
    it has no dropout)."""
    if args.dropout_seed is None:
        return _unused_cu_seqlens(device), 0, 1.0
    return args.dropout_seed, dropout.threshold(args.dropout_p), dropout.keep_scale(args.dropout_p)


_AUX_DSL_TYPES = {torch.int32: "Int32", torch.int64: "Int64", torch.int16: "Int16", torch.int8: "Int8",
                  torch.uint8: "Uint8", torch.bool: "Boolean", torch.float32: "Float32", torch.float16: "Float16",
                  torch.bfloat16: "BFloat16"}


def _dsl_type_name(dtype) -> str:
    if dtype not in _AUX_DSL_TYPES:
        raise TypeError(f"aux tensors of dtype {dtype} are not supported (use one of {list(_AUX_DSL_TYPES)})")
    return _AUX_DSL_TYPES[dtype]


def _compile(kernel, fake_args, extra_options: str, key):
    """cute.compile for the key's arch, named explicitly (--gpu-arch): the DSL reads
    CUTE_DSL_ARCH once, when cutlass is first imported, and without it detects the GPU
    (sm_100a on a machine without one), so setting the variable later does nothing. The
    option wins over both; on an sm_90 GPU it names what detection finds there anyway.

    Logs one INFO line on the "cute_attn" logger per compiled kernel: its class, the
    key it was compiled for and the seconds the compile took."""
    import cutlass.cute as cute

    options = f"--enable-tvm-ffi --gpu-arch {key.arch} {extra_options}".strip()
    start = time.perf_counter()
    compiled = cute.compile(kernel, *fake_args, options=options)
    seconds = time.perf_counter() - start
    logging.getLogger("cute_attn").info("compiled %s for %r in %.2f s", type(kernel).__name__, key, seconds)
    return compiled


def compile_fwd(key: FwdKey, extra_options: str = ""):
    """Compile one forward specialisation; returns the TVM-FFI callable
    f(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, page_table, max_seqlen_q,
    softmax_scale, softcap, window_left, window_right) (page_table is read only by a
    paged specialisation). Split-KV: f(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
    page_table, o_part, lse_part, tile_counters, max_seqlen_q, softmax_scale, softcap,
    window_left, window_right, num_splits)."""
    from cute_attn.kernels.fwd_sm90 import FlashFwdSm90, FlashFwdSm90Fp8, FlashFwdSm90Mods, FlashFwdSm90SplitKV

    fp8 = DTYPES[key.dtype].input.itemsize == 1
    _check_capability("fwd_fp8" if fp8 else "fwd", key)
    if fp8:
        cls = FlashFwdSm90Fp8
    elif key.features.mod_kernel:
        cls = FlashFwdSm90Mods
    else:
        cls = FlashFwdSm90SplitKV if key.config.split_kv else FlashFwdSm90
    kernel = cls(DTYPES[key.dtype], key.head_dim, key.features, key.config)
    return _compile(kernel, _fake_fwd_args(key), extra_options, key)


def _check_capability(family: str, key):
    cap = CAPABILITIES[family]
    if key.head_dim not in cap.head_dims or key.dtype not in cap.dtypes:
        raise NotImplementedError(
            f"cute_attn's {family} kernel supports head dims {cap.head_dims} and dtypes "
            f"{cap.dtypes}, got head dim {key.head_dim}, dtype {key.dtype}"
        )


_cache: dict = {}
_cache_lock = threading.Lock()
# (torch dtype, head_dim, features, pack_gqa, page_size, device, long unmasked tiles) -> the
# default config: a new call shape's plan then hashes plain values instead of running the
# heuristics
_default_configs: dict = {}


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


def _from_disk_or_compiled(compile_fn, direct_fn):
    """compile_fn's result through the on-disk cache (compile_cache): loaded when a
    previous process exported it, else compiled, exported and loaded back."""
    from cute_attn import compile_cache

    return lambda key: compile_cache.load_or_compile(
        key, compile_fn, compile_cache.dsl_export, compile_cache.dsl_load, direct_fn
    )


def get_fwd_kernel(key: FwdKey):
    return _cached(key, _from_disk_or_compiled(compile_fwd, _raw))


def _default_fwd_config(q, k, features: AttnFeatures, page_size: int = 0) -> FwdConfig:
    """The default config for this call (this GPU's tuned one where `python -m cute_attn
    tune` measured a better one, see cute_attn.tuning); page_size: a paged KV cache's (k
    is then (num_pages, page_size, heads_kv, head_dim)), else 0."""
    head_dim = q.shape[-1]
    # packed GQA (FwdConfig.pack_gqa) for short query sequences; the group size is static
    group = q.shape[-2] // k.shape[-2]
    pack = 1 if group == 1 else pack_gqa_for(head_dim, features, q.shape[1], group)
    # a dense batch's key length (a packed batch's k has no batch mode, a cache's rows are
    # its capacity): config.with_persistent_grid keeps long unmasked tiles one per CTA
    seqlen_k = None if features.varlen or features.kv_lengths or page_size else k.shape[1]
    long_tiles = long_unmasked_tiles(head_dim, features, seqlen_k)
    # per device: a host may mix GPU models, and each may have its own tuned table
    cache_key = (q.dtype, head_dim, features, pack, page_size, q.device.index, long_tiles)
    config = _default_configs.get(cache_key)
    if config is None:
        from cute_attn.tuning import default_fwd_config

        config = default_fwd_config(DTYPE_OF_INPUT[q.dtype].name, head_dim, features, q.device.index, pack, page_size,
                                    seqlen_k)
        config = _default_configs.setdefault(cache_key, config)
    return config



def _batched(features: AttnFeatures, *tensors):
    """The kernels see a packed (varlen) batch as one (1, total, heads, ...) sequence."""
    return tuple(t[None] for t in tensors) if features.varlen else tensors


def _cu_seqlens(features: AttnFeatures, args: RunArgs, device):
    if features.varlen:
        return args.cu_seqlens_q, args.cu_seqlens_k
    t = _unused_cu_seqlens(device)
    return t, t


def run_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    features: AttnFeatures,
    args: RunArgs,
    config: Optional[FwdConfig] = None,
    need_lse: bool = True,
    num_splits: Optional[int] = None,
):
    """Launch the forward on validated inputs; returns (out, lse). out has q's dtype and
    dimension order (empty_like keeps a transposed view's strides); lse is float32
    (batch, heads, seqlen_q), or (heads, total_q) for varlen. config=None takes the
    default (config.fwd_config_for). need_lse=False: the caller discards lse (an
    inference call without return_lse), so the kernel writes it into a shared sink
    instead of a fresh tensor (_lse_sink), and None is returned in its place.

    num_splits: split-KV CTAs per query tile (1: none); None picks by choose_splits, which
    splits only grids too small for the GPU. With more than one, the split forward writes
    fp32 partials and each tile's last split merges them into out, lse (one launch)."""
    plan = _plan(q, k, features, args, config, num_splits)
    if plan.num_splits > 1:
        return _run_fwd_split(q, k, v, features, args, plan, need_lse)
    out, lse = _outputs(q, features, need_lse)
    q4, k4, v4, cu_q, cu_k = _kernel_inputs(q, k, v, features, args)
    if plan.tile_queue:
        cu_q = _tile_queue(q.device)
    out4, lse3 = (out[None], lse[None]) if features.varlen else (out, lse)
    window_left, window_right = args.window
    plan.fn(q4, k4, v4, out4, lse3, cu_q, cu_k, _page_table(args, q.device), args.max_seqlen_q,
            args.softmax_scale, args.softcap, window_left, window_right)
    return out, (lse if need_lse else None)


class FwdLaunch:
    """run_fwd bound to one call signature (shapes, strides, dtype, device, features,
    run-time scalars) for a dense batch, a KV cache's included: the plan, the placeholders,
    the LSE sink and the split workspace's shape looked up once, so a repeated call is the
    output allocation, the workspace views of its stream (split-KV) and the kernel call
    (api._PlainCall and kvcache's decode fast path key these; perf/NOTES.md, host path).
    kv_lengths and page_table are the call's own: a KV cache's lengths and pages."""

    __slots__ = ("fn", "device", "lse_shape", "sink", "placeholder", "page_table", "scalars", "workspace",
                 "num_splits", "tile_queue", "partials")

    def __call__(self, q, k, v, need_lse: bool, kv_lengths=None, page_table=None):
        out = torch.empty_like(q)
        if need_lse:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        else:
            lse = self.sink
            if lse is None:  # the first call that discards lse: the shared sink (_lse_sink)
                lse = _lse_sink(self.device, self.lse_shape)
                # kept where _lse_sink kept it: not a capture's (the graph's pool) nor another
                # private pool's (outside_private_pools)
                self.sink = _lse_sink_views.get((self.device, self.lse_shape))
        unused = self.placeholder
        cu_k = unused if kv_lengths is None else kv_lengths
        pages = self.page_table if page_table is None else page_table
        if self.num_splits == 1:
            cu_q = _tile_queue(self.device) if self.tile_queue else unused
            self.fn(q, k, v, out, lse, cu_q, cu_k, pages, *self.scalars)
        else:
            # a cluster merge reads no workspace (_unused_partials); else this stream's
            o_part, lse_part, counters = self.partials or _split_workspace(self.device, *self.workspace)
            self.fn(q, k, v, out, lse, unused, cu_k, pages, o_part, lse_part, counters, *self.scalars,
                    self.num_splits)
        return out, (lse if need_lse else None)


def bind_fwd(q, k, features: AttnFeatures, args: RunArgs, num_splits: Optional[int] = None) -> Optional[FwdLaunch]:
    """A FwdLaunch for validated inputs of this signature, or None where run_fwd does
    more than allocate and launch once (varlen views, an output dtype other than q's) or
    while a CUDA graph captures or torch.compile's graph trees warm up in a private pool
    (the sink, placeholders and partials would come from that pool, not buffers to keep).
    num_splits as run_fwd's."""
    if features.varlen or DTYPE_OF_INPUT[q.dtype].output is not q.dtype or torch.cuda.is_current_stream_capturing():
        return None
    plan = _plan(q, k, features, args, None, num_splits)
    launch = FwdLaunch()
    launch.fn = plan.fn
    launch.device = q.device
    launch.lse_shape = _lse_shape(q, features)
    launch.sink = None  # fetched by the first call that discards lse: training calls never grow it
    launch.placeholder = _unused_cu_seqlens(q.device)
    launch.page_table = _unused_page_table(q.device)
    if _placeholders.get((q.device, (2,))) is not launch.placeholder \
            or _placeholders.get((q.device, (1, 1))) is not launch.page_table:
        return None  # made in a private pool (a graph tree's warm-up): this call's own, not bound
    launch.scalars = (args.max_seqlen_q, args.softmax_scale, args.softcap) + tuple(args.window)
    launch.num_splits = plan.num_splits
    launch.tile_queue = plan.tile_queue
    launch.workspace = None
    launch.partials = None
    if plan.num_splits > 1:
        batch, seqlen_q, heads, head_dim = q.shape
        launch.workspace = (plan.num_splits * batch, seqlen_q, heads, head_dim, plan.tiles)
        if plan.cluster_merge:
            launch.partials = _unused_partials(q.device, seqlen_q, heads, head_dim)
            if _unused_partial_buffers.get((q.device, seqlen_q, heads, head_dim)) is not launch.partials:
                return None  # a private pool's (a graph tree's warm-up): not a buffer to bind
    return launch


# ----------------------------------------------------------------------------------------
# FP8 (e4m3) forward (kernels/fwd_sm90.FlashFwdSm90Fp8)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransposeKey:
    head_dim: int
    varlen: bool
    arch: str = ARCH


def compile_transpose(key: TransposeKey, extra_options: str = ""):
    """Compile the FP8 V transpose (kernels/v_transpose.py); returns f(v, v_t, cu_seqlens_k)
    on uint8 views: v (batch, seqlen, heads, head_dim) (varlen: (1, total, ...)), v_t
    (batch, heads, head_dim, seqlen_padded); cu_seqlens_k is read by varlen only."""
    import cutlass
    import cutlass.cute as cute

    from cute_attn.kernels.v_transpose import TransposeV

    n, d = _Symbols(), key.head_dim

    def strides(name):
        return tuple(cute.sym_int64(divisibility=16, symbol=f"{name}_stride{i}") for i in range(3)) + (1,)

    # varlen: v is one packed sequence, v_t has the sequences' batch
    v = cute.runtime.make_fake_tensor(cutlass.Uint8, (cute.sym_int32(symbol="v_batch"), n.seqlen_k, n.heads_kv, d),
                                      stride=strides("v"),
                                      assumed_align=16)
    v_t = cute.runtime.make_fake_tensor(cutlass.Uint8, (n.batch, n.heads_kv, d, cute.sym_int32(symbol="padded")),
                                        stride=strides("v_t"), assumed_align=16)
    return _compile(TransposeV(d, key.varlen), (v, v_t, _fake_cu_seqlens("cu_seqlens_k"), _fake_stream()),
                    extra_options, key)


def transpose_v_fp8(v: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_k: int = 0):
    """V as the FP8 kernel reads it, by kernels/v_transpose.py: FP8 WGMMA takes only
    K-major operands and the K of P V is the key, so V must be key-contiguous in shared
    memory; one read and one write of V (1 byte per element), against the forward's two
    GEMMs over it per query tile.

    Dense V (batch, seqlen, heads, head_dim): returns (batch, seqlen_padded, heads,
    head_dim) with the key the contiguous dim (a fresh (batch, heads, head_dim,
    seqlen_padded) buffer seen through a permuted view). Packed varlen V (total, heads,
    head_dim) with its cu_seqlens_k: returns a dense (batch, max_seqlen_k_padded, heads,
    head_dim) view of that kind, sequence b's keys at entry b (the kernel module says why).
    seqlen_padded: seqlen rounded up to 16 keys (TMA: 16-byte strides).

    Each aligned group of 16 key columns holds its keys in blocks/fp8_operand.
    V_PERMUTATION's order (the order of P's registers in the forward), so the view runs to
    the padded length: a group's last keys may sit in columns past seqlen (and zeros, the
    keys past seqlen, in columns before it), and the forward's tensor map must reach them."""
    head_dim, heads = v.shape[-1], v.shape[-2]
    varlen = cu_seqlens_k is not None
    seqlen = max_seqlen_k if varlen else v.shape[1]
    batch = cu_seqlens_k.shape[0] - 1 if varlen else v.shape[0]
    padded = -(-seqlen // 16) * 16
    buf = torch.empty((batch, heads, head_dim, padded), dtype=torch.uint8, device=v.device)
    fn = _cached(TransposeKey(head_dim, varlen), _from_disk_or_compiled(compile_transpose, _raw))
    fn((v[None] if varlen else v).view(torch.uint8), buf,
       cu_seqlens_k if varlen else _unused_cu_seqlens(v.device))
    return buf.view(v.dtype)[..., :padded].movedim(-1, -3)


def run_fwd_fp8(q, k, v, descales, policy, features: AttnFeatures, args: RunArgs, need_lse: bool = True,
                sink=None):
    """The FP8 forward on validated inputs: q, k, v e4m3 (dense, or packed varlen),
    descales (q, k, v) each None (1) or float32 (batch, heads_kv), sink float32 (heads,)
    logits when features.sink; returns (out, lse), out in policy.output with q's
    dimension order, lse as run_fwd's."""
    from cute_attn.tuning import gpu_sm_count

    head_dim = q.shape[-1]
    group = q.shape[-2] // k.shape[-2]
    pack = 1 if group == 1 else pack_gqa_for(head_dim, features, q.shape[1], group)
    config = fp8_with_persistent_grid(fp8_fwd_config_for(head_dim, features, pack), head_dim, features,
                                      gpu_sm_count(q.device.index))
    key = FwdKey(policy.name, head_dim, features, config)
    fn = get_fwd_kernel(key)
    out = torch.empty_like(q, dtype=policy.output)
    shape = _lse_shape(q, features)
    lse = torch.empty(shape, dtype=torch.float32, device=q.device) if need_lse else _lse_sink(q.device, shape)
    batch = args.cu_seqlens_q.shape[0] - 1 if features.varlen else q.shape[0]
    ones = None
    scales = []
    for ds in descales:
        if ds is None:
            if ones is None:
                ones = torch.ones((batch, k.shape[-2]), dtype=torch.float32, device=q.device)
            ds = ones
        scales.append(ds)
    q4, k4, _, cu_q, cu_k = _kernel_inputs(q, k, v, features, args)
    cu_q = _tile_queue_or(cu_q, q, features, args, config)
    if features.varlen:
        vt4 = transpose_v_fp8(v, args.cu_seqlens_k, args.max_seqlen_k)
    else:
        vt4 = transpose_v_fp8(v)
    out4, lse3 = (out[None], lse[None]) if features.varlen else (out, lse)
    if sink is None:
        sink = _placeholder(q.device, (1,)).view(torch.float32)
    window_left, window_right = args.window
    fn(q4, k4, vt4, out4, lse3, cu_q, cu_k, *scales, sink, args.max_seqlen_q, args.softmax_scale, args.softcap,
       window_left, window_right)
    return out, (lse if need_lse else None)


# ----------------------------------------------------------------------------------------
# Mask and score mods (kernels/fwd_sm90.FlashFwdSm90Mods)
# ----------------------------------------------------------------------------------------


def run_fwd_mods(q, k, v, features: AttnFeatures, args: RunArgs, mask_mod, score_mod, block_mask=None,
                 need_lse: bool = True, sink=None):
    """The forward with mods on validated inputs: mask_mod, score_mod masks.Modifier or
    None (their specs are features'), block_mask a block_mask.BlockMask for mask_mod at
    this shape (None: built once per (mask, shape) and cached), sink float32 (heads,)
    logits when features.sink (args then may carry a mask kind's window and a softcap).
    Packed varlen inputs (features.varlen): block_mask per sequence (block_mask.
    create_varlen_block_mask). Returns (out, lse)."""
    from cute_attn.tuning import gpu_sm_count

    head_dim = q.shape[-1]
    # the mods' tiles (the block mask's), or a sink's dense ones; a persistent grid where
    # it measured faster (config.with_persistent_grid)
    config = with_persistent_grid(fwd_config_for(head_dim, features), head_dim, features, gpu_sm_count(q.device.index))
    fn = get_fwd_kernel(FwdKey(DTYPE_OF_INPUT[q.dtype].name, head_dim, features, config))
    out, lse = _outputs(q, features, need_lse)
    q4, k4, v4, cu_q, cu_k = _kernel_inputs(q, k, v, features, args)
    out4, lse3 = (out[None], lse[None]) if features.varlen else (out, lse)
    lists, aux = _mod_arguments(q4, k4, config.tile_m, config.tile_n, mask_mod, score_mod, block_mask,
                                varlen=args if features.varlen else None)
    if sink is None:
        sink = _placeholder(q.device, (1,)).view(torch.float32)
    cu_q = _tile_queue_or(cu_q, q, features, args, config)
    fn(q4, k4, v4, out4, lse3, cu_q, cu_k, *lists, aux, sink, *_dropout_arguments(q.device, args),
       args.max_seqlen_q, args.softmax_scale, args.softcap, args.window[0], args.window[1])
    return out, (lse if need_lse else None)


def _mod_arguments(q, k, tile_m, tile_n, mask_mod, score_mod, block_mask=None, transposed=False, varlen=None):
    """The mod kernels' block-mask lists (block_mask checked, or built and cached at these
    tiles; transposed for the backward, with its dQ turns as a fifth) and aux tensors
    (the mask mod's first). varlen: the RunArgs of a packed batch (q, k as the kernels
    take it, (1, total, ...)): the lists are then per sequence."""
    from cute_attn import block_mask as bm

    batch, seqlen_q, heads = q.shape[:3]
    seqlen_k = k.shape[1]
    if varlen is not None:
        batch = varlen.cu_seqlens_q.shape[0] - 1
    if mask_mod is not None:
        if varlen is not None:
            cu_q, cu_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
            if block_mask is None:
                block_mask = bm.cached_varlen_block_mask(mask_mod, cu_q, cu_k, heads, tile_m, tile_n, transposed)
            else:
                bm.check_varlen_block_mask(block_mask, mask_mod, cu_q, cu_k, heads, tile_m, tile_n)
        elif block_mask is None:
            block_mask = bm.cached_block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n, q.device,
                                              transposed)
        else:
            bm.check_block_mask(block_mask, mask_mod, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n)
            if block_mask.partial_count.device != q.device:
                raise ValueError(f"block_mask is on {block_mask.partial_count.device}, q on {q.device}: build it "
                                 "on q's device (create_block_mask(..., device=...))")
        lists = block_mask.kernel_tensors() + ((block_mask.dq_turns(),) if transposed else ())
    else:  # a score mod alone visits every tile: the lists are never read
        unused = _placeholder(q.device, (1, 1, 1, 1))
        lists = (unused[..., 0].expand(batch, heads, 1), unused.expand(batch, heads, 1, 1)) * 2
        if transposed:
            lists += (unused.expand(batch, heads, 1, 1),)
    aux = tuple(t for mod in (mask_mod, score_mod) if mod is not None for t in mod.aux)
    return lists, aux or (_unused_cu_seqlens(q.device),)


class _Plan(NamedTuple):
    """What a forward call of one shape launches."""

    fn: object  # the compiled forward: split-KV's when num_splits > 1
    num_splits: int
    tiles: int  # split-KV: work tiles, one counter each (else 0)
    tile_queue: bool = False  # a persistent grid's tile queue: its counter in the cu_seqlens_q slot
    cluster_merge: bool = False  # split-KV: the splits merge in a cluster (FwdConfig.cluster_splits), no workspace


# (q shape, k shape, dtype, device, features, config, num_splits asked, page-table width,
# varlen maxima and batch) -> _Plan: a repeated call (a decode step, a training step)
# skips the config, GQA-packing and split heuristics (5-15 us of host time per call,
# perf/NOTES.md session 8) for a tuple hash and a dict lookup
_plans: dict = {}


def _plan(q, k, features: AttnFeatures, args: RunArgs, config: Optional[FwdConfig],
          num_splits: Optional[int]) -> _Plan:
    page_table = args.page_table
    key = (q.shape, k.shape, q.dtype, q.device, features, config, num_splits,
           None if page_table is None else page_table.shape[1],
           (args.max_seqlen_q, args.max_seqlen_k, args.cu_seqlens_q.shape[0]) if features.varlen else None)
    plan = _plans.get(key)
    if plan is None:
        plan = remember(_plans, key, _make_plan(q, k, features, args, config, num_splits))
    return plan


def _make_plan(q, k, features: AttnFeatures, args: RunArgs, config: Optional[FwdConfig],
               num_splits: Optional[int]) -> _Plan:
    defaulted = config is None
    if defaulted:
        config = _default_fwd_config(q, k, features, 0 if args.page_table is None else k.shape[1])
    if num_splits is None:
        num_splits = choose_splits(q, k, features, args, config)
    if num_splits > 1:
        cluster = _cluster_merge(q, k, features, args, config, num_splits)
        if defaulted and q.dtype in (torch.bfloat16, torch.float16):
            # a short packed tile: 64 rows and deeper rings (config.split_decode_config)
            tile = split_decode_config(config, q.shape[-1], _packed_rows(q, features, args, config), cluster)
            if tile is not config:
                config, cluster = tile, _cluster_merge(q, k, features, args, tile, num_splits)
        return _Plan(_split_kernel(q, features, config, cluster), num_splits, _work_tiles(q, features, args, config),
                     cluster_merge=cluster)
    if defaulted and q.dtype in (torch.bfloat16, torch.float16):
        # a short packed tile that runs unsplit: 64 rows (config.unsplit_decode_config)
        config = unsplit_decode_config(config, q.shape[-1], q.shape[1] * config.pack_gqa)
    fn = get_fwd_kernel(FwdKey(DTYPE_OF_INPUT[q.dtype].name, q.shape[-1], features, config))
    return _Plan(fn, 1, 0, uses_tile_queue(config, _work_tiles(q, features, args, config)))


def _tile_queue_or(cu_seqlens_q, q, features: AttnFeatures, args: RunArgs, config: FwdConfig):
    """What a dense forward passes in its cu_seqlens_q slot: the tile queue's counter where
    the launch reads it (uses_tile_queue), else cu_seqlens_q (a placeholder)."""
    if config.tile_queue and uses_tile_queue(config, _work_tiles(q, features, args, config)):
        return _tile_queue(q.device)
    return cu_seqlens_q


def uses_tile_queue(config: FwdConfig, tiles: int) -> bool:
    """Whether a launch of config over `tiles` work tiles reads its tile-queue counter:
    not when the persistent grid has a CTA per tile (TileScheduler.take_ticket), so a
    small call skips the per-stream counter's lookup and passes the placeholder."""
    return config.tile_queue and tiles > config.persistent_ctas


def _outputs(q, features: AttnFeatures, need_lse: bool):
    """(out, lse) for a forward: out like q (its stride order, the policy's output
    dtype); lse float32, fresh, or the shared sink when the caller discards it."""
    output = DTYPE_OF_INPUT[q.dtype].output
    # empty_like without a dtype argument when it is q's: the cheaper call (~0.5 us)
    out = torch.empty_like(q) if output is q.dtype else torch.empty_like(q, dtype=output)
    shape = _lse_shape(q, features)
    lse = torch.empty(shape, dtype=torch.float32, device=q.device) if need_lse else _lse_sink(q.device, shape)
    return out, lse


def _kernel_inputs(q, k, v, features: AttnFeatures, args: RunArgs):
    """(q, k, v, cu_seqlens_q, the cu_seqlens_k slot) as the forward kernels take them:
    a packed batch as one (1, total, ...) sequence with its offsets; a dense one with
    placeholders, or a KV cache's key counts in the second slot."""
    if features.varlen:
        return q[None], k[None], v[None], args.cu_seqlens_q, args.cu_seqlens_k
    unused = _unused_cu_seqlens(q.device)
    return q, k, v, unused, (args.cu_seqlens_k if features.kv_lengths else unused)


def _page_table(args: RunArgs, device):
    return args.page_table if args.page_table is not None else _unused_page_table(device)


# (device, shape) -> int32 zeros: arguments a specialisation takes but never reads
_placeholders: dict = {}


def _placeholder(device, shape):
    """An int32 tensor a kernel takes but this specialisation never reads (the dense
    kernels' cu_seqlens, the unpaged kernels' page table, the non-deterministic
    backward's semaphore): one per device and shape, so no call allocates or memsets it,
    but for calls in a graph capture or a graph tree's warm-up (_keepable), which make
    their own."""
    t = _placeholders.get((device, shape))
    if t is None:
        t = torch.zeros(shape, dtype=torch.int32, device=device)
        if _keepable(t):
            _placeholders[(device, shape)] = t
    return t


def _keepable(*tensors) -> bool:
    """Whether buffers just allocated for a cache may be kept across calls: not a CUDA
    graph capture's (the graph's pool) nor another private pool's (torch.compile's graph
    trees warm up in theirs, then free it: bounded_cache.outside_private_pools)."""
    return not torch.cuda.is_current_stream_capturing() and outside_private_pools(*tensors)


def _unused_cu_seqlens(device):
    return _placeholder(device, (2,))


# (device, raw stream) -> the tile queue's counter
_tile_queues: dict = {}


def _tile_queue(device):
    """The counter of a persistent forward's tile queue (FwdConfig.tile_queue): int32
    zeros, shaped like the cu_seqlens_q slot it travels in (only element 0 is used).
    One per (device, stream) like the split workspace's counters, for the same reasons:
    kernels on one stream run in order and each leaves it zero, two streams may run at
    once; under CUDA graph capture the graph gets its own, zeroed by a memset it replays."""
    key = _stream_key(device)
    counter = None if key is None else _tile_queues.get(key)
    if counter is None:
        counter = torch.zeros(2, dtype=torch.int32, device=device)
        if key is not None and outside_private_pools(counter):
            _tile_queues[key] = counter
    return counter


def _stream_key(device):
    """(device, raw stream) of the current stream, the key of the per-stream scratch that
    kernels on one stream share in turn (the split workspace, the tile queue); None while
    a CUDA graph captures, whose calls get scratch of their own (the graph's pool), as a
    graph may be replayed on another stream while this one runs eager calls."""
    if torch.cuda.is_current_stream_capturing():
        return None
    return device, torch._C._cuda_getCurrentRawStream(device.index)


def _unused_page_table(device):
    return _placeholder(device, (1, 1))


def _unused_semaphore(device):
    return _placeholder(device, (1, 1, 1))


def _lse_shape(q, features: AttnFeatures):
    if features.varlen:
        total_q, heads, _ = q.shape
        return (heads, total_q)
    batch, seqlen_q, heads, _ = q.shape
    return (batch, heads, seqlen_q)


# ----------------------------------------------------------------------------------------
# Split-KV: a forward whose grid is too small for the GPU (decode; short queries against
# long keys) splits each query tile's KV range over several CTAs, then combines
# ----------------------------------------------------------------------------------------

_limits_by_device: dict = {}


def _device_limits(device) -> tuple:
    """(SMs, peak HBM GB/s) of the device: what split_heuristic weighs a grid against."""
    n = _limits_by_device.get(device)
    if n is None:
        props = torch.cuda.get_device_properties(device)
        # double data rate: 2 transfers per memory clock (kHz) over the bus (bits)
        hbm_gbs = 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8 / 1e9
        n = _limits_by_device[device] = (props.multi_processor_count, hbm_gbs)
    return n


def _max_seqlen_k(q, k, features: AttnFeatures, args: RunArgs) -> int:
    """The longest key sequence a call may have: varlen's maximum, or a KV cache's
    capacity (its lengths stay on the device): rows, or pages x page size."""
    if features.varlen:
        return args.max_seqlen_k
    return k.shape[1] if args.page_table is None else args.page_table.shape[1] * k.shape[1]


def _packed_rows(q, features: AttnFeatures, args: RunArgs, config: FwdConfig) -> int:
    """Rows of a query tile's work: the longest query sequence times the GQA heads packed."""
    return (args.max_seqlen_q if features.varlen else q.shape[1]) * config.pack_gqa


def _cluster_merge(q, k, features: AttnFeatures, args: RunArgs, config: FwdConfig, num_splits: int) -> bool:
    """Whether this call's splits merge in a thread-block cluster (FwdConfig.cluster_splits):
    the partial tile fits the K/V rings, its rows are few (config.cluster_merge_rows_fit) and
    split_heuristic.merge_in_cluster says so."""
    head_dim = q.shape[-1]
    if not cluster_splits_fit(split_config(config), head_dim, q.element_size()):
        return False
    if not cluster_merge_rows_fit(config, _packed_rows(q, features, args, config), head_dim):
        return False
    kv_blocks = -(-_max_seqlen_k(q, k, features, args) // config.tile_n)
    return split_heuristic.merge_in_cluster(num_splits, kv_blocks, 2 * config.tile_n * head_dim * k.element_size(),
                                            MAX_CLUSTER_SPLITS, _work_tiles(q, features, args, config))


def choose_splits(q, k, features: AttnFeatures, args: RunArgs, config: FwdConfig) -> int:
    """split_heuristic.choose_num_splits for this call: work tiles (query tiles of packed
    rows x the heads a tile covers x batch) against the GPU's SMs, KV blocks of the
    longest sequence. A grid of at least FILL_FRACTION x SMs tiles (most training calls)
    returns 1 after a few integer operations."""
    if features.varlen:
        batch = args.cu_seqlens_q.shape[0] - 1
        seqlen_q, heads = args.max_seqlen_q, q.shape[1]
    else:
        batch, seqlen_q, heads, _ = q.shape
    seqlen_k = _max_seqlen_k(q, k, features, args)
    pack = config.pack_gqa
    q_tiles = -(-(seqlen_q * pack) // config.tile_m)
    tiles = q_tiles * (heads // pack) * batch
    sms, hbm_gbs = _device_limits(q.device) if q.is_cuda else (132, 3350.0)
    if tiles >= split_heuristic.FILL_FRACTION * sms:  # most training calls: no further work
        return 1
    # step 2c (every SM for long splits) measured a gain at head dim <= 64 only, whose split
    # tile has one consumer warpgroup (config.split_decode_config); at 128 it was level
    head_dim = q.shape[-1]
    block_bytes = 2 * config.tile_n * head_dim * k.element_size() if head_dim <= 64 else 0
    return split_heuristic.choose_num_splits(batch, heads // pack, q_tiles, -(-seqlen_k // config.tile_n),
                                             num_sms=sms, hbm_gbs=hbm_gbs, kv_block_bytes=block_bytes)


# (torch dtype, head_dim, features, unsplit config) -> the split forward
_split_kernels: dict = {}


def _split_kernel(q, features: AttnFeatures, config: FwdConfig, cluster: bool = False):
    """The split forward of config; cluster: its splits merge in a thread-block cluster
    (FwdConfig.cluster_splits), for 2..MAX_CLUSTER_SPLITS splits."""
    head_dim = q.shape[-1]
    fn = _split_kernels.get((q.dtype, head_dim, features, config, cluster))
    if fn is None:
        split = dataclasses.replace(split_config(config), cluster_splits=cluster)
        key = FwdKey(DTYPE_OF_INPUT[q.dtype].name, head_dim, features, split)
        fn = _split_kernels.setdefault((q.dtype, head_dim, features, config, cluster), get_fwd_kernel(key))
    return fn


def _run_fwd_split(q, k, v, features: AttnFeatures, args: RunArgs, plan: _Plan, need_lse: bool):
    q4, k4, v4, cu_q, cu_k = _kernel_inputs(q, k, v, features, args)
    batch, seqlen_q, heads, head_dim = q4.shape
    if plan.cluster_merge:
        o_part, lse_part, counters = _unused_partials(q.device, seqlen_q, heads, head_dim)
    else:
        o_part, lse_part, counters = _split_workspace(q.device, plan.num_splits * batch, seqlen_q, heads, head_dim,
                                                      plan.tiles)
    out, lse = _outputs(q, features, need_lse)
    out4, lse3 = (out[None], lse[None]) if features.varlen else (out, lse)
    window_left, window_right = args.window
    plan.fn(q4, k4, v4, out4, lse3, cu_q, cu_k, _page_table(args, q.device), o_part, lse_part, counters,
            args.max_seqlen_q, args.softmax_scale, args.softcap, window_left, window_right, plan.num_splits)
    return out, (lse if need_lse else None)


def _work_tiles(q, features: AttnFeatures, args: RunArgs, config: FwdConfig) -> int:
    """Work tiles of the forward's grid (query tiles x head tiles x batch): the split
    forward keeps a counter per tile."""
    pack = config.pack_gqa
    if features.varlen:
        batch, seqlen_q, heads = args.cu_seqlens_q.shape[0] - 1, args.max_seqlen_q, q.shape[1]
    else:
        batch, seqlen_q, heads, _ = q.shape
    return -(-(seqlen_q * pack) // config.tile_m) * (heads // pack) * batch


# (device, seqlen_q, heads, head_dim) -> placeholders for the partials' arguments
_unused_partial_buffers: dict = {}


def _unused_partials(device, seqlen_q: int, heads: int, head_dim: int):
    """(o_part, lse_part, tile_counters) for a split forward that merges in a cluster and
    reads none of them: shaped as the kernel's signature ties them to q (one part), never
    initialised (nothing reads them, so a captured call records no memset), cached outside
    CUDA graph capture in a bounded cache (varlen's total_q varies per batch)."""
    key = (device, seqlen_q, heads, head_dim)
    parts = _unused_partial_buffers.get(key)
    if parts is None:
        f32 = dict(dtype=torch.float32, device=device)
        parts = (torch.empty((1, seqlen_q, heads, head_dim), **f32), torch.empty((1, heads, seqlen_q), **f32),
                 torch.empty((1,), dtype=torch.int32, device=device))
        if _keepable(*parts):
            remember(_unused_partial_buffers, key, parts, limit=16)
    return parts


# (device, stream) -> ([fp32 buffers], [int32 zero buffers]) grown so far, the last the
# largest; (device, stream, parts, seqlen_q, heads, head_dim, tiles) -> a call's views
_workspace_buffers: dict = {}
_workspace_views: dict = {}


def _split_workspace(device, parts: int, seqlen_q: int, heads: int, head_dim: int, tiles: int):
    """(o_part, lse_part, tile_counters) for a split forward: the fp32 partials,
    (parts, seqlen_q, heads, head_dim) and (parts, heads, seqlen_q), and `tiles` int32
    counters that are zero (fwd_sm90.merge_if_last leaves them zero).

    A decode step should neither allocate (~2-4 us of host time each) nor memset them,
    so each (device, stream) keeps one workspace, grown by doubling, and a call gets
    views of it (cached per shape). Per stream, because kernels on one stream run in
    order (the next call's splits start after the last merge read the partials) while
    two streams may run at once. The outgrown buffers are kept: a kernel queued earlier
    may still use them. Under CUDA graph capture a call allocates its own (the graph's
    pool; the counters zeroed by a memset the graph replays), as a graph may be replayed
    on another stream while this one runs eager calls."""
    f32 = dict(dtype=torch.float32, device=device)
    stream_key = _stream_key(device)
    if stream_key is None:
        return (torch.empty((parts, seqlen_q, heads, head_dim), **f32), torch.empty((parts, heads, seqlen_q), **f32),
                torch.zeros(tiles, dtype=torch.int32, device=device))
    key = (*stream_key, parts, seqlen_q, heads, head_dim, tiles)
    views = _workspace_views.get(key)
    if views is not None:
        return views
    floats, zeros = _workspace_buffers.setdefault(stream_key, ([], []))
    o_numel = parts * seqlen_q * heads * head_dim  # a multiple of 4: LSE starts 16-byte aligned
    numel = o_numel + parts * heads * seqlen_q
    buf, counters = (floats[-1] if floats else None), (zeros[-1] if zeros else None)
    grown = []
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 2 * buf.numel() if buf is not None else 1 << 16), **f32)
        grown.append((floats, buf))
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 2 * counters.numel() if counters is not None else 1024),
                               dtype=torch.int32, device=device)
        grown.append((zeros, counters))
    views = (buf[:o_numel].view(parts, seqlen_q, heads, head_dim), buf[o_numel:numel].view(parts, heads, seqlen_q),
             counters[:tiles])
    if grown and not outside_private_pools(*(t for _, t in grown)):
        return views  # a private pool's (outside_private_pools): this call's own, not kept
    for buffers, t in grown:
        buffers.append(t)
    return remember(_workspace_views, key, views)


def _fake_partials(n: "_Symbols", head_dim: int):
    """The split forward's fp32 partial O and LSE, (num_splits * batch, ...) with a batch
    symbol of their own."""
    import cutlass
    import cutlass.cute as cute

    parts = cute.sym_int32(symbol="partial_batch")
    o_part = cute.runtime.make_fake_tensor(
        cutlass.Float32, (parts, n.seqlen_q, n.heads, head_dim),
        stride=(*(cute.sym_int64(divisibility=4, symbol=f"opart_stride{i}") for i in range(3)), 1),
        assumed_align=16,
    )
    return o_part, _fake_rowwise(parts, n.heads, n.seqlen_q, "lse_part")


# ----------------------------------------------------------------------------------------
# KV-cache append: a decode step's new keys and values into the cache, in place
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AppendKey:
    dtype: str  # a config.DTYPES name
    head_dim: int
    paged: bool
    arch: str = ARCH


def _fake_append_args(key: AppendKey):
    import cutlass
    import cutlass.cute as cute

    batch, heads_kv = cute.sym_int32(symbol="batch"), cute.sym_int32(symbol="heads_kv")
    seqlen_new = cute.sym_int32(symbol="seqlen_new")
    cache_batch, cache_rows = cute.sym_int32(symbol="cache_batch"), cute.sym_int32(symbol="cache_rows")
    d = key.head_dim
    k, v = (_fake_bshd(key.dtype, batch, seqlen_new, heads_kv, d, name) for name in ("k_new", "v_new"))
    k_cache, v_cache = (_fake_bshd(key.dtype, cache_batch, cache_rows, heads_kv, d, name)
                        for name in ("k_cache", "v_cache"))
    page_table = cute.runtime.make_fake_tensor(
        cutlass.Int32, (cute.sym_int32(symbol="pt_batch"), cute.sym_int32(symbol="max_pages")),
        stride=(cute.sym_int64(symbol="pt_stride0"), 1), assumed_align=4,
    )
    return (k, v, k_cache, v_cache, _fake_cu_seqlens("cache_seqlens"), page_table, _fake_cu_seqlens("new_lengths"),
            _fake_stream())


def compile_append(key: AppendKey, extra_options: str = ""):
    """Compile the KV-cache append; returns f(k, v, k_cache, v_cache, cache_seqlens,
    page_table, new_lengths)."""
    from cute_attn.kernels.kv_append import KVAppend

    kernel = KVAppend(DTYPES[key.dtype], key.head_dim, key.paged)
    return _compile(kernel, _fake_append_args(key), extra_options, key)


def get_append_kernel(key: AppendKey):
    return _cached(key, _from_disk_or_compiled(compile_append, _raw))


# (torch dtype, head_dim, paged) -> the append kernel: a per-call lookup of plain values
_append_kernels: dict = {}


def run_append(k, v, k_cache, v_cache, cache_seqlens, page_table=None):
    """Write k, v (batch, seqlen_new, heads_kv, head_dim) into the caches at each entry's
    cache_seqlens (kernels/kv_append.py has the clamping rule) and return the entries'
    new lengths, int32 (batch,), on the device: no host sync."""
    paged = page_table is not None
    fn = _append_kernels.get((k.dtype, k.shape[3], paged))
    if fn is None:
        fn = _append_kernels.setdefault((k.dtype, k.shape[3], paged), get_append_kernel(
            AppendKey(DTYPE_OF_INPUT[k.dtype].name, k.shape[3], paged)))
    new_lengths = torch.empty_like(cache_seqlens)
    fn(k, v, k_cache, v_cache, cache_seqlens, page_table if paged else _unused_page_table(k.device), new_lengths)
    # the kernel wrote the caches behind autograd's back: a graph that saved one for its
    # backward now raises torch's in-place error there instead of using the new values
    # (one tensor per call: torch 2.4's increment_version takes no tuple; inference
    # tensors keep no version)
    for cache in (k_cache, v_cache):
        if not cache.is_inference():
            torch.autograd.graph.increment_version(cache)
    return new_lengths


# ----------------------------------------------------------------------------------------
# LSE combine as a kernel of its own (kernels/combine.py): context parallelism's merge
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CombineKey:
    out_dtype: str  # "float32", "bfloat16" or "float16"
    head_dim: int
    arch: str = ARCH


def _fake_combine_args(key: CombineKey):
    import cutlass
    import cutlass.cute as cute

    n = _Symbols()
    o_part, lse_part = _fake_partials(n, key.head_dim)
    out_type = getattr(cutlass, _dsl_type_name(getattr(torch, key.out_dtype)))
    align = 16 // getattr(torch, key.out_dtype).itemsize
    o = cute.runtime.make_fake_tensor(
        out_type, (n.batch, n.seqlen_q, n.heads, key.head_dim),
        stride=(*(cute.sym_int64(divisibility=align, symbol=f"o_stride{i}") for i in range(3)), 1), assumed_align=16,
    )
    return o_part, lse_part, o, _fake_rowwise(n.batch, n.heads, n.seqlen_q, "lse"), cutlass.Int32(1), _fake_stream()


def compile_combine(key: CombineKey, extra_options: str = ""):
    """Compile the LSE combine; returns f(o_part, lse_part, out, lse, num_splits)."""
    import cutlass

    from cute_attn.kernels.combine import LseCombine

    kernel = LseCombine(key.head_dim, getattr(cutlass, _dsl_type_name(getattr(torch, key.out_dtype))))
    return _compile(kernel, _fake_combine_args(key), extra_options, key)


def get_combine_kernel(key: CombineKey):
    return _cached(key, _from_disk_or_compiled(compile_combine, _raw))


def run_combine(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge num_splits = o_part.shape[0] // out.shape[0] partials into out and lse, in
    place (kernels/combine.py has the layouts; out may be split 0's rows of o_part, lse
    may not alias lse_part). Validated by the caller: fp32 partials and lse, head_dim
    contiguous with 16-byte aligned rows, the same (seqlen, heads, head_dim)."""
    splits = o_part.shape[0] // out.shape[0]
    if splits * out.shape[0] != o_part.shape[0] or o_part.shape[1:] != out.shape[1:] \
            or lse_part.shape != (o_part.shape[0], *lse.shape[1:]) or lse.shape != (out.shape[0], out.shape[2], out.shape[1]):
        raise ValueError(f"run_combine: partials {tuple(o_part.shape)} / {tuple(lse_part.shape)} do not stack "
                         f"outputs {tuple(out.shape)} / {tuple(lse.shape)}")
    fn = get_combine_kernel(CombineKey(str(out.dtype).removeprefix("torch."), out.shape[-1]))
    fn(o_part, lse_part, out, lse, splits)


# device -> the float32 sinks allocated so far (the last is the largest); (device, shape)
# -> a view of the largest, reused so that a call pays a dict lookup, not a view
_lse_sinks: dict = {}
_lse_sink_views: dict = {}


def _lse_sink(device, shape):
    """A float32 tensor of this shape for an LSE nobody reads. An allocation costs ~4-7 us
    of host time per call (perf/NOTES.md, host path), so calls that discard lse share one
    buffer per device: the kernels only write it, so calls that overlap on different
    streams race on bytes nobody reads. A larger shape gets a new buffer; the older ones
    are kept, never freed, because a kernel on another stream may still be writing them
    (freed memory could be handed to a live tensor). So the sinks of a device hold less
    than twice the largest LSE of any call that discarded it."""
    view = _lse_sink_views.get((device, shape))
    if view is not None:
        return view
    numel = shape[0] * shape[1] * (shape[2] if len(shape) == 3 else 1)
    sinks = _lse_sinks.setdefault(device, [])
    if not sinks or sinks[-1].numel() < numel:
        if torch.cuda.is_current_stream_capturing():
            # a capture allocates from the graph's private pool: not a buffer to keep
            return torch.empty(shape, dtype=torch.float32, device=device)
        size = max(numel, 2 * sinks[-1].numel()) if sinks else max(numel, 1 << 16)
        sink = torch.empty(size, dtype=torch.float32, device=device)
        if not outside_private_pools(sink):  # a private pool's: this call's own, not kept
            return sink[:numel].view(shape)
        sinks.append(sink)
    return remember(_lse_sink_views, (device, shape), sinks[-1][:numel].view(shape))


# ----------------------------------------------------------------------------------------
# Backward: preprocess (D, LSE2) -> main kernel (dK, dV, dQ_accum) -> postprocess (dQ)
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BwdKey:
    dtype: str  # a config.DTYPES name
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

    n, d = _Symbols(), key.head_dim
    # padded query rows (whole tiles: per batch entry, or per sequence when packed)
    rows_pad = cute.sym_int32(divisibility=key.config.tile_m, symbol="rows_pad")
    accum_len = cute.sym_int32(divisibility=key.config.tile_m * d, symbol="dq_accum_len")

    q, dq, o, do = (_fake_bshd(key.dtype, n.batch, n.seqlen_q, n.heads, d, name) for name in ("q", "dq", "o", "do"))
    k, v, dk, dv = (_fake_bshd(key.dtype, n.batch, n.seqlen_k, n.heads_kv, d, name) for name in ("k", "v", "dk", "dv"))
    lse = _fake_rowwise(n.batch, n.heads, n.seqlen_q, "lse")
    # 16-byte aligned chunks: the bulk copies of the main kernel need it
    lse2 = _fake_rowwise(n.batch, n.heads, rows_pad, "lse2", align=16, divisibility=4)
    dsum = _fake_rowwise(n.batch, n.heads, rows_pad, "dsum", align=16, divisibility=4)
    dq_accum = _fake_rowwise(n.batch, n.heads, accum_len, "dq_accum", align=16, divisibility=4)
    # its own symbols: a 1-element dummy is passed when not deterministic
    semaphore = _fake_rowwise(
        *(cute.sym_int32(symbol=f"sem_dim{i}") for i in range(3)), "sem", dtype=cutlass.Int32
    )
    cu_q, cu_k = _fake_cu_seqlens("cu_seqlens_q"), _fake_cu_seqlens("cu_seqlens_k")
    stream = _fake_stream()
    max_seqlen, scale, softcap, wl, wr = _fake_run_args()
    main = (q, k, v, do, lse2, dsum, dq_accum, dk, dv, semaphore, cu_q, cu_k)
    if key.features.mod_kernel:
        lists, aux = _fake_block_mask_and_aux(key.features, n, transposed=True)
        main = (*main, *lists, aux, *_fake_dropout_args(), max_seqlen, scale, softcap, wl, wr, stream)
    else:
        main = (*main, max_seqlen, scale, softcap, wl, wr, stream)
    return (
        (o, do, lse, lse2, dsum, dq_accum, cu_q, max_seqlen, stream),
        main,
        (dq_accum, dq, cu_q, max_seqlen, scale, stream),
    )


def compile_bwd(key: BwdKey, extra_options: str = ""):
    """Compile the three backward kernels of one specialisation; returns the TVM-FFI
    callables (preprocess, main, postprocess)."""
    from cute_attn.kernels.bwd_prepost import BwdPostprocess, BwdPreprocess
    from cute_attn.kernels.bwd_sm90 import FlashBwdSm90, FlashBwdSm90Mods

    _check_capability("bwd", key)
    dtypes, cfg, features = DTYPES[key.dtype], key.config, key.features
    pre_args, main_args, post_args = _fake_bwd_args(key)
    pre = _compile(BwdPreprocess(dtypes, key.head_dim, cfg, features), pre_args, extra_options, key)
    cls = FlashBwdSm90Mods if features.mod_kernel else FlashBwdSm90
    main = _compile(cls(dtypes, key.head_dim, features, cfg, key.deterministic), main_args, extra_options, key)
    post = _compile(BwdPostprocess(dtypes, key.head_dim, cfg, features), post_args, extra_options, key)
    return pre, main, post


def get_bwd_kernels(key: BwdKey):
    return _cached(key, _from_disk_or_compiled(compile_bwd, lambda fns: tuple(_raw(f) for f in fns)))


def run_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    features: AttnFeatures,
    args: RunArgs,
    deterministic: bool = False,
    config: Optional[BwdConfig] = None,
    mods: Optional[tuple] = None,
    sink: Optional[torch.Tensor] = None,
):
    """Gradients (dq, dk, dv) of the forward that produced (out, lse), each laid out like
    its input. dout must be TMA-addressable like q (validation.prepare_dout). features and
    args as for run_fwd; mods: (mask_mod, score_mod) masks.Modifier or None, as for
    run_fwd_mods (dense or varlen inputs); the backward's block mask (with its dQ turns) is built
    and cached here. sink: the forward's (heads,) float32 sink logits, whose gradient is
    then returned too: (dq, dk, dv, dsink)."""
    head_dim = q.shape[-1]
    if features.sink:
        # the sink enters the kernels only through the forward's lse: the sink-free ones serve
        features = dataclasses.replace(features, sink=False)
    lse_in = lse
    if config is None:
        queries = args.max_seqlen_q if features.varlen else q.shape[1]
        config = bwd_config_for(head_dim, features, bool(deterministic), queries)
    pre, main, post = get_bwd_kernels(
        BwdKey(DTYPE_OF_INPUT[q.dtype].name, head_dim, features, config, bool(deterministic))
    )
    tile_m = config.tile_m
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if features.varlen:
        total_q, heads, _ = q.shape
        batch = args.cu_seqlens_q.shape[0] - 1
        # each sequence padded to whole query tiles (blocks/seqlen.py): room for all
        rows = (total_q + batch * tile_m + tile_m - 1) // tile_m * tile_m
        stats_batch = 1
    else:
        batch, seqlen_q, heads, _ = q.shape
        rows = (seqlen_q + tile_m - 1) // tile_m * tile_m
        stats_batch = batch
    q, k, v, out, dout, dq4, dk4, dv4, lse = _batched(features, q, k, v, out, dout, dq, dk, dv, lse)
    cu_q, cu_k = _cu_seqlens(features, args, q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    lse2 = torch.empty((stats_batch, heads, rows), **f32)
    dsum = torch.empty((stats_batch, heads, rows), **f32)
    dq_accum = _unset_dq_accum((stats_batch, heads, rows * head_dim), q.device)
    if deterministic:
        # one turn counter per (batch, head, query block)
        semaphore = torch.zeros((stats_batch, heads, rows // tile_m), dtype=torch.int32, device=q.device)
    else:
        semaphore = _unused_semaphore(q.device)
    pre(out, dout, lse, lse2, dsum, dq_accum, cu_q, args.max_seqlen_q)
    if not features.mod_kernel:
        main(q, k, v, dout, lse2, dsum, dq_accum, dk4, dv4, semaphore, cu_q, cu_k, args.max_seqlen_k,
             args.softmax_scale, args.softcap, args.window[0], args.window[1])
    else:  # mods and/or dropout (a sink alone was dropped above: the dense kernel serves)
        lists, aux = _mod_arguments(q, k, config.tile_m, config.tile_n, *(mods or (None, None)), transposed=True,
                                    varlen=args if features.varlen else None)
        main(q, k, v, dout, lse2, dsum, dq_accum, dk4, dv4, semaphore, cu_q, cu_k, *lists, aux,
             *_dropout_arguments(q.device, args), args.max_seqlen_k, args.softmax_scale, args.softcap,
             args.window[0], args.window[1])
    post(dq_accum, dq4, cu_q, args.max_seqlen_q, args.softmax_scale)
    if sink is None:
        return dq, dk, dv
    if features.varlen:
        d = dsum[0][:, _padded_rows(args.cu_seqlens_q, lse_in.shape[-1], tile_m)]  # (heads, total_q)
        return dq, dk, dv, _sink_grad(d[None], lse_in[None], sink)
    return dq, dk, dv, _sink_grad(dsum[..., :lse_in.shape[-1]], lse_in, sink)


def _unset_dq_accum(shape: tuple, device: torch.device) -> torch.Tensor:
    """The backward's fp32 dQ accumulator, allocated unset: bulk reduce-adds or atomics
    (dq_atomic) accumulate into it, and the preprocess zeroes each query tile's chunk
    first (blocks/dq_accum.py; a torch.zeros here was a second pass over the buffer,
    perf/NOTES.md session 30). The GPU tests fill it with NaN through this function."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _padded_rows(cu_seqlens_q: torch.Tensor, total_q: int, tile_m: int) -> torch.Tensor:
    """Row of each packed query in the backward's per-sequence padded statistics
    (blocks/seqlen.py: sequence b starts at (cu_seqlens_q[b] + b * tile_m) // tile_m *
    tile_m): device ops only, no host sync."""
    token = torch.arange(total_q, device=cu_seqlens_q.device, dtype=torch.int32)
    # sequence of each token, within [0, batch - 1] even for offsets that end short of
    # total_q (unchecked cu_seqlens): an index past the last would fault on the device
    seq = torch.searchsorted(cu_seqlens_q[1:-1], token, right=True)
    # clamped as the kernels clamp each sequence's start (blocks/seqlen.packed_span)
    start = cu_seqlens_q[:-1].long().clamp(0, total_q)
    batch = torch.arange(start.shape[0], device=start.device)
    padded_start = (start + batch * tile_m) // tile_m * tile_m
    return token.long() + (padded_start - start)[seq]


def _sink_grad(d: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The attention sinks' gradient from the backward's D = rowsum(dO * O) (the
    preprocess kernel's, (batch, heads, seqlen_q)): the sink moves each row's lse by
    p_i = e^{sink - lse_i} and its out by -p_i out_i, so dsink = -sum_i p_i D_i. A torch
    reduction over batch x heads x seqlen_q values (reading dO and O again in torch cost
    0.4-0.9 ms per call at 2 x 8K tokens, H100, perf/NOTES.md)."""
    return -(torch.exp(sink[None, :, None] - lse) * d).sum((0, 2))


