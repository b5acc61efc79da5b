#!/usr/bin/env python3
"""Execute the walkthrough notebooks without Jupyter.

The GPU machine has python3, torch, numpy and matplotlib but no Jupyter packages, so the
notebooks are run by this file with the standard library alone: it reads the .ipynb JSON,
executes the code cells in order in one namespace (like a kernel would), captures stdout,
stderr, the value of a cell's last expression and every matplotlib figure, and writes them
back as nbformat v4 outputs.

    python3 notebooks/run_notebooks.py                  # execute all, write nothing (--check)
    python3 notebooks/run_notebooks.py --inplace        # execute all, save outputs in place
    python3 notebooks/run_notebooks.py 01 03 --inplace  # only these (number prefix or path)
    python3 notebooks/run_notebooks.py --out-dir $OUT/notebooks   # save copies elsewhere
    python3 notebooks/run_notebooks.py --check --cpu    # CPU mode even on a GPU machine (CI)

A cell that raises stops its notebook: the traceback is printed, nothing is written for that
notebook, and the exit status is 1. Without an sm_90 GPU (or with --cpu) CUTE_DSL_ARCH is set
to sm_90a so the CuTe DSL compiles for Hopper anyway; the notebooks skip their GPU cells.
"""

import argparse
import ast
import base64
import datetime
import io
import json
import linecache
import os
import sys
import time
import traceback
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parent
REPO_ROOT = NOTEBOOK_DIR.parent
FIGURE_DPI = 80
BIG_IMAGE_BYTES = 200_000  # warn above this: the tree travels to the GPU machine


class CellOutputs:
    """nbformat v4 outputs of one cell, in the order they were produced."""

    def __init__(self):
        self.items = []

    def stream(self, name, text):
        if not text:
            return
        last = self.items[-1] if self.items else None
        if last is not None and last["output_type"] == "stream" and last["name"] == name:
            last["_text"] += text
        else:
            self.items.append({"output_type": "stream", "name": name, "_text": text})

    def display(self, data):
        self.items.append({"output_type": "display_data", "data": data, "metadata": {}})

    def result(self, text, count):
        self.items.append({
            "output_type": "execute_result", "data": {"text/plain": _lines(text)},
            "metadata": {}, "execution_count": count,
        })

    def as_json(self):
        out = []
        for item in self.items:
            item = dict(item)
            if item["output_type"] == "stream":
                item["text"] = _lines(item.pop("_text"))
            out.append(item)
        return out


class _Stream(io.TextIOBase):
    """Stands in for sys.stdout / sys.stderr while a cell runs."""

    def __init__(self, outputs, name, echo=None):
        self.outputs, self.name, self.echo = outputs, name, echo

    def writable(self):
        return True

    def write(self, text):
        self.outputs.stream(self.name, text)
        if self.echo is not None:
            self.echo.write(text)
        return len(text)

    def flush(self):
        if self.echo is not None:
            self.echo.flush()


def _lines(text):
    return text.splitlines(keepends=True)


def _source(cell):
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


class FigureCapture:
    """Turns matplotlib figures into image/png outputs: at plt.show() and at the end of
    each cell (for figures never shown), then closes them, as the inline backend does."""

    def __init__(self):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.switch_backend("Agg")  # resolve the backend now, before show is replaced
        self.plt = plt
        self.outputs = None
        self.big = []

        def show(*args, **kwargs):  # a plain function: pyplot sets attributes on it
            self.flush()

        plt.show = show

    def flush(self):
        if self.outputs is None:
            return
        for num in self.plt.get_fignums():
            fig = self.plt.figure(num)
            buf = io.BytesIO()
            # no Software tag: the bytes then do not change with the matplotlib version
            fig.savefig(buf, format="png", dpi=FIGURE_DPI, bbox_inches="tight",
                        metadata={"Software": None})
            png = buf.getvalue()
            if len(png) > BIG_IMAGE_BYTES:
                self.big.append(len(png))
            w, h = fig.get_size_inches() * fig.dpi
            self.outputs.display({
                "image/png": base64.b64encode(png).decode("ascii"),
                "text/plain": [f"<Figure size {w:.0f}x{h:.0f} with {len(fig.axes)} Axes>"],
            })
            self.plt.close(fig)


