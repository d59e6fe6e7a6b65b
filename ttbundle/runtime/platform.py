"""vLLM platform plugin: Tenstorrent meshes, real or emulated (activation: ``activation.py``).

``check_and_update_config`` runs in the API server process and in the engine core; it
validates everything a package fixes before any weight is loaded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil
import torch
from vllm.platforms.interface import Platform, PlatformEnum

from .. import mesh as meshmod
from ..errors import InvalidInput, TTBundleError
from ..mesh import same_mesh
from ..package.names import DRAFT_DIR
from ..speculative import disagreements, recorded_config
from . import packages, registry
from .capabilities import model_capabilities, serving_tokens_per_step
from .cause import record
from .lanes import DP_KEY, LaneError, check_pool, dp_size_of, plan_lanes
from .options import env, parse
from .ttdevice import refuse_unlowered_vision


logger = logging.getLogger("vllm.ttbundle.platform")

WORKER = "ttbundle.runtime.worker.TTWorker"
SCHEDULER = "ttbundle.runtime.scheduler.PhaseScheduler"
ASYNC_SCHEDULER = "ttbundle.runtime.scheduler.AsyncPhaseScheduler"


class EmulatedMeshPlatform(Platform):
    """A Tenstorrent mesh emulated in torch on the host CPU."""

    _enum = PlatformEnum.OOT
    device_name = "tt"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    device_control_env_var = "TT_VISIBLE_DEVICES"
    supported_quantization: list[str] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16]

    @classmethod
    def import_kernels(cls) -> None:  # no vllm._C: the mesh runs its own programs
        return

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"Tenstorrent mesh (emulated, {os.environ.get('MESH_DEVICE', 'package mesh')})"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return psutil.virtual_memory().total

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return 0.0

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{dtype} is not supported on Tenstorrent meshes; use bfloat16 or float32")

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        configure(vllm_config, emulated=True)


class TTMeshPlatform(EmulatedMeshPlatform):
    """A Tenstorrent mesh through ttnn (``ttdevice.py``): the package's ``.tensorbin`` weights,
    compile warm-up, captured traces replayed per step. The host side stays on the CPU."""

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"Tenstorrent mesh ({os.environ.get('MESH_DEVICE', 'package mesh')})"

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """prompt_logprobs need every prompt position's logits: the emulated mesh's prefill has
        them (host path), a device program computes the last rows' only."""
        from vllm.exceptions import VLLMValidationError

        if getattr(params, "prompt_logprobs", None) is not None:
            raise VLLMValidationError("prompt_logprobs are not supported on a Tenstorrent device "
                                      "(its prefill programs compute the last token's logits only); "
                                      "the emulated mesh (`ttbundle serve --device emulated`) has them",
                                      parameter="prompt_logprobs", value=params.prompt_logprobs)

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        configure(vllm_config, emulated=False)


def _fail(msg: str):
    record(msg)  # serve's last line (cause.py)
    raise ValueError(f"ttbundle: {msg}")


