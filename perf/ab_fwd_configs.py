"""A/B of bf16 forward tile configs against fwd_config_for's, with FlashAttention-4 in the
same interleaved rounds: the measurements behind a tile choice in config._fwd_tile_config
(perf/NOTES.md records the prediction made before each run). 16K tokens and 2048 / head dim
heads per shape, kernels called through launcher.run_fwd with the config forced;
each variant's output is compared with the default's (max |diff|; bf16 rounding of a
different block order is ~1e-3 on these inputs, a wrong kernel is O(1)).

    python3 perf/ab_fwd_configs.py [--rounds 5] [--headdims 128] [--seqlens 4096,16384]
                                   [--variants n144,n176,s3] [--causal 0,1] [--base table|mha]

A variant name is a field and a value, applied to the default: n<keys> (tile_n),
m<rows> (tile_m), s<stages> (num_stages), p<ctas> (persistent_ctas: 132 on an H100 SXM or
H200; q<ctas>: the same with the tile queue), pvlate (pv_wait_after_softmax), pp0 / pp1 (ping-pong off / on); joined by
`+`, several at once (p132+pvlate). `copy` is the default itself timed again
under another name: the same-config spread of a run, the noise floor against which the
other variants' ratios are read.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

FIELDS = {"n": "tile_n", "m": "tile_m", "s": "num_stages", "p": "persistent_ctas", "pp": "pingpong",
          "late": "pv_wait_after_softmax", "queue": "tile_queue"}
FLAGS = ("pingpong", "pv_wait_after_softmax", "tile_queue")


def variant(base, name: str):
    if name == "copy":
        return base
    # q<ctas>: persistent with the tile queue; pvlate: the late PV wait
    parts = [f"p{part[1:]}+queue1" if part[:1] == "q" else "late1" if part == "pvlate" else part
             for part in name.split("+")]
    return harness.config_variant(base, "+".join(parts), FIELDS, FLAGS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--headdims", type=harness.parse_int_list, default=[128])
    p.add_argument("--seqlens", type=harness.parse_int_list, default=[4096, 16384])
    p.add_argument("--causal", type=harness.parse_flag_list, default=[0, 1])
    p.add_argument("--variants", default="n176")
    p.add_argument("--base", choices=("table", "mha"), default="table",
                   help="table: fwd_config_for's tiles, one tile per CTA; mha: what mha runs at each key length")
    args = p.parse_args(argv)
    from cute_attn import launcher
    from cute_attn.config import AttnFeatures, fwd_config_for, with_persistent_grid
    from cute_attn.tuning import gpu_sm_count

    print(harness.cuda_setup("perf/ab_fwd_configs.py"), flush=True)
    impls, _ = harness.load_impls(("fa4",))
    for d in args.headdims:
        for causal in map(bool, args.causal):
            features = AttnFeatures(mask="causal" if causal else "none")
            run_args = launcher.RunArgs(softmax_scale=d ** -0.5)
            for s in args.seqlens:
                base = fwd_config_for(d, features)
                if args.base == "mha":  # its grid depends on the key length (config.long_unmasked_tiles)
                    base = with_persistent_grid(base, d, features, gpu_sm_count(0), s)
                configs = {"default": base}
                for name in args.variants.split(","):
                    if name == "copy" or variant(base, name) not in configs.values():  # not the default renamed
                        configs[name] = variant(base, name)
                b, h = harness.TOKENS // s, harness.HIDDEN // d  # 10 heads at 192 (2048 / 192 rounded down)
                q, k, v = harness.random_qkv(b, s, h, d, torch.bfloat16)
                flops = harness.attention_flops(b, h, s, s, d, causal)
                timers, outs = {}, {}
                for name, cfg in configs.items():
                    try:
                        outs[name] = launcher.run_fwd(q, k, v, features, run_args, cfg)[0].float()
                        torch.cuda.synchronize()
                        timers[name] = (lambda c: lambda: harness.do_bench(
                            lambda: launcher.run_fwd(q, k, v, features, run_args, c)))(cfg)
                    except Exception as exc:  # noqa: BLE001 - a config that does not build or launch
                        print(f"  {name}: {harness.reason(exc)}", flush=True)
                for name, impl in impls.items():
                    timers[name] = harness.make_impl_timer(impl, "fwd", q, k, v, causal)
                ms, failed = harness.run_rounds(timers, args.rounds)
                tf = {n: harness.tflops(flops, harness.median_ms(m)) for n, m in ms.items() if m}
                diffs = {n: (o - outs["default"]).abs().max().item() for n, o in outs.items()}
                cells = [f"{n} {t:.0f} ({t / tf['default']:.3f}x"
                         + (f", |d| {diffs[n]:.0e})" if n in diffs else ")") for n, t in tf.items()]
                print(f"hd{d} {'causal' if causal else 'full'} {s}: " + ", ".join(cells),
                      {n: harness.reason(e) for n, e in failed.items()} or "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
