"""Writing a package's weight files: a safetensors file streamed front to back (:class:`ShardFile`,
its header computed up front from the declared entries, sha256 on the fly, writeback started as
it goes) and the bytes each shard takes in it (:func:`encoded_nbytes`)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import os
import struct
from pathlib import Path

from .. import blockfloat
from ..tiles import ELEM_BYTES

#: the safetensors dtype a shard of each encoding is stored as (block floats: raw tile bytes)
ST_DTYPE = {"bf16": "BF16", "bfp8": "U8", "bfp4": "U8"}


def encoded_nbytes(shape: list[int], dtype: str) -> int:
    """Bytes of one shard in the file: bf16 elements, or whole block-float tiles."""
    if dtype == "bf16":
        return math.prod(shape) * ELEM_BYTES["bf16"]
    return blockfloat.encoded_bytes(shape, dtype)


WRITE_PIECE = 1 << 19
WRITEBACK_EVERY = 16 << 20


@functools.cache
def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None."""
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
        self.i = self.part = 0  # the tensor being written, its bytes written so far
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
        """Append ``buf`` to tensor ``name``: its whole bytes, or the next piece of them (an
        expert stack is written a few experts at a time); the next tensor starts once they are
        all written."""
        if self.i >= len(self.order):
            raise RuntimeError(f"{self.path}: every tensor is written, got more for {name}")
        want, nbytes = self.order[self.i]
        got = memoryview(buf).nbytes
        if name != want or self.part + got > nbytes:
            raise RuntimeError(f"{self.path}: expected {want} ({nbytes - self.part} B more), got {name} ({got} B)")
        self._put(buf)
        self.part += got
        if self.part == nbytes:
            self.i, self.part = self.i + 1, 0

    def close(self) -> tuple[str, int]:
        if self.i != len(self.order):
            raise RuntimeError(f"{self.path}: {len(self.order) - self.i} tensors not written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.h.hexdigest(), self.size

    def abort(self) -> None:
        self.f.close()