def configure(vllm_config, emulated: bool) -> None:
    """Validate a vLLM config against the package it serves and set the plugin's classes."""
    try:
        opts = parse(vllm_config.additional_config)
        tenv = env()
    except TTBundleError as e:
        _fail(str(e))
    pc, sc, cc, mc = (vllm_config.parallel_config, vllm_config.scheduler_config,
                      vllm_config.cache_config, vllm_config.model_config)
    if mc is None:
        return
    verified = os.environ.get(registry.VERIFIED_ENV + "_MODEL") == str(mc.model)
    try:
        pkg = packages.open_package(mc.model, check_hashes=not verified)
    except TTBundleError as e:
        _fail(f"--model {mc.model}: {e}")
    os.environ[registry.VERIFIED_ENV + "_MODEL"] = str(mc.model)  # the engine core inherits it
    n = (pkg.bundle.family.name, pkg.mesh_name)
    devices = _mesh_devices(pkg.mesh_name)

    # parallelism: the mesh is the parallelism; data parallel runs the package's replicas
    lanes = _configure_lanes(vllm_config, pkg, opts, emulated)
    for flag, size in (("-tp/--tensor-parallel-size", pc.tensor_parallel_size),
                       ("-pp/--pipeline-parallel-size", pc.pipeline_parallel_size)):
        if size > 1:
            _fail(f"{flag} {size} is not supported: the mesh replaces it. Package "
                  f"{pkg.name}-{pkg.mesh_name} already splits the model over the {pkg.mesh_name} mesh's "
                  f"{devices} chip(s) (see `ttbundle plan`); to use more chips build the bundle for a "
                  "bigger mesh (targets: in the spec) and serve that package")
    mesh_env = os.environ.get("MESH_DEVICE")
    if mesh_env and not same_mesh(mesh_env, pkg.mesh_name):
        _fail(f"MESH_DEVICE={mesh_env} but package {pkg.path.name} was built for {pkg.mesh_name}; "
              f"serve the {mesh_env} package (`ttbundle build --mesh {mesh_env}`) or unset MESH_DEVICE "
              "(a shape such as \"(1,8)\" matches the preset of that shape and chip)")
    _configure_speculative(vllm_config, pkg, emulated)
    if vllm_config.lora_config is not None:
        _fail("LoRA is not supported on Tenstorrent meshes")
    if mc.dtype not in (torch.float32, torch.bfloat16):
        _fail(f"--dtype {str(mc.dtype).removeprefix('torch.')} is not supported; use float32 "
              "(token-identical to transformers on the emulated mesh) or bfloat16")

    rt, bk = pkg.serving, pkg.buckets
    longest = pkg.dims.max_model_len  # the programs' (their rope tables and page tables)
    if mc.max_model_len > longest:
        logger.warning("ttbundle: max_model_len %d capped to the package's %d", mc.max_model_len, longest)
        mc.max_model_len = longest
    if sc.max_num_seqs > lanes.engine_seqs:
        logger.warning("ttbundle: max_num_seqs %d capped to the package's %d%s", sc.max_num_seqs,
                       lanes.engine_seqs, f" ({lanes.lanes} lanes x {rt.max_num_seqs})" if lanes.lanes > 1 else "")
        sc.max_num_seqs = lanes.engine_seqs
    if cc.user_specified_block_size and cc.block_size != rt.kv_block_size:
        _fail(f"--block-size {cc.block_size}: the package's KV cache uses blocks of "
              f"{rt.kv_block_size} tokens (runtime.kv_block_size)")
    cc.block_size = rt.kv_block_size
    # prefix caching: vLLM hands a request the blocks of an earlier one with the same leading
    # tokens and schedules the rest as a prefill starting mid-prompt, which the emulated mesh's
    # chunked prefill already does (tested against transformers). On the device path a prefill
    # that starts on a cached block has not been exercised, so it stays off there.
    caps = model_capabilities(pkg, device=not emulated, vocab_size=pkg.dims.vocab_size)
    # with lanes a cached block would live in one lane's KV region only: off
    cc.enable_prefix_caching = bool(cc.enable_prefix_caching) and caps["supports_prefix_caching"] \
        and lanes.lanes == 1
    chunk = bk.prefill_chunk or max(bk.prefill)
    sc.enable_chunked_prefill = True
    try:  # decode tokens per host step: scheduled as that many tokens a request
        per_step = serving_tokens_per_step(pkg, opts, not emulated, vllm_config)
    except ValueError as e:
        _fail(str(e))
    declared = pkg.serving.output_tokens_per_step
    if per_step > 1:
        logger.info("ttbundle: up to %d tokens a decode step (the decode replayed, fed on the device)", per_step)
    elif declared > 1 and opts.output_tokens_per_step != 1:
        logger.info("ttbundle: one token a decode step though the package declares %d (it needs sampling on the "
                    "device and no speculative decoding: capabilities.tokens_per_step)", declared)
    spec_rows = max(per_step, 1 + (vllm_config.speculative_config.num_speculative_tokens
                                   if vllm_config.speculative_config is not None else 0))  # a decode's rows
    sc.max_num_batched_tokens = max(max(bk.prefill), sc.max_num_seqs * spec_rows, chunk)
    sc.max_num_scheduled_tokens = None
    sc.long_prefill_token_threshold = chunk
    # async scheduling (vLLM's default; off with --no-async-scheduling) needs async decode: a
    # decode step submitted before the previous one's tokens are read back (model_runner.py)
    # (lanes: on a device every lane's decode is submitted, then all collected when vLLM asks;
    # the emulated mesh computes at submit, so its lanes stay synchronous)
    from .model_runner import async_decode_supported
    if sc.async_scheduling and not async_decode_supported(emulated):
        logger.info("ttbundle: async scheduling off: this device cannot feed a decode's sampled tokens "
                    "into the next decode (capabilities.async_decode)")
    elif sc.async_scheduling and lanes.lanes > 1 and emulated:
        logger.info("ttbundle: async scheduling off: %d lanes on the emulated mesh run synchronous steps",
                    lanes.lanes)
    if sc.async_scheduling and vllm_config.speculative_config is not None:
        logger.info("ttbundle: async scheduling off: speculative decoding runs synchronous steps")
    sc.async_scheduling = bool(sc.async_scheduling) and async_decode_supported(emulated) \
        and (lanes.lanes == 1 or not emulated) and vllm_config.speculative_config is None
    if sc.scheduler_cls not in (None, SCHEDULER, ASYNC_SCHEDULER) and "ttbundle" not in str(sc.scheduler_cls):
        logger.warning("ttbundle: replacing scheduler %s: every step must be one phase", sc.scheduler_cls)
    sc.scheduler_cls = ASYNC_SCHEDULER if sc.async_scheduling else SCHEDULER
    _configure_images(pkg, mc, sc, emulated)
    from .pooling import configure as configure_task
    configure_task(pkg, vllm_config, emulated, _fail, SCHEDULER)  # task: embed needs vLLM's pooling runner
    pc.worker_cls = WORKER
    pc.distributed_executor_backend = "uni"

    from vllm.config import CompilationMode
    from vllm.config.compilation import CUDAGraphMode
    vllm_config.compilation_config.mode = CompilationMode.NONE
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    vllm_config.compilation_config.cudagraph_capture_sizes = []
    mc.enforce_eager = True

    # the architecture as Tenstorrent's plugin names it, registered with vLLM
    arch = registry.register_arch(pkg.arch)
    if list(mc.hf_config.architectures or []) != [arch]:
        _fail(f"{pkg.path}/config.json: architectures {mc.hf_config.architectures} should be "
              f"[{arch!r}] (vllm_metadata.json says {pkg.arch}); rebuild the package")
    if not emulated and not pkg.built_for_device:
        _fail(f"{pkg.path}: built for the emulated mesh only (no tensorbin/ weight caches); on a "
              f"Tenstorrent device serve a package built with `ttbundle build --backend ttnn`")
    _environment_notes(pkg, opts, tenv, emulated)
    _guard_empty_cache()
    logger.info("ttbundle: serving %s-%s (%s) on %s %s mesh; trace_mode=%s", pkg.name, pkg.mesh_name, n[0],
                "an emulated" if emulated else "a Tenstorrent", pkg.mesh_name, opts.trace_mode)


