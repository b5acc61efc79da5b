"""CPU tests of the programmable-mask groundwork (issue 14): cute_attn/masks.py and
cute_attn/mask_reference.py.

Each built-in mask is checked against an explicit Python loop spelling out its rule, the
fixed masks against reference.visible_keys, attention_ref_mod against attention_ref (and
its empty rows for NaN-free values and gradients), and the block masks against a
brute-force classification, including a simulated block-sparse forward that visits only
the listed tiles and calls the mask only on partial ones.
"""

import functools
import math

import pytest
import torch

from cute_attn import masks
from cute_attn.mask_reference import (
    EMPTY,
    FULL,
    PARTIAL,
    attention_ref_mod,
    block_mask,
    dense_mask,
    index_grids,
    seq_info,
    kv_tile_lists,
    q_tile_lists,
)
from cute_attn.reference import attention_ref, visible_keys


def loop_mask(rule, batch, heads, seqlen_q, seqlen_k):
    """Dense bool mask from a rule(b, h, i, j) -> bool on Python ints."""
    out = torch.zeros(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for i in range(seqlen_q):
                for j in range(seqlen_k):
                    out[b, h, i, j] = bool(rule(b, h, i, j))
    return out


def qkv(batch, sq, sk, heads, heads_kv=None, d=16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    heads_kv = heads_kv or heads
    tensors = (torch.randn(batch, sq, heads, d, generator=g),
               torch.randn(batch, sk, heads_kv, d, generator=g),
               torch.randn(batch, sk, heads_kv, d, generator=g))
    return tuple(t.requires_grad_(grad) for t in tensors)


# ----------------------------------------------------------------------------------------
# Built-in mask mods against their rules
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seqlen", [24, 25, 7])
@pytest.mark.parametrize("block_size", [1, 4, 5, 12])
def test_block_diffusion_matches_rule(block_size, seqlen):
    half = seqlen // 2  # L noisy tokens, then L clean ones (L + 1 at an odd length)

    def rule(b, h, i, j):
        i_clean, j_clean = i >= half, j >= half
        bi, bj = (i - half * i_clean) // block_size, (j - half * j_clean) // block_size
        if not i_clean and not j_clean:
            return bi == bj
        if not i_clean and j_clean:
            return bj < bi
        if i_clean and j_clean:
            return bj <= bi
        return False  # clean never sees noisy

    got = dense_mask(masks.block_diffusion(block_size), 1, 1, seqlen, seqlen)
    assert torch.equal(got, loop_mask(rule, 1, 1, seqlen, seqlen))


def test_block_diffusion_structure():
    """The four quadrants for L = 12, block 4: block diagonal, strictly block-lower,
    block-lower with diagonal, nothing."""
    m = dense_mask(masks.block_diffusion(4), 1, 1, 24, 24)[0, 0]
    blocks = torch.arange(12) // 4
    same = blocks[:, None] == blocks[None, :]
    before = blocks[None, :] < blocks[:, None]
    assert torch.equal(m[:12, :12], same)
    assert torch.equal(m[:12, 12:], before)
    assert torch.equal(m[12:, 12:], same | before)
    assert not m[12:, :12].any()
    # The first noisy block sees no clean key; every query sees at least one key.
    assert not m[:4, 12:].any() and m.any(dim=-1).all()


def test_block_diffusion_rejects_bad_arguments():
    with pytest.raises(ValueError):
        masks.block_diffusion(0)
    with pytest.raises(ValueError):
        masks.block_diffusion(2.5)


def test_block_diffusion_reads_the_length_at_run_time():
    """One mod (one kernel) for every L: the halves follow the length it is called with."""
    mod = masks.block_diffusion(3)
    for seqlen in (12, 18, 30):
        half = seqlen // 2
        m = dense_mask(mod, 1, 1, seqlen, seqlen)[0, 0]
        blocks = torch.arange(half) // 3
        assert torch.equal(m[:half, :half], blocks[:, None] == blocks[None, :])
        assert not m[half:, :half].any()


def test_prefix_lm_matches_rule():
    lens = (0, 3, 12)
    seqlen = 12

    def rule(b, h, i, j):
        return j < lens[b] or j <= i

    expected = loop_mask(rule, 3, 2, seqlen, seqlen)
    for prefix_lens in (lens, torch.tensor(lens, dtype=torch.int32)):
        got = dense_mask(masks.prefix_lm(prefix_lens), 3, 2, seqlen, seqlen)
        assert torch.equal(got, expected)
    assert torch.equal(expected[0, 0], torch.ones(12, 12, dtype=torch.bool).tril())
    assert expected[2].all()


DOC_IDS = torch.tensor([
    [0, 0, 0, 2, 2, 3, 5, 5, 5, 5, 6],  # ids 1 and 4 are empty documents, 3 and 6 one token
    [7, 7, 1, 1, 7, 9, 9, 9, 0, 1, 1],  # interleaved documents
])


@pytest.mark.parametrize("causal", [False, True])
def test_document_matches_rule(causal):
    def rule(b, h, i, j):
        return DOC_IDS[b, i] == DOC_IDS[b, j] and (not causal or j <= i)

    batch, seqlen = DOC_IDS.shape
    got = dense_mask(masks.document(DOC_IDS, causal=causal), batch, 2, seqlen, seqlen)
    assert torch.equal(got, loop_mask(rule, batch, 2, seqlen, seqlen))
    # a one-token document sees exactly itself
    assert got[0, 0, 5].nonzero().flatten().tolist() == [5]


SEQLEN_PAIRS = [(7, 7), (5, 9), (9, 5), (1, 6), (6, 1)]


@pytest.mark.parametrize("sq,sk", SEQLEN_PAIRS)
def test_causal_equals_visible_keys(sq, sk):
    expected = visible_keys(sq, sk, causal=True)
    got = dense_mask(masks.causal(), 1, 1, sq, sk)[0, 0]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("sq,sk", SEQLEN_PAIRS)
@pytest.mark.parametrize("window", [(2, 0), (0, 0), (1, 3), (-1, 2), (3, -1), (-1, -1)])
def test_sliding_window_equals_visible_keys(sq, sk, window):
    expected = visible_keys(sq, sk, window_size=window)
    if expected is None:
        expected = torch.ones(sq, sk, dtype=torch.bool)
    got = dense_mask(masks.sliding_window(*window), 2, 1, sq, sk)
    assert torch.equal(got[1, 0], expected)


def test_modifier_contract():
    with pytest.raises(TypeError, match="aux"):
        masks.Modifier.of("mask", lambda b, h, q, kv: q >= kv, (torch.zeros(3),))
    with pytest.raises(TypeError, match="positional"):
        masks.Modifier.of("mask", lambda q, kv: q >= kv)
    with pytest.raises(TypeError, match="score"):
        masks.Modifier.of("score", masks.causal())
    ids = torch.zeros(2, 5, dtype=torch.int32)
    with pytest.raises(TypeError, match="aux tensor"):
        masks.Modifier.of("mask", lambda b, h, q, kv: ids[b, q] == ids[b, kv]).key
    # closures of one body with other constants are other kernels; the same ones are not
    assert masks.block_diffusion(4).key == masks.block_diffusion(4).key
    assert masks.block_diffusion(4).key != masks.block_diffusion(8).key
    assert masks.sliding_window(2, 1).key != masks.sliding_window(1, 2).key
    assert masks.document(ids).key != masks.document(ids, causal=True).key


def test_combinators():
    seqlen = 11
    doc = masks.document(DOC_IDS)
    win = masks.sliding_window(2, 1)
    d, w = (dense_mask(m, 2, 1, seqlen, seqlen) for m in (doc, win))
    assert torch.equal(dense_mask(masks.and_masks(doc, win), 2, 1, seqlen, seqlen), d & w)
    assert torch.equal(dense_mask(masks.or_masks(doc, win), 2, 1, seqlen, seqlen), d | w)
    assert dense_mask(masks.and_masks(), 1, 1, 3, 4).all()
    assert not dense_mask(masks.or_masks(), 1, 1, 3, 4).any()
    assert masks.and_masks(doc, win).name == "and(document, sliding_window_2_1)"


def test_dense_mask_rejects_non_bool():
    with pytest.raises(TypeError):
        dense_mask(lambda b, h, q, kv: q - kv, 1, 1, 3, 3)


# ----------------------------------------------------------------------------------------
# attention_ref_mod
# ----------------------------------------------------------------------------------------


def _grads(fn, tensors, seed=1):
    """Gradients of a fixed random linear function of (out, finite lse) w.r.t. tensors."""
    out, lse = fn(*tensors)
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * torch.randn(lse.shape, generator=g)).sum()
    return out, lse, torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("sq,sk,heads,heads_kv", [(8, 8, 4, 4), (6, 10, 4, 2), (10, 6, 4, 1)])
def test_causal_and_window_match_attention_ref(sq, sk, heads, heads_kv):
    tensors = qkv(2, sq, sk, heads, heads_kv, grad=True)
    cases = [
        (dict(causal=True), masks.causal()),
        (dict(window_size=(2, 1)), masks.sliding_window(2, 1)),
        (dict(), None),
    ]
    for kwargs, mod in cases:
        out_r, lse_r, grads_r = _grads(lambda q, k, v: attention_ref(q, k, v, **kwargs), tensors)
        out_m, lse_m, grads_m = _grads(lambda q, k, v: attention_ref_mod(q, k, v, mask_mod=mod), tensors)
        torch.testing.assert_close(out_m, out_r)
        torch.testing.assert_close(lse_m, lse_r)
        for a, b in zip(grads_m, grads_r):
            torch.testing.assert_close(a, b)


def test_empty_rows_give_zero_and_minus_inf_without_nan():
    """Rows 0 and 3 see no key; the rest see a few."""
    def mod(b, h, q_idx, kv_idx):
        return (q_idx != 0) & (q_idx != 3) & (kv_idx <= q_idx)

    tensors = qkv(2, 6, 6, 2, 1, grad=True)
    out, lse, (dq, dk, dv) = _grads(lambda q, k, v: attention_ref_mod(q, k, v, mask_mod=mod), tensors)
    empty = torch.tensor([0, 3])
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[:, :, empty]).all()
    assert torch.isfinite(lse[:, :, [1, 2, 4, 5]]).all()
    for grad in (dq, dk, dv):
        assert torch.isfinite(grad).all()
    assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty]))
    assert dq[:, [1, 2]].abs().sum() > 0


