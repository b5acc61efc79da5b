"""cute_attn.fp8 on the CPU: e4m3 quantisation with per-(batch, kv head) descales, and the
torch emulation of an FP8 forward against cute_attn.reference.attention_ref.

The yardsticks come from the format: e4m3 rounds a normal value with relative error at
most 2^-4 and a subnormal one with absolute error at most 2^-10 (stored units). The
attention tests compare the emulation with the float32 reference on the *dequantised*
inputs, so what they measure is the cost of rounding P to e4m3 (the only rounding the
kernel adds after quantisation), and the P-scale test shows why P is scaled first.
"""

import math

import pytest
import torch

if getattr(torch, "float8_e4m3fn", None) is None:
    pytest.skip(f"torch {torch.__version__} has no float8_e4m3fn", allow_module_level=True)

from cute_attn.fp8 import (  # noqa: E402  (after the skip)
    E4M3_MAX,
    E4M3_REL_ERR,
    E4M3_SUBNORMAL_ABS_ERR,
    dequantize,
    fp8_attention_emulated,
    quantize_fp8,
    rmse,
)
from cute_attn.reference import attention_ref  # noqa: E402

FP8 = torch.float8_e4m3fn


def _randn(gen, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _qkv(seed=0, b=2, sq=32, sk=64, h=4, h_kv=2, d=64, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (_randn(gen, b, sq, h, d, dtype=dtype), _randn(gen, b, sk, h_kv, d, dtype=dtype),
            _randn(gen, b, sk, h_kv, d, dtype=dtype))


def _per_element_descale(descale, nheads):
    """(batch, nheads_kv) -> (batch, 1, nheads, 1), head h reading h // group."""
    return descale.repeat_interleave(nheads // descale.shape[1], dim=1)[:, None, :, None]


def _assert_round_trip(x, x8, descale):
    """|dequantised - x| <= 2^-4 |x| + descale * 2^-10 element-wise (a few float32 ulps
    of slack for the scale products), and the bound is not vacuous."""
    x = x.float()
    back = dequantize(x8, descale)
    ds = _per_element_descale(descale, x.shape[2])
    bound = (E4M3_REL_ERR * x.abs() + E4M3_SUBNORMAL_ABS_ERR * ds) * (1 + 1e-5)
    err = (back - x).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    normal = x.abs() > 2.0 ** -6 * ds
    if normal.any():  # round to nearest really uses most of the half ulp somewhere
        assert (err[normal] / x.abs()[normal]).max() > 2.0 ** -5


def _ref_on_dequantised(q8, k8, v8, qd, kd, vd, **kw):
    return attention_ref(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), **kw)


# ----------------------------------------------------------------------------------------
# Quantisation
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per", ["head", "tensor"])
def test_round_trip_error_bound(dtype, per):
    q, k, v = _qkv(seed=1, dtype=dtype)
    # heads of different magnitudes, and values spanning a wide range within a head
    k = k * torch.tensor([1.0, 30.0], dtype=dtype)[None, None, :, None]
    v = v * torch.logspace(-3, 1, v.shape[1], dtype=torch.float32)[None, :, None, None].to(dtype)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, per=per)
    for x, x8, ds in ((q, q8, qd), (k, k8, kd), (v, v8, vd)):
        _assert_round_trip(x, x8, ds)


def test_shapes_dtypes_and_amax_to_448():
    q, k, v = _qkv(seed=2, b=3, h=6, h_kv=3)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    for x, x8, ds in ((q, q8, qd), (k, k8, kd), (v, v8, vd)):
        assert x8.dtype == FP8 and x8.shape == x.shape
        assert ds.dtype == torch.float32 and ds.shape == (3, 3)
        stored = x8.float()
        assert not stored.isnan().any() and stored.abs().max() <= E4M3_MAX
        b, s, h, d = x.shape
        per_slice = stored.abs().reshape(b, s, 3, h // 3, d).amax(dim=(1, 3, 4))
        # the largest magnitude of every (batch, kv head) slice lands on 448 itself
        assert torch.equal(per_slice, torch.full_like(per_slice, E4M3_MAX))
        amax = x.float().abs().reshape(b, s, 3, h // 3, d).amax(dim=(1, 3, 4))
        torch.testing.assert_close(ds, amax / E4M3_MAX, rtol=1e-6, atol=0)


def test_per_tensor_scale_is_one_value_in_the_same_shape():
    q, k, v = _qkv(seed=3)
    k = k * torch.tensor([1.0, 10.0], dtype=k.dtype)[None, None, :, None]
    *_, qd, kd, vd = quantize_fp8(q, k, v, per="tensor")
    for ds, x in ((qd, q), (kd, k), (vd, v)):
        assert ds.shape == (2, 2)
        assert torch.equal(ds, torch.full_like(ds, x.float().abs().max().item() / E4M3_MAX))


def test_zero_slices_get_descale_one():
    q, k, v = _qkv(seed=4)
    v = torch.zeros_like(v)
    k = k.clone()
    k[1, :, 0] = 0  # one (batch, kv head) slice of zeros
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    assert torch.equal(vd, torch.ones_like(vd)) and not v8.float().any()
    assert kd[1, 0] == 1 and not k8[1, :, 0].float().any()
    assert (kd[0] != 1).all() and (kd[1, 1] != 1)
    assert torch.isfinite(torch.stack([qd, kd, vd])).all()


def test_tiny_amax_keeps_normal_float32_scales():
    q, k, v = _qkv(seed=5, dtype=torch.float32)
    k = k * 1e-37  # 448 / amax would overflow float32
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    assert torch.isfinite(kd).all() and (kd >= torch.finfo(torch.float32).tiny).all()
    _assert_round_trip(k, k8, kd)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises_naming_the_tensor(name, bad):
    tensors = dict(zip("qkv", _qkv(seed=6)))
    tensors[name] = tensors[name].clone()
    tensors[name][0, 3, 1, 5] = bad
    with pytest.raises(ValueError, match=rf"^{name} has non-finite values"):
        quantize_fp8(tensors["q"], tensors["k"], tensors["v"])


def test_bad_arguments():
    q, k, v = _qkv(seed=7)
    with pytest.raises(ValueError, match="per must be"):
        quantize_fp8(q, k, v, per="block")
    with pytest.raises(TypeError, match="q must be torch.float16 or torch.bfloat16"):
        quantize_fp8(q.to(torch.int32), k, v)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    with pytest.raises(TypeError, match="k must be torch.float8_e4m3fn"):
        fp8_attention_emulated(q8, k, v8, qd, kd, vd)
    with pytest.raises(ValueError, match=r"v_descale must be a \(2, 2\) tensor"):
        fp8_attention_emulated(q8, k8, v8, qd, kd, vd[:, :1])
    with pytest.raises(ValueError, match="p_scale must be"):
        fp8_attention_emulated(q8, k8, v8, qd, kd, vd, p_scale=512.0)
    with pytest.raises(ValueError, match="descale must be"):
        dequantize(q8, qd[:, :1].expand(2, 3))


def test_gqa_q_descale_shared_within_each_group():
    """4 query heads per kv head with different magnitudes: q's descale (batch, nheads_kv)
    is the amax of the whole group / 448, and every head of the group dequantises with it
    within the e4m3 bound."""
    q, k, v = _qkv(seed=8, h=8, h_kv=2)
    q = q * torch.tensor([1, 2, 4, 8, 0.5, 0.25, 3, 1], dtype=q.dtype)[None, None, :, None]
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    assert qd.shape == (2, 2)
    group_amax = q.float().abs().reshape(2, q.shape[1], 2, 4, q.shape[3]).amax(dim=(1, 3, 4))
    torch.testing.assert_close(qd, group_amax / E4M3_MAX, rtol=1e-6, atol=0)
    # only the loudest head of each group reaches 448
    head_max = q8.float().abs().amax(dim=(1, 3))  # (batch, heads)
    assert torch.equal(head_max[:, 3], torch.full((2,), E4M3_MAX))
    assert torch.equal(head_max[:, 6], torch.full((2,), E4M3_MAX))
    assert (head_max[:, [0, 1, 2, 4, 5, 7]] < E4M3_MAX).all()
    _assert_round_trip(q, q8, qd)


# ----------------------------------------------------------------------------------------
# The emulated FP8 forward
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_emulation_against_reference(heads, causal):
    h, h_kv = heads
    q, k, v = _qkv(seed=9, b=2, sq=48, sk=96, h=h, h_kv=h_kv)
    fp8 = quantize_fp8(q, k, v)
    ref, lse_ref = _ref_on_dequantised(*fp8, causal=causal)
    out, lse = fp8_attention_emulated(*fp8, causal=causal)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (2, h, 48)
    err, worst = rmse(out, ref), (out - ref).abs().max().item()
    print(f"\nfp8 emulation vs fp32 reference ({h}/{h_kv} heads, causal={causal}): "
          f"rmse {err:.2e}, max {worst:.2e}, lse max {(lse - lse_ref).abs().max().item():.2e}")
    # P rounded to e4m3 (relative 2^-4, averaged over ~50-100 keys) on O(0.1-1) outputs
    assert err < 6e-3 and worst < 4e-2
    # the LSE comes from the float32 scores and row sum: no FP8 rounding in it
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=2e-5)
    # the kernel's blocked online softmax rounds P against the running max instead:
    # a different rounding of P, the same error budget
    out_b, lse_b = fp8_attention_emulated(*fp8, causal=causal, block_n=32)
    torch.testing.assert_close(lse_b, lse_ref, rtol=0, atol=2e-5)
    assert rmse(out_b, ref) < 6e-3 and rmse(out_b, out) < 6e-3


@pytest.mark.parametrize("block_n", [None, 32])
def test_emulation_with_a_sink_against_reference(block_n):
    """The emulation's sink (one more e^sink term per row, taken at the end as the kernel
    does) against the fp32 reference with the same sink on the dequantised inputs: the
    LSE to float32 rounding, out within the P rounding's budget; a sink far above the
    scores takes most of each row; rows without keys get out = 0 and lse = sink."""
    from cute_attn import masks
    from cute_attn.mask_reference import attention_ref_mod

    q, k, v = _qkv(seed=13, b=2, sq=48, sk=48, h=4, h_kv=2)
    fp8 = quantize_fp8(q, k, v)
    deq = [dequantize(x, d) for x, d in zip(fp8[:3], fp8[3:])]
    for sink in (torch.tensor([0.0, 1.5, -2.0, 3.0]), torch.full((4,), 30.0)):
        ref, lse_ref = attention_ref_mod(*deq, mask_mod=masks.causal(), sink=sink)
        out, lse = fp8_attention_emulated(*fp8, causal=True, sink=sink, block_n=block_n)
        torch.testing.assert_close(lse, lse_ref, rtol=0, atol=2e-5)
        assert rmse(out, ref) < 6e-3 and (out - ref).abs().max().item() < 4e-2
    q, k, v = _qkv(seed=14, b=1, sq=8, sk=0, h=4, h_kv=2)
    out, lse = fp8_attention_emulated(*quantize_fp8(q, k, v), sink=sink)
    assert not out.any() and torch.equal(lse, sink[None, :, None].expand(1, 4, 8))


def test_emulation_error_is_the_fp8_p_rounding():
    """Against the reference on the original (bf16) inputs the error adds the input
    quantisation; against the dequantised inputs only P's rounding is left, which is
    smaller."""
    q, k, v = _qkv(seed=10, h=4, h_kv=4, sk=128)
    fp8 = quantize_fp8(q, k, v)
    out, _ = fp8_attention_emulated(*fp8)
    vs_dequantised = rmse(out, _ref_on_dequantised(*fp8)[0])
    vs_original = rmse(out, attention_ref(q, k, v)[0])
    print(f"\nrmse vs dequantised inputs {vs_dequantised:.2e}, vs bf16 inputs {vs_original:.2e}")
    assert vs_dequantised < vs_original < 2e-2


def _long_tail_case():
    """Every query sees one key with score 8 (P = 1) and 255 keys with score 0
    (P = e^-8 = 3.4e-4, below 2^-11): the tail holds 255 e^-8 / (1 + 255 e^-8) = 8% of
    the mass, and its values (1) differ from the top key's (0). Exactly representable in
    e4m3, so quantisation adds nothing."""
    b, sq, sk, h, d = 1, 4, 256, 2, 64
    q = torch.zeros(b, sq, h, d)
    q[..., 0] = 1
    k = torch.zeros(b, sk, h, d)
    k[:, 17, :, 0] = 8
    v = torch.ones(b, sk, h, d)
    v[:, 17] = 0
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def test_p_scale_keeps_small_probabilities():
    """Unscaled, P = e^-8 rounds to 0 in e4m3 (below half the smallest subnormal, 2^-10):
    the tail vanishes and the output drops from 0.08 to 0. Scaled by 448 (or FlashAttention-
    3's 256), e^-8 * 448 = 0.15 is a normal e4m3 value and the output is right to 2^-4."""
    fp8 = quantize_fp8(*_long_tail_case())
    ref, _ = _ref_on_dequantised(*fp8, softmax_scale=1.0)
    tail_mass = 255 * math.exp(-8) / (1 + 255 * math.exp(-8))
    torch.testing.assert_close(ref, torch.full_like(ref, tail_mass), rtol=1e-5, atol=0)
    errors = {}
    for p_scale in (448.0, 256.0, 1.0):
        out, _ = fp8_attention_emulated(*fp8, softmax_scale=1.0, p_scale=p_scale)
        errors[p_scale] = rmse(out, ref)
    print(f"\nlong-tail rmse by p_scale: {errors}")
    assert errors[1.0] == pytest.approx(tail_mass, rel=1e-5)  # the tail flushed entirely
    assert errors[448.0] < E4M3_REL_ERR * tail_mass and errors[256.0] < E4M3_REL_ERR * tail_mass
    assert errors[1.0] > 20 * errors[448.0]


@pytest.mark.parametrize("block_n", [None, 16])
@pytest.mark.parametrize(
    "mask",
    [
        dict(causal=True),  # seqlen_q > seqlen_k: the first rows see no key
        dict(window_size=(8, 0)),
        dict(window_size=(4, 4)),
        dict(window_size=(-1, 2)),
        dict(softcap=5.0),
        dict(causal=True, window_size=(6, -1), softcap=3.0),
    ],
    ids=["causal", "window-left", "window-both", "window-right", "softcap", "causal-window-softcap"],
)
def test_masks_softcap_and_empty_rows(mask, block_n):
    q, k, v = _qkv(seed=11, b=1, sq=40, sk=24, h=4, h_kv=2)
    fp8 = quantize_fp8(q, k, v)
    ref, lse_ref = _ref_on_dequantised(*fp8, **mask)
    out, lse = fp8_attention_emulated(*fp8, block_n=block_n, **mask)
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty)
    if mask.get("causal"):
        assert empty[..., :16].all()  # queries 0..15 of 40 against 24 keys see nothing
    assert not out.transpose(1, 2)[empty].any()  # out = 0 on those rows
    assert rmse(out, ref) < 1e-2
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=2e-5)


