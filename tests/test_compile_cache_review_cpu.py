"""Reliability checks of the on-disk compile cache (cute_attn.compile_cache) and the tuned
table (cute_attn.tuning) as many processes on one machine use them: what the key covers,
the permissions of an entry, a lock file this process may only read, a full disk."""

import ast
import dataclasses
import functools
import json
import logging
import multiprocessing
import os
import resource
import signal
import stat
from pathlib import Path

import pytest

from cute_attn import compile_cache as cc
from cute_attn import tuning
from cute_attn.config import AttnFeatures, fwd_config_for


# the fakes and fixtures of test_compile_cache_cpu.py (its fake_export and fake_load:
# a manifest listing two files)
from test_compile_cache_cpu import Key, cache, compiles, counter, direct, fake_compile, fake_export, fake_load  # noqa: E402,F401,I001


def run(key, counter, export=fake_export):
    return cc.load_or_compile(key, functools.partial(fake_compile, count_file=counter), export, fake_load, direct)


# ----------------------------------------------------------------------------------------
# The key
# ----------------------------------------------------------------------------------------


def _imported_package_files(path: Path) -> set:
    """The cute_attn source files that path imports (at any depth of its code)."""
    pkg = cc._PACKAGE
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cute_attn":
            base = pkg.joinpath(*node.module.split(".")[1:])
            for alias in node.names:  # `from cute_attn.blocks import mma_sm90`: a submodule
                if (base / f"{alias.name}.py").is_file():
                    found.add(base / f"{alias.name}.py")
                elif base.with_suffix(".py").is_file():
                    found.add(base.with_suffix(".py"))
                else:
                    found.add(base / "__init__.py")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "cute_attn" and len(parts) > 1:
                    found.add(pkg.joinpath(*parts[1:]).with_suffix(".py"))
    return found


def test_fingerprint_covers_every_module_the_kernels_import():
    # a module whose code runs while a kernel is traced (masks.SeqInfo, dropout's Philox
    # constants) changes the binary: an edit to it must miss, not load the old kernel
    pkg = cc._PACKAGE
    hashed = {p for pattern in cc._SOURCE_GLOBS for p in pkg.glob(pattern) if p.is_file()}
    sources = sorted(pkg.glob("kernels/*.py")) + sorted(pkg.glob("blocks/*.py"))
    assert sources
    missing = {str(p.relative_to(pkg)) for src in sources for p in _imported_package_files(src)} - {
        str(p.relative_to(pkg)) for p in hashed}
    assert not missing, f"imported by kernels/ or blocks/ but not in the source fingerprint: {sorted(missing)}"
    assert {"masks.py", "dropout.py"} <= {str(p.relative_to(pkg)) for p in hashed}


@pytest.mark.parametrize("setting", ["CUTE_DSL_ENABLE_ASSERTIONS", "CUTE_DSL_LINEINFO", "CUTE_DSL_DEBUG",
                                     "CUTE_DSL_COMPILER_OPT", "CUTE_DSL_LIBS", "CUTE_DSL_SOMETHING_NEW"])
def test_dsl_compile_settings_are_part_of_the_key(cache, counter, monkeypatch, setting):
    # a kernel built with assertions or line info (or without) is another binary: a process
    # with the other setting must not load it
    monkeypatch.delenv(setting, raising=False)
    key = Key("fwd")
    plain = cc.entry_key(key)
    run(key, counter)
    monkeypatch.setenv(setting, "1")
    assert cc.entry_key(key) != plain
    assert run(key, counter) == ("loaded", "kernel<fwd,1>")
    assert compiles(counter) == 2
    monkeypatch.delenv(setting)
    assert run(key, counter) == ("loaded", "kernel<fwd,1>")
    assert compiles(counter) == 2  # the first entry still stands


@pytest.mark.parametrize("setting", ["CUTE_DSL_LOG_LEVEL", "CUTE_DSL_KEEP", "CUTE_DSL_KEEP_PTX", "CUTE_DSL_DUMP_DIR",
                                     "CUTE_DSL_CACHE_DIR", "CUTE_DSL_ARCH"])
