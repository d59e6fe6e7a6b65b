"""What every ttnn op lowering builds on: the emitter of calls (:class:`Emitter`: collectives'
and partitions' per-device shapes), the lowerer of one program (:class:`Lowerer`: the weights,
KV cache and mesh the program records), the 4-D shape convention and the weight views made once
at setup (:func:`vector_view`, :func:`bias`, :func:`filled`).

Tensors are 4-D as in tt_transformers: an activation ``[rows, f]`` is ``[1, 1, rows, f]``, an
expert activation ``[rows, E, f]`` is ``[1, E, rows, f]``; attention heads are ``[1, H, S, d]``
(prefill) and ``[1, B, H, d]`` (decode, one token per row). Weights are held as the package's
tensorbin caches say (``layout.py``); setup derives the few views the ops need (bias rows,
per-expert batches, MLA's absorbed projections).
"""

from __future__ import annotations

import math
import struct

from ... import layout
from ...layout import tensor_layout
from ...mesh import AXES, Mesh
from ...program import Program, Step, WeightRef
from .calls import Attr, Call, Const, T, W
from .layout import device_shape


DRAM = Attr("DRAM_MEMORY_CONFIG")
BF16, F32, U32 = Attr("bfloat16"), Attr("float32"), Attr("uint32")
TILE_L, RM = Attr("TILE_LAYOUT"), Attr("ROW_MAJOR_LAYOUT")
# where a forward's tokens are sampled: "device" (top-k candidates, then ttnn.sampling with per-row
# k / p / temperature; greedy rows use k = 1, as tt_transformers does) or "host" (logits come back)
SAMPLING = ("device", "host")
TOPK = 32  # candidates ttnn.sampling draws from
#: phases whose forwards lower like decode: one token per row, each row its own position and
#: page-table row (a verify program's rows are each sequence's last token and its proposals)
DECODE_LIKE = ("decode", "verify")


def samplings(phase: str) -> tuple[str, ...]:
    """The sampling variants a forward of ``phase`` may be lowered in: a verify forward returns
    every row's logits only (acceptance, vLLM's rejection rule, runs on the host from them:
    ``runtime/sampling.accept``, as on the emulated mesh)."""
    return ("host",) if phase == "verify" else SAMPLING


