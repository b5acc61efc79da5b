"""Context parallelism on CPUs: the ring and all-to-all logic with gloo in 2-4 processes,
the fp32 reference standing in for the kernels (same LSE merge interface), against
single-process attention, forward and backward (tests/distributed_checks.py); and the
layout's step plan checked exhaustively against the global causal mask."""

import itertools

import pytest
import torch

from cute_attn import distributed as cp, reference
from cute_attn.distributed.layout import block_task, global_positions
from distributed_checks import Case, spawn


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_steps_cover_each_visible_pair_once(world_size, layout, causal):
    """Over the W steps of a rank, the (query, key) pairs the tasks compute, mapped to
    global positions, are exactly the pairs the mask lets through, each once."""
    local_len = 6
    seqlen = local_len * world_size
    for rank in range(world_size):
        count = torch.zeros(local_len, seqlen, dtype=torch.int32)
        q_pos = global_positions(seqlen, world_size, layout, rank)
        for src in range(world_size):
            k_pos = global_positions(seqlen, world_size, layout, src)
            task = block_task(layout, causal, rank, src, local_len)
            if task is None:
                continue
            for i, j in itertools.product(range(local_len)[task.q_rows], range(local_len)[task.k_rows]):
                local_i, local_j = i - task.q_rows.start, j - task.k_rows.start
                if task.causal and local_j > local_i:
                    continue
                count[i, k_pos[j]] += 1
        visible = q_pos[:, None] >= torch.arange(seqlen)[None, :] if causal else torch.ones(local_len, seqlen,
                                                                                             dtype=torch.bool)
        assert torch.equal(count, visible.int()), (rank, count)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_steps_cover_each_visible_pair_once(world_size, layout, causal):
    """layout.varlen_task over packed documents (one empty): over a rank's W steps, the
    (query, key) pairs of its calls' sequences, in packed positions, are exactly the
    pairs of the same document the mask lets through, each once."""
    from cute_attn.distributed.layout import varlen_positions, varlen_task

    parts = world_size * (2 if layout == "zigzag" else 1)
    cu = [0]
    for n in (2 * parts, 0, parts, 3 * parts):
        cu.append(cu[-1] + n)
    local_cu = [x // world_size for x in cu]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor([b - a for a, b in zip(cu, cu[1:])]))
    for rank in range(world_size):
        q_pos = varlen_positions(cu, world_size, layout, rank)
        count = torch.zeros(len(q_pos), cu[-1], dtype=torch.int32)
        for src in range(world_size):
            k_pos = varlen_positions(cu, world_size, layout, src)
            task = varlen_task(layout, causal, rank, src, local_cu)
            if task is None:
                continue
            for q0, q1, k0, k1 in zip(task.cu_seqlens_q, task.cu_seqlens_q[1:], task.cu_seqlens_k,
                                      task.cu_seqlens_k[1:]):
                for i in range(q0, q1):
                    for j in range(k0, k1):
                        # bottom-right causal within the call's sequence
                        if task.causal and j - k0 > i - q0 + (k1 - k0) - (q1 - q0):
                            continue
                        count[i, k_pos[j]] += 1
        same_doc = doc[q_pos][:, None] == doc[None, :]
        visible = same_doc & (q_pos[:, None] >= torch.arange(cu[-1])[None, :]) if causal else same_doc
        assert torch.equal(count, visible.int()), (rank, count)


def test_varlen_shard_round_trip():
    cu = [0, 8, 8, 24]
    x = torch.randn(24, 3, 4)
    for layout in ("contiguous", "zigzag"):
        shards = [cp.shard_varlen(x, cu, r, 2, layout) for r in range(2)]
        assert torch.equal(cp.unshard_varlen(shards, cu, layout), x)
    assert torch.equal(cp.shard_varlen(x, cu, 1, 2, "zigzag")[:4], torch.cat([x[2:4], x[4:6]]))
    with pytest.raises(ValueError, match="divide by 4"):
        cp.shard_varlen(x, [0, 6, 24], 0, 2, "zigzag")


def test_zigzag_balances_causal_work():
    """Every rank computes the same number of causal pairs with zigzag (not contiguous)."""
    def pairs(layout, rank, world_size, local_len=8):
        total = 0
        for src in range(world_size):
            task = block_task(layout, True, rank, src, local_len)
            if task is not None:
                rows = task.q_rows.stop - task.q_rows.start
                keys = task.k_rows.stop - task.k_rows.start
                total += rows * (rows + 1) // 2 if task.causal else rows * keys
        return total

    assert len({pairs("zigzag", r, 4) for r in range(4)}) == 1
    assert len({pairs("contiguous", r, 4) for r in range(4)}) == 4


def test_shard_unshard_round_trip():
    x = torch.randn(2, 24, 3, 4)
    for layout, world_size in (("contiguous", 3), ("zigzag", 3), ("zigzag", 4)):
        shards = [cp.shard(x, r, world_size, layout) for r in range(world_size)]
        assert torch.equal(cp.unshard(shards, layout), x)
    assert torch.equal(cp.shard(x, 1, 3, "zigzag")[:, :4], x[:, 4:8])
    assert torch.equal(cp.shard(x, 1, 3, "zigzag")[:, 4:], x[:, 16:20])
    with pytest.raises(ValueError, match="split evenly"):
        cp.shard(x, 0, 5, "contiguous")
    with pytest.raises(ValueError, match="layout"):
        cp.shard(x, 0, 2, "striped")


def test_ulysses_rank_order_is_built_once():
    """The zigzag permutation of Ulysses' exchanges is cached: a repeat call builds nothing."""
    from cute_attn.distributed.ulysses import _rank_order

    cpu = torch.device("cpu")
    order, inverse = _rank_order(24, 3, "zigzag", cpu), _rank_order(24, 3, "zigzag", cpu, inverse=True)
    assert torch.equal(order, torch.cat([global_positions(24, 3, "zigzag", r) for r in range(3)]))
    assert torch.equal(order[inverse], torch.arange(24))
    assert _rank_order(24, 3, "zigzag", cpu) is order and _rank_order(24, 3, "zigzag", cpu, inverse=True) is inverse


def test_choose_variant():
    assert cp.choose_variant(32, 8, 4, 65536) == "ulysses"
    assert cp.choose_variant(32, 8, 16, 65536) == "ulysses"
    assert cp.choose_variant(24, 8, 16, 65536) == "ring"
    assert cp.choose_variant(6, 6, 4, 65536) == "ring"
    assert cp.choose_variant(32, 2, 4, 65536) == "ulysses"  # KV heads copied per rank
    assert cp.choose_variant(32, 3, 4, 65536) == "ring"
    assert cp.choose_variant(32, 8, 4, 65536, window_size=(4096, 0)) == "ring"
    assert cp.choose_variant(32, 8, 4, 1024, window_size=(4096, 0)) == "ulysses"


def test_halo_fetches_only_the_shards_a_window_reaches():
    """halo.py's plan: the shards each rank reads, who reads its shard, and the kernel
    window that makes bottom-right alignment over them the global window (checked
    against the global mask for every rank)."""
    from cute_attn.distributed.halo import kernel_window, readers, window_keys

    # rank 2 of 4, shards of 100, a causal window of 30 back: shards 1 and 2
    assert window_keys(2, 4, 100, (30, 0)) == (1, 2, 170, 300)
    assert kernel_window(2, 4, 100, (30, 0)) == (30, 0) and readers(2, 4, 100, (30, 0)) == [3]
    assert window_keys(2, 4, 100, (150, 20)) == (0, 3, 50, 320)
    assert kernel_window(2, 4, 100, (150, 20)) == (170, 0) and readers(2, 4, 100, (150, 20)) == [1, 3]
    for window in ((30, 0), (150, 20), (-1, 7), (0, 0), (5, -1), (250, 250)):
        for rank in range(4):
            first, last, ka, kb = window_keys(rank, 4, 100, window)
            local = reference.visible_keys(100, kb - ka, window_size=kernel_window(rank, 4, 100, window))
            i = torch.arange(rank * 100, rank * 100 + 100)[:, None]
            j = torch.arange(ka, kb)[None, :]
            left, right = window
            want = ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))
            assert torch.equal(torch.ones_like(want) if local is None else local, want), (window, rank)
            # and no visible key lies outside [ka, kb)
            everything = torch.arange(400)[None, :]
            outside = ((everything >= i - left) | (left < 0)) & ((everything <= i + right) | (right < 0))
            assert outside[:, :ka].sum() == 0 and outside[:, kb:].sum() == 0


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bad_arguments_raise_clear_errors(one_rank_group):
    q = torch.randn(1, 8, 2, 16)
    local = cp.ReferenceAttention()
    with pytest.raises(ValueError, match="contiguous"):
        cp.ring_mha(q, q, q, window_size=(3, 0), local=local)
    with pytest.raises(ValueError, match="even"):
        cp.ring_mha(q[:, :7], q[:, :7], q[:, :7], causal=True, local=local)
    with pytest.raises(ValueError, match="same shard"):
        cp.ring_mha(q, q[:, :4], q[:, :4], layout="contiguous", local=local)
    with pytest.raises(ValueError, match="window_size"):
        cp.ring_mha(q, q, q, window_size=(-3, 0), layout="contiguous", local=local)
    with pytest.raises(TypeError, match="bfloat16"):
        cp.ring_mha(q, q, q)  # the kernels' checks: float32 is not theirs
    for fn in (cp.ring_mha, cp.ulysses_mha):  # a string is not a bool ("no" would be True)
        with pytest.raises(TypeError, match="causal must be a bool"):
            fn(q, q, q, causal="no", local=local)
        with pytest.raises(TypeError, match="return_lse must be a bool"):
            fn(q, q, q, return_lse=1, local=local)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cp.ring_mha_varlen(q[0], q[0], q[0], [0, 8], causal="no", local=local)


