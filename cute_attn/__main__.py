"""Command line: `python -m cute_attn ptx ...` (see cute_attn.ptx), `python -m cute_attn
warmup ...` (see cute_attn.warmup) and `python -m cute_attn tune ...` (see
cute_attn.tuning)."""

import argparse
import sys

from cute_attn import warmup
from cute_attn.config import CAPABILITIES, DTYPES, MASK_KINDS, AttnFeatures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cute_attn")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ptx", help="compile a kernel specialisation for sm_90a and print its PTX")
    p.add_argument("--kernel", choices=("fwd", "bwd"), default="fwd",
                   help="bwd: the preprocess, main and postprocess kernels of the backward")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--headdim", type=int, choices=CAPABILITIES["fwd"].head_dims, default=128)
    p.add_argument("--causal", action="store_true", help="same as --mask causal")
    p.add_argument("--mask", choices=MASK_KINDS, default=None,
                   help="none, causal, or local (sliding window; its sizes are run-time)")
    p.add_argument("--softcap", action="store_true", help="the logit-softcap specialisation")
    p.add_argument("--varlen", action="store_true", help="the packed variable-length one")
    p.add_argument("--seqlen-q", type=int, default=0,
                   help="bwd: the query length (max_seqlen_q) the backward's config is chosen for "
                        "(config.bwd_config_for; 0: short). E.g. --causal --seqlen-q 2048 at head dim "
                        "128: the 80-row kernel")
    p.add_argument("--out", help="write the PTX here instead of stdout")
    p.add_argument("--sass", action="store_true", help="also print SASS (needs cuobjdump)")
    w = sub.add_parser("warmup", help="compile the common specialisations into the on-disk cache")
    # (16-bit only: the FP8 forward's configs are fp8_fwd_config_for's, and it has no backward)
    w.add_argument("--dtype", nargs="+", choices=("bf16", "fp16"), default=list(warmup.DEFAULT_DTYPES))
    w.add_argument("--headdim", nargs="+", type=int, choices=CAPABILITIES["fwd"].head_dims,
                   default=list(warmup.DEFAULT_HEAD_DIMS))
    w.add_argument("--mask", nargs="+", choices=MASK_KINDS, default=list(warmup.DEFAULT_MASKS))
    w.add_argument("--softcap", action="store_true", help="the softcap specialisations instead")
    w.add_argument("--no-varlen", action="store_true", help="skip the packed variable-length ones")
    w.add_argument("--no-bwd", action="store_true", help="forward kernels only (inference)")
    w.add_argument("--gqa-pack", nargs="*", type=_int_at_least(1), default=[],
                   help="GQA group sizes whose packed forward (short query sequences) to build too")
    w.add_argument("--decode", action="store_true",
                   help="also the inference kernels: split-KV forwards, mha_with_kvcache's")
    w.add_argument("--jobs", type=_int_at_least(0), default=0,
                   help="parallel compile processes (0: one per CPU, <= 8)")
    w.add_argument("--list", action="store_true", help="print the plan, build nothing")
    t = sub.add_parser("tune", help="time the forward's tile configs on this GPU, keep the winners in its table")
    t.add_argument("--headdim", nargs="+", type=int, choices=CAPABILITIES["fwd"].head_dims, default=[64, 128, 256])
    t.add_argument("--mask", nargs="+", choices=("none", "causal"), default=["none", "causal"])
    t.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    t.add_argument("--seqlen", type=int, default=8192, help="tokens per sequence (batch x seqlen = 16384)")
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--list", action="store_true", help="print the candidates per head dim and mask, time nothing")
    t.add_argument("--dry-run", action="store_true", help="time, but do not write the table")
    args = parser.parse_args(argv)

    if args.command == "warmup":
        return _warmup(args)
    if args.command == "tune":
        return _tune(args)

    from cute_attn import ptx

    mask = args.mask or ("causal" if args.causal else "none")
    if args.causal and mask != "causal":
        parser.error(f"--causal contradicts --mask {mask}")
    features = AttnFeatures(mask=mask, softcap=args.softcap, varlen=args.varlen)
    if args.kernel == "fwd":
        arts = {"forward": ptx.compile_fwd_artifacts(args.dtype, args.headdim, features=features)}
    else:
        arts = ptx.compile_bwd_artifacts(args.dtype, args.headdim, features=features, max_seqlen_q=args.seqlen_q)
    text = "".join(f"// ===== {name} =====\n{art.ptx}" for name, art in arts.items())
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    for name, art in arts.items():
        # the resource report goes to stderr so that stdout stays valid PTX
        print(f"# {name}: {art.key}", file=sys.stderr)
        print(art.ptxas_report, file=sys.stderr)
        if "C7508" in art.ptxas_report:
            print(f"WARNING: {name}: setmaxnreg was ignored by ptxas (C7508)", file=sys.stderr)
        if args.sass:
            print(ptx.sass(art.cubin))
    return 0


def _int_at_least(minimum: int):
    """An argparse type: an int >= minimum (else a usage error, exit 2)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value
    return parse


def _warmup(args) -> int:
    jobs = warmup.plan(args.dtype, args.headdim, args.mask, softcap=args.softcap,
                       varlen=(False,) if args.no_varlen else (False, True), backward=not args.no_bwd,
                       gqa_packs=args.gqa_pack, decode=args.decode)
    if args.list:
        for job in jobs:
            print(job.family, job.key)
        return 0
    import torch

    from cute_attn import compile_cache

    if compile_cache.cache_dir() is None:
        print(f"warmup fills the disk compile cache, which is disabled ({compile_cache.ENV_ENABLE}=0)",
              file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        # the keys depend on the GPU (its SM count picks persistent grids, its tuned table,
        # the CUDA driver is in the cache key): built here they would never be asked for
        print("warmup builds the keys of this machine's GPU (its SM count, tuned table and CUDA driver are part "
              "of them) and this machine has none: run it on the GPU host (--list shows a plan without one)",
              file=sys.stderr)
        return 1
    warmup.run(jobs, workers=args.jobs)
    return 0



def _tune(args) -> int:
    from cute_attn import tuning

    if args.list:
        for d in args.headdim:
            for mask in args.mask:
                features = AttnFeatures(mask=mask)
                print(f"{tuning.entry_key(args.dtype, d, mask)}: default {tuning.fwd_config_for(d, features)}")
                for field, configs in tuning.candidates(d, features).items():
                    for config in configs:
                        print(f"  {field}: {config}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("tune needs a CUDA GPU (it times kernels); --list prints the candidates without one", file=sys.stderr)
        return 1
    tuning.tune(args.headdim, args.mask, args.dtype, args.seqlen, args.rounds, write=not args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
