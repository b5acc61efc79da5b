"""Programmable masks and score modifications, FlexAttention style (issue 14).

The kernels know three fixed mask kinds (config.MASK_KINDS). Models need more: block
diffusion (BD3LM), prefix-LM, packed documents, ALiBi... FlexAttention's answer is to let
the caller describe the mask as a function of the indices and compile it into the kernel.
This module holds that vocabulary:

- a *mask mod* ``mask_mod(b, h, q_idx, kv_idx[, seq]) -> bool``: may query q_idx of batch
  entry b, query head h, see key kv_idx? (True = visible);
- a *score mod* ``score_mod(score, b, h, q_idx, kv_idx[, seq]) -> score``: rewrites the
  scaled score (softmax_scale * q.k) before the mask and the softmax.

The optional last argument ``seq`` (a SeqInfo) carries what a mod may read besides the
indices: ``seq.aux``, the auxiliary tensors given with the mod (document ids, prefix
lengths, ALiBi slopes), and the entry's ``seqlen_q``, ``seqlen_k``, ``offset_q``,
``offset_k``. Indices are global: with packed (varlen) batches q_idx = offset_q + the
position in the sequence (likewise kv_idx), so an aux tensor laid out like the packed
tokens is indexed directly; dense batches have offsets 0. Lengths are run-time values,
so a mod that reads them (causal, block_diffusion) never recompiles per length.

One function body serves two callers. The reference (mask_reference.py) and the block-mask
builder (block_mask.py) call it with broadcasting int64 torch tensors and torch aux
tensors; the kernels call it with scalar Int32 indices and CuTe tensors while the DSL
traces the kernel. So a body uses only what both understand: comparisons, integer
arithmetic (+ - * // %), & | ~ on the booleans, indexing an aux tensor by indices
(``seq.aux[0][b, q_idx]``), and ``as_float`` to turn an integer into a float. No Python
``if`` on index values, no torch-only calls. Python values captured by the closure (a
block size, a window) are compile-time constants: they go into the kernel's cache key.

A ``Modifier`` binds a function to its aux tensors; the built-ins below return one, and
``Modifier.of`` wraps a plain function (with ``aux_tensors``) the same way.

The backward differentiates a score mod itself (no paired score_mod_bwd): the kernel
traces the body once more with the score as a ``Dual`` number (its value and its
derivative with respect to the score), so ``+ - * /`` with constants, index expressions
and aux reads carry the derivative along (forward-mode differentiation at trace time,
nothing at run time but the arithmetic). Beyond arithmetic a score mod may call
``tanh`` (a logit softcap); any other function of the score cannot be differentiated
and fails the backward's compile with a message naming the mod.
"""

import copy
import functools
import hashlib
import inspect
import math
import types
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from cute_attn.validation import validate_window_size


class SeqInfo(NamedTuple):
    """What a mod may read besides the indices (ints and torch tensors in the reference,
    Int32 and CuTe tensors in a kernel)."""

    aux: tuple = ()
    seqlen_q: object = 0
    seqlen_k: object = 0
    offset_q: object = 0
    offset_k: object = 0


