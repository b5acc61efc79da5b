"""GQA/MQA, sliding windows, softcap and variable-length batches (issue 4) on an sm_90 GPU,
forward and backward, against the fp32 reference (skipped without one).

Accuracy rule: the one of tests/test_mha_gpu.py and tests/test_mha_bwd_gpu.py, stated and
checked in tests/gpu_checks.py (shared with the fuzz test): out within 2x the error of torch
in the input dtype + 1e-5; lse -inf exactly on rows that see no key, elsewhere within 1e-3
(+ softcap * 2^-10); dq, dk, dv within 2x the error of autograd in the input dtype + 2x the
rounding + 1e-3; no NaN or inf; out == 0 and dq == 0 on rows that see no key, dk == dv == 0
on keys that no row sees; outputs and gradients allocated on NaN-poisoned memory. Inputs
are random normal with fixed seeds; with a softcap, q and k are scaled so that about 5% of
the scaled scores lie beyond the cap (asserted by assert_cap_bites).

Compiles (the device budget is tight): each (dtype, head dim, mask kind none / causal /
local, softcap on/off, varlen on/off) is one forward and one backward specialisation;
GQA and the values of the window, the cap and the lengths are run-time arguments, and
deterministic=True is one more backward per mask kind. This file needs 15 forward and 17
backward ones:

  bf16 d128: none, causal, local, none+cap, causal+cap, local+cap           (dense)
             varlen none, varlen causal, varlen local, varlen local+cap
             local and varlen causal deterministic (backward only)
  bf16 d64 local; fp16 d64 varlen causal; fp16 d128 none+cap; bf16 d96 local;
  bf16 d256 varlen causal

The full matrix runs at bf16 / head dim 128; the other dtype and head dims get a subset.
A window shaped like causal, (-1, 0) or (-1, r) with causal=True, takes the causal kernel.
"""

import pytest
import torch
from gpu_checks import (
    FP16,
    Case,
    assert_cap_bites,
    call_mha,
    check_case,
    check_forward,
    check_grads,
    kernel_grads,
    make_inputs,
    run_forward,
)
from gpu_helpers import exact_fp32_matmul  # noqa: F401 (fixture)

import cute_attn

pytestmark = pytest.mark.gpu


# ---------------------------------------------------------------------------- the matrix

# bf16 / d128, no window: group sizes 1, 4, 8 and MQA, causal or not, single tokens,
# odd lengths, sq < sk and sq > sk (causal rows with no key).
GQA_HEADS = [(4, 4), (8, 2), (16, 2), (4, 1)]
GQA_PAIRS = [(1, 1), (17, 1000), (129, 17), (1000, 1000)]
GQA = [Case(h=h, h_kv=h_kv, causal=causal, sq=sq, sk=sk)
       for h, h_kv in GQA_HEADS for causal in (False, True) for sq, sk in GQA_PAIRS]

# bf16 / d128, GQA 2: windows narrower than a tile, one tile wide, one-sided, wider than
# the sequences; causal forces right = 0. (1000, 129) leaves rows with no key, (129, 1000)
# keys that no row sees.
WINDOWS = [(3, 0), (5, 7), (0, 0), (64, 64), (256, -1), (-1, 33), (1000, 0)]
WINDOW_PAIRS = [(1, 300), (129, 1000), (1000, 129), (300, 300)]
WINDOW = [Case(h=4, h_kv=2, causal=causal, window=w, sq=sq, sk=sk)
          for w in WINDOWS for causal in (False, True) for sq, sk in WINDOW_PAIRS]

# bf16 / d128: softcap alone, with causal, with windows; GQA 4 for cap 5, MQA for cap 30.
SOFTCAP_MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 64)), (True, (256, -1))]
SOFTCAP = [Case(h=8, h_kv=2 if cap == 5.0 else 1, causal=causal, window=w, softcap=cap,
                sq=sq, sk=sk)
           for cap in (5.0, 30.0) for causal, w in SOFTCAP_MASKS
           for sq, sk in [(129, 1000), (1000, 129)]]

