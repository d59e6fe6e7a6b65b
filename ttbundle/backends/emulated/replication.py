"""Which devices of an emulated mesh provably hold the same value, and when a value is dead.

Why: an emulated mesh keeps every per-device value as one ``[D, ...]`` tensor, so a TG (8x4)
holds 32 copies of an activation and runs a per-device kernel (attention, a norm, rope, a
residual add) 32 times even where the program's placements make most of those copies the same
(Mistral's heads split over TG's 4 columns: attention is 4 distinct computations, not 32). This
module is the one owner of that reasoning for the executor (``model.EmulatedModel._run``):

* :class:`Replication`: which mesh axes a value *varies over* (devices that differ only in their
  coordinate on such an axis may hold different values), derived step by step from what the
  program does and what the devices hold, never from a declared split alone:

  - the entry values (tokens, patches) vary over nothing;
  - a weight varies over the axes along which its held shards differ (``gemm.shards_of``: a
    shard the package stores once for several devices is one object), so a shard some device
    holds apart from the others (a wrong shard) makes it vary;
  - a per-device step's output varies over its inputs' and weights' axes (a matmul's also over
    the axes its weight's PartitionSpec splits: each device takes its slice of the input);
  - an ``all_reduce`` or ``all_gather`` over axes A gives every member of a group the same
    result, so its output varies over its input's axes minus A.

  A step whose inputs and weights vary over fewer axes than the mesh has runs on one device per
  class (:meth:`Replication.reps`: a strided slice of the device dim, a *view*, so a KV cache
  write lands in those devices' caches) and the result is shared (:meth:`Replication.spread`:
  an ``expand`` of one copy where it varies over nothing). Collectives always run as written,
  so a dropped or misplaced collective leaves an axis varying, the steps after it run on every
  device, and the numbers come out wrong as they would on the mesh.

* :class:`Classes`: a value that varies over one axis of a two-axis mesh held as one copy per
  class (``[C, ...]`` for ``cols``: row 0's devices; ``[R, ...]`` for ``rows``: column 0's),
  not the ``[D, ...]`` tensor no strided view can express (an ``expand`` over one axis of the
  device dim cannot be flattened into it): q, k, v, g, u after their ``all_reduce`` over TG's
  rows, attention's and SwiGLU's outputs. Steps that run per class read it as it is
  (:meth:`Replication.pick`); a reader that needs every device's copy (a matmul whose weight
  differs per device, a kernel handed every activation) gets :meth:`Classes.full`, a copy held
  for that step only. Without it TG held 8 copies of each (one per row).

* :func:`drops`: per step of a layer program, the activations whose last read it is, so the
  executor holds only live ``[D, ...]`` values (the rest of a layer's activations were held to
  the layer's end: several GB on TG at a 512-row prefill).
"""

from __future__ import annotations

import torch

from ...mesh import AXES
from ...program import Op


class Varies(Exception):
    """A step's weights (or per-device indices) differ among devices its inputs say are alike:
    the step runs on every device instead."""


class Classes:
    """``[D, ...]`` held as ``y`` ``[n, ...]``, one copy per class of devices alike but along
    ``varies`` (one axis of a two-axis mesh): device ``d``'s value is ``y[d % C]`` (``cols``) or
    ``y[d // C]`` (``rows``); ``y`` is what :meth:`Replication.reps` selects."""

    def __init__(self, y: torch.Tensor, varies: frozenset, rep: "Replication"):
        self.y, self.varies, self.rep = y, varies, rep
        self.shape = (rep.D, *y.shape[1:])
        self.dtype, self.device = y.dtype, y.device

    def full(self) -> torch.Tensor:
        """Every device's copy, ``[D, ...]`` (a copy of ``y`` per device)."""
        R, C, rest = self.rep.R, self.rep.C, self.y.shape[1:]
        if self.varies == {"cols"}:
            return self.y.unsqueeze(0).expand(R, C, *rest).reshape(self.rep.D, *rest)
        return self.y.unsqueeze(1).expand(R, C, *rest).reshape(self.rep.D, *rest)


