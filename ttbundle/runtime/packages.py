"""Reading packages: the one place the runtime touches the package format.

Packages are what ``ttbundle build`` writes (``ttbundle.package`` documents the layout:
``manifest.json`` with every file's size and sha256, ``bundle.yaml``, ``config.json`` with the
``TT<arch>`` architecture, tokenizer files, ``vllm_metadata.json``, the generated adapter
module, per-device weight shards, ``programs/``). This module wraps ``ttbundle.package`` into the
narrow interface the runtime needs: :func:`open_package` -> bundle, mesh, the emulated model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..errors import InvalidInput, TTBundleError
from ..kvpool import HostFacts, host_pool
from ..manifest import MANIFEST, METADATA
from ..package.load import load_package
from ..package.verify import adapter_of, verify_package as verify



@dataclass
class Package:
    """An opened package: the resolved bundle, the mesh it was built for, its metadata."""

    path: Path
    bundle: object  # spec.Bundle
    mesh_name: str
    manifest: dict
    metadata: dict  # vllm_metadata.json
    loaded: object = None  # ttbundle.package.load.LoadedPackage
    warnings: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.manifest["bundle"]

    @property
    def arch(self) -> str:
        """The HF architecture (``LlamaForCausalLM``); vLLM sees ``TT`` + this."""
        return self.metadata["arch"]

    @property
    def trace_region_size(self) -> int:
        """The trace region the package's mesh is opened with (``LoadedPackage.trace_region_size``)."""
        return self.loaded.trace_region_size

    @property
    def serving(self):
        """The serving facts the build recorded (``LoadedPackage.serving``: max_num_seqs, KV block
        size, tokens per step, sample and trace modes, verify rows per sequence, the speculative
        config, the draft's KV blocks): the runtime reads these, never bundle.yaml's."""
        return self.loaded.serving

    @property
    def buckets(self):
        """The programs' buckets (``LoadedPackage.buckets``, the manifest's record)."""
        return self.loaded.buckets

    @property
    def built_for_device(self) -> bool:
        """Built with ``--backend ttnn`` (its ``tensorbin/`` weight caches): a device can run it."""
        return self.manifest.get("key_fields", {}).get("backend") == "ttnn"

    @property
    def dims(self):
        """The model's sizes as its programs record them (``traits.Dims``: hidden, vocab, layers,
        KV heads, head width, RMSNorm eps, max_model_len; ``LoadedPackage.dims``): what the
        runtime sizes vLLM's KV spec, logits and context cap by, never bundle.yaml's arch."""
        return self.loaded.dims

    @property
    def kv_blocks(self) -> int:
        """KV blocks the package's programs were built for (its plan's pool, recorded in every
        program): what the worker asks vLLM for and a device allocates; nothing re-plans."""
        return int(self.loaded.kv_cache["num_blocks"])

    def host_plan(self, lanes: int = 1, engines: int = 1, override_blocks: int | None = None,
                  available: int | None = None):
        """The package on the emulated mesh of this host (``kvpool.host_pool``: its KV pool,
        ``auto`` sized for the host's available memory, and the expected peak), from the facts
        its build recorded (``kvpool.HostFacts.of_package``: manifest ``serving.host``, the
        programs' dims and KV pool); nothing is re-planned."""
        facts = HostFacts.of_package(self.serving, self.dims.max_model_len, self.kv_blocks)
        return host_pool(facts, available, lanes, engines, override_blocks)

    def emulated_model(self, dtype=None, device="cpu"):
        """The package on the emulated mesh: its programs on its own weight shards."""
        import torch

        from ..backends.emulated import EmulatedModel
        return EmulatedModel.from_package(self.loaded, dtype=dtype or torch.float32, device=device)


def verify_package(path: str | Path, check_hashes: bool = True) -> dict:
    """Every file the manifest lists is there with its size (and sha256) and nothing else is;
    returns the manifest, raises a TTBundleError naming the first bad file."""
    return verify(Path(path), full=check_hashes)


def _version(v) -> tuple[int, int]:
    try:
        major, minor = str(v).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def check_versions(manifest: dict, where: Path) -> None:
    """A package built by a newer ttbundle (major.minor) than this one may use what this runtime
    does not know: refuse it, naming both versions."""
    built = (manifest.get("versions") or {}).get("ttbundle")
    if built is None:
        raise TTBundleError(f"{where}: manifest.json: no versions.ttbundle; rebuild the package")
    if _version(built) > _version(__version__):
        raise TTBundleError(f"{where}: manifest.json: built by ttbundle {built}, this is ttbundle "
                            f"{__version__}; upgrade ttbundle or rebuild the package with this one")


def is_package(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def open_package(path: str | Path, check_hashes: bool = True) -> Package:
    """Verify and open a package directory (raises TTBundleError naming what is wrong)."""
    d = Path(path).absolute()
    if not d.is_dir():
        raise InvalidInput(f"{d}: not a package directory")
    loaded = load_package(d, verify=check_hashes)
    check_versions(loaded.manifest, d)
    try:
        meta = json.loads((d / METADATA).read_text(encoding="utf-8"))
        meta["arch"], meta["main_class"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TTBundleError(f"{d}: {METADATA}: unreadable ({e})") from None
    adapter_of(d, loaded.manifest, meta)  # main_class: this package's own adapter, nothing else
    return Package(d, loaded.bundle, loaded.mesh.name, loaded.manifest, meta, loaded,
                   [str(w) for w in loaded.bundle.warnings])
