"""Whether a package may be used: its manifest read strictly (:func:`read_manifest`), every file's
size and sha256, nothing unlisted, no symlink, ``main_class`` its own adapter (:func:`adapter_of`),
the adapter whitelisted, no other Python file, no ``auto_map`` (:func:`verify_package`: one
verdict); and the adapter imported from its checked bytes by path (:func:`load_adapter`)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from ..errors import InvalidInput
from ..fsutil import hash_file
from ..manifest import MANIFEST, METADATA
from .names import CHECK_RECORD_BYTES, CHECKS_DIR, DRAFT_DIR, FORMATS, IDENT, SAFE_NAME, PackageError, module_name
from .templates import check_adapter_source


def sha256_file(path: Path) -> str:
    return hash_file(path, hashlib.sha256())


def read_manifest(pkg: Path) -> dict:
    """The package's manifest, read strictly (``ttbundle.manifest``): a regular file of at most
    ``manifest.MAX_BYTES``, JSON without duplicate keys, every key known and of its type, every
    listed path inside the package. PackageError naming the file and the field."""
    from .. import manifest as schema
    from ..fsutil import strict_json

    p = Path(pkg) / MANIFEST
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise PackageError(f"{pkg}: not a ttbundle package (no {MANIFEST})") from None
    except OSError as e:
        raise PackageError(f"{p}: unreadable manifest: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PackageError(f"{p}: not a regular file")
        if st.st_size > schema.MAX_BYTES:
            raise PackageError(f"{p}: {st.st_size:,} B, over the {schema.MAX_BYTES:,} B a manifest may have; "
                               "not a manifest ttbundle wrote: rebuild the package")
        raw = f.read(schema.MAX_BYTES + 1)
    try:
        m = strict_json(raw.decode("utf-8"), str(p))
    except UnicodeDecodeError as e:
        raise PackageError(f"{p}: unreadable manifest: not UTF-8 ({e.reason} at byte {e.start})") from None
    except InvalidInput as e:
        raise PackageError(e.message.replace(f"{p}: ", f"{p}: unreadable manifest: ", 1)) from None
    if not isinstance(m, dict) or m.get("format") not in FORMATS or not isinstance(m.get("files"), dict):
        old = isinstance(m, dict) and str(m.get("format", "")).startswith("ttbundle.package/")
        raise PackageError(f"{p}: not a {' or '.join(FORMATS)} manifest"
                           + (f" ({m['format']}, an older ttbundle's: rebuild the package)" if old else ""))
    for rel in m["files"]:
        check_relpath(rel, p)
    why = schema.problem(m, str(p))
    if why is not None:
        raise PackageError(f"{why}; rebuild the package")
    return m


def check_relpath(rel: str, where) -> str:
    """A manifest path: relative, normalized, no ``..``, no hidden parts, inside the package."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or rel.startswith("/") or "\\" in rel or any(
            not SAFE_NAME.fullmatch(p) or p in (".", "..") for p in parts):
        raise PackageError(f"{where}: refusing file path {rel!r} (must stay inside the package)")
    return rel


def verify_package(pkg: str | Path, full: bool = True) -> dict:
    """A package is exactly its manifest: every file it lists is a regular file with its size
    (and sha256 when ``full``), and every entry on disk (directories, symlinks, bytecode and
    hidden files included) is one the manifest lists or a directory holding one; a symlink
    anywhere inside is refused. ``main_class`` must name the package's own adapter
    (:func:`adapter_of`). Raises PackageError naming the first bad entry; returns the manifest."""
    pkg = Path(pkg)
    m = read_manifest(pkg)
    for rel in sorted(m["files"]):
        rec = m["files"][rel]
        p = pkg / rel
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise PackageError(f"{pkg}: {rel}: missing", ) from None
        except OSError as e:
            raise PackageError(f"{pkg}: {rel}: unreadable ({e.strerror or e})") from None
        if not stat.S_ISREG(st.st_mode):
            raise PackageError(f"{pkg}: {rel}: not a regular file")
        if not isinstance(rec, dict) or st.st_size != rec.get("size"):
            size = rec.get("size") if isinstance(rec, dict) else None
            raise PackageError(f"{pkg}: {rel}: size {st.st_size} B, manifest says {size} B")
        if full and sha256_file(p) != rec.get("sha256"):
            raise PackageError(f"{pkg}: {rel}: sha256 mismatch (file changed or corrupt)")
    _check_entries(pkg, m)
    _check_code(pkg, m, adapter_of(pkg, m), _draft_adapter(pkg, m, full))
    return m


