"""Attention-dropout benchmark (issue 14): what `dropout_p` costs cute_attn, against torch
SDPA's flash backend with dropout (FlashAttention-2's kernel; FlashAttention-4 has no
dropout on Hopper), in one process.

Cases as perf/bench_sinks.py (gpt-oss causal and 128-key window layers, 64/8 heads x 64;
a 16 x 128 causal layer; 2 x 8K tokens), dropout_p = 0.1, forward and backward:

- cute_attn_dropout: mha(..., dropout_p=0.1) (seed drawn per call from torch's generator);
- cute_attn: the same call without dropout: the dropout's cost;
- sdpa_flash_dropout: SDPA (FLASH_ATTENTION backend, dropout_p=0.1; causal layers only,
  GQA through enable_gqa).

Record keys as bench_sinks.py's: dropout_cost (vs no dropout),
speedup_vs_sdpa_flash_dropout, bwd_ prefixed for the backward.

    python3 perf/bench_dropout.py [--rounds 3] [--directions fwd,bwd] [--out DIR]
"""

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sinks  # noqa: E402  (its cases, measurement and command line)

P = 0.1


def impls(window):
    """name -> forward(q, k, v) of the implementations, for this window."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cute_attn

    def sdpa(q, k, v):
        if window != (-1, 0):
            raise NotImplementedError("SDPA's flash backend has no sliding window")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 dropout_p=P, is_causal=True,
                                                 enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    return {
        "cute_attn_dropout": lambda q, k, v: cute_attn.mha(q, k, v, window_size=window, dropout_p=P),
        "cute_attn": lambda q, k, v: cute_attn.mha(q, k, v, window_size=window),
        "sdpa_flash_dropout": sdpa,
    }


def run_case(c, rounds, directions):
    return bench_sinks.measure_case(c, impls(c["window"]), bench_sinks.case_tensors(c)[:3],
                                    ("cute_attn_dropout", "cute_attn", "sdpa_flash_dropout"), rounds, directions,
                                    "dropout_cost", dropout_p=P)


def main(argv=None) -> int:
    return bench_sinks.cli("dropout", run_case, argv)


if __name__ == "__main__":
    sys.exit(main())
