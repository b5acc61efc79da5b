"""GQA/MQA, sliding windows, softcap and variable-length batches (issue 4) on an sm_90 GPU,
forward and backward, against the fp32 reference (skipped without one).

Accuracy rule, the one of tests/test_mha_gpu.py and tests/test_mha_bwd_gpu.py, with the
reference of each case (attention_ref, or attention_ref_varlen for packed batches, called
with the case's causal / window_size / softcap):

- out: max |kernel - fp32 reference| <= 2 x max |torch in the input dtype - fp32 reference|
  + 1e-5, where "torch in the input dtype" is the reference with upcast=False.
- lse: -inf exactly on the rows that see no key; elsewhere within 1e-3 of the fp32
  reference, plus softcap * 2^-10 with a softcap: the kernel takes tanh in fast-math
  (tanh.approx.f32, relative error about 2^-11), which moves a capped score, and with it
  the lse, by up to about softcap * 2^-11; the 2x is margin.
- dq, dk, dv: max error <= 2 x the error of autograd through the reference with
  upcast=False + 2 x the rounding of the fp32 gradient to the input dtype + 1e-3.

Also checked everywhere: outputs and gradients are allocated on NaN-poisoned memory (an
element the kernel never writes shows up as NaN), no NaN or inf anywhere, rows that see
no key have out == 0 and dq == 0 exactly, keys that no row sees have dk == dv == 0
exactly. Inputs are random normal with fixed seeds; with a softcap, q and k are scaled so
that the scaled scores have standard deviation softcap / 2, which puts about 5% of them
beyond the cap (asserted by _assert_cap_bites), where tanh is far from linear.

Compiles (the device budget is tight): each (dtype, head dim, mask kind none / causal /
local, softcap on/off, varlen on/off) is one forward and one backward specialisation;
GQA and the values of the window, the cap and the lengths are run-time arguments, and
deterministic=True is one more backward per mask kind. This file needs 15 forward and 17
backward ones:

  bf16 d128: none, causal, local, none+cap, causal+cap, local+cap           (dense)
             varlen none, varlen causal, varlen local, varlen local+cap
             local and varlen causal deterministic (backward only)
  bf16 d64 local; fp16 d64 varlen causal; fp16 d128 none+cap; bf16 d96 local;
  bf16 d256 varlen causal

The full matrix runs at bf16 / head dim 128; the other dtype and head dims get a subset.
A window shaped like causal, (-1, 0) or (-1, r) with causal=True, takes the causal kernel.
"""

import itertools
import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from gpu_helpers import exact_fp32_matmul, poison_allocator  # noqa: F401 (fixture)

import cute_attn
from cute_attn.reference import attention_ref, attention_ref_varlen, visible_keys

pytestmark = pytest.mark.gpu
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

    @property
    def varlen(self):
        return self.lens_q is not None

    def __str__(self):
        parts = [str(self.dtype).removeprefix("torch."), f"d{self.d}", f"h{self.h}kv{self.h_kv}"]
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append("w{},{}".format(*self.window))
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.varlen:
            parts += ["varlen", "q" + ".".join(map(str, self.lens_q)),
                      "k" + ".".join(map(str, self.lens_k))]
        else:
            parts += [f"b{self.b}", f"q{self.sq}", f"k{self.sk}"]
        return "-".join(parts)


# ---------------------------------------------------------------------------- the matrix

# bf16 / d128, no window: group sizes 1, 4, 8 and MQA, causal or not, single tokens,
# odd lengths, sq < sk and sq > sk (causal rows with no key).
GQA_HEADS = [(4, 4), (8, 2), (16, 2), (4, 1)]
GQA_PAIRS = [(1, 1), (17, 1000), (129, 17), (1000, 1000)]
GQA = [Case(h=h, h_kv=h_kv, causal=causal, sq=sq, sk=sk)
       for h, h_kv in GQA_HEADS for causal in (False, True) for sq, sk in GQA_PAIRS]

