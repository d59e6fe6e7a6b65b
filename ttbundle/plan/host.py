"""The emulated mesh on this host: the KV pool ``auto`` gives it here (:func:`host_plan`, beside
:func:`pool.choose_pool`, the one rule for a device's DRAM), the process's expected peak, and
whether it fits the memory this host has available (:func:`available_memory`).

The emulated mesh runs a package's programs in torch on the host, in float32 (``serve`` starts
vLLM with ``--dtype float32``), so on the host:

* **weights**: every distinct shard once (devices that hold the same shard share one copy, as
  ``layout.holders`` says), each element 4 bytes whatever the device's dtype;
* **KV cache**: per layer and KV entry ``[devices, KV heads per device (padded), slots,
  head_dim]``, each element 4 bytes: the emulated cache holds bf16 or block-float *values* in
  float32 (``backends/emulated/state.kv_store``: attention reads them without a conversion per
  step, the speed-up of issue 25), and every device keeps its own heads, padded ones included;
* **activations**: every named activation of one layer on every device in float32 (the plan's
  per-chip activations, twice the bytes), one layer's K and V context of every sequence at full
  length (attention gathers it per step) and :data:`SCRATCH_BYTES` of scores and temporaries;
* **runtime**: :data:`RUNTIME_BYTES`, the processes before any weight or KV (``ttbundle serve``,
  vLLM's API server and its engine with torch and vLLM loaded).

``auto`` takes :data:`HOST_KV_SHARE` of what is available after weights, activations and runtime,
at most the device's pool (the plan's, which the package records), at least one
``max_model_len`` sequence. An explicit pool (``runtime.max_tokens_all_users``, or vLLM's
``--num-gpu-blocks-override``) is taken as given. Either fits when the whole expected peak is
within the available memory."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..tiles import ELEM_BYTES
from .pool import choose_pool, pool_blocks, pool_tokens
from .. import layout

#: the share of the available memory (after weights, activations and runtime) ``auto`` gives the
#: emulated KV pool: the emulated mesh decodes a few streams at a time (tens of tokens a second on
#: a small host), so a larger pool buys little, and the rest stays for the host's other work. At
#: 1/16 the issue's case (a 135M model on an emulated N300, 8192-token context, on a 24 GiB host
#: with ~21 GiB available) gets 17,920 tokens (1.08 GiB; 1/8 gave 37,056) and serve's processes
#: peaked at 3.73 GiB (4.72 GiB at 1/8) against an expected 4.58 GiB (docs/runtime.md)
HOST_KV_SHARE = 0.0625
#: ``ttbundle serve`` (~0.5 GB after a build), vLLM 0.33's API server (~0.6 GB) and its engine
#: process before weights and KV (~0.7 GB), measured serving the demo on this project's host
#: (docs/runtime.md, "The emulated mesh's memory")
RUNTIME_BYTES = 2 << 30
#: attention scores (the emulated attention computes them 128 MiB at a time) and temporaries
SCRATCH_BYTES = 256 << 20
#: bytes of an element of the emulated mesh's compute dtype (float32)
HOST_ELEM_BYTES = ELEM_BYTES["f32"]
MEMINFO = Path("/proc/meminfo")


def _cgroup_room() -> int | None:
    """Bytes this process's memory cgroup still allows (its limit less its usage; v2 or v1), or
    None where it sets no limit or none can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        if ctrl == "":  # cgroup v2
            files = ("memory.max", "memory.current")
            roots = [Path("/sys/fs/cgroup") / path.lstrip("/"), Path("/sys/fs/cgroup")]
        elif "memory" in ctrl.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            roots = [Path("/sys/fs/cgroup/memory") / path.lstrip("/"), Path("/sys/fs/cgroup/memory")]
        else:
            continue
        for root in roots:
            try:
                limit, used = ((root / f).read_text().strip() for f in files)
            except OSError:
                continue
            if limit == "max" or int(limit) >= 1 << 60:
                break
            return max(int(limit) - int(used), 0)
    return None


def available_memory() -> int:
    """Bytes of memory this host can give a new process now: the kernel's ``MemAvailable``
    (``/proc/meminfo``), less where this process's memory cgroup allows less. Tests replace
    this function (``monkeypatch.setattr(host, "available_memory", ...)``)."""
    avail = None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:  # not Linux: the physical memory
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            avail = 0
    room = _cgroup_room()
    return avail if room is None else min(avail, room)


