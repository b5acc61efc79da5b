"""The drop-in entry points of cute_attn.compat (flash_attn_func, flash_attn_varlen_func,
sdpa), checked without a GPU, plus the package's typing marker and the compile log line.

The launcher is replaced by a CPU stand-in (as in tests/test_autograd_cpu.py) that
computes what it is asked for -- mask kind, window, softcap, scale, varlen offsets -- with
cute_attn.reference, and records each call. So these tests check what the entry points
ask mha / mha_varlen for, against independent ground truth: mha itself for the
FlashAttention 2 functions, and torch's own scaled_dot_product_attention for sdpa (whose
causal mask is top-left aligned, where cute_attn's is bottom-right).
"""

import inspect
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cute_attn
import cute_attn.api as api
from cute_attn.config import UNBOUNDED
from cpu_standin import LauncherTrap, ref_kwargs, reference_grads
from cute_attn.reference import attention_ref, attention_ref_varlen

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------
# CPU stand-in for the launcher
# ----------------------------------------------------------------------------------------


class StandInLauncher:
    """run_fwd / run_bwd computed by the fp32 reference on the CPU; every call recorded."""

    def __init__(self):
        self.fwd_calls, self.bwd_calls = [], []

    def run_fwd(self, q, k, v, features, args, config=None, need_lse=True):
        kwargs = ref_kwargs(features, args)
        self.fwd_calls.append(dict(q=q, k=k, v=v, features=features, args=args, kwargs=kwargs))
        if features.varlen:
            out, lse = attention_ref_varlen(q, k, v, args.cu_seqlens_q, args.cu_seqlens_k, **kwargs)
        else:
            out, lse = attention_ref(q, k, v, **kwargs)
        # the launcher allocates out in q's stride order; so does this stand-in
        result = torch.empty_like(q)
        result.copy_(out)
        self.fwd_calls[-1]["out"] = result
        return result, lse

    def run_bwd(self, dout, q, k, v, out, lse, features, args, deterministic=False, config=None):
        kwargs = ref_kwargs(features, args)
        self.bwd_calls.append(dict(kwargs=kwargs, deterministic=deterministic))
        return reference_grads(q, k, v, dout, kwargs)


@pytest.fixture
def stand_in(monkeypatch):
    launcher = StandInLauncher()
    monkeypatch.setattr(api, "_launcher_module", launcher)
    # CPU tensors: skip the device checks (and everything else validation does, which
    # tests/test_features_cpu.py covers); the compat layer's own checks still run
    monkeypatch.setattr(api, "validate_fwd_inputs", lambda *a, **kw: None)
    monkeypatch.setattr(api, "validate_varlen_fwd_inputs", lambda *a, **kw: None)
    return launcher




@pytest.fixture
def trap(monkeypatch):
    """No launcher: a rejected argument must raise before anything would compile."""
    monkeypatch.setattr(api, "_launcher_module", LauncherTrap(": the argument should have been rejected first"))


def _bshd(batch, seqlen, heads, dim=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seqlen, heads, dim, generator=g).to(dtype)


def _close(a, b, dtype):
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    return torch.allclose(a.float(), b.float(), **tol)


# ----------------------------------------------------------------------------------------
# flash_attn_func / flash_attn_varlen_func
# ----------------------------------------------------------------------------------------

FA2_FUNC_PARAMS = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
    ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False),
]
FA2_VARLEN_PARAMS = FA2_FUNC_PARAMS[:3] + [
    ("cu_seqlens_q", inspect.Parameter.empty), ("cu_seqlens_k", inspect.Parameter.empty),
    ("max_seqlen_q", inspect.Parameter.empty), ("max_seqlen_k", inspect.Parameter.empty),
] + FA2_FUNC_PARAMS[3:] + [("block_table", None)]


