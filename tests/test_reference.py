"""cute_attn.reference.attention_ref against a float64 row-by-row computation (CPU)."""

import math

import pytest
import torch

from cute_attn.reference import attention_ref

# The fp32 reference vs float64 on these small shapes: a few fp32 ulps of O(1) values.
TOL = 1e-5


def _naive(q, k, v, *, causal, scale=None, top_left=False, lse_base2=False):
    """Attention one query row at a time in float64; the flags build wrong variants."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    shift = 0 if top_left else sk - sq  # causal: query i sees key j iff j <= i + shift
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                n = min(sk, i + shift + 1) if causal else sk
                if n <= 0:
                    continue  # sees no key: out 0, lse -inf
                s = scale * (k[bi, :n, hi] @ q[bi, i, hi])
                m = s.max()
                w = torch.exp(s - m)
                out[bi, i, hi] = (w @ v[bi, :n, hi]) / w.sum()
                lse[bi, hi, i] = (m + torch.log(w.sum())) / (math.log(2) if lse_base2 else 1)
    return out, lse


def _inputs(b, sq, sk, h, d, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(b, s, h, d, dtype=dtype) for s in (sq, sk, sk))


def _max_err(a, b):
    """Max |a - b| over finite entries; -inf must match -inf exactly."""
    a, b = a.double(), b.double()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    assert not a.isnan().any() and not b.isnan().any()
    fin = torch.isfinite(b)
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


def _max_err_any(a, b):
    """Like _max_err but a -inf pattern mismatch counts as an infinite error."""
    if not torch.equal(torch.isneginf(a), torch.isneginf(b.to(a.dtype))):
        return math.inf
    return _max_err(a, b)


SHAPES = [  # (b, sq, sk, h, d)
    (1, 1, 1, 1, 16),
    (2, 5, 5, 3, 16),
    (1, 3, 5, 2, 32),
    (2, 9, 4, 1, 8),
    (1, 17, 33, 2, 24),
    (2, 33, 17, 2, 64),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3, -0.7])
def test_matches_float64(shape, causal, scale):
    q, k, v = _inputs(*shape)
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale)
    out64, lse64 = _naive(q, k, v, causal=causal, scale=scale)
    assert _max_err(out, out64) < TOL
    assert _max_err(lse, lse64) < TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_upcast_is_exact_on_low_precision_inputs(dtype):
    # fp16/bf16 values are exact in fp32, so upcast=True loses nothing before the math.
    q, k, v = _inputs(2, 17, 33, 2, 64, dtype=dtype)
    out, lse = attention_ref(q, k, v, causal=True)
    out64, lse64 = _naive(q, k, v, causal=True)
    assert out.dtype == torch.float32 and _max_err(out, out64) < TOL
    assert _max_err(lse, lse64) < TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_path(dtype):
    b, sq, sk, h, d = 2, 33, 65, 3, 64
    q, k, v = _inputs(b, sq, sk, h, d, dtype=dtype)
    out_lp, lse_lp = attention_ref(q, k, v, upcast=False)
    out32, lse32 = attention_ref(q, k, v, upcast=True)
    assert out_lp.dtype == dtype and out32.dtype == torch.float32
    assert lse_lp.dtype == lse32.dtype == torch.float32
    assert out_lp.shape == q.shape and lse_lp.shape == (b, h, sq)
    # Rounding S, P and O to the input dtype costs a few ulps of that dtype: nonzero
    # (it is a different computation) but small.
    err = _max_err(out_lp, out32)
    assert 0 < err < 8 * torch.finfo(dtype).eps


def test_bottom_right_causal_pattern():
    # v[j] = e_j turns out[i] into row i of the attention matrix.
    sq, sk = 3, 5
    q, k, _ = _inputs(1, sq, sk, 1, 8)
    v = torch.eye(8)[:sk].reshape(1, sk, 1, 8)
    out, _ = attention_ref(q, k, v, causal=True)
    p = out[0, :, 0, :sk]
    seen = torch.tensor([[1, 1, 1, 0, 0],   # query 0 sees keys 0..2
                         [1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(p > 0, seen)
    assert torch.equal(p[~seen], torch.zeros(int((~seen).sum())))
    torch.testing.assert_close(p.sum(-1), torch.ones(sq))


@pytest.mark.parametrize("upcast", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows(upcast, dtype):
    b, sq, sk, h, d = 2, 7, 3, 2, 16
    q, k, v = _inputs(b, sq, sk, h, d, dtype=dtype)
    out, lse = attention_ref(q, k, v, causal=True, upcast=upcast)
    empty = sq - sk  # queries 0..3 see no key
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[..., :empty]).all()
    assert torch.isfinite(lse[..., empty:]).all()
    # The first visible query sees only key 0: out = v[0], lse = its score.
    torch.testing.assert_close(out[:, empty].float(), v[:, 0].float())
    score0 = (q[:, empty].float() * k[:, 0].float()).sum(-1) / math.sqrt(d)
    torch.testing.assert_close(lse[..., empty], score0, atol=0.05 if dtype != torch.float32 else 1e-5, rtol=0)


@pytest.mark.parametrize("wrong", ["top_left_causal", "missing_scale", "lse_base2"])
def test_checks_bite(wrong):
    """A plausible bug in the reference is caught by far more than the tolerance."""
    shape = (2, 9, 17, 2, 64)  # sq != sk so top-left and bottom-right causal differ
    q, k, v = _inputs(*shape)
    out, lse = attention_ref(q, k, v, causal=True)
    kwargs = {"top_left_causal": {"top_left": True},
              "missing_scale": {"scale": 1.0},
              "lse_base2": {"lse_base2": True}}[wrong]
    out_bad, lse_bad = _naive(q, k, v, causal=True, **kwargs)
    err = max(_max_err_any(out, out_bad), _max_err_any(lse, lse_bad))
    assert err > 1000 * TOL
    out_ok, lse_ok = _naive(q, k, v, causal=True)  # and the right variant still agrees
    assert max(_max_err(out, out_ok), _max_err(lse, lse_ok)) < TOL
