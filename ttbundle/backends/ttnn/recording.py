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

**It computes.** A tensor of the double holds one numpy array per mesh device (device
``d = r * cols + c`` of the mesh ``open_mesh_device`` opened, or of the submeshes
``FakeDevice.create_submeshes`` cut from it once it has), or is *unknown* with the reason.
Host tensors (``ttnn.Tensor``, ``load_tensor`` of a ``.tensorbin``), the mappers
(``replicate_tensor_to_mesh_mapper``, ``ShardTensor2dMesh``), ``from_host_shards``,
``get_device_tensors``, the composers (``ConcatMesh2dToTensor`` via ``aggregate_tensor``), the
collectives and the ops in :mod:`.numerics` compute; an op it does not model, or one reading an
unknown input (the fake weights :func:`populate` makes, a buffer never written), gives an unknown
result. Reading an unknown value (``to_numpy``, :meth:`FakeTensor.arrays`) raises
:class:`UnknownValue` saying why, unless the recorder was made with ``unknown_reads="zeros"``
(the call-order tests and the vLLM hook, whose weights are fake): then it gives zeros and lists
the read in ``Recorder.zero_reads``. Ops run between ``begin_trace_capture`` and
``end_trace_capture`` compute nothing then (as on a device); ``execute_trace`` replays them on
the buffers' current contents. Each computed result is checked against the shape the lowering
said (``Recorder.shape_mismatches``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from ... import tensorbin
from ...blockfloat import decode_array
from ...errors import TTBundleError
from . import numerics
from .cache import untilize
from .calls import Attr, T, W
from .introspect import Opaque

TRACE_API = ("begin_trace_capture", "end_trace_capture", "execute_trace", "release_trace")
# factory functions the lowering calls for config objects (``calls.New.factory``): their results
FACTORIES = {"create_sharded_memory_config": "MemoryConfig", "num_cores_to_corerangeset": "CoreRangeSet"}
# calls that move data or manage the device, not ops that compile
NOT_OPS = {"Shape", "Tensor", "set_fabric_config", "distribute_tensor", "replicate_tensor_to_mesh_mapper", "copy_host_to_device_tensor",
           "allocate_tensor_on_device", "synchronize_device", "deallocate", "from_device", "get_device_tensors",
           "load_tensor", "from_host_shards", "to_device", "open_mesh_device", "close_mesh_device", "full",
           "aggregate_tensor", "record_event", "event_synchronize", *TRACE_API}


@dataclass
class Event:
    fn: str
    args: tuple
    kwargs: dict
    compiled: bool = False  # an op that had to compile (a new signature)
    capturing: bool = False  # inside begin/end_trace_capture
    device: str | None = None  # the submesh an op ran on (its inputs'), None on the opened mesh


class UnknownValue(RuntimeError):
    """A numeric read of a value the double did not compute."""


class FakeDevice:
    """A mesh device of the double; ``create_submeshes`` cuts it as ttnn 0.81.1's
    ``MeshDevice.create_submeshes(MeshShape(r, c))`` does: row-major over the grid of submeshes,
    each its own device (its own program cache: a submesh's tensors carry its ``origin`` in their
    signatures, so an op compiles once per submesh, as on ttnn)."""

    def __init__(self, shape: tuple[int, int] = (1, 1), rec: "Recorder | None" = None, origin=None):
        self.shape, self._rec, self.origin = tuple(shape), rec, origin
        self.submeshes: list = []

    def get_num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def create_submeshes(self, submesh_shape) -> list:
        r, c = (int(x) for x in (submesh_shape.args if isinstance(submesh_shape, FakeObject) else submesh_shape))
        R, C = self.shape
        if R % r or C % c:
            raise ValueError(f"create_submeshes: MeshShape({r}, {c}) does not tile the {R}x{C} mesh")
        self.submeshes = [FakeDevice((r, c), self._rec, (i * r, j * c)) for i in range(R // r) for j in range(C // c)]
        if self._rec is not None:  # tensors from now on live on submeshes of this shape
            self._rec.mesh_shape = (r, c)
        return list(self.submeshes)

    def get_submeshes(self) -> list:
        return list(self.submeshes)

    def __repr__(self):
        if self.origin is None:
            return "<MeshDevice>"
        return f"<MeshDevice {self.shape[0]}x{self.shape[1]} at {self.origin[0]},{self.origin[1]}>"


class FakeTraceId:
    def __init__(self, n: int):
        self.n = n

    def __repr__(self):
        return f"<MeshTraceId {self.n}>"


class FakeTensor:
    """A tensor of the double: its signature, its shape where the lowering said it, and its
    value: ``data``, one array per device (a host tensor: one), or None with ``why`` it is
    unknown."""

    def __init__(self, sig: str, n_out: int = 2, shape: tuple | None = None, data: list | None = None,
                 why: str = "not computed", dtype: str | None = None, rec: "Recorder | None" = None,
                 device: str | None = None):
        self.sig, self._n, self.shape = sig, n_out, shape
        self.data, self.why, self.dtype, self._rec = data, why, dtype, rec
        self.device = device  # the submesh it lives on (FakeDevice repr), None on the opened mesh
        if data is not None and shape is None and data:
            self.shape = tuple(data[0].shape)

    def _part(self, i: int, data=None) -> "FakeTensor":
        return FakeTensor(f"{self.sig}[{i}]", shape=self.shape, data=data, why=self.why, dtype=self.dtype,
                          rec=self._rec, device=self.device)

    def __iter__(self):  # ops returning several tensors (topk) are unpacked
        return iter([self._part(i) for i in range(self._n)])

    def __getitem__(self, i):  # get_device_tensors(...)[0]
        return self._part(i, None if self.data is None else [self.data[i]])

    @property
    def known(self) -> bool:
        return self.data is not None

    def arrays(self) -> list[np.ndarray]:
        """Every device's array (mesh order); raises :class:`UnknownValue` when unknown."""
        if self.data is None:
            raise UnknownValue(f"tensor {self.sig[:60]} has no value in the double: {self.why}")
        return self.data

    def to_numpy(self):
        if self.data is None and self._rec is not None and self._rec.unknown_reads == "zeros":
            self._rec.zero_reads.append((self.sig, self.why))
            return np.zeros(self.shape or (1,))
        data = self.arrays()
        if len(data) != 1:
            raise UnknownValue(f"to_numpy of a tensor on {len(data)} devices: take get_device_tensors first")
        return np.array(data[0])

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


ALLOCATED = "allocated, never written"
# ops that write into their first argument (a KV cache) instead of returning a tensor
IN_PLACE = {"experimental.paged_update_cache", "experimental.paged_fill_cache"}
MULTI_OUT = {"topk": 2}


def _walk(v):
    if isinstance(v, FakeTensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _walk(x)


def _name(v) -> str | None:
    return v.path if isinstance(v, Name) else None


@dataclass
class Recorder:
    """The double itself: ``rec = Recorder(); ttnn = rec.module()``. ``unknown_reads``: "raise"
    (a numeric read of an unknown value raises :class:`UnknownValue`) or "zeros" (it gives
    zeros and is listed in ``zero_reads``)."""

    events: list = field(default_factory=list)
    compiled: set = field(default_factory=set)
    capturing: FakeTraceId | None = None
    captured: set = field(default_factory=set)
    capture_began: bool = False
    violations: list = field(default_factory=list)
    unknown_reads: str = "raise"
    zero_reads: list = field(default_factory=list)  # (sig, why) of each unknown value read as zeros
    shape_mismatches: list = field(default_factory=list)  # computed shape != the lowering's
    op_errors: list = field(default_factory=list)  # an op that raised on known inputs
    mesh_shape: tuple = (1, 1)
    max_elements: int = 1 << 25  # results larger than this (all devices) are left unknown
    _traces: int = 0
    _expect: tuple | None = None  # the output shape the executor expects of the next op
    _replays: dict = field(default_factory=dict)  # trace id -> the thunks its replay runs

    @property
    def num_devices(self) -> int:
        return self.mesh_shape[0] * self.mesh_shape[1]

    def on_call(self, call, layer) -> None:
        """``Executor.on_call`` hook: the lowered call about to run says its output's shape, so
        the op's output is known by its spec (shape), as ttnn's program cache knows it."""
        self._expect = call.shape

    def module(self) -> Name:
        return Name(self, "")

    def tensor(self, arrays, dtype: str = "float32", sig: str = "given") -> FakeTensor:
        """A device tensor holding ``arrays`` (one per device, mesh order), for tests."""
        return FakeTensor(sig, data=[np.asarray(a) for a in arrays], dtype=dtype, rec=self)

    def _call(self, path: str, args, kwargs):
        ev = Event(path, tuple(args), dict(kwargs), capturing=self.capturing is not None)
        self.events.append(ev)
        head = path.split(".")[-1]
        if path == "begin_trace_capture":
            if self.capturing is not None:
                self.violations.append("begin_trace_capture inside a capture")
            self._traces += 1
            self.capturing = FakeTraceId(self._traces)
            self._replays[self._traces] = []
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
            if path == "execute_trace":
                for thunk in self._replays.get(args[1].n, []):
                    thunk()
            return None
        if path == "open_mesh_device":
            shape = args[0].args if args and isinstance(args[0], FakeObject) else (1, 1)
            self.mesh_shape = tuple(int(x) for x in shape) if len(shape) == 2 else (1, 1)
            return FakeDevice(self.mesh_shape, self)
        if path == "allocate_tensor_on_device":
            if self.capture_began:
                self.violations.append("allocate_tensor_on_device after a trace capture began")
            shape = tuple(args[0].args[0]) if isinstance(args[0], FakeObject) and args[0].args else None
            on = next((repr(v) for v in list(args) + list(kwargs.values())
                       if isinstance(v, FakeDevice) and v.origin is not None), None)
            return FakeTensor(f"alloc{_sig(args[0])}:{_sig(args[1])}:{_sig(args[2])}", shape=shape,
                              why=ALLOCATED, dtype=_name(args[1]), rec=self, device=on)
        if path == "Shape":
            return FakeObject("Shape", args, kwargs)
        if path == "replicate_tensor_to_mesh_mapper":
            return FakeObject("CppTensorToMesh", args, kwargs)
        if path in ("from_device", "get_device_tensors") and isinstance(args[0], FakeTensor):
            t = args[0]
            if path == "from_device":
                return FakeTensor(f"{path}({_sig(args)})", shape=t.shape, data=t.data, why=t.why, dtype=t.dtype,
                                  rec=self)
            n = len(t.data) if t.data is not None else self.num_devices
            return [FakeTensor(f"{path}({_sig(args)})[{d}]", shape=t.shape,
                               data=None if t.data is None else [t.data[d]], why=t.why, dtype=t.dtype, rec=self)
                    for d in range(n)]
        if path in NOT_OPS:
            if path in ("synchronize_device", "deallocate", "event_synchronize"):
                return None
            on = next((repr(v) for v in list(args) + list(kwargs.values())
                       if isinstance(v, FakeDevice) and v.origin is not None), None)
            if on is None:  # a move within a device (from_device, distribute...) keeps its input's
                on = next((t.device for t in _walk(list(args)) if t.device), None)
            out = None if path == "copy_host_to_device_tensor" else FakeTensor(f"{path}({_sig(args)})", rec=self,
                                                                               device=on)
            self._schedule(lambda: self._move(path, args, kwargs, out))
            return out
        if head[:1].isupper():  # a class: a config object, not an op
            return FakeObject(path, args, kwargs)
        if path in FACTORIES:
            return FakeObject(FACTORIES[path], args, kwargs)
        # an op: compiles the first time it sees this signature (op, configuration, input specs)
        # on its device (each submesh has its own program cache, as on ttnn)
        dev = next((t.device for t in _walk(list(args) + list(kwargs.values())) if t.device), None)
        ev.device = dev
        key = hashlib.sha256(f"{dev}|{path}|{_sig(args)}|{_sig(sorted(kwargs.items()))}".encode()).hexdigest()[:16]
        if key not in self.compiled:
            self.compiled.add(key)
            ev.compiled = True
            if self.capturing is not None:
                self.violations.append(f"{path} compiled inside trace capture {self.capturing.n}")
        expect, self._expect = self._expect, None
        base = FakeTensor(f"spec{expect}" if expect is not None else key, shape=expect, rec=self,
                          n_out=MULTI_OUT.get(path, 2), device=dev)
        if path == "copy":  # ttnn.copy(a, b): b is written in place, nothing returned
            outs = [t for t in args[1:2] if isinstance(t, FakeTensor)]
            self._schedule(lambda: self._copy(args))
            return None
        if path in IN_PLACE:
            outs = [t for t in args[:1] if isinstance(t, FakeTensor)]
        elif path in MULTI_OUT:
            outs = [base._part(i) for i in range(MULTI_OUT[path])]
        else:
            outs = [base]
        if self.capturing is not None and path not in IN_PLACE:
            for o in outs:
                o.why = f"an output of trace {self.capturing.n}: computed at its execute_trace"
        self._schedule(lambda: self._evaluate(path, args, kwargs, expect, outs))
        return tuple(outs) if path in MULTI_OUT else base

    # -- computing ------------------------------------------------------------------------------------
    def _schedule(self, thunk) -> None:
        """Run ``thunk`` now, or (inside a capture) at every replay of the trace, as a device would."""
        if self.capturing is None:
            thunk()
        else:
            self._replays[self.capturing.n].append(thunk)

    def _copy(self, args) -> None:
        """``ttnn.copy(a, b)``: ``b`` takes ``a``'s values (equal shapes, as ttnn requires)."""
        src, dst = args[0], args[1]
        if src.data is None:
            dst.data, dst.why = None, f"depends on {src.sig[:48]}: {src.why}"
            return
        if dst.shape is not None and tuple(src.data[0].shape) != tuple(dst.shape):
            self.op_errors.append(f"ttnn.copy: shapes {tuple(src.data[0].shape)} and {tuple(dst.shape)} differ")
            dst.data, dst.why = None, "ttnn.copy of another shape"
            return
        dst.data = [np.array(a, dtype=numerics.INTS.get(dst.dtype, a.dtype)) for a in src.data]

    def _inputs_known(self, args, kwargs) -> None:
        for t in _walk(list(args) + list(kwargs.values())):
            if t.data is None:
                why = t.why if t.why.startswith("depends on ") else f"depends on {t.sig[:48]}: {t.why}"
                raise numerics.Unknown(why)

    def _per_device(self, v, d: int):
        if isinstance(v, FakeTensor):
            return v.data[d] if len(v.data) > 1 else v.data[0]
        if isinstance(v, list):
            return [self._per_device(x, d) for x in v]
        if isinstance(v, tuple):
            return tuple(self._per_device(x, d) for x in v)
        if isinstance(v, dict):
            return {k: self._per_device(x, d) for k, x in v.items()}
        return v

    def _devices(self, args, kwargs) -> int:
        n = {len(t.data) for t in _walk(list(args) + list(kwargs.values())) if t.data is not None}
        return max(n) if n else self.num_devices

    def _evaluate(self, path: str, args, kwargs, expect, outs: list) -> None:
        """Compute op ``path`` into ``outs`` (unknown, saying why, where it cannot)."""
        try:
            self._inputs_known(args[1:] if path in IN_PLACE else args, kwargs)  # a cache may be unwritten
            if path not in numerics.IMPLS_PER_DEVICE and path not in numerics.COLLECTIVES \
                    and path not in _SPECIAL:
                raise numerics.Unknown(f"ttnn.{path} is not computed by the double")
            n = self._devices(args, kwargs)
            if expect is not None and math.prod(expect) * n > self.max_elements:
                raise numerics.Unknown(f"ttnn.{path}: {math.prod(expect) * n} elements, over the double's "
                                       f"limit of {self.max_elements}")
            dtype = _name(kwargs.get("dtype")) or next((t.dtype for t in _walk(args) if t.dtype), None)
            if path in numerics.COLLECTIVES:
                kw = {k: v for k, v in kwargs.items() if k in ("cluster_axis",)}
                res = [numerics.COLLECTIVES[path](self.mesh_shape, args[0].data, *args[1:], **kw)]
            elif path in _SPECIAL:
                res, dtype = _SPECIAL[path](self, args, kwargs, n)
            else:
                fn = numerics.IMPLS_PER_DEVICE[path]
                per = [fn(*self._per_device(args, d), **self._per_device(kwargs, d)) for d in range(n)]
                res = [list(p) for p in zip(*per)] if path in MULTI_OUT else [per]
        except numerics.Unknown as e:
            for o in outs:
                o.data, o.why = None, str(e)
            return
        except Exception as e:  # known inputs an op refuses: a lowering bug the tests report
            msg = f"ttnn.{path}: {type(e).__name__}: {e}"
            self.op_errors.append(msg)
            for o in outs:
                o.data, o.why = None, msg
            return
        if path in IN_PLACE:
            return
        for o, arrays in zip(outs, res):
            if arrays and np.issubdtype(arrays[0].dtype, np.floating) and dtype in numerics.FLOATS:
                arrays = [numerics.as_dtype(a, dtype) for a in arrays]
            elif arrays and np.issubdtype(arrays[0].dtype, np.floating):
                arrays = [np.asarray(a, np.float32) for a in arrays]
            o.data, o.dtype = arrays, (dtype if np.issubdtype(arrays[0].dtype, np.floating) else str(arrays[0].dtype))
            got = tuple(arrays[0].shape)
            if expect is not None and got != tuple(expect):
                self.shape_mismatches.append(f"ttnn.{path} -> {o.sig[:40]}: computed {got}, "
                                             f"the lowering says {tuple(expect)}")

    def _move(self, path: str, args, kwargs, out: FakeTensor | None) -> None:
        """Data movement and host tensors: ``Tensor``, mappers, ``to_device``, ``load_tensor``..."""
        N = self.num_devices
        try:
            if path == "Tensor":  # ttnn.Tensor(ndarray, dtype, device, layout): a host tensor
                dtype = _name(args[1])
                out.data, out.dtype = [numerics.as_dtype(np.asarray(args[0]), dtype)], dtype
            elif path == "full":
                dtype = _name(kwargs.get("dtype"))
                # a constant rounds the same everywhere (block-float blocks of equal values included),
                # so a read-only broadcast of one rounded tile's value: a filled KV cache costs no memory
                # until a cache write copies it (``_cache_target``)
                v = numerics.as_dtype(np.full((32, 32), args[1], np.float32), dtype).flat[0]
                out.data = [np.broadcast_to(v, [int(s) for s in args[0]]) for _ in range(N)]
                out.dtype = dtype
            elif path == "distribute_tensor":
                t, mapper = args[0], args[1]
                self._inputs_known([t], {})
                out.dtype = t.dtype
                if mapper.cls == "CppTensorToMesh":
                    out.data = [np.array(t.data[0]) for _ in range(N)]
                elif mapper.cls == "ShardTensor2dMesh":
                    shape = mapper.kwargs.get("mesh_shape", mapper.args[1] if len(mapper.args) > 1 else None)
                    dims = mapper.kwargs.get("dims", mapper.args[2] if len(mapper.args) > 2 else None)
                    out.data = numerics.shard_2d(tuple(shape), t.data[0], tuple(dims))
                else:
                    raise numerics.Unknown(f"mapper {mapper.cls} is not modeled by the double")
            elif path == "to_device":
                t = args[0]
                self._inputs_known([t], {})
                out.data = [np.array(a) for a in (t.data if len(t.data) > 1 else t.data * N)]
                out.dtype = t.dtype
            elif path == "copy_host_to_device_tensor":
                src, dst = args[0], args[1]
                try:
                    self._inputs_known([src], {})
                except numerics.Unknown as e:
                    dst.data, dst.why = None, str(e)
                    return
                dst.data = [np.array(a) for a in (src.data if len(src.data) > 1 else src.data * N)]
                dst.dtype = src.dtype
            elif path == "from_host_shards":
                shards = list(args[0])
                self._inputs_known(shards, {})
                out.data = [s.data[0] for s in shards]
                out.dtype = shards[0].dtype
            elif path == "load_tensor":
                try:
                    out.data, out.dtype = [_load_tensorbin(args[0])], None
                except (OSError, ValueError, TTBundleError) as e:  # a file it cannot read: unknown
                    raise numerics.Unknown(f"load_tensor({args[0]}): {type(e).__name__}: {e}") from None
            elif path == "aggregate_tensor":
                t, comp = args[0], args[1]
                self._inputs_known([t], {})
                if comp.cls != "ConcatMesh2dToTensor":
                    raise numerics.Unknown(f"composer {comp.cls} is not modeled by the double")
                shape = comp.kwargs.get("mesh_shape", comp.args[1] if len(comp.args) > 1 else None)
                dims = comp.kwargs.get("dims", comp.args[2] if len(comp.args) > 2 else None)
                out.data, out.dtype = [numerics.concat_2d(tuple(shape), t.data, tuple(dims))], t.dtype
            elif out is not None:
                out.why = f"ttnn.{path} makes no tensor value in the double"
        except numerics.Unknown as e:
            if out is not None:
                out.data, out.why = None, str(e)
        if out is not None and out.data is not None:
            out.shape = tuple(out.data[0].shape)

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


# ---- ops the double computes outside numerics.IMPLS_PER_DEVICE ---------------------------------------
def _typecast(rec, args, kwargs, n):
    dtype = _name(args[1]) if len(args) > 1 else _name(kwargs.get("dtype"))
    return [[numerics.as_dtype(a, dtype) for a in args[0].data]], dtype


def _cache_target(rec, cache: FakeTensor) -> list[np.ndarray]:
    """The cache's arrays, written in place (a never-written buffer starts as NaN: garbage)."""
    if cache.data is None:
        if cache.why != ALLOCATED or cache.shape is None:  # unknown for another reason: stays so
            raise numerics.Unknown(cache.why)
        cache.data = [np.full(cache.shape, np.nan, np.float32) for _ in range(rec.num_devices)]
        cache.why = ""
    if any(not a.flags.writeable for a in cache.data):  # a ``full`` broadcast: its own copy now
        cache.data = [np.array(a) for a in cache.data]
    return cache.data


def _paged_update(rec, args, kwargs, n):
    cache = _cache_target(rec, args[0])
    for d in range(len(cache)):
        numerics.paged_update_cache(cache[d], rec._per_device(args[1], d),
                                    rec._per_device(kwargs.get("update_idxs_tensor"), d),
                                    rec._per_device(kwargs.get("page_table"), d))
    return [], None


def _paged_fill(rec, args, kwargs, n):
    cache = _cache_target(rec, args[0])
    for d in range(len(cache)):
        numerics.paged_fill_cache(cache[d], rec._per_device(args[1], d), rec._per_device(args[2], d))
    return [], None


def _sdpa(kernel, pos_kw):
    def run(rec, args, kwargs, n):
        q, k, v, pt = args[:4]
        out = []
        for d in range(n):
            extra = {key: rec._per_device(kwargs[key], d) for key in ("sliding_window_size", "attention_sink")
                     if kwargs.get(key) is not None}
            out.append(kernel(rec._per_device(q, d), rec._per_device(k, d), rec._per_device(v, d),
                              np.asarray(rec._per_device(pt, d)), rec._per_device(kwargs[pos_kw], d),
                              scale=float(kwargs.get("scale", 1.0)), **extra))
        return [out], q.dtype
    return run


def _mla(kernel, decode: bool):
    def run(rec, args, kwargs, n):
        q, cache = args[0], args[1]
        r, pt = (args[3], args[4]) if decode else (args[2], args[3])
        pos = kwargs.get("cur_pos_tensor") if decode else args[4]
        out = [kernel(rec._per_device(q, d), rec._per_device(cache, d), int(r), np.asarray(rec._per_device(pt, d)),
                      rec._per_device(pos, d), scale=float(kwargs.get("scale", 1.0))) for d in range(n)]
        return [out], q.dtype
    return run


_SPECIAL = {
    "typecast": _typecast,
    "experimental.paged_update_cache": _paged_update,
    "experimental.paged_fill_cache": _paged_fill,
    "transformer.paged_scaled_dot_product_attention_decode": _sdpa(numerics.paged_sdpa_decode, "cur_pos_tensor"),
    "transformer.chunked_scaled_dot_product_attention": _sdpa(numerics.chunked_sdpa, "chunk_start_idx_tensor"),
    "transformer.paged_flash_multi_latent_attention_decode": _mla(numerics.mla_decode, True),
    "transformer.chunked_flash_mla_prefill": _mla(numerics.mla_prefill, False),
}


def _load_tensorbin(path) -> np.ndarray:
    """A ``.tensorbin`` host tensor's values (bf16 / f32 / ints, TILE or ROW_MAJOR, block floats)."""
    h, data = tensorbin.read_shard(path)
    shape = tuple(h.shape)
    if h.dtype in ("bfp8", "bfp4"):
        return decode_array(data, shape, h.dtype)
    if h.dtype == "bf16":
        bits = untilize(data, shape) if h.layout == "TILE" else np.frombuffer(data, np.uint16).reshape(shape)
        return (np.asarray(bits, np.uint32) << 16).view(np.float32).reshape(shape)
    kind = {"f32": np.float32, "uint32": np.uint32, "int32": np.int32}.get(h.dtype)
    if kind is None:
        raise numerics.Unknown(f"{path}: dtype {h.dtype} is not modeled by the double")
    if h.layout == "TILE":
        return untilize(data, shape, kind).reshape(shape)
    return np.frombuffer(data, kind).reshape(shape).copy()


FAKE = "a fake tensor of recording.populate: shape only, no values"


def populate(executor, plan, forwards) -> None:
    """Fill ``executor``'s env with fake weights (every key the forwards' calls and setup read),
    the KV cache and the constants, each a FakeTensor whose signature carries its shape and no
    value (everything computed from them is unknown)."""
    shapes = {t.name: t.device_shape for t in plan.tensors}
    made = {c.out for fw in forwards for _, c in fw.setup}
    for fw in forwards:
        for layer, c in list(fw.calls()) + list(fw.setup):
            for v in c.values():
                if isinstance(v, W):
                    key = v.key(layer)
                    if key not in made:  # program caches key on shapes, not on which layer's buffer
                        executor.env["weights"].setdefault(key, FakeTensor(f"w:{v.name}:{v.variant}:{shapes.get(v.name)}",
                                                                           why=FAKE))
        for cst in fw.consts:
            executor.env.setdefault(cst.name, FakeTensor(f"const:{cst.name}:{cst.shape}", why=FAKE))
    for e in plan.kv["entries"]:
        for layer in range(e["layers"]):
            executor.env["kv"].setdefault(layer, {})[e["name"]] = FakeTensor(f"kv:{e['name']}:{e['device_shape']}",
                                                                             why=FAKE)
