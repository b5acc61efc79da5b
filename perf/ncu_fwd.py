"""One forward launch to profile under ncu: cute_attn (bf16 or FP8) or FlashAttention-4 at
the sweep's shape (16K tokens, 2048 / head dim heads), random normal inputs. Three calls
run; profile the last with `--launch-skip 2 --launch-count 1` and a kernel-name filter:

    ncu --clock-control none -k regex:"FlashFwdSm90|FlashAttentionForwardSm90" --launch-skip 2 --launch-count 1 \\
        --set full --import-source yes -o OUT python3 perf/ncu_fwd.py cute bf16 128 16384 0

    python3 perf/ncu_fwd.py {cute|fa4} {bf16|fp8} HEAD_DIM SEQLEN CAUSAL(0|1)

(FP8 is cute_attn's only: FA4 has no Hopper FP8 path.) perf/NOTES.md records what the
readings showed.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def main(argv):
    impl, dtype, d, s, causal = argv[0], argv[1], int(argv[2]), int(argv[3]), bool(int(argv[4]))
    if impl not in ("cute", "fa4") or dtype not in ("bf16", "fp8") or (impl, dtype) == ("fa4", "fp8"):
        raise SystemExit(f"{impl} {dtype}: expected cute bf16|fp8 or fa4 bf16 (FA4 has no Hopper FP8)")
    b, h = harness.sweep_shape(s, d)[:2]
    q, k, v = harness.random_qkv(b, s, h, d, torch.bfloat16)
    if impl == "cute":
        import cute_attn

        if dtype == "fp8":
            q8, k8, v8, qd, kd, vd = cute_attn.quantize_fp8(q, k, v)
            call = lambda: cute_attn.mha(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)  # noqa: E731
        else:
            call = lambda: cute_attn.mha(q, k, v, causal=causal)  # noqa: E731
    else:
        impls, _ = harness.load_impls(("fa4",))
        call = lambda: impls["fa4"].fn(q, k, v, causal)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print("ran", impl, dtype, d, s, causal, (b, s, h, d), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
