"""Activation sharding propagation: the family's layer dataflow traced op by op under the
resolved PartitionSpecs (:class:`_Tracer`), which finds every collective a layer needs
(:class:`Collective`, with its traffic) and the steps ``lower`` turns into programs; the vision
encoder's layers traced the same way (:func:`vision_steps`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import layout as layoutmod
from ..families.base import Combine, Dim, Embed, Linear, Local, Logits, Norm, Residual
from ..layout import axes_of
from ..mesh import AXES, Mesh
from .memory import ACT_BYTES, tensor_bytes

@dataclass
class Collective:
    layer: str  # layer kind or "embedding" / "head"
    op: str  # the op that needed it
    kind: str  # all_gather | all_reduce
    axes: tuple[str, ...]
    devices: int  # group size
    payload_bytes_per_token: int  # per-device tensor size the collective works on
    traffic_bytes_per_token: int  # bytes each device sends per token (ring algorithm)
    count: int  # times per forward (layers)


@dataclass
class _Act:
    dims: tuple[Dim, ...]
    spec: tuple[tuple[str, ...], ...]
    partial: frozenset

    def local_elems(self, mesh: Mesh, policy=None) -> int:
        """Elements per token on one device, by the same rules as weight shards (a replicated
        KV head is one whole head per device; padded dims count their padding)."""
        return math.prod(layoutmod.local_len(d, ax, mesh, policy) for d, ax in zip(self.dims, self.spec))


@dataclass(frozen=True)
class Step:
    """One step of a layer's per-device program: an op, or a collective inserted before it.

    ``kind`` is "op", "all_reduce" (sum partial results over ``axes``) or "all_gather"
    (concatenate the shards of feature dim ``dim`` over ``axes``, rows-major). For ops,
    ``specs`` holds the sharding of each input and of the output as seen by the op.
    """

    kind: str
    act: str = ""
    axes: tuple[str, ...] = ()
    dim: int = 0
    op: object = None
    specs: tuple = ()  # ((name, spec), ...) inputs then output
    feature: Dim | None = None  # all_gather: the gathered dim (its shards may be padded/replicated)


class _Tracer:
    """Walks layer ops, tracking each activation's sharding and emitting collectives."""

    def __init__(self, mesh: Mesh, specs: dict, decls: dict, layer: str, count: int, policy=None):
        self.mesh, self.specs, self.decls, self.policy = mesh, specs, decls, policy
        self.layer, self.count = layer, count
        self.acts: dict[str, _Act] = {}
        self.out: list[Collective] = []
        self.steps: list[Step] = []
        self.ops = 0
        hid = decls["embed"].dims[1] if "embed" in decls else Dim("hidden_size", 1)
        self.acts["h"] = _Act((hid,), ((),), frozenset())

    def _n(self, axes) -> int:
        return math.prod(self.mesh.axis_size(a) for a in axes) if axes else 1

    def _emit(self, op: str, kind: str, axes: tuple, act: _Act, name: str, dim: int = 0):
        n = self._n(axes)
        if n == 1:
            return
        payload = act.local_elems(self.mesh, self.policy) * ACT_BYTES
        if kind == "all_reduce":
            traffic = 2 * (n - 1) * payload // n
        else:  # all_gather: payload grows n-fold; each device receives (n-1) shards
            traffic = (n - 1) * payload
        self.out.append(Collective(self.layer, op, kind, tuple(axes), n, payload, traffic, self.count))
        self.steps.append(Step(kind, name, tuple(axes), dim,
                               feature=act.dims[dim] if kind == "all_gather" else None))
        self.ops += 1

    def reduce(self, name: str, op: str) -> _Act:
        a = self.acts[name]
        if a.partial:
            self._emit(op, "all_reduce", tuple(sorted(a.partial, key=AXES.index)), a, name)
            a = _Act(a.dims, a.spec, frozenset())
            self.acts[name] = a
        return a

    def gather(self, name: str, op: str, keep: tuple = ()) -> _Act:
        """Make ``name`` non-partial and replicated on every dim (except ``keep`` dim indices)."""
        a = self.reduce(name, op)
        for i, ax in enumerate(a.spec):
            if ax and i not in keep:
                self._emit(op, "all_gather", ax, a, name, i)
                a = _Act(a.dims, a.spec[:i] + ((),) + a.spec[i + 1:], a.partial)
        self.acts[name] = a
        return a

    def wspec(self, w: str) -> tuple[tuple[str, ...], ...]:
        return tuple(axes_of(e) for e in self.specs[w])

    def _record(self, op, ins: tuple[str, ...], out: str):
        specs = tuple((n, self.acts[n].spec) for n in ins) + ((out, self.acts[out].spec),)
        self.steps.append(Step("op", op=op, specs=specs))

    def run(self, op):
        self.ops += 1
        if isinstance(op, Embed):
            ws, wd = self.wspec(op.w), self.decls[op.w].dims
            self.acts[op.out] = _Act(wd[1:], ws[1:], frozenset(ws[0]))
            self._record(op, (), op.out)
            self.gather(op.out, f"embedding({op.w})")
        elif isinstance(op, Norm):
            a = self.gather(op.x, f"norm({op.w or op.x})")
            self.acts[op.out] = _Act(a.dims, a.spec, frozenset())
            self._record(op, (op.x,), op.out)
        elif isinstance(op, Linear):
            label = f"{op.x} @ {op.w}"
            a = self.reduce(op.x, label)
            ws, wd = self.wspec(op.w), self.decls[op.w].dims
            k_w = ws[-2]
            # contraction dim: a sharded input whose axes differ from the weight's is gathered
            if a.spec[-1] and a.spec[-1] != k_w:
                a = self.gather(op.x, label, keep=tuple(range(len(a.spec) - 1)))
            if len(wd) == 3 and len(a.dims) == 2 and a.spec[0] and a.spec[0] != ws[0]:
                a = self.gather(op.x, label)
            out_dims = wd[:-2] + (wd[-1],) if len(wd) == 3 else (wd[-1],)
            out_spec = ws[:-2] + (ws[-1],) if len(wd) == 3 else (ws[-1],)
            self.acts[op.out] = _Act(out_dims, out_spec, frozenset(k_w))
            self._record(op, (op.x,), op.out)
        elif isinstance(op, Local):
            lead = self.reduce(op.ins[0], op.what or op.out)
            for other in op.ins[1:]:
                b = self.reduce(other, op.what or op.out)
                if any(ax and ax != la for ax, la in zip(b.spec, lead.spec)):
                    self.gather(other, op.what or op.out)
            dims = op.out_dims(lead.dims)
            self.acts[op.out] = _Act(dims, lead.spec[-len(dims):], frozenset())
            self._record(op, tuple(op.ins), op.out)
        elif isinstance(op, Combine):
            # a weighted sum over experts is linear: pending partial sums pass through and the
            # expert axes join them, so [N] is reduced once instead of [E_local, N] first
            a = self.acts[op.x]
            self.acts[op.out] = _Act(a.dims[1:], a.spec[1:], a.partial | frozenset(a.spec[0]))
            self._record(op, (op.x,), op.out)
        elif isinstance(op, Residual):
            self.gather(op.x, f"residual += {op.x}")
            self.steps.append(Step("op", op=op, specs=((op.x, self.acts[op.x].spec),)))
        elif isinstance(op, Logits):
            self.gather(op.x, "logits")
            self.steps.append(Step("op", op=op, specs=((op.x, self.acts[op.x].spec),)))
        else:  # pragma: no cover
            raise TypeError(op)


