"""Tile and block arithmetic every stage shares, one definition each: the tile edge (32: a ttnn
tile is 32x32; prefill buckets, KV blocks and TILE-layout tensors pad to it), ceil-division,
rounding up, the KV blocks that hold a sequence, the bucket a size pads to, and the bytes of one
element of each dense dtype (a block float's tile is ``blockfloat.Format.tile_bytes``). No imports:
any module may use it."""

from __future__ import annotations

TILE = 32
#: bytes per element of the dense dtypes (on device, in a package, in a ``.tensorbin``)
ELEM_BYTES = {"bf16": 2, "f32": 4, "uint32": 4, "uint8": 1, "uint16": 2, "int32": 4}


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
