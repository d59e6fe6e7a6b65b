"""Reading packages: the one place the runtime learns what a package directory holds.

A package is a directory ``<name>-<mesh>/`` with:

* ``manifest.json``: ``{"format": 1, "bundle": NAME, "mesh": MESH, "buckets": {...},
  "versions": {"ttbundle": ...}, "files": {RELPATH: SHA256, ...}}``
* ``bundle.yaml``: the resolved spec (weights and tokenizer paths relative to the package)
* ``config.json`` (HF, ``architectures`` as in HF) and the tokenizer files
* ``vllm_metadata.json``: ``{"arch": "<HF arch>", "main_class": "<module>:<Class>"}``
  (the layout Tenstorrent's plugin reads from ``EXTRA_MODELS_DIR``)
* the weights (HF-named ``*.safetensors``)

``ttbundle build`` (ttbundle/package.py) writes packages; until its reader lands, this module
reads the layout above. Swap :func:`open_package` / :func:`verify_package` for the real reader
and nothing else in the runtime changes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidInput

MANIFEST = "manifest.json"
METADATA = "vllm_metadata.json"
SPEC = "bundle.yaml"
#: Package formats this runtime reads.
FORMATS = (1,)


@dataclass
class Package:
    """An opened package: the resolved bundle, the mesh it was built for, its metadata."""

    path: Path
    bundle: object  # spec.Bundle
    mesh_name: str
    manifest: dict
    metadata: dict
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.bundle.spec.name

    @property
    def arch(self) -> str:
        return self.metadata["arch"]

    def canonical_weights(self) -> dict:
        """Canonical tensors (``weights.canonical``) of the package's checkpoint."""
        from .. import weights
        src = self.bundle.spec.weights.source
        d = self.bundle.resolve_path(src) if src else self.path
        return weights.load_canonical(self.bundle.family, self.bundle.arch, d)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidInput(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: expected a JSON object")
    return data


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest_files(manifest: dict, where: Path) -> dict[str, str]:
    files = manifest.get("files")
    if isinstance(files, list):  # [{"path": ..., "sha256": ...}]
        try:
            files = {f["path"]: f["sha256"] for f in files}
        except (TypeError, KeyError):
            raise InvalidInput(f"{where}: `files` entries need `path` and `sha256`") from None
    if not isinstance(files, dict) or not files:
        raise InvalidInput(f"{where}: no `files` with their sha256")
    return files


def verify_package(path: str | Path, check_hashes: bool = True) -> dict:
    """Check a package's manifest: format version, every listed file present with its sha256.
    Returns the manifest; raises InvalidInput naming the first file that does not verify."""
    d = Path(path)
    if not d.is_dir():
        raise InvalidInput(f"{d}: not a package directory")
    mpath = d / MANIFEST
    manifest = _read_json(mpath)
    fmt = manifest.get("format")
    if fmt not in FORMATS:
        raise InvalidInput(f"{mpath}: package format {fmt!r} is not one this ttbundle reads "
                           f"({', '.join(map(str, FORMATS))}); rebuild it with `ttbundle build`")
    files = _manifest_files(manifest, mpath)
    for rel in (SPEC, METADATA, "config.json"):
        if rel not in files:
            raise InvalidInput(f"{mpath}: does not list {rel}")
    for rel, digest in sorted(files.items()):
        f = d / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise InvalidInput(f"{mpath}: file path {rel!r} leaves the package")
        if not f.is_file():
            raise InvalidInput(f"{f}: listed in {MANIFEST} but missing")
        if check_hashes and sha256_file(f) != digest:
            raise InvalidInput(f"{f}: sha256 does not match {MANIFEST} (modified or corrupt)")
    meta = _read_json(d / METADATA)
    for k in ("arch", "main_class"):
        if not isinstance(meta.get(k), str) or not meta[k]:
            raise InvalidInput(f"{d / METADATA}: `{k}` is missing")
    if ":" not in meta["main_class"]:
        raise InvalidInput(f"{d / METADATA}: main_class must be `module:Class`, got {meta['main_class']!r}")
    return manifest


def is_package(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def open_package(path: str | Path, check_hashes: bool = True) -> Package:
    """Verify and open a package directory."""
    from .. import mesh as meshmod, spec as specmod

    d = Path(path).resolve()
    manifest = verify_package(d, check_hashes)
    meta = _read_json(d / METADATA)
    bundle = specmod.load(d / SPEC)
    mesh_name = manifest.get("mesh")
    if not isinstance(mesh_name, str) or meshmod.try_resolve(mesh_name) is None:
        raise InvalidInput(f"{d / MANIFEST}: `mesh` {mesh_name!r} is not a known mesh")
    return Package(d, bundle, mesh_name, manifest, meta,
                   [str(w) for w in bundle.warnings])


def write_manifest(d: str | Path, bundle_name: str, mesh_name: str, buckets: dict,
                   extra: dict | None = None) -> dict:
    """Hash every file under ``d`` into ``manifest.json`` (used by the demo/test packages until
    ``ttbundle build`` writes real ones)."""
    from .. import __version__
    from ..fsutil import write_text_atomic

    d = Path(d)
    files = {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    manifest = {"format": 1, "bundle": bundle_name, "mesh": mesh_name, "buckets": buckets,
                "versions": {"ttbundle": __version__}, "files": files, **(extra or {})}
    write_text_atomic(d / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest
