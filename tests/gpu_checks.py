"""The accuracy rule of the feature tests, shared by tests/test_features_gpu.py and the
fuzz test (tests/test_fuzz_gpu.py), so that both hold the kernel to one rule.

Rule (the one of tests/test_mha_gpu.py and tests/test_mha_bwd_gpu.py), with the reference
of each case (attention_ref, or attention_ref_varlen for packed batches, called with the
case's causal / window_size / softcap / softmax_scale):

- out: max |kernel - fp32 reference| <= 2 x max |torch in the input dtype - fp32 reference|
  + 1e-5, where "torch in the input dtype" is the reference with upcast=False.
- lse: -inf exactly on the rows that see no key; elsewhere within 1e-3 of the fp32
  reference, plus softcap * 2^-10 with a softcap: the kernel takes tanh in fast-math
  (tanh.approx.f32, relative error about 2^-11), which moves a capped score, and with it
  the lse, by up to about softcap * 2^-11; the 2x is margin.
- dq, dk, dv: max error <= 2 x the error of autograd through the reference with
  upcast=False + 2 x the rounding of the fp32 gradient to the input dtype + 1e-3
  + 2 x the D-rounding term (d_rounding_terms) for dq and dk.

The D-rounding term: the backward's preprocess takes D_i = sum_d dO_id * O_id from the
kernel's out, rounded to the input dtype (as FlashAttention does), while autograd through
the reference gets D = sum_j P_ij dP_ij in fp32, exact against dS = P (dP - D). Rounding O
moves D_i by dD_i = sum_d dO_id (round(O_id) - O_id), which moves dq_i = scale sum_j dS_ij
k_j by -scale dD_i (P k)_i and dk_j by -scale (P^T (dD q))_j (a softcap's 1 - tanh^2 <= 1
scales both down); d_rounding_terms computes both from the fp32 reference's O rounded as
the kernel stores it, signs and all. Where P is nearly one-hot (very few keys, or scores
far beyond a softcap) dP - D cancels and torch's error is ~0, so this is all the kernel's
error: the 2,000-case fuzz run found dq errors of 2e-3 (fp16) to 3e-2 (bf16) there at
2-3 keys with softcap-scaled inputs, against the 1e-3 floor, and 0.7-1.4x this term on
the same inputs (H100, scratch probe in the session-5 notes of perf/NOTES.md). Both products with P are the
reference itself: P k is its out with v = k, P^T x its dv for dout = x.
"""

import itertools
import math
from dataclasses import dataclass
from typing import Optional

import torch
from gpu_helpers import backward_buffer_bytes, poison_allocator

import cute_attn
from cute_attn.reference import attention_ref, attention_ref_varlen, visible_keys

BF16, FP16 = torch.bfloat16, torch.float16

# The floors and the LSE tolerance of the existing GPU tests (their docstrings say why).
OUT_FLOOR = 1e-5
GRAD_FLOOR = 1e-3
LSE_ATOL = 1e-3
TANH_APPROX_REL_ERR = 2.0 ** -11


@dataclass(frozen=True)
class Case:
    """One attention problem: dense (b, sq, sk) or varlen (lens_q, lens_k per sequence)."""

    dtype: torch.dtype = BF16
    d: int = 128
    h: int = 4
    h_kv: int = 4
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    b: int = 2
    sq: int = 0
    sk: int = 0
    lens_q: Optional[tuple] = None
    lens_k: Optional[tuple] = None
    softmax_scale: Optional[float] = None  # None: the API's default, 1 / sqrt(d)
    deterministic: bool = False

    @property
    def varlen(self):
        return self.lens_q is not None

    @property
    def scale(self):
        """The softmax scale the kernel applies."""
        return self.d ** -0.5 if self.softmax_scale is None else self.softmax_scale

    def __str__(self):
        parts = [str(self.dtype).removeprefix("torch."), f"d{self.d}", f"h{self.h}kv{self.h_kv}"]
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append("w{},{}".format(*self.window))
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.softmax_scale is not None:
            parts.append(f"scale{self.softmax_scale:g}")
        if self.deterministic:
            parts.append("det")
        if self.varlen:
            parts += ["varlen", "q" + ".".join(map(str, self.lens_q)),
                      "k" + ".".join(map(str, self.lens_k))]
        else:
            parts += [f"b{self.b}", f"q{self.sq}", f"k{self.sk}"]
        return "-".join(parts)


