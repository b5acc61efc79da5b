"""Plain-torch attention, the ground truth the kernels are tested against.

Layout as in FlashAttention: q (batch, seqlen_q, nheads, headdim), k and v
(batch, seqlen_k, nheads_kv, headdim) with nheads_kv dividing nheads (GQA/MQA); the
packed variable-length form is attention_ref_varlen. Works on any device and under
autograd (the backward tests differentiate the float32 path); `mha` never calls it.
"""

import torch

from cute_attn.validation import (
    validate_gqa_heads,
    validate_softcap,
    validate_varlen_inputs,
    validate_window_size,
)


def visible_keys(seqlen_q, seqlen_k, *, causal=False, window_size=(-1, -1), device=None):
    """Bool (seqlen_q, seqlen_k): may query i attend to key j? None when every pair may.

    Bottom-right aligned, as FlashAttention: with shift = seqlen_k - seqlen_q, query i
    sees key j iff i + shift - left <= j <= i + shift + right, where -1 leaves that side
    unbounded. causal is the window (left, 0) (a given right is overridden).
    """
    left, right = validate_window_size(window_size)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diagonal = i + (seqlen_k - seqlen_q)  # the key aligned with query i
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= diagonal + right
    if left >= 0:
        visible &= j >= diagonal - left
    return visible


def attention_ref(q, k, v, *, causal=False, softmax_scale=None, upcast=True,
                  window_size=(-1, -1), softcap=0.0):
    """Return (out, lse) of softmax(mask(softcap(scale * q k^T))) v.

    upcast=True: everything in float32 whatever the input dtype; out is float32.
    upcast=False: what a same-precision torch computation does -- matmuls in the
    input dtype, softmax in float32, P rounded back to the input dtype before P @ V;
    out is in the input dtype. Tests use its error as the yardstick for the kernel's.

    Masks are aligned to the bottom-right corner (see visible_keys): causal, query i
    sees key j iff j <= i + seqlen_k - seqlen_q; window_size=(left, right) keeps
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, -1 meaning
    unbounded; causal=True is the window (left, 0). A query that sees no key gets
    out = 0 and lse = -inf (not NaN), and its gradients are 0 (not NaN).

    softcap > 0 caps the scaled scores: s = softcap * tanh(s / softcap) (Gemma 2's logit
    softcap, applied after softmax_scale, as FlashAttention does); 0 turns it off.

    k and v may have fewer heads than q (GQA/MQA): query head h reads kv head
    h // (nheads // nheads_kv).

    lse is float32 of shape (batch, nheads, seqlen_q), natural log, of the capped,
    scaled scores.
    """
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    softcap = validate_softcap(softcap)
    group = validate_gqa_heads(q, k, v)
    visible = visible_keys(sq, sk, causal=causal, window_size=window_size, device=q.device)
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))

    # The log-sum-exp spelled out so that rows with no visible key stay finite in the
    # backward too: torch.logsumexp's gradient there is exp(-inf - (-inf)) = NaN. The row
    # max is a constant shift (the softmax does not depend on it), so it is detached.
    if sk > 0:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
    else:
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    row_sum = torch.exp(scores - row_max).sum(dim=-1, keepdim=True)
    seen = row_sum > 0  # false exactly on rows with no visible key
    lse = torch.where(seen, row_max + torch.log(torch.where(seen, row_sum, 1.0)),
                      float("-inf"))
    # exp(s - lse) is the softmax; on empty rows s = -inf and lse is replaced by 0, so
    # p = exp(-inf) = 0 there, with no NaN in value or gradient.
    p = torch.exp(scores - torch.where(seen, lse, 0.0))
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return out, lse.squeeze(-1)


