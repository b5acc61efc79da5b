"""FP8 (e4m3) attention on the host: quantisation, and a torch emulation of the forward's math.

Groundwork for an FP8 forward kernel (issue 13). The kernel takes q, k, v already in
`torch.float8_e4m3fn` plus float32 "descale" factors, FlashAttention-3's convention:

    real value = stored e4m3 value * descale,   descale shape (batch, nheads_kv)

for all three of q, k and v. The kernel folds q_descale * k_descale into the softmax
scale (one multiply per score, already there for softmax_scale * log2(e)) and v_descale
into the final 1 / rowsum (one multiply per output row), so the descales cost nothing in
the mainloop. That is why a descale is per (batch, head) and not finer: one value per
CTA, read once. This module provides

- `quantize_fp8`: bf16/fp16 -> e4m3 with per-(batch, kv head) scales (or one per tensor),
  chosen so that each slice's largest magnitude maps to e4m3's largest finite value, 448.
- `dequantize`: e4m3 * descale -> float32, to feed `reference.attention_ref`.
- `fp8_attention_emulated`: what the kernel computes, step by step in float32 torch, with
  e4m3 rounding exactly where the kernel rounds (P before the PV GEMM). A future GPU test
  compares the kernel with it (tight tolerance: same roundings) and with
  `attention_ref` on the dequantised inputs (loose: the cost of FP8 P).
- `rmse`: root mean square error, the figure FlashAttention-3's paper reports for FP8.

Accuracy. e4m3 has 3 mantissa bits: a normal value rounds to nearest with relative error
at most 2^-4 (half a unit in the last place, 2^-3 of the binade). Below the smallest
normal, 2^-6 (in stored units), values are subnormal with a fixed spacing of 2^-9, so
the absolute error is at most 2^-10 and the relative error grows without bound; below
2^-10 they flush to 0. Mapping the amax to 448 keeps a slice's values in the normal range
down to amax * 2^-6 / 448 (about amax / 28700): e4m3 is a floating-point format, so a
larger scale range (per-tensor scaling with an outlier head) costs precision only for the
values it pushes below that, unlike int8 where every value loses resolution.

Not modelled: Hopper's FP8 WGMMA accumulates with fewer than float32's 24 significant
bits (DeepSeek-V3's report measured about 14 on H800s for long reductions); the
emulation's matmuls are plain float32. QK^T reduces over head_dim (<= 256) and PV over a
tile of keys per WGMMA, but the kernel keeps acc_O in the tensor core's accumulator across
every KV block, so a kernel test should use long sequences before trusting this model.
"""

import math
import numbers

import torch

from cute_attn.reference import visible_keys
from cute_attn.validation import _capturing_cuda_graph, _is_compiling, validate_gqa_heads, validate_softcap

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)  # None in torch builds without FP8
E4M3_MAX = 448.0  # largest finite e4m3fn value (1.75 * 2^8); the format has no inf
E4M3_MIN_NORMAL = 2.0 ** -6
# Relative rounding error bound of a normal e4m3 value (3 mantissa bits, round to nearest)
E4M3_REL_ERR = 2.0 ** -4
# Absolute rounding error bound below the normal range (subnormal spacing 2^-9, halved),
# in stored units: multiply by the descale for real units.
E4M3_SUBNORMAL_ABS_ERR = 2.0 ** -10
# The smallest amax that gets its own scale: 448 / amax and amax / 448 must both stay
# normal, finite float32 (the kernel folds the descale into float32 products). Smaller
# nonzero slices are scaled as if their amax were this (they round toward 0, which is
# within the absolute error bound relative to such a slice anyway).
_AMAX_FLOOR = E4M3_MAX * 2.0 ** -126
_NAMES = ("q", "k", "v")


def _require_fp8():
    if FP8_DTYPE is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.float8_e4m3fn (needs torch >= 2.1)")


