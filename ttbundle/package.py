"""The package format: one directory per bundle and mesh that a serving host loads as is.

Layout (``OUT/<mesh>/<bundle>/``, so ``EXTRA_MODELS_DIR=OUT/<mesh>`` registers every bundle built
for that mesh, see docs/build.md)::

    vllm_metadata.json        {"arch": "<HF arch>", "main_class": "<module>:<class>"} (TT plugin)
    <module>.py               generated adapter: subclasses ttbundle.runtime.adapter.BundleModel
    config.json               HF config, architectures = ["TT<HF arch>"]
    tokenizer.json, ...       tokenizer files copied from the spec's tokenizer directory
    bundle.yaml               the resolved spec for this mesh (loads with `ttbundle validate`)
    weights/device-NNN.safetensors   one file per device, that device's shards in plan order
    programs/<phase>-<bucket>.json   lowered per-device programs (``lower.lower``)
    README.md                 model card with the plan summary
    manifest.json             versions, spec hash, mesh, buckets, content key, sha256 of every file

Weights files are plain safetensors: bf16 shards as ``BF16``; block floats (bfp8/bfp4) as ``U8``
bytes in Tenstorrent's tile format (``ttbundle.blockfloat``). Each tensor is ``<name>`` (global)
or ``<name>.<layer>``; the header's ``__metadata__["ttbundle"]`` says which device the file is,
and each tensor's global shape, PartitionSpec, encoding and ``stored_in``: per device, the device
whose file stores its shard. A shard several devices hold is stored once, by the first of them
(``layout.holders``); format 1 packages (no ``stored_in``: every file holds every shard) still
read.

This module writes the small files (templates), streams shard files with a header computed up
front, reads packages back (:func:`load_package`) and verifies them (:func:`verify_package`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import keyword
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InvalidInput, TTBundleError
from .fsutil import TEMPLATE_DIR, hash_file
from .manifest import MANIFEST, METADATA

# /2: a shard several devices hold is stored once (weights ``stored_in``); /1 packages still read
FORMAT = "ttbundle.package/2"
FORMATS = ("ttbundle.package/1", FORMAT)
WEIGHTS_FORMAT = "ttbundle.weights/2"
WEIGHTS_FORMATS = ("ttbundle.weights/1", WEIGHTS_FORMAT)
RUNTIME_CLASS = ("ttbundle.runtime.adapter", "BundleModel")
# Tokenizer and generation files copied into a package when the tokenizer directory has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
# A tokenizer vLLM can instantiate has one of these; the other files configure it.
TOKENIZER_MODEL_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(names) -> bool:
    """Whether files ``names`` (a package's, or a tokenizer directory's) make a tokenizer."""
    return any(n in names for n in TOKENIZER_MODEL_FILES)
# names are matched whole (``fullmatch``: ``$`` would let a trailing newline through)
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ST_DTYPE = {"bf16": "BF16", "bfp8": "U8", "bfp4": "U8"}


class PackageError(TTBundleError):
    """A package on disk is missing, incomplete or corrupt (exit 1); names the first bad file."""


# ---- names ---------------------------------------------------------------------------------------
def mesh_slug(mesh_name: str) -> str:
    """Directory name of a mesh: presets as written (``T3K``), ``(2,4)`` -> ``2x4``,
    ``(2,4)@blackhole`` -> ``2x4-blackhole``."""
    m = re.fullmatch(r"\((\d+),(\d+)\)(?:@(\w+))?", mesh_name)
    slug = f"{m.group(1)}x{m.group(2)}" + (f"-{m.group(3)}" if m.group(3) else "") if m else mesh_name
    return safe_name(slug, "mesh name")


def safe_name(name: str, what: str) -> str:
    """``name`` if it is a single safe path component, else InvalidInput (no ``/``, ``..``,
    leading dot or dash, control characters)."""
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidInput(f"{what} {name!r} cannot name a directory: use letters, digits, '-', '_', "
                           "'.', starting with a letter or digit")
    return name


def package_path(out_dir: str | Path, bundle_name: str, mesh_name: str) -> Path:
    """``out_dir/<mesh>/<bundle>``, refusing any name that would leave ``out_dir``."""
    out = Path(out_dir).absolute()
    p = out / mesh_slug(mesh_name) / safe_name(bundle_name, "bundle name")
    if os.path.commonpath([os.path.normpath(p), os.path.normpath(out)]) != os.path.normpath(out):
        raise InvalidInput(f"package path {p} is outside {out}")  # unreachable with safe names
    return p


def identifier(name: str, what: str) -> str:
    """``name`` if it is a plain ASCII Python identifier (not a keyword), else InvalidInput."""
    if not isinstance(name, str) or not IDENT.fullmatch(name) or keyword.iskeyword(name):
        raise InvalidInput(f"{what} {name!r} is not a valid Python identifier")
    return name


def module_name(bundle_name: str, mesh_name: str) -> str:
    """The adapter module's name. Unique per (bundle, mesh): the TT plugin appends every package
    folder to ``sys.path``, so two packages with one module name would shadow each other."""
    slug = re.sub(r"[^a-z0-9]+", "_", f"{bundle_name}_{mesh_slug(mesh_name)}".lower()).strip("_")
    tag = hashlib.sha256(f"{bundle_name}\0{mesh_name}".encode()).hexdigest()[:6]
    return identifier(f"ttbundle_{slug}_{tag}", "adapter module name")


def tt_arch(hf_arch: str) -> str:
    return hf_arch if hf_arch.startswith("TT") else "TT" + hf_arch


# ---- templates -----------------------------------------------------------------------------------
class _Checked(str):
    """Template output that went through a filter; the environment refuses anything else."""


def pyrepr(value) -> _Checked:
    """A Python literal for plain data (str, int, finite float, bool, None, list, dict with str
    keys) that ``ast.literal_eval`` reads back as ``value``; anything else is refused."""
    def ok(v):
        if v is None or isinstance(v, (bool, int, str)):
            return True
        if isinstance(v, float):
            return math.isfinite(v)
        if isinstance(v, (list, tuple)):
            return all(ok(x) for x in v)
        if isinstance(v, dict):
            return all(isinstance(k, str) and ok(x) for k, x in v.items())
        return False
    if not ok(value):
        raise InvalidInput(f"cannot write {type(value).__name__} {value!r} into generated code")
    text = repr(value)
    if ast.literal_eval(text) != value:  # pragma: no cover - repr of plain data round-trips
        raise InvalidInput(f"value {value!r} does not round-trip as a Python literal")
    return _Checked(text)


def ident_filter(value) -> _Checked:
    return _Checked(identifier(value, "name"))


def dotted_filter(value) -> _Checked:
    """A dotted module path whose every part is an identifier."""
    for part in str(value).split("."):
        identifier(part, f"module path {value!r}: part")
    return _Checked(value)


def md(value) -> _Checked:
    """Markdown-safe inline text: HTML and markdown control characters escaped, one line."""
    text = " ".join(str(value).split())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = re.sub(r"([\\`*_{}\[\]()#+!|~])", r"\\\1", text)
    return _Checked(text)


def code(value) -> _Checked:
    """Text for an inline code span (no backticks, one line)."""
    return _Checked(" ".join(str(value).replace("`", "'").replace("|", "\\|").split()))


def size(n) -> _Checked:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return _Checked(f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}")
        n /= 1024
    raise AssertionError  # pragma: no cover


def jsonstr(value) -> _Checked:
    """A JSON (hence YAML) scalar, for the model card's front matter."""
    return _Checked(json.dumps(value, ensure_ascii=True))


