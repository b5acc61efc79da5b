"""Where a backward CTA's time goes: the main kernel (kernels/bwd_sm90.py) compiled with
clock reads at the edges of its phases, per CTA, for one shape. The reads are added at trace
time by wrapping the kernel's own methods in this process (nothing in the package changes;
the kernels compile fresh into a temporary cache folder). Each CTA's consumer thread 0 and
producer lane 0 store their stamps with `st.global` into a buffer whose address is baked
into the kernel:

    producer entry (warp 0, after the barrier inits) -> consumer entry (after setmaxnreg)
    -> K/V landed? (no: the first step's start) -> first step start -> last step end
    -> consumer exit (dK / dV stores issued)

in %globaltimer nanoseconds (one clock for every SM: the gaps between one CTA's exit and
the next CTA's entry on the same SM, read from %smid) and %clock64 cycles (the phases
inside a CTA). Prints the medians over CTAs: prologue (producer entry -> first step),
cycles and ns per step, epilogue (last step end -> consumer exit), the CTA's span, the gap
to the next CTA on its SM, CTAs per SM, and the kernel's span. FA4's main kernel has no
such probe: compare its time per CTA from perf/bwd_kernel_times.py (total / CTAs x SMs).

    python3 perf/bwd_cta_clocks.py HEAD_DIM SEQLEN CAUSAL(0|1)     # 16K tokens, 2048 / hd heads

(perf/NOTES.md, session 32, says why: the hd-64 backward trails FA4 by 4-8% at 512-2K.)
"""
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import cute_attn  # noqa: E402
import cute_attn.kernels.bwd_sm90 as B  # noqa: E402

SLOTS = 8  # per CTA: smid, producer entry ns, consumer entry ns, first step ns, last step end ns,
# consumer exit ns, steps, (first step - consumer entry) | (exit - last step end) cycles packed
MAX_CTAS = 1 << 16
STATE = {"addr": 0, "rec": None}