@pytest.mark.parametrize("fn, expected", [
    (cute_attn.flash_attn_func, FA2_FUNC_PARAMS),
    (cute_attn.flash_attn_varlen_func, FA2_VARLEN_PARAMS),
], ids=["flash_attn_func", "flash_attn_varlen_func"])
def test_fa2_signatures_keep_flash_attention_2_names_order_and_defaults(fn, expected):
    params = inspect.signature(fn).parameters.values()
    assert [(p.name, p.default) for p in params] == expected
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(causal=True),
    dict(softmax_scale=0.3, window_size=(3, 1)),
    dict(window_size=(2, 0), softcap=4.0),
    dict(causal=True, softcap=2.0, softmax_scale=0.2),
], ids=["dense", "causal", "window", "window-softcap", "causal-softcap"])
@pytest.mark.parametrize("seqlens", [(6, 6), (4, 9), (9, 4)], ids=["sq=sk", "sq<sk", "sq>sk"])
def test_flash_attn_func_computes_what_mha_computes(stand_in, kwargs, seqlens):
    sq, sk = seqlens
    q, k, v = _bshd(2, sq, 4, seed=1), _bshd(2, sk, 2, seed=2), _bshd(2, sk, 2, seed=3)  # GQA 2
    out = cute_attn.flash_attn_func(q, k, v, **kwargs)
    expected = cute_attn.mha(q, k, v, **kwargs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    ref, _ = attention_ref(q, k, v, **kwargs)  # bottom-right aligned, as FlashAttention 2
    torch.testing.assert_close(out, ref)


def test_flash_attn_func_positional_arguments_follow_flash_attention_2(stand_in):
    q, k, v = _bshd(1, 5, 2), _bshd(1, 7, 2, seed=1), _bshd(1, 7, 2, seed=2)
    # q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
    # deterministic, return_attn_probs
    out, lse, s_dmask = cute_attn.flash_attn_func(q, k, v, 0.0, 0.25, False, (2, 1), 3.0, None,
                                                  False, True)
    (call,) = stand_in.fwd_calls
    assert call["kwargs"] == dict(causal=False, softmax_scale=0.25, window_size=(2, 1), softcap=3.0)
    ref_out, ref_lse = attention_ref(q, k, v, softmax_scale=0.25, window_size=(2, 1), softcap=3.0)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert s_dmask is None


def test_flash_attn_func_return_attn_probs_gives_out_lse_and_none(stand_in):
    q, k, v = _bshd(2, 5, 3), _bshd(2, 8, 3, seed=1), _bshd(2, 8, 3, seed=2)
    plain = cute_attn.flash_attn_func(q, k, v, causal=True)
    assert isinstance(plain, torch.Tensor)
    result = cute_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3
    out, lse, s_dmask = result
    assert s_dmask is None  # S is never materialised
    out_mha, lse_mha = cute_attn.mha(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, out_mha, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_mha, rtol=0, atol=0)
    assert lse.shape == (2, 3, 5) and lse.dtype == torch.float32


def test_flash_attn_func_gradients_and_deterministic_reach_the_backward(stand_in):
    q, k, v = (t.requires_grad_() for t in (_bshd(2, 5, 4), _bshd(2, 7, 2, seed=1),
                                             _bshd(2, 7, 2, seed=2)))
    out, lse, _ = cute_attn.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                            return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    (call,) = stand_in.bwd_calls
    assert call["deterministic"] is True and call["kwargs"]["causal"] is True
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    attention_ref(q2, k2, v2, causal=True)[0].backward(dout)
    for g, g_ref in zip((q.grad, k.grad, v.grad), (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(g, g_ref)


def _packed(lens_q, lens_k, heads=4, heads_kv=2, dim=64):
    cu_q = torch.tensor([0, *lens_q], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0, *lens_k], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(int(cu_q[-1]), heads, dim, generator=g)
    k = torch.randn(int(cu_k[-1]), heads_kv, dim, generator=g)
    v = torch.randn(int(cu_k[-1]), heads_kv, dim, generator=g)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True), dict(window_size=(2, 1), softcap=3.0)],
                         ids=["dense", "causal", "window-softcap"])
def test_flash_attn_varlen_func_computes_what_mha_varlen_computes(stand_in, kwargs):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([3, 0, 6, 2], [5, 4, 3, 2])
    out = cute_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    expected = cute_attn.mha_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    ref, _ = attention_ref_varlen(q, k, v, cu_q, cu_k, **kwargs)
    torch.testing.assert_close(out, ref)
    assert stand_in.fwd_calls[0]["args"].cu_seqlens_q is cu_q


