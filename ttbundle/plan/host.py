"""The emulated mesh of a plan on this host: what it holds besides the KV pool, counted from the
plan (:func:`host_facts`, recorded in a package's manifest as ``serving.host`` at build), and its
KV pool and expected peak (:func:`host_plan`, through ``kvpool.host_pool``, the one rule the
vLLM plugin also applies to a package's recorded facts).

The emulated mesh runs a package's programs in torch on the host, in float32 (``serve`` starts
vLLM with ``--dtype float32``), so on the host:

* **weights**: every distinct shard once (devices that hold the same shard share one copy, as
  ``layout.holders`` says), each element 4 bytes whatever the device's dtype; a speculative
  draft's weights and KV region twice their device bytes;
* **KV cache**: per layer and KV entry ``[devices, KV heads per device (padded), slots,
  head_dim]``, each element 4 bytes: the emulated cache holds bf16 or block-float *values* in
  float32 (``backends/emulated/state.kv_store``: attention reads them without a conversion per
  step, the speed-up of issue 25), and every device keeps its own heads, padded ones included;
* **activations**: every named activation of one layer on every device in float32 (the plan's
  per-chip activations, twice the bytes), one layer's K and V context of every sequence at full
  length (attention gathers it per step) and :data:`SCRATCH_BYTES` of scores and temporaries;
* **runtime**: ``kvpool.RUNTIME_BYTES``; what the host has and the share ``auto`` takes:
  ``kvpool``."""

from __future__ import annotations

import math

from ..kvpool import HostFacts, HostPlan, host_pool
from ..tiles import ELEM_BYTES
from .. import layout

#: attention scores (the emulated attention computes them 128 MiB at a time) and temporaries
SCRATCH_BYTES = 256 << 20
#: bytes of an element of the emulated mesh's compute dtype (float32)
HOST_ELEM_BYTES = ELEM_BYTES["f32"]


def host_weights(bundle, plan) -> int:
    """The weights the emulated mesh holds: each distinct shard once, float32."""
    decls = {t.name: t for t in bundle.family.tensors(bundle.arch)}
    mesh, policy = plan.mesh, bundle.spec.sharding
    total = 0
    for t in plan.tensors:
        d = decls.get(t.name)
        if d is None:
            distinct = 1
        else:
            units = layout.tensor_units(d.dims, plan.specs[t.name], mesh, policy)
            distinct = len(set(layout.holders(units, mesh.num_devices)))
        total += math.prod(t.device_shape) * t.count * distinct * HOST_ELEM_BYTES
    return total


def host_kv_per_block(plan) -> int:
    """KV bytes of one block on the emulated mesh: every device's heads (padded ones included),
    every layer, K and V (each KV entry), float32."""
    D = plan.mesh.num_devices
    return sum(D * e["device_shape"][1] * plan.kv["block_size"] * e["device_shape"][3] * e["layers"]
               for e in plan.kv["entries"]) * HOST_ELEM_BYTES


def host_activations(bundle, plan) -> int:
    """The emulated forward's largest transient: one layer's activations on every device (float32),
    one layer's K and V context of every sequence at full length, :data:`SCRATCH_BYTES`."""
    rt = bundle.spec.runtime
    layers = max(sum(e["layers"] for e in plan.kv["entries"]) // max(len(plan.kv["entries"]), 1), 1)
    per_token_layer = host_kv_per_block(plan) // plan.kv["block_size"] // layers
    context = per_token_layer * rt.max_num_seqs * rt.max_model_len
    acts = plan.mesh.num_devices * plan.memory.activations * (HOST_ELEM_BYTES // 2)
    return acts + context + SCRATCH_BYTES


def host_facts(bundle, plan) -> HostFacts:
    """What ``kvpool.host_pool`` needs of ``plan`` (``make_plan(bundle, mesh)``; a package's:
    the plan it was built with), per engine: the build records it (``HostFacts.record``, manifest
    ``serving.host``), ``package.speccheck`` checks a package's record against it."""
    rt = bundle.spec.runtime
    pool = rt.max_tokens_all_users if isinstance(rt.max_tokens_all_users, int) else None
    return HostFacts(getattr(bundle.spec, "task", "generate"), rt.max_num_seqs, rt.kv_block_size,
                     rt.max_model_len, pool, host_weights(bundle, plan) + 2 * plan.memory.draft,
                     host_activations(bundle, plan), host_kv_per_block(plan), plan.kv["num_blocks"])


def host_plan(bundle, plan, available: int | None = None, lanes: int = 1, engines: int = 1,
              override_blocks: int | None = None) -> HostPlan:
    """The emulated mesh of ``plan`` (``make_plan(bundle, mesh)``) on this host: its KV pool and
    its expected peak (``kvpool.host_pool`` of :func:`host_facts`; the arguments are its)."""
    return host_pool(host_facts(bundle, plan), available, lanes, engines, override_blocks)
