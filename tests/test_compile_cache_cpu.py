"""The on-disk compile cache (cute_attn.compile_cache) with fake compile/export/load steps
that write small files, plus one real export of a small forward through the DSL (skipped
without cutlass; calling the loaded kernel needs a GPU)."""

import functools
import json
import logging
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from cute_attn import compile_cache as cc


@dataclass(frozen=True)
class Key:
    name: str
    n: int = 1
    arch: str = "sm_90a"


# ----------------------------------------------------------------------------------------
# Fakes: compile counts itself in a file (so that processes can be counted too); export
# writes the compiled payload; load reads it back.
# ----------------------------------------------------------------------------------------


def fake_compile(key, count_file, delay=0.0):
    import time

    with open(count_file, "a") as f:
        f.write(f"{os.getpid()} {key!r}\n")
    time.sleep(delay)
    return f"kernel<{key.name},{key.n}>"


def fake_export(compiled, folder):
    (folder / "kernel.bin").write_text(compiled)
    (folder / "extra.txt").write_text("x" * 100)
    return {"files": ["kernel.bin", "extra.txt"]}


def fake_load(folder, meta):
    assert meta == {"files": ["kernel.bin", "extra.txt"]}
    return ("loaded", (folder / "kernel.bin").read_text())


def direct(compiled):
    return ("direct", compiled)


def compiles(count_file):
    path = Path(count_file)
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(cc.ENV_DIR, str(root))
    monkeypatch.delenv(cc.ENV_ENABLE, raising=False)
    return root


@pytest.fixture
def counter(tmp_path):
    return str(tmp_path / "compiles.txt")


def run(key, counter, load=fake_load, export=fake_export):
    return cc.load_or_compile(key, functools.partial(fake_compile, count_file=counter), export, load, direct)


def entry(root, key):
    return root / cc.entry_key(key)


# ----------------------------------------------------------------------------------------
# Location and keys
# ----------------------------------------------------------------------------------------


def test_cache_dir_env_override_default_and_disable(monkeypatch, tmp_path):
    monkeypatch.delenv(cc.ENV_ENABLE, raising=False)
    monkeypatch.setenv(cc.ENV_DIR, str(tmp_path / "here"))
    assert cc.cache_dir() == tmp_path / "here"
    monkeypatch.delenv(cc.ENV_DIR)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cc.cache_dir() == tmp_path / ".cache" / "cute_attn"
    for off in ("0", "false", "off"):
        monkeypatch.setenv(cc.ENV_ENABLE, off)
        assert cc.cache_dir() is None
    monkeypatch.setenv(cc.ENV_ENABLE, "1")
    assert cc.cache_dir() == tmp_path / ".cache" / "cute_attn"


def test_entry_key_is_stable_and_changes_with_each_input():
    fp, vers = "a" * 64, {"cutlass_dsl": "4.8.1", "tvm_ffi": "0.1"}
    base = cc.entry_key(Key("fwd"), fp, vers)
    assert base == cc.entry_key(Key("fwd"), fp, dict(vers))
    assert base.startswith("key-") and all(c.isalnum() or c == "-" for c in base)
    others = {
        cc.entry_key(Key("fwd"), "b" * 64, vers),  # sources
        cc.entry_key(Key("fwd"), fp, {**vers, "cutlass_dsl": "4.9.0"}),  # DSL version
        cc.entry_key(Key("fwd"), fp, {**vers, "tvm_ffi": "0.2"}),  # TVM-FFI version
        cc.entry_key(Key("fwd", arch="sm_100a"), fp, vers),  # arch
        cc.entry_key(Key("fwd", n=2), fp, vers),  # specialisation
        cc.entry_key(Key("bwd"), fp, vers),
    }
    assert base not in others and len(others) == 6
    # the defaults: this process's fingerprint and versions
    assert cc.entry_key(Key("fwd")) == cc.entry_key(Key("fwd"), cc.source_fingerprint(), cc.versions())


def test_versions_name_the_dsl_and_tvm_ffi():
    vers = cc.versions()
    assert vers["format"] == cc.FORMAT
    assert {"cutlass_dsl", "tvm_ffi", "cuda_driver_major", "machine"} <= set(vers)


