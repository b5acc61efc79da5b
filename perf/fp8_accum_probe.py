"""Where the FP8 forward's extra error on outlier inputs comes from (issue 13): the e4m3
tensor core's own accumulation of q k^T, or something of ours. Session 9 found the kernel
2.7-4x the float32 emulation's RMSE when 4 channels of q and k are x20, and 1.0x without
outliers; the emulation sums the e4m3 products exactly in float32.

The probe computes S = q8 k8^T per head with cuBLAS's FP8 GEMM (torch._scaled_mm) twice:
use_fast_accum=True (the tensor core's accumulator across the K chunks, no promotion) and
False (cuBLAS promotes partial sums into float32), then the attention from each S with an
exact float32 softmax and P V on the dequantised V. Against the float32 reference on the
dequantised inputs, these isolate the error of S alone. If the fast-accumulation error is
about sqrt(kernel^2 - emulation^2) and the promoted one is ~0, the gap is the instruction's
accumulation, shared by every FP8 WGMMA kernel that does not promote.

    python3 perf/fp8_accum_probe.py [head_dim ...]      (default 128 256)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_fp8 import _inputs  # noqa: E402


def attention_from_scores(scores, v, causal):
    """(heads, sq, sk) float32 scores (already scaled) -> (sq, heads, d) with V float32."""
    if causal:
        sq, sk = scores.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril(sk - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def scores_scaled_mm(q8, k8, q_descale, k_descale, fast, chunk=None):
    """Per head h: q8[:, h] @ k8[:, h]^T through cuBLAS FP8, float32 out, with the descales.
    chunk: one GEMM per `chunk` columns of the head dim, their results summed in float32
    (what promoting the accumulator after every chunk / 32 WGMMAs of K 32 would give)."""
    one = torch.ones((), dtype=torch.float32, device=q8.device)
    d = q8.shape[-1]
    chunk = chunk or d
    rows = []
    for h in range(q8.shape[1]):
        s = 0
        for c in range(0, d, chunk):
            a = q8[:, h, c:c + chunk].contiguous()  # (sq, chunk) row-major
            b = k8[:, h, c:c + chunk].contiguous().t()  # (chunk, sk) column-major
            s = s + torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
        rows.append(s * (q_descale[h] * k_descale[h]))
    return torch.stack(rows)


def main(argv):
    import cute_attn
    from cute_attn.fp8 import dequantize, fp8_attention_emulated, rmse
    from cute_attn.reference import attention_ref

    print(harness.cuda_setup("perf/fp8_accum_probe.py"), flush=True)
    torch.set_float32_matmul_precision("highest")  # no TF32 in the float32 references
    head_dims = [int(a) for a in argv] or [128, 256]
    seqlen, heads, causal = 2048, 4, True
    for d in head_dims:
        for outliers in (False, True):
            (q, k, v), (q8, k8, v8, qd, kd, vd) = _inputs(1, seqlen, heads, d, outliers=outliers, seed=d)
            qf, kf, vf = (dequantize(x, s) for x, s in ((q8, qd), (k8, kd), (v8, vd)))
            ref = attention_ref(qf, kf, vf, causal=causal)[0].float()[0]
            kernel = cute_attn.mha(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd).float()[0]
            emu, _ = fp8_attention_emulated(q8, k8, v8, qd, kd, vd, causal=causal, p_scale=256.0)
            scale = d ** -0.5
            errs = {}
            for name, fast, chunk in (("s_fast_accum", True, None), ("s_promoted", False, None),
                                      ("k64", True, 64), ("k32", True, 32), ("k16", True, 16)):
                s = scores_scaled_mm(q8[0], k8[0], qd[0], kd[0], fast, chunk) * scale
                errs[name] = rmse(attention_from_scores(s, vf[0].float(), causal), ref)
            e_kernel, e_emu = rmse(kernel, ref), rmse(emu[0], ref)
            unexplained = max(e_kernel ** 2 - e_emu ** 2, 0.0) ** 0.5
            print(f"hd{d} outliers={outliers!s:5}: kernel {e_kernel:.3e} emulation {e_emu:.3e} "
                  f"({e_kernel / e_emu:.2f}x); kernel beyond the emulation {unexplained:.3e}; "
                  f"S alone: fast accumulation {errs['s_fast_accum']:.3e}, promoted {errs['s_promoted']:.3e}, "
                  f"summed in float32 per K chunk of 64 / 32 / 16: {errs['k64']:.3e} / {errs['k32']:.3e} / "
                  f"{errs['k16']:.3e}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