def test_everything_masked_gives_zero_gradients():
    tensors = qkv(1, 5, 4, 2, grad=True)
    out, lse, grads = _grads(
        lambda q, k, v: attention_ref_mod(q, k, v, mask_mod=masks.or_masks()), tensors)
    assert not out.any() and torch.isneginf(lse).all()
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))
    # backpropagating through the -inf lse itself must not produce NaN either
    out, lse = attention_ref_mod(*tensors, mask_mod=masks.or_masks())
    (out.sum() + lse.sum()).backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in tensors)


def test_score_mod_minus_inf_counts_as_masked():
    """A score mod that writes -inf hides keys like the mask mod would, empty rows too."""
    def hide(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= q_idx - 2, score, float("-inf"))

    def mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx - 2

    tensors = qkv(1, 6, 6, 2, grad=True)
    out_s, lse_s, grads_s = _grads(lambda q, k, v: attention_ref_mod(q, k, v, score_mod=hide), tensors)
    out_m, lse_m, grads_m = _grads(lambda q, k, v: attention_ref_mod(q, k, v, mask_mod=mod), tensors)
    torch.testing.assert_close(out_s, out_m)
    torch.testing.assert_close(lse_s, lse_m)
    for a, b in zip(grads_s, grads_m):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


def _user_score_mod(score, b, h, q_idx, kv_idx):
    # products, quotients and a tanh of the score, an index-dependent constant
    x = (score * 0.5 - 1.0) / (2.0 + masks.as_float(q_idx - kv_idx) * 0.1)
    return masks.tanh(x) * (3.0 - score / 4.0) + 1.0 / (1.5 + x * x)