def test_no_keys_at_all():
    q, k, v = _qkv(seed=12, sk=0)
    fp8 = quantize_fp8(q, k, v)
    assert torch.equal(fp8[4], torch.ones_like(fp8[4]))  # empty slices: descale 1
    out, lse = fp8_attention_emulated(*fp8)
    assert not out.any() and torch.isneginf(lse).all()


def test_outlier_heads_per_head_vs_per_tensor():
    """e4m3 is a floating-point format: a per-tensor scale that is 20x too large for most
    heads (a few x20 outlier channels in one head) only shifts their exponents, so the
    error barely moves. Per-head scales pay off once the spread between heads pushes the
    quiet heads below e4m3's normal range (here 2^14: their amax lands near 448 / 2^14 =
    0.027 stored, among the subnormals), where the error grows."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = (_randn(gen, 2, 64, 4, 64, dtype=torch.float32) for _ in range(3))
    results = {}
    cases = (("x20 channels", 20.0, slice(0, 3)), ("2^14 head", 2.0 ** 14, slice(None)))
    for label, factor, channels in cases:
        k_o, v_o = k.clone(), v.clone()
        k_o[:, :, 0, channels] *= factor
        v_o[:, :, 0, channels] *= factor
        ref, _ = attention_ref(q, k_o, v_o)
        for per in ("head", "tensor"):
            out, _ = fp8_attention_emulated(*quantize_fp8(q, k_o, v_o, per=per))
            results[label, per] = rmse(out[:, :, 1:], ref[:, :, 1:])  # the quiet heads
    print(f"\nrmse of the heads without outliers: {results}")
    ratio_20 = results["x20 channels", "tensor"] / results["x20 channels", "head"]
    assert 0.8 < ratio_20 < 1.25
    assert results["2^14 head", "head"] <= results["2^14 head", "tensor"] / 1.5


def test_rmse():
    assert rmse(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0])) == pytest.approx(math.sqrt(2))
    inf = float("-inf")
    assert rmse(torch.tensor([inf, 3.0]), torch.tensor([inf, 3.0])) == 0.0
    assert rmse(torch.empty(0), torch.empty(0)) == 0.0


# ----------------------------------------------------------------------------------------
# The FP8 entry points' validation (cute_attn.mha / mha_varlen with e4m3 inputs): every
# check that can be judged on CPU tensors raises, naming the argument, before any kernel
# ----------------------------------------------------------------------------------------

import cute_attn  # noqa: E402
from cute_attn.fp8 import hadamard  # noqa: E402


def _fp8_qkv(b=2, sq=16, sk=24, h=4, h_kv=2, d=128):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(b, s, n, d, generator=gen).to(FP8) for s, n in ((sq, h), (sk, h_kv), (sk, h_kv)))


def test_fp8_call_checks_dtypes_and_descales_naming_the_argument():
    q8, k8, v8 = _fp8_qkv()
    ones = torch.ones(2, 2)
    with pytest.raises(TypeError, match="k must be torch.float8_e4m3fn"):
        cute_attn.mha(q8, k8.bfloat16(), v8)
    with pytest.raises(TypeError, match="q must be torch.float8_e4m3fn"):
        cute_attn.mha(q8.bfloat16(), k8.bfloat16(), v8.bfloat16(), q_descale=ones)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(batch, nheads_kv\) = \(2, 2\)"):
        cute_attn.mha(q8, k8, v8, k_descale=torch.ones(2, 4))
    with pytest.raises(TypeError, match="v_descale must be torch.float32"):
        cute_attn.mha(q8, k8, v8, v_descale=ones.double())
    with pytest.raises(TypeError, match="q_descale must be None or a torch.Tensor"):
        cute_attn.mha(q8, k8, v8, q_descale=1.0)
    with pytest.raises(TypeError, match="out_dtype must be None"):
        cute_attn.mha(q8, k8, v8, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out_dtype is for FP8 inputs"):
        cute_attn.mha(q8.bfloat16(), k8.bfloat16(), v8.bfloat16(), out_dtype=torch.float16)
    # a descale that requires grad would get none (the FP8 forward has no backward)
    with pytest.raises(NotImplementedError, match="has no backward"):
        cute_attn.mha(q8, k8, v8, v_descale=torch.ones(2, 2, requires_grad=True))
    with torch.no_grad():  # no autograd: the check does not apply (then the CPU device is refused)
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            cute_attn.mha(q8, k8, v8, v_descale=torch.ones(2, 2, requires_grad=True))


def test_fp8_call_checks_head_dim_layout_and_device():
    q8, k8, v8 = _fp8_qkv(d=96)
    with pytest.raises(ValueError, match="headdim must be one of .* for the FP8 forward, got 96"):
        cute_attn.mha(q8, k8, v8)
    q8, k8, v8 = _fp8_qkv()
    with pytest.raises(ValueError, match="k must be contiguous in the last dimension"):
        cute_attn.mha(q8, k8.transpose(1, 3).contiguous().transpose(1, 3), v8)
    # every check passes on CPU tensors up to the device: the message names it
    with pytest.raises(ValueError, match="q is on cpu"):
        cute_attn.mha(q8, k8, v8, q_descale=torch.ones(2, 2), out_dtype=torch.float16)


def test_fp8_varlen_checks_descales_against_the_sequences():
    q8, k8, v8 = (t[0] for t in _fp8_qkv(b=1, sq=30, sk=40))
    cu_q = torch.tensor([0, 10, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 15, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, nheads_kv\) = \(2, 2\)"):
        cute_attn.mha_varlen(q8, k8, v8, cu_q, cu_k, 20, 25, q_descale=torch.ones(1, 2))
    with pytest.raises(ValueError, match="is on cpu"):
        cute_attn.mha_varlen(q8, k8, v8, cu_q, cu_k, 20, 25, q_descale=torch.ones(2, 2))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_rotation_keeps_scores(d):
    """quantize_fp8(rotate=True): H is orthonormal, so (q H)(k H)^T = q k^T; the rotated
    e4m3 inputs dequantise to attention inputs with the same scores (up to rounding)."""
    h = hadamard(d)
    assert torch.allclose(h @ h.T, torch.eye(d), atol=1e-5)
    gen = torch.Generator().manual_seed(d)
    q, k, v = (torch.randn(1, 20, 2, d, generator=gen) for _ in range(3))
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, rotate=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", dequantize(q8, qd), dequantize(k8, kd))
    exact = torch.einsum("bqhd,bkhd->bhqk", q, k)
    assert (scores - exact).abs().max() < 0.1 * exact.abs().max()
    assert torch.equal(v8, quantize_fp8(q, k, v)[2])  # v is not rotated
    with pytest.raises(ValueError, match="power-of-two head dim"):
        quantize_fp8(*(torch.randn(1, 4, 1, 96) for _ in range(3)), rotate=True)


@pytest.mark.parametrize("extra", [dict(dropout_p=0.1), dict(mask_mod="m"), dict(score_mod="s"),
                                   dict(block_mask="b")])
def test_fp8_refuses_what_only_the_mods_kernel_has(extra):
    """Dropout or mods with FP8 inputs: an error naming them, never dropped."""
    q8, k8, v8 = _fp8_qkv()
    name = next(iter(extra))
    with pytest.raises(NotImplementedError, match=f"{name}: no FP8 kernel yet"):
        cute_attn.mha(q8, k8, v8, **extra)
    if name == "dropout_p":
        q8, k8, v8 = (t[0] for t in _fp8_qkv(b=1, sq=30, sk=40))
        cu_q, cu_k = torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 15, 40], dtype=torch.int32)
        with pytest.raises(NotImplementedError, match=f"{name}: no FP8 kernel yet"):
            cute_attn.mha_varlen(q8, k8, v8, cu_q, cu_k, 20, 25, **extra)


class _SinkRecorder:
    """A launcher that records what run_fwd_fp8 receives (features, sink) and returns
    outputs of the launcher's shapes."""

    def __init__(self):
        self.calls = []

    def run_fwd_fp8(self, q, k, v, descales, policy, features, args, need_lse=True, sink=None):
        self.calls.append((features, sink))
        heads = q.shape[-2]
        lse_shape = (heads, q.shape[0]) if features.varlen else (q.shape[0], heads, q.shape[1])
        return torch.zeros(q.shape, dtype=policy.output), torch.zeros(lse_shape)


