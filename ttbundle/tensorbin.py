"""ttnn ``.tensorbin`` files (``ttnn.dump_tensor`` / ``ttnn.load_tensor``) without ttnn.

Layout of a file (ttnn 0.81.1; checked by tests/tt/test_tensorbin_ttnn.py):

* 8 bytes: little-endian length ``L`` of the header;
* ``L`` bytes: a FlatBuffer, root table ``tt.tt_metal.flatbuffer.Tensor`` (tt-metal's
  ``tt_metal/impl/tensor/flatbuffer/{tensor,tensor_spec,tensor_topology,mesh_shape}.fbs``)::

      Tensor        { tensor_spec: TensorSpec; mesh_shape: MeshShape; shards: [TensorShard];
                      tensor_topology: TensorTopology }
      TensorSpec    { shape: [uint32]; tensor_layout: TensorLayout }
      TensorLayout  { data_type: ubyte; page_config: union {RowMajorPageConfig, TilePageConfig};
                      memory_config: MemoryConfig; alignment: [uint32] }
      TilePageConfig{ tile: Tile { tile_shape_h, tile_shape_w: uint32; transpose_tile: bool } }
      TensorShard   { buffer: union {InlineFileStorage struct {offset, size: uint64}};
                      mesh_coordinate: MeshCoordinate { values: [uint32] } }
      TensorTopology{ distribution_shape: MeshShape; placements: [MeshMapperPlacement
                      { type: ubyte; tensor_dim: int }]; mesh_coords: [MeshCoordinate] }

* the data region: each shard's raw bytes at ``offset`` (from the region's start) — for TILE
  layout exactly the tiles :func:`ttbundle.blockfloat.encode` produces.

:func:`write` emits one host shard (a single-device, replicated tensor, as ``dump_tensor``
writes a host tensor); multi-device files are read but not written yet.
"""

from __future__ import annotations

#: the ttnn version whose file format this module writes and reads (a cache's identity records it)
TTNN_VERSION = "0.81.1"

import struct
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InvalidInput

# TensorSpec.tensor_layout.data_type
DTYPES = {"bf16": 0, "f32": 1, "uint32": 2, "bfp8": 3, "bfp4": 4, "uint8": 5, "uint16": 6, "int32": 7}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ROW_MAJOR, _TILE = 1, 2  # PageConfig union types
_INLINE_FILE_STORAGE = 1  # TensorBuffer union type
_TILE_ALIGNMENT = [32, 32]


@dataclass
class Shard:
    """One device's buffer: ``size`` bytes at ``offset`` in the data region."""

    coord: list[int]
    offset: int
    size: int


@dataclass
class Header:
    """What a ``.tensorbin`` header says (the fields ttbundle uses)."""

    shape: list[int]
    dtype: str
    layout: str  # "TILE" | "ROW_MAJOR"
    tile: tuple[int, int] | None
    alignment: list[int]
    mesh_shape: list[int]
    shards: list[Shard] = field(default_factory=list)
    data_start: int = 0  # file offset of the data region


# ---- writing -----------------------------------------------------------------------------------
class _Table:
    """A table to serialize: ``fields[i]`` is field id ``i`` (``None`` = absent/default)."""

    def __init__(self, *fields):
        self.fields = fields


class _Scalar:
    def __init__(self, fmt: str, value):
        self.fmt, self.value = fmt, value


class _Vec:
    """A vector of scalars (``fmt``) or of tables (``fmt=None``)."""

    def __init__(self, items, fmt: str | None):
        self.items, self.fmt = list(items), fmt


class _Struct:
    """A struct stored out of line (a union member): raw bytes with an alignment."""

    def __init__(self, data: bytes, align: int):
        self.data, self.align = data, align


