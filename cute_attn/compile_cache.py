"""A persistent, on-disk cache of compiled kernels (launcher.get_fwd_kernel / get_bwd_kernels).

One entry per compile key, a folder under cache_dir():

    <cache_dir>/<entry_key>/           the exported files, then manifest.json (written last)
    <cache_dir>/<entry_key>.lock       flock'ed: shared to read an entry, exclusive to build one
    <cache_dir>/.tmp-<entry_key>-...   an entry being built (renamed into place when complete)

An entry is used only when its manifest names the same key, versions and source fingerprint
and every file it lists has the recorded size and SHA-256; otherwise, or when loading it
raises, it is deleted and rebuilt. Two processes that miss the same key at once compile it
once: the second waits on the exclusive lock, then finds the entry built and loads it.

This module has no dependency beyond the standard library: the compile, export and load
steps are passed in (load_or_compile). dsl_export / dsl_load are the real ones for
TVM-FFI functions compiled by the CuTe DSL (cute.compile(..., options="--enable-tvm-ffi")):
each compiled function is exported to an object file (export_to_c), the objects are linked
into one shared library with the system C compiler, and the library is loaded back with
tvm_ffi.load_module, which neither imports cutlass nor needs a GPU. Without a C compiler
the objects are kept and loaded with cute.runtime.load_module (imports cutlass: ~0.5 s).

Environment: CUTE_ATTN_CACHE_DIR (default ~/.cache/cute_attn); CUTE_ATTN_CACHE=0 disables
the cache (every key compiles, nothing is read or written). The DSL's CUTE_DSL_* compile
settings are part of the key (versions()). There is no size bound or eviction: entries of
old sources or versions stay until clear() (which, run while other processes use the
cache, may let two of them build one key at once: each still loads only a verified entry).
"""

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger("cute_attn")

ENV_DIR = "CUTE_ATTN_CACHE_DIR"
ENV_ENABLE = "CUTE_ATTN_CACHE"
# the layout of an entry (manifest fields, file naming, export format); bump on a change
FORMAT = 1
MANIFEST = "manifest.json"

_PACKAGE = Path(__file__).resolve().parent
# the sources a compiled kernel depends on (relative to the package), as globs: every
# cute_attn module that kernels/ and blocks/ import (masks.py: the mods' SeqInfo/Dual and
# the built-in mods' helpers, named but not hashed by a mod's digest; dropout.py: Philox)
_SOURCE_GLOBS = ("kernels/*.py", "blocks/*.py", "config.py", "launcher.py", "compile_cache.py", "masks.py",
                 "dropout.py")
# CUTE_DSL_* settings that do not change what the DSL compiles (its env_manager's
# affects_compile=False: logs, dumps, its own JIT cache; ARCH: the launcher names the arch
# with --gpu-arch). Every other CUTE_DSL_* variable (DEBUG, LINEINFO, ENABLE_ASSERTIONS,
# COMPILER_OPT, LIBS, ... and any unknown one) is part of the key: a needless rebuild at
# worst, never a kernel built under other settings.
_DSL_ENV_NOT_COMPILED = frozenset({
    "LOG_LEVEL", "LOG_TO_CONSOLE", "LOG_TO_FILE", "LOG_AUTOTUNE", "PRINT_AFTER_PREPROCESSOR", "PRINT_IR",
    "SHOW_STACKTRACE", "FILTER_STACKTRACE", "NO_CACHE", "JIT_CACHE_MAX_ELEMS", "DUMP_DIR", "CACHE_DIR", "KEEP",
    "KEEP_IR", "KEEP_PTX", "KEEP_CUBIN", "KEEP_SASS", "WARNINGS_IGNORE", "ENABLE_OPTIMIZATION_WARNINGS",
    "DISABLE_FILE_CACHING", "ARCH",
})


# ----------------------------------------------------------------------------------------
# Where, and under which name
# ----------------------------------------------------------------------------------------


def enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Optional[Path]:
    """The cache folder, or None when the cache is disabled (CUTE_ATTN_CACHE=0)."""
    if not enabled():
        return None
    configured = os.environ.get(ENV_DIR)
    if configured:
        return Path(configured).expanduser()
    return Path("~/.cache/cute_attn").expanduser()


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    """SHA-256 over the kernel-relevant sources of the package (names and contents), once
    per process."""
    h = hashlib.sha256()
    files = sorted({p for pattern in _SOURCE_GLOBS for p in _PACKAGE.glob(pattern) if p.is_file()})
    for path in files:
        h.update(path.relative_to(_PACKAGE).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _dist_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def cuda_driver_major() -> Optional[int]:
    """The CUDA major version the driver supports (cuDriverGetVersion // 1000), None
    without a driver. The DSL picks its runtime flavour (cu12/cu13), which an exported
    library links against, from this number (newest flavour when there is no driver)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value // 1000
    except (OSError, AttributeError):
        pass
    return None


def versions() -> dict:
    """Everything besides the sources and the key that an exported entry depends on."""
    return {
        "format": FORMAT,
        "cutlass_dsl": _dist_version("nvidia-cutlass-dsl"),
        "tvm_ffi": _dist_version("apache-tvm-ffi"),
        "cuda_driver_major": cuda_driver_major(),
        "machine": platform.machine(),
        # an exported library is rpath'ed to this environment's runtime libraries
        "prefix": sys.prefix,
        # the DSL's compile settings (CUTE_DSL_LIBS: an explicit runtime library choice)
        "cute_dsl_env": {name: value for name, value in sorted(os.environ.items())
                         if name.startswith("CUTE_DSL_") and name[9:] not in _DSL_ENV_NOT_COMPILED},
    }


def entry_key(key: Any, fingerprint: Optional[str] = None, vers: Optional[dict] = None) -> str:
    """A stable, filename-safe name for key's entry: '<key class>-<sha256 prefix>' of the
    source fingerprint, versions(), the key's arch and its repr (a frozen dataclass of
    plain values, whose repr is stable across processes)."""
    payload = json.dumps(
        {
            "fingerprint": fingerprint if fingerprint is not None else source_fingerprint(),
            "versions": vers if vers is not None else versions(),
            "arch": getattr(key, "arch", None),
            "key": repr(key),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(payload.encode()).hexdigest()[:40]
    prefix = "".join(c for c in type(key).__name__.lower() if c.isalnum())[:24] or "key"
    return f"{prefix}-{digest}"


# ----------------------------------------------------------------------------------------
# Manifest
# ----------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _expected_manifest(key: Any) -> dict:
    return {"format": FORMAT, "key": repr(key), "fingerprint": source_fingerprint(), "versions": versions()}


def _write_manifest(folder: Path, key: Any, meta: Any) -> None:
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name == MANIFEST or not path.is_file():
            continue
        files[path.name] = {"size": path.stat().st_size, "sha256": _sha256_file(path)}
    manifest = dict(_expected_manifest(key), files=files, meta=meta, created=time.time())
    tmp = folder / (MANIFEST + ".part")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def verify_entry(folder: Path, key: Any) -> Optional[dict]:
    """The manifest of a complete, intact entry for key; None when the entry is missing,
    incomplete, stale (other key, versions or sources) or corrupt (a file's size or hash)."""
    try:
        with open(folder / MANIFEST) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    for field, value in _expected_manifest(key).items():
        if manifest.get(field) != value:
            return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return None
    try:
        for name, info in files.items():
            path = folder / name
            if path.parent != folder or path.stat().st_size != info["size"]:
                return None
            if _sha256_file(path) != info["sha256"]:
                return None
    except (OSError, KeyError, TypeError):
        return None
    return manifest


# ----------------------------------------------------------------------------------------
# Load or compile
# ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _flock(path: Path, mode: int):
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        # a lock file this process may only read (a cache another user warmed up, a
        # read-only mount): flock needs no write access, except over NFS, where a
        # LOCK_EX then fails and the caller compiles in memory
        fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        with contextlib.suppress(OSError):
            path.unlink()


def _try_load(folder: Path, key: Any, load_fn: Callable, name: str, skip: Optional[dict] = None):
    """(callable, manifest): callable is None unless folder holds a valid entry for key that
    loads; manifest is the entry's when valid (None when not). A valid entry whose
    manifest equals skip (one that failed to load before) is not tried again."""
    manifest = verify_entry(folder, key)
    if manifest is None or manifest == skip:
        return None, manifest
    start = time.perf_counter()
    try:
        fn = load_fn(folder, manifest.get("meta"))
    except Exception as exc:  # a load failure means a bad entry: rebuild it
        log.warning("cute_attn: cached kernel %s failed to load (%s: %s); rebuilding",
                    name, type(exc).__name__, exc)
        return None, manifest
    log.debug("cute_attn: loaded %r from %s in %.1f ms", key, folder, (time.perf_counter() - start) * 1e3)
    return fn, manifest


def _compile(key: Any, compile_fn: Callable):
    # compile_fn logs each kernel it compiles at INFO (launcher._compile); this line only
    # adds the total for a key of several kernels (the backward's three)
    start = time.perf_counter()
    compiled = compile_fn(key)
    log.debug("cute_attn: compiled %r in %.2f s", key, time.perf_counter() - start)
    return compiled


def load_or_compile(
    key: Any,
    compile_fn: Callable[[Any], Any],
    export_fn: Callable[[Any, Path], Any],
    load_fn: Callable[[Path, Any], Any],
    direct_fn: Callable[[Any], Any] = lambda compiled: compiled,
):
    """The callable of key: loaded from its cache entry, or compiled, exported, and loaded.

    compile_fn(key) -> compiled; export_fn(compiled, folder) writes the entry's files into
    folder and returns JSON-able metadata; load_fn(folder, metadata) -> the callable.
    direct_fn(compiled) -> the callable without the disk: used when the cache is disabled,
    and (with a warning) when the cache folder cannot be written or a fresh export fails
    to export or load, so that the cache never stops a kernel from running."""
    root = cache_dir()
    if root is None:
        return direct_fn(_compile(key, compile_fn))
    name = entry_key(key)
    folder, lock = root / name, root / (name + ".lock")
    with contextlib.ExitStack() as held:
        try:
            root.mkdir(parents=True, exist_ok=True)
            with _flock(lock, fcntl.LOCK_SH):
                fn, seen = _try_load(folder, key, load_fn, name)
            if fn is not None:
                return fn
            held.enter_context(_flock(lock, fcntl.LOCK_EX))
        except OSError as exc:
            log.warning("cute_attn: compile cache at %s unusable (%s); compiling in memory", root, exc)
            return direct_fn(_compile(key, compile_fn))
        # another process may have built it while this one waited for the lock; an entry
        # that failed to load above (the same manifest) is rebuilt without a second try
        fn, _ = _try_load(folder, key, load_fn, name, skip=seen)
        if fn is not None:
            return fn
        return _rebuild(key, name, root, compile_fn, export_fn, load_fn, direct_fn)


def _rebuild(key, name: str, root: Path, compile_fn, export_fn, load_fn, direct_fn):
    """Compile key, export it into a temp folder and rename that into place; called with
    the entry's exclusive lock held."""
    folder = root / name
    if folder.exists():
        log.warning("cute_attn: cache entry %s is stale or corrupt; rebuilding", folder)
    _remove(folder)
    # under the exclusive lock, any temp folder of this entry is a dead process's
    for stale in root.glob(f".tmp-{name}-*"):
        _remove(stale)
    compiled = _compile(key, compile_fn)
    tmp = None
    try:
        # not mkdtemp: its mode 0700 would make the entry unreadable to the other users of
        # a shared cache (warmed up by root in an image, read by the job's user)
        tmp = root / f".tmp-{name}-{os.getpid()}-{os.urandom(4).hex()}"
        tmp.mkdir()
        meta = export_fn(compiled, tmp)
        _write_manifest(tmp, key, meta)  # last: an entry without it is never used
        os.replace(tmp, folder)
        tmp = None
    except Exception as exc:
        log.warning("cute_attn: exporting %s to the compile cache failed (%s: %s)",
                    name, type(exc).__name__, exc)
        return direct_fn(compiled)
    finally:
        if tmp is not None:
            _remove(tmp)
    fn, _ = _try_load(folder, key, load_fn, name)
    if fn is not None:
        return fn
    _remove(folder)  # an entry that cannot load right after its export is of no use
    return direct_fn(compiled)


def clear(root: Optional[Path] = None) -> int:
    """Delete every entry (and lock) under the cache folder; returns how many entries."""
    root = root or cache_dir()
    if root is None or not root.is_dir():
        return 0
    count = 0
    for path in root.iterdir():
        if path.is_dir():
            count += not path.name.startswith(".tmp-")
            _remove(path)
        elif path.suffix == ".lock":
            _remove(path)
    return count


# ----------------------------------------------------------------------------------------
# The DSL's TVM-FFI export and load (cute.compile(..., options="--enable-tvm-ffi ..."))
# ----------------------------------------------------------------------------------------

_LIBRARY = "kernels.so"


def _c_compiler() -> Optional[str]:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate:
            found = shutil.which(candidate)
            if found:
                return found
    return None


def dsl_export(compiled, folder: Path) -> dict:
    """export_fn for a TVM-FFI compiled function, or a tuple of them (the backward's three):
    function i is exported as object f{i}.o (export_to_c, its TVM-FFI symbol
    __tvm_ffi_f{i}, every other symbol hidden), then all are linked into kernels.so
    against the DSL's runtime libraries (rpath'ed), and the objects removed. Without a C
    compiler the objects stay (dsl_load then loads them through cutlass)."""
    import cutlass.cute as cute

    many = isinstance(compiled, (tuple, list))
    fns = list(compiled) if many else [compiled]
    names = [f"f{i}" for i in range(len(fns))]
    objects = []
    for fn, fname in zip(fns, names):
        path = folder / f"{fname}.o"
        fn.export_to_c(str(path), function_name=fname, export_only_tvm_ffi_symbols=True)
        objects.append(path)
    meta = {"functions": names, "tuple": many, "format": "o"}
    cc = _c_compiler()
    if cc is not None:
        libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
        rpaths = [f"-Wl,-rpath,{d}" for d in dict.fromkeys(str(Path(lib).parent) for lib in libs)]
        cmd = [cc, "-shared", "-o", str(folder / _LIBRARY), *map(str, objects), *libs, *rpaths]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode == 0:
            for path in objects:
                path.unlink()
            meta["format"] = "so"
        else:
            log.debug("cute_attn: linking %s failed, keeping objects: %s", folder, result.stderr.strip())
            _remove(folder / _LIBRARY)
    return meta


def dsl_load(folder: Path, meta: dict):
    """load_fn for dsl_export's entries: the tvm_ffi.Function(s), positional arguments as
    the launcher passes them to _raw(compiled) today."""
    names = meta["functions"]
    if meta["format"] == "so":
        import tvm_ffi

        module = tvm_ffi.load_module(str(folder / _LIBRARY))
        fns = [module.get_function(fname) for fname in names]
    else:
        import cutlass.cute as cute

        fns = [getattr(cute.runtime.load_module(str(folder / f"{fname}.o"), enable_tvm_ffi=True), fname)
               for fname in names]
    if any(fn is None for fn in fns):
        raise RuntimeError(f"{folder}: a function of {names} is missing")
    return tuple(fns) if meta["tuple"] else fns[0]
