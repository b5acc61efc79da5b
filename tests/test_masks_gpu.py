"""Mask and score mods on the GPU (kernels/fwd_sm90.FlashFwdSm90Mods, blocks/mods.py,
block_mask.py), forward, against the fp32 reference with the same mods applied densely
(mask_reference.attention_ref_mod).

Rule (as tests/gpu_checks.py for the fixed masks): out within 2x the error of torch doing
the same computation in the input dtype (QK^T and PV in bf16/fp16, softmax in fp32) plus
1e-5; lse -inf exactly on rows that see no key, elsewhere within 1e-3; no NaN; rows that
see nothing give out = 0. Outputs are poisoned with NaN before each call, lengths are not
multiples of the tiles, BD3LM block sizes do not divide them, inputs are fresh normals.
"""

import pytest
import torch

import cute_attn
from cute_attn import masks
from cute_attn.block_mask import FULL, build_block_mask
from cute_attn.config import mod_fwd_config_for
from cute_attn.mask_reference import attention_ref_mod, dense_mask
from gpu_helpers import exact_fp32_matmul, poison_allocator  # noqa: F401  (autouse)

pytestmark = pytest.mark.gpu

OUT_FLOOR = 1e-5
LSE_ATOL = 1e-3


def _inputs(b, sq, sk, h, h_kv, d, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=gen, device="cuda", dtype=dtype)
                 for s, n in ((sq, h), (sk, h_kv), (sk, h_kv)))


def _reference_lowp(q, k, v, mask_mod, score_mod):
    """torch in the input dtype: QK^T and PV with 16-bit operands and outputs, the mods
    and the softmax in fp32, P rounded to the input dtype."""
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    kr, vr = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr).float() * d ** -0.5
    if score_mod is not None:
        from cute_attn.mask_reference import index_grids, seq_info
        mod = masks.Modifier.of("score", score_mod)
        scores = mod(scores, *index_grids(b, h, sq, k.shape[1], q.device),
                     seq=seq_info(mod, sq, k.shape[1], device=q.device))
    if mask_mod is not None:
        scores = scores.masked_fill(~dense_mask(mask_mod, b, h, sq, k.shape[1], q.device), float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, vr)