class _Builder:
    """Front-to-back FlatBuffer writer: every object's children go after it, so all uoffsets are
    forward; each table's vtable directly precedes it (a positive soffset)."""

    def __init__(self):
        self.buf = bytearray(4)  # root uoffset, patched in finish()

    def _align(self, n: int):
        self.buf += bytes(-len(self.buf) % n)

    def _patch(self, at: int, target: int):
        struct.pack_into("<I", self.buf, at, target - at)

    def finish(self, root: _Table) -> bytes:
        self._patch(0, self.table(root))
        self._align(8)
        return bytes(self.buf)

    def table(self, t: _Table) -> int:
        # inline layout: soffset, then scalars, then uoffsets (each at its natural alignment)
        slots, size = [], 4
        for i, v in enumerate(t.fields):
            if v is None:
                continue
            n = struct.calcsize("<" + v.fmt) if isinstance(v, _Scalar) else 4
            size += -size % n
            slots.append((i, v, size))
            size += n
        size += -size % 4
        vt = struct.pack("<HH", 4 + 2 * len(t.fields), size)
        offs = {i: off for i, _, off in slots}
        vt += b"".join(struct.pack("<H", offs.get(i, 0)) for i in range(len(t.fields)))
        vt_pos = len(self.buf)
        self.buf += vt
        self._align(8)
        pos = len(self.buf)
        self.buf += bytes(size)
        struct.pack_into("<i", self.buf, pos, pos - vt_pos)
        refs = []
        for _, v, off in slots:
            if isinstance(v, _Scalar):
                struct.pack_into("<" + v.fmt, self.buf, pos + off, v.value)
            else:
                refs.append((pos + off, v))
        for at, v in refs:
            self._patch(at, self.object(v))
        return pos

    def object(self, v) -> int:
        if isinstance(v, _Table):
            return self.table(v)
        if isinstance(v, _Struct):
            self._align(v.align)
            pos = len(self.buf)
            self.buf += v.data
            return pos
        # vector: length, then elements
        self._align(8)
        pos = len(self.buf)
        if v.fmt is not None:
            self.buf += struct.pack(f"<I{len(v.items)}{v.fmt}", len(v.items), *v.items)
            return pos
        self.buf += struct.pack("<I", len(v.items)) + bytes(4 * len(v.items))
        for k, item in enumerate(v.items):
            self._patch(pos + 4 + 4 * k, self.object(item))
        return pos