def test_one_rank_is_plain_attention(one_rank_group):
    """World size 1: the ring is one diagonal step, the halo one windowed call."""
    from cute_attn import reference

    q, k, v = (torch.randn(2, 10, 2, 16) for _ in range(3))
    local = cp.ReferenceAttention()
    dout = torch.randn(2, 10, 2, 16)
    for kwargs in ({"causal": True}, {"window_size": (3, 2), "layout": "contiguous"},
                   {"causal": True, "window_size": (99, 0)}):  # a window past the sequence: the ring
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = cp.ring_mha(*leaves, return_lse=True, local=local, **kwargs)
        out.backward(dout)
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want, want_lse = reference.attention_ref(*ref_leaves, **{key: val for key, val in kwargs.items()
                                                                  if key != "layout"})
        want.backward(dout)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)
        for got, expect in zip(leaves, ref_leaves):
            torch.testing.assert_close(got.grad, expect.grad)
    with pytest.raises(ValueError, match="k headdim must equal q headdim"):
        cp.ring_mha(q, k[..., :8], v, causal=True, local=local)


def test_needs_an_initialised_group():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.ring_mha(q, q, q)


_RING_CASES = [
    Case("ring", "zigzag", True),
    Case("ring", "contiguous", True),
    Case("ring", "zigzag", False, heads_kv=4),
    Case("ring", "contiguous", True, softcap=5.0, heads_kv=1),
    Case("ring", "contiguous", True, window=(5, 0)),  # a halo: neighbours only
    Case("ring", "contiguous", False, window=(30, 7)),  # reaches several shards back
    Case("ring", "contiguous", False, window=(-1, 3)),
    Case("ring", "contiguous", False, window=(0, 0)),
    # packed documents (ring_mha_varlen), every length a multiple of 2 x 4 ranks, one empty
    Case("ring", "zigzag", True, documents=(16, 8, 0, 24)),
    Case("ring", "contiguous", True, documents=(8, 32, 8), heads_kv=1),
    Case("ring", "zigzag", False, documents=(24, 16), softcap=5.0),
    Case("ring", "zigzag", True, scale=0.3, bf16_on_cpu=True),  # bf16 shards, fp32 dK/dV in flight
]
_ULYSSES_CASES = [
    Case("ulysses", "zigzag", True),  # 2 KV heads: copied per rank at 4 ranks
    Case("ulysses", "contiguous", False, heads_kv=4),
    Case("ulysses", "zigzag", True, window=(5, 3), softcap=4.0, heads_kv=1),
]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_and_ulysses_match_single_process(world_size, tmp_path):
    """Forward (out, lse) and backward (dq, dk, dv) of every rank's shard against the
    whole sequence's attention in one process, fp32, gloo."""
    spawn(world_size, _RING_CASES + _ULYSSES_CASES, on_gpu=False, tmp_path=tmp_path)


