"""cute_attn.mha's backward on an sm_90 GPU against autograd through the fp32 reference
(skipped without one).

Accuracy rule, as for the forward: each gradient's max error against the fp32 reference
must be within 2x the error of the same backward computed by torch in the input dtype
(autograd through attention_ref(upcast=False)), plus the rounding of the reference itself
to the input dtype (the kernel returns gradients in that dtype), plus a floor.

The floor: where torch's computation is exact (seqlen_k == 1: P == 1 and dS == dP - D
cancels to 0), the kernel's dS is fp32 summation noise of D = rowsum(dO * O), a dot
product of head_dim terms of size up to ~30 here: ~head_dim * 2^-24 * 30 ~ 2e-4. 1e-3
covers it and stays below a quarter ulp of bf16 gradients of magnitude >= 1.
"""

import itertools

import pytest
import torch
from gpu_helpers import backward_buffer_bytes, exact_fp32_matmul, poison_allocator  # noqa: F401 (fixture)

import cute_attn
from cute_attn.config import CAPABILITIES
from cute_attn.reference import attention_ref

pytestmark = pytest.mark.gpu
BF16, FP16 = torch.bfloat16, torch.float16

PAIRS = [
    (1, 1), (17, 17), (17, 1000), (128, 128), (128, 129), (129, 128), (129, 17),
    (1000, 1000), (1000, 1), (1, 1000),
]
SUBSET = [(17, 1000), (129, 128), (1000, 129)]
FULL = [(BF16, 128, b, h, sq, sk) for b, h in ((1, 1), (3, 4)) for sq, sk in PAIRS]
FULL += [(BF16, 128, 1, 2, 4096, 4096), (BF16, 128, 1, 2, 4096, 129)]
PARTIAL = [(dt, d, 3, 4, sq, sk)
           for dt, d in ((FP16, 128), (BF16, 64), (FP16, 64), (BF16, 96), (BF16, 192), (BF16, 256))
           for sq, sk in SUBSET]
FLOOR = 1e-3


def _case_id(case):
    dtype, d, b, h, sq, sk = case
    return f"{str(dtype).removeprefix('torch.')}-d{d}-b{b}-h{h}-sq{sq}-sk{sk}"


def _inputs(b, sq, sk, h, d, dtype, seed=0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device="cuda") for s in (sq, sk, sk))
    dout = torch.randn(b, sq, h, d, dtype=dtype, device="cuda")
    return q, k, v, dout


def _kernel_grads(q, k, v, dout, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = cute_attn.mha(q, k, v, **kwargs)
    poison_allocator(*backward_buffer_bytes(q, k))
    return torch.autograd.grad(out, (q, k, v), dout)


def _ref_grads(q, k, v, dout, upcast, **kwargs):
    # fp32 leaves for the reference, or its gradients would come back rounded to q's dtype
    q, k, v = (t.detach().float() if upcast else t.detach() for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(q, k, v, upcast=upcast, **kwargs)
    return torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))