def vision_steps(bundle, mesh: Mesh, specs: dict, decls: dict) -> tuple[list, list]:
    """The vision encoder's per-layer steps (multimodal families; [] otherwise), traced like the
    text layers from the activations ``Family.vision_inputs`` declares, replicated; and the
    activation buffers of its largest layer kind at the largest vision bucket (each activation
    its own bf16 TILE buffer, as for the text layers)."""
    fam, a = bundle.family, bundle.arch
    kinds = fam.vision_programs(a)
    if not kinds or bundle.vision is None:
        return [], []
    rows, row_of = fam.vision_rows(a, max(bundle.vision.buckets))
    out, best, best_bytes = [], [], 0
    seed = fam.vision_inputs(a)
    for i, (name, count, ops) in enumerate(kinds):
        tr = _Tracer(mesh, specs, decls, name, count, bundle.spec.sharding)
        # every kind starts from the vision residual stream; the first also from the inputs
        tr.acts.update({n: _Act(tuple(d), tuple(() for _ in d), frozenset())
                        for n, d in seed.items() if i == 0 or n == "h"})
        for op in ops:
            tr.run(op)
        out.append((name, count, tr.steps))
        bufs = [(n, [row_of.get(n, rows), x.local_elems(mesh, bundle.spec.sharding)]) for n, x in tr.acts.items()]
        nbytes = sum(tensor_bytes(shape, "bf16", "TILE", mesh) for _, shape in bufs)
        if nbytes > best_bytes:
            best, best_bytes = bufs, nbytes
    return out, best


def _seen_by_attention(programs, weight: str):
    """Feature-dim axes of ``weight``'s output as the first Local op consuming it sees them."""
    for _, _, steps in programs:
        produced = None
        for st in steps:
            if st.kind != "op":
                continue
            if isinstance(st.op, Linear) and st.op.w == weight:
                produced = st.op.out
            elif isinstance(st.op, Local) and produced in st.op.ins:
                return dict(st.specs)[produced][-1]
    return None
