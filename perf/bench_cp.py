"""Context-parallel attention on every GPU of the machine: strong scaling (one sequence of
S tokens over W GPUs) against single-GPU `mha` on the same machine, forward and
forward+backward; per-GPU TFLOP/s and parallel efficiency = T_1 / (W T_W).

Weak scaling reads across the sequence lengths: S = 128K x W is a fixed shard of 128K per
GPU. One process per GPU (torch.multiprocessing, NCCL); each round times every variant
once, interleaved (order rotated), the time of a parallel call being the slowest rank's
(CUDA events, all_reduce MAX); the record is the median of rounds. Inputs random normal,
bf16, batch 1, the zigzag layout unless --layout says otherwise. --documents N packs N
equal documents into the sequence instead (ring_mha_varlen against mha_varlen; Ulysses
has no varlen entry point and is left out).

    python perf/bench_cp.py --seqlens 131072,262144 --out DIR
    python perf/bench_cp.py --seqlens 524288 --causal 1 --heads-kv 4 --documents 8
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness  # noqa: E402

VARIANTS = ("single", "ring", "ulysses")


def _time_call(fn, active: bool) -> float:
    """ms of fn on this rank (0 where not active), then the slowest rank's."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    torch.cuda.synchronize()
    ms = 0.0
    if active:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
    slowest = torch.tensor([ms], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def documents_cu_seqlens(seqlen: int, documents: int) -> list:
    """Offsets of `documents` equal documents packed into seqlen tokens."""
    return [i * (seqlen // documents) for i in range(documents + 1)]


def _calls(variant, q, k, v, dout, causal, rank, world_size, layout="zigzag", documents=1):
    """(forward, forward+backward) callables of a variant on this rank's tensors
    ((1, seqlen, heads, head_dim); packed as (seqlen, heads, head_dim) when documents > 1)."""
    import torch

    import cute_attn
    from cute_attn import distributed as cp

    if documents > 1:
        cu = documents_cu_seqlens(q.shape[1], documents)
        q, k, v, dout = (t[0] for t in (q, k, v, dout))
        if variant == "single":
            cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
            length = cu[1]

            def attend(q_, k_, v_):
                return cute_attn.mha_varlen(q_, k_, v_, cu_t, cu_t, length, length, causal=causal,
                                            check_cu_seqlens=False)
            tensors = (q, k, v, dout)
        else:
            def attend(q_, k_, v_):
                return cp.ring_mha_varlen(q_, k_, v_, cu, causal=causal, layout=layout)
            tensors = tuple(cp.shard_varlen(t, cu, rank, world_size, layout) for t in (q, k, v, dout))
    elif variant == "single":
        def attend(q_, k_, v_):
            return cute_attn.mha(q_, k_, v_, causal=causal)
        tensors = (q, k, v, dout)
    else:
        fn = cp.ring_mha if variant == "ring" else cp.ulysses_mha

        def attend(q_, k_, v_):
            return fn(q_, k_, v_, causal=causal, layout=layout)
        tensors = tuple(cp.shard(t, rank, world_size, layout) for t in (q, k, v, dout))
    q_, k_, v_, do_ = tensors
    leaves = tuple(t.detach().requires_grad_() for t in (q_, k_, v_))

    def forward():
        with torch.no_grad():
            attend(q_, k_, v_)

    def forward_backward():
        out = attend(*leaves)
        torch.autograd.grad(out, leaves, do_)

    return forward, forward_backward


def worker(rank, world_size, init_file, args, results_file):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank))
    records = []
    for seqlen in args.seqlens:
        for causal in args.causal:
            q, dout = harness.random_tensors([(1, seqlen, args.heads, args.headdim)] * 2, torch.bfloat16, seed=seqlen)
            k, v = harness.random_tensors([(1, seqlen, args.heads_kv, args.headdim)] * 2, torch.bfloat16,
                                          seed=seqlen + 1)
            from cute_attn.distributed import choose_variant

            ulysses_ok = args.documents == 1 and choose_variant(args.heads, args.heads_kv, world_size, 0) == "ulysses"
            variants = [name for name in args.variants if name != "ulysses" or ulysses_ok]
            calls = {name: _calls(name, q, k, v, dout, causal, rank, world_size, args.layout, args.documents)
                     for name in variants}
            rounds = {(name, p): [] for name in variants for p in ("fwd", "fwd+bwd")}
            for r in range(args.rounds + 1):  # round 0 warms up (compiles) and is dropped
                for name in harness.round_order(variants, r):
                    active = name != "single" or rank == 0
                    for p, fn in zip(("fwd", "fwd+bwd"), calls[name]):
                        ms = _time_call(fn, active)
                        if r:
                            rounds[(name, p)].append(ms)
            if rank == 0:
                doc = seqlen // args.documents
                fwd_flops = harness.attention_flops(args.documents, args.heads, doc, doc, args.headdim, causal)
                for (name, p), ms_rounds in rounds.items():
                    ms = harness.median_ms(ms_rounds)
                    flops = fwd_flops * (1 + harness.BWD_FLOP_FACTOR if p == "fwd+bwd" else 1)
                    gpus = 1 if name == "single" else world_size
                    single = harness.median_ms(rounds[("single", p)]) if ("single", p) in rounds else None
                    rec = {"variant": name, "pass": p, "seqlen": seqlen, "causal": causal, "heads": args.heads,
                           "heads_kv": args.heads_kv, "headdim": args.headdim, "layout": args.layout,
                           "documents": args.documents, "gpus": gpus, "ms": ms, "ms_rounds": ms_rounds,
                           "tflops_per_gpu": harness.tflops(flops, ms) / gpus,
                           "efficiency": None if single is None or name == "single" else single / (gpus * ms)}
                    records.append(rec)
                    harness.log(f"S={seqlen:>8} causal={causal!s:5} {name:8} {p:8} {gpus} GPU  {ms:9.2f} ms  "
                                f"{rec['tflops_per_gpu']:6.1f} TF/s/GPU  eff "
                                f"{'-' if rec['efficiency'] is None else format(rec['efficiency'], '.3f')}")
            del q, k, v, dout, calls
            torch.cuda.empty_cache()
    if rank == 0:
        import json

        Path(results_file).write_text(json.dumps(records))
    dist.destroy_process_group()


def parse_args(argv=None, world_size=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=harness.parse_int_list, default=[131072, 262144])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=None, help="KV heads (default: --heads)")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    parser.add_argument("--documents", type=harness.parse_positive_int, default=1,
                        help="equal documents packed per sequence (varlen; default 1: one sequence)")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", type=lambda s: [c == "1" for c in s.split(",")], default=[True, False],
                        help="comma list of 1/0 (default 1,0)")
    parser.add_argument("--variants", type=lambda s: harness.parse_names(s, VARIANTS, given_order=True),
                        default=list(VARIANTS))
    parser.add_argument("--rounds", type=harness.parse_positive_int, default=3)
    parser.add_argument("--gpus", type=int, default=0, help="world size (default: every GPU)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="write only under --out")
    args = parser.parse_args(argv)
    args.heads_kv = args.heads if args.heads_kv is None else args.heads_kv
    if args.heads % args.heads_kv:
        parser.error(f"--heads-kv ({args.heads_kv}) must divide --heads ({args.heads})")
    if "single" not in args.variants:
        args.variants = ["single", *args.variants]
    parts = (world_size or 1) * (2 if args.layout == "zigzag" else 1) * args.documents
    bad = [s for s in args.seqlens if s % parts]
    if bad:
        parser.error(f"sequence lengths {bad} do not split into {args.documents} document(s) x "
                     f"{world_size or 1} rank(s){' x 2 (zigzag)' if args.layout == 'zigzag' else ''}")
    return args


def main(argv=None):
    import json

    import torch
    import torch.multiprocessing as mp

    device = harness.cuda_setup("bench_cp.py")
    gpus = parse_args(argv).gpus
    world_size = gpus or torch.cuda.device_count()
    args = parse_args(argv, world_size)
    info = harness.run_info()
    harness.log(harness.describe_run(device, info), f"| {world_size} GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        results_file = os.path.join(tmp, "records.json")
        mp.spawn(worker, args=(world_size, os.path.join(tmp, "init"), args, results_file), nprocs=world_size,
                 join=True)
        records = json.loads(Path(results_file).read_text())
    doc = harness.build_results(f"{world_size} x {device}", records, **info,
                                method={"timing": f"{args.rounds} interleaved rounds (after one warm-up), CUDA events "
                                        "around one call per variant and pass, the slowest rank's time; ms = median",
                                        "flops": "4 L^2 H D per document of L tokens (halved causal), fwd+bwd x 3.5",
                                        "efficiency": "T_single / (gpus x T)"})
    for directory in harness.output_dirs(args.out, args.quick):
        path = harness.result_path(directory, f"{harness.device_slug(device)}-x{world_size}", "cp")
        harness.write_json(doc, path)
        harness.log(f"wrote {path}")


if __name__ == "__main__":
    main()
