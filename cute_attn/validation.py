"""Host-side checks of `mha` inputs, run before anything is compiled or launched.

Each failure raises TypeError (wrong kind of thing) or ValueError (right kind, wrong
value) whose message names the argument, the value received and what is accepted.
The order is deliberate: everything that can be judged on a CPU tensor (type, rank,
dtype, shapes, head dim, strides, scale) comes before the device checks, so the CPU
test suite exercises every check but the last two. The dtypes, head dims and alignment
accepted come from cute_attn.config (DTYPE_OF_INPUT, CAPABILITIES["fwd"]), and the dense
and varlen entry points share one copy of each check.
"""

import itertools
import math
import numbers
import struct

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from cute_attn.config import CAPABILITIES, DTYPE_OF_INPUT, DTYPES, FP8, FP8_POLICY_OF_OUTPUT, DtypePolicy

_NAMES = ("q", "k", "v")
_DENSE_SHAPE = "(batch, seqlen, nheads, headdim)"
_VARLEN_SHAPE = "(total_tokens, nheads, headdim) for varlen"
# Not .contiguous(): it returns its input unchanged when only a size-1 dim has an odd
# stride or the storage offset is misaligned; a clone always gets fresh packed strides.
_COPY_HINT = "make a packed copy with .clone(memory_format=torch.contiguous_format)"
_DIM_LABELS = {4: ("batch", "seqlen", "nheads", "headdim"), 3: ("total_tokens", "nheads", "headdim")}

try:  # numpy's bool is as good a flag as Python's; numpy itself is optional
    import numpy

    _BOOL_TYPES = (bool, numpy.bool_)
except ImportError:  # pragma: no cover
    _BOOL_TYPES = (bool,)


# ----------------------------------------------------------------------------------------
# What float32 carries through the kernels' scale folding (blocks/softmax.py,
# fold_score_scale): the kernels take softmax_scale and softcap as float32 and compute
# softmax_scale * log2(e) (no softcap), or softcap * log2(e) and softmax_scale / softcap.
# Each must be a normal, finite float32: an inf turns every score into inf - inf = NaN,
# and a subnormal is flushed to zero (uniform attention, or tanh(0) = 0 for every score).
# ----------------------------------------------------------------------------------------

F32_MAX = 3.4028234663852886e38  # the largest finite float32
F32_MIN_NORMAL = 1.1754943508222875e-38  # the smallest normal float32


