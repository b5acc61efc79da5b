"""`python -m cute_attn tune`: measure the forward's tile configs on this GPU and keep the
winners in a table that the default heuristic reads.

The defaults (config.fwd_config_for) are FlashAttention-3's choices adjusted by hand-run
A/Bs (perf/NOTES.md). The tuner runs such A/Bs itself, for the plain forward (16-bit,
no mask or causal, per head dim): starting from the default it tries each field of
FwdConfig in turn (KV block length, pipeline stages, ping-pong, intra-warpgroup overlap,
tree row sums), keeps a change only if it is faster, and moves on to the next field
(coordinate descent: a handful of compiles per head dim, not the whole product).
Candidates are timed in interleaved rounds (CUDA events around a loop of calls, the
median round), at batch x seqlen = 16K tokens and 2048 hidden (the FA3-paper shape).

A winner is then confirmed: timed against the default again, in the same process, at each
of CONFIRM_SEQLENS (the benchmark sweep's 1K, 4K and 16K), and adopted only if it beats
the default by MIN_GAIN on their geometric mean and loses at none of them. (The first
tables, adopted on the search shape alone, measured 0.4-3.3% slower than the defaults in
the sweep: perf/NOTES.md, session 15.) Either way the table records every candidate's time
and the confirmation, so a later reader sees why an entry says what it says.
Tables live in cute_attn/tuned/<device>-fwd.json, one per GPU model (an H200 may pick
differently from an H100), or in $CUTE_ATTN_TUNED_DIR when that is set (read first, and
where `tune` writes: an installed package's directory may not be writable, and a run on
a remote GPU writes where its results come back); tuned_fwd_config reads the table of
the GPU a call runs on. An entry that does not parse as a valid config is ignored with
a warning, never used. Nothing here runs per call: the launcher asks once per kernel key.
"""

import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import re
import statistics
from pathlib import Path
from typing import Callable, Optional

from cute_attn.config import (
    SM90_SMEM_BYTES,
    AttnFeatures,
    FwdConfig,
    fwd_config_for,
    fwd_smem_bytes,
    with_persistent_grid,
)

TABLE_DIR = Path(__file__).resolve().parent / "tuned"  # the tables committed with the package
ENV_DIR = "CUTE_ATTN_TUNED_DIR"
MIN_GAIN = 0.02  # a tuned config replaces the default only when >= 2% faster
CONFIRM_SEQLENS = (1024, 4096, 16384)  # where a winner must hold (batch x seqlen = 16K)
TUNED_MASKS = ("none", "causal")
# KV block lengths tried per head dim (multiples of 16; the register budget bounds them),
# and query tile rows (64 per consumer warpgroup: three of them get 160 registers, which
# only head dim 64's accumulators fit)
TILE_N_CHOICES = {64: (96, 128, 160, 192), 96: (96, 128), 128: (96, 128, 176), 192: (64, 80, 96),
                  256: (64, 80, 96)}
TILE_M_CHOICES = {64: (128, 192)}

METHOD = ("coordinate descent over FwdConfig fields from config.fwd_config_for; each candidate timed by CUDA "
          "events around 20 calls, interleaved rounds, median; batch x seqlen = 16384, nheads x head_dim = 2048; "
          f"the winner re-timed against the default at seqlens {CONFIRM_SEQLENS} and adopted when >= "
          f"{MIN_GAIN:.0%} faster on their geometric mean and slower at none")
