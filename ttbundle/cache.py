"""Content keys: what a package was built from, and which part of it a change invalidates.

A package's **content key** is the sha256 of its key fields (:data:`FIELDS`): digests of the
resolved spec and its sections, of the checkpoint and tokenizer files, of the family's code and
of ttbundle's conversion / lowering / template / backend code, plus the versions of ttbundle,
torch, transformers, vLLM and ttnn and the mesh. Equal keys mean `ttbundle build` has nothing
to do. Each artifact has its own key over the fields it depends on, so a changed bucket changes
one program's key and nothing else (:func:`artifact_keys`).

Checkpoint files are hashed once: the manifest records each file's size, mtime and inode with
its BLAKE3 digest, and a later build reuses the digest while those are unchanged (like git's
index). BLAKE3 (the ``blake3`` package, also vLLM's prefix-cache hash) rather than sha256: the
digest only identifies a build input, and it runs ~4x faster per core, which matters because a
first build hashes the whole checkpoint beside the conversion. Package files (``manifest.json``)
stay sha256, the format every verifier has.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from . import __version__
from .errors import InvalidInput
from .fsutil import MAX_TOKENIZER_BYTES, TEMPLATE_DIR, hash_file, read_user_json, user_file
from .package.names import TOKENIZER_FILES, TOKENIZER_MODEL_FILES, has_tokenizer
from .package.templates import render_bundle_yaml, resolved_spec
from .program import program_name
from .weights import shard_name

ROOT = Path(__file__).resolve().parent
# What each field is, for `cache explain`.
FIELDS = {
    "spec": "the resolved spec (sha256 of bundle.yaml)",
    "spec.model": "architecture dims",
    "spec.sharding": "resolved PartitionSpec per tensor and padding policies",
    "spec.dtypes": "storage dtype per tensor",
    "spec.buckets": "prefill/decode buckets and prefill_chunk",
    "spec.runtime": "runtime limits (KV cache, trace mode, ...)",
    "spec.card": "name and description",
    "weights": "BLAKE3 of the checkpoint files",
    "weights.format": "the checkpoint's quantization_config (config.json; quantized checkpoints only)",
    "weights.adapters": "sha256 of the LoRA adapters' files (weights.adapters; only when given)",
    "tokenizer": "BLAKE3 of the tokenizer files",
    "family_code": "source of the family module and the ttbundle modules it imports",
    "ttbundle": "ttbundle version",
    "code.convert": "weight conversion code (ttbundle.convert and every ttbundle module it imports)",
    "code.lower": "lowering code (ttbundle.lower and its imports)",
    "code.templates": "package templates and the small files' code (ttbundle.package.templates and its imports)",
    "code.backend": "warm-up code (ttbundle.warmup and its imports: the emulated backend)",
    "torch": "torch version",
    "transformers": "transformers version (config.json)",
    "vllm": "vLLM version",
    "ttnn": "ttnn version",
    "mesh": "target mesh",
    "backend": "build backend (ttnn builds add tensorbin/ weight caches)",
    "speculative.draft": "content key of the speculative draft's package, built into this one (speculative: {method: draft})",
    "kernel_cache": "SFPI compiler that filled tt-metal's kernel cache (ttnn builds; none: not filled)",
    "trace_region_size": "the trace region a ttnn build reserves (the traces' need + headroom, tracebudget): the KV pool is what is left beside it",
    "code.tensorbin": "tensorbin weight cache code (ttbundle.backends.ttnn.cache and its imports; ttnn builds)",
}
WEIGHTS_DEPS = ("spec.model", "spec.sharding", "spec.dtypes", "weights", "family_code", "ttbundle",
                "code.convert", "mesh", "weights.format", "weights.adapters")  # the last two: when present
PROGRAM_DEPS = ("spec.model", "spec.sharding", "spec.dtypes", "spec.runtime", "family_code",
                "ttbundle", "code.lower", "mesh", "trace_region_size")  # the last: ttnn builds
WARMUP_DEPS = ("code.backend", "torch")


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest(obj) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """Versions recorded in the manifest (installed distributions, not imported)."""
    return {"ttbundle": __version__, "python": ".".join(map(str, sys.version_info[:3])),
            "torch": dist_version("torch"), "transformers": dist_version("transformers"),
            "vllm": dist_version("vllm"), "ttnn": dist_version("ttnn"),
            "safetensors": dist_version("safetensors")}


def code_digest(paths, base: Path = ROOT.parent) -> str:
    """sha256 over ``paths`` (sorted; each as its path relative to ``base``, then its bytes)."""
    h = hashlib.sha256()
    for p in sorted({Path(p).resolve() for p in paths if p and Path(p).exists()}):
        rel = p.relative_to(base) if p.is_relative_to(base) else p.name
        h.update(str(rel).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def family_sources(family, root: Path = ROOT) -> list[Path]:
    """The family's module and every ttbundle module it imports (:func:`module_sources`): its
    base classes (``families/base.py``), shared parts (``families/moe.py``, ``transforms.py``), a
    family it extends (gemma3 -> gemma2), never the other families."""
    return module_sources([type(family).__module__], root)


# ---- code fields: the modules each artifact's producer imports -------------------------------------
# The module(s) that produce what each code field covers. The field hashes every ttbundle module
# they import, transitively (:func:`module_sources`), so no list of files is kept by hand and a
# module nothing here imports (the build's orchestration, transactions, progress bars, the CLI)
# changes no key.
PRODUCERS = {
    "code.convert": ("ttbundle.convert",),   # weights: streaming, shard cutting, block floats
    "code.lower": ("ttbundle.lower",),       # programs/<phase>-<bucket>.json
    "code.templates": ("ttbundle.package.templates",),  # small files (config.json, adapter, README) + *.j2
    "code.backend": ("ttbundle.warmup",),    # warm-up: the emulated backend and the reference it records
}
# The one module a walk does not enter: ``ttbundle.families``' ``__init__``, the registry that
# imports every family. Python runs it before any family module, but what a family computes does
# not depend on which others are registered; entering it would make every family's packages
# depend on every family's code. Its submodules (``families/base.py``, ...) are walked as usual.
WALK_SKIP = ("ttbundle.families",)


def _module_file(root: Path, name: str) -> Path | None:
    """The source file of ttbundle module ``name`` under ``root`` (the ``ttbundle`` directory)."""
    p = root.joinpath(*name.split(".")[1:])
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    return None


def _imported(tree, module: str, is_package: bool) -> list[str]:
    """Names of the ttbundle modules (and would-be modules: ``from .x import y`` gives ``.x.y``
    too) that ``tree`` imports anywhere, function bodies included; relative imports resolved."""
    pkg = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.partition(".")[0] == "ttbundle"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                if node.level - 1 >= len(parts):
                    continue  # beyond the top package: not ttbundle's
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.partition(".")[0] != "ttbundle":
                continue
            out.append(base)
            out += [f"{base}.{a.name}" for a in node.names if a.name != "*"]
    return out


def module_sources(modules, root: Path = ROOT) -> list[Path]:
    """The files of ``modules`` (``ttbundle.x`` names) and of every ttbundle module they import,
    transitively, read with ``ast`` (nothing is executed): ``import`` and ``from ... import``
    statements anywhere in a module (lazy imports inside functions count), relative imports
    resolved, ``from .x import y`` counting ``.x.y`` where that is a module, and the
    ``__init__.py`` of every package on the way (Python runs them). ``root`` is the ``ttbundle``
    directory to read (tests pass a copy)."""
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen or name in WALK_SKIP:
            continue
        f = _module_file(root, name)
        if f is None:
            continue  # a name imported from a module, not a module
        seen[name] = f
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += _imported(ast.parse(f.read_bytes(), str(f)), name, f.name == "__init__.py")
    return sorted(seen.values())


def code_fields(root: Path = ROOT, template_dir: Path = TEMPLATE_DIR) -> dict:
    """``code.*`` key fields: a digest of each producer's :func:`module_sources` (``code.templates``
    also of the package templates)."""
    out = {}
    for name, mods in PRODUCERS.items():
        files = module_sources(mods, root)
        if name == "code.templates":
            files += sorted(Path(template_dir).glob("*.j2"))
        out[name] = code_digest(files, Path(root).resolve().parent)
    return out


# ---- source files --------------------------------------------------------------------------------
def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's files: the index and the shards it names, or every ``*.safetensors``.
    An index naming a file outside the directory is refused."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.exists():
        user_file(index, "safetensors index", d, 64 << 20)  # before reading it: not /dev/zero
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidInput(f"{index}: not a safetensors index ({e})") from None
        for n in names:
            shard_name(index, n)
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise InvalidInput(f"{d}: index names missing shard files: {', '.join(missing)}")
        files = [index] + [d / n for n in names]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise InvalidInput(f"{d}: no *.safetensors files and no model.safetensors.index.json")
    for f in files:  # regular files inside the directory: never hash a device or a file elsewhere
        user_file(f, "checkpoint file", d)
    return files


def tokenizer_dir(bundle) -> Path | None:
    """The bundle's tokenizer directory (``spec.Bundle.tokenizer_dir``)."""
    return bundle.tokenizer_dir()


