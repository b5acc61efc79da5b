"""Review of the command line's callers (warmup, tuned table; session 32), on the CPU:
warmup refuses to build keys this machine's GPU would never ask for (no GPU, a disabled
cache), the CLI takes only values its plans can serve, and a tuned-table entry the plain
forward could not run is ignored with a warning, never applied."""
import dataclasses
import json

import pytest
import torch

from cute_attn import tuning, warmup
from cute_attn.__main__ import main
from cute_attn.config import AttnFeatures, fwd_config_for
from test_tuning_cpu import table_dir  # noqa: F401 (fixture: a tuned-table folder of its own)


def test_warmup_without_a_gpu_refuses_instead_of_building_keys_a_gpu_never_asks_for(monkeypatch, capsys):
    """Without a GPU the dense forwards plan without the persistent grid (no SM count) and
    the cache key has no CUDA driver: none of those keys is one a GPU host's mha asks for,
    so warmup says so and exits 1 (it printed 'done' and exited 0)."""
    monkeypatch.setattr(tuning, "gpu_sm_count", lambda index=None: None)
    cpu = {j.key for j in warmup.plan(head_dims=(128,), masks=("causal",), varlen=(False,), backward=False)}
    monkeypatch.setattr(tuning, "gpu_sm_count", lambda index=None: 132)
    gpu = {j.key for j in warmup.plan(head_dims=(128,), masks=("causal",), varlen=(False,), backward=False)}
    assert cpu.isdisjoint(gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(warmup, "run", lambda *a, **kw: pytest.fail("warmup built without a GPU"))
    assert main(["warmup", "--headdim", "128", "--mask", "causal", "--no-varlen", "--no-bwd", "--jobs", "1"]) == 1
    assert "GPU host" in capsys.readouterr().err


def test_warmup_with_the_cache_disabled_is_a_message_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("CUTE_ATTN_CACHE", "0")
    monkeypatch.setattr(warmup, "run", lambda *a, **kw: pytest.fail("warmup built with the cache disabled"))
    assert main(["warmup", "--headdim", "64", "--mask", "none", "--no-varlen", "--no-bwd"]) == 1
    assert "disabled" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--dtype", "e4m3"], ["--gqa-pack", "0"], ["--gqa-pack", "-4"], ["--jobs", "-1"]])
def test_warmup_values_its_plans_cannot_serve_are_usage_errors(argv):
    """FP8 (its configs are fp8_fwd_config_for's, no backward), a group of 0 or less, a
    negative worker count: argparse's exit 2 with a message, not a plan or a traceback."""
    with pytest.raises(SystemExit) as exc:
        main(["warmup", "--list", *argv])
    assert exc.value.code == 2


def test_gqa_pack_one_or_repeated_is_planned_once():
    base = warmup.plan(head_dims=(128,), masks=("none",), varlen=(False,), backward=False)
    jobs = warmup.plan(head_dims=(128,), masks=("none",), varlen=(False,), backward=False, gqa_packs=(1, 4, 4))
    assert len(jobs) == len(set(jobs))
    assert jobs == warmup.plan(head_dims=(128,), masks=("none",), varlen=(False,), backward=False, gqa_packs=(4,))
    assert set(base) < set(jobs)


@pytest.mark.parametrize("bad", [dict(pack_gqa=4), dict(split_kv=True), dict(page_size=64),
                                 dict(persistent_ctas=132), dict(cluster_splits=True), dict(num_stages=0),
                                 dict(tile_n=128.0), dict(tile_n=256, num_stages=4)],
                         ids=["pack", "split", "paged", "persistent", "cluster", "no-stage", "float", "smem"])
def test_tuned_entries_the_plain_forward_cannot_run_are_ignored(table_dir, bad):
    good = dataclasses.asdict(fwd_config_for(128, AttnFeatures()))
    (table_dir / "nvidia-test-gpu-fwd.json").write_text(
        json.dumps({"entries": {"bf16/128/none": {"config": {**good, **bad}}}}))
    assert tuning.tuned_fwd_config("NVIDIA Test GPU", "bf16", 128, AttnFeatures()) is None


def test_a_runnable_tuned_entry_is_still_applied(table_dir):
    config = dataclasses.replace(fwd_config_for(128, AttnFeatures()), num_stages=3, tile_n=64)
    (table_dir / "nvidia-test-gpu-fwd.json").write_text(
        json.dumps({"entries": {"bf16/128/none": {"config": dataclasses.asdict(config)}}}))
    assert tuning.tuned_fwd_config("NVIDIA Test GPU", "bf16", 128, AttnFeatures()) == config


def test_tune_times_each_config_on_the_grid_a_call_runs(monkeypatch):
    """tune's baseline and candidates reach the timer as the launcher runs them (the
    persistent grid where with_persistent_grid takes it: causal hd 128 at 1K on 132 SMs,
    with the tile queue), while the times come back keyed by the configs as given, the
    ones the table stores (it timed a default no call of those shapes runs)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Test GPU")
    monkeypatch.setattr(tuning, "gpu_sm_count", lambda index=None: 132)
    timed = []

    def fake_measure(dtype, d, features, seqlen, rounds):
        def measure(configs):
            timed.extend((seqlen, c) for c in configs)
            return {c: 1.0 for c in configs}
        return measure

    monkeypatch.setattr(tuning, "cuda_measure", fake_measure)
    entries = tuning.tune([128], ["causal"], seqlen=1024, rounds=1, log=lambda *a: None, write=False)
    features = AttnFeatures(mask="causal")
    persistent = tuning.with_persistent_grid(fwd_config_for(128, features), 128, features, 132, 1024)
    assert persistent.persistent_ctas == 132 and timed[0] == (1024, persistent)
    # every config timed is already the one a call runs (persistence applied where it fits)
    assert all(tuning.with_persistent_grid(c, 128, features, 132, 1024) == c for _, c in timed)
    assert entries["bf16/128/causal"]["config"]["persistent_ctas"] == 0  # stored as given