def test_flash_attn_varlen_func_return_attn_probs(stand_in):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([3, 5], [4, 6])
    # positional: ..., dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
    # deterministic, return_attn_probs
    out, lse, s_dmask = cute_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                         0.0, 0.3, True, (-1, -1), 0.0, None,
                                                         False, True)
    assert s_dmask is None
    ref_out, ref_lse = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert lse.shape == (4, 8)  # (nheads, total_q): FlashAttention 2's varlen layout


# ----------------------------------------------------------------------------------------
# sdpa vs torch.nn.functional.scaled_dot_product_attention
# ----------------------------------------------------------------------------------------


def _bhsd(batch, heads, seqlen, dim=64, dtype=torch.float32, seed=0):
    return _bshd(batch, seqlen, heads, dim, dtype, seed).transpose(1, 2).contiguous()


def test_sdpa_signature_matches_torch():
    params = inspect.signature(cute_attn.sdpa).parameters
    assert list(params) == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                            "scale", "enable_gqa"]
    assert params["scale"].kind is params["enable_gqa"].kind is inspect.Parameter.KEYWORD_ONLY
    assert [params[n].default for n in ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")] \
        == [None, 0.0, False, None, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(6, 6), (3, 9), (9, 3), (1, 5), (5, 1)],
                         ids=["sq=sk", "sq<sk", "sq>sk", "sq=1", "sk=1"])
def test_sdpa_matches_torch_sdpa(stand_in, seqlens, is_causal, scale, dtype):
    sq, sk = seqlens
    query, key, value = _bhsd(2, 3, sq, dtype=dtype), _bhsd(2, 3, sk, dtype=dtype, seed=1), \
        _bhsd(2, 3, sk, dtype=dtype, seed=2)
    out = cute_attn.sdpa(query, key, value, is_causal=is_causal, scale=scale)
    expected = F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)
    assert out.shape == expected.shape == (2, 3, sq, 64) and out.dtype == dtype
    assert _close(out, expected, dtype), (out.float() - expected.float()).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seqlens", [(3, 9), (9, 3)], ids=["sq<sk", "sq>sk"])
def test_sdpa_causal_is_top_left_not_bottom_right(stand_in, seqlens, dtype):
    """Teeth: on these shapes a bottom-right causal mask gives a clearly different
    answer, so sdpa matching torch means it really computes top-left."""
    sq, sk = seqlens
    query, key, value = _bhsd(1, 2, sq, dtype=dtype), _bhsd(1, 2, sk, dtype=dtype, seed=1), \
        _bhsd(1, 2, sk, dtype=dtype, seed=2)
    expected = F.scaled_dot_product_attention(query, key, value, is_causal=True)
    bottom_right = cute_attn.mha(query.transpose(1, 2), key.transpose(1, 2),
                                 value.transpose(1, 2), causal=True).transpose(1, 2)
    assert not _close(bottom_right, expected, dtype)
    out = cute_attn.sdpa(query, key, value, is_causal=True)
    assert _close(out, expected, dtype)


def test_sdpa_causal_mapping_sent_to_mha(stand_in):
    """sq < sk: keys cut to the first sq (a view) and mha's causal; sq > sk: the window
    (-1, sq - sk); sq == sk: plain causal. q, k, v reach mha as transposed views."""
    query, key, value = _bhsd(2, 4, 3), _bhsd(2, 4, 8, seed=1), _bhsd(2, 4, 8, seed=2)
    cute_attn.sdpa(query, key, value, is_causal=True)
    call = stand_in.fwd_calls[-1]
    assert call["features"].mask == "causal"
    assert call["k"].shape == call["v"].shape == (2, 3, 4, 64)
    assert call["k"].data_ptr() == key.data_ptr() and call["v"].data_ptr() == value.data_ptr()
    assert call["k"].stride() == key.transpose(1, 2).stride()

    query, key, value = _bhsd(2, 4, 8), _bhsd(2, 4, 3, seed=1), _bhsd(2, 4, 3, seed=2)
    cute_attn.sdpa(query, key, value, is_causal=True)
    call = stand_in.fwd_calls[-1]
    assert call["features"].mask == "local" and call["args"].window == (UNBOUNDED, 5)
    assert call["k"].shape == (2, 3, 4, 64)

    query = _bhsd(2, 4, 5)
    cute_attn.sdpa(query, query, query, is_causal=True)
    assert stand_in.fwd_calls[-1]["features"].mask == "causal"
    cute_attn.sdpa(query, query, query)
    assert stand_in.fwd_calls[-1]["features"].mask == "none"


