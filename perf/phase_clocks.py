"""Where a forward mainloop step's cycles go, per consumer warpgroup: the dense forward
(FP8 or bf16, head dim 128, 16K x 16 heads, no mask, its default persistent grid)
compiled with %clock reads at each phase of every mainloop step. The reads are added at
trace time by wrapping the kernel's own methods in this process (nothing in the package
changes, and the kernel is compiled fresh, never from the disk cache):

    entry -> turn (ping-pong barrier) -> QK^T issued -> O rescaled -> V wait + PV issued ->
    turn passed -> QK^T done (wait_group 1) -> softmax step -> PV done (wait_group 0) ->
    P converted

Each phase's cycles are summed over a tile's steps, and the last step's raw stamps kept;
thread 0 of each warpgroup writes them into the cu_seqlens_q slot, which the dense
unmasked kernel does not read (so: no tile queue, no varlen). Prints cycles per step per
phase (median over CTAs) and the last step's stamps of four CTAs relative to warpgroup 0's
entry. The reads cost a few registers (ptxas: 4 bytes spilled at FP8 hd 128) and a few
cycles per phase. perf/NOTES.md (session 24) has what it showed.

    python3 perf/phase_clocks.py [fp8|bf16] [pingpong: 1|0]
"""
import sys
import dataclasses
import statistics
import torch
import cutlass
import cutlass.cute as cute
from cutlass import Int32
import cute_attn.kernels.fwd_sm90 as F
from cute_attn.blocks import softmax as SM
from cute_attn import launcher, api
from cute_attn.config import fp8_fwd_config_for, fp8_with_persistent_grid, fwd_config_for, AttnFeatures
from cute_attn.fp8 import quantize_fp8

SLOTS = 32
REC = {"on": False, "ts": None, "last": None, "gemms": 0}
ORDER = ["entry", "turn", "QK issued", "O rescaled", "V wait+PV issued", "turn passed", "QK done", "softmax",
         "PV done", "P converted"]


def stamp(name):
    if REC["on"]:
        k = ORDER.index(name)
        t = cute.arch.clock()
        ts = REC["ts"]
        if k == 0:
            ts[31] = ts[31] + Int32(1)
        else:
            ts[k - 1] = ts[k - 1] + (t - REC["last"])
        ts[12 + k] = t
        REC["last"] = t


orig_step = F.FlashFwdSm90.mainloop_step
def step_rec(self, *a, **kw):
    REC["on"] = True
    REC["gemms"] = 0
    stamp("entry")
    r = orig_step(self, *a, **kw)
    REC["on"] = False
    return r
F.FlashFwdSm90.mainloop_step = step_rec

orig_wait_turn = F.FlashFwdSm90.wait_turn
def wait_turn_rec(self, wg_idx):
    orig_wait_turn(self, wg_idx)
    stamp("turn")
F.FlashFwdSm90.wait_turn = wait_turn_rec

orig_pass_turn = F.FlashFwdSm90.pass_turn
def pass_turn_rec(self, wg_idx):
    orig_pass_turn(self, wg_idx)
    stamp("turn passed")
F.FlashFwdSm90.pass_turn = pass_turn_rec

class WG:
    def __getattr__(self, name):
        return getattr(F.__dict__["_real_warpgroup"], name)
    def wait_group(self, n):
        F.__dict__["_real_warpgroup"].wait_group(n)
        stamp("QK done" if n == 1 else "PV done")
F._real_warpgroup = F.warpgroup
F.warpgroup = WG()

orig_wait_pv = F.FlashFwdSm90.wait_pv
def wait_pv_rec(self, softmax):
    orig_wait_pv(self, softmax)
    if self.pv_wait_after_softmax:  # the wait is mma_sm90's (the WG proxy above stamps the other)
        stamp("PV done")
F.FlashFwdSm90.wait_pv = wait_pv_rec

orig_sm_step = SM.OnlineSoftmax.step
def sm_step_rec(self, acc_S, is_first):
    r = orig_sm_step(self, acc_S, is_first)
    stamp("softmax")
    return r
SM.OnlineSoftmax.step = sm_step_rec

orig_s2p = F.FlashFwdSm90.scores_to_p
def s2p_rec(self, *a, **kw):
    r = orig_s2p(self, *a, **kw)
    stamp("P converted")
    return r
