"""CPU tests of perf/bench_cp.py's command line and helpers (the benchmark itself needs
several GPUs: perf/NOTES.md, session 12)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))

import bench_cp  # noqa: E402


def test_defaults_time_single_gpu_beside_the_variants():
    args = bench_cp.parse_args([], world_size=2)
    assert args.variants[0] == "single" and set(args.variants) == set(bench_cp.VARIANTS)
    assert args.heads_kv == args.heads and args.layout == "zigzag" and args.documents == 1
    assert bench_cp.parse_args(["--variants", "ring"], world_size=2).variants == ["single", "ring"]


def test_documents_and_shards_must_split_evenly():
    assert bench_cp.documents_cu_seqlens(64, 4) == [0, 16, 32, 48, 64]
    bench_cp.parse_args(["--seqlens", "1024", "--documents", "8"], world_size=4)  # 1024 / (8 x 4 x 2)
    with pytest.raises(SystemExit):
        bench_cp.parse_args(["--seqlens", "1000", "--documents", "8"], world_size=4)
    with pytest.raises(SystemExit):
        bench_cp.parse_args(["--heads", "16", "--heads-kv", "5"], world_size=2)
    bench_cp.parse_args(["--seqlens", "96", "--layout", "contiguous"], world_size=3)
    with pytest.raises(SystemExit):
        bench_cp.parse_args(["--seqlens", "96", "--layout", "zigzag"], world_size=5)