# Packed batches: (lens_q, lens_k) per sequence.
LENS = [
    ((1, 17, 0, 300, 129), (1, 200, 0, 129, 1000)),  # a single token, an empty sequence, sq < sk, sq > sk
    ((100, 5, 257), (64, 0, 300)),                    # the middle sequence's queries see no key
    ((0, 128, 1), (0, 128, 1)),                       # leading empty sequence, a whole tile, one token
    ((33, 0), (33, 40)),                              # last sequence: keys but no queries (dk = dv = 0)
]
VARLEN_SETTINGS = [
    dict(h=8, h_kv=2),                                  # GQA, no mask
    dict(h=4, h_kv=1, causal=True),                     # MQA, causal
    dict(h=4, h_kv=2, window=(64, 7)),                  # window
    dict(h=4, h_kv=2, causal=True, window=(3, -1)),     # narrow causal window
    dict(h=4, h_kv=4, window=(100, 100), softcap=5.0),  # window and softcap
]
VARLEN = [Case(lens_q=lq, lens_k=lk, **s) for s in VARLEN_SETTINGS for lq, lk in LENS]

# Other dtypes and head dims: a few cases each, one specialisation per line.
SUBSET = (
    [Case(d=64, h=8, h_kv=2, window=w, sq=sq, sk=sk)
     for w in [(3, 0), (64, 64), (256, -1), (-1, 33)] for sq, sk in [(1000, 129), (129, 1000)]]
    + [Case(FP16, 64, h=4, h_kv=1, causal=True, lens_q=lq, lens_k=lk) for lq, lk in LENS[:2]]
    + [Case(FP16, 128, h=8, h_kv=2, softcap=cap, sq=sq, sk=sk)
       for cap in (5.0, 30.0) for sq, sk in [(129, 1000), (1000, 129)]]
    + [Case(d=96, h=4, h_kv=2, causal=causal, window=w, sq=sq, sk=sk)
       for causal, w in [(False, (5, 7)), (True, (256, -1))] for sq, sk in [(1000, 129), (129, 1000)]]
    + [Case(d=256, h=4, h_kv=2, causal=True, lens_q=lq, lens_k=lk) for lq, lk in LENS[:2]]
)

GROUPS = {"gqa": GQA, "window": WINDOW, "softcap": SOFTCAP, "varlen": VARLEN, "subset": SUBSET}
ALL = [pytest.param(case, id=f"{group}-{case}") for group, cases in GROUPS.items() for case in cases]


# -------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("case", ALL)
def test_forward(case):
    q, k, v, _, cu = make_inputs(case)
    if case.softcap:
        assert_cap_bites(case, q, k)
    out, lse = run_forward(case, q, k, v, cu)
    check_forward(case, q, k, v, cu, out, lse)


@pytest.mark.parametrize("case", ALL)
def test_backward(case):
    q, k, v, dout, cu = make_inputs(case)
    grads = kernel_grads(case, q, k, v, cu, dout)
    check_grads(case, q, k, v, cu, dout, grads)


@pytest.mark.parametrize("case", [
    Case(h=8, h_kv=2, causal=True, window=(300, -1), sq=900, sk=1000),
    # packed: the turn counters index the per-sequence padded query blocks
    Case(h=8, h_kv=2, causal=True, lens_q=(300, 0, 1000, 17), lens_k=(129, 5, 1000, 17)),
], ids=["gqa-window", "varlen-gqa"])
def test_deterministic_backward_is_bit_identical(case):
    q, k, v, dout, cu = make_inputs(case, seed=1)
    g1 = kernel_grads(case, q, k, v, cu, dout, deterministic=True)
    g2 = kernel_grads(case, q, k, v, cu, dout, deterministic=True)
    for name, a, b in zip("qkv", g1, g2):
        assert torch.equal(a, b), f"d{name} differs between two deterministic runs"
    check_grads(case, q, k, v, cu, dout, g1)


def _compiled_keys():
    from cute_attn import launcher

    return set(launcher._cache)


def _run_and_check(case):
    q, k, v, dout, cu = make_inputs(case)
    out = check_case(case, q, k, v, dout, cu)
    return q, k, v, cu, out


def test_new_varlen_lengths_do_not_recompile():
    """cu_seqlens and max_seqlen are run-time arguments: a batch with other lengths (and
    batch size, maxima and head counts) reuses the compiled forward and backward."""
    first = Case(h=8, h_kv=2, causal=True, lens_q=(5, 300, 0), lens_k=(7, 200, 0))
    second = Case(h=4, h_kv=1, causal=True, lens_q=(1000, 1, 64, 17), lens_k=(129, 1000, 0, 17))
    _run_and_check(first)
    keys = _compiled_keys()
    q, k, v, cu, out = _run_and_check(second)
    # return_lse=False gives out alone, bit-identical to the call above
    out_only = call_mha(second, q, k, v, cu)
    assert isinstance(out_only, torch.Tensor) and torch.equal(out_only, out)
    new = _compiled_keys() - keys
    assert not new, f"new lengths compiled again: {new}"
    assert len(_compiled_keys()) == len(keys)


def test_cu_seqlens_values_are_checked_on_the_gpu():
    """By default mha_varlen reads the GPU offsets before the launch: a decreasing offset
    and a max_seqlen below the longest sequence raise; check_cu_seqlens=False skips the
    read and, on right offsets, gives the same output bit for bit."""
    case = Case(h=4, h_kv=2, causal=True, lens_q=(5, 300, 0), lens_k=(7, 200, 0))
    q, k, v, _, cu = make_inputs(case)
    decreasing = cu[0].clone()
    decreasing[1] = 306
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing, got 306 then 305"):
        cute_attn.mha_varlen(q, k, v, decreasing, cu[1], 300, 200)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be >= the longest sequence .*\(300\), got 299"):
        cute_attn.mha_varlen(q, k, v, *cu, 299, 200)
    out = call_mha(case, q, k, v, cu)
    unchecked = cute_attn.mha_varlen(q, k, v, *cu, 300, 200, causal=True, check_cu_seqlens=False)
    assert torch.equal(out, unchecked)


def test_new_window_and_softcap_values_do_not_recompile():
    """The window's sides and the cap are run-time arguments of the local+softcap kernel.
    Two shapes whose plans differ (a small grid takes the split-KV kernel, a larger one
    the unsplit one), each seen with one window and cap first, then with others: no new
    kernel for the new values."""
    shapes = (dict(h=8, h_kv=2, sq=129, sk=1000), dict(h=4, h_kv=4, b=1, sq=1000, sk=17))
    for shape in shapes:
        _run_and_check(Case(**shape, window=(64, 64), softcap=30.0))
    keys = _compiled_keys()
    for shape in shapes:
        _run_and_check(Case(**shape, window=(3, 200), softcap=5.0))
    new = _compiled_keys() - keys
    assert not new, f"new window / softcap values compiled again: {new}"


TEETH = [
    pytest.param(Case(h=4, h_kv=2, window=(5, 7), sq=300, sk=300), dict(window_size=(5, 8)),
                 id="window-right-off-by-one"),
    pytest.param(Case(h=4, h_kv=2, window=(5, 7), sq=300, sk=300), dict(window_size=(4, 7)),
                 id="window-left-off-by-one"),
    pytest.param(Case(h=8, h_kv=2, softcap=5.0, sq=129, sk=1000), dict(softcap=0.0),
                 id="softcap-omitted"),
    pytest.param(Case(h=4, h_kv=1, causal=True, lens_q=LENS[0][0], lens_k=LENS[0][1]),
                 dict(causal=False), id="varlen-causal-omitted"),
]


@pytest.mark.parametrize("case, wrong", TEETH)
def test_accuracy_checks_have_teeth(case, wrong):
    """The checks pass the kernel against the right reference and fail it against a
    slightly wrong one, forward and backward."""
    q, k, v, dout, cu = make_inputs(case)
    out, lse = run_forward(case, q, k, v, cu)
    check_forward(case, q, k, v, cu, out, lse)
    with pytest.raises(AssertionError, match=r"out: kernel error"):
        check_forward(case, q, k, v, cu, out, lse, **wrong)
    grads = kernel_grads(case, q, k, v, cu, dout)
    check_grads(case, q, k, v, cu, dout, grads)
    with pytest.raises(AssertionError, match=r"d[qkv]: kernel error"):
        check_grads(case, q, k, v, cu, dout, grads, **wrong)


# ------------------------------------------- BwdConfig.split_d (bwd_config_for's at 192/256)

SPLIT_D_CASES = [
    Case(d=256, h=4, h_kv=4, sq=1000, sk=1000),
    Case(d=256, h=8, h_kv=2, causal=True, sq=129, sk=1000),
    Case(d=192, h=4, h_kv=1, causal=True, sq=1000, sk=129),  # rows with no key
    Case(d=256, h=4, h_kv=2, softcap=20.0, window=(64, 64), sq=333, sk=333),
    Case(d=192, h=4, h_kv=2, causal=True, lens_q=(300, 0, 1000, 17), lens_k=(129, 5, 1000, 17)),
]


