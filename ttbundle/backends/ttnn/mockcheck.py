"""Run a lowered forward through ttnn's own op validation on a mock mesh.

On a mock cluster (``ttbundle mock-cluster`` + setup_tt.sh's SFPI stub) the allocator is real
and every op runs its host-side checks — shapes, dtypes, layouts, memory configs, program
configs, cluster axes — before it compiles its kernels, which is where a mock device stops
("build failed": the stub compiles nothing). So an op that gets as far as compiling accepted its
arguments; one that fails earlier with a ``TT_FATAL`` did not. :func:`validate` runs every call
of a forward this way, with weights, KV cache, constants and inputs allocated at their planned
shapes, and each output that never materializes replaced by a stand-in tensor of the shape,
dtype and memory config the lowering says it has, so the next call is checked on what it would
really receive.

This checks argument validity, not numerics: nothing is computed (reads from a mock device are
zeros), which is why op numerics can only be checked on hardware.

Multi-chip meshes (N300, T3K), as measured on ttnn 0.81.1's mock:

* **Collectives.** ``all_gather`` and ``all_reduce`` look up the fabric context in their host
  code, and a mock mesh cannot have one: with ``ttnn.set_fabric_config(FABRIC_1D | FABRIC_2D)``
  ``open_mesh_device`` compiles the fabric router firmware (``fabric_erisc_router``: "Compiling
  fabric on mock devices (no router programming or sync)"), which the SFPI stub cannot, so the
  mesh does not open; with the fabric disabled ``all_gather`` stops at "Trying to get
  un-initialized fabric context" and ``all_reduce`` at "Unsupported fabric config". Graph
  capture with ``RunMode.NO_DISPATCH`` does not skip either (nor kernel compilation). What runs
  before that point still runs for real (a cluster_axis the mesh does not have is refused), so
  each collective call is first attempted; only a refusal naming the fabric sends it to
  :func:`check_by_signature`: the wheel's signature binding (``introspect.check``) and the
  output spec checked by arithmetic (an all_gather multiplies ``dim`` by the mesh's size along
  ``cluster_axis``, an all_reduce keeps the shape; dtype and layout of the input). Those calls
  are counted apart (``Validation.by_signature``), never as accepted. ``mesh_partition`` is
  device-local and is validated for real.
* **Worker grid.** The mock N300/T3K chips have two harvested Tensix rows, and ttnn's program
  validation refuses any core on row 7 ("the compute worker grid on this device is 8x7") under
  every dispatch configuration, while ``compute_with_storage_grid_size()`` says 8x8 with the
  default (ethernet) dispatch. With dispatch on a worker row (``DispatchCoreConfig(WORKER,
  ROW)``) the device itself reports 8x7 and ops pick their cores inside it; :func:`open_mesh`
  opens multi-chip Wormhole meshes that way and :func:`worker_grid` passes the device's answer
  to the lowering as its ``grid``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from . import feed, layout
from .calls import Attr, Call, New, W, resolve
from .device import Executor, allocate
from .introspect import check_call

BUILD_MARKERS = ("build failed", "trisc", "brisc", "ncrisc", "erisc", "sfpi", "riscv", "jit build",
                 "Failed to generate binaries", "compile")


@dataclass
class Validation:
    """What ttnn made of a forward's calls: ``accepted`` (its host checks passed: the call got as
    far as kernel compilation), ``refused`` (a check failed: the first message per function) and
    ``by_signature`` (collectives whose checks need a fabric: bound to the wheel's signature and
    their output spec checked by arithmetic, :func:`check_by_signature`); every call is counted in
    one of ``accepted``, ``refusals`` (calls per refused function) and ``by_signature``."""

    calls: int = 0
    accepted: Counter = field(default_factory=Counter)  # fn -> calls that reached kernel build (or ran)
    refused: dict = field(default_factory=dict)  # fn -> first TT_FATAL (op, message)
    by_signature: Counter = field(default_factory=Counter)  # fn -> collectives only a fabric could check
    refusals: Counter = field(default_factory=Counter)  # fn -> calls refused

    @property
    def ok(self) -> bool:
        """Nothing refused (collectives checked by signature count as not refused)."""
        return not self.refused

    @property
    def all_by_ttnn(self) -> bool:
        """Nothing refused and nothing left to the signature check: every call validated by ttnn."""
        return self.ok and not self.by_signature


def _is_build_failure(msg: str) -> bool:
    low = msg.lower()
    return any(m.lower() in low for m in BUILD_MARKERS)


FABRIC_MARKERS = ("fabric context", "fabric config")
COLLECTIVES = ("all_gather", "all_reduce")


def _needs_fabric(fn: str, msg: str) -> bool:
    low = msg.lower()
    return fn in COLLECTIVES and any(m in low for m in FABRIC_MARKERS)


def open_mesh(ttnn, mesh):
    """Open preset ``mesh`` as a mock mesh device. Multi-chip Wormhole meshes dispatch from a
    worker row, the only configuration in which the device's reported grid is the grid its
    program validation accepts (module docstring)."""
    kw = {}
    if mesh.chip.arch.startswith("wormhole") and mesh.num_devices > 1:
        kw["dispatch_core_config"] = ttnn.DispatchCoreConfig(ttnn.DispatchCoreType.WORKER, ttnn.DispatchCoreAxis.ROW)
    return ttnn.open_mesh_device(ttnn.MeshShape(*mesh.shape), **kw)


def worker_grid(device) -> tuple[int, int]:
    """The compute grid ``device`` reports (x, y): what the lowering configures ops for."""
    g = device.compute_with_storage_grid_size()
    return int(g.x), int(g.y)


def check_by_signature(ttnn, ex: Executor, c: Call, layer) -> list[str]:
    """Problems with collective ``c`` that ttnn's host checks would have seen had the fabric been
    up: the call's binding to the wheel's signature, then the lowering's per-device output shape
    against the arithmetic of the collective on the input ttnn holds (empty: none)."""
    problems = check_call(ttnn, c)
    if problems:
        return problems
    kw = dict(c.kwargs)
    src = resolve(ttnn, c.args[0], ex.env, layer)
    shape = list(src.shape)
    axis = kw.get("cluster_axis")
    mesh_shape = list(ex.device.shape)
    if axis is None or not 0 <= axis < len(mesh_shape):
        return [f"ttnn.{c.fn}: cluster_axis {axis!r} is not an axis of the {mesh_shape} mesh"]
    if c.fn == "all_gather":
        dim = c.args[1]
        if not -len(shape) <= dim < len(shape):
            return [f"ttnn.all_gather: dim {dim} is not a dim of the input's shape {shape}"]
        shape[dim] *= mesh_shape[axis]
    if c.shape is not None and list(c.shape) != shape:
        return [f"ttnn.{c.fn}: the lowering expects output shape {list(c.shape)}, but {c.fn} over cluster_axis "
                f"{axis} (size {mesh_shape[axis]}) of an input of shape {list(src.shape)} gives {shape}"]
    return []


def _stand_in(ttnn, ex: Executor, c: Call, layer):
    """A tensor of the spec ``c``'s output would have: its first tensor input's dtype and
    layout, unless the call says otherwise."""
    dtype, mem, lay = "bf16", ttnn.DRAM_MEMORY_CONFIG, "TILE"
    names = {ttnn.bfloat16: "bf16", ttnn.float32: "f32", ttnn.uint32: "uint32", ttnn.int32: "int32",
             ttnn.bfloat8_b: "bfp8", ttnn.bfloat4_b: "bfp4", ttnn.uint16: "uint32"}
    first = next((a for a in c.args if not isinstance(a, (Attr, New, int, float, list, tuple, type(None)))), None)
    if first is not None and c.fn not in ("embedding",):
        src = resolve(ttnn, first, ex.env, layer)
        dtype = names.get(src.dtype, "bf16")
        lay = "ROW_MAJOR" if src.layout == ttnn.ROW_MAJOR_LAYOUT else "TILE"
        if dtype in ("bfp8", "bfp4"):
            dtype = "bf16"  # ops compute in bf16 unless asked
    kw = dict(c.kwargs)
    if c.fn == "typecast":
        d = c.args[1]
        dtype = {"bfloat16": "bf16", "bfloat8_b": "bfp8", "float32": "f32", "uint32": "uint32",
                 "int32": "int32"}.get(d.path, "bf16") if isinstance(d, Attr) else "bf16"
    if kw.get("dtype") is not None and isinstance(kw["dtype"], Attr):
        dtype = {"bfloat16": "bf16", "float32": "f32"}.get(kw["dtype"].path, "bf16")
    if c.fn == "to_memory_config":
        mem = resolve(ttnn, c.args[1], ex.env, layer)
    if c.fn in COLLECTIVES and kw.get("memory_config") is not None:  # where the call writes its output
        mem = resolve(ttnn, kw["memory_config"], ex.env, layer)
    if c.fn in ("argmax", "sampling"):
        dtype = "uint32"
    if c.fn == "sampling":  # ttnn.sampling writes uint32 ROW_MAJOR ids (its documented output)
        lay = "ROW_MAJOR"
    if c.fn == "to_layout":
        lay = "ROW_MAJOR" if "ROW_MAJOR" in c.args[1].path else "TILE"
    if c.fn in ("embedding", "linear", "matmul", "transpose", "concat", "rms_norm") or c.op == "setup" and c.fn == "add":
        lay = "TILE" if c.fn != "add" else lay
    if c.op == feed.OP and c.fn == "concat":  # the token feed's: ids, as its (uint32 ROW_MAJOR) inputs are
        dtype, lay = "uint32", "ROW_MAJOR"
    shape = c.shape or (1, 1, 32, 32)
    return ttnn.allocate_tensor_on_device(ttnn.Shape(list(shape)), layout.ttnn_dtype(ttnn, dtype),
                                          layout.ttnn_layout(ttnn, lay), ex.device, mem)


def validate(ttnn, device, program, fw) -> Validation:
    """Every call (and setup call) of forward ``fw``, lowered from ``program`` (a
    ``program.Program``: its KV cache record), through ttnn's validation on ``device``; weights
    are allocated as the forward holds them (``Forward.weights``)."""
    ex = Executor(ttnn, device)
    made = {c.out for _, c in fw.setup}
    for lyr, c in list(fw.calls()) + list(fw.setup):
        for v in c.values():
            if isinstance(v, W) and v.key(lyr) not in made and v.key(lyr) not in ex.env["weights"]:
                shape, dtype, lay = fw.weights[v.name]
                ex.env["weights"][v.key(lyr)] = allocate(ttnn, device, shape, dtype, lay)
    used = {lyr for lyr, _ in fw.calls() if lyr is not None}
    kv = program.kv_cache
    for e in kv["entries"]:  # the KV cache of the layers this forward runs
        for lyr in sorted(used):
            ex.env["kv"].setdefault(lyr, {})[e["name"]] = allocate(ttnn, device, e["device_shape"], kv["dtype"], "TILE")
    for cst in fw.consts:
        ex.env[cst.name] = allocate(ttnn, device, cst.shape, cst.dtype, cst.layout)
    for n, (shape, dtype, lay) in fw.inputs.items():
        ex.env[n] = allocate(ttnn, device, shape, dtype, lay)
    for n, (shape, dtype, lay) in fw.state.items():  # a runner's persistent tensors (the token feed's ids)
        ex.env[n] = allocate(ttnn, device, shape, dtype, lay)
    res = Validation()

    def attempt(c: Call, lyr):
        res.calls += 1
        try:
            out = ex.call(c, lyr)
            res.accepted[c.fn] += 1
            return out
        except Exception as e:  # noqa: BLE001 - sorted into accepted (build) or refused below
            msg = str(e)
            if _is_build_failure(msg):
                res.accepted[c.fn] += 1
            elif _needs_fabric(c.fn, msg):
                why = check_by_signature(ttnn, ex, c, lyr)
                if why:
                    res.refusals[c.fn] += 1
                    res.refused.setdefault(c.fn, (c.op, "; ".join(why)[:1500]))
                else:
                    res.by_signature[c.fn] += 1
            else:
                first = next((ln for ln in msg.splitlines() if "TT_FATAL" in ln or "info" in ln), msg[:300])
                res.refusals[c.fn] += 1
                res.refused.setdefault(c.fn, (c.op, " ".join(msg.splitlines()[:3])[:500] if "TT_" in msg else msg[:1500]))
            return None

    for lyr, c in fw.setup:
        out = attempt(c, lyr)
        ex.env["weights"][c.out] = out if out is not None else _stand_in(ttnn, ex, c, lyr)
        ex.env[c.out] = ex.env["weights"][c.out]
    for lyr, c in fw.calls():
        out = attempt(c, lyr)
        if isinstance(c.out, str):
            ex.env[c.out] = out if out is not None else _stand_in(ttnn, ex, c, lyr)
        elif isinstance(c.out, tuple):
            outs = out if out is not None else [_stand_in(ttnn, ex, c, lyr) for _ in c.out]
            if out is None and c.fn == "topk":  # values bf16, indices uint16
                outs[1] = ttnn.allocate_tensor_on_device(ttnn.Shape(list(c.shape)), ttnn.uint16, ttnn.TILE_LAYOUT,
                                                         device, ttnn.DRAM_MEMORY_CONFIG)
            for n, t in zip(c.out, outs):
                if n:
                    ex.env[n] = t
    return res


__all__ = ["Validation", "check_by_signature", "open_mesh", "validate", "worker_grid"]
