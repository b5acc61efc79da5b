"""A/B of this tree's kernels against another revision's, with FlashAttention-4, in the
same process and interleaved rounds: the measurement for a kernel change that has no
config field to switch it (a reordering inside a step, a different WGMMA split).

The other revision travels as a renamed copy of its package (`cute_attn_old`: imports,
custom-op namespace and cache folder renamed, so both load side by side):

    python3 perf/ab_trees.py --prepare REV          # on your machine: writes scratch/ab_tree/
    python3 perf/ab_trees.py --pass bwd [--rounds 5] [--headdims 64,128] [--seqlens ...]
                             [--dropout 0.1]   # both trees with dropout; no FA4 (none on Hopper)
    python3 perf/ab_trees.py --pass fwd --dtype fp8   # e4m3 inputs (quantize_fp8); no FA4 either

(on the device, carry scratch/ab_tree). 16K tokens per shape (harness.sweep_shape),
causal and not; prints TFLOP/s and new/old, new/fa4, old/fa4.
"""
import argparse
import io
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

OLD_DIR = harness.REPO_ROOT / "scratch" / "ab_tree"


def prepare(rev: str) -> None:
    """Extract rev's cute_attn/ as OLD_DIR/cute_attn_old with every name renamed."""
    shutil.rmtree(OLD_DIR, ignore_errors=True)
    OLD_DIR.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "cute_attn"], cwd=harness.REPO_ROOT,
                             check=True, capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(OLD_DIR)
    (OLD_DIR / "cute_attn").rename(OLD_DIR / "cute_attn_old")
    for path in (OLD_DIR / "cute_attn_old").rglob("*.py"):
        path.write_text(re.sub(r"\bcute_attn\b", "cute_attn_old", path.read_text()))
    print(f"{rev} -> {OLD_DIR / 'cute_attn_old'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", metavar="REV")
    p.add_argument("--pass", dest="pas", choices=harness.PASSES, default="bwd")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--headdims", type=harness.parse_int_list, default=[64, 128])
    p.add_argument("--seqlens", type=harness.parse_int_list, default=[1024, 4096, 16384])
    p.add_argument("--dropout", type=float, default=0.0, help="dropout_p for both trees (then no FA4)")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="fp8: forward only, no FA4")
    p.add_argument("--causal", type=harness.parse_flag_list, default=[0, 1])
    args = p.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    import torch

    sys.path.insert(0, str(OLD_DIR))
    import cute_attn
    import cute_attn_old

    print(harness.cuda_setup("perf/ab_trees.py"), flush=True)

    def fa4(q, k, v, causal):
        from flash_attn.cute import flash_attn_func

        out = flash_attn_func(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    impls = {"new": cute_attn.mha, "old": cute_attn_old.mha, "fa4": fa4}
    if args.dropout:
        seed = torch.tensor([1234, 5678], dtype=torch.int32, device="cuda")
        extra = dict(dropout_p=args.dropout, dropout_seed=seed)
        impls = {"new": lambda q, k, v, causal: cute_attn.mha(q, k, v, causal=causal, **extra),
                 "old": lambda q, k, v, causal: cute_attn_old.mha(q, k, v, causal=causal, **extra)}
    if args.dtype == "fp8" and (args.pas != "fwd" or args.dropout):
        p.error("--dtype fp8 has a forward only, without dropout")
    for d in args.headdims:
        for causal in map(bool, args.causal):
            for s in args.seqlens:
                b, h = harness.sweep_shape(s, d)
                q, k, v = (t.requires_grad_(args.pas == "bwd") for t in harness.random_qkv(b, s, h, d, torch.bfloat16))
                dout = torch.randn_like(q)
                if args.dtype == "fp8":  # quantised once per shape, outside the timing
                    q, k, v, *descales = cute_attn.quantize_fp8(q, k, v)
                    impls = {name: _with_descales(mha, *descales)
                             for name, mha in (("new", cute_attn.mha), ("old", cute_attn_old.mha))}
                timers = {}
                for name, f in impls.items():
                    if args.pas == "fwd":
                        with torch.no_grad():
                            f(q, k, v, causal=causal)

                        def timer(f=f):
                            with torch.no_grad():
                                return harness.do_bench(lambda: f(q, k, v, causal=causal))
                    else:
                        o = f(q, k, v, causal=causal)
                        torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)

                        def timer(o=o):
                            return harness.do_bench(lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
                    timers[name] = timer
                ms, _ = harness.run_rounds(timers, args.rounds)
                flops = harness.attention_flops(b, h, s, s, d, causal, args.pas)
                tf = {n: harness.tflops(flops, statistics.median(t)) for n, t in ms.items()}
                line = (f"hd{d} causal={causal!s:5} s{s:5d} {args.pas}: new {tf['new']:.0f} old {tf['old']:.0f} TF/s"
                        f" | new/old {tf['new'] / tf['old']:.3f} (rounds %.3f-%.3f)"
                        % harness.round_ratio_range(ms["new"], ms["old"]))
                if "fa4" in tf:
                    line += f" fa4 {tf['fa4']:.0f} new/fa4 {tf['new'] / tf['fa4']:.3f} old/fa4 {tf['old'] / tf['fa4']:.3f}"
                print(line, flush=True)
    return 0


def _with_descales(mha, q_descale, k_descale, v_descale):
    return lambda q, k, v, causal: mha(q, k, v, causal=causal, q_descale=q_descale, k_descale=k_descale,
                                       v_descale=v_descale)


if __name__ == "__main__":
    sys.exit(main())