@pytest.mark.parametrize("case", [c for c in _RING_CASES if c.window == (-1, -1)],
                         ids=lambda c: f"{c.layout}-{'causal' if c.causal else 'full'}-{'varlen' if c.documents else 'dense'}")
def test_ring_in_threads_matches_single_process(case):
    """The thread-ring harness the GPU tests use where one GPU is lent (distributed_checks
    .ThreadRing), itself checked here with the reference at 4 ranks."""
    from distributed_checks import check_case_threads

    check_case_threads(case, 4, on_gpu=False)


def test_ring_three_ranks(tmp_path):
    """An odd ring (zigzag: 6 chunks)."""
    spawn(3, [Case("ring", "zigzag", True, seqlen=36), Case("ring", "contiguous", True, seqlen=36)], on_gpu=False,
          tmp_path=tmp_path)


def test_a_wrong_merge_is_caught(tmp_path):
    """The check has teeth: a merge that drops the step's partial fails it."""
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match="max error"):
        spawn(2, [Case("ring", "zigzag", True, batch=1)], on_gpu=False, tmp_path=tmp_path,
              broken_merge=True)


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("contiguous", False)])
def test_varlen_steps_offsets_come_from_one_copy_and_match_each_task(layout, causal):
    """VarlenSteps builds every step's offsets in one host-to-device copy (no stream wait
    per step): the views must still be each step's own offsets, steps without work
    (causal: a later rank's keys) skipped, in order."""
    from cute_attn.distributed.layout import varlen_task
    from cute_attn.distributed.ring import VarlenSteps

    world_size, rank = 4, 1
    local_cu = [0, 8, 8, 24, 40]  # an empty document too; each length splits over 2 x 4 chunks
    steps = VarlenSteps(None, layout, causal, 1.0, 0.0, rank, world_size, local_cu, torch.device("cpu"))
    for src in range(world_size):
        task = varlen_task(layout, causal, rank, src, local_cu)
        if task is None:
            assert src not in steps.cu
            continue
        cu_q, cu_k = steps.cu[src]
        assert cu_q.dtype == torch.int32 and cu_q.tolist() == list(task.cu_seqlens_q)
        assert cu_k.tolist() == list(task.cu_seqlens_k)