def check_tokenizer(bundle) -> None:
    """A package serves text only with a tokenizer: InvalidInput (at the spec's ``tokenizer:``)
    when the tokenizer directory has none of ``package.names.TOKENIZER_MODEL_FILES``, unless the spec
    says ``tokenizer: false`` (token ids only)."""
    if bundle.spec.tokenizer is False or bundle.spec.weights.source is None:
        return  # token ids only; no checkpoint: `compute` says weights.source is missing
    d = tokenizer_dir(bundle)
    if d is not None and has_tokenizer({p.name for p in tokenizer_files(bundle)}):
        return
    s = bundle.spec
    which = ("`tokenizer:`" if s.tokenizer is not None else "from_hf's directory" if s.from_hf is not None
             else "weights.source (no `tokenizer:` given)")
    raise InvalidInput(f"{bundle.file}: no tokenizer", [bundle.locate(
        ("tokenizer",) if s.tokenizer is not None else (), f"{which}: {d} has none of "
        f"{', '.join(TOKENIZER_MODEL_FILES)}, so vLLM could not serve text; set `tokenizer:` to the "
        "directory (or model id) that has the model's tokenizer, or `tokenizer: false` to build a "
        "package that serves token ids only (vLLM's --skip-tokenizer-init)")])


def tokenizer_files(bundle) -> list[Path]:
    d = tokenizer_dir(bundle)
    if d is None:
        return []
    # present ones only; each must be a regular file inside the directory (symlinks out refused)
    return [d / n for n in TOKENIZER_FILES
            if os.path.lexists(d / n) and user_file(d / n, "tokenizer file", d, MAX_TOKENIZER_BYTES)]


