"""Which global elements each device holds, in which order: the one owner of the layout rule.

Every stage that needs to know where a tensor's elements live calls this module: ``plan``
(per-device shapes and memory), ``lower`` (program shapes), ``build`` (cutting weight shards),
``package`` (reassembling them), the emulated mesh (scatter, gather, reduce) and the ttnn
lowering (the order of its per-axis collectives). Nothing else computes it.

Vocabulary (PyTorch DTensor's): per mesh axis a tensor is ``Shard(dim)``, ``Replicate()`` or
``Partial()`` (a pending sum). A PartitionSpec entry lists the mesh axes a tensor dim is split
over, outermost first: ``("rows", "cols")`` puts device ``(r, c)`` at position ``r * C + c`` of
its group (DTensor's ``[Shard(d), Shard(d)]``), ``("cols", "rows")`` at ``c * R + r``.
Devices are numbered ``d = r * cols + c`` (mesh order, rows-major).

Where a dim does not divide its axes ttbundle pads (DTensor splits like ``torch.chunk``
instead): a dim is a count of *units* (heads, tiles, rows) of ``Dim.unit`` elements, and a
device's shard is a list of global unit indices, ``-1`` for a zero padding unit.
Rules, all in :func:`split` / :func:`units`:

* even: device ``i`` of its group holds units ``[i * per, (i + 1) * per)``;
* vocabulary: splits in whole 32-wide tiles; ``vocab: pad`` zero-pads at the end;
* KV heads (``Dim.name == "num_key_value_heads"``): ``kv_heads: replicate`` gives each device
  the one KV head its query heads use (axis a multiple of the heads), ``pad`` zero-pads at the
  end;
* query heads grouped under KV heads (``Dim.groups`` = KV heads): the query heads a device
  holds are exactly those of the KV heads it holds, so a padded KV head brings a padded group
  of query heads and a replicated KV head splits its group over its replicas (each part
  padded to the same size). With even KV heads this is the even split.

Collectives: an all_gather over several axes concatenates the group in group order; the ttnn
lowering gets that order by gathering the innermost axis first (:func:`gather_sequence`) and
partitions outermost first (:func:`partition_sequence`); a padded or replicated dim is put back in
global order by :func:`gather_index`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .families.base import Dim
from .mesh import AXES, Mesh
from .tiles import TILE, cdiv as _cdiv, round_up as _round_up


# ---- DTensor's placements ----------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    dim: int

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    reduce_op: str = "sum"

    def __repr__(self) -> str:
        return "Partial()"


def axes_of(entry) -> tuple[str, ...]:
    """PartitionSpec entry -> tuple of axis names (``()`` = replicated)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def tensor_layout(t) -> str:
    """How a declared tensor (``families.base.TensorDecl``) is held on device: matrices ``TILE``,
    vectors and embeddings ``ROW_MAJOR`` (``backends/ttnn/layout.py`` gives the buffer shapes)."""
    return "TILE" if t.kind == "matrix" else "ROW_MAJOR"


def placements(spec, partial=()) -> tuple:
    """DTensor placements (one per mesh axis, ``rows`` first) of a tensor with PartitionSpec
    ``spec`` and pending sums over the axes ``partial``. Raises ValueError where DTensor's plain
    placements cannot say it: an axis used twice, or a dim split over ``("cols", "rows")``
    (DTensor needs a strided shard for that order)."""
    out: dict[str, object] = {}
    for i, e in enumerate(spec):
        ax = axes_of(e)
        if len(ax) > 1 and [AXES.index(a) for a in ax] != sorted(AXES.index(a) for a in ax):
            raise ValueError(f"dim {i} split over {ax}: not expressible as plain DTensor placements (DTensor needs a strided shard for that order)")
        for a in ax:
            if a in out:
                raise ValueError(f"mesh axis {a} used twice in {spec}")
            out[a] = Shard(i)
    for a in partial:
        if a in out:
            raise ValueError(f"mesh axis {a} both shards and reduces")
        out[a] = Partial()
    return tuple(out.get(a, Replicate()) for a in AXES)


# ---- even splits -------------------------------------------------------------------------------
def even_part(size: int, n: int) -> int | None:
    """What each of ``n`` devices holds of a dim of ``size`` split evenly, nothing padded or
    replicated (ttnn's ``mesh_partition`` and ``ShardTensor2dMesh``, and so a ttnn mapper), or
    None when ``n`` does not divide ``size``; :func:`even_slice` says which part."""
    return size // n if size % n == 0 else None


def even_slice(size: int, n: int, i: int) -> slice | None:
    """The elements the ``i``-th of ``n`` devices holds of an even split of ``size`` (the i-th
    part, in order: what ``np.split(x, n)[i]`` cuts), or None when ``n`` does not divide it."""
    part = even_part(size, n)
    return None if part is None else slice(i * part, (i + 1) * part)