def _run(q, k, v, **kw):
    poison_allocator(q.numel() * q.element_size(), q.numel() // q.shape[-1] * 4)
    out, lse = cute_attn.mha(q, k, v, return_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    return out, lse


def _check(q, k, v, out, lse, mask_mod=None, score_mod=None):
    out_ref, lse_ref = attention_ref_mod(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    out_lp = _reference_lowp(q, k, v, mask_mod, score_mod)
    assert not out.isnan().any(), "out has NaN"
    assert not lse.isnan().any(), "lse has NaN"
    err = (out.float() - out_ref).abs().max().item()
    err_torch = (out_lp.float() - out_ref).abs().max().item()
    assert err <= 2 * err_torch + OUT_FLOOR, f"out: kernel error {err:.3g} > 2 x torch {q.dtype} {err_torch:.3g}"
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly on rows that see no key"
    if not empty.all():
        lse_err = (lse[~empty] - lse_ref[~empty]).abs().max().item()
        assert lse_err <= LSE_ATOL, f"lse: error {lse_err:.3g}"
    if empty.any():
        rows = empty.transpose(1, 2)  # (b, sq, h)
        assert not out[rows].any(), "rows that see no key must give out = 0"


def _doc_ids(b, s, seed, mean_len=150):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    starts = torch.rand(b, s, generator=gen, device="cuda") < 1.0 / mean_len
    return starts.cumsum(dim=1).to(torch.int32)


def _cases():
    b = 2
    return {
        # BD3LM: L = 509 (2L not a multiple of the tile), blocks of 4 and 16 and 5
        "block_diffusion_4": (lambda: masks.block_diffusion(4), 1, 1018, 1018),
        "block_diffusion_16": (lambda: masks.block_diffusion(16), 2, 1018, 1018),
        "block_diffusion_5": (lambda: masks.block_diffusion(5), 1, 700, 700),
        "prefix_lm": (lambda: masks.prefix_lm(torch.tensor([0, 333], dtype=torch.int32, device="cuda")), b, 777, 777),
        "document": (lambda: masks.document(_doc_ids(b, 901, 1)), b, 901, 901),
        "document_causal": (lambda: masks.document(_doc_ids(b, 901, 2), causal=True), b, 901, 901),
        "causal_rect": (lambda: masks.causal(), b, 300, 845),
        "window": (lambda: masks.sliding_window(100, 37), b, 611, 611),
        # nothing visible for queries q % 7 == 3, and whole tiles empty (q in [128, 256))
        "empty_rows_and_tiles": (lambda: masks.Modifier.of("mask", lambda b_, h, q, kv: (q % 7 != 3) & (
            (q < 128) | (q >= 256)) & (kv <= q)), b, 500, 500),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("d,h,h_kv", [(128, 4, 2), (64, 2, 2), (256, 2, 1)])
def test_mask_mods_match_reference(name, d, h, h_kv):
    make, b, sq, sk = CASES[name]
    mod = make()
    q, k, v = _inputs(b, sq, sk, h, h_kv, d, seed=hash(name) % 1000)
    out, lse = _run(q, k, v, mask_mod=mod)
    _check(q, k, v, out, lse, mask_mod=mod)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alibi_score_mod_with_causal_mask(dtype):
    b, s, h, d = 2, 731, 4, 128
    q, k, v = _inputs(b, s, s, h, 2, d, dtype=dtype, seed=5)
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda")
    mask, score = masks.causal(), masks.alibi(slopes)
    out, lse = _run(q, k, v, mask_mod=mask, score_mod=score)
    _check(q, k, v, out, lse, mask_mod=mask, score_mod=score)
    # the score mod alone (no block mask: every tile visited)
    out, lse = _run(q, k, v, score_mod=score)
    _check(q, k, v, out, lse, score_mod=score)


def test_plain_function_mod_reads_an_aux_tensor():
    """A user's function with seq, reading a per-head window length from an aux tensor."""
    b, s, h, d = 1, 600, 4, 64
    q, k, v = _inputs(b, s, s, h, h, d, seed=7)
    widths = torch.tensor([0, 7, 100, 1000], dtype=torch.int32, device="cuda")

    def per_head_window(b_, h_, q_idx, kv_idx, seq):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - seq.aux[0][h_])

    out, lse = _run(q, k, v, mask_mod=per_head_window, aux_tensors=(widths,))
    mod = masks.Modifier.of("mask", per_head_window, (widths,))
    _check(q, k, v, out, lse, mask_mod=mod)


def test_new_lengths_and_aux_values_reuse_the_kernel():
    """BD3LM at another L, documents with other ids: no new compile (the launcher's cache
    holds one kernel per mod key), still correct."""
    from cute_attn import launcher

    before = len(launcher._cache)
    for s, seed in ((1018, 1), (390, 2)):
        q, k, v = _inputs(1, s, s, 2, 2, 128, seed=seed)
        for mod in (masks.block_diffusion(16), masks.document(_doc_ids(1, s, seed))):
            out, lse = _run(q, k, v, mask_mod=mod)
            _check(q, k, v, out, lse, mask_mod=mod)
    assert len(launcher._cache) - before <= 2  # at most the two mods' kernels, compiled once each


def test_user_block_mask_and_a_wrong_one_is_caught():
    """create_block_mask's lists give the same output as the cached ones; a FULL tile
    dropped from the lists (marked empty) changes the output, and _check catches it."""
    b, s, h, d = 1, 1018, 2, 128
    q, k, v = _inputs(b, s, s, h, h, d, seed=11)
    mod = masks.block_diffusion(16)
    bm = cute_attn.create_block_mask(mod, b, h, s, s, head_dim=d, device="cuda")
    out, lse = _run(q, k, v, mask_mod=mod, block_mask=bm)
    _check(q, k, v, out, lse, mask_mod=mod)
    classes = bm.classes()
    assert (classes == FULL).any()
    # drop the first FULL tile of query tile 0's list (a FULL tile marked empty)
    m = int((bm.full_count[0, 0] > 0).nonzero()[0])
    wrong = bm._replace(full_count=bm.full_count.clone())
    wrong.full_count[0, 0, m] -= 1
    out_w, lse_w = _run(q, k, v, mask_mod=mod, block_mask=wrong)
    with pytest.raises(AssertionError):
        _check(q, k, v, out_w, lse_w, mask_mod=mod)


def test_block_mask_tiles_are_the_kernels():
    cfg = mod_fwd_config_for(128)
    bm = build_block_mask(masks.causal(), 1, 1, 1000, 1000, cfg.tile_m, cfg.tile_n, "cuda")
    assert (bm.tile_m, bm.tile_n) == (cfg.tile_m, cfg.tile_n)
    wrong_shape = build_block_mask(masks.causal(), 1, 1, 999, 1000, cfg.tile_m, cfg.tile_n, "cuda")
    q, k, v = _inputs(1, 1000, 1000, 2, 2, 128)
    with pytest.raises(ValueError, match="built for"):
        cute_attn.mha(q, k, v, mask_mod=masks.causal(), block_mask=wrong_shape)