def own_rss() -> int:
    """Bytes this process holds resident now (``/proc/self/statm``; 0 where unreadable)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@dataclass
class HostPlan:
    """The emulated mesh of one plan on this host (bytes)."""

    available: int  # the host's available memory (``available_memory``)
    weights: int  # all engines
    activations: int  # all engines
    runtime: int
    kv_bytes_per_block: int  # every device, every layer, float32
    blocks: int  # the pool each engine takes here (all its lanes): vLLM's block count
    tokens: int  # its max_tokens_all_users (per lane)
    lanes: int  # per engine
    engines: int  # vLLM engine processes (data parallel ranks)
    chosen: str  # "auto" | "spec" | "override" | "embed"
    why: str

    @property
    def kv(self) -> int:
        return self.engines * self.blocks * self.kv_bytes_per_block

    @property
    def fixed(self) -> int:
        """What the processes hold besides the KV pool."""
        return self.weights + self.activations + self.runtime

    @property
    def peak(self) -> int:
        """The expected peak of serve's processes, once traffic has written every KV page."""
        return self.fixed + self.kv

    @property
    def fits(self) -> bool:
        return self.peak <= self.available

    def largest_blocks(self) -> int:
        """The largest pool (blocks per engine) with which the expected peak fits what is available."""
        return max((self.available - self.fixed) // (self.engines * self.kv_bytes_per_block), 0)

    def arithmetic(self) -> str:
        """``weights W + KV pool K (B blocks x b) + activations A + runtime R = P``."""
        engines = f"{self.engines} engines x " if self.engines > 1 else ""
        return (f"weights {gib(self.weights)} + KV pool {gib(self.kv)} ({engines}{self.blocks:,} blocks x "
                f"{self.kv_bytes_per_block:,} B, float32 on every device) + activations "
                f"{gib(self.activations)} + runtime {gib(self.runtime)} = {gib(self.peak)}")

    def pool_line(self) -> str:
        """The pool and the expected peak against what is available (``serve`` prints it)."""
        lanes = f" per lane x {self.lanes} lanes" if self.lanes > 1 else ""
        return (f"KV pool {self.tokens:,} tokens{lanes} ({self.blocks:,} blocks, {gib(self.kv)} on the host; "
                f"{self.why}); expected peak {gib(self.peak)} of {gib(self.available)} available: "
                f"{self.arithmetic()}")

    def verdict(self) -> str:
        """One line for ``plan`` and ``validate``: whether the emulated mesh fits this host."""
        if self.fits:
            return (f"fits: KV pool {self.tokens:,} tokens ({self.chosen}), expected peak "
                    f"{gib(self.peak)} of {gib(self.available)} available")
        return (f"does not fit: expected peak {gib(self.peak)} ({self.arithmetic()}), "
                f"{gib(self.available)} available")

    def to_json(self) -> dict:
        return {"available": self.available, "weights": self.weights, "activations": self.activations,
                "runtime": self.runtime, "kv_bytes_per_block": self.kv_bytes_per_block,
                "num_blocks": self.blocks, "max_tokens_all_users": self.tokens, "lanes": self.lanes,
                "engines": self.engines, "kv_bytes": self.kv, "peak": self.peak, "fits": self.fits,
                "pool_chosen": self.chosen, "pool_why": self.why, "share": HOST_KV_SHARE}


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


def host_plan(bundle, plan, available: int | None = None, lanes: int = 1, engines: int = 1,
              override_blocks: int | None = None) -> HostPlan:
    """The emulated mesh of ``plan`` (``make_plan(bundle, mesh)``) on this host: its KV pool and
    its expected peak. The pool: ``override_blocks`` (vLLM's ``--num-gpu-blocks-override``, per
    engine); else the spec's ``max_tokens_all_users``; else ``auto``: :data:`HOST_KV_SHARE` of
    what ``available`` (default :func:`available_memory`) leaves after weights, activations and
    runtime, at most the device's pool, at least one ``max_model_len`` sequence (with lanes,
    every sequence at full length: what lanes need, ``runtime.lanes.check_pool``). ``lanes``:
    replicas an engine serves, one pool each; ``engines``: vLLM engine processes (data parallel),
    each holding the weights."""
    rt = bundle.spec.runtime
    avail = available_memory() if available is None else available
    lanes, engines = max(lanes, 1), max(engines, 1)
    w = engines * (host_weights(bundle, plan) + 2 * plan.memory.draft)
    a = engines * host_activations(bundle, plan)
    per_block = host_kv_per_block(plan)
    left = avail - w - a - RUNTIME_BYTES
    device_blocks = plan.kv["num_blocks"]

    def done(blocks, tokens, chosen, why):
        return HostPlan(avail, w, a, RUNTIME_BYTES, per_block, blocks, tokens, lanes, engines, chosen, why)

    if override_blocks is not None:
        return done(override_blocks, pool_tokens(rt, override_blocks // lanes), "override",
                    "vLLM's --num-gpu-blocks-override")
    budget = int(HOST_KV_SHARE * left) // (lanes * engines)
    pool = choose_pool(rt, lambda n: n * per_block, budget, one_prefill=bundle.spec.task == "embed")
    blocks, tokens, why = pool.blocks, pool.tokens, pool.why
    share = f"{HOST_KV_SHARE:g} of the {gib(max(left, 0))} this host has available after weights, " \
            "activations and runtime"
    if pool.chosen == "auto":
        full = pool_blocks(rt, rt.max_num_seqs * rt.max_model_len)
        if lanes > 1 and blocks < min(full, device_blocks):
            blocks = min(full, device_blocks)
            tokens = pool_tokens(rt, blocks)
            why = f"auto: every sequence at full length, what {lanes} lanes need ({share} is less)"
        elif blocks >= device_blocks:
            blocks, tokens = device_blocks, plan.kv["max_tokens_all_users"]
            why = f"auto: the device's pool, within {share}"
        elif blocks > pool_blocks(rt, rt.max_model_len):
            why = f"auto: {share} (the device's pool is {plan.kv['max_tokens_all_users']:,} tokens)"
        else:
            why = f"auto: one max_model_len={rt.max_model_len} sequence, the least a pool holds ({share} is less)"
    return done(blocks * lanes, tokens, pool.chosen, why)
