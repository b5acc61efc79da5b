"""A/B of FwdConfig.p_double_buffer (two P register buffers) against the single-buffered FP8
forward, 16K tokens, kernels called directly (V transposed once, outside the timing),
interleaved rounds, same process; outputs compared bit for bit. The measurement behind
config.fp8_fwd_config_for's choice at hd 128 (perf/NOTES.md, session 15).

    python3 perf/ab_fp8_pbuffer.py [rounds]
"""
import dataclasses, sys, torch
sys.path.insert(0, "perf")
import harness
from cute_attn import launcher, api
from cute_attn.config import fp8_fwd_config_for
from cute_attn.fp8 import quantize_fp8

print(torch.cuda.get_device_name(), flush=True)
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7
for d, causal in ((128, False), (128, True), (256, False), (256, True), (64, False)):
    h, s = 2048 // d, 16384
    q, k, v = harness.random_qkv(1, s, h, d, torch.bfloat16, seed=d)
    feat, args = api._features_and_args(causal, (-1, -1), 0.0, d ** -0.5)
    cu = launcher._unused_cu_seqlens(q.device)
    out, lse = torch.empty_like(q), torch.empty(1, h, s, device="cuda")
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
    vt = launcher.transpose_v_fp8(v8)
    call_args = (q8, k8, vt, out, lse, cu, cu, qd, kd, vd, args.max_seqlen_q, args.softmax_scale, 0.0, *args.window)
    base = dataclasses.replace(fp8_fwd_config_for(d, feat), p_double_buffer=False)
    if not base.intra_wg_overlap:
        print(f"hd{d}: no intra-warpgroup overlap in its config, nothing to compare"); continue
    fns = {"default": launcher.compile_fwd(launcher.FwdKey("e4m3", d, feat, base)),
           "p_double": launcher.compile_fwd(launcher.FwdKey("e4m3", d, feat, dataclasses.replace(base, p_double_buffer=True)))}
    outs = {}
    for name, fn in fns.items():
        out.fill_(float("nan")); fn(*call_args); torch.cuda.synchronize(); outs[name] = out.clone()
    same = torch.equal(outs["default"], outs["p_double"])
    flops = 4 * h * s * s * d / (2 if causal else 1)
    timers = {n: (lambda f: lambda: harness.do_bench(lambda: f(*call_args)))(f) for n, f in fns.items()}
    ms, failed = harness.run_rounds(timers, ROUNDS)
    tf = {n: flops / harness.median_ms(m) / 1e9 for n, m in ms.items()}
    print(f"hd{d} {'causal' if causal else 'full  '}: default {tf['default']:.0f} TF/s, p_double {tf['p_double']:.0f} TF/s "
          f"({tf['p_double'] / tf['default']:.3f}x), bit-identical {same}", failed or "", flush=True)
