"""Programmable masks and score modifications, FlexAttention style (issue 14).

The kernels today know three fixed mask kinds (config.MASK_KINDS). Models need more:
block diffusion (BD3LM), prefix-LM, packed documents, ALiBi... FlexAttention's answer is
to let the caller describe the mask as a function of the indices and compile it into the
kernel. This module holds that vocabulary, as plain Python/torch functions:

- a *mask mod* is ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``: may query q_idx of
  batch entry b, head h, see key kv_idx? (True = visible);
- a *score mod* is ``score_mod(score, b, h, q_idx, kv_idx) -> score``: rewrites the
  scaled score (softmax_scale * q.k) before masking and the softmax.

The index arguments are integer tensors that broadcast against each other (on the CPU
reference, mask_reference.dense_mask passes shapes (B,1,1,1), (1,H,1,1), (1,1,Q,1),
(1,1,1,K)); the result only has to broadcast to their common shape. The bodies use only
elementwise torch operations (comparisons, integer arithmetic, &, |, ~, torch.where) and
indexing a captured tensor by an index (doc_ids[b, q_idx]), so that the same function can
later be traced by the CuTe DSL with scalar Int32 indices in place of the tensors: no
Python control flow on index values, no reductions, no shape-dependent code.

The built-ins return closures; the values they capture (block size, prefix lengths,
document ids, slopes) are what a kernel would receive as run-time arguments or auxiliary
tensors. mask_reference.py turns a mask mod into dense masks, reference attention and
tile-level block masks; tests/test_masks_cpu.py checks each built-in against a loop.
"""

import torch

from cute_attn.validation import validate_window_size


def _all_visible(q_idx, kv_idx):
    """A bool tensor of True in the broadcast shape of the two index tensors."""
    return (q_idx - kv_idx) == (q_idx - kv_idx)


def _named(fn, name):
    """Give a closure a readable name (shows up in reprs, errors and, later, cache keys)."""
    fn.__name__ = fn.__qualname__ = name
    return fn


def _diagonal_shift(seqlen_q, seqlen_k):
    """seqlen_k - seqlen_q (FlashAttention's bottom-right alignment), 0 when neither is given."""
    if (seqlen_q is None) != (seqlen_k is None):
        raise ValueError("give both seqlen_q and seqlen_k, or neither (then they are equal)")
    if seqlen_q is None:
        return 0
    if seqlen_q < 0 or seqlen_k < 0:
        raise ValueError(f"sequence lengths must be >= 0, got {seqlen_q}, {seqlen_k}")
    return int(seqlen_k) - int(seqlen_q)


# ----------------------------------------------------------------------------------------
# Mask mods
# ----------------------------------------------------------------------------------------


def causal(seqlen_q=None, seqlen_k=None):
    """Causal mask: query i sees key j iff j <= i + seqlen_k - seqlen_q.

    Bottom-right aligned like reference.visible_keys(causal=True): the last query is
    aligned with the last key. Without lengths the two sequences are taken as equal
    (j <= i), the self-attention case.
    """
    shift = _diagonal_shift(seqlen_q, seqlen_k)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + shift

    return _named(mask_mod, "causal")


def sliding_window(left, right, seqlen_q=None, seqlen_k=None):
    """FlashAttention's local window: query i sees key j iff
    i + shift - left <= j <= i + shift + right, shift = seqlen_k - seqlen_q (0 without
    lengths); -1 leaves a side unbounded, so (-1, 0) is causal and (-1, -1) sees all.
    Equal to reference.visible_keys(window_size=(left, right)).
    """
    left, right = validate_window_size((left, right))
    shift = _diagonal_shift(seqlen_q, seqlen_k)

    def mask_mod(b, h, q_idx, kv_idx):
        visible = _all_visible(q_idx, kv_idx)
        if right >= 0:  # static: decided when the mod is built, not per index
            visible = visible & (kv_idx <= q_idx + shift + right)
        if left >= 0:
            visible = visible & (kv_idx >= q_idx + shift - left)
        return visible

    return _named(mask_mod, f"sliding_window_{left}_{right}")


