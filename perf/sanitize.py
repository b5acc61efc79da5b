"""compute-sanitizer over one small case of every kernel: memcheck, racecheck, synccheck and
initcheck, failing on any device-side report.

    python3 perf/sanitize.py                      # every tool x every case, ~4-6 min on an H100
    python3 perf/sanitize.py --tools racecheck --cases bwd-causal-gqa --keep-logs $OUT

Each (tool, case group) runs in its own child process (`compute-sanitizer --tool T ...
python3 perf/sanitize.py --child CASES`), up to --jobs at once, so the compiles of the
groups overlap on the host's cores. The child builds random inputs for each case, calls
cute_attn (forward, then the backward through autograd for the cases that have one),
synchronises, and prints a line per finished case; it runs no reference and no other
torch work beyond making the inputs, so the kernels under test are nearly all that the
tool sees.

initcheck cannot see TMA stores initialise global memory (measured: `poison_next_outputs`),
so each child fills the blocks its outputs will take with NaN through torch first, and
checks afterwards that no NaN is left in out.

Host-API noise, filtered explicitly: cuda-bindings probes the driver with
`cuGetProcAddress` for entry points the driver may not have, and each failed probe is a
"Program hit CUDA_ERROR_NOT_FOUND" host API report. Those are host-side and expected, so
the tools run with `--report-api-errors no`; nothing else is filtered. A run fails when a
tool's summary counts any error, any hazard (racecheck's errors and warnings alike, with
`--racecheck-report hazard`), when the summary line is missing (the tool or the child
died), or when the child exits non-zero.

The case list covers each compiled kernel family and the code paths a shape can take:
the forward (dense, causal + GQA, sliding window, softcap, varlen with an empty sequence,
packed GQA for a short query, head dims 64 / 96 / 256, fp16) and the backward (its
preprocess, main kernel and postprocess) for the same cases, plus the deterministic
backward (semaphore turn counters). Shapes are deliberately not tile multiples.
New kernel families add their cases here.
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
TOOL_FLAGS = {
    "memcheck": ["--leak-check", "no"],
    # "hazard" lists every hazard with its addresses; the default "analysis" summarises
    "racecheck": ["--racecheck-report", "hazard"],
    "synccheck": [],
    "initcheck": [],
}
# See the module docstring: cuda-bindings' cuGetProcAddress probing is host API noise.
COMMON_FLAGS = ["--report-api-errors", "no", "--print-limit", "20"]


@dataclass(frozen=True)
class Case:
    """One small attention problem. lengths: varlen (seqlen_q, seqlen_k) per sequence."""

    name: str
    head_dim: int = 128
    batch: int = 2
    seqlen_q: int = 300
    seqlen_k: int = 333
    nheads: int = 4
    nheads_kv: int = 4
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    dtype: str = "bf16"
    lengths: tuple | None = None
    backward: bool = True
    deterministic: bool = False
    kvcache: bool = False  # mha_with_kvcache: seqlen_q new tokens appended to a seqlen_k cache
    num_splits: int = 0  # kvcache cases: forced split-KV count (0 = the heuristic)
    page_size: int = 0  # kvcache cases: a paged cache of this page size, random page table
    extra: dict = field(default_factory=dict, compare=False)


CASES = (
    Case("dense"),
    Case("causal-gqa", nheads=4, nheads_kv=2, causal=True),
    Case("window", window_size=(64, 32)),
    Case("softcap-causal", causal=True, softcap=30.0),
    Case("varlen-causal", nheads=4, nheads_kv=2, causal=True,
         lengths=((0, 40), (150, 200), (277, 129))),
    Case("packed-gqa-decode", batch=2, seqlen_q=3, seqlen_k=300, nheads=8, nheads_kv=1,
         causal=True, backward=False),
    Case("hd64", head_dim=64),
    Case("hd96-causal", head_dim=96, causal=True),
    Case("hd256-causal", head_dim=256, causal=True),
    Case("fp16-window-gqa", dtype="fp16", nheads=4, nheads_kv=1, window_size=(100, 0)),
    Case("deterministic-causal-gqa", nheads=4, nheads_kv=2, causal=True, deterministic=True),
    # batch 1, one query, 3000 keys: a grid of 2 CTAs, so mha takes split-KV + the combine
    Case("split-decode-gqa", batch=1, seqlen_q=1, seqlen_k=3000, nheads=8, nheads_kv=2,
         causal=True, backward=False),
    # head dim 64 decode: the split tile of config.split_decode_config (64 rows, 4 stages)
    Case("split-decode-hd64-gqa", batch=2, seqlen_q=1, seqlen_k=3000, nheads=16, nheads_kv=2, head_dim=64,
         causal=True, backward=False),
    Case("kvcache-paged16-hd64", batch=2, seqlen_q=1, seqlen_k=704, nheads=16, nheads_kv=2, head_dim=64,
         causal=True, backward=False, kvcache=True, num_splits=3, page_size=16),
    # per-entry lengths read on the device, in-place append, forced 3 splits + combine
    Case("kvcache-append-split", batch=3, seqlen_q=2, seqlen_k=700, nheads=8, nheads_kv=2,
         causal=True, backward=False, kvcache=True, num_splits=3),
    # a paged cache, 16-key pages (8 TMA boxes per KV block) in a permuted page table
    Case("kvcache-paged16", batch=3, seqlen_q=2, seqlen_k=704, nheads=8, nheads_kv=2,
         causal=True, backward=False, kvcache=True, num_splits=2, page_size=16),
    # FP8 forward (e4m3 in, bf16 out, random descales) and its V transpose kernel
    Case("fp8-causal-gqa", dtype="fp8", nheads=4, nheads_kv=2, causal=True, backward=False),
    Case("fp8-hd256-window-softcap", dtype="fp8", head_dim=256, window_size=(64, 32), softcap=30.0,
         backward=False),
    # FP8 with a learnable sink (the sink's exp folded into the fp8 forward's row sums)
    Case("fp8-sink-causal-gqa", dtype="fp8", nheads=4, nheads_kv=2, seqlen_q=333, seqlen_k=517, causal=True,
         backward=False, extra={"sink": True}),
    Case("fp8-varlen-causal", dtype="fp8", nheads=4, nheads_kv=2, causal=True, backward=False,
         lengths=((0, 40), (150, 200), (277, 129))),
    # mask / score mods (FlashFwdSm90Mods: block-mask lists, aux tensors read per element)
    Case("mods-bd3lm-gqa", seqlen_q=302, seqlen_k=302, nheads=4, nheads_kv=2, backward=False,
         extra={"mods": "bd3lm"}),
    Case("mods-document-alibi-hd64", head_dim=64, seqlen_q=333, backward=False, extra={"mods": "document_alibi"}),
    # and its backward (ALiBi traced with a Dual score: the per-element body)
    Case("mods-document-alibi-bwd-hd64", head_dim=64, seqlen_q=333, extra={"mods": "document_alibi"}),
    Case("mods-empty-rows-hd256", head_dim=256, seqlen_q=333, backward=False, extra={"mods": "empty_rows"}),
    # attention sinks and dropout (the mods' entry points, forward and backward)
    Case("sink-dropout-causal-gqa", nheads=4, nheads_kv=2, causal=True, extra={"sink": True, "dropout": 0.2}),
    Case("mods-bd3lm-dropout-hd64", head_dim=64, seqlen_q=302, seqlen_k=302, extra={"mods": "bd3lm", "dropout": 0.1}),
    Case("dropout-hd256-window", head_dim=256, window_size=(64, 32), extra={"dropout": 0.3}),
    # dropout beside a score derivative (softcap: dP^T masked before the fold)
    Case("dropout-softcap-causal-gqa", nheads=4, nheads_kv=2, causal=True, softcap=20.0, extra={"dropout": 0.2}),
    # packed sequences with a sink and dropout; the deterministic backward's block-mask turns
    Case("varlen-sink-dropout-gqa", nheads=4, nheads_kv=2, causal=True, lengths=((0, 40), (150, 200), (277, 129)),
         extra={"sink": True, "dropout": 0.2}),
    Case("mods-bd3lm-deterministic-gqa", seqlen_q=302, seqlen_k=302, nheads=4, nheads_kv=2, deterministic=True,
         extra={"mods": "bd3lm"}),
    # mods in a packed batch: per-sequence block-mask lists, global indices (an empty sequence)
    Case("varlen-mods-document-gqa", nheads=4, nheads_kv=2, lengths=((40, 40), (0, 0), (150, 150), (277, 277)),
         extra={"mods": "packed_document"}),
    # bad offsets that bypassed the host's check (see run_case): out of order, past the
    # tensor, negative; forward and backward, FP8 (its V^T transpose reads by offset) too
    Case("varlen-bad-offsets", nheads=4, nheads_kv=2, causal=True, lengths=((40, 40), (150, 200), (277, 129)),
         extra={"bad_offsets": True}),
    Case("varlen-bad-offsets-fp8", dtype="fp8", nheads=4, nheads_kv=2, backward=False,
         lengths=((40, 40), (150, 200), (277, 129)), extra={"bad_offsets": True}),
    # ... with a mask mod, whose block-mask lists (cached per tensor version) outlive the
    # offsets, and deterministic: the clamped spans overlap, two KV blocks meet one dQ turn
    Case("varlen-bad-offsets-mods-deterministic", nheads=4, nheads_kv=2, deterministic=True,
         lengths=((40, 40), (150, 150), (277, 277)), extra={"bad_offsets": True, "mods": "packed_document"}),
    # the head-dim-split backward of 192/256 (P^T / dS^T through shared memory): the sdQ
    # tile at 192, dQ by atomics at 256 (hd256-causal above), and the deterministic one's
    # sdQ tile with its ordered reduce-adds at 256
    Case("split-d-hd192-varlen", head_dim=192, nheads=4, nheads_kv=1, causal=True,
         lengths=((0, 40), (150, 200), (277, 129))),
    Case("split-d-hd256-deterministic-gqa", head_dim=256, nheads=4, nheads_kv=2, causal=True, deterministic=True),
    # the FP8 forward's double-buffered P (fp8_fwd_config_for's at hd 128 without a mask),
    # forced (extra "config") so the case keeps covering it whatever the default
    Case("fp8-p-double-hd128", dtype="fp8", seqlen_q=700, seqlen_k=900, backward=False,
         extra={"config": "p_double_buffer"}),
    # the persistent FP8 forward (config.fp8_with_persistent_grid) over 8 x 16 x 4 = 512
    # causal tiles: the tile queue's tickets; and round robin without a mask
    Case("fp8-persistent-causal-gqa", dtype="fp8", batch=4, seqlen_q=1000, seqlen_k=1000, nheads=16, nheads_kv=4,
         causal=True, backward=False),
    Case("fp8-persistent-hd256", dtype="fp8", head_dim=256, batch=4, seqlen_q=1000, seqlen_k=1011, nheads=16,
         nheads_kv=16, backward=False),
    # more tiles than an H100's 132 SMs (6 x 16 x 4 = 384 at 192 rows): the persistent
    # forward's CTAs walk 2-3 tiles each, the rings and ping-pong turns running on; causal:
    # the same through the tile queue (8 x 16 x 4 = 512 tiles: tickets, the hand-off)
    Case("persistent-hd64-gqa", head_dim=64, batch=4, seqlen_q=1000, seqlen_k=1111, nheads=16, nheads_kv=4,
         softcap=20.0),
    # head dims 65-128 without a mask from 4K keys keep one tile per CTA
    # (config.long_unmasked_tiles) with the FMNMX row max: a key length past the rule, and
    # 128 query tiles, enough that the launcher does not split the keys (choose_splits)
    Case("long-keys-hd128-gqa", batch=2, seqlen_q=1000, seqlen_k=4200, nheads=8, nheads_kv=4, backward=False),
    # the pinned descriptors (FlashFwdSm90.pin_descriptors) of head dim 64's persistent
    # causal forward, through the tile queue
    Case("persistent-queue-causal-hd64-gqa", head_dim=64, batch=4, seqlen_q=1000, seqlen_k=1000, nheads=16,
         nheads_kv=4, causal=True, backward=False),
    Case("persistent-queue-causal-gqa", batch=4, seqlen_q=1000, seqlen_k=1000, nheads=16, nheads_kv=4, causal=True),
    # the same tiles dealt round robin (no queue), and through the queue without GQA
    Case("persistent-rr-causal-gqa", batch=4, seqlen_q=1000, seqlen_k=1000, nheads=16, nheads_kv=4, causal=True,
         backward=False, extra={"config": "round_robin"}),
    Case("persistent-queue-causal", batch=4, seqlen_q=1000, seqlen_k=1000, nheads=16, nheads_kv=16, causal=True,
         backward=False),
    # the backward with two sdS buffers (BwdConfig.ds_stages; the default at head dim 64 and
    # at 128 without a mask, forced at 128 causal): dS^T written with no barrier before it,
    # causal GQA with a group of query heads
    Case("bwd-ds2-causal-gqa", batch=2, seqlen_q=700, seqlen_k=700, nheads=8, nheads_kv=2, causal=True,
         extra={"config": "ds2"}),
    # BwdConfig.dq_handoff_per_wg: a barrier pair per warpgroup between the consumers and
    # the dQ writer, and the two halves of sdQ reduced one after the other
    Case("bwd-dq-per-wg-causal-gqa", batch=2, seqlen_q=700, seqlen_k=700, nheads=8, nheads_kv=2, causal=True,
         extra={"config": "dq_per_wg"}),
    Case("bwd-ds2-hd64-deterministic", head_dim=64, seqlen_q=500, seqlen_k=600, nheads=4, nheads_kv=4,
         deterministic=True),
    # 80 query rows per step with dQ^T = K^T dS^T (BwdConfig.dq_swapped; m80bdkwg is head dim 128's default):
    # dS stored queries x keys by stmatrix .trans, two sdS buffers, 80-row Q / dO / LSE2 / D
    # stages; lengths not multiples of 80; GQA, and varlen with the deterministic turns
    Case("bwd-m80-gqa", batch=2, seqlen_q=700, seqlen_k=900, nheads=8, nheads_kv=2, extra={"config": "m80"}),
    Case("bwd-m80-varlen-deterministic", nheads=4, nheads_kv=2, deterministic=True,
         lengths=((0, 40), (150, 200), (277, 129)), extra={"config": "m80"}),
    Case("bwd-m80-per-wg-gqa", batch=2, seqlen_q=700, seqlen_k=900, nheads=8, nheads_kv=2, extra={"config": "m80wg"}),
    # BwdConfig.dq_order: dQ^T issued before dK, its sdQ store under dK ("before_dk"), or
    # once dV is done, under dK ("after_dv")
    Case("bwd-m80-before-dk-gqa", batch=2, seqlen_q=700, seqlen_k=900, nheads=8, nheads_kv=2,
         extra={"config": "m80bdk"}),
    Case("bwd-m80-before-dk-per-wg-varlen", nheads=4, nheads_kv=2, lengths=((0, 40), (150, 200), (277, 129)),
         extra={"config": "m80bdkwg"}),
    # the same under the causal mask (the default from 2K query rows): the diagonal cutting
    # 80-row blocks at every offset against the 128-key tiles, rows with no visible key
    Case("bwd-m80-causal-gqa", batch=2, seqlen_q=700, seqlen_k=600, nheads=8, nheads_kv=2, causal=True,
         extra={"config": "m80bdkwg"}),
    Case("bwd-m80-after-dv-gqa", batch=2, seqlen_q=700, seqlen_k=900, nheads=8, nheads_kv=2,
         extra={"config": "m80adv"}),
    # BwdConfig.do_stages 1 (head dim 256): dO's one-stage ring with its own pipeline state,
    # released once dV's WGMMA retired, while Q keeps two stages; causal GQA, ragged lengths
    Case("bwd-do1-hd256-causal-gqa", head_dim=256, batch=2, seqlen_q=333, seqlen_k=400, nheads=4, nheads_kv=2,
         causal=True, extra={"config": "do1"}),
    # kernels/combine.py (context parallelism's LSE merge): 3 splits, 300 rows, in place too
    Case("lse-combine", batch=2, seqlen_q=300, nheads=3, backward=False, extra={"combine": 3}),
)
CASE_BY_NAME = {c.name: c for c in CASES}

# Child processes per tool: the cases are dealt round-robin into this many groups.
GROUPS_PER_TOOL = 3

_SUMMARY = {
    # "========= ERROR SUMMARY: 0 errors"
    "error": re.compile(r"=+\s+ERROR SUMMARY:\s+(\d+)\s+error"),
    # "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    "racecheck": re.compile(
        r"=+\s+RACECHECK SUMMARY:\s+(\d+)\s+hazards? displayed\s+\((\d+)\s+errors?,\s+(\d+)\s+warnings?\)"
    ),
}


# ----------------------------------------------------------------------------------------
# Pure helpers (tested on the CPU by tests/test_sanitize_cpu.py)
# ----------------------------------------------------------------------------------------

def groups(cases, n):
    """Deal cases round-robin into at most n non-empty groups (their order kept)."""
    n = max(1, min(n, len(cases)))
    return [list(cases[i::n]) for i in range(n)]


def sanitizer_command(tool, case_names, python=sys.executable):
    if tool not in TOOLS:
        raise ValueError(f"tool must be one of {TOOLS}, got {tool!r}")
    return ["compute-sanitizer", "--tool", tool, *COMMON_FLAGS, *TOOL_FLAGS[tool],
            python, str(Path(__file__).resolve()), "--child", ",".join(case_names)]


def parse_report(tool, text):
    """(device_reports, problem) from one sanitizer run's output: device_reports counts the
    errors (and for racecheck the hazards, warnings included); problem is None, or why the
    run cannot be trusted (no summary line)."""
    if tool == "racecheck":
        m = _SUMMARY["racecheck"].search(text)
        if m:
            return int(m.group(2)) + int(m.group(3)), None
        # racecheck prints an ERROR SUMMARY instead when it found nothing to report
        m = _SUMMARY["error"].search(text)
        if m:
            return int(m.group(1)), None
        return 0, "no RACECHECK/ERROR SUMMARY line: the tool or the child did not finish"
    m = _SUMMARY["error"].search(text)
    if m is None:
        return 0, "no ERROR SUMMARY line: the tool or the child did not finish"
    return int(m.group(1)), None


def finished_cases(text):
    """The case names the child reported as finished ('case NAME done')."""
    return re.findall(r"^case (\S+) done$", text, re.M)


# ----------------------------------------------------------------------------------------
# The child: run the cases' kernels, nothing else
# ----------------------------------------------------------------------------------------

def run_case(case):
    import torch

    import cute_attn

    fp8 = case.dtype == "fp8"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[case.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    d, h, hk = case.head_dim, case.nheads, case.nheads_kv
    force_config(case.extra.get("config"))
    kwargs = dict(causal=case.causal, window_size=case.window_size, softcap=case.softcap,
                  deterministic=case.deterministic)
    if case.kvcache:
        run_kvcache_case(case, randn)
        return
    if case.extra.get("combine"):
        run_combine_case(case, gen)
        return
    if case.extra.get("mods"):
        kwargs = {**mod_kwargs(case, gen), "deterministic": case.deterministic}
    if case.extra.get("sink"):
        kwargs["learnable_sink"] = torch.randn(h, device="cuda", generator=gen)
    if case.extra.get("dropout"):
        kwargs["dropout_p"] = case.extra["dropout"]
    if case.lengths is None:
        q = randn(case.batch, case.seqlen_q, h, d)
        k, v = randn(case.batch, case.seqlen_k, hk, d), randn(case.batch, case.seqlen_k, hk, d)
    else:
        total_q = sum(lq for lq, _ in case.lengths)
        total_k = sum(lk for _, lk in case.lengths)
        q, k, v = randn(total_q, h, d), randn(total_k, hk, d), randn(total_k, hk, d)
    tensors = (q, k, v)
    if fp8:
        # before the poisoning: these allocations could take the poisoned blocks
        batch = case.batch if case.lengths is None else len(case.lengths)
        tensors = tuple(t.to(torch.float8_e4m3fn) for t in tensors)
        kwargs.update({name: 0.5 + torch.rand(batch, hk, device="cuda", generator=gen)
                       for name in ("q_descale", "k_descale", "v_descale")})
        del kwargs["deterministic"]
    if case.lengths is None:
        attend = cute_attn.mha
    else:
        offsets = [[0], [0]]
        for lq, lk in case.lengths:
            offsets[0].append(offsets[0][-1] + lq)
            offsets[1].append(offsets[1][-1] + lk)
        cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device="cuda") for o in offsets)
        max_q = max(lq for lq, _ in case.lengths)
        max_k = max(lk for _, lk in case.lengths)

        def attend(q, k, v, **kw):
            return cute_attn.mha_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        if case.extra.get("bad_offsets"):
            # offsets rewritten behind torch's version counter after a checked call: the
            # host's once-per-version check does not see them, the kernels' clamp
            # (blocks/seqlen.packed_span) must keep every access inside the tensors
            # (with the mods and a backward: the forward's and the transposed block masks,
            # built on the host from the offsets, are made and cached while they are valid)
            checked = attend(*(t.detach().requires_grad_(case.backward) for t in tensors), **kwargs)
            if case.backward:
                checked.float().sum().backward()
            cu_q.data[1] = total_q + 4096
            cu_k.data[1] = -7
    if case.extra.get("mods"):
        # build (and cache) the block mask first: its temporaries would otherwise take the
        # poisoned blocks meant for out, and initcheck then flags out's TMA-stored rows
        # (seen with the head-dim-64 BD3LM case, whose out is the size of a temporary)
        attend(*tensors, **{n: a for n, a in kwargs.items() if n in ("mask_mod", "score_mod")})
    poison_next_outputs(q)  # FP8 too: out is bf16 like this q, so the same sizes
    if case.backward:
        tensors = tuple(t.requires_grad_() for t in tensors)
    out = attend(*tensors, **kwargs)
    if out.isnan().any() and not case.extra.get("bad_offsets"):  # bad offsets: rows no one owns
        raise AssertionError(f"{case.name}: out has elements the forward never wrote")
    if case.backward:
        torch.autograd.grad(out, tensors, torch.randn_like(out))
    torch.cuda.synchronize()


_DEFAULT_CHOICES = {}  # (module, name) -> the function a forced config replaces


def force_config(name):
    """Swap the launcher's config choice for a case's forced one; every case first puts the
    defaults back, so a child that runs several cases forces nothing on the later ones."""
    import dataclasses

    from cute_attn import api, config, kvcache, launcher, tuning

    for module, attr in ((launcher, "fp8_with_persistent_grid"), (launcher, "fp8_fwd_config_for"),
                         (launcher, "bwd_config_for"), (tuning, "with_persistent_grid")):
        setattr(module, attr, _DEFAULT_CHOICES.setdefault((module, attr), getattr(module, attr)))
    # the caches that remember a choice: an earlier case of this child with the same key
    # (launcher._default_configs: dtype, head dim, features, pack, ...) would else answer
    # without asking tuning.with_persistent_grid, so a forced choice never ran (a review
    # found it on a branch: persistent-queue-causal before a forced case in one child),
    # and a forced one would outlive its case
    for cache in (launcher._default_configs, launcher._plans, api._plain_calls, kvcache._decode_steps):
        cache.clear()
    if name == "p_double_buffer":
        # one tile per CTA: the persistent FP8 grid has one P buffer
        launcher.fp8_with_persistent_grid = lambda cfg, *a: cfg
        launcher.fp8_fwd_config_for = lambda *a, **kw: dataclasses.replace(
            config.fp8_fwd_config_for(*a, **kw), p_double_buffer=True, pv_wait_after_softmax=False)
    elif name == "ds2":
        launcher.bwd_config_for = lambda *a, **kw: dataclasses.replace(
            config.bwd_config_for(*a, **kw), ds_stages=2)
    elif name == "do1":
        def one_do_stage(*a, **kw):
            cfg = config.bwd_config_for(*a, **kw)
            return dataclasses.replace(cfg, do_stages=1) if cfg.split_d and cfg.num_stages > 1 else cfg
        launcher.bwd_config_for = one_do_stage
    elif name == "dq_per_wg":
        launcher.bwd_config_for = lambda *a, **kw: dataclasses.replace(
            config.bwd_config_for(*a, **kw), ds_stages=2, dq_handoff_per_wg=True)
    elif name in ("m80", "m80wg", "m80adv", "m80bdk", "m80advwg", "m80bdkwg"):
        order = {"adv": "after_dv", "bdk": "before_dk"}.get(name[3:6], "after_dkv")
        launcher.bwd_config_for = lambda *a, **kw: dataclasses.replace(
            config.bwd_config_for(*a, **kw), tile_m=80, dq_swapped=True, ds_stages=2,
            dq_handoff_per_wg=name.endswith("wg") and not kw.get("deterministic", a[2] if len(a) > 2 else False),
            dq_order=order)
    elif name == "round_robin":
        tuning.with_persistent_grid = lambda *a, **kw: dataclasses.replace(
            config.with_persistent_grid(*a, **kw), tile_queue=False)
    elif name is not None:
        raise ValueError(f"unknown forced config {name!r}")


def mod_kwargs(case, gen):
    """mha's mask_mod / score_mod arguments of a mods case (self-attention lengths)."""
    import torch

    from cute_attn import masks

    which = case.extra["mods"]
    if which == "bd3lm":
        return dict(mask_mod=masks.block_diffusion(16))
    if which == "document_alibi":
        ids = (torch.rand(case.batch, case.seqlen_k, device="cuda", generator=gen) < 0.02).cumsum(1).to(torch.int32)
        slopes = torch.rand(case.nheads, device="cuda", generator=gen)
        return dict(mask_mod=masks.document(ids, causal=True), score_mod=masks.alibi(slopes))
    if which == "packed_document":  # ids over the packed tokens (self-attention lengths)
        total = sum(lq for lq, _ in case.lengths)
        ids = (torch.rand(total, device="cuda", generator=gen) < 0.02).cumsum(0).to(torch.int32)
        return dict(mask_mod=masks.document(ids, causal=True))
    return dict(mask_mod=lambda b, h, q, kv: (q % 7 != 3) & (kv <= q))