@pytest.mark.parametrize("mod", [
    masks.alibi([0.5, 0.25]), masks.softcap(5.0), masks.Modifier("score", _user_score_mod),
    masks.Modifier("score", lambda score, b, h, q_idx, kv_idx: 2.0 - score),
], ids=lambda m: m.name)
def test_dual_derivative_matches_autograd(mod):
    """What the backward kernel traces (score mod on a masks.Dual) equals torch autograd
    of the same body, at scores from -30 to 30 and several index pairs."""
    seq = seq_info(mod, 9, 11)
    for score in (-30.0, -2.5, -0.1, 0.0, 0.7, 4.0, 30.0):
        for b, h, q_idx, kv_idx in ((0, 0, 3, 1), (1, 1, 8, 10), (0, 1, 0, 0)):
            x = torch.tensor(score, dtype=torch.float64, requires_grad=True)
            out = mod(x, b, h, q_idx, kv_idx, seq=seq)
            (grad,) = torch.autograd.grad(out, x)
            dual = mod(masks.Dual(score), b, h, q_idx, kv_idx, seq=seq)
            value, dgrad = masks.Dual.parts(dual)
            assert float(value) == pytest.approx(out.item(), rel=1e-5, abs=1e-6)
            assert float(dgrad) == pytest.approx(grad.item(), rel=1e-5, abs=1e-6)


