"""Per-chip memory the way ttnn's allocator accounts it: interleaved pages over the DRAM banks,
each bank's share rounded up to whole aligned pages (:func:`dram_bytes`, :func:`tensor_bytes`), the
trace region's carve-out, a plan's :class:`Memory` and the one wording of a plan that does not
fit (:func:`shortfall`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..mesh import Mesh
from ..tiles import ELEM_BYTES, TILE, cdiv as _cdiv, round_up as _round_up, tile_bytes

#: bytes of one 32x32 tile of each dtype a plan stores (``tiles.tile_bytes``)
TILE_BYTES = {d: tile_bytes(d) for d in ("bf16", "bfp8", "bfp4", "f32")}
ACT_BYTES = 2  # activations are bf16 on device
TRACE_BYTES_PER_OP = 8 * 1024  # dispatch commands + runtime args per captured op (estimate)
# ttnn carves the trace region out of the top of every DRAM bank when the mesh opens: each bank
# gives ceil(trace_region_size / banks) rounded up to 8 KiB (measured on the ttnn 0.81.1 mock
# allocator, Wormhole and Blackhole alike; tests/tt/test_allocator_ttnn.py)
TRACE_BANK_ALIGN = 8 * 1024


@dataclass
class Memory:
    weights_by_dtype: dict[str, int]
    weights: int
    kv_cache: int
    activations: int
    trace_region: int
    total: int
    dram: int
    draft: int = 0  # speculative decoding's draft model (``speculative: {method: draft}``): weights + KV

    @property
    def free(self) -> int:
        return self.dram - self.total


def shortfall(m: Memory, fmt=None) -> str:
    """The one wording of a plan that does not fit (``validate``, ``init``, ``build``): ``needs
    X per chip, chip has Y``; ``fmt`` writes bytes (default ``1,234 B``; ``report.human``: GiB)."""
    fmt = fmt or (lambda b: f"{b:,} B")
    return f"needs {fmt(m.total)} per chip, chip has {fmt(m.dram)}"


def percent(n: int, d: int) -> str:
    """``n`` as a percentage of ``d``: one decimal, two below 1% (a small share is not 0.0%)."""
    p = 100 * n / d if d else 0.0
    return f"{p:.1f}%" if p >= 1 or p == 0 else f"{p:.2f}%"


def verdict(m: Memory, fmt=None) -> tuple[bool, str, str]:
    """The one wording of a plan's verdict (``ttbundle plan``'s table, the SVG's header):
    (fits, "fits" / "does not fit", the numbers: ``X of Y per chip (P% of DRAM used), Z free``
    or ``needs X of Y per chip (P% of DRAM), Z over``); ``fmt`` writes bytes (``report.human``)."""
    fmt = fmt or (lambda b: f"{b:,} B")
    used = percent(m.total, m.dram)
    if m.free >= 0:
        return True, "fits", f"{fmt(m.total)} of {fmt(m.dram)} per chip ({used} of DRAM used), {fmt(m.free)} free"
    return False, "does not fit", f"needs {fmt(m.total)} of {fmt(m.dram)} per chip ({used} of DRAM), {fmt(-m.free)} over"


def dram_bytes(pages: int, page_bytes: int, mesh: Mesh) -> int:
    """Bytes an interleaved DRAM buffer takes on one chip: pages round-robin over the banks, each
    bank reserving whole pages rounded up to the DRAM alignment."""
    chip = mesh.chip
    if pages == 0:
        return 0
    per_bank = _cdiv(pages, chip.dram_banks) * _round_up(page_bytes, chip.dram_alignment)
    return per_bank * chip.dram_banks


def trace_region_dram(size: int, mesh: Mesh) -> int:
    """DRAM a chip gives up for a trace region of ``size`` bytes: every bank reserves
    ``ceil(size / banks)`` rounded up to :data:`TRACE_BANK_ALIGN`."""
    banks = mesh.chip.dram_banks
    return banks * _round_up(_cdiv(size, banks), TRACE_BANK_ALIGN)


def tile_pages(shape: list[int]) -> int:
    """Number of 32x32 tiles of a tensor in TILE layout (last two dims padded to tiles)."""
    if len(shape) == 1:
        shape = [1] + list(shape)
    lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
    return lead * _cdiv(shape[-2], TILE) * _cdiv(shape[-1], TILE)


def tensor_bytes(shape: list[int], dtype: str, layout: str, mesh: Mesh) -> int:
    if layout == "TILE":
        return dram_bytes(tile_pages(shape), TILE_BYTES[dtype], mesh)
    # ROW_MAJOR: one page per row of the last dim (1-D tensors are stored as rows of 32)
    if len(shape) == 1:
        return dram_bytes(_cdiv(shape[0], TILE), TILE * ELEM_BYTES[dtype], mesh)
    return dram_bytes(math.prod(shape[:-1]), shape[-1] * ELEM_BYTES[dtype], mesh)

