"""A timing model of a Tenstorrent device: ttnn's device side for benches and tests (not a device
to serve on).

On the emulated mesh the "device" computes on the host CPU, so host overhead between steps is
invisible. The timing device stands in for ttnn under the TT platform path instead
(``ttdevice.py``: trace capture and replay, device sampling, readback), over ttbundle's recording
double (``backends/ttnn/recording.py``, which records and checks every ttnn call), and gives each
replayed trace a modeled duration per (phase, bucket), spent off the CPU, with ttnn's semantics:

* ``execute_trace(..., blocking=False)`` returns at once; the device runs enqueued work in order
  (a step starts when the previous one is done); each mesh device (each submesh of
  ``MeshDevice.create_submeshes``: the lanes of a package split into replicas) has its own
  command queue and clock, so steps enqueued on different submeshes run at the same time;
* a readback (``from_device``, blocking) waits, sleeping, until the step that wrote the tensor is
  done; ``from_device(t, blocking=False)`` enqueues the copy behind the work already queued and
  returns the host tensor at once, ``record_event`` / ``event_synchronize`` wait for it
  (Tenstorrent's ``read_decode_output(async_read=True)``);
* device sampling returns deterministic token ids: a decode row's id is
  ``(31 * token + 7 * position + 1) % vocab`` of its input, a prefill's
  ``(31 * sum(tokens) + bucket) % vocab`` (its tokens padded to the bucket);
  ``feed_rows`` models the device-side feed of one decode's sampled ids into the next decode's
  token input (async decode).

Select it with ONE switch, ``TTBUNDLE_DEVICE_MODEL=timing:DECODE[/PREFILL]`` (milliseconds, ``ms``
optional): ``DECODE`` is a decode step of any bucket (a decode step is weight-bandwidth bound: the
batch barely changes it), ``PREFILL`` a 128-token prefill (longer prefill buckets scale with their
length). Without ``/PREFILL``: the published TTFT of the matching demo (38 ms: Llama-3.1-8B on N150,
TTFT 104 ms; 14 ms: Llama-3.3-70B on Galaxy, TTFT 53 ms), else ``DECODE`` x 3 (about those ratios).
It makes the TT platform active without a device (``activation.py``). Untraced (eager) programs
take no modeled time. Its weights are the double's: nothing numeric is computed while serving.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidInput

ENV = "TTBUNDLE_DEVICE_MODEL"
#: decode ms -> 128-token prefill ms (published TTFTs, shared/notes/tt-plugin-contract.md)
PUBLISHED_PREFILL_MS = {38.0: 104.0, 14.0: 53.0}


@dataclass(frozen=True)
class StepTimes:
    decode_ms: float
    prefill128_ms: float

    def seconds(self, phase: str, bucket: int) -> float:
        if phase == "decode":
            return self.decode_ms / 1000
        return self.prefill128_ms * max(1.0, bucket / 128) / 1000


def parse(spec: str) -> StepTimes:
    """``timing:14ms``, ``timing:14``, ``timing:5ms/20ms`` -> StepTimes; anything else: InvalidInput."""
    m = re.fullmatch(r"\s*timing:([0-9]*\.?[0-9]+)(?:ms)?(?:/([0-9]*\.?[0-9]+)(?:ms)?)?\s*", spec or "")
    if not m or float(m.group(1)) <= 0:
        raise InvalidInput(f"{ENV}={spec!r}: expected timing:DECODE_MS[/PREFILL128_MS], e.g. timing:14ms "
                           "(a bench/test device: a decode step of 14 ms)")
    d = float(m.group(1))
    p = float(m.group(2)) if m.group(2) else PUBLISHED_PREFILL_MS.get(d, 3 * d)
    return StepTimes(d, p)


@dataclass
class DeviceEvent:
    """One thing the device did, in the order the host asked for it (``TimingDevice.events``)."""

    kind: str  # "execute" (a trace enqueued) | "read" (a blocking readback / event wait returned)
    step: int  # the execute's number; a read: the step whose output it waited for
    key: tuple | None  # the trace's forward key (phase, bucket, sampling, start)
    at: float  # perf_counter when the host made the call
    done: float  # execute: when the modeled step ends; read: when the wait returned


class _Event:
    def __init__(self, at: float, step: int):
        self.at, self.step = at, step


@dataclass
class TimingDevice:
    times: StepTimes
    vocab: int = 0
    events: list = field(default_factory=list)
    busy: float = 0.0  # modeled seconds of device work (every submesh's, summed)
    free_at: float = 0.0  # when the last enqueued step ends (on any submesh)
    _free: dict = field(default_factory=dict)  # id(mesh device) -> when its last enqueued step ends
    _steps: int = 0
    _traces: dict = field(default_factory=dict)  # trace number -> (key, inputs, outputs)
    _feeds: dict = field(default_factory=dict)  # id(dst input) -> (src output, rows)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, ttnn):
        return TimingTTNN(ttnn, self)

    def attach(self, runner, vocab: int) -> None:
        """Learn the captured traces of a ``TraceRunner`` (their keys, input and output tensors)."""
        self.vocab = vocab
        for key, (tid, outs) in runner.traces.items():
            self._traces[tid.n] = (key, runner.inputs[key], outs)

    # -- the clock --------------------------------------------------------------------------------
    @staticmethod
    def _sleep_until(t: float) -> None:
        d = t - time.perf_counter()
        if d > 0:
            time.sleep(d)

    def execute(self, tid, blocking: bool, device=None) -> None:
        key, inputs, outs = self._traces.get(getattr(tid, "n", None), (None, {}, {}))
        now = time.perf_counter()
        with self._lock:
            self._steps += 1
            dur = self.times.seconds(key[0], key[1]) if key else 0.0
            start = max(now, self._free.get(id(device), 0.0))
            done = self._free[id(device)] = start + dur
            self.free_at = max(self.free_at, done)
            self.busy += dur
            step = self._steps
        self._sample(key, inputs, outs, step, done)
        self.events.append(DeviceEvent("execute", step, key, now, done))
        if blocking:
            self._sleep_until(done)

    def _sample(self, key, inputs: dict, outs: dict, step: int, done: float) -> None:
        """Device sampling: write the deterministic ids into the trace's ``next_tokens`` output."""
        t = outs.get("next_tokens")
        if t is None or key is None:
            for o in outs.values():
                o.ready_at, o.step = done, step
            return
        tok = inputs["tokens"]
        feed = self._feeds.pop(id(tok), None)
        x = np.asarray(tok.data[0] if tok.data is not None else np.zeros(t.shape or (1,)), dtype=np.int64).reshape(-1)
        if key[0] == "decode":
            if feed is not None:
                src, rows = feed
                fed = rows >= 0
                x = x.copy()
                x[fed] = np.asarray(src.data[0]).reshape(-1)[rows[fed]]
            pos = np.asarray(inputs["positions"].data[0], dtype=np.int64).reshape(-1)
            ids = (31 * x + 7 * pos + 1) % self.vocab
        else:
            ids = np.full(x.size, (31 * int(x.sum()) + x.size) % self.vocab)
        shape = t.shape or ids.shape
        n = len(t.data) if t.data is not None else 1
        head = 1
        for d in shape:
            head *= int(d)
        ids = (ids if ids.size == head else np.resize(ids, head)).reshape(shape).astype(np.uint32)
        t.data, t.ready_at, t.step = [ids] * n, done, step  # (read only: one array for every device)

    def feed_rows(self, dst, src, rows) -> None:
        """Before the next trace reading ``dst`` (a decode's token input) runs, its row ``i``
        takes ``src``'s row ``rows[i]`` (``rows[i] < 0``: keep the written token). On the device:
        a gather of the previous step's sampled ids; modeled as free."""
        self._feeds[id(dst)] = (src, np.asarray(rows, dtype=np.int64).reshape(-1))

    def read(self, t, blocking: bool):
        """The host's view of device tensor ``t``: blocking, after the step that wrote it."""
        ready = getattr(t, "ready_at", 0.0)
        if blocking:
            now = time.perf_counter()
            self._sleep_until(ready)
            if getattr(t, "step", None) is not None:
                self.events.append(DeviceEvent("read", t.step, None, now, time.perf_counter()))
        return ready

    def record_event(self, device=None) -> _Event:
        return _Event(self._free.get(id(device), 0.0), self._steps)

    def wait_event(self, ev: _Event) -> None:
        now = time.perf_counter()
        self._sleep_until(ev.at)
        self.events.append(DeviceEvent("read", ev.step, None, now, time.perf_counter()))

    def synchronize(self, device=None) -> None:
        self._sleep_until(self._free.get(id(device), 0.0))