def _check_inputs(q, k, v, want_fp8):
    """Rank, batch, head dim, heads (GQA), dtype; return the group size."""
    for name, t in zip(_NAMES, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}")
        if want_fp8 and t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} must be torch.float8_e4m3fn, got {t.dtype}")
        if not want_fp8 and t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be torch.float16 or torch.bfloat16 (or float32), got {t.dtype}")
    for name, t in zip(_NAMES[1:], (k, v)):
        if t.shape[0] != q.shape[0] or t.shape[3] != q.shape[3]:
            raise ValueError(f"{name} batch and headdim must match q's {tuple(q.shape)}, got {tuple(t.shape)}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"v seqlen must equal k seqlen ({k.shape[1]}), got {v.shape[1]}")
    return validate_gqa_heads(q, k, v)


def _check_finite(amaxes):
    """ValueError naming the first of q, k, v whose amax is not finite (an inf or NaN
    input: amax propagates NaN, and an inf is its own amax). One host read for the three;
    skipped while a CUDA graph captures or torch.compile traces (no host read there: a
    non-finite input then gives non-finite outputs, as any torch op would)."""
    if _is_compiling() or _capturing_cuda_graph():
        return
    finite = torch.stack([torch.isfinite(a).all() for a in amaxes]).tolist()
    for name, ok in zip(_NAMES, finite):
        if not ok:
            raise ValueError(f"{name} has non-finite values (inf or NaN): FP8 scales need finite inputs")


def _amax_per_kv_head(x, nheads_kv):
    """|x|.max() per (batch, kv head): (batch, nheads_kv) float32. With more heads than
    nheads_kv (q under GQA), the max runs over each group of heads that share a kv head."""
    b, s, h, d = x.shape
    grouped = x.reshape(b, s, nheads_kv, h // max(nheads_kv, 1), d)
    if grouped.numel() == 0:
        return torch.zeros(b, nheads_kv, dtype=torch.float32, device=x.device)
    return grouped.abs().float().amax(dim=(1, 3, 4))


def _descale_from_amax(amax):
    """(scale, descale) with amax * scale = 448 and descale = 1 / scale; 1 where amax is 0."""
    zero = amax == 0
    amax = amax.clamp(min=_AMAX_FLOOR)
    scale = torch.where(zero, 1.0, E4M3_MAX / amax)
    descale = torch.where(zero, 1.0, amax / E4M3_MAX)
    return scale, descale


def _per_head(descale, nheads):
    """A (batch, nheads_kv) descale expanded to (batch, nheads): head h reads entry
    h // (nheads / nheads_kv), the GQA rule of the kernels."""
    group = nheads // descale.shape[1] if descale.shape[1] else 1
    return descale.repeat_interleave(group, dim=1) if group > 1 else descale


def _to_e4m3(x_scaled):
    """float32 already in e4m3's range (up to rounding of the scale product) -> e4m3.
    The clamp matters: torch's cast of a value past 448 gives NaN, not saturation."""
    return x_scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def hadamard(n, device=None):
    """The n x n orthonormal Hadamard matrix (Sylvester's construction, divided by
    sqrt(n)), float32; n a power of two. Symmetric, and H @ H = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dim, got {n}")
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def quantize_fp8(q, k, v, *, per="head", rotate=False):
    """Quantise q, k, v (batch, seqlen, nheads, headdim) to float8_e4m3fn with float32 scales.

    Returns (q8, k8, v8, q_descale, k_descale, v_descale), each descale float32 of shape
    (batch, nheads_kv) with real value = stored value * descale (FlashAttention-3's
    convention, also for q).

    per="head": one scale per (batch, kv head), chosen so the slice's largest magnitude
    maps to 448, e4m3's largest finite value (the whole range is used, nothing
    saturates). per="tensor": one scale for the whole tensor, repeated into the same
    (batch, nheads_kv) shape, so the kernel's interface does not change; it is the naive
    choice and is worse when heads differ in magnitude by more than e4m3's normal range
    can absorb (see the module docstring).

    GQA (nheads_kv < nheads): the kernel reads one q descale per (batch, kv head), because
    it folds q_descale * k_descale into the score scale of a CTA that may hold several
    query heads of one group (pack_gqa) and a per-query-head value would need a
    per-row multiply. So the query heads h with h // (nheads / nheads_kv) == g share
    q_descale[:, g], and q's amax is taken over that whole group of heads.

    A slice of zeros gets descale 1 (stored zeros; any descale would do, 1 avoids a 0/0).
    A nonzero slice with amax below 448 * 2^-126 is scaled as if its amax were that, so
    the scale and the descale stay normal float32. Non-finite input raises ValueError
    naming the tensor: an inf amax would make every other value 0, a NaN poisons the scale.
    That check is one host read of the three amaxes (a sync), skipped while a CUDA graph
    captures or torch.compile traces, where the call then has no host read at all.

    Accuracy: each element is rounded once to e4m3 (3 mantissa bits): relative error at
    most 2^-4 for values above amax * 2^-6 / 448, absolute error at most
    descale * 2^-10 below.

    rotate=True multiplies q and k by the same orthonormal Hadamard matrix H over the head
    dim before quantising (FlashAttention-3's "incoherent processing"): (q H)(k H)^T =
    q k^T, so attention is unchanged, while a few outlier channels get spread over all of
    them. That matters on Hopper beyond the e4m3 rounding: the FP8 tensor cores sum the
    products of q k^T with fewer bits than float32, aligned to the largest product, so
    where a few channels of both q and k are large the small products are lost. Measured
    on an H100 (4 channels x20 in q and k, hd 128, tests/test_fp8_gpu.py): the kernel's
    RMSE is 4-5x that of the float32 emulation of the same e4m3 math without rotation,
    and within 1.2x with it. The head dim must be a power of two; v is not rotated (the
    output would need the inverse rotation).
    """
    _require_fp8()
    if per not in ("head", "tensor"):
        raise ValueError(f"per must be 'head' or 'tensor', got {per!r}")
    _check_inputs(q, k, v, want_fp8=False)
    if rotate:
        h = hadamard(q.shape[-1], q.device)
        q, k = q.float() @ h, k.float() @ h
    nheads_kv = k.shape[2]
    amaxes = [_amax_per_kv_head(x, nheads_kv) for x in (q, k, v)]
    _check_finite(amaxes)
    quantised, descales = [], []
    for x, amax in zip((q, k, v), amaxes):
        if per == "tensor":
            amax = amax.amax().expand_as(amax) if amax.numel() else amax
        scale, descale = _descale_from_amax(amax)
        scale_bshd = _per_head(scale, x.shape[2])[:, None, :, None]
        quantised.append(_to_e4m3(x.float() * scale_bshd))
        descales.append(descale.contiguous())
    return (*quantised, *descales)


def dequantize(x8, descale):
    """float32 values of an e4m3 tensor (batch, seqlen, nheads, headdim) with its
    (batch, nheads_kv) descale; nheads may be a multiple of nheads_kv (q under GQA), head
    h reading descale[:, h // (nheads / nheads_kv)]."""
    b, _, h, _ = x8.shape
    if descale.dim() != 2 or descale.shape[0] != b or (descale.shape[1] and h % descale.shape[1]):
        raise ValueError(
            f"descale must be (batch, nheads_kv) with nheads_kv dividing {h}, got {tuple(descale.shape)}"
        )
    return x8.float() * _per_head(descale.float(), h)[:, None, :, None]


def rmse(a, b):
    """Root mean square error sqrt(mean((a - b)^2)) as a Python float, computed in float64.
    Entries equal in both (-inf LSE of fully masked rows, say) count as 0 error; 0 for
    empty tensors."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if a.numel() == 0:
        return 0.0
    diff = torch.where(a == b, 0.0, a - b)
    return math.sqrt(diff.square().mean().item())


def fp8_attention_emulated(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False,
                           window_size=(-1, -1), softcap=0.0, softmax_scale=None,
                           p_scale=448.0, block_n=None, sink=None):
    """The forward an FP8 kernel computes, in float32 torch: returns (out, lse), float32,
    out (batch, seqlen_q, nheads, headdim), lse (batch, nheads, seqlen_q), natural log.

    Step by step, for query head h reading kv head g = h // (nheads / nheads_kv) and the
    descales of entry [b, g]:

    1. S = (q8 @ k8^T, exact e4m3 products summed in float32) * q_descale * k_descale *
       softmax_scale (default 1 / sqrt(headdim)); the kernel folds the three factors into
       one score scale.
    2. softcap > 0: S = softcap * tanh(S / softcap); then the mask of
       `reference.visible_keys` (bottom-right aligned causal / window), masked scores -inf.
       Both as `reference.attention_ref`.
    3. P = exp(S - rowmax) in float32, in [0, 1]; rowsum = sum of this float32 P (the
       kernel sums its registers before converting them).
    4. P8 = e4m3(P * p_scale): P becomes the A operand of an FP8 GEMM, so it is rounded to
       e4m3. The scale matters: e4m3's smallest normal is 2^-6 and its smallest subnormal
       2^-9, so unscaled probabilities below 2^-6 (any row spread over more than ~64 keys)
       lose precision and those below 2^-10 flush to 0, a bias toward the largest scores.
       Scaling by p_scale maps [0, 1] onto [0, p_scale] and keeps probabilities down to
       2^-6 / p_scale normal. In the kernel the scale is free: exp2(x - m + log2(p_scale))
       moves it into the exponent's offset (FlashAttention-3 uses 2^8, an offset of 8).
       p_scale must be in (0, 448] so that P * p_scale cannot exceed e4m3's range.
    5. O = (P8 @ v8 in float32) * v_descale / (rowsum * p_scale); lse = rowmax + log(rowsum).
       A row that sees no key gets out = 0 and lse = -inf, no NaN.
    6. sink (heads,) float logits (attention sinks): one more term e^sink[h] of every
       row's sum, taken at the end against max(rowmax, sink) as the kernel does; a row that
       sees no key then gets out = 0 and lse = sink[h].

    block_n=None uses the final row max (the online softmax's result, up to where it
    rounds). block_n=n follows the kernel's online softmax over key blocks [j*n, (j+1)*n),
    last block first as the forward kernels walk them: each block's P is taken against the
    running max and rounded there, and the fp32 O and rowsum are rescaled when the max
    grows. The two agree to within the P rounding; the blocked form is the one to hold a
    kernel to a tight tolerance.
    """
    _require_fp8()
    group = _check_inputs(q8, k8, v8, want_fp8=True)
    softcap = validate_softcap(softcap)
    if isinstance(p_scale, bool) or not isinstance(p_scale, numbers.Real) \
            or not 0 < p_scale <= E4M3_MAX:
        raise ValueError(f"p_scale must be a number in (0, {E4M3_MAX:g}], got {p_scale!r}")
    if block_n is not None and (isinstance(block_n, bool) or not isinstance(block_n, numbers.Integral)
                                or block_n < 1):
        raise ValueError(f"block_n must be None or a positive int, got {block_n!r}")
    b, sq, h, d = q8.shape
    sk, h_kv = k8.shape[1], k8.shape[2]
    for name, ds in zip(_NAMES, (q_descale, k_descale, v_descale)):
        if not isinstance(ds, torch.Tensor) or tuple(ds.shape) != (b, h_kv):
            raise ValueError(f"{name}_descale must be a ({b}, {h_kv}) tensor (batch, nheads_kv), "
                             f"got {getattr(ds, 'shape', type(ds).__name__)}")
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)

    qf, kf, vf = q8.float(), k8.float(), v8.float()
    if group > 1:
        kf = kf.repeat_interleave(group, dim=2)
        vf = vf.repeat_interleave(group, dim=2)
    # (batch, heads) -> broadcast against (batch, heads, seqlen_q, seqlen_k)
    qk_descale = (_per_head(q_descale.float(), h) * _per_head(k_descale.float(), h))[:, :, None, None]
    v_ds = _per_head(v_descale.float(), h)[:, None, :, None]

    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * (qk_descale * scale)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_keys(sq, sk, causal=causal, window_size=window_size, device=q8.device)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))

    # key blocks in the order the kernel visits them (last first); none for seqlen_k 0
    step = sk if block_n is None else block_n
    blocks = [(j, min(j + step, sk)) for j in range(0, sk, max(step, 1))][::-1]
    acc = torch.zeros(b, h, sq, d, dtype=torch.float32, device=q8.device)
    row_max = torch.full((b, h, sq, 1), float("-inf"), dtype=torch.float32, device=q8.device)
    row_sum = torch.zeros(b, h, sq, 1, dtype=torch.float32, device=q8.device)
    for start, end in blocks:
        s_blk = scores[..., start:end]
        new_max = torch.maximum(row_max, s_blk.amax(dim=-1, keepdim=True))
        # -inf max (nothing visible yet): subtract 0 instead, so exp(-inf) = 0, not NaN
        safe_max = torch.where(torch.isfinite(new_max), new_max, 0.0)
        rescale = torch.exp(row_max - safe_max)  # 0 while row_max is still -inf
        p = torch.exp(s_blk - safe_max)
        p8 = _to_e4m3(p * p_scale).float()
        acc = acc * rescale + torch.einsum("bhqk,bkhd->bhqd", p8, vf[:, start:end])
        row_sum = row_sum * rescale + p.sum(dim=-1, keepdim=True)
        row_max = new_max

    if sink is not None:
        s = sink.float().to(q8.device)[None, :, None, None]
        top = torch.maximum(row_max, s)  # finite: the sink is
        rebase = torch.exp(row_max - top)  # 0 for a row without keys
        total = row_sum * rebase + torch.exp(s - top)
        out = (acc * (rebase / (total * p_scale))).transpose(1, 2) * v_ds
        return out.contiguous(), (top + torch.log(total)).squeeze(-1)
    seen = row_sum > 0
    inv = torch.where(seen, 1.0 / (row_sum * p_scale), 0.0)
    out = (acc * inv).transpose(1, 2) * v_ds  # (batch, seqlen_q, heads, headdim)
    lse = torch.where(seen, row_max + torch.log(torch.where(seen, row_sum, 1.0)), float("-inf"))
    return out.contiguous(), lse.squeeze(-1)