@pytest.mark.parametrize("dq_path", ["atomic", "sdq", "atomic-do1"])
@pytest.mark.parametrize("case", SPLIT_D_CASES, ids=str)
def test_split_d_backward(case, dq_path, monkeypatch):
    """The head-dim-split backward for 192/256 (config.split_d_bwd_config) with either dQ
    path forced: atomics from registers (bwd_config_for's at 256) and the sdQ tile with
    the dQ writer (its choice at 192, and the deterministic backward's); atomic-do1 is
    the first with a one-stage dO ring (BwdConfig.do_stages: its own pipeline state, the
    stage freed once dV's WGMMA retired). The accuracy rule of every backward test, and
    bit-identical deterministic gradients on the GQA cases."""
    import dataclasses

    from cute_attn import config, launcher

    forced = config.split_d_bwd_config(case.d, dq_atomic=dq_path.startswith("atomic"))
    if dq_path == "atomic-do1":
        forced = dataclasses.replace(forced, do_stages=1)
    default = config.bwd_config_for(case.d, config.AttnFeatures())
    assert default.split_d and default.dq_atomic == (case.d == 256)
    monkeypatch.setattr(launcher, "bwd_config_for",
                        lambda head_dim, features, deterministic=False, max_seqlen_q=0:
                        config.bwd_config_for(head_dim, features, True) if deterministic else forced)
    q, k, v, dout, cu = make_inputs(case, seed=3)
    if case.softcap:
        assert_cap_bites(case, q, k)
    check_grads(case, q, k, v, cu, dout, kernel_grads(case, q, k, v, cu, dout))
    if case.h != case.h_kv and dq_path == "atomic":
        g1 = kernel_grads(case, q, k, v, cu, dout, deterministic=True)
        g2 = kernel_grads(case, q, k, v, cu, dout, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2)), "deterministic split_d gradients differ"
        check_grads(case, q, k, v, cu, dout, g1)


# BwdConfig.dq_handoff_per_wg: each warpgroup hands its half of sdQ to the dQ writer on a
# barrier pair of its own; head dims 64 (warpgroups split the queries) and 128 (the head
# dim), causal or not, GQA (a KV tile walks the group's heads), varlen, lengths off the tile
DQ_PER_WG_CASES = [
    Case(d=128, h=4, h_kv=4, sq=1000, sk=1000),
    Case(d=128, h=8, h_kv=2, causal=True, sq=777, sk=1000),
    Case(d=64, h=4, h_kv=4, sq=1000, sk=555),
    Case(d=64, h=8, h_kv=2, causal=True, sq=1000, sk=1000),
    Case(d=128, h=4, h_kv=2, causal=True, lens_q=(40, 300, 129), lens_k=(40, 300, 129)),
]


@pytest.mark.parametrize("case", DQ_PER_WG_CASES, ids=str)
def test_dq_handoff_per_warpgroup_backward(case, monkeypatch):
    """The 64-row backward with BwdConfig.dq_handoff_per_wg forced (with its two sdS
    buffers): the accuracy rule of every backward test. The deterministic backward keeps
    the joint hand-off (it orders whole chunks), so it is not forced there. (Head dim 128
    without a mask defaults to the 80-row swapped_dq_bwd_config, tested below; here it
    takes the 64-row tiles.)"""
    import dataclasses

    from cute_attn import config, launcher

    real = config.bwd_config_for

    def per_wg(head_dim, features, deterministic=False, max_seqlen_q=0):
        base = real(head_dim, features, deterministic)
        if base.dq_swapped:
            base = config.BwdConfig(tile_m=64, tile_n=128, num_stages=2)
        return base if deterministic else dataclasses.replace(base, ds_stages=2, dq_handoff_per_wg=True)

    monkeypatch.setattr(launcher, "bwd_config_for", per_wg)
    q, k, v, dout, cu = make_inputs(case, seed=5)
    check_grads(case, q, k, v, cu, dout, kernel_grads(case, q, k, v, cu, dout))


@pytest.mark.parametrize("case", [Case(d=128, h=2, h_kv=1, causal=True, sq=4096 + 77, sk=4096 + 77),
                                  Case(d=64, h=2, h_kv=2, sq=4096 + 77, sk=1000),
                                  Case(FP16, 128, h=2, h_kv=1, sq=4096 + 77, sk=2000),
                                  Case(d=128, h=4, h_kv=2, lens_q=(300, 4096 + 77), lens_k=(900, 4096 + 77))],
                         ids=str)