_log = logging.getLogger("cute_attn")


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (perf/results' naming)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def table_dirs() -> list:
    """Where tables are looked for, first match wins: $CUTE_ATTN_TUNED_DIR, the package's."""
    env = os.environ.get(ENV_DIR)
    return ([Path(env)] if env else []) + [TABLE_DIR]


def table_path(device_name: str, write: bool = False) -> Path:
    """The device's table: the first that exists (write: where tune writes)."""
    name = f"{device_slug(device_name)}-fwd.json"
    dirs = table_dirs()
    if not write:
        for directory in dirs:
            if (directory / name).exists():
                return directory / name
    return dirs[0] / name


def entry_key(dtype: str, head_dim: int, mask: str) -> str:
    return f"{dtype}/{head_dim}/{mask}"


def tunable(features: AttnFeatures) -> bool:
    """The forwards the table covers: no mask or causal, no softcap, dense or varlen
    (the same mainloop); not the mods', KV caches' or windows' kernels."""
    return (features.mask in TUNED_MASKS and not features.softcap and not features.kv_lengths
            and not features.mod_kernel)


@functools.lru_cache(maxsize=None)
def load_table(device_name: str) -> dict:
    """{entry key: FwdConfig} of this GPU model's table (empty when there is none)."""
    path = table_path(device_name)
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())["entries"]
        if not isinstance(entries, dict):  # else .items() below raises on every call
            raise TypeError(f"entries is a {type(entries).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _log.warning("tuned table %s unreadable (%s): using the default configs", path, exc)
        return {}
    table = {}
    for key, entry in entries.items():
        try:
            config = _tuned_entry(key, entry["config"])
        except (KeyError, TypeError, ValueError) as exc:
            _log.warning("tuned table %s: entry %s ignored (%s)", path, key, exc)
            continue
        if entry.get("adopted", True):
            table[key] = config
    return table


# FwdConfig fields a tuned entry must leave at their defaults: the launcher sets them per
# call (GQA packing, paging, split-KV and its merge, the persistent grid and its queue)
_PER_CALL_FIELDS = ("pack_gqa", "page_size", "split_kv", "cluster_splits", "persistent_ctas", "tile_queue",
                    "mask_before_scores")


def _tuned_entry(key: str, fields: dict) -> FwdConfig:
    """A table entry's FwdConfig, or ValueError / TypeError when the plain forward it
    serves could not run it: a field of the wrong type (a float tile), a per-call field
    set, no pipeline stage, or more shared memory than a CTA has at the key's head dim."""
    defaults = {f.name: f.default for f in dataclasses.fields(FwdConfig)}
    for name, value in fields.items():
        default = defaults.get(name, dataclasses.MISSING)
        kind = int if default is dataclasses.MISSING else type(default)  # tile_m, tile_n, num_stages: ints
        if name in defaults and default is not None and type(value) is not kind:
            raise TypeError(f"{name} is {type(value).__name__} {value!r}, not {kind.__name__}")
    config = FwdConfig(**fields)
    changed = [name for name in _PER_CALL_FIELDS if getattr(config, name) != defaults[name]]
    if changed:
        raise ValueError(f"{', '.join(changed)} set: the launcher chooses those per call")
    if config.num_stages < 1:
        raise ValueError(f"num_stages {config.num_stages} < 1")
    head_dim = int(key.split("/")[1])
    if fwd_smem_bytes(config, head_dim) > SM90_SMEM_BYTES:
        raise ValueError(f"{fwd_smem_bytes(config, head_dim)} bytes of shared memory at head dim {head_dim}, "
                         f"over a CTA's {SM90_SMEM_BYTES}")
    return config


def tuned_fwd_config(device_name: Optional[str], dtype: str, head_dim: int,
                     features: AttnFeatures) -> Optional[FwdConfig]:
    """The tuned config of this call on this GPU model, or None (use fwd_config_for)."""
    if device_name is None or not tunable(features):
        return None
    return load_table(device_name).get(entry_key(dtype, head_dim, features.mask))


@functools.lru_cache(maxsize=None)
def gpu_name(index: Optional[int] = None) -> Optional[str]:
    """The CUDA device's model name, None on a machine without a GPU (the CPU compiles)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(index)


def default_fwd_config(dtype: str, head_dim: int, features: AttnFeatures, device_index: Optional[int] = None,
                       pack_gqa: int = 1, page_size: int = 0, seqlen_k: Optional[int] = None) -> FwdConfig:
    """The forward's config for a call: this GPU's tuned one where the table has it (the
    unpacked, unpaged forwards), else config.fwd_config_for; on a persistent grid where
    config.with_persistent_grid takes one (seqlen_k: the call's key length, None where
    unknown). The launcher and warmup both ask here, so warmup builds what calls look up."""
    config = None
    if pack_gqa == 1 and page_size == 0:
        config = tuned_fwd_config(gpu_name(device_index), dtype, head_dim, features)
    if config is None:
        config = fwd_config_for(head_dim, features, pack_gqa, page_size)
    return with_persistent_grid(config, head_dim, features, gpu_sm_count(device_index), seqlen_k)


@functools.lru_cache(maxsize=None)
def gpu_sm_count(index: Optional[int] = None) -> Optional[int]:
    """The CUDA device's SM count (the current device's for None), None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(device).multi_processor_count


