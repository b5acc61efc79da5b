"""The order of a forward kernel's waits and exp2s in its SASS (the code that runs), read
without a GPU: compile for sm_90a, disassemble the DSL's cubin with nvdisasm, and print one
line per kernel with the mainloop's events in order:

    T  the ping-pong turn passed (BAR.ARV)     W1 wait for QK^T (WARPGROUP.DEPBAR.LE gsb0, 1)
    W0 wait for PV (WARPGROUP.DEPBAR.LE gsb0, 0)   [n e]  n MUFU.EX2 in a row
    G  a WGMMA group issued (its last WGMMA, the one that commits it)

Intra-warpgroup overlap wants "G G T W1 [n e] W0": the softmax between the two waits, under
the PV WGMMA. Session 24 found "G G T W1 W0 [n e]" in every FP8 and 16-bit forward
(perf/NOTES.md).

nvdisasm is not in the DSL wheel: `pip download --no-deps nvidia-cuda-nvdisasm` (13.x) and
unzip it, then pass the binary's path. Run from the repo root with CUTE_DSL_ARCH=sm_90a on
a machine without a GPU:

    python3 perf/sass_events.py --nvdisasm PATH [--head-dim 128] [--dtype e4m3|bf16] [--mask none|causal]
                                [--set pv_wait_after_softmax=True] [--seqlen-k 16384]

It also prints the mainloop's length: instructions per iteration of each loop that issues a
step's WGMMAs (session 26: the persistent kernels' steps were 29-46 instructions longer
than the one-tile kernel's, descriptor arithmetic).
"""
import argparse
import ast
import dataclasses
import re
import subprocess
import tempfile

from cute_attn import ptx as ptx_tool
from cute_attn.config import (AttnFeatures, fp8_fwd_config_for, fp8_with_persistent_grid, fwd_config_for,
                              with_persistent_grid)

EVENTS = (("WARPGROUP.DEPBAR.LE gsb0, 0x0", "W0"), ("WARPGROUP.DEPBAR.LE gsb0, 0x1", "W1"), ("MUFU.EX2", "e"))


def events(sass: str) -> str:
    out = []
    for line in sass.splitlines():
        if "BAR.ARV" in line and "0x100" in line:
            out.append("T")
            continue
        if "GMMA." in line and "gsb0" in line:  # the last WGMMA of a committed group
            out.append("G")
            continue
        out.extend(tag for pattern, tag in EVENTS if pattern in line)
    runs = []  # consecutive exp2s collapsed into one [n e]
    for tag in out:
        if tag == "e" and runs and runs[-1][0] == "e":
            runs[-1][1] += 1
        else:
            runs.append([tag, 1])
    return " ".join(f"[{n}e]" if tag == "e" else tag for tag, n in runs)


def mainloop_lengths(sass: str, min_wgmmas: int = 10) -> list:
    """Instructions per iteration of each loop (a backward branch to a label) that issues
    at least min_wgmmas WGMMAs and is not the whole tile loop: the mainloop steps (masked
    and unmasked), comparable across configs and against FA4's dynamic count per step."""
    instructions, labels, pending = [], {}, None
    for line in sass.splitlines():
        label = re.match(r"\.L_x_(\d+):", line.strip())
        if label:
            pending = label.group(1)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,5})\*/\s+(.*?);", line)
        if m:
            address = int(m.group(1), 16)
            instructions.append((address, m.group(2).strip()))
            if pending is not None:
                labels[pending], pending = address, None
    lengths = []
    for address, text in instructions:
        target = re.search(r"BRA\s+`?\(?\.L_x_(\d+)", text)
        if target and labels.get(target.group(1), address) < address:
            body = [t for a, t in instructions if labels[target.group(1)] <= a <= address]
            if sum("GMMA." in t for t in body) >= min_wgmmas and len(body) < 1000:
                lengths.append(len(body))
    return lengths


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvdisasm", required=True)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="e4m3", choices=("e4m3", "bf16", "fp16"))
    p.add_argument("--mask", default="none", choices=("none", "causal"))
    p.add_argument("--sms", type=int, default=132, help="SMs for the persistent-grid rule")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a FwdConfig field of the default (Python literal), e.g. pv_wait_after_softmax=True")
    p.add_argument("--seqlen-k", type=int, default=None, help="the call's key length (the persistent-grid rule)")
    a = p.parse_args()
    f = AttnFeatures(mask=a.mask)
    if a.dtype == "e4m3":
        cfg = fp8_with_persistent_grid(fp8_fwd_config_for(a.head_dim, f), a.head_dim, f, a.sms)
    else:
        cfg = with_persistent_grid(fwd_config_for(a.head_dim, f), a.head_dim, f, a.sms, a.seqlen_k)
    for item in a.set:
        field, value = item.split("=", 1)
        cfg = dataclasses.replace(cfg, **{field: ast.literal_eval(value)})
    art = ptx_tool.compile_fwd_artifacts(a.dtype, a.head_dim, f, cfg)
    if art.cubin is None:
        raise SystemExit("no cubin was built (the DSL's --keep-cubin gave none)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(art.cubin)
        cubin.flush()
        sass = subprocess.run([a.nvdisasm, "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    print(cfg)
    print(events(sass))
    print("mainloop steps, instructions per iteration:", mainloop_lengths(sass))


if __name__ == "__main__":
    main()
