"""The vLLM worker: opens the package vLLM was given as the model, owns the model runner.

vLLM calls, in order: ``init_device``, ``load_model``, ``get_kv_cache_spec``,
``determine_available_memory``, ``initialize_from_config`` (allocate the KV cache from vLLM's
``num_blocks``), ``compile_or_warm_up_model`` (every bucket, before the server reports healthy),
then ``execute_model`` / ``sample_tokens`` per step.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from .. import kvpool
from ..backends.ttnn import kernelcache
from . import ttdevice
from .activation import HARDWARE, active_platform
from .cause import recorded
from .lanes import plan_lanes_for
from .model_runner import TTModelRunner
from .options import parse
from .packages import open_package
from .pooling import runner_class, supported_tasks

logger = logging.getLogger("vllm.ttbundle.worker")


def emulated_threads() -> int:
    """torch threads of the emulated mesh: ``TTBUNDLE_EMULATED_THREADS``, else every core this
    process may use. (On a host busy with other work, fewer threads than free cores avoid
    OpenMP barriers waiting on descheduled threads.)"""
    v = os.environ.get("TTBUNDLE_EMULATED_THREADS")
    if v:
        return max(1, int(v))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class TTWorker(WorkerBase):
    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False, **kwargs):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        with recorded():
            self.options = parse(vllm_config.additional_config)
        self.package = None

    def init_device(self):
        with recorded():
            self._init_device()

    def _init_device(self):
        self.device = torch.device("cpu")
        torch.manual_seed(self.model_config.seed or 0)
        self.package = open_package(self.model_config.model, check_hashes=False)  # verified at start
        self.tt = None
        if active_platform() == HARDWARE:
            self.tt = self._open_mesh()
        else:
            torch.set_num_threads(emulated_threads())
        self.model_runner = runner_class(self.package)(self.vllm_config, self.package, self.options, self.device,
                                                       tt=self.tt)

    def _open_mesh(self):
        """The TT platform: the kernel cache the build filled (a writable copy) as TT_METAL_CACHE
        unless set, then the package's mesh opened through ttnn (``ttdevice.py``): with lanes the
        whole target, which the model cuts into the lanes' submeshes."""
        cache = kernelcache.runtime_cache_dir(self.package.path, self.package.manifest)
        if cache is not None and not os.environ.get("TT_METAL_CACHE"):
            os.environ["TT_METAL_CACHE"] = f"{cache}/"
            logger.info("ttbundle: TT_METAL_CACHE=%s (the package's pre-filled kernel cache)", cache)
        ttnn = ttdevice.import_ttnn()
        lanes = plan_lanes_for(self.vllm_config, self.package, self.options).lanes
        return ttnn, ttdevice.open_mesh(ttnn, self.package, self.options, whole=lanes > 1)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        with recorded():
            self.model_runner.load_model()

    def get_model(self):
        """An ``nn.Module`` (vLLM walks ``.modules()``) holding the mesh model as ``.mesh_model``."""
        return self.model_runner.model

    def get_kv_cache_spec(self):
        return self.model_runner.kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def determine_available_memory(self) -> int:
        """Exactly the blocks of the plan's KV pool (Tenstorrent's
        ceil((max_tokens_all_users + block x max_num_seqs) / block), as ``plan.make.kv_blocks`` chose it
        and the package's programs record it: ``Package.kv_blocks``), unless
        ``--num-gpu-blocks-override`` says otherwise (``ttbundle serve`` passes the emulated mesh's
        pool for this host that way); vLLM preempts when they run out. On the emulated mesh
        without an override (``vllm serve PACKAGE``), the pool ``Package.host_plan`` gives this
        host (``kvpool.host_pool`` of the facts the build recorded: ``auto`` takes a share of the
        available memory, at most the package's pool)."""
        override = self.cache_config.num_gpu_blocks_override
        lanes = self.model_runner.lane_plan.lanes
        if override:
            blocks = override
        elif self.tt is None:
            blocks = self._host_blocks(lanes)
        else:  # with lanes, one region of the package's pool per lane
            blocks = self.package.kv_blocks * lanes
        return blocks * self.model_runner.kv_bytes_per_block()

    def _host_blocks(self, lanes: int) -> int:
        """The emulated pool for this host, from inside the engine: what it already holds (its
        resident bytes: runtime, weights) counts as available, since the host plan counts it."""
        m = self.package.host_plan(lanes=lanes, available=kvpool.available_memory() + kvpool.own_rss())
        logger.info("ttbundle: emulated mesh on this host: %s", m.pool_line())
        if not m.fits:
            logger.warning("ttbundle: the emulated mesh's expected peak exceeds this host's available memory")
        return m.blocks

    def initialize_from_config(self, kv_cache_config) -> None:
        with recorded():
            self.model_runner.initialize_kv_cache(kv_cache_config.num_blocks)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        t0 = time.perf_counter()
        with recorded():
            self.model_runner.warm_up()
        return CompilationTimes(language_model=time.perf_counter() - t0, encoder=0.0)

    def get_supported_tasks(self):
        return supported_tasks(self.package)

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        """Speculative decoding: the proposals for the next step (vLLM's engine asks after each)."""
        take = getattr(self.model_runner, "take_draft_token_ids", None)  # (the pooling runner has none)
        return take() if take is not None else None

    def check_health(self) -> None:
        return

    def synchronize_device(self) -> None:
        return

    def get_cache_block_size_bytes(self) -> int:
        return self.model_runner.kv_bytes_per_block()

    def add_lora(self, lora_request) -> bool:
        raise ValueError("LoRA is not supported on Tenstorrent meshes")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def shutdown(self) -> None:
        runner, self.model_runner = getattr(self, "model_runner", None), None
        if getattr(self, "tt", None) is not None:
            ttnn, mesh = self.tt
            if runner is not None and runner.mesh_model is not None:
                runner.mesh_model.release()
            ttnn.close_mesh_device(mesh)
            self.tt = None
