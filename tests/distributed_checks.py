"""Context-parallel checks shared by the CPU tests (gloo, the fp32 reference standing in for
the kernels) and the GPU runs (NCCL, cute_attn's kernels): every rank builds the same
whole problem from one seed, runs the parallel attention on its shard, and compares its
shard of out, lse, dq, dk, dv with single-process attention on the whole sequence.

worker(rank, world_size, init_file, cases, on_gpu) is torch.multiprocessing.spawn's target.
"""

import dataclasses
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Case:
    variant: str = "ring"  # or "ulysses"
    layout: str = "zigzag"
    causal: bool = True
    batch: int = 2
    seqlen: int = 48  # the whole sequence
    heads: int = 4
    heads_kv: int = 2
    head_dim: int = 16
    softcap: float = 0.0
    window: tuple = (-1, -1)


def _whole_problem(case: Case, device, dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q = randn(case.batch, case.seqlen, case.heads, case.head_dim)
    k = randn(case.batch, case.seqlen, case.heads_kv, case.head_dim)
    v = randn(case.batch, case.seqlen, case.heads_kv, case.head_dim)
    dout = randn(case.batch, case.seqlen, case.heads, case.head_dim)
    return q, k, v, dout


def _single(case: Case, q, k, v, dout, attention):
    """(out, lse, dq, dk, dv) of the whole sequence in one process."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _parallel(case: Case, q, k, v, dout, rank, world_size, local):
    from cute_attn import distributed as cp

    shards = [cp.shard(t, rank, world_size, case.layout).requires_grad_() for t in (q, k, v)]
    kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, layout=case.layout,
                  return_lse=True, local=local)
    fn = cp.ring_mha if case.variant == "ring" else cp.ulysses_mha
    out, lse = fn(*shards, **kwargs)
    out.backward(cp.shard(dout, rank, world_size, case.layout))
    return (out.detach(), lse, *(t.grad for t in shards))


def check_case(case: Case, rank: int, world_size: int, on_gpu: bool):
    """Raises AssertionError naming the case and the tensor if this rank's shard is off."""
    from cute_attn import api, distributed as cp, reference

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    q, k, v, dout = _whole_problem(case, device, dtype)

    def ref(q_, k_, v_):
        return reference.attention_ref(q_, k_, v_, causal=case.causal, softcap=case.softcap, window_size=case.window)

    want = _single(case, q.float(), k.float(), v.float(), dout.float(), ref)
    got = _parallel(case, q, k, v, dout, rank, world_size, None if on_gpu else cp.ReferenceAttention())
    names = ("out", "lse", "dq", "dk", "dv")
    if on_gpu:
        def kernel(q_, k_, v_):
            return api.mha(q_, k_, v_, causal=case.causal, softcap=case.softcap, window_size=case.window,
                           return_lse=True)

        # the yardstick: single-GPU mha's own error against the fp32 reference
        single = _single(case, q, k, v, dout, kernel)
    for i, name in enumerate(names):
        seq_dim = 2 if name == "lse" else 1
        expect = cp.shard(want[i].float(), rank, world_size, case.layout, dim=seq_dim)
        err = (got[i].float() - expect).abs().max().item()
        if on_gpu:
            base = (cp.shard(single[i].float(), rank, world_size, case.layout, dim=seq_dim) - expect).abs().max().item()
            bound = 2 * base + 1e-3 * expect.abs().max().item() + 1e-6
        else:
            bound = 1e-4 * (1 + expect.abs().max().item())
        if not err <= bound:
            raise AssertionError(f"{case} rank {rank}/{world_size}: {name} max error {err:.3g} > {bound:.3g}")
        if torch.isnan(got[i]).any():
            raise AssertionError(f"{case} rank {rank}: NaN in {name}")


def _drop_the_partial(self, o_part, lse_part, out, lse):
    """A wrong merge (for the test that the checks catch one): keeps split 0 only."""
    batch = out.shape[0]
    out.copy_(o_part[:batch])
    lse.copy_(lse_part[:batch])


def worker(rank: int, world_size: int, init_file: str, cases, on_gpu: bool, broken_merge: bool = False):
    if broken_merge:
        from cute_attn.distributed import ReferenceAttention

        ReferenceAttention.merge = _drop_the_partial
    if on_gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        for case in cases:
            check_case(case, rank, world_size, on_gpu)
    finally:
        dist.destroy_process_group()


def spawn(world_size: int, cases, on_gpu: bool, tmp_path, broken_merge: bool = False) -> None:
    import torch.multiprocessing as mp

    init_file = os.path.join(str(tmp_path), f"cp_init_{world_size}")
    mp.spawn(worker, args=(world_size, init_file, list(cases), on_gpu, broken_merge), nprocs=world_size, join=True)
