"""PartitionSpecs as ttnn mesh mappers, where a ttnn mapper can express the split.

``ttnn.ShardTensor2dMesh(mesh, mesh_shape, dims=(row_dim, col_dim))`` cuts one tensor dim evenly
over the mesh rows and one over the columns (devices row-major, as ttbundle numbers them:
``d = r * cols + c``); ``ttnn.ReplicateTensorToMesh`` copies. A plan's split is one of those
when every dim is split over at most one axis, each axis splits at most one dim, and the split is
even with nothing padded or replicated inside it (``sharding.kv_heads: replicate`` and padded
heads/vocab are ttbundle's own per-device layouts: ``mapper_dims`` returns None for them and the
per-device ``.tensorbin`` files carry the split instead).
"""

from __future__ import annotations

from ...layout import axes_of, even_part
from .layout import TILE, device_shape

AXIS_INDEX = {"rows": 0, "cols": 1}


def mapper_dims(plan, name: str, policy=None) -> dict | None:
    """``{"type": "ReplicateTensorToMesh"}``, ``{"type": "ShardTensor2dMesh", "dims": [r, c]}``
    (dims of the ttnn-shaped tensor, ``None`` = replicated along that mesh axis), or None when no
    ttnn mapper reproduces the plan's per-device shards of tensor ``name``."""
    t = next(x for x in plan.tensors if x.name == name)
    if t.notes:  # padded or replicated units inside a split
        return None
    mesh = plan.mesh
    dims: list[int | None] = [None, None]
    for k, (size, entry) in enumerate(zip(t.shape, t.spec)):
        axes = axes_of(entry)
        if not axes:
            continue
        if len(axes) > 1:
            return None
        a = AXIS_INDEX[axes[0]]
        n = mesh.axis_size(axes[0])
        if dims[a] is not None or even_part(size, n) != t.device_shape[k]:
            return None
        dims[a] = k
    if dims == [None, None]:
        return {"type": "ReplicateTensorToMesh"}
    if t.layout == "ROW_MAJOR" and len(t.shape) == 1:
        # held as [1, 1, N/32, 32]: an even split of N is a split of dim 2 in whole rows of 32
        if t.device_shape[0] % TILE:
            return None
        dims = [None if d is None else 2 for d in dims]
    shp = device_shape(t.device_shape, t.layout)
    assert all(d is None or d < len(shp) for d in dims)
    return {"type": "ShardTensor2dMesh", "dims": dims}


def make_mapper(ttnn, mesh_device, mesh_shape, m: dict | None):
    """A :func:`mapper_dims` result as ttnn's mapper object (what ``ttnn.distribute_tensor`` and
    ``ttnn.as_tensor(mesh_mapper=...)`` take), or None."""
    if m is None:
        return None
    if m["type"] == "ReplicateTensorToMesh":
        return ttnn.replicate_tensor_to_mesh_mapper(mesh_device)
    return ttnn.ShardTensor2dMesh(mesh_device, mesh_shape=tuple(mesh_shape), dims=tuple(m["dims"]))


def ttnn_mapper(ttnn, mesh_device, plan, name: str, policy=None):
    """The ttnn mapper object for tensor ``name`` on ``mesh_device``, or None."""
    return make_mapper(ttnn, mesh_device, plan.mesh.shape, mapper_dims(plan, name, policy))


def expressible(plan) -> dict[str, bool]:
    """Per tensor: whether a ttnn mapper reproduces its split."""
    return {t.name: mapper_dims(plan, t.name) is not None for t in plan.tensors}


__all__ = ["expressible", "make_mapper", "mapper_dims", "ttnn_mapper"]
