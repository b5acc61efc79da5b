"""cute_attn.tuning on the CPU: the candidates, the coordinate descent against a fake timer,
the table written and read back, bad tables ignored, and the launcher and warmup taking a
tuned config. The timing itself (cuda_measure) needs the GPU machine:
`python -m cute_attn tune` there."""

import dataclasses
import json
import logging
import math

import pytest

from cute_attn import tuning
from cute_attn.config import AttnFeatures, FwdConfig, fwd_config_for

DEVICE = "NVIDIA Test GPU 80GB"


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    tuning.load_table.cache_clear()
    yield tmp_path
    tuning.load_table.cache_clear()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_candidates_change_one_field_each(head_dim, mask):
    features = AttnFeatures(mask=mask)
    base = fwd_config_for(head_dim, features)
    seen = set()
    for field, configs in tuning.candidates(head_dim, features).items():
        for config in configs:
            assert isinstance(config, FwdConfig) and config not in seen and config != base
            changed = [f.name for f in dataclasses.fields(FwdConfig) if getattr(config, f.name) != getattr(base, f.name)]
            assert changed == [field]
            seen.add(config)
    assert seen, "nothing to try"


def _fake_measure(times_of, calls):
    def measure(configs):
        calls.append(list(configs))
        return {c: times_of(c) for c in configs}
    return measure


def test_coordinate_descent_keeps_each_faster_field():
    """A timer under which tile_n 96 and 3 stages are each faster: the descent finds
    both (3 stages tried from the tile_n-96 config), and never times a config twice."""
    features = AttnFeatures()
    base = fwd_config_for(128, features)

    def times_of(c):
        return 1.0 - 0.1 * (c.tile_n == 96) - 0.05 * (c.num_stages == 3) + 0.2 * (not c.pingpong)

    calls = []
    best, times = tuning.coordinate_descent(base, 128, features, _fake_measure(times_of, calls))
    assert best == dataclasses.replace(base, tile_n=96, num_stages=3)
    assert times[best] == pytest.approx(0.85) and times[base] == 1.0
    timed = [c for batch in calls for c in batch if c is not batch[0]]
    assert len(timed) == len(set(timed))


def test_failed_candidates_lose():
    features = AttnFeatures(mask="causal")
    base = fwd_config_for(64, features)
    best, times = tuning.coordinate_descent(
        base, 64, features, _fake_measure(lambda c: float("inf") if c.tile_n == 160 else 1.0, []))
    assert best == base and times[dataclasses.replace(base, tile_n=160)] == float("inf")


HOLDS = {1024: 0.05, 4096: 0.04, 16384: 0.03}


@pytest.mark.parametrize("gain, confirmation, adopted", [
    (0.10, HOLDS, True),
    (0.01, HOLDS, False),  # the search's own gain is below MIN_GAIN
    (0.10, None, False),  # never re-timed
    (0.10, {1024: 0.10, 4096: 0.05, 16384: -0.01}, False),  # slower at one seqlen
    (0.10, {1024: 0.02, 4096: 0.01, 16384: 0.01}, False),  # geometric mean below MIN_GAIN
    (0.10, {1024: float("inf"), 4096: 0.05, 16384: 0.05}, False),  # the default's timing failed
    (0.10, {1024: float("nan"), 4096: 0.05, 16384: 0.05}, False),  # both failed
])
def test_table_round_trip_adopts_only_a_confirmed_gain(table_dir, gain, confirmation, adopted):
    features = AttnFeatures()
    base = fwd_config_for(128, features)
    better = dataclasses.replace(base, tile_n=96)
    times = {base: 1.0, better: 1.0 / (1.0 + gain)}
    entry = tuning.make_entry(base, better, times, {"seqlen": 8192}, DEVICE, confirmation)
    path = tuning.write_table(DEVICE, {tuning.entry_key("bf16", 128, "none"): entry})
    assert path.parent == table_dir and path.name == "nvidia-test-gpu-80gb-fwd.json"
    stored = json.loads(path.read_text())["entries"]["bf16/128/none"]
    assert stored["adopted"] is adopted and len(stored["measured"]) == 2 and stored["default_ms"] == 1.0
    expected = {str(k): (v if math.isfinite(v) else None) for k, v in (confirmation or {}).items()}
    assert stored["confirmation"] == expected
    got = tuning.tuned_fwd_config(DEVICE, "bf16", 128, features)
    assert got == (better if adopted else None)  # not adopted: the heuristic's default stands
    # only that entry: other dtypes, head dims, masks and the features tuning leaves alone
    assert tuning.tuned_fwd_config(DEVICE, "fp16", 128, features) is None
    assert tuning.tuned_fwd_config(DEVICE, "bf16", 128, AttnFeatures(mask="causal")) is None
    assert tuning.tuned_fwd_config(DEVICE, "bf16", 128, AttnFeatures(softcap=True)) is None
    assert tuning.tuned_fwd_config("Another GPU", "bf16", 128, features) is None
    assert tuning.tuned_fwd_config(None, "bf16", 128, features) is None


