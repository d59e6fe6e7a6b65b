"""Reading a package back: :func:`load_package` (the manifest verified, the resolved spec, its
programs, the weight files' headers checked against them) gives a :class:`LoadedPackage`; nothing
here re-plans. :func:`assemble` is the same from parts (``build`` warms its temp directory up
with it before the manifest exists)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .. import mesh as meshmod, spec as specmod
from ..layout import holders, local_len
from ..manifest import BucketsRecord, ServingRecord
from ..program import Program, ProgramError, program_name
from .names import WEIGHTS_FORMATS, PackageError, weight_file
from .shards import PackageWeights
from .verify import verify_package


@dataclass
class LoadedPackage:
    """A package read back: the resolved bundle, its mesh, programs, weights and manifest.

    Nothing here re-plans: the programs say what runs and where every weight lives
    (:attr:`weight_refs`), the KV cache they were built for (:attr:`kv_cache`), and the manifest
    the trace region (:attr:`trace_region_size`); a backend reads these, never ``plan``. (A
    build-time caller that wants the plan makes it: ``plan.make.make_plan(pkg.bundle, pkg.mesh)``.)"""

    dir: Path
    manifest: dict
    bundle: object
    mesh: object
    weights: PackageWeights
    programs: dict = field(default_factory=dict)  # (phase, bucket) -> relative path
    #: every file's sha256 was checked against the manifest when it was loaded (``verify=True``)
    verified: bool = False
    _ir: dict = field(default_factory=dict, repr=False)

    @property
    def kv_cache(self) -> dict:
        """The KV cache the programs were built for (dtype, ``num_blocks``, block size): one
        record, the same in every program (``lower`` writes the plan's pool into each). The
        runtime allocates and hands vLLM this, not a re-planned number."""
        if "_kv" not in self._ir:
            recs = {}
            for phase, bucket in self.programs:
                kv = self.program_ir(phase, bucket).kv_cache
                recs.setdefault(json.dumps(kv, sort_keys=True), []).append(f"{phase}/{bucket}")
            if len(recs) != 1:
                raise PackageError(f"{self.dir}: its programs disagree on the KV cache: "
                                   + "; ".join(f"{', '.join(v)}: {k}" for k, v in recs.items()))
            self._ir["_kv"] = json.loads(next(iter(recs)))
        return dict(self._ir["_kv"])

    @property
    def dims(self):
        """The model's sizes (``traits.Dims``: hidden, vocab, layers, KV heads, head width, RMSNorm
        eps, max_model_len), as the programs record them: one record, the same in every program
        (checked against bundle.yaml by ``speccheck.check_spec``: build, check, cache verify). The runtime and both backends size things by
        this, never by bundle.yaml's arch or ``runtime.max_model_len``."""
        return self.program_ir(*min(self.programs)).dims

    def program(self, phase: str, bucket: int) -> dict:
        """The JSON form of the (phase, bucket) program (both backends run ``program_ir``)."""
        return self.program_ir(phase, bucket).to_json()

    def program_ir(self, phase: str, bucket: int):
        """The (phase, bucket) program as the typed IR (``program.Program``)."""
        key = (phase, bucket)
        if key not in self._ir:
            try:
                rel = self.programs[key]
            except KeyError:
                raise PackageError(f"{self.dir}: no program for {phase} bucket {bucket}; has "
                                   f"{sorted(self.programs)}") from None
            try:
                data = json.loads((self.dir / rel).read_text(encoding="utf-8"))
                prog = Program.from_json(data, f"{self.dir}/{rel}")
                prog.verify()  # every step's inputs as the steps before it leave them
                self._ir[key] = prog
            except (OSError, ValueError, ProgramError) as e:
                raise PackageError(f"{self.dir}: {rel}: {e}") from None
        return self._ir[key]

    @property
    def weight_refs(self) -> dict:
        """``{name: program.WeightRef}``: every weight the programs read, with its PartitionSpec,
        per-device shape, dtype and layers (one record: every program of a package agrees on it,
        and the weight files' headers agree with it; checked at load)."""
        return dict(self.weights.refs)

    @property
    def serving(self):
        """The serving facts the build recorded (manifest ``serving``, a ``manifest.ServingRecord``:
        max_num_seqs, the KV block size, tokens per step, sample and trace modes, the verify rows
        per sequence, the speculative config, the draft's KV blocks): what the runtime and the
        backends read, never bundle.yaml. A package built before they were recorded is refused
        with a rebuild hint (nothing falls back on the spec)."""
        if "_serving" not in self._ir:
            self._ir["_serving"] = serving_of(self.dir, self.manifest)
        return self._ir["_serving"]

    @property
    def buckets(self):
        """The programs' buckets as the manifest records them (``manifest.BucketsRecord``:
        ``prefill``, ``decode``, ``prefill_chunk``, ``vision``, ``verify``)."""
        if "_buckets" not in self._ir:
            self._ir["_buckets"] = BucketsRecord.model_validate(self.manifest["buckets"])
        return self._ir["_buckets"]

    @property
    def trace_region_size(self) -> int:
        """Bytes to open the mesh's trace region with (``open_mesh_device(trace_region_size=)``):
        the size the build planned (manifest ``trace_region_size``). A manifest written before it
        was recorded gives ``trace_region_bytes``, the DRAM that size costs (a little more)."""
        m = self.manifest
        return int(m.get("trace_region_size", m.get("trace_region_bytes")) or 0)


