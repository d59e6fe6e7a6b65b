"""bfp8 / bfp4 tiles against bytes derived by hand from the format (docs/blockfloat.md).

Byte equality with the real ttnn wheel is tests/tt/test_blockfloat_ttnn.py (Python 3.12 env);
here every expected byte is computed in the test from the definition:

* element (r, c) of a tile is in face ``f = 2*(r//16) + c//16``, face row ``fr = 16*f + r%16``;
  its shared exponent is byte ``fr``, its code is code number ``16*fr + c%16`` after the 64
  exponent bytes (bfp8: one byte; bfp4: a nibble, even codes in the low nibble);
* code = sign << W | round_half_even((1.m * 2**23) >> (shared - e), drop 24 - W bits), W = 7 / 3.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from blockfloat_cases import (FACE_CELLS, FMTS, MIXED_SIGNS, W, faces, flush, flush_values,
                              inf_nan, mixed_signs, powers_of_two, rounding, special_mix,
                              tile_order, truncation, truncation_value)

from ttbundle import blockfloat as bf
from ttbundle.errors import InvalidInput


def code_pos(r: int, c: int) -> tuple[int, int]:
    """(face row, code number) of element (r, c) of a 32x32 tile."""
    fr = 16 * (2 * (r // 16) + c // 16) + r % 16
    return fr, 16 * fr + c % 16


def tile_fields(data: bytes, fmt: str, tile: int = 0) -> tuple[list[int], list[int]]:
    """(64 exponents, 1024 codes) of tile ``tile``, decoded by hand from the byte layout."""
    t = data[tile * bf.tile_bytes(fmt):(tile + 1) * bf.tile_bytes(fmt)]
    exps, body = list(t[:64]), t[64:]
    if fmt == "bfp8":
        codes = list(body)
    else:
        codes = [n for b in body for n in (b & 0xF, b >> 4)]
    return exps, codes


def codes_at(data, fmt, r, c0, n):
    _, codes = tile_fields(data, fmt)
    return [codes[code_pos(r, c0 + i)[1]] for i in range(n)]


def exp_at(data, fmt, r, c):
    return tile_fields(data, fmt)[0][code_pos(r, c)[0]]


# ---- hand-computed tiles -----------------------------------------------------------------------
def test_tile_sizes():
    from ttbundle.plan.memory import TILE_BYTES

    assert bf.tile_bytes("bfp8") == 1088 == 64 + 1024 == TILE_BYTES["bfp8"]
    assert bf.tile_bytes("bfp4") == 576 == 64 + 512 == TILE_BYTES["bfp4"]
    x = np.ones((64, 96), np.float32)
    assert len(bf.encode(x, "bfp8")) == 6 * 1088
    assert len(bf.encode(x, "bfp4")) == 6 * 576


@pytest.mark.parametrize("fmt", FMTS)
def test_all_zero_tile_is_all_zero_bytes(fmt):
    assert bf.encode(np.zeros((32, 32), np.float32), fmt) == bytes(bf.tile_bytes(fmt))
    # -0.0 encodes as +0 (no sign on a zero code) and the exponent of zeros is 0
    assert bf.encode(np.full((32, 32), -0.0, np.float32), fmt) == bytes(bf.tile_bytes(fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_powers_of_two_face_row(fmt):
    # 2**-k, k = 0..15, in face 0 row 0: shared exponent 127; mantissa 0x800000 >> k, then W bits
    # kept: 2**(W-1) >> k. At k = W the dropped part is exactly half with an even kept part (0):
    # ties-to-even gives 0, and everything smaller is below half.
    data = bf.encode(powers_of_two(), fmt)
    w = W[fmt]
    expected = [(1 << (w - 1)) >> k if k < w else 0 for k in range(16)]
    assert codes_at(data, fmt, 0, 0, 16) == expected
    assert exp_at(data, fmt, 0, 0) == 127
    exps, codes = tile_fields(data, fmt)
    assert exps[1:] == [0] * 63 and codes[16:] == [0] * (1024 - 16)


def test_mixed_signs_face_row():
    # face 1 (columns 16..31), row 0: shared exponent of 3.0 = 1.5 * 2**1 -> 128
    assert MIXED_SIGNS == [-3.0, 1.5, -0.75, -(2.0 ** -10)]
    a = mixed_signs()
    d8, d4 = bf.encode(a, "bfp8"), bf.encode(a, "bfp4")
    assert exp_at(d8, "bfp8", 0, 16) == exp_at(d4, "bfp4", 0, 16) == 128
    # bfp8: 1.5 -> m 0xC00000; >> diff (0, 1, 2, 11) then >> 17:
    #   -3.0: 0x60 | sign 0x80; 1.5: 0x30; -0.75: 0x18 | 0x80; -2**-10: 0x1000 >> 17 = 0, below
    #   half -> 0 and the sign is dropped (no -0 code).
    assert codes_at(d8, "bfp8", 0, 16, 4) == [0x80 | 0x60, 0x30, 0x80 | 0x18, 0]
    # bfp4 (>> 21, half = 0x100000): -3.0: 6 | 8; 1.5: 3; -0.75: 0x300000 -> 1 with exactly half
    # dropped and an odd kept part: ties-to-even rounds up to 2 -> 0xA; -2**-10 -> 0.
    assert codes_at(d4, "bfp4", 0, 16, 4) == [0x8 | 6, 3, 0x8 | 2, 0]
    # the face row is face 1's row 0 = exponent byte 16, codes 256..259
    assert code_pos(0, 16) == (16, 256)
    assert d8[64 + 256] == 0xE0 and d4[16] == 128


def test_rounding_bfp8():
    # one face row with shared exponent 127 (1.0 = 0x3F800000, m = 0x800000); the inputs and the
    # arithmetic for each are in blockfloat_cases.ROUNDING_BFP8
    data = bf.encode(rounding("bfp8"), "bfp8")
    assert codes_at(data, "bfp8", 5, 0, 5) == [65, 64, 66, 127, 0x80 | 65]
    assert exp_at(data, "bfp8", 5, 0) == 127


def test_rounding_bfp4():
    # blockfloat_cases.ROUNDING_BFP4: half-even down, half-odd up, above half, saturation
    data = bf.encode(rounding("bfp4"), "bfp4")
    assert codes_at(data, "bfp4", 7, 3, 4) == [4, 6, 5, 7]


@pytest.mark.parametrize("fmt", FMTS)
def test_mantissa_is_truncated_to_the_shared_exponent_before_rounding(fmt):
    # tt-metal shifts the 24-bit mantissa right by (shared - own exponent), dropping bits, and
    # only then rounds: bits shifted out below the round position do not count as "above half".
    # Element: own exponent 127 - k with m24 = (kept 0b10, exactly half) << k | (k ones below).
    w = W[fmt]
    x = truncation_value(fmt)
    data = bf.encode(truncation(fmt), fmt)
    assert codes_at(data, fmt, 0, 0, 2) == [1 << (w - 1), 0b10]  # correct rounding would give 0b11
    # the exact value is above the midpoint of 2 and 3 steps
    step = 2.0 ** -(w - 1)
    assert x / step > 2.5


@pytest.mark.parametrize("fmt", FMTS)
def test_values_below_the_shared_range_flush_to_zero(fmt):
    w = W[fmt]
    assert flush_values(fmt) == [1.0, 2.0 ** -(w + 1), 2.0 ** -30, 1e-40, -1e-40, -(2.0 ** -40)]
    data = bf.encode(flush(fmt), fmt)
    assert codes_at(data, fmt, 20, 20, 6) == [1 << (w - 1), 0, 0, 0, 0, 0]
    # a face row of float32 denormals only (1e-40, 2e-40, -3e-39 at (31, 16..18)): exponent 0 and
    # zero codes (denormals encode 0)
    assert exp_at(data, fmt, 31, 16) == 0
    assert codes_at(data, fmt, 31, 16, 3) == [0, 0, 0]


@pytest.mark.parametrize("fmt", FMTS)
def test_inf_and_nan(fmt):
    # row 0: [inf, 1.0, -inf]; row 1: [quiet NaN 0x7FC00000, 2.0]
    w = W[fmt]
    data = bf.encode(inf_nan(), fmt)
    # Inf/NaN have exponent 255, which becomes the face row's shared exponent
    assert exp_at(data, fmt, 0, 0) == exp_at(data, fmt, 1, 0) == 255
    half = 1 << (w - 1)
    assert codes_at(data, fmt, 0, 0, 3) == [half, 0, (1 << w) | half]  # 1.0 is 128 below: 0
    assert codes_at(data, fmt, 1, 0, 2) == [half | (half >> 1), 0]  # quiet NaN: m 0xC00000
    out = bf.decode_array(data, (32, 32), fmt)
    assert out[0, 0] == math.inf and out[0, 2] == -math.inf and out[0, 1] == 0
    assert math.isnan(out[1, 0])


@pytest.mark.parametrize("fmt", FMTS)
def test_face_order_and_nibble_order(fmt):
    # one value per face, at a different (row, col) in each; distinct exponents 2**0..2**3
    cells = FACE_CELLS
    assert cells == {(0, 0): 1.0, (3, 17): 2.0, (18, 5): 4.0, (31, 31): 8.0}
    data = bf.encode(faces(), fmt)
    exps, codes = tile_fields(data, fmt)
    for k, ((r, c), v) in enumerate(cells.items()):
        fr, n = code_pos(r, c)
        assert fr // 16 == k  # faces: top-left, top-right, bottom-left, bottom-right
        assert exps[fr] == 127 + k
        assert codes[n] == 1 << (W[fmt] - 1)
    assert sum(1 for e in exps if e) == 4 and sum(1 for c in codes if c) == 4
    if fmt == "bfp4":
        # (3, 17): face 1 row 3, code 16*19 + 1 = 305 -> byte 64 + 152, high nibble
        assert code_pos(3, 17) == (19, 305)
        assert data[64 + 152] == 0x4 << 4


@pytest.mark.parametrize("fmt", FMTS)
def test_tile_order_and_padding(fmt):
    # 2 x 33 x 65, tile (b, ti, tj) = 2**(6b + 3ti + tj): each matrix pads to 64 x 96 = 2 x 3
    # tiles, stored row-major per matrix
    a = tile_order()
    data = bf.encode(a, fmt)
    assert len(data) == 12 * bf.tile_bytes(fmt)
    assert bf.padded_shape(a.shape) == (2, 64, 96) and bf.num_tiles(a.shape) == 12
    for t in range(12):
        exps, codes = tile_fields(data, fmt, t)
        b, ti, tj = t // 6, (t % 6) // 3, t % 3
        # face rows holding data: rows < 33 - 32*ti, columns < 65 - 32*tj
        nrows, ncols = min(32, 33 - 32 * ti), min(32, 65 - 32 * tj)
        for r in range(32):
            for c in (0, 16):
                fr = code_pos(r, c)[0]
                has = r < nrows and c < ncols
                assert exps[fr] == (127 + b * 6 + ti * 3 + tj if has else 0), (t, r, c)
        nonzero = sum(1 for c in codes if c)
        assert nonzero == nrows * ncols
    out = bf.decode_array(data, a.shape, fmt)
    assert out.shape == a.shape and np.array_equal(out, a)


def test_one_dim_is_one_row():
    a = np.arange(1, 41, dtype=np.float32)
    data = bf.encode(a, "bfp8")
    assert len(data) == 2 * 1088 and bf.padded_shape(a.shape) == (32, 64)
    assert np.array_equal(bf.decode_array(data, a.shape, "bfp8"), bf.quantize(a, "bfp8"))


# ---- the decoder -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FMTS)
def test_decode_is_code_times_step(fmt):
    w = W[fmt]
    table = bf._value_table(fmt)
    for e in (w, 100, 127, 130, 254):
        for code in range(1, 1 << w):
            assert table[e, code] == code * 2.0 ** (e - 127 - (w - 1))
            assert table[e, code | (1 << w)] == -table[e, code]
        assert table[e, 0] == 0 and not math.copysign(1, table[e, 0]) < 0
        assert table[e, 1 << w] == 0 and math.copysign(1, table[e, 1 << w]) < 0  # a -0 code
    # below float32's normal range: a magnitude needing more normalizing shifts than the exponent
    # flushes to +0; exactly as many leaves exponent field 0 (float32 reads it as a denormal)
    assert table[0, 1] == 0 and table[w - 2, 1] == 0
    assert table[w - 1, 1] == 0.0  # exponent field 0, fraction bits 0
    # magnitude 3 needs w - 2 shifts: at e = w - 2 the bits are 2**22 with exponent field 0, which
    # float32 reads as 2**-127 (the "true" value 3 * 2**(e - 127 - (w - 1)) would be 1.5 * 2**-127)
    assert table[w - 2, 3] == 2.0 ** -127
    assert table[255, 1 << (w - 1)] == math.inf and math.isnan(table[255, (1 << (w - 1)) + 1])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("chunk", [2, 256])
def test_every_exponent_and_code_decodes_as_the_table_says(fmt, chunk, monkeypatch):
    """Arbitrary tile bytes (every shared exponent 0..255, every code, negative zeros, face rows
    below float32's normal range and at 255) decode, in both layouts, to ``_value_table[e, code]``
    looked up one element at a time from the byte layout: the decoders multiply a code's magnitude
    by its step and must fall back to the table exactly where that product is not the value."""
    rng = np.random.default_rng(11)
    data = bytearray(rng.integers(0, 256, 4 * bf.tile_bytes(fmt), dtype=np.uint8).tobytes())
    for t, e in enumerate(rng.permutation(256).reshape(4, 64)):  # each exponent in one face row
        data[t * bf.tile_bytes(fmt): t * bf.tile_bytes(fmt) + 64] = bytes(int(x) for x in e)
    data = bytes(data)
    table = bf._value_table(fmt)
    expected = np.empty((64, 64), np.float32)
    for t in range(4):
        exps, codes = tile_fields(data, fmt, t)
        for r in range(32):
            for c in range(32):
                fr, k = code_pos(r, c)
                expected[32 * (t // 2) + r, 32 * (t % 2) + c] = table[exps[fr], codes[k]]
    assert {int(c) for t in range(4) for c in tile_fields(data, fmt, t)[1]} == set(range(1 << (W[fmt] + 1)))
    monkeypatch.setattr(bf, "CHUNK_TILES", chunk)
    got = bf.decode_array(data, (64, 64), fmt)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    got_t = bf.decode_array_t(data, (64, 64), fmt)
    assert np.array_equal(got_t.view(np.uint32), expected.T.copy().view(np.uint32))


# ---- against a per-element reference written from the definition -----------------------------
def reference_encode(a: np.ndarray, fmt: str) -> bytes:
    """Slow, literal encoder: one face row at a time, one value at a time."""
    w, s = W[fmt], 24 - W[fmt]
    lead = a.reshape(-1, a.shape[-2], a.shape[-1])
    out = bytearray()
    for m in lead:
        h, wd = m.shape
        hp, wp = -(-h // 32) * 32, -(-wd // 32) * 32
        p = np.zeros((hp, wp), np.float32)
        p[:h, :wd] = m
        for ti in range(hp // 32):
            for tj in range(wp // 32):
                exps, codes = [], []
                for face in range(4):
                    for r in range(16):
                        rr, cc = 32 * ti + 16 * (face // 2) + r, 32 * tj + 16 * (face % 2)
                        vals = p[rr, cc:cc + 16]
                        bits = [struct.unpack("<I", struct.pack("<f", float(v)))[0] for v in vals]
                        shared = max((b >> 23) & 0xFF for b in bits)
                        exps.append(shared)
                        for b in bits:
                            e = (b >> 23) & 0xFF
                            if e == 0:
                                codes.append(0)
                                continue
                            mant = ((b & 0x7FFFFF) | 0x800000) >> min(shared - e, 31)
                            kept, dropped = mant >> s, mant & ((1 << s) - 1)
                            if dropped > (1 << (s - 1)) or (dropped == 1 << (s - 1) and kept & 1):
                                kept += 1
                            kept = min(kept, (1 << w) - 1)
                            codes.append(((b >> 31) << w | kept) if kept else 0)
                out += bytes(exps)
                if fmt == "bfp8":
                    out += bytes(codes)
                else:
                    out += bytes(codes[i] | codes[i + 1] << 4 for i in range(0, 1024, 2))
    return bytes(out)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(32, 32), (33, 47), (2, 40, 70)])
def test_matches_reference_encoder(fmt, shape):
    rng = np.random.default_rng([W[fmt], *shape])
    a = special_mix(rng, shape)
    assert bf.encode(a, fmt) == reference_encode(a, fmt)


# ---- numerics ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, lo, hi", [("bfp8", 0.0065, 0.0080), ("bfp4", 0.105, 0.125)])
def test_gaussian_relative_error(fmt, lo, hi):
    # ../shared/notes/ttnn-host.md measured 0.0072 (bfp8) and 0.116 (bfp4) with the wheel
    x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    q = bf.quantize(x, fmt)
    rel = float(np.abs(q - x).mean() / np.abs(x).mean())
    assert lo < rel < hi, rel


@pytest.mark.parametrize("fmt", FMTS)
def test_error_within_one_step_of_the_block(fmt):
    w = W[fmt]
    x = (np.random.default_rng(1).standard_normal((64, 64)) * 10).astype(np.float32)
    q = bf.quantize(x, fmt)
    groups = x.reshape(64, 4, 16)
    shared = np.frexp(np.abs(groups).max(-1))[1] - 1  # unbiased exponent of the largest value
    step = np.exp2(shared - (w - 1)).astype(np.float32)[..., None]
    assert np.all(np.abs(q.reshape(64, 4, 16) - groups) <= step)


def test_quantize_is_decode_of_encode_torch():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 45, 77)
    for fmt in FMTS:
        q = bf.quantize(x, fmt)
        assert isinstance(q, torch.Tensor) and q.dtype == torch.float32 and q.shape == x.shape
        d = bf.decode(bf.encode(x, fmt), x.shape, fmt)
        assert isinstance(d, torch.Tensor) and torch.equal(q, d)


def test_bf16_and_fp16_inputs_widen_exactly():
    torch = pytest.importorskip("torch")
    x = torch.randn(50, 70)
    for dt in (torch.bfloat16, torch.float16):
        y = x.to(dt)
        for fmt in FMTS:
            assert bf.encode(y, fmt) == bf.encode(y.float(), fmt)
            assert bf.encode(y, fmt) == bf.encode(y.float().numpy(), fmt)


@pytest.mark.parametrize("fmt", FMTS)
def test_bf16_fast_path_equals_the_float32_path_for_every_bf16_value(fmt):
    """bf16 sources take a table-driven path (``_encode_rows_bf16``); every one of the 65,536 bf16
    bit patterns (zeros, denormals, Inf, NaN included), each in face rows whose other values set
    shared exponents from 0 to 255 above or below it, gives the bytes of the float32 path (the one
    tests/tt pins to ttnn's packer)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    allbits = np.arange(1 << 16, dtype=np.uint16)
    for k in range(3):  # the same values in three different neighbourhoods
        bits = rng.permutation(allbits).reshape(-1, 512)
        if k == 2:  # a face row of one huge value with 15 of the others
            bits[:, ::16] = rng.integers(0x7F00, 0x7F80, bits[:, ::16].shape, dtype=np.uint16)
        x = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        assert bf.encode(x, fmt) == bf.encode(x.float(), fmt)
        assert np.array_equal(bf.quantize_array(x, fmt).view(np.uint32),
                              bf.quantize_array(x.float(), fmt).view(np.uint32))


@pytest.mark.parametrize("fmt", FMTS)
def test_chunking_does_not_change_results(fmt, monkeypatch):
    x = np.random.default_rng(2).standard_normal((3, 100, 130)).astype(np.float32)
    whole = bf.encode(x, fmt)
    q = bf.quantize(x, fmt)
    monkeypatch.setattr(bf, "CHUNK_TILES", 2)  # one tile row (5 tiles) per slab
    assert bf.encode(x, fmt) == whole
    assert np.array_equal(bf.decode_array(whole, x.shape, fmt), q)
    assert np.array_equal(bf.quantize(x, fmt), q)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(64, 96), (33, 17), (3, 40, 70), (1, 5), (96, 2000)])