def test_dual_refuses_what_it_cannot_differentiate():
    branchy = masks.Modifier("score", lambda score, b, h, q_idx, kv_idx: score * (score > 0))
    with pytest.raises(TypeError, match="differentiates"):
        branchy(masks.Dual(1.0), 0, 0, 0, 0)
    with pytest.raises(ValueError, match="positive"):
        masks.softcap(0)


def test_alibi_matches_hand_written_bias():
    batch, sq, sk, heads, d = 2, 5, 7, 4, 8
    slopes = [2.0 ** (-8 * (i + 1) / heads) for i in range(heads)]
    q, k, v = qkv(batch, sq, sk, heads, 2, d=d, grad=True)
    scale = 0.3

    # the score mod alone, element by element
    zero = torch.zeros(batch, heads, sq, sk)
    alibi = masks.alibi(slopes)
    bias = alibi(zero, *index_grids(batch, heads, sq, sk), seq=seq_info(alibi, sq, sk))
    for h in range(heads):
        for i in range(sq):
            for j in range(sk):
                assert bias[1, h, i, j].item() == pytest.approx(slopes[h] * (j - i - (sk - sq)))

    # with a causal mask it is FlashAttention's -slope * |i + sk - sq - j|
    kr, vr = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    fa_bias = -torch.tensor(slopes)[:, None, None] * (i + sk - sq - j).abs()
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale + fa_bias
    scores = scores.masked_fill(~visible_keys(sq, sk, causal=True), float("-inf"))
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vr)
    out, lse = attention_ref_mod(q, k, v, mask_mod=masks.causal(), score_mod=masks.alibi(slopes),
                                 softmax_scale=scale)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    dq, dk = torch.autograd.grad(out.sum(), (q, k))
    dq_e, dk_e = torch.autograd.grad(expected.sum(), (q, k))
    torch.testing.assert_close(dq, dq_e)
    torch.testing.assert_close(dk, dk_e)


def test_alibi_bias_stays_exact_far_into_a_long_sequence():
    """The bias is slope x (key - query) with the positions converted to float32 apart
    (per column, per row in a kernel) and subtracted exactly: near the diagonal of a 1M
    sequence it is one rounding of the product, not the difference of two large rounded
    products (which is ~6e-2 off there for slopes that are not powers of two)."""
    slopes = torch.tensor([0.3, 2 ** -0.5, 0.0123], dtype=torch.float64)
    alibi = masks.alibi(slopes.float())
    n = 1 << 20
    q = torch.tensor([n - 1, n - 7, 123_457, n - 1])[:, None]
    kv = q + torch.tensor([-3, -1, 0, -40_000])[None, :]
    seq = masks.SeqInfo(alibi.aux, n, n, 0, 0)
    for h in range(len(slopes)):
        bias = alibi.fn(torch.zeros(q.shape[0], kv.shape[1]), 0, h, q, kv, seq)
        exact = slopes[h] * (kv - q).double()
        err = (bias.double() - exact).abs() / exact.abs().clamp_min(1e-30)
        assert err.max().item() <= 2 ** -23, (h, err.max().item())