def _f32(x):
    """x rounded to float32 (what the kernel receives); +-inf past float32's range."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _next_f32(x):
    """The float32 after the positive float32 x."""
    return struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0] + 1))[0]


def _largest_foldable():
    """The largest float32 x with x * log2(e) (a float32 product, as in the kernel) finite."""
    log2e = _f32(math.log2(math.e))
    x = _f32(F32_MAX / log2e)
    while math.isinf(_f32(x * log2e)):
        x = _f32(x * (1 - 2.0 ** -24))
    while not math.isinf(_f32(_next_f32(x) * log2e)):
        x = _next_f32(x)
    return x


# softmax_scale and softcap are accepted in [FOLD_MIN, FOLD_MAX]: both ends are float32
# values, so every number in between rounds to a float32 in between, which stays normal
# and finite times log2(e) (about 1.443). The fast path compares against the same bounds.
FOLD_MIN = F32_MIN_NORMAL
FOLD_MAX = _largest_foldable()
_FOLD_RANGE = f"[{FOLD_MIN:.7g}, {FOLD_MAX:.7g}]"


_capabilities = {}  # torch.device -> (major, minor): the query costs microseconds per call


def _device_capability(device):
    """(major, minor) of a CUDA device; a function so tests can monkeypatch it."""
    cap = _capabilities.get(device)
    if cap is None:
        cap = _capabilities[device] = tuple(torch.cuda.get_device_capability(device))
    return cap


# dynamo folds this function to True while it traces (bound once: the fast path reads it)
_is_compiling = torch.compiler.is_compiling


def plainly_tma_operands(policy, q, k, v):
    """The fast paths' TMA layout test of three 4-D tensors: last dim contiguous, the other
    strides multiples of align_elems (a power of two, so one test of their OR) and nonzero
    (an expanded dim goes to the detailed checks, which reject it unless the dim has size
    1), the pointers aligned, no negative-bit view. False means "look closer"
    (_layout_problem names it)."""
    elems = policy.align_elems
    qt, kt, vt = q.stride(), k.stride(), v.stride()
    if qt[3] != 1 or kt[3] != 1 or vt[3] != 1:
        return False
    if not (qt[0] and qt[1] and qt[2] and kt[0] and kt[1] and kt[2] and vt[0] and vt[1] and vt[2]):
        return False
    if _is_compiling():
        # traced: strides are symbolic (a bitwise OR of them would pin their values), and
        # the tensors have no address (a data_ptr read breaks the graph): the pointers are
        # checked by the op's real implementation (cute_attn.ops). Dynamo folds
        # _is_compiling() to a constant.
        return not any(s % elems for s in (qt[0], qt[1], qt[2], kt[0], kt[1], kt[2], vt[0], vt[1], vt[2]))
    return not ((qt[0] | qt[1] | qt[2] | kt[0] | kt[1] | kt[2] | vt[0] | vt[1] | vt[2]) % elems
                or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % policy.align_bytes
                or q.is_neg() or k.is_neg() or v.is_neg())


# The launch grids put heads and batch entries (or sequences) on grid.y and grid.z
# (blocks/tile_scheduler.py), which CUDA caps at 65535 each
GRID_YZ_MAX = 65535


def _check_grid_extents(batch, heads, batch_name="batch"):
    for name, value in ((batch_name, batch), ("nheads", heads)):
        if value > GRID_YZ_MAX:
            raise ValueError(f"{name} must be at most {GRID_YZ_MAX} (a dimension of the kernels' launch grid), "
                             f"got {value}; split the call")


def _plainly_valid(q, k, v, softmax_scale):
    """The common case in as few attribute reads as possible (this runs on every call;
    perf/NOTES.md has the host-time breakdown). False means "look closer", never
    "invalid": the detailed checks below then find and name the problem."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return False
    qs, ks = q.shape, k.shape
    if len(qs) != 4 or len(ks) != 4 or v.shape != ks:
        return False
    dtype, fwd = q.dtype, CAPABILITIES["fwd"]
    policy = DTYPE_OF_INPUT.get(dtype)  # as in _check_dtypes
    if policy is None or policy.name not in fwd.dtypes or k.dtype is not dtype or v.dtype is not dtype:
        return False
    b, sq, h, d = qs
    if ks[0] != b or ks[2] < 1 or h % ks[2] or ks[3] != d or d not in fwd.head_dims or sq < 1 or ks[1] < 1 or b < 1 or h < 1:
        return False
    if b > GRID_YZ_MAX or h > GRID_YZ_MAX:
        return False
    if not plainly_tma_operands(policy, q, k, v):
        return False
    if softmax_scale is not None and not (type(softmax_scale) is float and FOLD_MIN <= softmax_scale <= FOLD_MAX):
        return False
    if not q.is_cuda:
        return False
    device = q.device
    if k.device != device or v.device != device:
        return False
    # traced: the capability cache is Python state that dynamo would guard on (a first call
    # that fills it would then recompile); the op's real implementation checks it instead
    return _is_compiling() or _device_capability(device) == (9, 0)


def validate_fwd_inputs(q, k, v, softmax_scale, softcap=0.0):
    """Raise TypeError/ValueError if (q, k, v, softmax_scale) cannot go to the kernel;
    softcap (already checked by validate_softcap; 0 is off) for the float32 range of
    softmax_scale / softcap.

    Returns True when the call needs no kernel: q has no elements (batch, seqlen_q or
    nheads 0) or k has no keys (seqlen_k 0); see api._outputs_without_kernel. Otherwise
    None. Empty tensors get every other check (dtype, rank, head dim, strides, device)."""
    if _plainly_valid(q, k, v, softmax_scale):  # never true of an empty call
        if softcap:
            _check_softcap_scale(softcap, softmax_scale, q.shape[3])
        return None
    tensors = dict(zip(_NAMES, (q, k, v)))
    for name, t in tensors.items():
        _check_is_tensor(name, t)
    for name, t in tensors.items():
        _check_rank(name, t, 4, _DENSE_SHAPE)
    policy = _check_dtypes(q, k, v)
    _check_shapes(q, k, v)
    _check_operands(tensors, policy, softmax_scale, softcap)
    return True if q.numel() == 0 or k.shape[1] == 0 else None


def _check_shapes(q, k, v):
    for name, t in (("k", k), ("v", v)):
        for axis, label in ((0, "batch"), (3, "headdim")):
            _check_equal(name, label, t.shape[axis], q.shape[axis], shapes=(q, t))
    _check_equal("v", "seqlen", v.shape[1], k.shape[1], ref="k")
    # batch, seqlen_q, seqlen_k and nheads may be 0: such a call needs no kernel
    validate_gqa_heads(q, k, v)
    _check_grid_extents(q.shape[0], q.shape[2])


# ----------------------------------------------------------------------------------------
# One copy of each check that validate_fwd_inputs and validate_varlen_fwd_inputs share
# (and the TMA layout rule, which prepare_dout applies too)
# ----------------------------------------------------------------------------------------


def _check_is_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    # a sparse or nested tensor has no (or symbolic) strides: the layout checks would
    # misname it (sparse strides read as 0, "expanded") or fail inside torch (jagged)
    if t.is_nested:
        raise TypeError(f"{name} is a nested tensor (layout {t.layout}); pass dense tensors, or the "
                        "packed sequences to mha_varlen (a jagged tensor's .values(), with "
                        ".offsets().to(torch.int32) as cu_seqlens)")
    if t.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (torch.strided) tensor, got layout {t.layout}; "
                        "call .to_dense()")


def _check_rank(name, t, dims, shape):
    if t.dim() != dims:
        raise ValueError(f"{name} must have shape {shape}, got shape {tuple(t.shape)} ({t.dim()} dims)")


def _check_equal(name, label, value, expected, ref="q", shapes=()):
    """ValueError unless value (of name) == expected (of ref); shapes: the (ref, name)
    tensors whose shapes the message shows."""
    if value != expected:
        detail = ""
        if shapes:
            detail = f" ({ref} shape {tuple(shapes[0].shape)}, {name} shape {tuple(shapes[1].shape)})"
        raise ValueError(f"{name} {label} must equal {ref} {label} ({expected}), got {value}{detail}")


def _accepted_dtypes(fwd):
    """The forward's input dtypes as messages name them ("torch.float16 or torch.bfloat16")."""
    return " or ".join(str(DTYPES[name].input) for name in fwd.dtypes)


def _check_dtypes(q, k, v):
    """q's dtype one the forward takes, k's and v's the same; returns its DtypePolicy."""
    fwd = CAPABILITIES["fwd"]
    policy = DTYPE_OF_INPUT.get(q.dtype)
    if policy is None or policy.name not in fwd.dtypes:
        hint = "; cast with .to(torch.bfloat16) or .half()" if q.dtype == torch.float32 else ""
        if q.dtype.is_floating_point and q.dtype.itemsize == 1:  # another FP8 format than the kernels'
            hint = "; the FP8 forward takes torch.float8_e4m3fn with q/k/v_descale (cute_attn.quantize_fp8)"
        raise TypeError(f"q must be {_accepted_dtypes(fwd)}, got {q.dtype}{hint}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {t.dtype}")
    return policy


def _check_operands(tensors, policy, softmax_scale, softcap=0.0, **other_tensors):
    """What the kernel needs of q, k, v (tensors) once their shapes hold: a head dim it is
    built for, TMA-addressable layouts, a usable scale (and softmax_scale / softcap);
    then the devices of the tensors and of other_tensors."""
    head_dims = CAPABILITIES["fwd"].head_dims
    d = tensors["q"].shape[-1]
    if d not in head_dims:
        raise ValueError(f"q headdim must be one of {head_dims}, got {d}")
    for name, t in tensors.items():
        problem = _layout_problem(name, t, policy)
        if problem:
            raise ValueError(problem)
    _check_scale(softmax_scale)
    if softcap:
        _check_softcap_scale(softcap, softmax_scale, d)
    _check_devices({**tensors, **other_tensors})


def memory_problem(name, t):
    """What keeps any tensor a kernel reads through its address (an operand, a descale, a
    sink) from holding its values there (None: nothing): a negative-bit view or a wrapper
    subclass without storage."""
    if not _is_compiling() and t.is_neg():
        # a lazily negated view (torch._neg_view, the .imag of a conjugated complex tensor):
        # its memory holds the values' negation, which a kernel reading it would take as is
        # (traced calls reach the kernel through a custom op, whose dispatch resolves it)
        return f"{name} is a negative-bit view (its memory holds -{name}); call .resolve_neg()"
    if not pointer_unknown(t) and not t.data_ptr() and t.numel():
        # a wrapper subclass (DTensor, or any _make_wrapper_subclass tensor) has no storage:
        # its address reads 0, which passes the alignment test below and would be launched
        return (f"{name} has no memory of its own (data pointer 0 for {t.numel()} elements): "
                f"a wrapper tensor subclass ({type(t).__name__}, such as a DTensor) keeps its "
                "data in inner tensors, which the kernels cannot read; pass a plain tensor "
                "(a DTensor's .to_local())")
    return None