def cu_seqlens(lens, device="cuda"):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def make_inputs(case, seed=0, device="cuda"):
    """q, k, v, dout in case.dtype, contiguous, and (cu_seqlens_q, cu_seqlens_k) or None.
    The offsets are made here, before any poisoning, so that they cannot take a poisoned
    block."""
    torch.manual_seed(seed)
    if case.varlen:
        lead_q, lead_k = (sum(case.lens_q),), (sum(case.lens_k),)
        cu = (cu_seqlens(case.lens_q, device), cu_seqlens(case.lens_k, device))
    else:
        lead_q, lead_k = (case.b, case.sq), (case.b, case.sk)
        cu = None
    q, k, v, dout = (torch.randn(*lead, h, case.d, device=device)
                     for lead, h in ((lead_q, case.h), (lead_k, case.h_kv), (lead_k, case.h_kv),
                                     (lead_q, case.h)))
    if case.softcap:
        # scaled scores (scale * q k^T) get standard deviation scale * sqrt(d) * s^2 =
        # softcap / 2 (with the default scale, s^2 = softcap / 2)
        s2 = case.softcap / 2
        if case.softmax_scale is not None:
            s2 /= case.softmax_scale * math.sqrt(case.d)
        s = math.sqrt(s2)
        q, k = q * s, k * s
    return (*(t.to(case.dtype) for t in (q, k, v, dout)), cu)


def call_mha(case, q, k, v, cu, **kwargs):
    """cute_attn.mha or mha_varlen with the case's features (defaults left out, so plain
    calls take the default path), max_seqlen the actual maxima: the kernel under test."""
    if case.causal:
        kwargs.setdefault("causal", True)
    if case.window != (-1, -1):
        kwargs.setdefault("window_size", case.window)
    if case.softcap:
        kwargs.setdefault("softcap", case.softcap)
    if case.softmax_scale is not None:
        kwargs.setdefault("softmax_scale", case.softmax_scale)
    if case.deterministic:
        kwargs.setdefault("deterministic", True)
    if case.varlen:
        return cute_attn.mha_varlen(q, k, v, *cu, max(case.lens_q), max(case.lens_k), **kwargs)
    return cute_attn.mha(q, k, v, **kwargs)


def reference(case, q, k, v, cu, *, upcast, **wrong):
    """(out, lse) of the reference; `wrong` overrides the case's causal / window_size /
    softcap / softmax_scale (the teeth tests)."""
    kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap,
                  softmax_scale=case.softmax_scale) | wrong
    if case.varlen:
        return attention_ref_varlen(q, k, v, *cu, upcast=upcast, **kwargs)
    return attention_ref(q, k, v, upcast=upcast, **kwargs)


def seen(case, device="cuda"):
    """(rows that see at least one key, keys that at least one row sees): bool vectors
    along the token dimension (dim 1 dense, the packed dim 0 varlen)."""
    pairs = zip(case.lens_q, case.lens_k) if case.varlen else [(case.sq, case.sk)]
    rows, keys = [], []
    for sq, sk in pairs:
        vis = visible_keys(sq, sk, causal=case.causal, window_size=case.window, device=device)
        if vis is None:
            vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
        rows.append(vis.any(dim=1))
        keys.append(vis.any(dim=0))
    return torch.cat(rows), torch.cat(keys)


def _tokens_first(t):
    # dense (b, s, h, d) -> (s, b, h, d); varlen (total, h, d) unchanged
    return t.movedim(-3, 0)


def _assert_zero_where(t, keep, what):
    dead = _tokens_first(t)[~keep]
    assert torch.equal(dead, torch.zeros_like(dead)), f"{what} must be exactly 0"


def assert_cap_bites(case, q, k):
    """The premise of the softcap cases: a fair share of the scaled scores lies beyond the
    cap, where softcap * tanh(s / softcap) is far from s (tanh(1) = 0.76)."""
    q0, k0 = (t[:, 0] if case.varlen else t[0, :, 0] for t in (q, k))
    scores = (q0[:512].float() @ k0[:512].float().T) * case.scale
    beyond = (scores.abs() > case.softcap).float().mean().item()
    assert beyond > 0.02, f"only {beyond:.1%} of the scores exceed softcap {case.softcap}"


