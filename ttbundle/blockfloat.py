"""Tenstorrent block floats (``bfp8`` = ttnn.bfloat8_b, ``bfp4`` = ttnn.bfloat4_b) on the host.

Byte-for-byte the tiles tt-metal's host packer writes (checked against the ttnn 0.81.1 wheel in
``tests/tt``; the format and its edge cases are described in docs/blockfloat.md):

* TILE layout: the last two dims are zero-padded to multiples of 32; tiles are stored row-major
  over ``[*lead, H/32, W/32]``. A tile is four 16x16 faces (top-left, top-right, bottom-left,
  bottom-right), each face row-major, so a tile is 64 *face rows* of 16 values.
* One tile = 64 shared exponents (one byte per face row, in face-row order) followed by the
  64 x 16 sign-magnitude codes in the same order: 1 byte each for bfp8 (1,088 B per tile),
  4 bits each for bfp4, the even value in the low nibble (576 B per tile).
* Shared exponent = the largest float32 biased exponent of the 16 values (NaN/Inf count: 255).
  Each value's 24-bit mantissa (hidden 1 included) is shifted right by ``shared - own exponent``
  (the bits shifted out are dropped, not used for rounding), then rounded to ``W`` bits (7 for
  bfp8, 3 for bfp4) to nearest, ties to even, saturating at ``2**W - 1``; the sign is kept only
  for a nonzero result. Zeros and float32 denormals encode 0.
* Decode: a code with magnitude ``m > 0`` is ``m * 2**(shared - 127 - (W - 1))``; 0 decodes to
  +-0.0 with the code's sign bit (ttnn's unpacker; see :func:`_value_table` for the corners).

Everything runs on numpy (present in both the main and the Python 3.12 ttnn environments);
torch tensors are converted at the edges, and torch is imported only when one is passed in or
asked for. Work is chunked over rows of tiles so memory stays ~ the input + the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import InvalidInput
from .tiles import BLOCK_FLOAT_CODE_BITS, FACE, TILE, tile_bytes as _tile_bytes

FACE_ROWS = (TILE // FACE) ** 2 * FACE  # 64 shared exponents per tile
CHUNK_TILES = 256  # tiles per vectorized step (1 MB of float32): temporaries stay in cache


@dataclass(frozen=True)
class Format:
    """A block-float format: ``W`` magnitude bits + 1 sign bit per value, one exponent per 16."""

    name: str
    ttnn_name: str
    mantissa_bits: int  # W: magnitude bits of a code (the hidden 1 is explicit here)

    @property
    def code_bits(self) -> int:
        return self.mantissa_bits + 1

    @property
    def tile_bytes(self) -> int:
        return _tile_bytes(self.name)  # FACE_ROWS exponent bytes + TILE * TILE codes


FORMATS = {
    "bfp8": Format("bfp8", "bfloat8_b", BLOCK_FLOAT_CODE_BITS["bfp8"] - 1),
    "bfp4": Format("bfp4", "bfloat4_b", BLOCK_FLOAT_CODE_BITS["bfp4"] - 1),
}


def get_format(fmt: str | Format) -> Format:
    if isinstance(fmt, Format):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown block-float format {fmt!r}: expected one of {sorted(FORMATS)}") from None


def tile_bytes(fmt: str | Format) -> int:
    """Bytes of one 32x32 tile: 1,088 for bfp8, 576 for bfp4."""
    return get_format(fmt).tile_bytes


def _dims(shape) -> tuple[int, int, int]:
    """(lead, H, W) of a tensor shape; a 1-D tensor is one row ``[1, N]`` (as in plan.tile_pages)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("block floats need a tensor of rank >= 1, got a scalar")
    if len(shape) == 1:
        shape = (1,) + shape
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def padded_shape(shape) -> tuple[int, ...]:
    """The shape with its last two dims rounded up to whole tiles (ttnn's ``padded_shape``)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 1:
        shape = (1,) + shape
    return shape[:-2] + tuple(-(-d // TILE) * TILE for d in shape[-2:])


def num_tiles(shape) -> int:
    lead, h, w = _dims(shape)
    return lead * -(-h // TILE) * -(-w // TILE)


def encoded_bytes(shape, fmt: str | Format) -> int:
    """Size of :func:`encode`'s output for a tensor of ``shape``."""
    return num_tiles(shape) * tile_bytes(fmt)


