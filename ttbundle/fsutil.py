"""Files: atomic writes (temp file beside the target, fsync, rename), reading user input files,
hashing a file, and where the jinja2 templates live."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import InvalidInput, TTBundleError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; honour the umask like open()
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
    except OSError as e:
        raise TTBundleError(f"cannot write {path}: {e.strerror or e}") from None


def read_user_text(path: str | Path, what: str) -> str:
    """A user's input file as text; a missing or unreadable file is InvalidInput naming it."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidInput(f"{path}: no such {what}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{path}: cannot read {what}: {e}") from None


def hash_file(path: str | Path, h, chunk: int = 1 << 22) -> str:
    """``h`` (a hashlib-style object: sha256, blake3, ...) over the file's bytes, read 4 MiB at a
    time into one reused buffer; its hex digest."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _template_dir() -> Path:
    """``templates/`` of a source checkout (editable installs), else the copy a wheel ships as
    the ``ttbundle._templates`` package (pyproject's package-dir)."""
    here = Path(__file__).resolve().parent
    src = here.parent / "templates"
    if (src / "adapter.py.j2").is_file():
        return src
    return here / "_templates"


TEMPLATE_DIR = _template_dir()


# a test hook: called with a stage name at every point a build can be interrupted (``fault``)
fault_hook = None


def fault(stage: str) -> None:
    if fault_hook is not None:
        fault_hook(stage)