def _check_grads(q, k, v, dout, grads, **kwargs):
    ref = _ref_grads(q, k, v, dout, upcast=True, **kwargs)
    low = _ref_grads(q, k, v, dout, upcast=False, **kwargs)
    for name, g, g_ref, g_low, x in zip("qkv", grads, ref, low, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert not g.isnan().any(), f"d{name} has NaN"
        assert torch.isfinite(g).all(), f"d{name} not finite"
        err = (g.float() - g_ref).abs().max().item()
        err_torch = (g_low.float() - g_ref).abs().max().item()
        rounding = (g_ref.to(x.dtype).float() - g_ref).abs().max().item()
        assert err <= 2 * err_torch + 2 * rounding + FLOOR, (
            f"d{name}: kernel error {err:.3g} > 2 x torch {x.dtype} error {err_torch:.3g}"
            f" + 2 x rounding {rounding:.3g}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", FULL + PARTIAL, ids=_case_id)
def test_grads_match_reference(case, causal):
    dtype, d, b, h, sq, sk = case
    q, k, v, dout = _inputs(b, sq, sk, h, d, dtype)
    grads = _kernel_grads(q, k, v, dout, causal=causal)
    _check_grads(q, k, v, dout, grads, causal=causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_grads_from_a_nan_dq_accum(monkeypatch, d, varlen):
    """The preprocess zeroes every dQ_accum chunk the main kernel adds into and the
    postprocess reads: with the buffer handed over full of NaN (instead of whatever the
    allocator had), the gradients are still right. Lengths not multiples of any tile_m;
    varlen packs three sequences, so chunks of padding sit between them."""
    from cute_attn import launcher

    real = launcher._unset_dq_accum
    monkeypatch.setattr(launcher, "_unset_dq_accum", lambda shape, device: real(shape, device).fill_(float("nan")))
    if not varlen:
        q, k, v, dout = _inputs(2, 300, 517, 2, d, BF16)
        grads = _kernel_grads(q, k, v, dout, causal=True)
        _check_grads(q, k, v, dout, grads, causal=True)
        return
    lens_q, lens_k = (77, 300, 129), (200, 65, 333)
    starts_q, starts_k = ([0, *itertools.accumulate(n)] for n in (lens_q, lens_k))
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (starts_q, starts_k))
    torch.manual_seed(1)
    q = torch.randn(sum(lens_q), 2, d, dtype=BF16, device="cuda")
    k, v = (torch.randn(sum(lens_k), 2, d, dtype=BF16, device="cuda") for _ in range(2))
    dout = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = cute_attn.mha_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    for b in range(len(lens_q)):  # each sequence against the dense rule
        rq, rk = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        _check_grads(q[None, rq], k[None, rk], v[None, rk], dout[None, rq],
                     (grads[0][None, rq], grads[1][None, rk], grads[2][None, rk]), causal=True)


@pytest.mark.parametrize("softmax_scale", [0.05, 2.0])
def test_softmax_scale(softmax_scale):
    q, k, v, dout = _inputs(2, 129, 300, 4, 128, BF16)
    grads = _kernel_grads(q, k, v, dout, causal=True, softmax_scale=softmax_scale)
    _check_grads(q, k, v, dout, grads, causal=True, softmax_scale=softmax_scale)


def test_rows_that_see_no_key_get_zero_grads():
    sq, sk = 1000, 129
    q, k, v, dout = _inputs(3, sq, sk, 4, 128, BF16)
    dq, dk, dv = _kernel_grads(q, k, v, dout, causal=True)
    empty = sq - sk  # bottom-right causal: queries 0..870 see no key
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))
    _check_grads(q, k, v, dout, (dq, dk, dv), causal=True)


def test_dk_dv_repeatable_and_dq_close():
    """dK and dV have one writer each, so they are bit-identical run to run; dQ is summed
    with unordered atomics in the default mode, so only close."""
    q, k, v, dout = _inputs(2, 1000, 1000, 4, 128, BF16)
    g1 = _kernel_grads(q, k, v, dout, causal=True)
    g2 = _kernel_grads(q, k, v, dout, causal=True)
    assert torch.equal(g1[1], g2[1]) and torch.equal(g1[2], g2[2])
    torch.testing.assert_close(g1[0], g2[0], atol=1e-2, rtol=0)


def _stride_order(t):
    return sorted(range(t.dim()), key=lambda i: -t.stride(i))


def test_transposed_bhsd_layout():
    b, sq, sk, h, d = 2, 300, 129, 4, 128
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, s, d, dtype=BF16, device="cuda").transpose(1, 2)
                     for s in (sq, sk, sk, sq))
    grads = _kernel_grads(q, k, v, dout, causal=True)
    for g, x in zip(grads, (q, k, v)):
        assert _stride_order(g) == _stride_order(x)
    _check_grads(q, k, v, dout, grads, causal=True)


def test_expanded_dout_from_sum():
    """out.sum().backward() hands the backward a stride-0 dout; it must still work."""
    q, k, v, _ = _inputs(1, 129, 129, 2, 64, BF16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cute_attn.mha(q, k, v, causal=True).sum().backward()
    grads = (q.grad, k.grad, v.grad)
    _check_grads(q, k, v, torch.ones_like(q), grads, causal=True)


def test_backward_memory_is_linear_in_seqlen():
    """Peak extra memory of a backward call: a few tensors of q's size, never seqlen^2
    (which here would be 4 heads x 8192^2 x 4 bytes = 1 GiB)."""
    b, s, h, d = 1, 8192, 4, 128
    q, k, v, dout = _inputs(b, s, s, h, d, BF16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = cute_attn.mha(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # dq, dk, dv (3 x q) + the fp32 dQ accumulator (2 x q) + LSE2/D rows: < 8 x q
    assert extra < 8 * q.numel() * q.element_size(), f"backward used {extra / 2**20:.1f} MiB extra"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_is_bit_identical(causal):
    q, k, v, dout = _inputs(2, 1000, 1000, 4, 128, BF16, seed=1)
    g1 = _kernel_grads(q, k, v, dout, causal=causal, deterministic=True)
    g2 = _kernel_grads(q, k, v, dout, causal=causal, deterministic=True)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    _check_grads(q, k, v, dout, g1, causal=causal)


def test_backward_covers_every_forward_head_dim():
    assert set(CAPABILITIES["bwd"].head_dims) == set(CAPABILITIES["fwd"].head_dims)
