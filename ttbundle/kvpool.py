"""The KV pool, one owner for its arithmetic, below every stage that reads it (``plan``, the
vLLM plugin in ``runtime``, the launchers in ``serving``): its block count from a token count
(Tenstorrent's formula, :func:`pool_blocks`) and back (:func:`pool_tokens`), the pool a plan takes
(:func:`choose_pool`: the spec's ``max_tokens_all_users``, or ``auto``, the largest that fits),
and the pool the emulated mesh takes on this host (:func:`host_pool`) with this host's available
memory (:func:`available_memory`).

The emulated mesh runs a package's programs in torch on the host, in float32 (``serve`` starts
vLLM with ``--dtype float32``). What its processes hold besides the KV pool (weights,
activations, the KV bytes of a block) is ``plan.host``'s rule, counted from the plan at build and
recorded in the package (manifest ``serving.host``, :class:`HostFacts`): the plugin reads them
there and imports no ``plan``. Here, from those facts:

* **runtime**: :data:`RUNTIME_BYTES`, the processes before any weight or KV (``ttbundle serve``,
  vLLM's API server and its engine with torch and vLLM loaded);
* **what the host has** (:func:`available_memory`): the kernel's ``MemAvailable``, less where
  this process's memory cgroup allows less.

``auto`` takes :data:`HOST_KV_SHARE` of what is available after weights, activations and runtime,
at most the device's pool (the plan's, which the package's programs record), at least one
``max_model_len`` sequence. An explicit pool (``runtime.max_tokens_all_users``, or vLLM's
``--num-gpu-blocks-override``) is taken as given. Either fits when the whole expected peak is
within the available memory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .tiles import cdiv as _cdiv

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
MEMINFO = Path("/proc/meminfo")


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


# ---- the pool's blocks and tokens, and the pool a plan takes ----------------------------------

def pool_blocks(rt, tokens: int) -> int:
    """Blocks of a KV pool of ``tokens`` tokens (Tenstorrent's formula): ceil((tokens +
    kv_block_size x max_num_seqs) / kv_block_size), i.e. one spare block per sequence. ``rt``:
    anything with ``kv_block_size`` and ``max_num_seqs`` (the spec's runtime, a package's
    ``serving`` record, :class:`HostFacts`)."""
    return _cdiv(tokens + rt.kv_block_size * rt.max_num_seqs, rt.kv_block_size)


def pool_tokens(rt, blocks: int, max_num_seqs: int | None = None) -> int:
    """The pool (``max_tokens_all_users``) that :func:`pool_blocks` turns into ``blocks`` (at
    ``max_num_seqs`` sequences; default ``rt``'s)."""
    return blocks * rt.kv_block_size - rt.kv_block_size * (max_num_seqs or rt.max_num_seqs)


@dataclass
class _Pool:
    tokens: int  # max_tokens_all_users
    blocks: int
    chosen: str  # "spec" | "auto"
    why: str


def choose_pool(rt, kv_bytes, free: int, one_prefill: bool = False) -> _Pool:
    """The KV pool: the spec's ``max_tokens_all_users``, or (``auto`` / absent) the largest whole
    number of blocks whose KV bytes per chip (``kv_bytes(blocks)``, allocator-rounded, monotone)
    fit in ``free`` (DRAM left after weights, activations and trace region), between one
    ``max_model_len`` sequence and every sequence at full length. ``one_prefill`` (``task:
    embed``: nothing is decoded, a request leaves after its prefill): one ``max_model_len``
    sequence unless the spec says otherwise. ``rt``: the spec's runtime, or :class:`HostFacts`."""
    want = rt.max_tokens_all_users
    full = rt.max_num_seqs * rt.max_model_len
    if isinstance(want, int):
        return _Pool(want, pool_blocks(rt, want), "spec", "runtime.max_tokens_all_users")
    if one_prefill:
        return _Pool(rt.max_model_len, pool_blocks(rt, rt.max_model_len), "embed",
                     f"task: embed: prefill only, one max_model_len={rt.max_model_len} sequence")
    lo, hi = pool_blocks(rt, rt.max_model_len), pool_blocks(rt, full)
    if kv_bytes(hi) <= free:
        return _Pool(full, hi, "auto", f"auto: every sequence at full length fits (max_num_seqs="
                     f"{rt.max_num_seqs} x max_model_len={rt.max_model_len})")
    if kv_bytes(lo) > free:
        return _Pool(rt.max_model_len, lo, "auto", f"auto: not even one max_model_len="
                     f"{rt.max_model_len} sequence fits in the {gib(max(free, 0))} left")
    a, b = lo, hi - 1  # kv_bytes(lo) fits, kv_bytes(hi) does not
    while a < b:
        mid = (a + b + 1) // 2
        if kv_bytes(mid) <= free:
            a = mid
        else:
            b = mid - 1
    return _Pool(pool_tokens(rt, a), a, "auto", f"auto: the largest pool that fits the "
                 f"{gib(free)} left after weights, activations and trace region")


# ---- this host ---------------------------------------------------------------------------------

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
    this function (``monkeypatch.setattr(kvpool, "available_memory", ...)``)."""
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


# ---- the emulated mesh of a package on this host -----------------------------------------------

#: the facts a package records for its emulated mesh (manifest ``serving.host``,
#: ``manifest.HostRecord``), counted by ``plan.host.host_facts`` at build
HOST_RECORD = ("max_tokens_all_users", "weights", "activations", "kv_bytes_per_block")


@dataclass(frozen=True)
class HostFacts:
    """What :func:`host_pool` needs of a package (bytes per engine): its serving settings (as
    ``rt``: :func:`pool_blocks`, :func:`choose_pool` read them), what its emulated mesh holds
    besides the KV pool, the KV bytes of a block, and the device's pool (the plan's, the blocks
    its programs record). ``plan.host.host_facts`` gives them for a plan; :meth:`of_package` reads
    them back from a package (manifest ``serving``, its programs' dims and KV cache)."""

    task: str  # "generate" | "embed"
    max_num_seqs: int
    kv_block_size: int
    max_model_len: int
    max_tokens_all_users: int | None  # the spec's pool; None: auto
    weights: int  # every distinct shard once, float32, and the draft's (speculative decoding)
    activations: int  # one layer's on every device, float32, K and V context, scratch
    kv_bytes_per_block: int  # every device, every layer, float32
    device_blocks: int  # the device's pool: the plan's blocks, as the programs record them

    def record(self) -> dict:
        """The manifest's ``serving.host`` (:data:`HOST_RECORD`); the rest is recorded already
        (``serving``, the programs' dims and KV cache)."""
        return {k: getattr(self, k) for k in HOST_RECORD}

    @classmethod
    def of_package(cls, serving, max_model_len: int, device_blocks: int) -> "HostFacts":
        """From a package: its ``serving`` record (``manifest.ServingRecord``, with ``host``),
        ``max_model_len`` (its programs' dims) and ``device_blocks`` (its programs' KV pool)."""
        h = serving.host
        return cls(serving.task, serving.max_num_seqs, serving.kv_block_size, int(max_model_len),
                   h.max_tokens_all_users, h.weights, h.activations, h.kv_bytes_per_block, int(device_blocks))


@dataclass
class HostPlan:
    """The emulated mesh of one package (or plan) on this host (bytes)."""

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


def host_pool(f: HostFacts, available: int | None = None, lanes: int = 1, engines: int = 1,
              override_blocks: int | None = None) -> HostPlan:
    """The emulated mesh of a package (its :class:`HostFacts`) on this host: its KV pool and its
    expected peak. The pool: ``override_blocks`` (vLLM's ``--num-gpu-blocks-override``, per
    engine); else the spec's ``max_tokens_all_users``; else ``auto``: :data:`HOST_KV_SHARE` of
    what ``available`` (default :func:`available_memory`) leaves after weights, activations and
    runtime, at most the device's pool, at least one ``max_model_len`` sequence (with lanes,
    every sequence at full length: what lanes need, ``runtime.lanes.check_pool``). ``lanes``:
    replicas an engine serves, one pool each; ``engines``: vLLM engine processes (data parallel),
    each holding the weights."""
    avail = available_memory() if available is None else available
    lanes, engines = max(lanes, 1), max(engines, 1)
    w, a = engines * f.weights, engines * f.activations
    per_block = f.kv_bytes_per_block
    left = avail - w - a - RUNTIME_BYTES
    device_blocks = f.device_blocks

    def done(blocks, tokens, chosen, why):
        return HostPlan(avail, w, a, RUNTIME_BYTES, per_block, blocks, tokens, lanes, engines, chosen, why)

    if override_blocks is not None:
        return done(override_blocks, pool_tokens(f, override_blocks // lanes), "override",
                    "vLLM's --num-gpu-blocks-override")
    budget = int(HOST_KV_SHARE * left) // (lanes * engines)
    pool = choose_pool(f, lambda n: n * per_block, budget, one_prefill=f.task == "embed")
    blocks, tokens, why = pool.blocks, pool.tokens, pool.why
    share = f"{HOST_KV_SHARE:g} of the {gib(max(left, 0))} this host has available after weights, " \
            "activations and runtime"
    if pool.chosen == "auto":
        # the device's pool as ``auto`` chose it for the plan: the largest of at most
        # ``device_blocks`` blocks (its tokens: every sequence at full length, or the blocks')
        device = choose_pool(f, lambda n: n, device_blocks)
        full = pool_blocks(f, f.max_num_seqs * f.max_model_len)
        if lanes > 1 and blocks < min(full, device_blocks):
            blocks = min(full, device_blocks)
            tokens = pool_tokens(f, blocks)
            why = f"auto: every sequence at full length, what {lanes} lanes need ({share} is less)"
        elif blocks >= device_blocks:
            blocks, tokens = device_blocks, device.tokens
            why = f"auto: the device's pool, within {share}"
        elif blocks > pool_blocks(f, f.max_model_len):
            why = f"auto: {share} (the device's pool is {device.tokens:,} tokens)"
        else:
            why = f"auto: one max_model_len={f.max_model_len} sequence, the least a pool holds ({share} is less)"
    return done(blocks * lanes, tokens, pool.chosen, why)