def run_forward(case, q, k, v, cu, kernel=call_mha, **kwargs):
    """Kernel (out, lse) on NaN-poisoned memory, with shape and dtype checks."""
    if q.is_cuda:
        poison_allocator(q.numel() * q.element_size(), q.numel() // case.d * 4)
    out, lse = kernel(case, q, k, v, cu, return_lse=True, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    lse_shape = (case.h, q.shape[0]) if case.varlen else (case.b, case.h, case.sq)
    assert lse.shape == lse_shape and lse.dtype == torch.float32, (tuple(lse.shape), lse.dtype)
    return out, lse


def check_forward(case, q, k, v, cu, out, lse, **wrong):
    out_ref, lse_ref = reference(case, q, k, v, cu, upcast=True, **wrong)
    out_lp, _ = reference(case, q, k, v, cu, upcast=False, **wrong)
    # NaN compares false everywhere, so say it outright rather than rely on max().
    assert not out.isnan().any(), "out has NaN"
    assert not lse.isnan().any(), "lse has NaN"
    assert torch.isfinite(out).all(), "out is not finite"
    err_kernel = (out.float() - out_ref).abs().max().item()
    err_torch = (out_lp.float() - out_ref).abs().max().item()
    assert err_kernel <= 2 * err_torch + OUT_FLOOR, (
        f"out: kernel error {err_kernel:.3g} > 2 x torch {q.dtype} error {err_torch:.3g} + {OUT_FLOOR}")

    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly on rows with no key"
    if not empty.all():
        assert torch.isfinite(lse[~empty]).all(), "lse not finite on rows that see keys"
        lse_err = (lse[~empty] - lse_ref[~empty]).abs().max().item()
        lse_tol = LSE_ATOL + 2 * case.softcap * TANH_APPROX_REL_ERR
        assert lse_err <= lse_tol, f"lse: error {lse_err:.3g} > {lse_tol:.3g}"
    rows, _ = seen(case, q.device)
    _assert_zero_where(out, rows, "out of rows that see no key")


def kernel_grads(case, q, k, v, cu, dout, kernel=call_mha, **kwargs):
    """(dq, dk, dv) of the kernel, the gradients allocated on NaN-poisoned memory."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = kernel(case, q, k, v, cu, **kwargs)
    if q.is_cuda:
        # dq like q, dk and dv like k (GQA: nheads_kv heads), and dQ_accum
        poison_allocator(*backward_buffer_bytes(q, k, len(case.lens_q) if case.lens_q else 1))
    return torch.autograd.grad(out, (q, k, v), dout)


def _reference_grads(case, q, k, v, cu, dout, *, upcast, **wrong):
    # fp32 leaves for the fp32 reference, or its gradients would come back rounded
    q, k, v = (t.detach().float() if upcast else t.detach() for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = reference(case, q, k, v, cu, upcast=upcast, **wrong)
    return torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))


def d_rounding_terms(case, q, k, v, cu, dout, **wrong):
    """(dq, dk, dv): how far rounding O before D = rowsum(dO * O) moves each gradient, at
    most, from the fp32 reference (module docstring); dv has no such term (0)."""
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    scale = wrong.get("softmax_scale") or case.scale
    out, _ = reference(case, q32, k32, v32, cu, upcast=True, **wrong)
    d_err = (dout.float() * (out.to(q.dtype).float() - out)).sum(-1, keepdim=True)
    p_k, _ = reference(case, q32, k32, k32, cu, upcast=True, **wrong)
    dq_term = scale * (d_err * p_k).abs().max().item()
    v_leaf = v32.clone().requires_grad_()
    out_v, _ = reference(case, q32, k32, v_leaf, cu, upcast=True, **wrong)
    (pt_x,) = torch.autograd.grad(out_v, v_leaf, d_err * q32)
    dk_term = scale * pt_x.abs().max().item()
    return dq_term, dk_term, 0.0


def check_grads(case, q, k, v, cu, dout, grads, **wrong):
    ref = _reference_grads(case, q, k, v, cu, dout, upcast=True, **wrong)
    low = _reference_grads(case, q, k, v, cu, dout, upcast=False, **wrong)
    d_terms = d_rounding_terms(case, q, k, v, cu, dout, **wrong)
    for name, g, g_ref, g_low, x, d_term in zip("qkv", grads, ref, low, (q, k, v), d_terms):
        assert g.shape == x.shape and g.dtype == x.dtype, f"d{name}: {tuple(g.shape)} {g.dtype}"
        assert not g.isnan().any(), f"d{name} has NaN"
        assert torch.isfinite(g).all(), f"d{name} is not finite"
        err = (g.float() - g_ref).abs().max().item()
        err_torch = (g_low.float() - g_ref).abs().max().item()
        rounding = (g_ref.to(x.dtype).float() - g_ref).abs().max().item()
        assert err <= 2 * err_torch + 2 * rounding + GRAD_FLOOR + 2 * d_term, (
            f"d{name}: kernel error {err:.3g} > 2 x torch {x.dtype} error {err_torch:.3g}"
            f" + 2 x rounding {rounding:.3g} + {GRAD_FLOOR} + 2 x D-rounding {d_term:.3g}")
    rows, keys = seen(case, q.device)
    dq, dk, dv = grads
    _assert_zero_where(dq, rows, "dq of rows that see no key")
    _assert_zero_where(dk, keys, "dk of keys that no row sees")
    _assert_zero_where(dv, keys, "dv of keys that no row sees")


def check_case(case, q, k, v, dout, cu, kernel=call_mha):
    """The whole rule on one set of inputs: forward (out, lse), then the gradients.
    Returns the kernel's out."""
    out, lse = run_forward(case, q, k, v, cu, kernel)
    check_forward(case, q, k, v, cu, out, lse)
    check_grads(case, q, k, v, cu, dout, kernel_grads(case, q, k, v, cu, dout, kernel))
    return out