def test_alibi_backward_trace_recomputes_the_forward_bias_bit_for_bit():
    """The backward traces alibi with a Dual score and takes the per-element conversion
    there: the same value bit for bit as the forward's per-column form (both are slope x
    the exact distance, rounded once), and derivative 1."""
    slopes = torch.tensor([0.3, 2 ** -0.5, 0.0123])
    alibi = masks.alibi(slopes)
    n = 1 << 20
    q = torch.tensor([n - 1, 5, 123_457, 900])[:, None]
    kv = torch.tensor([n - 4, 0, 123_457, 17, 2000])[None, :]
    for seqlen_q, seqlen_k in ((n, n), (1000, n)):
        seq = masks.SeqInfo(alibi.aux, seqlen_q, seqlen_k, 0, 0)
        for h in range(len(slopes)):
            score = torch.randn(q.shape[0], kv.shape[1])
            forward = alibi.fn(score, 0, h, q, kv, seq)
            dual = alibi.fn(masks.Dual(score), 0, h, q, kv, seq)
            assert torch.equal(dual.value, forward) and dual.grad == 1.0


# ----------------------------------------------------------------------------------------
# Block masks and tile lists
# ----------------------------------------------------------------------------------------


def _random_doc_ids(batch, seqlen, seed):
    g = torch.Generator().manual_seed(seed)
    # sorted ids with random jumps: runs of random lengths, some of one token
    return torch.randint(0, 3, (batch, seqlen), generator=g).cumsum(dim=1) // 2


def _block_cases():
    doc_ids = _random_doc_ids(2, 23, seed=3)
    per_head_window = lambda b, h, q, kv: (kv <= q) & (kv >= q - 3 * (h + 1))  # noqa: E731
    return [
        ("document", masks.document(doc_ids), 2, 2, 23, 23),
        ("document_causal_window", masks.and_masks(masks.document(doc_ids, causal=True),
                                                   per_head_window), 2, 2, 23, 23),
        ("block_diffusion", masks.block_diffusion(4), 1, 1, 26, 26),
        ("prefix_lm", masks.prefix_lm([0, 9]), 2, 1, 19, 19),
        ("causal_rect", masks.causal(), 1, 1, 13, 21),
        ("nothing", masks.or_masks(), 1, 1, 7, 9),
    ]


BLOCK_CASES = _block_cases()
TILES = [(1, 1), (3, 5), (4, 4), (5, 7), (8, 3), (32, 32)]


def _brute_force_classes(dense, tile_m, tile_n):
    batch, heads, sq, sk = dense.shape
    tiles_m, tiles_n = math.ceil(sq / tile_m), math.ceil(sk / tile_n)
    classes = torch.empty(batch, heads, tiles_m, tiles_n, dtype=torch.int8)
    for b in range(batch):
        for h in range(heads):
            for m in range(tiles_m):
                for n in range(tiles_n):
                    tile = dense[b, h, m * tile_m:(m + 1) * tile_m, n * tile_n:(n + 1) * tile_n]
                    classes[b, h, m, n] = FULL if tile.all() else PARTIAL if tile.any() else EMPTY
    return classes


@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c[0])
def test_block_mask_matches_brute_force(case, tile):
    _, mod, batch, heads, sq, sk = case
    classes = block_mask(mod, batch, heads, sq, sk, *tile)
    assert classes.dtype == torch.int8
    assert classes.shape == (batch, heads, math.ceil(sq / tile[0]), math.ceil(sk / tile[1]))
    expected = _brute_force_classes(dense_mask(mod, batch, heads, sq, sk), *tile)
    assert torch.equal(classes, expected)


def test_block_mask_cut_tiles_are_full_when_in_bounds_pairs_are():
    """Sequences of 5 queries and 7 keys in 4 x 4 tiles, all visible: every tile is FULL,
    the ones cut by the sequence ends included."""
    classes = block_mask(masks.and_masks(), 1, 1, 5, 7, 4, 4)
    assert (classes == FULL).all()
    assert block_mask(masks.and_masks(), 1, 1, 0, 7, 4, 4).shape == (1, 1, 0, 2)


@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c[0])
def test_tile_lists_follow_block_mask(case, tile):
    _, mod, batch, heads, sq, sk = case
    classes = block_mask(mod, batch, heads, sq, sk, *tile)
    tiles_m, tiles_n = classes.shape[-2:]
    kv, qs = kv_tile_lists(classes), q_tile_lists(classes)
    assert kv.num_blocks.shape == (batch, heads, tiles_m) and kv.indices.shape == classes.shape
    assert qs.num_blocks.shape == (batch, heads, tiles_n)
    assert qs.indices.shape == (batch, heads, tiles_n, tiles_m)
    for t in (*kv, *qs):
        assert t.dtype == torch.int32
    for b in range(batch):
        for h in range(heads):
            for m in range(tiles_m):
                want = [n for n in reversed(range(tiles_n)) if classes[b, h, m, n] != EMPTY]
                count = kv.num_blocks[b, h, m].item()
                assert count == len(want)
                assert kv.indices[b, h, m, :count].tolist() == want
                assert (kv.indices[b, h, m, count:] == -1).all()
            for n in range(tiles_n):
                want = [m for m in range(tiles_m) if classes[b, h, m, n] != EMPTY]
                count = qs.num_blocks[b, h, n].item()
                assert count == len(want)
                assert qs.indices[b, h, n, :count].tolist() == want
                assert (qs.indices[b, h, n, count:] == -1).all()


