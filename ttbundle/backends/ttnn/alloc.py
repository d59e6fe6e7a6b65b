"""A plan's DRAM, allocated for real: the buffers ``ttbundle plan`` says each chip holds, on a
ttnn mesh (a mock one in CI, where the allocator is ttnn's own).

:func:`plan_buffers` lists them (pure data): every weight shard (``count`` copies, one per
layer), the KV cache per layer and entry, and the activation buffers the plan budgets; the trace
region is not a buffer: ttnn carves it out of every DRAM bank when the mesh opens
(``open_mesh_device(trace_region_size=...)``). :func:`allocate` allocates them one by one as
interleaved DRAM tensors (``ttnn.allocate_tensor_on_device``) and reports where it ran out.

The planner and the allocator must agree: allocation succeeds exactly when ``plan.fits``
(tests/tt/test_allocator_ttnn.py, near the boundary on N150, N300, T3K, P150).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from .layout import BufferSpec, tensor_buffer, ttnn_dtype, ttnn_layout


def plan_buffers(plan) -> list[BufferSpec]:
    """Every DRAM buffer ``plan`` charges to one chip (the trace region aside)."""
    out = [tensor_buffer(t) for t in plan.tensors]
    kv = plan.kv
    for e in kv["entries"]:
        out.append(BufferSpec(f"kv:{e['name']}", tuple(e["device_shape"]), kv["dtype"], "TILE",
                              e["layers"], "kv_cache"))
    for name, shape in activation_buffers(plan):
        out.append(BufferSpec(f"act:{name}", tuple(shape), "bf16", "TILE", 1, "activation"))
    return out


def activation_buffers(plan) -> list[tuple[str, list[int]]]:
    """The activation tensors the plan budgets (``Plan.activation_buffers``)."""
    bufs = getattr(plan, "activation_buffers", None)
    if bufs is not None:
        return [(n, list(s)) for n, s in bufs]
    # a plan without the breakdown: its figure as one bf16 buffer of whole tiles
    tiles = -(-plan.memory.activations // 2048)
    return [("activations", [32, 32 * tiles])] if tiles else []


def trace_region_size(plan) -> int:
    """The ``trace_region_size`` to open the mesh with (bytes requested per chip)."""
    return getattr(plan, "trace_region_size", plan.memory.trace_region)


@dataclass
class Allocation:
    ok: bool
    buffers: int = 0  # buffers allocated
    failed: str | None = None  # "name (copy i of n)" that did not fit
    error: str | None = None  # ttnn's message, first line
    allocated_per_bank: int = 0
    bank_bytes: int = 0
    banks: int = 0
    held: list = field(default_factory=list, repr=False)  # the tensors (freed by release())

    def release(self, ttnn) -> None:
        for t in self.held:
            ttnn.deallocate(t)
        self.held.clear()


def dram_view(ttnn, device) -> tuple[int, int, int]:
    """(banks, bytes per bank, allocated bytes per bank) of the device's DRAM."""
    mv = ttnn.get_memory_view(device, ttnn.BufferType.DRAM)
    return mv.num_banks, mv.total_bytes_per_bank, mv.total_bytes_allocated_per_bank


def allocate(ttnn, device, buffers: list[BufferSpec], keep: bool = False) -> Allocation:
    """Allocate ``buffers`` on ``device`` (every chip of a mesh) as interleaved DRAM tensors, in
    order, stopping at the first out-of-memory error. Frees them unless ``keep``."""
    res = Allocation(ok=True)
    mem = ttnn.DRAM_MEMORY_CONFIG
    try:
        for b in buffers:
            dt, lay = ttnn_dtype(ttnn, b.dtype), ttnn_layout(ttnn, b.layout)
            shape = ttnn.Shape(list(b.shape))
            for i in range(b.count):
                try:
                    res.held.append(ttnn.allocate_tensor_on_device(shape, dt, lay, device, mem))
                except RuntimeError as e:
                    msg = str(e)
                    if "Out of Memory" not in msg:
                        raise
                    res.ok = False
                    res.failed = f"{b.name} (copy {i + 1} of {b.count})"
                    res.error = next((ln.strip() for ln in msg.splitlines() if "Out of Memory" in ln), msg)
                    return res
                res.buffers += 1
    finally:
        res.banks, res.bank_bytes, res.allocated_per_bank = dram_view(ttnn, device)
        if not keep:
            res.release(ttnn)
    return res


def check_plan(ttnn, plan, buffers: list[BufferSpec] | None = None) -> Allocation:
    """Open ``plan.mesh`` (the mock cluster ttnn was started with) with the plan's trace region,
    allocate everything the plan charges to a chip, close the mesh."""
    shape = ttnn.MeshShape(*plan.mesh.shape)
    device = ttnn.open_mesh_device(shape, trace_region_size=trace_region_size(plan))
    try:
        return allocate(ttnn, device, plan_buffers(plan) if buffers is None else buffers)
    finally:
        ttnn.close_mesh_device(device)


# ---- a process per mock cluster: python -m ttbundle.backends.ttnn.alloc CASES.json -------------
def case(name: str, plan) -> dict:
    """A plan as JSON for :func:`main`: the mesh shape, trace region and buffers."""
    return {"name": name, "mesh_shape": list(plan.mesh.shape), "trace_region_size": trace_region_size(plan),
            "buffers": [[b.name, list(b.shape), b.dtype, b.layout, b.count] for b in plan_buffers(plan)]}


def main(argv: list[str] | None = None) -> int:
    """Run each case of a JSON list on the mock cluster ttnn was started with (one mesh open per
    case); print one ``RESULT {json}`` line per case."""
    import ttnn

    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        cases = json.load(f)
    for c in cases:
        bufs = [BufferSpec(n, tuple(s), dt, lay, cnt) for n, s, dt, lay, cnt in c["buffers"]]
        device = ttnn.open_mesh_device(ttnn.MeshShape(*c["mesh_shape"]), trace_region_size=c["trace_region_size"])
        try:
            r = allocate(ttnn, device, bufs)
        finally:
            ttnn.close_mesh_device(device)
        out = {"name": c["name"], "ok": r.ok, "buffers": r.buffers, "failed": r.failed, "error": r.error,
               "allocated_per_bank": r.allocated_per_bank, "bank_bytes": r.bank_bytes, "banks": r.banks}
        print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
