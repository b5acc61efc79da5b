"""A/B of FP8 forward configs against fp8_fwd_config_for's, 16K tokens, kernels called
directly (V transposed once, outside the timing), interleaved rounds, same process; each
variant's output compared with the default's (max |diff|: 0 means bit-identical). The
measurements behind fp8_fwd_config_for's double-buffered P at hd 128 and its tile choice
(perf/NOTES.md, session 15).

    python3 perf/ab_fp8_configs.py [rounds] [head dims] [variants]
    python3 perf/ab_fp8_configs.py 5 128,256,64 pdouble,psingle     # the P buffers
    python3 perf/ab_fp8_configs.py 5 128 192x96,192x128,s3           # tiles at hd 128

Variants ((head dim, features) -> a config, None where it does not apply):
    pdouble / psingle  the default with p_double_buffer on / off
    192x96, 192x128    three consumer warpgroups
    s3                 the default with three stages
"""
import dataclasses
import sys

import torch

sys.path.insert(0, "perf")
import harness  # noqa: E402
from cute_attn import api, launcher  # noqa: E402
from cute_attn.config import FwdConfig, fp8_fwd_config_for  # noqa: E402
from cute_attn.fp8 import quantize_fp8  # noqa: E402

VARIANTS = {
    "pdouble": lambda d, f: dataclasses.replace(fp8_fwd_config_for(d, f), p_double_buffer=True),
    "psingle": lambda d, f: dataclasses.replace(fp8_fwd_config_for(d, f), p_double_buffer=False),
    "192x96": lambda d, f: FwdConfig(tile_m=192, tile_n=96, num_stages=2) if d == 128 else None,
    "192x128": lambda d, f: FwdConfig(tile_m=192, tile_n=128, num_stages=2) if d == 128 else None,
    "s3": lambda d, f: dataclasses.replace(fp8_fwd_config_for(d, f), num_stages=3),
}


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    head_dims = harness.parse_int_list(sys.argv[2] if len(sys.argv) > 2 else "128")
    names = (sys.argv[3] if len(sys.argv) > 3 else "psingle,pdouble").split(",")
    print(torch.cuda.get_device_name(), flush=True)
    for d in head_dims:
        for causal in (False, True):
            h, s = 2048 // d, 16384
            q, k, v = harness.random_qkv(1, s, h, d, torch.bfloat16, seed=d)
            feat, args = api._features_and_args(causal, (-1, -1), 0.0, d ** -0.5)
            cu = launcher._unused_cu_seqlens(q.device)
            out, lse = torch.empty_like(q), torch.empty(1, h, s, device="cuda")
            q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
            sink = launcher._placeholder(q.device, (1,)).view(torch.float32)  # no sink (unread)
            call_args = (q8, k8, launcher.transpose_v_fp8(v8), out, lse, cu, cu, qd, kd, vd, sink,
                         args.max_seqlen_q, args.softmax_scale, 0.0, *args.window)
            configs = {"default": fp8_fwd_config_for(d, feat)}
            configs.update({n: c for n in names if (c := VARIANTS[n](d, feat)) is not None})
            fns, outs = {}, {}
            for name, cfg in configs.items():
                try:
                    fn = launcher.compile_fwd(launcher.FwdKey("e4m3", d, feat, cfg))
                    out.fill_(float("nan"))
                    fn(*call_args)
                    torch.cuda.synchronize()
                    fns[name], outs[name] = fn, out.clone()
                except Exception as exc:  # noqa: BLE001 - a config that does not build or launch
                    print(f"  {name}: {harness.reason(exc)}")
            diffs = {n: (o.float() - outs["default"].float()).abs().max().item() for n, o in outs.items()}
            flops = 4 * h * s * s * d / (2 if causal else 1)
            timers = {n: (lambda f: lambda: harness.do_bench(lambda: f(*call_args)))(f) for n, f in fns.items()}
            ms, failed = harness.run_rounds(timers, rounds)
            tf = {n: flops / harness.median_ms(m) / 1e9 for n, m in ms.items()}
            print(f"hd{d} {'causal' if causal else 'full'}: " + ", ".join(
                f"{n} {t:.0f} ({t / tf['default']:.3f}x, max|diff| {diffs[n]:.1e})" for n, t in tf.items()),
                failed or "", flush=True)


if __name__ == "__main__":
    main()