def test_sdpa_passes_views_and_returns_a_view(stand_in):
    query, key, value = _bhsd(2, 4, 5), _bhsd(2, 4, 7, seed=1), _bhsd(2, 4, 7, seed=2)
    out = cute_attn.sdpa(query, key, value)
    (call,) = stand_in.fwd_calls
    for sent, given in ((call["q"], query), (call["k"], key), (call["v"], value)):
        assert sent.data_ptr() == given.data_ptr()  # no copy
        assert sent.shape == given.transpose(1, 2).shape  # (batch, seqlen, heads, headdim)
    # out is mha's output transposed back: same memory, (batch, heads, seqlen, headdim)
    assert out.shape == (2, 4, 5, 64)
    assert out.data_ptr() == call["out"].data_ptr()
    assert out.is_contiguous()  # the launcher allocates in q's stride order


@pytest.mark.parametrize("heads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("seqlens", [(5, 5), (3, 7), (7, 3)], ids=["sq=sk", "sq<sk", "sq>sk"])
def test_sdpa_enable_gqa_matches_torch(stand_in, heads_kv, seqlens):
    sq, sk = seqlens
    query, key, value = _bhsd(2, 4, sq), _bhsd(2, heads_kv, sk, seed=1), _bhsd(2, heads_kv, sk, seed=2)
    for causal in (False, True):
        out = cute_attn.sdpa(query, key, value, is_causal=causal, scale=0.2, enable_gqa=True)
        expected = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=0.2,
                                                  enable_gqa=True)
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("seqlens", [(4, 9), (9, 4), (6, 6)], ids=["sq<sk", "sq>sk", "sq=sk"])
def test_sdpa_gradients_match_torch(stand_in, seqlens):
    """Through the transposes and the cut of unseen keys (whose gradients are zero)."""
    sq, sk = seqlens
    inputs = [_bhsd(2, 4, sq), _bhsd(2, 2, sk, seed=1), _bhsd(2, 2, sk, seed=2)]
    ours = [t.clone().requires_grad_() for t in inputs]
    theirs = [t.clone().requires_grad_() for t in inputs]
    out = cute_attn.sdpa(*ours, is_causal=True, enable_gqa=True)
    expected = F.scaled_dot_product_attention(*theirs, is_causal=True, enable_gqa=True)
    dout = torch.randn_like(expected)
    out.backward(dout)
    expected.backward(dout)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    if sq < sk:
        assert torch.count_nonzero(ours[1].grad[:, :, sq:]) == 0


# ----------------------------------------------------------------------------------------
# Rejected arguments: each raises, naming the argument, before any launch
# ----------------------------------------------------------------------------------------


def _fa2_inputs():
    return _bshd(1, 4, 2), _bshd(1, 4, 2, seed=1), _bshd(1, 4, 2, seed=2)


def _varlen_inputs():
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([2, 2], [2, 2])
    return (q, k, v, cu_q, cu_k, max_q, max_k)


FA2_REJECTED = [
    (dict(dropout_p="0"), TypeError, "dropout_p must be a float"),
    (dict(dropout_p=None), TypeError, "dropout_p must be a float"),
    (dict(alibi_slopes=torch.zeros(2)), NotImplementedError, "alibi_slopes is not supported"),
    (dict(return_attn_probs=1), TypeError, "return_attn_probs must be a bool"),
    # FlashAttention 2 returns S_dmask here; never silently None
    (dict(return_attn_probs=True, dropout_p=0.1), NotImplementedError, r"return_attn_probs=True with dropout_p > 0"),
]


# both run mha's / mha_varlen's dropout (which check the rate)
FUNC_REJECTED = FA2_REJECTED + [
    (dict(dropout_p=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=float("nan")), ValueError, r"dropout_p must be in \[0, 1\)"),
]
VARLEN_REJECTED = FUNC_REJECTED