def serving_of(pkg, manifest: dict):
    """The manifest's ``serving`` record, typed; a package built before it was recorded is refused:
    rebuild it (``ttbundle build`` reuses every artifact whose key is unchanged)."""
    rec = manifest.get("serving")
    if rec is None:
        raise PackageError(f"{pkg}: manifest.json has no serving record (built by an older ttbundle, which "
                           "left the runtime to re-read bundle.yaml); rebuild the package with `ttbundle build`")
    if rec.get("host") is None:
        raise PackageError(f"{pkg}: manifest.json's serving record has no host facts (serving.host: what the "
                           "emulated mesh holds on a host, recorded since the vLLM plugin stopped re-planning "
                           "the package); rebuild the package with `ttbundle build`")
    return ServingRecord.model_validate(rec)


def read_bundle(pkg: str | Path):
    """The resolved spec a package directory holds (``bundle.yaml``), loaded."""
    pkg = Path(pkg)
    text = (pkg / "bundle.yaml").read_text(encoding="utf-8")
    return specmod.loads(text, str(pkg / "bundle.yaml"), base_dir=pkg)


def load_package(pkg: str | Path, verify: bool = False) -> LoadedPackage:
    """Read a package: manifest (and every file's sha256 when ``verify``), the resolved spec, its
    programs (the weights each reads, checked against the weight files' headers). Nothing is
    re-derived from the spec: the check of the programs and the manifest's serving facts against
    bundle.yaml is ``speccheck.check_spec`` (the build, ``check PACKAGE``, ``cache verify``)."""
    pkg = Path(pkg)
    m = verify_package(pkg, full=verify)
    serving_of(pkg, m)  # an older package is refused here, before anything reads it
    bundle = read_bundle(pkg)
    # one replica's submesh when split (``plan.sharding.target_mesh``'s rule, without the planner)
    mesh = meshmod.replica_mesh(meshmod.resolve(m["mesh"]["name"]), bundle.spec.replicas)
    if list(mesh.shape) != list(m["mesh"].get("shape", mesh.shape)) or \
            mesh.replicas != (m.get("replicas") or {}).get("count", 1):
        raise PackageError(f"{pkg}: manifest says mesh {m['mesh'].get('shape')} x "
                           f"{(m.get('replicas') or {}).get('count', 1)} replicas, bundle.yaml "
                           f"{mesh.describe()}: the package is inconsistent; rebuild it")
    programs = {}
    for phase, buckets in (("prefill", m["buckets"]["prefill"]), ("decode", m["buckets"]["decode"]),
                           ("verify", m["buckets"].get("verify") or []), ("vision", m["buckets"].get("vision", []))):
        for b in buckets:
            rel = f"programs/{program_name(phase, b)}.json"
            if rel not in m["files"]:
                raise PackageError(f"{pkg}: {rel}: missing from the manifest")
            programs[(phase, b)] = rel
    loaded = assemble(pkg, m, bundle, mesh, programs)
    loaded.verified = verify
    return loaded


def assemble(pkg: Path, manifest: dict, bundle, mesh, programs: dict) -> LoadedPackage:
    """A package's parts read back (``programs``: (phase, bucket) -> relative path), the weight
    headers checked against the programs; ``build`` warms its temp directory up with it before
    the manifest exists (and checks it against the spec, ``speccheck.check_spec``)."""
    loaded = LoadedPackage(Path(pkg), manifest, bundle, mesh, None, dict(programs))
    if not programs:
        raise PackageError(f"{pkg}: no programs")
    refs = _weight_refs(loaded)
    _check_arch(Path(pkg), bundle, mesh, refs)
    loaded.weights = PackageWeights(Path(pkg), bundle, mesh, refs)
    _check_headers(loaded.weights)
    return loaded