def header_bytes(shape, dtype: str, layout: str, size: int) -> bytes:
    """The FlatBuffer header of a single-shard host tensor whose data is ``size`` bytes."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    if layout == "TILE":
        page = _Table(_Table(_Scalar("I", 32), _Scalar("I", 32), None))  # TilePageConfig{Tile}
        page_type, alignment = _TILE, _TILE_ALIGNMENT
    elif layout == "ROW_MAJOR":
        if dtype in ("bfp8", "bfp4"):
            raise ValueError(f"{dtype} needs TILE layout")
        page, page_type, alignment = _Table(), _ROW_MAJOR, [1]
    else:
        raise ValueError(f"unknown layout {layout!r}: expected TILE or ROW_MAJOR")
    coord = _Table(_Vec([0, 0], "I"))
    spec = _Table(
        _Vec([int(s) for s in shape], "I"),
        _Table(_Scalar("B", DTYPES[dtype]), _Scalar("B", page_type), page,
               _Table(),  # MemoryConfig: interleaved DRAM (all defaults)
               _Vec(alignment, "I")))
    shard = _Table(_Scalar("B", _INLINE_FILE_STORAGE), _Struct(struct.pack("<QQ", 0, size), 8), coord)
    topology = _Table(_Table(_Vec([1], "I")),  # distribution_shape
                      _Vec([_Table(None, _Scalar("i", -1))], None),  # [Replicate]
                      _Vec([_Table(_Vec([0, 0], "I"))], None))
    root = _Table(spec, _Table(_Vec([1, 1], "I")), _Vec([shard], None), topology)
    return _Builder().finish(root)


def write(path: str | Path, data: bytes, shape, dtype: str, layout: str = "TILE") -> None:
    """Write ``data`` (TILE: :func:`ttbundle.blockfloat.encode`'s bytes, or tilized bf16/f32) as
    a ``.tensorbin`` that ``ttnn.load_tensor`` reads as a host tensor of ``shape``."""
    head = header_bytes(shape, dtype, layout, len(data))
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        fh.write(data)


# ---- reading -----------------------------------------------------------------------------------
class _Reader:
    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        vt = pos - struct.unpack_from("<i", buf, pos)[0]
        vsize = struct.unpack_from("<H", buf, vt)[0]
        self.offs = struct.unpack_from(f"<{(vsize - 4) // 2}H", buf, vt + 4)

    def _off(self, i):
        return self.offs[i] if i < len(self.offs) and self.offs[i] else None

    def scalar(self, i, fmt, default=0):
        o = self._off(i)
        return default if o is None else struct.unpack_from("<" + fmt, self.buf, self.pos + o)[0]

    def ref(self, i):
        o = self._off(i)
        if o is None:
            return None
        at = self.pos + o
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def table(self, i):
        r = self.ref(i)
        return None if r is None else _Reader(self.buf, r)

    def vec(self, i, fmt):
        r = self.ref(i)
        if r is None:
            return []
        n = struct.unpack_from("<I", self.buf, r)[0]
        return list(struct.unpack_from(f"<{n}{fmt}", self.buf, r + 4))

    def tables(self, i):
        r = self.ref(i)
        if r is None:
            return []
        n = struct.unpack_from("<I", self.buf, r)[0]
        return [_Reader(self.buf, r + 4 + 4 * k + struct.unpack_from("<I", self.buf, r + 4 + 4 * k)[0])
                for k in range(n)]


def read_header(path: str | Path) -> Header:
    """Parse a ``.tensorbin`` header (the data is not read)."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise InvalidInput(f"{path}: not a tensorbin file ({len(head)} bytes)")
        n = struct.unpack("<Q", head)[0]
        buf = fh.read(n)
    if len(buf) != n:
        raise InvalidInput(f"{path}: truncated header ({len(buf)} of {n} bytes)")
    try:
        return _parse(buf, path)
    except (struct.error, IndexError, AttributeError) as e:  # offsets outside the buffer, missing tables
        raise InvalidInput(f"{path}: malformed tensorbin header ({e})") from None


def _parse(buf: bytes, path) -> Header:
    root = _Reader(buf, struct.unpack_from("<I", buf, 0)[0])
    spec = root.table(0)
    lay = spec.table(1)
    page_type = lay.scalar(1, "B")
    tile = None
    if page_type == _TILE:
        t = lay.table(2).table(0)
        tile = (t.scalar(0, "I"), t.scalar(1, "I"))
    shards = []
    for s in root.tables(2):
        if s.scalar(0, "B") != _INLINE_FILE_STORAGE:
            raise InvalidInput(f"{path}: shard buffer type {s.scalar(0, 'B')} is not inline file storage")
        off, size = struct.unpack_from("<QQ", buf, s.ref(1))
        coord = s.table(2)
        shards.append(Shard(coord.vec(0, "I") if coord else [], off, size))
    mesh = root.table(1)
    return Header(shape=spec.vec(0, "I"), dtype=_DTYPE_NAMES.get(lay.scalar(0, "B"), "invalid"),
                  layout="TILE" if page_type == _TILE else "ROW_MAJOR", tile=tile,
                  alignment=lay.vec(4, "I"), mesh_shape=mesh.vec(0, "I") if mesh else [],
                  shards=shards, data_start=8 + len(buf))


def read_shard(path: str | Path, index: int = 0) -> tuple[Header, bytes]:
    """The header and shard ``index``'s raw bytes."""
    h = read_header(path)
    s = h.shards[index]
    with open(path, "rb") as fh:
        fh.seek(h.data_start + s.offset)
        data = fh.read(s.size)
    if len(data) != s.size:
        raise InvalidInput(f"{path}: shard {index} truncated ({len(data)} of {s.size} bytes)")
    return h, data
