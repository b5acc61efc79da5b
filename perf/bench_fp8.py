"""FP8 (e4m3) forward benchmark and accuracy table: cute_attn's FP8 forward against its own
bf16 forward in the same process (`perf/bench.py --dtype fp8` runs this).

Shapes: the FlashAttention-3 paper's FP8 sweep, 16K tokens (batch * seqlen), nheads =
2048 / headdim, headdim 64, 128, 256, seqlen 4K, 8K, 16K, causal and not. FLOPs as in
perf/bench.py (4 * b * h * s^2 * d, halved when causal). The FP8 call is what a user
times: cute_attn.mha on e4m3 q, k, v with their descales, the V transpose included
(launcher.transpose_v_fp8); `vt_us` records the transpose alone. Interleaved rounds and
medians as perf/harness.py does them.

Accuracy (--accuracy, or always with the sweep): RMSE against the float32 reference on the
dequantised inputs (reference.attention_ref), for the kernel, for the float32 emulation
of the same e4m3 math (fp8.fp8_attention_emulated) and for the bf16 kernel on the bf16
inputs; random normal inputs and inputs with outlier channels (4 columns x20), with and
without quantize_fp8(rotate=True).

cuDNN's FP8 forward (perf/cudnn_fp8.py: nvidia-cudnn-frontend, carried to the GPU machine
in a second call, ../shared/GPU.md) is timed beside them where it imports, on the same bf16
inputs quantised per tensor, after a check of its output against cute_attn's bf16 one;
otherwise the run records why it was skipped. It writes O in e4m3 on Hopper (half of
cute_attn's output bytes) and its scales are per tensor (perf/cudnn_fp8.py says more).

    python3 perf/bench_fp8.py [--rounds 3] [--headdims 128,256] [--seqlens 16384] [--out DIR]
"""

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import cudnn_fp8  # noqa: E402
import harness  # noqa: E402
from harness import log  # noqa: E402

TOKENS = 16384
SEQLENS = (4096, 8192, 16384)
HEADDIMS = (64, 128, 256)
# cuDNN's FP8 output against cute_attn's bf16 one on the same inputs: per-tensor e4m3 with
# P and O in e4m3 measure a few percent of the output's RMS; an anchor beyond this computes
# something else and is not timed
MAX_ANCHOR_REL_RMSE = 0.15


def _inputs(batch, seqlen, nheads, headdim, *, outliers=False, rotate=False, seed=0):
    import torch

    from cute_attn.fp8 import quantize_fp8

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    if outliers:
        cols = torch.randperm(headdim, generator=gen, device="cuda")[:4]
        for t in (q, k, v):
            t[..., cols] *= 20
    return (q, k, v), quantize_fp8(q, k, v, rotate=rotate)


def cudnn_anchor():
    """(cudnn_fp8.CudnnFp8Attention or None, the reason it is None)."""
    skip = cudnn_fp8.unavailable()
    if skip is not None:
        return None, skip
    try:
        return cudnn_fp8.CudnnFp8Attention(), None
    except Exception as exc:  # noqa: BLE001 (no handle: a recorded skip, not a failed run)
        return None, harness.reason(exc)


def cudnn_error(anchor, inputs, causal, expected):
    """Relative RMSE of cuDNN's dequantised O against `expected` (cute_attn's bf16 out on
    the same bf16 inputs): the anchor is timed only where it computes attention."""
    from cute_attn.fp8 import rmse

    q8, k8, v8, scales = inputs
    out = anchor(q8, k8, v8, scales, causal).float() * scales["descale_v"]
    expected = expected.float()
    return rmse(out, expected) / expected.square().mean().sqrt().item()