def test_fp8_sink_is_checked_and_reaches_the_kernel(monkeypatch):
    """learnable_sink with FP8 inputs (dense and varlen): shape, dtype and device checked
    naming it, a sink that requires grad refused (the FP8 forward has no backward), a valid
    one reaching run_fwd_fp8 as float32 (heads,) with AttnFeatures.sink; with no keys the
    rows see only the sink (lse = its logit, no kernel)."""
    from cpu_standin import fake_cuda

    from cute_attn import api, validation

    recorder = _SinkRecorder()
    monkeypatch.setattr(api, "_launcher_module", recorder)
    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    q8, k8, v8 = (fake_cuda(t) for t in _fp8_qkv())
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(nheads,\) = \(4,\)"):
        cute_attn.mha(q8, k8, v8, learnable_sink=fake_cuda(torch.zeros(2)))
    with pytest.raises(TypeError, match="learnable_sink must be float32, bfloat16 or float16"):
        cute_attn.mha(q8, k8, v8, learnable_sink=fake_cuda(torch.zeros(4, dtype=torch.int32)))
    with pytest.raises(ValueError, match="learnable_sink is on cpu"):
        cute_attn.mha(q8, k8, v8, learnable_sink=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="has no backward"):
        cute_attn.mha(q8, k8, v8, learnable_sink=fake_cuda(torch.zeros(4)).requires_grad_())
    assert not recorder.calls
    sink = fake_cuda(torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16))
    cute_attn.mha(q8, k8, v8, causal=True, learnable_sink=sink)
    features, got = recorder.calls[-1]
    assert features.sink and features.mask == "causal"
    assert got.dtype == torch.float32 and torch.equal(got, sink.float())
    qv, kv, vv = (t[0] for t in _fp8_qkv(b=1, sq=30, sk=40))
    cu_q = fake_cuda(torch.tensor([0, 10, 30], dtype=torch.int32))
    cu_k = fake_cuda(torch.tensor([0, 15, 40], dtype=torch.int32))
    cute_attn.mha_varlen(fake_cuda(qv), fake_cuda(kv), fake_cuda(vv), cu_q, cu_k, 20, 25, learnable_sink=sink,
                         check_cu_seqlens=False)
    features, got = recorder.calls[-1]
    assert features.sink and features.varlen and torch.equal(got, sink.float())
    calls = len(recorder.calls)
    no_keys = fake_cuda(k8[:, :0].contiguous())
    out, lse = cute_attn.mha(q8, no_keys, fake_cuda(v8[:, :0].contiguous()), learnable_sink=sink, return_lse=True)
    assert len(recorder.calls) == calls  # no kernel
    assert torch.equal(out.float(), torch.zeros(out.shape))
    assert torch.equal(lse, sink.float()[None, :, None].expand(2, 4, 16))