def run_combine_case(case, gen):
    """The LSE combine into a fresh bf16 out, then in place into split 0 (fp32), as the
    ring's running merge does."""
    import torch

    from cute_attn import launcher

    splits, b, s, h, d = case.extra["combine"], case.batch, case.seqlen_q, case.nheads, case.head_dim
    o_part = torch.randn(splits * b, s, h, d, device="cuda", generator=gen)
    lse_part = torch.randn(splits * b, h, s, device="cuda", generator=gen)
    out = torch.full((b, s, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((b, h, s), float("nan"), device="cuda")
    launcher.run_combine(o_part, lse_part, out, lse)
    launcher.run_combine(o_part, lse_part, o_part[:b], lse)
    if out.isnan().any() or lse.isnan().any():
        raise AssertionError(f"{case.name}: out or lse has elements the combine never wrote")
    torch.cuda.synchronize()


def run_kvcache_case(case, randn):
    """One decode step: entries of different lengths (0, partly filled, full after the
    append), seqlen_q new keys and values appended in place, then attention."""
    import torch

    import cute_attn

    d, h, hk, b = case.head_dim, case.nheads, case.nheads_kv, case.batch
    # finite padding: slots past a length that share its last tile are read and masked
    k_cache = torch.zeros(b, case.seqlen_k, hk, d, device="cuda", dtype=randn(1).dtype)
    v_cache = torch.zeros_like(k_cache)
    filled = torch.tensor([0, case.seqlen_k // 3, case.seqlen_k - case.seqlen_q][:b],
                          dtype=torch.int32, device="cuda")
    for i, n in enumerate(filled.tolist()):
        k_cache[i, :n], v_cache[i, :n] = randn(n, hk, d), randn(n, hk, d)
    q = randn(b, case.seqlen_q, h, d)
    k_new, v_new = randn(b, case.seqlen_q, hk, d), randn(b, case.seqlen_q, hk, d)
    page_table = None
    if case.page_size:  # the same rows cut into pages, in a random order
        pages = b * case.seqlen_k // case.page_size
        order = torch.randperm(pages, device="cuda")
        page_table = order.to(torch.int32).view(b, -1)
        k_cache, v_cache = (torch.empty_like(c).view(pages, case.page_size, hk, d).index_copy_(
            0, order, c.view(pages, case.page_size, hk, d)) for c in (k_cache, v_cache))
    poison_next_outputs(q)
    out = cute_attn.mha_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=filled,
                                     page_table=page_table, causal=case.causal, num_splits=case.num_splits)
    if out.isnan().any():
        raise AssertionError(f"{case.name}: out has elements the forward never wrote")
    torch.cuda.synchronize()


def poison_next_outputs(q):
    """Fill the memory the next out and lse allocations will get with NaN (0xFF bytes),
    through torch, before the forward runs.

    Why: initcheck does not see TMA stores (cp.async.bulk.tensor, shared -> global) as
    initialising global memory. Measured on an H100 (compute-sanitizer 2025.3.1): reading
    back a TMA-stored out of 51,200 elements gave exactly 51,200 "uninitialized read"
    reports, a row-stored (varlen) out and the st.global-written lse none; the backward's
    preprocess reads out, so every dense case reported once per element. Pre-filling the
    blocks through torch (instrumented writes) marks them initialised, and the NaN check
    after the forward still catches any element the kernel did not write, which initcheck
    could not have. The caching allocator hands the freed blocks back to the next
    same-sized requests (tests/gpu_helpers.poison_allocator relies on the same), both
    orders covering either allocation order."""
    import torch

    out_bytes = q.numel() * q.element_size()
    lse_bytes = (q.numel() // q.shape[-1]) * 4
    for sizes in ((out_bytes, lse_bytes), (lse_bytes, out_bytes)):
        blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=q.device) for n in sizes]
        del blocks


def child(names):
    sys.path.insert(0, str(REPO_ROOT))
    for name in names:
        run_case(CASE_BY_NAME[name])
        print(f"case {name} done", flush=True)


# ----------------------------------------------------------------------------------------
# The parent
# ----------------------------------------------------------------------------------------

@dataclass
class RunResult:
    tool: str
    cases: list
    returncode: int
    reports: int
    problem: str | None
    seconds: float
    log: str

    @property
    def ok(self):
        done = finished_cases(self.log)
        return (self.returncode == 0 and self.reports == 0 and self.problem is None
                and done == self.cases)


def run_one(tool, cases, timeout):
    cmd = sanitizer_command(tool, cases)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log, rc = out + f"\n[timed out after {timeout} s]", -1
    reports, problem = parse_report(tool, log)
    return RunResult(tool, cases, rc, reports, problem, time.perf_counter() - t0,
                     " ".join(map(shlex.quote, cmd)) + "\n" + log)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tools", default=",".join(TOOLS), help="comma list of " + ", ".join(TOOLS))
    p.add_argument("--cases", default=",".join(CASE_BY_NAME),
                   help="comma list of: " + ", ".join(CASE_BY_NAME))
    p.add_argument("--jobs", type=int, default=12, help="child processes at once")
    p.add_argument("--timeout", type=int, default=480, help="seconds per child")
    p.add_argument("--keep-logs", type=Path, default=None,
                   help="write each child's full sanitizer output under this folder")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        child(args.child.split(","))
        return 0

    tools = [t for t in args.tools.split(",") if t]
    names = [n for n in args.cases.split(",") if n]
    for t in tools:
        if t not in TOOLS:
            p.error(f"unknown tool {t!r}; choose from {TOOLS}")
    for n in names:
        if n not in CASE_BY_NAME:
            p.error(f"unknown case {n!r}; choose from {tuple(CASE_BY_NAME)}")
    jobs = [(t, g) for t in tools for g in groups(names, GROUPS_PER_TOOL)]
    print(f"{len(jobs)} sanitizer runs ({', '.join(tools)}) over {len(names)} cases, "
          f"{args.jobs} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda job: run_one(*job, args.timeout), jobs))

    failed = 0
    for r in results:
        status = "ok" if r.ok else "FAIL"
        failed += not r.ok
        detail = f"{r.reports} device report(s)"
        if r.problem:
            detail += f"; {r.problem}"
        if r.returncode != 0:
            detail += f"; exit {r.returncode}"
        print(f"{status:4} {r.tool:9} {','.join(r.cases)}: {detail} ({r.seconds:.0f} s)")
        if not r.ok:
            print("\n".join(r.log.splitlines()[-40:]))
    if args.keep_logs is not None:  # one file per tool (a device call returns 8 files)
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        for tool in tools:
            logs = [r.log for r in results if r.tool == tool]
            (args.keep_logs / f"sanitize-{tool}.log").write_text("\n\n".join(logs))
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
