"""A/B of FP8 forward configs against fp8_fwd_config_for's, 16K tokens, kernels called
directly (V transposed once, outside the timing), interleaved rounds, same process; each
variant's output compared with the default's (max |diff|: 0 means bit-identical). The
measurements behind fp8_fwd_config_for's double-buffered P at hd 128 and its tile choice
(perf/NOTES.md, session 15).

    python3 perf/ab_fp8_configs.py [rounds] [head dims] [variants] [seqlens (16K tokens each)]
    python3 perf/ab_fp8_configs.py 5 128,256,64 pdouble,psingle     # the P buffers
    python3 perf/ab_fp8_configs.py 5 128 192x96,192x128,s3           # tiles at hd 128

"default" is what mha runs (fp8_fwd_config_for on fp8_with_persistent_grid's grid). Variants
((head dim, features) -> a config, None where it does not apply):
    pdouble / psingle  fp8_fwd_config_for's tiles, one tile per CTA, p_double_buffer on / off
                       (one buffer with the late PV wait where mha takes it, two without)
    192x96, 192x128    three consumer warpgroups
    s3                 fp8_fwd_config_for's tiles with three stages, one tile per CTA
    persist            a persistent grid (one CTA per SM; causal: the tile queue), one P buffer
                       (two spill at hd 128 x 224 there)
    nopp / noiwo       the default without ping-pong / without intra-warpgroup overlap
    pvlate             the default with the PV wait pinned below the exp2s (pv_wait_after_softmax)
Or fields of the default joined by '+': n<keys>, m<rows>, s<stages>, pp0/pp1 (pingpong),
late0/late1 (pv_wait_after_softmax), tree0/tree1 (tree_row_sums), e.g. n192+pp0.
"""
import dataclasses
import sys

import torch

sys.path.insert(0, "perf")
import harness  # noqa: E402
from cute_attn import api, launcher  # noqa: E402
from cute_attn.config import FwdConfig, fp8_fwd_config_for  # noqa: E402
from cute_attn.config import fp8_late_pv_wait, fp8_with_persistent_grid  # noqa: E402
from cute_attn.tuning import gpu_sm_count  # noqa: E402


def _default(d, f):
    """What mha runs: fp8_fwd_config_for's tiles on fp8_with_persistent_grid's grid."""
    return fp8_with_persistent_grid(fp8_fwd_config_for(d, f), d, f, gpu_sm_count(0))
from cute_attn.fp8 import quantize_fp8  # noqa: E402

VARIANTS = {
    "pdouble": lambda d, f: dataclasses.replace(fp8_fwd_config_for(d, f), p_double_buffer=True,
                                                pv_wait_after_softmax=False),
    "psingle": lambda d, f: dataclasses.replace(fp8_fwd_config_for(d, f), p_double_buffer=False,
                                                pv_wait_after_softmax=fp8_late_pv_wait(d, False)),
    "192x96": lambda d, f: FwdConfig(tile_m=192, tile_n=96, num_stages=2) if d == 128 else None,
    "192x128": lambda d, f: FwdConfig(tile_m=192, tile_n=128, num_stages=2) if d == 128 else None,
    "s3": lambda d, f: dataclasses.replace(fp8_fwd_config_for(d, f), num_stages=3),
    "persist": lambda d, f: dataclasses.replace(fp8_fwd_config_for(d, f), persistent_ctas=gpu_sm_count(0),
                                                tile_queue=f.mask == "causal", p_double_buffer=False,
                                                pv_wait_after_softmax=fp8_late_pv_wait(d, False)),
    "nopp": lambda d, f: dataclasses.replace(_default(d, f), pingpong=False),
    "pvlate": lambda d, f: dataclasses.replace(_default(d, f), pv_wait_after_softmax=True),
    "noiwo": lambda d, f: dataclasses.replace(_default(d, f), intra_wg_overlap=False, p_double_buffer=False,
                                              pv_wait_after_softmax=False),
}


# fields a variant may set on the default, as <prefix><int>: n224, s3, pp0, late1, tree1
FIELDS = {"n": "tile_n", "m": "tile_m", "s": "num_stages", "pp": "pingpong", "late": "pv_wait_after_softmax",
          "tree": "tree_row_sums"}
FLAGS = ("pingpong", "pv_wait_after_softmax", "tree_row_sums")


def variant(name, d, f):
    """A named variant, or changes to the default joined by '+' (n192+late1+pp0); None where
    it does not apply."""
    if name in VARIANTS:
        return VARIANTS[name](d, f)
    return harness.config_variant(_default(d, f), name, FIELDS, FLAGS)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    head_dims = harness.parse_int_list(sys.argv[2] if len(sys.argv) > 2 else "128")
    names = (sys.argv[3] if len(sys.argv) > 3 else "psingle,pdouble").split(",")
    seqlens = harness.parse_int_list(sys.argv[4] if len(sys.argv) > 4 else "16384")
    print(torch.cuda.get_device_name(), flush=True)
    for d, s in [(d, s) for d in head_dims for s in seqlens]:
        for causal in (False, True):
            h, b = 2048 // d, max(16384 // s, 1)
            q, k, v = harness.random_qkv(b, s, h, d, torch.bfloat16, seed=d)
            feat, args = api._features_and_args(causal, (-1, -1), 0.0, d ** -0.5)
            cu = launcher._unused_cu_seqlens(q.device)
            out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
            q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
            sink = launcher._placeholder(q.device, (1,)).view(torch.float32)  # no sink (unread)
            call_args = (q8, k8, launcher.transpose_v_fp8(v8), out, lse, cu, cu, qd, kd, vd, sink,
                         args.max_seqlen_q, args.softmax_scale, 0.0, *args.window)
            configs = {"default": _default(d, feat)}
            configs.update({n: c for n in names if (c := variant(n, d, feat)) is not None})
            fns, outs = {}, {}
            for name, cfg in configs.items():
                # a tile queue's counter travels in cu_seqlens_q's slot (launcher._tile_queue)
                cfg_args = (call_args[:5] + (launcher._tile_queue(q.device),) + call_args[6:]
                            if cfg.tile_queue else call_args)
                try:
                    fn = launcher.compile_fwd(launcher.FwdKey("e4m3", d, feat, cfg))
                    out.fill_(float("nan"))
                    fn(*cfg_args)
                    torch.cuda.synchronize()
                    fns[name], outs[name] = (lambda f, a: lambda: f(*a))(fn, cfg_args), out.clone()
                except Exception as exc:  # noqa: BLE001 - a config that does not build or launch
                    print(f"  {name}: {harness.reason(exc)}")
            diffs = {n: (o.float() - outs["default"].float()).abs().max().item() for n, o in outs.items()}
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            timers = {n: (lambda f: lambda: harness.do_bench(f))(f) for n, f in fns.items()}
            ms, failed = harness.run_rounds(timers, rounds)
            tf = {n: flops / harness.median_ms(m) / 1e9 for n, m in ms.items()}
            print(f"hd{d} {s // 1024}K {'causal' if causal else 'full'}: " + ", ".join(
                f"{n} {t:.0f} ({t / tf['default']:.3f}x, max|diff| {diffs[n]:.1e})" for n, t in tf.items()),
                failed or "", flush=True)


if __name__ == "__main__":
    main()