def _block_sparse_forward(q, k, v, mod, tile_m, tile_n):
    """What a block-sparse kernel would do: per query tile, visit only the listed KV tiles
    in order with an online softmax, call the mask mod only on PARTIAL tiles (on FULL
    ones only the sequence end is masked)."""
    batch, sq, heads, d = q.shape
    sk = k.shape[1]
    classes = block_mask(mod, batch, heads, sq, sk, tile_m, tile_n)
    lists = kv_tile_lists(classes)
    dense = dense_mask(mod, batch, heads, sq, sk)
    out = torch.zeros(batch, sq, heads, d)
    lse = torch.full((batch, heads, sq), float("-inf"))
    for b in range(batch):
        for h in range(heads):
            for m in range(classes.shape[2]):
                rows = slice(m * tile_m, min((m + 1) * tile_m, sq))
                row_max = torch.full((rows.stop - rows.start,), float("-inf"))
                row_sum = torch.zeros_like(row_max)
                acc = torch.zeros(rows.stop - rows.start, d)
                for n in lists.indices[b, h, m, :lists.num_blocks[b, h, m]].tolist():
                    cols = slice(n * tile_n, min((n + 1) * tile_n, sk))
                    s = q[b, rows, h] @ k[b, cols, h].T * d ** -0.5
                    if classes[b, h, m, n] == PARTIAL:
                        s = s.masked_fill(~dense[b, h, rows, cols], float("-inf"))
                    new_max = torch.maximum(row_max, s.amax(-1))
                    safe = torch.where(torch.isfinite(new_max), new_max, 0.0)
                    correction = torch.exp(row_max - safe)
                    p = torch.exp(s - safe[:, None])
                    row_sum = row_sum * correction + p.sum(-1)
                    acc = acc * correction[:, None] + p @ v[b, cols, h]
                    row_max = new_max
                seen = row_sum > 0
                out[b, rows, h] = torch.where(seen[:, None], acc / row_sum.clamp(min=1e-30)[:, None], 0.0)
                lse[b, h, rows] = torch.where(seen, row_max + row_sum.clamp(min=1e-30).log(), float("-inf"))
    return out, lse


@pytest.mark.parametrize("tile", [(3, 5), (8, 3)], ids=str)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c[0])
def test_block_sparse_forward_matches_dense(case, tile):
    _, mod, batch, heads, sq, sk = case
    q, k, v = qkv(batch, sq, sk, heads, d=8, seed=5)
    out, lse = _block_sparse_forward(q, k, v, mod, *tile)
    out_ref, lse_ref = attention_ref_mod(q, k, v, mask_mod=mod)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(lse, lse_ref)


def _window(b, h, q_idx, kv_idx, w):
    return (q_idx - kv_idx) <= w


class _Window:
    def __init__(self, w):
        self.w = w

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) <= self.w


@pytest.mark.parametrize("make", [
    lambda w: functools.partial(_window, w=w),
    lambda w: (lambda b, h, q_idx, kv_idx, *, w=w: (q_idx - kv_idx) <= w),
    lambda w: (lambda b, h, q_idx, kv_idx, w=w: (q_idx - kv_idx) <= w),
    _Window,
], ids=["partial", "kwdefault", "default", "callable-object"])
def test_mods_that_differ_only_in_bound_values_are_different_kernels(make):
    """A mod's key (the kernel cache's and the traced ops' digest) covers what a
    functools.partial binds, a function's defaults and a callable object's attributes:
    two such mods with other windows never share a kernel; equal ones do."""
    one, other, again = (masks.Modifier.of("mask", make(w)) for w in (1, 100, 1))
    assert one.spec.digest != other.spec.digest
    assert one.spec.digest == again.spec.digest


class _Slotted:
    __slots__ = ("w",)  # no __dict__: its state cannot be read into a key

    def __init__(self, w):
        self.w = w

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) <= self.w


def test_a_mod_that_cannot_be_keyed_is_refused():
    with pytest.raises(TypeError, match="a mod must be a Python function"):
        masks.Modifier.of("mask", _Slotted(1))


def _user_module(source: str) -> dict:
    """A stand-in for a user's module: source executed in a namespace of its own, whose
    functions read it as their globals."""
    namespace = {"__name__": "user_mods"}
    exec(source, namespace)
    return namespace


_HELPER_MOD = """
BLOCK = {block}

def same_block(q_idx, kv_idx):
    return q_idx // BLOCK {op} kv_idx // BLOCK

def mask(b, h, q_idx, kv_idx):
    return same_block(q_idx, kv_idx)
"""


def test_a_mods_key_covers_the_helpers_and_constants_it_reads():
    """A mod's bytecode names a helper it calls and a module constant it reads but does
    not hold them: edit either and the key must change (else the disk cache, or this
    process's, hands back the kernel of the old helper); unchanged, the key is stable."""
    def digest(block, op):
        return masks.Modifier.of("mask", _user_module(_HELPER_MOD.format(block=block, op=op))["mask"]).spec.digest

    base = digest(16, "==")
    assert digest(16, "==") == base
    assert digest(16, ">=") != base  # the helper's body
    assert digest(32, "==") != base  # the constant it reads


def test_recursive_helpers_and_library_functions_are_keyed_without_recursing_forever():
    namespace = _user_module("""
import math
from cute_attn.masks import tanh

def even(n):
    return True if n == 0 else odd(n - 1)

def odd(n):
    return False if n == 0 else even(n - 1)

def mask(b, h, q_idx, kv_idx):
    return even(2) and tanh(0.0) == 0.0 and math.pi > 3 and q_idx >= kv_idx
""")
    key = masks.Modifier.of("mask", namespace["mask"]).spec.key
    assert "('tanh', 'cute_attn.masks', 'tanh')" in repr(key)  # a library function: by name
    assert masks.Modifier.of("mask", namespace["mask"]).spec.key == key


def test_block_diffusion_noisy_queries_against_the_2L_keys():
    """BD3LM's L noisy queries against the 2L keys x_t ++ x_0 (sampling, or a noisy-only
    query pass): L comes from the keys, so the noisy rows are those of the square mask
    (L from seqlen_q split both sides at L / 2: half the noisy queries read as clean)."""
    from cute_attn.mask_reference import dense_mask

    for L, bs in ((8, 4), (10, 3), (7, 2)):
        got = dense_mask(masks.block_diffusion(bs), 1, 1, L, 2 * L)[0, 0]
        i, j = torch.arange(L)[:, None], torch.arange(2 * L)[None]
        want = ((j < L) & (j // bs == i // bs)) | ((j >= L) & ((j - L) // bs < i // bs))
        assert torch.equal(got, want), (L, bs)
        square = dense_mask(masks.block_diffusion(bs), 1, 1, 2 * L, 2 * L)[0, 0]
        assert torch.equal(square[:L], want)


def test_ids_given_as_arrays_are_copied_so_a_refilled_buffer_cannot_stale_the_cache():
    """document(np_array) / prefix_lm(np_array) wrapped the caller's buffer: a data loader
    refilling it changed the ids behind torch's version counter, and the cached block mask
    kept FULL tiles across what became two documents. Arrays and sequences are copied."""
    import numpy as np

    from cute_attn import block_mask as bm

    ids = np.zeros((1, 256), np.int64)
    mod = masks.document(ids)
    before = bm.cached_block_mask(mod, 1, 1, 256, 256, 128, 128, "cpu").classes()
    ids[0, 128:] = 1  # the caller's buffer, refilled
    assert torch.equal(bm.cached_block_mask(mod, 1, 1, 256, 256, 128, 128, "cpu").classes(), before)
    assert torch.equal(mod.aux[0], torch.zeros(1, 256, dtype=torch.int64))  # the copy: unchanged, consistent
    lens = np.array([3], np.int32)
    prefix = masks.prefix_lm(lens)
    lens[0] = 100
    assert prefix.aux[0].tolist() == [3]