@pytest.mark.parametrize("kwargs, error, message", FUNC_REJECTED,
                         ids=[str(list(c[0].items())[0]) for c in FUNC_REJECTED])
def test_flash_attn_func_rejects(trap, kwargs, error, message):
    with pytest.raises(error, match=message):
        cute_attn.flash_attn_func(*_fa2_inputs(), **kwargs)


@pytest.mark.parametrize("kwargs, error, message", VARLEN_REJECTED + [
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), NotImplementedError,
     "block_table .* is not supported"),
], ids=[str(list(c[0].items())[0]) for c in VARLEN_REJECTED] + ["block_table"])
def test_flash_attn_varlen_func_rejects(trap, kwargs, error, message):
    with pytest.raises(error, match=message):
        cute_attn.flash_attn_varlen_func(*_varlen_inputs(), **kwargs)


def test_fa2_bad_mha_arguments_still_reach_mha_checks(trap):
    """What mha checks (here a bool causal) is not re-checked, nor skipped, by the wrapper."""
    with pytest.raises(TypeError, match="causal must be a bool"):
        cute_attn.flash_attn_func(*_fa2_inputs(), causal=1)
    with pytest.raises(ValueError, match="window_size left must be >= -1"):
        cute_attn.flash_attn_func(*_fa2_inputs(), window_size=(-2, 0))


def _sdpa_inputs(heads=(4, 4, 4), seqlens=(5, 6, 6)):
    return tuple(_bhsd(2, h, s, seed=i) for i, (h, s) in enumerate(zip(heads, seqlens)))


@pytest.mark.parametrize("name", ["query", "key", "value"])
@pytest.mark.parametrize("shape", [(5, 4, 64), (1, 2, 4, 5, 64), (64,)], ids=["3d", "5d", "1d"])
def test_sdpa_rejects_inputs_that_are_not_4d(trap, name, shape):
    args = dict(zip(("query", "key", "value"), _sdpa_inputs()))
    args[name] = torch.zeros(shape)
    with pytest.raises(ValueError, match=rf"sdpa: {name} must be 4-D .* got {len(shape)}-D"):
        cute_attn.sdpa(**args)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)), NotImplementedError,
     "attn_mask is not supported"),
    (dict(attn_mask=torch.zeros(5, 6), is_causal=True), NotImplementedError,
     "attn_mask is not supported"),
    (dict(dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\)"),  # mha's check
    (dict(dropout_p="0.0"), TypeError, "dropout_p must be a float"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    (dict(enable_gqa="yes"), TypeError, "enable_gqa must be a bool"),
], ids=["mask", "mask-and-causal", "dropout-range", "dropout-type", "is_causal-type", "enable_gqa-type"])
def test_sdpa_rejects(trap, kwargs, error, message):
    with pytest.raises(error, match=message):
        cute_attn.sdpa(*_sdpa_inputs(), **kwargs)


def test_sdpa_dropout_is_mhas(monkeypatch):
    """dropout_p > 0 reaches mha as its dropout_p (numpy scalars too); the default passes
    nothing, so the plain call keeps mha's fast path."""
    import numpy as np

    import cute_attn.compat as compat

    seen = []
    monkeypatch.setattr(compat, "mha", lambda q, k, v, **kw: seen.append(kw) or torch.zeros_like(q))
    cute_attn.sdpa(*_sdpa_inputs(), dropout_p=np.float32(0.25))
    cute_attn.sdpa(*_sdpa_inputs())
    assert seen[0]["dropout_p"] == 0.25 and type(seen[0]["dropout_p"]) is float
    assert "dropout_p" not in seen[1]


