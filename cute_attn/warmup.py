"""`python -m cute_attn warmup`: build the common kernel specialisations into the on-disk
compile cache (cute_attn.compile_cache) ahead of time, so the first `mha` call of a
training or serving process loads a library (milliseconds) instead of compiling
(seconds per specialisation).

A specialisation is what launcher.FwdKey / BwdKey name: dtype, head dim, features (mask
kind, softcap, varlen), the default tile config, and for GQA with short query sequences
the packed-group variant (config.choose_pack_gqa). Keys are built by the launcher's own
heuristics (tuning.default_fwd_config, bwd_config_for), so warmup builds exactly what a
call looks up.

Compiling is CPU work (no GPU needed) and single-threaded per kernel, so keys are built
in parallel processes; two processes building one key compile it once (the cache's lock).
The entries are valid only for the same package sources, DSL version, CUDA driver major,
Python environment and CUTE_DSL_* compile settings (compile_cache.versions): warm up on the
machine that runs, with its environment.
"""

import dataclasses
import itertools
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

from cute_attn.config import (CAPABILITIES, DQ_HANDOFF_PER_WG_FROM_QUERIES, ONE_TILE_PER_CTA_FROM_KEYS,
                              SWAPPED_DQ_CAUSAL_FROM_QUERIES,
                              AttnFeatures, bwd_config_for, cluster_splits_fit, split_config, split_decode_config,
                              unsplit_decode_config)
from cute_attn.tuning import default_fwd_config

# What a plain training or inference job calls: bf16, the two most used head dims,
# no mask and causal, forward and backward, dense and varlen.
DEFAULT_DTYPES = ("bf16",)
DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_MASKS = ("none", "causal")
# the backward's query lengths at which bwd_config_for's choice may change (0: short)
BWD_QUERY_LENGTHS = tuple(sorted({0, SWAPPED_DQ_CAUSAL_FROM_QUERIES, DQ_HANDOFF_PER_WG_FROM_QUERIES}))


@dataclass(frozen=True)
class Job:
    family: str  # "fwd" | "bwd" | "append"
    key: object  # launcher.FwdKey | launcher.BwdKey | launcher.AppendKey


def plan(dtypes: Sequence[str] = DEFAULT_DTYPES, head_dims: Sequence[int] = DEFAULT_HEAD_DIMS,
         masks: Sequence[str] = DEFAULT_MASKS, softcap: bool = False, varlen: Iterable[bool] = (False, True),
         backward: bool = True, gqa_packs: Sequence[int] = (), decode: bool = False) -> list:
    """The Jobs for every combination; gqa_packs: group sizes whose packed forward (short
    query sequences, see config.choose_pack_gqa) to build as well. decode: also what
    inference takes: the split-KV forwards (small grids), the KV-cache append (contiguous and paged), and
    mha_with_kvcache's kv_lengths forwards, split and unsplit, for each pack."""
    from cute_attn.launcher import AppendKey, BwdKey, FwdKey

    # group 1 is the unpacked kernel, planned anyway; each group once
    gqa_packs = sorted({g for g in gqa_packs if g > 1})
    jobs = []
    if decode:
        for dtype, d, mask in itertools.product(dtypes, head_dims, masks):
            if d not in CAPABILITIES["fwd"].head_dims:
                continue
            for kv_lengths, pack, split in itertools.product((False, True), (1, *gqa_packs), (False, True)):
                if not (kv_lengths or split):
                    continue  # the plain forward: built below
                features = AttnFeatures(mask=mask, softcap=softcap, kv_lengths=kv_lengths)
                config = default_fwd_config(dtype, d, features, pack_gqa=pack)
                if split:  # as launcher._make_plan builds them: each decode tile merged globally and in a cluster
                    configs = []
                    for in_cluster in (False, True):
                        tile = split_config(split_decode_config(config, d, pack, in_cluster))
                        if not in_cluster:
                            configs.append(tile)
                        if cluster_splits_fit(tile, d):
                            configs.append(dataclasses.replace(tile, cluster_splits=True))
                else:  # one query per sequence, unsplit: launcher._make_plan's decode tile
                    configs = [unsplit_decode_config(config, d, pack)]
                jobs += [Job("fwd", FwdKey(dtype, d, features, c)) for c in dict.fromkeys(configs)]
        for dtype, d, paged in itertools.product(dtypes, head_dims, (False, True)):
            if d in CAPABILITIES["fwd"].head_dims:
                jobs.append(Job("append", AppendKey(dtype, d, paged)))
    for dtype, d, mask, var in itertools.product(dtypes, head_dims, masks, varlen):
        features = AttnFeatures(mask=mask, softcap=softcap, varlen=var)
        if d in CAPABILITIES["fwd"].head_dims:
            # this GPU's tuned config where it has one, as the launcher takes it, for short
            # and long keys (config.long_unmasked_tiles: one tile per CTA from 4K keys)
            short = default_fwd_config(dtype, d, features)
            long = default_fwd_config(dtype, d, features, seqlen_k=ONE_TILE_PER_CTA_FROM_KEYS)
            jobs += [Job("fwd", FwdKey(dtype, d, features, c)) for c in dict.fromkeys((short, long))]
            for pack in gqa_packs if not var else ():
                config = default_fwd_config(dtype, d, features, pack_gqa=pack)
                jobs.append(Job("fwd", FwdKey(dtype, d, features, config)))
                decode = unsplit_decode_config(config, d, pack)  # its one-query calls
                if decode is not config:
                    jobs.append(Job("fwd", FwdKey(dtype, d, features, decode)))
        if backward and d in CAPABILITIES["bwd"].head_dims:
            # every query length at which the choice changes (config's thresholds: the
            # per-warpgroup dQ hand-off, the 80-row causal backward)
            configs = [bwd_config_for(d, features, max_seqlen_q=s) for s in BWD_QUERY_LENGTHS]
            jobs += [Job("bwd", BwdKey(dtype, d, features, c)) for c in dict.fromkeys(configs)]
    return jobs


def build(job: Job) -> float:
    """Load or compile one job's kernels through the disk cache; returns the seconds."""
    from cute_attn import launcher

    get = {"fwd": launcher.get_fwd_kernel, "bwd": launcher.get_bwd_kernels,
           "append": launcher.get_append_kernel}
    start = time.perf_counter()
    get[job.family](job.key)
    return time.perf_counter() - start


def run(jobs: Sequence[Job], workers: int = 0, log=print) -> dict:
    """Build every job, `workers` processes at a time (0: one per CPU, at most 8: each
    compile holds ~1-2 GB of memory); returns {job: seconds}."""
    from cute_attn import compile_cache

    root = compile_cache.cache_dir()
    if root is None:
        raise RuntimeError(f"the compile cache is disabled ({compile_cache.ENV_ENABLE}=0): nothing to warm up")
    workers = workers or min(8, os.cpu_count() or 1, len(jobs)) or 1
    log(f"warming up {len(jobs)} specialisations into {root} with {workers} processes")
    seconds = {}
    start = time.perf_counter()
    if workers == 1:
        for job in jobs:
            seconds[job] = build(job)
            log(f"  {seconds[job]:6.1f} s  {job.family} {job.key}")
    else:
        import multiprocessing

        # spawn: a fresh interpreter per worker (the DSL's state is not fork-safe)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for job, s in zip(jobs, pool.map(build, jobs)):
                seconds[job] = s
                log(f"  {s:6.1f} s  {job.family} {job.key}")
    log(f"done in {time.perf_counter() - start:.1f} s")
    return seconds