def _check_arch(pkg: Path, bundle, mesh, refs: dict) -> None:
    """bundle.yaml's model declares exactly the weights the programs read, each of the
    per-device shape ``layout`` gives its dims under the programs' PartitionSpec."""
    decls = {t.name: t for t in bundle.family.tensors(bundle.arch)}
    if set(decls) != set(refs):
        raise PackageError(f"{pkg}: bundle.yaml declares tensors {sorted(set(decls) ^ set(refs))} the "
                           f"programs do not read (or the reverse)")
    for n, t in decls.items():
        want = [local_len(d, e, mesh, bundle.spec.sharding) for d, e in zip(t.dims, refs[n].spec)]
        if want != list(refs[n].device_shape):
            raise PackageError(f"{pkg}: bundle.yaml's model gives {n} {want} per device, the programs "
                               f"{list(refs[n].device_shape)}: the package is inconsistent; rebuild it")


def _weight_refs(loaded: LoadedPackage) -> dict:
    """The weights the programs read; every program of a package must agree on them."""
    refs = None
    for key in sorted(loaded.programs):
        p = loaded.program_ir(*key)
        if refs is None:
            refs, first = p.weights, p.name
        elif p.weights != refs:
            bad = sorted(n for n in set(refs) | set(p.weights) if refs.get(n) != p.weights.get(n))
            raise PackageError(f"{loaded.dir}: programs {first} and {p.name} disagree on weights {bad}")
    return refs


def _check_headers(w: PackageWeights) -> None:
    """Each device file's header agrees with the programs (names, per-device shapes, encodings),
    and says where each shard is stored: a ``stored_in`` entry names, per device, a device
    holding the same units (``layout.holders``) whose own entry names itself, and a file holds
    exactly the tensors stored in it. Format 1 files (no ``stored_in``) hold every shard."""
    pkg, refs, mesh = w.pkg, w.refs, w.mesh
    D = mesh.num_devices
    want = {n: (list(r.device_shape), r.dtype) for n, r in refs.items()}
    owners = {n: holders(u, D) for n, u in w.units.items()}
    tables = []
    for d in range(D):
        rel = weight_file(d)
        p = pkg / rel
        try:
            with open(p, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
            meta = json.loads(header["__metadata__"]["ttbundle"])
            tensors = meta["tensors"]
        except (OSError, ValueError, KeyError, struct.error) as e:
            raise PackageError(f"{pkg}: {rel}: unreadable weights header: {e}") from None
        if meta.get("format") not in WEIGHTS_FORMATS:
            raise PackageError(f"{pkg}: {rel}: weights format {meta.get('format')!r}, this ttbundle reads "
                               f"{', '.join(WEIGHTS_FORMATS)}; rebuild the package")
        if meta.get("device") != d:
            raise PackageError(f"{pkg}: {rel}: header says device {meta.get('device')}, expected {d}")
        stored = set(header) - {"__metadata__"}
        for key, info in tensors.items():
            name = info.get("tensor")
            shape, dtype = want.get(name, (None, None))
            if shape is None or info.get("shape") != shape or info.get("encoding") != dtype:
                raise PackageError(f"{pkg}: {rel}: {key} is {info.get('encoding')}{info.get('shape')}, "
                                   f"the programs say {dtype}{shape}")
            src = info.get("stored_in")
            if src is not None and meta["format"] == WEIGHTS_FORMATS[0]:
                raise PackageError(f"{pkg}: {rel}: {key}: stored_in in a {WEIGHTS_FORMATS[0]} header")
            if src is not None and (not isinstance(src, list) or len(src) != D or any(
                    not isinstance(e, int) or not 0 <= e < D or owners[name][e] != owners[name][i]
                    or src[e] != e for i, e in enumerate(src))):
                raise PackageError(f"{pkg}: {rel}: {key}: stored_in {src} does not name, for every device, "
                                   f"a device holding the same shard that stores it itself")
            here = src is None or src[d] == d
            if here != (key in stored):
                raise PackageError(f"{pkg}: {rel}: {key} is " + (
                    "missing (the header says this file stores it)" if here else
                    f"in the file, but the header says device {src[d]}'s file stores it"))
        if stored - set(tensors):
            raise PackageError(f"{pkg}: {rel}: holds tensors its header does not describe: "
                               f"{sorted(stored - set(tensors))[:5]}")
        tables.append(tensors)
    w.stored_in = {k: v.get("stored_in") or list(range(D)) for k, v in tables[0].items()}
    for d in range(1, D):  # one table: where every device's shard is stored
        if {k: v.get("stored_in") for k, v in tables[d].items()} != \
                {k: v.get("stored_in") for k, v in tables[0].items()}:
            raise PackageError(f"{pkg}: {weight_file(d)}: its header and {weight_file(0)}'s disagree on "
                               "which tensors the files hold or where they are stored")