def test_bad_entries_are_ignored_with_a_warning(table_dir, caplog):
    good = dataclasses.asdict(dataclasses.replace(fwd_config_for(64, AttnFeatures()), tile_n=96))
    entries = {"bf16/64/none": {"config": good},
               "bf16/128/none": {"config": {**good, "tile_n": 100}},  # not a multiple of 16
               "bf16/256/none": {"config": {**good, "warps": 3}},  # no such field
               "bf16/96/none": {"nothing": 1}}
    (table_dir / "nvidia-test-gpu-80gb-fwd.json").write_text(json.dumps({"entries": entries}))
    with caplog.at_level(logging.WARNING, logger="cute_attn"):
        table = tuning.load_table(DEVICE)
    assert list(table) == ["bf16/64/none"] and table["bf16/64/none"].tile_n == 96
    assert sum("ignored" in r.message for r in caplog.records) == 3
    (table_dir / "nvidia-test-gpu-80gb-fwd.json").write_text("{not json")
    tuning.load_table.cache_clear()
    with caplog.at_level(logging.WARNING, logger="cute_attn"):
        assert tuning.load_table(DEVICE) == {}


def test_launcher_and_warmup_take_the_tuned_config(table_dir, monkeypatch):
    """default_fwd_config serves both: the tuned entry for the plain forward (dense and
    varlen), the heuristic for packed GQA, paged caches and what the table lacks."""
    import torch

    from cute_attn import launcher, warmup
    from cute_attn.config import RunArgs

    features = AttnFeatures(mask="causal")
    tuned = dataclasses.replace(fwd_config_for(128, features), num_stages=3)
    entry = tuning.make_entry(fwd_config_for(128, features), tuned,
                              {fwd_config_for(128, features): 1.0, tuned: 0.9}, {}, DEVICE, HOLDS)
    tuning.write_table(DEVICE, {"bf16/128/causal": entry})
    monkeypatch.setattr(tuning, "gpu_name", lambda index=None: DEVICE)
    assert tuning.default_fwd_config("bf16", 128, features) == tuned
    assert tuning.default_fwd_config("bf16", 128, dataclasses.replace(features, varlen=True)) == tuned
    assert tuning.default_fwd_config("bf16", 128, features, pack_gqa=4) == fwd_config_for(128, features, 4)
    assert tuning.default_fwd_config("bf16", 64, features) == fwd_config_for(64, features)
    # the launcher's default kernel lookup (its kernel compile stubbed out)
    monkeypatch.setattr(launcher, "get_fwd_kernel", lambda key: ("kernel", key))
    monkeypatch.setattr(launcher, "_default_configs", {})
    q = torch.empty(1, 64, 4, 128, dtype=torch.bfloat16)
    config = launcher._default_fwd_config(q, q, features)
    _, key = launcher._make_plan(q, q, features, RunArgs(softmax_scale=128 ** -0.5), None, 1).fn
    assert config == tuned and key.config == tuned
    # warmup builds the same key
    jobs = warmup.plan(("bf16",), (128,), ("causal",), varlen=(False,), backward=False)
    assert [job.key.config for job in jobs] == [tuned]


