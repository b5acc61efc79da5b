"""Context parallelism on CPUs, the failure paths: arguments refused before any exchange
(on every rank alike, so that no rank is left waiting in one), a rank outside the group,
the shard helpers' rank and length rules, and double backward refused as mha refuses it.
gloo and the fp32 reference stand in for NCCL and the kernels (as test_distributed_cpu)."""

import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cute_attn import distributed as cp


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _spawn(target, world_size, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(target, args=(world_size, str(tmp_path / "init")), nprocs=world_size, join=True)


def _init(rank, world_size, init_file):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # a hang (an exchange one rank never joins) fails the test instead of stalling it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))


def _non_member_worker(rank, world_size, init_file):
    _init(rank, world_size, init_file)
    try:
        group = dist.new_group([0])  # rank 1 gets new_group's non-member sentinel
        local = cp.ReferenceAttention()
        q = torch.randn(1, 8, 2, 16)
        calls = {"ring": lambda: cp.ring_mha(q, q, q, group, local=local),
                 "halo": lambda: cp.ring_mha(q, q, q, group, window_size=(2, 0), layout="contiguous", local=local),
                 "ulysses": lambda: cp.ulysses_mha(q, q, q, group, local=local),
                 "varlen": lambda: cp.ring_mha_varlen(q[0], q[0], q[0], [0, 8], group, local=local)}
        for name, call in calls.items():
            if rank == 0:  # the group's one rank: plain attention
                call()
            else:  # was: uninitialised memory from a ring of -1 steps, or an obscure reshape error
                try:
                    call()
                except ValueError as exc:
                    assert "not a member" in str(exc), (name, exc)
                else:
                    raise AssertionError(f"{name}: a rank outside the group got a result")
    finally:
        dist.destroy_process_group()


def test_a_rank_outside_the_group_is_refused(tmp_path):
    _spawn(_non_member_worker, 2, tmp_path)


def test_group_must_be_a_process_group(one_rank_group):
    q = torch.randn(1, 8, 2, 16)
    for group in (True, 4, "world"):  # e.g. ring_mha(q, k, v, True) meaning causal
        with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
            cp.ring_mha(q, q, q, group, local=cp.ReferenceAttention())


def _refusal_worker(rank, world_size, init_file):
    """Every refusal raises on every rank before an exchange: afterwards a full ring call
    still pairs up (a send left posted by a refused call would be matched to it)."""
    _init(rank, world_size, init_file)
    try:
        local = cp.ReferenceAttention()
        q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
        refused = [
            (lambda: cp.ring_mha(q[:, :7], k[:, :7], k[:, :7], causal=True, local=local), "even"),
            (lambda: cp.ring_mha(q, torch.randn(1, 8, 3, 16), torch.randn(1, 8, 3, 16), local=local), "divide"),
            (lambda: cp.ring_mha(q, k, k, window_size=(3, 0), local=local), "contiguous"),
            (lambda: cp.ulysses_mha(torch.randn(1, 8, 3, 16), k[:, :, :1], k[:, :, :1], local=local), "divisible"),
            (lambda: cp.ring_mha_varlen(q[0], k[0], k[0], [0, 6, 16], local=local), "divide by"),
            (lambda: cp.ring_mha_varlen(q[0], k[0], k[0], [0, 16], layout="striped", local=local), "layout"),
        ]
        for call, match in refused:
            try:
                call()
            except (ValueError, TypeError) as exc:
                assert match in str(exc), (match, exc)
            else:
                raise AssertionError(f"not refused ({match})")
        out = cp.ring_mha(q, k, k, causal=True, local=local)
        assert torch.isfinite(out).all()
    finally:
        dist.destroy_process_group()


def test_refusals_leave_no_exchange_pending(tmp_path):
    _spawn(_refusal_worker, 2, tmp_path)


def test_varlen_refuses_an_unknown_layout(one_rank_group):
    """A misspelt layout ran with zigzag's step plan (varlen_task treats every name but
    "contiguous" as zigzag): wrong rows on contiguous shards, silently."""
    q = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.ring_mha_varlen(q, q, q, [0, 8], layout="contigous", local=cp.ReferenceAttention())
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard_varlen(q[:0], [0, 0], 0, 2, "striped")  # every document empty: no position checked it


def test_varlen_offsets_must_be_integers(one_rank_group):
    q = torch.randn(8, 2, 16)
    local = cp.ReferenceAttention()
    with pytest.raises(TypeError, match="cu_seqlens must be .* integer"):
        cp.ring_mha_varlen(q, q, q, [0, 8.5], local=local)  # was: truncated to 8, no error
    with pytest.raises(TypeError, match="cu_seqlens must be .* integer"):
        cp.ring_mha_varlen(q, q, q, torch.tensor([0.0, 8.0]), local=local)
    with pytest.raises(TypeError, match="cu_seqlens must be .* integer"):
        cp.ring_mha_varlen(q, q, q, torch.tensor([[0, 8]]), local=local)
    with pytest.raises(TypeError, match="cu_seqlens must be .* integer"):
        cp.ring_mha_varlen(q, q, q, None, local=local)
    want = cp.ring_mha_varlen(q, q, q, [0, 4, 8], local=local)
    for cu in (torch.tensor([0, 4, 8], dtype=torch.int32), np.array([0, 4, 8]), (0, 4, 8)):
        torch.testing.assert_close(cp.ring_mha_varlen(q, q, q, cu, local=local), want)


def test_shard_helpers_refuse_what_they_would_misplace():
    x = torch.arange(16.0).reshape(1, 16, 1, 1)
    # zigzag took rank 2 of 2 as chunks 2 and 1, rank 3 as chunks 3 and 0: other ranks' rows
    for rank in (2, 3, -1):
        with pytest.raises(ValueError, match="rank must be in"):
            cp.shard(x, rank, 2, "zigzag")
    with pytest.raises(ValueError, match="rank must be in"):
        cp.shard(x, 0, 0, "contiguous")
    # shards of unequal lengths (a divisible total) were put back in the wrong places
    with pytest.raises(ValueError, match="same number of rows"):
        cp.unshard([x[:, :6], x[:, 6:]], "contiguous")
    packed = torch.arange(24.0)
    with pytest.raises(ValueError, match="cu_seqlens ends at 16"):
        cp.shard_varlen(packed, [0, 8, 16], 0, 2, "contiguous")  # took the first 16 rows
    shards = [cp.shard_varlen(packed, [0, 8, 24], r, 2, "zigzag") for r in range(2)]
    assert torch.equal(cp.unshard_varlen(shards, [0, 8, 24], "zigzag"), packed)
    with pytest.raises(ValueError, match="same number of rows"):
        cp.unshard_varlen(shards, [0, 8, 16], "zigzag")  # returned the first 16 of 24 rows


@pytest.mark.parametrize("variant", ["ring", "halo", "ulysses"])
def test_double_backward_is_refused(one_rank_group, variant):
    """As mha: create_graph's gradients would not be differentiable (the exchanges and the
    kernels record nothing), so differentiating them again is an error, not a silent 0."""
    local = cp.ReferenceAttention()
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    if variant == "ulysses":
        out = cp.ulysses_mha(q, k, v, causal=True, local=local)
    elif variant == "halo":
        out = cp.ring_mha(q, k, v, window_size=(2, 1), layout="contiguous", local=local)
    else:
        out = cp.ring_mha(q, k, v, causal=True, local=local)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.square().sum().backward()