def test_source_fingerprint_covers_kernel_sources(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "blocks").mkdir()
    (pkg / "kernels" / "fwd.py").write_text("a = 1\n")
    (pkg / "blocks" / "mma.py").write_text("b = 1\n")
    (pkg / "config.py").write_text("c = 1\n")
    (pkg / "api.py").write_text("not a kernel source\n")

    def fingerprint():
        cc.source_fingerprint.cache_clear()
        return cc.source_fingerprint()

    with monkeypatch.context() as patch:
        patch.setattr(cc, "_PACKAGE", pkg)
        try:
            first = fingerprint()
            assert len(first) == 64 and first == fingerprint()
            (pkg / "api.py").write_text("changed, still not a kernel source\n")
            assert fingerprint() == first
            for path in (pkg / "kernels" / "fwd.py", pkg / "blocks" / "mma.py", pkg / "config.py"):
                before = fingerprint()
                path.write_text(path.read_text() + "# edit\n")
                assert fingerprint() != before
            before = fingerprint()
            (pkg / "blocks" / "new.py").write_text("")
            assert fingerprint() != before
        finally:
            cc.source_fingerprint.cache_clear()
    # once per process: the real one is cached, and covers this package's files
    real = cc.source_fingerprint()
    assert real == cc.source_fingerprint() and real != first


# ----------------------------------------------------------------------------------------
# Hits, misses, invalidation
# ----------------------------------------------------------------------------------------


def test_miss_then_hit(cache, counter):
    key = Key("fwd")
    assert run(key, counter) == ("loaded", "kernel<fwd,1>")
    assert compiles(counter) == 1
    folder = entry(cache, key)
    manifest = json.loads((folder / cc.MANIFEST).read_text())
    assert manifest["key"] == repr(key)
    assert manifest["fingerprint"] == cc.source_fingerprint()
    assert manifest["versions"] == cc.versions()
    assert set(manifest["files"]) == {"kernel.bin", "extra.txt"}
    assert manifest["files"]["extra.txt"]["size"] == 100
    assert run(key, counter) == ("loaded", "kernel<fwd,1>")
    assert compiles(counter) == 1
    # another specialisation is another entry
    assert run(Key("fwd", n=2), counter) == ("loaded", "kernel<fwd,2>")
    assert compiles(counter) == 2
    assert not list(cache.glob(".tmp-*"))


def test_changed_fingerprint_or_versions_miss(cache, counter, monkeypatch):
    key = Key("fwd")
    run(key, counter)
    monkeypatch.setattr(cc, "source_fingerprint", lambda: "f" * 64)
    run(key, counter)
    assert compiles(counter) == 2
    real_versions = cc.versions
    monkeypatch.setattr(cc, "versions", lambda: {**real_versions(), "cutlass_dsl": "9.9.9"})
    run(key, counter)
    assert compiles(counter) == 3
    run(key, counter)
    assert compiles(counter) == 3


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_file", "no_manifest", "bad_manifest",
                                    "stale_manifest", "extra_manifest_file"])
def test_corrupt_entry_is_rebuilt(cache, counter, damage):
    key = Key("fwd")
    run(key, counter)
    folder = entry(cache, key)
    kernel, manifest = folder / "kernel.bin", folder / cc.MANIFEST
    if damage == "truncate":
        kernel.write_bytes(kernel.read_bytes()[:3])
    elif damage == "flip":  # same size, other bytes
        kernel.write_text(kernel.read_text().upper())
    elif damage == "delete_file":
        kernel.unlink()
    elif damage == "no_manifest":  # as if the writer died before the manifest
        manifest.unlink()
    elif damage == "bad_manifest":
        manifest.write_text("{not json")
    elif damage == "stale_manifest":  # a manifest of another key in this folder
        data = json.loads(manifest.read_text())
        data["key"] = repr(Key("other"))
        manifest.write_text(json.dumps(data))
    elif damage == "extra_manifest_file":
        data = json.loads(manifest.read_text())
        data["files"]["missing.bin"] = {"size": 1, "sha256": "0" * 64}
        manifest.write_text(json.dumps(data))
    assert run(key, counter) == ("loaded", "kernel<fwd,1>")
    assert compiles(counter) == 2
    assert cc.verify_entry(folder, key) is not None
    assert run(key, counter) == ("loaded", "kernel<fwd,1>")
    assert compiles(counter) == 2


def test_load_exception_rebuilds(cache, counter, tmp_path):
    key = Key("fwd")
    run(key, counter)
    fail_once = tmp_path / "fail_once"
    fail_once.touch()

    def flaky_load(folder, meta):
        if fail_once.exists():
            fail_once.unlink()
            raise OSError("undefined symbol")
        return fake_load(folder, meta)

    assert run(key, counter, load=flaky_load) == ("loaded", "kernel<fwd,1>")
    assert compiles(counter) == 2