@dsl_user_op
def _special(reg: str, *, loc=None, ip=None) -> Int64:
    """A 64-bit special register (%globaltimer, %clock64) read with side effects (not moved)."""
    return Int64(llvm.inline_asm(T.i64(), [], f"mov.u64 $0, {reg};", "=l", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _smid(*, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %smid;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _store(slot, value: Int64, *, loc=None, ip=None):
    """buf[slot] = value (int64) at the buffer's baked-in address."""
    addr = Int64(STATE["addr"]) + Int64(slot) * 8
    llvm.inline_asm(None, [addr.ir_value(loc=loc, ip=ip), Int64(value).ir_value(loc=loc, ip=ip)],
                    "st.global.u64 [$0], $1;", "l,l", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def _cta_base():
    bx, by, bz = cute.arch.block_idx()
    gx, gy, _ = cute.arch.grid_dim()
    return (bx + gx * (by + gy * bz)) * SLOTS


_orig_produce = B.FlashBwdSm90.produce
_orig_consume = B.FlashBwdSm90.consume
_orig_step = B.FlashBwdSm90.step


@cute.jit
def _produce(self, g, smem, pipes, tile, group, block_range, seqlen):
    if cute.arch.lane_idx() == 0:
        _store(_cta_base() + 1, _special("%globaltimer"))
    _orig_produce(self, g, smem, pipes, tile, group, block_range, seqlen)


@cute.jit
def _consume(self, g, layouts, smem, pipes, tile, group, block_range, seqlen, window, score, tidx):
    # (ns entry, ns first step, ns last step end, steps, cycles entry, cycles first, cycles last end)
    rec = cute.make_rmem_tensor((8,), Int64)
    rec.fill(0)
    rec[0] = _special("%globaltimer")
    rec[4] = _special("%clock64")
    STATE["rec"] = rec
    _orig_consume(self, g, layouts, smem, pipes, tile, group, block_range, seqlen, window, score, tidx)
    STATE["rec"] = None
    t_exit, c_exit = _special("%globaltimer"), _special("%clock64")
    if tidx == 0:
        base = _cta_base()
        _store(base + 0, Int64(_smid()))
        _store(base + 2, rec[0])
        _store(base + 3, rec[1])
        _store(base + 4, rec[2])
        _store(base + 5, t_exit)
        _store(base + 6, rec[3])
        # cycles: (first step - entry) << 32 | (exit - last step end)
        _store(base + 7, ((rec[5] - rec[4]) << 32) | (c_exit - rec[6]))


@cute.jit
def _step(self, m_block, *args, **kwargs):
    rec = STATE["rec"]
    if rec[3] == 0:
        rec[1] = _special("%globaltimer")
        rec[5] = _special("%clock64")
    _orig_step(self, m_block, *args, **kwargs)
    rec[2] = _special("%globaltimer")
    rec[6] = _special("%clock64")
    rec[3] = rec[3] + 1


def instrument(addr: int):
    """Swap the wrapped methods in (the next backward compiled in this process stamps into
    the int64 buffer at device address addr, SLOTS per CTA)."""
    STATE["addr"] = addr
    B.FlashBwdSm90.produce, B.FlashBwdSm90.consume, B.FlashBwdSm90.step = _produce, _consume, _step


def main():
    head_dim, seqlen, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    os.environ["CUTE_ATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="bwd_cta_clocks_")  # never a cached kernel
    buf = torch.zeros(MAX_CTAS * SLOTS, dtype=torch.int64, device="cuda")
    instrument(buf.data_ptr())
    b, h = harness.sweep_shape(seqlen, head_dim)
    q, k, v = (t.requires_grad_() for t in harness.random_qkv(b, seqlen, h, head_dim, torch.bfloat16))
    dout = torch.randn_like(q)
    out = cute_attn.mha(q, k, v, causal=causal)
    for _ in range(3):  # the last backward's stamps stay
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    t = buf.view(MAX_CTAS, SLOTS).cpu()
    ctas = int((t[:, 6] > 0).sum())
    t = t[:ctas]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} | hd {head_dim} seqlen {seqlen} causal {causal} b{b} h{h}: {ctas} CTAs "
          f"with steps ({ctas / sms:.1f} per SM)")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    steps = t[:, 6].tolist()
    pro_ns = (t[:, 3] - t[:, 1]).tolist()
    entry_gap_ns = (t[:, 2] - t[:, 1]).tolist()
    step_ns = ((t[:, 4] - t[:, 3]) / (t[:, 6] - 1).clamp(min=1)).tolist()
    epi_ns = (t[:, 5] - t[:, 4]).tolist()
    span_ns = (t[:, 5] - t[:, 1]).tolist()
    cyc = t[:, 7]
    first_cyc, epi_cyc = (cyc >> 32).tolist(), (cyc & 0xFFFFFFFF).tolist()
    print(f"steps per CTA: median {med(steps):.0f}, mean {statistics.mean(steps):.2f}")
    print(f"producer entry -> consumer entry {med(entry_gap_ns):.0f} ns; -> first step {med(pro_ns):.0f} ns "
          f"(consumer entry -> first step {med(first_cyc):.0f} cycles)")
    print(f"per step {med(step_ns):.0f} ns (first start -> last end over steps - 1)")
    print(f"epilogue (last step end -> consumer exit) {med(epi_ns):.0f} ns, {med(epi_cyc):.0f} cycles")
    print(f"CTA span (producer entry -> consumer exit) {med(span_ns):.0f} ns")
    # the same SM's next CTA: entry after this one's exit
    by_sm = {}
    for row in t.tolist():
        by_sm.setdefault(row[0], []).append((row[1], row[5]))
    gaps = []
    for rows in by_sm.values():
        rows.sort()
        gaps += [nxt[0] - cur[1] for cur, nxt in zip(rows, rows[1:])]
    if gaps:
        print(f"gap from a CTA's exit to the next CTA's entry on its SM: median {med(gaps):.0f} ns, "
              f"p10 {sorted(gaps)[len(gaps) // 10]:.0f}, p90 {sorted(gaps)[9 * len(gaps) // 10]:.0f} "
              f"(negative: two CTAs resident at once)")
    print(f"kernel span (first entry -> last exit) {(t[:, 5].max() - t[:, 1].min()).item() / 1e3:.1f} us")


if __name__ == "__main__":
    main()