def test_long_queries_take_the_per_warpgroup_dq_handoff(case, monkeypatch):
    """From config.DQ_HANDOFF_PER_WG_FROM_QUERIES query rows the default backward hands dQ
    over per warpgroup (the launcher passes the query length): the config it chose, and
    the accuracy rule of every backward test."""
    from cute_attn import config, launcher

    chosen = []

    def recording(*a, **kw):
        chosen.append(config.bwd_config_for(*a, **kw))
        return chosen[-1]

    monkeypatch.setattr(launcher, "bwd_config_for", recording)
    q, k, v, dout, cu = make_inputs(case, seed=11)
    check_grads(case, q, k, v, cu, dout, kernel_grads(case, q, k, v, cu, dout))
    assert chosen and all(c.dq_handoff_per_wg for c in chosen), chosen
    # head dim 128 (no mask; causal from SWAPPED_DQ_CAUSAL_FROM_QUERIES rows) takes the
    # 80-row config, whose hand-off is per warpgroup at every length
    assert all(c.dq_swapped == (case.d == 128) for c in chosen), chosen


# --------------------------- BwdConfig.dq_swapped: 80 query rows per step (head dim 128's default)

# Without a mask here (causal: M80_CAUSAL_CASES below). Lengths that are not multiples of 80
# leave a partial last query tile (LSE2 = +inf rows) and partial KV tiles (masked keys).
M80_CASES = [
    Case(h=4, h_kv=4, sq=1000, sk=1000),   # 1000 = 12 * 80 + 40
    Case(h=8, h_kv=2, sq=129, sk=1000),    # GQA 4
    Case(h=4, h_kv=1, sq=1000, sk=129),    # MQA, the last KV tile cut at 129 keys
    Case(h=2, h_kv=2, sq=80, sk=80),       # exactly one query tile
    Case(h=2, h_kv=1, sq=1, sk=17),
    Case(FP16, 128, h=4, h_kv=2, sq=333, sk=555),
    Case(h=8, h_kv=2, lens_q=(300, 0, 1000, 17, 81), lens_k=(129, 5, 1000, 17, 80)),
    Case(h=4, h_kv=4, lens_q=(80, 1, 161), lens_k=(80, 300, 161)),
]


@pytest.mark.parametrize("dq_order", ["after_dkv", "after_dv", "before_dk"])
@pytest.mark.parametrize("per_wg", [False, True], ids=["joint", "per_wg"])
@pytest.mark.parametrize("case", M80_CASES, ids=str)
def test_backward_80_query_rows_with_swapped_dq(case, per_wg, dq_order, monkeypatch):
    """BwdConfig(tile_m=80, dq_swapped=True) forced at head dim 128 (S^T, dP^T and dQ^T
    m64n80, dS stored queries x keys, dQ_accum in the dQ^T fragment's order and the
    postprocess's transposed store), with the joint or the per-warpgroup dQ hand-off and
    dQ^T's WGMMA after dV and dK, after dV under dK, or before dK (BwdConfig.dq_order): the
    accuracy rule of every backward test, and bit-identical deterministic gradients on the
    GQA cases (the turn counters per 80-row query block; always the joint hand-off)."""
    import dataclasses

    from cute_attn import config, launcher

    forced = config.BwdConfig(tile_m=80, tile_n=128, num_stages=2, ds_stages=2, dq_swapped=True, dq_order=dq_order)
    calls = []

    def bwd_config_for(head_dim, features, deterministic=False, max_seqlen_q=0):
        calls.append(head_dim)
        return forced if deterministic or not per_wg else dataclasses.replace(forced, dq_handoff_per_wg=True)

    monkeypatch.setattr(launcher, "bwd_config_for", bwd_config_for)
    q, k, v, dout, cu = make_inputs(case, seed=5)
    check_grads(case, q, k, v, cu, dout, kernel_grads(case, q, k, v, cu, dout))
    assert calls, "the forced config never reached the launcher"
    if case.h != case.h_kv and not per_wg:
        g1 = kernel_grads(case, q, k, v, cu, dout, deterministic=True)
        g2 = kernel_grads(case, q, k, v, cu, dout, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2)), "deterministic m80 gradients differ"
        check_grads(case, q, k, v, cu, dout, g1)

