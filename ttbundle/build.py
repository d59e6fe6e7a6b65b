"""`ttbundle build`: a checkpoint and a spec -> one registrable package per mesh.

``build(bundle, mesh, out_dir)`` plans the bundle on the mesh, computes its content key
(``cache``), and unless the package at ``out_dir/<mesh>/<bundle>`` already has that key:

1. streams the checkpoint one canonical tensor at a time (safetensors mmap, sharded index
   supported): family name table -> transform -> dtype policy -> split per the plan -> appended
   to one safetensors file per device whose header was computed up front;
2. lowers a program per (phase, bucket) (``lower``) and warms each new one once on the emulated
   backend, recording that it ran;
3. writes the small files (config.json, tokenizer, vllm_metadata.json, adapter, bundle.yaml,
   README.md) and manifest.json last.

Everything goes to a temp directory beside the output (``out_dir/.ttbundle/tmp``, outside any
``EXTRA_MODELS_DIR``) and replaces the old package with one atomic exchange (renameat2), so a
build killed at any point leaves the previous package whole and nothing half-written where the
plugin looks. Builds of one package serialize on an ``fcntl`` lock. Artifacts whose key did not
change are hard-linked from the previous package (same inode, same mtime), so a changed bucket
rewrites one program and a no-op build writes nothing at all.

Progress goes to an optional callback as plain dict events (the CLI draws bars or prints JSON).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from . import __version__, cache, layout as layoutmod, lower as lowermod
from .errors import EXIT_DOES_NOT_FIT, InvalidInput, TTBundleError
from .package import (MANIFEST, METADATA, FORMAT, ST_DTYPE, WEIGHTS_FORMAT, PackageError, ShardFile,
                      encoded_nbytes, hf_config_json, metadata_json, module_name, package_path,
                      read_manifest, render_adapter, render_readme, stored_shape, tensor_key, tt_arch,
                      weight_file)
from .plan import Plan, axes_of, make_plan
from .program import Program

STATE_DIR = ".ttbundle"  # under out_dir: locks and temp dirs (not a package folder)
BACKENDS = ("emulated", "ttnn")  # ttnn: + per-device .tensorbin weight caches
# rough rates for `--dry-run` estimates on a CPU builder
EST_CONVERT_BYTES_PER_S = 400e6
EST_EMULATED_FLOPS = 1e10
TRANSPOSE_BLOCK = 64  # source rows per step when cutting a transposed shard
WRITER_THREADS = None  # threads that write + sha256 device files (None: one per usable core)

Progress = Callable[[dict], None]


class DoesNotFit(TTBundleError):
    """The plan does not fit the mesh's DRAM; exit 3."""

    exit_code = EXIT_DOES_NOT_FIT


# a test hook: called with a stage name at every point a build can be interrupted
_fault_hook: Callable[[str], None] | None = None


def _fault(stage: str) -> None:
    if _fault_hook is not None:
        _fault_hook(stage)


@dataclass
class BuildResult:
    package: str
    bundle: str
    mesh: str
    status: str  # built | up-to-date | dry-run
    key: str | None
    changed_fields: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    traces: list[dict] = field(default_factory=list)
    warmed: list[str] = field(default_factory=list)
    files: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    timings: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    estimate: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


