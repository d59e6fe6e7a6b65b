"""The ttnn backend: a package's programs on a real Tenstorrent mesh (docs/hardware.md).

Host side (runs anywhere; what can be checked without a device):

* :mod:`.layout` — how a planned tensor is held by ttnn (shape, dtype, layout per kind);
* :mod:`.alloc` — the DRAM buffers a plan says each chip holds, allocated on a (mock) mesh;
* :mod:`.cache` — per-device ``.tensorbin`` weight caches written from a package's shards;
* :mod:`.mappers` — PartitionSpecs as ttnn mesh mappers, where ttnn's mappers can express them;
* :mod:`.calls` — a lowered op as data: ttnn function names and arguments;
* :mod:`.lowering` / :mod:`.configs` — every program op kind -> ttnn calls with program configs (the op
  lowerings in :mod:`.text_ops`, :mod:`.moe_ops`, :mod:`.vision` (one module per encoder), :mod:`.mesh_ops` on :mod:`.emitter`;
  a forward's inputs in :mod:`.inputs`);
* :mod:`.handover` — programs handed to a ttnn process (kernel-cache fill, mockcheck) as a package lays them out;
* :mod:`.introspect` — those calls checked against the installed wheel's signatures;
* :mod:`.mockcheck` — those calls through ttnn's own op validation on a mock chip or mesh (collectives that need a fabric: by signature and output spec);
* :mod:`.recording` — a recording stand-in for the ttnn module (program cache, trace API).

Device side: :mod:`.device` (executor, KV cache, constants, ``generate``), :mod:`.model` (``open_model``) and
:mod:`.trace` (warm-up, capture, replay, in that order). Not yet run on hardware.

Nothing here imports ttnn at module import; functions that need it take the module as an
argument (so tests can pass the recording double) or import it lazily.
"""