# bf16 / d128, GQA 2: windows narrower than a tile, one tile wide, one-sided, wider than
# the sequences; causal forces right = 0. (1000, 129) leaves rows with no key, (129, 1000)
# keys that no row sees.
WINDOWS = [(3, 0), (5, 7), (0, 0), (64, 64), (256, -1), (-1, 33), (1000, 0)]
WINDOW_PAIRS = [(1, 300), (129, 1000), (1000, 129), (300, 300)]
WINDOW = [Case(h=4, h_kv=2, causal=causal, window=w, sq=sq, sk=sk)
          for w in WINDOWS for causal in (False, True) for sq, sk in WINDOW_PAIRS]

# bf16 / d128: softcap alone, with causal, with windows; GQA 4 for cap 5, MQA for cap 30.
SOFTCAP_MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 64)), (True, (256, -1))]
SOFTCAP = [Case(h=8, h_kv=2 if cap == 5.0 else 1, causal=causal, window=w, softcap=cap,
                sq=sq, sk=sk)
           for cap in (5.0, 30.0) for causal, w in SOFTCAP_MASKS
           for sq, sk in [(129, 1000), (1000, 129)]]

# Packed batches: (lens_q, lens_k) per sequence.
LENS = [
    ((1, 17, 0, 300, 129), (1, 200, 0, 129, 1000)),  # a single token, an empty sequence, sq < sk, sq > sk
    ((100, 5, 257), (64, 0, 300)),                    # the middle sequence's queries see no key
    ((0, 128, 1), (0, 128, 1)),                       # leading empty sequence, a whole tile, one token
    ((33, 0), (33, 40)),                              # last sequence: keys but no queries (dk = dv = 0)
]
VARLEN_SETTINGS = [
    dict(h=8, h_kv=2),                                  # GQA, no mask
    dict(h=4, h_kv=1, causal=True),                     # MQA, causal
    dict(h=4, h_kv=2, window=(64, 7)),                  # window
    dict(h=4, h_kv=2, causal=True, window=(3, -1)),     # narrow causal window
    dict(h=4, h_kv=4, window=(100, 100), softcap=5.0),  # window and softcap
]
VARLEN = [Case(lens_q=lq, lens_k=lk, **s) for s in VARLEN_SETTINGS for lq, lk in LENS]

# Other dtypes and head dims: a few cases each, one specialisation per line.
SUBSET = (
    [Case(d=64, h=8, h_kv=2, window=w, sq=sq, sk=sk)
     for w in [(3, 0), (64, 64), (256, -1), (-1, 33)] for sq, sk in [(1000, 129), (129, 1000)]]
    + [Case(FP16, 64, h=4, h_kv=1, causal=True, lens_q=lq, lens_k=lk) for lq, lk in LENS[:2]]
    + [Case(FP16, 128, h=8, h_kv=2, softcap=cap, sq=sq, sk=sk)
       for cap in (5.0, 30.0) for sq, sk in [(129, 1000), (1000, 129)]]
    + [Case(d=96, h=4, h_kv=2, causal=causal, window=w, sq=sq, sk=sk)
       for causal, w in [(False, (5, 7)), (True, (256, -1))] for sq, sk in [(1000, 129), (129, 1000)]]
    + [Case(d=256, h=4, h_kv=2, causal=True, lens_q=lq, lens_k=lk) for lq, lk in LENS[:2]]
)

GROUPS = {"gqa": GQA, "window": WINDOW, "softcap": SOFTCAP, "varlen": VARLEN, "subset": SUBSET}
ALL = [pytest.param(case, id=f"{group}-{case}") for group, cases in GROUPS.items() for case in cases]


# ------------------------------------------------------------------------------ helpers