def block_diffusion(block_size, seqlen):
    """BD3LM's block-diffusion mask (Arriola et al., "Block Diffusion", 2025).

    The training input is the sequence twice: the noisy half x_t at positions [0, L),
    then the clean half x_0 at [L, 2L), with L = seqlen // 2 (seqlen must be even). Both
    halves are cut into blocks of block_size tokens, block(p) = (p mod L) // block_size
    (the last block is shorter when block_size does not divide L). Query i sees key j iff

    - i noisy, j noisy: block(j) == block(i)  -- a noisy block denoises itself
      bidirectionally (block diagonal);
    - i noisy, j clean: block(j) <  block(i)  -- conditioned on the clean blocks before
      it (offset block causal);
    - i clean, j clean: block(j) <= block(i)  -- the clean half is block-causal, as in
      autoregressive decoding with a KV cache;
    - i clean, j noisy: never.

    Self-attention: q_idx and kv_idx index the same 2L-token sequence.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if seqlen < 0 or seqlen % 2:
        raise ValueError(f"seqlen must be even and >= 0 (noisy half + clean half), got {seqlen}")
    half = seqlen // 2

    def mask_mod(b, h, q_idx, kv_idx):
        q_clean, kv_clean = q_idx >= half, kv_idx >= half
        q_block = (q_idx % half) // block_size if half else q_idx
        kv_block = (kv_idx % half) // block_size if half else kv_idx
        noisy_noisy = ~q_clean & ~kv_clean & (kv_block == q_block)
        noisy_clean = ~q_clean & kv_clean & (kv_block < q_block)
        clean_clean = q_clean & kv_clean & (kv_block <= q_block)
        return noisy_noisy | noisy_clean | clean_clean

    return _named(mask_mod, f"block_diffusion_{block_size}_{seqlen}")


def prefix_lm(prefix_lens):
    """Prefix-LM: in batch entry b, query i sees key j iff j < prefix_lens[b] (the prefix
    is visible to every query, bidirectionally) or j <= i (causal beyond it).

    prefix_lens: (batch,) ints (a tensor or a sequence); 0 is plain causal attention, a
    length >= seqlen is full bidirectional attention. Self-attention (top-left aligned).
    """
    prefix_lens = torch.as_tensor(prefix_lens, dtype=torch.int64)
    if prefix_lens.dim() != 1:
        raise ValueError(f"prefix_lens must be 1-D (batch,), got shape {tuple(prefix_lens.shape)}")

    def mask_mod(b, h, q_idx, kv_idx):
        lens = prefix_lens.to(kv_idx.device)[b]
        return (kv_idx < lens) | (kv_idx <= q_idx)

    return _named(mask_mod, "prefix_lm")


def document(doc_ids, causal=False):
    """Packed documents: in batch entry b, query i sees key j iff
    doc_ids[b, i] == doc_ids[b, j] (and j <= i when causal).

    doc_ids: (batch, seqlen) integer tensor, one id per token; ids need not be contiguous
    or sorted (a skipped id is an empty document), a token with an id of its own is a
    one-token document that sees only itself. Self-attention: seqlen_q = seqlen_k =
    doc_ids.shape[1]. Unlike varlen (cu_seqlens), this keeps a dense (batch, seqlen)
    layout and lets documents interleave.
    """
    doc_ids = torch.as_tensor(doc_ids)
    if doc_ids.dim() != 2 or doc_ids.is_floating_point() or doc_ids.dtype == torch.bool:
        raise ValueError(
            f"doc_ids must be a (batch, seqlen) integer tensor, got {doc_ids.dtype} "
            f"of shape {tuple(doc_ids.shape)}"
        )

    def mask_mod(b, h, q_idx, kv_idx):
        ids = doc_ids.to(q_idx.device)
        same = ids[b, q_idx] == ids[b, kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    return _named(mask_mod, "document_causal" if causal else "document")


def and_masks(*mask_mods):
    """Visible iff every mod says visible (no mods: everything visible)."""

    def mask_mod(b, h, q_idx, kv_idx):
        visible = _all_visible(q_idx, kv_idx)
        for mod in mask_mods:
            visible = visible & mod(b, h, q_idx, kv_idx)
        return visible

    return _named(mask_mod, "and(" + ", ".join(m.__name__ for m in mask_mods) + ")")


def or_masks(*mask_mods):
    """Visible iff some mod says visible (no mods: nothing visible)."""

    def mask_mod(b, h, q_idx, kv_idx):
        visible = ~_all_visible(q_idx, kv_idx)
        for mod in mask_mods:
            visible = visible | mod(b, h, q_idx, kv_idx)
        return visible

    return _named(mask_mod, "or(" + ", ".join(m.__name__ for m in mask_mods) + ")")


# ----------------------------------------------------------------------------------------
# Score mods
# ----------------------------------------------------------------------------------------


def alibi(slopes, seqlen_q=None, seqlen_k=None):
    """ALiBi (Press et al.): score + slopes[h] * (kv_idx - q_idx - shift), with
    shift = seqlen_k - seqlen_q (0 without lengths, the self-attention case).

    The sign follows FlashAttention's alibi_slopes: slopes are positive (the usual
    2^(-8k/H)) and the bias is -slope * distance for keys at or before the (bottom-right
    aligned) diagonal, so farther keys are penalised. Under a causal mask this is exactly
    FlashAttention's bias -slope * |i + shift - j|. Keys after the diagonal (visible
    only without a causal mask) get +slope * distance here, whereas FlashAttention's
    non-causal ALiBi is symmetric (-slope * |distance|): pair alibi with a causal mask
    to match FlashAttention, or write a symmetric score mod.

    slopes: (heads,) float tensor or sequence, indexed by the query head.
    """
    slopes = torch.as_tensor(slopes, dtype=torch.float32)
    if slopes.dim() != 1:
        raise ValueError(f"slopes must be 1-D (heads,), got shape {tuple(slopes.shape)}")
    shift = _diagonal_shift(seqlen_q, seqlen_k)

    def score_mod(score, b, h, q_idx, kv_idx):
        slope = slopes.to(score.device)[h]
        return score + slope * (kv_idx - q_idx - shift).to(score.dtype)

    return _named(score_mod, "alibi")
