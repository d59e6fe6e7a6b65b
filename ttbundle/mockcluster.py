"""UMD cluster descriptors for mesh presets: ttnn's mock mode on a machine without a device.

``TT_METAL_MOCK_CLUSTER_DESC_PATH=<file>`` makes ttnn mock every device driver call and take the
cluster (chips, boards, ethernet links, harvesting) from that YAML file instead of PCIe. With it,
host-side ttnn works (tilizing, block floats, ``dump_tensor`` / ``load_tensor``), and with an SFPI
stub (scripts/setup_tt.sh) mock meshes open with a real allocator. ``descriptor(mesh)`` writes the
file for a preset (``ttbundle mock-cluster --mesh M -o FILE``), so CI can run ttnn's host side
for the mesh a package targets.

Format: the "boards" format ttnn 0.81.1 reads (tt-umd's ``cluster_descriptor.yaml``; the older
format without ``boards`` is refused with "Invalid or missing 'boards' node"). Per chip: arch,
location ``[x, y, rack, shelf]``, unique id, harvesting masks, board type; per board its id and
chips; ethernet links as ``(chip, channel)`` pairs; the PCIe-attached (MMIO) chips. A board id
carries the board type in bits 36..55 (tt-umd ``get_board_type_from_board_id``: n150 0x18,
n300 0x14, p150 0x40, p100 0x36).

The wiring is that of the real systems (tt-umd / tt-metal test descriptors): an N300 is two
Wormholes on one board joined by ethernet channels 8, 9 <-> 0, 1, the left one on PCIe; a T3K is
four N300s in a 2x4 grid. Harvesting is what tt-umd expects per board (one Tensix row on an
N150, two per N300 chip, the P150's usual ethernet/PCIe harvesting, a P100's two Tensix
columns, one DRAM channel and every ethernet core), so ttnn reads them without warnings. Only presets checked against
the wheel are offered (tests/tt/test_mockcluster_ttnn.py opens each mesh); others raise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidInput
from .mesh import PRESETS
from .fsutil import write_text_atomic

_UPI = {"n150": 0x18, "n300": 0x14, "p150": 0x40, "p100": 0x36}
# Tensix rows harvested, as tt-umd expects per board (it warns otherwise): one on an N150, two
# on each N300 chip
_WH_HARVEST = {"n150": 1 << 6, "n300": (1 << 6) | 1}


@dataclass(frozen=True)
class _Chip:
    arch: str  # wormhole_b0 | blackhole
    board: int  # index into the boards list
    location: tuple[int, int, int, int]
    mmio: bool
    harvest: int = 0
    dram_harvest: int = 0
    eth_harvest: int = 0
    pcie_harvest: int = 0


@dataclass(frozen=True)
class _Cluster:
    chips: tuple[_Chip, ...]
    boards: tuple[str, ...]  # board type per board
    links: tuple[tuple[tuple[int, int], tuple[int, int]], ...]  # ((chip, chan), (chip, chan))


def _wh(board: int, x: int, y: int, mmio: bool, kind: str = "n300") -> _Chip:
    return _Chip("wormhole_b0", board, (x, y, 0, 0), mmio, harvest=_WH_HARVEST[kind])


def _n300_links(left: int, right: int) -> list:
    return [((left, 8), (right, 0)), ((left, 9), (right, 1))]


def _t3k() -> _Cluster:
    # chips 0-3 on PCIe (the left chip of each N300), 4-7 their partners; locations as in a
    # T3000 (x 0..3, y 0..1); links: each board's internal pair plus the inter-board cables
    loc = {0: (1, 0), 1: (1, 1), 2: (2, 0), 3: (2, 1), 4: (0, 0), 5: (0, 1), 6: (3, 0), 7: (3, 1)}
    board_of = {0: 0, 4: 0, 1: 1, 5: 1, 2: 2, 6: 2, 3: 3, 7: 3}
    chips = tuple(_wh(board_of[c], *loc[c], c < 4) for c in range(8))
    links = [*_n300_links(0, 4), *_n300_links(1, 5), *_n300_links(2, 6), *_n300_links(3, 7)]
    for a, b, chans in ((0, 2, ((6, 6), (7, 7))), (0, 1, ((14, 14), (15, 15))), (1, 3, ((0, 0), (1, 1))),
                        (2, 3, ((14, 14), (15, 15))), (4, 5, ((6, 6), (7, 7))), (6, 7, ((6, 6), (7, 7)))):
        links += [((a, ca), (b, cb)) for ca, cb in chans]
    return _Cluster(chips, ("n300",) * 4, tuple(links))


def _clusters() -> dict[str, _Cluster]:
    p150 = _Chip("blackhole", 0, (0, 0, 0, 0), True, eth_harvest=0b100100000, pcie_harvest=0b10)
    return {
        "N150": _Cluster((_wh(0, 0, 0, True, "n150"),), ("n150",), ()),
        "N300": _Cluster((_wh(0, 0, 0, True), _wh(0, 1, 0, False)), ("n300",), tuple(_n300_links(0, 1))),
        "T3K": _t3k(),
        "P150": _Cluster((p150,), ("p150",), ()),
        # 7 of 8 DRAM channels (mesh.BLACKHOLE_P100), two Tensix columns and all 14 ethernet
        # cores harvested, as tt-umd expects of a p100
        "P100": _Cluster((_Chip("blackhole", 0, (0, 0, 0, 0), True, harvest=0b11, dram_harvest=1 << 7,
                                eth_harvest=(1 << 14) - 1, pcie_harvest=0b10),), ("p100",), ()),
    }


def supported() -> list[str]:
    """Mesh presets with a descriptor."""
    return list(_clusters())


def _board_id(kind: str, i: int) -> int:
    # bits 36..55: the board type (UPI); low bits a serial. Wormhole ids also set bit 56, as
    # real N150/N300 ids do.
    prefix = 1 << 56 if kind.startswith("n") else 0
    return prefix | (_UPI[kind] << 36) | (0x1180B000 + 17 * i)


def descriptor(mesh_name: str) -> str:
    """The cluster descriptor YAML of mesh preset ``mesh_name``."""
    cl = _clusters().get(mesh_name)
    if cl is None:
        known = ", ".join(supported())
        why = "not a mesh preset" if mesh_name not in PRESETS else "no descriptor for it yet"
        raise InvalidInput(f"mock-cluster: {mesh_name!r}: {why}; supported: {known}")
    n = len(cl.chips)
    ids = [_board_id(kind, i) for i, kind in enumerate(cl.boards)]
    L = [f"# UMD cluster descriptor: mock {mesh_name} ({n} chip{'s' if n > 1 else ''}), written by "
         "`ttbundle mock-cluster`.",
         f"# Use: TT_METAL_MOCK_CLUSTER_DESC_PATH={mesh_name}.yaml (no device; ttnn mocks the driver).",
         "arch:"]
    L += [f"  {c}: {ch.arch}" for c, ch in enumerate(cl.chips)]
    L.append("chips:")
    L += [f"  {c}: [{', '.join(map(str, ch.location))}]" for c, ch in enumerate(cl.chips)]
    L.append("chip_unique_ids:")
    L += [f"  {c}: {0x300000000 + 0x1000 * ch.board + c}" for c, ch in enumerate(cl.chips)]
    L.append("ethernet_connections:" + ("" if cl.links else " []"))
    for (a, ca), (b, cb) in cl.links:
        L += [f"  - - {{chip: {a}, chan: {ca}}}", f"    - {{chip: {b}, chan: {cb}}}"]
    L.append("ethernet_connections_to_remote_devices: []")
    L.append("chips_with_mmio:")
    L += [f"  - {c}: {k}" for k, c in enumerate(c for c, ch in enumerate(cl.chips) if ch.mmio)]
    L.append("harvesting:")
    for c, ch in enumerate(cl.chips):
        L += [f"  {c}: {{noc_translation: true, harvest_mask: {ch.harvest}, dram_harvesting_mask: "
              f"{ch.dram_harvest}, eth_harvesting_mask: {ch.eth_harvest}, pcie_harvesting_mask: "
              f"{ch.pcie_harvest}, l2cpu_harvesting_mask: 0}}"]
    L.append("chip_to_boardtype:")
    L += [f"  {c}: {cl.boards[ch.board]}" for c, ch in enumerate(cl.chips)]
    L.append("boards:")
    for i, kind in enumerate(cl.boards):
        chips = [c for c, ch in enumerate(cl.chips) if ch.board == i]
        L += [f"  - - board_id: {ids[i]}", f"    - board_type: {kind}",
              f"    - chips: [{', '.join(map(str, chips))}]"]
    return "\n".join(L) + "\n"


def write(mesh_name: str, path: str | Path) -> Path:
    """Write the descriptor of ``mesh_name`` to ``path`` (atomically); returns the path."""
    text = descriptor(mesh_name)
    p = Path(path)
    write_text_atomic(p, text)
    return p


def mock_env(mesh_name: str, workdir: str | Path, base: dict | None = None) -> dict[str, str]:
    """Environment for a process running ttnn in mock mode for ``mesh_name``: the descriptor
    (written to ``workdir``), and everything ttnn writes kept in ``workdir`` (the JIT cache
    ``TT_METAL_CACHE`` with its trailing slash, OpenMPI's ``TMPDIR``). Run the process with
    ``cwd=workdir`` too: ttnn writes ``generated/`` into the working directory."""
    w = Path(workdir).absolute()
    (w / "tmp").mkdir(parents=True, exist_ok=True)
    desc = write(mesh_name, w / f"{mesh_name}.yaml")
    env = dict(os.environ if base is None else base)
    env.update({"TT_METAL_MOCK_CLUSTER_DESC_PATH": str(desc), "TT_METAL_CACHE": f"{w / 'cache'}/",
                "TMPDIR": str(w / "tmp")})
    return env