def test_fp8_persistent_grid_where_it_measured_faster():
    """config.fp8_with_persistent_grid: head dims 128 and 256, unmasked (round robin) or
    causal (the tile queue), with one P buffer (two spilled on the persistent loop); not
    head dim 64 (it lost 5% at 16K), not a window, varlen, sink or softcap (not measured),
    not packed GQA, and not without a GPU to size the grid."""
    import dataclasses

    from cute_attn.config import AttnFeatures, fp8_fwd_config_for, fp8_with_persistent_grid

    for d, mask in ((128, "none"), (128, "causal"), (256, "none"), (256, "causal")):
        f = AttnFeatures(mask=mask)
        cfg = fp8_with_persistent_grid(fp8_fwd_config_for(d, f), d, f, 132)
        assert cfg.persistent_ctas == 132 and cfg.tile_queue == (mask == "causal") and not cfg.p_double_buffer
    for d, f in ((64, AttnFeatures()), (128, AttnFeatures(mask="local")), (128, AttnFeatures(varlen=True)),
                 (128, dataclasses.replace(AttnFeatures(), sink=True)), (128, AttnFeatures(softcap=True))):
        base = fp8_fwd_config_for(d, f)
        assert fp8_with_persistent_grid(base, d, f, 132) == base
    f = AttnFeatures()
    assert fp8_with_persistent_grid(fp8_fwd_config_for(128, f), 128, f, None) == fp8_fwd_config_for(128, f)
    packed = fp8_fwd_config_for(128, f, pack_gqa=4)
    assert fp8_with_persistent_grid(packed, 128, f, 132) == packed


