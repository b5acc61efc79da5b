"""A schematic timeline of the forward kernel's warp-specialised pipeline, computed from its
barrier protocol (cute_attn/kernels/fwd_sm90.py) with made-up unit durations.

Each agent below is the kernel's program for one role, written as the sequence of barrier
waits, arrivals and asynchronous operations it performs:

    producer()   warp 0 of warpgroup 0: TMA loads of Q, then K and V into `stages`-deep rings
    consumer()   each MMA warpgroup: WGMMAs, the online softmax, releases of ring stages

and a tiny discrete-event simulation runs them against three shared resources: the TMA
unit (one tile at a time), the tensor cores (one WGMMA group at a time, first issued, first
served) and the exp units (one warpgroup's softmax at a time: every warpgroup has a warp on
each of the SM's four sub-partitions, and each sub-partition has one MUFU pipe).

It is a teaching model, not a measurement: real WGMMAs of two warpgroups interleave
instruction by instruction, loads hit L2 at varying speed, and the softmax also uses the
FMA pipes. It reproduces who waits on whom, which is what the figures are for. A
protocol mistake (a wait nobody signals) shows up here as a DeadlockError.
"""

import heapq
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Durations:
    """Illustrative costs in arbitrary units (head dim 128, tile 128 x 128, per warpgroup)."""

    load: float = 0.5  # one K or V tile by TMA (mostly L2 hits: every m-block reads them)
    qk: float = 1.0  # S = Q K^T for one warpgroup's 64 rows
    pv: float = 1.0  # O += P V for one warpgroup's 64 rows
    softmax: float = 1.2  # row max, exp2, row sum over 64 x 128 scores (MUFU bound)
    rescale: float = 0.1  # O *= exp2(m_old - m_new), on the FMA pipes


@dataclass
class Bar:
    lane: str
    start: float
    end: float
    label: str
    kind: str  # load_q, load_k, load_v, qk, pv, softmax, rescale


@dataclass
class Timeline:
    bars: list = field(default_factory=list)
    num_wg: int = 2

    @property
    def makespan(self):
        return max(b.end for b in self.bars)


class DeadlockError(RuntimeError):
    pass


# A WGMMA group of a 64 x 128 x 128 GEMM is 8 instructions (K = 128 in steps of 16); the
# softmax is modelled as 8 chunks too. Warpgroups that issue at the same time therefore
# interleave on the shared units instead of one going wholly first.
CHUNKS = 8
ISSUE = 0.01  # time to issue one instruction


def producer(n, stages, overlap, d):
    """fwd_sm90.FlashFwdSm90.produce: Q once, then K/V. With intra-warpgroup overlap the
    consumers need K[j] before V[j+1] (they issue QK^T of block j with PV of block j+1),
    so V runs one block behind K. `i` counts visited blocks; the kernel walks n_block
    j = n - 1 - i, from the last block down."""
    yield ("use", "tma", d.load, "TMA", "Q", "load_q", "Q_full")
    if overlap:
        order = [("K", 0)] + [x for i in range(1, n) for x in (("K", i), ("V", i - 1))]
        order.append(("V", n - 1))
    else:
        order = [x for i in range(n) for x in (("K", i), ("V", i))]
    for name, i in order:
        if i >= stages:  # producer_acquire: the stage's empty barrier, freed by every WG
            yield ("wait", f"{name}_empty{i - stages}")
        kind = "load_k" if name == "K" else "load_v"
        yield ("use", "tma", d.load, "TMA", f"{name}{n - 1 - i}", kind, f"{name}_full{i}")


def consumer(w, n, num_wg, overlap, pingpong, d):
    """fwd_sm90.FlashFwdSm90.consume / mainloop_step for warpgroup w."""
    lane = f"WG{w + 1}"
    nxt = (w + 1) % num_wg
    turns = [0]  # tokens this WG has received

    def j(i):
        return n - 1 - i

    def gemm(kind, i):
        """Issue one WGMMA group: CHUNKS instructions, each queued on the tensor cores
        (async: the warpgroup does not wait). Returns the event of the last one."""
        dur = (d.qk if kind == "qk" else d.pv) / CHUNKS
        label = f"{kind.upper()}{j(i)}"
        for c in range(CHUNKS):
            yield ("use", "tensor", dur, lane, label, kind, f"{kind}{w}_{i}_{c}")
            yield ("delay", ISSUE)
        return f"{kind}{w}_{i}_{CHUNKS - 1}"

    def wait_turn(i):
        if pingpong:
            yield ("wait", f"turn{w}_{turns[0]}")
            turns[0] += 1

    def pass_turn(i):
        if pingpong:
            # the next WG's k-th token; WG0 starts with token 0, so its next is 1 later
            k = i - 1 + (1 if nxt == 0 else 0)
            yield ("arrive", f"turn{nxt}_{k}", 1)

    def softmax(i):  # a warp's instruction stream: each chunk waits for the last
        for c in range(CHUNKS):
            ev = f"sm{w}_{i}_{c}"
            yield ("use", "mufu", d.softmax / CHUNKS, lane, f"sm{j(i)}", "softmax", ev)
            yield ("wait", ev)

    def rescale(i):  # O *= exp2(m_old - m_new) before O += P_i V_i
        yield ("use", f"alu{w}", d.rescale, lane, f"rs{j(i)}", "rescale", f"rs{w}_{i}")
        yield ("wait", f"rs{w}_{i}")

    def pv_step(i):  # wait V, O += P V, wait for it, release V
        yield ("wait", f"V_full{i}")
        ev = yield from gemm("pv", i)
        yield ("wait", ev)
        yield ("arrive", f"V_empty{i}", num_wg)

    yield ("wait", "Q_full")
    # first block: S = Q K^T, (mask), softmax -> P; no turn taken
    yield ("wait", "K_full0")
    ev = yield from gemm("qk", 0)
    yield ("wait", ev)
    yield ("arrive", "K_empty0", num_wg)
    yield from softmax(0)
    if not overlap:
        yield from pv_step(0)
    for i in range(1, n):
        yield ("wait", f"K_full{i}")
        yield from wait_turn(i)
        ev_qk = yield from gemm("qk", i)
        if overlap:
            yield from rescale(i - 1)  # for PV of block i-1, under the QK^T WGMMA
            yield ("wait", f"V_full{i - 1}")
            ev_pv = yield from gemm("pv", i - 1)
            yield from pass_turn(i)
            yield ("wait", ev_qk)  # wgmma.wait_group 1: QK^T done, PV may still run
            yield ("arrive", f"K_empty{i}", num_wg)
            yield from softmax(i)  # overlaps this WG's PV
            yield ("wait", ev_pv)  # wgmma.wait_group 0
            yield ("arrive", f"V_empty{i - 1}", num_wg)
        else:
            yield from pass_turn(i)
            yield ("wait", ev_qk)
            yield ("arrive", f"K_empty{i}", num_wg)
            yield from softmax(i)
            yield from rescale(i)
            yield from pv_step(i)
    if overlap:
        yield from rescale(n - 1)
        yield from pv_step(n - 1)