def _cu_seqlens(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")


def _inputs(case, seed=0):
    """q, k, v, dout in case.dtype, and (cu_seqlens_q, cu_seqlens_k) or None. The offsets
    are made here, before any poisoning, so that they cannot take a poisoned block."""
    torch.manual_seed(seed)
    if case.varlen:
        lead_q, lead_k = (sum(case.lens_q),), (sum(case.lens_k),)
        cu = (_cu_seqlens(case.lens_q), _cu_seqlens(case.lens_k))
    else:
        lead_q, lead_k = (case.b, case.sq), (case.b, case.sk)
        cu = None
    q, k, v, dout = (torch.randn(*lead, h, case.d, device="cuda")
                     for lead, h in ((lead_q, case.h), (lead_k, case.h_kv), (lead_k, case.h_kv),
                                     (lead_q, case.h)))
    if case.softcap:
        # scaled scores (q k^T / sqrt(d)) get standard deviation s^2 = softcap / 2
        s = math.sqrt(case.softcap / 2)
        q, k = q * s, k * s
    return (*(t.to(case.dtype) for t in (q, k, v, dout)), cu)


def _call(case, q, k, v, cu, **kwargs):
    """cute_attn.mha or mha_varlen with the case's features (defaults left out, so plain
    calls take the default path), max_seqlen the actual maxima."""
    if case.causal:
        kwargs["causal"] = True
    if case.window != (-1, -1):
        kwargs["window_size"] = case.window
    if case.softcap:
        kwargs["softcap"] = case.softcap
    if case.varlen:
        return cute_attn.mha_varlen(q, k, v, *cu, max(case.lens_q), max(case.lens_k), **kwargs)
    return cute_attn.mha(q, k, v, **kwargs)


def _reference(case, q, k, v, cu, *, upcast, **wrong):
    """(out, lse) of the reference; `wrong` overrides the case's causal / window_size /
    softcap (the teeth test)."""
    kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap) | wrong
    if case.varlen:
        return attention_ref_varlen(q, k, v, *cu, upcast=upcast, **kwargs)
    return attention_ref(q, k, v, upcast=upcast, **kwargs)


def _seen(case):
    """(rows that see at least one key, keys that at least one row sees): bool vectors
    along the token dimension (dim 1 dense, the packed dim 0 varlen)."""
    pairs = zip(case.lens_q, case.lens_k) if case.varlen else [(case.sq, case.sk)]
    rows, keys = [], []
    for sq, sk in pairs:
        vis = visible_keys(sq, sk, causal=case.causal, window_size=case.window, device="cuda")
        if vis is None:
            vis = torch.ones(sq, sk, dtype=torch.bool, device="cuda")
        rows.append(vis.any(dim=1))
        keys.append(vis.any(dim=0))
    return torch.cat(rows), torch.cat(keys)


def _tokens_first(t):
    # dense (b, s, h, d) -> (s, b, h, d); varlen (total, h, d) unchanged
    return t.movedim(-3, 0)


def _assert_zero_where(t, keep, what):
    dead = _tokens_first(t)[~keep]
    assert torch.equal(dead, torch.zeros_like(dead)), f"{what} must be exactly 0"


def _assert_cap_bites(case, q, k):
    """The premise of the softcap cases: a fair share of the scaled scores lies beyond the
    cap, where softcap * tanh(s / softcap) is far from s (tanh(1) = 0.76)."""
    q0, k0 = (t[:, 0] if case.varlen else t[0, :, 0] for t in (q, k))
    scores = (q0[:512].float() @ k0[:512].float().T) * case.d ** -0.5
    beyond = (scores.abs() > case.softcap).float().mean().item()
    assert beyond > 0.02, f"only {beyond:.1%} of the scores exceed softcap {case.softcap}"


