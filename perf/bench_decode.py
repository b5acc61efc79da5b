"""Decode / small-grid forward benchmark (issue 12): few queries against many keys, where
the work is reading K and V once and the grid of one CTA per (query tile, KV head) is far
too small for the GPU without split-KV.

    python3 perf/bench_decode.py --out $OUT          # on the GPU machine

Per shape: cute_attn.mha (contiguous K/V; split-KV chosen automatically), the same through
mha_with_kvcache (a full contiguous cache, lengths from a device tensor), and paged
(the same K/V memory seen as pages of 16, 64 or 256 keys, the page table a random
permutation of them, so consecutive pages of an entry lie anywhere in the pool), FA4 (no
split-KV on sm90), torch SDPA (its own backend choice, enable_gqa), each timed by
do_bench (median) in interleaved rounds in this process.

    python3 perf/bench_decode.py --grid --out $OUT   # the cuDNN decode sweep's grid
    python3 perf/bench_decode.py --quick --host-overhead --out $OUT   # + a decode step's host time
    python3 perf/bench_decode.py --quick --graph --out $OUT   # + each call captured in a CUDA graph

--graph adds a second timing per implementation: GRAPH_CALLS calls captured in one CUDA
graph and replayed (median of GRAPH_REPLAYS replays, per call), as a serving engine runs
its decode steps. No flush kernel is in that window (do_bench's L2 flush is a 256-MB
memset whose dirty lines the timed call's reads must write back, and its window holds the
launch); instead the captured calls cycle through copies of K and V, enough that a call
finds no recent call's keys in L2 (rotating_copies). session 21's probe: b1 x 32K 64.5 us
in do_bench against 55.2 in a graph (perf/NOTES.md).

--grid runs the grid of NVIDIA's cuDNN 9.27 decode sweep (batch 1/8/32/128 x keys
2K/8K/32K/128K x 1/8/16 queries, 64/8 heads, hd 128; the points that fit in memory) with
the paged and contiguous cache paths and SDPA only, and records the published cuDNN
bandwidths where the issue quotes them (H200, paged, page 16). Reported: microseconds, GB/s of the bytes that must
move (K and V read once, plus q and out), and that as a share of the copy bandwidth
measured in the same run (a device-to-device copy of 2 GiB: read + write bytes / time).
Masks are bottom-right causal (the decode convention); SDPA's is_causal is top-left, so it
runs unmasked, which for seqlen_q = 1 is the same attention and for 16 queries against
64K keys reads the same bytes. Writes decode-<device>.json.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim): the table, then the
# batch-64 and cuDNN-sweep-like points
SHAPES = [
    (1, 1, 131072, 32, 8, 128),
    (1, 1, 32768, 32, 8, 128),
    (8, 1, 8192, 32, 8, 128),
    (1, 16, 65536, 64, 8, 128),
    (64, 1, 4096, 32, 8, 128),
    (1, 1, 8192, 64, 8, 128),
    (8, 8, 32768, 64, 8, 128),
    (32, 16, 8192, 64, 8, 128),
    # batch 1 against a short cache, where a split decode's fixed cost shows (perf/NOTES.md,
    # session 22), and a head-dim-64 decode (gpt-oss: 64/8 heads)
    (1, 1, 2048, 32, 8, 128),
    (1, 1, 32768, 64, 8, 64),
]
QUICK = SHAPES[:4]
GRID = [(b, sq, sk, 64, 8, 128) for b in (1, 8, 32, 128) for sk in (2048, 8192, 32768, 131072) for sq in (1, 8, 16)]
PAGE_SIZES = (16, 64, 256)
GRID_IMPLS = ("cute_attn_kvcache", "cute_attn_paged16", "cute_attn_paged64", "sdpa")
# cuDNN 9.27 on an H200, paged (page 16), 64/8 heads, hd 128, one query: GB/s as issue 12
# quotes NVIDIA's published sweep (cudnn-frontend benchmark/attention_inference/results/
# decode_sweep/h200); keys None: the issue gives batch 128's figure without a key count
CUDNN_H200_PUBLISHED = {(1, 1, 32768): 3250, (1, 1, 131072): 4100, (128, 1, None): 4500}


def published_gbs(batch: int, seqlen_q: int, seqlen_k: int):
    """cuDNN's published H200 bandwidth at this grid point (CUDNN_H200_PUBLISHED), or None."""
    return CUDNN_H200_PUBLISHED.get((batch, seqlen_q, seqlen_k), CUDNN_H200_PUBLISHED.get((batch, seqlen_q, None)))


