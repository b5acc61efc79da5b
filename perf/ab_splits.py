"""A/B of forced split-KV counts for decode shapes (mha_with_kvcache, full contiguous cache), the
measurement behind split_heuristic.memory_bound_ctas: python3 perf/ab_splits.py on the device."""
import sys, torch
sys.path.insert(0, "perf")
import harness
import cute_attn
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, flush=True)
p = torch.cuda.get_device_properties(0)
print("mem clock", getattr(p, "memory_clock_rate", None), "bus", getattr(p, "memory_bus_width", None), flush=True)
CASES = [((1, 1, 131072, 32, 8), (8, 12, 16)), ((1, 1, 32768, 32, 8), (8, 12, 16)),
         ((8, 1, 8192, 32, 8), (1, 2)), ((8, 1, 32768, 64, 8), (1, 2)), ((8, 1, 131072, 64, 8), (1, 2)),
         ((1, 16, 65536, 64, 8), (8, 16)), ((4, 1, 32768, 64, 8), (1, 2, 4))]
for (b, sq, sk, h, hkv), splits in CASES:
    q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    timers = {s: (lambda s: lambda: harness.do_bench(lambda: cute_attn.mha_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, num_splits=s)))(s) for s in splits}
    ms, _ = harness.run_rounds(timers, 5)
    nbytes = 2 * b * sk * hkv * 128 * 2
    print(f"b{b} q{sq} k{sk} h{h}/{hkv}: " + " | ".join(f"{s} splits {harness.median_ms(m)*1e3:7.1f} us {nbytes/harness.median_ms(m)/1e6:6.0f} GB/s" for s, m in ms.items()), flush=True)