class Replication:
    """The classes of devices of a ``rows x cols`` mesh along the axes a value varies over."""

    def __init__(self, rows: int, cols: int):
        self.R, self.C, self.D = rows, cols, rows * cols
        #: the axes that can vary at all (an axis of size 1 splits nothing)
        self.all = frozenset(a for a, n in zip(AXES, (rows, cols)) if n > 1)

    def of_group(self, group) -> frozenset:
        """The axes along which per-device shard indices ``group`` (``gemm.shards_of``) differ."""
        R, C = self.R, self.C
        out = set()
        if R > 1 and any(group[r * C + c] != group[c] for r in range(R) for c in range(C)):
            out.add("rows")
        if C > 1 and any(group[r * C + c] != group[r * C] for r in range(R) for c in range(C)):
            out.add("cols")
        return frozenset(out)

    def of_rows(self, x: torch.Tensor) -> frozenset:
        """The axes along which the slices ``x[d]`` of a small per-device tensor differ (by value:
        for index tables such as ``EmulatedModel.units``)."""
        g = x.reshape(self.R, self.C, -1)
        out = set()
        if self.R > 1 and not torch.equal(g, g[:1].expand_as(g)):
            out.add("rows")
        if self.C > 1 and not torch.equal(g, g[:, :1].expand_as(g)):
            out.add("cols")
        return frozenset(out)

    def reps(self, varies: frozenset) -> slice | None:
        """One device per class of a value varying over ``varies``, as a slice of the device dim
        (device d = row * cols + col): None where every device is its own class."""
        if self.D == 1 or varies >= self.all:
            return None
        if not varies:
            return slice(0, 1)
        if varies == {"cols"}:
            return slice(0, self.C)  # row 0's devices
        return slice(0, self.D, self.C)  # column 0's devices

    def spread(self, y: torch.Tensor, varies: frozenset):
        """``y`` computed on :meth:`reps` as every device's value: ``[D, ...]`` as it is, one copy
        viewed D times where it varies over nothing, else :class:`Classes` (one copy per class)."""
        if y.shape[0] == self.D:
            return y
        if y.shape[0] == 1:
            return y.expand(self.D, *y.shape[1:])
        return Classes(y, varies, self)

    def pick(self, x, sl: slice | None) -> torch.Tensor:
        """The devices ``sl`` of ``x`` (``[D, ...]`` or :class:`Classes`; None: every device)."""
        if not isinstance(x, Classes):
            return x if sl is None else x[sl]
        if sl is not None and sl == self.reps(x.varies):
            return x.y
        if sl == slice(0, 1):  # device 0: the first class's copy
            return x.y[:1]
        full = x.full()
        return full if sl is None else full[sl]

    def share(self, x: torch.Tensor, varies: frozenset) -> torch.Tensor:
        """``x [D, ...]`` held once where it varies over nothing (device 0's copy, viewed D times;
        the other copies are the same values, so they are dropped), else as it is."""
        if varies or isinstance(x, Classes) or x.shape[0] < 2 or x.stride(0) == 0:
            return x
        return x[:1].expand(x.shape)

    def after_collective(self, varies: frozenset, axes) -> frozenset:
        """What a collective over ``axes`` leaves: every member of a group holds the same."""
        return varies - frozenset(axes)


def reads(st, everything: frozenset) -> frozenset:
    """The activations step ``st`` reads (``everything`` for a step handed the whole
    activation dict: ``combine``)."""
    if st.op is Op.COMBINE:
        return everything
    if st.op is Op.RESIDUAL_ADD:
        return frozenset(["h", *(a.name for a in st.ins)])
    return frozenset(a.name for a in st.ins)


def writes(st) -> frozenset:
    if st.op.collective:
        return frozenset([st.act])
    if st.op is Op.RESIDUAL_ADD:
        return frozenset(["h"])
    return frozenset([st.out.name]) if st.out is not None else frozenset()


def drops(steps, keep) -> list[tuple[str, ...]]:
    """Per step, the activations to drop right after it: those it reads or writes that no later
    step reads before writing them again, except ``keep`` (what the caller reads after the
    layer program: the hidden state ``h``, a vision program's output)."""
    everything = frozenset(n for st in steps for n in reads(st, frozenset()) | writes(st)) | {"tokens", "patches"}
    live = frozenset(keep)
    out: list = [()] * len(steps)
    for i in range(len(steps) - 1, -1, -1):
        r, w = reads(steps[i], everything), writes(steps[i])
        out[i] = tuple(sorted((r | w) - live))
        live = (live - w) | r
    return out
