"""Mask and score mods, attention sinks and dropout on the GPU (kernels/fwd_sm90.
FlashFwdSm90Mods, bwd_sm90.FlashBwdSm90Mods, blocks/mods.py, blocks/dropout.py,
block_mask.py), forward and backward, against the fp32 reference with the same mods,
sink and dropout mask applied densely (mask_reference.attention_ref_mod).

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
from cute_attn.dropout import keep_scale, threshold
from cute_attn.mask_reference import attention_ref_mod, dense_mask
from gpu_helpers import backward_buffer_bytes, exact_fp32_matmul, hang_guard, poison_allocator  # noqa: F401  (autouse)

pytestmark = pytest.mark.gpu

OUT_FLOOR = 1e-5
LSE_ATOL = 1e-3


def _inputs(b, sq, sk, h, h_kv, d, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=gen, device="cuda", dtype=dtype)
                 for s, n in ((sq, h), (sk, h_kv), (sk, h_kv)))


def _reference_lowp(q, k, v, mask_mod, score_mod, sink=None, drop=None):
    """torch in the input dtype: QK^T and PV with 16-bit operands and outputs, the mods
    and the softmax in fp32, P rounded to the input dtype. drop: (keep mask, p) of
    dropout, applied to P before the rounding."""
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
    if sink is not None:
        scores = torch.cat([scores, sink.float()[None, :, None, None].expand(b, h, sq, 1)], dim=-1)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    p = p[..., :-1] if sink is not None else p
    if drop is not None:
        p = p * drop[0] * keep_scale(drop[1])
    return torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype), vr)


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
        "block_diffusion_16_odd": (lambda: masks.block_diffusion(16), 1, 701, 701),  # the clean half 351
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


@pytest.mark.parametrize("name", ["block_diffusion_5", "document_causal", "empty_rows_and_tiles"])
@pytest.mark.parametrize("d,h,h_kv", [(128, 4, 2), (64, 8, 2)])
def test_mask_mods_on_a_persistent_grid(name, d, h, h_kv, monkeypatch):
    """The mods' forward on a persistent grid of 5 CTAs with the tile queue (the
    default's 132 on an H100 leave most CTAs one tile here), forced through the grid
    rule launcher.run_fwd_mods applies: each CTA walks many tiles of unequal
    block lists (empty ones among them), twice in a row (the second call needs the
    counter the first left at zero)."""
    import dataclasses

    from cute_attn import launcher

    monkeypatch.setattr(launcher, "with_persistent_grid", lambda config, head_dim, features, num_sms: dataclasses.replace(
        config, persistent_ctas=5, tile_queue=True))
    make, b, sq, sk = CASES[name]
    mod = make()
    q, k, v = _inputs(b, sq, sk, h, h_kv, d, seed=hash(name) % 1000)
    for _ in range(2):
        out, lse = _run(q, k, v, mask_mod=mod)
        _check(q, k, v, out, lse, mask_mod=mod)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("d,h,h_kv", [(128, 4, 2), (64, 2, 2)])
def test_mask_mods_with_the_other_mask_placement(name, d, h, h_kv, monkeypatch):
    """Every mask mod with FwdConfig.mask_before_scores flipped from the package's choice
    (config._fwd_tile_config: on for documents only), forced through the grid rule that
    launcher.run_fwd_mods applies last: the verdicts packed into bits before the scores
    exist, or evaluated after them, give the reference's answer either way."""
    import dataclasses

    from cute_attn import launcher

    rule = launcher.with_persistent_grid
    flipped = []

    def flip(config, head_dim, features, num_sms):
        config = rule(config, head_dim, features, num_sms)
        flipped.append(not config.mask_before_scores)
        return dataclasses.replace(config, mask_before_scores=flipped[-1])

    monkeypatch.setattr(launcher, "with_persistent_grid", flip)
    make, b, sq, sk = CASES[name]
    mod = make()
    q, k, v = _inputs(b, sq, sk, h, h_kv, d, seed=hash(name) % 1000 + 1)
    out, lse = _run(q, k, v, mask_mod=mod)
    assert flipped == [not name.startswith("document")], "the rule's choice for this mask changed"
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


# ----------------------------------------------------------------------------------------
# Backward (kernels/bwd_sm90.FlashBwdSm90Mods)
# ----------------------------------------------------------------------------------------
#
# Rule (tests/gpu_checks.py's for the fixed masks): each gradient within 2x the error of
# autograd through the same computation in the input dtype (_reference_lowp), plus 2x the
# rounding of the fp32 gradient to the input dtype, plus 1e-3, plus 2x the D-rounding term
# for dq and dk (gpu_checks.d_rounding_terms says why: D = rowsum(dO * O) is taken from
# the kernel's rounded out). Gradients are poisoned before the call; rows that see no key
# must get dq = 0, keys no row sees dk = dv = 0.

GRAD_FLOOR = 1e-3


def _grads_of(fn, q, k, v, dout, upcast):
    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


def _ref_kwargs(drop):
    return {} if drop is None else dict(dropout_keep=drop[0], dropout_p=drop[1])


