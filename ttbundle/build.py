"""`ttbundle build`: a checkpoint and a spec -> one registrable package per mesh.

``build(bundle, mesh, out_dir)`` plans the bundle on the mesh, computes its content key
(``cache``), and unless the package at ``out_dir/<mesh>/<bundle>`` already has that key:

1. converts the weights (``convert``): the checkpoint streamed one canonical tensor at a time
   into one safetensors file per device;
2. lowers a program per (phase, bucket) (``lower``) and warms each new one on the emulated
   backend on a fixed input, recording its output as the reference later runs are compared
   with (``warmup``);
3. writes the small files (config.json, tokenizer, vllm_metadata.json, adapter, bundle.yaml,
   README.md) and manifest.json last (``artifacts``).

Everything goes to a temp directory beside the output (``out_dir/.ttbundle/tmp``, outside any
``EXTRA_MODELS_DIR``) and replaces the old package with one atomic exchange (renameat2), so a
build killed at any point leaves the previous package whole and nothing half-written where the
plugin looks; builds of one package serialize on an ``fcntl`` lock (``txn``). Artifacts whose
key did not change are hard-linked from the previous package (same inode, same mtime), so a
changed bucket rewrites one program and a no-op build writes nothing at all.

This module only decides what to redo and in which order; no content key depends on it, nor on
``txn``, ``artifacts`` or ``progress`` (``cache.PRODUCERS``). Progress goes to an optional
callback as plain dict events (the CLI draws bars with ``progress`` or prints JSON).
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from . import cache, lower as lowermod, spec as specmod, tracebudget, warmref, warmup
from .artifacts import PackageWriter
from .convert import convert
from .errors import DoesNotFit, InvalidInput, TTBundleError
from .fsutil import fault as _fault
from .package.names import PackageError, package_path, weight_file
from .package.verify import read_manifest
from .plan.make import Plan, make_plan
from .plan.memory import shortfall
from .program import program_name
from .txn import (STATE_DIR, _check_replaceable, _fsync_dir, _Lock, _recover, _swap, _tag,  # noqa: F401
                  lock_unless_read_only)
from .backends.ttnn import kernelcache
from .fsutil import read_user_text
from .speculative import draft_path, draft_spec_text

BACKENDS = ("emulated", "ttnn")  # ttnn: + per-device .tensorbin weight caches
# rough rates for `--dry-run` estimates on a CPU builder
EST_CONVERT_BYTES_PER_S = 400e6
EST_EMULATED_FLOPS = 1e10

Progress = Callable[[dict], None]


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
def _os_errors(fn):
    """``build`` with an OSError (no space left, read-only, permission, ...) turned into a
    TTBundleError naming the path and saying that the previous package was not touched (every
    write goes to a temp dir that replaces the package only once complete)."""
    @functools.wraps(fn)
    def wrapper(bundle, mesh, out_dir, **kw):
        try:
            return fn(bundle, mesh, out_dir, **kw)
        except OSError as e:
            where = e.filename or out_dir
            hint = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
                    errno.EROFS: "choose a writable -o", errno.EACCES: "choose a writable -o",
                    errno.EPERM: "choose a writable -o"}.get(e.errno, "fix it")
            raise TTBundleError(f"{where}: cannot build the package: {e.strerror or e}; {hint} and "
                                f"run the build again (any previous package in {out_dir} is unchanged)") from None
    return wrapper


def _check_output_dir(out: Path) -> None:
    """``-o`` must be a directory, or not exist yet under a directory: a file, ``/dev/null`` or a
    path with a file in the way is InvalidInput; so is a special file system (``/proc``)."""
    p = out
    while not os.path.lexists(p) and p.parent != p:
        p = p.parent
    if not p.is_dir():
        what = "the output directory" if p == out else f"a parent of the output directory {out}"
        raise InvalidInput(f"{p}: {what} is not a directory; give -o a directory path")
    if os.path.realpath(p).startswith(("/proc/", "/sys/", "/dev/")) or os.path.realpath(p) in ("/proc", "/sys", "/dev"):
        raise InvalidInput(f"{out}: not a place for packages (a kernel file system); give -o a directory "
                           "on disk")


def device_plan(bundle, mesh: str, backend: str) -> Plan:
    """The plan a package is built with. For ``backend="ttnn"`` with traced programs, its trace
    region is the traces' need as the ttnn lowering counts it (``tracebudget``: the programs of a
    first plan, lowered as the TT runtime lowers them) plus :data:`~.tracebudget.HEADROOM`, not
    the first plan's op-count estimate; the spec's ``runtime.trace_region_size``, when given, is
    kept and refused (:class:`DoesNotFit`, at its line) below the need. The KV pool ``auto``
    sizes is then what is left beside that region. The emulated backend traces nothing."""
    plan = make_plan(bundle, mesh)
    if backend != "ttnn" or not any(lowermod.traced(bundle, ph) for ph, _ in lowermod.trace_set(bundle)):
        return plan
    tn = tracebudget.trace_need(bundle, plan.mesh, lowermod.lower_all(bundle, plan))
    own = bundle.spec.runtime.trace_region_size
    if own is not None:
        if own < tn.need:
            d = bundle.locate(("runtime", "trace_region_size"), "")
            at = f"{d.file}:{d.line}: " if d.file and d.line is not None else ""
            raise DoesNotFit(f"{at}runtime.trace_region_size {own:,} B is below what {bundle.spec.name}'s traces "
                             f"need on {plan.mesh.describe()}: {tn.arithmetic()}; {tn.need - own:,} B short; fix: "
                             f"{tn.suggested:,} (the need + {tracebudget.HEADROOM:.0%} headroom) or more, or "
                             "leave it out (the build sizes it)")
        return plan
    return make_plan(bundle, mesh, trace_region_size=tn.suggested)


@_os_errors
def build(bundle, mesh: str, out_dir: str | Path, *, dry_run: bool = False, force: bool = False,
          warmup: bool = True, progress: Progress | None = None, backend: str = "emulated") -> BuildResult:
    """Build (or, with ``dry_run``, describe) the package of ``bundle`` for ``mesh``.

    ``backend="ttnn"`` also writes per-device ``.tensorbin`` weight caches (``tensorbin/``,
    ``ttbundle.backends.ttnn.cache``) so a Tenstorrent host loads weights without converting."""
    if backend not in BACKENDS:
        raise InvalidInput(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
    t0 = time.monotonic()
    emit = progress or (lambda e: None)
    plan = device_plan(bundle, mesh, backend)
    if not plan.fits:
        raise DoesNotFit(f"{bundle.spec.name} does not fit {plan.mesh.describe()}: "
                         f"{shortfall(plan.memory)} (see `ttbundle plan --mesh {mesh}`)")
    if backend == "ttnn" and bundle.family.ttnn_unlowered:
        raise InvalidInput(f"not yet: --backend ttnn for {bundle.family.name}: the ttnn backend has no lowering "
                           f"for its {bundle.family.ttnn_unlowered}; build the emulated package")
    cache.check_tokenizer(bundle)
    pkg = package_path(out_dir, bundle.spec.name, plan.mesh.name)
    sfpi = _sfpi(backend)
    res = BuildResult(str(pkg), bundle.spec.name, plan.mesh.name, "dry-run" if dry_run else "built", None)
    draft = _build_draft(bundle, mesh, out_dir, dry_run=dry_run, force=force, warmup=warmup)
    if dry_run:
        prev = _previous(pkg)
        inp = cache.compute(bundle, plan, prev, lowermod.trace_set(bundle))
        _backend_field(inp, backend, sfpi, plan)
        _draft_field(inp, draft)
        _hash_sources(inp, emit)
        _describe(bundle, plan, inp, prev, res)
        res.seconds = time.monotonic() - t0
        emit({"event": "done", **res.to_json()})
        return res

    out = Path(out_dir).absolute()
    _check_output_dir(out)
    state = out / STATE_DIR
    lock_path = state / "locks" / f"{_tag(pkg)}.lock"
    with lock_unless_read_only(lock_path, emit) as read_only:
        if read_only is None:
            _recover(state, pkg)
        _check_replaceable(pkg)
        prev = _previous(pkg)
        inp = cache.compute(bundle, plan, prev, lowermod.trace_set(bundle))
        _backend_field(inp, backend, sfpi, plan)
        _draft_field(inp, draft)
        if prev is not None and inp.pending:
            _hash_sources(inp, emit)  # decide no-op vs rebuild on content, not on mtimes
        if prev is not None and not force and not inp.pending \
                and prev.get("key") == cache.content_key(inp.fields) and _intact(pkg, prev) \
                and (not warmup or _warmed(prev)):
            _describe(bundle, plan, inp, prev, res)
            res.status, res.rebuilt, res.reused = "up-to-date", [], sorted(prev.get("artifacts", {}))
            res.seconds = time.monotonic() - t0
            emit({"event": "done", **res.to_json()})
            return res
        if read_only is not None:  # an up-to-date package needs no lock; anything else does
            raise read_only
        tmp = state / "tmp" / f"{_tag(pkg)}@{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            builder = _Builder(bundle, plan, inp, prev, pkg, tmp, res, emit, force, warmup, backend, sfpi)
            builder.draft = draft
            builder.run()
            _fault("before-swap")
            _swap(tmp, pkg, state)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    res.seconds = time.monotonic() - t0
    emit({"event": "done", **res.to_json()})
    return res


def _build_draft(bundle, mesh: str, out_dir, **kw) -> BuildResult | None:
    """``speculative: {method: draft}``: the draft bundle's own package for the same mesh, built
    (or found up to date) under the output's state directory (``STATE_DIR/drafts``, where the
    plugin's scan does not look); the target's build copies it into its ``draft/`` directory.
    Always an emulated package: speculative decoding runs on the emulated mesh only. Built
    with a verify program per decode bucket (``speculative.draft_spec_text``: the proposer's
    catch-up). Its progress is not reported (its `done` event is not the target's)."""
    path = draft_path(bundle)
    if path is None:
        return None
    draft = specmod.loads(draft_spec_text(bundle, read_user_text(path, "spec file")), str(path),
                          base_dir=path.parent)  # with its catch-up (verify) programs
    return build(draft, mesh, Path(out_dir).absolute() / STATE_DIR / "drafts", backend="emulated", **kw)


def _draft_field(inp, draft: BuildResult | None) -> None:
    """The draft package's content key is one of the target's key fields (``speculative.draft``)."""
    if draft is not None:
        inp.fields["speculative.draft"] = draft.key


def _backend_field(inp, backend: str, sfpi=None, plan=None) -> None:
    """The backend's key fields (``cache.backend_fields``; ``cache explain`` adds the same)."""
    cache.backend_fields(inp, backend, sfpi[0].key() if sfpi else None, _traced_region(plan, backend))


def _traced_region(plan, backend: str) -> int | None:
    """A ttnn build's trace region (``device_plan``): a key field of its programs."""
    return plan.trace_region_size if plan is not None and backend == "ttnn" else None


def _sfpi(backend: str):
    """ttnn builds: (SFPI found on this host, the Python with ttnn that fills the kernel cache)."""
    if backend != "ttnn":
        return None
    return kernelcache.status()


def explain(pkg: str | Path, spec_path: str | Path | None = None) -> dict:
    """Which key fields changed since ``pkg`` was built (current spec, files, code and versions
    against the manifest), which artifacts a build would redo, and why the last build ran. Here,
    not in ``cache``, because a ttnn package's key names the kernel cache's SFPI compiler, which
    only the ttnn backend finds (``backends.ttnn.kernelcache``): the content keys stay below the
    backends."""
    pkg = Path(pkg)
    m = read_manifest(pkg)
    b = m.get("build", {})
    spec_file = Path(spec_path) if spec_path else Path(b.get("spec_file", ""))
    if not spec_path and not spec_file.is_file():
        raise InvalidInput(f"{pkg}: was built from {b.get('spec_file')!r}, which is not there now; "
                           "pass --spec SPEC")
    bundle = specmod.load(spec_file)
    rec = m.get("key_fields", {})
    backend = rec.get("backend", "emulated")  # what it was built with: not a change by itself
    plan = device_plan(bundle, m["mesh"]["name"], backend)
    inp = cache.compute(bundle, plan, m, lowermod.trace_set(bundle))
    sfpi = None
    if "kernel_cache" in rec:
        sfpi = _sfpi("ttnn")[0].key()
    cache.backend_fields(inp, backend, sfpi, _traced_region(plan, backend))
    # the draft's key as a build now would compute it (a dry run of the draft's own build)
    _draft_field(inp, _build_draft(bundle, m["mesh"]["name"], pkg.absolute().parent.parent, dry_run=True))
    cache.fill_digests(inp.weight_records + inp.tokenizer_records)
    inp.finish()
    rows = [{"field": k, "what": cache.FIELDS.get(k, ""), "recorded": rec.get(k),
             "current": inp.fields.get(k), "changed": rec.get(k) != inp.fields.get(k)} for k in sorted(set(rec) | set(inp.fields))]
    now = cache.artifact_keys(inp.fields, inp.traces)
    before = m.get("artifacts", {})
    redo = [a for a, k in now.items() if before.get(a, {}).get("key") != k]
    # a --no-warmup package: a build (which warms by default) runs the warm-up (_warmed)
    unwarmed = [a for a, r in before.items() if a.startswith("warmup:") and not r.get("ran")]
    redo += [a for a in unwarmed if a not in redo]
    return {"package": str(pkg), "spec_file": str(spec_file), "key": m.get("key"),
            "current_key": cache.content_key(inp.fields),
            "up_to_date": m.get("key") == cache.content_key(inp.fields) and not unwarmed,
            "warmed": not unwarmed,
            "fields": rows, "would_rebuild": redo,
            "last_build": {"changed_fields": b.get("changed_fields", []), "rebuilt": b.get("rebuilt", []),
                           "reused": b.get("reused", []), "finished": b.get("finished")}}


def _previous(pkg: Path) -> dict | None:
    try:
        return read_manifest(pkg)
    except PackageError:
        return None


def _warmed(m: dict) -> bool:
    """Whether every program of the manifest ``m`` has its warm-up reference: a package built
    ``--no-warmup`` is not up to date for a build that asks for the warm-up (that build runs it
    and reuses the rest)."""
    return all(rec.get("ran") for art, rec in m.get("artifacts", {}).items() if art.startswith("warmup:"))


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
        # the warm-up runs the real rows of its fixed input, not the whole bucket
        flops = s["flops_per_device"] * plan.mesh.num_devices * warmref.real_rows(phase, b) / max(1, s["rows"])
        s["warmup_seconds_est"] = round(flops / EST_EMULATED_FLOPS, 3)
        total_flops += flops
        s["rebuild"] = f"program:{program_name(phase, b)}" in res.rebuilt
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



# ---- the build itself -------------------------------------------------------------------------------------
class _Builder(PackageWriter):
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
        if self.draft is not None:
            self._draft_files(self.draft)
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
        convert(self.bundle, self.plan, self.inp.weights_dir, self.tmp, self.res, self.emit, self.files)