def as_float(x):
    """An integer index expression as float32, in torch and in a kernel alike."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float32)
    if isinstance(x, int):
        return float(x)
    from cutlass import Float32

    return Float32(x)


class Dual:
    """A score and its derivative d(value)/d(score), for the backward's trace of a score
    mod (see the module docstring). value and grad are DSL Float32 (grad may be a Python
    float where it is a constant, which keeps it out of the kernel); anything else in an
    expression (an index, an aux value, a Python number) is a constant."""

    __slots__ = ("value", "grad")

    def __init__(self, value, grad=1.0):
        self.value, self.grad = value, grad

    @staticmethod
    def parts(x):
        return (x.value, x.grad) if isinstance(x, Dual) else (x, 0.0)

    def __add__(self, other):
        v, g = Dual.parts(other)
        return Dual(self.value + v, self.grad + g if isinstance(other, Dual) else self.grad)

    __radd__ = __add__

    def __sub__(self, other):
        v, g = Dual.parts(other)
        return Dual(self.value - v, self.grad - g if isinstance(other, Dual) else self.grad)

    def __rsub__(self, other):
        return Dual(other - self.value, -self.grad)

    def __neg__(self):
        return Dual(-self.value, -self.grad)

    def __mul__(self, other):
        if not isinstance(other, Dual):
            return Dual(self.value * other, self.grad * other)
        return Dual(self.value * other.value, self.grad * other.value + self.value * other.grad)

    __rmul__ = __mul__

    def __truediv__(self, other):
        if not isinstance(other, Dual):
            return Dual(self.value / other, self.grad / other)
        quotient = self.value / other.value
        return Dual(quotient, (self.grad - quotient * other.grad) / other.value)

    def __rtruediv__(self, other):
        quotient = other / self.value
        return Dual(quotient, -quotient * self.grad / self.value)

    def _undifferentiable(self, *args):
        raise TypeError("a score mod's backward differentiates it through + - * / and masks.tanh only; "
                        "comparisons, selects and other functions of the score are not supported")

    __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __pow__ = __rpow__ = __abs__ = _undifferentiable


def tanh(x):
    """tanh in a mod body: on torch tensors, on a kernel's Float32, and on the backward's
    Dual (derivative 1 - tanh^2)."""
    if isinstance(x, torch.Tensor):
        return torch.tanh(x)
    if isinstance(x, Dual):
        t = tanh(x.value)
        return Dual(t, x.grad * (1.0 - t * t))
    if isinstance(x, (int, float)):
        return math.tanh(x)
    import cutlass.cute as cute

    return cute.math.tanh(x, fastmath=True)


def _identity(value, where: str, seen: Optional[set] = None):
    """A hashable, process-independent stand-in for a value a mod's closure captures."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_identity(v, where, seen) for v in value)
    if isinstance(value, Modifier):
        return value.key
    if isinstance(value, types.FunctionType):
        return _function_identity(value, seen)
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{where} captures a torch tensor; a kernel cannot read it from Python: pass it "
            "as an aux tensor (aux_tensors=...) and read it as seq.aux[i]"
        )
    raise TypeError(f"{where} captures a {type(value).__name__}; only Python scalars, tuples and functions can be "
                    "compiled into a kernel")