def candidates(head_dim: int, features: AttnFeatures, base: Optional[FwdConfig] = None) -> dict:
    """{field: [configs differing from base in that field only]}, the coordinate steps."""
    base = base or fwd_config_for(head_dim, features)
    steps = {
        "tile_m": [dataclasses.replace(base, tile_m=m) for m in TILE_M_CHOICES.get(head_dim, ()) if m != base.tile_m],
        "tile_n": [dataclasses.replace(base, tile_n=n) for n in TILE_N_CHOICES.get(head_dim, ()) if n != base.tile_n],
        "num_stages": [dataclasses.replace(base, num_stages=s) for s in (2, 3) if s != base.num_stages],
        "pingpong": [dataclasses.replace(base, pingpong=not base.pingpong)] if base.num_mma_warpgroups > 1 else [],
        # the late PV wait needs the overlap: turning the overlap off turns it off too
        "intra_wg_overlap": [dataclasses.replace(base, intra_wg_overlap=not base.intra_wg_overlap,
                                                 pv_wait_after_softmax=False)],
        "tree_row_sums": [dataclasses.replace(base, tree_row_sums=not base.tree_row_sums)],
        "pv_wait_after_softmax": ([dataclasses.replace(base, pv_wait_after_softmax=not base.pv_wait_after_softmax)]
                                  if base.intra_wg_overlap and not base.p_double_buffer else []),
    }
    return {field: configs for field, configs in steps.items() if configs}


def coordinate_descent(base: FwdConfig, head_dim: int, features: AttnFeatures,
                       measure: Callable[[list], dict]) -> tuple:
    """(best config, {config: ms} of everything measured). measure(configs) times the
    configs (interleaved) and returns {config: ms}, inf for one that failed to build or
    run. Each field's alternatives are timed against the best so far, from base."""
    times = dict(measure([base]))
    best = base
    for field in candidates(head_dim, features, base):
        trial = [best] + [c for c in candidates(head_dim, features, best)[field] if c not in times]
        if len(trial) == 1:
            continue
        times.update(measure(trial))
        best = min(trial, key=lambda c: times[c])
    return best, times


def confirmed(confirmation: Optional[dict]) -> bool:
    """Whether a winner's re-timing {seqlen: gain over the default} holds: >= MIN_GAIN on
    the geometric mean, and no seqlen slower (even by noise: the default stands unless
    the winner holds everywhere). None (not re-timed), or a gain that is not a finite
    number (a timing failed): it does not."""
    if not confirmation:
        return False
    gains = list(confirmation.values())
    if not all(isinstance(g, (int, float)) and math.isfinite(g) for g in gains) or min(gains) < 0.0:
        return False
    return statistics.geometric_mean(1.0 + g for g in gains) - 1.0 >= MIN_GAIN


def make_entry(base: FwdConfig, best: FwdConfig, times: dict, shape: dict, device_name: str,
               confirmation: Optional[dict] = None) -> dict:
    """The table entry of one (dtype, head dim, mask): best is adopted only if it beat the
    default in the search by MIN_GAIN and its confirmation holds (`confirmed`)."""
    gain = times[base] / times[best] - 1.0 if times[best] > 0 else 0.0
    adopted = best != base and gain >= MIN_GAIN and confirmed(confirmation)
    chosen = best if adopted else base
    return {
        "config": dataclasses.asdict(chosen),
        "adopted": adopted,
        "ms": times[chosen],
        "default_ms": times[base],
        "gain_vs_default": round(gain, 4),
        "shape": shape,
        "device": device_name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "measured": [{"config": dataclasses.asdict(c), "ms": ms} for c, ms in times.items()],
        # a failed timing's gain is stored as None (JSON has no inf / nan)
        "confirmation": {str(s): round(g, 4) if math.isfinite(g) else None for s, g in (confirmation or {}).items()},
    }


def write_table(device_name: str, entries: dict, path: Optional[Path] = None) -> Path:
    """Merge entries into the device's table (other keys kept) and write it."""
    path = path or table_path(device_name, write=True)
    table = {"device": device_name, "method": METHOD, "entries": {}}
    if path.exists():
        try:
            table["entries"] = json.loads(path.read_text()).get("entries", {})
        except ValueError:
            pass
    table["entries"].update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temp file renamed over the table: a process reading it meanwhile, or a write cut
    # short (full disk, ^C), never sees half a table (which the next merge would drop)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    load_table.cache_clear()
    return path


