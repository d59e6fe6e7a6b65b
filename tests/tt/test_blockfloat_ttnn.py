"""ttbundle's bfp8/bfp4 tiles equal ttnn's byte for byte (ttnn 0.81.1, mock N150 cluster).

ttnn's bytes are its host buffer of a ``layout=TILE`` tensor made from the same float32 array;
its decode is ``Tensor.to_numpy()``. ttnn cannot build a block-float tensor from raw bytes, so
arbitrary bytes reach its decoder through a ``.tensorbin`` written by ttbundle.
"""

from __future__ import annotations

import numpy as np
import pytest
from blockfloat_cases import FMTS, hand_cases, special_mix

from ttbundle import blockfloat as bf
from ttbundle import tensorbin

pytestmark = pytest.mark.ttnn


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_same_bytes(ours: bytes, theirs: bytes, fmt: str):
    if ours == theirs:
        return
    a, b = np.frombuffer(ours, np.uint8), np.frombuffer(theirs, np.uint8)
    assert a.size == b.size, f"{fmt}: {a.size} B vs ttnn's {b.size} B"
    bad = np.nonzero(a != b)[0]
    tb = bf.tile_bytes(fmt)
    where = [(int(i) // tb, int(i) % tb) for i in bad[:8]]
    raise AssertionError(f"{fmt}: {bad.size} bytes differ; first (tile, byte): {where}; "
                         f"ours {a[bad[:8]].tolist()} ttnn {b[bad[:8]].tolist()}")


def random_cases(rng) -> dict[str, np.ndarray]:
    return {
        "gaussian 64x64": rng.standard_normal((64, 64)).astype(np.float32),
        "gaussian 40x70": rng.standard_normal((40, 70)).astype(np.float32),
        "gaussian 2x3x33x65": rng.standard_normal((2, 3, 33, 65)).astype(np.float32),
        "gaussian 1-D 100": rng.standard_normal(100).astype(np.float32),
        "wide range 64x96": (rng.standard_normal((64, 96)) * np.exp2(rng.integers(-60, 60, (64, 96)))
                             ).astype(np.float32),
        "specials 96x160": special_mix(rng, (96, 160)),
        "bf16 values 50x300": (bits(rng.standard_normal((50, 300))) & 0xFFFF0000).view(np.float32),
        "ties 32x32": (np.arange(1024, dtype=np.float32).reshape(32, 32) / 64 + 1),
        "tall thin 1000x3": rng.standard_normal((1000, 3)).astype(np.float32),
    }


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_equals_ttnn(fmt, to_tt, host_bytes):
    cases = {**hand_cases(fmt), **random_cases(np.random.default_rng(0))}
    for name, a in cases.items():
        t = to_tt(a, fmt)
        assert list(t.shape) == list(a.shape), name
        assert list(t.padded_shape) == list(bf.padded_shape(a.shape)), name
        ours = bf.encode(a, fmt)
        assert len(ours) == bf.encoded_bytes(a.shape, fmt)
        try:
            assert_same_bytes(ours, host_bytes(t), fmt)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        # and ttnn's decode of those tiles is ours, bit for bit (NaN payloads included)
        assert np.array_equal(bits(t.to_numpy()), bits(bf.decode_array(ours, a.shape, fmt))), name


@pytest.mark.parametrize("fmt", FMTS)
def test_bf16_tensor_to_dtype_equals_encode(fmt, ttnn, to_tt, tt_dtype, host_bytes):
    # the bf16 source path: a bf16 ROW_MAJOR tensor tilized and converted on the host by ttnn
    rng = np.random.default_rng(1)
    a = (bits(rng.standard_normal((40, 70)) * 4) & 0xFFFF0000).view(np.float32)
    t = to_tt(a, "bf16", ttnn.ROW_MAJOR_LAYOUT)
    t = ttnn.to_dtype(ttnn.to_layout(t, ttnn.TILE_LAYOUT), tt_dtype[fmt])
    assert_same_bytes(bf.encode(a, fmt), host_bytes(t), fmt)


def every_code_tiles(fmt: str) -> bytes:
    """Tiles holding every (shared exponent, code) pair: face row ``i`` has exponent ``i % 256``
    and codes ``16 * (i // 256) ...`` so that all codes appear with every exponent."""
    f = bf.get_format(fmt)
    ncodes = 1 << f.code_bits
    rows_per_exp = ncodes // 16
    nrows = 256 * rows_per_exp
    exps = np.arange(nrows) % 256
    codes = ((np.arange(nrows) // 256)[:, None] * 16 + np.arange(16)[None, :]).astype(np.uint8)
    tiles = []
    for t in range(nrows // 64):
        e = exps[64 * t:64 * t + 64].astype(np.uint8)
        c = codes[64 * t:64 * t + 64].reshape(-1)
        body = c if f.code_bits == 8 else (c[0::2] | (c[1::2] << 4)).astype(np.uint8)
        tiles.append(e.tobytes() + body.tobytes())
    return b"".join(tiles)


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_of_every_exponent_and_code_equals_ttnn(fmt, ttnn, tmp_path):
    data = every_code_tiles(fmt)
    n = len(data) // bf.tile_bytes(fmt)
    shape = (32, 32 * n)
    path = tmp_path / f"every_{fmt}.tensorbin"
    tensorbin.write(path, data, shape, fmt)
    t = ttnn.load_tensor(str(path))
    assert np.array_equal(bits(t.to_numpy()), bits(bf.decode_array(data, shape, fmt)))


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_of_random_bytes_equals_ttnn(fmt, ttnn, tmp_path):
    shape = (2, 64, 96)
    data = np.random.default_rng(2).integers(0, 256, bf.encoded_bytes(shape, fmt), np.uint8).tobytes()
    path = tmp_path / "random.tensorbin"
    tensorbin.write(path, data, shape, fmt)
    t = ttnn.load_tensor(str(path))
    assert np.array_equal(bits(t.to_numpy()), bits(bf.decode_array(data, shape, fmt)))
