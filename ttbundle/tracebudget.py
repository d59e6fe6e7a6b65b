"""What a package's traces need of the trace region, under the ttnn it targets (0.81.1): the one
owner of the size a ttnn package opens its mesh with. ``build --backend ttnn`` plans with it
(``build.device_plan``: the need of the programs a first plan lowers, plus :data:`HEADROOM`, is
the region the final plan reserves and the manifest records, beside the need of the programs that
ship); ``serve --device tt`` reads the record and recomputes only for serving options that change
which forwards are traced.

**Semantics.** Since tt-metal PR #47122 ``trace_region_size`` is the *total* trace budget of a
chip, across its DRAM banks (before, it was reserved per bank while the capture check treated it
as a total). Each bank reserves ``ceil(size / banks)`` rounded up to the largest trace page,
8 KiB (PR #47766); ttnn 0.81.1's allocator does exactly that on a mock mesh
(``tests/tt/test_allocator_ttnn.py``, ``plan.memory.trace_region_dram``). At the end of each
capture tt-metal pads the trace to a whole number of pages on every bank (``MeshTrace::
populate_mesh_buffer``: ``round_up(size, page_size * banks)``, a page at most 8 KiB) and refuses
it once the traces' padded sizes add up to more than ``trace_region_size``.

**The need** of a package on a device is therefore the sum, over every forward the TT runtime
captures (``backends/ttnn/model.forward_keys``: each traced bucket in each sampling variant the runtime opens,
the host-sampled fallback included, one per MLA chunk start), of its captured calls (the ttnn
calls its lowering emits, what the recording double records inside that capture) times
:data:`~ttbundle.plan.memory.TRACE_BYTES_PER_OP`, each rounded up to ``8 KiB x banks``. The bytes
per captured op are the planner's estimate: a mock device compiles no kernel, so ttnn 0.81.1
cannot capture a trace without hardware, and the real size of a captured op's dispatch commands
is not measured here (docs/hardware.md). :data:`HEADROOM` is added on top for the size ttbundle
suggests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .backends.ttnn.lowering import lower_forward
from .backends.ttnn.model import forward_keys
from .package.facts import of_bundle
from .plan.memory import TRACE_BYTES_PER_OP
from .tiles import round_up

#: tt-metal's largest trace buffer page (``kMaxTraceBufPageSize``, PR #47766): the padding unit per bank
TRACE_PAGE_MAX = 8 * 1024
#: the margin ttbundle adds to the need when it suggests a size (the per-op bytes are an estimate)
HEADROOM = 0.25
SEMANTICS = ("total across the chip's DRAM banks (ttnn 0.81.1: tt-metal PR #47122, each trace padded to "
             "8 KiB pages on every bank, PR #47766)")


@dataclass
class TraceNeed:
    banks: int
    traces: list = field(default_factory=list)  # (forward key, captured calls, padded bytes)

    @property
    def need(self) -> int:
        return sum(t[2] for t in self.traces)

    @property
    def suggested(self) -> int:
        """The need plus :data:`HEADROOM`, rounded up to 1 MiB."""
        return round_up(int(self.need * (1 + HEADROOM)), 1 << 20)

    def arithmetic(self) -> str:
        calls = sum(t[1] for t in self.traces)
        return (f"{len(self.traces)} traces of {calls:,} captured calls x {TRACE_BYTES_PER_OP:,} B, each padded "
                f"to {TRACE_PAGE_MAX:,} B x {self.banks} banks = {self.need:,} B, {SEMANTICS}")


def padded(calls: int, banks: int) -> int:
    """One trace's bytes of the region: its calls' estimate padded as tt-metal pads it (at most)."""
    return round_up(calls * TRACE_BYTES_PER_OP, TRACE_PAGE_MAX * banks) if calls else 0


def trace_need(bundle, mesh, programs: dict, sample_on_device_mode: str | None = None,
               trace_mode: str | None = None, facts=None) -> TraceNeed:
    """What the traces of ``programs`` ((phase, bucket) -> typed program) need on each chip of
    ``mesh`` with the runtime's options (default: the package's serving facts, ``facts``: a
    ``LoadedPackage``, or at build :func:`package.facts.of_bundle` of ``bundle``): every traced
    forward the TT runtime opens (``backends.ttnn.model.forward_keys``, the host-sampled fallback
    included) lowered as the runtime lowers it, its captured calls counted."""
    facts = facts if facts is not None else of_bundle(bundle)
    rt = facts.serving
    keys, traced = forward_keys(facts, programs, sample_on_device_mode or rt.sample_on_device_mode,
                                host_fallback=True, trace_mode=trace_mode or rt.trace_mode)
    banks = mesh.chip.dram_banks
    out = TraceNeed(banks)
    for key in keys:
        if key not in traced:
            continue
        phase, b, sampling, start = key
        fw = lower_forward(bundle, mesh, programs[phase, b], sampling, chunk_start=start)
        n = sum(1 for _ in fw.calls())
        out.traces.append((key, n, padded(n, banks)))
    return out


def package_need(loaded, sample_on_device_mode: str | None = None, trace_mode: str | None = None) -> TraceNeed:
    """:func:`trace_need` of a built package (``package.load.LoadedPackage``): its own programs."""
    programs = {k: loaded.program_ir(*k) for k in loaded.programs}
    return trace_need(loaded.bundle, loaded.mesh, programs, sample_on_device_mode, trace_mode, facts=loaded)


def record(tn: TraceNeed, size: int, source: str, sample_on_device_mode: str, trace_mode: str) -> dict:
    """The manifest's ``trace_region`` record: the size the mesh is opened with, where it came
    from, the need of the shipped programs and the options it was counted for."""
    return {"size": size, "source": source, "need": tn.need, "headroom": HEADROOM, "traces": len(tn.traces),
            "captured_calls": sum(t[1] for t in tn.traces), "sample_on_device_mode": sample_on_device_mode,
            "trace_mode": trace_mode, "semantics": SEMANTICS}
