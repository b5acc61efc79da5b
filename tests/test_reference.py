"""cute_attn.reference against a float64 row-by-row computation (CPU): the dense forward,
sliding windows, softcap, GQA/MQA, the packed varlen form, and gradients (fully masked
rows included)."""

import math

import pytest
import torch

from cute_attn.reference import attention_ref, attention_ref_varlen, visible_keys

# The fp32 reference vs float64 on these small shapes: a few fp32 ulps of O(1) values.
TOL = 1e-5


def _naive(q, k, v, *, causal, scale=None, top_left=False, lse_base2=False,
           window_size=(-1, -1), softcap=0.0, softcap_before_scale=False, gqa_modulo=False):
    """Attention one query row at a time in float64, over the range of keys the row sees;
    the flags after lse_base2 select features, the others build wrong variants.

    Differentiable (the float64 gradients are the backward's ground truth).
    """
    q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    group = h // h_kv
    scale = 1 / math.sqrt(d) if scale is None else scale
    left, right = window_size
    if causal:
        right = 0
    shift = 0 if top_left else sk - sq  # query i is aligned with key i + shift
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv_head = hi % h_kv if gqa_modulo else hi // group
            for i in range(sq):
                first = 0 if left < 0 else max(0, i + shift - left)
                last = sk - 1 if right < 0 else min(sk - 1, i + shift + right)
                if last < first:
                    continue  # sees no key: out 0, lse -inf
                dots = k[bi, first:last + 1, kv_head] @ q[bi, i, hi]
                if softcap > 0 and softcap_before_scale:
                    s = scale * softcap * torch.tanh(dots / softcap)
                elif softcap > 0:
                    s = softcap * torch.tanh(scale * dots / softcap)
                else:
                    s = scale * dots
                m = s.max().detach()
                w = torch.exp(s - m)
                out[bi, i, hi] = (w @ v[bi, first:last + 1, kv_head]) / w.sum()
                lse[bi, hi, i] = (m + torch.log(w.sum())) / (math.log(2) if lse_base2 else 1)
    return out, lse


def _inputs(b, sq, sk, h, d, dtype=torch.float32, seed=0, h_kv=None):
    torch.manual_seed(seed)
    h_kv = h if h_kv is None else h_kv
    return (torch.randn(b, s, heads, d, dtype=dtype)
            for s, heads in ((sq, h), (sk, h_kv), (sk, h_kv)))


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


# --- sliding window --------------------------------------------------------------------

WINDOWS = [(0, 0), (2, 1), (3, -1), (-1, 2), (0, -1), (1, 0), (-1, -1), (40, 40)]
WINDOW_SHAPES = [  # (b, sq, sk, h, d): equal, more keys, more queries, a single query
    (1, 6, 6, 2, 16),
    (2, 5, 11, 1, 8),
    (1, 11, 4, 2, 16),
    (1, 1, 9, 1, 8),
]


@pytest.mark.parametrize("shape", WINDOW_SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_window_matches_float64(shape, window, causal):
    q, k, v = _inputs(*shape)
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window)
    out64, lse64 = _naive(q, k, v, causal=causal, window_size=window)
    assert _max_err(out, out64) < TOL
    assert _max_err(lse, lse64) < TOL


def test_visible_keys_pattern():
    # seqlen_q 3, seqlen_k 6: query i is aligned with key i + 3; window (1, 1) keeps
    # keys i + 2 .. i + 4 that exist.
    expected = torch.tensor([[0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 1, 1, 1],
                             [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(visible_keys(3, 6, window_size=(1, 1)), expected)
    # seqlen_q 5, seqlen_k 3, window (0, 0): query i sees only key i - 2; 0 and 1 see none.
    expected = torch.zeros(5, 3, dtype=torch.bool)
    expected[2, 0] = expected[3, 1] = expected[4, 2] = True
    assert torch.equal(visible_keys(5, 3, window_size=(0, 0)), expected)
    assert visible_keys(4, 7) is None
    assert visible_keys(4, 7, window_size=(-1, -1)) is None


@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 8), (8, 3), (1, 1), (0, 4), (4, 0)])
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_keys_is_flash_attention_rule(sq, sk, window):
    left, right = window
    got = visible_keys(sq, sk, window_size=window)
    got = torch.ones(sq, sk, dtype=torch.bool) if got is None else got
    for i in range(sq):
        for j in range(sk):
            lo_ok = left < 0 or i + sk - sq - left <= j
            hi_ok = right < 0 or j <= i + sk - sq + right
            assert bool(got[i, j]) == (lo_ok and hi_ok), (i, j)