def _code_identity(code):
    """A code object by its bytecode, constants (nested code objects recursively: their
    repr holds an address) and names: stable across processes."""
    consts = tuple(_code_identity(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return (code.co_code, consts, code.co_names)


def _function_identity(fn, seen: Optional[set] = None):
    """The function's code, its captured values, its defaults and the module globals it
    reads (_globals_identity): two closures of one body with other constants (block sizes,
    windows; `lambda ..., w=w` in a loop) are different kernels, and so are two versions of
    a helper it calls or of a constant it reads."""
    where = fn.__qualname__
    seen = set() if seen is None else seen
    if id(fn) in seen:  # (mutually) recursive helpers: named once
        return ("seen", fn.__module__, fn.__qualname__)
    seen.add(id(fn))
    cells = tuple(_identity(c.cell_contents, where, seen) for c in fn.__closure__ or ())
    defaults = _identity(fn.__defaults__ or (), where, seen)
    kwdefaults = tuple(sorted((k, _identity(v, where, seen)) for k, v in (fn.__kwdefaults__ or {}).items()))
    return (fn.__module__, fn.__qualname__, _code_identity(fn.__code__), cells, defaults, kwdefaults,
            _globals_identity(fn, seen))


def _global_names(code) -> set:
    """The names a code object (and the code nested in it) looks up: globals among them."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


# functions of these packages are keyed by name: their code is keyed already (cute_attn's
# sources and the DSL's version, compile_cache.versions) or never reaches a kernel
_KEYED_BY_NAME = ("cute_attn", "cutlass", "torch", "numpy", "math", "builtins", "functools", "operator")


def _globals_identity(fn, seen: set) -> tuple:
    """The module globals fn reads that decide what its kernel computes: the code of the
    helper functions it calls (a mod's bytecode names a helper but does not hold it: an
    edited helper would load the old kernel from the disk cache, and in one process reuse
    the old one) and the Python scalars it reads (a module-level block size). Modules,
    classes and other objects are not keyed (their attribute names are in co_names)."""
    keyed = []
    for name in sorted(_global_names(fn.__code__)):
        if name not in fn.__globals__:
            continue
        value = fn.__globals__[name]
        if isinstance(value, types.FunctionType):
            if (value.__module__ or "").split(".")[0] in _KEYED_BY_NAME:
                keyed.append((name, value.__module__, value.__qualname__))
            else:
                keyed.append((name, _function_identity(value, seen)))
        elif value is None or isinstance(value, (bool, int, float, str)) or (
                isinstance(value, tuple) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value)):
            keyed.append((name, value))
    return tuple(keyed)


def _callable_identity(fn):
    """A mod's body as a key: a function (_function_identity), a functools.partial of one
    (its function, arguments and keywords), or an object whose class defines __call__ (the
    method and the object's attributes). Anything else cannot be keyed: a TypeError, never
    two different mods sharing a kernel."""
    if isinstance(fn, types.FunctionType):
        return _function_identity(fn)
    where = type(fn).__qualname__
    if isinstance(fn, functools.partial):
        keywords = tuple(sorted((k, _identity(v, where)) for k, v in fn.keywords.items()))
        return ("partial", _callable_identity(fn.func), _identity(fn.args, where), keywords)
    call = getattr(type(fn), "__call__", None)
    if isinstance(call, types.FunctionType) and hasattr(fn, "__dict__"):
        state = tuple(sorted((k, _identity(v, where)) for k, v in vars(fn).items()))
        return ("object", type(fn).__module__, where, _function_identity(call), state)
    raise TypeError(f"a mod must be a Python function, a functools.partial of one or an object with a "
                    f"__call__ method, got {type(fn).__name__}")


class ModSpec:
    """A mod's static part, what a compiled kernel is specialised on: the body, whether
    it takes seq, and its key (code, captured constants, the aux tensors' dtypes and
    ranks). Equal keys are the same kernel."""

    def __init__(self, kind: str, fn: Callable, takes_seq: bool, name: str, key: tuple, aux_signature: tuple,
                 token_aux: bool = False):
        self.kind, self.fn, self.takes_seq, self.name, self.key = kind, fn, takes_seq, name, key
        self.aux_signature = aux_signature  # ((torch dtype, ndim), ...) of the aux tensors
        # an aux tensor indexed by token position (aux_extents "tokens", e.g. document ids):
        # a load per key column of each tile, which the forward issues before its scores
        # exist (config.FwdConfig.mask_before_scores). Not in the key: a config choice.
        self.token_aux = token_aux
        # names the kernel in compile_cache's on-disk key (which hashes the key's repr)
        self.digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        self._hash = hash(key)  # the key holds bytecode: hash it once, not per lookup

    def __call__(self, *args, seq: SeqInfo):
        return self.fn(*args, seq) if self.takes_seq else self.fn(*args)

    def __eq__(self, other):
        return isinstance(other, ModSpec) and other.key == self.key

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"ModSpec({self.kind}, {self.name}, {self.digest})"


class Modifier:
    """A mask or score mod with the aux tensors it reads.

    kind: "mask" or "score". fn: the body (see the module docstring), taking ``seq`` last
    or not. spec: its static part (ModSpec), what a compiled kernel is cached by; the aux
    tensors' values are run-time arguments of the kernel. aux_extents: per aux tensor,
    None or the call dimension each of its dims is indexed by ("batch", "heads", or
    "tokens": query and key positions), so a call can refuse an aux tensor too small to
    index (check_extents) instead of reading past it; the built-ins give theirs.

    Called directly (mod(b, h, q_idx, kv_idx), to draw it or hand it to another library)
    without ``seq``, it sees SeqInfo(aux): lengths and offsets 0. Mods that read the
    lengths (block_diffusion's halves) then give another mask: pass
    seq=SeqInfo(aux, seqlen_q, seqlen_k) as the kernels do.
    """

    def __init__(self, kind: str, fn: Callable, aux: Sequence[torch.Tensor] = (), name: Optional[str] = None,
                 aux_extents: Sequence[Optional[tuple]] = ()):
        if torch.compiler.is_compiling():
            # the key below reads bytecode and hashes it, which dynamo cannot trace
            raise RuntimeError("a mask/score mod cannot be made inside a torch.compile'd function: make it outside "
                               "(masks.document(ids), Modifier(...), once per step if its aux tensors change) and "
                               "pass it in; a new mod with the same body and constants does not recompile")
        if kind not in ("mask", "score"):
            raise ValueError(f"kind must be 'mask' or 'score', got {kind!r}")
        if not callable(fn):
            raise TypeError(f"a {kind} mod must be callable, got {type(fn).__name__}")
        index_args = 4 if kind == "mask" else 5
        try:
            params = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            params = []
        if len(params) not in (index_args, index_args + 1):
            what = "(b, h, q_idx, kv_idx[, seq])" if kind == "mask" else "(score, b, h, q_idx, kv_idx[, seq])"
            raise TypeError(f"a {kind} mod takes {what}, got {getattr(fn, '__name__', fn)} with {len(params)} "
                            "positional parameters")
        self.kind = kind
        self.fn = fn
        self.takes_seq = len(params) == index_args + 1
        self.aux = tuple(aux)
        for i, t in enumerate(self.aux):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"aux tensor {i} must be a torch.Tensor, got {type(t).__name__}")
        if self.aux and not self.takes_seq:
            raise TypeError(f"{getattr(fn, '__name__', fn)} has aux tensors but no seq parameter to read them")
        self.aux_extents = tuple(aux_extents) or (None,) * len(self.aux)
        self.name = name or getattr(fn, "__name__", kind + "_mod")
        # computed now, not on first use: torch.compile may trace that first use, and the
        # key's bytecode walk and hash are not traceable (a captured tensor raises here)
        body = _callable_identity(fn)
        aux_signature = tuple((t.dtype, t.dim()) for t in self.aux)
        key = (self.kind, self.name, body, aux_signature)
        token_aux = any("tokens" in extents for extents in self.aux_extents if extents)
        self.spec = ModSpec(self.kind, fn, self.takes_seq, self.name, key, aux_signature, token_aux)
        if self.spec.digest not in _BY_DIGEST:
            template = copy.copy(self)
            template.aux = ()
            _BY_DIGEST[self.spec.digest] = template

    def check_extents(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int):
        """Raise ValueError if an aux tensor with known extents (aux_extents) is too small
        for a call of this batch, head count and lengths (a packed varlen batch: its
        totals), which the mod would index past (the kernels clamp positions into the
        sequence, not into the aux tensor)."""
        need = {"batch": batch, "heads": heads, "tokens": max(seqlen_q, seqlen_k)}
        for i, (t, extents) in enumerate(zip(self.aux, self.aux_extents)):
            for dim, what in enumerate(extents or ()):
                if t.dim() <= dim or t.shape[dim] < need[what]:
                    raise ValueError(f"{self.name}: aux tensor {i} has shape {tuple(t.shape)}, but dim {dim} is "
                                     f"indexed by {what} and this call has {what} = {need[what]}")

    def rebound(self, aux: Sequence[torch.Tensor]) -> "Modifier":
        """This mod reading other aux tensors of the same dtypes and ranks (its key)."""
        bound = copy.copy(self)
        bound.aux = tuple(aux)
        return bound

    @staticmethod
    def by_digest(digest: str) -> "Modifier":
        """The mod whose spec has this digest, bound to no aux tensors (rebound gives them):
        the custom ops name their mods by digest (ops.fwd_mods: an op's arguments are
        tensors and scalars, not functions)."""
        try:
            return _BY_DIGEST[digest]
        except KeyError:
            raise KeyError(f"no mask/score mod with digest {digest!r} was made in this process") from None

    @property
    def key(self) -> tuple:
        return self.spec.key

    @staticmethod
    def of(kind: str, mod, aux_tensors: Sequence[torch.Tensor] = ()) -> Optional["Modifier"]:
        """mod as a Modifier: None stays None, a Modifier is taken as is (aux_tensors then
        must be empty: it carries its own), a function is bound to aux_tensors."""
        if mod is None:
            return None
        if isinstance(mod, Modifier):
            if mod.kind != kind:
                raise TypeError(f"expected a {kind} mod, got a {mod.kind} mod ({mod.name})")
            if aux_tensors:
                raise ValueError(f"{mod.name} carries its own aux tensors; aux_tensors is for plain functions")
            return mod
        return Modifier(kind, mod, aux_tensors)

    def __call__(self, *args, seq: Optional[SeqInfo] = None):
        """The body on (b, h, q_idx, kv_idx) (a score mod: score first); seq defaults to
        this mod's aux tensors with zero lengths and offsets."""
        if not self.takes_seq:
            return self.fn(*args)
        if seq is None:
            seq = SeqInfo(aux=self.aux)
        return self.fn(*args, seq)

    def __repr__(self):
        return f"<{self.kind} mod {self.name}>"


# Every mod made in this process, by its spec's digest, without aux tensors
# (Modifier.by_digest); one entry per distinct kernel body and constants
_BY_DIGEST: dict = {}


def _mask(fn, name, aux=(), aux_extents=()):
    return Modifier("mask", fn, aux, name, aux_extents)


def _sub(seq: SeqInfo, start: int, mod: Modifier) -> SeqInfo:
    """seq as mod sees it inside a combination: its own slice of the aux tensors."""
    return seq._replace(aux=seq.aux[start:start + len(mod.aux)])


def _visible_all(q_idx, kv_idx):
    """True in the broadcast shape of the two indices (torch), or True (kernel)."""
    return q_idx - kv_idx == q_idx - kv_idx


# ----------------------------------------------------------------------------------------
# Mask mods
# ----------------------------------------------------------------------------------------


def causal():
    """Causal mask, bottom-right aligned like reference.visible_keys(causal=True): query i
    sees key j iff j <= i + seqlen_k - seqlen_q (positions within the entry)."""

    def causal(b, h, q_idx, kv_idx, seq):
        return kv_idx - seq.offset_k <= q_idx - seq.offset_q + seq.seqlen_k - seq.seqlen_q

    return _mask(causal, "causal")


def sliding_window(left, right):
    """FlashAttention's local window: query i sees key j iff
    i + shift - left <= j <= i + shift + right, shift = seqlen_k - seqlen_q; -1 leaves a
    side unbounded, so (-1, 0) is causal and (-1, -1) sees all. Equal to
    reference.visible_keys(window_size=(left, right))."""
    left, right = validate_window_size((left, right))

    def sliding_window(b, h, q_idx, kv_idx, seq):
        diag = q_idx - seq.offset_q + seq.seqlen_k - seq.seqlen_q  # the query's aligned key
        key = kv_idx - seq.offset_k
        visible = _visible_all(q_idx, kv_idx)
        if right >= 0:  # static: fixed when the mod is built, not per index
            visible = visible & (key <= diag + right)
        if left >= 0:
            visible = visible & (key >= diag - left)
        return visible

    return _mask(sliding_window, f"sliding_window_{left}_{right}")


# above any block index (exact while seqlen < 2^30 * block_size; the largest code,
# 2^29 + a block index, stays in int32): a noisy key's code offset (block_diffusion)
_NOISY = 1 << 29


def block_diffusion(block_size):
    """BD3LM's block-diffusion mask (Arriola et al., "Block Diffusion", 2025).

    The training input is the sequence twice: the noisy half x_t at positions [0, L),
    then the clean half x_0 at [L, 2L), with L = seqlen_k // 2 on both sides: the queries
    are all 2L tokens (self-attention), or the noisy L alone against the 2L keys (their
    rows of the same mask). The length is read at run time, so one kernel serves every L.
    Both halves are cut into blocks
    of block_size tokens, block(p) = (p mod L) // block_size (the last block is shorter
    when block_size does not divide L). Query i sees key j iff

    - i noisy, j noisy: block(j) == block(i)  -- a noisy block denoises itself
      bidirectionally (block diagonal);
    - i noisy, j clean: block(j) <  block(i)  -- conditioned on the clean blocks before
      it (offset block causal);
    - i clean, j clean: block(j) <= block(i)  -- the clean half is block-causal, as in
      autoregressive decoding with a KV cache;
    - i clean, j noisy: never.

    With an odd length 2L + 1 the clean half gets the extra token (position L of it).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")

    def block_diffusion(b, h, q_idx, kv_idx, seq):
        # L from the keys (x_t ++ x_0): with only the noisy queries, seqlen_q // 2 would
        # split them and the keys at L / 2 (session 32's review)
        half = seq.seqlen_k // 2
        q, kv = q_idx - seq.offset_q, kv_idx - seq.offset_k
        q_clean, kv_clean = q >= half, kv >= half
        # p mod L for p < 2L, without a division by the run-time L
        q_block = (q - half * q_clean) // block_size
        kv_block = (kv - half * kv_clean) // block_size
        # One code per key, two bounds per query, so a kernel keeps one register per key
        # column across a tile's rows (with a block and a flag per key, BD3LM's forward
        # spilled 60-136 bytes, ptxas): a clean key's code is its block, a noisy key's
        # _NOISY + its block. A noisy query sees codes < its block (earlier clean blocks)
        # and == _NOISY + its block (its own noisy block); a clean query sees codes <= its
        # block and equals nothing (-1).
        code = kv_block + _NOISY * ~kv_clean
        below = q_block + q_clean
        same = (q_block + _NOISY + 1) * ~q_clean - 1
        return (code < below) | (code == same)

    return _mask(block_diffusion, f"block_diffusion_{block_size}")


def prefix_lm(prefix_lens):
    """Prefix-LM: in batch entry b, query i sees key j iff j < prefix_lens[b] (the prefix
    is visible to every query, bidirectionally) or j <= i (causal beyond it).

    prefix_lens: (batch,) int32 tensor (a sequence is converted); 0 is plain causal
    attention, a length >= seqlen is full bidirectional attention. Self-attention
    (top-left aligned, positions within the entry).
    """
    # (a sequence or array is copied: wrapping a numpy buffer the caller later refills
    # would change the ids behind torch's version counter, so a cached block mask went stale)
    lens = torch.tensor(prefix_lens, dtype=torch.int32) if not isinstance(prefix_lens, torch.Tensor) \
        else prefix_lens
    if lens.dim() != 1 or lens.is_floating_point() or lens.dtype == torch.bool:
        raise ValueError(f"prefix_lens must be a 1-D (batch,) integer tensor, got {lens.dtype} {tuple(lens.shape)}")

    def prefix_lm(b, h, q_idx, kv_idx, seq):
        key = kv_idx - seq.offset_k
        return (key < seq.aux[0][b]) | (key <= q_idx - seq.offset_q)

    return _mask(prefix_lm, "prefix_lm", (lens,), (("batch",),))


def document(doc_ids, causal=False):
    """Packed documents: query i sees key j iff they carry the same document id (and
    j <= i when causal).

    doc_ids: one integer id per token, (batch, seqlen) for a dense batch (indexed
    doc_ids[b, i]), or (total,) for a packed varlen batch (indexed by the global token
    index). Ids need not be contiguous or sorted (a token with an id of its own is a
    one-token document that sees only itself). Self-attention.

    The kernels read the ids as given, at each call (so ids rewritten in place are seen):
    int32 ids are the fast choice. int64 ids, torch's default, take two registers per key
    column of a tile: 1-8% slower forward and backward on an H100 (perf/NOTES.md, session
    21). `doc_ids.to(torch.int32)` is exact while the ids fit in 32 bits.
    """
    # a copy unless a tensor (as prefix_lm: a refilled numpy buffer bypasses the version
    # counter that the block-mask cache reads)
    ids = doc_ids if isinstance(doc_ids, torch.Tensor) else torch.tensor(doc_ids)
    if ids.dim() not in (1, 2) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"doc_ids must be a (batch, seqlen) or (total,) integer tensor, got {ids.dtype} of "
                         f"shape {tuple(ids.shape)}")
    packed = ids.dim() == 1

    def document(b, h, q_idx, kv_idx, seq):
        d = seq.aux[0]
        same = (d[q_idx] == d[kv_idx]) if packed else (d[b, q_idx] == d[b, kv_idx])
        if causal:
            same = same & (kv_idx <= q_idx)
        return same

    return _mask(document, "document_causal" if causal else "document", (ids,),
                 ((("tokens",) if packed else ("batch", "tokens")),))


def and_masks(*mask_mods):
    """Visible iff every mod says visible (no mods: everything visible)."""
    mods = tuple(Modifier.of("mask", m) for m in mask_mods)
    starts = [sum(len(m.aux) for m in mods[:i]) for i in range(len(mods))]

    def and_masks(b, h, q_idx, kv_idx, seq):
        visible = _visible_all(q_idx, kv_idx)
        for mod, start in zip(mods, starts):
            visible = visible & mod(b, h, q_idx, kv_idx, seq=_sub(seq, start, mod))
        return visible

    return _mask(and_masks, "and(" + ", ".join(m.name for m in mods) + ")", sum((m.aux for m in mods), ()),
                 sum((m.aux_extents for m in mods), ()))


def or_masks(*mask_mods):
    """Visible iff some mod says visible (no mods: nothing visible)."""
    mods = tuple(Modifier.of("mask", m) for m in mask_mods)
    starts = [sum(len(m.aux) for m in mods[:i]) for i in range(len(mods))]

    def or_masks(b, h, q_idx, kv_idx, seq):
        visible = ~_visible_all(q_idx, kv_idx)
        for mod, start in zip(mods, starts):
            visible = visible | mod(b, h, q_idx, kv_idx, seq=_sub(seq, start, mod))
        return visible

    return _mask(or_masks, "or(" + ", ".join(m.name for m in mods) + ")", sum((m.aux for m in mods), ()),
                 sum((m.aux_extents for m in mods), ()))


# ----------------------------------------------------------------------------------------
# Score mods
# ----------------------------------------------------------------------------------------


def softcap(cap):
    """Gemma 2's logit softcap as a score mod: cap * tanh(score / cap) (mha's softcap=,
    for combining with a mask mod)."""
    if not isinstance(cap, (int, float)) or cap <= 0:
        raise ValueError(f"softcap must be a positive number, got {cap!r}")
    cap = float(cap)

    def softcap(score, b, h, q_idx, kv_idx):
        return tanh(score * (1.0 / cap)) * cap

    return Modifier("score", softcap, (), f"softcap_{cap}")


def alibi(slopes):
    """ALiBi (Press et al.): score + slopes[h] * (j - i - shift), positions within the
    entry, shift = seqlen_k - seqlen_q (bottom-right aligned).

    The sign follows FlashAttention's alibi_slopes: slopes are positive (the usual
    2^(-8k/H)) and the bias is -slope * distance for keys at or before the aligned
    diagonal, so farther keys are penalised. Under a causal mask this is exactly
    FlashAttention's bias -slope * |i + shift - j|. Keys after the diagonal (visible only
    without a causal mask) get +slope * distance here, whereas FlashAttention's
    non-causal ALiBi is symmetric: pair alibi with a causal mask to match FlashAttention.

    slopes: (heads,) float32 tensor (a sequence is converted), indexed by the query head.
    """
    s = torch.as_tensor(slopes, dtype=torch.float32) if not isinstance(slopes, torch.Tensor) else slopes
    if s.dim() != 1 or s.dtype != torch.float32:
        raise ValueError(f"slopes must be a 1-D (heads,) float32 tensor, got {s.dtype} {tuple(s.shape)}")

    def alibi(score, b, h, q_idx, kv_idx, seq):
        if isinstance(score, Dual):
            # the backward's trace: there the distance converted per element measured 3%
            # faster at head dim 64 than the per-column form below (H100, twice; level at
            # 128; perf/NOTES.md, session 21). Both are slope x the exact distance rounded
            # once, so the backward recomputes the forward's scores bit for bit.
            distance = (kv_idx - seq.offset_k) - (q_idx - seq.offset_q) - (seq.seqlen_k - seq.seqlen_q)
            return score + seq.aux[0][h] * as_float(distance)
        # the distance as a difference of two floats: a thread's rows share its columns'
        # key positions, so the int -> float conversions run per column and per row, not
        # per element (forward +3-7%); the difference of integers below 2^24 is exact, so
        # the bias is slope * distance rounded once (slope * key - slope * query would
        # cancel: 6e-2 off near the diagonal at 1M positions)
        key = as_float(kv_idx - seq.offset_k)
        query = as_float((q_idx - seq.offset_q) + (seq.seqlen_k - seq.seqlen_q))
        return score + seq.aux[0][h] * (key - query)

    return Modifier("score", alibi, (s,), "alibi", (("heads",),))