def _layout_problem(name, t, policy):
    """What keeps t from being a TMA operand of the policy's dtype (None: nothing). TMA
    descriptors need the last dim contiguous, every other stride a multiple of align_bytes
    (align_elems elements of the dtype), and the base address aligned to align_bytes."""
    problem = memory_problem(name, t)
    if problem:
        return problem
    strides = t.stride()
    for dim, (size, stride) in enumerate(zip(t.shape, strides)):
        if stride == 0 and size > 1:
            return _broadcast_problem(name, t, dim)
    if strides[-1] != 1:
        return (f"{name} must be contiguous in the last dimension, got strides {strides}; "
                "call .contiguous()")
    if any(s % policy.align_elems for s in strides[:-1]):
        return (f"{name} strides must be multiples of {policy.align_elems} elements "
                f"({policy.align_bytes} bytes, a TMA requirement), got strides {strides}; "
                f"{_COPY_HINT}")
    if not pointer_unknown(t) and t.data_ptr() % policy.align_bytes:
        return (f"{name} data pointer must be {policy.align_bytes}-byte aligned (a TMA "
                f"requirement), got address {t.data_ptr():#x} (storage offset "
                f"{t.storage_offset()}); {_COPY_HINT}")
    return None


def pointer_unknown(t):
    """True when t has no address to check: a FakeTensor (FakeTensorMode, or what
    torch.compile's AOT tracing sees, functional wrappers included), a meta tensor, or
    any tensor while dynamo traces (it hands plain Tensors over, and a data_ptr read there
    breaks the graph). Alignment is then checked where real pointers exist, in the real
    implementations of cute_attn.ops. Off the fast path (_plainly_valid has its own
    guard), so the cost of the checks here does not matter."""
    if _is_compiling() or t.is_meta:
        return True
    return type(t) is not torch.Tensor and is_fake(t)


def _broadcast_problem(name, t, dim):
    """Why t, expanded (stride 0) along dim, cannot be a TMA operand, and what to do."""
    labels = _DIM_LABELS.get(t.dim(), ())
    label = labels[dim] if dim < len(labels) else f"dim {dim}"
    problem = (
        f"{name} strides must be nonzero on every dim of size > 1, got stride 0 on dim {dim} "
        f"({label}, size {t.shape[dim]}), strides {t.stride()}: an expanded (broadcast) "
        "tensor, which TMA cannot read (it loads each row from its own memory); "
    )
    if name in ("k", "v") and label == "nheads":
        return problem + (
            f"pass {name} unexpanded, with fewer heads: nheads_kv dividing nheads is "
            "supported natively (GQA/MQA), with no copy"
        )
    return problem + _COPY_HINT