def row_band(shape, fmt: str | Format, b: int, r0: int, r1: int) -> tuple[int, int]:
    """Byte range ``[start, stop)`` of :func:`encode`'s output that holds rows ``[r0, r1)`` of
    matrix ``b`` (of the ``lead`` matrices of ``shape``): tiles are stored matrix by matrix, tile
    row by tile row, so whole tile rows are contiguous. ``r0`` must start a tile row and ``r1``
    end one (or be the last row); :func:`decode` of those bytes with shape ``[r1 - r0, W]`` gives
    exactly those rows."""
    lead, h, w = _dims(shape)
    if not (0 <= b < lead and 0 <= r0 < r1 <= h) or r0 % TILE or (r1 % TILE and r1 != h):
        raise ValueError(f"rows [{r0}, {r1}) of matrix {b} of {list(shape)}: not whole tile rows")
    row = -(-w // TILE) * tile_bytes(fmt)
    base = b * -(-h // TILE) * row
    return base + r0 // TILE * row, base + -(-r1 // TILE) * row


# ---- input conversion --------------------------------------------------------------------------
def _as_array(x):
    """(numpy array, kind): float32 / float16 arrays as is; bf16 as its uint16 bits ("bf16")."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(np.uint16), "bf16"
        if t.dtype in (torch.float32, torch.float16):
            return t.contiguous().numpy(), "float"
        if t.dtype == torch.float64:
            return t.to(torch.float32).numpy(), "float"
        raise TypeError(f"block floats encode float tensors, got {t.dtype}")
    a = np.asarray(x)
    if a.dtype.name == "bfloat16":  # ml_dtypes.bfloat16 (shipped with ttnn)
        return np.ascontiguousarray(a).view(np.uint16), "bf16"
    if a.dtype in (np.float32, np.float16):
        return a, "float"
    if a.dtype == np.float64:
        return a.astype(np.float32), "float"
    raise TypeError(f"block floats encode float arrays, got {a.dtype}")


def _bits32(a: np.ndarray, kind: str) -> np.ndarray:
    """float32 bit patterns (uint32) of a chunk; bf16 and fp16 widen exactly."""
    if kind == "bf16":
        return a.astype(np.uint32) << 16
    if a.dtype != np.float32:
        a = a.astype(np.float32)
    return np.ascontiguousarray(a).view(np.uint32)


# ---- tiles <-> rows ----------------------------------------------------------------------------
def _tilize(rows: np.ndarray) -> np.ndarray:
    """``[32*t, Wp]`` (Wp a multiple of 32) -> ``[t*Wp/32, 64, 16]``: tiles of 64 face rows."""
    r, wp = rows.shape
    t = rows.reshape(r // TILE, 2, FACE, wp // TILE, 2, FACE)  # [ht, fr, row, wt, fc, col]
    return t.transpose(0, 3, 1, 4, 2, 5).reshape(-1, FACE_ROWS, FACE)


def _untilize(tiles: np.ndarray, wp: int) -> np.ndarray:
    """Inverse of :func:`_tilize` for ``[n, 64, 16]``: -> ``[32*n*32/Wp, Wp]``."""
    t = tiles.reshape(-1, wp // TILE, 2, 2, FACE, FACE)  # [ht, wt, fr, fc, row, col]
    return t.transpose(0, 2, 4, 1, 3, 5).reshape(-1, wp)


def _tilize_exponents(shared: np.ndarray) -> np.ndarray:
    """Face-row exponents in row layout ``[32*t, Wp/16]`` -> tile order ``[n, 64]``."""
    r, g = shared.shape
    t = shared.reshape(r // TILE, 2, FACE, g // 2, 2)  # [ht, fr, row, wt, fc]
    return t.transpose(0, 3, 1, 4, 2).reshape(-1, FACE_ROWS)


def _untilize_exponents(shared: np.ndarray, wp: int) -> np.ndarray:
    """Inverse of :func:`_tilize_exponents`: ``[n, 64]`` -> ``[rows, Wp/16]``."""
    t = shared.reshape(-1, wp // TILE, 2, 2, FACE)  # [ht, wt, fr, fc, row]
    return t.transpose(0, 2, 4, 1, 3).reshape(-1, wp // FACE)


def _slabs(lead: int, h: int, w: int):
    """(b, row0, row1) row ranges of whole tile rows, about CHUNK_TILES tiles each."""
    wt = -(-w // TILE)
    step = max(1, CHUNK_TILES // max(wt, 1)) * TILE
    for b in range(lead):
        for r0 in range(0, h, step):
            yield b, r0, min(h, r0 + step)


def _padded_slab(src, b: int, r0: int, r1: int, kind: str, wp: int, native: bool = False) -> np.ndarray:
    """uint32 bits of rows ``[r0, r1)`` of matrix ``b``, zero-padded to whole tiles (``native``:
    bf16 input stays uint16 bits, for :func:`_encode_rows_bf16`)."""
    bits = src[b, r0:r1] if native and kind == "bf16" else _bits32(src[b, r0:r1], kind)
    rows = -(-(r1 - r0) // TILE) * TILE
    if bits.shape == (rows, wp):
        return bits
    out = np.zeros((rows, wp), bits.dtype)
    out[: r1 - r0, : bits.shape[1]] = bits
    return out


# ---- the format --------------------------------------------------------------------------------
_U32 = np.uint32


def _encode_rows(u: np.ndarray, f: Format) -> tuple[np.ndarray, np.ndarray]:
    """float32 bits ``[r, Wp]`` -> (shared exponents ``[r, Wp/16]``, codes ``[r, Wp]``) uint8.

    A face row is 16 consecutive values of a row, so the format is computed in row layout and
    only the uint8 results are tilized."""
    r, wp = u.shape
    w = f.mantissa_bits
    shift = 24 - w  # bits dropped from the 24-bit mantissa when the value has the shared exponent
    exp = (u >> _U32(23)).astype(np.uint8)  # the cast drops the sign bit
    # max over each group of 16: reduce along a contiguous axis (much faster than a short last axis)
    shared = np.ascontiguousarray(exp.reshape(-1, FACE).T).max(axis=0).reshape(r, wp // FACE)
    diff = np.repeat(shared, FACE, axis=1)
    diff -= exp  # >= 0
    np.minimum(diff, np.uint8(31), out=diff)  # shifts of >= 24 leave nothing anyway
    m = u & _U32(0x7FFFFF)
    m |= _U32(0x800000)
    m >>= diff  # truncating shift first (as tt-metal does), then rounding of what is left
    # Round to nearest, ties to even: adding (half - 1) + the kept LSB carries exactly when the
    # dropped bits are above half, or equal to half with an odd kept part.
    g = m >> _U32(shift)
    g &= _U32(1)
    m += g
    m += _U32((1 << (shift - 1)) - 1)
    m >>= _U32(shift)
    np.minimum(m, _U32((1 << w) - 1), out=m)  # 1.11..1 rounding up saturates instead of carrying
    code = m.astype(np.uint8)
    code *= exp != 0  # +-0 and float32 denormals encode 0
    sign = (u >> _U32(31 - w)).astype(np.uint8)
    sign &= np.uint8(1 << w)
    sign *= code != 0  # no -0 codes
    code |= sign
    return shared, code


@lru_cache(maxsize=None)
def _bf16_codes(fmt: str) -> np.ndarray:
    """``[32 * 256]`` uint8: the code of a bf16 value (nonzero exponent) from ``diff << 8 | sign << 7 |
    mantissa``, ``diff`` = shared minus own exponent (clamped at 31 as :func:`_encode_rows` does).

    A bf16 value has 7 mantissa bits, so its code depends on nothing else; the table is computed by
    :func:`_encode_rows` itself (16-value face rows: one value of exponent 200 sets the shared
    exponent, the next has exponent ``200 - diff``), so the rounding rule has one owner."""
    f = get_format(fmt)
    diff = np.arange(32, dtype=np.uint32)[:, None]
    low = np.arange(256, dtype=np.uint32)[None, :]  # sign << 7 | mantissa
    value = ((low >> 7) << 31) | ((200 - diff) << 23) | ((low & 0x7F) << 16)
    rows = np.zeros((32 * 256, FACE), np.uint32)
    rows[:, 0] = 200 << 23
    rows[:, 1] = value.reshape(-1)
    return _encode_rows(rows, f)[1][:, 1].copy()


def _encode_rows_bf16(b: np.ndarray, f: Format) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_encode_rows` for bf16 bits ``[r, Wp]`` (uint16), the same bytes at a fraction of the
    memory traffic: one exponent byte per value, then one table lookup per value
    (:func:`_bf16_codes`) instead of the 24-bit mantissa arithmetic on uint32."""
    r, wp = b.shape
    exp = (b >> np.uint16(7)).astype(np.uint8)  # the cast drops the sign bit
    shared = np.ascontiguousarray(exp.reshape(-1, FACE).T).max(axis=0).reshape(r, wp // FACE)
    idx = np.repeat(shared, FACE, axis=1)
    idx -= exp
    np.minimum(idx, np.uint8(31), out=idx)
    idx = idx.astype(np.uint16)
    idx <<= np.uint16(8)
    t = b >> np.uint16(8)
    t &= np.uint16(0x80)
    idx |= t
    np.bitwise_and(b, np.uint16(0x7F), out=t)
    idx |= t
    code = _bf16_codes(f.name).take(idx)
    code *= exp != 0  # +-0 and denormals encode 0
    return shared, code


def _pack(shared: np.ndarray, code: np.ndarray, f: Format) -> np.ndarray:
    """``[n, tile_bytes]`` uint8 from tile-order exponents ``[n, 64]`` and codes ``[n, 64, 16]``:
    exponents then codes (bfp4: two per byte, the even one in the low nibble)."""
    n = shared.shape[0]
    out = np.empty((n, f.tile_bytes), np.uint8)
    out[:, :FACE_ROWS] = shared
    flat = code.reshape(n, -1)
    if f.code_bits == 8:
        out[:, FACE_ROWS:] = flat
    else:
        out[:, FACE_ROWS:] = flat[:, 0::2] | (flat[:, 1::2] << np.uint8(4))
    return out


def _unpack(tiles: np.ndarray, f: Format) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`_pack`: ``[n, tile_bytes]`` -> (exponents ``[n, 64]``, codes ``[n, 64, 16]``)."""
    n = tiles.shape[0]
    shared = tiles[:, :FACE_ROWS]
    body = tiles[:, FACE_ROWS:]
    if f.code_bits == 8:
        code = body
    else:
        code = np.empty((n, 2 * body.shape[1]), np.uint8)
        code[:, 0::2] = body & np.uint8(0xF)
        code[:, 1::2] = body >> np.uint8(4)
    return shared, code.reshape(n, FACE_ROWS, FACE)


@lru_cache(maxsize=None)
def _value_table(fmt: str) -> np.ndarray:
    """``[256, 2**code_bits]`` float32: the value of every (shared exponent, code) pair.

    Mirrors tt-metal's unpacker: the magnitude is normalized (``s`` = shifts until its top bit is
    set) and stored as float32 bits ``sign | (e - s) << 23 | fraction``; a zero magnitude gives
    +-0.0 with the code's sign; ``s > e`` (a value below float32's normal range, which the packer
    never produces) flushes to +0.0; ``s == e`` gives exponent field 0, i.e. float32's
    denormal reading of those bits, and ``e == 255`` gives Inf (magnitude a power of two) or NaN.
    """
    f = get_format(fmt)
    w = f.mantissa_bits
    code = np.arange(1 << f.code_bits, dtype=np.int64)
    mag = code & ((1 << w) - 1)
    sign = (code >> w) << 31
    top = np.zeros_like(mag)  # index of the highest set bit (0 for mag 0)
    for b in range(w):
        top[(mag >> b) > 0] = b
    s = (w - 1) - top  # normalizing shifts
    frac = (mag << (s + 1)) & ((1 << w) - 1)  # hidden bit shifted out
    exp = np.arange(256, dtype=np.int64)[:, None] - s[None, :]
    bits = sign | (exp << 23) | (frac << (23 - w))
    bits = np.where(mag == 0, sign, bits)
    bits = np.where((mag != 0) & (exp < 0), 0, bits)
    return bits.astype(np.uint32).view(np.float32)


@lru_cache(maxsize=None)
def _steps(fmt: str) -> np.ndarray:
    """float32 ``[256]``: the value of magnitude 1 at each shared exponent ``e``,
    ``2**(e - 127 - (W - 1))``, where every code's value is its signed magnitude times that step
    (``W <= e <= 254``: :func:`_value_table` agrees there, tested); 0 elsewhere (those face rows
    are read from the table, :func:`_values_into`)."""
    f = get_format(fmt)
    e = np.arange(256)
    ok = (e >= f.mantissa_bits) & (e <= 254)
    return np.where(ok, np.ldexp(1.0, np.where(ok, e, 127) - 127 - (f.mantissa_bits - 1)), 0.0).astype(np.float32)


def _values_into(code: np.ndarray, e: np.ndarray, f: Format, out: np.ndarray) -> None:
    """``out`` (float32, ``code``'s shape) = the value of every code (uint8, sign-magnitude) at
    its face row's shared exponent ``e`` (uint8, broadcast to ``code``'s shape), as
    :func:`_value_table` gives it. Computed as the code's signed magnitude (int8) times the step
    (:func:`_steps`): one multiply over the chunk, no per-value table lookup; the corners that
    product does not give (a negative-zero code: -0.0; a face row whose exponent leaves float32's
    normal range or is 255: Inf/NaN) are then read from the table, only where present."""
    w = f.mantissa_bits
    top = code if f.code_bits == 8 else np.left_shift(code, 8 - f.code_bits)  # the sign bit on top
    sign = top.view(np.int8) >> np.int8(7)  # 0 or -1
    t = np.bitwise_and(code, np.uint8((1 << w) - 1)).view(np.int8)
    t ^= sign
    t -= sign  # two's complement of the signed magnitude
    np.multiply(t, _steps(f.name).take(e), out=out)
    if top.view(np.int8).min() == -128:  # a negative zero code (ttnn's packer writes none)
        out[code == (1 << w)] = -0.0
    bad = (e < w) | (e == 255)
    if bad.any():
        where = np.broadcast_to(bad, code.shape)
        out[where] = _value_table(f.name)[np.broadcast_to(e, code.shape)[where], code[where]]


def _decode_rows(shared: np.ndarray, code: np.ndarray, f: Format, out: np.ndarray) -> None:
    """``out`` (float32 ``[r', w']``) = the first ``r'`` rows and ``w'`` columns of the values of
    row-layout exponents ``[r, Wp/16]`` and codes ``[r, Wp]`` (padding dropped): decoded straight
    into ``out`` where nothing is padding, else through one temporary."""
    r, wp = code.shape
    whole = out if out.shape == (r, wp) and out.flags.c_contiguous else np.empty((r, wp), np.float32)
    _values_into(code.reshape(r, wp // FACE, FACE), shared.reshape(r, wp // FACE, 1), f,
                 whole.reshape(r, wp // FACE, FACE))
    if whole is not out:
        out[...] = whole[: out.shape[0], : out.shape[1]]


# ---- public API --------------------------------------------------------------------------------
def encode(x, fmt: str | Format) -> bytes:
    """Block-float tiles of ``x`` (torch tensor or numpy array; float32, bf16, fp16 or fp64 [cast to
    float32 first]), as ttnn stores a ``layout=TILE`` tensor of that dtype: last two dims
    zero-padded to multiples of 32, ``num_tiles(shape) * tile_bytes(fmt)`` bytes."""
    return encode_array(x, fmt).tobytes()


def encode_array(x, fmt: str | Format) -> np.ndarray:
    """:func:`encode` as a ``uint8`` array of shape ``[num_tiles, tile_bytes]`` (no final copy)."""
    f = get_format(fmt)
    a, kind = _as_array(x)
    lead, h, w = _dims(a.shape)
    src = a.reshape(lead, h, w)
    wp = -(-w // TILE) * TILE
    out = np.empty((num_tiles(a.shape), f.tile_bytes), np.uint8)
    i = 0
    enc = _encode_rows_bf16 if kind == "bf16" else _encode_rows
    for b, r0, r1 in _slabs(lead, h, w):
        shared, code = enc(_padded_slab(src, b, r0, r1, kind, wp, native=True), f)
        n = code.size // (TILE * TILE)
        out[i: i + n] = _pack(_tilize_exponents(shared), _tilize(code), f)
        i += n
    return out


def _encoded(data, shape, fmt: str | Format):
    """(format, shape as ints, (lead, H, W), tiles ``[num_tiles, tile_bytes]``) of :func:`encode`'s
    bytes for ``shape``; bytes of another size are refused with the arithmetic."""
    f = get_format(fmt)
    shape = tuple(int(s) for s in shape)
    expected = encoded_bytes(shape, f)
    buf = np.frombuffer(data, np.uint8)
    if buf.size != expected:
        raise InvalidInput(f"{f.name} data for shape {list(shape)}: expected {num_tiles(shape)} tiles x "
                           f"{f.tile_bytes} B = {expected} B, got {buf.size} B")
    return f, shape, _dims(shape), buf.reshape(-1, f.tile_bytes)


def decode_array(data, shape, fmt: str | Format) -> np.ndarray:
    """float32 numpy array of ``shape`` from :func:`encode`'s bytes (padding dropped)."""
    f, shape, (lead, h, w), tiles = _encoded(data, shape, fmt)
    wp = -(-w // TILE) * TILE
    out = np.empty((lead, h, w), np.float32)
    i = 0
    for b, r0, r1 in _slabs(lead, h, w):
        n = (-(-(r1 - r0) // TILE)) * (wp // TILE)
        shared, code = _unpack(tiles[i: i + n], f)
        _decode_rows(_untilize_exponents(shared, wp), _untilize(code, wp), f, out[b, r0:r1])
        i += n
    return out.reshape(shape)


def decode_columns_t(tiles: np.ndarray, h: int, w: int, fmt: str | Format, c0: int, c1: int,
                     out: np.ndarray) -> None:
    """Tile columns ``[c0, c1)`` of one ``[h, w]`` matrix, decoded transposed: ``out`` (float32,
    C-contiguous ``[min(32*c1, w) - 32*c0, h]``) gets rows ``32*c0 ...`` of the matrix's
    transpose, the values :func:`decode_array` gives. ``tiles`` is the matrix's encoded bytes
    (``[num_tiles, tile_bytes]``, as :func:`encode` writes them). A matrix held as ``[N, K]``
    (the emulated GEMM's layout) is decoded so with no float32 transpose after it: a tile's
    32x32 codes are regrouped while they are in cache, and each output row is written whole."""
    f = get_format(fmt)
    ht, wt = -(-h // TILE), -(-w // TILE)
    grid = tiles.reshape(ht, wt, f.tile_bytes)
    step = max(1, CHUNK_TILES // (2 * ht))  # tile columns per step: ~512 KB of float32 (L2)
    for a in range(c0, c1, step):
        z = min(c1, a + step)
        if f.code_bits == 8:
            shared, code = grid[:, a:z, :FACE_ROWS], grid[:, a:z, FACE_ROWS:]
        else:
            shared, code = _unpack(np.ascontiguousarray(grid[:, a:z]).reshape(-1, f.tile_bytes), f)
        n = z - a
        c = code.reshape(ht, n, 2, 2, FACE, FACE).transpose(1, 3, 5, 0, 2, 4)  # [wt, fc, col, ht, fr, row]
        c = np.ascontiguousarray(c).reshape(2 * n, FACE, ht * TILE)
        e = shared.reshape(ht, n, 2, 2, FACE).transpose(1, 3, 0, 2, 4).reshape(2 * n, 1, ht * TILE)
        r0, r1 = (a - c0) * TILE, min((z - c0) * TILE, out.shape[0])
        if (n * TILE, ht * TILE) == (r1 - r0, h) and out.flags.c_contiguous:  # a view, written in place
            _values_into(c, e, f, out[r0:r1].reshape(c.shape))
        else:  # padding (the last tile column or tile row is partial), or an ``out`` reshape would copy
            full = np.empty(c.shape, np.float32)
            _values_into(c, e, f, full)
            out[r0:r1] = full.reshape(n * TILE, ht * TILE)[: r1 - r0, :h]


def decode_array_t(data, shape, fmt: str | Format) -> np.ndarray:
    """:func:`decode_array` with each matrix's last two dims swapped: float32 ``[*lead, W, H]``
    (C-contiguous), the same values (:func:`decode_columns_t`)."""
    f, shape, (lead, h, w), tiles = _encoded(data, shape, fmt)
    tiles = tiles.reshape(lead, -1, f.tile_bytes)
    out = np.empty((lead, w, h), np.float32)
    for b in range(lead):
        decode_columns_t(tiles[b], h, w, f, 0, -(-w // TILE), out[b])
    return out.reshape(*shape[:-2], w, h)


def decode(data, shape, fmt: str | Format):
    """float32 ``torch.Tensor`` of ``shape`` from :func:`encode`'s bytes."""
    import torch

    return torch.from_numpy(decode_array(data, shape, fmt))


def quantize_array(x, fmt: str | Format) -> np.ndarray:
    """``decode_array(encode(x))`` without the byte round trip: the values the device holds."""
    f = get_format(fmt)
    a, kind = _as_array(x)
    lead, h, w = _dims(a.shape)
    src = a.reshape(lead, h, w)
    wp = -(-w // TILE) * TILE
    out = np.empty((lead, h, w), np.float32)
    for b, r0, r1 in _slabs(lead, h, w):
        u = _padded_slab(src, b, r0, r1, kind, wp, native=True)
        _decode_rows(*(_encode_rows_bf16 if kind == "bf16" else _encode_rows)(u, f), f, out[b, r0:r1])
    return out.reshape(a.shape)


def quantize(x, fmt: str | Format):
    """The values ``x`` takes on the device in ``fmt`` (float32): what the emulated backend
    computes with. Returns a torch tensor for a torch input, else a numpy array."""
    q = quantize_array(x, fmt)
    if type(x).__module__.startswith("torch"):
        import torch

        return torch.from_numpy(q)
    return q
