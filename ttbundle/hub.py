"""Where a model comes from: a directory, a Hugging Face hub-cache snapshot, or a model id.

``--from-hf`` and the spec's ``from_hf`` / ``weights.source`` / ``tokenizer`` take any of:

- a directory (relative paths: to the current directory for ``--from-hf``, to the spec file in
  a spec);
- a hub-cache snapshot, ``.../models--ORG--NAME/snapshots/REV/``, where huggingface_hub keeps
  every file as a symlink to ``../../blobs/HASH`` (:func:`snapshot_of` recognises one;
  ``fsutil.input_root`` lets its files resolve inside that ``models--ORG--NAME`` folder only);
- a model id ``ORG/NAME[@REVISION]``, resolved as vLLM resolves one: a path that exists is a
  path; otherwise huggingface_hub's ``snapshot_download`` in its cache (``HF_HUB_CACHE`` /
  ``HF_HOME``), local files only under ``HF_HUB_OFFLINE=1`` (read by huggingface_hub when it is
  first imported, as vLLM reads it), else downloading what ttbundle reads (:data:`ALLOW`).

This module owns those rules; ``init``, ``spec`` (path resolution), ``build`` (through the
bundle's paths), ``check`` and ``fsutil`` ask it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidInput

#: a Hugging Face model id ``ORG/NAME`` (what the spec's ``hf_model`` holds)
HF_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
#: a revision after ``@``: a branch, tag or commit hash (``refs/pr/1`` included)
REVISION_RE = re.compile(r"[\w.-]+(?:/[\w.-]+)*")
#: the files of a repo ttbundle reads: config, checkpoint, tokenizer and generation config, the
#: image processor's config (``snapshot_download``'s ``allow_patterns``; no ``*.bin``/``*.pth``)
ALLOW = ("*.json", "*.safetensors", "tokenizer.model", "merges.txt", "*.jinja", "*.tiktoken")


@dataclass(frozen=True)
class Snapshot:
    """A hub-cache snapshot: the repo it belongs to, its ``models--ORG--NAME`` folder and the
    snapshot directory (named by the commit hash)."""

    repo_id: str
    folder: Path
    path: Path

    @property
    def name(self) -> str:
        """The model's own name (``NAME`` of ``ORG/NAME``)."""
        return self.repo_id.rsplit("/", 1)[-1]


def snapshot_of(path: str | Path) -> Snapshot | None:
    """The hub-cache snapshot ``path`` (a directory, symlinks resolved) is or lies in, if any:
    ``<cache>/models--ORG--NAME/snapshots/<rev>[/...]`` with the folder named as huggingface_hub
    names a model repo's folder (``repo_folder_name``)."""
    try:
        p = Path(path).resolve()
    except (OSError, RuntimeError):
        return None
    for d in (p, *p.parents):
        if d.parent.name == "snapshots" and d.parent.parent != d.parent:
            repo = _repo_of_folder(d.parent.parent.name)
            if repo is not None:
                return Snapshot(repo, d.parent.parent, d)
    return None


def _repo_of_folder(folder: str) -> str | None:
    """``models--ORG--NAME`` -> ``ORG/NAME``, when huggingface_hub would name that repo's folder so."""
    from huggingface_hub.constants import REPO_ID_SEPARATOR
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import validate_repo_id

    prefix = "models" + REPO_ID_SEPARATOR
    if not folder.startswith(prefix):
        return None
    repo = folder[len(prefix):].replace(REPO_ID_SEPARATOR, "/")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo if repo_folder_name(repo_id=repo, repo_type="model") == folder else None


