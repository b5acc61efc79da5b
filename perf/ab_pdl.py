"""A/B of the split-KV launch with and without programmatic dependent launch
(FwdConfig.programmatic_launch), in CUDA graphs over rotating K/V copies
(bench_decode.graph_us) and in do_bench, interleaved rounds, one process. On the device:

    python3 perf/ab_pdl.py [rounds]

Both sides run mha's own plan for the shape (split count, tile, cluster merge); only the
compiled kernel differs: "off" is the same config with programmatic_launch=False. Prints
us, % of copy bandwidth and on/off per shape, and SDPA's time beside them."""
import dataclasses
import statistics
import sys

import torch

sys.path.insert(0, "perf")
import bench_decode as bd  # noqa: E402
import harness  # noqa: E402

from cute_attn import api, config, launcher  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim): issue 12's split rows
CASES = [(1, 1, 32768, 32, 8, 128), (1, 1, 131072, 32, 8, 128), (1, 1, 8192, 32, 8, 128),
         (1, 1, 32768, 64, 8, 64), (1, 16, 65536, 64, 8, 128), (2, 1, 16384, 32, 8, 128)]


def plans(q, k, features, args):
    """(mha's plan, the same plan with the kernel built without programmatic launch)."""
    on = launcher._plan(q, k, features, args, None, None)
    saved = launcher.split_config
    launcher.split_config = lambda c: dataclasses.replace(saved(c), programmatic_launch=False)
    launcher._plans.clear()
    launcher._split_kernels.clear()
    try:
        off = launcher._plan(q, k, features, args, None, None)
    finally:
        launcher.split_config = saved
        launcher._plans.clear()
        launcher._split_kernels.clear()
    assert on.num_splits == off.num_splits and on.fn is not off.fn
    return on, off


def main(rounds: int) -> None:
    print(torch.cuda.get_device_name(), flush=True)
    copy = bd.copy_bandwidth_gbs()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sdpa = bd.impls()["sdpa"]
    for b, sq, sk, h, hkv, d in CASES:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        kvs = [tuple(torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
               for _ in range(bd.rotating_copies(2 * b * sk * hkv * d * 2, l2))]
        features, args = api._features_and_args(True, (-1, -1), 0.0, d ** -0.5)
        on, off = plans(q, kvs[0][0], features, args)
        if on.num_splits == 1:
            print(f"b{b} q{sq} k{sk} d{d}: unsplit, skipped", flush=True)
            continue
        fns = {
            "pdl": lambda q, k, v: launcher._run_fwd_split(q, k, v, features, args, on, need_lse=False)[0],
            "no_pdl": lambda q, k, v: launcher._run_fwd_split(q, k, v, features, args, off, need_lse=False)[0],
            "sdpa": sdpa,
        }
        outs = {name: fn(q, *kvs[0]) for name, fn in fns.items()}
        same = torch.equal(outs["pdl"], outs["no_pdl"])
        err = (outs["pdl"].float() - outs["sdpa"].float()).abs().max().item()
        graph = {name: [] for name in fns}
        bench = {name: [] for name in fns}
        for r in range(rounds):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                graph[name].append(bd.graph_us(fns[name], q, kvs))
                bench[name].append(1e3 * harness.do_bench(lambda: fns[name](q, *kvs[0])))
        nbytes = bd.moved_bytes(b, sq, sk, h, hkv, d)
        g = {n: statistics.median(x) for n, x in graph.items()}
        t = {n: statistics.median(x) for n, x in bench.items()}
        print(f"b{b} q{sq} k{sk} h{h}/{hkv} d{d} splits {on.num_splits} cluster {on.cluster_merge} "
              f"bit-identical {same} max|d-sdpa| {err:.1e}\n  graph: "
              + " | ".join(f"{n} {m:.1f} us {100 * nbytes / m / 1e3 / copy:.0f}%" for n, m in g.items())
              + f" | pdl/no_pdl {g['no_pdl'] / g['pdl']:.3f}x vs sdpa {g['sdpa'] / g['pdl']:.3f}x\n  do_bench: "
              + " | ".join(f"{n} {m:.1f} us" for n, m in t.items())
              + f" | pdl/no_pdl {t['no_pdl'] / t['pdl']:.3f}x vs sdpa {t['sdpa'] / t['pdl']:.3f}x", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