def _environment_notes(pkg, opts, tenv, emulated: bool) -> None:
    """Tenstorrent options and variables that have no effect on this package, said once."""
    if opts.no_effect():
        logger.info("ttbundle: %s: accepted, no effect (Tenstorrent multi-host / test-model options; "
                    "ttbundle serves one host)", ", ".join(opts.no_effect()))
    for var in ("TT_CACHE_PATH", "TT_LLAMA_TEXT_VER", "TT_QWEN3_TEXT_VER", "TT_VLLM_BUILTIN_MODELS"):
        if getattr(tenv, var) is not None:
            logger.info("ttbundle: %s=%s: no effect (package %s runs its own programs and weights)",
                        var, getattr(tenv, var), pkg.name)
    hf = getattr(pkg.bundle.spec, "hf_model", None)
    if tenv.HF_MODEL and tenv.HF_MODEL not in {pkg.name, hf, str(pkg.path)}:
        logger.warning("ttbundle: HF_MODEL=%s but serving package %s (%s): the package's own weights "
                       "are used", tenv.HF_MODEL, pkg.name, hf or "no hf_model in its spec")
    if tenv.TT_VISIBLE_DEVICES is not None and emulated:
        logger.info("ttbundle: TT_VISIBLE_DEVICES=%s: the emulated mesh opens no device",
                    ",".join(map(str, tenv.TT_VISIBLE_DEVICES)))


def _configure_lanes(vllm_config, pkg, opts, emulated: bool):
    """The package's replicas over vLLM's data-parallel ranks and each engine's lanes
    (``runtime/lanes.py``); records the DP size for the engine processes. Refuses impossible
    combinations naming the numbers."""
    pc = vllm_config.parallel_config
    dp = dp_size_of(vllm_config)
    try:
        lp = plan_lanes(pkg.loaded.mesh, pkg.serving.max_num_seqs, dp,
                        opts.tt_data_parallel_size, 0, f"package {pkg.name}-{pkg.mesh_name}")
        check_pool(pkg, pkg.kv_blocks, lp.lanes, f"package {pkg.name}-{pkg.mesh_name}")
    except LaneError as e:
        _fail(str(e))
    if dp > 1:
        if vllm_config.additional_config is None:
            vllm_config.additional_config = {}
        vllm_config.additional_config[DP_KEY] = dp
        if pc.data_parallel_size > 1 and vllm_config.model_config.is_moe:
            _fail(f"--data-parallel-size {dp} with a mixture-of-experts model: vLLM runs MoE ranks "
                  "in lockstep with collectives the emulated mesh does not provide; serve the replicas "
                  "as lanes in one engine instead (leave --data-parallel-size out)")
    if not emulated and dp > 1:  # lanes in one engine open the target's submeshes (ttdevice.lane_submeshes)
        _fail(f"{lp.describe()}: vLLM data parallel on a Tenstorrent device (each rank opening its own "
              "replicas' chips) is not implemented yet; serve every replica as a lane of one engine "
              "(leave --data-parallel-size out), or data parallel on the emulated mesh")
    return lp


