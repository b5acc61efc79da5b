"""A/B of the mods forward (block diffusion, documents) with one tile per CTA against a
persistent grid with the tile queue (FwdConfig.persistent_ctas / tile_queue), in the
same interleaved rounds: the measurement behind the mods' grid choice (perf/NOTES.md
holds the prediction). Each variant replaces the grid rule (config.with_persistent_grid)
that launcher.run_fwd_mods applies; outputs are compared (max |diff|, 0 expected: same tiles,
same order of blocks within a tile).

    python3 perf/ab_mods_persistent.py [--rounds 5] [--ctas 132]
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
    args = p.parse_args(argv)
    import cute_attn
    from cute_attn import launcher

    print(harness.cuda_setup("perf/ab_mods_persistent.py"), flush=True)
    rule = launcher.with_persistent_grid

    def one_tile(config, head_dim, features, num_sms):
        return config

    def persistent(config, head_dim, features, num_sms):
        return dataclasses.replace(config, persistent_ctas=args.ctas, tile_queue=True)

    for c in bench_masks.cases(("bd", "documents")):
        b, s, h, d = c["batch"], c["seqlen"], c["nheads"], c["headdim"]
        q, k, v = harness.random_qkv(b, s, h, d, torch.bfloat16)
        mask_mod, score_mod, _, _ = bench_masks.mods_for(c)

        def call(grid_rule):
            launcher.with_persistent_grid = grid_rule
            try:
                return cute_attn.mha(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
            finally:
                launcher.with_persistent_grid = rule

        outs = {name: call(fn).float() for name, fn in (("one_tile", one_tile), ("copy", one_tile),
                                                        ("persistent", persistent))}
        torch.cuda.synchronize()
        timers = {name: (lambda fn: lambda: harness.do_bench(lambda: call(fn)))(fn)
                  for name, fn in (("one_tile", one_tile), ("copy", one_tile), ("persistent", persistent))}
        ms, failed = harness.run_rounds(timers, args.rounds)
        med = {n: harness.median_ms(m) for n, m in ms.items() if m}
        diff = (outs["persistent"] - outs["one_tile"]).abs().max().item()
        cells = ", ".join(f"{n} {1e3 * t:.0f} us ({med['one_tile'] / t:.3f}x)" for n, t in med.items())
        print(f"{c['case']}: {cells}, |d| {diff:.0e}", {n: harness.reason(e) for n, e in failed.items()} or "",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
