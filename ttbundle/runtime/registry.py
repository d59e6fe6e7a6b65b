"""Where packages are found: registered directories and ``EXTRA_MODELS_DIR``.

* ``ttbundle register --dir DIR`` verifies every package in DIR and records DIR, and the digest
  of each package's manifest (:func:`manifest_digest`), in the user registry
  ``$XDG_CONFIG_HOME/ttbundle/registry.json`` (default ``~/.config/ttbundle``), under a lock
  (:func:`lock_file`). A package of a registered directory whose manifest is not the one recorded
  (rebuilt, or changed and re-hashed; or never registered) is refused (:func:`unregistered`);
  ``EXTRA_MODELS_DIR`` and a package given by path are trusted as they are.
* At vLLM start (the ``vllm.general_plugins`` entry point, only when the ttbundle platform is
  active) every package of every registered directory and of ``$EXTRA_MODELS_DIR`` is verified;
  each architecture is registered with vLLM as ``TT<HF arch>`` (Tenstorrent's naming). A package
  that does not verify is skipped with a warning naming the file; the rest still register.

A directory may be a package itself or hold packages as sub-directories.

Verification results are cached in ``$XDG_CONFIG_HOME/ttbundle/verified.json``, keyed by the
package path and a fingerprint: the manifest's sha256 and the type, size, mtime, ctime and inode
of the package directory and of every entry under it (so any write, rename, added file or
replaced file re-checks the package; ctime cannot be set back by a user). A cached result is used
only when the fingerprint and the ttbundle version match; otherwise the package is verified in
full (every file's sha256) and the result recorded.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import os
import sys
import types
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from .. import __version__, families
from ..errors import Diagnostic, InvalidInput, TTBundleError
from ..families import vision_class_of
from ..fsutil import locked, strict_json, write_text_atomic
from ..mesh import same_mesh
from ..package.load import read_bundle
from . import packages
from .packages import MANIFEST, METADATA

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
    hf_model: str = ""  # the spec's hf_model: the HF id the package also answers to
    manifest_digest: str = ""  # manifest_digest() of the manifest it was verified with


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest's content (canonical JSON: sorted keys, no spaces): what ``register``
    records per package. Any change of what the manifest says (a file's sha256 or size, a file
    added, the build's key) changes it; rewriting the same content with other whitespace does not."""
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "ttbundle"


def registry_file() -> Path:
    return config_dir() / "registry.json"


def _read_registry() -> tuple[list[Path], dict[str, str]]:
    """(directories, {package path: manifest digest}) of the user registry, parsed strictly."""
    f = registry_file()
    if not f.exists():
        return [], {}
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{f}: unreadable registry ({getattr(e, 'strerror', None) or e}); fix or delete it") from None
    return parse_registry_doc(text, f)


def registered_dirs() -> list[Path]:
    """The directories in the user registry, parsed strictly (:func:`parse_registry`)."""
    return _read_registry()[0]


def parse_registry(text: str, where) -> list[Path]:
    """The directories of a registry file's ``text`` (:func:`parse_registry_doc`)."""
    return parse_registry_doc(text, where)[0]