def _d_rounding_terms(q, k, v, dout, mask_mod, score_mod, sink=None, drop=None):
    """gpu_checks.d_rounding_terms with the mods' reference."""
    ref = lambda q_, k_, v_: attention_ref_mod(q_, k_, v_, mask_mod=mask_mod, score_mod=score_mod,  # noqa: E731
                                               sink=sink, **_ref_kwargs(drop))[0]
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5
    out = ref(q32, k32, v32)
    d_err = (dout.float() * (out.to(q.dtype).float() - out)).sum(-1, keepdim=True)
    dq_term = scale * (d_err * ref(q32, k32, k32)).abs().max().item()
    v_leaf = v32.clone().requires_grad_()
    (pt_x,) = torch.autograd.grad(ref(q32, k32, v_leaf), v_leaf, d_err * q32)
    return dq_term, scale * pt_x.abs().max().item(), 0.0


def _kernel_grads(q, k, v, dout, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = cute_attn.mha(q, k, v, **kw)
    poison_allocator(*backward_buffer_bytes(q, k))
    return out, torch.autograd.grad(out, (q, k, v), dout)


def _check_grads(q, k, v, dout, grads, mask_mod=None, score_mod=None, sink=None, drop=None):
    ref = _grads_of(lambda *t: attention_ref_mod(*t, mask_mod=mask_mod, score_mod=score_mod, sink=sink,
                                                 **_ref_kwargs(drop))[0], q, k, v, dout, True)
    low = _grads_of(lambda *t: _reference_lowp(*t, mask_mod, score_mod, sink, drop), q, k, v, dout, False)
    d_terms = _d_rounding_terms(q, k, v, dout, mask_mod, score_mod, sink, drop)
    for name, g, g_ref, g_low, x, d_term in zip("qkv", grads, ref, low, (q, k, v), d_terms):
        assert g.shape == x.shape and g.dtype == x.dtype, f"d{name}: {tuple(g.shape)} {g.dtype}"
        assert torch.isfinite(g).all(), f"d{name} has NaN or inf"
        err = (g.float() - g_ref).abs().max().item()
        err_torch = (g_low.float() - g_ref).abs().max().item()
        rounding = (g_ref.to(x.dtype).float() - g_ref).abs().max().item()
        bound = 2 * err_torch + 2 * rounding + GRAD_FLOOR + 2 * d_term
        assert err <= bound, f"d{name}: kernel error {err:.3g} > {bound:.3g} (torch {x.dtype}: {err_torch:.3g})"
    if mask_mod is not None:
        b, sq, h, _ = q.shape
        visible = dense_mask(mask_mod, b, h, sq, k.shape[1], q.device)  # (b, h, sq, sk)
        rows_seen = visible.any(-1).transpose(1, 2)  # (b, sq, h)
        group = h // k.shape[2]
        keys_seen = visible.any(2).view(b, k.shape[2], group, -1).any(2).transpose(1, 2)  # (b, sk, h_kv)
        dq, dk, dv = grads
        assert not dq[~rows_seen].any(), "dq of rows that see no key must be 0"
        assert not dk[~keys_seen].any() and not dv[~keys_seen].any(), "dk, dv of keys no row sees must be 0"


def _bwd_cases():
    b = 2
    return {
        "block_diffusion_16": (lambda: masks.block_diffusion(16), 1, 1018),
        "block_diffusion_5": (lambda: masks.block_diffusion(5), 1, 700),
        "prefix_lm": (lambda: masks.prefix_lm(torch.tensor([0, 333], dtype=torch.int32, device="cuda")), b, 777),
        "document_causal": (lambda: masks.document(_doc_ids(b, 901, 2), causal=True), b, 901),
        "window": (lambda: masks.sliding_window(100, 37), b, 611),
        # rows that see nothing (q % 7 == 3, and the query tiles of [128, 256)), keys no
        # row sees (kv % 5 == 2) and whole KV tiles nobody sees ([128, 256): dK, dV of a
        # tile with an empty list must still be written, as zeros)
        "empty_rows_keys_and_tiles": (lambda: masks.Modifier.of("mask", lambda b_, h, q, kv: (q % 7 != 3) & (
            (q < 128) | (q >= 256)) & ((kv < 128) | (kv >= 256)) & (kv % 5 != 2) & (kv <= q)), b, 500),
    }


BWD_CASES = _bwd_cases()


@pytest.mark.parametrize("name", list(BWD_CASES))
@pytest.mark.parametrize("d,h,h_kv", [(128, 4, 2), (64, 2, 2)])
def test_mask_mods_backward(name, d, h, h_kv):
    make, b, s = BWD_CASES[name]
    mod = make()
    q, k, v = _inputs(b, s, s, h, h_kv, d, seed=hash(name) % 1000 + 1)
    dout = torch.randn_like(q)
    _, grads = _kernel_grads(q, k, v, dout, mask_mod=mod)
    _check_grads(q, k, v, dout, grads, mask_mod=mod)


@pytest.mark.parametrize("name,d", [("block_diffusion", 128), ("document_causal", 64)])
def test_deterministic_mask_mod_backward(name, d):
    """deterministic=True with a mask mod: each dQ tile's sums ordered by the block mask's
    turns, so two runs give bit-identical gradients (a turn read wrong would hang or
    drop a tile's sum), and they match the reference."""
    b, s, h, h_kv = 2, 515, 4, 2
    mod = masks.block_diffusion(16) if name == "block_diffusion" else masks.document(_doc_ids(b, s, 5), causal=True)
    q, k, v = _inputs(b, s, s, h, h_kv, d, seed=d)
    dout = torch.randn_like(q)
    with hang_guard(f"test_deterministic_mask_mod_backward[{name}]"):
        _, grads = _kernel_grads(q, k, v, dout, mask_mod=mod, deterministic=True)
        _, again = _kernel_grads(q, k, v, dout, mask_mod=mod, deterministic=True)
        torch.cuda.synchronize()
    for g, g2 in zip(grads, again):
        assert torch.equal(g, g2)
    _check_grads(q, k, v, dout, grads, mask_mod=mod)


@pytest.mark.parametrize("d", [96, 256])
def test_mask_mod_backward_other_head_dims(d):
    b, s, h = 1, 515, 2
    mod = masks.block_diffusion(16)
    q, k, v = _inputs(b, s, s, h, 1, d, seed=d)
    dout = torch.randn_like(q)
    _, grads = _kernel_grads(q, k, v, dout, mask_mod=mod)
    _check_grads(q, k, v, dout, grads, mask_mod=mod)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alibi_backward(dtype):
    """ALiBi reads an aux tensor; its derivative is 1 (the Dual carries a constant)."""
    b, s, h, d = 2, 731, 4, 128
    q, k, v = _inputs(b, s, s, h, 2, d, dtype=dtype, seed=5)
    dout = torch.randn_like(q)
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda")
    mask, score = masks.causal(), masks.alibi(slopes)
    _, grads = _kernel_grads(q, k, v, dout, mask_mod=mask, score_mod=score)
    _check_grads(q, k, v, dout, grads, mask_mod=mask, score_mod=score)
    _, grads = _kernel_grads(q, k, v, dout, score_mod=score)
    _check_grads(q, k, v, dout, grads, score_mod=score)


def test_softcap_score_mod_backward_matches_and_bites():
    """masks.softcap's derivative 1 - tanh^2 comes from tracing it on a Dual; the scores
    are scaled so the cap bites (a wrong derivative would fail the bound)."""
    b, s, h, d = 1, 640, 2, 128
    q, k, v = _inputs(b, s, s, h, h, d, seed=9)
    q = q * 4
    dout = torch.randn_like(q)
    mask, score = masks.document(_doc_ids(b, s, 3, mean_len=300), causal=True), masks.softcap(5.0)
    _, grads = _kernel_grads(q, k, v, dout, mask_mod=mask, score_mod=score)
    _check_grads(q, k, v, dout, grads, mask_mod=mask, score_mod=score)
    # the cap bites: without it the gradients differ by far more than the bound
    plain = _grads_of(lambda *t: attention_ref_mod(*t, mask_mod=mask)[0], q, k, v, dout, True)
    assert (plain[0] - grads[0].float()).abs().max() > 0.1


# ----------------------------------------------------------------------------------------
# Attention sinks (learnable_sink): forward, backward and the sink's own gradient
# ----------------------------------------------------------------------------------------

SINK_CASES = {
    # (mha kwargs, the same as mods for the reference, heads, heads_kv, head dim)
    "causal_gqa": (dict(causal=True), lambda: (masks.causal(), None), 4, 2, 128),
    "window_softcap": (dict(window_size=(64, 0), softcap=10.0),
                       lambda: (masks.sliding_window(64, 0), masks.softcap(10.0)), 2, 2, 64),
    "block_diffusion": (None, lambda: (masks.block_diffusion(16), None), 2, 1, 128),
    "none": (dict(), lambda: (None, None), 2, 2, 128),
}


@pytest.mark.parametrize("name", list(SINK_CASES))
def test_learnable_sink_forward_and_backward(name):
    kwargs, make, h, h_kv, d = SINK_CASES[name]
    mask, score = make()
    b, s = 2, 519
    q, k, v = _inputs(b, s, s, h, h_kv, d, seed=len(name))
    gen = torch.Generator(device="cuda").manual_seed(100 + len(name))
    sink = torch.randn(h, device="cuda", generator=gen) * 2
    call = dict(mask_mod=mask, score_mod=score) if kwargs is None else kwargs
    poison_allocator(q.numel() * q.element_size(), q.numel() // q.shape[-1] * 4)
    out, lse = cute_attn.mha(q, k, v, learnable_sink=sink, return_lse=True, **call)
    out_ref, lse_ref = attention_ref_mod(q, k, v, mask_mod=mask, score_mod=score, sink=sink)
    out_lp = _reference_lowp(q, k, v, mask, score, sink)
    err, err_torch = ((o.float() - out_ref).abs().max().item() for o in (out, out_lp))
    assert err <= 2 * err_torch + OUT_FLOOR, f"out: {err:.3g} > 2 x {err_torch:.3g}"
    cap_err = 0.0 if score is None else 10.0 * 2 ** -10  # tanh.approx, see gpu_checks
    assert (lse - lse_ref).abs().max().item() <= LSE_ATOL + cap_err
    # backward: q, k, v as for the mods, and the sink's gradient against autograd's
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sink)]
    out, lse = cute_attn.mha(*leaves[:3], learnable_sink=leaves[3], return_lse=True, **call)  # what backward saves
    grads = torch.autograd.grad(out, leaves, dout)
    _check_grads(q, k, v, dout, grads[:3], mask_mod=mask, score_mod=score, sink=sink)
    # the sink's gradient: a sum over every row, so the floor scales with its size
    sink32, sink_lp = (sink.detach().clone().requires_grad_() for _ in range(2))
    (g32,) = torch.autograd.grad(attention_ref_mod(*(t.float() for t in (q, k, v)), mask_mod=mask, score_mod=score,
                                                   sink=sink32)[0], sink32, dout.float())
    (glp,) = torch.autograd.grad(_reference_lowp(q, k, v, mask, score, sink_lp), sink_lp, dout)
    _check_dsink(grads[3], g32, glp, _dsink(out_ref, lse_ref, sink, dout), _dsink(out.detach(), lse, sink, dout))


