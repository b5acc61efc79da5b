"""cute_attn.mha on an sm_90 GPU against the fp32 reference (skipped without one).

Accuracy rule (FlashAttention style): the kernel's max error against the fp32
reference must be within 2x the error of the same attention computed by torch in
the input dtype (attention_ref(upcast=False)), plus a rounding floor.

Runtime: each (dtype, headdim, causal) is one compiled kernel, so the matrix is
full only for bf16 / headdim 128 and a subset of shapes elsewhere (14 kernels).
"""

import pytest
import torch
from gpu_checks import Case, call_mha, check_forward, check_grads, kernel_grads, make_inputs, run_forward
from gpu_helpers import exact_fp32_matmul, forget_bound_launches, poison_allocator, validation_spy  # noqa: F401

import cute_attn
from cute_attn import api
from cute_attn.config import CAPABILITIES
from cute_attn.reference import attention_ref

pytestmark = pytest.mark.gpu

# Rounding floor of the accuracy rule. It matters only where the torch computation is
# exact (err_torch == 0, e.g. seqlen_k == 1 where out == v): there the kernel may still
# differ from the fp32 reference by fp32 summation-order noise, a few fp32 ulps
# (2^-23 ~ 1.2e-7) of |out| < ~5. 1e-5 covers that with margin and is far below one
# ulp of the output dtype near 1 (bf16 2^-8 ~ 3.9e-3, fp16 2^-11 ~ 4.9e-4), so it
# cannot hide a rounding mistake of the kernel's own.
FLOOR = 1e-5
# LSE is computed in fp32 from the same (exactly upcast) inputs in both; differences
# are exp2/log2 approximation and summation order, ~1e-5 for |lse| < ~20.
LSE_ATOL = 1e-3

# (seqlen_q, seqlen_k): odd sizes around tile edges, sq > sk (fully masked causal
# rows), sq < sk, single query / single key, and long sequences.
PAIRS = [
    (1, 1), (1, 4096), (17, 17), (17, 1000), (128, 128), (128, 129),
    (129, 128), (129, 17), (1000, 1000), (1000, 1), (4096, 4096), (4096, 129),
]
SUBSET = [(1, 17), (128, 129), (1000, 129), (4096, 4096)]
HEAD_DIMS = CAPABILITIES["fwd"].head_dims
MAIN_DIMS = [d for d in (64, 128) if d in HEAD_DIMS]
OTHER_DIMS = [d for d in HEAD_DIMS if d not in MAIN_DIMS]
BF16, FP16 = torch.bfloat16, torch.float16

# Full matrix: bf16, headdim 128, every pair, batch (1, 3) x nheads (1, 16).
FULL = [(BF16, 128, b, h, sq, sk) for b in (1, 3) for h in (1, 16) for sq, sk in PAIRS]
# Subset: other dtype / head dim combos, batch 3 x nheads 16, the SUBSET pairs.
COMBOS = [(FP16, 128), (BF16, 64), (FP16, 64)] + [(BF16, d) for d in OTHER_DIMS]
PARTIAL = [(dt, d, 3, 16, sq, sk) for dt, d in COMBOS if d in HEAD_DIMS
           for sq, sk in SUBSET]


def _case_id(case):
    dtype, d, b, h, sq, sk = case
    return f"{str(dtype).removeprefix('torch.')}-d{d}-b{b}-h{h}-sq{sq}-sk{sk}"


def _qkv(b, sq, sk, h, d, dtype, seed=0):
    torch.manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, dtype=dtype, device="cuda") for s in (sq, sk, sk))


def _out_lse_bytes(q):
    b, sq, h, _ = q.shape
    return q.numel() * q.element_size(), b * h * sq * 4


def _run(q, k, v, **kwargs):
    """mha on NaN-poisoned memory, with output shape/dtype checks."""
    poison_allocator(*_out_lse_bytes(q))
    out, lse = cute_attn.mha(q, k, v, return_lse=True, **kwargs)
    b, sq, h, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    return out, lse


def _check_against_reference(q, k, v, out, lse, *, causal, softmax_scale=None):
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
    out_lp, _ = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=False)
    # NaN compares false everywhere, so say it outright rather than rely on max().
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.isfinite(out).all()
    err_kernel = (out.float() - out_ref).abs().max().item()
    err_torch = (out_lp.float() - out_ref).abs().max().item()
    assert err_kernel <= 2 * err_torch + FLOOR, (
        f"out: kernel error {err_kernel:.3g} > 2 x torch {q.dtype} error {err_torch:.3g} + {FLOOR}")

    empty = torch.isneginf(lse_ref)  # rows that see no key
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly on rows with no key"
    if not empty.all():
        assert torch.isfinite(lse[~empty]).all()
        lse_err = (lse[~empty] - lse_ref[~empty]).abs().max().item()
        assert lse_err <= LSE_ATOL, f"lse: error {lse_err:.3g} > {LSE_ATOL}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", FULL + PARTIAL, ids=_case_id)