@pytest.mark.parametrize("left", [-1, 0, 3])
def test_causal_is_window_left_0(left):
    q, k, v = _inputs(2, 7, 12, 2, 16)
    out_c, lse_c = attention_ref(q, k, v, causal=True, window_size=(left, -1))
    out_w, lse_w = attention_ref(q, k, v, window_size=(left, 0))
    assert torch.equal(out_c, out_w) and torch.equal(lse_c, lse_w)
    # causal overrides a given right edge, as FlashAttention does
    out_r, _ = attention_ref(q, k, v, causal=True, window_size=(left, 5))
    assert torch.equal(out_c, out_r)
    if left == -1:
        out_old, _ = attention_ref(q, k, v, causal=True)
        assert torch.equal(out_c, out_old)


def test_window_rows_with_no_key():
    q, k, v = _inputs(1, 9, 4, 2, 16)
    out, lse = attention_ref(q, k, v, window_size=(0, 0))  # query i sees key i - 5 only
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    assert torch.isneginf(lse[..., :5]).all() and torch.isfinite(lse[..., 5:]).all()
    torch.testing.assert_close(out[:, 5:], v)  # one key each: out is its value row


# --- softcap ---------------------------------------------------------------------------

@pytest.mark.parametrize("softcap", [0.5, 2.0, 30.0])
@pytest.mark.parametrize("scale", [None, 1.7])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_matches_float64(softcap, scale, causal):
    q, k, v = _inputs(2, 9, 13, 2, 32)
    q = q * 3  # scores of a few units, so the cap bends them
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale, softcap=softcap)
    out64, lse64 = _naive(q, k, v, causal=causal, scale=scale, softcap=softcap)
    assert _max_err(out, out64) < TOL
    assert _max_err(lse, lse64) < TOL


def test_softcap_zero_is_off_and_large_is_identity():
    q, k, v = _inputs(1, 7, 7, 2, 16)
    out, lse = attention_ref(q, k, v)
    out0, lse0 = attention_ref(q, k, v, softcap=0.0)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    out_big, _ = attention_ref(q, k, v, softcap=1e6)
    assert _max_err(out_big, out) < TOL
    # a cap bounds every score, so lse <= log(seqlen_k) + cap
    _, lse_capped = attention_ref(q * 10, k, v, softcap=1.0)
    assert (lse_capped <= math.log(7) + 1.0 + 1e-6).all()


# --- GQA / MQA -------------------------------------------------------------------------

