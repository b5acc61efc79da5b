"""CPU tests from an audit of the benchmark scripts' counts and comparisons: each FLOP or
byte count against an independent count (a brute-force mask, or arithmetic written out
here), and the guards that keep an anchor from computing a different problem than
cute_attn's (SDPA's top-left causal mask; outputs compared before timing).

Imports perf/ as the scripts do; needs neither a GPU nor triton.
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from test_bench_features_cpu import _brute_pairs as brute_pairs  # bottom-right pairs, enumerated

PERF = Path(__file__).resolve().parents[1] / "perf"


@pytest.fixture(scope="module")
def perf():
    if str(PERF) not in sys.path:
        sys.path.insert(0, str(PERF))
    return {name: importlib.import_module(name)
            for name in ("harness", "bench_features", "bench_sinks", "bench_decode")}


# ---------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("sq,sk", [(1, 4096), (16, 4096), (100, 300), (300, 100), (4096, 1024)])
def test_causal_flops_follow_the_visible_pairs_when_seqlen_q_differs(perf, sq, sk):
    """Bottom-right causal with sq != sk: "half of sq * sk" is wrong (a decode query sees
    every key, twice the half; sq > sk leaves whole rows empty). attention_flops counts the
    visible region (the papers' half at sq == sk): half a pair per diagonal row from exact."""
    h = perf["harness"]
    b, nh, d = 2, 3, 64
    exact = 4 * b * nh * d * brute_pairs(sq, sk, True, (-1, -1))
    got = h.attention_flops(b, nh, sq, sk, d, True)
    assert abs(got - exact) <= 4 * b * nh * d * min(sq, sk) / 2
    assert h.attention_flops(b, nh, sq, sk, d, True, "bwd") == 2.5 * got


@pytest.mark.parametrize("s", [1, 7, 2048])
def test_square_causal_flops_keep_the_papers_half(perf, s):
    # every committed dense record is square: its numbers must not move
    h = perf["harness"]
    assert h.attention_flops(3, 5, s, s, 128, True) == 4 * 3 * 5 * s * s * 128 / 2


@pytest.mark.parametrize("sq,sk,causal,window", [
    (37, 37, True, (-1, -1)), (37, 53, True, (-1, -1)), (53, 37, True, (-1, -1)),
    (40, 40, True, (7, 0)), (40, 40, False, (5, 5)), (31, 47, False, (3, 11)),
    (47, 31, False, (0, 2)), (20, 20, False, (30, 30)), (9, 13, True, (2, 9)),
])
def test_feature_pairs_match_brute_force(perf, sq, sk, causal, window):
    bf = perf["bench_features"]
    assert bf.visible_pairs(sq, sk, causal, window) == brute_pairs(sq, sk, causal, window)


def test_feature_flops_gqa_varlen_bwd(perf):
    bf = perf["bench_features"]
    # GQA: query heads count (32), not KV heads (8); varlen: a sum over the sequences
    case = bf.Case("x", "gqa", 32, 8, 128, causal=True, seqlens=(5, 9, 1))
    pairs = brute_pairs(5, 5, True, (-1, -1)) + brute_pairs(9, 9, True, (-1, -1)) + brute_pairs(1, 1, True, (-1, -1))
    assert case.flops() == 4 * 128 * 32 * pairs
    assert case.flops("bwd") == 2.5 * 4 * 128 * 32 * pairs


@pytest.mark.parametrize("s,window", [(1, (-1, 0)), (9, (-1, 0)), (9, (3, 0)), (200, (127, 0))])
def test_sinks_pairs_match_brute_force(perf, s, window):
    assert perf["bench_sinks"].visible_pairs(s, window) == brute_pairs(s, s, False, window)


# ---------------------------------------------------------------------------------------
# Decode bytes
# ---------------------------------------------------------------------------------------

def test_decode_bytes_are_kv_once_per_kv_head_plus_q_and_out(perf):
    # b2, 3 queries, 1000 keys, 8 / 2 heads, hd 64, bf16: K and V once per KV head (not per
    # query head), q read and out written once
    kv = 2 * (2 * 1000 * 2 * 64) * 2
    q_out = 2 * (2 * 3 * 8 * 64) * 2
    assert perf["bench_decode"].moved_bytes(2, 3, 1000, 8, 2, 64) == kv + q_out


# ---------------------------------------------------------------------------------------
# Same problem for every implementation
# ---------------------------------------------------------------------------------------

def test_sdpa_anchor_refuses_causal_with_unequal_lengths(perf):
    """SDPA's is_causal is top-left aligned; cute_attn and FA4 are bottom-right. With
    seqlen_q != seqlen_k the anchor would time another (cheaper) problem: it must refuse
    (a recorded "unsupported" skip), not compute it."""
    h = perf["harness"]
    impl = h.load_sdpa("sdpa_math", "MATH")
    q = torch.randn(1, 3, 2, 8)
    k = v = torch.randn(1, 7, 2, 8)
    with pytest.raises(NotImplementedError, match="top-left"):
        impl.fn(q, k, v, True)
    assert impl.fn(q, k, v, False).shape == q.shape  # not causal: no alignment to disagree on
    kq = torch.randn(1, 3, 2, 8)
    assert impl.fn(q, kq, kq, True).shape == q.shape  # square: top-left == bottom-right


def test_check_agreement_drops_what_computes_another_problem(perf):
    h = perf["harness"]
    x = torch.randn(2, 5, 3, 4)
    forwards = {
        "mine": lambda t: t.clone(),
        "same": lambda t: (t + 1e-3).to(torch.bfloat16),  # rounding-level difference
        "other": lambda t: t * 2,  # a different problem
        "broken": lambda t: 1 / 0,
        "no_ref": lambda t: t,
    }
    bad, diffs = h.check_agreement(forwards, (x,), {"same": "mine", "other": "mine",
                                                    "broken": "mine", "absent": "mine",
                                                    "no_ref": "missing"})
    assert set(bad) == {"other", "broken"}
    assert "differs from mine" in bad["other"] and "ZeroDivisionError" in bad["broken"]
    assert diffs["same"] < 0.01 and diffs["other"] > 0.5


def test_sinks_record_drops_an_anchor_that_disagrees(perf, monkeypatch):
    """measure_case (bench_sinks, bench_dropout) compares the anchor's forward with the
    feature's before timing; one that computes something else is recorded, not timed."""
    bs, h = perf["bench_sinks"], perf["harness"]
    timed = []

    def fake_time_passes(makers, rounds, rec, prefix):
        timed.append(sorted(makers))
        return {name: 1.0 for name in makers}

    monkeypatch.setattr(h, "time_passes", fake_time_passes)
    q = torch.randn(1, 4, 2, 8)
    forwards = {"mine": lambda q, k, v: q * 1.0, "base": lambda q, k, v: q * 1.0,
                "anchor": lambda q, k, v: q * 3.0}
    c = {"case": "t", "batch": 1, "seqlen": 4, "nheads": 2, "nheads_kv": 2, "headdim": 8,
         "window": (-1, 0)}
    rec = bs.measure_case(c, forwards, (q, q, q), ("mine", "base", "anchor"), 1, ("fwd",),
                          "cost", agree={"anchor": "mine"})
    assert timed == [["base", "mine"]] and "anchor" in rec["errors"]
    assert "speedup_vs_anchor" not in rec
    # without the agreement pairs (dropout: random outputs) nothing is compared
    rec = bs.measure_case(c, forwards, (q, q, q), ("mine", "base", "anchor"), 1, ("fwd",),
                          "cost")
    assert rec["speedup_vs_anchor"] == 1.0


def test_cudnn_fp8_anchor_refuses_causal_with_unequal_lengths():
    """perf/cudnn_fp8.py's use_causal_mask is top-left aligned as SDPA's: refused where it
    would differ from cute_attn's bottom-right mask (checked before any cuDNN call)."""
    import cudnn_fp8

    anchor = object.__new__(cudnn_fp8.CudnnFp8Attention)  # no handle: the check comes first
    anchor.graphs = {}
    q8 = torch.zeros(1, 3, 2, 16).to(torch.float8_e4m3fn)
    k8 = torch.zeros(1, 7, 2, 16).to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="top-left"):
        anchor(q8, k8, k8, {}, True)
