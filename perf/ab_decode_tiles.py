"""A/B of the split decode's tile (config.split_decode_config): mha's plan against the same
split count on the dense default tile, and SDPA, in CUDA graphs over rotating K/V copies
(bench_decode.graph_us), interleaved rounds, one query, causal. On the device:

    python3 perf/ab_decode_tiles.py [rounds]

Prints per shape the split count, whether the splits merge in a cluster, the max |out -
SDPA's out|, us and % of copy bandwidth for each, and the ratios (perf/NOTES.md, session 23)."""
import statistics
import sys

import torch

sys.path.insert(0, "perf")
import bench_decode as bd  # noqa: E402

import cute_attn  # noqa: E402
from cute_attn import api, launcher  # noqa: E402

# (batch, seqlen_k, heads, heads_kv, head_dim)
CASES = [(1, 2048, 32, 8, 128), (1, 8192, 32, 8, 128), (1, 16384, 32, 8, 128), (1, 8192, 64, 8, 64),
         (1, 32768, 64, 8, 64), (2, 8192, 64, 8, 64), (2, 32768, 64, 8, 64), (4, 32768, 64, 8, 64),
         (1, 131072, 64, 8, 64)]


def main(rounds: int) -> None:
    print(torch.cuda.get_device_name(), flush=True)
    copy = bd.copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sdpa = bd.impls()["sdpa"]
    for b, sk, h, hkv, d in CASES:
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        kvs = [tuple(torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
               for _ in range(bd.rotating_copies(2 * b * sk * hkv * d * 2, l2))]
        features, args = api._features_and_args(True, (-1, -1), 0.0, d ** -0.5)
        plan = launcher._plan(q, kvs[0][0], features, args, None, None)
        default_tile = launcher._default_fwd_config(q, kvs[0][0], features, 0)

        def on_default_tile(q, k, v):
            return launcher.run_fwd(q, k, v, features, args, config=default_tile, need_lse=False,
                                    num_splits=plan.num_splits)[0]

        fns = {"mha": lambda q, k, v: cute_attn.mha(q, k, v, causal=True), "default_tile": on_default_tile,
               "sdpa": sdpa}
        outs = {name: fn(q, *kvs[0]) for name, fn in fns.items()}
        err = max((outs[n].float() - outs["sdpa"].float()).abs().max().item() for n in ("mha", "default_tile"))
        times = {name: [] for name in fns}
        for r in range(rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                times[name].append(bd.graph_us(fns[name], q, kvs))
        nbytes = bd.moved_bytes(b, 1, sk, h, hkv, d)
        med = {name: statistics.median(x) for name, x in times.items()}
        print(f"b{b} k{sk} h{h}/{hkv} d{d} splits {plan.num_splits} cluster {plan.cluster_merge} max|d| {err:.1e}: "
              + " | ".join(f"{n} {m:.1f} us {100 * nbytes / m / 1e3 / copy:.0f}%" for n, m in med.items())
              + f" | mha/default_tile {med['default_tile'] / med['mha']:.3f}x mha/sdpa {med['sdpa'] / med['mha']:.3f}x",
              flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
