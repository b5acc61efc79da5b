"""The layering the code relies on (kernels/__init__.py): kernels build on blocks/ and
never on each other, and the tile scheduler is the one place that maps CTAs to work."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "cute_attn"
KERNELS = sorted(p for p in (PKG / "kernels").glob("*.py") if p.name != "__init__.py")
BLOCKS = sorted((PKG / "blocks").glob("*.py"))


def _imports(path):
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def test_there_are_kernel_modules():
    assert {p.stem for p in KERNELS} >= {"fwd_sm90", "bwd_sm90", "bwd_prepost"}


def test_no_kernel_module_imports_another():
    for path in KERNELS:
        bad = sorted(m for m in _imports(path) if m.startswith("cute_attn.kernels"))
        assert not bad, f"{path.name} imports {bad}: move what they share to cute_attn/blocks/"


def test_blocks_do_not_import_kernels_or_the_launcher():
    for path in BLOCKS:
        bad = sorted(m for m in _imports(path)
                     if m.startswith(("cute_attn.kernels", "cute_attn.launcher", "cute_attn.api")))
        assert not bad, f"blocks/{path.name} imports {bad}"


def test_only_the_tile_scheduler_reads_block_indices_and_writes_grids():
    for path in KERNELS + BLOCKS:
        text = path.read_text()
        if path.name == "tile_scheduler.py":
            assert "block_idx()" in text
            continue
        assert "block_idx()" not in text, f"{path.name} maps CTAs itself: use TileScheduler.tile()"
        for line in text.splitlines():
            if line.strip().startswith("grid = "):
                assert "scheduler.grid(" in line, f"{path.name} writes a grid: {line.strip()}"


def test_kernels_read_register_budgets_and_dtypes_from_config():
    for path in KERNELS:
        text = path.read_text()
        assert "_REGISTERS" not in text and "_REGS =" not in text, path.name
        assert "cutlass.BFloat16" not in text and "cutlass.Float16" not in text, path.name