def _env():
    import jinja2

    def finalize(v):
        if isinstance(v, _Checked):
            return v
        raise InvalidInput(f"template bug: {v!r} written without a filter (pyrepr, ident, md, json, num)")

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), autoescape=False,
                             undefined=jinja2.StrictUndefined, finalize=finalize,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(pyrepr=pyrepr, ident=ident_filter, dotted=dotted_filter, md=md, json=jsonstr,
                       code=code, size=size, num=lambda v: _Checked(f"{int(v):,}"))
    return env


def _render(template: str, **ctx) -> str:
    import jinja2
    try:
        return _env().get_template(template).render(**ctx)
    except jinja2.TemplateNotFound:
        raise TTBundleError(f"template {template} not found in {TEMPLATE_DIR} (ttbundle build needs "
                            "the templates/ folder of a source checkout)") from None


def render_adapter(bundle_name: str, mesh_name: str, arch: str, class_name: str, version: str) -> str:
    """The adapter module: imports the runtime's BundleModel and subclasses it with the package
    directory (found from ``__file__`` at import) and the arch baked in. The rendered text is
    parsed and checked against a whitelist of statement kinds before it is returned."""
    src = _render("adapter.py.j2", bundle=bundle_name, mesh=mesh_name, arch=arch, tt_arch=tt_arch(arch),
                  class_name=identifier(class_name, "adapter class name"),
                  runtime_module=RUNTIME_CLASS[0], runtime_class=RUNTIME_CLASS[1], version=version)
    check_adapter_source(src, class_name)
    return src


