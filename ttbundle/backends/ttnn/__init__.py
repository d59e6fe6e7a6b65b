"""The ttnn backend: a package's programs on a real Tenstorrent mesh.

Host side (runs anywhere; what this machine kind can check without a device):

* :mod:`.layout` — how a planned tensor is held by ttnn (shape, dtype, layout per kind);
* :mod:`.alloc` — the DRAM buffers a plan says each chip holds, allocated on a (mock) mesh;
* :mod:`.cache` — per-device ``.tensorbin`` weight caches written from a package's shards;
* :mod:`.mappers` — PartitionSpecs as ttnn mesh mappers, where ttnn's mappers can express them;
* :mod:`.calls` — a lowered op as data: ttnn function names and arguments, checked against the
  wheel by introspection and executed by :mod:`.device`;
* :mod:`.lowering` — every program op kind (``lower.lower``'s JSON) -> ttnn calls;
* :mod:`.trace` — warm-up (compile), trace capture and replay per bucket, in that order.

Device side (needs a device; marked ``tt_hardware`` in tests): :mod:`.device` runs the calls.

Nothing here imports ttnn at module import; functions that need it take the module as an argument
(so tests can pass a recording double) or import it lazily.
"""
