"""A/B of forced split-KV counts for decode shapes, the measurement behind
split_heuristic.memory_bound_ctas. On the device:

    python3 perf/ab_splits.py                  # head dim 128 through mha_with_kvcache, do_bench (2026-11-25)
    python3 perf/ab_splits.py --graph --head-dim 64 [--rounds 3]
        # mha with forced counts on its default split tile (config.split_decode_config), in
        # CUDA graphs over rotating K/V copies (bench_decode.graph_us), 64/8 heads

Each line: the shape, then per split count the median us and GB/s of K and V read once;
with --graph also the count the heuristic picks (launcher.choose_splits) and whether the
splits merge in a cluster."""
import argparse
import statistics
import sys

import torch

sys.path.insert(0, "perf")
import harness  # noqa: E402

import cute_attn  # noqa: E402

CASES = [((1, 1, 131072, 32, 8), (8, 12, 16)), ((1, 1, 32768, 32, 8), (8, 12, 16)),
         ((8, 1, 8192, 32, 8), (1, 2)), ((8, 1, 32768, 64, 8), (1, 2)), ((8, 1, 131072, 64, 8), (1, 2)),
         ((1, 16, 65536, 64, 8), (8, 16)), ((4, 1, 32768, 64, 8), (1, 2, 4))]
# (batch, keys) at one query, 64/8 heads, for --graph
GRAPH_SHAPES = [(1, 8192), (1, 32768), (1, 131072), (2, 8192), (2, 32768), (4, 8192), (4, 32768), (8, 8192),
                (8, 32768)]
GRAPH_SPLITS = (1, 2, 4, 8, 16)


def kvcache_do_bench(rounds: int) -> None:
    for (b, sq, sk, h, hkv), splits in CASES:
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        timers = {s: (lambda s: lambda: harness.do_bench(lambda: cute_attn.mha_with_kvcache(
            q, kc, vc, cache_seqlens=lens, causal=True, num_splits=s)))(s) for s in splits}
        ms, _ = harness.run_rounds(timers, rounds)
        nbytes = 2 * b * sk * hkv * 128 * 2
        print(f"b{b} q{sq} k{sk} h{h}/{hkv}: " + " | ".join(
            f"{s} splits {harness.median_ms(m)*1e3:7.1f} us {nbytes/harness.median_ms(m)/1e6:6.0f} GB/s"
            for s, m in ms.items()), flush=True)


def forced_in_graphs(head_dim: int, rounds: int) -> None:
    import bench_decode as bd

    from cute_attn import api, launcher

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    h, hkv = 64, 8
    for b, sk in GRAPH_SHAPES:
        q = torch.randn(b, 1, h, head_dim, device="cuda", dtype=torch.bfloat16)
        kvs = [tuple(torch.randn(b, sk, hkv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
               for _ in range(bd.rotating_copies(2 * b * sk * hkv * head_dim * 2, l2))]
        features, args = api._features_and_args(True, (-1, -1), 0.0, head_dim ** -0.5)
        chosen = launcher._plan(q, kvs[0][0], features, args, None, None)
        fns = {s: (lambda s: lambda q, k, v: launcher.run_fwd(q, k, v, features, args, need_lse=False,
                                                               num_splits=s)[0])(s) for s in GRAPH_SPLITS}
        times = {s: [] for s in fns}
        for r in range(rounds):
            for s in (GRAPH_SPLITS if r % 2 == 0 else GRAPH_SPLITS[::-1]):
                times[s].append(bd.graph_us(fns[s], q, kvs))
        nbytes = bd.moved_bytes(b, 1, sk, h, hkv, head_dim)
        merges = {s: launcher._plan(q, kvs[0][0], features, args, None, s).cluster_merge for s in GRAPH_SPLITS}
        print(f"b{b} k{sk} h{h}/{hkv} d{head_dim} (heuristic: {chosen.num_splits}): " + " | ".join(
            f"{s}{'c' if merges[s] else ''} {statistics.median(x):.1f} us {nbytes / statistics.median(x) / 1e3:.0f} GB/s"
            for s, x in times.items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", action="store_true")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(torch.cuda.get_device_name(), props.multi_processor_count, flush=True)
    print("mem clock", getattr(props, "memory_clock_rate", None), "bus", getattr(props, "memory_bus_width", None),
          flush=True)
    if args.graph:
        forced_in_graphs(args.head_dim, args.rounds)
    else:
        kvcache_do_bench(args.rounds)


if __name__ == "__main__":
    main()