def check_adapter_source(src: str, class_name: str, where: str | None = None) -> None:
    """Refuse generated adapter code that is anything but: docstring, imports of ``os`` and the
    runtime class, assignments of literals (or ``os.path`` of ``__file__``), and one class whose
    body assigns literals. A template or escaping bug cannot smuggle code past this. ``where``:
    the adapter file of a package (its verification: :func:`verify_package`), which names it in
    a PackageError; else a TTBundleError (``render_adapter``, a template bug)."""
    if where is not None:
        try:
            return check_adapter_source(src, class_name)
        except TTBundleError as e:
            raise PackageError(f"{where}: {e.message}; not the adapter `ttbundle build` writes (rebuild "
                               "the package)") from None
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError) as e:
        raise TTBundleError(f"generated adapter does not parse: {e}") from None

    def literal_or_path(node) -> bool:
        try:
            ast.literal_eval(node)
            return True
        except ValueError:
            pass
        dump = ast.dump(node)
        return dump == ast.dump(ast.parse("os.path.dirname(os.path.abspath(__file__))", mode="eval").body)

    def bad(what):
        raise TTBundleError(f"generated adapter rejected: unexpected {what}")

    classes = 0
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, ast.ImportFrom) and (node.module, [a.name for a in node.names]) in (
                ("__future__", ["annotations"]), (RUNTIME_CLASS[0], [RUNTIME_CLASS[1]])):
            continue
        if isinstance(node, ast.Import) and [a.name for a in node.names] == ["os"]:
            continue
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets) \
                and literal_or_path(node.value):
            continue
        if isinstance(node, ast.ClassDef) and node.name == class_name and classes == 0 \
                and [ast.dump(b) for b in node.bases] == [ast.dump(ast.Name(RUNTIME_CLASS[1], ast.Load()))] \
                and not node.decorator_list and not node.keywords:
            classes += 1
            for b in node.body:
                if isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    continue
                if isinstance(b, ast.Assign) and all(isinstance(t, ast.Name) for t in b.targets) and (
                        literal_or_path(b.value) or (isinstance(b.value, ast.Name) and b.value.id.isupper())):
                    continue
                bad(f"statement in class {class_name}: {ast.dump(b)[:80]}")
            continue
        bad(f"top-level statement: {ast.dump(node)[:80]}")
    if classes != 1:
        bad(f"class layout (want one class {class_name})")


def render_readme(ctx: dict) -> str:
    return _render("README.md.j2", **ctx)


def metadata_json(arch: str, main_class: str) -> str:
    return json.dumps({"arch": arch, "main_class": main_class}, indent=2) + "\n"


def hf_config_json(bundle) -> str:
    """config.json: the arch's HF config (transformers' full dict) with the TT-prefixed arch."""
    from . import reference
    cfg = json.loads(reference.hf_config(bundle).to_json_string(use_diff=False))
    cfg["architectures"] = [tt_arch(bundle.family.hf_architecture(bundle.arch))]
    cfg["torch_dtype"] = "bfloat16"
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def resolved_spec(bundle, plan) -> dict:
    """The spec as this package was built: the arch inline (``from_hf`` resolved), the buckets,
    the full resolved sharding plan and per-tensor dtypes, this mesh as the only target, no paths
    (the package holds the weights and tokenizer)."""
    s = bundle.spec
    d = s.model_dump(mode="json", exclude_none=False)
    d["model"] = bundle.arch.model_dump(mode="json")  # nulls kept: some are required keys (q_lora_rank)
    d["from_hf"] = None
    d["tokenizer"] = False if s.tokenizer is False else None  # false: token ids only (serve says so)
    d["targets"] = [plan.mesh.name]
    d["weights"] = {"source": None, "dtypes": {"default": s.weights.dtypes.default,
                                               "tensors": {t.name: t.dtype for t in plan.tensors
                                                           if t.layout == "TILE"}}}
    d["sharding"] = {k: v for k, v in d["sharding"].items() if k != "targets"}
    d.pop("replicas", None)
    if plan.mesh.target_shape:  # this target's split only
        d["replicas"] = {plan.mesh.name: {"submesh": list(plan.mesh.shape), "count": plan.mesh.replicas}}
    d["sharding"]["plan"] = {n: [_entry(e) for e in sp] for n, sp in plan.specs.items()}
    d["buckets"] = bundle.buckets.model_dump(mode="json")
    return {k: v for k, v in d.items() if v is not None}


def _entry(e):
    if e is None or isinstance(e, str):
        return e
    return list(e)


def render_bundle_yaml(resolved: dict, version: str) -> str:
    import yaml
    head = (f"# Resolved bundle spec written by ttbundle {version}: the arch, sharding plan and "
            "dtypes this package was built with.\n")
    return head + yaml.safe_dump(resolved, sort_keys=False, default_flow_style=None, width=100)