def test_dsl_settings_that_compile_nothing_keep_the_key(monkeypatch, setting):
    monkeypatch.delenv(setting, raising=False)
    before = cc.entry_key(Key("fwd"))
    monkeypatch.setenv(setting, "ptx")
    assert cc.entry_key(Key("fwd")) == before


# ----------------------------------------------------------------------------------------
# Several users, read-only locks
# ----------------------------------------------------------------------------------------


def test_entry_is_readable_by_other_users(cache, counter):
    # entries take the umask like any folder (mkdtemp's 0700 would lock out the job's user
    # of a cache that root warmed up in an image)
    old = os.umask(0o022)
    try:
        run(Key("fwd"), counter)
    finally:
        os.umask(old)
    folder = cache / cc.entry_key(Key("fwd"))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, path


def test_lock_file_that_only_reads_still_loads(cache, counter, monkeypatch):
    # another user's lock file (0644) or a read-only mount: O_RDWR fails, the entry loads
    key = Key("fwd")
    run(key, counter)
    real_open = os.open

    def no_write_on_locks(path, flags, *args, **kwargs):
        if str(path).endswith(".lock") and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_write_on_locks)
    assert run(key, counter) == ("loaded", "kernel<fwd,1>")
    assert compiles(counter) == 1
    # no lock file at all and none can be made: compiled in memory, with a warning
    (cache / (cc.entry_key(key) + ".lock")).unlink()
    assert run(key, counter) == ("direct", "kernel<fwd,1>")
    assert compiles(counter) == 2


# ----------------------------------------------------------------------------------------
# A full disk (RLIMIT_FSIZE: a write past the limit fails with EFBIG), in a forked child
# ----------------------------------------------------------------------------------------


def _in_child_with_file_limit(limit, fn, *args):
    def target(queue):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            queue.put(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            queue.put(("raised", f"{type(exc).__name__}: {exc}"))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(queue,))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(60)
    return got


def _big_export(compiled, folder):
    (folder / "kernel.bin").write_text(compiled)
    (folder / "extra.txt").write_bytes(b"x" * 1_000_000)  # past the child's file-size limit
    return {"files": ["kernel.bin", "extra.txt"]}


def test_full_disk_compiles_in_memory_and_leaves_nothing(cache, counter):
    key = Key("fwd")
    got = _in_child_with_file_limit(4096, run, key, counter, _big_export)
    assert got == ("ok", ("direct", "kernel<fwd,1>"))
    assert not (cache / cc.entry_key(key)).exists()
    assert not list(cache.glob(".tmp-*"))
    assert run(key, counter, _big_export) == ("loaded", "kernel<fwd,1>")  # room again: built
    assert compiles(counter) == 2


def test_tuned_table_survives_a_write_cut_short(tmp_path, monkeypatch, caplog):
    # a table write that fails halfway (full disk) must leave the old table whole: a torn
    # one would read as no table here, and the next write_table would drop its entries
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    tuning.load_table.cache_clear()
    features = AttnFeatures()
    base = fwd_config_for(128, features)
    better = dataclasses.replace(base, tile_n=96)
    entry = tuning.make_entry(base, better, {base: 1.0, better: 0.9}, {"seqlen": 8192}, "GPU",
                              {1024: 0.1, 4096: 0.1, 16384: 0.1})
    path = tuning.write_table("GPU", {"bf16/128/none": entry})
    before = path.read_text()
    many = {f"bf16/{i}/none": dict(entry, padding="y" * 1000) for i in range(50)}
    got = _in_child_with_file_limit(len(before) + 100, tuning.write_table, "GPU", many)
    assert got[0] == "raised" and "File too large" in got[1]
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    tuning.load_table.cache_clear()
    try:
        assert tuning.tuned_fwd_config("GPU", "bf16", 128, features) == better
    finally:
        tuning.load_table.cache_clear()


def test_tuned_table_whose_entries_are_not_an_object_is_ignored(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(tuning.ENV_DIR, str(tmp_path))
    (tmp_path / "gpu-fwd.json").write_text(json.dumps({"entries": []}))
    tuning.load_table.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cute_attn"):
            assert tuning.tuned_fwd_config("GPU", "bf16", 128, AttnFeatures()) is None
        assert any("unreadable" in r.message for r in caplog.records)
    finally:
        tuning.load_table.cache_clear()
