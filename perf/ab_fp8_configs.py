"""A/B of FP8 forward tile configs at hd 128 (three consumer warpgroups: 192-row tiles; three
stages) against fp8_fwd_config_for's, 16K tokens, kernels called directly (V transposed
once, outside the timing), interleaved rounds, same process (perf/NOTES.md, session 15).

    python3 perf/ab_fp8_configs.py [rounds]
"""
import dataclasses, sys, torch
sys.path.insert(0, "perf")
import harness
from cute_attn import launcher, api
from cute_attn.config import fp8_fwd_config_for, FwdConfig
from cute_attn.fp8 import quantize_fp8

print(torch.cuda.get_device_name(), flush=True)
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
CANDIDATES = {"192x96": FwdConfig(tile_m=192, tile_n=96, num_stages=2),
              "192x128": FwdConfig(tile_m=192, tile_n=128, num_stages=2),
              "128x224s3": FwdConfig(tile_m=128, tile_n=224, num_stages=3),
              "128x128s3": FwdConfig(tile_m=128, tile_n=128, num_stages=3)}
for d, causal in ((128, False), (128, True)):
    h, s = 2048 // d, 16384
    q, k, v = harness.random_qkv(1, s, h, d, torch.bfloat16, seed=d)
    feat, args = api._features_and_args(causal, (-1, -1), 0.0, d ** -0.5)
    cu = launcher._unused_cu_seqlens(q.device)
    out, lse = torch.empty_like(q), torch.empty(1, h, s, device="cuda")
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    vt = launcher.transpose_v_fp8(v8)
    call_args = (q8, k8, vt, out, lse, cu, cu, qd, kd, vd, args.max_seqlen_q, args.softmax_scale, 0.0, *args.window)
    configs = {"default": fp8_fwd_config_for(d, feat)}
    configs.update(CANDIDATES)
    fns, outs = {}, {}
    for name, cfg in configs.items():
        try:
            fns[name] = launcher.compile_fwd(launcher.FwdKey("e4m3", d, feat, cfg))
        except Exception as exc:  # noqa: BLE001
            print(f"  {name}: does not compile ({harness.reason(exc)})")
    for name, fn in list(fns.items()):
        try:
            out.fill_(float("nan")); fn(*call_args); torch.cuda.synchronize(); outs[name] = out.clone()
        except Exception as exc:  # noqa: BLE001
            print(f"  {name}: does not launch ({harness.reason(exc)})"); del fns[name]
    diffs = {n: (o.float() - outs["default"].float()).abs().max().item() for n, o in outs.items()}
    flops = 4 * h * s * s * d / (2 if causal else 1)
    timers = {n: (lambda f: lambda: harness.do_bench(lambda: f(*call_args)))(f) for n, f in fns.items()}
    ms, failed = harness.run_rounds(timers, ROUNDS)
    tf = {n: flops / harness.median_ms(m) / 1e9 for n, m in ms.items()}
    print(f"hd{d} {'causal' if causal else 'full'}: " + ", ".join(
        f"{n} {t:.0f} ({t / tf['default']:.3f}x, max|diff| {diffs[n]:.1e})" for n, t in tf.items()), failed or "", flush=True)
