"""ttnn program and compute configs, chosen from per-device shapes (tt_transformers' rules).

* Matmuls with a decode batch (one tile row, ``M = 32``): ``MatmulMultiCoreReuseMultiCast1DProgramConfig``
  over as many cores as divide the output's tile columns (at most the compute grid), the input
  multicast (``mcast_in0``); prefill (``M >= 64``): ``MatmulMultiCoreReuseMultiCastProgramConfig``
  over the whole grid, ``per_core_M`` / ``per_core_N`` the tiles each core row / column owns.
  Batched (expert) matmuls, and outputs so wide that a core would own more than 16 tile columns
  (a whole vocabulary on one chip), let ttnn choose.
* Output sub-blocks are at most 4 tiles (what fits the destination registers with fp32
  accumulation); ``in0_block_w`` divides the contraction's tiles.
* Compute kernels: HiFi4 for bf16 weights, HiFi2 for bfp8, LoFi for bfp4; fp32 accumulation and
  packer L1 accumulation on.
* SDPA: chunk sizes from the sequence (prefill) or ttnn's choice (decode, ``0``).

Every constructor here is checked against the installed wheel by the coverage test.
"""

from __future__ import annotations

from ...tiles import TILE, cdiv
from .calls import Attr, New

MAX_PER_CORE_N = 16  # output tiles per core beyond which the blocks overflow a core's buffers
FIDELITY = {"bf16": "HiFi4", "bfp8": "HiFi2", "bfp4": "LoFi", "f32": "HiFi4"}


def _tiles(n: int) -> int:
    return cdiv(n, TILE)


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` (1 if none bigger)."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


def fits(cores: int, grid: tuple[int, int]) -> bool:
    """Whether ``cores`` cores form an x-by-y rectangle inside ``grid``."""
    gx, gy = grid
    return any(cores % y == 0 and cores // y <= gx for y in range(1, gy + 1))


def core_grid(cores: int, grid: tuple[int, int]) -> tuple[int, int]:
    """An ``x * y == cores`` rectangle inside ``grid`` (x columns, y rows), widest first."""
    gx, gy = grid
    for y in range(1, gy + 1):
        if cores % y == 0 and cores // y <= gx:
            return cores // y, y
    raise ValueError(f"{cores} cores do not form a rectangle in a {gx}x{gy} grid")


def coord(x: int, y: int) -> New:
    return New.of("CoreCoord", x, y)


def compute_config(dtype: str = "bf16", approx: bool = False) -> New:
    return New.of("WormholeComputeKernelConfig", math_fidelity=Attr(f"MathFidelity.{FIDELITY[dtype]}"),
                  math_approx_mode=approx, fp32_dest_acc_en=True, packer_l1_acc=True)


def matmul_config(m: int, k: int, n: int, grid: tuple[int, int]) -> New | None:
    """Program config for ``[m, k] @ [k, n]`` on one device's compute ``grid`` (x, y)."""
    mt, kt, nt = _tiles(m), _tiles(k), _tiles(n)
    gx, gy = grid
    if mt == 1:  # decode: one tile row, outputs spread over the cores that divide N
        cores = next(c for c in range(min(nt, gx * gy), 0, -1) if nt % c == 0 and fits(c, grid))
        x, y = core_grid(cores, grid)
        per_n = nt // cores
        if per_n > MAX_PER_CORE_N:  # a huge N (an unsplit vocabulary): let ttnn choose
            return None
        return New.of("MatmulMultiCoreReuseMultiCast1DProgramConfig", compute_with_storage_grid_size=coord(x, y),
                      in0_block_w=largest_divisor(kt, 8), out_subblock_h=1,
                      out_subblock_w=largest_divisor(per_n, 4), per_core_M=1, per_core_N=per_n,
                      fuse_batch=True, fused_activation=None, mcast_in0=True)
    per_m, per_n = -(-mt // gy), -(-nt // gx)
    if per_n > MAX_PER_CORE_N:
        return None
    return New.of("MatmulMultiCoreReuseMultiCastProgramConfig", compute_with_storage_grid_size=coord(gx, gy),
                  in0_block_w=largest_divisor(kt, 4), out_subblock_h=1,
                  out_subblock_w=largest_divisor(per_n, 4), per_core_M=per_m, per_core_N=per_n,
                  transpose_mcast=False, fused_activation=None, fuse_batch=False)


def sdpa_config(grid: tuple[int, int], rows: int | None) -> New:
    """``rows`` = prefill tokens (chunk sizes follow them), None for decode (ttnn chooses)."""
    if rows is None:
        q = k = 0
    else:
        q = 256 if rows >= 2048 else min(rows, 128) if rows >= 128 else TILE * max(1, rows // TILE)
        k = 512 if rows >= 2048 else q
    return New.of("SDPAProgramConfig", compute_with_storage_grid_size=coord(*grid), q_chunk_size=q,
                  k_chunk_size=k, exp_approx_mode=False)