class _HostRead:
    """A device tensor's known value read back while serving (``TimingTTNN.from_device``): what
    ``get_device_tensors(...)[i].to_numpy()`` needs, without the double's bookkeeping."""

    __slots__ = ("data", "ready_at", "step")

    def __init__(self, data, ready_at=0.0, step=None):
        self.data, self.ready_at, self.step = data, ready_at, step

    def to_numpy(self):
        return np.array(self.data[0])


class _HostArray:
    """A host tensor made while serving (see ``TimingTTNN.Tensor``)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


class TimingTTNN:
    """The ttnn module the TT platform path sees: every call goes to the recording double's
    module except the device-side ones the clock models."""

    def __init__(self, inner, device: TimingDevice):
        self._inner, self.timing = inner, device

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def execute_trace(self, mesh_device, tid, cq_id: int = 0, blocking: bool = True):
        self.timing.execute(tid, blocking, mesh_device)

    # host -> device copies while serving (after ``attach``): ttnn does them in C++ in microseconds;
    # the double's Python bookkeeping of each call would be most of the host time measured, so the
    # timing device copies the arrays itself (before ``attach``, at warm-up, the double records them)
    def Tensor(self, array, *a, **kw):  # noqa: N802 (ttnn's name)
        if not self.timing._traces:
            return self._inner.Tensor(array, *a, **kw)
        return _HostArray(array)

    def replicate_tensor_to_mesh_mapper(self, *a, **kw):
        if not self.timing._traces:
            return self._inner.replicate_tensor_to_mesh_mapper(*a, **kw)
        return None

    def distribute_tensor(self, t, *a, **kw):
        if isinstance(t, _HostArray):
            return t
        return self._inner.distribute_tensor(t, *a, **kw)

    def copy_host_to_device_tensor(self, src, dst, *a, **kw):
        if isinstance(src, _HostArray):
            n = len(dst.data) if dst.data is not None else 1
            dst.data = [src.array] * n
            return None
        return self._inner.copy_host_to_device_tensor(src, dst, *a, **kw)

    def from_device(self, t, blocking: bool = True, **kw):
        ready = self.timing.read(t, blocking)
        if self.timing._traces and getattr(t, "data", None) is not None:  # serving: a known value
            return _HostRead(t.data, ready, getattr(t, "step", None))
        host = self._inner.from_device(t)
        host.ready_at, host.step = ready, getattr(t, "step", None)
        return host

    def get_device_tensors(self, t):
        if isinstance(t, _HostRead):
            return [_HostRead([d]) for d in t.data]
        return self._inner.get_device_tensors(t)

    def record_event(self, mesh_device, cq_id: int = 0, *a, **kw):
        return self.timing.record_event(mesh_device)

    def event_synchronize(self, ev):
        self.timing.wait_event(ev)

    def synchronize_device(self, mesh_device, *a, **kw):
        self.timing.synchronize(mesh_device)
        return self._inner.synchronize_device(mesh_device)

    def feed_rows(self, dst, src, rows) -> None:
        self.timing.feed_rows(dst, src, rows)


def from_env():
    """The TimingDevice ``TTBUNDLE_DEVICE_MODEL`` selects, or None."""
    spec = os.environ.get(ENV)
    return TimingDevice(parse(spec)) if spec else None