def simulate(n_blocks=6, num_wg=2, overlap=True, pingpong=True, stages=2, d=Durations()):
    """Run the producer and `num_wg` consumers; returns a Timeline of the bars."""
    agents = [producer(n_blocks, stages, overlap, d)]
    agents += [consumer(w, n_blocks, num_wg, overlap, pingpong and num_wg > 1, d)
               for w in range(num_wg)]
    now = [0.0] * len(agents)
    events = {}  # name -> time it fires
    waiters = defaultdict(list)  # event name -> agents blocked on it
    arrivals = defaultdict(list)
    free = defaultdict(float)  # resource -> time it becomes free
    bars = {}
    heap = [(0.0, a) for a in range(len(agents))]
    done = set()

    def fire(name, t):
        events[name] = t
        for a in waiters.pop(name, []):
            now[a] = max(now[a], t)
            heapq.heappush(heap, (now[a], a))

    if pingpong and num_wg > 1:
        fire("turn0_0", 0.0)  # warpgroup 0 takes the first turn
    while heap:
        t, a = heapq.heappop(heap)
        if a in done or t < now[a]:
            continue
        while True:
            try:
                op = next(agents[a])
            except StopIteration:
                done.add(a)
                break
            if op[0] == "wait":
                if op[1] not in events:
                    waiters[op[1]].append(a)
                    break
                if events[op[1]] > now[a]:
                    now[a] = events[op[1]]
                    heapq.heappush(heap, (now[a], a))  # keep agents in time order
                    break
            elif op[0] == "arrive":
                _, name, needed = op
                arrivals[name].append(now[a])
                if len(arrivals[name]) == needed:
                    fire(name, max(arrivals[name]))
            elif op[0] == "delay":
                now[a] += op[1]
                heapq.heappush(heap, (now[a], a))
                break
            else:  # ("use", resource, duration, lane, label, kind, done_event)
                _, res, dur, lane, label, kind, ev = op
                start = max(now[a], free[res])
                free[res] = start + dur
                bar = bars.get((lane, label))  # chunks of one operation make one bar
                if bar is None:
                    bars[(lane, label)] = Bar(lane, start, start + dur, label, kind)
                else:
                    bar.end = start + dur
                fire(ev, start + dur)
    if len(done) != len(agents):
        raise DeadlockError(f"blocked on: {sorted(waiters)}")
    return Timeline(list(bars.values()), num_wg)


COLORS = {
    "load_q": "#9e9e9e", "load_k": "#7e57c2", "load_v": "#8d6e63",
    "qk": "#1e88e5", "pv": "#fb8c00", "softmax": "#43a047", "rescale": "#546e7a",
}


def draw(ax, timeline, title="", xmax=None):
    """Lanes: the producer's TMA loads, then per warpgroup its WGMMAs (upper half: on the
    shared tensor cores) and its own CUDA-core work (lower half: softmax, rescale)."""
    lanes = ["TMA"] + [f"WG{w + 1}" for w in range(timeline.num_wg)]
    y = {name: len(lanes) - 1 - i for i, name in enumerate(lanes)}
    for b in timeline.bars:
        base = y[b.lane]
        if b.lane == "TMA":
            y0, h = base + 0.15, 0.7
        elif b.kind in ("qk", "pv"):
            y0, h = base + 0.5, 0.42
        else:
            y0, h = base + 0.08, 0.42
        ax.broken_barh([(b.start, b.end - b.start)], (y0, h), facecolors=COLORS[b.kind],
                       edgecolor="white", linewidth=0.5)
        if b.label and b.end - b.start >= 0.45:
            ax.text((b.start + b.end) / 2, y0 + h / 2, b.label, ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_yticks([y[n] + 0.5 for n in lanes], lanes, fontsize=8)
    ax.set_ylim(0, len(lanes))
    ax.set_xlim(0, xmax or timeline.makespan * 1.02)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"{title}  (makespan {timeline.makespan:.1f} units)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def legend(fig):
    from matplotlib.patches import Patch

    names = {"load_q": "TMA Q", "load_k": "TMA K", "load_v": "TMA V", "qk": "WGMMA QK^T",
             "pv": "WGMMA PV", "softmax": "softmax", "rescale": "rescale O"}
    handles = [Patch(color=COLORS[k], label=v) for k, v in names.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7,
               frameon=False)