def validate_flags(causal, return_lse, deterministic):
    """The three switches of mha / mha_varlen as Python bools; each must be a bool (or
    numpy.bool_): anything else, a 0/1 or a string such as "no", is a TypeError rather
    than a truth value."""
    flags = (("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic))
    for name, value in flags:
        if not isinstance(value, _BOOL_TYPES):
            raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return bool(causal), bool(return_lse), bool(deterministic)


def _check_softcap_scale(softcap, softmax_scale, head_dim):
    """With a softcap the kernel computes tanh(scores * softmax_scale / softcap): the
    quotient, in float32, must be normal and finite (each factor is checked on its own)."""
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    # rounded as the kernel rounds it; while dynamo traces, a float argument may be a
    # SymFloat, which struct cannot pack: the quotient in float64 then (the same test but
    # for values within a float32 rounding of the range's ends)
    pre = scale / softcap if _is_compiling() else _f32(_f32(scale) / _f32(softcap))
    if not F32_MIN_NORMAL <= pre <= F32_MAX:
        default = " (the default, 1/sqrt(headdim))" if softmax_scale is None else ""
        raise ValueError(
            f"softcap must keep softmax_scale / softcap a normal, finite float32 (in "
            f"[{F32_MIN_NORMAL:.7g}, {F32_MAX:.7g}]; the kernel computes tanh(scores * "
            f"softmax_scale / softcap) in float32), got softcap={softcap!r} with "
            f"softmax_scale={scale!r}{default}: softmax_scale / softcap = {scale / softcap:.7g}"
        )


def _finite(x) -> bool:
    """math.isfinite by comparisons: an int is finite however large (math.isfinite would
    overflow converting it), and under torch.compile a float argument may be a SymFloat,
    which comparisons trace (specialising on the value) and math.isfinite does not."""
    return x == x and -math.inf < x < math.inf


def _check_scale(softmax_scale):
    if softmax_scale is None:
        return
    # bool is an int subclass but never a meaningful scale; tensors would force a sync.
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            "softmax_scale must be None or a Python float/int, "
            f"got {type(softmax_scale).__name__}"
        )
    # positive: the kernel takes each row's max over raw scores and scales it after,
    # which is the max of the scaled scores only when the scale is positive
    if not _finite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(
            f"softmax_scale must be a finite positive number (or None for 1/sqrt(headdim)), "
            f"got {softmax_scale}"
        )
    if not FOLD_MIN <= softmax_scale <= FOLD_MAX:
        raise ValueError(
            f"softmax_scale must be in {_FOLD_RANGE}, where it and softmax_scale * log2(e) "
            "(which the kernel computes) are normal, finite float32 numbers, got "
            f"{softmax_scale}"
        )


def _check_devices(tensors):
    """q, k, v (first) on one CUDA device of compute capability 9.0."""
    q = next(iter(tensors.values()))
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(
                f"{name} is on {t.device}; cute_attn needs CUDA tensors on an sm_90 GPU"
            )
    for name in list(tensors)[1:]:
        if tensors[name].device != q.device:
            raise ValueError(
                f"{name} is on {tensors[name].device} but q is on {q.device}; "
                "q, k and v must be on the same device"
            )

    if _is_compiling():  # checked by the op's real implementation (see _plainly_valid)
        return
    cap = tuple(_device_capability(q.device))
    if cap != (9, 0):
        raise ValueError(
            f"q is on {q.device} with compute capability sm_{cap[0]}{cap[1]}; "
            "cute_attn needs an sm_90 (Hopper: H100/H200) GPU"
        )


def prepare_dout(dout, out):
    """dout as the backward kernels need it: out's dtype, shape and device, laid out like a
    TMA operand (_layout_problem). Autograd hands over whatever the next op produced (an
    expanded stride-0 tensor after .sum(), say); such a tensor is packed into a fresh copy
    rather than rejected, since the user never chose it."""
    if dout.dtype != out.dtype or dout.shape != out.shape or dout.device != out.device:
        raise ValueError(
            f"dout must match out (dtype {out.dtype}, shape {tuple(out.shape)}, device "
            f"{out.device}); got dtype {dout.dtype}, shape {tuple(dout.shape)}, device {dout.device}"
        )
    # every kernel-written out has a policy; a stand-in launcher's (float32 in the CPU
    # tests) gets the default one of its dtype
    policy = DTYPE_OF_INPUT.get(dout.dtype) or DtypePolicy("", dout.dtype, dout.dtype, dout.dtype)
    if _layout_problem("dout", dout, policy):
        dout = dout.clone(memory_format=torch.contiguous_format)
    return dout


# ----------------------------------------------------------------------------------------
# Checks for GQA/MQA, sliding windows, softcap and variable-length batches. Like the
# checks above they raise TypeError (wrong kind of thing) or ValueError (wrong value)
# naming the argument, and never synchronise with a GPU unless asked to.
# ----------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------
# FP8 (e4m3) forward: q, k, v in e4m3 with (batch, nheads_kv) float32 descales
# ----------------------------------------------------------------------------------------


def validate_fp8_operands(q, k, v, descales, out_dtype, batch, softmax_scale, softcap=0.0, **other_tensors):
    """The FP8 forward's checks once q, k, v have their ranks and shapes (dense or
    varlen, checked by the caller): e4m3 dtypes, a head dim it is built for, TMA
    layouts (16-byte strides: 16 elements), descales (None or float32 (batch, nheads_kv)
    on q's device), out_dtype (None: bfloat16, or torch.float16), no autograd, then scale
    and devices as for 16-bit calls. Returns the DtypePolicy."""
    for name, t in zip(_NAMES, (q, k, v)):
        if t.dtype != FP8:
            raise TypeError(f"{name} must be torch.float8_e4m3fn for the FP8 forward (descales were given "
                            f"or another operand is e4m3), got {t.dtype}; quantise with cute_attn.quantize_fp8")
    policy = FP8_POLICY_OF_OUTPUT.get(torch.bfloat16 if out_dtype is None else out_dtype)
    if policy is None:
        raise TypeError(f"out_dtype must be None (bfloat16), torch.bfloat16 or torch.float16, got {out_dtype}")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, *descales)):
        # descales included: a descale requiring grad would otherwise get none, silently
        raise NotImplementedError("the FP8 forward has no backward: call it under torch.no_grad() "
                                  "or with tensors (descales too) that do not require grad")
    head_dims = CAPABILITIES["fwd_fp8"].head_dims
    d = q.shape[-1]
    if d not in head_dims:
        raise ValueError(f"q headdim must be one of {head_dims} for the FP8 forward, got {d}")
    for name, t in zip(_NAMES, (q, k, v)):
        problem = _layout_problem(name, t, policy)
        if problem:
            raise ValueError(problem)
    heads_kv = k.shape[-2]
    for name, ds in zip(("q_descale", "k_descale", "v_descale"), descales):
        if ds is None:
            continue
        if not isinstance(ds, torch.Tensor):
            raise TypeError(f"{name} must be None or a torch.Tensor, got {type(ds).__name__}")
        if ds.dtype != torch.float32:
            raise TypeError(f"{name} must be torch.float32, got {ds.dtype}")
        if tuple(ds.shape) != (batch, heads_kv):
            raise ValueError(f"{name} must have shape (batch, nheads_kv) = ({batch}, {heads_kv}), "
                             f"got {tuple(ds.shape)}")
        problem = memory_problem(name, ds)  # the kernel reads descales through their address too
        if problem:
            raise ValueError(problem)
    _check_scale(softmax_scale)
    if softcap:
        _check_softcap_scale(softcap, softmax_scale, d)
    given = {n: ds for n, ds in zip(("q_descale", "k_descale", "v_descale"), descales) if ds is not None}
    _check_devices({**dict(zip(_NAMES, (q, k, v))), **other_tensors, **given})
    return policy


