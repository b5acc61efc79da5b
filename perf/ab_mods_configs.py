"""A/B of the mods forward's config variants in the same interleaved rounds, on
perf/bench_masks.py's cases: the measurement behind the mods' config choices
(perf/NOTES.md holds each prediction). Each variant rewrites the config that
launcher.run_fwd_mods launches, through the grid rule it applies last
(config.with_persistent_grid); outputs are compared with the default's (max |diff|, 0
expected: same tiles, same order of blocks within a tile).

    python3 perf/ab_mods_configs.py [--rounds 5] [--cases bd,documents] [--variants persistent,mask_early]

Variants: default (the package's rule), copy (the default again: the noise floor),
persistent (a persistent grid of --ctas CTAs with the tile queue), mask_early
(FwdConfig.mask_before_scores).
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_masks  # noqa: E402
import harness  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ctas", type=int, default=132)
    p.add_argument("--cases", default="bd,documents", help="bench_masks case families")
    p.add_argument("--variants", default="persistent", help="comma list: persistent, mask_early")
    args = p.parse_args(argv)
    import cute_attn
    from cute_attn import launcher

    print(harness.cuda_setup("perf/ab_mods_configs.py"), flush=True)
    rule = launcher.with_persistent_grid

    variants = {
        "default": rule,
        "copy": rule,
        "persistent": lambda config, *a: dataclasses.replace(config, persistent_ctas=args.ctas, tile_queue=True),
        "mask_early": lambda config, *a: dataclasses.replace(rule(config, *a), mask_before_scores=True),
    }
    chosen = {n: variants[n] for n in ["default", "copy"] + args.variants.split(",")}

    for c in bench_masks.cases(tuple(args.cases.split(","))):
        b, s, h, d = c["batch"], c["seqlen"], c["nheads"], c["headdim"]
        q, k, v = harness.random_qkv(b, s, h, d, torch.bfloat16)
        mask_mod, score_mod, _, _ = bench_masks.mods_for(c)

        def call(grid_rule):
            launcher.with_persistent_grid = grid_rule
            try:
                return cute_attn.mha(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
            finally:
                launcher.with_persistent_grid = rule

        outs = {name: call(fn).float() for name, fn in chosen.items()}
        torch.cuda.synchronize()
        timers = {name: (lambda fn: lambda: harness.do_bench(lambda: call(fn)))(fn) for name, fn in chosen.items()}
        ms, failed = harness.run_rounds(timers, args.rounds)
        med = {n: harness.median_ms(m) for n, m in ms.items() if m}
        diff = max((o - outs["default"]).abs().max().item() for o in outs.values())
        cells = ", ".join(f"{n} {1e3 * t:.0f} us ({med['default'] / t:.3f}x)" for n, t in med.items())
        print(f"{c['case']}: {cells}, max |d| {diff:.0e}", {n: harness.reason(e) for n, e in failed.items()} or "",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
