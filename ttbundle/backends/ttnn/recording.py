"""A recording stand-in for the ttnn module: runs the backend's device code with no wheel and no
device, and records what it asks of ttnn.

Every attribute is a :class:`Name` (``ttnn.bfloat16``, ``ttnn.Topology.Ring``); calling a name is
recorded as an :class:`Event`. Ops return :class:`FakeTensor` objects whose ``sig`` describes how
they were made (the op, its configuration and its inputs' signatures, down to the shapes of the
allocated inputs and the weights). That models ttnn's program cache: an op runs a *compiled*
program when the same op has run before on inputs of the same signature, and *compiles*
otherwise (``Event.compiled``). The double also knows the trace API, so it can say what a real
device would not tolerate:

* ``compile_in_capture``: an op compiled between ``begin_trace_capture`` and ``end_trace_capture``;
* ``alloc_after_capture``: a persistent buffer (``allocate_tensor_on_device``) allocated after a
  capture began (replays would overwrite it);
* replaying a trace id that was never captured, or capturing inside a capture.

``Recorder.values_of(event)`` gives each recorded argument as a value the introspection checker
understands, so the calls the runtime makes can be checked against the real wheel too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .calls import Attr, T
from .introspect import Opaque

TRACE_API = ("begin_trace_capture", "end_trace_capture", "execute_trace", "release_trace")
# factory functions the lowering calls for config objects (``calls.New.factory``): their results
FACTORIES = {"create_sharded_memory_config": "MemoryConfig", "num_cores_to_corerangeset": "CoreRangeSet"}
# calls that move data or manage the device, not ops that compile
NOT_OPS = {"Shape", "Tensor", "set_fabric_config", "distribute_tensor", "replicate_tensor_to_mesh_mapper", "copy_host_to_device_tensor",
           "allocate_tensor_on_device", "synchronize_device", "deallocate", "from_device", "get_device_tensors",
           "load_tensor", "from_host_shards", "to_device", "open_mesh_device", "close_mesh_device", "full",
           *TRACE_API}


@dataclass
class Event:
    fn: str
    args: tuple
    kwargs: dict
    compiled: bool = False  # an op that had to compile (a new signature)
    capturing: bool = False  # inside begin/end_trace_capture


class FakeDevice:
    def __repr__(self):
        return "<MeshDevice>"


class FakeTraceId:
    def __init__(self, n: int):
        self.n = n

    def __repr__(self):
        return f"<MeshTraceId {self.n}>"


class FakeTensor:
    """A tensor of the double: its signature, and its shape where the lowering said it (so a read
    gives zeros of the right shape: the double computes nothing)."""

    def __init__(self, sig: str, n_out: int = 2, shape: tuple | None = None):
        self.sig, self._n, self.shape = sig, n_out, shape

    def __iter__(self):  # ops returning several tensors (topk) are unpacked
        return iter([FakeTensor(f"{self.sig}[{i}]", shape=self.shape) for i in range(self._n)])

    def __getitem__(self, i):  # get_device_tensors(...)[0]
        return FakeTensor(f"{self.sig}[{i}]", shape=self.shape)

    def to_numpy(self):
        import numpy as np
        return np.zeros(self.shape or (1,))

    def __repr__(self):
        return f"<Tensor {self.sig[:12]}>"


def _sig(v) -> str:
    if isinstance(v, FakeTensor):
        return v.sig
    if isinstance(v, Name):
        return v.path
    if isinstance(v, FakeObject):
        return f"{v.cls}({','.join(map(_sig, v.args))};{','.join(f'{k}={_sig(x)}' for k, x in sorted(v.kwargs.items()))})"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_sig(x) for x in v) + "]"
    if hasattr(v, "shape") and hasattr(v, "dtype"):  # a numpy array handed to ttnn.Tensor
        return f"ndarray{tuple(v.shape)}"
    return repr(v)


class FakeObject:
    """A constructed ttnn object (a program config, a core coordinate)."""

    def __init__(self, cls: str, args, kwargs):
        self.cls, self.args, self.kwargs = cls, tuple(args), dict(kwargs)


class Name:
    """``ttnn.<path>``: an attribute, a class, a function or an op of the double."""

    def __init__(self, rec: "Recorder", path: str):
        self._rec, self.path = rec, path

    def __getattr__(self, name: str) -> "Name":
        if name.startswith("__"):
            raise AttributeError(name)
        return Name(self._rec, f"{self.path}.{name}" if self.path else name)

    def __call__(self, *args, **kwargs):
        return self._rec._call(self.path, args, kwargs)

    def __repr__(self):
        return f"ttnn.{self.path}"


@dataclass
class Recorder:
    """The double itself: ``rec = Recorder(); ttnn = rec.module()``."""

    events: list = field(default_factory=list)
    compiled: set = field(default_factory=set)
    capturing: FakeTraceId | None = None
    captured: set = field(default_factory=set)
    capture_began: bool = False
    violations: list = field(default_factory=list)
    _traces: int = 0
    _expect: tuple | None = None  # the output shape the executor expects of the next op

    def on_call(self, call, layer) -> None:
        """``Executor.on_call`` hook: the lowered call about to run says its output's shape, so
        the op's output is known by its spec (shape), as ttnn's program cache knows it."""
        self._expect = call.shape

    def module(self) -> Name:
        return Name(self, "")

    def _call(self, path: str, args, kwargs):
        ev = Event(path, tuple(args), dict(kwargs), capturing=self.capturing is not None)
        self.events.append(ev)
        head = path.split(".")[-1]
        if path == "begin_trace_capture":
            if self.capturing is not None:
                self.violations.append("begin_trace_capture inside a capture")
            self._traces += 1
            self.capturing = FakeTraceId(self._traces)
            self.capture_began = True
            return self.capturing
        if path == "end_trace_capture":
            if self.capturing is None or args[1] is not self.capturing:
                self.violations.append("end_trace_capture without its begin")
            self.captured.add(args[1].n)
            self.capturing = None
            return None
        if path in ("execute_trace", "release_trace"):
            if args[1].n not in self.captured:
                self.violations.append(f"{path} of trace {args[1].n}, never captured")
            if self.capturing is not None:
                self.violations.append(f"{path} inside a capture")
            return None
        if path == "open_mesh_device":
            return FakeDevice()
        if path == "allocate_tensor_on_device":
            if self.capture_began:
                self.violations.append("allocate_tensor_on_device after a trace capture began")
            return FakeTensor(f"alloc{_sig(args[0])}:{_sig(args[1])}:{_sig(args[2])}")
        if path == "Shape":
            return FakeObject("Shape", args, kwargs)
        if path == "replicate_tensor_to_mesh_mapper":
            return FakeObject("CppTensorToMesh", args, kwargs)
        if path in ("from_device", "get_device_tensors") and isinstance(args[0], FakeTensor):
            return FakeTensor(f"{path}({_sig(args)})", shape=args[0].shape)
        if path in NOT_OPS:
            return FakeTensor(f"{path}({_sig(args)})") if path not in ("synchronize_device", "deallocate",
                                                                          "copy_host_to_device_tensor") else None
        if head[:1].isupper():  # a class: a config object, not an op
            return FakeObject(path, args, kwargs)
        if path in FACTORIES:
            return FakeObject(FACTORIES[path], args, kwargs)
        # an op: compiles the first time it sees this signature (op, configuration, input specs)
        key = hashlib.sha256(f"{path}|{_sig(args)}|{_sig(sorted(kwargs.items()))}".encode()).hexdigest()[:16]
        if key not in self.compiled:
            self.compiled.add(key)
            ev.compiled = True
            if self.capturing is not None:
                self.violations.append(f"{path} compiled inside trace capture {self.capturing.n}")
        expect, self._expect = self._expect, None
        return FakeTensor(f"spec{expect}" if expect is not None else key, shape=expect)

    # -- for the introspection check -----------------------------------------------------------------
    def values_of(self, ev: Event) -> tuple[tuple, dict]:
        """``ev``'s arguments as introspection values (tensors as T, device objects as Opaque)."""
        def conv(v):
            if isinstance(v, FakeTensor):
                return T("t")
            if isinstance(v, FakeDevice):
                return Opaque("MeshDevice")
            if isinstance(v, FakeTraceId):
                return Opaque("MeshTraceId")
            if isinstance(v, Name):
                return Attr(v.path)
            if isinstance(v, FakeObject):
                return Opaque(v.cls.split(".")[-1])
            if isinstance(v, (list, tuple)):
                return type(v)(conv(x) for x in v)
            if hasattr(v, "shape") and hasattr(v, "dtype"):  # numpy: nanobind's ArrayLike
                return Opaque("ArrayLike")
            return v
        return tuple(conv(a) for a in ev.args), {k: conv(v) for k, v in ev.kwargs.items()}

    @staticmethod
    def is_op(e: Event) -> bool:
        """An op (it runs kernels), not a data move, a device call or a constructor."""
        head = e.fn.split(".")[-1]
        return head not in NOT_OPS and e.fn not in FACTORIES and not head[:1].isupper()

    def ops(self) -> list[Event]:
        return [e for e in self.events if self.is_op(e)]


def populate(executor, plan, forwards) -> None:
    """Fill ``executor``'s env with fake weights (every key the forwards' calls and setup read),
    the KV cache and the constants, each a FakeTensor whose signature carries its shape."""
    from .calls import W
    shapes = {t.name: t.device_shape for t in plan.tensors}
    made = {c.out for fw in forwards for _, c in fw.setup}
    for fw in forwards:
        for layer, c in list(fw.calls()) + list(fw.setup):
            for v in c.values():
                if isinstance(v, W):
                    key = v.key(layer)
                    if key not in made:  # program caches key on shapes, not on which layer's buffer
                        executor.env["weights"].setdefault(key, FakeTensor(f"w:{v.name}:{v.variant}:{shapes.get(v.name)}"))
        for cst in fw.consts:
            executor.env.setdefault(cst.name, FakeTensor(f"const:{cst.name}:{cst.shape}"))
    for e in plan.kv["entries"]:
        for layer in range(e["layers"]):
            executor.env["kv"].setdefault(layer, {})[e["name"]] = FakeTensor(f"kv:{e['name']}:{e['device_shape']}")
