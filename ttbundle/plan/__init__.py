"""Partition specs -> per-device shapes, per-chip memory, collectives.

``make_plan(bundle, mesh)`` resolves the sharding plan (family default, then ``sharding.plan``,
then ``sharding.targets[<mesh>]``), checks every sharded dim divides its mesh axis, derives each
device's shard shape, accounts DRAM the way ttnn's allocator does (interleaved pages over the
DRAM banks, each bank's share rounded up to whole aligned pages), and propagates activation
shardings through the family's layer dataflow to find every collective and its traffic.
The returned :class:`Plan` is pure data; nothing here touches a weight.

Its modules, each imported by name (this ``__init__`` imports none of them), in the order they
build on each other:

- ``memory``: DRAM accounting (pages over banks, the trace region), ``Memory``, ``shortfall``;
- ``sharding``: the resolved PartitionSpecs, ``target_mesh``, each device's shards and the
  divisibility diagnostics;
- ``propagate``: activation sharding propagation (the collectives, the steps ``lower`` reads);
- ``make``: ``make_plan`` -> ``Plan``, ``kv_blocks``, ``check_mesh`` (the KV pool's rule,
  ``choose_pool``, is ``ttbundle.kvpool``'s, which the vLLM plugin reads too);
- ``host``: the emulated mesh of a plan on this host (``host_facts``, recorded in a package;
  ``host_plan``, through ``kvpool.host_pool``);
- ``advice``: what would make a plan that does not fit fit (``fixes``, ``pool_diagnostic``);
- ``validate``: ``ttbundle validate``'s checks: a spec planned on each target, every problem at
  once, and the wording of a target it does not fit (the CLI only prints them).
"""