def model_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` when ``text`` is written as a model id
    ``ORG/NAME[@REVISION]``; None for anything else (absolute or dotted paths, more than one
    ``/`` before ``@``)."""
    repo, at, rev = str(text).partition("@")
    if not HF_ID_RE.fullmatch(repo) or ".." in repo or repo.endswith("."):
        return None
    if at and not (REVISION_RE.fullmatch(rev) and ".." not in rev):
        return None
    return repo, (rev if at else None)


@dataclass(frozen=True)
class Source:
    """A resolved model reference: the directory, and the model id when it was resolved as one."""

    path: Path
    model: tuple[str, str | None] | None = None


class NotCached(InvalidInput):
    """A model id whose snapshot is not in the hub cache. ``final``: nothing later will fetch it
    (HF_HUB_OFFLINE, or the download itself failed); else only a look-up that does not download
    (``validate``) missed it, and a build will download it."""

    def __init__(self, message: str, final: bool):
        super().__init__(message)
        self.final = final


def resolve(ref: str | Path, base: str | Path = ".", download: bool = True) -> Source:
    """What ``ref`` (a user's path or model id) names, relative paths taken from ``base``: the
    path when it exists (a path that exists is a path, as for vLLM and transformers), else the
    snapshot of the model id it is written as (:func:`snapshot`), else the path as given (the
    caller says it does not exist). ``download=False`` never downloads (``validate``)."""
    p = Path(base) / ref
    try:
        exists = p.exists()
    except OSError:  # ENAMETOOLONG, ELOOP: the caller's own check reports it
        return Source(p)
    mid = None if exists else model_id(str(ref))
    if mid is None:
        return Source(p)
    return Source(snapshot(*mid, download=download, path=p), mid)


_memo: dict[tuple, Path] = {}


def snapshot(repo_id: str, revision: str | None = None, download: bool = True,
             path: Path | None = None) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` (default: ``main``) through
    huggingface_hub's ``snapshot_download``: from its cache only under ``HF_HUB_OFFLINE`` or
    without ``download``, else fetched (only :data:`ALLOW`). Every failure is InvalidInput
    saying what to do (:class:`NotCached` when the cache lacks it); ``path`` is the directory
    the same text would have named, for the message."""
    import huggingface_hub.constants as hc
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, HfHubHTTPError,
                                        IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    offline = bool(hc.HF_HUB_OFFLINE)
    local = offline or not download
    key = (repo_id, revision, local, hc.HF_HUB_CACHE)
    if key in _memo and _memo[key].is_dir():
        return _memo[key]
    rev = f"@{revision}" if revision else ""
    what = f"{repo_id}{rev}"
    nodir = f"no directory {path}, and " if path is not None else ""
    get = f"`hf download {repo_id}{f' --revision {revision}' if revision else ''}`"
    try:
        got = Path(snapshot_download(repo_id, revision=revision, local_files_only=local,
                                     allow_patterns=list(ALLOW)))
    except (LocalEntryNotFoundError, IncompleteSnapshotError) as e:
        why = ("HF_HUB_OFFLINE=1: nothing is downloaded" if offline else
               "validation does not download; `ttbundle build` or `check` will" if not download
               else f"downloading failed: {e}")
        part = "an incomplete" if isinstance(e, IncompleteSnapshotError) else "no"
        raise NotCached(f"{what}: {nodir}{part} snapshot of model {what} in the Hugging Face cache "
                        f"{hc.HF_HUB_CACHE} ({why}); download it ({get}), point HF_HUB_CACHE or "
                        "HF_HOME at the cache holding it, or give the model's directory",
                        offline or download) from None
    except GatedRepoError as e:
        raise InvalidInput(f"{what}: the model is gated on the Hugging Face Hub: accept its licence "
                           f"there and log in (`hf auth login`) ({e})") from None
    except RevisionNotFoundError:
        raise InvalidInput(f"{what}: model {repo_id} has no revision {revision!r} on the Hugging "
                           "Face Hub; give a branch, tag or commit hash it has") from None
    except RepositoryNotFoundError:
        raise InvalidInput(f"{what}: {nodir}no model {repo_id} on the Hugging Face Hub (or it is "
                           "private: log in with `hf auth login`)") from None
    except HFValidationError as e:
        raise InvalidInput(f"{what}: not a Hugging Face model id ({e})") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise InvalidInput(f"{what}: cannot fetch it from the Hugging Face Hub ({e}); download it "
                           f"({get}) or give the model's directory") from None
    _memo[key] = got
    return got
