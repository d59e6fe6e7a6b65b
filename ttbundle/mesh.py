"""Mesh presets and chip facts.

A mesh is a grid of chips with two named axes, ``rows`` (dim 0) and ``cols`` (dim 1), the same
shape Tenstorrent's plugin opens for a ``MESH_DEVICE`` name. Chip facts come from the ttnn wheel's
SoC descriptors and its allocator (see docs/meshes.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidInput

AXES = ("rows", "cols")


@dataclass(frozen=True)
class Chip:
    arch: str  # "wormhole_b0" | "blackhole"
    label: str
    dram_banks: int
    dram_bank_bytes: int  # allocatable bytes per DRAM bank (ttnn allocator)
    l1_banks: int
    l1_bank_bytes: int  # allocatable L1 per worker core
    compute_grid: tuple[int, int]
    dram_alignment: int

    @property
    def dram_bytes(self) -> int:
        return self.dram_banks * self.dram_bank_bytes

    @property
    def l1_bytes(self) -> int:
        return self.l1_banks * self.l1_bank_bytes


WORMHOLE = Chip("wormhole_b0", "Wormhole B0", 12, 1_072_693_184, 64, 1_393_312, (8, 8), 32)
BLACKHOLE = Chip("blackhole", "Blackhole", 8, 4_277_141_376, 130, 1_461_120, (13, 10), 64)
# P100 is a Blackhole board with 7 DRAM channels and two Tensix columns harvested: ttnn 0.81.1
# reports an 11x10 compute grid and 110 L1 banks on a mock P100.
BLACKHOLE_P100 = Chip("blackhole", "Blackhole (7 DRAM channels)", 7, 4_277_141_376, 110,
                      1_461_120, (11, 10), 64)


@dataclass(frozen=True)
class Mesh:
    name: str
    shape: tuple[int, int]
    chip: Chip
    topology: str  # "linear" | "ring" | "torus"
    hosts: int = 1
    note: str = ""
    #: a replica's submesh (``split``): how many replicas the target runs and the target's shape;
    #: ``shape`` is then the submesh's, and ``name`` stays the target's (packages, MESH_DEVICE)
    replicas: int = 1
    target_shape: tuple[int, int] | None = None

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def axis_size(self, axis: str) -> int:
        return self.shape[AXES.index(axis)]

    @property
    def total_devices(self) -> int:
        """Chips of the whole target (every replica)."""
        return self.num_devices * self.replicas

    def describe(self) -> str:
        if self.target_shape is not None:
            r, c = self.target_shape
            return f"{self.name} {r}x{c} as {self.replicas} replicas of {self.rows}x{self.cols}"
        return f"{self.name} {self.rows}x{self.cols}"

    def whole(self) -> "Mesh":
        """The target mesh a replica was cut from (itself when not split)."""
        if self.target_shape is None:
            return self
        return resolve(self.name)


def split(target: "Mesh", submesh) -> "Mesh":
    """The mesh one replica of ``target`` runs on when ``target`` is split into replicas of
    shape ``submesh`` (R, C): a standalone mesh of that shape and chip (the layout and the plan
    treat it as any other mesh), keeping the target's name. The submesh must tile the target:
    rows divide rows and cols divide cols."""
    try:
        r, c = (int(x) for x in submesh)
    except (TypeError, ValueError):
        raise InvalidInput(f"submesh must be [rows, cols], got {submesh!r}") from None
    R, C = target.shape
    if r < 1 or c < 1:
        raise InvalidInput(f"submesh [{r}, {c}]: rows and cols must be >= 1")
    bad = [f"{what} {n} % {k} = {n % k}" for what, n, k in (("rows", R, r), ("cols", C, c)) if n % k]
    if bad:
        fits = [f"[{a}, {b}]" for a in range(1, R + 1) if R % a == 0 for b in range(1, C + 1)
                if C % b == 0 and (a, b) != (R, C)]
        raise InvalidInput(f"submesh [{r}, {c}] does not tile {target.describe()}: {'; '.join(bad)}; "
                           f"submeshes that do: {', '.join(fits) or 'none (a 1x1 mesh)'}")
    if target.target_shape is not None:
        raise InvalidInput(f"{target.describe()} is already split")
    n = (R // r) * (C // c)
    # a strip cut from a ring or torus is a line; a 2-D block of a torus stays a torus
    topo = "linear" if min(r, c) == 1 else target.topology
    hosts = max(1, target.hosts * r * c // (R * C)) if target.hosts > 1 else 1
    return Mesh(target.name, (r, c), target.chip, topo, hosts, f"replica of {target.describe()}",
                n, (R, C))


def host_of(mesh_shape, hosts: int, chip: tuple[int, int]) -> int:
    """The host a chip of a multi-host mesh belongs to: the hosts split the cols axis into equal
    blocks (a DUAL_GALAXY (8,8) is two Galaxies of (8,4) side by side, a QUAD_GALAXY (8,16) four)."""
    if hosts <= 1:
        return 0
    per = mesh_shape[1] // hosts
    return chip[1] // per


def host_shape(mesh_shape, hosts: int) -> tuple[int, int]:
    return (mesh_shape[0], mesh_shape[1] // max(1, hosts))


def submesh_origins(target_shape, submesh, hosts: int = 1) -> list[tuple[int, int]]:
    """Top-left chip (row, col) of each replica, replica 0 first: row-major over the grid of
    submeshes (the order ttnn's ``create_submeshes`` hands them out); on a multi-host mesh host
    by host (so each host's replicas, and the data-parallel ranks driving them, are contiguous)."""
    (R, C), (r, c) = target_shape, submesh
    out = [(i * r, j * c) for i in range(R // r) for j in range(C // c)]
    return sorted(out, key=lambda o: host_of(target_shape, hosts, o)) if hosts > 1 else out


def _m(name, shape, chip, topology, hosts=1, note=""):
    return Mesh(name, shape, chip, topology, hosts, note)


# Every MESH_DEVICE name Tenstorrent's plugin accepts, plus multi-host Galaxies.
PRESETS: dict[str, Mesh] = {m.name: m for m in [
    _m("N150", (1, 1), WORMHOLE, "linear"),
    _m("N300", (1, 2), WORMHOLE, "linear"),
    _m("N150x4", (1, 4), WORMHOLE, "linear"),
    _m("T3K", (1, 8), WORMHOLE, "ring", note="physically 2x4; presented as 1x8 like the plugin"),
    _m("TG", (8, 4), WORMHOLE, "torus", note="Galaxy; the plugin's worker opens (8,4)"),
    _m("DUAL_GALAXY", (8, 8), WORMHOLE, "torus", hosts=2),
    _m("QUAD_GALAXY", (8, 16), WORMHOLE, "torus", hosts=4),
    _m("P100", (1, 1), BLACKHOLE_P100, "linear"),
    _m("P150", (1, 1), BLACKHOLE, "linear"),
    _m("P150x2", (1, 2), BLACKHOLE, "linear"),
    _m("P300", (1, 2), BLACKHOLE, "linear"),
    _m("P150x4", (1, 4), BLACKHOLE, "linear"),
    _m("P300x2", (1, 4), BLACKHOLE, "linear"),
    _m("P150x8", (1, 8), BLACKHOLE, "ring"),
    _m("BH-Galaxy", (8, 4), BLACKHOLE, "torus"),
]}

# full-string match (``$`` would accept a trailing newline), spaces only; ASCII digits, at most 6, so
# no 5,000-digit number reaches int()
_TUPLE = re.compile(r" *\( *([0-9]{1,6}) *, *([0-9]{1,6}) *\) *(?:@ *(wormhole|blackhole) *)?", re.I)


def valid_names() -> str:
    return ", ".join(list(PRESETS) + ['"(R,C)"', '"(R,C)@blackhole"'])


def resolve(name: str) -> Mesh:
    """A preset by its exact MESH_DEVICE name, or ``"(R,C)"`` (Wormhole) / ``"(R,C)@blackhole"``."""
    if not isinstance(name, str):
        raise InvalidInput(f"mesh must be a name or \"(R,C)\", got {name!r}; valid: {valid_names()}")
    if name in PRESETS:
        return PRESETS[name]
    m = _TUPLE.fullmatch(name)
    if m:
        r, c = int(m.group(1)), int(m.group(2))
        if r < 1 or c < 1 or r * c > 256:
            raise InvalidInput(f"mesh {name!r}: rows and cols must be >= 1 with at most 256 chips")
        chip = BLACKHOLE if (m.group(3) or "").lower() == "blackhole" else WORMHOLE
        topo = "linear" if r == 1 and c <= 2 else ("ring" if r == 1 else "torus")
        return Mesh(f"({r},{c})" + ("@blackhole" if chip is BLACKHOLE else ""), (r, c), chip, topo)
    raise InvalidInput(f"unknown mesh {name!r}; valid: {valid_names()}")


def same_mesh(a: str, b: str) -> bool:
    """Whether two mesh names mean one mesh: equal names, or the same shape of the same chip
    (Tenstorrent's ``MESH_DEVICE="(1,8)"`` is a T3K). An unknown name matches nothing else."""
    if a == b:
        return True
    ma, mb = try_resolve(a), try_resolve(b)
    return ma is not None and mb is not None and tuple(ma.shape) == tuple(mb.shape) \
        and ma.chip.arch == mb.chip.arch


def spec_target(where, targets, mesh: str) -> str:
    """The one of a spec's ``targets`` that ``mesh`` names (:func:`same_mesh`: ``"(1,8)"`` is
    the T3K target); InvalidInput naming the spec file ``where`` and its targets if none."""
    named = [t for t in targets if same_mesh(mesh, t)]
    if not named:
        raise InvalidInput(f"{where}: mesh {mesh} is not one of its targets ({', '.join(targets)})")
    return named[0]


def try_resolve(name: str) -> Mesh | None:
    try:
        return resolve(name)
    except InvalidInput:
        return None


def target_key(names, mesh_name: str) -> str:
    """The entry of ``names`` (targets as written) that names mesh ``mesh_name``, else itself."""
    if mesh_name in names:
        return mesh_name
    for k in names:
        m = try_resolve(k)
        if m is not None and m.name == mesh_name:
            return k
    return mesh_name


def replica_mesh(target: Mesh, replicas: dict) -> Mesh:
    """The mesh one replica of ``target`` runs on under a spec's ``replicas:`` (keyed by target
    names as written): ``target`` itself, or its split (:func:`split`)."""
    rep = replicas.get(target_key(replicas, target.name))
    return target if rep is None else split(target, rep.submesh)