def _stat_key(p: Path) -> dict:
    st = os.stat(p)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def source_records(files: list[Path], previous: list[dict] | None, base: Path) -> list[dict]:
    """``{"name", "size", "mtime_ns", "ino", "blake3"}`` per file; the digest reused from
    ``previous`` when size, mtime and inode match, else None (see :func:`fill_digests`)."""
    prev = {(r.get("dir"), r["name"]): r for r in (previous or [])}
    out = []
    for p in files:
        rec = {"dir": str(base), "name": p.name, **_stat_key(p)}
        old = prev.get((rec["dir"], rec["name"]))
        same = old and all(old.get(k) == rec[k] for k in ("size", "mtime_ns", "ino"))
        rec["blake3"] = old.get("blake3") if same else None
        out.append(rec)
    return out


def blake3_file(path: Path) -> str:
    import blake3
    return hash_file(path, blake3.blake3())


def fill_digests(records: list[dict], on_bytes=None) -> None:
    """Hash every record still without a digest (reads each file once, 4 MiB at a time)."""
    for r in records:
        if r["blake3"] is None:
            p = Path(r["dir"]) / r["name"]
            r["blake3"] = blake3_file(p)
            if on_bytes:
                on_bytes(r["size"])


def sources_digest(records: list[dict]) -> str:
    return digest([[r["name"], r["blake3"]] for r in records])


# ---- key fields ----------------------------------------------------------------------------------
@dataclass
class Inputs:
    """Everything the key is computed from, for one bundle on one mesh."""

    resolved: dict
    bundle_yaml: str
    fields: dict  # field -> value (None while a source digest is pending)
    weight_records: list[dict]
    tokenizer_records: list[dict]
    weights_dir: Path
    traces: list = field(default_factory=list)

    def finish(self) -> None:
        """Fill the source-derived fields once every digest is known."""
        self.fields["weights"] = sources_digest(self.weight_records)
        self.fields["tokenizer"] = sources_digest(self.tokenizer_records)

    @property
    def pending(self) -> bool:
        return any(r["blake3"] is None for r in self.weight_records + self.tokenizer_records)


