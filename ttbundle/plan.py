"""Partition specs -> per-device shapes, per-chip memory, collectives.

``make_plan(bundle, mesh)`` resolves the sharding plan (family default, then ``sharding.plan``,
then ``sharding.targets[<mesh>]``), checks every sharded dim divides its mesh axis, derives each
device's shard shape, accounts DRAM the way ttnn's allocator does (interleaved pages over the
DRAM banks, each bank's share rounded up to whole aligned pages), and propagates activation
shardings through the family's layer dataflow to find every collective and its traffic.
The returned :class:`Plan` is pure data; nothing here touches a weight.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from . import mesh as meshmod
from .errors import Diagnostic, InvalidInput
from .families.base import (Combine, Dim, Embed, Linear, Local, Logits, Norm, Residual,
                            TensorDecl)
from . import layout as layoutmod
from .layout import axes_of, tensor_layout
from .mesh import AXES, Mesh
from .tiles import TILE, cdiv as _cdiv, round_up as _round_up
from .speculative import rows_per_seq, verify_buckets, verify_rows

TILE_BYTES = {"bf16": 2048, "bfp8": 1088, "bfp4": 576, "f32": 4096}
ELEM_BYTES = {"bf16": 2, "f32": 4}
ACT_BYTES = 2  # activations are bf16 on device
TRACE_BYTES_PER_OP = 8 * 1024  # dispatch commands + runtime args per captured op (estimate)
# ttnn carves the trace region out of the top of every DRAM bank when the mesh opens: each bank
# gives ceil(trace_region_size / banks) rounded up to 8 KiB (measured on the ttnn 0.81.1 mock
# allocator, Wormhole and Blackhole alike; tests/tt/test_allocator_ttnn.py)
TRACE_BANK_ALIGN = 8 * 1024


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
class Memory:
    weights_by_dtype: dict[str, int]
    weights: int
    kv_cache: int
    activations: int
    trace_region: int
    total: int
    dram: int

    @property
    def free(self) -> int:
        return self.dram - self.total


def shortfall(m: Memory, fmt=None) -> str:
    """The one wording of a plan that does not fit (``validate``, ``init``, ``build``): ``needs
    X per chip, chip has Y``; ``fmt`` writes bytes (default ``1,234 B``; ``report.human``: GiB)."""
    fmt = fmt or (lambda b: f"{b:,} B")
    return f"needs {fmt(m.total)} per chip, chip has {fmt(m.dram)}"


@dataclass
class Plan:
    bundle_name: str
    family: str
    mesh: Mesh
    tensors: list[TensorPlan]
    memory: Memory
    collectives: list[Collective]
    kv: dict
    activation_tokens: int
    num_traces: int
    diagnostics: list[Diagnostic]
    specs: dict = field(default_factory=dict)  # resolved PartitionSpec per tensor
    programs: list = field(default_factory=list)  # [(layer kind, count, [Step])], embedding first, head last
    trace_region_size: int = 0  # bytes requested (open_mesh_device); memory.trace_region is what DRAM gives up
    activation_buffers: list = field(default_factory=list)  # [(name, [rows, features])], bf16 TILE each
    max_num_seqs: int = 0  # runtime.max_num_seqs: per replica
    vision: list = field(default_factory=list)  # the vision encoder's [(layer kind, count, [Step])], if any

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory.dram

    @property
    def decode_traffic_bytes_per_token(self) -> int:
        return sum(c.traffic_bytes_per_token * c.count for c in self.collectives)

    def consumers(self) -> list[tuple[str, int]]:
        """Largest memory consumers per chip, biggest first."""
        items = [(f"{t.name} ({t.dtype}, x{t.count})", t.bytes) for t in self.tensors]
        items += [(f"KV cache ({self.kv['dtype']})", self.memory.kv_cache),
                  ("activations", self.memory.activations), ("trace region", self.memory.trace_region)]
        return sorted(items, key=lambda x: -x[1])

    @property
    def replicas(self) -> int:
        return self.mesh.replicas

    def concurrency(self, max_num_seqs: int) -> int:
        """Sequences the whole target serves at once: replicas x per-replica max_num_seqs."""
        return self.mesh.replicas * max_num_seqs

    def to_json(self) -> dict:
        m = self.mesh
        mem = asdict(self.memory)
        mem["free"] = self.memory.free
        mem["trace_region_size"] = self.trace_region_size
        out = {
            "bundle": self.bundle_name,
            "family": self.family,
            "mesh": {"name": m.name, "shape": list(m.shape), "arch": m.chip.arch,
                     "devices": m.num_devices, "topology": m.topology,
                     "dram_bytes_per_chip": m.chip.dram_bytes, "l1_bytes_per_chip": m.chip.l1_bytes},
            "fits": self.fits,
            "memory": mem,
            "per_chip": [{"device": [r, c], "bytes": self.memory.total}
                         for r in range(m.rows) for c in range(m.cols)],
            "tensors": [{"name": t.name, "group": t.group, "dtype": t.dtype, "layout": t.layout,
                         "shape": t.shape, "spec": [list(axes_of(e)) or None for e in t.spec],
                         "device_shape": t.device_shape, "count": t.count,
                         "bytes_per_copy": t.bytes_per_copy, "bytes": t.bytes,
                         "notation": t.notation(), "notes": t.notes} for t in self.tensors],
            "kv_cache": self.kv,
            "collectives": [{**asdict(c), "axes": list(c.axes)} for c in self.collectives],
            "decode_traffic_bytes_per_token": self.decode_traffic_bytes_per_token,
            "activation_tokens": self.activation_tokens,
            "num_traces": self.num_traces,
            "diagnostics": [d.to_json() for d in self.diagnostics],
        }
        if m.target_shape is not None:
            out["replicas"] = replica_json(m, self.max_num_seqs)
        return out


# ---- DRAM accounting ---------------------------------------------------------------------------
def dram_bytes(pages: int, page_bytes: int, mesh: Mesh) -> int:
    """Bytes an interleaved DRAM buffer takes on one chip: pages round-robin over the banks, each
    bank reserving whole pages rounded up to the DRAM alignment."""
    chip = mesh.chip
    if pages == 0:
        return 0
    per_bank = _cdiv(pages, chip.dram_banks) * _round_up(page_bytes, chip.dram_alignment)
    return per_bank * chip.dram_banks


def trace_region_dram(size: int, mesh: Mesh) -> int:
    """DRAM a chip gives up for a trace region of ``size`` bytes: every bank reserves
    ``ceil(size / banks)`` rounded up to :data:`TRACE_BANK_ALIGN`."""
    banks = mesh.chip.dram_banks
    return banks * _round_up(_cdiv(size, banks), TRACE_BANK_ALIGN)


def tile_pages(shape: list[int]) -> int:
    """Number of 32x32 tiles of a tensor in TILE layout (last two dims padded to tiles)."""
    if len(shape) == 1:
        shape = [1] + list(shape)
    lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
    return lead * _cdiv(shape[-2], TILE) * _cdiv(shape[-1], TILE)


def tensor_bytes(shape: list[int], dtype: str, layout: str, mesh: Mesh) -> int:
    if layout == "TILE":
        return dram_bytes(tile_pages(shape), TILE_BYTES[dtype], mesh)
    # ROW_MAJOR: one page per row of the last dim (1-D tensors are stored as rows of 32)
    if len(shape) == 1:
        return dram_bytes(_cdiv(shape[0], TILE), TILE * ELEM_BYTES[dtype], mesh)
    return dram_bytes(math.prod(shape[:-1]), shape[-1] * ELEM_BYTES[dtype], mesh)


# ---- sharding resolution ------------------------------------------------------------------------
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
    key = _target_key(s.sharding.targets, mesh_name)
    for n, sp in s.sharding.targets.get(key, {}).items():
        if n in plan:
            plan[n], origin[n] = tuple(sp), ("sharding", "targets", key, n)
    return plan, origin


def _target_key(names, mesh_name: str) -> str:
    """The entry of ``names`` (targets as written) that names mesh ``mesh_name``, else itself."""
    if mesh_name in names:
        return mesh_name
    for k in names:
        m = meshmod.try_resolve(k)
        if m is not None and m.name == mesh_name:
            return k
    return mesh_name


def tensor_dtype(spec, t: TensorDecl) -> str:
    """A declared tensor's storage dtype under ``spec``'s dtype policy (matrices only; the rest
    stay bf16)."""
    return spec.weights.dtypes.dtype_of(t.name, t.group) if t.kind == "matrix" else "bf16"


# ---- activation sharding propagation ------------------------------------------------------------
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


# ---- the plan ----------------------------------------------------------------------------------
def pool_blocks(rt, tokens: int) -> int:
    """Blocks of a KV pool of ``tokens`` tokens (Tenstorrent's formula): ceil((tokens +
    kv_block_size x max_num_seqs) / kv_block_size), i.e. one spare block per sequence."""
    return _cdiv(tokens + rt.kv_block_size * rt.max_num_seqs, rt.kv_block_size)


def pool_tokens(rt, blocks: int, max_num_seqs: int | None = None) -> int:
    """The pool (``max_tokens_all_users``) that :func:`pool_blocks` turns into ``blocks`` (at
    ``max_num_seqs`` sequences; default the spec's)."""
    return blocks * rt.kv_block_size - rt.kv_block_size * (max_num_seqs or rt.max_num_seqs)


def kv_blocks(bundle, mesh: Mesh | str) -> int:
    """KV cache blocks of ``bundle`` on ``mesh``: the plan's pool (the one owner of this number;
    the worker asks vLLM for it, the ttnn backend allocates it, packages record it)."""
    return make_plan(bundle, mesh).kv["num_blocks"]


@dataclass
class _Pool:
    tokens: int  # max_tokens_all_users
    blocks: int
    chosen: str  # "spec" | "auto"
    why: str


def choose_pool(rt, kv_bytes, free: int, one_prefill: bool = False) -> _Pool:
    """The KV pool: the spec's ``max_tokens_all_users``, or (``auto`` / absent) the largest whole
    number of blocks whose KV bytes per chip (``kv_bytes(blocks)``, allocator-rounded, monotone)
    fit in ``free`` (DRAM left after weights, activations and trace region), between one
    ``max_model_len`` sequence and every sequence at full length. ``one_prefill`` (``task:
    embed``: nothing is decoded, a request leaves after its prefill): one ``max_model_len``
    sequence unless the spec says otherwise."""
    want = rt.max_tokens_all_users
    full = rt.max_num_seqs * rt.max_model_len
    if isinstance(want, int):
        return _Pool(want, pool_blocks(rt, want), "spec", "runtime.max_tokens_all_users")
    if one_prefill:
        return _Pool(rt.max_model_len, pool_blocks(rt, rt.max_model_len), "embed",
                     f"task: embed: prefill only, one max_model_len={rt.max_model_len} sequence")
    lo, hi = pool_blocks(rt, rt.max_model_len), pool_blocks(rt, full)
    if kv_bytes(hi) <= free:
        return _Pool(full, hi, "auto", f"auto: every sequence at full length fits (max_num_seqs="
                     f"{rt.max_num_seqs} x max_model_len={rt.max_model_len})")
    if kv_bytes(lo) > free:
        return _Pool(rt.max_model_len, lo, "auto", f"auto: not even one max_model_len="
                     f"{rt.max_model_len} sequence fits in the {_gib(max(free, 0))} left")
    a, b = lo, hi - 1  # kv_bytes(lo) fits, kv_bytes(hi) does not
    while a < b:
        mid = (a + b + 1) // 2
        if kv_bytes(mid) <= free:
            a = mid
        else:
            b = mid - 1
    return _Pool(pool_tokens(rt, a), a, "auto", f"auto: the largest pool that fits the "
                 f"{_gib(free)} left after weights, activations and trace region")


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
    tkey = _target_key(s.targets, mesh.name)
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
    mesh = meshmod.resolve(name)
    key = _target_key(bundle.spec.replicas, mesh.name)
    rep = bundle.spec.replicas.get(key)
    return mesh if rep is None else meshmod.split(mesh, rep.submesh)


def make_plan(bundle, mesh: Mesh | str) -> Plan:
    """The plan of ``bundle`` on ``mesh`` (a target name: on one replica's submesh when the spec
    splits it, ``target_mesh``). Raises InvalidInput listing every divisibility error."""
    if isinstance(mesh, str):
        mesh = target_mesh(bundle, mesh)
    fam, a, s = bundle.family, bundle.arch, bundle.spec
    specs, decls, tensors, diags = _shard_tensors(bundle, mesh)
    if diags:
        raise InvalidInput(f"{bundle.file}: sharding plan does not fit {mesh.describe()}", diags)

    # collectives and op counts per layer kind
    # activations: every named activation of one layer live at once for the largest prefill shape
    # (an upper bound; ttnn frees them as it goes), each its own interleaved bf16 TILE buffer
    # [tokens, features] (so each is rounded to whole pages per bank, like any buffer), plus the
    # last-token logits of the largest decode batch (rows padded to a tile) over the vocabulary,
    # gathered on every device
    bk = bundle.buckets
    act_tokens = min(max(bk.prefill), bk.prefill_chunk or max(bk.prefill))
    lm = next(t for t in tensors if t.name == "lm_head")
    vocab_gathered = lm.device_shape[-1] * math.prod(mesh.axis_size(x) for x in axes_of(lm.spec[-1]))
    act_layer, act_layer_bytes = [], 0

    collectives: list[Collective] = []
    ops_per_forward = 0
    programs = []
    kinds = [("embedding", 1, fam.embed_ops(a))] + [(k.name, k.count, k.ops) for k in fam.layers(a)] \
        + [("head", 1, fam.head_ops(a))]
    for name, count, ops in kinds:
        tr = _Tracer(mesh, specs, decls, name, count, s.sharding)
        for op in ops:
            tr.run(op)
        collectives += tr.out
        ops_per_forward += tr.ops * count
        programs.append((name, count, tr.steps))
        if name not in ("embedding", "head"):
            bufs = [(n, [act_tokens, x.local_elems(mesh, s.sharding)]) for n, x in tr.acts.items()]
            nbytes = sum(tensor_bytes(shape, "bf16", "TILE", mesh) for _, shape in bufs)
            if nbytes > act_layer_bytes:
                act_layer, act_layer_bytes = bufs, nbytes

    # speculative decoding: a verify program's logits cover every row (k + 1 per sequence)
    logit_rows = max([_round_up(max(bk.decode, default=1), TILE)]
                     + [verify_rows(n, rows_per_seq(bundle) - 1) for n in verify_buckets(bundle)])
    act_bufs = act_layer + [("logits", [logit_rows, vocab_gathered])]
    act_bytes = sum(tensor_bytes(shape, "bf16", "TILE", mesh) for _, shape in act_bufs)
    vision, vision_bufs = vision_steps(bundle, mesh, specs, decls)
    vision_bytes = sum(tensor_bytes(shape, "bf16", "TILE", mesh) for _, shape in vision_bufs)
    if vision_bytes > act_bytes:  # the vision encoder runs alone: its largest layer is the peak
        act_bufs, act_bytes = vision_bufs, vision_bytes

    rt = s.runtime
    traced_prefill = len(bk.prefill) if rt.trace_mode == "all" else 0
    traced_decode = len(bk.decode) if rt.trace_mode in ("all", "decode_only") else 0
    num_traces = traced_prefill + traced_decode * (2 if verify_buckets(bundle) else 1)  # + verify
    # the vision forwards are traced with the prefills (one per vision bucket, its own op count)
    vision_trace_ops = sum(len(steps) * count for _, count, steps in vision) * len(bundle.vision.buckets) \
        if vision and rt.trace_mode == "all" else 0
    trace_size = rt.trace_region_size if rt.trace_region_size is not None else \
        _round_up((num_traces * ops_per_forward + vision_trace_ops) * TRACE_BYTES_PER_OP, 1 << 20)
    trace = trace_region_dram(trace_size, mesh) if trace_size else 0

    # KV cache: (num_blocks, kv_heads/device, block_size, head_dim) per layer, K and V separately,
    # as one pool of blocks shared by all sequences (choose_pool: the spec's, or what fits)
    kv_units = []
    for e in fam.kv_cache(a):
        if e.follows:
            tname, di = e.follows
            # the cache is split like the activation the attention op sees (after any gather)
            ax = _seen_by_attention(programs, tname)
            ax = axes_of(specs[tname][di]) if ax is None else ax
            units = layoutmod.split(e.heads, ax, mesh, s.sharding).per_device
        else:
            units = e.heads.size
        kv_units.append((e, units))

    def kv_layout(nblocks: int):
        total, entries = 0, []
        for e, units in kv_units:
            shape = [nblocks, units, rt.kv_block_size, e.head_dim]
            per_layer = tensor_bytes(shape, rt.kv_cache_dtype, "TILE", mesh)
            total += per_layer * e.count
            entries.append({"name": e.name, "device_shape": shape, "layers": e.count,
                            "bytes_per_layer": per_layer})
        return total, entries

    by_dtype: dict[str, int] = {}
    for t in tensors:
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.bytes
    weights = sum(by_dtype.values())
    free = mesh.chip.dram_bytes - weights - act_bytes - trace
    pool = choose_pool(rt, lambda n: kv_layout(n)[0], free, one_prefill=s.task == "embed")
    blocks = pool.blocks
    kv_total, kv_entries = kv_layout(blocks)
    kv = {"dtype": rt.kv_cache_dtype, "num_blocks": blocks, "block_size": rt.kv_block_size,
          "entries": kv_entries, "bytes": kv_total, "max_tokens_all_users": pool.tokens,
          "pool_chosen": pool.chosen, "pool_why": pool.why,
          "max_num_seqs": rt.max_num_seqs, "full_length_tokens": rt.max_num_seqs * rt.max_model_len}

    total = weights + kv_total + act_bytes + trace
    mem = Memory(by_dtype, weights, kv_total, act_bytes, trace, total, mesh.chip.dram_bytes)
    return Plan(s.name, a.family, mesh, tensors, mem, collectives, kv, act_tokens, num_traces,
                list(bundle.warnings), dict(specs), programs, trace_size, act_bufs, rt.max_num_seqs, vision)


def replica_json(mesh: Mesh, max_num_seqs: int) -> dict:
    """The replica split of a target (plan JSON and the package manifest)."""
    return {"count": mesh.replicas, "submesh": list(mesh.shape), "target_shape": list(mesh.target_shape),
            "devices_per_replica": mesh.num_devices, "devices": mesh.total_devices,
            "origins": [list(o) for o in meshmod.submesh_origins(mesh.target_shape, mesh.shape,
                                                                   mesh.whole().hosts)],
            "max_num_seqs_per_replica": max_num_seqs, "max_num_seqs_total": mesh.replicas * max_num_seqs}


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


def check_mesh(bundle, mesh_name: str) -> list[Diagnostic]:
    """Mesh-dependent diagnostics for one target (empty when the plan resolves)."""
    try:
        make_plan(bundle, mesh_name)
    except InvalidInput as e:
        return e.diagnostics or [Diagnostic(e.message, "", bundle.file)]
    return []


# ---- advice when it does not fit ----------------------------------------------------------------
def largest_pool(bundle, mesh: Mesh) -> int | None:
    """The largest explicit ``max_tokens_all_users`` (whole blocks) with which ``bundle`` fits
    ``mesh``, by re-planning; None when not even one ``max_model_len`` sequence fits."""
    rt = bundle.spec.runtime

    def fits(blocks: int) -> bool:
        return make_plan(_with(bundle, max_tokens_all_users=pool_tokens(rt, blocks)), mesh).fits
    lo = pool_blocks(rt, rt.max_model_len)
    if not fits(lo):
        return None
    hi = lo * 2
    while fits(hi):  # grow until it does not fit (DRAM is finite)
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return pool_tokens(rt, lo)


def pool_diagnostic(bundle, p: Plan) -> Diagnostic | None:
    """For a plan that does not fit with an explicit ``runtime.max_tokens_all_users``: where,
    the arithmetic (pool bytes against what weights, activations and trace region leave) and
    the fix (the largest pool that fits, which `auto` picks)."""
    rt = bundle.spec.runtime
    if p.fits or not isinstance(rt.max_tokens_all_users, int):
        return None
    m, kv = p.memory, p.kv
    left = m.dram - (m.weights + m.activations + m.trace_region)
    msg = (f"max_tokens_all_users={rt.max_tokens_all_users:,} does not fit {p.mesh.describe()}: "
           f"the KV pool of {kv['num_blocks']:,} blocks x {kv['block_size']} takes {_gib(m.kv_cache)} "
           f"per chip, {_gib(max(left, 0))} is left after weights {_gib(m.weights)}, activations "
           f"{_gib(m.activations)} and trace region {_gib(m.trace_region)}")
    best = largest_pool(bundle, p.mesh)
    if best is not None:
        msg += f"; fix: max_tokens_all_users: {best} (the largest that fits) or `auto`"
    else:
        msg += (f"; not even one max_model_len={rt.max_model_len} sequence fits: use smaller weight "
                f"dtypes or a bigger mesh (`ttbundle plan --mesh {p.mesh.name}` lists fixes)")
    return bundle.locate(("runtime", "max_tokens_all_users"), msg)


def _with(bundle, **runtime):
    spec = bundle.spec.model_copy(update={"runtime": bundle.spec.runtime.model_copy(update=runtime)})
    return type(bundle)(spec, bundle.arch, bundle.family, bundle.file, bundle.base_dir, bundle.positions)


def _with_dtypes(bundle, **groups):
    pol = bundle.spec.weights.dtypes.model_copy(update=groups)
    w = bundle.spec.weights.model_copy(update={"dtypes": pol})
    spec = bundle.spec.model_copy(update={"weights": w})
    return type(bundle)(spec, bundle.arch, bundle.family, bundle.file, bundle.base_dir, bundle.positions)


def fixes(bundle, p: Plan) -> list[str]:
    """Concrete changes that would make ``p`` fit, each verified by re-planning."""
    out: list[str] = []
    mesh, rt = p.mesh, bundle.spec.runtime
    over = p.memory.total - p.memory.dram
    # smaller dtypes
    present = {t.group for t in p.tensors}
    for groups in ({"attention": "bfp8", "mlp": "bfp8", "experts": "bfp8", "lm_head": "bfp8"},
                   {"attention": "bfp8", "mlp": "bfp4", "experts": "bfp4", "lm_head": "bfp8"}):
        # the label is the exact YAML to write under weights.dtypes (groups this model has)
        label = "{" + ", ".join(f"{g}: {dt}" for g, dt in groups.items() if g in present) + "}"
        try:
            q = make_plan(_with_dtypes(bundle, **groups), mesh)
        except InvalidInput:
            continue
        if q.memory.weights < p.memory.weights:
            verdict = "fits" if q.fits else f"still {_gib(q.memory.total - q.memory.dram)} over"
            out.append(f"weights.dtypes: {label}: weights {_gib(p.memory.weights)} -> "
                       f"{_gib(q.memory.weights)} per chip ({verdict})")
            if q.fits:
                break
    # bigger mesh of the same chip
    for cand in sorted(meshmod.PRESETS.values(), key=lambda m: m.num_devices):
        if cand.chip.arch != mesh.chip.arch or cand.num_devices <= mesh.num_devices:
            continue
        try:
            q = make_plan(bundle, cand)
        except InvalidInput:
            continue
        if q.fits:
            out.append(f"a bigger mesh: {cand.describe()} ({cand.num_devices} chips) fits: weights "
                       f"{_gib(q.memory.weights)} per chip of {_gib(q.memory.dram)}, a KV pool of "
                       f"{q.kv['max_tokens_all_users']:,} tokens ({_gib(q.memory.kv_cache)})")
            break
    # KV: a smaller pool, a shorter context or fewer sequences
    kv_per_token = p.memory.kv_cache / max(1, p.kv["num_blocks"] * rt.kv_block_size)
    if isinstance(rt.max_tokens_all_users, int) and over < p.memory.kv_cache:
        best = largest_pool(bundle, mesh)
        if best is not None:
            out.append(f"runtime.max_tokens_all_users: {rt.max_tokens_all_users} -> {best} (the "
                       f"largest pool that fits, or `auto`; KV cache "
                       f"{kv_per_token * rt.kv_block_size / (1 << 20):.2f} MiB per block per chip)")
    if p.memory.kv_cache > 0 and over < p.memory.kv_cache:
        for field_name, step in (("max_model_len", rt.kv_block_size), ("max_num_seqs", 1)):
            cur = getattr(rt, field_name)
            if field_name == "max_model_len" and isinstance(rt.max_tokens_all_users, int):
                continue  # the pool, not the context, sizes an explicit pool's KV cache
            lo, hi, best = 1, (cur - 1) // step, None  # search in whole steps (blocks / sequences)
            while lo <= hi:  # largest value that fits, by re-planning
                mid = (lo + hi) // 2
                try:
                    ok = make_plan(_with(bundle, **{field_name: mid * step}), mesh).fits
                except InvalidInput:
                    ok = False
                if ok:
                    best, lo = mid * step, mid + 1
                else:
                    hi = mid - 1
            if best:
                out.append(f"runtime.{field_name}: {cur} -> {best} (KV cache "
                           f"{kv_per_token * rt.kv_block_size / (1 << 20):.2f} MiB per block per chip)")
    if not out:
        out.append("no single change found; combine smaller dtypes with a bigger mesh")
    return out


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"
