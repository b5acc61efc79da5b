"""A/B of backward tile configs against cute_attn's default, FA4 and cuDNN (SDPA) in one
process: the measurements behind config.bwd_config_for's head-dim-192/256 choices (split_d,
dq_atomic; perf/NOTES.md, session 15). bf16, batch x seqlen = 16K tokens, 2048 / head_dim
heads (10 at 192), interleaved rounds of triton's do_bench medians (perf/harness.py); before
timing, each variant's gradients are compared with the default's (max relative difference).

    python3 perf/ab_bwd_configs.py [rounds] [seqlens] [head dims] [variants] [causal: 0,1] [window]
    python3 perf/ab_bwd_configs.py 3 4096,16384 256,192 sdq,atomic
    python3 perf/ab_bwd_configs.py 5 1024,4096,16384 128,64 atomic 1
    python3 perf/ab_bwd_configs.py 3 16384 128 ds2,dqwg,copy 0 4096:0   # window_size (4096, 0)

A window (LEFT:RIGHT, FlashAttention's window_size; causal is then ignored) times
cute_attn and FA4 with it (cuDNN's SDPA has no window), TFLOP/s of the visible pairs.

Variants (forced through launcher.bwd_config_for, where they apply to the head dim).
"The 64-row default" is m64 below: the default itself but at head dim 128 (no mask, or
causal from config.SWAPPED_DQ_CAUSAL_FROM_QUERIES rows), where the default is the 80-row
swapped_dq_bwd_config and these knobs are compared against copy at two changes at once:
    sdq      split_d with the sdQ tile and the dQ writer (192/256)
    atomic   the 64-row default with dq_atomic (dQ by vector atomics)
    atomic3  the same with three stages (head dims <= 128)
    ds1      the 64-row default with one sdS buffer (BwdConfig.ds_stages; head dims <= 128)
    ds2      the 64-row default with two sdS buffers
    dplate   the 64-row default with the dP^T wait pinned below P^T's exp2s (dp_wait_after_exp2)
    dqwg     the 64-row default with two sdS buffers and the per-warpgroup dQ hand-off
             (dq_handoff_per_wg; 64 / 128)
    dqjoint  the 64-row default with the joint dQ hand-off (the per-warpgroup one is its
             choice from config.DQ_HANDOFF_PER_WG_FROM_QUERIES rows)
    copy     the default itself (at each length), timed again: the run's noise floor
    do1      the default with a one-stage dO ring, released once dV's WGMMA retired
             (BwdConfig.do_stages; split_d head dims 192 / 256 with two Q stages)
    m64      the 64-row default (at head dim 128, no mask or causal, the config that
             swapped_dq_bwd_config replaced in session 29; elsewhere the default)
    m80      80 query rows per step and dQ^T = K^T dS^T (BwdConfig.dq_swapped; head dim 128
             no mask or causal), two sdS buffers, the joint dQ hand-off; dQ^T after dV and dK
             (BwdConfig.dq_order "after_dkv")
    m80ds1   the same with one sdS buffer
    m80wg    m80 with the per-warpgroup dQ hand-off (at every length)
    m80adv   m80 with dQ^T issued once dV is done, under dK (dq_order "after_dv")
    m80bdk   m80 with dQ^T before dK, its store to sdQ under dK (dq_order "before_dk")
    m80advwg, m80bdkwg   the same two with the per-warpgroup hand-off
(dK after dQ and LSE2 / D in registers, measured in session 19, lost: perf/NOTES.md)
"""
import contextlib
import dataclasses
import sys

import torch

sys.path.insert(0, "perf")
import harness  # noqa: E402
from bench_features import visible_pairs  # noqa: E402
from cute_attn import config, launcher  # noqa: E402

def _default(d, f, s):
    """What mha's backward runs at s query rows (config.bwd_config_for)."""
    return config.bwd_config_for(d, f, max_seqlen_q=s)


def _m64(d, f, s):
    """The default with 64 query rows per step: at head dim 128 (no mask or causal), where the
    default is config.swapped_dq_bwd_config (80 rows, session 29), the config it replaced
    (two sdS buffers, the per-warpgroup hand-off from DQ_HANDOFF_PER_WG_FROM_QUERIES rows)."""
    cfg = _default(d, f, s)
    if cfg.dq_swapped:
        per_wg = s >= config.DQ_HANDOFF_PER_WG_FROM_QUERIES
        cfg = config.BwdConfig(tile_m=64, tile_n=128, num_stages=2, ds_stages=2 if per_wg or f.mask == "none" else 1,
                               dq_handoff_per_wg=per_wg)
    return cfg


def _joint(d, f, s):
    """The 64-row default with the joint dQ hand-off (what dq_atomic and one sdS buffer need)."""
    return dataclasses.replace(_m64(d, f, s), dq_handoff_per_wg=False)


VARIANTS = {  # (head dim, features, query rows) -> a forced config, or None where it does not apply
    "sdq": lambda d, f, s: config.split_d_bwd_config(d, dq_atomic=False) if d > 128 else None,
    "atomic": lambda d, f, s: dataclasses.replace(_joint(d, f, s), dq_atomic=True, ds_stages=1),
    "atomic3": lambda d, f, s: (dataclasses.replace(_joint(d, f, s), dq_atomic=True, num_stages=3,
                                                    ds_stages=1) if d <= 128 else None),
    "ds1": lambda d, f, s: dataclasses.replace(_joint(d, f, s), ds_stages=1) if d <= 128 else None,
    "ds2": lambda d, f, s: (dataclasses.replace(_m64(d, f, s), ds_stages=2)
                            if d <= 128 and d != 96 else None),  # 96: one dQ warpgroup, no second sdS
    "dplate": lambda d, f, s: dataclasses.replace(_m64(d, f, s), dp_wait_after_exp2=True),
    "dqwg": lambda d, f, s: (dataclasses.replace(_m64(d, f, s), ds_stages=2, dq_handoff_per_wg=True)
                             if d in (64, 128) else None),
    "dqjoint": lambda d, f, s: _joint(d, f, s),
    "do1": lambda d, f, s: (dataclasses.replace(_default(d, f, s), do_stages=1)
                            if _default(d, f, s).split_d and _default(d, f, s).num_stages > 1 else None),
    "copy": lambda d, f, s: _default(d, f, s),
    "m64": lambda d, f, s: _m64(d, f, s),
}


