"""Inputs of the hand-computed block-float tests, shared with tests/tt (which checks that ttnn
produces the same bytes for them). Plain numpy: importable in the Python 3.12 ttnn env."""

from __future__ import annotations

import math
import struct

import numpy as np

W = {"bfp8": 7, "bfp4": 3}  # magnitude bits of a code
FMTS = ("bfp8", "bfp4")


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def one_tile(values: dict[tuple[int, int], float]) -> np.ndarray:
    a = np.zeros((32, 32), np.float32)
    for (r, c), v in values.items():
        a[r, c] = v
    return a


def row(r0: int, c0: int, vals) -> dict:
    return {(r0, c0 + i): v for i, v in enumerate(vals)}


def powers_of_two() -> np.ndarray:
    return one_tile(row(0, 0, [2.0 ** -k for k in range(16)]))


MIXED_SIGNS = [-3.0, 1.5, -0.75, -(2.0 ** -10)]


def mixed_signs() -> np.ndarray:
    return one_tile(row(0, 16, MIXED_SIGNS))


ROUNDING_BFP8 = [
    1.0 + 3 / 256,      # m 0x818000: kept 64, dropped 0x18000 > half 0x10000 -> 65
    1.0 + 2 ** -7,      # m 0x810000: kept 64, dropped == half, even -> 64
    1.0 + 3 * 2 ** -7,  # m 0x830000: kept 65, dropped == half, odd -> 66
    f32(0x3FFFFFFF),    # 1.99999988: m 0xFFFFFF: kept 127, rounds to 128 -> saturates at 127
    -(1.0 + 2 ** -6),   # m 0x820000: kept 65 exactly -> 0x80 | 65
]
ROUNDING_BFP4 = [
    1.0 + 2 ** -3,      # m 0x900000: kept 4, dropped 0x100000 == half, even -> 4
    1.0 + 3 * 2 ** -3,  # m 0xB00000: kept 5, dropped == half, odd -> 6
    1.0 + 2 ** -3 + 2 ** -20,  # above half -> 5
    1.875,              # m 0xF00000: kept 7, exactly half -> 8 -> saturates at 7
]


def rounding(fmt: str) -> np.ndarray:
    return one_tile(row(5, 0, ROUNDING_BFP8) if fmt == "bfp8" else row(7, 3, ROUNDING_BFP4))


def truncation_value(fmt: str) -> float:
    """A value whose mantissa, shifted to shared exponent 127 (a 1.0 in its face row), keeps
    0b10 and drops exactly half -- plus k more bits that the truncating shift loses first."""
    s = 24 - W[fmt]
    k = 5 if fmt == "bfp8" else 1
    m24 = (((0b10 << s) | (1 << (s - 1))) << k) | ((1 << k) - 1)
    assert (1 << 23) <= m24 < (1 << 24)
    return f32(((127 - k) << 23) | (m24 & 0x7FFFFF))


def truncation(fmt: str) -> np.ndarray:
    return one_tile(row(0, 0, [1.0, truncation_value(fmt)]))


def flush_values(fmt: str) -> list[float]:
    return [1.0, 2.0 ** -(W[fmt] + 1), 2.0 ** -30, 1e-40, -1e-40, -(2.0 ** -40)]


def flush(fmt: str) -> np.ndarray:
    return one_tile({**row(20, 20, flush_values(fmt)), **row(31, 16, [1e-40, 2e-40, -3e-39])})


QNAN = f32(0x7FC00000)


def inf_nan() -> np.ndarray:
    return one_tile({**row(0, 0, [math.inf, 1.0, -math.inf]), **row(1, 0, [QNAN, 2.0])})


FACE_CELLS = {(0, 0): 1.0, (3, 17): 2.0, (18, 5): 4.0, (31, 31): 8.0}


def faces() -> np.ndarray:
    return one_tile(FACE_CELLS)


def tile_order() -> np.ndarray:
    """2 x 33 x 65: tile (b, ti, tj) holds 2**(6b + 3ti + tj) where the tensor has data."""
    a = np.zeros((2, 33, 65), np.float32)
    for b in range(2):
        for ti in range(2):
            for tj in range(3):
                a[b, 32 * ti:32 * ti + 32, 32 * tj:32 * tj + 32] = 2.0 ** (b * 6 + ti * 3 + tj)
    return a


def special_mix(rng, shape) -> np.ndarray:
    """Wide-range Gaussian values with 1/8 of them replaced by zeros, denormals, Inf, NaN, max."""
    a = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    flat = a.reshape(-1)
    idx = rng.choice(flat.size, size=flat.size // 8, replace=False)
    specials = np.array([0.0, -0.0, 1e-40, -1e-40, np.inf, -np.inf, np.nan, 3.4e38, -1.17549435e-38],
                        np.float32)
    flat[idx] = specials[rng.integers(0, len(specials), idx.size)]
    return a


def hand_cases(fmt: str) -> dict[str, np.ndarray]:
    """Every input of tests/test_blockfloat.py's hand-computed tests for ``fmt``."""
    return {
        "zeros": np.zeros((32, 32), np.float32),
        "negative zeros": np.full((32, 32), -0.0, np.float32),
        "powers of two": powers_of_two(),
        "mixed signs": mixed_signs(),
        "rounding": rounding(fmt),
        "truncation before rounding": truncation(fmt),
        "flush": flush(fmt),
        "inf nan": inf_nan(),
        "faces": faces(),
        "tile order 2x33x65": tile_order(),
        "one dim 40": np.arange(1, 41, dtype=np.float32),
    }