def _draft_adapter(pkg: Path, m: dict, full: bool) -> str | None:
    """A package holding a speculative draft (``names.DRAFT_DIR``, ``speculative: {method:
    draft}``): the draft directory is a whole package, verified here like any other (every file
    of it is also listed, with size and sha256, in the including package's manifest); returns
    the path of its adapter (``draft/<module>.py``), the one other Python file allowed. A draft
    holds no draft of its own."""
    if f"{DRAFT_DIR}/{MANIFEST}" not in m["files"]:
        return None
    d = pkg / DRAFT_DIR
    dm = verify_package(d, full)
    if f"{DRAFT_DIR}/{MANIFEST}" in dm["files"]:
        raise PackageError(f"{d}: a draft package holding a draft of its own; rebuild the package")
    outer = {rel[len(DRAFT_DIR) + 1:] for rel in m["files"] if rel.startswith(f"{DRAFT_DIR}/")}
    if outer != set(dm["files"]) | {MANIFEST}:
        extra = sorted(outer ^ (set(dm["files"]) | {MANIFEST}))
        raise PackageError(f"{pkg}: {MANIFEST} and {DRAFT_DIR}/{MANIFEST} list different draft files "
                           f"({', '.join(extra[:3])}); rebuild the package")
    return f"{DRAFT_DIR}/{adapter_of(d, dm)[0]}.py"


#: files Python imports or runs: a package holds one, its own generated adapter
PYTHON_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyd", ".pyz", ".pth", ".so")


def _check_code(pkg: Path, m: dict, adapter: tuple[str, str], draft_adapter: str | None = None) -> None:
    """The only code a package carries is its generated adapter, and it passes the adapter
    whitelist (:func:`check_adapter_source`, what the engine checks again before it runs it);
    no other Python file, and no ``auto_map`` (Hugging Face's pointer to remote code, run under
    ``--trust-remote-code``) in any of its top-level JSON files (``config.json``,
    ``tokenizer_config.json``, ...). ttbundle packages never need remote code."""
    mod, cls = adapter
    for rel in sorted(m["files"]):
        name = rel.rsplit("/", 1)[-1]
        if rel not in (f"{mod}.py", draft_adapter) and (name.lower().endswith(PYTHON_SUFFIXES) or ".so." in name.lower()):
            raise PackageError(f"{pkg}: {rel}: Python code that is not the package's adapter ({mod}.py); a "
                               "ttbundle package holds no other code: remove it from the package and its "
                               "manifest, or rebuild the package")
    check_adapter_source(_read_small(pkg, f"{mod}.py"), cls, f"{pkg}: {mod}.py")
    for rel in sorted(m["files"]):
        if "/" in rel or not rel.endswith(".json") or rel in (MANIFEST, "tokenizer.json"):
            continue  # tokenizer.json is the tokenizers library's model: transformers reads no auto_map there
        try:
            doc = json.loads(_read_small(pkg, rel))
        except (ValueError, RecursionError) as e:
            raise PackageError(f"{pkg}: {rel}: not readable JSON ({e}); rebuild the package") from None
        path = _auto_map(doc)
        if path is not None:
            raise PackageError(f"{pkg}: {rel}: {path}: Hugging Face remote code (it names Python classes "
                               "to download and run under --trust-remote-code); a ttbundle package never "
                               "needs remote code: rebuild the package from its spec")


def _auto_map(doc, path: str = "") -> str | None:
    """The path of the first ``auto_map`` key in a JSON document, at any depth; None if none."""
    todo = [(doc, path)]
    while todo:
        d, at = todo.pop()
        if isinstance(d, dict):
            for k, v in d.items():
                if k == "auto_map":
                    return f"{at}.{k}" if at else k
                todo.append((v, f"{at}.{k}" if at else k))
        elif isinstance(d, list):
            todo.extend((v, f"{at}[{i}]") for i, v in enumerate(d))
    return None


