"""`python -m cute_attn warmup`: the plan names exactly the keys the launcher looks up, and
a run fills the on-disk cache so that a second run (another process) compiles nothing."""

import dataclasses
import subprocess
import sys

import pytest

from cute_attn import warmup
from cute_attn.config import DQ_HANDOFF_PER_WG_FROM_QUERIES, AttnFeatures, bwd_config_for, fwd_config_for
from cute_attn.launcher import BwdKey, FwdKey


def test_default_plan_is_the_launchers_keys():
    jobs = warmup.plan()
    # 2 head dims x 2 masks x dense/varlen x (fwd, bwd for short and for long queries),
    # but head dim 128 without a mask has one backward config at every length
    # (config.swapped_dq_bwd_config)
    assert len(jobs) == 22
    long = DQ_HANDOFF_PER_WG_FROM_QUERIES
    for job in jobs:
        f = job.key.features
        if job.family == "fwd":
            assert job.key == FwdKey("bf16", job.key.head_dim, f, fwd_config_for(job.key.head_dim, f))
        else:
            assert job.key in [BwdKey("bf16", job.key.head_dim, f, bwd_config_for(job.key.head_dim, f, max_seqlen_q=s))
                               for s in warmup.BWD_QUERY_LENGTHS]
    assert sum(j.family == "bwd" and j.key.config.dq_handoff_per_wg for j in jobs) == 8
    assert {(j.key.head_dim, j.key.features.mask, j.key.features.varlen) for j in jobs} == {
        (d, m, var) for d in (64, 128) for m in ("none", "causal") for var in (False, True)}
    # every backward config the launcher picks at any query length is planned (the
    # thresholds' lengths cover the steps of bwd_config_for)
    planned = {j.key for j in jobs if j.family == "bwd"}
    for d in (64, 128):
        for m in ("none", "causal"):
            for var in (False, True):
                f = AttnFeatures(mask=m, varlen=var)
                for s in range(0, 4 * long + 1, 256):
                    assert BwdKey("bf16", d, f, bwd_config_for(d, f, max_seqlen_q=s)) in planned, (d, m, var, s)


def test_plan_options():
    jobs = warmup.plan(dtypes=("fp16",), head_dims=(256,), masks=("local",), softcap=True, varlen=(False,),
                       backward=False, gqa_packs=(4, 8))
    assert [j.family for j in jobs] == ["fwd"] * 3
    assert [j.key.config.pack_gqa for j in jobs] == [1, 4, 8]
    assert all(j.key.features == AttnFeatures(mask="local", softcap=True) and j.key.dtype == "fp16" for j in jobs)