def _split_last_expression(source):
    """(body, last expression or None) the way IPython displays a cell's last value;
    a trailing ';' suppresses it."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source, None
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return source, None
    if source.rstrip().endswith(";"):
        return source, None
    last = tree.body.pop()
    return tree, ast.Expression(last.value)


def run_cell(source, namespace, filename):
    # Register the source the way IPython does: inspect.getsource() must find it, and the
    # CuTe DSL reads a @cute.jit function's source to compile it.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    body, last = _split_last_expression(source)
    code = compile(body, filename, "exec")
    exec(code, namespace)  # noqa: S102 - running the notebook's code is the point
    if last is not None:
        value = eval(compile(last, filename, "eval"), namespace)
        return value
    return None


def execute_notebook(path, *, echo=False, log=print):
    """Run every code cell of `path`; returns (notebook dict with outputs, error text or
    None). Runs with the notebook's folder as working directory, like Jupyter."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    if nb.get("nbformat") != 4:
        raise ValueError(f"{path}: nbformat {nb.get('nbformat')} (only v4 is supported)")
    figures = FigureCapture()
    namespace = {"__name__": "__main__", "__file__": str(Path(path).resolve())}
    old_cwd, old_out, old_err = os.getcwd(), sys.stdout, sys.stderr
    os.chdir(Path(path).resolve().parent)
    count, error = 0, None
    try:
        for index, cell in enumerate(nb["cells"]):
            if cell.get("cell_type") != "code":
                continue
            count += 1
            outputs = CellOutputs()
            figures.outputs = outputs
            sys.stdout = _Stream(outputs, "stdout", old_out if echo else None)
            sys.stderr = _Stream(outputs, "stderr", old_err if echo else None)
            t0 = time.perf_counter()
            try:
                value = run_cell(_source(cell), namespace, f"<{Path(path).name} cell {count}>")
                figures.flush()
                if value is not None:
                    outputs.result(repr(value), count)
            except BaseException as exc:  # report any failure, then stop
                if isinstance(exc, KeyboardInterrupt):
                    raise
                sys.stdout, sys.stderr = old_out, old_err
                captured = "".join(i.get("_text", "") for i in outputs.items)
                shown = f"--- its output ---\n{captured}\n--- traceback ---\n" if captured else ""
                error = (f"{Path(path).name}: code cell {count} (cell index {index}) raised\n"
                         + shown + traceback.format_exc())
                return nb, error
            finally:
                sys.stdout, sys.stderr = old_out, old_err
                figures.outputs = None
            cell["outputs"] = outputs.as_json()
            cell["execution_count"] = count
            log(f"  cell {count:2d} ok  {time.perf_counter() - t0:6.1f} s")
    finally:
        sys.stdout, sys.stderr = old_out, old_err
        os.chdir(old_cwd)
        figures.plt.close("all")
    for size in figures.big:
        log(f"  warning: a figure of {size / 1e3:.0f} kB; keep notebooks small (dpi, figsize)")
    return nb, error


def stamp(nb, device):
    """Notebook metadata: a Python 3 kernel, and where the outputs were produced."""
    meta = nb.setdefault("metadata", {})
    meta.setdefault("kernelspec", {"display_name": "Python 3", "language": "python",
                                   "name": "python3"})
    meta.setdefault("language_info", {"name": "python"})
    meta["cute_attn"] = {"executed_on": device,
                         "date": datetime.date.today().isoformat()}
    nb.setdefault("nbformat_minor", 5)
    for i, cell in enumerate(nb["cells"]):
        cell.setdefault("id", f"cell-{i}")
        cell.setdefault("metadata", {})
        if cell.get("cell_type") == "code":
            cell.setdefault("outputs", [])
            cell.setdefault("execution_count", None)
    return nb


def write_notebook(nb, path):
    text = json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    Path(path).write_text(text, encoding="utf-8")


def find_notebooks(names):
    every = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return every
    chosen = []
    for name in names:
        p = Path(name)
        if p.suffix == ".ipynb" and p.exists():
            chosen.append(p.resolve())
            continue
        hits = [nb for nb in every if nb.name.startswith(name)]
        if not hits:
            raise SystemExit(f"no notebook matches {name!r}; have: "
                             + ", ".join(nb.name for nb in every))
        chosen += hits
    return chosen


def prepare_environment(force_cpu):
    """Hide the GPUs when asked, put the working tree first on sys.path, and let the DSL
    target sm_90a when there is no Hopper GPU to ask. Returns a device description."""
    if force_cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("MPLBACKEND", "Agg")
    for p in (str(NOTEBOOK_DIR), str(REPO_ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        import torch

        gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        gpu, name = False, None
    if not gpu:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if gpu:
        return name
    return "cpu (no sm_90 GPU: GPU cells skipped)" + (f"; found {name}" if name else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*",
                   help="notebook paths or number prefixes (default: every NN_*.ipynb)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--inplace", action="store_true", help="write outputs into the notebooks")
    mode.add_argument("--out-dir", type=Path, help="write executed copies into this folder")
    mode.add_argument("--check", action="store_true",
                      help="execute only, write nothing (the default)")
    p.add_argument("--cpu", action="store_true",
                   help="hide every GPU (CUDA_VISIBLE_DEVICES=''): the notebooks' CPU mode")
    p.add_argument("--echo", action="store_true", help="also print the cells' output")
    args = p.parse_args(argv)

    paths = find_notebooks(args.notebooks)
    device = prepare_environment(args.cpu)
    print(f"device: {device}", flush=True)
    failed = []
    for path in paths:
        print(f"{path.name}", flush=True)
        t0 = time.perf_counter()
        nb, error = execute_notebook(path, echo=args.echo,
                                     log=lambda m: print(m, flush=True))
        if error is not None:
            print(error, file=sys.stderr, flush=True)
            failed.append(path.name)
            continue
        print(f"  done in {time.perf_counter() - t0:.1f} s", flush=True)
        target = None
        if args.inplace:
            target = path
        elif args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            target = args.out_dir / path.name
        if target is not None:
            write_notebook(stamp(nb, device), target)
            print(f"  wrote {target} ({target.stat().st_size / 1e3:.0f} kB)", flush=True)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