def f32(x: float) -> float:
    """``x`` rounded to float32: some ttnn bindings take a C++ ``float`` and refuse a Python float
    that float32 cannot hold exactly (``chunked_scaled_dot_product_attention(scale=0.1)`` raises
    "incompatible function arguments"; ``scale=float32(0.1)`` binds)."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def tt_shape(shape) -> tuple[int, ...]:
    """A program shape ``[rows, f]`` / ``[rows, E, f]`` as the 4-D ttnn tensor shape."""
    if len(shape) == 2:
        return (1, 1, shape[0], shape[1])
    if len(shape) == 3:
        return (1, shape[1], shape[0], shape[2])
    raise ValueError(f"activation of rank {len(shape)}: {shape}")


def tt_dim(shape, k: int) -> int:
    """Program dim ``k`` of an activation of ``shape`` as its ttnn dim."""
    return {2: (2, 3), 3: (2, 1, 3)}[len(shape)][k]


class Emitter:
    """Emits calls on ``mesh``: the collectives and partitions of any step, with the per-device
    shapes each call leaves (``shapes``). ``policy``: the sharding policy of padded dims."""

    def __init__(self, mesh: Mesh, policy=None):
        self.mesh, self.policy = mesh, policy
        self.shapes: dict[str, tuple] = {}  # tensor name -> 4-D per-device shape (as lowered)
        self.calls: list[Call] = []
        self.op = ""

    def call(self, fn: str, *args, out=None, shape=None, **kwargs) -> str | None:
        c = Call(fn, tuple(args), tuple(sorted(kwargs.items())), out, tuple(shape) if shape else None, self.op)
        self.calls.append(c)
        if isinstance(out, str) and shape is not None:
            self.shapes[out] = tuple(shape)
        return out

    def topology(self, axes) -> Attr:
        n = math.prod(self.mesh.axis_size(a) for a in axes)
        return Attr("Topology.Ring" if self.mesh.topology in ("ring", "torus") and n > 2 else "Topology.Linear")

    def partition(self, x: str, dim: int, axes, out: str) -> str:
        """Each device keeps its slice of replicated ``x`` along ``dim`` split over ``axes``:
        one ``mesh_partition`` per axis in ``layout.partition_sequence`` order, which leaves
        device ``(r, c)`` the part at its group position (``layout.group_of``)."""
        cur = x
        split = [ax for ax in layout.partition_sequence(axes) if self.mesh.axis_size(ax) > 1]
        for i, ax in enumerate(split):
            shp = list(self.shapes[cur])
            part = layout.even_part(shp[dim], self.mesh.axis_size(ax))
            if part is None:
                raise ValueError(f"{out}: dim {dim} of {tuple(shp)} does not divide over mesh {ax}")
            shp[dim] = part
            nxt = out if i == len(split) - 1 else f"{out}.p{i}"
            cur = self.call("mesh_partition", T(cur), dim, AXES.index(ax), out=nxt, shape=shp,
                            memory_config=DRAM)
        return cur  # x itself when nothing is split on this mesh


class HeldWeight:
    """A weight as the program records it (``program.WeightRef``: PartitionSpec, per-device
    shape, dtype, layers) and how ttnn holds it (``layout.tensor_layout`` of its kind)."""

    def __init__(self, ref: WeightRef, layout_: str):
        self.spec = [tuple(e) for e in ref.spec]
        self.device_shape = list(ref.device_shape)
        self.dtype = ref.dtype
        self.layers = ref.layers
        self.layout = layout_


class Lowerer(Emitter):
    """Lowers one program with what it records: the weights it reads (``weights``), its KV cache
    (dtype, block size) and its mesh; its traits (``program.traits``, ``layer_traits``) and dims
    (``program.dims``); ``bundle`` gives the weights' declarations, the vision settings and the
    buckets. Nothing here reads a plan."""

    def __init__(self, bundle, mesh: Mesh, program: Program, sampling: str, grid: tuple[int, int] | None = None):
        super().__init__(mesh, program_policy(program, bundle))
        self.bundle, self.prog = bundle, program
        self.fam, self.a = bundle.family, bundle.arch
        self.phase, self.rows = program.phase, program.rows
        self.decode = self.phase in DECODE_LIKE  # verify: decode's lowering over its rows
        self.sampling = sampling
        self.grid = grid or self.mesh.chip.compute_grid
        decls = {t.name: t for t in self.fam.tensors(self.a)}
        self.tensors = {n: HeldWeight(r, tensor_layout(decls[n])) for n, r in program.weights.items()}
        self.traits = program.traits  # typed, read as a mapping by the op modules
        self.dims = program.dims  # the model's sizes (hidden, vocab, head width, eps, max_model_len)
        self.kv_dtype = program.kv_cache["dtype"]
        self.block_size = int(program.kv_cache["block_size"])
        self.layer: int | None = None
        self.setup: dict[str, Call] = {}
        self.consts: dict[str, Const] = {}
        self.gaps: list[str] = []
        self.inputs: dict[str, tuple] = {}
        self.chunk_start = 0  # MLA prefill: the static start this forward is lowered for

    # -- emitting ------------------------------------------------------------------------------
    def setup_call(self, key: str, fn: str, *args, shape=None, **kwargs) -> None:
        """A once-per-model call producing weight view ``key`` (run with this layer's weights);
        deduplicated."""
        if key not in self.setup:
            self.setup[key] = (self.layer, Call(fn, tuple(args), tuple(sorted(kwargs.items())), key,
                                                tuple(shape) if shape else None, "setup"))

    def has(self, w: str) -> bool:
        t = self.tensors.get(w)
        if t is None:
            return False
        return t.layers is None or self.layer is None or t.layers[0] <= self.layer < t.layers[1]

    def lt(self):
        """This decoder layer's traits, as the program records them (a mapping)."""
        lts = self.prog.layer_traits
        return lts[self.layer] if self.layer is not None and self.layer < len(lts) else {}


def vector_view(lw: Lowerer, w: str, shape: tuple, variant: str) -> W:
    """Vector weight ``w`` (held as rows of 32, ``[1, 1, ceil(n/32), 32]``, zero-padded) as a
    TILE tensor of ``shape`` (``n`` values), made once at setup: flatten, cut the padding,
    reshape, tilize."""
    t = lw.tensors[w]
    n = math.prod(t.device_shape)
    held = math.prod(device_shape(t.device_shape, t.layout))
    cur = W(w)
    steps = [("flat", "reshape", ([1, 1, 1, held],), (1, 1, 1, held))]
    if held != n:
        steps.append(("cut", "slice", ([0, 0, 0, 0], [1, 1, 1, n], [1, 1, 1, 1]), (1, 1, 1, n)))
    steps += [("shaped", "reshape", (list(shape),), tuple(shape)), ("", "to_layout", (TILE_L,), tuple(shape))]
    for suffix, fn, args, shp in steps:
        nxt = W(w, variant=f"{variant}.{suffix}" if suffix else variant)
        lw.setup_call(nxt.key(lw.layer), fn, cur, *args, shape=shp)
        cur = nxt
    return cur


def add_bias(lw: Lowerer, x: str, w: str, out: str) -> str:
    """``x + b`` for a bias vector ``w`` (made a broadcastable TILE row once at setup)."""
    shp = lw.shapes[x]
    per_expert = len(lw.tensors[w].device_shape) == 2  # [E, n]: one row per expert
    view = vector_view(lw, w, (1, shp[1], 1, shp[3]) if per_expert else (1, 1, 1, shp[-1]), "row")
    return lw.call("add", T(x), view, out=out, shape=shp, memory_config=DRAM)


def filled(lw: Lowerer, kind: str, shape: tuple) -> str:
    """A host-made bf16 TILE constant of zeros or ones, named by its shape: a model's forwards
    share constants by name (``model.open_model``), and buckets differ in rows."""
    name = f"{kind}.{'x'.join(map(str, shape))}"
    lw.consts[name] = Const(name, tuple(shape), "bf16", "TILE", kind)
    return name


def one_input(lw: Lowerer, st: Step) -> str:
    (x,) = (a.name for a in st.ins)
    lw.shapes.setdefault(x, tt_shape(st.ins[0].shape))
    return x


def program_policy(program: Program, bundle=None):
    """The sharding policy a program was lowered with (its ``policy``; else the bundle's)."""
    return layout.Policy.from_json(program.policy or None, None if bundle is None else bundle.spec.sharding)