def test_entry_that_never_loads_is_removed_and_direct_result_returned(cache, counter):
    def broken_load(folder, meta):
        raise RuntimeError("no")

    key = Key("fwd")
    assert run(key, counter, load=broken_load) == ("direct", "kernel<fwd,1>")
    assert not entry(cache, key).exists()
    assert run(key, counter, load=broken_load) == ("direct", "kernel<fwd,1>")
    assert compiles(counter) == 2


def test_failed_export_leaves_nothing_and_returns_direct(cache, counter):
    def broken_export(compiled, folder):
        (folder / "half.bin").write_text("x")
        raise RuntimeError("disk full")

    key = Key("fwd")
    assert run(key, counter, export=broken_export) == ("direct", "kernel<fwd,1>")
    assert not entry(cache, key).exists()
    assert not list(cache.glob(".tmp-*"))
    assert run(key, counter) == ("loaded", "kernel<fwd,1>")
    assert compiles(counter) == 2


def test_dead_writers_temp_folder_is_cleaned(cache, counter):
    key = Key("fwd")
    cache.mkdir(parents=True)
    leftover = cache / f".tmp-{cc.entry_key(key)}-deadbeef"
    leftover.mkdir()
    (leftover / "kernel.bin").write_text("partial")
    assert run(key, counter) == ("loaded", "kernel<fwd,1>")
    assert not leftover.exists()


def test_compile_error_propagates_and_leaves_nothing(cache):
    def failing_compile(key):
        raise NotImplementedError("head dim 48")

    with pytest.raises(NotImplementedError):
        cc.load_or_compile(Key("fwd"), failing_compile, fake_export, fake_load, direct)
    assert [p.name for p in cache.iterdir()] == [cc.entry_key(Key("fwd")) + ".lock"]


def test_unusable_cache_dir_compiles_in_memory(tmp_path, monkeypatch, counter):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(cc.ENV_DIR, str(blocker / "cache"))
    monkeypatch.delenv(cc.ENV_ENABLE, raising=False)
    assert run(Key("fwd"), counter) == ("direct", "kernel<fwd,1>")


def test_disabled_compiles_every_time_and_writes_nothing(tmp_path, monkeypatch, counter):
    root = tmp_path / "cache"
    monkeypatch.setenv(cc.ENV_DIR, str(root))
    monkeypatch.setenv(cc.ENV_ENABLE, "0")
    key = Key("fwd")
    for i in range(3):
        assert run(key, counter) == ("direct", "kernel<fwd,1>")
        assert compiles(counter) == i + 1
    assert not root.exists()


def test_logs_debug_lines_only_the_compile_step_logs_info(cache, counter, caplog):
    # the INFO line per compiled kernel is the compile step's (launcher._compile): the
    # cache adds DEBUG lines, so a compile is announced once, a hit is silent at INFO
    key = Key("fwd")
    with caplog.at_level(logging.DEBUG, logger="cute_attn"):
        run(key, counter)
        run(key, counter)
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
    compiled = [r for r in caplog.records if "compiled" in r.getMessage()]
    loaded = [r for r in caplog.records if "loaded" in r.getMessage()]
    assert len(compiled) == 1 and repr(key) in compiled[0].getMessage() and " s" in compiled[0].getMessage()
    assert len(loaded) == 2  # after the export, and the hit


def test_clear(cache, counter):
    run(Key("a"), counter)
    run(Key("b"), counter)
    assert cc.clear() == 2
    assert list(cache.iterdir()) == []


# ----------------------------------------------------------------------------------------
# Two processes, one key
# ----------------------------------------------------------------------------------------


def _worker(root, counter, start, results):
    os.environ[cc.ENV_DIR] = root
    os.environ.pop(cc.ENV_ENABLE, None)
    start.wait(30)
    compile_fn = functools.partial(fake_compile, count_file=counter, delay=1.0)
    results.put(cc.load_or_compile(Key("shared"), compile_fn, fake_export, fake_load, direct))


def test_concurrent_processes_compile_once(cache, counter):
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(cache), counter, start, results)) for _ in range(3)]
    for p in procs:
        p.start()
    start.set()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got == [("loaded", "kernel<shared,1>")] * 3
    assert compiles(counter) == 1
    assert cc.verify_entry(entry(cache, Key("shared")), Key("shared")) is not None