def _dsink(out, lse, sink, dout):
    """The sink's gradient, -sum_i e^(sink - lse_i) dO_i . O_i over the rows of its head,
    in fp32 from out (b, s, h, d) and lse (b, h, s)."""
    d = (dout.float() * out.float()).sum(-1)  # (b, s, h)
    return -(torch.exp(sink.detach().float().view(1, 1, -1) - lse.float().transpose(1, 2)) * d).sum((0, 1))


def _check_dsink(dsink, g32, glp, formula32, formula_own):  # glp: for the message
    """The kernel's sink gradient is the formula on its own O and lse (what the backward
    reads; their accuracy is the forward checks'), to fp32 summation (GRAD_FLOOR,
    relative); and the formula is autograd's gradient (on the fp32 reference), which
    keeps the yardstick honest. Against autograd directly the gap is mostly D's rounding
    of O, a sum over every row whose sign pattern decides its size: a 2 x torch bound
    there failed one draw in an H100 run (0.060 > 0.041) without any kernel change."""
    scale = max(1.0, g32.abs().max().item())
    assert (formula32 - g32).abs().max().item() <= 1e-4 * scale, "the dsink formula is not autograd's"
    err = (dsink - formula_own).abs().max().item()
    assert err <= GRAD_FLOOR * scale, (
        f"dsink: {err:.3g} off the formula on the kernel's O and lse (autograd's fp32 gradient: "
        f"{(dsink - g32).abs().max().item():.3g} off, torch's low precision {(glp - g32).abs().max().item():.3g})")