def grads_from_lse(dout, q, k, v, out, lse, *, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0,
                   visible=None, keep_factor=None):
    """(dq, dk, dv) in float32 from the forward's out and lse, in closed form: the
    backward kernels' math, not autograd (it also serves where no graph is recorded: an
    op's kernel below the autograd key, a context-parallel step whose lse is the whole
    row's).

        P = exp(S - lse) on the visible pairs (0 on rows with lse = -inf)
        dV = (P f)^T dO,  dP = dO V^T,  D = rowsum(dO * O),  dS = P (dP f - D)
        dQ = dS K scale,  dK = dS^T Q scale   (times 1 - tanh^2 through a softcap)

    S is the capped, scaled score; the mask is causal / window_size as attention_ref's,
    or `visible`, a bool tensor broadcasting to (batch, heads, seqlen_q, seqlen_k) (a
    mask mod's dense mask). keep_factor: dropout's keep mask times 1 / (1 - p), the
    same shape (None: no dropout). GQA: dK, dV summed over each KV head's group.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    do, qf = dout.float(), q.float()
    kf, vf = (t.float().repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if softcap > 0:
        tanh = torch.tanh(s / softcap)
        s = softcap * tanh
    p = torch.exp(s - lse.float().unsqueeze(-1))
    if visible is None:
        visible = visible_keys(sq, sk, causal=causal, window_size=window_size, device=q.device)
    if visible is not None:
        p = p.masked_fill(~visible, 0.0)
    p = torch.where(torch.isfinite(lse).unsqueeze(-1), p, torch.zeros_like(p))
    factor = 1.0 if keep_factor is None else keep_factor
    dv = torch.einsum("bhqk,bqhd->bkhd", p * factor, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    big_d = (do * out.float()).sum(-1).transpose(1, 2).unsqueeze(-1)
    ds = p * (dp * factor - big_d)
    if softcap > 0:
        ds = ds * (1 - tanh * tanh)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * softmax_scale
    dk, dv = (t.reshape(b, sk, hk, group, d).sum(3) for t in (dk, dv))
    return dq, dk, dv


def attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False,
                         softmax_scale=None, upcast=True, window_size=(-1, -1), softcap=0.0):
    """attention_ref over a packed batch of variable-length sequences.

    q: (total_q, nheads, headdim), k and v: (total_k, nheads_kv, headdim); sequence b
    is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1]
    of k and v (cu_seqlens: int32, start at 0, non-decreasing, end at the totals; see
    validation.validate_varlen_inputs). Masks are bottom-right aligned per sequence, with
    that sequence's own lengths; an empty key sequence leaves its queries with out = 0,
    lse = -inf.

    Returns out ((total_q, nheads, headdim), float32 when upcast, else q's dtype) and lse
    float32 (nheads, total_q), FlashAttention's varlen layout.

    Reads cu_seqlens on the host (a device sync if they are on a GPU): a test helper.
    """
    validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, check_values=True)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        q0, q1 = starts_q[b], starts_q[b + 1]
        k0, k1 = starts_k[b], starts_k[b + 1]
        out_b, lse_b = attention_ref(
            q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0),
            causal=causal, softmax_scale=softmax_scale, upcast=upcast,
            window_size=window_size, softcap=softcap,
        )
        outs.append(out_b[0])
        lses.append(lse_b[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def combine_splits(out_parts, lse_parts):
    """Merge split-KV partial results into (out, lse), in float32.

    out_parts: (num_splits, batch, seqlen_q, nheads, headdim), each split's output over
    its share of the keys (normalised within the split); lse_parts: (num_splits, batch,
    nheads, seqlen_q), each split's natural-log LSE, -inf where the split saw no key (its
    out_parts there may hold anything, NaN included: weight 0, never read). The whole
    row is the LSE-weighted mean, out = sum_s exp(lse_s - lse) out_s with
    lse = log sum_s exp(lse_s); a row that no split saw gets out = 0 and lse = -inf. The
    ground truth of kernels/combine.py (and of any split of the keys: chunks of one
    sequence, or the ranks of a context-parallel ring).
    """
    lse_parts = lse_parts.float()
    seen = lse_parts > float("-inf")  # (splits, batch, heads, seqlen_q)
    row_max = torch.where(seen, lse_parts, float("-inf")).amax(dim=0)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.where(seen, torch.exp(lse_parts - row_max), 0.0)
    total = weights.sum(dim=0)
    any_seen = total > 0
    lse = torch.where(any_seen, row_max + torch.log(torch.where(any_seen, total, 1.0)), float("-inf"))
    weights = weights / torch.where(any_seen, total, 1.0)
    # (splits, batch, heads, seqlen_q) -> (splits, batch, seqlen_q, heads, 1) against out
    w = weights.permute(0, 1, 3, 2).unsqueeze(-1)
    parts = torch.where(w > 0, out_parts.float(), 0.0)
    return (w * parts).sum(dim=0), lse