# ---- weights files -------------------------------------------------------------------------------
def weight_file(d: int) -> str:
    return f"weights/device-{d:03d}.safetensors"


def tensor_key(name: str, layer: int | None) -> str:
    return name if layer is None else f"{name}.{layer}"


def encoded_nbytes(shape: list[int], dtype: str) -> int:
    """Bytes of one shard in the file: bf16 elements, or whole block-float tiles."""
    if dtype == "bf16":
        return math.prod(shape) * 2
    from .plan import TILE_BYTES, tile_pages
    return tile_pages(shape) * TILE_BYTES[dtype]


WRITE_PIECE = 1 << 19
WRITEBACK_EVERY = 16 << 20


@functools.cache
def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None."""
    import ctypes
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)``: queue the range for writeback without waiting
    (elsewhere a no-op, and the final fsync does all the work)."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE


class ShardFile:
    """A safetensors file written front to back: the header is computed from the declared
    entries, then each tensor's bytes are written in declaration order; sha256 on the fly."""

    def __init__(self, path: Path, entries: list[tuple[str, str, list[int], int]], metadata: dict):
        header: dict = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
        off = 0
        self.order: list[tuple[str, int]] = []
        for name, st_dtype, shape, nbytes in entries:
            header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            self.order.append((name, nbytes))
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        # a fresh inode: ``path`` may be a hard link into the previous package
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb")
        self.h = hashlib.sha256()
        self.size = self.synced = 0
        self.i = 0
        self._put(struct.pack("<Q", len(raw)) + raw)

    def _put(self, buf) -> None:
        # piecewise, so sha256 reads each piece while the write has left it in cache (hashing
        # from memory runs at ~60% of the speed of hashing from cache on the machines measured)
        mv = memoryview(buf).cast("B")
        for i in range(0, mv.nbytes, WRITE_PIECE):
            piece = mv[i:i + WRITE_PIECE]
            self.f.write(piece)
            self.h.update(piece)
        self.size += mv.nbytes
        if self.size - self.synced >= WRITEBACK_EVERY:
            # start writing back what is written so far (asynchronously), so the disk works
            # during the conversion and the final fsync has little left to wait for
            self.f.flush()
            _start_writeback(self.f.fileno(), self.synced, self.size - self.synced)
            self.synced = self.size

    def write(self, name: str, buf) -> None:
        want, nbytes = self.order[self.i]
        got = memoryview(buf).nbytes
        if name != want or got != nbytes:
            raise RuntimeError(f"{self.path}: expected {want} ({nbytes} B), got {name} ({got} B)")
        self._put(buf)
        self.i += 1

    def close(self) -> tuple[str, int]:
        if self.i != len(self.order):
            raise RuntimeError(f"{self.path}: {len(self.order) - self.i} tensors not written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.h.hexdigest(), self.size

    def abort(self) -> None:
        self.f.close()


# ---- manifest and verification ---------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    return hash_file(path, hashlib.sha256())


def read_manifest(pkg: Path) -> dict:
    """The package's manifest, read strictly (``ttbundle.manifest``): a regular file of at most
    ``manifest.MAX_BYTES``, JSON without duplicate keys, every key known and of its type, every
    listed path inside the package. PackageError naming the file and the field."""
    from . import manifest as schema
    from .fsutil import strict_json

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
        raise PackageError(f"{p}: not a {' or '.join(FORMATS)} manifest")
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
    _check_code(pkg, m, adapter_of(pkg, m))
    return m


#: files Python imports or runs: a package holds one, its own generated adapter
PYTHON_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyd", ".pyz", ".pth", ".so")


def _check_code(pkg: Path, m: dict, adapter: tuple[str, str]) -> None:
    """The only code a package carries is its generated adapter, and it passes the adapter
    whitelist (:func:`check_adapter_source`, what the engine checks again before it runs it);
    no other Python file, and no ``auto_map`` (Hugging Face's pointer to remote code, run under
    ``--trust-remote-code``) in any of its top-level JSON files (``config.json``,
    ``tokenizer_config.json``, ...). ttbundle packages never need remote code."""
    mod, cls = adapter
    for rel in sorted(m["files"]):
        name = rel.rsplit("/", 1)[-1]
        if rel != f"{mod}.py" and (name.lower().endswith(PYTHON_SUFFIXES) or ".so." in name.lower()):
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
    """Every entry under ``pkg`` is a listed file or a directory above one; no symlinks."""
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
            if stat.S_ISDIR(st.st_mode):
                if rel not in dirs_needed:
                    hint = (" (bytecode written by an import from the package folder; delete it, and "
                            "set PYTHONDONTWRITEBYTECODE=1 for loaders that import from the folder)"
                            if name == "__pycache__" else "")
                    raise PackageError(f"{pkg}: {rel}/: directory not in the manifest{hint}")
            elif rel not in listed:
                raise PackageError(f"{pkg}: {rel}: not in the manifest")


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


# ---- reading a package back ------------------------------------------------------------------------
@dataclass
class LoadedPackage:
    """A package read back: the resolved bundle, its mesh, programs, weights and manifest.

    Nothing here re-plans: the programs say what runs and where every weight lives
    (:attr:`weight_refs`), the KV cache they were built for (:attr:`kv_cache`), and the manifest
    the trace region (:attr:`trace_region_size`); a backend reads these, never ``plan``. (A
    build-time caller that wants the plan makes it: ``plan.make_plan(pkg.bundle, pkg.mesh)``.)"""

    dir: Path
    manifest: dict
    bundle: object
    mesh: object
    weights: "PackageWeights"
    programs: dict = field(default_factory=dict)  # (phase, bucket) -> relative path
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

    def program(self, phase: str, bucket: int) -> dict:
        """The JSON form of the (phase, bucket) program (both backends run ``program_ir``)."""
        return self.program_ir(phase, bucket).to_json()

    def program_ir(self, phase: str, bucket: int):
        """The (phase, bucket) program as the typed IR (``program.Program``)."""
        from .program import Program, ProgramError
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
    def trace_region_size(self) -> int:
        """Bytes to open the mesh's trace region with (``open_mesh_device(trace_region_size=)``):
        the size the build planned (manifest ``trace_region_size``). A manifest written before it
        was recorded gives ``trace_region_bytes``, the DRAM that size costs (a little more)."""
        m = self.manifest
        return int(m.get("trace_region_size", m.get("trace_region_bytes")) or 0)


class SharedStack:
    """A tensor's ``[D, *local]`` held as its distinct shards: ``distinct`` ``[G, *local]`` and
    ``group`` (per device, the index of its shard in ``distinct``). What :func:`stack_shards`
    gives where some but not all devices hold the same shard (split over one mesh axis and
    replicated over the other, replicated KV heads), which no strided ``[D, *local]`` view can
    express. Read-only: :meth:`dense` is a copy; the emulated mesh's GEMM works per distinct
    shard (``backends/emulated/gemm``)."""

    def __init__(self, distinct, group):
        self.distinct, self.group = distinct, tuple(int(g) for g in group)
        self.shape = (len(self.group), *distinct.shape[1:])
        self.dtype, self.device = distinct.dtype, distinct.device

    def dim(self) -> int:
        return len(self.shape)

    def members(self) -> list:
        """Per distinct shard, the devices holding it (mesh order)."""
        out: list = [[] for _ in range(self.distinct.shape[0])]
        for d, g in enumerate(self.group):
            out[g].append(d)
        return out

    def dense(self):
        """The plain ``[D, *local]`` tensor (a copy: one per device)."""
        import torch
        return self.distinct.index_select(0, torch.tensor(self.group, device=self.distinct.device))


def stack_shards(shards: list, device="cpu"):
    """Per-device shards as the emulated mesh holds them, one copy per distinct shard: devices
    whose entries are the same tensor object (``is``) share it. All one object: a ``[D, *local]``
    view of that one copy (``expand``: stride 0 over the devices); all distinct: ``torch.stack``;
    otherwise a :class:`SharedStack`. Nothing here compares values: sharing is what the caller
    says (the package's ``stored_in``, or ``layout.holders``)."""
    import torch
    ids: dict[int, int] = {}
    distinct: list = []
    group = []
    for x in shards:
        g = ids.setdefault(id(x), len(distinct))
        if g == len(distinct):
            distinct.append(x)
        group.append(g)
    return held_as(torch.stack(distinct).to(device), group)


def held_as(distinct, group):
    """``distinct`` (``[G, *local]``: each distinct shard once) held for the devices of
    ``group`` (per device, the index of its shard): itself when every device has its own (in
    device order), a stride-0 view of the one copy when all share it, else a
    :class:`SharedStack`. No copy is made."""
    D = len(group)
    if tuple(group) == tuple(range(D)) and distinct.shape[0] == D:
        return distinct
    if distinct.shape[0] == 1:
        return distinct.expand(D, *distinct.shape[1:])
    return SharedStack(distinct, group)


class PackageWeights:
    """Per-device shards of a package: ``device(d)`` as stored, ``device_stacks()`` as the
    emulated mesh holds them (``[D, *local]`` per tensor, one copy per distinct shard:
    :func:`stack_shards`), ``canonical()`` the global tensors they make up (padding dropped,
    per ``layout``). A shard several devices hold is stored once, in the file of the first of
    them (the header's ``stored_in``), read and decoded once, and shared."""

    def __init__(self, pkg: Path, bundle, mesh, refs: dict):
        from . import layout
        self.pkg, self.bundle, self.mesh, self.refs = pkg, bundle, mesh, refs
        self.decls = {t.name: t for t in bundle.family.tensors(bundle.arch)}
        self.dtypes = {n: r.dtype for n, r in refs.items()}
        self.units = {n: layout.tensor_units(t.dims, refs[n].spec, mesh, bundle.spec.sharding)
                      for n, t in self.decls.items()}
        self._handles = None
        #: per tensor key, per device: the device whose file stores its shard (set by the load's
        #: header check, ``_check_headers``, from the files' ``stored_in``)
        self.stored_in: dict = {}

    def files(self) -> list[Path]:
        return [self.pkg / weight_file(d) for d in range(self.mesh.num_devices)]

    def device(self, d: int, names: list[str] | None = None) -> dict:
        """Device ``d``'s shards ``{key: tensor}`` (bf16; block floats decoded to float32), each
        read from the file that stores it (``stored_in``)."""
        handles, metas = self._open()
        return {key: self._read(self.source(d, key), key) for key in (names or metas[d])}

    def source(self, d: int, key: str) -> int:
        """The device whose file stores device ``d``'s shard of ``key`` (itself, or the first
        device holding the same shard: ``stored_in``, checked at load)."""
        return int(self.stored_in[key][d])

    def _read(self, s: int, key: str):
        handles, metas = self._open()
        return _decode(handles[s].get_tensor(key), metas[s][key])

    def _open(self):
        """The device files' safetensors handles (memory-mapped) and headers, opened once."""
        if self._handles is None:
            from safetensors import safe_open
            try:
                handles = [safe_open(str(p), framework="pt") for p in self.files()]
                metas = [json.loads(h.metadata()["ttbundle"])["tensors"] for h in handles]
            except Exception as e:  # safetensors raises its own error types
                raise PackageError(f"{self.pkg}: weights unreadable: {e}") from None
            self._handles = (handles, metas)
        return self._handles

    def close(self) -> None:
        """Drop the open handles (their mmaps); the next read opens the files again."""
        self._handles = None

    def shards(self, name: str, layer: int | None = None, dtype=None) -> list:
        """Every device's shard of tensor ``name`` (of ``layer``), decoded from its file to
        ``dtype`` (bf16 values; bfp8/bfp4 tiles decoded as ttnn does). A shard stored once for
        several devices is read and decoded once: those devices' entries are one tensor."""
        import torch
        key = tensor_key(name, layer)
        src = [self.source(d, key) for d in range(self.mesh.num_devices)]
        one = {s: self._read(s, key).to(dtype or torch.float32) for s in dict.fromkeys(src)}
        return [one[s] for s in src]

    def stack(self, name: str, layer: int | None = None, dtype=None, device="cpu"):
        """One tensor (of ``layer``) as the emulated mesh holds it: ``[D, *local]``, each
        device's shard exactly as its file holds it (the values of :meth:`shards`), one copy per
        distinct stored shard (``stored_in``, :func:`held_as`), each read band by band straight
        into one preallocated tensor (:data:`BAND_BYTES`): a large tensor never exists whole in
        another dtype or as a second copy. What a layer-by-layer reader loads."""
        import torch

        handles, metas = self._open()
        key = tensor_key(name, layer)
        shape = [int(s) for s in metas[0][key]["shape"]]
        src = [self.source(d, key) for d in range(len(handles))]
        firsts = list(dict.fromkeys(src))
        out = torch.empty([len(firsts)] + shape, dtype=dtype or torch.float32)
        for i, s in enumerate(firsts):
            _decode_into(handles[s], key, metas[s][key], out[i])
        return held_as(out.to(device), [firsts.index(s) for s in src])

    def layers_of(self, name: str) -> list:
        """``[None]`` for a global tensor, else the layer indices it has."""
        t = self.decls[name]
        return [None] if t.layers is None else list(range(*t.layers))

    def _each(self, combine, dtype):
        """``{tensor: combine(name, [shard of each device])}`` (a list per layer for layered
        tensors), every shard decoded from its file to ``dtype``."""
        out: dict = {}
        for name, t in self.decls.items():
            per_layer = [combine(name, self.shards(name, layer, dtype)) for layer in self.layers_of(name)]
            out[name] = per_layer[0] if t.layers is None else per_layer
        return out

    def device_stacks(self, dtype=None, device="cpu") -> dict:
        """Every tensor as ``[D, *local]`` (a list per layer for layered tensors): :meth:`stack`
        of each (bf16 values; bfp8/bfp4 tiles decoded as ttnn does)."""
        import torch
        dtype = dtype or torch.float32
        return {name: [self.stack(name, layer, dtype, device) for layer in self.layers_of(name)]
                if self.decls[name].layers is not None else self.stack(name, None, dtype, device)
                for name in self.decls}

    def canonical(self, dtype=None) -> dict:
        """Global tensors reassembled from every device's shards (padding dropped)."""
        import torch
        dtype = dtype or torch.float32

        def assemble(name, shards):
            t = self.decls[name]
            g = torch.zeros(t.shape, dtype=dtype)
            for d, shard in enumerate(shards):
                _scatter(g, shard, [u[d] for u in self.units[name]], t.dims)
            return g
        return self._each(assemble, dtype)


def _scatter(g, shard, units_per_dim: list[list[int]], dims) -> None:
    """Write a device's shard back into global ``g`` (padding positions skipped)."""
    import torch

    from .layout import elements
    idx = []
    for k, (us, d) in enumerate(zip(units_per_dim, dims)):
        pos = torch.tensor(elements(us, d.unit), dtype=torch.long)
        keep = (pos >= 0).nonzero().reshape(-1)
        shard = shard.index_select(k, keep)
        shape = [1] * g.dim()
        shape[k] = -1
        idx.append(pos[keep].view(shape))
    g[tuple(idx)] = shard


#: a large tensor is read and decoded this many bytes (of float32) at a time (PackageWeights.stack)
BAND_BYTES = 64 << 20


def _decode_into(handle, key: str, info: dict, out) -> None:
    """Device shard ``key`` from its file (``handle``: safetensors, memory-mapped) into ``out``
    (the device tensor, any float dtype), a band at a time, bands decoded on one thread per core:
    a large tensor never exists whole in another dtype or as a second copy. Decoding is
    ``package._decode``'s (bf16 as stored, or transposed back; block-float tiles as the device
    decodes them)."""
    enc = info.get("encoding", "bf16")
    shape = [int(s) for s in info["shape"]]
    if out.numel() * 4 <= BAND_BYTES or len(shape) < 2:
        out.copy_(_decode(handle.get_tensor(key), info).reshape(out.shape))
        return
    sl = handle.get_slice(key)
    jobs = []  # (destination view, stored-slice bounds, info)
    if enc == "bf16":  # banded along the stored first dim
        flip = bool(info.get("transposed")) and len(shape) == 2
        stored0 = shape[-1] if flip else shape[0]
        row = (out[:, 0] if flip else out[0]).numel() * 4
        per = max(1, BAND_BYTES // max(1, row))
        for r0 in range(0, stored0, per):
            r1 = min(stored0, r0 + per)
            jobs.append((out[:, r0:r1] if flip else out[r0:r1], r0, r1, info))
    else:
        from . import blockfloat

        h, w = shape[-2], shape[-1]
        mats = out.reshape(-1, h, w)
        per = max(blockfloat.TILE, BAND_BYTES // (4 * w) // blockfloat.TILE * blockfloat.TILE)
        for b in range(mats.shape[0]):
            for r0 in range(0, h, per):
                r1 = min(h, r0 + per)
                a, z = blockfloat.row_band(shape, enc, b, r0, r1)
                jobs.append((mats[b, r0:r1], a, z, {**info, "shape": [r1 - r0, w]}))

    def one(job):
        dst, a, z, inf = job
        dst.copy_(_decode(sl[a:z], inf))
    _parallel(one, jobs)


def _parallel(fn, jobs: list) -> None:
    """``fn`` over ``jobs`` on one thread per usable core (numpy and torch release the GIL)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    n = min(len(jobs), len(os.sched_getaffinity(0)), 8)
    if n <= 1:
        for j in jobs:
            fn(j)
        return
    with ThreadPoolExecutor(n, thread_name_prefix="ttbundle-read") as pool:
        for _ in pool.map(fn, jobs):
            pass


def stored_shape(shape, transposed: bool) -> list:
    """The shape a bf16 shard has in its weights file: the device shape, or with its last two dims
    swapped when the header marks it ``"transposed"`` (kept in the checkpoint's element order)."""
    return list(shape[:-2]) + [shape[-1], shape[-2]] if transposed else list(shape)


def _decode(t, info: dict):
    """A stored shard as the device tensor: block floats decoded, a shard stored in its
    checkpoint's element order (``"transposed"``, see ``convert._stored_transposed``) turned back
    into the device's ``[..., in, out]`` (a view)."""
    enc = info.get("encoding", "bf16")
    if enc == "bf16":
        return t.transpose(-1, -2) if info.get("transposed") else t
    try:
        from . import blockfloat
    except ImportError:
        raise PackageError(f"package holds {enc} weights but ttbundle.blockfloat is not available") from None
    return blockfloat.decode(t.numpy().tobytes(), info["shape"], enc)


def read_bundle(pkg: str | Path):
    """The resolved spec a package directory holds (``bundle.yaml``), loaded."""
    from . import spec as specmod
    pkg = Path(pkg)
    text = (pkg / "bundle.yaml").read_text(encoding="utf-8")
    return specmod.loads(text, str(pkg / "bundle.yaml"), base_dir=pkg)


def load_package(pkg: str | Path, verify: bool = False) -> LoadedPackage:
    """Read a package: manifest (and every file's sha256 when ``verify``), the resolved spec, its
    programs (the weights each reads, checked against the weight files' headers)."""
    from .lower import program_name
    from .plan import target_mesh

    pkg = Path(pkg)
    m = verify_package(pkg, full=verify)
    bundle = read_bundle(pkg)
    mesh = target_mesh(bundle, m["mesh"]["name"])  # one replica's submesh when split
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
    return assemble(pkg, m, bundle, mesh, programs)


def assemble(pkg: Path, manifest: dict, bundle, mesh, programs: dict) -> LoadedPackage:
    """A package's parts read back (``programs``: (phase, bucket) -> relative path), the weight
    headers checked against the programs; ``build`` warms its temp directory up with it before
    the manifest exists."""
    loaded = LoadedPackage(Path(pkg), manifest, bundle, mesh, None, dict(programs))
    if not programs:
        raise PackageError(f"{pkg}: no programs")
    refs = _weight_refs(loaded)
    _check_arch(Path(pkg), bundle, mesh, refs)
    _check_spec(loaded, refs)
    loaded.weights = PackageWeights(Path(pkg), bundle, mesh, refs)
    _check_headers(loaded.weights)
    return loaded


def _check_arch(pkg: Path, bundle, mesh, refs: dict) -> None:
    """bundle.yaml's model declares exactly the weights the programs read, each of the
    per-device shape ``layout`` gives its dims under the programs' PartitionSpec."""
    from .layout import local_len
    decls = {t.name: t for t in bundle.family.tensors(bundle.arch)}
    if set(decls) != set(refs):
        raise PackageError(f"{pkg}: bundle.yaml declares tensors {sorted(set(decls) ^ set(refs))} the "
                           f"programs do not read (or the reverse)")
    for n, t in decls.items():
        want = [local_len(d, e, mesh, bundle.spec.sharding) for d, e in zip(t.dims, refs[n].spec)]
        if want != list(refs[n].device_shape):
            raise PackageError(f"{pkg}: bundle.yaml's model gives {n} {want} per device, the programs "
                               f"{list(refs[n].device_shape)}: the package is inconsistent; rebuild it")


def _check_spec(loaded: LoadedPackage, refs: dict) -> None:
    """bundle.yaml (the spec the package says it was built from) and the programs (what runs)
    agree: every program's mesh is the package's, and every weight's PartitionSpec and dtype and
    the KV cache's dtype and block size are what the spec resolves to (``plan.resolved_plan``,
    ``plan.tensor_dtype``; no plan is made). A disagreement names the program, the weight, both
    values and the bundle.yaml line; nothing at run time re-derives a layout, so a package whose
    programs and spec disagree would run one and describe the other."""
    from .layout import axes_of
    from .plan import resolved_plan, tensor_dtype

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
    kv, rt = loaded.kv_cache, bundle.spec.runtime
    for what, field_, got, want in (("dtype", "kv_cache_dtype", kv.get("dtype"), rt.kv_cache_dtype),
                                    ("block size", "kv_block_size", kv.get("block_size"), rt.kv_block_size)):
        if got != want:
            raise PackageError(f"{where}: KV cache {what} {got}, bundle.yaml says {want} "
                               f"({at(('runtime', field_))}: runtime.{field_}): the programs and the spec "
                               "disagree; rebuild the package from its spec")


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
    from .layout import holders
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


def trim_heap() -> None:
    """Hand the heap's freed pages back to the system (glibc's ``malloc_trim``): a layer's
    tensors, once freed, would otherwise stay resident as fragments of the heap, and the peak
    would grow with the layer count. A no-op where the C library has none."""
    import ctypes
    import ctypes.util

    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None