def test_matches_reference(case, causal):
    dtype, d, b, h, sq, sk = case
    q, k, v = _qkv(b, sq, sk, h, d, dtype)
    out, lse = _run(q, k, v, causal=causal)
    _check_against_reference(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("softmax_scale", [0.05, 1.0, 3.0])
def test_softmax_scale(softmax_scale):
    q, k, v = _qkv(2, 129, 1000, 4, 128, BF16)
    out, lse = _run(q, k, v, causal=True, softmax_scale=softmax_scale)
    _check_against_reference(q, k, v, out, lse, causal=True, softmax_scale=softmax_scale)


def test_return_lse_false_returns_only_out():
    q, k, v = _qkv(1, 128, 128, 2, 128, BF16)
    out = cute_attn.mha(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_fully_masked_rows(dtype):
    sq, sk = 1000, 129
    q, k, v = _qkv(3, sq, sk, 16, 128, dtype)
    out, lse = _run(q, k, v, causal=True)
    empty = sq - sk  # bottom-right causal: queries 0..870 see no key
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[..., :empty]).all()
    _check_against_reference(q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic(causal):
    q, k, v = _qkv(3, 1000, 1000, 16, 128, BF16)
    out1, lse1 = _run(q, k, v, causal=causal)
    out2, lse2 = _run(q, k, v, causal=causal)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


def _stride_order(t):
    return sorted(range(t.dim()), key=lambda i: -t.stride(i))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_transposed_bhsd_layout(causal):
    b, sq, sk, h, d = 2, 1000, 129, 16, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, dtype=BF16, device="cuda").transpose(1, 2)
               for s in (sq, sk, sk))
    out, lse = _run(q, k, v, causal=causal)
    assert _stride_order(out) == _stride_order(q)
    # The same values laid out differently must give bit-identical results: TMA
    # loads the same tiles, and nothing in the math depends on strides.
    out_c, lse_c = _run(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    _check_against_reference(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (3, 1000, 16, 128), (2, 129, 3, 256)])
def test_poison_reaches_the_outputs(shape):
    """The poisoning above really hands NaN memory to the next same-sized torch.empty."""
    b, sq, h, d = shape
    q = torch.empty(shape, dtype=BF16, device="cuda")
    for first_out in (True, False):
        poison_allocator(*_out_lse_bytes(q))
        make_out = lambda: torch.empty(shape, dtype=BF16, device="cuda")  # noqa: E731
        make_lse = lambda: torch.empty(b, h, sq, dtype=torch.float32, device="cuda")  # noqa: E731
        if first_out:
            out, lse = make_out(), make_lse()
        else:
            lse, out = make_lse(), make_out()
        assert out.isnan().all() and lse.isnan().all()
        del out, lse


@pytest.mark.parametrize("d", [64, 128])
def test_late_first_key_with_very_negative_scores(d):
    """A causal row whose first visible key arrives after an all-masked block, with scores
    so negative that exp2(-max) overflows: the rescale of the (empty) running sum must be
    0, not inf (inf * 0 = NaN). Found by reading softmax.py; rows 0..127 of hdim 64's
    192-row tile hit it before the fix."""
    q = torch.full((1, 256, 1, d), 4.0, device="cuda", dtype=BF16)
    k = -q
    v = torch.randn_like(q)
    out, lse = _run(q, k, v, causal=True)
    _check_against_reference(q, k, v, out, lse, causal=True)


FAST_PATH_CASES = [
    # GQA, lengths no tile multiple, a grid (7 query tiles x 16 heads x 3) that fills the GPU
    Case(b=3, sq=777, sk=1000, h=16, h_kv=4),
    Case(b=3, sq=777, sk=1000, h=16, h_kv=4, causal=True, softmax_scale=0.07),
    # decode: a grid of 8 CTAs, so split-KV with its per-stream workspace
    Case(b=1, sq=1, sk=3000, h=32, h_kv=8, causal=True),
    Case(b=2, sq=5, sk=1031, h=16, h_kv=16),
]


@pytest.mark.parametrize("case", FAST_PATH_CASES, ids=str)
def test_repeated_signature_takes_the_fast_path(case, monkeypatch):
    """mha's plain call of a signature seen before skips the checks (api._PlainCall): after
    the first call, fresh inputs of that signature never reach validation, yet match the
    reference (out alone, with lse, under autograd); an address off TMA's 16 bytes or a
    negative-bit view of the same layout does reach it, and is refused."""
    forget_bound_launches(monkeypatch)
    q, k, v, dout, cu = make_inputs(case, seed=1)
    run_forward(case, q, k, v, cu)  # binds the signature
    checks = validation_spy(monkeypatch, api, "validate_fwd_inputs")
    for seed in (2, 3):
        q, k, v, dout, cu = make_inputs(case, seed=seed)
        out, lse = run_forward(case, q, k, v, cu)
        check_forward(case, q, k, v, cu, out, lse)
        assert torch.equal(call_mha(case, q, k, v, cu), out)
    check_grads(case, q, k, v, cu, dout, kernel_grads(case, q, k, v, cu, dout))
    assert not checks, "a bound signature went through validation"
    buffer = torch.randn(q.numel() + 1, dtype=q.dtype, device="cuda")
    q_off = buffer[1:].view(q.shape)  # 2 bytes past an aligned address
    assert q_off.stride() == q.stride()
    with pytest.raises(ValueError, match="aligned"):
        call_mha(case, q_off, k, v, cu)
    with pytest.raises(ValueError, match="resolve_neg"):
        call_mha(case, q, torch._neg_view(k), v, cu)
    assert len(checks) == 2
