"""The package's names: format versions, the error a bad package raises, and the names of its
directory (``OUT/<mesh>/<bundle>``), adapter module, weight files and tensors. Every other module
of ``ttbundle.package`` builds on these."""

from __future__ import annotations

import hashlib
import keyword
import os
import re
from pathlib import Path

from ..errors import InvalidInput, TTBundleError

# /2: a shard several devices hold is stored once (weights ``stored_in``); /3: the programs
# record the family's traits (``ttbundle.program/3``); /4: and the model's dims and max_model_len
# (``ttbundle.program/4``), so older packages are refused: rebuild them
FORMAT = "ttbundle.package/4"
FORMATS = (FORMAT,)
WEIGHTS_FORMAT = "ttbundle.weights/2"
WEIGHTS_FORMATS = ("ttbundle.weights/1", WEIGHTS_FORMAT)
#: where a package holds its speculative draft's package (``speculative: {method: draft}``): a
#: whole package of its own (manifest, programs, weights), every file also listed in the
#: including package's manifest
DRAFT_DIR = "draft"
#: check records kept with a package (``ttbundle check PACKAGE`` writes ``checks/<dtype>.json``):
#: data bound to the manifest's digest, not part of the manifest, so recording a check changes
#: no hash; ``verify`` allows regular ``.json`` files of at most ``CHECK_RECORD_BYTES`` here
CHECKS_DIR = "checks"
CHECK_RECORD_BYTES = 1 << 20
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


# ---- weights files -------------------------------------------------------------------------------
def weight_file(d: int) -> str:
    return f"weights/device-{d:03d}.safetensors"


def tensor_key(name: str, layer: int | None) -> str:
    return name if layer is None else f"{name}.{layer}"