def validate_fp8_fwd_inputs(q, k, v, descales, out_dtype, softmax_scale, softcap=0.0):
    """validate_fwd_inputs for the FP8 forward (dense (batch, seqlen, nheads, headdim)
    tensors): returns (policy, no_kernel) with no_kernel as validate_fwd_inputs'."""
    tensors = dict(zip(_NAMES, (q, k, v)))
    for name, t in tensors.items():
        _check_is_tensor(name, t)
    for name, t in tensors.items():
        _check_rank(name, t, 4, _DENSE_SHAPE)
    _check_shapes(q, k, v)
    policy = validate_fp8_operands(q, k, v, descales, out_dtype, q.shape[0], softmax_scale, softcap)
    return policy, (q.numel() == 0 or k.shape[1] == 0)


def validate_varlen_fwd_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, check_cu_seqlens=None, *, softcap=0.0, fp8=None):
    """Everything mha_varlen needs before a launch: the packed shapes and cu_seqlens
    (validate_varlen_inputs), then dtype, head dim, TMA layout, scale, and the device
    checks of validate_fwd_inputs, applied to (total, nheads, headdim) tensors; last, once
    all of that holds, the values of cu_seqlens (check_cu_seqlens: None reads them unless
    a CUDA graph is being captured, True always, False never). softcap as in
    validate_fwd_inputs. Returns the batch. Zero total tokens (or heads) pass: the
    caller returns empty outputs without a kernel."""
    if check_cu_seqlens is not None and not isinstance(check_cu_seqlens, bool):
        raise TypeError(
            f"check_cu_seqlens must be None, True or False, got {type(check_cu_seqlens).__name__}"
        )
    batch = validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, check_values=False)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None:
            raise TypeError(f"{name} must be a Python int (the longest sequence), got None")
    if fp8 is not None:
        validate_fp8_operands(q, k, v, *fp8, batch, softmax_scale, softcap,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    else:
        policy = _check_dtypes(q, k, v)
        _check_operands(dict(zip(_NAMES, (q, k, v))), policy, softmax_scale, softcap,
                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if check_cu_seqlens is not False:
        capturing = _capturing_cuda_graph()
        if check_cu_seqlens and capturing:
            raise ValueError(
                "check_cu_seqlens=True reads cu_seqlens on the host, which cannot happen while a "
                "CUDA graph is being captured; check them before capture and pass "
                "check_cu_seqlens=False (or None) inside it"
            )
        if not capturing:
            # True reads them again even when remembered (writes behind the version counter)
            _check_cu_seqlens_once(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   again=check_cu_seqlens is True)
    # also where the offsets are not read (capture, check_cu_seqlens=False): some sequence
    # of batch holding total tokens is at least total / batch long, so a max_seqlen below
    # that is wrong whatever the offsets (the rows past it would be left unwritten)
    for name, value, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]), ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        if batch > 0 and value * batch < total:
            raise ValueError(f"{name} must be >= the longest sequence: {batch} sequences hold {total} tokens "
                             f"(cu_seqlens must end at the packed total: no padding rows), so one has at least "
                             f"{-(-total // batch)}; got {value}")
    return batch


