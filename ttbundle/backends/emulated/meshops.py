"""Device-batched tensors and explicit collectives for an emulated mesh.

Every per-device value is one torch tensor with a leading device dim ``D = rows * cols``
(device ``d`` is mesh coordinate ``(d // cols, d % cols)``), so a 32-device mesh costs one
batched op, not 32. Collectives move data between the slices of that dim exactly as the real
mesh would: a wrong sharding plan produces wrong numbers here.
"""

from __future__ import annotations

import math

import torch

from ...families.base import Dim
from ...mesh import AXES, Mesh
from ...plan import axes_of


class MeshOps:
    def __init__(self, mesh: Mesh, device: torch.device | str = "cpu"):
        self.mesh = mesh
        self.R, self.C = mesh.shape
        self.D = self.R * self.C
        self.device = torch.device(device)
        self._index_cache: dict = {}

    # -- shard indices ------------------------------------------------------------------------
    def group_index(self, axes: tuple[str, ...]) -> tuple[torch.Tensor, int]:
        """Each device's position within its group over ``axes`` (rows-major), and group size."""
        r = torch.arange(self.D) // self.C
        c = torch.arange(self.D) % self.C
        coord = {"rows": r, "cols": c}
        idx, n = torch.zeros(self.D, dtype=torch.long), 1
        for ax in axes:
            size = self.mesh.axis_size(ax)
            idx, n = idx * size + coord[ax], n * size
        return idx, n

    def shard_positions(self, d: Dim, axes: tuple[str, ...], policy) -> torch.Tensor:
        """[D, local_len] element positions along a dim of length ``d.length`` for each device;
        ``-1`` marks padding (zeros). Same rules as ``plan.shard_dim``."""
        key = (d, axes, getattr(policy, "kv_heads", None), getattr(policy, "attention_heads", None),
               getattr(policy, "vocab", None))
        if key in self._index_cache:
            return self._index_cache[key]
        idx, n = self.group_index(axes)
        unit = d.unit
        if n == 1 or d.size % n == 0:
            per = d.size // n
            units = idx[:, None] * per + torch.arange(per)[None, :]
        elif d.name == "num_key_value_heads" and getattr(policy, "kv_heads", "") == "replicate" \
                and n % d.size == 0:
            units = (idx * d.size // n)[:, None]  # the KV head this device's query heads use
        else:  # padded: units beyond d.size are zeros
            per = -(-d.size // n)
            units = idx[:, None] * per + torch.arange(per)[None, :]
            units = torch.where(units < d.size, units, torch.full_like(units, -1))
        pos = units[:, :, None] * unit + torch.arange(unit)[None, None, :]
        pos = torch.where(units[:, :, None] >= 0, pos, torch.full_like(pos, -1)).reshape(self.D, -1)
        self._index_cache[key] = pos.to(self.device)
        return self._index_cache[key]

    def take(self, x: torch.Tensor, dim: int, pos: torch.Tensor) -> torch.Tensor:
        """Per-device slice of dim ``dim`` of ``x`` ([D, ...]) at positions ``pos`` [D, L]."""
        if (pos < 0).any():
            pad_shape = list(x.shape)
            pad_shape[dim] = 1
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
            pos = torch.where(pos < 0, torch.full_like(pos, x.shape[dim] - 1), pos)
        shape = [1] * x.dim()
        shape[0], shape[dim] = self.D, pos.shape[1]
        index = pos.view(shape).expand(*[x.shape[i] if i not in (0, dim) else shape[i]
                                         for i in range(x.dim())])
        return torch.gather(x, dim, index)

    def shard(self, t: torch.Tensor, dims: tuple[Dim, ...], spec, policy) -> torch.Tensor:
        """Global tensor -> [D, *local] per the PartitionSpec ``spec``."""
        x = t.to(self.device).unsqueeze(0).expand(self.D, *t.shape)
        for i, (d, e) in enumerate(zip(dims, spec)):
            axes = axes_of(e)
            if axes:
                x = self.take(x, i + 1, self.shard_positions(d, axes, policy))
        return x.contiguous()

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Sum over the devices of each group along ``axes``; every member gets the sum."""
        g = x.view(self.R, self.C, *x.shape[1:])
        dims = tuple(AXES.index(a) for a in axes)
        return g.sum(dim=dims, keepdim=True).expand_as(g).reshape(x.shape)

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...], dim: int, feature: Dim | None = None,
                   policy=None) -> torch.Tensor:
        """Concatenate dim ``dim`` (of ``x``, counting the device dim) over ``axes``, rows-major.

        With ``feature`` (the gathered dim's declaration) the result is put back in global order:
        padding dropped and replicated shards (KV heads) taken once."""
        out = self._concat(x, axes, dim)
        if feature is None:
            return out
        pos = self.shard_positions(feature, axes, policy)  # [D, L]
        idx, n = self.group_index(axes)
        first = [int((idx == k).nonzero()[0]) for k in range(n)]
        flat = pos[first].reshape(-1)  # position in the global dim of each concatenated element
        if bool((flat == torch.arange(flat.numel(), device=flat.device)).all()):
            return out
        inv = torch.empty(feature.length, dtype=torch.long, device=flat.device)
        valid = flat >= 0
        src = torch.arange(flat.numel(), device=flat.device)[valid]
        inv[flat[valid]] = src  # replicas hold identical values: any copy serves
        return out.index_select(dim, inv)

    def _concat(self, x: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        g = x.view(self.R, self.C, *x.shape[1:])
        d = dim + 1  # in g, dims 0 and 1 are (rows, cols)
        if axes == ("cols",):
            parts = [g[:, c] for c in range(self.C)]  # each [R, ...]
            full = torch.cat(parts, dim=d - 1)
            out = full.unsqueeze(1).expand(self.R, self.C, *full.shape[1:])
        elif axes == ("rows",):
            parts = [g[r] for r in range(self.R)]  # each [C, ...]
            full = torch.cat(parts, dim=d - 1)
            out = full.unsqueeze(0).expand(self.R, self.C, *full.shape[1:])
        else:
            order = [(r, c) for r in range(self.R) for c in range(self.C)]
            if axes == ("cols", "rows"):
                order = [(r, c) for c in range(self.C) for r in range(self.R)]
            full = torch.cat([g[r, c] for r, c in order], dim=d - 2)
            out = full.expand(self.R, self.C, *full.shape)
        return out.reshape(self.D, *out.shape[2:])


def group_size(mesh: Mesh, axes) -> int:
    return math.prod(mesh.axis_size(a) for a in axes_of(axes)) if axes else 1