GRAPH_CALLS = 20
GRAPH_REPLAYS = 5


def rotating_copies(kv_bytes: int, l2_bytes: int, calls: int = GRAPH_CALLS) -> int:
    """How many copies of K and V a graph of `calls` calls cycles through so that a call's
    keys have left L2 since the last call that read them: the other copies read between
    two reads of one copy hold at least twice the L2 (one copy when K and V alone do: the
    call's own later reads evict its earlier ones); at most one copy per call."""
    if kv_bytes <= 0 or kv_bytes >= 2 * l2_bytes:
        return 1
    return min(calls, 1 + -(-2 * l2_bytes // kv_bytes))


def graph_us(fn, q, kvs, calls: int = GRAPH_CALLS, replays: int = GRAPH_REPLAYS) -> float:
    """Microseconds per call of `calls` calls of fn captured in one CUDA graph, call i on
    K/V copy i mod len(kvs) (rotating_copies), replayed `replays` times (median)."""
    import statistics

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: compiles, plans, workspaces
        for k, v in kvs:
            fn(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(q, *kvs[i % len(kvs)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = harness.do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def moved_bytes(b, sq, sk, h, hkv, d) -> int:
    return 2 * (b * sk * hkv * d * 2) + 2 * (b * sq * h * d * 2)


_lengths: dict = {}
_tables: dict = {}


def full_lengths(q, k):
    key = (q.shape[0], k.shape[1])
    if key not in _lengths:
        _lengths[key] = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
    return _lengths[key]


def as_pages(k, v, page_size):
    """k, v's memory as (num_pages, page_size, heads_kv, d) pages and a page table that is a
    random permutation of them (no copy: the keys an entry sees are the pool's pages in
    the table's order, which correct_keys gathers for the error check)."""
    b, sk, hkv, d = k.shape
    key = (b, sk, page_size)
    if key not in _tables:
        gen = torch.Generator(device="cuda").manual_seed(sk + page_size)
        _tables[key] = torch.randperm(b * sk // page_size, device="cuda", generator=gen).to(torch.int32).view(b, -1)
    shape = (b * sk // page_size, page_size, hkv, d)
    return k.view(shape), v.view(shape), _tables[key]


def entry0_keys(name, k, v):
    """Entry 0's keys and values as the impl `name` sees them (paged: gathered)."""
    if not name.startswith("cute_attn_paged"):
        return k[:1], v[:1]
    pages_k, pages_v, table = as_pages(k, v, int(name.removeprefix("cute_attn_paged")))
    rows = table[0].long()
    return (p[rows].reshape(1, -1, *p.shape[2:]) for p in (pages_k, pages_v))


def impls():
    import cute_attn
    from cute_attn import launcher

    def unsplit(q, k, v):
        # the same forward without split-KV (what mha ran before it, but for packed rows of one
        # query on 64-row tiles since session 20: config.unsplit_decode_config): the split's gain
        features, run_args = cute_attn.api._features_and_args(True, (-1, -1), 0.0, q.shape[-1] ** -0.5)
        return launcher.run_fwd(q, k, v, features, run_args, need_lse=False, num_splits=1)[0]

    def kvcache(q, k, v):
        # the same keys as a full KV cache (no append): mha_with_kvcache's kv_lengths path
        return cute_attn.mha_with_kvcache(q, k, v, cache_seqlens=full_lengths(q, k), causal=True)

    out = {"cute_attn": lambda q, k, v: cute_attn.mha(q, k, v, causal=True), "cute_attn_unsplit": unsplit,
           "cute_attn_kvcache": kvcache}
    for page_size in PAGE_SIZES:
        def paged(q, k, v, page_size=page_size):
            pages_k, pages_v, table = as_pages(k, v, page_size)
            return cute_attn.mha_with_kvcache(q, pages_k, pages_v, cache_seqlens=full_lengths(q, k),
                                              page_table=table, causal=True)
        out[f"cute_attn_paged{page_size}"] = paged
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            r = flash_attn_func(q, k, v, causal=True)
            return r[0] if isinstance(r, tuple) else r
        out["fa4"] = fa4
    except ImportError as exc:
        harness.log(f"fa4 unavailable: {exc}")

    def sdpa(q, k, v):
        causal = q.shape[1] == k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    out["sdpa"] = sdpa
    return out


# the decode step of issue 12's host-time target: batch 1, one query, 32/8 heads, hd 128,
# a 1K-key cache with 1000 filled: its GPU time is well under the host time of any call
HOST_STEP = {"batch": 1, "seqlen_cache": 1024, "filled": 1000, "heads": 32, "heads_kv": 8, "head_dim": 128}


def decode_host_overhead() -> dict:
    """Host time per call (harness.host_us_per_call, a loop with one sync at each end) of
    the decode step HOST_STEP: mha_with_kvcache attend-only and with a one-token append,
    mha at one query over the same keys, and SDPA over them (the anchor)."""
    import cute_attn

    s = HOST_STEP
    b, d = s["batch"], s["head_dim"]
    q = torch.randn(b, 1, s["heads"], d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, s["seqlen_cache"], s["heads_kv"], d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    k_new, v_new = (torch.randn(b, 1, s["heads_kv"], d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((b,), s["filled"], dtype=torch.int32, device="cuda")
    keys = k_cache[:, :s["filled"]], v_cache[:, :s["filled"]]
    calls = {
        # the append writes the same slot every call (lengths never change here)
        "cute_attn_kvcache_append": lambda: cute_attn.mha_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                                       cache_seqlens=lengths, causal=True),
        "cute_attn_kvcache": lambda: cute_attn.mha_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                                causal=True),
        "cute_attn_mha": lambda: cute_attn.mha(q, *keys, causal=True),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys[0].transpose(1, 2), keys[1].transpose(1, 2), enable_gqa=True),
    }
    us = {name: harness.host_us_per_call(fn) for name, fn in calls.items()}
    for name, value in us.items():
        harness.log(f"host: {name:26s} {value:6.1f} us/call")
    return {"step": s, "calls": harness.HOST_CALLS, "warmup_calls": harness.HOST_WARMUP_CALLS,
            "method": "wall clock of a host loop, torch.cuda.synchronize before and after", "us_per_call": us}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="the issue's four shapes only")
    p.add_argument("--grid", action="store_true", help="the cuDNN decode sweep's grid (paged, kvcache, SDPA)")
    p.add_argument("--published", action="store_true",
                   help="with --grid: only the points with a published cuDNN figure (CUDNN_H200_PUBLISHED)")
    p.add_argument("--graph", action="store_true",
                   help="also time each implementation in a CUDA graph of GRAPH_CALLS calls (graph_us)")
    p.add_argument("--host-overhead", action="store_true",
                   help="first measure the host time per call of a tiny decode step (HOST_STEP)")
    args = p.parse_args(argv)
    from cute_attn import launcher
    from cute_attn.reference import attention_ref

    device = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth_gbs()
    harness.log(f"{device}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    host = decode_host_overhead() if args.host_overhead else None
    fns = impls()
    if args.grid:
        fns = {n: f for n, f in fns.items() if n in GRID_IMPLS}
    records, path = [], None
    shapes = GRID if args.grid else QUICK if args.quick else SHAPES
    if args.published:
        if not args.grid:
            p.error("--published selects points of --grid")
        shapes = [s for s in GRID if published_gbs(*s[:3]) is not None]
    for b, sq, sk, h, hkv, d in shapes:
        kv_bytes = 2 * b * sk * hkv * d * 2
        if 3 * kv_bytes > torch.cuda.mem_get_info()[0]:  # K, V and SDPA's working room
            harness.log(f"b{b} q{sq} k{sk}: skipped, {kv_bytes / 2**30:.0f} GiB of K/V does not fit")
            continue
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        features, run_args = __import__("cute_attn").api._features_and_args(True, (-1, -1), 0.0, d ** -0.5)
        splits = launcher.choose_splits(q, k, features, run_args, launcher._default_fwd_config(q, k, features))
        timers, errors = {}, {}
        for name, fn in fns.items():
            try:
                ref, _ = attention_ref(q[:1], *entry0_keys(name, k, v), causal=True)
                err = (fn(q, k, v)[:1].float() - ref).abs().max().item()
                if err > 0.05:
                    raise RuntimeError(f"wrong result (max error {err:.3g})")
                timers[name] = (lambda f: lambda: harness.do_bench(lambda: f(q, k, v)))(fn)
            except Exception as exc:  # noqa: BLE001
                errors[name] = harness.reason(exc)
        ms_rounds, failed = harness.run_rounds(timers, args.rounds)
        errors.update({n: harness.reason(e) for n, e in failed.items()})
        nbytes = moved_bytes(b, sq, sk, h, hkv, d)
        # host time of the decode call (a loop of calls with one sync at the end; above
        # the GPU time it would be what the timings measure)
        host_name = "cute_attn_kvcache" if args.grid else "cute_attn"
        host_us = harness.host_us_per_call(lambda: fns[host_name](q, k, v), 300, 20)
        rec = {"batch": b, "seqlen_q": sq, "seqlen_k": sk, "heads": h, "heads_kv": hkv, "head_dim": d,
               "causal": True, "bytes": nbytes, "cute_attn_splits": splits, "cute_attn_host_us": host_us, "skipped": errors, "impls": {}}
        kvs = [(k, v)]
        if args.graph:
            copies = rotating_copies(kv_bytes, torch.cuda.get_device_properties(0).L2_cache_size)
            if copies > 1 and (copies - 1) * kv_bytes * 1.5 < torch.cuda.mem_get_info()[0]:
                kvs += [(k.clone(), v.clone()) for _ in range(copies - 1)]
        cells = []
        for name, ms in ms_rounds.items():
            med = harness.median_ms(ms)
            gbs = nbytes / (med * 1e-3) / 1e9
            rec["impls"][name] = {"us": med * 1e3, "ms_rounds": ms, "gbs": gbs, "pct_copy_bw": 100 * gbs / copy_gbs}
            cell = f"{name} {med * 1e3:8.1f} us {gbs:6.0f} GB/s ({100 * gbs / copy_gbs:3.0f}%)"
            if args.graph:
                try:
                    g_us = graph_us(fns[name], q, kvs)
                    g_gbs = nbytes / (g_us * 1e-6) / 1e9
                    rec["impls"][name].update(graph_us=g_us, graph_gbs=g_gbs, graph_pct_copy_bw=100 * g_gbs / copy_gbs,
                                              graph_kv_copies=len(kvs))
                    cell += f" [graph {g_us:.1f} us {100 * g_gbs / copy_gbs:3.0f}%]"
                except Exception as exc:  # noqa: BLE001
                    rec["impls"][name]["graph_error"] = harness.reason(exc)
                    cell += " [graph: failed]"
            cells.append(cell)
        kvs = None
        harness.log(f"b{b} q{sq} k{sk} h{h}/{hkv} d{d} splits {splits} host {host_us:.1f} us: " + " | ".join(cells)
                    + (f"  skipped {errors}" if errors else ""))
        published = published_gbs(b, sq, sk)
        if published is not None:
            rec["cudnn_h200_published_gbs"] = published
        records.append(rec)
        q = k = v = None  # free them before the next shape
        _tables.clear()
        _lengths.clear()
        # rewritten after every shape: a run cut short by a time limit keeps what it measured
        path = write_results(args, device, copy_gbs, host, records)
    if path is not None:
        harness.log(f"wrote {path}")
    return 0


def write_results(args, device, copy_gbs, host, records):
    """The results document so far (None without --out)."""
    if not args.out:
        return None
    doc = {"device": device, "copy_bandwidth_gbs": copy_gbs, "torch": torch.__version__,
           "method": f"do_bench median, {args.rounds} interleaved rounds, bf16, random normal inputs"
                     + (f"; graph_us: {GRAPH_CALLS} calls in one CUDA graph over rotating K/V copies, median of "
                        f"{GRAPH_REPLAYS} replays" if args.graph else ""),
           "records": records}
    if host is not None:
        doc["host"] = host
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{harness.device_slug(device)}-decode{'-grid' if args.grid else ''}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


if __name__ == "__main__":
    sys.exit(main())