@pytest.mark.parametrize("chunk", [2, 256])
def test_the_transposed_decode_is_the_decode_transposed(fmt, shape, chunk, monkeypatch):
    """``decode_array_t`` (the emulated GEMM's [N, K] read) gives :func:`decode_array`'s values
    bit for bit, matrices transposed: padding, zeros of both signs, Inf/NaN, tiny values."""
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32) * 0.02
    flat = x.reshape(-1)
    flat[::13] = 0.0
    flat[1::29] = -0.0
    flat[2::31] = 1e-30
    flat[3] = np.inf
    flat[4] = np.nan
    data = bf.encode(x, fmt)
    monkeypatch.setattr(bf, "CHUNK_TILES", chunk)
    t = bf.decode_array_t(data, shape, fmt)
    ref = np.swapaxes(bf.decode_array(data, shape, fmt), -1, -2)
    assert t.flags.c_contiguous and t.shape == ref.shape
    assert np.array_equal(t.view(np.uint32), ref.view(np.uint32))


# ---- errors ------------------------------------------------------------------------------------
def test_errors():
    with pytest.raises(ValueError, match="unknown block-float format 'bfp2'"):
        bf.encode(np.ones((4, 4), np.float32), "bfp2")
    with pytest.raises(InvalidInput, match=r"expected 6 tiles x 1088 B = 6528 B, got 100 B"):
        bf.decode_array(b"\0" * 100, (40, 70), "bfp8")
    with pytest.raises(TypeError, match="float"):
        bf.encode(np.ones((4, 4), np.int32), "bfp8")