def test_cli_list_prints_the_plan():
    result = subprocess.run([sys.executable, "-m", "cute_attn", "warmup", "--list", "--headdim", "64", "--mask", "causal",
                             "--no-varlen"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    # the backward for short queries and for long ones (config.DQ_HANDOFF_PER_WG_FROM_QUERIES)
    assert len(lines) == 3 and lines[0].startswith("fwd FwdKey(")
    assert all(line.startswith("bwd BwdKey(") for line in lines[1:])


def test_disabled_cache_is_an_error(monkeypatch):
    monkeypatch.setenv("CUTE_ATTN_CACHE", "0")
    with pytest.raises(RuntimeError, match="disabled"):
        warmup.run(warmup.plan(head_dims=(64,), masks=("none",), varlen=(False,), backward=False))


def test_warmup_fills_the_cache_and_a_second_process_only_loads(tmp_path):
    pytest.importorskip("cutlass")
    import os

    env = dict(os.environ, CUTE_ATTN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("CUTE_ATTN_CACHE", None)
    # warmup.run in a fresh process, with the INFO lines of the compiles on stderr (the
    # command line refuses a machine without a GPU: its keys differ from a GPU host's;
    # test_cli_review_cpu.py)
    logged = ("import logging; logging.basicConfig(level=logging.INFO); from cute_attn import warmup; "
              "warmup.run(warmup.plan(head_dims=(64,), masks=('none',), varlen=(False,), backward=False), "
              "workers=1)")
    args = []
    first = subprocess.run([sys.executable, "-c", logged, *args], env=env, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("compiled FlashFwdSm90") == 1
    entries = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(entries) == 1 and (entries[0] / "manifest.json").exists()
    second = subprocess.run([sys.executable, "-c", logged, *args], env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr
    assert "compiled" not in second.stderr


def test_decode_plan_adds_the_inference_kernels():
    base = warmup.plan(head_dims=(128,), masks=("causal",), varlen=(False,), backward=False, gqa_packs=(4,))
    jobs = warmup.plan(head_dims=(128,), masks=("causal",), varlen=(False,), backward=False, gqa_packs=(4,),
                       decode=True)
    extra = [j for j in jobs if j not in base]
    assert _keys(base) <= _keys(jobs)
    fwd = [j.key for j in extra if j.family == "fwd"]
    # (dense split, kv_lengths unsplit, kv_lengths split) x packs 1 and 4, each split merged
    # in a cluster (FwdConfig.cluster_splits, fits at head dim 128) and through global
    # memory, and the 64-row tile of config.split_decode_config merged in a cluster; the
    # unsplit packed tile has 64 rows (config.unsplit_decode_config)
    assert len(fwd) == 14 and len(set(fwd)) == 14
    split = {(kv, True, pack, cluster, tile_m) for kv in (False, True) for pack in (1, 4)
             for cluster, tile_m in ((False, 128), (True, 128), (True, 64))}
    unsplit = {(True, False, 1, False, 128), (True, False, 4, False, 64)}
    assert {(k.features.kv_lengths, k.config.split_kv, k.config.pack_gqa, k.config.cluster_splits,
             k.config.tile_m) for k in fwd} == split | unsplit
    from cute_attn.launcher import AppendKey

    assert [j.key for j in extra if j.family == "append"] == [AppendKey("bf16", 128, False),
                                                              AppendKey("bf16", 128, True)]


def _keys(jobs):
    return {(j.family, j.key) for j in jobs}


def test_decode_plan_builds_the_launchers_split_keys_on_a_gpu_host(monkeypatch):
    """With a GPU's SM count the dense defaults are persistent; the split-KV jobs must
    still be the keys launcher._split_kernel builds (split_config: never persistent),
    not a persistent split config (which FwdConfig refuses)."""
    import torch

    from cute_attn import launcher, tuning
    from cute_attn.config import AttnFeatures, split_config, split_decode_config

    monkeypatch.setattr(tuning, "gpu_sm_count", lambda index=None: 132)
    monkeypatch.setattr(tuning, "gpu_name", lambda index=None: None)
    jobs = warmup.plan(head_dims=(128,), masks=("causal",), varlen=(False,), backward=False, decode=True)
    dense = AttnFeatures(mask="causal")
    plain = tuning.default_fwd_config("bf16", 128, dense)
    assert plain.persistent_ctas == 132 and plain.tile_queue
    splits = [j.key for j in jobs if j.family == "fwd" and j.key.config.split_kv and not j.key.features.kv_lengths]
    clustered = dataclasses.replace(split_config(plain), cluster_splits=True)
    decode_tile = split_decode_config(plain, 128, 1, in_cluster=True)  # 64 rows, merged in a cluster
    assert [k.config for k in splits] == [split_config(plain), clustered,
                                          dataclasses.replace(split_config(decode_tile), cluster_splits=True)]
    monkeypatch.setattr(launcher, "get_fwd_kernel", lambda key: key)
    monkeypatch.setattr(launcher, "_split_kernels", {})
    q = torch.empty(1, 64, 4, 128, dtype=torch.bfloat16)
    assert launcher._split_kernel(q, dense, plain) == splits[0]
    assert launcher._split_kernel(q, dense, plain, cluster=True) == splits[1]
    assert launcher._split_kernel(q, dense, decode_tile, cluster=True) == splits[2]
