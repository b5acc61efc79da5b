"""Shared set-up for the walkthrough notebooks (imported by their first cell).

- puts the working tree's root and perf/ first on sys.path, so the notebooks run the
  package as it is in this checkout (and perf/bench.py's helpers);
- finds out whether an sm_90 GPU is here (HAS_SM90); without one, lets the CuTe DSL
  target sm_90a anyway (CUTE_DSL_ARCH), so layouts and PTX still work on a CPU;
- keeps the DSL's --keep-ptx dumps out of the working tree (CUTE_DSL_DUMP_DIR);
- small helpers to count and quote PTX, print tables, and say why a GPU cell is skipped.
"""

import os
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (REPO / "perf", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

os.environ.setdefault("CUTE_DSL_DUMP_DIR", os.path.join(tempfile.gettempdir(), "cute_attn_dump"))
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)

import torch  # noqa: E402  (after the environment above)

HAS_CUDA = torch.cuda.is_available()
HAS_SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
DEVICE = torch.cuda.get_device_name() if HAS_CUDA else "cpu"
if not HAS_SM90:
    # compile for Hopper without asking a GPU which architecture it is
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

SKIP = "skipped: needs an sm_90 GPU (H100/H200); this machine has " + (
    DEVICE if HAS_CUDA else "no CUDA GPU")


def describe():
    """One line: where this notebook runs."""
    import importlib.metadata as md

    try:
        dsl = md.version("nvidia-cutlass-dsl")
    except md.PackageNotFoundError:
        dsl = "not installed"
    mode = "GPU cells run" if HAS_SM90 else "CPU mode: GPU cells are skipped"
    return f"device: {DEVICE} | torch {torch.__version__} | nvidia-cutlass-dsl {dsl} | {mode}"


def count(ptx, patterns):
    """{pattern: occurrences in ptx} for plain-text patterns."""
    return {p: ptx.count(p) for p in patterns}


def shorten(line, width=110):
    """Abbreviate long register lists ({%r1, %r2, ..., %r64} -> {%r1 .. %r64: 64 regs}) and
    cut the line to `width` columns."""

    def fold(m):
        regs = [r.strip() for r in m.group(1).split(",")]
        if len(regs) <= 4:
            return m.group(0)
        return f"{{{regs[0]} .. {regs[-1]}: {len(regs)} regs}}"

    line = re.sub(r"\{([^{}]*)\}", fold, line.rstrip())
    return line if len(line) <= width else line[: width - 3] + "..."


def grep(text, pattern, limit=8, width=110):
    """The first `limit` lines matching the regex, stripped and shortened."""
    hits = [ln.strip() for ln in text.splitlines() if re.search(pattern, ln)]
    return [shorten(h, width) for h in hits[:limit]]


def excerpt(text, start, stop, keep=None, nth=1, stop_nth=1, width=110, max_lines=30):
    """Lines from the `nth` match of regex `start` to the `stop_nth` match of `stop` after it
    (inclusive), optionally only those matching regex `keep`, shortened."""
    lines = text.splitlines()
    starts = [n for n, ln in enumerate(lines) if re.search(start, ln)]
    if len(starts) < nth:
        return f"(pattern {start!r} found {len(starts)} times, wanted match {nth})"
    i = starts[nth - 1]
    stops = [n for n in range(i + 1, len(lines)) if re.search(stop, lines[n])]
    j = stops[stop_nth - 1] if len(stops) >= stop_nth else len(lines) - 1
    chosen = [shorten(ln.replace("\t", "    "), width) for ln in lines[i : j + 1]
              if keep is None or re.search(keep, ln)]
    if len(chosen) > max_lines:
        chosen = chosen[:max_lines] + [f"    ... ({len(chosen) - max_lines} more lines)"]
    return "\n".join(chosen)


def table(rows, header):
    """A plain-text table from a list of row tuples: first column left-aligned, the
    others right-aligned."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
