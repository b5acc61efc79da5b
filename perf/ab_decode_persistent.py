"""A/B of the decode forward (mha_with_kvcache's kernel: kv_lengths, packed GQA, contiguous
or paged cache) with one tile per CTA against a persistent grid, round robin or tile
queue (FwdConfig.persistent_ctas / tile_queue), in the same interleaved rounds: the
measurement a persistent decode grid needs before config.with_persistent_grid takes it
(perf/NOTES.md, session 17, holds the prediction). Large batches only (b x heads_kv tiles
of one query each, unsplit): the cuDNN decode sweep's batch-128 points and one with
speculative queries. Kernels are called through launcher.run_fwd with the config forced
and num_splits=1; outputs are compared with the default's (0 expected).

    python3 perf/ab_decode_persistent.py [--rounds 5] [--ctas 132]
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads, heads_kv), head dim 128, causal (bottom-right)
SHAPES = [(128, 1, 2048, 64, 8), (128, 1, 8192, 64, 8), (128, 1, 32768, 64, 8), (32, 16, 8192, 64, 8)]
PAGES = (0, 16)  # contiguous, and vLLM's page size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ctas", type=int, default=132)
    args = p.parse_args(argv)
    from cute_attn import api, launcher, tuning
    from cute_attn.config import RunArgs, attn_features, pack_gqa_for

    print(harness.cuda_setup("perf/ab_decode_persistent.py"), flush=True)
    d = 128
    for (b, sq, sk, h, hkv), page in ((s, pg) for s in SHAPES for pg in PAGES):
        plain, base_args = api._features_and_args(True, (-1, -1), 0.0, d ** -0.5)
        features = attn_features(plain.mask, plain.softcap, kv_lengths=True)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        lengths = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        table = None
        if page:
            # the same memory as pages, in a random order per entry
            k, v = (t.view(b * sk // page, page, hkv, d) for t in (k, v))
            table = torch.randperm(b * sk // page, device="cuda", generator=gen).to(torch.int32).view(b, -1)
        run_args = RunArgs(base_args.softmax_scale, base_args.softcap, base_args.window, None, lengths,
                           page_table=table)
        pack = pack_gqa_for(d, features, sq, h // hkv)
        base = tuning.default_fwd_config("bf16", d, features, None, pack, page)
        configs = {"one_tile": base, "copy": base,
                   "round_robin": dataclasses.replace(base, persistent_ctas=args.ctas),
                   "queue": dataclasses.replace(base, persistent_ctas=args.ctas, tile_queue=True)}

        def call(cfg):
            return launcher.run_fwd(q, k, v, features, run_args, cfg, need_lse=False, num_splits=1)[0]

        outs = {n: call(c).float() for n, c in configs.items()}
        torch.cuda.synchronize()
        timers = {n: (lambda c: lambda: harness.do_bench(lambda: call(c)))(c) for n, c in configs.items()}
        ms, failed = harness.run_rounds(timers, args.rounds)
        nbytes = 2 * b * sk * hkv * d * 2 + 2 * q.numel() * 2  # K, V read once; q in, out back
        med = {n: harness.median_ms(m) for n, m in ms.items() if m}
        diff = max((o - outs["one_tile"]).abs().max().item() for o in outs.values())
        cells = ", ".join(f"{n} {1e3 * t:.1f} us {nbytes / t / 1e6:.0f} GB/s ({med['one_tile'] / t:.3f}x)"
                          for n, t in med.items())
        print(f"b{b} q{sq} k{sk} {h}/{hkv} page {page or '-'} pack {pack}: {cells}, |d| {diff:.0e}",
              {n: harness.reason(e) for n, e in failed.items()} or "", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
