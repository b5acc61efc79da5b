"""Programmable masks benchmark (issue 14): cute_attn's mask/score-mod forward against
FlexAttention (torch.compile'd flex_attention with its own block mask) and torch SDPA with
a dense mask (or bias), in one process, on the issue's cases:

- BD3LM block diffusion: L = 1024 and 4096 (sequence 2L: noisy half, clean half), blocks
  of 4 and 16, 12 heads x 64 and 16 heads x 128; batch x 2L = 16K tokens;
- documents: 16 packed documents of random lengths in one 16K sequence, causal; the same
  documents also as a packed varlen batch through mha_varlen, plain causal
  (cute_attn_varlen: what a FlashAttention user runs) and with a causal mask mod
  (cute_attn_varlen_mod: the mods kernel on per-sequence block masks);
- prefix-LM: 2 x 8K, prefixes of 2048 and 5000 tokens;
- ALiBi, causal: 2 x 8K.

Each mask's block mask is built once, outside the timing, for cute_attn (create_block_mask)
and FlexAttention (its create_block_mask) alike; their build times are recorded. TFLOP/s
count the visible pairs only (4 * d per visible (query, key) pair and head), so a kernel
that skips masked tiles is not credited for work it avoids; `causal_tflops` is cute_attn's
own causal kernel at the same shape (its FLOPs: the causal pairs), the yardstick of the
issue's "within 0.85x of cute_attn's causal" target. The backward (keys prefixed bwd_) is
timed alone: one forward keeps its graph, then autograd.grad of a fixed dout; its FLOPs
are 2.5x the forward's (five GEMMs to two). Before timing, each forward but
cute_attn_causal is compared with cute_attn's (harness.check_agreement; the largest
difference is recorded as max_diff_vs_cute_attn): one that computes another problem is
recorded in errors and not timed. Timing: perf/harness.py's interleaved rounds
(pass_call, time_passes), median of rounds.

    python3 perf/bench_masks.py [--rounds 3] [--cases bd,documents,prefix_lm,alibi]
                                [--directions fwd,bwd] [--out DIR]
"""

import argparse
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import log  # noqa: E402

TOKENS = 16384
CASE_GROUPS = ("bd", "documents", "prefix_lm", "alibi")


