"""Warm-up, trace capture and replay of every bucket, in that order.

ttnn compiles an op's kernels the first time it runs with a given shape and configuration;
compiling while a trace is being captured corrupts the trace (the plugin's warm-up exists for
that reason, shared/notes/tt-plugin-contract.md). So :class:`TraceRunner` goes through fixed
stages and refuses anything out of order:

1. ``prepare``: everything persistent is allocated first — every bucket's input tensors (written
   before each run, never reallocated, so a trace keeps reading them), and the setup views of the
   weights. Nothing persistent is allocated after the first capture: a buffer placed where a
   captured trace's intermediates lived would be overwritten by every replay.
2. ``warmup``: every bucket runs once eagerly on dummy inputs (position 0, an all-zero page
   table): each op of each bucket compiles here.
3. ``capture``: each traced bucket runs once between ``begin_trace_capture`` and
   ``end_trace_capture``; its outputs stay bound to the trace.
4. ``run``: write the request's inputs into the bucket's tensors, then ``execute_trace`` (or run
   eagerly for an untraced bucket, warmed in step 2).

Every ttnn call goes through the :class:`~.device.Executor`'s ttnn module, so the recording
double in tests/test_ttnn_backend.py checks the order on this exact code.
"""

from __future__ import annotations

import numpy as np

from .calls import Forward
from .device import Executor, allocate, keep_names, liveness
from .layout import ttnn_dtype, ttnn_layout

STAGES = ("new", "prepared", "warm", "captured")


class OrderError(RuntimeError):
    """A stage run out of order (capture before every bucket is warm, run before capture...)."""


def _dummy(name: str, shape, dtype: str):
    """Warm-up inputs: position 0, an all-zero page table, greedy sampling (k = 1, p = 1, t = 1)."""
    fill = 1 if name in ("top_k", "top_p", "temperature") else 0
    return np.full(shape, fill, dtype={"uint32": np.uint32, "int32": np.int32, "bf16": np.float32,
                                       "f32": np.float32}[dtype])


def allocate_state(ttnn, device, forwards) -> dict:
    """The runner's persistent state tensors (``Forward.state``), one per name for every forward
    that declares it, zero-filled on ``device``; a name declared with two specs is refused."""
    specs: dict = {}
    for fw in forwards:
        for name, spec in fw.state.items():
            if specs.setdefault(name, spec) != spec:
                raise ValueError(f"state tensor {name!r} declared as {specs[name]} and as {spec}")
    return {name: ttnn.full(list(shape), 0, dtype=ttnn_dtype(ttnn, dtype), layout=ttnn_layout(ttnn, layout),
                            device=device, memory_config=ttnn.DRAM_MEMORY_CONFIG)
            for name, (shape, dtype, layout) in specs.items()}