def _configure_speculative(vllm_config, pkg, emulated: bool) -> None:
    """vLLM's ``--speculative-config`` against the package's ``speculative:`` (its verify
    programs are built for one method and k): a config that disagrees is refused naming both;
    ``ngram`` runs on the emulated mesh and on a device (the verify programs lowered to ttnn);
    ``draft_model`` (the draft package inside the package, ``package.names.DRAFT_DIR``: ttbundle's
    runner runs it, ``runtime.draft``) on the emulated mesh only."""
    sc = vllm_config.speculative_config
    if sc is None:
        return
    given = {"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
             "prompt_lookup_min": getattr(sc, "prompt_lookup_min", None),
             "prompt_lookup_max": getattr(sc, "prompt_lookup_max", None)}
    if sc.method not in ("ngram", "draft_model"):
        _fail(f"--speculative-config method {sc.method!r} is not supported: ttbundle serves `ngram` "
              "(prompt lookup) and `draft_model` (the draft package a package is built with, "
              "`speculative: {method: draft}`) speculative decoding")
    if not emulated and sc.method != "ngram":
        _fail(f"--speculative-config method {sc.method!r} on a Tenstorrent device is not implemented yet "
              "(the draft model runs beside the emulated mesh only); serve it on the emulated mesh, or "
              "speculate with `ngram` (a package built with `speculative: {method: ngram}`)")
    pc = recorded_config(pkg.serving, pkg.path / DRAFT_DIR)
    if sc.method == "draft_model":
        given = {"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
                 "model": str(Path(sc.model).absolute()) if sc.model else None}
        if getattr(sc, "draft_sample_method", "greedy") != "greedy":
            _fail(f"--speculative-config draft_sample_method {sc.draft_sample_method!r}: ttbundle's draft "
                  "proposes greedily (vLLM's default, `greedy`); leave it out")
    bad = disagreements(pc, given)
    if bad:
        _fail(f"--speculative-config {given} disagrees with package {pkg.name}-{pkg.mesh_name}'s "
              f"speculative: {pc}: " + "; ".join(bad) + "; drop the flag (`ttbundle serve` passes the "
              "package's) or rebuild with the spec's `speculative:` changed")


def _configure_images(pkg, mc, sc, emulated: bool) -> None:
    """A multimodal package: the spec's ``vision.images_per_prompt`` as vLLM's
    ``limit_mm_per_prompt`` (a larger limit asked for is capped, with a warning; more images
    in a request is vLLM's 400), and an image's tokens never split over two prefill chunks
    (Gemma 3's attend to each other; Qwen2.5-VL's are encoded by one vision program). On a
    device, a package whose images the TT device path cannot run yet is refused
    (``ttdevice.refuse_unlowered_vision``)."""
    vs = pkg.bundle.vision
    mm = getattr(mc, "multimodal_config", None)
    if vs is None or mm is None:
        return
    if not emulated:  # the device encodes images with the lowered vision programs, if every op is
        try:
            refuse_unlowered_vision(pkg.loaded)
        except InvalidInput as e:
            _fail(str(e))
    from vllm.config.multimodal import ImageDummyOptions

    asked = mm.get_limit_per_prompt("image")
    if "image" in mm.limit_per_prompt and asked > vs.images_per_prompt:
        logger.warning("ttbundle: limit_mm_per_prompt image=%d capped to the package's %d "
                       "(vision.images_per_prompt)", asked, vs.images_per_prompt)
    if "image" not in mm.limit_per_prompt or asked > vs.images_per_prompt:
        old = mm.limit_per_prompt.get("image")
        mm.limit_per_prompt["image"] = ImageDummyOptions(
            count=vs.images_per_prompt, width=getattr(old, "width", None), height=getattr(old, "height", None))
    sc.disable_chunked_mm_input = True


def _mesh_devices(name: str) -> int:
    return meshmod.resolve(name).num_devices


def _guard_empty_cache() -> None:
    """vLLM calls torch.accelerator.empty_cache() / empty_host_cache() for non-CPU platforms
    (engine shutdown); with CPU-only torch they raise. No-ops when there is no accelerator."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and not acc.is_available():
        acc.empty_cache = lambda: None
        acc.empty_host_cache = lambda: None