def _forward(case, q, k, v, cu, **kwargs):
    """Kernel (out, lse) on NaN-poisoned memory, with shape and dtype checks."""
    poison_allocator(q.numel() * q.element_size(), q.numel() // case.d * 4)
    out, lse = _call(case, q, k, v, cu, return_lse=True, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    lse_shape = (case.h, q.shape[0]) if case.varlen else (case.b, case.h, case.sq)
    assert lse.shape == lse_shape and lse.dtype == torch.float32, (tuple(lse.shape), lse.dtype)
    return out, lse


def _check_fwd(case, q, k, v, cu, out, lse, **wrong):
    out_ref, lse_ref = _reference(case, q, k, v, cu, upcast=True, **wrong)
    out_lp, _ = _reference(case, q, k, v, cu, upcast=False, **wrong)
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
    rows, _ = _seen(case)
    _assert_zero_where(out, rows, "out of rows that see no key")


def _kernel_grads(case, q, k, v, cu, dout, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = _call(case, q, k, v, cu, **kwargs)
    # dq like q, dk and dv like k (GQA: nheads_kv heads)
    poison_allocator(q.numel() * q.element_size(), k.numel() * k.element_size())
    return torch.autograd.grad(out, (q, k, v), dout)


def _reference_grads(case, q, k, v, cu, dout, *, upcast, **wrong):
    # fp32 leaves for the fp32 reference, or its gradients would come back rounded
    q, k, v = (t.detach().float() if upcast else t.detach() for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = _reference(case, q, k, v, cu, upcast=upcast, **wrong)
    return torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))


def _check_grads(case, q, k, v, cu, dout, grads, **wrong):
    ref = _reference_grads(case, q, k, v, cu, dout, upcast=True, **wrong)
    low = _reference_grads(case, q, k, v, cu, dout, upcast=False, **wrong)
    for name, g, g_ref, g_low, x in zip("qkv", grads, ref, low, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"d{name}: {tuple(g.shape)} {g.dtype}"
        assert not g.isnan().any(), f"d{name} has NaN"
        assert torch.isfinite(g).all(), f"d{name} is not finite"
        err = (g.float() - g_ref).abs().max().item()
        err_torch = (g_low.float() - g_ref).abs().max().item()
        rounding = (g_ref.to(x.dtype).float() - g_ref).abs().max().item()
        assert err <= 2 * err_torch + 2 * rounding + GRAD_FLOOR, (
            f"d{name}: kernel error {err:.3g} > 2 x torch {x.dtype} error {err_torch:.3g}"
            f" + 2 x rounding {rounding:.3g} + {GRAD_FLOOR}")
    rows, keys = _seen(case)
    dq, dk, dv = grads
    _assert_zero_where(dq, rows, "dq of rows that see no key")
    _assert_zero_where(dk, keys, "dk of keys that no row sees")
    _assert_zero_where(dv, keys, "dv of keys that no row sees")


# -------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("case", ALL)
def test_forward(case):
    q, k, v, _, cu = _inputs(case)
    if case.softcap:
        _assert_cap_bites(case, q, k)
    out, lse = _forward(case, q, k, v, cu)
    _check_fwd(case, q, k, v, cu, out, lse)


@pytest.mark.parametrize("case", ALL)
def test_backward(case):
    q, k, v, dout, cu = _inputs(case)
    grads = _kernel_grads(case, q, k, v, cu, dout)
    _check_grads(case, q, k, v, cu, dout, grads)


@pytest.mark.parametrize("case", [
    Case(h=8, h_kv=2, causal=True, window=(300, -1), sq=900, sk=1000),
    # packed: the turn counters index the per-sequence padded query blocks
    Case(h=8, h_kv=2, causal=True, lens_q=(300, 0, 1000, 17), lens_k=(129, 5, 1000, 17)),
], ids=["gqa-window", "varlen-gqa"])
def test_deterministic_backward_is_bit_identical(case):
    q, k, v, dout, cu = _inputs(case, seed=1)
    g1 = _kernel_grads(case, q, k, v, cu, dout, deterministic=True)
    g2 = _kernel_grads(case, q, k, v, cu, dout, deterministic=True)
    for name, a, b in zip("qkv", g1, g2):
        assert torch.equal(a, b), f"d{name} differs between two deterministic runs"
    _check_grads(case, q, k, v, cu, dout, g1)


def _compiled_keys():
    from cute_attn import launcher

    return set(launcher._cache)


def _run_and_check(case):
    q, k, v, dout, cu = _inputs(case)
    out, lse = _forward(case, q, k, v, cu)
    _check_fwd(case, q, k, v, cu, out, lse)
    _check_grads(case, q, k, v, cu, dout, _kernel_grads(case, q, k, v, cu, dout))
    return q, k, v, cu, out


def test_new_varlen_lengths_do_not_recompile():
    """cu_seqlens and max_seqlen are run-time arguments: a batch with other lengths (and
    batch size, maxima and head counts) reuses the compiled forward and backward."""
    first = Case(h=8, h_kv=2, causal=True, lens_q=(5, 300, 0), lens_k=(7, 200, 0))
    second = Case(h=4, h_kv=1, causal=True, lens_q=(1000, 1, 64, 17), lens_k=(129, 1000, 0, 17))
    _run_and_check(first)
    keys = _compiled_keys()
    q, k, v, cu, out = _run_and_check(second)
    # return_lse=False gives out alone, bit-identical to the call above
    out_only = _call(second, q, k, v, cu)
    assert isinstance(out_only, torch.Tensor) and torch.equal(out_only, out)
    new = _compiled_keys() - keys
    assert not new, f"new lengths compiled again: {new}"
    assert len(_compiled_keys()) == len(keys)


def test_cu_seqlens_values_are_checked_on_the_gpu():
    """By default mha_varlen reads the GPU offsets before the launch: a decreasing offset
    and a max_seqlen below the longest sequence raise; check_cu_seqlens=False skips the
    read and, on right offsets, gives the same output bit for bit."""
    case = Case(h=4, h_kv=2, causal=True, lens_q=(5, 300, 0), lens_k=(7, 200, 0))
    q, k, v, _, cu = _inputs(case)
    decreasing = cu[0].clone()
    decreasing[1] = 306
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing, got 306 then 305"):
        cute_attn.mha_varlen(q, k, v, decreasing, cu[1], 300, 200)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be >= the longest sequence .*\(300\), got 299"):
        cute_attn.mha_varlen(q, k, v, *cu, 299, 200)
    out = _call(case, q, k, v, cu)
    unchecked = cute_attn.mha_varlen(q, k, v, *cu, 300, 200, causal=True, check_cu_seqlens=False)
    assert torch.equal(out, unchecked)


def test_new_window_and_softcap_values_do_not_recompile():
    """The window's sides and the cap are run-time arguments of the local+softcap kernel."""
    first = Case(h=8, h_kv=2, window=(64, 64), softcap=30.0, sq=129, sk=1000)
    second = Case(h=4, h_kv=4, window=(3, 200), softcap=5.0, b=1, sq=1000, sk=17)
    _run_and_check(first)
    keys = _compiled_keys()
    _run_and_check(second)
    new = _compiled_keys() - keys
    assert not new, f"new window / softcap values compiled again: {new}"


TEETH = [
    pytest.param(Case(h=4, h_kv=2, window=(5, 7), sq=300, sk=300), dict(window_size=(5, 8)),
                 id="window-right-off-by-one"),
    pytest.param(Case(h=4, h_kv=2, window=(5, 7), sq=300, sk=300), dict(window_size=(4, 7)),
                 id="window-left-off-by-one"),
    pytest.param(Case(h=8, h_kv=2, softcap=5.0, sq=129, sk=1000), dict(softcap=0.0),
                 id="softcap-omitted"),
    pytest.param(Case(h=4, h_kv=1, causal=True, lens_q=LENS[0][0], lens_k=LENS[0][1]),
                 dict(causal=False), id="varlen-causal-omitted"),
]


@pytest.mark.parametrize("case, wrong", TEETH)
def test_accuracy_checks_have_teeth(case, wrong):
    """The checks pass the kernel against the right reference and fail it against a
    slightly wrong one, forward and backward."""
    q, k, v, dout, cu = _inputs(case)
    out, lse = _forward(case, q, k, v, cu)
    _check_fwd(case, q, k, v, cu, out, lse)
    with pytest.raises(AssertionError, match=r"out: kernel error"):
        _check_fwd(case, q, k, v, cu, out, lse, **wrong)
    grads = _kernel_grads(case, q, k, v, cu, dout)
    _check_grads(case, q, k, v, cu, dout, grads)
    with pytest.raises(AssertionError, match=r"d[qkv]: kernel error"):
        _check_grads(case, q, k, v, cu, dout, grads, **wrong)