def _read_small(pkg: Path, rel: str) -> str:
    """A listed small text file of the package (not through a symlink), as text."""
    try:
        fd = os.open(pkg / rel, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(64 << 20)
        return data.decode("utf-8")
    except OSError as e:
        raise PackageError(f"{pkg}: {rel}: unreadable ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise PackageError(f"{pkg}: {rel}: not UTF-8 text") from None


def _check_entries(pkg: Path, m: dict) -> None:
    """Every entry under ``pkg`` is a listed file or a directory above one; no symlinks. The one
    exception is ``checks/`` (``names.CHECKS_DIR``): check records, regular ``.json`` files only
    and small, which nothing imports or runs."""
    listed = set(m["files"]) | {MANIFEST}
    dirs_needed = {"/".join(rel.split("/")[:i]) for rel in listed for i in range(1, rel.count("/") + 1)}

    def bad(e):
        raise PackageError(f"{pkg}: cannot list the package: {e.strerror or e}")

    for root, dirs, files in os.walk(pkg, onerror=bad):  # never follows symlinked directories
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(root, name)
            rel = os.path.relpath(p, pkg).replace(os.sep, "/")
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                raise PackageError(f"{pkg}: {rel}: a symlink; a package holds regular files only "
                                   "(copy the package with its files, e.g. `cp -rL`, or rebuild it)")
            if rel == CHECKS_DIR and stat.S_ISDIR(st.st_mode) and CHECKS_DIR not in dirs_needed:
                _check_records(pkg, p)
                dirs.remove(name)  # not walked into: checked above
                continue
            if stat.S_ISDIR(st.st_mode):
                if rel not in dirs_needed:
                    hint = (" (bytecode written by an import from the package folder; delete it, and "
                            "set PYTHONDONTWRITEBYTECODE=1 for loaders that import from the folder)"
                            if name == "__pycache__" else "")
                    raise PackageError(f"{pkg}: {rel}/: directory not in the manifest{hint}")
            elif rel not in listed:
                raise PackageError(f"{pkg}: {rel}: not in the manifest")


def _check_records(pkg: Path, d: str) -> None:
    """``checks/`` holds regular, small ``.json`` files and nothing else."""
    for name in sorted(os.listdir(d)):
        st = os.lstat(os.path.join(d, name))
        if not stat.S_ISREG(st.st_mode) or not name.endswith(".json") or name.startswith("."):
            raise PackageError(f"{pkg}: {CHECKS_DIR}/{name}: a check record directory holds .json files only")
        if st.st_size > CHECK_RECORD_BYTES:
            raise PackageError(f"{pkg}: {CHECKS_DIR}/{name}: {st.st_size} B, over the {CHECK_RECORD_BYTES} B "
                               f"a check record may have")


def adapter_of(pkg: Path, m: dict, metadata: dict | None = None) -> tuple[str, str]:
    """``(module, class)`` of the package's own adapter, checked: ``main_class`` (in the
    manifest, and in ``vllm_metadata.json`` when given) is ``<module>:<class>`` with the module
    the one ``ttbundle build`` names for this bundle and mesh, its ``<module>.py`` listed in the
    manifest, and the class the manifest's architecture. ``this:x`` or ``os:system`` is refused."""
    mc = m.get("main_class")
    where = f"{pkg}: {MANIFEST}"
    if metadata is not None and metadata.get("main_class") != mc:
        raise PackageError(f"{pkg}: {METADATA}: main_class {metadata.get('main_class')!r} is not the "
                           f"manifest's {mc!r}; rebuild the package")
    mod, _, cls = mc.partition(":") if isinstance(mc, str) else ("", "", "")
    mesh = m.get("mesh") if isinstance(m.get("mesh"), dict) else {}
    try:
        want = module_name(m.get("bundle"), mesh.get("name"))
    except InvalidInput:
        want = None
    if not IDENT.fullmatch(mod) or not IDENT.fullmatch(cls) or mod != want or cls != m.get("arch") \
            or f"{mod}.py" not in m["files"]:
        raise PackageError(f"{where}: main_class {mc!r} is not this package's adapter (expected "
                           f"{want}:{m.get('arch')} with {want}.py in the package); rebuild the package")
    return mod, cls


def load_adapter(pkg: str | Path, m: dict, metadata: dict | None = None):
    """The adapter class, imported from the package's own ``<module>.py`` by path: its bytes are
    read once, checked against the manifest's sha256 and the adapter whitelist
    (:func:`check_adapter_source`), then compiled and run as a fresh module. Nothing is looked up
    on ``sys.path`` and no bytecode is read or written."""
    import importlib.machinery
    import importlib.util
    import sys

    pkg = Path(pkg)
    mod, cls = adapter_of(pkg, m, metadata)
    rel = f"{mod}.py"
    path = pkg / rel
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise PackageError(f"{pkg}: {rel}: not a regular file")
            data = f.read()
    except OSError as e:
        raise PackageError(f"{pkg}: {rel}: cannot read the adapter: {e.strerror or e}") from None
    if hashlib.sha256(data).hexdigest() != m["files"][rel].get("sha256"):
        raise PackageError(f"{pkg}: {rel}: sha256 mismatch (file changed or corrupt)")
    try:
        src = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PackageError(f"{pkg}: {rel}: not UTF-8 text") from None
    check_adapter_source(src, cls, f"{pkg}: {rel}")
    spec = importlib.machinery.ModuleSpec(mod, None, origin=str(path))
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    code_obj = compile(src, str(path), "exec", dont_inherit=True)
    sys.modules[mod] = module
    try:
        exec(code_obj, module.__dict__)
    except BaseException:
        sys.modules.pop(mod, None)
        raise
    return getattr(module, cls)