# Offsets already checked: tensor -> (its version counter, total tokens, max_seqlen) at
# the time. A model passes one cu_seqlens tensor to every layer, so only its first call
# reads it on the host; torch bumps _version on any in-place write (views included), and
# a new tensor is a new key even at a recycled address. Keys are weak and compared by
# identity (a plain WeakKeyDictionary would compare tensors with ==).
_checked_offsets = WeakIdKeyDictionary()


def _check_cu_seqlens_once(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, again=False):
    """check_cu_seqlens_values, unless these tensors were checked at their current version
    with these totals and maxima (again: check anyway, and remember the result)."""
    if cu_seqlens_q.is_inference() or cu_seqlens_k.is_inference():
        # inference tensors keep no version counter: nothing to remember them by, so every
        # call reads them (a sync per call: check_cu_seqlens=False skips it)
        check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return
    states = ((cu_seqlens_q, (cu_seqlens_q._version, q.shape[0], max_seqlen_q)),
              (cu_seqlens_k, (cu_seqlens_k._version, k.shape[0], max_seqlen_k)))
    if not again and all(_checked_offsets.get(t) == state for t, state in states):
        return
    check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for t, state in states:
        _checked_offsets[t] = state


def _capturing_cuda_graph():
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                            max_seqlen_k=None):
    """The values of a packed batch's offsets: start at 0, non-decreasing, end at q's and
    k's total tokens, max_seqlen (when given) at least the longest sequence: the kernels
    size their grid by max_seqlen and trust the offsets, so a broken one would leave rows
    of out unwritten or read another sequence's rows. On a GPU this is one device-to-host
    copy of both tensors (equal lengths, checked before), hence one synchronisation."""
    offsets_q, offsets_k = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()
    _check_offsets("cu_seqlens_q", offsets_q, "q", q.shape[0], "max_seqlen_q", max_seqlen_q)
    _check_offsets("cu_seqlens_k", offsets_k, "k", k.shape[0], "max_seqlen_k", max_seqlen_k)


def _is_int(value):
    # bool is an int subclass but never a meaningful size; numpy ints are Integral.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def validate_window_size(window_size):
    """Return window_size as a (left, right) tuple of Python ints.

    FlashAttention's sliding window: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 leaves that
    side unbounded, so (-1, -1) is no window and (-1, 0) is causal.
    """
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(
            "window_size must be a (left, right) tuple of ints, -1 for unbounded, "
            f"got {type(window_size).__name__}"
        )
    if len(window_size) != 2:
        raise ValueError(
            f"window_size must have 2 entries (left, right), got {len(window_size)}: "
            f"{tuple(window_size)}"
        )
    for side, value in zip(("left", "right"), window_size):
        if not _is_int(value):
            raise TypeError(
                f"window_size {side} must be an int (-1 for unbounded), "
                f"got {type(value).__name__}"
            )
        if value < -1:
            raise ValueError(
                f"window_size {side} must be >= -1 (-1 for unbounded), got {value}"
            )
    return int(window_size[0]), int(window_size[1])