def _bd_cases():
    for L in (1024, 4096):
        for block in (4, 16):
            for h, d in ((12, 64), (16, 128)):
                yield {"case": f"bd3lm L{L} block{block} {h}x{d}", "group": "bd", "L": L, "block": block,
                       "batch": TOKENS // (2 * L), "seqlen": 2 * L, "nheads": h, "headdim": d}


def cases(groups):
    out = []
    if "bd" in groups:
        out += list(_bd_cases())
    if "documents" in groups:
        out.append({"case": "documents 16 in 16K causal 16x128", "group": "documents", "batch": 1, "seqlen": TOKENS,
                    "nheads": 16, "headdim": 128, "docs": 16})
    if "prefix_lm" in groups:
        out.append({"case": "prefix-LM 2x8K 16x128", "group": "prefix_lm", "batch": 2, "seqlen": 8192, "nheads": 16,
                    "headdim": 128, "prefix": (2048, 5000)})
    if "alibi" in groups:
        out.append({"case": "ALiBi causal 2x8K 16x128", "group": "alibi", "batch": 2, "seqlen": 8192, "nheads": 16,
                    "headdim": 128})
    return out


def _doc_ids(batch, seqlen, docs, seed=0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    cuts = torch.randperm(seqlen - 1, generator=gen, device="cuda")[:docs - 1] + 1
    starts = torch.zeros(seqlen, dtype=torch.int32, device="cuda")
    starts[cuts] = 1
    return starts.cumsum(0).to(torch.int32).expand(batch, -1).contiguous()


def mods_for(c):
    """(cute_attn mask Modifier or None, score Modifier or None, flex mask_mod, flex
    score_mod or None, SDPA attn_mask builder) of a case."""
    import torch

    from cute_attn import masks

    b, s, h = c["batch"], c["seqlen"], c["nheads"]
    if c["group"] == "bd":
        L, bs = c["L"], c["block"]

        def flex_mask(b_, h_, q, kv):
            qc, kc = q >= L, kv >= L
            qb = torch.where(qc, q - L, q) // bs
            kb = torch.where(kc, kv - L, kv) // bs
            return (~qc & ~kc & (qb == kb)) | (~qc & kc & (kb < qb)) | (qc & kc & (kb <= qb))

        return masks.block_diffusion(bs), None, flex_mask, None
    if c["group"] == "documents":
        ids = _doc_ids(b, s, c["docs"])

        def flex_mask(b_, h_, q, kv):
            return (ids[b_, q] == ids[b_, kv]) & (kv <= q)

        return masks.document(ids, causal=True), None, flex_mask, None
    if c["group"] == "prefix_lm":
        lens = torch.tensor(c["prefix"], dtype=torch.int32, device="cuda")

        def flex_mask(b_, h_, q, kv):
            return (kv < lens[b_]) | (kv <= q)

        return masks.prefix_lm(lens), None, flex_mask, None
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda")

    def flex_causal(b_, h_, q, kv):
        return kv <= q

    def flex_alibi(score, b_, h_, q, kv):
        return score + slopes[h_] * (kv - q)

    return masks.causal(), masks.alibi(slopes), flex_causal, flex_alibi


def run_case(c, rounds, impls, directions=("fwd", "bwd")):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    import cute_attn
    from cute_attn import masks
    from cute_attn.mask_reference import dense_mask, index_grids, seq_info

    b, s, h, d = c["batch"], c["seqlen"], c["nheads"], c["headdim"]
    q, k, v = harness.random_qkv(b, s, h, d, torch.bfloat16)
    mask, score, flex_mask, flex_score = mods_for(c)
    visible = dense_mask(mask, b, 1, s, s, "cuda")  # (b, 1, s, s): no case's mask depends on the head
    pairs = visible.sum().item() * h
    rec = dict(c, visible_fraction=visible.float().mean().item())

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    bm = cute_attn.create_block_mask(mask, b, h, s, s, head_dim=d, device="cuda")
    torch.cuda.synchronize()
    rec["cute_block_mask_ms"] = 1e3 * (time.perf_counter() - t0)
    rec["tiles_skipped"] = bm.sparsity()
    t0 = time.perf_counter()
    fbm = flex_block_mask(flex_mask, b, None, s, s, device="cuda")
    torch.cuda.synchronize()
    rec["flex_block_mask_ms"] = 1e3 * (time.perf_counter() - t0)

    # static shapes: dynamo caches flex_attention by its code object across cases, and
    # after a second shape its automatic dynamic shapes would recompile every later case
    # with symbolic sizes (slower kernels: ALiBi 2 x 8K forward 2266 us there vs 1603 us
    # compiled alone, H100); each case gets Flex's best, a kernel for its own shape
    flex = torch.compile(flex_attention, dynamic=False)

    def bhsd(t):
        return t.transpose(1, 2)

    forwards = {
        "cute_attn": lambda q_, k_, v_: cute_attn.mha(q_, k_, v_, mask_mod=mask, score_mod=score, block_mask=bm),
        "cute_attn_causal": lambda q_, k_, v_: cute_attn.mha(q_, k_, v_, causal=True),
        "flex": lambda q_, k_, v_: bhsd(flex(bhsd(q_), bhsd(k_), bhsd(v_), score_mod=flex_score, block_mask=fbm)),
    }
    if "sdpa_dense_mask" in impls and b * s * s <= 2 ** 31:
        if score is None:
            attn_mask = visible
        else:  # ALiBi: the bias, -inf where masked
            grids = index_grids(b, h, s, s, "cuda")
            zero = torch.zeros((), device="cuda")
            bias = score(zero, *grids, seq=seq_info(score, s, s, device="cuda"))
            attn_mask = bias.masked_fill(~visible, float("-inf")).to(torch.bfloat16)
        forwards["sdpa_dense_mask"] = lambda q_, k_, v_: bhsd(torch.nn.functional.scaled_dot_product_attention(
            bhsd(q_), bhsd(k_), bhsd(v_), attn_mask=attn_mask))
    if c["group"] == "documents":
        # the documents as sequences: cu_seqlens from the id changes (one host read, here)
        ids = mask.aux[0][0]
        starts = torch.nonzero(torch.diff(ids) != 0).flatten() + 1
        cu = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), s)]).to(torch.int32)
        longest = int(torch.diff(cu).max())
        causal_mod = masks.causal()

        def varlen(**kw):
            return lambda q_, k_, v_: cute_attn.mha_varlen(q_[0], k_[0], v_[0], cu, cu, longest, longest, **kw)[None]

        forwards["cute_attn_varlen"] = varlen(causal=True)
        forwards["cute_attn_varlen_mod"] = varlen(mask_mod=causal_mod)
    forwards = {n: f for n, f in forwards.items() if n in impls or n == "cute_attn_causal"}
    # the anchors and the varlen forms compute the same masked attention as cute_attn (not
    # cute_attn_causal: another problem, the yardstick); one that does not is not timed
    bad, rec["max_diff_vs_cute_attn"] = harness.check_agreement(
        forwards, (q, k, v), {name: "cute_attn" for name in forwards if name not in ("cute_attn", "cute_attn_causal")})
    rec["errors"] = dict(bad)
    forwards = {n: f for n, f in forwards.items() if n not in bad}
    for direction in directions:
        prefix = "" if direction == "fwd" else "bwd_"
        makers = {name: (lambda fwd=fwd: harness.pass_call(direction, fwd, (q, k, v))) for name, fwd in forwards.items()}
        ms = harness.time_passes(makers, rounds, rec, prefix)
        # the backward's five GEMMs against the forward's two: 2.5x the FLOPs
        per_pair = 4.0 * d * (1.0 if direction == "fwd" else 2.5)
        for name, t in ms.items():
            flops = per_pair * (b * h * s * (s + 1) / 2 if name == "cute_attn_causal" else pairs)
            rec[f"{prefix}{name}_ms"] = t
            rec[f"{prefix}{name}_tflops"] = harness.tflops(flops, t)
        cute = rec.get(f"{prefix}cute_attn_ms")
        for anchor in ("flex", "sdpa_dense_mask"):
            if cute and rec.get(f"{prefix}{anchor}_ms"):
                rec[f"{prefix}speedup_vs_{anchor}"] = rec[f"{prefix}{anchor}_ms"] / cute
        if rec.get(f"{prefix}cute_attn_tflops") and rec.get(f"{prefix}cute_attn_causal_tflops"):
            rec[f"{prefix}tflops_vs_own_causal"] = rec[f"{prefix}cute_attn_tflops"] / rec[f"{prefix}cute_attn_causal_tflops"]
        line = f"{direction} {c['case']:38s} skip {rec['tiles_skipped']:.2f}"
        for name in ("cute_attn", "flex", "sdpa_dense_mask", "cute_attn_causal", "cute_attn_varlen",
                     "cute_attn_varlen_mod"):
            if f"{prefix}{name}_ms" in rec:
                line += f"  {name} {1e3 * rec[prefix + name + '_ms']:.0f} us {rec[prefix + name + '_tflops']:.0f} TF/s"
        line += f"  vs flex {rec.get(prefix + 'speedup_vs_flex', float('nan')):.2f}x"
        line += f"  vs own causal {rec.get(prefix + 'tflops_vs_own_causal', float('nan')):.2f}"
        log(line)
    for name, why in rec["errors"].items():
        log(f"  {name}: {why}")
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=lambda t: harness.parse_names(t, CASE_GROUPS), default=list(CASE_GROUPS))
    impls = ("cute_attn", "flex", "sdpa_dense_mask", "cute_attn_varlen", "cute_attn_varlen_mod")
    p.add_argument("--impls", type=lambda t: harness.parse_names(t, impls), default=list(impls))
    p.add_argument("--directions", type=lambda t: harness.parse_names(t, ("fwd", "bwd")), default=["fwd", "bwd"])
    p.add_argument("--rounds", type=harness.parse_positive_int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    torch._dynamo.config.cache_size_limit = 64  # one flex compile per mask and shape
    # the backward is timed by repeated autograd.grad over one retained graph, which a
    # compiled backward with donated buffers refuses
    torch._functorch.config.donated_buffer = False
    device = torch.cuda.get_device_name()
    info = harness.run_info()
    log(harness.describe_run(device, info))
    records = [run_case(c, args.rounds, args.impls, args.directions) for c in cases(args.cases)]
    doc = harness.build_results(device, records, timing=harness.timing_method(args.rounds, "case"), **info)
    slug = harness.device_slug(device)
    for directory in harness.output_dirs(args.out):
        log("wrote", harness.write_json(doc, harness.result_path(directory, slug, "masks")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