def sweep(headdims, seqlens, rounds):
    import cute_attn
    from cute_attn import launcher

    anchor, skip = cudnn_anchor()
    if skip:
        log(f"cudnn_fp8 skipped: {skip}")
    records = []
    for d in headdims:
        for s in seqlens:
            b, h = max(1, TOKENS // s), 2048 // d
            (q, k, v), (q8, k8, v8, qd, kd, vd) = _inputs(b, s, h, d)
            per_tensor = cudnn_fp8.prepare(q, k, v) if anchor is not None else None
            for causal in (False, True):
                flops = harness.attention_flops(b, h, s, s, d, causal)
                calls = {
                    "cute_attn_fp8": lambda: cute_attn.mha(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                                           v_descale=vd),
                    "cute_attn_bf16": lambda: cute_attn.mha(q, k, v, causal=causal),
                    "v_transpose": lambda: launcher.transpose_v_fp8(v8),
                }
                cudnn_rel_rmse = None
                if anchor is not None:
                    try:
                        cudnn_rel_rmse = cudnn_error(anchor, per_tensor, causal, cute_attn.mha(q, k, v, causal=causal))
                        if not cudnn_rel_rmse <= MAX_ANCHOR_REL_RMSE:
                            raise RuntimeError(f"wrong result (relative RMSE {cudnn_rel_rmse:.3g})")
                        calls["cudnn_fp8"] = lambda: anchor(*per_tensor, causal)
                    except Exception as exc:  # noqa: BLE001
                        log(f"  cudnn_fp8 d{d} s{s} causal={causal}: {harness.reason(exc)}")
                for fn in calls.values():
                    fn()
                harness.synchronize()
                timers = {name: (lambda fn=fn: harness.do_bench(fn)) for name, fn in calls.items()}
                ms_rounds, errors = harness.run_rounds(timers, rounds)
                for name, exc in errors.items():
                    log(f"  {name} d{d} s{s} causal={causal}: {harness.reason(exc)}")
                ms = {name: harness.median_ms(r) for name, r in ms_rounds.items()}
                rec = {"headdim": d, "seqlen": s, "batch": b, "nheads": h, "causal": causal,
                       "fp8_ms": ms.get("cute_attn_fp8"), "bf16_ms": ms.get("cute_attn_bf16"),
                       "cudnn_fp8_ms": ms.get("cudnn_fp8"), "cudnn_fp8_rel_rmse": cudnn_rel_rmse,
                       "vt_us": 1e3 * ms["v_transpose"] if "v_transpose" in ms else None,
                       "ms_rounds": ms_rounds}
                for name in ("fp8", "bf16", "cudnn_fp8"):
                    rec[f"{name}_tflops"] = harness.tflops(flops, rec[f"{name}_ms"]) if rec[f"{name}_ms"] else None
                records.append(rec)
                versus = ""
                if rec["cudnn_fp8_tflops"]:
                    versus = f"  cuDNN fp8 {rec['cudnn_fp8_tflops']:.0f} TF/s ({rec['fp8_tflops'] / rec['cudnn_fp8_tflops']:.2f}x)"
                log(f"d{d:3d} s{s:5d} causal={causal!s:5}: fp8 {rec['fp8_tflops']:.0f} TF/s  bf16 "
                    f"{rec['bf16_tflops']:.0f} TF/s  fp8/bf16 {rec['fp8_tflops'] / rec['bf16_tflops']:.2f}x  "
                    f"V transpose {rec['vt_us']:.0f} us" + versus)
    return records, ({"skipped": skip} if skip else cudnn_fp8.versions())


def accuracy(headdims):
    import torch

    import cute_attn
    from cute_attn.fp8 import dequantize, fp8_attention_emulated, rmse
    from cute_attn.reference import attention_ref

    torch.set_float32_matmul_precision("highest")
    rows = []
    for d in headdims:
        for outliers, rotate in ((False, False), (True, False), (True, True)):
            (q, k, v), (q8, k8, v8, qd, kd, vd) = _inputs(1, 2048, 4, d, outliers=outliers, rotate=rotate, seed=d)
            out = cute_attn.mha(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd).float()
            emu, _ = fp8_attention_emulated(q8, k8, v8, qd, kd, vd, causal=True, p_scale=256.0)
            ref, _ = attention_ref(dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), causal=True)
            bf16_ref, _ = attention_ref(q.float(), k.float(), v.float(), causal=True)
            bf16 = cute_attn.mha(q, k, v, causal=True).float()
            row = {"headdim": d, "outliers": outliers, "rotate": rotate, "kernel_rmse": rmse(out, ref),
                   "emulation_rmse": rmse(emu, ref), "bf16_kernel_rmse": rmse(bf16, bf16_ref),
                   "fp8_vs_bf16_inputs_rmse": rmse(out, bf16_ref), "nan": bool(out.isnan().any())}
            row["ratio"] = row["kernel_rmse"] / row["emulation_rmse"]
            rows.append(row)
            log(f"accuracy d{d} outliers={outliers!s:5} rotate={rotate!s:5}: kernel {row['kernel_rmse']:.2e} "
                f"emulation {row['emulation_rmse']:.2e} ({row['ratio']:.2f}x)  bf16 kernel {row['bf16_kernel_rmse']:.2e}"
                f"  fp8 vs the bf16 inputs' reference {row['fp8_vs_bf16_inputs_rmse']:.2e}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--headdims", type=harness.parse_int_list, default=list(HEADDIMS))
    p.add_argument("--seqlens", type=harness.parse_int_list, default=list(SEQLENS))
    p.add_argument("--rounds", type=harness.parse_positive_int, default=3)
    p.add_argument("--accuracy-only", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    device = torch.cuda.get_device_name()
    info = harness.run_info()
    log(harness.describe_run(device, info))
    records, cudnn = ([], None) if args.accuracy_only else sweep(args.headdims, args.seqlens, args.rounds)
    acc = accuracy(args.headdims)
    doc = harness.build_results(device, records, accuracy=acc, cudnn_fp8=cudnn,
                                timing=harness.timing_method(args.rounds, "shape"), **info)
    slug = harness.device_slug(device)
    for directory in harness.output_dirs(args.out, quick=args.accuracy_only):
        log("wrote", harness.write_json(doc, harness.result_path(directory, slug, "fp8")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