def parse_registry_doc(text: str, where) -> tuple[list[Path], dict[str, str]]:
    """``{"dirs": [absolute path, ...], "manifests": {absolute package path: sha256 hex}}`` and
    nothing else (``manifests`` may be absent: a registry written before digests were recorded,
    whose packages are then all unregistered): a duplicate key, an unknown key, a value of another
    type is InvalidInput naming the file and the field (never a traceback, never a string read one
    character at a time)."""
    class Registry(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        dirs: list[str] = []
        manifests: dict[str, str] = {}

    data = strict_json(text, f"{where}")
    try:
        reg = Registry.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise InvalidInput(f"{where}: registry field {field}: {err['msg']} (expected {{\"dirs\": "
                           f"[\"/abs/dir\", ...], \"manifests\": {{\"/abs/package\": \"<sha256>\"}}}}); "
                           "fix it, or delete it and `ttbundle register` again") from None
    for field, paths in (("dirs", reg.dirs), ("manifests", list(reg.manifests))):
        bad = next((d for d in paths if not d or "\0" in d or not os.path.isabs(d)), None)
        if bad is not None:
            raise InvalidInput(f"{where}: registry field {field}: {bad!r} is not an absolute path; fix it, "
                               "or delete the file and `ttbundle register` again")
    bad = next((k for k, v in reg.manifests.items()
                if len(v) != 64 or any(c not in "0123456789abcdef" for c in v)), None)
    if bad is not None:
        raise InvalidInput(f"{where}: registry field manifests.{bad}: {reg.manifests[bad]!r} is not a "
                           "sha256 (64 hex digits); fix it, or delete the file and `ttbundle register` again")
    return [Path(d) for d in reg.dirs], dict(reg.manifests)


def lock_file() -> Path:
    """The lock every read-modify-write of ``registry.json`` and ``verified.json`` holds
    (``fsutil.locked``): parallel ``register`` processes each add their directory, none lost."""
    return config_dir() / "registry.lock"


def _save(dirs: list[Path], manifests: dict[str, str]) -> None:
    write_text_atomic(registry_file(), json.dumps({"dirs": [str(d) for d in dirs],
                                                   "manifests": dict(sorted(manifests.items()))},
                                                  indent=2) + "\n")


def _add_dir(d: Path, good: list[Entry], bad: list[Path]) -> None:
    """Record ``d`` and the manifest digest of each package in ``good``; forget the digest of each
    package in ``bad`` (refused now) and of every recorded package under ``d`` that is gone. Read,
    changed and rewritten (atomically) under the registry lock, so that registers running at once
    each see the others' directories."""
    with locked(lock_file()):
        dirs, manifests = _read_registry()
        for p in bad:
            manifests.pop(str(p), None)
        for p in [p for p in manifests if Path(p).is_relative_to(d) and not os.path.isdir(p)]:
            del manifests[p]
        manifests.update({str(e.path): e.manifest_digest for e in good})
        _save(dirs if d in dirs else dirs + [d], manifests)


def package_dirs(d: Path) -> list[Path]:
    """Package directories in ``d``: ``d`` itself, or its sub-directories, or theirs (``ttbundle
    build -o OUT`` writes ``OUT/<mesh>/<bundle>``; ``EXTRA_MODELS_DIR`` is usually
    ``OUT/<mesh>``). A folder with a ``vllm_metadata.json`` but no manifest is returned too,
    so that it is reported (it is not a ttbundle package)."""
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
    pkg = packages.open_package(path, check_hashes)
    b = pkg.buckets
    return Entry(pkg.name, pkg.mesh_name, pkg.arch, pkg.path, list(b.prefill), list(b.decode),
                 pkg.bundle.spec.description, pkg.bundle.spec.hf_model or "",
                 manifest_digest(pkg.manifest))


# ---- verification cache -------------------------------------------------------------------------
CACHE_FORMAT = "ttbundle.verified/3"  # /2: entries carry hf_model; /3: manifest_digest


def cache_file() -> Path:
    return config_dir() / "verified.json"


def fingerprint(pkg: Path) -> str | None:
    """sha256 over the manifest's bytes and ``(name, mode, size, mtime, ctime, inode)`` of the
    package directory and every entry under it; None when something cannot be read."""
    h = hashlib.sha256()
    try:
        with open(pkg / MANIFEST, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
        todo = [(pkg, "")]
        while todo:
            d, rel = todo.pop()
            st = os.lstat(d)
            h.update(f"{rel}/\0{st.st_mode}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n".encode())
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
            for e in entries:
                st = e.stat(follow_symlinks=False)
                h.update(f"{rel}/{e.name}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0"
                         f"{st.st_ctime_ns}\0{st.st_ino}\n".encode())
                if e.is_dir(follow_symlinks=False):
                    todo.append((Path(e.path), f"{rel}/{e.name}"))
    except OSError:
        return None
    return h.hexdigest()


class VerifyCache:
    """``path -> {fingerprint, entry | refused}`` for this ttbundle version (see module doc)."""

    def __init__(self):
        self.version = __version__
        self.data: dict = {}
        self.changed: dict = {}  # what this process recorded: save() merges it into the file
        self.dirty = False
        try:
            doc = json.loads(cache_file().read_text(encoding="utf-8"))
            if doc.get("format") == CACHE_FORMAT and doc.get("ttbundle") == self.version \
                    and isinstance(doc.get("packages"), dict):
                self.data = doc["packages"]
        except (OSError, ValueError, AttributeError):
            pass  # no cache, or an unreadable one: verify everything and write a new one

    def lookup(self, p: Path, fp: str | None):
        rec = self.data.get(str(p))
        if fp is None or not isinstance(rec, dict) or rec.get("fingerprint") != fp:
            return None
        if isinstance(rec.get("refused"), str):
            return rec["refused"]
        e = rec.get("entry")
        try:
            return Entry(**{**e, "path": Path(e["path"])})
        except (TypeError, KeyError):
            return None

    def record(self, p: Path, fp: str | None, result) -> None:
        if fp is None:
            return
        if isinstance(result, Entry):
            rec = {"fingerprint": fp, "entry": {**asdict(result), "path": str(result.path)}}
        else:
            rec = {"fingerprint": fp, "refused": result}
        if self.data.get(str(p)) != rec:
            self.data[str(p)] = rec
            self.changed[str(p)] = rec
            self.dirty = True

    def save(self) -> None:
        """Write this process's changed records over what is in the file now (read again under
        the registry lock: another process may have recorded other packages meanwhile)."""
        if not self.dirty:
            return
        try:
            with locked(lock_file()):
                on_disk = VerifyCache().data
                on_disk.update(self.changed)
                self.data = on_disk
                write_text_atomic(cache_file(), json.dumps({"format": CACHE_FORMAT, "ttbundle": self.version,
                                                            "packages": self.data}, separators=(",", ":")))
        except TTBundleError as e:  # a read-only config dir: slower next time, nothing worse
            logger.warning("ttbundle: verification cache not saved: %s", e)
        self.dirty = False
        self.changed = {}


def scan_dir(d: Path, check_hashes: bool = True, cache: VerifyCache | None = None
             ) -> tuple[list[Entry], list[tuple[Path, str]]]:
    """(packages that verify, [(package dir, why refused)]) in ``d``. With ``cache``, a package
    whose fingerprint is unchanged since it was verified in full is not verified again; any
    other is verified in full (hashes included) and recorded."""
    good, bad = [], []
    for p in package_dirs(d):
        fp = fingerprint(p) if cache is not None else None
        hit = cache.lookup(p, fp) if cache is not None else None
        if hit is None:
            try:
                hit = entry_of(p, check_hashes or cache is not None)
            except TTBundleError as e:
                why = str(e)
                hit = why[len(f"{p}: "):] if why.startswith(f"{p}: ") else why
            if cache is not None:
                cache.record(p, fp, hit)
        if isinstance(hit, Entry):
            good.append(hit)
        else:
            bad.append((p, hit))
    return good, bad


def _search(strict: bool = True) -> list[tuple[Path, dict[str, str] | None]]:
    """(directory, the registry's manifest digests) for each registered directory, then
    (directory, None) for each of ``EXTRA_MODELS_DIR`` (trusted as it is, like a package path).
    ``strict=False`` (the vLLM plugin): a broken registry file is a warning and only
    ``EXTRA_MODELS_DIR`` is searched, so a corrupt registry does not stop ``serve PACKAGE_DIR``."""
    try:
        dirs, manifests = _read_registry()
    except InvalidInput as e:
        if strict:
            raise
        logger.warning("ttbundle: ignoring the registry: %s", e)
        dirs, manifests = [], {}
    out = [(d, manifests) for d in dirs]
    extra = os.environ.get("EXTRA_MODELS_DIR")
    if extra:
        out += [(Path(x), None) for x in extra.split(os.pathsep) if x]
    return out


def search_dirs(strict: bool = True) -> list[Path]:
    """The registry's directories, then ``EXTRA_MODELS_DIR``'s (:func:`_search`)."""
    return [d for d, _ in _search(strict)]


def unregistered(e: Entry, d: Path, manifests: dict[str, str]) -> str | None:
    """Why package ``e`` of registered directory ``d`` is not served by name: its manifest is not
    the one ``register`` recorded (rebuilt, or changed and re-hashed), or none was recorded (it
    appeared after ``register``, or the registry predates digests); None when it is."""
    again = f"`ttbundle register --dir {d}`"
    rec = manifests.get(str(e.path))
    if rec is None:
        return (f"not registered (it appeared in {d} after it was registered, or was registered by an "
                f"older ttbundle); register it: {again}")
    if rec != e.manifest_digest:
        return (f"manifest.json changed since it was registered (a rebuild, or files changed and "
                f"re-hashed); re-register after a rebuild: {again}")
    return None


def scan(check_hashes: bool = True, cached: bool = True, strict: bool = True
         ) -> tuple[list[Entry], list[tuple[Path, str]]]:
    """Every package of every search directory (:func:`search_dirs`). ``cached``: through the
    verification cache (a changed package is verified in full); else verified now, with hashes
    when ``check_hashes``."""
    good, bad = [], []
    seen = set()
    cache = VerifyCache() if cached else None
    for d, manifests in _search(strict):
        if not d.exists():
            bad.append((d, f"{d}: registered directory no longer exists"))
            continue
        g, b = scan_dir(d, check_hashes, cache)
        for e in g:
            if e.path not in seen:
                seen.add(e.path)
                why = unregistered(e, d, manifests) if manifests is not None else None
                if why is None:
                    good.append(e)
                else:
                    bad.append((e.path, why))
        bad += b
    if cache is not None:
        cache.save()
    return good, bad


def register_dir(d: str | Path) -> tuple[list[Entry], list[tuple[Path, str]]]:
    """Verify every package in ``d`` and record ``d`` in the user registry when at least one
    verifies (refused packages are returned with the reason, naming the file)."""
    d = Path(d).resolve()
    if not d.is_dir():
        raise InvalidInput(f"{d}: not a directory")
    cache = VerifyCache()
    good, bad = scan_dir(d, cache=cache)
    cache.save()
    if not good and not bad:
        raise InvalidInput(f"{d}: no packages found (a package is a directory with manifest.json; "
                           "`ttbundle build -o DIR` writes DIR/<mesh>/<bundle>)")
    if good:
        _add_dir(d, good, [p for p, _ in bad])
    return good, bad


def find(name_or_path: str, mesh: str | None = None) -> Entry:
    """A registered package by bundle name (``NAME`` or ``NAME-MESH``), by the HF model id its
    spec names (``hf_model``), or directory. Several
    packages of one name are told apart by ``mesh`` (else ``MESH_DEVICE``, which only narrows);
    when that still leaves several (one name and mesh in two directories), the error lists each
    with its path, which names it."""
    p = Path(name_or_path)
    if os.path.isdir(p):  # False on any OSError (a name too long to be a path)
        return entry_of(p)
    good, refused = scan(check_hashes=False)
    hits = [e for e in good if name_or_path in (e.name, f"{e.name}-{e.mesh}")
            or (e.hf_model and e.hf_model == name_or_path)]
    if mesh is not None:
        picked = [e for e in hits if same_mesh(mesh, e.mesh)]
        if hits and not picked:
            _raise_refused(name_or_path, mesh, refused)
            raise InvalidInput(f"{name_or_path!r} has no package for mesh {mesh}; it has: "
                               + ", ".join(sorted({e.mesh for e in hits})))
        hits = picked
    elif len(hits) > 1 and os.environ.get("MESH_DEVICE"):
        hits = [e for e in hits if same_mesh(os.environ["MESH_DEVICE"], e.mesh)] or hits
    if len(hits) == 1:
        return hits[0]
    if not hits:
        _raise_refused(name_or_path, mesh, refused)
        known = ", ".join(sorted(f"{e.name}-{e.mesh}" + (f" ({e.hf_model})" if e.hf_model else "")
                                 for e in good)) or "none"
        where = ", ".join(str(d) for d in search_dirs()) or "no registered directory, no EXTRA_MODELS_DIR"
        raise InvalidInput(f"no registered package named {name_or_path!r} (registered: {known}; searched: "
                           f"{where}); `ttbundle register --dir DIR` or EXTRA_MODELS_DIR adds a directory")
    meshes = {e.mesh for e in hits}
    how = ("give the package's path" if len(meshes) == 1
           else "use NAME-MESH, --mesh M or MESH_DEVICE, or give the package's path")
    raise InvalidInput(f"{name_or_path!r} names {len(hits)} packages; {how}:",
                       [Diagnostic(str(e.path), f"{e.name}-{e.mesh}") for e in
                        sorted(hits, key=lambda e: (e.mesh, str(e.path)))])


def _raise_refused(name: str, mesh: str | None, refused: list[tuple[Path, str]]) -> None:
    """When the package ``name`` (and ``mesh``) asks for is there but refused, say why (the file
    that does not verify, the manifest changed since ``register``), not "no package"."""
    named = [(p, why, n) for p, why in refused if (n := _claimed_name(p)) is not None
             and name in (n[0], f"{n[0]}-{n[1]}") and (mesh is None or same_mesh(mesh, n[1]))]
    if named:
        p, why, (n, m) = named[0]
        more = f" (and {len(named) - 1} more of that name, refused too; `ttbundle ls` lists them)" \
            if len(named) > 1 else ""
        raise TTBundleError(f"registered package {n}-{m} ({p}) is refused: {why}{more}")


def _claimed_name(p: Path) -> tuple[str, str] | None:
    """(bundle, mesh) a refused package's manifest claims, read leniently (the package failed
    verification: this only names it in an error), or None."""
    try:
        with open(p / MANIFEST, "rb") as f:
            m = json.loads(f.read(64 << 20))
        return str(m["bundle"]), str(m["mesh"]["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---- vLLM side ----------------------------------------------------------------------------------
def resolve_model(name: str) -> str:
    """vLLM's model argument as a package path: an existing path as it is, else the registered
    package of that name / HF id (``find``; ``MESH_DEVICE`` picks among meshes). Raises
    ValueError (vLLM's config error) listing what is registered."""
    if os.path.exists(name):
        return name
    try:
        return str(find(name).path)
    except TTBundleError as e:
        raise ValueError(f"ttbundle: model {name!r} is not a package directory and {e}") from None


_HOOKED = "_ttbundle_resolves_names"


def hook_name_resolution() -> None:
    """Make vLLM resolve a registered bundle name or HF id to its package before it looks for
    the name on the HF hub. vLLM 0.33 interprets the model argument first in
    ``EngineArgs.__post_init__`` (right after loading the general plugins; with
    ``HF_HUB_OFFLINE`` it replaces the name by a local hub snapshot, ``get_model_path``, which
    raises for a name not in the hub cache), then in ``EngineArgs.create_engine_config``
    (speculator detection reads the name's HF config, then ``ModelConfig`` fetches it). The
    first lets a registered name through (an unknown one raises, listing the registered
    packages); the second makes the model the package path and, unless given, the served model
    name the name. Idempotent."""
    import vllm.engine.arg_utils as vargs

    if getattr(vargs.get_model_path, _HOOKED, False):
        return
    get_path, create = vargs.get_model_path, vargs.EngineArgs.create_engine_config

    def get_model_path(model, revision=None):
        if isinstance(model, str) and not os.path.exists(model):
            resolve_model(model)  # raises, listing the registered packages, for an unknown name
            return model  # registered: create_engine_config makes it the package path
        return get_path(model, revision)

    def create_engine_config(self, *args, **kwargs):
        name = self.model
        if isinstance(name, str) and not os.path.exists(name):
            self.model = resolve_model(name)
            if self.tokenizer in (None, name):
                self.tokenizer = self.model
            if not self.served_model_name:
                self.served_model_name = name
        return create(self, *args, **kwargs)

    for f in (get_model_path, create_engine_config):
        setattr(f, _HOOKED, True)
    vargs.get_model_path = get_model_path
    vargs.EngineArgs.create_engine_config = create_engine_config


_STUBS: dict[str, type] = {}

def _pil_image_processors(part) -> None:
    """Without torchvision transformers' torchvision image processors do not import, and vLLM's
    model modules import from them (a type, Qwen's ``smart_resize``); transformers itself then
    loads the PIL processor of the same settings (``Gemma3ImageProcessorPil``,
    ``Qwen2VLImageProcessorPil``). Make each import the vision ``part`` names
    (``PIL_PROCESSORS``) give those, and the processor classes that needed torchvision only
    through them (``PROCESSOR_CLASSES``) the real class in place of the lazy placeholder."""
    for name, (pil_name, names) in part.PIL_PROCESSORS.items():
        try:
            importlib_import(name)
        except ImportError:
            pil = importlib_import(pil_name)
            shim = types.ModuleType(name)
            for ours, theirs in names.items():
                setattr(shim, ours, getattr(pil, theirs))
            sys.modules[name] = shim
            package = importlib_import(name.rsplit(".", 1)[0])
            for ours in names:  # the package's lazy attribute would import the torchvision module
                if ours.endswith("Processor"):
                    setattr(package, ours, getattr(pil, names[ours]))
            logger.debug("ttbundle: torchvision missing: %s is the PIL image processor", name)
    for package, (module, cls) in part.PROCESSOR_CLASSES.items():
        real = getattr(importlib_import(module), cls)  # imports with the shims above in place
        pkg = importlib_import(package)
        if getattr(pkg, cls, None) is not real:  # the lazy package's torchvision placeholder
            setattr(pkg, cls, real)


def importlib_import(name: str):
    return importlib.import_module(name)


_IMAGE_ONLY: dict = {}


def _image_only_info(base, processor: str):
    """vLLM's processing info ``base`` for images only: its HF processor is transformers'
    ``processor`` class without a video processor (which needs torchvision; ``from_pretrained``
    loads the image processor and the tokenizer only), and it declares image inputs alone, so
    vLLM neither profiles nor accepts video (a video part is vLLM's 400)."""
    key = (base, processor)
    if key in _IMAGE_ONLY:
        return _IMAGE_ONLY[key]
    import transformers

    hf_cls = getattr(transformers, processor)

    class ImageOnlyProcessor(hf_cls):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
            self.video_processor = None

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = "ImageOnly" + processor

    class ImageOnlyInfo(base):
        def get_hf_processor(self, **kwargs):
            return self.ctx.get_hf_processor(ImageOnlyProcessor, **kwargs)

        def get_supported_mm_limits(self):
            return {"image": None}

        def get_mm_max_tokens_per_item(self, seq_len, mm_counts):
            return {"image": self.get_max_image_tokens()}

        def get_supported_mm_processor_kwargs(self):
            # vLLM's own rule over the modalities declared (images): a model's override may
            # assume a video processor (Qwen3-VL adds video pixel kwargs)
            from vllm.multimodal.processing.context import BaseProcessingInfo
            return BaseProcessingInfo.get_supported_mm_processor_kwargs(self)

    ImageOnlyInfo.__name__ = ImageOnlyInfo.__qualname__ = "TT" + base.__name__
    _IMAGE_ONLY[key] = ImageOnlyInfo
    return ImageOnlyInfo


def _image_only_dummy(base):
    """vLLM's dummy-inputs builder ``base`` (what its profiling and multimodal warm-up preprocess)
    for images only: the images of ``base``'s largest size and nothing else. Qwen3-VL's own also
    makes a dummy video from the video processor, which the images-only processor has not (its
    warm-up failed: ``'NoneType' object has no attribute 'size'``)."""
    key = ("dummy", base)
    if key in _IMAGE_ONLY:
        return _IMAGE_ONLY[key]

    class ImageOnlyDummyInputs(base):
        def get_dummy_mm_data(self, seq_len, mm_counts, mm_options):
            width, height = self.info.get_image_size_with_most_features()
            return {"image": self._get_dummy_images(width=width, height=height,
                                                    num_images=mm_counts.get("image", 0),
                                                    overrides=(mm_options or {}).get("image"))}

    ImageOnlyDummyInputs.__name__ = ImageOnlyDummyInputs.__qualname__ = "TT" + base.__name__
    _IMAGE_ONLY[key] = ImageOnlyDummyInputs
    return ImageOnlyDummyInputs


_CAPS: dict = {}


def package_cap(model_dir) -> tuple | None:
    """(the vision part, the image settings, the most patches a prompt's images may have: the
    largest vision bucket) of the package at ``model_dir``, for a part whose buckets count patches;
    None where the directory holds no package (``bundle.yaml``) or buckets count images."""
    key = str(model_dir)
    if key not in _CAPS:
        _CAPS[key] = None
        if (Path(model_dir) / "bundle.yaml").is_file():
            b = read_bundle(model_dir)
            part = b.family.vision_part(b.arch)
            if part is not None and part.largest_image(b.vision) is not None:
                _CAPS[key] = (part, b.vision, max(b.vision.buckets))
    return _CAPS[key]


def _capped(proc_cls, info_cls):
    """vLLM's processor and processing info for a package whose largest vision bucket caps a
    prompt's images (``vision.buckets``; the spec says where it is below the largest images):
    vLLM's budgets (the most tokens an image takes, its dummy image for warm-up and profiling)
    are those of an image within the cap, and a request whose images need more patches than the
    package encodes is refused with a 400 naming the limit, never resized to something else."""
    key = ("capped", proc_cls, info_cls)
    if key in _IMAGE_ONLY:
        return _IMAGE_ONLY[key]

    class CappedInfo(info_cls):
        def _tt_cap(self):
            return package_cap(self.ctx.model_config.model)

        def get_mm_max_tokens_per_item(self, seq_len, mm_counts):
            out = super().get_mm_max_tokens_per_item(seq_len, mm_counts)
            cap = self._tt_cap()
            if out is None or cap is None or "image" not in out:
                return out
            part, vs, most = cap
            return {**out, "image": min(out["image"], part.prompt_tokens_of(vs, most))}

        def get_image_size_with_most_features(self, *args, **kwargs):
            size = super().get_image_size_with_most_features(*args, **kwargs)
            cap = self._tt_cap()
            if cap is None:
                return size
            part, vs, most = cap
            v = part.v
            blocks = min(part.largest_image(vs), most) // v.merge_unit
            side = math.isqrt(blocks) * v.factor  # a square image of at most that many merge blocks
            if size.width * size.height <= side * side:
                return size
            return type(size)(width=side, height=side)

    class CappedProcessor(proc_cls):
        def apply(self, *args, **kwargs):
            out = super().apply(*args, **kwargs)
            cap = self.info._tt_cap() if hasattr(self.info, "_tt_cap") else None
            if cap is not None:
                part, vs, most = cap
                soft = [p.get_num_embeds() for p in out["mm_placeholders"].get("image", [])]
                need = sum(soft) * part.v.merge_unit
                if need > most:
                    from vllm.exceptions import VLLMValidationError
                    raise VLLMValidationError(
                        f"this request's images need {need} patches ({' + '.join(map(str, soft))} soft tokens x "
                        f"{part.v.merge_unit}); the package encodes at most {most} patches per prompt (its largest "
                        "vision bucket, vision.buckets): send smaller or fewer images", parameter="messages")
            return out

    CappedInfo.__name__ = CappedInfo.__qualname__ = "Capped" + info_cls.__name__
    CappedProcessor.__name__ = CappedProcessor.__qualname__ = "Capped" + proc_cls.__name__
    _IMAGE_ONLY[key] = (CappedProcessor, CappedInfo)
    return _IMAGE_ONLY[key]


def _multimodal(name: str, part, attrs: dict):
    """``attrs`` plus what vLLM needs to preprocess images with its own processor for the HF
    class the vision ``part`` (a ``VisionPart`` class) names (``VLLM_PROCESSOR``):
    SupportsMultiModal's class attributes and the placeholder string (the registration of the
    processor factories happens on the class, :func:`stub_class`)."""
    mod, proc, info, dummy = part.VLLM_PROCESSOR
    placeholder = part.PLACEHOLDER_STR
    _pil_image_processors(part)
    m = importlib.import_module(mod)

    def get_placeholder_str(cls, modality: str, i: int):
        if modality.startswith("image"):
            return placeholder
        raise ValueError(f"{name}: only images are supported")

    attrs.update(get_placeholder_str=classmethod(get_placeholder_str),
                 embed_multimodal=lambda self, **kw: None)
    info_cls, dummy_cls = getattr(m, info), getattr(m, dummy)
    if part.IMAGE_ONLY_PROCESSOR is not None:  # images only (no video processor, no video)
        info_cls = _image_only_info(info_cls, part.IMAGE_ONLY_PROCESSOR)
        dummy_cls = _image_only_dummy(dummy_cls)
    proc_cls = getattr(m, proc)
    if part.BUCKET_UNIT == "patches":  # a prompt's images are capped by the largest vision bucket
        proc_cls, info_cls = _capped(proc_cls, info_cls)
    return (proc_cls, info_cls, dummy_cls)


def stub_class(arch: str):
    """The class registered with vLLM as ``TT<arch>``: it satisfies vLLM's model-class checks;
    the model itself runs on the mesh through ttbundle's worker, never through this class."""
    name = arch if arch.startswith("TT") else "TT" + arch
    if name in _STUBS:
        return _STUBS[name]
    import torch.nn as nn

    def _no(self, *a, **k):
        raise RuntimeError(f"{name} runs on a Tenstorrent mesh through ttbundle's model runner")

    attrs = {
        "__init__": lambda self, *, vllm_config=None, prefix="": _no(self),
        "embed_input_ids": _no, "forward": lambda self, input_ids, positions, **kw: _no(self),
        "compute_logits": _no, "__module__": __name__,
    }

    part = vision_class_of(arch.removeprefix("TT"))
    if part is not None:  # images preprocessed by vLLM's own processor for the HF class
        from vllm.model_executor.models.interfaces import SupportsMultiModal
        from vllm.multimodal import MULTIMODAL_REGISTRY

        proc, info, dummy = _multimodal(name, part, attrs)
        cls = type(name, (nn.Module, SupportsMultiModal), attrs)
        cls = MULTIMODAL_REGISTRY.register_processor(proc, info=info, dummy_inputs=dummy)(cls)
    else:
        cls = type(name, (nn.Module,), attrs)
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
    hook_name_resolution()
    for fam in families.all_families().values():
        for arch in fam.hf_architectures:
            register_arch(arch)
    verify = os.environ.get(VERIFIED_ENV) != "1"
    try:
        good, bad = scan(check_hashes=verify, strict=False)
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
