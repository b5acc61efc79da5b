"""The split-KV combine on the CPU: its reference (cute_attn.reference.combine_splits)
against whole attention, and the combine kernel compiling for sm_90a.

Any partition of the keys into splits, each attended separately (attention_ref over that
split's keys gives its normalised out and its LSE), must combine into attention over all
the keys. The partition includes empty splits (whose out is NaN here, to prove it is never
read) and, under a causal mask, splits that some rows do not see.
"""

import pytest
import torch

from cute_attn.reference import attention_ref, combine_splits


def _split_attention(q, k, v, bounds, **kw):
    """Per-split (out, lse) over keys [a, b) of each (a, b) in bounds, stacked; the mask is
    the whole sequence's, so a split gets the visible keys of its range."""
    sq, sk = q.shape[1], k.shape[1]
    outs, lses = [], []
    for a, b in bounds:
        if a == b:  # an empty split: saw no key, out never written
            outs.append(torch.full_like(q, float("nan")))
            lses.append(torch.full((q.shape[0], q.shape[2], sq), float("-inf")))
            continue
        # the whole problem's mask, restricted to keys [a, b)
        keep = torch.zeros(sk, dtype=torch.bool)
        keep[a:b] = True
        out, lse = _masked_attention(q, k, v, keep, **kw)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _masked_attention(q, k, v, keep, causal=False):
    scale = q.shape[-1] ** -0.5
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = q.shape[1], k.shape[1]
    visible = keep[None, :].expand(sq, sk).clone()
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        visible &= j <= i + (sk - sq)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(visible, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bounds", [[(0, 37)], [(0, 10), (10, 10), (10, 37)], [(0, 1), (1, 2), (2, 30), (30, 37)]])
def test_combined_splits_are_whole_attention(causal, bounds):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 41, 3, 32), torch.randn(2, 37, 3, 32), torch.randn(2, 37, 3, 32)
    parts = _split_attention(q, k, v, bounds, causal=causal)
    out, lse = combine_splits(*parts)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)  # causal: 4 rows see no key
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not out.isnan().any()


def test_rows_no_split_saw_get_zero_and_minus_inf():
    out_parts = torch.full((3, 1, 2, 1, 32), float("nan"))
    lse_parts = torch.full((3, 1, 1, 2), float("-inf"))
    out, lse = combine_splits(out_parts, lse_parts)
    assert torch.equal(out, torch.zeros(1, 2, 1, 32)) and torch.isneginf(lse).all()


def test_a_wrong_weighting_is_caught():
    """Teeth: averaging the splits' outs without their LSE weights is not attention."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 9, 2, 32), torch.randn(1, 20, 2, 32), torch.randn(1, 20, 2, 32)
    out_parts, lse_parts = _split_attention(q, k, v, [(0, 5), (5, 20)])
    ref, _ = attention_ref(q, k, v)
    assert not torch.allclose(out_parts.mean(0), ref, atol=1e-3)
    out, _ = combine_splits(out_parts, lse_parts)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