# ---- public entry point ----------------------------------------------------------------------------
def build(bundle, mesh: str, out_dir: str | Path, *, dry_run: bool = False, force: bool = False,
          warmup: bool = True, progress: Progress | None = None, backend: str = "emulated") -> BuildResult:
    """Build (or, with ``dry_run``, describe) the package of ``bundle`` for ``mesh``.

    ``backend="ttnn"`` also writes per-device ``.tensorbin`` weight caches (``tensorbin/``,
    ``ttbundle.backends.ttnn.cache``) so a Tenstorrent host loads weights without converting."""
    if backend not in BACKENDS:
        raise InvalidInput(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
    t0 = time.monotonic()
    emit = progress or (lambda e: None)
    plan = make_plan(bundle, mesh)
    if not plan.fits:
        raise DoesNotFit(f"{bundle.spec.name} does not fit {plan.mesh.describe()}: needs "
                         f"{plan.memory.total:,} B per chip, has {plan.memory.dram:,} B "
                         f"(see `ttbundle plan --mesh {mesh}`)")
    _check_dtypes(plan)
    pkg = package_path(out_dir, bundle.spec.name, plan.mesh.name)
    sfpi = _sfpi(backend)
    res = BuildResult(str(pkg), bundle.spec.name, plan.mesh.name, "dry-run" if dry_run else "built", None)
    if dry_run:
        prev = _previous(pkg)
        inp = cache.compute(bundle, plan, prev)
        _backend_field(inp, backend, sfpi)
        _hash_sources(inp, emit)
        _describe(bundle, plan, inp, prev, res)
        res.seconds = time.monotonic() - t0
        emit({"event": "done", **res.to_json()})
        return res

    out = Path(out_dir).absolute()
    state = out / STATE_DIR
    lock_path = state / "locks" / f"{_tag(pkg)}.lock"
    with _Lock(lock_path, emit):
        _recover(state, pkg)
        _check_replaceable(pkg)
        prev = _previous(pkg)
        inp = cache.compute(bundle, plan, prev)
        _backend_field(inp, backend, sfpi)
        if prev is not None and inp.pending:
            _hash_sources(inp, emit)  # decide no-op vs rebuild on content, not on mtimes
        if prev is not None and not force and not inp.pending \
                and prev.get("key") == cache.content_key(inp.fields) and _intact(pkg, prev):
            _describe(bundle, plan, inp, prev, res)
            res.status, res.rebuilt, res.reused = "up-to-date", [], sorted(prev.get("artifacts", {}))
            res.seconds = time.monotonic() - t0
            emit({"event": "done", **res.to_json()})
            return res
        tmp = state / "tmp" / f"{_tag(pkg)}@{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            _Builder(bundle, plan, inp, prev, pkg, tmp, res, emit, force, warmup, backend, sfpi).run()
            _fault("before-swap")
            _swap(tmp, pkg, state)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    res.seconds = time.monotonic() - t0
    emit({"event": "done", **res.to_json()})
    return res


def _backend_field(inp, backend: str, sfpi=None) -> None:
    """The backend's key fields (``cache.backend_fields``; ``cache explain`` adds the same)."""
    cache.backend_fields(inp, backend, sfpi[0].key() if sfpi else None)


def _sfpi(backend: str):
    """ttnn builds: (SFPI found on this host, the Python with ttnn that fills the kernel cache)."""
    if backend != "ttnn":
        return None
    from .backends.ttnn import kernelcache
    return kernelcache.status()


def _check_dtypes(plan: Plan) -> None:
    block = sorted({t.dtype for t in plan.tensors if t.dtype != "bf16"})
    if block:
        try:
            from . import blockfloat  # noqa: F401
        except ImportError:
            names = [t.name for t in plan.tensors if t.dtype != "bf16"]
            raise InvalidInput(f"not yet: {'/'.join(block)} weights ({', '.join(names[:4])}"
                               f"{', ...' if len(names) > 4 else ''}) need ttbundle.blockfloat, which "
                               "is not in this ttbundle yet; build with bf16 (weights.dtypes) for now") from None


def _previous(pkg: Path) -> dict | None:
    try:
        return read_manifest(pkg)
    except PackageError:
        return None


def _intact(pkg: Path, m: dict) -> bool:
    """Cheap check that the package on disk is what its manifest says (existence and sizes)."""
    for rel, rec in m["files"].items():
        try:
            if os.stat(pkg / rel).st_size != rec.get("size"):
                return False
        except OSError:
            return False
    return True


def _hash_sources(inp, emit: Progress) -> None:
    todo = [r for r in inp.weight_records + inp.tokenizer_records if r["blake3"] is None]
    if todo:
        total = sum(r["size"] for r in todo)
        emit({"event": "phase", "phase": "hash", "total": total, "unit": "bytes"})
        cache.fill_digests(todo, lambda n: emit({"event": "advance", "phase": "hash", "bytes": n}))
    inp.finish()


def _describe(bundle, plan: Plan, inp, prev: dict | None, res: BuildResult) -> None:
    """Key, trace set with estimates, and what a build would redo (dry-run and up-to-date)."""
    res.key = cache.content_key(inp.fields)
    keys = cache.artifact_keys(inp.fields, inp.traces)
    before = (prev or {}).get("artifacts", {})
    res.rebuilt = [a for a, k in keys.items() if before.get(a, {}).get("key") != k]
    res.reused = [a for a in keys if a not in res.rebuilt]
    res.changed_fields = _changed(prev, inp.fields)
    total_flops = 0
    for phase, b in inp.traces:
        s = lowermod.summary(lowermod.lower(bundle, plan, phase, b))
        s["warmup_seconds_est"] = round(s["flops_per_device"] * plan.mesh.num_devices / EST_EMULATED_FLOPS, 3)
        total_flops += s["flops_per_device"] * plan.mesh.num_devices
        s["rebuild"] = f"program:{lowermod.program_name(phase, b)}" in res.rebuilt
        res.traces.append(s)
    src = sum(r["size"] for r in inp.weight_records)
    out_bytes = sum(t.bytes_per_copy * t.count for t in plan.tensors)  # per device, allocator-rounded
    res.estimate = {"source_bytes": src, "device_weight_bytes": out_bytes,
                    "devices": plan.mesh.num_devices,
                    "convert_seconds": round(src / EST_CONVERT_BYTES_PER_S, 1),
                    "warmup_seconds": round(total_flops / EST_EMULATED_FLOPS, 1),
                    "trace_region_bytes": plan.memory.trace_region}


def _changed(prev: dict | None, fields: dict) -> list[str]:
    if prev is None:
        return ["(no previous package)"]
    old = prev.get("key_fields", {})
    return sorted(k for k in set(old) | set(fields) if old.get(k) != fields.get(k))


# ---- locking, recovery and the atomic swap ------------------------------------------------------------
class _Lock:
    """An exclusive ``flock`` on a file beside the packages; released when the process dies."""

    def __init__(self, path: Path, emit: Progress):
        self.path, self.emit = path, emit

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.emit({"event": "waiting", "lock": str(self.path)})
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _tag(pkg: Path) -> str:
    """``<mesh>@<bundle>``: names this package's lock and temp dirs ('@' is in neither name, so
    one package's prefix never matches another's)."""
    return f"{pkg.parent.name}@{pkg.name}"


def _check_replaceable(pkg: Path) -> None:
    """Refuse to replace anything at the package path that is not a package (or empty)."""
    if not os.path.lexists(pkg):
        return
    if pkg.is_symlink() or not pkg.is_dir():
        raise InvalidInput(f"{pkg} exists and is not a package directory (a file or a symlink); "
                           "remove it or choose another -o")
    names = {p.name for p in pkg.iterdir()}
    if names and not names & {MANIFEST, METADATA}:
        raise InvalidInput(f"{pkg} exists and is not a ttbundle package; remove it or choose another -o")


def _recover(state: Path, pkg: Path) -> None:
    """Under the lock: undo a fallback swap cut short, and delete temp dirs of killed builds."""
    old = state / "tmp" / f"{_tag(pkg)}@old"
    if old.exists() and not pkg.exists():
        os.rename(old, pkg)
    tmpdir = state / "tmp"
    if tmpdir.is_dir():
        for d in tmpdir.iterdir():
            if d.name.startswith(f"{_tag(pkg)}@"):
                shutil.rmtree(d, ignore_errors=True)


_RENAME_EXCHANGE = 2
_libc = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    global _libc
    try:
        _libc = _libc or ctypes.CDLL(None, use_errno=True)
        fn = _libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(e, f"renameat2({a}, {b}): {os.strerror(e)}")


def _fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap(tmp: Path, pkg: Path, state: Path) -> None:
    pkg.parent.mkdir(parents=True, exist_ok=True)
    if not pkg.exists():
        os.rename(tmp, pkg)
        _fsync_dir(pkg.parent)
        _fault("after-swap")
        return
    if _exchange(tmp, pkg):
        _fsync_dir(pkg.parent)
        _fault("after-swap")
        shutil.rmtree(tmp)  # the previous package, now at the temp path
        return
    # no renameat2 (not Linux, or the filesystem refuses): two renames; _recover() undoes a
    # build killed between them
    old = state / "tmp" / f"{_tag(pkg)}@old"
    os.rename(pkg, old)
    _fault("mid-swap")
    os.rename(tmp, pkg)
    _fsync_dir(pkg.parent)
    shutil.rmtree(old)


# ---- the build itself -------------------------------------------------------------------------------------
class _Builder:
    def __init__(self, bundle, plan, inp, prev, pkg, tmp, res, emit, force, warmup, backend="emulated", sfpi=None):
        self.bundle, self.plan, self.inp, self.prev = bundle, plan, inp, prev
        self.sfpi = sfpi
        self.pkg, self.tmp, self.res, self.emit = pkg, tmp, res, emit
        self.force, self.do_warmup = force, warmup
        self.backend = backend
        self.files: dict[str, dict] = {}
        self.prev_files = (prev or {}).get("files", {}) if not force else {}
        self.prev_art = (prev or {}).get("artifacts", {}) if not force else {}
        self.artifacts: dict[str, dict] = {}
        self.hf_arch = bundle.family.hf_architectures[0]

    # -- files ---------------------------------------------------------------------------------
    def _link(self, rel: str) -> bool:
        """Reuse the previous package's file ``rel`` (hard link: same inode and mtime)."""
        rec = self.prev_files.get(rel)
        src = self.pkg / rel
        if rec is None or not src.is_file() or os.stat(src).st_size != rec["size"]:
            return False
        dst = self.tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        self.files[rel] = {"sha256": rec["sha256"], "size": rec["size"]}
        return True

    def _write(self, rel: str, data: bytes) -> None:
        """Write a small file, or link the previous one when the bytes are the same."""
        import hashlib
        sha = hashlib.sha256(data).hexdigest()
        old = self.prev_files.get(rel)
        if old and old["sha256"] == sha and self._link(rel):
            return
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():  # never write through a hard link into the previous package
            p.unlink()
        with open(p, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[rel] = {"sha256": sha, "size": len(data)}
        self.res.bytes_written += len(data)
        _fault(f"wrote:{rel}")

    # -- steps ---------------------------------------------------------------------------------
    def run(self) -> None:
        inp, res = self.inp, self.res
        hasher, hash_err = None, []
        if inp.pending:  # first build: hash the checkpoint beside the conversion
            def hash_sources():
                c = time.thread_time()
                try:
                    cache.fill_digests(inp.weight_records + inp.tokenizer_records)
                except BaseException as e:  # re-raised below, after the conversion
                    hash_err.append(e)
                res.timings["cpu_hash"] = round(time.thread_time() - c, 3)
            hasher = threading.Thread(target=hash_sources, name="ttbundle-hash", daemon=True)
            hasher.start()
        t = time.monotonic()
        import torch  # noqa: F401  (its import, ~1 s of CPU, is not part of the weight phase)
        res.timings["import_torch"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        wkey = None if inp.pending else cache.artifact_keys(inp.fields, [])["weights"]
        if wkey is not None and self.prev_art.get("weights", {}).get("key") == wkey \
                and all(self._link(weight_file(d)) for d in range(self.plan.mesh.num_devices)):
            res.reused.append("weights")
        else:
            self._convert()
            res.rebuilt.append("weights")
        res.timings["weights"] = round(time.monotonic() - t, 3)
        if hasher is not None:
            t = time.monotonic()
            hasher.join()
            if hash_err:
                raise TTBundleError(f"hashing the checkpoint failed: {hash_err[0]}") from hash_err[0]
            inp.finish()
            res.timings["hash_wait"] = round(time.monotonic() - t, 3)
        keys = cache.artifact_keys(inp.fields, inp.traces)
        self.artifacts["weights"] = {"key": keys["weights"],
                                     "files": [weight_file(d) for d in range(self.plan.mesh.num_devices)]}
        if self.backend == "ttnn":
            t = time.monotonic()
            self._tensorbin(keys["weights"])
            res.timings["tensorbin"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        self._programs(keys)
        res.timings["programs"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        self._warmup(keys)
        res.timings["warmup"] = round(time.monotonic() - t, 3)
        if self.backend == "ttnn":
            t = time.monotonic()
            self._kernel_cache(keys)
            res.timings["kernel_cache"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        self._small_files()
        res.key = cache.content_key(inp.fields)
        res.changed_fields = _changed(self.prev, inp.fields)
        self._manifest()
        res.timings["metadata"] = round(time.monotonic() - t, 3)
        for root, _, _ in os.walk(self.tmp):
            _fsync_dir(Path(root))
        res.files = len(self.files) + 1

    # -- weights -------------------------------------------------------------------------------
    def _convert(self) -> None:
        from .weights import Checkpoint, read_plan

        bundle, plan = self.bundle, self.plan
        fam, a, mesh = bundle.family, bundle.arch, plan.mesh
        D = mesh.num_devices
        cpu0 = time.thread_time()
        ck = Checkpoint(self.inp.weights_dir)
        for f in set(ck.files.values()):
            if Path(f).resolve().parent != Path(self.inp.weights_dir).resolve():
                raise InvalidInput(f"{self.inp.weights_dir}: refusing checkpoint file {f} outside the directory")
        jobs = read_plan(fam, a, ck.keys())
        tp = {t.name: t for t in plan.tensors}
        decls = {t.name: t for t in fam.tensors(a)}
        units = {n: [layoutmod.units(d, axes_of(e), mesh, bundle.spec.sharding)
                     for d, e in zip(decls[n].dims, plan.specs[n])] for n in decls}
        # one header per device, computed before any tensor is read
        transform = {n.tensor: n.transform for n in fam.hf_names(a)}
        entries, layout = [], {}
        for name, layer, sources in jobs:
            t = tp[name]
            key = tensor_key(name, layer)
            nbytes = encoded_nbytes(t.device_shape, t.dtype)
            flip = _stored_transposed(transform[name], decls[name], sources, t.dtype)
            shape = stored_shape(t.device_shape, flip) if t.dtype == "bf16" else [nbytes]
            entries.append((key, ST_DTYPE[t.dtype], shape, nbytes))
            layout[key] = {"tensor": name, "layer": layer, "encoding": t.dtype, "shape": t.device_shape,
                           "global_shape": list(decls[name].shape),
                           "spec": [list(axes_of(e)) or None for e in plan.specs[name]]}
            if flip:
                layout[key]["transposed"] = True
        (self.tmp / "weights").mkdir(exist_ok=True)
        writers, bg = [], []
        # one torch thread: the writer and checkpoint-hash threads use the other cores, and
        # OpenMP workers competing with them make every copy slower
        import torch
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for d in range(D):
                meta = {"format": WEIGHTS_FORMAT, "device": d, "coord": [d // mesh.cols, d % mesh.cols],
                        "mesh": mesh.name, "tensors": layout}
                writers.append(ShardFile(self.tmp / weight_file(d), entries,
                                         {"ttbundle": json.dumps(meta, sort_keys=True)}))
            total = sum(e[3] for e in entries) * D
            self.emit({"event": "phase", "phase": "weights", "total": len(jobs), "total_bytes": total,
                       "unit": "tensors"})
            # one tensor's distinct shards may wait for the writers while the next one is read
            cap = max(encoded_nbytes(tp[n].device_shape, tp[n].dtype) * D for n, _, _ in jobs)
            # write + sha256 is most of the work: one thread per core, each owning whole device files
            nbg = max(1, min(D, WRITER_THREADS or len(os.sched_getaffinity(0))))
            bg = [_WriteBehind(cap) for _ in range(nbg)]
            pool = _BufferPool(2 * cap)
            for i, (name, layer, sources) in enumerate(jobs):
                t = tp[name]
                c, nread = _read_canonical(ck, transform[name], a, decls[name], layer, sources, t.dtype)
                self.res.bytes_read += nread
                key = tensor_key(name, layer)
                written = 0
                keep = bool(layout[key].get("transposed"))
                for buf, devices, handle in _device_shards(c, units[name], decls[name].dims, D, t.dtype, pool,
                                                           keep_source_order=keep):
                    n = memoryview(buf).nbytes
                    by = {}
                    for d in devices:
                        by.setdefault(d % nbg, []).append((writers[d], key))
                    done = None if handle is None else _Countdown(len(by), lambda h=handle: pool.give(h))
                    for j, targets in by.items():
                        bg[j].put(targets, buf, n, done)
                    written += n * len(devices)
                    del buf, handle
                del c
                self.res.bytes_written += written
                self.emit({"event": "advance", "phase": "weights", "item": key, "i": i + 1,
                           "n": len(jobs), "bytes": written})
                _fault(f"tensor:{key}")
            for w in bg:
                w.finish()
            self.res.timings["cpu_convert"] = round(time.thread_time() - cpu0, 3)
            self.res.timings["cpu_write"] = round(sum(w.cpu for w in bg), 3)
            self.res.timings["writer_threads"] = len(bg)
            t = time.monotonic()
            for d, wr in enumerate(writers):
                sha, size = wr.close()  # fsync: waits for the disk
                self.files[weight_file(d)] = {"sha256": sha, "size": size}
            self.res.timings["weights_fsync"] = round(time.monotonic() - t, 3)
        except BaseException:
            for w in bg:
                w.abort()
            for wr in writers:
                wr.abort()
            raise
        finally:
            torch.set_num_threads(threads)
            _trim_heap()

    def _tensorbin(self, weights_key: str) -> None:
        """Per-device .tensorbin caches of the weights just written (or linked)."""
        from .backends.ttnn import cache as ttcache
        key = ttcache.artifact_key(weights_key)
        old = self.prev_art.get("tensorbin", {})
        if old.get("key") == key and all(self._link(rel) for rel in old.get("files", [])):
            files = old["files"]
            self.res.reused.append("tensorbin")
        else:
            written = ttcache.write_caches(self.tmp, self.plan, self.bundle.spec.sharding, self.emit)
            self.files.update(written)
            self.res.bytes_written += sum(r["size"] for r in written.values())
            files = sorted(written)
            self.res.rebuilt.append("tensorbin")
        self.artifacts["tensorbin"] = {"key": key, "files": files}

    def _kernel_cache(self, keys: dict) -> None:
        """tt-metal's kernel cache for every traced program, where a real SFPI compiler is present
        (``backends/ttnn/kernelcache.py``); else recorded as not filled, with the reason."""
        from .backends.ttnn import kernelcache as kc
        sfpi, python = self.sfpi or kc.status()
        key = cache.digest({"programs": sorted(v for k, v in keys.items() if k.startswith("program:")),
                            "sfpi": sfpi.key(), "ttnn": self.inp.fields.get("ttnn")})
        old = self.prev_art.get("kernel_cache", {})
        files = None
        if sfpi.found and old.get("key") == key and old.get("filled") and all(self._link(r) for r in old["files"]):
            self.res.reused.append("kernel_cache")
            files = {r: self.files[r] for r in old["files"]}
        elif sfpi.found:
            files = kc.fill(python, self.bundle.file, self.plan.mesh.name, self.tmp / kc.CACHE_DIR, self.emit)
            self.files.update(files)
            self.res.bytes_written += sum(r["size"] for r in files.values())
            self.res.rebuilt.append("kernel_cache")
        self.artifacts["kernel_cache"] = {"key": key, **kc.record(sfpi, files)}
        if not self.artifacts["kernel_cache"]["filled"]:
            self.res.warnings.append("kernel cache not pre-filled (the first warm-up on a Tenstorrent host "
                                     f"compiles every kernel): {self.artifacts['kernel_cache']['reason']}")

    # -- programs ------------------------------------------------------------------------------
    def _programs(self, keys: dict) -> None:
        traces = self.inp.traces
        self.emit({"event": "phase", "phase": "programs", "total": len(traces), "unit": "traces"})
        for i, (phase, b) in enumerate(traces):
            name = lowermod.program_name(phase, b)
            rel = f"programs/{name}.json"
            art = f"program:{name}"
            reused = self.prev_art.get(art, {}).get("key") == keys[art] and self._link(rel)
            if not reused:
                prog = lowermod.lower(self.bundle, self.plan, phase, b).to_json()
                self._write(rel, (json.dumps(prog, sort_keys=True, indent=1) + "\n").encode())
            (self.res.reused if reused else self.res.rebuilt).append(art)
            self.artifacts[art] = {"key": keys[art], "files": [rel]}
            self.emit({"event": "advance", "phase": "programs", "item": name, "i": i + 1,
                       "n": len(traces), "reused": reused})

    def _warmup(self, keys: dict) -> None:
        """Run each (phase, bucket) whose warm-up key is new once on the emulated backend, from
        the weights just written, and record the shapes the backend reports it ran."""
        todo, records = [], {}
        for phase, b in self.inp.traces:
            art = f"warmup:{lowermod.program_name(phase, b)}"
            old = self.prev_art.get(art)
            if old and old.get("key") == keys[art] and old.get("ran"):
                records[art] = old
                self.res.reused.append(art)
            elif self.do_warmup:
                todo.append((phase, b))
            else:
                records[art] = {"key": keys[art], "backend": "emulated", "ran": False}
        if todo:
            self.emit({"event": "phase", "phase": "warmup", "total": len(todo), "unit": "traces"})
            ran = _warm(self.bundle, self.plan, self.tmp, todo, self.emit)
            for (phase, b), rec in zip(todo, ran):
                art = f"warmup:{lowermod.program_name(phase, b)}"
                records[art] = {"key": keys[art], **rec}
                self.res.rebuilt.append(art)
                self.res.warmed.append(lowermod.program_name(phase, b))
        self.artifacts.update(records)

    # -- small files ---------------------------------------------------------------------------
    def _small_files(self) -> None:
        b, plan = self.bundle, self.plan
        mod = module_name(b.spec.name, plan.mesh.name)
        cls = self.hf_arch
        self.main_class = f"{mod}:{cls}"
        self._write(METADATA, metadata_json(self.hf_arch, self.main_class).encode())
        self._write(f"{mod}.py", render_adapter(b.spec.name, plan.mesh.name, self.hf_arch, cls,
                                                __version__).encode())
        self._write("config.json", hf_config_json(b).encode())
        self._write("bundle.yaml", self.inp.bundle_yaml.encode())
        for r in self.inp.tokenizer_records:
            src = Path(r["dir"]) / r["name"]
            self._write(r["name"], src.read_bytes())
        if not self.inp.tokenizer_records:
            self.res.warnings.append("no tokenizer files found (set `tokenizer:` in the spec); vLLM will "
                                     "need --tokenizer")
        self._write("README.md", render_readme(self._card()).encode())

    def _card(self) -> dict:
        b, p, m = self.bundle, self.plan, self.plan.mesh
        progs = []
        for phase, bk in self.inp.traces:
            name = lowermod.program_name(phase, bk)
            prog = Program.from_json(json.loads((self.tmp / f"programs/{name}.json").read_text()), name)
            s = lowermod.summary(prog)
            w = self.artifacts.get(f"warmup:{name}", {})
            s["warmed"] = "emulated" if w.get("ran") else "not warmed"
            progs.append(s)
        mem = p.memory
        return {
            "bundle": b.spec.name, "description": b.spec.description, "family": p.family,
            "tt_arch": tt_arch(self.hf_arch), "main_class": self.main_class,
            "mesh": {"name": m.name, "rows": m.rows, "cols": m.cols, "devices": m.num_devices,
                     "chip": m.chip.label},
            "memory": [("weights", mem.weights), ("KV cache", mem.kv_cache),
                       ("activations", mem.activations), ("trace region", mem.trace_region),
                       ("total", mem.total), ("DRAM", mem.dram)],
            "tensors": [{"name": t.name, "dtype": t.dtype, "notation": t.notation(),
                         "device_shape": "x".join(map(str, t.device_shape)), "count": t.count}
                        for t in p.tensors],
            "collectives": sum(c.count for c in p.collectives),
            "traffic": p.decode_traffic_bytes_per_token,
            "programs": progs, "trace_region": mem.trace_region,
            "prefill_chunk": str(b.buckets.prefill_chunk or "none"),
            "key": cache.content_key(self.inp.fields), "spec_sha256": self.inp.fields["spec"],
            "versions": [(k, str(v)) for k, v in cache.versions().items()],
        }

    def _manifest(self) -> None:
        b, p, m = self.bundle, self.plan, self.plan.mesh
        bk = b.buckets
        manifest = {
            "format": FORMAT,
            "bundle": b.spec.name,
            "arch": self.hf_arch,
            "tt_arch": tt_arch(self.hf_arch),
            "main_class": self.main_class,
            "mesh": {"name": m.name, "shape": list(m.shape), "arch": m.chip.arch, "devices": m.num_devices},
            "buckets": {"prefill": list(bk.prefill), "decode": list(bk.decode),
                        "prefill_chunk": bk.prefill_chunk},
            "trace_region_bytes": p.memory.trace_region,
            "versions": cache.versions(),
            "spec_sha256": self.inp.fields["spec"],
            "key": cache.content_key(self.inp.fields),
            "key_fields": self.inp.fields,
            "artifacts": self.artifacts,
            "sources": {"weights": self.inp.weight_records, "tokenizer": self.inp.tokenizer_records},
            "build": {"spec_file": str(Path(b.file).absolute()), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "changed_fields": self.res.changed_fields, "rebuilt": sorted(self.res.rebuilt),
                      "reused": sorted(self.res.reused)},
            "files": dict(sorted(self.files.items())),
        }
        data = (json.dumps(manifest, indent=1) + "\n").encode()
        with open(self.tmp / MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fault("wrote:manifest")


# ---- conversion helpers -------------------------------------------------------------------------------
@dataclass
class _Canon:
    """One canonical tensor: ``base``, or ``base.transpose(-1, -2)`` when ``swap`` (the HF source
    itself, read by mmap; shards are cut from it without materializing the transpose)."""

    base: object
    swap: bool = False

    def dim(self, k: int) -> int:
        """The dim of ``base`` holding canonical dim ``k``."""
        n = self.base.dim()
        if self.swap and k >= n - 2:
            return 2 * n - 3 - k
        return k


def _is_view(tf: str, sources) -> bool:
    """A canonical tensor that is one checkpoint tensor as it is or transposed: read as a view."""
    return tf in ("t", "id") and len(sources) == 1 and "{e}" not in sources[0][0]


def _read_canonical(ck, tf: str, a, decl, layer, sources, dtype: str):
    """One canonical tensor from its checkpoint tensors (``tf``: its name-table transform).
    ``t``/``id`` of a single source stay a view of the source (mmap); other transforms run on
    the source dtype and are materialized. Returns (_Canon, bytes read)."""
    import torch

    from .families import transforms

    where = f"{decl.name}{'' if layer is None else f' (layer {layer})'}"
    if _is_view(tf, sources):
        x = ck.get(sources[0][1][0])
        shape = tuple(x.shape)
        if tf == "t" and x.dim() >= 2:
            shape = shape[:-2] + (shape[-1], shape[-2])
        if shape != decl.shape:
            raise InvalidInput(f"{where}: checkpoint gives shape {list(shape)}, the architecture says "
                               f"{list(decl.shape)}")
        return _Canon(x, tf == "t" and x.dim() >= 2), x.numel() * x.element_size()
    nread, srcs = 0, []
    for pattern, keys in sources:
        ts = [ck.get(k) for k in keys]
        nread += sum(x.numel() * x.element_size() for x in ts)
        srcs.append(torch.stack(ts) if "{e}" in pattern else ts[0])
        del ts
    w = transforms.apply(tf, srcs, a)
    del srcs
    if tuple(w.shape) != decl.shape:
        raise InvalidInput(f"{where}: checkpoint gives shape {list(w.shape)}, the architecture says "
                           f"{list(decl.shape)}")
    return _Canon(w), nread


class _BufferPool:
    """Reused shard buffers: fresh memory costs a page fault per 4 KiB on first touch."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.free: dict[int, list] = {}
        self.lock = threading.Lock()

    def take(self, shape, dtype):
        import torch
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self.lock:
            bufs = self.free.get(nbytes)
            if bufs:
                self.held -= nbytes
                return bufs.pop().view(dtype).view(shape)
        return torch.empty(nbytes, dtype=torch.uint8).view(dtype).view(shape)

    def give(self, t) -> None:
        import torch
        flat = t.reshape(-1).view(torch.uint8)
        with self.lock:
            if self.held + flat.numel() <= self.limit:
                self.free.setdefault(flat.numel(), []).append(flat)
                self.held += flat.numel()


def _stored_transposed(tf: str, decl, sources, dtype: str) -> bool:
    """Whether a tensor's shards keep the checkpoint's element order (HF ``[out, in]``) instead of
    the canonical ``[in, out]``: bf16 tensors that are one checkpoint tensor transposed. Their
    shards are then plain cuts of the source (no transpose; often contiguous, written straight
    from the mmap) and the weights header marks them ``"transposed": true``; readers transpose
    back (``package._decode``: a view). Block floats are always stored in device order: their
    tiles share exponents along the device's rows."""
    return dtype == "bf16" and tf == "t" and _is_view(tf, sources) and len(decl.shape) >= 2


class _Countdown:
    """Calls ``fn`` once ``n`` writer threads have each called it."""

    def __init__(self, n: int, fn):
        self.n, self.fn, self.lock = n, fn, threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.n -= 1
            last = self.n == 0
        if last:
            self.fn()


def _device_shards(c: _Canon, units_per_dim, dims, D: int, dtype: str, pool: "_BufferPool | None" = None,
                   keep_source_order: bool = False):
    """Yield (bytes-like, [devices], pooled buffer or None) once per distinct shard: cut from the
    source view, then one copy that gathers, transposes and casts (bf16, or float32 for block
    floats, then encoded). A pooled buffer goes back to ``pool`` once written. With
    ``keep_source_order`` (bf16 only, see :func:`_stored_transposed`) a shard stays in the
    source's element order: a contiguous cut is yielded as a view of the source, zero copies."""
    import torch

    sigs: dict[tuple, list[int]] = {}
    for d in range(D):
        sigs.setdefault(tuple(tuple(u[d]) for u in units_per_dim), []).append(d)
    host = torch.bfloat16 if dtype == "bf16" else torch.float32
    for sig, devices in sigs.items():
        v, pads = c.base, []
        for k, (units, dim) in enumerate(zip(sig, dims)):
            if len(units) == dim.size and units == tuple(range(dim.size)):
                continue
            sk = c.dim(k)
            run = layoutmod.unit_runs(units)
            if run is not None:
                v = v.narrow(sk, run[0] * dim.unit, run[1] * dim.unit)
                continue
            pos = torch.tensor(layoutmod.elements(units, dim.unit), dtype=torch.long)
            v = v.index_select(sk, pos.clamp(min=0))
            if bool((pos < 0).any()):
                pads.append((k, (pos < 0).nonzero().reshape(-1)))
        if keep_source_order:
            if dtype != "bf16":
                raise RuntimeError(f"source order is kept for bf16 shards only, not {dtype}")
            if not pads and v.is_contiguous() and v.dtype == torch.bfloat16:
                yield v.reshape(-1).view(torch.uint8).numpy(), devices, None
                del v
                continue
            x = pool.take(tuple(v.shape), host) if pool is not None else torch.empty(v.shape, dtype=host)
            x.copy_(v)
            del v
            for k, where in pads:
                x.index_fill_(c.dim(k), where, 0)
            yield x.view(torch.uint8).numpy(), devices, x if pool is not None else None
            del x
            continue
        shape = tuple(v.transpose(-1, -2).shape if c.swap else v.shape)
        x = pool.take(shape, host) if pool is not None else torch.empty(shape, dtype=host)
        if c.swap and v.shape[-2] > 16 * TRANSPOSE_BLOCK:
            # blocks of source rows (output columns): ~2x faster than one big strided copy
            for r in range(0, v.shape[-2], TRANSPOSE_BLOCK):
                x[..., r:r + TRANSPOSE_BLOCK].copy_(v[..., r:r + TRANSPOSE_BLOCK, :].transpose(-1, -2))
        else:
            x.copy_(v.transpose(-1, -2) if c.swap else v)
        del v
        for k, where in pads:
            x.index_fill_(k, where, 0)
        if dtype == "bf16":
            yield x.view(torch.uint8).numpy(), devices, x if pool is not None else None
        else:
            from . import blockfloat
            data = blockfloat.encode(x, dtype)
            want = encoded_nbytes(list(x.shape), dtype)
            if len(data) != want:
                raise RuntimeError(f"blockfloat.encode gave {len(data)} B for {list(x.shape)} {dtype}, "
                                   f"expected {want} B")
            if pool is not None:
                pool.give(x)
            yield data, devices, None
        del x


class _WriteBehind:
    """A thread that appends shards to the device files (write + sha256) while the next tensor is
    read and cut; ``put`` blocks while more than ``cap`` bytes are waiting."""

    def __init__(self, cap: int):
        import collections
        self.cap, self.pending = cap, 0
        self.q: collections.deque = collections.deque()
        self.cv = threading.Condition()
        self.err: BaseException | None = None
        self.closed = False
        self.cpu = 0.0  # the thread's CPU seconds
        self.t = threading.Thread(target=self._run, name="ttbundle-writer", daemon=True)
        self.t.start()

    def put(self, targets: list, buf, nbytes: int, on_done=None) -> None:
        with self.cv:
            while self.pending and self.pending + nbytes > self.cap and self.err is None:
                self.cv.wait()
            if self.err is not None:
                raise self.err
            self.q.append((targets, buf, nbytes, on_done))
            self.pending += nbytes
            self.cv.notify_all()

    def _run(self) -> None:
        c = time.thread_time()
        try:
            self._loop()
        finally:
            self.cpu = time.thread_time() - c

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.q and not self.closed:
                    self.cv.wait()
                if not self.q:
                    return
                targets, buf, nbytes, on_done = self.q.popleft()
            try:
                for f, key in targets:
                    f.write(key, buf)
            except BaseException as e:  # surfaced to the producer on its next put / finish
                with self.cv:
                    self.err = e
                    self.cv.notify_all()
                return
            del buf
            if on_done is not None:
                on_done()
            with self.cv:
                self.pending -= nbytes
                self.cv.notify_all()

    def finish(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.t.join()
        if self.err is not None:
            raise self.err

    def abort(self) -> None:
        with self.cv:
            self.q.clear()
            self.closed = True
            self.cv.notify_all()
        self.t.join()


def _trim_heap() -> None:
    """Hand freed conversion buffers back to the OS (glibc keeps them in its arenas otherwise,
    and they would count against every later phase's peak RSS)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- warm-up ---------------------------------------------------------------------------------------------
def _warm(bundle, plan: Plan, pkg_dir: Path, todo: list, emit: Progress) -> list[dict]:
    """Load the package's weights into the emulated backend and run each (phase, bucket) once."""
    import torch

    from .backends.emulated import EmulatedModel, Runner
    from .package import assemble

    parts = assemble(pkg_dir, {}, bundle, plan.mesh,
                     {k: f"programs/{lowermod.program_name(*k)}.json" for k in lowermod.trace_set(bundle)})
    model = EmulatedModel.from_package(parts, dtype=torch.float32)
    # KV blocks for the longest prefill warmed (decode runs at position 0), not max_model_len
    bs = bundle.spec.runtime.kv_block_size
    need = -(-max([b for p, b in todo if p == "prefill"] + [1]) // bs) + 1
    runner = Runner(model, num_blocks=need)
    blocks = list(range(need))
    vocab = bundle.arch.vocab_size
    out = []
    with torch.no_grad():
        for i, (phase, b) in enumerate(todo):
            t = time.monotonic()
            runner.shapes_run.clear()
            if phase == "prefill":
                runner.chunk = b  # one chunk of exactly this bucket
                runner.prefill([(7 * j + 1) % vocab for j in range(b)], blocks)
            else:
                runner.decode([1] * b, [0] * b, [blocks] * b)
            ran = (phase, b) in runner.shapes_run
            out.append({"backend": "emulated", "ran": ran, "seconds": round(time.monotonic() - t, 3),
                        "shapes_run": sorted([list(s) for s in runner.shapes_run])})
            emit({"event": "advance", "phase": "warmup", "item": lowermod.program_name(phase, b),
                  "i": i + 1, "n": len(todo)})
            if not ran:
                raise TTBundleError(f"warm-up of {phase} bucket {b}: the emulated backend ran "
                                    f"{sorted(runner.shapes_run)} instead")
    return out


# ---- console rendering (used by the CLI) ----------------------------------------------------------------
class ConsoleProgress:
    """Build events as rich progress bars: one bar per phase with the current item and an ETA."""

    LABELS = {"hash": "hashing checkpoint", "weights": "converting weights", "programs": "lowering programs",
              "tensorbin": "writing .tensorbin caches",
              "warmup": "warming traces"}

    def __init__(self, console, prefix: str = ""):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)
        self.console, self.prefix = console, prefix
        self.bars = Progress(TextColumn("{task.description:<28}"), BarColumn(bar_width=30), MofNCompleteColumn(),
                             TextColumn("{task.fields[item]:<18}"), TimeElapsedColumn(), TextColumn("ETA"),
                             TimeRemainingColumn(), console=console)
        self.tasks: dict[str, int] = {}
        self.running = False

    def __call__(self, e: dict) -> None:
        ev = e["event"]
        if ev == "phase":
            if not self.running:
                self.bars.start()
                self.running = True
            total = e["total"] if e["phase"] != "hash" else max(1, e["total"] >> 20)
            self.tasks[e["phase"]] = self.bars.add_task(f"{self.prefix}{self.LABELS.get(e['phase'], e['phase'])}",
                                                        total=total, item="")
        elif ev == "advance" and e["phase"] in self.tasks:
            step = (e.get("bytes", 0) >> 20) if e["phase"] == "hash" else 1
            self.bars.update(self.tasks[e["phase"]], advance=step, item=str(e.get("item", ""))[:18])
        elif ev == "waiting":
            self.console.print(f"{self.prefix}waiting for another build of this package ({e['lock']})")
        elif ev == "done" and self.running:
            self.bars.stop()
            self.running = False


def print_results(results: list[BuildResult], console) -> None:
    """The summary table after a build, or the trace set and estimates of a dry run."""
    from rich.table import Table
    for r in results:
        if r.status == "dry-run":
            t = Table(title=f"{r.bundle} on {r.mesh}: trace set (dry run, nothing written)",
                      title_justify="left", show_edge=False)
            for c in ("phase", "bucket", "rows", "ops", "coll", "trace", "act", "warm-up", "build"):
                t.add_column(c, justify="right", no_wrap=True)
            for s in r.traces:
                t.add_row(s["phase"], str(s["bucket"]), str(s["rows"]), str(s["ops"]), str(s["collectives"]),
                          _size(s["trace_region_bytes"]), _size(s["activation_bytes"]),
                          f"{s['warmup_seconds_est']:.2f} s", "new" if s["rebuild"] else "reuse")
            console.print(t)
            e = r.estimate
            console.print(f"  weights: {e['source_bytes']:,} B to convert into {e['devices']} device files "
                          f"({e['device_weight_bytes']:,} B of DRAM per device), est. {e['convert_seconds']} s; "
                          f"warm-up est. {e['warmup_seconds']} s; trace region {e['trace_region_bytes']:,} B")
            console.print(f"  package: {r.package}")
            console.print(f"  content key: {r.key}")
            console.print(f"  would rebuild: {', '.join(r.rebuilt) or 'nothing (up to date)'}")
            continue
    done = [r for r in results if r.status != "dry-run"]
    if not done:
        return
    t = Table(title="ttbundle build", title_justify="left", show_edge=False)
    for c in ("mesh", "status", "rebuilt", "reused", "files", "read", "written", "time"):
        t.add_column(c, justify="left" if c in ("mesh", "status") else "right", no_wrap=True)
    for r in done:
        t.add_row(r.mesh, r.status, str(len(r.rebuilt)), str(len(r.reused)), str(r.files),
                  _size(r.bytes_read), _size(r.bytes_written), f"{r.seconds:.1f} s")
    console.print(t)
    for r in done:
        console.print(f"{r.mesh}: {r.package} (key {r.key[:16]})")
        for w in r.warnings:
            console.print(f"  warning: {w}")
        if r.status == "built":
            console.print(f"  rebuilt: {', '.join(r.rebuilt) or 'nothing'}")
            console.print(f"  changed: {', '.join(r.changed_fields) or 'nothing'}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover
