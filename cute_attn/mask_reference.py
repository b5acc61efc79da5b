"""CPU ground truth for programmable masks (issue 14): dense masks, reference attention
with mask/score mods, and the tile-level block masks a kernel would consume.

A kernel cannot afford to evaluate a mask mod on every (query, key) pair of every tile
and still skip the work that is masked away. FlexAttention and FlashAttention therefore
precompute, per (batch, head), a *block mask*: for each (query tile, KV tile) pair
whether it is empty (skip it), full (compute it without calling the mask mod) or partial
(compute it and apply the mask mod per element), plus, per query tile, the list of
non-empty KV tiles to visit (forward) and, per KV tile, the list of non-empty query
tiles (backward). This module computes all of that by brute force from the dense mask,
so that a later GPU block-mask builder and the kernels have something to be tested
against. Mask/score mods are those of cute_attn/masks.py.

Layouts follow reference.py: q (batch, seqlen_q, heads, headdim), k and v
(batch, seqlen_k, heads_kv, headdim), out like q in float32, lse (batch, heads,
seqlen_q) in float32.
"""

import math
from typing import NamedTuple

import torch

from cute_attn.block_mask import EMPTY, FULL, PARTIAL  # noqa: F401  (the classes: one definition)
from cute_attn.masks import Modifier, SeqInfo
from cute_attn.validation import validate_gqa_heads


def index_grids(batch, heads, seqlen_q, seqlen_k, device=None, offset_q=0, offset_k=0, first_batch=0):
    """The broadcast index tensors (b, h, q_idx, kv_idx) of shapes (B,1,1,1), (1,H,1,1),
    (1,1,Q,1), (1,1,1,K), int64: what mask and score mods are called with. The offsets
    make the indices global (a packed sequence's first token in the packed batch), and
    b counts from first_batch (a packed sequence's index in its batch)."""
    b = torch.arange(first_batch, first_batch + batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q_idx = torch.arange(offset_q, offset_q + seqlen_q, device=device).view(1, 1, -1, 1)
    kv_idx = torch.arange(offset_k, offset_k + seqlen_k, device=device).view(1, 1, 1, -1)
    return b, h, q_idx, kv_idx


def seq_info(mod: Modifier, seqlen_q, seqlen_k, offset_q=0, offset_k=0, device=None) -> SeqInfo:
    """The SeqInfo a reference call passes: the mod's aux tensors (on device) and the
    entry's lengths and offsets."""
    aux = tuple(t.to(device) for t in mod.aux) if device is not None else mod.aux
    return SeqInfo(aux, seqlen_q, seqlen_k, offset_q, offset_k)


def dense_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, device=None, offset_q=0, offset_k=0, first_batch=0):
    """Bool (batch, heads, seqlen_q, seqlen_k): mask_mod evaluated on every index tuple.

    mask_mod: a masks.Modifier or a plain (b, h, q_idx, kv_idx[, seq]) function. It is
    called once with broadcast index tensors (index_grids); its result is expanded to
    the full shape (a mod that ignores b or h may return fewer dims).
    """
    mod = Modifier.of("mask", mask_mod)
    grids = index_grids(batch, heads, seqlen_q, seqlen_k, device, offset_q, offset_k, first_batch)
    visible = mod(*grids, seq=seq_info(mod, seqlen_q, seqlen_k, offset_q, offset_k, device))
    if not isinstance(visible, torch.Tensor) or visible.dtype != torch.bool:
        raise TypeError(
            f"mask_mod {mod.name!r} must return a bool tensor, "
            f"got {getattr(visible, 'dtype', type(visible).__name__)}"
        )
    return visible.expand(batch, heads, seqlen_q, seqlen_k).contiguous()