def _m80(order, per_wg, ds_stages=2):
    """80 query rows with dQ^T (head dim 128 without a mask), from the joint default."""
    return lambda d, f, s: (dataclasses.replace(_joint(d, f, s), tile_m=80, dq_swapped=True, ds_stages=ds_stages,
                                                dq_handoff_per_wg=per_wg, dq_order=order)
                            if d == 128 and f.mask != "local" else None)


VARIANTS.update({
    "m80": _m80("after_dkv", False),
    "m80ds1": _m80("after_dkv", False, ds_stages=1),
    "m80wg": _m80("after_dkv", True),
    "m80adv": _m80("after_dv", False),
    "m80bdk": _m80("before_dk", False),
    "m80advwg": _m80("after_dv", True),
    "m80bdkwg": _m80("before_dk", True),
})


@contextlib.contextmanager
def forced(cfg):
    real = launcher.bwd_config_for
    launcher.bwd_config_for = lambda *args, **kwargs: cfg  # whatever the launcher passes (max_seqlen_q too)
    try:
        yield
    finally:
        launcher.bwd_config_for = real


def windowed(impls, window):
    """cute_attn and FA4 with window_size=window (their fn's causal flag unused)."""
    import cute_attn
    from flash_attn.cute import flash_attn_func

    def fa4(q, k, v, causal):
        out = flash_attn_func(q, k, v, window_size=window)
        return out[0] if isinstance(out, tuple) else out

    fns = {"cute_attn": lambda q, k, v, causal: cute_attn.mha(q, k, v, window_size=window), "fa4": fa4}
    return {n: dataclasses.replace(i, fn=fns[n]) for n, i in impls.items() if n in fns}


def max_rel_diff(grads, ref):
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(grads, ref))


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    seqlens = harness.parse_int_list(sys.argv[2] if len(sys.argv) > 2 else "4096,16384")
    head_dims = harness.parse_int_list(sys.argv[3] if len(sys.argv) > 3 else "256,192")
    names = (sys.argv[4] if len(sys.argv) > 4 else "sdq").split(",")
    causals = harness.parse_flag_list(sys.argv[5] if len(sys.argv) > 5 else "0,1")
    window = tuple(int(x) for x in sys.argv[6].split(":")) if len(sys.argv) > 6 else None
    print(torch.cuda.get_device_name(), flush=True)
    base, _ = harness.load_impls(["cute_attn", "fa4", "sdpa_cudnn"])
    if window is not None:
        base, causals = windowed(base, window), [0]
    for d in head_dims:
        for causal in map(bool, causals):
            features = config.AttnFeatures(mask="local" if window else "causal" if causal else "none")
            for s in seqlens:
                impls = dict(base)
                for name in names:
                    cfg = VARIANTS[name](d, features, s)
                    if cfg is not None:
                        impls[name] = dataclasses.replace(base["cute_attn"], name=name,
                                                          context=lambda cfg=cfg: forced(cfg))
                nheads = 2048 // d if 2048 % d == 0 else 10
                b = 16384 // s
                q, k, v = (t.requires_grad_() for t in harness.random_qkv(b, s, nheads, d, torch.bfloat16, seed=s))
                dout = harness.random_qkv(b, s, nheads, d, torch.bfloat16, seed=s + 1)[0]
                grads = {}
                for name in ("cute_attn", *names):
                    if name in impls:
                        with impls[name].context():
                            grads[name] = torch.autograd.grad(impls[name].fn(q, k, v, causal), (q, k, v), dout)
                diffs = {n: max_rel_diff(g, grads["cute_attn"]) for n, g in grads.items() if n != "cute_attn"}
                del grads
                first = {n: (lambda i=i: harness.make_impl_timer(i, "bwd", q, k, v, causal, dout)) for n, i in impls.items()}
                ms, _ = harness.time_interleaved(first, rounds, lambda n, e: print("skip", n, harness.reason(e)))
                pairs = visible_pairs(s, s, causal, window) if window else s * s / (2 if causal else 1)
                flops = harness.BWD_FLOP_FACTOR * 4 * b * nheads * pairs * d
                tf = {n: flops / harness.median_ms(m) / 1e9 for n, m in ms.items()}
                ratio = lambda a, c: f"{tf[a] / tf[c]:.2f}" if a in tf and c in tf else "-"  # noqa: E731
                print(f"hd{d} {'causal' if causal else 'full'} s{s} b{b} h{nheads}: "
                      + ", ".join(f"{n} {t:.0f}" for n, t in tf.items())
                      + f" | cute_attn/fa4 {ratio('cute_attn', 'fa4')}, /cudnn {ratio('cute_attn', 'sdpa_cudnn')}, "
                      + ", ".join(f"/{n} {ratio('cute_attn', n)} (%.2f-%.2f)"
                                  % harness.round_ratio_range(ms["cute_attn"], ms[n]) for n in names if n in tf)
                      + " | grad rel diff vs default " + ", ".join(f"{n} {e:.1e}" for n, e in diffs.items()), flush=True)


if __name__ == "__main__":
    main()