def test_sink_rows_that_see_no_key_and_a_dominant_sink():
    """Causal with seqlen_q > seqlen_k: the first rows see no key, out = 0, lse = the
    sink; a sink far above every score (80 nats) neither overflows nor leaves NaN."""
    b, sq, sk, h, d = 1, 300, 200, 2, 128
    q, k, v = _inputs(b, sq, sk, h, h, d, seed=3)
    sink = torch.tensor([0.5, 80.0], device="cuda")
    out, lse = cute_attn.mha(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
    out_ref, lse_ref = attention_ref_mod(q, k, v, mask_mod=masks.causal(), sink=sink)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert not out[:, : sq - sk].any()
    assert torch.allclose(lse[:, :, : sq - sk], sink[None, :, None].expand(b, h, sq - sk))
    assert (out.float() - out_ref).abs().max() < 2e-2 and (lse - lse_ref).abs().max() < LSE_ATOL
    assert out[:, :, 1].abs().max() < 1e-20  # head 1: the sink takes all the weight


# Packed sequences (mha_varlen) with a sink and/or dropout: lengths of 1 to 519, a query
# sequence longer than its keys, one with no keys and one with no queries, GQA
VARLEN_LENGTHS_Q = [1, 130, 0, 519, 77, 6]
VARLEN_LENGTHS_K = [1, 200, 33, 519, 64, 0]
VARLEN_CASES = {"causal_sink": (True, True, 0.0), "sink_dropout": (False, True, 0.2),
                "causal_dropout": (True, False, 0.3)}


def _packed(lengths, h, d, gen):
    t = torch.randn(sum(lengths), h, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    return t, cu


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_sink_and_dropout_forward_and_backward(name):
    """mha_varlen with learnable_sink / dropout_p against the fp32 reference of each
    sequence alone (its dropout mask is dropout_mask's entry b: sequence b is keyed like
    mha's batch entry b), out, lse, dq, dk, dv per sequence and the sink's gradient over
    all of them; outputs poisoned first."""
    causal, with_sink, p = VARLEN_CASES[name]
    h, h_kv, d = 4, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(len(name))
    q, cu_q = _packed(VARLEN_LENGTHS_Q, h, d, gen)
    k, cu_k = _packed(VARLEN_LENGTHS_K, h_kv, d, gen)
    v, _ = _packed(VARLEN_LENGTHS_K, h_kv, d, gen)
    sink = torch.randn(h, device="cuda", generator=gen) * 2 if with_sink else None
    seed = _seed(7, len(name))
    kw = dict(causal=causal, learnable_sink=sink, dropout_p=p, dropout_seed=seed if p else None)
    args = (cu_q, cu_k, max(VARLEN_LENGTHS_Q), max(VARLEN_LENGTHS_K))
    poison_allocator(q.numel() * q.element_size(), q.numel() // d * 4)
    out, lse = cute_attn.mha_varlen(q, k, v, *args, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    dout = torch.randn(q.shape, generator=gen, device="cuda", dtype=q.dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if with_sink else [])
    out_g = cute_attn.mha_varlen(*leaves[:3], *args, **{**kw, "learnable_sink": leaves[3] if with_sink else None})
    grads = torch.autograd.grad(out_g, leaves, dout)
    assert torch.equal(out_g, out), "the autograd forward differs from the plain one"
    mask = masks.causal() if causal else None
    sink32, sink_lp = (None, None) if not with_sink else (sink.clone().requires_grad_() for _ in range(2))
    loss32 = loss_lp = formula32 = formula_own = 0.0
    for b, (lq, lk) in enumerate(zip(VARLEN_LENGTHS_Q, VARLEN_LENGTHS_K)):
        rq, rk = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())
        if lq == 0:  # keys no query sees: zero gradients, written
            assert not grads[1][rk].any() and not grads[2][rk].any()
            continue
        if lk == 0:  # every row sees no key: out = 0, lse = the sink (or -inf), zero gradients
            assert not out[rq].any() and not grads[0][rq].any()
            expect = sink[:, None].expand(h, lq) if with_sink else torch.full((h, lq), float("-inf"), device="cuda")
            if with_sink:  # (top + log2(sum)) * ln 2 in float32: the sink to rounding
                assert torch.allclose(lse[:, rq], expect)
            else:
                assert torch.equal(lse[:, rq], expect)
            continue
        qb, kb, vb, db = (t[r][None] for t, r in ((q, rq), (k, rk), (v, rk), (dout, rq)))
        drop = (cute_attn.dropout_mask(seed, b + 1, h, lq, lk, p)[b:b + 1], p) if p else None
        out_ref, lse_ref = attention_ref_mod(qb, kb, vb, mask_mod=mask, sink=sink, **_ref_kwargs(drop))
        out_lp = _reference_lowp(qb, kb, vb, mask, None, sink, drop)
        err, err_torch = ((o[0].float() - out_ref[0]).abs().max().item() for o in (out[rq][None], out_lp))
        assert err <= 2 * err_torch + OUT_FLOOR, f"seq {b} out: {err:.3g} > 2 x {err_torch:.3g}"
        empty = torch.isneginf(lse_ref[0])
        assert torch.equal(torch.isneginf(lse[:, rq]), empty)
        assert (lse[:, rq][~empty] - lse_ref[0][~empty]).abs().max().item() <= LSE_ATOL, f"seq {b} lse"
        _check_grads(qb, kb, vb, db, tuple(g[r][None] for g, r in zip(grads[:3], (rq, rk, rk))), mask_mod=mask,
                     sink=sink, drop=drop)
        if with_sink:
            ref32 = attention_ref_mod(*(t.float() for t in (qb, kb, vb)), mask_mod=mask, sink=sink32,
                                      **_ref_kwargs(drop))[0]
            loss32 = loss32 + (ref32 * db.float()).sum()
            loss_lp = loss_lp + (_reference_lowp(qb, kb, vb, mask, None, sink_lp, drop).float() * db.float()).sum()
            formula32 = formula32 + _dsink(out_ref, lse_ref, sink, db)
            formula_own = formula_own + _dsink(out[rq][None], lse[:, rq][None], sink, db)
    if with_sink:
        (g32,), (glp,) = torch.autograd.grad(loss32, sink32), torch.autograd.grad(loss_lp, sink_lp)
        _check_dsink(grads[3], g32, glp, formula32, formula_own)


# Packed sequences (mha_varlen) with mask/score mods: each sequence against the fp32
# reference of that sequence alone, with the mod seeing what the kernels give it (global
# indices, b = the sequence's index, the sequence's offsets): _at_sequence. Self-attention
# lengths for the masks that need them (documents over the packed tokens, BD3LM halves per
# sequence); a cross-attention batch for causal + ALiBi; empty sequences in both.
VARLEN_MOD_SELF = [1, 130, 0, 519, 77, 301]
VARLEN_MOD_CROSS = ([1, 130, 0, 519, 77, 6], [1, 200, 33, 519, 64, 0])


def _varlen_mod_cases():
    packed_ids = lambda: torch.cat([_doc_ids(1, n, 3 + i, mean_len=60)[0] + 1000 * i  # noqa: E731
                                    for i, n in enumerate(VARLEN_MOD_SELF)])
    return {
        "document_causal_packed": (lambda: (masks.document(packed_ids(), causal=True), None),
                                   VARLEN_MOD_SELF, VARLEN_MOD_SELF),
        "block_diffusion_5": (lambda: (masks.block_diffusion(5), None), VARLEN_MOD_SELF, VARLEN_MOD_SELF),
        "causal_alibi_cross": (lambda: (masks.causal(), masks.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625],
                                                                                  device="cuda"))),
                               *VARLEN_MOD_CROSS),
        # the deterministic backward: dQ turns read per sequence (the block mask's dq_turn)
        "block_diffusion_5_deterministic": (lambda: (masks.block_diffusion(5), None), VARLEN_MOD_SELF,
                                            VARLEN_MOD_SELF),
    }