def attention_ref_mod(q, k, v, *, mask_mod=None, score_mod=None, softmax_scale=None, offset_q=0, offset_k=0,
                      sink=None, dropout_keep=None, dropout_p=0.0, first_batch=0):
    """Return (out, lse) of softmax(mask(score_mod(scale * q k^T))) v in float32.

    As in FlexAttention, score_mod sees the scaled score and the indices (query head h);
    then keys the mask_mod hides get -inf. GQA: query head h reads KV head
    h // (heads // heads_kv). A query that sees no key (masked out, or every visible
    score -inf) gets out = 0 and lse = -inf, and autograd gives it finite, zero
    gradients: nothing on the way is exp(-inf - -inf), log(0) or 0 / 0. offset_q,
    offset_k, first_batch: the entry's place in a packed batch (the mods see global
    indices and the sequence's index as b).
    sink: (heads,) attention-sink logits, one more term e^sink in each row's denominator
    (a key with a zero value vector that every query sees; differentiable).
    dropout_keep: bool (batch, heads, seqlen_q, seqlen_k), the pairs dropout keeps
    (cute_attn.dropout_mask); kept probabilities are scaled by dropout.keep_scale
    (1 / (1 - p) for p taken to 1/256), lse is the undropped softmax's.
    """
    batch, sq, heads, d = q.shape
    sk = k.shape[1]
    group = validate_gqa_heads(q, k, v)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    q, k, v = q.float(), k.float(), v.float()
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if score_mod is not None:
        mod = Modifier.of("score", score_mod)
        grids = index_grids(batch, heads, sq, sk, q.device, offset_q, offset_k, first_batch)
        scores = mod(scores, *grids, seq=seq_info(mod, sq, sk, offset_q, offset_k, q.device))
    if mask_mod is not None:
        visible = dense_mask(mask_mod, batch, heads, sq, sk, q.device, offset_q, offset_k, first_batch)
        scores = scores.masked_fill(~visible, float("-inf"))
    if sink is not None:
        sink_col = sink.float()[None, :, None, None].expand(batch, heads, sq, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
        sk = sk + 1

    # Softmax with a shift by the row max, which does not change its value (hence
    # detached); a row whose max is -inf (nothing visible) is shifted by 0 instead, so
    # every exp below is exp(-inf) = 0 there rather than exp(NaN).
    if sk > 0:
        shift = scores.amax(dim=-1, keepdim=True).detach()
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    else:
        shift = scores.new_zeros((*scores.shape[:-1], 1))
    weights = torch.exp(scores - shift)
    total = weights.sum(dim=-1, keepdim=True)
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))  # no 0 / 0, no log(0)
    probs = weights / safe_total
    lse = torch.where(seen, shift + torch.log(safe_total), torch.full_like(total, float("-inf")))
    if sink is not None:
        probs = probs[..., :-1]
    if dropout_keep is not None:
        from cute_attn.dropout import keep_scale

        probs = probs * dropout_keep * keep_scale(dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse.squeeze(-1)


# ----------------------------------------------------------------------------------------
# Block masks
# ----------------------------------------------------------------------------------------


def block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, tile_m, tile_n, device=None, offset_q=0, offset_k=0,
               first_batch=0):
    """Classify every (query tile, KV tile): int8 (batch, heads, ceil(seqlen_q / tile_m),
    ceil(seqlen_k / tile_n)) of EMPTY (0: no visible pair), PARTIAL (1) or FULL (2:
    every pair visible). offset_q, offset_k, first_batch: a packed sequence's place, as
    dense_mask takes it.

    Tiles cut by the end of a sequence are judged on their in-bounds pairs only: such a
    tile is FULL when every in-bounds pair is visible (the mask's own classification).
    The GPU builder (block_mask.py) then demotes a FULL last KV tile cut by seqlen_k to
    PARTIAL, because the kernels mask keys past the end only in PARTIAL tiles; the tests
    compare the two through that rule (their _kernel_view). Rows past seqlen_q are ignored
    by the kernels either way.
    """
    if tile_m < 1 or tile_n < 1:
        raise ValueError(f"tile sizes must be >= 1, got ({tile_m}, {tile_n})")
    tiles_m, tiles_n = math.ceil(seqlen_q / tile_m), math.ceil(seqlen_k / tile_n)
    visible = dense_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, device, offset_q, offset_k,
                         first_batch).to(torch.int32)
    # Pad both sequences to whole tiles with invisible pairs, then count per tile.
    padded = torch.nn.functional.pad(
        visible, (0, tiles_n * tile_n - seqlen_k, 0, tiles_m * tile_m - seqlen_q)
    )
    counts = padded.view(batch, heads, tiles_m, tile_m, tiles_n, tile_n).sum(dim=(3, 5))
    rows = (seqlen_q - torch.arange(tiles_m, device=device) * tile_m).clamp(max=tile_m)
    cols = (seqlen_k - torch.arange(tiles_n, device=device) * tile_n).clamp(max=tile_n)
    in_bounds = rows[:, None] * cols[None, :]  # pairs inside the sequences, per tile
    classes = torch.full_like(counts, PARTIAL, dtype=torch.int8)
    classes[counts == 0] = EMPTY
    classes[counts == in_bounds] = FULL  # in_bounds >= 1: every tile holds a pair
    return classes


class TileLists(NamedTuple):
    """Per outer tile, the non-empty inner tiles in visiting order (FlexAttention's
    kv_num_blocks / kv_indices, or q_num_blocks / q_indices for the backward).

    num_blocks: int32 (batch, heads, outer tiles), how many inner tiles to visit;
    indices: int32 (batch, heads, outer tiles, inner tiles), the first num_blocks
    entries of each row are the tiles to visit, in order; the rest are -1 (never to be
    read). Whether a listed tile is FULL or PARTIAL is read from the block_mask classes.
    """

    num_blocks: torch.Tensor
    indices: torch.Tensor


def _non_empty_in_order(classes, descending):
    """TileLists over the last dim of classes: the non-empty positions, sorted."""
    inner = classes.shape[-1]
    non_empty = classes != EMPTY
    position = torch.arange(inner, device=classes.device).expand_as(classes)
    # Empty tiles get a key that sorts after every non-empty one.
    sentinel = -1 if descending else inner
    keys = torch.where(non_empty, position, torch.full_like(position, sentinel))
    order = torch.sort(keys, dim=-1, descending=descending, stable=True).values
    num_blocks = non_empty.sum(dim=-1, dtype=torch.int32)
    rank = torch.arange(inner, device=classes.device)
    indices = torch.where(rank < num_blocks.unsqueeze(-1), order, torch.full_like(order, -1))
    return TileLists(num_blocks, indices.to(torch.int32))


def kv_tile_lists(classes):
    """Forward: per query tile, the non-empty KV tiles from the last to the first, the
    order kernels/fwd_sm90.py visits them (n_block_max - 1 down to n_block_min). Lists of
    shape (batch, heads, tiles_m[, tiles_n])."""
    return _non_empty_in_order(classes, descending=True)


def q_tile_lists(classes):
    """Backward: per KV tile, the non-empty query tiles from the first to the last, the
    order kernels/bwd_sm90.py visits them (m_block_min up to m_block_max - 1). Lists of
    shape (batch, heads, tiles_n[, tiles_m])."""
    return _non_empty_in_order(classes.transpose(-1, -2), descending=False)