@pytest.mark.parametrize("h,h_kv", [(8, 8), (8, 4), (8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_matches_float64(h, h_kv, causal):
    q, k, v = _inputs(2, 5, 9, h, 16, h_kv=h_kv)
    out, lse = attention_ref(q, k, v, causal=causal)
    out64, lse64 = _naive(q, k, v, causal=causal)
    assert out.shape == q.shape and lse.shape == (2, h, 5)
    assert _max_err(out, out64) < TOL
    assert _max_err(lse, lse64) < TOL
    # the same as repeating each kv head for its group of query heads
    group = h // h_kv
    out_rep, _ = attention_ref(q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2),
                               causal=causal)
    assert torch.equal(out, out_rep)


@pytest.mark.parametrize("upcast", [True, False])
def test_gqa_low_precision(upcast):
    q, k, v = _inputs(1, 17, 33, 4, 64, dtype=torch.bfloat16, h_kv=2)
    out, _ = attention_ref(q, k, v, causal=True, upcast=upcast)
    out64, _ = _naive(q, k, v, causal=True)
    assert out.dtype == (torch.float32 if upcast else torch.bfloat16)
    assert _max_err(out, out64) < (TOL if upcast else 8 * torch.finfo(torch.bfloat16).eps)


@pytest.mark.parametrize("kwargs, exc, msg", [
    ({"window_size": (-2, 0)}, ValueError, r"window_size left must be >= -1 .*, got -2"),
    ({"window_size": (0, 1.5)}, TypeError, r"window_size right must be an int"),
    ({"window_size": 3}, TypeError, r"window_size must be a \(left, right\) tuple"),
    ({"softcap": -1.0}, ValueError, r"softcap must be 0 \(off\) or a finite positive"),
])
def test_bad_feature_args(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        attention_ref(*_inputs(1, 4, 4, 2, 8), **kwargs)


def test_bad_gqa_heads():
    q, k, v = _inputs(1, 4, 4, 6, 8, h_kv=4)
    with pytest.raises(ValueError, match=r"k nheads must divide q nheads \(6\)"):
        attention_ref(q, k, v)
    q, k, _ = _inputs(1, 4, 4, 4, 8, h_kv=2)
    with pytest.raises(ValueError, match=r"v nheads must equal k nheads \(2\), got 4"):
        attention_ref(q, k, torch.zeros(1, 4, 4, 8))


# --- the checks bite -------------------------------------------------------------------

@pytest.mark.parametrize("wrong", ["top_left_window", "softcap_before_scale", "gqa_modulo"])
def test_feature_checks_bite(wrong):
    """A plausible bug in a feature is caught by far more than the tolerance."""
    q, k, v = _inputs(2, 9, 17, 4, 32, h_kv=2)  # sq != sk: top-left and bottom-right differ
    q = q * 3
    kwargs = {"window_size": (3, 2), "softcap": 2.0, "scale": 0.5}
    out, lse = attention_ref(q, k, v, window_size=(3, 2), softcap=2.0, softmax_scale=0.5)
    bad = {"top_left_window": {"top_left": True},
           "softcap_before_scale": {"softcap_before_scale": True},
           "gqa_modulo": {"gqa_modulo": True}}[wrong]
    out_bad, lse_bad = _naive(q, k, v, causal=False, **kwargs, **bad)
    err = max(_max_err_any(out, out_bad), _max_err_any(lse, lse_bad))
    assert err > 1000 * TOL
    out_ok, lse_ok = _naive(q, k, v, causal=False, **kwargs)
    assert max(_max_err(out, out_ok), _max_err(lse, lse_ok)) < TOL


# --- gradients -------------------------------------------------------------------------

GRAD_TOL = 1e-5  # fp32 gradients vs float64: measured <= 1e-6 on these O(1)-sized cases


def _grads_of(fn, q, k, v, dout, dlse=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        # lse's gradient, with the -inf rows weighted 0: they must give 0, not NaN
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0).double() * dlse).sum()
    return torch.autograd.grad(loss, leaves)


GRAD_CASES = [  # (b, sq, sk, h, h_kv, causal, window, softcap)
    (2, 5, 5, 2, 2, False, (-1, -1), 0.0),
    (1, 7, 11, 4, 2, True, (-1, -1), 0.0),
    (1, 11, 4, 2, 1, True, (-1, -1), 0.0),  # queries 0..6 see no key
    (2, 9, 6, 2, 2, False, (1, 1), 0.0),  # query i sees keys i-4..i-2: 0, 1 see none
    (1, 8, 8, 3, 3, False, (2, 0), 5.0),
    (1, 6, 10, 4, 1, True, (3, -1), 1.5),
]


@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("with_lse", [False, True])
def test_grads_match_float64(case, with_lse):
    b, sq, sk, h, h_kv, causal, window, softcap = case
    q, k, v = _inputs(b, sq, sk, h, 16, h_kv=h_kv)
    torch.manual_seed(1)
    dout = torch.randn(b, sq, h, 16)
    dlse = torch.randn(b, h, sq, dtype=torch.float64) if with_lse else None
    kwargs = {"causal": causal, "window_size": window, "softcap": softcap}
    got = _grads_of(lambda q, k, v: attention_ref(q, k, v, **kwargs), q, k, v, dout, dlse)
    want = _grads_of(lambda q, k, v: _naive(q, k, v, **kwargs), q, k, v, dout, dlse)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert (g.double() - w).abs().max().item() < GRAD_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("upcast", [True, False])
def test_fully_masked_rows_have_zero_grads(dtype, upcast):
    b, sq, sk, h, d = 2, 9, 4, 2, 16
    q, k, v = _inputs(b, sq, sk, h, d, dtype=dtype)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, window_size=(0, 0), upcast=upcast)
    # query i sees key i - 5 only: queries 0..4 see nothing; every key is seen once
    loss = out.float().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()
    dq, dk, dv = torch.autograd.grad(loss, leaves)
    for g in (dq, dk, dv):
        assert not g.isnan().any() and torch.isfinite(g).all()
    assert torch.equal(dq[:, :5], torch.zeros_like(dq[:, :5]))
    # a query that sees one key: out = v[key], lse = its score, so dv = 1 and dq, dk carry
    # only the lse term
    assert torch.equal(dv.float(), torch.ones_like(dv.float()))
    # sq > sk with causal: the first sq - sk queries see nothing
    q2 = q.detach().requires_grad_()
    out2, _ = attention_ref(q2, k.detach(), v.detach(), causal=True, upcast=upcast)
    (dq2,) = torch.autograd.grad(out2.float().sum(), [q2])
    assert not dq2.isnan().any()
    assert torch.equal(dq2[:, :5], torch.zeros_like(dq2[:, :5]))


# --- variable length -------------------------------------------------------------------

def _varlen_inputs(lens_q, lens_k, h=4, h_kv=2, d=16, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, dtype=dtype)
    k = torch.randn(sum(lens_k), h_kv, d, dtype=dtype)
    v = torch.randn(sum(lens_k), h_kv, d, dtype=dtype)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    return q, k, v, cu(lens_q), cu(lens_k)


VARLEN = [  # (lens_q, lens_k): an empty sequence, a length-1 one, sq != sk, keys empty
    ([5, 0, 1, 7], [5, 3, 1, 12]),
    ([3, 6], [0, 6]),
    ([9], [4]),
]


@pytest.mark.parametrize("lens", VARLEN)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window, softcap", [((-1, -1), 0.0), ((2, 1), 0.0), ((1, 0), 3.0)])
def test_varlen_matches_per_sequence_float64(lens, causal, window, softcap):
    lens_q, lens_k = lens
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k)
    kwargs = {"causal": causal, "window_size": window, "softcap": softcap}
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, **kwargs)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        out64, lse64 = _naive(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwargs)
        assert _max_err(out[q0:q1], out64[0]) < TOL
        assert _max_err(lse[:, q0:q1], lse64[0]) < TOL
        if k1 == k0:  # no keys at all: every query of the sequence sees nothing
            assert torch.equal(out[q0:q1], torch.zeros_like(out[q0:q1]))
            assert torch.isneginf(lse[:, q0:q1]).all()


