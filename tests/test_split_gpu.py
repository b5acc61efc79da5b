"""Split-KV forward and its in-kernel merge on the GPU (launcher._run_fwd_split,
fwd_sm90.merge_if_last), held to the feature tests' accuracy rule (tests/gpu_checks.py)
on NaN-poisoned outputs and workspaces.

Split counts are forced through launcher.choose_splits (1 .. more splits than KV blocks,
so that some splits see no key and must weigh 0 in the combine), and the automatic
choice is checked to split exactly the grids that are too small for the GPU."""

import pytest
import torch

import cute_attn
from cute_attn import launcher
from cute_attn.config import split_decode_config
from gpu_checks import Case, check_forward, check_grads, kernel_grads, make_inputs, run_forward
from gpu_helpers import exact_fp32_matmul, forget_bound_launches  # noqa: F401  (autouse)

pytestmark = pytest.mark.gpu


@pytest.fixture
def forced_splits(monkeypatch):
    """force(n): every forward takes n splits; the calls' choices are recorded."""
    chosen = []
    real = launcher.choose_splits

    def force(n):
        def choose(*args):
            chosen.append(real(*args))
            return n
        monkeypatch.setattr(launcher, "choose_splits", choose)
        forget_bound_launches(monkeypatch)  # the plans and bound launches cache split counts
        return chosen
    return force


DECODE_CASES = [
    # decode and speculative decoding: GQA groups 1/4/8/16 packed into the tile rows
    Case(b=2, sq=1, sk=3000, h=32, h_kv=8, causal=True),
    Case(b=3, sq=5, sk=1031, h=16, h_kv=16, causal=True),
    Case(b=1, sq=16, sk=4099, h=64, h_kv=8, causal=True),
    Case(b=2, sq=7, sk=2500, h=16, h_kv=1, causal=True, softcap=20.0),
    Case(b=2, sq=3, sk=5000, h=32, h_kv=8, window=(700, 0)),
    Case(b=1, sq=1, sk=777, h=8, h_kv=8, d=64),
    # head dim 64 with few packed rows: config.split_decode_config's 64-row, 4-stage tile
    Case(b=2, sq=1, sk=3001, h=64, h_kv=8, d=64, causal=True),
    Case(b=1, sq=3, sk=2000, h=32, h_kv=2, d=64, causal=True, softcap=15.0),
    Case(b=1, sq=4, sk=1500, h=16, h_kv=4, d=256, causal=True),
    Case(b=2, sq=130, sk=2049, h=4, h_kv=2, causal=True),  # query tiles of more than one block
    # varlen: empty and one-token sequences, keys shorter and longer than a split
    Case(h=8, h_kv=2, causal=True, lens_q=(1, 5, 0, 16, 1), lens_k=(700, 2000, 33, 4096, 1)),
    # varlen decode whose few rows merge in a cluster (launcher._cluster_merge) at 2-8
    # splits: tiles past an empty sequence's end exit, the whole cluster together
    Case(h=8, h_kv=2, causal=True, lens_q=(1, 1, 0, 1), lens_k=(700, 2000, 33, 4096)),
    Case(h=16, h_kv=2, d=64, causal=True, lens_q=(1, 1, 0, 1), lens_k=(700, 2000, 33, 4096)),
]


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_forced_splits_match_the_reference(case, splits, forced_splits):
    chosen = forced_splits(splits)
    q, k, v, _, cu = make_inputs(case, seed=splits)
    out, lse = run_forward(case, q, k, v, cu)
    assert chosen, "the forward did not consult choose_splits"
    check_forward(case, q, k, v, cu, out, lse)


def test_split_equals_unsplit_within_fp32_rounding(forced_splits):
    """The same call with 1 and 8 splits: out within a couple of bf16 ulps, lse within
    fp32 rounding of the merge."""
    case = Case(b=1, sq=1, sk=8192, h=32, h_kv=8, causal=True)
    q, k, v, _, cu = make_inputs(case, seed=3)
    forced_splits(1)
    out1, lse1 = cute_attn.mha(q, k, v, causal=True, return_lse=True)
    forced_splits(8)
    out8, lse8 = cute_attn.mha(q, k, v, causal=True, return_lse=True)
    assert (lse1 - lse8).abs().max().item() < 1e-4
    assert (out1.float() - out8.float()).abs().max().item() <= 2 * 2 ** -8 * out1.float().abs().max().item()


@pytest.mark.parametrize("case", [Case(b=1, sq=300, sk=4096, h=4, h_kv=2, causal=True),
                                  Case(h=4, h_kv=4, lens_q=(100, 1, 250), lens_k=(3000, 50, 2600))], ids=str)
def test_split_forward_under_autograd(case, forced_splits):
    """Training on a small grid: the split forward's out and lse feed the backward."""
    forced_splits(4)
    q, k, v, dout, cu = make_inputs(case, seed=7)
    out, lse = run_forward(case, q, k, v, cu)
    check_forward(case, q, k, v, cu, out, lse)
    check_grads(case, q, k, v, cu, dout, kernel_grads(case, q, k, v, cu, dout))


