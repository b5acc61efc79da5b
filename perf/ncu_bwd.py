"""One backward to profile under ncu: cute_attn's or FlashAttention-4's, bf16, at the sweep's
shape (16K tokens, 2048 / head dim heads; perf/bench.py --bwd), random normal inputs. The
backward alone is called three times (harness.pass_call: one forward keeps its graph, then
torch.autograd.grad of a fixed dout); profile the last main kernel with a name filter:

    ncu --clock-control none -k regex:"FlashBwdSm90|FlashAttentionBackwardSm90" --launch-skip 2 \\
        --launch-count 1 --set full --import-source yes -o OUT python3 perf/ncu_bwd.py cute 128 512 1

    python3 perf/ncu_bwd.py {cute|fa4} HEAD_DIM SEQLEN CAUSAL(0|1)

The preprocess and postprocess kernels of both have other names, so the filter skips them.
perf/NOTES.md records what the readings showed.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def main(argv):
    impl, d, s, causal = argv[0], int(argv[1]), int(argv[2]), bool(int(argv[3]))
    if impl not in ("cute", "fa4"):
        raise SystemExit(f"{impl}: expected cute or fa4")
    b, h = harness.sweep_shape(s, d)
    q, k, v = harness.random_qkv(b, s, h, d, torch.bfloat16)
    if impl == "cute":
        import cute_attn

        fwd = lambda q, k, v: cute_attn.mha(q, k, v, causal=causal)  # noqa: E731
    else:
        impls, _ = harness.load_impls(("fa4",))
        fwd = lambda q, k, v: impls["fa4"].fn(q, k, v, causal)  # noqa: E731
    backward = harness.pass_call("bwd", fwd, (q, k, v))
    for _ in range(3):
        backward()
    torch.cuda.synchronize()
    print("ran", impl, "bwd", d, s, causal, (b, s, h, d), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
