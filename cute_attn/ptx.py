"""Compile a kernel specialisation for sm_90a on any machine (no GPU needed) and return
its PTX, its cubin and what ptxas says about it (registers, spills, ignored setmaxnreg).

    python -m cute_attn ptx [--kernel fwd|bwd] --dtype bf16 --headdim 128
                            [--causal | --mask none|causal|local] [--softcap] [--varlen]
                            [--out FILE] [--sass]

The backward is three kernels (preprocess, main, postprocess); each gets its own PTX and
resource report.
"""

import atexit
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Optional

from cute_attn.config import AttnFeatures, BwdConfig, FwdConfig, bwd_config_for, fwd_config_for
from cute_attn.launcher import ARCH, BwdKey, FwdKey, compile_bwd, compile_fwd


@dataclass
class CompiledArtifacts:
    key: object  # FwdKey or BwdKey
    ptx: str
    cubin: Optional[bytes]
    ptxas_report: str  # ptxas -v lines, or why they are missing


# --keep-ptx also dumps files into the DSL's dump directory, which defaults to the working
# directory of the process; send them to a scratch folder unless the user chose one. One
# folder per process, removed at exit: the files are named by kernel, not by
# specialisation, so two processes compiling at once in a shared folder read each
# other's PTX (seen: a test found a persistent kernel's PTX for a varlen one).
if "CUTE_DSL_DUMP_DIR" not in os.environ:
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="cute_attn_dump_")
    atexit.register(shutil.rmtree, os.environ["CUTE_DSL_DUMP_DIR"], ignore_errors=True)
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)


def compile_fwd_artifacts(
    dtype: str, head_dim: int, features: AttnFeatures, config: Optional[FwdConfig] = None
) -> CompiledArtifacts:
    """The forward of (features), with the default tile config unless one is given."""
    key = FwdKey(dtype, head_dim, features, config or fwd_config_for(head_dim, features))
    fn = compile_fwd(key, "--keep-ptx --keep-cubin")
    return CompiledArtifacts(key, fn.__ptx__, fn.__cubin__, ptxas_report(fn.__ptx__))


def compile_bwd_artifacts(
    dtype: str, head_dim: int, features: AttnFeatures, config: Optional[BwdConfig] = None,
    deterministic: bool = False, max_seqlen_q: int = 0,
) -> dict:
    """{"preprocess" | "main" | "postprocess": CompiledArtifacts} of one backward, with the
    default config for max_seqlen_q query rows (0: short) unless one is given."""
    config = config or bwd_config_for(head_dim, features, deterministic, max_seqlen_q)
    key = BwdKey(dtype, head_dim, features, config, deterministic)
    fns = compile_bwd(key, "--keep-ptx --keep-cubin")
    return {
        name: CompiledArtifacts(key, fn.__ptx__, fn.__cubin__, ptxas_report(fn.__ptx__))
        for name, fn in zip(("preprocess", "main", "postprocess"), fns)
    }


def ptxas_report(ptx: str) -> str:
    """Run the local ptxas -v for the resource report. An older ptxas than the DSL's
    rejects the PTX .version line; the kernel uses nothing newer than sm_90a's ISA, so
    the version is lowered to what that ptxas accepts (and the report says so)."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return "ptxas not found on PATH: no register/spill report"
    note = ""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        for _ in range(2):
            with open(src, "w") as f:
                f.write(ptx)
            run = subprocess.run(
                [ptxas, f"-arch={ARCH}", "-v", src, "-o", out], capture_output=True, text=True
            )
            m = re.search(r"current version is '([\d.]+)'", run.stderr)
            if run.returncode == 0 or m is None:
                break
            ptx = re.sub(r"^\.version [\d.]+", f".version {m.group(1)}", ptx, flags=re.M)
            note = f"(PTX .version lowered to {m.group(1)} for the local ptxas)\n"
    lines = [ln for ln in run.stderr.splitlines() if "Compiling entry" not in ln]
    return note + "\n".join(lines)


def sass(cubin: Optional[bytes]) -> str:
    tool = shutil.which("cuobjdump")
    if tool is None or cubin is None:
        return "cuobjdump not found on PATH: no SASS here (the GPU machine has it)"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
