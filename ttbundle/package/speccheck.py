"""A package against its spec: the programs and the manifest's serving facts are what bundle.yaml
resolves to (:func:`check_spec`; :func:`load_checked` loads a package and checks it). Run where a
package is made or judged (the build's warm-up, ``check PACKAGE``, ``cache verify``), never when
one is served: the runtime trusts the verified package and reads its programs and manifest, so
nothing it imports re-resolves a spec (this module imports ``plan``; ``load`` and ``verify`` do
not import it)."""

from __future__ import annotations

from pathlib import Path

from .. import speculative
from ..layout import axes_of
from ..plan.host import host_facts
from ..plan.make import make_plan
from ..plan.sharding import resolved_plan, tensor_dtype
from ..traits import Dims
from .facts import buckets_record, serving_record
from .load import load_package, read_bundle
from .names import DRAFT_DIR, PackageError


def load_checked(pkg: str | Path, verify: bool = False):
    """:func:`load.load_package` (every file's sha256 with ``verify``), then :func:`check_spec`."""
    loaded = load_package(pkg, verify=verify)
    check_spec(loaded)
    return loaded


def _planned(loaded) -> tuple[int | None, dict]:
    """The serving facts of ``loaded`` that its plan counts, from its spec: the draft's KV blocks
    (``speculative.draft_kv_blocks`` of bundle.yaml and the draft package's bundle.yaml, method
    draft) and the emulated mesh's host facts (``plan.host.host_facts`` of the plan on the
    package's mesh, with that draft)."""
    bundle, pkg = loaded.bundle, loaded.dir
    draft = None
    if speculative.draft_path(bundle) is not None:
        try:
            draft = read_bundle(pkg / DRAFT_DIR)
        except OSError as e:
            raise PackageError(f"{pkg}: {DRAFT_DIR}/bundle.yaml: unreadable ({e}); rebuild the package") from None
    plan = make_plan(bundle, loaded.manifest["mesh"]["name"], draft_bundle=draft)
    blocks = speculative.draft_kv_blocks(bundle, draft) if draft is not None else None
    return blocks, host_facts(bundle, plan).record()


def check_spec(loaded, refs: dict | None = None) -> None:
    """bundle.yaml (the spec the package says it was built from) and the programs (what runs)
    agree: every program's mesh is the package's, and every weight's PartitionSpec and dtype and
    the KV cache's dtype and block size are what the spec resolves to (``plan.sharding.resolved_plan``,
    ``plan.sharding.tensor_dtype``; no plan is made). A disagreement names the program, the weight, both
    values and the bundle.yaml line; nothing at run time re-derives a layout, so a package whose
    programs and spec disagree would run one and describe the other. The manifest's serving facts
    and buckets (what the runtime reads, ``package.facts``) must be what the spec gives too: the
    ones its plan counts (the draft's KV blocks, the emulated mesh's host facts) from a plan of
    bundle.yaml on the package's mesh (:func:`_planned`).
    ``loaded``: a ``load.LoadedPackage`` (``refs``: its weights, default ``loaded.weight_refs``)."""
    refs = loaded.weight_refs if refs is None else refs
    pkg, bundle, mesh = loaded.dir, loaded.bundle, loaded.mesh
    first = min(loaded.programs)
    others = len(loaded.programs) - 1
    where = f"{pkg}: {loaded.programs[first]}" + (f" (and its {others} other program(s), which agree with it)"
                                                  if others else "")
    for key in sorted(loaded.programs):
        p = loaded.program_ir(*key)
        if list(p.mesh.get("shape", ())) != list(mesh.shape) or p.mesh.get("name") != mesh.name:
            raise PackageError(f"{pkg}: {loaded.programs[key]}: program for mesh {p.mesh.get('name')} "
                               f"{p.mesh.get('shape')}, the package is for {mesh.describe()}; rebuild it")

    def at(path: tuple) -> str:
        d = bundle.locate(path, "")
        return f"{d.file}:{d.line}" if d.file and d.line is not None else str(d.file or "bundle.yaml")

    def show(spec) -> str:
        return "[" + ", ".join("null" if not e else e[0] if len(e) == 1 else "[" + ", ".join(e) + "]"
                               for e in spec) + "]"

    specs, origin = resolved_plan(bundle, mesh.name)
    decls = {t.name: t for t in bundle.family.tensors(bundle.arch)}
    for n, ref in sorted(refs.items()):
        want = tuple(axes_of(e) for e in specs[n])
        if want != tuple(ref.spec):
            src = origin[n] or ("sharding", "plan")
            raise PackageError(
                f"{where}: weight {n} is split {show(ref.spec)} (PartitionSpec), bundle.yaml says "
                f"{show(want)} ({at(src)}: {'.'.join(map(str, src))}): the programs and the spec disagree, "
                "and the programs are what runs; rebuild the package from its spec")
        dt = tensor_dtype(bundle.spec, decls[n])
        if dt != ref.dtype:
            path = ("weights", "dtypes", "tensors", n)
            raise PackageError(f"{where}: weight {n} is {ref.dtype}, bundle.yaml says {dt} ({at(path)}): the "
                               "programs and the spec disagree; rebuild the package from its spec")
    want_dims = Dims.of_arch(bundle.arch, bundle.spec.runtime.max_model_len)
    for key in sorted(loaded.programs):
        got = loaded.program_ir(*key).dims
        if got != want_dims:
            bad = [f"{k} {got.get(k)} (bundle.yaml: {want_dims.get(k)})" for k in want_dims if got.get(k) != want_dims.get(k)]
            raise PackageError(f"{pkg}: {loaded.programs[key]}: the program's dims disagree with bundle.yaml: "
                               f"{', '.join(bad)}: the programs are what runs; rebuild the package from its spec")
    kv, rt = loaded.kv_cache, bundle.spec.runtime
    for what, field_, got, want in (("dtype", "kv_cache_dtype", kv.get("dtype"), rt.kv_cache_dtype),
                                    ("block size", "kv_block_size", kv.get("block_size"), rt.kv_block_size)):
        if got != want:
            raise PackageError(f"{where}: KV cache {what} {got}, bundle.yaml says {want} "
                               f"({at(('runtime', field_))}: runtime.{field_}): the programs and the spec "
                               "disagree; rebuild the package from its spec")
    if loaded.manifest.get("serving") is not None:  # the build checks its parts before the manifest exists
        want = serving_record(bundle, *_planned(loaded))
        got = loaded.manifest["serving"]
        bad = [f"{k} {got.get(k)!r} (bundle.yaml: {want.get(k)!r})" for k in sorted(set(want) | set(got))
               if got.get(k) != want.get(k)]
        want_b, got_b = buckets_record(bundle), loaded.manifest.get("buckets", {})
        bad += [f"buckets.{k} {got_b.get(k)!r} (bundle.yaml: {want_b.get(k)!r})"
                for k in sorted(set(want_b) | set(got_b)) if got_b.get(k) != want_b.get(k)]
        if bad:
            raise PackageError(f"{pkg}: manifest.json's serving facts disagree with bundle.yaml: {'; '.join(bad)}: "
                               "the manifest is what the runtime reads; rebuild the package from its spec")
