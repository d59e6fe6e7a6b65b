"""A lowered program as data: ttnn calls by name, with their arguments.

The lowering (:mod:`.lowering`) never touches ttnn; it emits :class:`Call` records that name a
ttnn function by its dotted path (``"linear"``, ``"transformer.scaled_dot_product_attention"``)
and give its arguments as plain values and references:

* :class:`T` — a tensor of the forward by name (an input, an activation, an output);
* :class:`W` — a weight (``W("wq")`` is layer ``i``'s ``wq.i`` when the layer runs);
* :class:`KV` — a layer's KV cache entry;
* :class:`Attr` — a ttnn attribute (``Attr("Topology.Ring")``, ``Attr("bfloat16")``);
* :class:`New` — a ttnn object to construct (``New("MatmulMultiCoreReuseMultiCastProgramConfig",
  per_core_M=4, ...)``), itself checked like a call.

That makes every ttnn name and argument the backend uses inspectable without a device: the
coverage test (tests/tt/test_lowering_coverage_ttnn.py) checks each against the installed wheel's
signatures, and the recording double (tests/test_ttnn_backend.py) runs them through a fake ttnn to
check the order of warm-up, capture and replay. :func:`resolve` turns a value into the real
object for ``ttnn`` (the executor in :mod:`.device`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class T:
    """A tensor of the forward, by name."""

    name: str


@dataclass(frozen=True)
class W:
    """Weight ``name``; per-layer weights take the running layer's index (``wq.3``)."""

    name: str
    per_layer: bool = True
    variant: str = ""  # a setup-time derivative of the weight (``row``: a [1,1,1,n] TILE row)

    def key(self, layer: int | None) -> str:
        base = self.name if (layer is None or not self.per_layer) else f"{self.name}.{layer}"
        return f"{base}:{self.variant}" if self.variant else base


@dataclass(frozen=True)
class KV:
    """The running layer's KV cache entry ``name`` (``k``, ``v``, ``kv_latent``)."""

    name: str


@dataclass(frozen=True)
class Attr:
    """An attribute of the ttnn module by dotted path."""

    path: str


@dataclass(frozen=True)
class New:
    """A ttnn object constructed from keyword (or positional) arguments: a class, or a factory
    function whose result type is ``returns`` (``create_sharded_memory_config`` -> MemoryConfig)."""

    cls: str
    args: tuple = ()
    kwargs: tuple = ()  # ((name, value), ...)
    returns: str = ""  # the type a factory returns (empty: ``cls`` is the class)

    @staticmethod
    def of(cls: str, *args, **kwargs) -> "New":
        return New(cls, tuple(args), tuple(sorted(kwargs.items())))

    @staticmethod
    def factory(fn: str, returns: str, *args, **kwargs) -> "New":
        return New(fn, tuple(args), tuple(sorted(kwargs.items())), returns)

    @property
    def type_name(self) -> str:
        return self.returns or self.cls.split(".")[-1]


@dataclass(frozen=True)
class Call:
    """``out = ttnn.<fn>(*args, **kwargs)``; ``out`` is a name, a tuple of names (the result is
    unpacked), or None. ``shape`` is the per-device output shape the lowering expects."""

    fn: str
    args: tuple = ()
    kwargs: tuple = ()
    out: str | tuple | None = None
    shape: tuple | None = None
    op: str = ""  # the program op kind this call implements (for reports)

    def values(self):
        """Every argument value, constructor arguments included (depth first)."""
        stack = list(self.args) + [v for _, v in self.kwargs]
        while stack:
            v = stack.pop()
            yield v
            if isinstance(v, New):
                stack += list(v.args) + [x for _, x in v.kwargs]
            elif isinstance(v, (tuple, list)):
                stack += list(v)

    def reads(self) -> list[str]:
        return [v.name for v in self.values() if isinstance(v, T)]

    def writes(self) -> list[str]:
        if self.out is None:
            return []
        return [self.out] if isinstance(self.out, str) else [o for o in self.out if o]


@dataclass(frozen=True)
class Const:
    """A host-made tensor the forward reads (rope tables, masks, per-device expert selectors):
    ``kind`` names its maker in :mod:`.device`, ``params`` what it needs."""

    name: str
    shape: tuple
    dtype: str
    layout: str
    kind: str
    params: tuple = ()


@dataclass
class Layer:
    """One layer's calls (``index`` = the layer number for W/KV references; None for the
    embedding and the head)."""

    kind: str
    index: int | None
    calls: list[Call]


@dataclass
class Forward:
    """Everything one (phase, bucket) runs on device: its inputs (written before each run; never
    reallocated, so a captured trace keeps reading them), the layers' calls, its outputs."""

    phase: str
    bucket: int
    rows: int
    inputs: dict  # name -> (shape, dtype, layout)
    layers: list[Layer]
    outputs: list[str]
    setup: list = field(default_factory=list)  # [(layer, Call)]: weight views made once per model
    consts: list[Const] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # what this lowering knowingly leaves out
    # the weights the calls read, as ttnn holds them: name -> (held shape, dtype, layout)
    weights: dict = field(default_factory=dict)
    # persistent device tensors one runner keeps across its forwards and steps, zero-filled when
    # it prepares (never written from the host): name -> (shape, dtype, layout). The decode feed's
    # last sampled ids (:mod:`.feed`) is one: each device-sampled decode writes it, the next reads it
    state: dict = field(default_factory=dict)

    def calls(self):
        """(layer index, call) in execution order."""
        for layer in self.layers:
            for c in layer.calls:
                yield layer.index, c

    def op_kinds(self) -> set[str]:
        return {c.op for _, c in self.calls() if c.op}


def resolve_attr(ttnn, path: str):
    obj = ttnn
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def resolve(ttnn, v, env: dict, layer: int | None):
    """A call argument as the object to pass to ttnn."""
    if isinstance(v, T):
        return env[v.name]
    if isinstance(v, W):
        return env["weights"][v.key(layer)]
    if isinstance(v, KV):
        return env["kv"][layer][v.name]
    if isinstance(v, Attr):
        return resolve_attr(ttnn, v.path)
    if isinstance(v, New):
        cls = resolve_attr(ttnn, v.cls)
        return cls(*[resolve(ttnn, a, env, layer) for a in v.args],
                   **{k: resolve(ttnn, x, env, layer) for k, x in v.kwargs})
    if isinstance(v, tuple):
        return tuple(resolve(ttnn, x, env, layer) for x in v)
    if isinstance(v, list):
        return [resolve(ttnn, x, env, layer) for x in v]
    return v
