"""Tile and block arithmetic every stage shares, one definition each: the tile edge (32: a ttnn
tile is 32x32; prefill buckets, KV blocks and TILE-layout tensors pad to it), ceil-division,
rounding up, the KV blocks that hold a sequence, the bucket a size pads to, and the bytes a tile
takes (:func:`tile_bytes`: a dense dtype's elements, a block float's exponents and codes). No
imports: any module may use it (the plan's memory without the block-float encoder, so an encoder
edit does not change the programs' content key)."""

from __future__ import annotations

TILE = 32
#: values per shared exponent of a block float (a face row: tiles are four 16x16 faces)
FACE = 16
#: bytes per element of the dense dtypes (on device, in a package, in a ``.tensorbin``)
ELEM_BYTES = {"bf16": 2, "f32": 4, "uint32": 4, "uint8": 1, "uint16": 2, "int32": 4}
#: bits of one value's code in a block float (sign + magnitude; ttnn's bfloat8_b, bfloat4_b)
BLOCK_FLOAT_CODE_BITS = {"bfp8": 8, "bfp4": 4}


def tile_bytes(dtype: str) -> int:
    """Bytes of one TILE x TILE tile of ``dtype``: a dense dtype's elements (bf16 2,048), or a
    block float's shared exponents (one byte per FACE values) and codes (bfp8 1,088, bfp4 576)."""
    if dtype in BLOCK_FLOAT_CODE_BITS:
        return TILE * TILE // FACE + TILE * TILE * BLOCK_FLOAT_CODE_BITS[dtype] // 8
    return TILE * TILE * ELEM_BYTES[dtype]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b``."""
    return cdiv(a, b) * b


def blocks_per_seq(tokens: int, block_size: int) -> int:
    """KV-cache blocks that hold ``tokens`` positions of one sequence (``max_model_len``: a
    sequence's page-table width)."""
    return cdiv(tokens, block_size)


def pick(buckets: list[int], n: int) -> int:
    """The bucket ``n`` pads to: the smallest of ``buckets`` (sorted) >= n; ValueError if none.
    Prefill and decode buckets (the runner, the emulated ``Runner``, pooling), vision buckets
    (``vision.vision_bucket``) and a ladder's cost (``buckets.assign``)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
