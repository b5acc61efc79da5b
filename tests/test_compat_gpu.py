"""The drop-in entry points on the GPU (issue 11): flash_attn_func and flash_attn_varlen_func
held to the feature tests' accuracy rule (tests/gpu_checks.py: forward and gradients
against the fp32 reference, NaN-poisoned outputs), and sdpa against torch's own SDPA in
float32 (its top-left causal alignment, GQA, a scale), with the gradients of keys that
no query sees exactly zero."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cute_attn
from gpu_checks import OUT_FLOOR, Case, check_case, make_inputs
from gpu_helpers import poison_allocator

pytestmark = pytest.mark.gpu


def fa2_kernel(case, q, k, v, cu, return_lse=False):
    """The case through flash_attn_func / flash_attn_varlen_func, defaults left out."""
    kwargs = {}
    if case.causal:
        kwargs["causal"] = True
    if case.window != (-1, -1):
        kwargs["window_size"] = case.window
    if case.softcap:
        kwargs["softcap"] = case.softcap
    if case.softmax_scale is not None:
        kwargs["softmax_scale"] = case.softmax_scale
    if case.varlen:
        result = cute_attn.flash_attn_varlen_func(q, k, v, *cu, max(case.lens_q), max(case.lens_k),
                                                  return_attn_probs=return_lse, **kwargs)
    else:
        result = cute_attn.flash_attn_func(q, k, v, return_attn_probs=return_lse, **kwargs)
    if not return_lse:
        return result
    out, lse, probs = result
    assert probs is None  # FlashAttention 2's S_dmask: never materialised here
    return out, lse


@pytest.mark.parametrize("case", [
    Case(b=2, sq=300, sk=517, h=8, h_kv=2, causal=True),
    Case(b=1, sq=257, sk=257, h=4, h_kv=4, d=64, window=(64, 16), softcap=20.0),
    Case(b=2, sq=130, sk=70, h=4, h_kv=1, softmax_scale=0.3),
    Case(h=6, h_kv=3, causal=True, lens_q=(100, 1, 300), lens_k=(250, 40, 300)),
], ids=str)
def test_flash_attn_functions_match_the_reference(case):
    q, k, v, dout, cu = make_inputs(case, seed=5)
    check_case(case, q, k, v, dout, cu, kernel=fa2_kernel)


def _attention_in(dtype, query, key, value, is_causal, scale):
    """SDPA's semantics (top-left causal) computed in dtype, step by step: its error against
    float32 sizes the tolerance (torch's math SDPA may upcast half inputs)."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-1, -2)) * scale
    if is_causal:
        seen = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~seen, float("-inf"))
    return torch.softmax(scores, dim=-1).to(dtype) @ value


def _bhsd(b, h, s, d, dtype, seed):
    torch.manual_seed(seed)
    return torch.randn(b, h, s, d, device="cuda").to(dtype)


@pytest.mark.parametrize("b, h, h_kv, sq, sk, d, is_causal, scale", [
    (2, 8, 2, 200, 333, 128, True, None),    # top-left causal: keys >= sq never seen
    (1, 4, 4, 300, 120, 64, True, None),     # more queries than keys: a window in mha
    (2, 4, 4, 77, 190, 64, False, 0.3),
    (1, 8, 1, 64, 64, 128, True, 0.1),       # MQA
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_matches_torch_sdpa_in_float32(b, h, h_kv, sq, sk, d, is_causal, scale, dtype):
    query = _bhsd(b, h, sq, d, dtype, 1)
    key, value = _bhsd(b, h_kv, sk, d, dtype, 2), _bhsd(b, h_kv, sk, d, dtype, 3)
    gqa = h_kv != h
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), is_causal=is_causal,
                                             scale=scale, enable_gqa=gqa)
    low = _attention_in(dtype, query, key, value, is_causal, scale)
    poison_allocator(query.numel() * query.element_size(), 0)
    leaves = [t.detach().requires_grad_() for t in (query, key, value)]
    out = cute_attn.sdpa(*leaves, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    assert out.shape == query.shape and out.dtype == dtype and out.stride()[-1] == 1
    assert not out.isnan().any()
    err = (out.float() - ref).abs().max().item()
    err_torch = (low.float() - ref).abs().max().item()
    assert err <= 2 * err_torch + OUT_FLOOR, (err, err_torch)
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    if is_causal and sq < sk:
        # top-left causal: no query sees keys sq.. (mha drops them; their gradients are 0)
        assert not dk[:, :, sq:].any() and not dv[:, :, sq:].any()
        assert dk[:, :, :sq].abs().max() > 0