def test_persistent_grid_only_where_it_measured_faster(monkeypatch):
    """config.with_persistent_grid through default_fwd_config: the GPU's SM count as the
    grid for unmasked and causal dense 16-bit forwards up to head dim 128 (softcap and GQA
    alike; causal and mask mods with the tile queue); windows, varlen, KV caches, sinks,
    dropout, packed GQA and head dims whose O tile does not fit beside Q and the K/V
    rings keep one tile per CTA; no GPU, no persistence."""
    from cute_attn.config import SM90_SMEM_BYTES, fwd_smem_bytes, with_persistent_grid

    monkeypatch.setattr(tuning, "gpu_name", lambda index=None: None)
    monkeypatch.setattr(tuning, "gpu_sm_count", lambda index=None: 132)
    for d in (64, 96, 128):
        for features in (AttnFeatures(), AttnFeatures(softcap=True), AttnFeatures(mask="causal")):
            config = tuning.default_fwd_config("bf16", d, features)
            # causal tiles differ in cost: they come from the tile queue
            assert config == dataclasses.replace(fwd_config_for(d, features), persistent_ctas=132,
                                                 tile_queue=features.mask == "causal")
            assert fwd_smem_bytes(config, d) <= SM90_SMEM_BYTES
    kept = [(128, AttnFeatures(mask="local")), (128, AttnFeatures(varlen=True)),
            (128, AttnFeatures(kv_lengths=True)), (192, AttnFeatures()), (256, AttnFeatures())]
    for d, features in kept:
        assert tuning.default_fwd_config("bf16", d, features) == fwd_config_for(d, features), (d, features)
    assert tuning.default_fwd_config("bf16", 128, AttnFeatures(), pack_gqa=4) == fwd_config_for(128, AttnFeatures(), 4)
    # a persistent grid whose O tile would not fit is refused (3 stages at 128 keys)
    deep = dataclasses.replace(fwd_config_for(128, AttnFeatures()), num_stages=3)
    assert with_persistent_grid(deep, 128, AttnFeatures(), 132) == deep
    assert with_persistent_grid(fwd_config_for(128, AttnFeatures()), 128, AttnFeatures(), None).persistent_ctas == 0
    # mask / score mods take the queue (their tiles' block lists differ); not with a sink or dropout
    from cute_attn import masks
    from cute_attn.config import mod_fwd_config_for

    bd = AttnFeatures(mask_mod=masks.block_diffusion(16).spec)
    assert with_persistent_grid(mod_fwd_config_for(64), 64, bd, 132) == dataclasses.replace(
        mod_fwd_config_for(64), persistent_ctas=132, tile_queue=True)
    assert with_persistent_grid(mod_fwd_config_for(128), 128, dataclasses.replace(bd, varlen=True), 132).persistent_ctas == 0
    for extra in (AttnFeatures(mask="causal", sink=True), dataclasses.replace(bd, sink=True),
                  dataclasses.replace(bd, dropout=True)):
        assert with_persistent_grid(fwd_config_for(128, extra), 128, extra, 132) == fwd_config_for(128, extra)
    with pytest.raises(ValueError, match="tile_queue needs a persistent grid"):
        dataclasses.replace(fwd_config_for(128, AttnFeatures()), tile_queue=True)