def test_fp8_pv_wait_after_softmax_where_it_measured_faster():
    """config.fp8_late_pv_wait: the PV wait pinned below the exp2s at head dims 64 and 128
    (+3-4.5% unmasked on an H100), not at 256 (level) and never beside two P buffers
    (ptxas serialised the WGMMAs there); the persistent grid, which drops the second
    buffer, takes it back at head dim 128."""
    import dataclasses

    from cute_attn.config import AttnFeatures, FwdConfig, fp8_fwd_config_for, fp8_with_persistent_grid

    sink = dataclasses.replace(AttnFeatures(), sink=True)
    for d, f, want in ((64, AttnFeatures(), True), (64, AttnFeatures(mask="causal"), True),
                       (64, AttnFeatures(mask="local", softcap=True), True), (128, AttnFeatures(mask="causal"), True),
                       (128, AttnFeatures(varlen=True), True), (128, sink, False), (256, AttnFeatures(), False),
                       (256, AttnFeatures(mask="causal"), False)):
        cfg = fp8_fwd_config_for(d, f)
        assert cfg.pv_wait_after_softmax == want, (d, f)
        assert not (cfg.pv_wait_after_softmax and cfg.p_double_buffer)
    plain = AttnFeatures()
    assert fp8_fwd_config_for(128, plain).p_double_buffer and not fp8_fwd_config_for(128, plain).pv_wait_after_softmax
    persistent = fp8_with_persistent_grid(fp8_fwd_config_for(128, plain), 128, plain, 132)
    assert persistent.pv_wait_after_softmax and not persistent.p_double_buffer
    assert not fp8_with_persistent_grid(fp8_fwd_config_for(256, plain), 256, plain, 132).pv_wait_after_softmax
    with pytest.raises(ValueError, match="exclude each other"):
        FwdConfig(tile_m=128, tile_n=128, num_stages=2, p_double_buffer=True, pv_wait_after_softmax=True)
    with pytest.raises(ValueError, match="needs intra_wg_overlap"):
        FwdConfig(tile_m=128, tile_n=128, num_stages=2, intra_wg_overlap=False, pv_wait_after_softmax=True)
