"""Where packages are found: registered directories and ``EXTRA_MODELS_DIR``.

* ``ttbundle register --dir DIR`` verifies every package in DIR and records DIR in the user
  registry ``$XDG_CONFIG_HOME/ttbundle/registry.json`` (default ``~/.config/ttbundle``).
* At vLLM start (the ``vllm.general_plugins`` entry point, only when the ttbundle platform is
  active) every package of every registered directory and of ``$EXTRA_MODELS_DIR`` is verified;
  each architecture is registered with vLLM as ``TT<HF arch>`` (Tenstorrent's naming). A package
  that does not verify is skipped with a warning naming the file; the rest still register.

A directory may be a package itself or hold packages as sub-directories.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidInput, TTBundleError

logger = logging.getLogger("vllm.ttbundle.registry")

#: Set in a process once its registry scan verified hashes; child processes (vLLM's engine
#: core) inherit it and skip re-hashing.
VERIFIED_ENV = "TTBUNDLE_REGISTRY_VERIFIED"


@dataclass
class Entry:
    """A package found in a directory."""

    name: str
    mesh: str
    arch: str
    path: Path
    prefill: list
    decode: list
    description: str = ""


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "ttbundle"


def registry_file() -> Path:
    return config_dir() / "registry.json"


def registered_dirs() -> list[Path]:
    f = registry_file()
    if not f.exists():
        return []
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
        return [Path(d) for d in data.get("dirs", [])]
    except (OSError, ValueError, AttributeError) as e:
        raise TTBundleError(f"{f}: unreadable registry ({e}); fix or delete it") from None


def _save_dirs(dirs: list[Path]) -> None:
    from ..fsutil import write_text_atomic
    write_text_atomic(registry_file(), json.dumps({"dirs": [str(d) for d in dirs]}, indent=2) + "\n")


def package_dirs(d: Path) -> list[Path]:
    """Package directories in ``d``: ``d`` itself, or its sub-directories, or theirs (``ttbundle
    build -o OUT`` writes ``OUT/<mesh>/<bundle>``; ``EXTRA_MODELS_DIR`` is usually
    ``OUT/<mesh>``). A folder with a ``vllm_metadata.json`` but no manifest is returned too,
    so that it is reported (it is not a ttbundle package)."""
    from .packages import MANIFEST, METADATA

    def looks(p: Path) -> bool:
        return (p / MANIFEST).is_file() or (p / METADATA).is_file()

    if looks(d):
        return [d]
    if not d.is_dir():
        return []
    out = []
    for child in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if looks(child):
            out.append(child)
        else:
            out += [g for g in sorted(child.iterdir()) if g.is_dir() and not g.name.startswith(".")
                    and looks(g)]
    return out


def entry_of(path: Path, check_hashes: bool = True) -> Entry:
    from .packages import open_package

    pkg = open_package(path, check_hashes)
    b = pkg.bundle.buckets
    return Entry(pkg.name, pkg.mesh_name, pkg.arch, pkg.path, list(b.prefill), list(b.decode),
                 pkg.bundle.spec.description)


def scan_dir(d: Path, check_hashes: bool = True) -> tuple[list[Entry], list[tuple[Path, str]]]:
    """(packages that verify, [(package dir, why refused)]) in ``d``."""
    good, bad = [], []
    for p in package_dirs(d):
        try:
            good.append(entry_of(p, check_hashes))
        except TTBundleError as e:
            why = str(e)
            bad.append((p, why[len(f"{p}: "):] if why.startswith(f"{p}: ") else why))
    return good, bad


def search_dirs() -> list[Path]:
    dirs = list(registered_dirs())
    extra = os.environ.get("EXTRA_MODELS_DIR")
    if extra:
        dirs += [Path(x) for x in extra.split(os.pathsep) if x]
    return dirs


def scan(check_hashes: bool = True) -> tuple[list[Entry], list[tuple[Path, str]]]:
    good, bad = [], []
    seen = set()
    for d in search_dirs():
        if not d.exists():
            bad.append((d, f"{d}: registered directory no longer exists"))
            continue
        g, b = scan_dir(d, check_hashes)
        for e in g:
            if e.path not in seen:
                seen.add(e.path)
                good.append(e)
        bad += b
    return good, bad


def register_dir(d: str | Path) -> tuple[list[Entry], list[tuple[Path, str]]]:
    """Verify every package in ``d`` and record ``d`` in the user registry when at least one
    verifies (refused packages are returned with the reason, naming the file)."""
    d = Path(d).resolve()
    if not d.is_dir():
        raise InvalidInput(f"{d}: not a directory")
    good, bad = scan_dir(d)
    if not good and not bad:
        raise InvalidInput(f"{d}: no packages found (a package is a directory with manifest.json; "
                           "`ttbundle build -o DIR` writes DIR/<mesh>/<bundle>)")
    if good:
        dirs = registered_dirs()
        if d not in dirs:
            _save_dirs(dirs + [d])
    return good, bad


def find(name_or_path: str) -> Entry:
    """A registered package by bundle name (``NAME`` or ``NAME-MESH``; ``MESH_DEVICE`` picks
    among meshes) or directory."""
    p = Path(name_or_path)
    if p.is_dir():
        return entry_of(p)
    good, _ = scan(check_hashes=False)
    hits = [e for e in good if e.name == name_or_path or f"{e.name}-{e.mesh}" == name_or_path]
    mesh = os.environ.get("MESH_DEVICE")
    if len(hits) > 1 and mesh:
        hits = [e for e in hits if e.mesh == mesh] or hits
    if len(hits) == 1:
        return hits[0]
    if not hits:
        known = ", ".join(sorted(f"{e.name}-{e.mesh}" for e in good)) or "none"
        raise InvalidInput(f"no registered package named {name_or_path!r} (registered: {known}); "
                           "`ttbundle register --dir DIR` adds a directory")
    raise InvalidInput(f"{name_or_path!r} names {len(hits)} packages ("
                       + ", ".join(f"{e.name}-{e.mesh}" for e in hits) + "); use NAME-MESH or set MESH_DEVICE")


# ---- vLLM side ----------------------------------------------------------------------------------
_STUBS: dict[str, type] = {}


def stub_class(arch: str):
    """The class registered with vLLM as ``TT<arch>``: it satisfies vLLM's model-class checks;
    the model itself runs on the mesh through ttbundle's worker, never through this class."""
    name = arch if arch.startswith("TT") else "TT" + arch
    if name in _STUBS:
        return _STUBS[name]
    import torch.nn as nn

    def _no(self, *a, **k):
        raise RuntimeError(f"{name} runs on a Tenstorrent mesh through ttbundle's model runner")

    cls = type(name, (nn.Module,), {
        "__init__": lambda self, *, vllm_config=None, prefix="": _no(self),
        "embed_input_ids": _no, "forward": lambda self, input_ids, positions, **kw: _no(self),
        "compute_logits": _no, "__module__": __name__,
    })
    _STUBS[name] = cls
    return cls


def register_arch(arch: str) -> str:
    """Register ``TT<arch>`` with vLLM (idempotent); returns that name."""
    from vllm import ModelRegistry

    name = arch if arch.startswith("TT") else "TT" + arch
    if name not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(name, stub_class(arch))
    return name


def register_models() -> None:
    """Register ``TT<arch>`` for every family ttbundle knows (a package served directly by path
    needs its architecture known before vLLM reads its config.json), then verify the packages of
    every search directory, warning about each one refused. Called from
    ``activation.general_plugin`` when the platform is active."""
    from .. import families

    for fam in families.all_families().values():
        for arch in fam.hf_architectures:
            register_arch(arch)
    verify = os.environ.get(VERIFIED_ENV) != "1"
    try:
        good, bad = scan(check_hashes=verify)
    except TTBundleError as e:
        logger.warning("ttbundle: %s", e)
        return
    for path, why in bad:
        logger.warning("ttbundle: skipping package %s: %s", path, why)
    for arch in sorted({e.arch for e in good}):
        register_arch(arch)
    if good:
        logger.info("ttbundle: registered %d package(s): %s", len(good),
                    ", ".join(f"{e.name}-{e.mesh}" for e in good))
    os.environ[VERIFIED_ENV] = "1"
