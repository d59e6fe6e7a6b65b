"""Build transactions: one build of a package at a time (an ``fcntl`` lock beside the packages),
a temp directory for the new package, and one atomic exchange (renameat2) with the old one, so a
build killed at any point leaves the previous package whole; ``_recover`` undoes what a killed
build left. Nothing here shapes a package's contents: no content key depends on this module."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

from .errors import InvalidInput
from .fsutil import fault as _fault
from .manifest import MANIFEST, METADATA

STATE_DIR = ".ttbundle"  # under out_dir: locks and temp dirs (not a package folder)

Progress = Callable[[dict], None]


class _Lock:
    """An exclusive ``flock`` on a file beside the packages; released when the process dies."""

    def __init__(self, path: Path, emit: Progress):
        self.path, self.emit = path, emit

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.emit({"event": "waiting", "lock": str(self.path)})
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


@contextlib.contextmanager
def lock_unless_read_only(path: Path, emit: Progress):
    """The build lock (:class:`_Lock`), yielding None; where the output cannot be written at all
    (a read-only file system or directory: the lock cannot be created), nothing takes it and the
    OSError is yielded instead: no build can change the package there, so the caller may still
    report it up to date, and raises the error only if it would have to write."""
    lock = _Lock(path, emit)
    try:
        lock.__enter__()
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        yield e
        return
    try:
        yield None
    finally:
        lock.__exit__(None, None, None)


def _tag(pkg: Path) -> str:
    """``<mesh>@<bundle>``: names this package's lock and temp dirs ('@' is in neither name, so
    one package's prefix never matches another's)."""
    return f"{pkg.parent.name}@{pkg.name}"


def _check_replaceable(pkg: Path) -> None:
    """Refuse to replace anything at the package path that is not a package (or empty)."""
    if not os.path.lexists(pkg):
        return
    if pkg.is_symlink() or not pkg.is_dir():
        raise InvalidInput(f"{pkg} exists and is not a package directory (a file or a symlink); "
                           "remove it or choose another -o")
    names = {p.name for p in pkg.iterdir()}
    if names and not names & {MANIFEST, METADATA}:
        raise InvalidInput(f"{pkg} exists and is not a ttbundle package; remove it or choose another -o")


def _recover(state: Path, pkg: Path) -> None:
    """Under the lock: undo a fallback swap cut short, and delete temp dirs of killed builds."""
    old = state / "tmp" / f"{_tag(pkg)}@old"
    if old.exists() and not pkg.exists():
        os.rename(old, pkg)
    tmpdir = state / "tmp"
    if tmpdir.is_dir():
        for d in tmpdir.iterdir():
            if d.name.startswith(f"{_tag(pkg)}@"):
                shutil.rmtree(d, ignore_errors=True)


_RENAME_EXCHANGE = 2
_libc = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    global _libc
    try:
        _libc = _libc or ctypes.CDLL(None, use_errno=True)
        fn = _libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(e, f"renameat2({a}, {b}): {os.strerror(e)}")


def _fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap(tmp: Path, pkg: Path, state: Path) -> None:
    pkg.parent.mkdir(parents=True, exist_ok=True)
    if not pkg.exists():
        os.rename(tmp, pkg)
        _fsync_dir(pkg.parent)
        _fault("after-swap")
        return
    if _exchange(tmp, pkg):
        _fsync_dir(pkg.parent)
        _fault("after-swap")
        shutil.rmtree(tmp)  # the previous package, now at the temp path
        return
    # no renameat2 (not Linux, or the filesystem refuses): two renames; _recover() undoes a
    # build killed between them
    old = state / "tmp" / f"{_tag(pkg)}@old"
    os.rename(pkg, old)
    _fault("mid-swap")
    os.rename(tmp, pkg)
    _fsync_dir(pkg.parent)
    shutil.rmtree(old)

