"""Files: atomic writes (temp file beside the target, fsync, rename), reading user input files,
hashing a file, and where the jinja2 templates live."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
from pathlib import Path

from .errors import InvalidInput, TTBundleError
from .hub import snapshot_of


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """``data`` into ``path`` through a temp file beside it, fsynced, then renamed over it. A
    ``path`` that exists and is not a regular file or a symlink (``/dev/null``, a FIFO, a
    directory) is InvalidInput: renaming over it would replace the device node itself."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise TTBundleError(f"cannot write {path}: {e.strerror or e}") from None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise InvalidInput(f"{path}: exists and is not a regular file; give a file path to write")
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


@contextlib.contextmanager
def locked(path: str | Path):
    """An exclusive ``flock`` on ``path`` (created, kept: removing a lock file while another
    process waits on it would let a third take a different one) for a read-modify-write of files
    beside it that several processes may do at once; released on exit and when the process dies.
    A lock that cannot be created is a TTBundleError naming it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666 & ~_umask())
    except OSError as e:
        raise TTBundleError(f"cannot lock {path}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


#: Size limits of user input files (a real spec is a few KiB, a config.json a few KiB, the
#: largest published tokenizer.json about 35 MiB).
MAX_TEXT_BYTES = 16 << 20
MAX_TOKENIZER_BYTES = 256 << 20


def input_root(directory: str | Path) -> Path:
    """Where the files of a user's input ``directory`` may resolve to (symlinks followed): the
    directory itself, or, for a Hugging Face hub-cache snapshot (``models--ORG--NAME/snapshots/
    REV``, every file a symlink to ``../../blobs/HASH``), that repo's ``models--ORG--NAME``
    folder (``hub.snapshot_of``) and nothing outside it."""
    root = Path(directory).resolve()
    snap = snapshot_of(root)
    return snap.folder if snap is not None else root


def user_file(path: str | Path, what: str, inside: str | Path | None = None,
              max_bytes: int | None = None) -> Path:
    """``path`` checked as a user input file and resolved: it exists, is a regular file (not a
    device, FIFO or directory), is at most ``max_bytes``, and, with ``inside``, resolves within
    :func:`input_root` of that directory once symlinks are followed (``tokenizer.json ->
    /proc/self/environ`` is refused; a hub-cache snapshot's links into its own blobs are not).
    Every failure is InvalidInput naming the file and what to do."""
    path = Path(path)
    try:
        real = path.resolve(strict=True)
        st = os.stat(real)
    except FileNotFoundError:
        raise InvalidInput(f"{path}: no such {what}") from None
    except (OSError, RuntimeError) as e:  # ENAMETOOLONG, ELOOP, EACCES, a symlink loop
        raise InvalidInput(f"{path}: cannot read {what}: {getattr(e, 'strerror', None) or e}") from None
    if inside is not None:
        root = input_root(inside)
        if not real.is_relative_to(root):
            where = (f"its hub-cache folder {root}" if root != Path(inside).resolve() else str(root))
            raise InvalidInput(f"{path}: the {what} is a symlink to {real}, outside {where}; copy the "
                               f"file itself into {inside}")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInput(f"{path}: the {what} is not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise InvalidInput(f"{path}: the {what} is {st.st_size:,} B, more than the {max_bytes:,} B "
                           "a ttbundle input may be")
    return real


def read_user_bytes(path: str | Path, what: str, inside: str | Path | None = None,
                    max_bytes: int = MAX_TEXT_BYTES) -> bytes:
    """A user input file's bytes, checked by :func:`user_file` and read from the descriptor the
    check was made on (no symlink followed between the check and the read)."""
    real = user_file(path, what, inside, max_bytes)
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise InvalidInput(f"{path}: the {what} is not a regular file")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read {what}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise InvalidInput(f"{path}: the {what} grew past {max_bytes:,} B while being read")
    return data


def read_user_text(path: str | Path, what: str, inside: str | Path | None = None,
                   max_bytes: int = MAX_TEXT_BYTES) -> str:
    """A user's input file as UTF-8 text; a missing, unreadable, oversized or non-regular file is
    InvalidInput naming it."""
    data = read_user_bytes(path, what, inside, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{path}: cannot read {what}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _no_duplicates(where: str):
    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise InvalidInput(f"{where}: key {k!r} appears twice; keep one")
            out[k] = v
        return out
    return pairs


def strict_json(text: str, where: str):
    """JSON that ttbundle itself writes, read back strictly: a duplicate key (which plain JSON
    readers resolve silently, last wins), ``NaN``/``Infinity`` or broken syntax is InvalidInput
    naming ``where``."""
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates(where))
    except (ValueError, RecursionError) as e:
        raise InvalidInput(f"{where}: not readable JSON: {e}") from None


def read_user_json(path: str | Path, what: str, inside: str | Path | None = None,
                   max_bytes: int = MAX_TEXT_BYTES):
    """A user's JSON file (``NaN``/``Infinity`` refused, integers bounded by Python's digit
    limit); any failure is InvalidInput naming the file."""
    text = read_user_text(path, what, inside, max_bytes)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise InvalidInput(f"{path}: not readable JSON: {e}") from None


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
