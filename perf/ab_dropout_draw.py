"""A/B of the dropout forward's Philox placement (FwdConfig.dropout_draw_early: a block's
words drawn under its QK^T and the previous block's PV WGMMAs) against the default
(drawn after the softmax step), beside the same call without dropout, in interleaved
rounds. The variant replaces the grid rule launcher.run_fwd_mods applies
(config.with_persistent_grid), so it keeps the default's tiles and grid; outputs must be
bit-identical (the same words, only drawn earlier). Prints us per call, early / default,
and each one's cost over no dropout (the issue's target: <= 15%).

    python3 perf/ab_dropout_draw.py [--rounds 5] [--headdims 64,128] [--seqlens 2048,8192] [--p 0.1]
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=harness.parse_positive_int, default=5)
    p.add_argument("--headdims", type=harness.parse_int_list, default=[64, 128])
    p.add_argument("--seqlens", type=harness.parse_int_list, default=[2048, 8192])
    p.add_argument("--causal", type=harness.parse_flag_list, default=[0, 1])
    p.add_argument("--p", type=float, default=0.1)
    args = p.parse_args(argv)
    import cute_attn
    from cute_attn import launcher

    print(harness.cuda_setup("perf/ab_dropout_draw.py"), flush=True)
    rule = launcher.with_persistent_grid

    def early(config, head_dim, features, num_sms):
        return dataclasses.replace(rule(config, head_dim, features, num_sms), dropout_draw_early=True)

    seed = torch.tensor([1234, 5678], dtype=torch.int32, device="cuda")
    for d in args.headdims:
        for causal in map(bool, args.causal):
            for s in args.seqlens:
                b, h = harness.TOKENS // s, harness.HIDDEN // d
                q, k, v = harness.random_qkv(b, s, h, d, torch.bfloat16)

                def call(grid_rule, p_drop):
                    launcher.with_persistent_grid = grid_rule
                    try:
                        return cute_attn.mha(q, k, v, causal=causal, dropout_p=p_drop, dropout_seed=seed)
                    finally:
                        launcher.with_persistent_grid = rule

                variants = {"default": (rule, args.p), "early": (early, args.p), "no_dropout": (rule, 0.0)}
                outs = {n: call(*a) for n, a in variants.items() if n != "no_dropout"}
                same = torch.equal(outs["default"], outs["early"])
                torch.cuda.synchronize()
                timers = {n: (lambda a: lambda: harness.do_bench(lambda: call(*a)))(a) for n, a in variants.items()}
                ms, failed = harness.run_rounds(timers, args.rounds)
                med = {n: harness.median_ms(m) for n, m in ms.items() if m}
                base = med.get("no_dropout")
                cells = ", ".join(f"{n} {1e3 * t:.0f} us" + (f" (+{100 * (t / base - 1):.0f}%)" if base and n != "no_dropout"
                                                               else "") for n, t in med.items())
                ratio = med["default"] / med["early"] if "default" in med and "early" in med else float("nan")
                print(f"hd{d} {'causal' if causal else 'full'} s{s} b{b} h{h} p{args.p}: {cells} | early/default "
                      f"{ratio:.3f} | bit-identical {same}", {n: harness.reason(e) for n, e in failed.items()} or "",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
