"""Block masks: which (query tile, KV tile) pairs a mask mod leaves empty, partial or full,
as the tile lists the forward kernel walks (issue 14).

Evaluating a mask mod on every pair of every tile would cost the kernel as much as the
attention it saves, so the mask is summarised per tile once, on the GPU, with torch: the
mod is called with broadcast index tensors over a chunk of query tiles at a time (a
mod's body works on torch tensors and in the kernel alike, see masks.py), and each tile
is classified:

- EMPTY: no pair visible: the kernel never loads the KV tile;
- FULL: every pair visible and no key past the sequence end: computed without calling
  the mod;
- PARTIAL: the rest: computed, then the mod is evaluated per element (and keys past the
  end are masked).

Per query tile the forward gets two lists, the PARTIAL KV tiles and the FULL ones, each
from the last tile to the first (the order of the dense kernel). The backward walks the
other way, per KV tile its query tiles (first to last), at its own tile shape: a
transposed BlockMask, which mha builds (and caches) itself. The layout is
FlexAttention's (kv_num_blocks / kv_indices and full_kv_num_blocks / full_kv_indices),
the classes are mask_reference.block_mask's, which tests/test_block_mask_*.py hold it
to. A mod that ignores the batch or head index gets lists of batch (or heads) 1, expanded
with stride 0 at the call; a mask mod that does depend on them costs one evaluation each.

Build once per (mask, shape) with create_block_mask and pass it to every layer; mha
builds (and caches, by the mod's key, its aux tensors' identity and the shape) one when
none is given.
"""

import math
import numbers
import weakref
from collections import OrderedDict
from typing import NamedTuple, Optional

import torch

from cute_attn.bounded_cache import outside_private_pools
from cute_attn.masks import Modifier, SeqInfo

EMPTY, PARTIAL, FULL = 0, 1, 2

# pairs evaluated per chunk of query tiles (bools, plus the int64 index tensors): bounds
# the builder's memory at 16K x 16K and beyond
_CHUNK_PAIRS = 1 << 27


class BlockMask(NamedTuple):
    """The tile lists of one mask at one shape and tile size (see the module docstring).

    partial_count, full_count: int32 (B', H', tiles_m); partial_idx, full_idx: int32
    (B', H', tiles_m, tiles_n), the first count entries of a row are KV tiles, last to
    first; the rest -1. B' is batch or 1 (the mod ignores b), H' heads or 1.
    transposed (the backward's): per KV tile its query tiles, first to last, so the
    lists are (B', H', tiles_n[, tiles_m]); dq_turn then int32 (B', H', tiles_n,
    tiles_m): how many KV tiles before n visit query tile m, the turn at which KV tile n
    adds its dQ there in the deterministic backward (None in a forward mask). A varlen
    mask (cu_seqlens set) has a row per sequence, tiles counted within the sequence and
    sized by the longest one; tiles past a shorter sequence's end are EMPTY."""

    partial_count: torch.Tensor
    partial_idx: torch.Tensor
    full_count: torch.Tensor
    full_idx: torch.Tensor
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    tile_m: int
    tile_n: int
    mod_key: tuple
    transposed: bool = False
    dq_turn: Optional[torch.Tensor] = None
    # a packed varlen batch's mask (build_varlen_block_mask): the (cu_seqlens_q,
    # cu_seqlens_k) values it was built for, as tuples; batch is then the number of
    # sequences and seqlen_q / seqlen_k the longest ones. None: a dense batch's
    cu_seqlens: Optional[tuple] = None

    def kernel_tensors(self):
        """The four lists expanded to (batch, heads, ...) (stride 0 where B' or H' is 1)."""
        b, h = self.batch, self.heads
        return (self.partial_count.expand(b, h, -1), self.partial_idx.expand(b, h, -1, -1),
                self.full_count.expand(b, h, -1), self.full_idx.expand(b, h, -1, -1))

    def dq_turns(self) -> torch.Tensor:
        """dq_turn expanded to (batch, heads, tiles_n, tiles_m), as the backward takes it."""
        return self.dq_turn.expand(self.batch, self.heads, -1, -1)

    def classes(self) -> torch.Tensor:
        """int8 (B', H', tiles_m, tiles_n) of EMPTY / PARTIAL / FULL (for tests and plots)."""
        inner = self.partial_idx.shape[-1]
        # one spare column takes the writes of the unlisted (-1) entries
        out = torch.zeros(*self.partial_idx.shape[:-1], inner + 1, dtype=torch.int8, device=self.partial_idx.device)
        for idx, count, cls in ((self.partial_idx, self.partial_count, PARTIAL), (self.full_idx, self.full_count, FULL)):
            listed = torch.arange(inner, device=idx.device) < count.unsqueeze(-1)
            target = torch.where(listed, idx, inner).long()
            out.scatter_(-1, target, torch.full_like(target, cls, dtype=torch.int8))
        out = out[..., :inner]
        return out.transpose(-1, -2) if self.transposed else out

    def sparsity(self) -> float:
        """The fraction of (query tile, KV tile) pairs skipped (EMPTY)."""
        tiles = self.partial_idx.shape[-2] * self.partial_idx.shape[-1]
        visited = (self.partial_count.sum() + self.full_count.sum()).item()
        return 1.0 - visited / max(1, tiles * self.partial_count.shape[0] * self.partial_count.shape[1])