F.FlashFwdSm90.scores_to_p = s2p_rec

orig_gemm = F.mma_sm90.gemm
def gemm_rec(*a, **kw):
    r = orig_gemm(*a, **kw)
    if REC["on"]:
        REC["gemms"] += 1
        stamp("QK issued" if REC["gemms"] == 1 else "V wait+PV issued")
    return r
F.mma_sm90 = type("M", (), {"__getattr__": lambda self, n: getattr(__import__("cute_attn.blocks.mma_sm90", fromlist=["x"]), n),
                             "gemm": staticmethod(gemm_rec)})()

orig_rescale = SM.OnlineSoftmax.rescale
def rescale_rec(self, acc_O, row_scale):
    orig_rescale(self, acc_O, row_scale)
    stamp("O rescaled")
SM.OnlineSoftmax.rescale = rescale_rec

orig_consume = F.FlashFwdSm90.consume


@cute.jit
def consume_rec(self, g, layouts, smem, pipes, tile, block_range, seqlen, window, score, tidx, q_state, kv_state):
    ts = cute.make_rmem_tensor((SLOTS,), Int32)
    ts.fill(0)
    REC["ts"] = ts
    q_state, kv_state = orig_consume(self, g, layouts, smem, pipes, tile, block_range, seqlen, window, score, tidx,
                                     q_state, kv_state)
    bid, _, _ = cute.arch.block_idx()
    if tidx % 128 == 0:
        base = (bid * 2 + tidx // 128) * SLOTS
        for k in cutlass.range_constexpr(SLOTS):
            g.cu_seqlens_q[base + k] = ts[k]
    return q_state, kv_state
F.FlashFwdSm90.consume = consume_rec


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "fp8"
    pingpong = (sys.argv[2] != "0") if len(sys.argv) > 2 else True
    d, s, h = 128, 16384, 16
    feat, args = api._features_and_args(False, (-1, -1), 0.0, d ** -0.5)
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, h, s, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros(sms * 2 * SLOTS, dtype=torch.int32, device="cuda")  # (CTA, warpgroup, slot)
    cu = launcher._unused_cu_seqlens(q.device)
    if kind == "fp8":
        cfg = fp8_with_persistent_grid(fp8_fwd_config_for(d, feat), d, feat, sms)
        q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v)
        sink = launcher._placeholder(q.device, (1,)).view(torch.float32)
        fn = launcher.compile_fwd(launcher.FwdKey("e4m3", d, feat, dataclasses.replace(cfg, pingpong=pingpong)))
        call = lambda: fn(q8, k8, launcher.transpose_v_fp8(v8), out, lse, buf, cu, qd, kd, vd, sink,
                          args.max_seqlen_q, args.softmax_scale, 0.0, *args.window)
    else:
        from cute_attn.config import with_persistent_grid
        cfg = with_persistent_grid(fwd_config_for(d, feat), d, feat, sms)
        fn = launcher.compile_fwd(launcher.FwdKey("bf16", d, feat, dataclasses.replace(cfg, pingpong=pingpong)))
        pt = launcher._unused_page_table(q.device)
        call = lambda: fn(q, k, v, out, lse, buf, cu, pt, args.max_seqlen_q, args.softmax_scale, 0.0, *args.window)
    print(kind, "pingpong", pingpong, cfg)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    t = buf.view(sms, 2, SLOTS).cpu().long()
    names = ORDER[1:]
    steps = t[:, :, 31].clamp(min=1)
    print("steps per tile (median):", int(steps.median()))
    for wg in range(2):
        per = [(t[:, wg, i] / steps[:, wg]).median().item() for i in range(len(names))]
        print(f"WG{wg} cycles per step: " + ", ".join(f"{n} {p:.0f}" for n, p in zip(names, per)),
              f"| total {sum(per):.0f}")
    # the last step's raw stamps in CTA 0..3, relative to WG0's entry
    for cta in range(4):
        base = t[cta, 0, 12].item()
        for wg in range(2):
            print(f"CTA{cta} WG{wg} last step:", [((t[cta, wg, 12 + i].item() - base + 2**31) % 2**32) - 2**31
                                                   for i in range(len(ORDER))])


if __name__ == "__main__":
    main()
