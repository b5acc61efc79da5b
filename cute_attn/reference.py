"""Plain-torch attention forward, the ground truth the kernel is tested against.

Layout as in FlashAttention: q (batch, seqlen_q, nheads, headdim), k and v
(batch, seqlen_k, nheads, headdim). Works on any device; `mha` never calls it.
"""

import torch


def attention_ref(q, k, v, *, causal=False, softmax_scale=None, upcast=True):
    """Return (out, lse) of softmax(scale * q k^T [+ causal mask]) v.

    upcast=True: everything in float32 whatever the input dtype; out is float32.
    upcast=False: what a same-precision torch computation does -- matmuls in the
    input dtype, softmax in float32, P rounded back to the input dtype before P @ V;
    out is in the input dtype. Tests use its error as the yardstick for the kernel's.

    Causal is aligned to the bottom-right corner: query i sees key j iff
    j <= i + seqlen_k - seqlen_q. A query that sees no key gets out = 0 and
    lse = -inf (not NaN).

    lse is float32 of shape (batch, nheads, seqlen_q), natural log.
    """
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    if upcast:
        q, k, v = q.float(), k.float(), v.float()

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (sk - sq), float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows with no visible key
    # exp(s - lse) is softmax; subtracting 0 instead of -inf on empty rows turns
    # exp(-inf - (-inf)) = NaN into exp(-inf) = 0.
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return out, lse