def compute(bundle, plan, previous: dict | None, traces: list) -> Inputs:
    """Key inputs of ``bundle`` on ``plan.mesh``, whose programs are ``traces`` ((phase, bucket)
    pairs, ``lower.trace_set``: the build passes them, this module does not lower); source digests
    come from ``previous``'s stat cache where possible (``Inputs.pending`` says whether any file
    still needs hashing)."""
    s = bundle.spec
    if s.weights.source is None:
        raise InvalidInput(f"{bundle.file}: weights.source is not set; `ttbundle build` converts a "
                           "checkpoint (write a plan-only spec's weights first)")
    wdir = bundle.resolve_path(s.weights.source)
    resolved = resolved_spec(bundle, plan)
    text = render_bundle_yaml(resolved, __version__)
    prev_src = (previous or {}).get("sources", {})
    wrec = source_records(weight_files(wdir), prev_src.get("weights"), wdir.resolve())
    tfiles = tokenizer_files(bundle)
    trec = source_records(tfiles, prev_src.get("tokenizer"), tfiles[0].parent.resolve()) if tfiles else []
    m = plan.mesh
    f = {
        "spec": hashlib.sha256(text.encode()).hexdigest(),
        "spec.model": digest(resolved["model"]),
        "spec.sharding": digest({k: v for k, v in resolved["sharding"].items()}),
        "spec.dtypes": digest({t.name: t.dtype for t in plan.tensors}),
        "spec.buckets": digest(resolved["buckets"]),
        "spec.runtime": digest(resolved["runtime"]),
        "spec.card": digest([resolved["name"], resolved.get("description", "")]),
        "weights": None,
        "tokenizer": None,
        "family_code": code_digest(family_sources(bundle.family)),
        "ttbundle": __version__,
        "torch": dist_version("torch"),
        "transformers": dist_version("transformers"),
        "vllm": dist_version("vllm"),
        "ttnn": dist_version("ttnn") or "not installed",
        "mesh": f"{m.name} {m.rows}x{m.cols} {m.chip.arch}",
    }
    f.update(code_fields())
    f.update(format_fields(bundle, wdir))
    inp = Inputs(resolved, text, f, wrec, trec, wdir, list(traces))
    if not inp.pending:
        inp.finish()
    return inp


def format_fields(bundle, wdir: Path) -> dict:
    """What else the converted weights depend on, only where it is there (other packages' keys
    stay as they were): the checkpoint's ``quantization_config`` and the LoRA adapters' files."""
    out = {}
    cfg = wdir / "config.json"
    if cfg.is_file():
        c = read_user_json(cfg, "config.json", inside=wdir)  # as weights.Checkpoint reads it
        q = c.get("quantization_config") if isinstance(c, dict) else None
        if q:
            out["weights.format"] = digest(q)
    if bundle.spec.weights.adapters:
        recs = []
        for p in bundle.spec.weights.adapters:
            d = bundle.resolve_path(p)
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                f = d / name
                if not f.is_file():
                    raise InvalidInput(f"{bundle.file}: weights.adapters: {d} has no {name} (a PEFT LoRA adapter "
                                       "directory holds adapter_config.json and adapter_model.safetensors)")
                recs.append([str(d), name, hash_file(f, hashlib.sha256())])
        out["weights.adapters"] = digest(recs)
    return out


def content_key(fields: dict) -> str:
    if any(v is None for v in fields.values()):
        raise RuntimeError("content key asked for before every source digest is known")
    return digest(fields)


def artifact_keys(fields: dict, traces) -> dict:
    """Key per artifact: ``weights``, ``program:<phase>-<bucket>``, ``warmup:<phase>-<bucket>``."""
    keys = {"weights": digest({k: fields[k] for k in WEIGHTS_DEPS if k in fields})}
    for phase, b in traces:
        name = program_name(phase, b)
        pk = digest({**{k: fields[k] for k in PROGRAM_DEPS if k in fields}, "phase": phase, "bucket": b})
        keys[f"program:{name}"] = pk
        keys[f"warmup:{name}"] = digest({"program": pk, "weights": keys["weights"],
                                         **{k: fields[k] for k in WARMUP_DEPS}})
    return keys


def backend_fields(inp, backend: str, sfpi_key: str | None = None, trace_region_size: int | None = None) -> None:
    """A ttnn build is a different package (it adds tensorbin/ and maybe kernel_cache/): its key
    says so, and which SFPI compiler filled the kernel cache (``none``: not filled; a host that
    gains SFPI rebuilds it). Emulated builds add no field, so their keys are what they were
    before backends existed."""
    if backend != "emulated":
        inp.fields["backend"] = backend
        # the caches' format and writer: a new one rebuilds them (never an old index read as new)
        inp.fields["code.tensorbin"] = code_digest(module_sources(["ttbundle.backends.ttnn.cache"]))
        if sfpi_key is not None:
            inp.fields["kernel_cache"] = sfpi_key
        if trace_region_size:  # the plan's KV pool (in every program) is what is left beside it
            inp.fields["trace_region_size"] = trace_region_size