def test_varlen_equal_lengths_is_the_dense_batch():
    b, s, h, d = 3, 7, 4, 16
    q, k, v = _inputs(b, s, s, h, d, h_kv=2)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    out, lse = attention_ref_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                    causal=True)
    out_dense, lse_dense = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, out_dense.flatten(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, lse_dense.transpose(0, 1).flatten(1), atol=1e-6, rtol=0)


def test_varlen_low_precision_and_grads():
    q, k, v, cu_q, cu_k = _varlen_inputs([3, 6, 2], [0, 6, 5], dtype=torch.bfloat16)
    out_lp, _ = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True, upcast=False)
    assert out_lp.dtype == torch.bfloat16
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref_varlen(*leaves, cu_q, cu_k, causal=True)
    dq, dk, dv = torch.autograd.grad(out.sum(), leaves)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[:3], torch.zeros_like(dq[:3]))  # sequence 0 has no keys
    # sequence 2: 2 queries, 5 keys, causal: keys 0..2 (rows 6..8 of k) are seen by
    # query 0 and 1, key 4 only by query 1, so every key gets a gradient
    assert (dv[6:11].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("bad, exc, msg", [
    ("int64", TypeError, r"cu_seqlens_q must be torch.int32, got torch.int64"),
    ("decreasing", ValueError, r"cu_seqlens_q must be non-decreasing"),
    ("short_total", ValueError, r"cu_seqlens_k must end at k's total tokens \(9\), got 8"),
])
def test_varlen_rejects_bad_offsets(bad, exc, msg):
    q, k, v, cu_q, cu_k = _varlen_inputs([3, 4], [4, 5])
    if bad == "int64":
        cu_q = cu_q.long()
    elif bad == "decreasing":
        cu_q = torch.tensor([0, 5, 4, 7], dtype=torch.int32)
        cu_k = torch.tensor([0, 3, 6, 9], dtype=torch.int32)
    else:
        cu_k = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(exc, match=msg):
        attention_ref_varlen(q, k, v, cu_q, cu_k)