# ----------------------------------------------------------------------------------------
# The real DSL export (compiling for sm_90a needs no GPU; so does loading the library)
# ----------------------------------------------------------------------------------------


def _small_fwd_key():
    from cute_attn.config import AttnFeatures, fwd_config_for
    from cute_attn.launcher import FwdKey

    features = AttnFeatures()
    return FwdKey("bf16", 64, features, fwd_config_for(64, features))


def _real_compile(key, counter):
    from cute_attn.launcher import compile_fwd

    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    return compile_fwd(key)


def _no_compile(key):
    raise AssertionError("expected a cache hit")


def _build_real_entry(root, counter, no_cc):
    os.environ[cc.ENV_DIR] = root
    if no_cc:
        cc._c_compiler = lambda: None
    from cute_attn.launcher import _raw

    key = _small_fwd_key()
    compile_fn = functools.partial(_real_compile, counter=counter)
    cc.load_or_compile(key, compile_fn, cc.dsl_export, cc.dsl_load, _raw)


def _build_in_child(cache, counter, no_cc):
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_build_real_entry, args=(str(cache), counter, no_cc))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0


@pytest.mark.parametrize("no_cc", [False, True], ids=["shared-library", "object-file"])
def test_real_forward_export_and_load(cache, counter, no_cc):
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    import tvm_ffi

    # built in another process, loaded here without compiling
    _build_in_child(cache, counter, no_cc)
    assert compiles(counter) == 1
    key = _small_fwd_key()
    folder = entry(cache, key)
    manifest = cc.verify_entry(folder, key)
    assert manifest is not None
    fmt = manifest["meta"]["format"]
    assert fmt == ("o" if no_cc else "so")
    expected = {"f0.o"} if no_cc else {"kernels.so"}
    assert set(manifest["files"]) == expected
    assert all(1_000 < info["size"] < 10_000_000 for info in manifest["files"].values())
    fn = cc.load_or_compile(key, _no_compile, cc.dsl_export, cc.dsl_load)
    assert isinstance(fn, tvm_ffi.Function)
    # the compiled argument check runs without a GPU: 13 positional arguments
    with pytest.raises(TypeError, match="13 parameters"):
        fn(1)


@pytest.mark.gpu
def test_real_forward_from_disk_matches_in_memory(cache, counter):
    import torch

    from cute_attn.config import UNBOUNDED
    from cute_attn.launcher import _raw, compile_fwd

    _build_in_child(cache, counter, False)
    key = _small_fwd_key()
    from_disk = cc.load_or_compile(key, _no_compile, cc.dsl_export, cc.dsl_load)
    in_memory = _raw(compile_fwd(key))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.zeros(2, dtype=torch.int32, device="cuda")
    outs = []
    for fn in (from_disk, in_memory):
        out, lse = torch.empty_like(q), torch.empty(2, 4, 300, device="cuda", dtype=torch.float32)
        fn(q, k, v, out, lse, cu, cu, cu.view(1, 2), 0, 64 ** -0.5, 0.0, UNBOUNDED, UNBOUNDED)
        outs.append((out, lse))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(outs[0][0], ref, atol=2e-2, rtol=2e-2)


_FRESH_PROCESS_CALL = """
import sys, torch
from cute_attn import compile_cache as cc
from cute_attn.config import UNBOUNDED
from cute_attn.launcher import FwdKey
from cute_attn.config import AttnFeatures, fwd_config_for
f = AttnFeatures()
def no_compile(key):
    raise AssertionError("expected a cache hit")
fn = cc.load_or_compile(FwdKey("bf16", 64, f, fwd_config_for(64, f)), no_compile, cc.dsl_export, cc.dsl_load)
q, k, v = (torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out, lse = torch.empty_like(q), torch.empty(1, 2, 256, device="cuda", dtype=torch.float32)
cu = torch.zeros(2, dtype=torch.int32, device="cuda")
fn(q, k, v, out, lse, cu, cu, cu.view(1, 2), 0, 64 ** -0.5, 0.0, UNBOUNDED, UNBOUNDED)
ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
assert "cutlass" not in sys.modules, "loading a shared-library entry should not import cutlass"
print("ok")
"""


@pytest.mark.gpu
def test_real_forward_from_disk_in_a_process_without_cutlass(cache, counter):
    import subprocess
    import sys

    _build_in_child(cache, counter, False)
    env = dict(os.environ, **{cc.ENV_DIR: str(cache)})
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_CALL], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