def _depends(mod: Modifier, batch: int, heads: int, seq: SeqInfo, device, first_batch: int = 0):
    """Whether the mod's result varies with b and with h: the broadcast shape of one
    evaluation at a single (q, kv) pair, the entry's first (seq's offsets; b from
    first_batch), says which index tensors it used."""
    b = torch.arange(first_batch, first_batch + batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q_idx, kv_idx = (torch.full((1, 1, 1, 1), o, dtype=torch.int64, device=device)
                     for o in (seq.offset_q, seq.offset_k))
    out = torch.as_tensor(mod(b, h, q_idx, kv_idx, seq=seq))
    shape = (1,) * (4 - out.dim()) + tuple(out.shape)
    return shape[0] != 1, shape[1] != 1


def _lists(classes: torch.Tensor, cls: int, descending: bool):
    """(count, idx) of the tiles of class cls in each row of classes, last to first
    (descending) or first to last, then -1."""
    inner = classes.shape[-1]
    position = torch.arange(inner, device=classes.device).expand_as(classes)
    hit = classes == cls
    # the unlisted sort after the listed either way, then become -1
    keys = torch.where(hit, position, torch.full_like(position, -1 if descending else inner))
    order = torch.sort(keys, dim=-1, descending=descending).values
    count = hit.sum(dim=-1, dtype=torch.int32)
    order = torch.where(order == inner, -1, order)
    return count, order.to(torch.int32)


def _classify(mod: Modifier, b: torch.Tensor, h: torch.Tensor, seq: SeqInfo, tile_m: int, tile_n: int) -> torch.Tensor:
    """int8 (len(b), len(h), tiles_m, tiles_n) classes of one (dense batch, or one packed
    sequence) at seq's lengths, the mod called with global indices (seq's offsets added),
    a chunk of query tiles at a time."""
    seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
    nb, nh = b.shape[0], h.shape[1]
    device = b.device
    tiles_m, tiles_n = math.ceil(seqlen_q / tile_m), math.ceil(seqlen_k / tile_n)
    kv_idx = torch.arange(seq.offset_k, seq.offset_k + seqlen_k, device=device).view(1, 1, 1, -1)
    classes = torch.zeros(nb, nh, tiles_m, tiles_n, dtype=torch.int8, device=device)
    pad_k = tiles_n * tile_n - seqlen_k
    tiles_per_chunk = max(1, _CHUNK_PAIRS // max(1, nb * nh * tile_m * tiles_n * tile_n))
    for m0 in range(0, tiles_m, tiles_per_chunk):
        m1 = min(tiles_m, m0 + tiles_per_chunk)
        rows = min(m1 * tile_m, seqlen_q) - m0 * tile_m
        first = seq.offset_q + m0 * tile_m
        q_idx = torch.arange(first, first + rows, device=device).view(1, 1, -1, 1)
        visible = mod(b, h, q_idx, kv_idx, seq=seq)
        if not isinstance(visible, torch.Tensor) or visible.dtype != torch.bool:
            raise TypeError(f"mask_mod {mod.name!r} must return a bool tensor, got "
                            f"{getattr(visible, 'dtype', type(visible).__name__)}")
        visible = visible.expand(nb, nh, rows, seqlen_k)
        pad_q = (m1 - m0) * tile_m - rows
        shape = (nb, nh, m1 - m0, tile_m, tiles_n, tile_n)
        # padding counts as invisible for "any", visible for "all": tiles are judged on
        # their in-bounds pairs
        any_ = torch.nn.functional.pad(visible, (0, pad_k, 0, pad_q), value=False).view(shape).any(5).any(3)
        all_ = torch.nn.functional.pad(visible, (0, pad_k, 0, pad_q), value=True).view(shape).all(5).all(3)
        classes[:, :, m0:m1] = torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)
    if pad_k and tiles_n:
        # the kernel masks keys past the end only in PARTIAL tiles: the last KV tile of a
        # length that is not a multiple of tile_n cannot be FULL
        last = classes[..., -1]
        last[last == FULL] = PARTIAL
    return classes


def _from_classes(classes, mod, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n, transposed, cu_seqlens=None):
    """The BlockMask of (B', H', tiles_m, tiles_n) classes (see BlockMask)."""
    dq_turn = None
    if transposed:
        classes = classes.transpose(-1, -2)
        # exclusive count over the KV tiles (dim -2 now) that visit each query tile
        visits = (classes != EMPTY).to(torch.int32)
        dq_turn = (visits.cumsum(dim=-2, dtype=torch.int32) - visits).contiguous()
    partial_count, partial_idx = _lists(classes, PARTIAL, descending=not transposed)
    full_count, full_idx = _lists(classes, FULL, descending=not transposed)
    return BlockMask(partial_count, partial_idx, full_count, full_idx, batch, heads, seqlen_q, seqlen_k,
                     tile_m, tile_n, mod.key, transposed, dq_turn, cu_seqlens)


def _check_ints(**values):
    """Python ints (FlexAttention's B=None / H=None is not taken: pass the call's batch
    and heads; a mod that ignores b or h keeps one row of lists anyway)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r}")


@torch.no_grad()
def build_block_mask(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int,
                     device=None, transposed: bool = False) -> BlockMask:
    """Classify every tile of mask_mod (a masks.Modifier or a plain function) at this
    shape, on device (the aux tensors' device by default), and return its tile lists
    (transposed: the backward's, per KV tile)."""
    mod = Modifier.of("mask", mask_mod)
    _check_ints(batch=batch, heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, tile_m=tile_m, tile_n=tile_n)
    if min(batch, heads, seqlen_q, seqlen_k) < 0 or min(tile_m, tile_n) < 1:
        raise ValueError(f"bad block-mask shape {(batch, heads, seqlen_q, seqlen_k)} / tile {(tile_m, tile_n)}")
    # the builder indexes the aux tensors with raw indices (the kernels clamp, torch does
    # not): one too small must be a ValueError here, not a device-side assert on the GPU
    mod.check_extents(batch, heads, seqlen_q, seqlen_k)
    if device is None:
        device = mod.aux[0].device if mod.aux else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seq = SeqInfo(tuple(t.to(device) for t in mod.aux), seqlen_q, seqlen_k, 0, 0)
    by_b, by_h = _depends(mod, max(batch, 1), max(heads, 1), seq, device) if seqlen_q and seqlen_k else (False, False)
    nb, nh = (batch if by_b else 1), (heads if by_h else 1)
    b = torch.arange(nb, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nh, device=device).view(1, -1, 1, 1)
    classes = _classify(mod, b, h, seq, tile_m, tile_n)
    return _from_classes(classes, mod, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n, transposed)


@torch.no_grad()
def build_varlen_block_mask(mask_mod, cu_seqlens_q, cu_seqlens_k, heads: int, tile_m: int, tile_n: int,
                            device=None, transposed: bool = False) -> BlockMask:
    """The block mask of a packed varlen batch (mha_varlen): per sequence b its own tiles,
    classified with the indices the kernel gives the mod (global: the sequence's offset
    added; b the sequence's index; seq.seqlen_q / seqlen_k its lengths). cu_seqlens_q /
    _k: the batch's offsets (tensors or sequences; tensors are read to the host once
    here). Rows are sized by the longest sequence."""
    mod = Modifier.of("mask", mask_mod)
    offsets_q, offsets_k = (tuple(int(x) for x in (c.tolist() if isinstance(c, torch.Tensor) else c))
                            for c in (cu_seqlens_q, cu_seqlens_k))
    _check_ints(heads=heads, tile_m=tile_m, tile_n=tile_n)
    if len(offsets_q) != len(offsets_k) or len(offsets_q) < 1 or heads < 0 or min(tile_m, tile_n) < 1:
        raise ValueError(f"bad varlen block-mask arguments: {len(offsets_q)} and {len(offsets_k)} offsets, "
                         f"heads {heads}, tile {(tile_m, tile_n)}")
    for name, offsets in (("cu_seqlens_q", offsets_q), ("cu_seqlens_k", offsets_k)):
        if any(b < a for a, b in zip(offsets, offsets[1:])):  # a negative length: no sequence
            raise ValueError(f"{name} must be non-decreasing, got {list(offsets)}")
    # as build_block_mask: the mod indexes its aux tensors by sequence and packed token
    mod.check_extents(len(offsets_q) - 1, heads, offsets_q[-1], offsets_k[-1])
    if device is None:  # where the kernel runs: the offsets' GPU, an aux tensor's, else CUDA
        on_gpu = [t.device for t in (cu_seqlens_q, *mod.aux) if isinstance(t, torch.Tensor) and t.is_cuda]
        device = on_gpu[0] if on_gpu else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    aux = tuple(t.to(device) for t in mod.aux)
    batch = len(offsets_q) - 1
    lengths = [(offsets_q[i + 1] - offsets_q[i], offsets_k[i + 1] - offsets_k[i]) for i in range(batch)]
    seqlen_q, seqlen_k = max((lq for lq, _ in lengths), default=0), max((lk for _, lk in lengths), default=0)
    seqs = [SeqInfo(aux, lq, lk, offsets_q[i], offsets_k[i]) for i, (lq, lk) in enumerate(lengths)]
    live = [i for i, (lq, lk) in enumerate(lengths) if lq and lk]
    by_h = bool(live) and _depends(mod, 1, max(heads, 1), seqs[live[0]], device, live[0])[1]
    nh = heads if by_h else 1
    h = torch.arange(nh, device=device).view(1, -1, 1, 1)
    classes = torch.zeros(batch, nh, math.ceil(seqlen_q / tile_m), math.ceil(seqlen_k / tile_n), dtype=torch.int8,
                          device=device)
    for i in live:  # an empty sequence's row stays EMPTY
        c = _classify(mod, torch.full((1, 1, 1, 1), i, device=device), h, seqs[i], tile_m, tile_n)
        classes[i:i + 1, :, :c.shape[2], :c.shape[3]] = c
    return _from_classes(classes, mod, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n, transposed,
                         (offsets_q, offsets_k))


class _SameTensors:
    """The identity of live tensors and their versions, for caches keyed by what a call
    passed: equal only while the very same tensor objects are alive and unmodified (a
    data pointer is not enough: a freed tensor's memory is handed to the next one).
    on_death: called once one of them is freed (the cache drops its entry then, instead
    of keeping the lists of a batch long gone until the LRU evicts them). Inference
    tensors keep no version: callers do not cache them (rememberable)."""

    def __init__(self, tensors, on_death=None):
        def dead(_ref, fired=[]):  # noqa: B006 - once per entry, whichever tensor dies first
            if not fired and on_death is not None:
                fired.append(True)
                on_death()

        self.refs = tuple(weakref.ref(t, dead) for t in tensors)
        self.versions = tuple(t._version for t in tensors)

    @staticmethod
    def rememberable(tensors) -> bool:
        return not any(t.is_inference() for t in tensors)

    def hold(self, tensors) -> bool:
        return len(tensors) == len(self.refs) and all(
            r() is t and t._version == v for r, t, v in zip(self.refs, tensors, self.versions))


# (mod key, shape, tiles, device, transposed, ids of the aux tensors) -> (_SameTensors,
# BlockMask); ids are unique among live objects, and the entry checks that its tensors
# are the ones alive
_cache: "OrderedDict[tuple, tuple]" = OrderedDict()
_CACHE_SIZE = 64


def cached_block_mask(mod: Modifier, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n, device,
                      transposed: bool = False) -> BlockMask:
    """build_block_mask, remembered while the same aux tensors live unmodified: a model
    calling mha with one mask in every layer builds it once. An aux tensor modified in
    place (its version changes) or a new one (even at a freed one's address, with the
    same version) builds anew."""
    key = (mod.key, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n, str(device), transposed)
    return _remembered(_cache, key, tuple(mod.aux), lambda: build_block_mask(
        mod, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n, device, transposed), device)


# id(BlockMask) -> the BlockMask, for every cached mask a CUDA graph captured: the graph
# replays with its lists' addresses, so they must outlive their cache entry (LRU, a new
# version of an aux tensor); one per mask a capture used, never freed
_held_by_graphs: dict = {}


def _capturing(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def _remembered(cache: OrderedDict, key: tuple, tensors: tuple, build, device):
    """build(), kept in cache (LRU of _CACHE_SIZE) under key while `tensors` are the same
    live, unmodified objects (_SameTensors); an entry leaves when one of them is freed.
    Inference tensors have no version to key by: built every time. Under CUDA graph
    capture a hit is kept alive for the graph (_held_by_graphs) and a miss is built into
    the graph, not remembered: its lists are written only when the graph replays. A mask
    built in another private pool (torch.compile's graph trees warm up in theirs, then
    reset it) is not remembered either (bounded_cache.outside_private_pools)."""
    if not _SameTensors.rememberable(tensors):
        return build()
    key = key + (tuple(id(t) for t in tensors),)
    found = cache.get(key)
    if found is not None and found[0].hold(tensors):
        cache.move_to_end(key)
        if _capturing(device):
            _held_by_graphs[id(found[1])] = found[1]
        return found[1]
    if _capturing(device):
        return build()
    value = build()
    lists = [t for t in (value if isinstance(value, tuple) else ()) if isinstance(t, torch.Tensor)]
    if torch.device(device).type == "cuda" and not outside_private_pools(*lists):
        return value  # built in a private pool (a graph tree's warm-up): freed at its reset
    cache[key] = (_SameTensors(tensors, on_death=lambda: cache.pop(key, None)), value)
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)
    return value


def check_block_mask(block_mask: BlockMask, mod: Modifier, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n):
    """A user's block mask must be this mask's, at this shape and the kernel's tiles."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cute_attn.BlockMask (create_block_mask), got {type(block_mask).__name__}")
    want = (batch, heads, seqlen_q, seqlen_k, tile_m, tile_n)
    got = (block_mask.batch, block_mask.heads, block_mask.seqlen_q, block_mask.seqlen_k, block_mask.tile_m,
           block_mask.tile_n)
    if got != want:
        raise ValueError(f"block_mask was built for (batch, heads, seqlen_q, seqlen_k, tile_m, tile_n) = {got}, "
                         f"this call needs {want}")
    if block_mask.cu_seqlens is not None:
        raise ValueError("block_mask was built for a packed varlen batch (create_varlen_block_mask): pass it to "
                         "mha_varlen")
    _check_kind(block_mask, mod)


def _check_kind(block_mask: BlockMask, mod: Modifier):
    if block_mask.transposed:
        raise ValueError("block_mask is a backward (transposed) block mask; pass the forward's")
    if block_mask.mod_key != mod.key:
        raise ValueError(f"block_mask was built for another mask mod than {mod.name!r}")


# (mod key, heads, tiles, device, transposed, ids of the offsets and aux tensors) ->
# (_SameTensors, BlockMask), as _cache
_varlen_cache: "OrderedDict[tuple, tuple]" = OrderedDict()


def cached_varlen_block_mask(mod: Modifier, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, heads: int,
                             tile_m: int, tile_n: int, transposed: bool = False) -> BlockMask:
    """build_varlen_block_mask, remembered while the same offset and aux tensors live
    unmodified: a model passing one cu_seqlens (and one doc-id tensor) to every layer
    reads the offsets to the host and builds once per batch."""
    key = (mod.key, heads, tile_m, tile_n, str(cu_seqlens_q.device), transposed)
    return _remembered(_varlen_cache, key, (cu_seqlens_q, cu_seqlens_k, *mod.aux), lambda: build_varlen_block_mask(
        mod, cu_seqlens_q, cu_seqlens_k, heads, tile_m, tile_n, transposed=transposed), cu_seqlens_q.device)


# id(user's varlen BlockMask) -> (_SameTensors of (its partial_count, the call's offsets),
# its cu_seqlens): a mask checked against these offsets once is not read back again
_varlen_checked: "OrderedDict[int, tuple]" = OrderedDict()


def check_varlen_block_mask(block_mask: BlockMask, mod: Modifier, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, heads: int, tile_m: int, tile_n: int):
    """A user's varlen block mask must be this mask's, for these offsets (its tile lists
    are per sequence: other lengths would send the kernel past them) and the kernel's
    tiles. The offsets are read to the host once per (mask, offset tensors, version)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cute_attn.BlockMask (create_varlen_block_mask), got "
                        f"{type(block_mask).__name__}")
    if block_mask.cu_seqlens is None:
        raise ValueError("block_mask was built for a dense batch (create_block_mask); mha_varlen needs "
                         "create_varlen_block_mask's")
    _check_kind(block_mask, mod)
    if (block_mask.heads, block_mask.tile_m, block_mask.tile_n) != (heads, tile_m, tile_n):
        raise ValueError(f"block_mask was built for (heads, tile_m, tile_n) = "
                         f"{(block_mask.heads, block_mask.tile_m, block_mask.tile_n)}, this call needs "
                         f"{(heads, tile_m, tile_n)}")
    if block_mask.partial_count.device != cu_seqlens_q.device:
        raise ValueError(f"block_mask is on {block_mask.partial_count.device}, the call on {cu_seqlens_q.device}: "
                         "build it on the GPU (create_varlen_block_mask(..., device=...))")
    tensors = (block_mask.partial_count, cu_seqlens_q, cu_seqlens_k)
    seen = _varlen_checked.get(id(block_mask))
    if seen is not None and seen[0].hold(tensors) and seen[1] == block_mask.cu_seqlens:
        return
    offsets = tuple(tuple(c.tolist()) for c in (cu_seqlens_q, cu_seqlens_k))
    if offsets != block_mask.cu_seqlens:
        raise ValueError("block_mask was built for other cu_seqlens than this call's")
    if _SameTensors.rememberable(tensors):
        key = id(block_mask)
        _varlen_checked[key] = (_SameTensors(tensors, on_death=lambda: _varlen_checked.pop(key, None)),
                                block_mask.cu_seqlens)
        if len(_varlen_checked) > _CACHE_SIZE:
            _varlen_checked.popitem(last=False)


def create_block_mask(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, *, head_dim: int = 128,
                      aux_tensors=(), device=None) -> BlockMask:
    """The block mask mha(mask_mod=...) needs for inputs of this shape and head dim (the
    head dim fixes the kernel's tiles): build it once, pass it to every call as
    block_mask=. Without it mha builds one per new (mask, shape) and caches it.
    A block mask is checked against the call's mod, shape and tiles, not against its aux
    tensors' values: one built for other document ids is accepted and skips or computes
    tiles by those ids (as FlexAttention's block masks), so rebuild it when they change."""
    from cute_attn.config import mod_fwd_config_for

    mod = Modifier.of("mask", mask_mod, aux_tensors)
    cfg = mod_fwd_config_for(head_dim)
    return build_block_mask(mod, batch, heads, seqlen_q, seqlen_k, cfg.tile_m, cfg.tile_n, device)


def create_varlen_block_mask(mask_mod, cu_seqlens_q, cu_seqlens_k, heads: int, *, head_dim: int = 128,
                             aux_tensors=(), device=None) -> BlockMask:
    """The block mask mha_varlen(mask_mod=...) needs for this packed batch (its offsets)
    and head dim: build it once per batch of lengths and pass it to every layer as
    block_mask= (mha_varlen checks it against the call's offsets once). Without it
    mha_varlen builds one per new (mask, offsets) and caches it."""
    from cute_attn.config import mod_fwd_config_for

    mod = Modifier.of("mask", mask_mod, aux_tensors)
    cfg = mod_fwd_config_for(head_dim)
    return build_varlen_block_mask(mod, cu_seqlens_q, cu_seqlens_k, heads, cfg.tile_m, cfg.tile_n, device)
