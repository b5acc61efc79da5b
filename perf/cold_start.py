"""Cold start of cute_attn: how long the first call of a fresh process takes, with an empty
on-disk compile cache (every specialisation compiles) and with a warm one (each loads a
library), for the forward and the backward.

    python3 perf/cold_start.py --out $OUT      # on the GPU machine

Each measurement runs in a new Python process (spawned with subprocess, so nothing is
kept in memory between them) against a cache folder of its own under a temporary
directory. The child times, after `import torch` and CUDA initialisation (not ours):
`import cute_attn`, the first forward call (batch 1, seqlen 128, 16 heads, head dim 128,
causal: harness.HOST_SHAPE), the first backward of it, and a second forward for
comparison. torch's one-time import of sympy for autograd is taken out
(and reported) first. It also counts the INFO lines "compiled ..." of the "cute_attn" logger, one
per compiled kernel, so a warm run that compiled anything shows it. Writes
cold-start.json (with the device) to --out.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, logging, sys, time
import torch
torch.cuda.init()
shape = dict(batch=1, seqlen=128, nheads=16, headdim=128)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, 128, 16, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
dout = torch.randn_like(q)
torch.cuda.synchronize()
# torch's own first-use cost, paid by any autograd user: the first torch.autograd.grad
# imports torch.fx.experimental.symbolic_shapes and sympy (~3 s on the GPU machine, whose
# site-packages have no bytecode cache). Imported here, before the clocks, and timed.
t = time.perf_counter()
import torch.fx.experimental.symbolic_shapes
torch_first_use_s = time.perf_counter() - t

class Count(logging.Handler):
    compiled = 0
    def emit(self, record):
        if record.getMessage().startswith("compiled"):
            Count.compiled += 1
logging.getLogger("cute_attn").addHandler(Count())
logging.getLogger("cute_attn").setLevel(logging.INFO)

def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, r

t_import, _ = timed(lambda: __import__("cute_attn"))
import cute_attn
t_fwd, out = timed(lambda: cute_attn.mha(q, k, v, causal=True))
compiled_fwd = Count.compiled
t_fwd2, _ = timed(lambda: cute_attn.mha(q, k, v, causal=True))
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
def fwd_bwd():
    o = cute_attn.mha(qg, kg, vg, causal=True)
    return torch.autograd.grad(o, (qg, kg, vg), dout)
t_bwd, _ = timed(fwd_bwd)
ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
err = (out.float() - ref.float()).abs().max().item()
print(json.dumps(dict(torch_autograd_import_s=torch_first_use_s, import_s=t_import, first_fwd_s=t_fwd, second_fwd_s=t_fwd2, first_bwd_s=t_bwd,
                      kernels_compiled_fwd=compiled_fwd, kernels_compiled_total=Count.compiled,
                      cutlass_imported="cutlass" in sys.modules, max_err_vs_sdpa=err)))
"""


def run_child(cache: Path) -> dict:
    env = dict(os.environ, CUTE_ATTN_CACHE_DIR=str(cache))
    env.pop("CUTE_ATTN_CACHE", None)
    result = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"child failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--warm-runs", type=int, default=3, help="fresh processes against the warm cache")
    args = p.parse_args(argv)

    import torch

    device = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory(prefix="cute_attn_cold_") as tmp:
        cache = Path(tmp) / "cache"
        cold = run_child(cache)
        print(f"empty cache: {json.dumps(cold)}", flush=True)
        warm = []
        for _ in range(args.warm_runs):
            warm.append(run_child(cache))
            print(f"warm cache:  {json.dumps(warm[-1])}", flush=True)
        entries = sorted(p.name for p in cache.iterdir() if p.is_dir())
    result = dict(device=device, torch=torch.__version__, shape="batch 1, seqlen 128, 16 heads, hd 128, causal, bf16",
                  empty_cache=cold, warm_cache=warm, cache_entries=entries,
                  method="each run a fresh python process; times after import torch and CUDA init; "
                         "first_bwd_s is a forward + backward call (its forward kernel already loaded)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cold-start.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