def cuda_measure(dtype: str, head_dim: int, features: AttnFeatures, seqlen: int, rounds: int) -> Callable:
    """measure(configs) -> {config: ms} on the current GPU for coordinate_descent."""
    import torch

    from cute_attn import launcher
    from cute_attn.config import DTYPES

    batch, heads = max(1, 16384 // seqlen), max(1, 2048 // head_dim)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, generator=gen, device="cuda").to(DTYPES[dtype].input)
               for _ in range(3))
    args = launcher.RunArgs(softmax_scale=head_dim ** -0.5)

    def measure(configs):
        calls = {}
        for config in configs:
            try:
                call = functools.partial(launcher.run_fwd, q, k, v, features, args, config=config, need_lse=False,
                                         num_splits=1)
                call()  # compiles (or loads) the candidate
                torch.cuda.synchronize()
                calls[config] = call
            except Exception as exc:  # a config that does not build (shared memory, registers) or run
                _log.warning("tune: %s failed: %s", config, exc)
        samples = {c: [] for c in calls}
        for r in range(rounds):
            order = list(calls)[r % max(1, len(calls)):] + list(calls)[:r % max(1, len(calls))]
            for config in order:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    calls[config]()
                end.record()
                torch.cuda.synchronize()
                samples[config].append(start.elapsed_time(end) / 20)
        out = {c: float("inf") for c in configs}
        out.update({c: sorted(s)[len(s) // 2] for c, s in samples.items()})
        return out

    return measure


def as_called(measure: Callable, head_dim: int, features: AttnFeatures, seqlen: int) -> Callable:
    """measure(configs) timing each config as a call runs it: with the persistent grid
    with_persistent_grid gives it at this length on this GPU (as default_fwd_config does
    for the default), results keyed by the config as given (what the table stores).
    Without it the default was timed on a grid no call of those shapes uses."""
    sms = gpu_sm_count()

    def timed(configs):
        run = {c: with_persistent_grid(c, head_dim, features, sms, seqlen) for c in configs}
        times = measure(list(dict.fromkeys(run.values())))
        return {c: times[run[c]] for c in configs}

    return timed


def tune(head_dims, masks=TUNED_MASKS, dtype: str = "bf16", seqlen: int = 8192, rounds: int = 5,
         log=print, write: bool = True) -> dict:
    """Tune every (head dim, mask) on the current GPU; returns {entry key: entry} and
    (write) merges them into the GPU model's table."""
    import torch

    device_name = torch.cuda.get_device_name()
    entries = {}
    for head_dim in head_dims:
        for mask in masks:
            features = AttnFeatures(mask=mask)
            base = fwd_config_for(head_dim, features)
            def measure_at(s):  # each config as a call at s tokens per sequence runs it
                return as_called(cuda_measure(dtype, head_dim, features, s, rounds), head_dim, features, s)

            best, times = coordinate_descent(base, head_dim, features, measure_at(seqlen))
            shape = {"seqlen": seqlen, "batch": max(1, 16384 // seqlen), "heads": max(1, 2048 // head_dim)}
            confirmation = None
            if best != base and times[base] / times[best] - 1.0 >= MIN_GAIN:
                confirmation = {}
                for s in CONFIRM_SEQLENS:
                    t = measure_at(s)([base, best])
                    confirmation[s] = t[base] / t[best] - 1.0 if t[best] > 0 else -1.0
            entry = make_entry(base, best, times, shape, device_name, confirmation)
            key = entry_key(dtype, head_dim, mask)
            entries[key] = entry
            held = ", ".join(f"{s}: {g:+.1%}" for s, g in (confirmation or {}).items()) or "not re-timed"
            log(f"{key}: default {times[base]:.3f} ms, best {times[best]:.3f} ms ({entry['gain_vs_default']:+.1%}; "
                f"confirmation {held}), {'adopted' if entry['adopted'] else 'kept the default'}: {entry['config']}")
    if write and entries:
        log(f"wrote {write_table(device_name, entries)}")
    return entries