# The causal mask with 80-row steps (the diagonal cuts 80-row blocks at every offset mod 80
# against the 128-key tiles): bottom-right alignment with more queries than keys, fewer,
# and varlen with empty and one-key sequences
M80_CAUSAL_CASES = [
    Case(h=4, h_kv=2, causal=True, sq=1000, sk=1000),
    Case(h=8, h_kv=2, causal=True, sq=1000, sk=777),   # rows with no visible key
    Case(h=4, h_kv=4, causal=True, sq=129, sk=1000),
    Case(FP16, 128, h=4, h_kv=1, causal=True, sq=333, sk=555),
    Case(h=8, h_kv=2, causal=True, lens_q=(300, 0, 1000, 17, 81), lens_k=(129, 5, 1000, 17, 80)),
]


@pytest.mark.parametrize("case", M80_CAUSAL_CASES, ids=str)
def test_backward_80_query_rows_causal(case, monkeypatch):
    """swapped_dq_bwd_config (80 rows, dQ^T before dK, per-warpgroup dQ) forced under the
    causal mask: the accuracy rule of every backward test, and bit-identical deterministic
    gradients (its joint hand-off) on the GQA cases."""
    import dataclasses

    from cute_attn import config, launcher

    swapped = config.swapped_dq_bwd_config()
    calls = []

    def bwd_config_for(head_dim, features, deterministic=False, max_seqlen_q=0):
        calls.append(features.mask)
        return dataclasses.replace(swapped, dq_handoff_per_wg=False) if deterministic else swapped

    monkeypatch.setattr(launcher, "bwd_config_for", bwd_config_for)
    q, k, v, dout, cu = make_inputs(case, seed=7)
    check_grads(case, q, k, v, cu, dout, kernel_grads(case, q, k, v, cu, dout))
    assert calls and all(m == "causal" for m in calls), calls
    if case.h != case.h_kv:
        g1 = kernel_grads(case, q, k, v, cu, dout, deterministic=True)
        g2 = kernel_grads(case, q, k, v, cu, dout, deterministic=True)
        check_grads(case, q, k, v, cu, dout, g1)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2)), "deterministic causal m80 gradients differ"



# Persistent forward grids (config.FwdConfig.persistent_ctas): a few CTAs walking many
# tiles each, so every ring (Q, K, V) and the ping-pong turns run on across tiles; tiles
# with no visible key (sq > sk, causal) sit between tiles with keys.
PERSISTENT_CASES = [
    Case(d=128, h=4, h_kv=4, sq=1000, sk=1000),
    Case(d=128, h=8, h_kv=2, causal=True, sq=1000, sk=777),
    Case(FP16, 128, h=4, h_kv=1, softcap=20.0, window=(100, 30), sq=555, sk=700),
    Case(d=64, h=4, h_kv=4, sq=1000, sk=129),
    Case(d=64, h=8, h_kv=2, causal=True, sq=700, sk=1000),
]


def check_persistent_forward(case, seed, **forced_fields):
    """The case through launcher.run_fwd with the default config plus forced_fields (a
    persistent grid), under the accuracy rule of every forward test; twice with the tile
    queue, so the second call needs the counter the first left at zero."""
    import dataclasses

    from cute_attn import api, config, launcher

    def persistent_kernel(case, q, k, v, cu, return_lse):
        features, run_args = api._features_and_args(case.causal, case.window, case.softcap, case.scale)
        forced = dataclasses.replace(config.fwd_config_for(case.d, features), **forced_fields)
        return launcher.run_fwd(q, k, v, features, run_args, forced, num_splits=1)

    q, k, v, _, cu = make_inputs(case, seed=seed)
    if case.softcap:
        assert_cap_bites(case, q, k)
    for _ in range(2 if forced_fields.get("tile_queue") else 1):
        out, lse = run_forward(case, q, k, v, cu, kernel=persistent_kernel)
        check_forward(case, q, k, v, cu, out, lse)


@pytest.mark.parametrize("tile_queue", [False, True], ids=["round_robin", "queue"])
@pytest.mark.parametrize("ctas", [5, 132])
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=str)
def test_persistent_forward(case, ctas, tile_queue):
    """The default tiles with a persistent grid of `ctas` CTAs (5: each walks 6-40 tiles;
    132: an H100's / H200's SMs, at most one tile each here), tiles by round robin or
    from the tile queue, run through launcher.run_fwd with the config forced: the
    accuracy rule of every forward test. The queue is called twice, so the second call
    needs the counter the first left at zero (else it skips tiles: poisoned rows)."""
    check_persistent_forward(case, 5, persistent_ctas=ctas, tile_queue=tile_queue)