def test_automatic_choice_splits_small_grids_only():
    q, k, v = (torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16)
               for s, h in ((1, 32), (32768, 8), (32768, 8)))
    features, args = cute_attn.api._features_and_args(True, (-1, -1), 0.0, 128 ** -0.5)
    config = launcher._default_fwd_config(q, k, features)
    decode = launcher.choose_splits(q, k, features, args, config)
    assert decode >= 8, decode
    big_q = torch.randn(4, 4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    big_kv = torch.randn(4, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert launcher.choose_splits(big_q, big_kv, features, args, launcher._default_fwd_config(big_q, big_kv, features)) == 1
    # and the decode call that takes the split path is right
    case = Case(b=1, sq=1, sk=32768, h=32, h_kv=8, causal=True)
    q, k, v, _, cu = make_inputs(case, seed=11)
    out, lse = run_forward(case, q, k, v, cu)
    check_forward(case, q, k, v, cu, out, lse)


@pytest.mark.parametrize("case", [Case(b=2, sq=1, sk=3000, h=32, h_kv=8, causal=True),
                                  Case(b=1, sq=1, sk=2047, h=64, h_kv=8, d=64, causal=True),
                                  Case(h=8, h_kv=2, causal=True, lens_q=(1, 0, 1), lens_k=(900, 33, 2500))], ids=str)
def test_cluster_merge_equals_the_global_merge(case, forced_splits, monkeypatch):
    """The same split forward merged in a thread-block cluster (FwdConfig.cluster_splits)
    and through global memory: the two fold the same partials in the same order, so the
    outputs and LSEs are bit-identical (an indexing slip in either shows here), and both
    match the reference. Both run the tile a cluster merge takes (split_decode_config)."""
    results = []
    monkeypatch.setattr(launcher, "split_decode_config",
                        lambda cfg, head_dim, rows, in_cluster: split_decode_config(cfg, head_dim, rows, True))
    for cluster in (True, False):
        forced_splits(5)  # also forgets the cached plans, which hold the merge choice
        monkeypatch.setattr(launcher, "_cluster_merge", lambda *args, cluster=cluster: cluster)
        q, k, v, _, cu = make_inputs(case, seed=9)
        out, lse = run_forward(case, q, k, v, cu)
        check_forward(case, q, k, v, cu, out, lse)
        results.append((out, lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_split_call_is_cuda_graph_capturable(forced_splits):
    forced_splits(6)
    q, k, v = (torch.randn(2, s, h, 128, device="cuda", dtype=torch.bfloat16) for s, h in ((3, 16), (5000, 4), (5000, 4)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cute_attn.mha(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cute_attn.mha(q, k, v, causal=True)
    k.copy_(torch.randn_like(k))
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, cute_attn.mha(q, k, v, causal=True))


def test_poisoned_workspace_and_counters_left_zero(forced_splits):
    """Every partial the merge reads was written by this call (the stream's workspace is
    NaN beforehand), and each call leaves the per-tile counters at zero for the next
    (with a different split count too)."""
    case = Case(b=2, sq=3, sk=2000, h=16, h_kv=4, causal=True)
    q, k, v, _, cu = make_inputs(case, seed=5)
    forced_splits(5)
    run_forward(case, q, k, v, cu)  # the stream's workspace exists from here on
    torch.cuda.synchronize()
    floats = [buf for floats, _ in launcher._workspace_buffers.values() for buf in floats]
    assert floats
    for splits in (5, 3):
        for buf in floats:
            buf.fill_(float("nan"))
        forced_splits(splits)
        out, lse = run_forward(case, q, k, v, cu)
        check_forward(case, q, k, v, cu, out, lse)
        torch.cuda.synchronize()
        for _, zeros in launcher._workspace_buffers.values():
            assert all(int(z.count_nonzero()) == 0 for z in zeros)


def test_split_calls_on_two_streams_at_once(forced_splits):
    """Two streams running split forwards concurrently: each stream has its own partials
    and counters, so neither merges the other's."""
    forced_splits(8)
    case = Case(b=1, sq=2, sk=20000, h=32, h_kv=8, causal=True)
    inputs = [make_inputs(case, seed=s) for s in (21, 22)]
    streams = [torch.cuda.Stream() for _ in inputs]
    outs = [None, None]
    torch.cuda.synchronize()
    for _ in range(3):
        for i, (stream, (q, k, v, _, cu)) in enumerate(zip(streams, inputs)):
            with torch.cuda.stream(stream):  # no allocator games here: back-to-back launches
                outs[i] = cute_attn.mha(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    for (q, k, v, _, cu), (out, lse) in zip(inputs, outs):
        check_forward(case, q, k, v, cu, out, lse)