@pytest.mark.parametrize("heads", [(4, 2, 2), (4, 4, 2), (4, 2, 4)], ids=["gqa", "value-only", "key-only"])
def test_sdpa_rejects_different_head_counts_without_enable_gqa(trap, heads):
    query, key, value = _sdpa_inputs(heads=heads)
    with pytest.raises(RuntimeError):  # torch's own behaviour for these shapes
        F.scaled_dot_product_attention(query, key, value)
    with pytest.raises(ValueError, match="enable_gqa=False .* pass enable_gqa=True"):
        cute_attn.sdpa(query, key, value)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sdpa_one_kv_head_without_enable_gqa_broadcasts_like_torch(stand_in, is_causal):
    """torch broadcasts a heads dim of 1 even with enable_gqa=False: that is MQA."""
    query, key, value = _sdpa_inputs(heads=(4, 1, 1), seqlens=(7, 5, 5))
    out = cute_attn.sdpa(query, key, value, is_causal=is_causal)
    expected = F.scaled_dot_product_attention(query, key, value, is_causal=is_causal)
    torch.testing.assert_close(out, expected)


def test_sdpa_rejects_key_value_seqlen_mismatch_before_cutting_keys(trap):
    """With is_causal and seqlen_q < seqlen_k the keys are cut to seqlen_q: a value of
    another length must be an error first, not hidden by the cut."""
    query, key, value = _sdpa_inputs(seqlens=(3, 6, 7))
    with pytest.raises(ValueError, match="key and value must have the same seqlen"):
        cute_attn.sdpa(query, key, value, is_causal=True)


@pytest.mark.parametrize("shapes, message", [
    (((2, 4, 5, 64), (2, 1, 6, 64), (2, 4, 6, 64)), "key has 1 heads and value 4"),
    (((2, 4, 5, 64), (1, 4, 6, 64), (1, 4, 6, 64)), "same batch"),
    (((2, 4, 5, 64), (2, 4, 6, 64), (2, 4, 6, 32)), "same headdim"),
], ids=["key-heads-broadcast", "batch-broadcast", "value-headdim"])
def test_sdpa_rejects_what_torch_broadcasts_but_the_kernels_do_not_take(trap, shapes, message):
    """torch's SDPA runs these (broadcast key heads or batch, another value headdim);
    cute_attn.sdpa names them in SDPA's terms before mha would, in its own."""
    query, key, value = (torch.randn(s) for s in shapes)
    F.scaled_dot_product_attention(query, key, value, enable_gqa=True)  # torch takes them
    with pytest.raises(ValueError, match=f"sdpa: .*{message}"):
        cute_attn.sdpa(query, key, value, enable_gqa=True)


def test_compat_all_names_every_entry_point():
    import cute_attn.compat as compat

    assert set(compat.__all__) == {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "sdpa"}
    assert all(getattr(cute_attn, name) is getattr(compat, name) for name in compat.__all__)


def test_sdpa_rejects_a_non_tensor(trap):
    query, key, _ = _sdpa_inputs()
    with pytest.raises(TypeError, match="sdpa: value must be a torch.Tensor"):
        cute_attn.sdpa(query, key, [1.0])


# ----------------------------------------------------------------------------------------
# Packaging: import without the DSL, typing marker
# ----------------------------------------------------------------------------------------


def test_import_does_not_import_the_dsl():
    code = ("import sys, cute_attn\n"
            "assert callable(cute_attn.sdpa) and callable(cute_attn.flash_attn_func)\n"
            "assert callable(cute_attn.flash_attn_varlen_func)\n"
            "print('cutlass' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"


def test_py_typed_marker_is_package_data():
    assert (ROOT / "cute_attn" / "py.typed").is_file()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python >= 3.11")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["cute_attn"]


def test_public_api_is_annotated():
    for fn in (cute_attn.mha, cute_attn.mha_varlen, cute_attn.flash_attn_func,
               cute_attn.flash_attn_varlen_func, cute_attn.sdpa):
        sig = inspect.signature(fn)
        assert sig.return_annotation is not inspect.Signature.empty, fn.__name__
        missing = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
        assert not missing, f"{fn.__name__}: {missing}"


# ----------------------------------------------------------------------------------------
# Compile log line
# ----------------------------------------------------------------------------------------


def test_compile_logs_one_info_line_per_kernel(caplog):
    pytest.importorskip("cutlass", reason="the CuTe DSL (nvidia-cutlass-dsl) is not installed")
    from cute_attn import launcher
    from cute_attn.config import AttnFeatures, fwd_config_for

    features = AttnFeatures()
    key = launcher.FwdKey("bf16", 64, features, fwd_config_for(64, features))
    caplog.set_level(logging.INFO, logger="cute_attn")
    launcher.compile_fwd(key)
    lines = [r for r in caplog.records if r.name == "cute_attn"]
    assert len(lines) == 1
    (record,) = lines
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert message.startswith("compiled FlashFwdSm90 for ")
    assert repr(key) in message
    seconds = float(message.rsplit(" in ", 1)[1].removesuffix(" s"))
    assert seconds > 0


def test_flash_attn_varlen_func_passes_dropout_to_mha_varlen(monkeypatch):
    """dropout_p reaches mha_varlen's dropout (it checks the rate and draws the seed)."""
    import cute_attn.compat as compat

    calls = []
    monkeypatch.setattr(compat, "mha_varlen", lambda *args, **kwargs: calls.append(kwargs) or args[0])
    q, k, v, cu_q, cu_k, max_q, max_k = _packed([3, 5], [4, 6])
    cute_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.25, causal=True)
    assert calls[0]["dropout_p"] == 0.25 and calls[0]["causal"] is True