VARLEN_MOD_CASES = _varlen_mod_cases()


def _at_sequence(mod, b, offset_q, offset_k):
    """mod as a kernel applies it to packed sequence b, for a reference call on that
    sequence alone (batch 1, indices from 0): global indices, b, the sequence's offsets."""
    if mod is None:
        return None
    if mod.kind == "mask":
        def at(b_, h, q, kv, seq):
            return mod(b_ + b, h, q + offset_q, kv + offset_k, seq=seq._replace(offset_q=offset_q, offset_k=offset_k))
    else:
        def at(score, b_, h, q, kv, seq):
            return mod(score, b_ + b, h, q + offset_q, kv + offset_k,
                       seq=seq._replace(offset_q=offset_q, offset_k=offset_k))
    return masks.Modifier(mod.kind, at, mod.aux, f"{mod.name}_at_{b}")


@pytest.mark.parametrize("name", list(VARLEN_MOD_CASES))
def test_varlen_mods_forward_and_backward(name):
    """mha_varlen with mask/score mods: out, lse, dq, dk, dv of every sequence against its
    own fp32 reference (the error rule of _check / _check_grads), empty sequences' rows and
    keys zero, outputs poisoned first; a block mask built once (create_varlen_block_mask)
    gives the same out bit for bit, and one built for other offsets is refused."""
    make, lengths_q, lengths_k = VARLEN_MOD_CASES[name]
    mask_mod, score_mod = make()
    h, h_kv, d = 4, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(len(name) + 11)
    q, cu_q = _packed(lengths_q, h, d, gen)
    k, cu_k = _packed(lengths_k, h_kv, d, gen)
    v, _ = _packed(lengths_k, h_kv, d, gen)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    kw = dict(mask_mod=mask_mod, score_mod=score_mod, deterministic=name.endswith("deterministic"))
    poison_allocator(q.numel() * q.element_size(), q.numel() // d * 4)
    out, lse = cute_attn.mha_varlen(q, k, v, *args, return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    dout = torch.randn(q.shape, generator=gen, device="cuda", dtype=q.dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(cute_attn.mha_varlen(*leaves, *args, **kw), leaves, dout)
    if kw["deterministic"]:
        again = torch.autograd.grad(cute_attn.mha_varlen(*leaves, *args, **kw), leaves, dout)
        assert all(torch.equal(a, b) for a, b in zip(grads, again)), "deterministic gradients differ run to run"
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        rq, rk = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())
        if lq == 0:
            assert not grads[1][rk].any() and not grads[2][rk].any(), f"seq {b}: keys no query sees"
            continue
        if lk == 0:
            assert not out[rq].any() and not grads[0][rq].any() and torch.isneginf(lse[:, rq]).all()
            continue
        at_mask, at_score = (_at_sequence(m, b, rq.start, rk.start) for m in (mask_mod, score_mod))
        qb, kb, vb, db = (t[r][None] for t, r in ((q, rq), (k, rk), (v, rk), (dout, rq)))
        _check(qb, kb, vb, out[rq][None], lse[:, rq][None], mask_mod=at_mask, score_mod=at_score)
        _check_grads(qb, kb, vb, db, tuple(g[r][None] for g, r in zip(grads, (rq, rk, rk))), mask_mod=at_mask,
                     score_mod=at_score)
    if mask_mod is not None:
        built = cute_attn.create_varlen_block_mask(mask_mod, cu_q, cu_k, h, head_dim=d)
        again = cute_attn.mha_varlen(q, k, v, *args, block_mask=built, **kw)
        assert torch.equal(again, out), "a prebuilt varlen block mask must give the same kernel work"
        shifted = cu_q.clone()
        shifted[1] += 1
        with pytest.raises(ValueError, match="other cu_seqlens"):
            cute_attn.mha_varlen(q, k, v, shifted, cu_k, *args[2:], block_mask=built, **kw)


def test_varlen_dropout_equals_dense_batch():
    """Equal lengths packed: mha_varlen with dropout draws the dense batch's masks
    (sequence b = batch entry b), so out, dk and dv equal mha's bit for bit (dq sums by
    atomics, in any order: to rounding)."""
    b, s, h, d, p = 3, 257, 2, 64, 0.25
    q, k, v = _inputs(b, s, s, h, h, d, seed=12)
    dout = torch.randn_like(q)
    seed = _seed(3, 9)
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    dense = _kernel_grads(q, k, v, dout, causal=True, dropout_p=p, dropout_seed=seed)
    flat = [t.reshape(b * s, h, d) for t in (q, k, v, dout)]
    packed = _kernel_grads_varlen(*flat, cu, s, causal=True, dropout_p=p, dropout_seed=seed)
    for name, x, y in zip(("out", "dq", "dk", "dv"), (dense[0], *dense[1]), (packed[0], *packed[1])):
        exact = name != "dq"
        torch.testing.assert_close(x.reshape(y.shape), y, atol=0 if exact else 1e-3, rtol=0 if exact else 1e-2,
                                   msg=lambda m: f"{name}: {m}")


def _kernel_grads_varlen(q, k, v, dout, cu, max_seqlen, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = cute_attn.mha_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)
    return out, torch.autograd.grad(out, (q, k, v), dout)


# ----------------------------------------------------------------------------------------
# Dropout: the kernels' Philox, the mask they apply, forward and backward
# ----------------------------------------------------------------------------------------


def test_kernel_philox_equals_torch():
    """blocks/dropout.philox in a small kernel against dropout.philox4x32 at the
    kernels' rounds (the torch version matches the known-answer vectors at 10, CPU
    tests), over varied counters and a key."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Uint32

    from cute_attn.blocks.dropout import philox
    from cute_attn.dropout import PHILOX_ROUNDS, philox4x32

    @cute.kernel
    def kernel(counters: cute.Tensor, key: cute.Tensor, out: cute.Tensor):
        i = cute.arch.block_idx()[0] * 128 + cute.arch.thread_idx()[0]
        c = [Uint32(counters[i, j]) for j in range(4)]
        words = philox(c[0], c[1], c[2], c[3], Uint32(key[0]), Uint32(key[1]))
        for j in cutlass.range_constexpr(4):
            out[i, j] = Int32(words[j])

    @cute.jit
    def run(counters: cute.Tensor, key: cute.Tensor, out: cute.Tensor):
        kernel(counters, key, out).launch(grid=[counters.shape[0] // 128, 1, 1], block=[128, 1, 1])

    from cutlass.cute.runtime import from_dlpack

    gen = torch.Generator(device="cuda").manual_seed(5)
    counters = torch.randint(-2 ** 31, 2 ** 31 - 1, (1024, 4), dtype=torch.int32, device="cuda", generator=gen)
    counters[:4] = torch.tensor([[0, 0, 0, 0], [-1, -1, -1, -1], [1, 2, 3, 4], [7, 0, 0, 7]], dtype=torch.int32)
    key = torch.tensor([0x1234567, -0x7654321], dtype=torch.int32, device="cuda")
    out = torch.zeros_like(counters)
    run(from_dlpack(counters), from_dlpack(key), from_dlpack(out))
    expected = philox4x32(tuple(counters.long().unbind(1)), tuple(key.long().unbind()), PHILOX_ROUNDS)
    got = out.long() & 0xFFFFFFFF
    for j in range(4):
        assert torch.equal(got[:, j], expected[j]), f"word {j}"


def _seed(a, b):
    return torch.tensor([a, b], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_dropout_mask_read_back_from_the_kernel(d):
    """V = identity (as many keys as the head dim) makes out[q] the dropped P row itself:
    its zeros are exactly the kernel's dropped pairs, equal to dropout_mask's, and the
    keep rate is within a binomial bound of 1 - p. Head dim 256 runs 80-key blocks, whose
    Philox groups straddle blocks (the forward's unpaired word pick); 64, 192-row tiles."""
    b, s, h, p = 2, d, 4, 0.3
    q, k, _ = _inputs(b, s, s, h, h, d, seed=11)
    v = torch.eye(s, device="cuda", dtype=torch.bfloat16)[None, :, None, :].expand(b, s, h, d).contiguous()
    seed = _seed(17, -5)
    out = cute_attn.mha(q, k, v, dropout_p=p, dropout_seed=seed)  # (b, q, h, key)
    kept = (out != 0).permute(0, 2, 1, 3)  # (b, h, q, key)
    expected = cute_attn.dropout_mask(seed, b, h, s, s, p)
    assert torch.equal(kept, expected), f"{(kept != expected).sum().item()} pairs differ from dropout_mask"
    n = kept.numel()
    rate = kept.float().mean().item()
    p_byte = threshold(p) / 256  # p taken to 1/256
    assert abs(rate - (1 - p_byte)) < 5 * (p_byte * (1 - p_byte) / n) ** 0.5
    # the kept values: P / (1 - p), rows summing to 1 / (1 - p) in expectation
    ref, _ = attention_ref_mod(q, k, v, dropout_keep=expected, dropout_p=p)
    assert (out.float() - ref).abs().max() < 2e-2


DROPOUT_CASES = {
    # (mha kwargs, the same as mods for the reference, b, sq, sk, heads, heads_kv, head dim)
    "causal_gqa_128": (dict(causal=True), lambda: (masks.causal(), None), 2, 333, 333, 4, 2, 128),
    "dense_64": (dict(), lambda: (None, None), 2, 300, 517, 2, 2, 64),
    "window_128": (dict(window_size=(100, 20)), lambda: (masks.sliding_window(100, 20), None), 1, 611, 611, 2, 1, 128),
    "block_diffusion_64": (None, lambda: (masks.block_diffusion(16), None), 1, 700, 700, 2, 2, 64),
    "causal_256": (dict(causal=True), lambda: (masks.causal(), None), 1, 259, 259, 2, 2, 256),
    # a score derivative beside the mask: dP^T masked before the fold, P^T after dS^T
    "softcap_causal_128": (dict(causal=True, softcap=20.0), lambda: (masks.causal(), masks.softcap(20.0)),
                           2, 333, 333, 4, 2, 128),
    "alibi_causal_64": (None, lambda: (masks.causal(), masks.alibi(torch.linspace(0.05, 0.5, 4, device="cuda"))),
                        1, 517, 517, 4, 2, 64),
}


@pytest.mark.parametrize("name", list(DROPOUT_CASES))
def test_dropout_forward_and_backward_match_reference(name):
    """The kernels' output and gradients against the fp32 reference with the kernels'
    own mask (dropout_mask of the call's seed), under the rules of the mods' tests."""
    kwargs, make, b, sq, sk, h, h_kv, d = DROPOUT_CASES[name]
    mask, score = make()
    p = 0.17
    seed = _seed(len(name), 99)
    q, k, v = _inputs(b, sq, sk, h, h_kv, d, seed=len(name) + 1)
    call = dict(mask_mod=mask, score_mod=score) if kwargs is None else kwargs
    keep = cute_attn.dropout_mask(seed, b, h, sq, sk, p)
    drop = (keep, p)
    out, lse = _run(q, k, v, dropout_p=p, dropout_seed=seed, **call)
    out_ref, lse_ref = attention_ref_mod(q, k, v, mask_mod=mask, score_mod=score, dropout_keep=keep, dropout_p=p)
    err = (out.float() - out_ref).abs().max().item()
    err_torch = (_reference_lowp(q, k, v, mask, score, drop=drop).float() - out_ref).abs().max().item()
    assert err <= 2 * err_torch + OUT_FLOOR, f"out: {err:.3g} > 2 x {err_torch:.3g}"
    finite = torch.isfinite(lse_ref)
    assert (lse[finite] - lse_ref[finite]).abs().max().item() <= LSE_ATOL  # the undropped softmax's
    dout = torch.randn_like(q)
    _, grads = _kernel_grads(q, k, v, dout, dropout_p=p, dropout_seed=seed, **call)
    _check_grads(q, k, v, dout, grads, mask_mod=mask, score_mod=score, drop=drop)


def test_dropout_same_seed_is_bit_identical_and_seeds_differ():
    q, k, v = _inputs(1, 400, 400, 2, 2, 128, seed=3)
    dout = torch.randn_like(q)
    runs = []
    for seed in (_seed(1, 2), _seed(1, 2), _seed(1, 3)):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = cute_attn.mha(*leaves, causal=True, dropout_p=0.25, dropout_seed=seed, deterministic=True)
        runs.append((out, *torch.autograd.grad(out, leaves, dout)))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    assert (runs[0][0] != runs[2][0]).float().mean() > 0.1


def test_dropout_seed_from_torch_generator():
    """Without a seed the call draws one from torch's generator: manual_seed reproduces
    it, the next call draws another; a CUDA graph replays with a new draw each time."""
    q, k, v = _inputs(1, 256, 256, 2, 2, 64, seed=4)
    torch.manual_seed(0)
    a = cute_attn.mha(q, k, v, dropout_p=0.5)
    b = cute_attn.mha(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    a2 = cute_attn.mha(q, k, v, dropout_p=0.5)
    assert torch.equal(a, a2) and not torch.equal(a, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cute_attn.mha(q, k, v, dropout_p=0.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cute_attn.mha(q, k, v, dropout_p=0.5)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert torch.isfinite(out).all() and not torch.equal(first, out)


def test_dropout_with_a_sink():
    b, s, h, d, p = 1, 300, 2, 128, 0.2
    q, k, v = _inputs(b, s, s, h, h, d, seed=8)
    sink = torch.randn(h, device="cuda")
    seed = _seed(4, 4)
    keep = cute_attn.dropout_mask(seed, b, h, s, s, p)
    out = cute_attn.mha(q, k, v, causal=True, learnable_sink=sink, dropout_p=p, dropout_seed=seed)
    ref, _ = attention_ref_mod(q, k, v, mask_mod=masks.causal(), sink=sink, dropout_keep=keep, dropout_p=p)
    low = _reference_lowp(q, k, v, masks.causal(), None, sink, (keep, p))
    assert (out.float() - ref).abs().max() <= 2 * (low.float() - ref).abs().max() + OUT_FLOOR
