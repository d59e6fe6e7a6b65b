"""Device-batched tensors and explicit collectives for an emulated mesh.

Every per-device value is one torch tensor with a leading device dim ``D = rows * cols``
(device ``d`` is mesh coordinate ``(d // cols, d % cols)``), so a 32-device mesh costs one
batched op, not 32. Collectives move data between the slices of that dim exactly as the real
mesh would: a wrong sharding plan produces wrong numbers here.
"""

from __future__ import annotations

import torch

from ... import layout
from ...families.base import Dim
from ...layout import axes_of
from ...mesh import AXES, Mesh


class MeshOps:
    def __init__(self, mesh: Mesh, device: torch.device | str = "cpu"):
        self.mesh = mesh
        self.R, self.C = mesh.shape
        self.D = self.R * self.C
        self.device = torch.device(device)
        self._index_cache: dict = {}

    # -- shard indices (layout's rule as index tensors) ---------------------------------------
    def shard_positions(self, d: Dim, axes: tuple[str, ...], policy) -> torch.Tensor:
        """[D, local_len] element positions along ``d`` for each device; ``-1`` marks padding
        (zeros). ``layout.positions`` as a tensor."""
        key = ("pos", d, axes_of(axes), layout.policy_key(policy))
        if key not in self._index_cache:
            pos = layout.positions(d, axes, self.mesh, policy)
            self._index_cache[key] = torch.tensor(pos, dtype=torch.long, device=self.device)
        return self._index_cache[key]

    def take(self, x: torch.Tensor, dim: int, pos: torch.Tensor) -> torch.Tensor:
        """Per-device slice of dim ``dim`` of ``x`` ([n, ...]) at positions ``pos`` [n, L] (n: the
        devices, or some of them)."""
        if (pos < 0).any():
            pad_shape = list(x.shape)
            pad_shape[dim] = 1
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
            pos = torch.where(pos < 0, torch.full_like(pos, x.shape[dim] - 1), pos)
        shape = [1] * x.dim()
        shape[0], shape[dim] = pos.shape[0], pos.shape[1]
        index = pos.view(shape).expand(*[x.shape[i] if i not in (0, dim) else shape[i]
                                         for i in range(x.dim())])
        return torch.gather(x, dim, index)

    def shard(self, t: torch.Tensor, dims: tuple[Dim, ...], spec, policy, devices=None) -> torch.Tensor:
        """Global tensor -> [D, *local] per the PartitionSpec ``spec`` ([len(devices), *local]:
        the shards of ``devices`` only)."""
        sel = None if devices is None else torch.tensor(list(devices), dtype=torch.long, device=self.device)
        n = self.D if sel is None else len(sel)
        x = t.to(self.device).unsqueeze(0).expand(n, *t.shape)
        for i, (d, e) in enumerate(zip(dims, spec)):
            axes = axes_of(e)
            if axes:
                pos = self.shard_positions(d, axes, policy)
                x = self.take(x, i + 1, pos if sel is None else pos.index_select(0, sel))
        return x.contiguous()

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, axes: tuple[str, ...], devices: slice | None = None) -> torch.Tensor:
        """Sum over the devices of each group along ``axes``; every member gets the sum.
        ``devices``: only those devices' results (``[n, ...]``; a slice of the device dim): the
        sums are computed once per group either way, and no copy is made for the others."""
        g = x.view(self.R, self.C, *x.shape[1:])
        dims = tuple(AXES.index(a) for a in axes)
        s = g.sum(dim=dims, keepdim=True)
        if devices is not None:
            idx = torch.arange(self.D, device=x.device)[devices]
            return s.expand_as(g)[idx // self.C, idx % self.C]
        return s.expand_as(g).reshape(x.shape)

    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...], dim: int, feature: Dim | None = None,
                   policy=None, devices: slice | None = None) -> torch.Tensor:
        """Concatenate dim ``dim`` (of ``x``, counting the device dim) over ``axes`` in group
        order (``layout.group_of``); every member of a group gets the result (``devices``: only
        those devices' results, ``[n, ...]``, as :meth:`all_reduce`).

        With ``feature`` (the gathered dim's declaration) the result is put back in global order:
        padding dropped and replicated shards (KV heads) taken once (``layout.gather_index``)."""
        out = self._concat(x, axes, dim, devices)
        if feature is None:
            return out
        key = ("gather", feature, axes_of(axes), layout.policy_key(policy))
        if key not in self._index_cache:
            inv = layout.gather_index(feature, axes, self.mesh, policy)
            self._index_cache[key] = None if inv is None else torch.tensor(inv, dtype=torch.long,
                                                                             device=self.device)
        inv = self._index_cache[key]
        return out if inv is None else out.index_select(dim, inv)

    def _concat(self, x: torch.Tensor, axes: tuple[str, ...], dim: int, devices: slice | None = None) -> torch.Tensor:
        key = ("groups", axes_of(axes))
        if key not in self._index_cache:
            gs = layout.groups(self.mesh, axes)
            member_of = {d: gi for gi, g in enumerate(gs) for d in g}
            self._index_cache[key] = (torch.tensor(gs, dtype=torch.long, device=self.device),
                                      torch.tensor([member_of[d] for d in range(self.D)], device=self.device))
        gs, member_of = self._index_cache[key]
        G, n = gs.shape
        parts = x.index_select(0, gs.reshape(-1)).view(G, n, *x.shape[1:])  # [G, n, ...]
        # concatenate the n members along dim (dim counts the device dim: in parts it is dim + 1)
        full = torch.cat(parts.unbind(1), dim=dim)  # [G, ..., n * L, ...]
        return full.index_select(0, member_of if devices is None else member_of[devices])