def test_long_unmasked_tiles_keep_one_tile_per_cta(monkeypatch):
    """config.long_unmasked_tiles: head dims 65-128 without a mask take one tile per CTA
    from ONE_TILE_PER_CTA_FROM_KEYS keys on (the persistent kernel's per-step cost, session
    26); shorter keys, an unknown length, causal, head dim 64 and mods stay persistent. The
    launcher decides by the call's k and keeps both configs apart; warmup builds both."""
    import torch

    from cute_attn import launcher, warmup
    from cute_attn.config import ONE_TILE_PER_CTA_FROM_KEYS, long_unmasked_tiles

    monkeypatch.setattr(tuning, "gpu_name", lambda index=None: None)
    monkeypatch.setattr(tuning, "gpu_sm_count", lambda index=None: 132)
    none, causal = AttnFeatures(), AttnFeatures(mask="causal")
    long_keys = ONE_TILE_PER_CTA_FROM_KEYS
    for d in (96, 128):
        assert tuning.default_fwd_config("bf16", d, none, seqlen_k=long_keys) == fwd_config_for(d, none)
        assert tuning.default_fwd_config("bf16", d, none, seqlen_k=4 * long_keys) == fwd_config_for(d, none)
        for seqlen_k in (None, long_keys - 1, 1024):
            assert tuning.default_fwd_config("bf16", d, none, seqlen_k=seqlen_k).persistent_ctas == 132
        assert tuning.default_fwd_config("bf16", d, causal, seqlen_k=long_keys).persistent_ctas == 132
    assert tuning.default_fwd_config("bf16", 64, none, seqlen_k=long_keys).persistent_ctas == 132
    assert not long_unmasked_tiles(128, AttnFeatures(mask_mod=object()), long_keys)

    # the launcher's per-signature cache keeps the two apart (a short call first, then a
    # long one of the same features must not get the short one's grid), per dtype too
    monkeypatch.setattr(launcher, "_default_configs", {})
    for dtype in (torch.bfloat16, torch.float16):
        short_q = torch.empty(1, 1024, 4, 128, dtype=dtype)
        long_k = torch.empty(1, long_keys, 4, 128, dtype=dtype)
        assert launcher._default_fwd_config(short_q, short_q, none).persistent_ctas == 132
        assert launcher._default_fwd_config(short_q, long_k, none) == fwd_config_for(128, none)
        assert launcher._default_fwd_config(short_q, short_q, none).persistent_ctas == 132
        assert launcher._default_fwd_config(long_k, long_k, causal).persistent_ctas == 132

    jobs = warmup.plan(("bf16",), (128,), ("none", "causal"), varlen=(False,), backward=False)
    assert [job.key.config for job in jobs] == [
        tuning.default_fwd_config("bf16", 128, none), fwd_config_for(128, none),
        tuning.default_fwd_config("bf16", 128, causal)]


def test_a_grid_with_a_cta_per_tile_reads_no_tile_queue():
    """launcher.uses_tile_queue: the queue's counter (a per-stream lookup per call) only
    where the persistent grid has fewer CTAs than tiles; the kernel's take_ticket skips
    the counter otherwise (the tiny causal call of the host-time measurement: 16 tiles)."""
    from cute_attn import launcher

    causal = AttnFeatures(mask="causal")
    queue = dataclasses.replace(fwd_config_for(128, causal), persistent_ctas=132, tile_queue=True)
    assert not launcher.uses_tile_queue(queue, 16) and not launcher.uses_tile_queue(queue, 132)
    assert launcher.uses_tile_queue(queue, 133)
    round_robin = dataclasses.replace(queue, tile_queue=False)
    assert not launcher.uses_tile_queue(round_robin, 1000)
    assert not launcher.uses_tile_queue(fwd_config_for(128, causal), 1000)


def test_cli_lists_candidates_without_a_gpu(capsys):
    from cute_attn.__main__ import main

    assert main(["tune", "--list", "--headdim", "128", "--mask", "none"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("bf16/128/none: default FwdConfig(") and "tile_n: FwdConfig(" in out