# ---- device groups -----------------------------------------------------------------------------
def group_size(mesh: Mesh, axes) -> int:
    return math.prod(mesh.axis_size(a) for a in axes_of(axes)) if axes else 1


def coord(mesh: Mesh, d: int, axis: str) -> int:
    return d // mesh.cols if axis == "rows" else d % mesh.cols


@functools.lru_cache(maxsize=None)
def _group_index(shape: tuple[int, int], axes: tuple[str, ...]) -> tuple[int, ...]:
    R, C = shape
    idx = [0] * (R * C)
    for ax in axes:
        size = R if ax == "rows" else C
        for d in range(R * C):
            idx[d] = idx[d] * size + (d // C if ax == "rows" else d % C)
    return tuple(idx)


def group_index(mesh: Mesh, axes) -> list[int]:
    """Each device's position within its group over ``axes`` (first axis outermost)."""
    return list(_group_index(tuple(mesh.shape), axes_of(axes)))


def group_of(mesh: Mesh, axes, d: int) -> list[int]:
    """The devices of ``d``'s group over ``axes``, in group order (the order an all_gather
    concatenates them in)."""
    axes = axes_of(axes)
    idx = _group_index(tuple(mesh.shape), axes)
    fixed = [a for a in AXES if a not in axes]
    members = [e for e in range(mesh.num_devices) if all(coord(mesh, e, a) == coord(mesh, d, a) for a in fixed)]
    return sorted(members, key=lambda e: idx[e])


def groups(mesh: Mesh, axes) -> list[list[int]]:
    """Every group over ``axes`` (each in group order), in the order of their first device."""
    seen, out = set(), []
    for d in range(mesh.num_devices):
        if d not in seen:
            g = group_of(mesh, axes, d)
            seen.update(g)
            out.append(g)
    return out


def gather_sequence(axes) -> tuple[str, ...]:
    """The per-axis all_gathers, in order, whose result is the group order of ``axes``: the
    innermost axis first (gathering ``cols`` then ``rows`` concatenates row blocks, each in
    column order: position ``r * C + c``)."""
    return tuple(reversed(axes_of(axes)))


def partition_sequence(axes) -> tuple[str, ...]:
    """The per-axis partitions (each keeping a device's part along one mesh axis, as ttnn's
    ``mesh_partition`` does), in order, that leave every device the part at its group position
    of ``axes``: the outermost axis first (cutting by ``rows`` then ``cols`` leaves device
    ``(r, c)`` part ``r * C + c``). The inverse of :func:`gather_sequence`."""
    return axes_of(axes)


# ---- one dim over its axes ------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """How a dim splits over its axes: units per device (padding included), a note for the plan
    when padded or replicated, or the error saying why it cannot."""

    per_device: int
    note: str | None = None
    error: str | None = None
    padded_size: int | None = None  # global units incl. padding (None: not padded)


def _divisors_hint(size: int, n: int) -> str:
    divs = [d for d in (1, 2, 4, 8, 16, 32) if size % d == 0 and d != n]
    return ", ".join(map(str, divs[-3:]))


def _kv_mode(kv: int, n: int, policy) -> str:
    """How ``kv`` KV heads lay out over ``n`` devices: even, replicate, pad or error."""
    if n == 1 or kv % n == 0:
        return "even"
    mode = getattr(policy, "kv_heads", "replicate")
    if mode == "replicate" and n % kv == 0:
        return "replicate"
    return "pad" if mode == "pad" else "error"


def split(d: Dim, axes, mesh: Mesh, policy) -> Split:
    """Units of ``d`` per device over ``axes`` (see the module docstring for the rules)."""
    axes = axes_of(axes)
    n = group_size(mesh, axes)
    if getattr(d, "groups", 0) and n > 1:
        return _split_grouped(d, axes, n, mesh, policy)
    quantum = n * TILE if d.name == "vocab_size" and n > 1 else n
    if n == 1 or d.size % quantum == 0:
        return Split(d.size // n)
    where = f"mesh axis {'*'.join(axes)}={n} ({mesh.describe()})"
    arith = f"{d.name}={d.size} is not divisible by {where}"
    if d.size % n == 0:
        arith = (f"{d.name}={d.size} over {where} is {d.size // n} per device, not whole "
                 f"{TILE}-wide tiles ({d.size} is not a multiple of {n}*{TILE}={quantum})")
    if d.name == "num_key_value_heads":
        mode = _kv_mode(d.size, n, policy)
        if mode == "replicate":
            return Split(1, f"each KV head replicated on {n // d.size} devices")
        if mode == "pad":
            padded = _round_up(d.size, n)
            return Split(padded // n, f"KV heads padded {d.size} -> {padded}", padded_size=padded)
        if getattr(policy, "kv_heads", "") != "error":
            return Split(0, error=(f"{arith}, and {n} is not a multiple of {d.size} so heads cannot be "
                                   f"replicated; use sharding.kv_heads: pad, or a mesh axis that divides "
                                   f"or is a multiple of {d.size}"))
    if d.name == "num_attention_heads" and getattr(policy, "attention_heads", "") == "pad":
        padded = _round_up(d.size, n)
        return Split(padded // n, f"query heads padded {d.size} -> {padded}", padded_size=padded)
    if d.name == "vocab_size" and getattr(policy, "vocab", "") == "pad":
        padded = _round_up(d.size, quantum)
        return Split(padded // n, f"vocab padded {d.size} -> {padded}", padded_size=padded)
    fixes = {"num_attention_heads": "sharding.attention_heads: pad",
             "num_key_value_heads": "sharding.kv_heads: replicate or pad",
             "vocab_size": "sharding.vocab: pad"}
    tiles = d.size // TILE if quantum != n and d.size % TILE == 0 else None
    hint = _divisors_hint(tiles or d.size, n)
    fix = ["replicate that dim (null)", f"a mesh whose axis divides {d.size}"
           + (f" into {TILE}-wide tiles" if quantum != n else "") + (f" (e.g. {hint})" if hint else "")]
    if d.name in fixes:
        fix.insert(0, fixes[d.name])
    return Split(0, error=f"{arith}; fix: {' or '.join(fix)}")


def _grouped(d: Dim, n: int, policy) -> tuple[str, int, int]:
    """Query heads under ``d.groups`` KV heads over ``n`` devices: (KV mode, KV heads per
    device or replicas per KV head, query heads per device)."""
    kv, g = d.groups, d.size // d.groups
    mode = _kv_mode(kv, n, policy)
    if mode == "even":
        return mode, kv // n, kv // n * g
    if mode == "replicate":
        rep = n // kv
        return mode, rep, _cdiv(g, rep)
    if mode == "pad":
        per_kv = _round_up(kv, n) // n
        return mode, per_kv, per_kv * g
    return mode, 0, 0


def _split_grouped(d: Dim, axes, n: int, mesh: Mesh, policy) -> Split:
    kv, g = d.groups, d.size // d.groups
    mode, k, per = _grouped(d, n, policy)
    if mode == "error":  # the KV heads' own error says what to do; split the query heads alone
        return split(Dim(d.name, d.size, d.unit), axes, mesh, policy)
    padded = per * n
    if padded == d.size:
        return Split(per)
    where = f"mesh axis {'*'.join(axes)}={n} ({mesh.describe()})"
    why = (f"KV heads padded {kv} -> {_round_up(kv, n)}" if mode == "pad" else
           f"each KV head's {g} query heads split over its {k} replicas")
    if getattr(policy, "attention_heads", "") != "pad":
        head = (f"{d.name}={d.size} is not divisible by {where}" if d.size % n else
                f"{d.name}={d.size} over {where}")
        return Split(0, error=(f"{head}; fix: sharding.attention_heads: pad or replicate that dim (null) "
                               f"or a mesh axis that divides {kv} ({why}, so the query heads must be padded "
                               f"{d.size} -> {padded} to stay with their KV heads)"))
    return Split(per, f"query heads padded {d.size} -> {padded} ({why})", padded_size=padded)


@functools.lru_cache(maxsize=4096)
def _units(d: Dim, axes: tuple[str, ...], shape: tuple[int, int], mesh: Mesh, policy_key) -> tuple:
    policy = Policy(*policy_key)
    n = group_size(mesh, axes)
    if n == 1:
        return (tuple(range(d.size)),) * mesh.num_devices
    s = split(d, axes, mesh, policy)
    if s.error:
        raise ValueError(s.error)
    idx = _group_index(shape, axes)
    out = []
    if getattr(d, "groups", 0) and _kv_mode(d.groups, n, policy) != "error":
        kv, g = d.groups, d.size // d.groups
        mode, k, per = _grouped(d, n, policy)
        for i in idx:
            if mode == "replicate":
                kh, part = divmod(i, k)
                u = [kh * g + part * per + j if part * per + j < g else -1 for j in range(per)]
            else:
                u = [kh * g + j if kh < kv else -1
                     for kh in range(i * k, (i + 1) * k) for j in range(g)]
            out.append(tuple(u))
        return tuple(out)
    if d.name == "num_key_value_heads" and _kv_mode(d.size, n, policy) == "replicate":
        return tuple((i * d.size // n,) for i in idx)
    per = s.per_device
    for i in idx:
        out.append(tuple(u if u < d.size else -1 for u in range(i * per, (i + 1) * per)))
    return tuple(out)


@dataclass(frozen=True)
class Policy:
    """The sharding-policy fields the layout rule reads (``spec.Sharding`` has them too); a
    program records them (``to_json``) so its executors need no spec."""

    kv_heads: str = "replicate"
    attention_heads: str = "error"
    vocab: str = "pad"

    @classmethod
    def of(cls, policy) -> "Policy":
        return cls(*policy_key(policy))

    @classmethod
    def from_json(cls, d: dict | None, fallback=None) -> "Policy":
        """A program's recorded policy; without one, ``fallback``'s (a spec's ``Sharding``)."""
        return cls(**d) if d else cls.of(fallback)

    def to_json(self) -> dict:
        return {"kv_heads": self.kv_heads, "attention_heads": self.attention_heads, "vocab": self.vocab}


def policy_key(policy) -> tuple:
    return (getattr(policy, "kv_heads", "replicate"), getattr(policy, "attention_heads", "error"),
            getattr(policy, "vocab", "pad"))


def units(d: Dim, axes, mesh: Mesh, policy) -> list[list[int]]:
    """Per device (mesh order), the global unit indices of ``d`` it holds in its shard's order;
    ``-1`` is a zero padding unit. Raises ValueError when ``d`` cannot split over ``axes``."""
    return [list(u) for u in _units(d, axes_of(axes), tuple(mesh.shape), mesh, policy_key(policy))]


def positions(d: Dim, axes, mesh: Mesh, policy) -> list[list[int]]:
    """Per device, the global element positions along ``d`` (``-1`` = padding)."""
    return [elements(u, d.unit) for u in units(d, axes, mesh, policy)]


def elements(us, unit: int) -> list[int]:
    """Element positions of a list of units (``-1`` stays padding, ``unit`` elements each)."""
    return [u * unit + k if u >= 0 else -1 for u in us for k in range(unit)]


def local_len(d: Dim, axes, mesh: Mesh, policy) -> int:
    """Elements of ``d`` on one device (padding included)."""
    axes = axes_of(axes)
    if not axes:
        return d.length
    s = split(d, axes, mesh, policy)
    if s.error:  # activations of a plan that resolved always split; defensive
        return _cdiv(d.length, group_size(mesh, axes))
    return s.per_device * d.unit


def unit_runs(us) -> tuple[int, int] | None:
    """``(first, count)`` when ``us`` is one contiguous run without padding, else None."""
    us = list(us)
    if not us or us[0] < 0 or us != list(range(us[0], us[0] + len(us))):
        return None
    return us[0], len(us)


def tensor_units(dims, spec, mesh: Mesh, policy) -> list[list[list[int]]]:
    """Per tensor dim, per device: the units it holds (:func:`units` of every dim)."""
    return [units(d, axes_of(e), mesh, policy) for d, e in zip(dims, spec)]


def holders(unit_lists, devices: int) -> list[int]:
    """For each device, the first device (in mesh order) whose shard holds the same units of
    every dim in the same order, itself when none before it does (``unit_lists``: per dim, per
    device, as :func:`tensor_units` gives them). Devices with one holder hold identical shards
    (padding included): a package stores such a shard once, in its holder's file, and the
    emulated mesh holds one copy of it."""
    first: dict[tuple, int] = {}
    out = []
    for d in range(devices):
        out.append(first.setdefault(tuple(tuple(u[d]) for u in unit_lists), d))
    return out


def gather_index(d: Dim, axes, mesh: Mesh, policy) -> list[int] | None:
    """For each global element of ``d``, its position in the concatenation an all_gather over
    ``axes`` produces (group order, padding and replicas included); None when the concatenation
    is already the global order. Replicas hold identical values, so the first copy serves."""
    axes = axes_of(axes)
    pos = positions(d, axes, mesh, policy)
    flat = [p for member in group_of(mesh, axes, 0) for p in pos[member]]
    if flat == list(range(d.length)):
        return None
    inv = [-1] * d.length
    for i, p in enumerate(flat):
        if p >= 0 and inv[p] < 0:
            inv[p] = i
    if min(inv) < 0:
        raise ValueError(f"{d.name}: an all_gather over {axes} does not hold every element")
    return inv


__all__ = ["AXES", "Partial", "Replicate", "Shard", "Split", "axes_of", "elements", "gather_index",
           "gather_sequence", "group_index", "holders", "partition_sequence", "group_of", "group_size", "groups", "local_len",
           "placements", "positions", "split", "tensor_units", "unit_runs", "units"]
