"""ttbundle's ``.tensorbin`` writer and reader, without ttnn (tests/tt checks them against it)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ttbundle import blockfloat as bf
from ttbundle import tensorbin
from ttbundle.errors import InvalidInput


@pytest.mark.parametrize("fmt", ["bfp8", "bfp4"])
def test_round_trip(fmt, tmp_path):
    a = np.random.default_rng(0).standard_normal((2, 40, 70)).astype(np.float32)
    data = bf.encode(a, fmt)
    path = tmp_path / "t.tensorbin"
    tensorbin.write(path, data, a.shape, fmt)
    h, got = tensorbin.read_shard(path)
    assert got == data
    assert h.shape == [2, 40, 70] and h.dtype == fmt and h.layout == "TILE" and h.tile == (32, 32)
    assert h.alignment == [32, 32] and h.mesh_shape == [1, 1]
    assert [(s.coord, s.offset, s.size) for s in h.shards] == [([0, 0], 0, len(data))]
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    assert h.data_start == 8 + n and n % 8 == 0
    assert raw[h.data_start:] == data


def test_flatbuffer_is_well_formed():
    head = tensorbin.header_bytes((3, 64), "bfp8", "TILE", 2 * 1088)
    (root,) = struct.unpack_from("<I", head, 0)
    seen = set()

    def table(pos):
        # every table 4-aligned and in bounds, its vtable in bounds, every uoffset forward
        assert pos % 4 == 0 and 0 < pos < len(head)
        vt = pos - struct.unpack_from("<i", head, pos)[0]
        vsize, tsize = struct.unpack_from("<HH", head, vt)
        assert vt >= 0 and vsize >= 4 and pos + tsize <= len(head)
        seen.add(pos)
        return [o for o in struct.unpack_from(f"<{(vsize - 4) // 2}H", head, vt + 4)]

    offs = table(root)
    assert len(offs) == 4 and all(offs)  # tensor_spec, mesh_shape, shards, tensor_topology
    for o in offs:
        at = root + o
        target = at + struct.unpack_from("<I", head, at)[0]
        assert target > at
    # the shard's InlineFileStorage struct (two uint64) is 8-aligned
    h = tensorbin._Reader(head, root)
    shard = h.tables(2)[0]
    assert shard.ref(1) % 8 == 0
    assert struct.unpack_from("<QQ", head, shard.ref(1)) == (0, 2 * 1088)


def test_row_major(tmp_path):
    a = np.arange(35, dtype=np.float32).reshape(5, 7)
    path = tmp_path / "rm.tensorbin"
    tensorbin.write(path, a.tobytes(), a.shape, "f32", layout="ROW_MAJOR")
    h, data = tensorbin.read_shard(path)
    assert (h.layout, h.tile, h.alignment, h.dtype) == ("ROW_MAJOR", None, [1], "f32")
    assert np.array_equal(np.frombuffer(data, np.float32).reshape(5, 7), a)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        tensorbin.header_bytes((32, 32), "fp8", "TILE", 0)
    with pytest.raises(ValueError, match="bfp8 needs TILE layout"):
        tensorbin.header_bytes((32, 32), "bfp8", "ROW_MAJOR", 0)
    with pytest.raises(ValueError, match="unknown layout"):
        tensorbin.header_bytes((32, 32), "bf16", "tile", 0)
    path = tmp_path / "cut.tensorbin"
    tensorbin.write(path, bytes(1088), (32, 32), "bfp8")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(InvalidInput, match="shard 0 truncated"):
        tensorbin.read_shard(path)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(InvalidInput, match="truncated header"):
        tensorbin.read_header(path)
    path.write_bytes(b"abc")
    with pytest.raises(InvalidInput, match="not a tensorbin file"):
        tensorbin.read_header(path)
    path.write_bytes(struct.pack("<Q", 8) + b"\xff" * 8)
    with pytest.raises(InvalidInput, match="malformed tensorbin header"):
        tensorbin.read_header(path)