def validate_softcap(softcap):
    """Return softcap as a float: 0 (off) or a finite positive cap (Gemma 2 uses 30 / 50)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(
            f"softcap must be a Python float/int (0 for off), got {type(softcap).__name__}"
        )
    if not _finite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be 0 (off) or a finite positive number, got {softcap}")
    if softcap and not FOLD_MIN <= softcap <= FOLD_MAX:
        raise ValueError(
            f"softcap must be 0 (off) or in {_FOLD_RANGE}, where it and softcap * log2(e) "
            f"(which the kernel computes) are normal, finite float32 numbers, got {softcap}"
        )
    return float(softcap)


def validate_gqa_heads(q, k, v, names=_NAMES):
    """Return the group size nheads // nheads_kv after checking the head counts.

    Heads are dim -2 of q, k and v, so this serves the dense (batch, seqlen, nheads,
    headdim) layout and the packed varlen (total, nheads, headdim) one alike. k and v
    must have the same number of heads, which must divide q's (GQA; 1 head is MQA).
    q with 0 heads (an empty call) returns 0 whatever k's heads; k with 0 heads for
    q's nonzero heads is an error. names: the three arguments' names in the messages
    (a KV cache's are "k_cache", "v_cache").
    """
    q_name, k_name, v_name = names
    for name, t in zip(names, (q, k, v)):
        _check_is_tensor(name, t)
        if t.dim() < 3:
            raise ValueError(
                f"{name} must have a heads dimension (dim -2), got shape {tuple(t.shape)}"
            )
    nheads, nheads_k, nheads_v = q.shape[-2], k.shape[-2], v.shape[-2]
    if nheads_v != nheads_k:
        raise ValueError(f"{v_name} nheads must equal {k_name} nheads ({nheads_k}), got {nheads_v}")
    if nheads == 0:  # no query heads: an empty call (any k/v heads, 0 included)
        return 0
    if nheads_k < 1 or nheads % nheads_k:
        raise ValueError(
            f"{k_name} nheads must divide {q_name} nheads ({nheads}): each group of "
            f"{q_name} nheads / {k_name} nheads query heads shares one k/v head (GQA/MQA), got {nheads_k}"
        )
    return nheads // nheads_k


def validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, *, check_values=None):
    """Check a packed variable-length batch; return its batch size.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim). cu_seqlens_q and
    cu_seqlens_k: torch.int32, 1-D, length batch + 1, on q's device; sequence b is rows
    cu_seqlens[b]:cu_seqlens[b+1]. max_seqlen_q / max_seqlen_k: None or an int >= 0.

    The values (start at 0, non-decreasing, end at total_q / total_k, the max_seqlens at
    least the longest sequence) need the tensors on the host. check_values=None checks them
    only when cu_seqlens are on the CPU, so a launch path never synchronises; True checks
    them anywhere (one device sync per tensor), False never. dtype, head dim, strides and
    the device capability are validate_varlen_fwd_inputs' business (the checks it shares
    with validate_fwd_inputs).
    """
    for name, t in zip(_NAMES, (q, k, v)):
        _check_is_tensor(name, t)
        _check_rank(name, t, 3, _VARLEN_SHAPE)
    _check_equal("v", "total tokens", v.shape[0], k.shape[0], ref="k")
    for name, t in (("k", k), ("v", v)):
        _check_equal(name, "headdim", t.shape[2], q.shape[2])
    validate_gqa_heads(q, k, v)

    cu = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    for name, t in cu.items():
        _check_is_tensor(name, t)
        if t.dtype != torch.int32:
            raise TypeError(
                f"{name} must be torch.int32, got {t.dtype}; cast with .to(torch.int32)"
            )
        if t.dim() != 1:
            raise ValueError(
                f"{name} must be 1-D (batch + 1 offsets), got shape {tuple(t.shape)}"
            )
        if t.shape[0] < 2:
            raise ValueError(
                f"{name} must have length batch + 1 >= 2, got length {t.shape[0]}"
            )
        if t.stride(0) != 1:  # the kernels read it as a compact vector
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}; call .contiguous()")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(
            f"cu_seqlens_k must have the same length as cu_seqlens_q (batch + 1 = "
            f"{cu_seqlens_q.shape[0]}), got {cu_seqlens_k.shape[0]}"
        )
    _check_grid_extents(cu_seqlens_q.shape[0] - 1, q.shape[1], "the number of sequences")
    maxes = {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k}
    for name, value in maxes.items():
        if value is None:
            continue
        if not _is_int(value):
            raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")

    for name, t in cu.items():
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}; cu_seqlens must be on "
                "q's device"
            )

    if check_values is None:
        check_values = all(t.device.type == "cpu" for t in cu.values())
    if check_values:
        check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return cu_seqlens_q.shape[0] - 1


def _check_offsets(name, offsets, tensor_name, total, max_name, max_seqlen):
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(
                f"{name} must be non-decreasing, got {offsets[i]} then {offsets[i + 1]} "
                f"at index {i}"
            )
    if offsets[-1] != total:
        raise ValueError(
            f"{name} must end at {tensor_name}'s total tokens ({total}), got {offsets[-1]}"
        )
    if max_seqlen is not None and max_seqlen < max(lengths):
        raise ValueError(
            f"{max_name} must be >= the longest sequence in {name} ({max(lengths)}), "
            f"got {max_seqlen}"
        )
