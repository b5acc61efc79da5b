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
    documents: tuple = ()  # varlen (ring_mha_varlen): the packed documents' lengths; batch unused
    scale: float = None  # softmax_scale (None: head_dim ** -0.5)
    bf16_on_cpu: bool = False  # CPU cases: bf16 inputs (K/V and dK/dV messages then differ in size)


def _whole_problem(case: Case, device, dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    rows = (sum(case.documents),) if case.documents else (case.batch, case.seqlen)
    q = randn(*rows, case.heads, case.head_dim)
    k = randn(*rows, case.heads_kv, case.head_dim)
    v = randn(*rows, case.heads_kv, case.head_dim)
    dout = randn(*rows, case.heads, case.head_dim)
    return q, k, v, dout


def _cu_seqlens(case: Case) -> list:
    cu = [0]
    for n in case.documents:
        cu.append(cu[-1] + n)
    return cu


def _sharder(case: Case, rank: int, world_size: int):
    """shard(tensor, sequence dim) of this rank, dense or varlen."""
    from cute_attn import distributed as cp

    if case.documents:
        return lambda t, dim: cp.shard_varlen(t, _cu_seqlens(case), rank, world_size, case.layout, dim=dim)
    return lambda t, dim: cp.shard(t, rank, world_size, case.layout, dim=dim)


def _single(case: Case, q, k, v, dout, attention):
    """(out, lse, dq, dk, dv) of the whole sequence in one process."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _parallel(case: Case, q, k, v, dout, rank, world_size, local):
    from cute_attn import distributed as cp

    seq_dim = 0 if case.documents else 1
    shard = _sharder(case, rank, world_size)
    shards = [shard(t, seq_dim).requires_grad_() for t in (q, k, v)]
    kwargs = dict(causal=case.causal, softmax_scale=case.scale, softcap=case.softcap, layout=case.layout,
                  return_lse=True, local=local)
    if case.documents:
        out, lse = cp.ring_mha_varlen(*shards, _cu_seqlens(case), **kwargs)
    else:
        fn = cp.ring_mha if case.variant == "ring" else cp.ulysses_mha
        out, lse = fn(*shards, window_size=case.window, **kwargs)
    out.backward(shard(dout, seq_dim))
    return (out.detach(), lse, *(t.grad for t in shards))


def expected(case: Case, on_gpu: bool):
    """(q, k, v, dout) of the whole problem, the fp32 reference's (out, lse, dq, dk, dv),
    and on the GPU single-GPU mha's (the yardstick of the error bound), else None."""
    from cute_attn import api, reference

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu or case.bf16_on_cpu else torch.float32
    q, k, v, dout = _whole_problem(case, device, dtype)
    cu = torch.tensor(_cu_seqlens(case), dtype=torch.int32, device=device)

    def ref(q_, k_, v_):
        if case.documents:
            return reference.attention_ref_varlen(q_, k_, v_, cu, cu, causal=case.causal, softmax_scale=case.scale,
                                                  softcap=case.softcap)
        return reference.attention_ref(q_, k_, v_, causal=case.causal, softmax_scale=case.scale, softcap=case.softcap,
                                       window_size=case.window)

    def kernel(q_, k_, v_):
        if case.documents:
            longest = max(case.documents)
            return api.mha_varlen(q_, k_, v_, cu, cu, longest, longest, causal=case.causal, softmax_scale=case.scale,
                                  softcap=case.softcap, return_lse=True)
        return api.mha(q_, k_, v_, causal=case.causal, softmax_scale=case.scale, softcap=case.softcap,
                       window_size=case.window, return_lse=True)

    want = _single(case, q.float(), k.float(), v.float(), dout.float(), ref)
    single = _single(case, q, k, v, dout, kernel) if on_gpu else None
    return (q, k, v, dout), want, single


def compare(case: Case, rank: int, world_size: int, got, want, single) -> None:
    """Raises AssertionError naming the case and the tensor if this rank's shard is off:
    fp32 (CPU) within 1e-4 relative, bf16 on the CPU (fp32 math, bf16 outputs) within
    two bf16 roundings; on the GPU within twice mha's own error."""
    shard = _sharder(case, rank, world_size)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        # lse: (batch, heads, seqlen), varlen (heads, total)
        seq_dim = (1 if name == "lse" else 0) if case.documents else (2 if name == "lse" else 1)
        expect = shard(want[i].float(), seq_dim)
        err = (got[i].float() - expect).abs().max().item()
        if single is not None:
            base = (shard(single[i].float(), seq_dim) - expect).abs().max().item()
            bound = 2 * base + 1e-3 * expect.abs().max().item() + 1e-6
        elif got[i].dtype == torch.bfloat16:
            bound = 2 ** -7 * (1 + expect.abs().max().item())
        else:
            bound = 1e-4 * (1 + expect.abs().max().item())
        if not err <= bound:
            raise AssertionError(f"{case} rank {rank}/{world_size}: {name} max error {err:.3g} > {bound:.3g}")
        if torch.isnan(got[i]).any():
            raise AssertionError(f"{case} rank {rank}: NaN in {name}")


def check_case(case: Case, rank: int, world_size: int, on_gpu: bool):
    """This rank's shard through the public entry points (a process group is up)."""
    from cute_attn import distributed as cp

    tensors, want, single = expected(case, on_gpu)
    got = _parallel(case, *tensors, rank, world_size, None if on_gpu else cp.ReferenceAttention())
    compare(case, rank, world_size, got, want, single)


# ----------------------------------------------------------------------------------------
# The ring without torch.distributed: W threads of one process, one per rank
# ----------------------------------------------------------------------------------------


class _Arrival:
    def __init__(self, inbox, recv):
        self.inbox, self.recv = inbox, recv

    def wait(self):
        self.recv.copy_(self.inbox.get(timeout=120))


class ThreadRing:
    """distributed.ring.Ring's interface over queues between threads: rank r's sends go
    to rank r + 1's inbox in order, and the ring's receives come in the same order. On
    one GPU the ranks' kernels then share it (one stream: correct, not concurrent), so
    the kernel path of W ranks runs where only one GPU is lent."""

    def __init__(self, rank: int, world_size: int, inboxes):
        self.rank, self.world_size, self.inboxes = rank, world_size, inboxes

    def start(self, send):
        self.inboxes[(self.rank + 1) % self.world_size].put(send.clone())
        recv = torch.empty_like(send)
        return recv, [_Arrival(self.inboxes[self.rank], recv)]

    @staticmethod
    def wait(works):
        for work in works:
            work.wait()


def _ring_direct(case: Case, tensors, rank: int, world_size: int, ring, local):
    """(out, lse, dq, dk, dv) of rank's shard through ring_forward / ring_backward (no
    autograd: its engine runs one device's backward on one thread)."""
    from cute_attn.distributed.ring import DenseSteps, VarlenSteps, ring_backward, ring_forward

    q, k, v, dout = tensors
    seq_dim = 0 if case.documents else 1
    shard = _sharder(case, rank, world_size)
    qs, ks, vs, dos = (shard(t, seq_dim) for t in (q, k, v, dout))
    scale = case.head_dim ** -0.5 if case.scale is None else case.scale
    if case.documents:
        qs, ks, vs, dos = (t[None] for t in (qs, ks, vs, dos))
        steps = VarlenSteps(local, case.layout, case.causal, scale, case.softcap, rank, world_size,
                            [x // world_size for x in _cu_seqlens(case)], q.device)
    else:
        steps = DenseSteps(local, case.layout, case.causal, scale, case.softcap, rank, qs.shape[1])
    kv = torch.stack([ks, vs])
    out, lse = ring_forward(qs, kv, ring, steps)
    grads = ring_backward(dos, qs, kv, out, lse, ring, steps)
    results = (out, lse, *grads)
    return tuple(t[0] for t in results) if case.documents else results


def check_case_threads(case: Case, world_size: int, on_gpu: bool) -> None:
    """Every rank of a ring (dense or varlen, no window) in its own thread, compared."""
    import queue
    import threading

    from cute_attn import distributed as cp

    tensors, want, single = expected(case, on_gpu)
    inboxes = [queue.Queue() for _ in range(world_size)]
    results, errors = [None] * world_size, []
    device = torch.cuda.current_device() if on_gpu else None

    def run(rank):
        try:
            if device is not None:
                torch.cuda.set_device(device)
            local = cp.KernelAttention() if on_gpu else cp.ReferenceAttention()
            results[rank] = _ring_direct(case, tensors, rank, world_size, ThreadRing(rank, world_size, inboxes), local)
        except BaseException as exc:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for rank in range(world_size):
        compare(case, rank, world_size, results[rank], want, single)


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
