"""The package's model on a Tenstorrent mesh, behind the same model interface as the emulated
:class:`~.adapter.BundleModel` (``allocate_kv_cache``, ``prefill_forward``, ``decode_forward``,
``warmup_model_*``, ``seal``), so the model runner drives either one the same way.

It runs ``backends/ttnn/model.open_model``: the mesh opened for the package's mesh (or
``MESH_DEVICE``, which must name it) with the trace region and L1 / fabric / dispatch options of
``--additional-config '{"tt": {...}}'``, the ``.tensorbin`` weights loaded, the paged KV cache
allocated, then warm-up compiles every forward (each bucket, device- and host-sampling
variants), :meth:`seal` captures a trace of each traced one (``trace_mode``), and each step
writes its inputs and replays the trace of the bucket it was padded to (``execute_trace``).
Device sampling returns token ids; the host fallback returns logits for vLLM's sampler.
Images (multimodal packages): :meth:`TTDeviceModel.encode_images` runs the lowered vision
program of the images' vision bucket (warmed, and traced, with the prefills) and reads the soft
tokens back; the prefill forward merges them at the image tokens and attends with the image-block
mask (docs/multimodal.md, "Images on the TT device path").

**Test-only hook**: ``TTBUNDLE_TEST_TTNN=recording`` stands ttbundle's recording double
(``backends/ttnn/recording.py``) in for the ``ttnn`` module and makes the TT platform active
without a device (``activation.py``), so the whole path runs through vLLM's engine in tests.
Its weights are fake, so the double knows no value of the model's (every token read is 0,
listed in ``RECORDER.zero_reads``); never set it to serve.

**Timing device** (benches and tests): ``TTBUNDLE_DEVICE_MODEL=timing:14ms`` stands the timing
model of ``timing.py`` (over the same double) in for ttnn: replayed traces take a modeled time off
the CPU, readbacks wait for it, device sampling returns deterministic ids (``DEVICE`` holds it).

**Lanes** (a package split into replicas, ``runtime/lanes.py``): the worker opens the whole
target mesh (:func:`open_mesh`) and :meth:`TTDeviceModel.initialize_vllm_model` cuts it with
``MeshDevice.create_submeshes(MeshShape(r, c))`` (the replica's shape; as Tenstorrent's
``tt_data_parallel_size``), one submesh per lane in ``mesh.submesh_origins`` order; each lane has
its own weights, KV cache, inputs and traces on its submesh (one ``TraceRunner`` per lane), and
the KV handle :meth:`~TTDeviceModel.allocate_kv_cache` gives the runner names the lane every
call of that lane's rows runs on. The runner enqueues every lane's decode before it reads any
back (``model_runner._decode_lanes``), so the lanes' device time overlaps.

**Async decode** (``read_from_device=False``): the trace is enqueued, the readback of its sampled
ids enqueued right behind it (``from_device(blocking=False)`` and an event, as Tenstorrent's
``read_decode_output(async_read=True)``), and :meth:`read_decode_output` waits for the event. The
next decode's rows take their input token from that output on the device: every device-sampled
decode trace gathers them from the runner's last sampled ids (``backends/ttnn/feed``; the host
passes the ``feed_rows`` index, :meth:`TTDeviceModel._feed`), and the timing device models the
same (``feed_rows``). So async decode and several tokens a step are on here as on the emulated mesh.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from ..backends.ttnn import device as ttdev, inputs as ttinputs, recording
from ..backends.ttnn.feed import FEED_INPUT, feed_index
from ..backends.ttnn.lowering import TOPK, lower_forward, static_start, unlowered_ops
from ..backends.ttnn.model import open_model
from ..errors import InvalidInput
from ..families.vision_part import decode_rope
from ..vision import vision_bucket
from . import packages, timing
from .capabilities import device_seeds, model_capabilities
from .images import prompt_inputs, request_pixels
from .interface import MeshModel
from .options import TTOptions
from .sampling import DeviceSampling, accept
from .speculation import verify_batch

logger = logging.getLogger("vllm.ttbundle.ttdevice")

TEST_TTNN_ENV = "TTBUNDLE_TEST_TTNN"
#: the recording double's Recorder when the test-only hook is on (tests read it)
RECORDER = None
#: the timing device (``timing.TimingDevice``) when ``TTBUNDLE_DEVICE_MODEL`` selects it
DEVICE = None


def import_ttnn():
    """The ttnn module: the wheel, or the recording double under the test-only hook."""
    global RECORDER, DEVICE
    dev = timing.from_env()
    if dev is not None:  # the timing device over the recording double
        RECORDER, DEVICE = recording.Recorder(unknown_reads="zeros"), dev
        return dev.wrap(RECORDER.module())
    if os.environ.get(TEST_TTNN_ENV) == "recording":
        if RECORDER is None:
            RECORDER = recording.Recorder(unknown_reads="zeros")  # its weights are fake: reads give 0
        return RECORDER.module()
    import ttnn
    return ttnn


def open_mesh(ttnn, package, options, whole: bool = False):
    """The package's mesh (the one its programs run on), opened with the plugin options (trace
    region: the option, else the size the package's build planned, from its manifest).
    ``whole``: a package split into replicas opens the whole target (its lanes' submeshes are
    cut from it, :meth:`TTDeviceModel.initialize_vllm_model`); the fabric follows the replica's
    chips (collectives run within a replica)."""
    mesh = package.loaded.mesh
    shape = mesh.target_shape if whole and mesh.target_shape is not None else mesh.shape
    fabric = options.fabric_config or ("FABRIC_1D" if mesh.num_devices > 1 else None)
    if fabric:  # collectives need the fabric; 1D by default, as Tenstorrent's plugin
        args = [getattr(ttnn.FabricConfig, fabric)]
        if options.fabric_reliability_mode:
            args.append(getattr(ttnn.FabricReliabilityMode, options.fabric_reliability_mode))
        ttnn.set_fabric_config(*args)
    kw = {"trace_region_size": options.trace_region_size or package.trace_region_size}
    if options.l1_small_size:
        kw["l1_small_size"] = options.l1_small_size
    if options.worker_l1_size:
        kw["worker_l1_size"] = options.worker_l1_size
    if options.dispatch_core_axis:
        axis = ttnn.DispatchCoreAxis.ROW if options.dispatch_core_axis == "row" else ttnn.DispatchCoreAxis.COL
        kw["dispatch_core_config"] = ttnn.DispatchCoreConfig(axis=axis)
    return ttnn.open_mesh_device(ttnn.MeshShape(*shape), **kw)


class KVHandle:
    """The paged KV cache the plan sized (it lives in the executor of its lane's submesh); what
    the runner holds. ``lane``: which lane (submesh) it is on, 0 without lanes."""

    def __init__(self, num_blocks: int, block_size: int, lane: int = 0):
        self.num_blocks, self.block_size, self.lane = num_blocks, block_size, lane


def _output_name(tokens: bool) -> str:
    """A program's output read back: its sampled ids (device sampling) or its logits."""
    return "next_tokens" if tokens else "logits.out"


class PrefillOutput:
    """A prefill chunk enqueued (``prefill_forward(read_from_device=False)``), read by
    ``read_prefill_output``: its outputs on the device, the lane's runner, which row of the head
    is the chunk's last real token, and the readback queued behind it."""

    def __init__(self, out: dict, runner, row: int, head: int, tokens: bool, deltas=None):
        self.out, self.runner, self.row, self.head, self.tokens, self.deltas = out, runner, row, head, tokens, deltas
        self.name = _output_name(tokens)
        self.pending = None  # (host tensor, event) of the readback queued at submit


class DecodeOutput:
    """A decode's outputs before read-back (``decode_forward(read_from_device=False)``):
    Tenstorrent's plugin then calls ``read_decode_output`` and ``process_decode_output_host``."""

    def __init__(self, out: dict, rows: int, tokens: bool, host=None, runner=None):
        self.out, self.rows, self.tokens, self.host, self.runner = out, rows, tokens, host, runner
        self.pending = None  # async decode: (host tensor, event) of the readback queued at submit


def refuse_unlowered_vision(loaded) -> None:
    """A multimodal package whose images the TT device path cannot run yet is refused (naming
    what is missing, before anything opens): a vision op the ttnn lowering has none for, or a
    vision forward that reads host-made inputs the device runner does not make
    (``backends/ttnn/device.vision_inputs``: the patches, the per-row 2-D rope and window / image
    masks of Qwen2.5-VL and Pixtral, Qwen3-VL's position interpolation)."""
    bundle = loaded.bundle
    vision = sorted(b for phase, b in loaded.programs if phase == "vision")
    if not vision:
        return
    way_out = "images run on the emulated mesh only for this model (serve it with TTBUNDLE_EMULATED=1)"
    for b in vision:
        missing = unlowered_ops(loaded.program_ir("vision", b))
        if missing:
            raise InvalidInput(f"{loaded.dir}: programs/vision-{b}.json uses {', '.join(missing)}, which the ttnn "
                               f"lowering does not translate yet: {way_out}")
    fw = lower_forward(bundle, loaded.mesh, loaded.program_ir("vision", vision[0]), "host")
    extra = sorted(set(fw.inputs) - set(ttinputs.VISION_HOST_INPUTS))
    if extra:
        raise InvalidInput(f"{loaded.dir}: programs/vision-{vision[0]}.json lowered reads the host-made inputs "
                           f"{', '.join(extra)}, which the TT device path does not make yet: {way_out}")


def _rope_kwargs(rope_positions, rope_deltas, start_pos, rows: int):
    """A decode batch's M-RoPE positions [3, B, 1] (``rope_positions``, else each row's cache
    position plus its ``rope_deltas``, Tenstorrent's convention; None when neither is given)."""
    if rope_positions is not None or rope_deltas is None:
        return rope_positions
    d = torch.as_tensor(rope_deltas, dtype=torch.long).reshape(-1)
    return decode_rope(start_pos, torch.nn.functional.pad(d, (0, rows - d.numel())))


def lane_submeshes(ttnn, package, mesh_device, lanes: int) -> list:
    """The mesh device of each lane: ``mesh_device`` itself for one lane; else the submeshes of
    the replica's shape ``create_submeshes`` cuts the whole target into (row-major, the order of
    ``mesh.submesh_origins``: lane ``i`` is replica ``i``). Refuses a mesh device that is not the
    target, or a lane count other than the target's replicas (naming both)."""
    mesh = package.loaded.mesh
    if lanes == 1 and mesh.replicas == 1:
        return [mesh_device]
    target = mesh.target_shape or mesh.shape
    where = f"package {package.name}-{package.mesh_name} ({mesh.describe()})"
    if lanes != mesh.replicas:
        raise ValueError(f"{where}: {lanes} lane(s) on one mesh device; a Tenstorrent device runs every "
                         f"replica of the target as a lane ({mesh.replicas}), one engine for the whole "
                         "target")
    got = tuple(int(x) for x in mesh_device.shape)
    if got != tuple(target):
        raise ValueError(f"{where}: the mesh device is {got[0]}x{got[1]}; its {lanes} lanes are cut from "
                         f"the whole {target[0]}x{target[1]} target (open it, not one replica)")
    subs = list(mesh_device.create_submeshes(ttnn.MeshShape(*mesh.shape)))
    if len(subs) != lanes:
        raise ValueError(f"{where}: create_submeshes gave {len(subs)} submeshes for {lanes} lanes")
    return subs


class TTDeviceModel(MeshModel):
    """A package on a ttnn mesh device (its tensorbin weights, lowered forwards, traces), behind
    the model protocol (``runtime.interface.MeshModel``)."""

    #: ``ttnn.sampling`` runs with one seed for the batch: seeded requests sample on the host
    seeded_on_device = device_seeds(device=True)
    #: how many of the latest runs' forward keys :attr:`replays` keeps (a server runs for days)
    replays_kept = 4096
    model_capabilities: dict  # per instance: capabilities.model_capabilities(bundle, device=True)

    def __init__(self, ttnn, package, runner, trace_mode: str, sample_mode: str, lane_runners=None):
        self.ttnn, self.package, self.runner = ttnn, package, runner
        #: one TraceRunner per lane (its submesh's weights, KV, inputs, traces); [runner] without lanes
        self.lane_runners = list(lane_runners or [runner])
        self._kv_given = 0  # lanes' KV handles handed out (allocate_kv_cache), in lane order
        self.bundle = package.bundle
        b = package.buckets  # the manifest's (what the programs were lowered for)
        self.prefill_buckets, self.decode_buckets = list(b.prefill), list(b.decode)
        self.trace_mode, self.sample_mode = trace_mode, sample_mode
        self.block_size = int(package.loaded.kv_cache["block_size"])  # the programs' KV layout
        self.vocab_size = package.dims.vocab_size
        self.warmed: set[tuple[str, int]] = set()
        self.sealed = False
        self.programs_run: dict[tuple[str, int], int] = {}
        #: the forward keys of the latest ``replays_kept`` runs, in order; ``replay_count``: all runs
        self.replays: deque[tuple] = deque(maxlen=self.replays_kept)
        self.replay_count = 0
        self.model_capabilities = model_capabilities(package, device=True)
        self._sampling_cache: dict = {}  # lane -> (DeviceSampling, rows, its host inputs) of its last decode
        self._page_cache: dict = {}  # (lane, decode key) -> (page table given, its host array)
        #: decodes whose fed rows took their tokens on the device / read back first (tests, logs)
        self.feeds = {"device": 0, "host": 0}
        self._feed_cache: dict = {}  # (runner, decode key) -> (feed rows, the feed_rows input made of them)
        self._steady: dict = {}  # (lane, decode key) -> (tokens, its host array, prev_rows, its host array)
        self._mask_free: dict = {}  # forward key -> True when it reads no mask / M-RoPE input
        self._decode_keys: dict = {}  # (bucket, mode) -> forward key, checked once after seal

    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size, max_seq_len, tt_data_parallel=1,
                              optimizations=None, *, package=None, options=None, sample_mode: str | None = None,
                              ttnn=None):
        """The package (``package``, else the directory vLLM was given) on ttnn mesh device
        ``mesh_device``, with ``options`` (default: Tenstorrent's, with ``optimizations``) and
        ``sample_mode`` (default: the options', else the bundle's ``sample_on_device_mode``)."""
        package = package or packages.open_package(Path(hf_config._name_or_path))
        options = options or TTOptions(optimizations=optimizations)
        sample_mode = sample_mode or options.sample_mode(package.serving.sample_on_device_mode)

        if not (package.path / "tensorbin" / "index.json").is_file():
            raise InvalidInput(f"{package.path}: no tensorbin/ weight caches; a Tenstorrent device runs packages "
                               "built with `ttbundle build --backend ttnn`")
        refuse_unlowered_vision(package.loaded)
        ttnn = ttnn or import_ttnn()
        t0 = time.perf_counter()
        devices = lane_submeshes(ttnn, package, mesh_device, tt_data_parallel)
        runners = []
        for dev in devices:  # each lane: its own weights, KV cache, inputs and (later) traces
            runner = open_model(ttnn, package.loaded, sample_mode, dev, host_fallback=True,
                                trace_mode=options.trace_mode)
            if RECORDER is not None and RECORDER.unknown_reads == "zeros":  # test-only hook, fake weights:
                runner.ex.on_call = RECORDER.on_call  # each op's output gets the shape the lowering says
            runners.append(runner)
        logger.info("ttbundle: %s on a %s mesh%s: weights, KV cache, %d forwards in %.1f s", package.name,
                    package.mesh_name, f" ({len(runners)} lanes, one submesh each)" if len(runners) > 1 else "",
                    len(runners[0].forwards), time.perf_counter() - t0)
        return cls(ttnn, package, runners[0], options.trace_mode, sample_mode, runners)

    # -- KV ---------------------------------------------------------------------------------------
    def allocate_kv_cache(self, kv_cache_shape, dtype=None, num_layers=None) -> KVHandle:
        """The KV cache of the next lane (lanes: called once per lane, in lane order; each
        lane's cache was allocated on its submesh when the model opened)."""
        plan_blocks = self._plan_blocks()
        if kv_cache_shape[0] != plan_blocks:
            raise ValueError(f"the {self.package.mesh_name} package's KV cache holds {plan_blocks} blocks "
                             f"(its plan); vLLM asked for {kv_cache_shape[0]} (--num-gpu-blocks-override is "
                             "not supported on Tenstorrent devices)")
        if self._kv_given >= len(self.lane_runners):
            raise ValueError(f"{self._kv_given + 1} KV caches asked of {len(self.lane_runners)} lane(s)")
        self._kv_given += 1
        return KVHandle(plan_blocks, kv_cache_shape[2], self._kv_given - 1)

    def _lane(self, kv_cache) -> int:
        return getattr(kv_cache, "lane", 0)

    def _plan_blocks(self) -> int:
        return self.package.kv_blocks

    # -- programs ---------------------------------------------------------------------------------
    def _key(self, phase: str, bucket: int, sampling, start: int = 0) -> tuple:
        mode = "device" if sampling is not None else "host"
        if phase == "decode" and self.sealed:  # the hot path: checked once per bucket and mode
            key = self._decode_keys.get((bucket, mode))
            if key is not None:
                self.programs_run[(phase, bucket)] += 1
                return key
        key = (phase, bucket, mode, static_start(self.package.loaded, self.package.loaded.program_ir(phase, bucket), start))
        if key not in self.runner.forwards:
            raise ValueError(f"no {mode}-sampling forward for {phase} bucket {bucket}")
        traced = key in self.runner.traced
        if self.sealed and traced and key not in self.runner.traces:
            raise RuntimeError(f"{phase} bucket {bucket} was not captured at warm-up; refusing to capture a "
                               "trace while serving")
        self.programs_run[(phase, bucket)] = self.programs_run.get((phase, bucket), 0) + 1
        if phase == "decode" and self.sealed and start == 0:
            self._decode_keys[(bucket, mode)] = key
        return key

    def replays_since(self, count: int) -> list[tuple]:
        """The forward keys of the runs after the first ``count`` (a ``replay_count`` read
        earlier), oldest first; refused when the window no longer holds them all."""
        new = self.replay_count - count
        if not 0 <= new <= len(self.replays):
            raise ValueError(f"{new} runs since replay {count}; the last {len(self.replays)} are kept")
        return list(self.replays)[len(self.replays) - new:]

    def _run(self, key: tuple, host: dict, lane: int = 0) -> dict:
        self.replays.append(key)
        self.replay_count += 1
        runner = self.lane_runners[lane]
        if runner.stage == "captured":
            return runner.run(key, host)
        return runner.run_eager(key, host)  # enable_model_warmup=false: compiles on first use

    def _sampling_inputs(self, s: DeviceSampling | None, rows: int) -> dict:
        """``ttnn.sampling``'s inputs. Rows with top_k above TOPK or none never come here from
        ttbundle's runner (``sampling.host_reasons`` with ``max_device_top_k``); from another
        caller they are cut to TOPK candidates, as ttnn.sampling does."""
        if s is None:
            return {}
        temp = np.asarray(torch.as_tensor(s.temperature, dtype=torch.float32)).reshape(-1)
        greedy = temp < 1e-5
        k = np.asarray(torch.as_tensor(s.top_k, dtype=torch.long)).reshape(-1).clip(0, TOPK)
        k = np.where((k == 0) & ~greedy, TOPK, k)
        k = np.where(greedy, 1, k)
        t = np.where(greedy, 1.0, temp)
        p = np.asarray(torch.as_tensor(s.top_p, dtype=torch.float32)).reshape(-1)
        pad = lambda a, fill: np.concatenate([a, np.full(max(0, rows - a.size), fill)])[:rows]  # noqa: E731
        return {"top_k": pad(k, 1).astype(np.uint32), "top_p": pad(p, 1.0).astype(np.float32),
                "temperature": pad(t, 1.0).astype(np.float32)}

    @torch.no_grad()
    def prefill_forward(self, tokens, page_table, kv_cache, prompt_lens, start_pos=None, sampling_params=None,
                        enable_trace: bool = True, return_prompt_logits: bool = False, mm: dict | None = None,
                        pixel_values=None, rope_positions=None, image_grid_thw=None, read_from_device: bool = True,
                        **kwargs):
        """One sequence's prefill chunk (as ``adapter.BundleModel.prefill_forward``). ``mm``: the
        chunk's image soft tokens (``runtime.images.chunk_inputs``; ttbundle's runner);
        ``pixel_values``: the request's images as Tenstorrent's plugin passes them (the whole
        prompt in this call), encoded here by the vision forwards (``images.prompt_inputs``).
        Either way the soft tokens are merged by the prefill forward itself
        (``inputs.merge_images``) and its attention mask holds their image blocks. Other
        keywords of that plugin (``image_grid_thw``: the images' patch grids, Qwen2.5-VL, Qwen3-VL,
        Mistral 3) are
        used as the emulated adapter uses them. ``rope_positions`` [3, 1, S]: the chunk's M-RoPE
        positions (ttbundle's runner); images given as ``pixel_values`` to an M-RoPE model make
        their own, and the call then returns ``(output, rope_deltas)`` as
        ``adapter.BundleModel.prefill_forward`` does. Refused: ``return_prompt_logits`` (the
        platform refuses prompt_logprobs on a device). ``read_from_device=False``: the chunk's
        program is enqueued with its readback right behind it (a later replay of the same trace on
        this submesh overwrites its outputs) and a handle returned for :meth:`read_prefill_output`:
        the runner enqueues every chunk of a step before reading any, so lanes prefill side by side."""
        N, S = tokens.shape
        if N != 1 or S not in self.prefill_buckets:
            raise ValueError(f"prefill runs one sequence padded to a bucket {self.prefill_buckets}, "
                             f"got tokens {list(tokens.shape)}")
        if return_prompt_logits:  # the platform refuses prompt_logprobs on a device
            raise ValueError("every prompt position's logits (prompt_logprobs) come back on the emulated mesh only")
        n, p0 = int(prompt_lens[0]), 0 if start_pos is None else int(start_pos[0])
        deltas = None
        if mm is None and pixel_values is not None:
            part = self.bundle.family.vision_part(self.bundle.arch)
            if part is None:
                raise ValueError(f"pixel_values for {self.package.name}, a text-only model (no vision part)")
            px = request_pixels(pixel_values, N, p0)
            thw = image_grid_thw
            mm, pos = prompt_inputs(part, tokens[0, :n].tolist(), px,
                                    thw[0] if isinstance(thw, (list, tuple)) else thw, self.encode_images, S)
            if not pos.plain and rope_positions is None:  # M-RoPE: the positions the images give
                rope_positions = pos.chunk(0, n, S)["rope_positions"]
                deltas = torch.tensor([pos.delta], dtype=torch.long)
        key = self._key("prefill", S, sampling_params, p0)
        fw = self.runner.forwards[key]
        host = ttdev.prefill_host_inputs(fw, tokens[0].numpy(), n, p0, page_table[0].numpy(), self.block_size,
                                   self.package.dims.max_model_len, mm=mm,
                                   rope_positions=None if rope_positions is None else rope_positions.numpy())
        head = fw.inputs["last_rows"][0][2]
        host.update(self._sampling_inputs(sampling_params, head))
        lane = self._lane(kv_cache)
        out = self._run(key, host, lane)
        runner = self.lane_runners[lane]
        handle = PrefillOutput(out, runner, (n - 1) % head, head, sampling_params is not None, deltas)
        if read_from_device:
            return self.read_prefill_output(handle)
        handle.pending = self._queue_read(runner, out[handle.name])
        return handle

    def _queue_read(self, runner, t) -> tuple:
        """The readback of output ``t`` queued right behind the program that wrote it, and an
        event after it: (host tensor, event), read by :meth:`_queued`. A later replay of the same
        trace on this (sub)mesh overwrites ``t``; the queued read has its value."""
        return self.ttnn.from_device(t, blocking=False), self.ttnn.record_event(runner.ex.device, 0)

    def _queued(self, pending: tuple):
        """What a :meth:`_queue_read` read back, once its event has passed (device 0's copy)."""
        host_t, event = pending
        self.ttnn.event_synchronize(event)
        return np.asarray(self.ttnn.get_device_tensors(host_t)[0].to_numpy())

    def read_prefill_output(self, handle: "PrefillOutput"):
        """A prefill chunk's result (what :meth:`prefill_forward` returns), read back: the
        sampled id [1] or the last real row's logits [1, V] (and the M-RoPE deltas where the
        call made them)."""
        if handle.pending is not None:  # enqueued: wait for its readback's event
            data = self._queued(handle.pending)
        else:
            data = np.asarray(handle.runner.read(handle.out[handle.name]))
        row = handle.row
        if handle.tokens:
            res = torch.tensor([int(data.reshape(-1)[row])])
        else:
            logits = data.reshape(handle.head, -1)
            res = torch.from_numpy(logits[row:row + 1, :self.vocab_size].astype(np.float32))
        return res if handle.deltas is None else (res, handle.deltas)

    @property
    def vision_buckets(self) -> list[int]:
        return sorted(k[1] for k in self.runner.forwards if k[0] == "vision")

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw=None) -> torch.Tensor:
        """Soft tokens [soft tokens, hidden] of the images vLLM's processor made: the lowered
        vision program of the smallest vision bucket holding them (the family's vision part
        says what a bucket counts and makes the patches and the per-call rope and segment
        metadata, as for the emulated backend; ``device.vision_inputs`` writes them), on the
        mesh (its trace replayed where ``trace_mode`` is ``all``), read back to the host for the
        prefill that merges them (as Tenstorrent's models pass vision embeddings into prefill)."""
        part = self.bundle.family.vision_part(self.bundle.arch)
        bucket, inputs = vision_bucket(part, self.vision_buckets, pixel_values, image_grid_thw)
        key = self._key("vision", bucket, None)
        fw = self.runner.forwards[key]
        patches, meta, finish = part.program_inputs(inputs, bucket, torch.float32)
        out = self._run(key, ttdev.vision_inputs(fw, patches.numpy(), meta))
        (name,) = fw.outputs
        soft = np.asarray(self.runner.read(out[name]), dtype=np.float32)  # [1, 1, soft, hidden (x sets)]
        soft = soft.reshape(-1, soft.shape[-1])
        return finish(torch.from_numpy(soft.copy()))

    @torch.no_grad()
    def verify_forward(self, tokens, start_pos, num_tokens, page_table, kv_cache, sampling_params=None):
        """Speculative decoding's verify step, as ``adapter.BundleModel.verify_forward``: the
        lowered verify forward of the decode bucket (``B x (k + 1)`` rows padded to a tile, each
        row a token at its own position over its sequence's pages: decode's lowering, the KV
        writes and the attention run per group of the sequences' row ``j``, each a decode batch of
        B rows, so row ``j`` sees its sequence's rows up to itself) replays its trace; every
        row's logits come back, and with ``sampling_params`` acceptance runs on the host
        (``sampling.accept``, vLLM's rejection rule). Returns logits [B, k + 1, V] or the
        accepted tokens [B, k + 1] (-1 past each sequence's last)."""
        valid, positions, n = verify_batch(self.package.serving.rows_per_seq, self.decode_buckets, tokens, start_pos, num_tokens)
        B, K1 = tokens.shape
        key = self._key("verify", B, None)
        lane = self._lane(kv_cache)  # with lanes: the lane (submesh) these sequences run on
        runner = self.lane_runners[lane]
        fw = runner.forwards[key]
        host = ttdev.verify_inputs(fw, tokens.numpy(), torch.where(valid, positions, -1).numpy(), page_table.numpy())
        out = self._run(key, host, lane)
        V = self.vocab_size
        logits = np.asarray(runner.read(out["logits.out"])).reshape(fw.rows, -1)[:, :V]
        logits = torch.from_numpy(np.ascontiguousarray(ttdev.verify_rows(fw, logits, K1), dtype=np.float32))
        if sampling_params is None:
            return logits
        return accept(logits, tokens[:, 1:], (n - 1).clamp(min=0), sampling_params)

    def decode_forward(self, tokens, start_pos, page_table, kv_cache, sampling_params=None, enable_trace: bool = True,
                       read_from_device: bool = True, prev_output=None, prev_rows=None, rope_positions=None,
                       rope_deltas=None):
        """``read_from_device=False`` (device sampling): enqueue and return a handle for
        :meth:`read_decode_output`; rows with ``prev_rows[i] >= 0`` take their token from row
        ``prev_rows[i]`` of ``prev_output`` (an earlier such handle) on the device.
        ``rope_positions`` [3, B, 1]: each row's M-RoPE positions (ttbundle's runner); else
        ``rope_deltas`` [B] (what ``prefill_forward`` returned per request): row ``i`` at
        ``start_pos[i] + rope_deltas[i]``; neither: the cache positions. (No ``torch.no_grad``
        here, unlike the other forwards: the step is host arrays and device calls, no torch op,
        and entering the context costs microseconds per lane per step, issue 25.)"""
        B = tokens.shape[0]
        if tokens.shape[1] != 1 or B not in self.decode_buckets:
            raise ValueError(f"decode runs a batch padded to a bucket {self.decode_buckets}, "
                             f"got tokens {list(tokens.shape)}")
        key = self._key("decode", B, sampling_params)
        fw = self.runner.forwards[key]
        # the forward's rows are the bucket padded to whole tiles (fw.rows): padding rows idle
        # (position -1: nothing written, nothing attended), as backends/ttnn/device.decode_inputs
        R, blocks = fw.rows, fw.inputs["page_table"][0][1]
        lane = self._lane(kv_cache)
        runner = self.lane_runners[lane]
        pos = start_pos.numpy()
        if R != B:
            pos = np.concatenate([pos, np.full(R - B, -1, np.int64)])
        # a chained step of a persistent batch passes the same tokens (zeros: every row fed on the
        # device) and feed map tensors step after step: their host arrays are made once (the same
        # token array lets write_inputs skip its copy; the fed rows overwrite it on the device)
        same = self._steady.get((lane, key))
        if same is not None and same[0] is tokens and prev_rows is not None and same[2] is prev_rows:
            toks, rows = same[1], same[3]
        else:
            toks = np.zeros(R, np.uint32)
            toks[:B] = tokens.numpy().reshape(B)
            rows = None
            if prev_rows is not None:
                rows = np.full(R, -1, np.int64)
                rows[:B] = prev_rows.numpy()
            self._steady[lane, key] = (tokens, toks, prev_rows, rows)
        # the runner passes one page-table tensor while a batch's rows and blocks stay: its host
        # array is made once, and the same array object lets write_inputs skip the copy
        cached_pt = self._page_cache.get((lane, key))
        if cached_pt is None or cached_pt[0] is not page_table:
            pt = np.zeros((R, blocks), np.int32)
            given = page_table.numpy()[:, :blocks]
            pt[:given.shape[0], :given.shape[1]] = given
            self._page_cache[lane, key] = cached_pt = (page_table, pt)
        host = {"tokens": toks.reshape(1, R), "positions": np.maximum(pos, 0).astype(np.uint32).reshape(1, R),
                "cur_pos": pos.astype(np.int32), "page_table": cached_pt[1]}
        if not self._mask_free.get(key):
            rope = _rope_kwargs(rope_positions, rope_deltas, start_pos, B)
            masks = ttdev.mask_inputs(fw, host["cur_pos"][:, None], rope_positions=None if rope is None else rope.numpy())
            self._mask_free[key] = not masks
            host.update(masks)
        if sampling_params is not None:  # the runner passes one object while a batch's rows stay
            cached = self._sampling_cache.get(lane)
            if cached is None or cached[0] is not sampling_params or cached[1] != R:
                self._sampling_cache[lane] = cached = (sampling_params, R, self._sampling_inputs(sampling_params, R))
            host.update(cached[2])
        fed = FEED_INPUT in fw.inputs  # a device-sampled decode: its trace gathers the fed tokens
        if fed:
            host["tokens"], host[FEED_INPUT], on_device = self._feed(runner, key, R, host["tokens"], rows,
                                                                     prev_output)
        elif prev_rows is not None:
            raise ValueError(f"decode {key} samples on the host: it has no token feed (prev_rows given)")
        if prev_rows is not None and DEVICE is not None and (not fed or on_device):
            self.ttnn.feed_rows(runner.inputs[key]["tokens"], prev_output.out["next_tokens"], rows)  # its model
        handle = DecodeOutput(self._run(key, host, lane), B, sampling_params is not None, runner=runner)
        if fed:  # this step's ids are in the runner's feed tensor now, for the next decode of R rows
            runner.feed_owner[R] = handle
        if not read_from_device:
            if handle.tokens:  # async decode: the readback queued right behind the trace, and its event
                handle.pending = self._queue_read(runner, handle.out["next_tokens"])
            return handle
        return self.process_decode_output_host(self.read_decode_output(handle), is_tokens=handle.tokens)

    def _feed(self, runner, key, R: int, toks, rows, prev_output):
        """(tokens, ``feed_rows`` input, fed on the device) of a decode of ``R`` rows whose rows
        ``i`` with ``rows[i] >= 0`` take row ``rows[i]`` of ``prev_output``'s sampled ids
        (``backends/ttnn/feed``). On the device when ``prev_output`` is the decode that last
        wrote the runner's feed ids for ``R`` rows (async decode, several tokens a step: the step
        just before); otherwise its ids are read back and written with the tokens (a synchronous
        step, as without the feed). The index arrays are reused while ``rows`` is the same array,
        so an unchanged feed map is not copied again."""
        if rows is None:
            return toks, feed_index(R), False
        if runner.feed_owner.get(R) is prev_output:
            cached = self._feed_cache.get((id(runner), key))
            if cached is None or cached[0] is not rows:
                self._feed_cache[id(runner), key] = cached = (rows, feed_index(R, rows))
            self.feeds["device"] += 1
            return toks, cached[1], True
        self.feeds["host"] += 1
        ids = np.asarray(self.read_decode_output(prev_output).host).reshape(-1)
        take = rows >= 0
        out = np.array(toks, copy=True).reshape(-1)
        out[take] = ids[rows[take]]
        return out.reshape(toks.shape), feed_index(R), False

    def read_decode_output(self, tt_out: DecodeOutput, async_read: bool = True) -> DecodeOutput:
        """The decode's output read back to the host (token ids or logits)."""
        if tt_out.pending is not None:  # enqueued at submit: wait for its event
            return DecodeOutput(tt_out.out, tt_out.rows, tt_out.tokens, self._queued(tt_out.pending), tt_out.runner)
        name = _output_name(tt_out.tokens)
        runner = tt_out.runner or self.runner
        return DecodeOutput(tt_out.out, tt_out.rows, tt_out.tokens, np.asarray(runner.read(tt_out.out[name])),
                            runner)

    def process_decode_output_host(self, tt_out: DecodeOutput, is_tokens: bool | None = None) -> torch.Tensor:
        """Token ids [B] (device sampling) or logits [B, V] (host sampling), B the padded batch."""
        if tt_out.host is None:
            tt_out = self.read_decode_output(tt_out)
        B = tt_out.rows
        if tt_out.tokens if is_tokens is None else is_tokens:
            return torch.from_numpy(tt_out.host.reshape(-1)[:B].astype(np.int64))
        logits = tt_out.host.reshape(-1, tt_out.host.shape[-1])[:B]  # rows: the bucket padded to tiles
        return torch.from_numpy(logits[:, :self.vocab_size].astype(np.float32))

    # -- warm-up: compile everything, then (seal) capture ------------------------------------------
    def warmup_model_prefill(self, kv_cache, enable_trace: bool = True, can_sample_on_device: bool = True):
        t0 = time.perf_counter()
        keys = [k for k in self.runner.forwards if k[0] in ("prefill", "vision")]  # images encode at prefill
        for runner in self.lane_runners:  # each submesh compiles its own programs
            runner.warmup(keys)
        self.warmed |= {(k[0], k[1]) for k in keys}
        logger.info("[WARMUP] compiled %d prefill and vision forwards in %.1f s", len(keys), time.perf_counter() - t0)

    def warmup_model_decode(self, kv_cache, enable_trace: bool = True, max_batch_size=None, num_blocks=None,
                            can_sample_on_device: bool = True):
        t0 = time.perf_counter()
        keys = [k for k in self.runner.forwards if k[0] in ("decode", "verify")]  # verify: speculative decoding
        for runner in self.lane_runners:
            runner.warmup(keys)
        self.warmed |= {(k[0], k[1]) for k in keys}
        logger.info("[WARMUP] compiled %d decode and verify forwards in %.1f s", len(keys), time.perf_counter() - t0)
        if all(r.stage == "warm" for r in self.lane_runners):  # every forward compiled: capture now, as Tenstorrent's
            self.seal()                 # plugin expects of its last warm-up call (no seal() there)

    def release(self) -> None:
        """The captured traces given back to the device before its mesh closes (every lane's)."""
        for runner in self.lane_runners:
            runner.release()

    def seal(self):
        """Capture a trace of every traced forward (every one compiled first); from now on each
        step replays. Once only."""
        if self.sealed:
            return
        t0 = time.perf_counter()
        for runner in self.lane_runners:
            runner.capture()
        self.sealed = True
        if DEVICE is not None:
            for runner in self.lane_runners:
                DEVICE.attach(runner, self.vocab_size)
        logger.info("[WARMUP] captured %d traces in %.1f s", sum(len(r.traces) for r in self.lane_runners),
                    time.perf_counter() - t0)