class TraceRunner:
    """The forwards of one model on one mesh, keyed by ``(phase, bucket)``."""

    def __init__(self, executor: Executor, forwards: dict[tuple, Forward], traced: set[tuple]):
        self.ex, self.forwards, self.traced = executor, forwards, set(traced)
        unknown = self.traced - set(forwards)
        if unknown:
            raise ValueError(f"traced buckets without a forward: {sorted(unknown)}")
        self.stage = "new"
        self.inputs: dict[tuple, dict] = {}
        self.state: dict = {}  # Forward.state: persistent tensors every forward of this runner shares
        # decode rows -> the device-sampled decode output that last wrote its feed ids (.feed)
        self.feed_owner: dict = {}
        self.warm: set[tuple] = set()
        self.traces: dict[tuple, tuple] = {}  # key -> (trace id, outputs)
        self._drops = {k: liveness(list(fw.calls()), keep_names(fw)) for k, fw in forwards.items()}
        self._write_specs: dict[tuple, list] = {}  # key -> [(input, ttnn dtype, ttnn layout)]
        self._written: dict[tuple, dict] = {}  # key -> input -> the host array last copied in

    @property
    def ttnn(self):
        return self.ex.ttnn

    def _need(self, stage: str, what: str) -> None:
        if STAGES.index(self.stage) < STAGES.index(stage):
            raise OrderError(f"{what} needs stage {stage!r}; the runner is at {self.stage!r}")

    # -- 1. persistent buffers -------------------------------------------------------------------
    def prepare(self) -> None:
        if self.stage != "new":
            raise OrderError(f"prepare() at stage {self.stage!r}")
        dev = self.ex.device
        for key, fw in self.forwards.items():
            self.inputs[key] = {n: allocate(self.ttnn, dev, shape, dtype, layout)
                                for n, (shape, dtype, layout) in fw.inputs.items()}
        self.state = allocate_state(self.ttnn, dev, self.forwards.values())
        self.ex.env.update(self.state)
        seen = set()
        for fw in self.forwards.values():
            todo = [(layer, c) for layer, c in fw.setup if c.out not in seen]
            seen |= {c.out for _, c in todo}
            self.ex.run_setup(todo)
        self.stage = "prepared"

    def write_inputs(self, key: tuple, host: dict) -> None:
        """Copy host arrays into ``key``'s device input tensors (all inputs must be given). An
        input whose host array is the very object last written to it is not copied again (the
        device tensor holds it: each forward's inputs are its own); a caller passes a new array
        whenever the values change and never changes a written array in place."""
        fw = self.forwards[key]
        if len(host) < len(fw.inputs) or not all(n in host for n in fw.inputs):
            raise ValueError(f"{key}: inputs {sorted(set(fw.inputs) - set(host))} not given")
        ttnn, dev = self.ttnn, self.ex.device
        specs = self._write_specs.get(key)
        if specs is None:
            specs = self._write_specs[key] = [(n, ttnn_dtype(ttnn, d), ttnn_layout(ttnn, lay))
                                              for n, (_, d, lay) in fw.inputs.items()]
        last = self._written.setdefault(key, {})
        dst = self.inputs[key]
        mapper, mapped = None, False
        for name, dtype, layout in specs:
            a = host[name]
            if last.get(name) is a:
                continue
            if not mapped:
                mapper, mapped = ttnn.replicate_tensor_to_mesh_mapper(dev), True
            t = ttnn.distribute_tensor(ttnn.Tensor(a, dtype, None, layout), mapper, None)
            ttnn.copy_host_to_device_tensor(t, dst[name])
            last[name] = a

    def _bind(self, key: tuple) -> None:
        self.ex.env.update(self.inputs[key])

    # -- 2. compile ------------------------------------------------------------------------------
    def warmup(self, keys=None) -> None:
        """Run every bucket (or those of ``keys``) once eagerly: every kernel compiles here, never
        during a capture. The runner is warm when every bucket is."""
        if self.stage == "new":
            self.prepare()
        self._need("prepared", "warmup()")
        if self.stage == "captured":
            raise OrderError("warmup() after capture(): a compile now could land in a later capture")
        for key in (list(self.forwards) if keys is None else list(keys)):
            if key in self.warm:
                continue
            fw = self.forwards[key]
            self.write_inputs(key, {n: _dummy(n, s, d) for n, (s, d, _) in fw.inputs.items()})
            self._bind(key)
            self.ex.run(fw, self._drops[key])
            self.ttnn.synchronize_device(self.ex.device)
            self.warm.add(key)
        if self.warm >= set(self.forwards):
            self.stage = "warm"

    # -- 3. capture ------------------------------------------------------------------------------
    def capture(self) -> None:
        self._need("warm", "capture()")
        cold = set(self.forwards) - self.warm
        if cold:
            raise OrderError(f"capture() with buckets never warmed: {sorted(cold)}")
        ttnn, dev = self.ttnn, self.ex.device
        for key in [k for k in self.forwards if k in self.traced]:
            fw = self.forwards[key]
            self._bind(key)
            tid = ttnn.begin_trace_capture(dev)
            outs = self.ex.run(fw, self._drops[key])
            ttnn.end_trace_capture(dev, tid)
            self.traces[key] = (tid, outs)
        self.stage = "captured"

    # -- 4. replay -------------------------------------------------------------------------------
    def run(self, key: tuple, host_inputs: dict) -> dict:
        """One forward of bucket ``key`` on the given inputs; its output tensors (on device)."""
        self._need("captured", "run()")
        self.write_inputs(key, host_inputs)
        if key in self.traces:
            tid, outs = self.traces[key]
            self.ttnn.execute_trace(self.ex.device, tid, blocking=False)
            return outs
        if key not in self.warm:  # pragma: no cover - capture() checked every key
            raise OrderError(f"{key} was never warmed")
        self._bind(key)
        return self.ex.run(self.forwards[key], self._drops[key])

    def run_eager(self, key: tuple, host_inputs: dict) -> dict:
        """Serving without warm-up (``enable_model_warmup=false``): run ``key`` eagerly, compiling
        on its first use, never traced. Refused once traces exist (use :meth:`run`)."""
        if self.stage == "new":
            self.prepare()
        if self.stage == "captured":
            raise OrderError("run_eager() after capture(): use run()")
        self.write_inputs(key, host_inputs)
        self._bind(key)
        return self.ex.run(self.forwards[key], self._drops[key])

    def read(self, t):
        """A (replicated) output tensor back on the host, as device 0 holds it."""
        ttnn = self.ttnn
        host = ttnn.from_device(t)
        return ttnn.get_device_tensors(host)[0].to_numpy()

    def release(self) -> None:
        for tid, _ in self.traces.values():
            self.ttnn.release_trace(self.ex.device, tid)
        self.traces.clear()
        self.stage = "warm" if self.stage == "captured" else self.stage
