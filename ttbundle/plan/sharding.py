"""Sharding resolution: the PartitionSpec of every tensor (family default, then ``sharding.plan``,
then ``sharding.targets[<mesh>]``, :func:`resolved_plan`), the mesh a target's replica runs on
(:func:`target_mesh`), and each device's shard of every tensor with one diagnostic per dim that
does not divide its axis (:func:`sharding_diagnostics`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import layout as layoutmod, mesh as meshmod
from ..errors import Diagnostic, InvalidInput
from ..families.base import TensorDecl
from ..layout import axes_of, tensor_layout
from ..mesh import AXES, Mesh
from .memory import tensor_bytes

def fmt_entry(entry) -> str:
    ax = axes_of(entry)
    return "null" if not ax else ax[0] if len(ax) == 1 else "[" + ",".join(ax) + "]"


@dataclass
class TensorPlan:
    name: str
    group: str
    dtype: str
    layout: str  # TILE | ROW_MAJOR
    shape: list[int]
    spec: list  # one entry per dim
    device_shape: list[int]
    count: int  # copies (layers) on each device
    bytes_per_copy: int  # DRAM bytes per device for one copy, allocator-rounded
    notes: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return self.bytes_per_copy * self.count

    def notation(self) -> str:
        """JAX-style: ``bf16[4096, 14336@cols]`` (global dims, split axes after ``@``)."""
        parts = []
        for n, e in zip(self.shape, self.spec):
            ax = axes_of(e)
            parts.append(f"{n}@{'*'.join(ax)}" if ax else str(n))
        return f"{self.dtype}[{', '.join(parts)}]"


def resolved_plan(bundle, mesh_name: str) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Final PartitionSpec per tensor and, per tensor, the spec key path it came from."""
    fam, a, s = bundle.family, bundle.arch, bundle.spec
    names = [t.name for t in fam.tensors(a)]
    default = fam.default_plan(a)
    plan, origin = {}, {}
    for n in names:
        rank = next(len(t.dims) for t in fam.tensors(a) if t.name == n)
        plan[n] = tuple(default.get(n, (None,) * rank))
        origin[n] = None
    for n, sp in s.sharding.plan.items():
        if n in plan:
            plan[n], origin[n] = tuple(sp), ("sharding", "plan", n)
    key = meshmod.target_key(s.sharding.targets, mesh_name)
    for n, sp in s.sharding.targets.get(key, {}).items():
        if n in plan:
            plan[n], origin[n] = tuple(sp), ("sharding", "targets", key, n)
    return plan, origin


def tensor_dtype(spec, t: TensorDecl) -> str:
    """A declared tensor's storage dtype under ``spec``'s dtype policy (matrices only; the rest
    stay bf16)."""
    return spec.weights.dtypes.dtype_of(t.name, t.group) if t.kind == "matrix" else "bf16"


def replicate_undividable(bundle, mesh_name: str) -> dict[str, list]:
    """Per tensor whose resolved spec does not divide mesh ``mesh_name``'s axes (the dims
    ``_shard_tensors`` reports): that spec with those dims replicated, i.e. the per-target
    override ``init`` writes when padding heads is not enough (e.g. an MLP width that is not
    whole tiles per device). Head dims are left alone: ``sharding.attention_heads`` /
    ``kv_heads`` pad them instead."""
    mesh = target_mesh(bundle, mesh_name)
    specs, _ = resolved_plan(bundle, mesh.name)
    out = {}
    for t in bundle.family.tensors(bundle.arch):
        spec = list(specs[t.name])
        bad = {i for i, (d, e) in enumerate(zip(t.dims, spec))
               if axes_of(e) and d.name not in ("num_attention_heads", "num_key_value_heads")
               and layoutmod.split(d, axes_of(e), mesh, bundle.spec.sharding).error}
        if bad:
            out[t.name] = [None if i in bad else e for i, e in enumerate(spec)]
    return out


def _shard_tensors(bundle, mesh: Mesh):
    """Per-device shard of every tensor, and one diagnostic per dim that does not divide its axis.
    Needs only the schema to be valid, so ``validate`` can report these next to spec errors."""
    fam, a, s = bundle.family, bundle.arch, bundle.spec
    specs, origin = resolved_plan(bundle, mesh.name)
    decls = {t.name: t for t in fam.tensors(a)}
    errors: dict[tuple, tuple[list[str], str, tuple]] = {}
    tensors: list[TensorPlan] = []
    tkey = meshmod.target_key(s.targets, mesh.name)
    target_idx = s.targets.index(tkey) if tkey in s.targets else None

    for t in decls.values():
        spec = specs[t.name]
        if len(spec) != len(t.dims):
            continue  # spec.check reports the rank; only reached for a spec with errors
        dev, notes = [], []
        for d, e in zip(t.dims, spec):
            ax = axes_of(e)
            for x in ax:
                if x not in AXES:  # schema already limits this; defensive for API callers
                    raise InvalidInput(f"{t.name}: unknown mesh axis {x!r}; axes are rows, cols")
            sp = layoutmod.split(d, ax, mesh, s.sharding)
            units, note, err = sp.per_device, sp.note, sp.error
            if err:
                key = (d.name, ax)
                at = origin[t.name] or (("targets", target_idx) if target_idx is not None else ("targets",))
                errors.setdefault(key, ([], err, at))[0].append(t.name)
            if note and note not in notes:
                notes.append(note)
            dev.append(units * d.unit)
        dtype = tensor_dtype(s, t)
        layout = tensor_layout(t)
        tensors.append(TensorPlan(t.name, t.group, dtype, layout, list(t.shape), list(spec), dev,
                                  t.count, tensor_bytes(dev, dtype, layout, mesh), notes))
    diags = []
    for (dname, ax), (tnames, msg, at) in errors.items():
        origin_note = "" if at[0] == "sharding" else " (family default plan)"
        diags.append(bundle.locate(at, f"{', '.join(tnames)}{origin_note}: {msg}"))
    return specs, decls, tensors, diags


def sharding_diagnostics(bundle, mesh: Mesh | str) -> list[Diagnostic]:
    """The divisibility errors of ``bundle`` on ``mesh`` (works on a spec with other errors)."""
    if isinstance(mesh, str):
        try:
            mesh = target_mesh(bundle, mesh)
        except InvalidInput:  # a submesh that does not tile: reported by spec.check
            mesh = meshmod.resolve(mesh)
    return _shard_tensors(bundle, mesh)[3]


def target_mesh(bundle, name: str) -> Mesh:
    """The mesh one replica of target ``name`` runs on: the target itself, or, when the spec's
    ``replicas`` splits it, the submesh (``mesh.split``), planned as a standalone mesh."""
    return meshmod.replica_mesh(meshmod.resolve(name), bundle.spec.replicas)