def test_plain_drop_in_calls_take_mhas_fast_path(monkeypatch):
    """flash_attn_func and sdpa pass mha only the options that differ from its defaults,
    so their plain calls reach mha's signature fast path (api._plain_calls); a window or
    softcap goes to the full path."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 6, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    answered = []
    monkeypatch.setattr(api, "_plain_calls", {})
    api._plain_calls[api._plain_signature(q, k, v, True, None)] = lambda *args: answered.append(args) or q
    cute_attn.flash_attn_func(q, k, v, causal=True)
    query, key, value = (t.transpose(1, 2) for t in (q, k, v))
    cute_attn.sdpa(query, key, value, is_causal=True)  # (its transposes are q, k, v again)
    assert len(answered) == 2
    with pytest.raises(ValueError, match="is on cpu"):  # the full path's checks ran
        cute_attn.flash_attn_func(q, k, v, causal=True, softcap=5.0)
    with pytest.raises(ValueError, match="is on cpu"):
        cute_attn.flash_attn_func(q, k, v, window_size=(2, 0))
    assert len(answered) == 2


def test_flash_attention_defaults_written_out_keep_the_fast_paths(monkeypatch):
    """vLLM-style callers write FlashAttention's defaults out: window_size=(-1, -1) (a tuple
    or a list), softcap=0 (an int). They mean no window and no softcap, so flash_attn_func
    passes mha no option (mha's signature fast path needs none) and flash_attn_with_kvcache
    hands mha_with_kvcache its own defaults (its decode fast path tests them by identity).
    A real window or cap still goes through, unchanged."""
    import cute_attn.compat as compat
    import cute_attn.kvcache as kvcache
    from cute_attn.api import _NO_WINDOW

    seen = []
    monkeypatch.setattr(compat, "mha", lambda q, k, v, **kw: seen.append(kw) or torch.zeros_like(q))
    q = torch.zeros(1, 4, 2, 64)
    for written_out in (dict(window_size=(-1, -1), softcap=0), dict(window_size=[-1, -1], softcap=0.0), {}):
        cute_attn.flash_attn_func(q, q, q, **written_out)
    cute_attn.flash_attn_func(q, q, q, window_size=(8, -1), softcap=30)
    assert [set(kw) - {"causal", "softmax_scale", "deterministic", "return_lse"} for kw in seen] == [set()] * 3 + [
        {"window_size", "softcap"}]
    assert seen[3]["window_size"] == (8, -1) and seen[3]["softcap"] == 30

    got = []
    monkeypatch.setattr(kvcache, "mha_with_kvcache", lambda *a, **kw: got.append(kw) or a[0])
    lengths = torch.zeros(1, dtype=torch.int32)
    cache = torch.zeros(1, 16, 2, 64)
    cute_attn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, window_size=(-1, -1), softcap=0)
    cute_attn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, window_size=(3, 0), softcap=5)
    assert got[0]["window_size"] is _NO_WINDOW and type(got[0]["softcap"]) is float and got[0]["softcap"] == 0.0
    assert got[1]["window_size"] == (3, 0) and got[1]["softcap"] == 5
