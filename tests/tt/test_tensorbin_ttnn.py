"""``.tensorbin`` files: ttbundle reads what ``ttnn.dump_tensor`` writes, and ``ttnn.load_tensor``
reads what ttbundle writes (ttnn 0.81.1, mock N150 cluster)."""

from __future__ import annotations

import numpy as np
import pytest

from ttbundle import blockfloat as bf
from ttbundle import tensorbin

pytestmark = pytest.mark.ttnn

SHAPES = [(32, 32), (40, 70), (2, 3, 33, 65), (100,)]


@pytest.mark.parametrize("fmt", ["bfp8", "bfp4"])
def test_ttnn_dump_is_read_by_ttbundle(fmt, ttnn, to_tt, tmp_path):
    a = np.random.default_rng(3).standard_normal((2, 40, 70)).astype(np.float32)
    path = tmp_path / "ttnn.tensorbin"
    ttnn.dump_tensor(str(path), to_tt(a, fmt))
    h, data = tensorbin.read_shard(path)
    assert (h.shape, h.dtype, h.layout, h.tile, h.mesh_shape) == ([2, 40, 70], fmt, "TILE", (32, 32), [1, 1])
    assert [(s.coord, s.offset, s.size) for s in h.shards] == [([0, 0], 0, bf.encoded_bytes(a.shape, fmt))]
    assert data == bf.encode(a, fmt)
    assert path.stat().st_size == h.data_start + len(data)


@pytest.mark.parametrize("fmt", ["bfp8", "bfp4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_ttbundle_file_loads_in_ttnn(fmt, shape, ttnn, tt_dtype, host_bytes, tmp_path):
    a = (np.random.default_rng(4).standard_normal(shape) * 5).astype(np.float32)
    data = bf.encode(a, fmt)
    path = tmp_path / "ours.tensorbin"
    tensorbin.write(path, data, shape, fmt)
    t = ttnn.load_tensor(str(path))
    assert list(t.shape) == list(shape)
    assert t.dtype == tt_dtype[fmt] and t.layout == ttnn.TILE_LAYOUT
    assert host_bytes(t) == data
    assert np.array_equal(t.to_numpy(), bf.decode_array(data, shape, fmt))
    # ttbundle's reader agrees with its writer
    h = tensorbin.read_header(path)
    assert (h.shape, h.dtype, h.layout, h.alignment) == (list(shape), fmt, "TILE", [32, 32])


def test_row_major_f32_file_loads_in_ttnn(ttnn, tmp_path):
    a = np.random.default_rng(5).standard_normal((5, 7)).astype(np.float32)
    path = tmp_path / "rm.tensorbin"
    tensorbin.write(path, a.tobytes(), a.shape, "f32", layout="ROW_MAJOR")
    t = ttnn.load_tensor(str(path))
    assert t.dtype == ttnn.float32 and t.layout == ttnn.ROW_MAJOR_LAYOUT
    assert np.array_equal(t.to_numpy(), a)


def test_header_fields_match_ttnn(ttnn, to_tt, tmp_path):
    # every header field ttbundle writes is what ttnn writes for the same tensor (the FlatBuffer
    # bytes differ only in layout: vtable sharing and padding)
    for fmt, shape, layout in [("bfp8", (40, 70), "TILE"), ("bfp4", (3, 64), "TILE"),
                               ("f32", (5, 7), "ROW_MAJOR")]:
        a = np.ones(shape, np.float32)
        theirs = tmp_path / "theirs.tensorbin"
        ttnn.dump_tensor(str(theirs), to_tt(a, fmt, getattr(ttnn, f"{layout}_LAYOUT")))
        h_theirs, data = tensorbin.read_shard(theirs)
        ours = tmp_path / "ours.tensorbin"
        tensorbin.write(ours, data, shape, fmt, layout)
        h_ours = tensorbin.read_header(ours)
        h_ours.data_start = h_theirs.data_start = 0
        assert h_ours == h_theirs
