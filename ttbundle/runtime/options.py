"""Plugin options: ``--additional-config '{"tt": {...}}'`` with Tenstorrent's own key names.

The keys and their meanings follow Tenstorrent's vLLM plugin so one command line works with
either plugin. Keys that only matter on real hardware (L1 sizes, fabric, dispatch axis) are
accepted and recorded; the emulated mesh has no use for them. Keys of Tenstorrent's multi-host
launcher and its test models are accepted, type-checked and reported as having no effect
(``no_effect``). Unknown keys are an error that names the key and the closest valid one.
Tenstorrent's environment variables are read and checked here too (:func:`env`).
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ..errors import InvalidInput

#: The key under ``additional_config`` this plugin reads (same as Tenstorrent's plugin).
SECTION = "tt"
#: ttbundle-only key: how many prefill steps in a row may run while decodes are waiting.
DEFAULT_MAX_PREFILL_STEPS = 1
#: ``ttnn.FabricConfig`` and ``ttnn.FabricReliabilityMode`` members (ttnn 0.81.1): a name outside
#: them fails at start-up with the valid choices, not later inside ``set_fabric_config``
FabricConfigName = Literal["DISABLED", "FABRIC_1D", "FABRIC_1D_NEIGHBOR_EXCHANGE", "FABRIC_1D_RING",
                           "FABRIC_2D", "FABRIC_2D_TORUS_X", "FABRIC_2D_TORUS_XY", "FABRIC_2D_TORUS_Y",
                           "CUSTOM"]
FabricReliabilityName = Literal["STRICT_INIT", "RELAXED_INIT", "DYNAMIC_RECONFIG"]
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: keys that only matter to Tenstorrent's multi-host launcher (tt-run / MPI)
MULTI_HOST = ("rank_binding", "mpi_args", "extra_ttrun_args", "config_pkl_dir", "env_passthrough")


class TTOptions(BaseModel):
    """``additional_config["tt"]``: Tenstorrent plugin options (defaults as in that plugin)."""

    # strict: JSON's "5" or true is not the number 5 or 1, nor "yes" a boolean
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True)

    trace_mode: Literal["all", "decode_only", "none"] = "all"
    """Which phases replay captured traces: prefill and decode, decode only, or none."""
    sample_on_device_mode: Literal["all", "decode_only", "off"] | None = None
    """Where sampling runs on device (token ids come back instead of logits); default: the
    bundle's runtime.sample_on_device_mode. Batches needing what the device cannot do fall
    back to the host per batch anyway."""
    enable_model_warmup: bool = True
    """Compile and capture every bucket before the server reports healthy."""
    trace_region_size: int | None = Field(default=None, gt=0)
    """Bytes reserved for traces on each chip; default: the plan's estimate."""
    worker_l1_size: int | None = Field(default=None, gt=0)
    """L1 bytes per worker core given to kernels (hardware only)."""
    l1_small_size: int | None = Field(default=None, gt=0)
    """L1 small-region bytes (hardware only)."""
    fabric_config: FabricConfigName | None = None
    """Fabric topology (a ``ttnn.FabricConfig`` name), e.g. FABRIC_1D, FABRIC_1D_RING,
    FABRIC_2D_TORUS_XY (hardware only)."""
    fabric_reliability_mode: FabricReliabilityName | None = None
    """Fabric bring-up (a ``ttnn.FabricReliabilityMode`` name): STRICT_INIT (ttnn's default)
    or RELAXED_INIT (hardware only)."""
    dispatch_core_axis: Literal["row", "col"] | None = None
    """Dispatch cores on a row or a column (hardware only)."""
    tt_data_parallel_size: int | None = Field(default=None, gt=0)
    """Replicas one engine drives as lanes (Tenstorrent's key); default: the package's replicas
    divided by vLLM's ``--data-parallel-size``. lanes x DP x chips per replica must be the
    target's chips."""
    optimizations: Literal["performance", "accuracy"] | None = None
    """Model precision preset passed to ``initialize_vllm_model``."""
    always_compat_sampling: bool = False
    """Sample every batch on the host with vLLM's sampler (Tenstorrent's "compatibility"
    sampling), whatever ``sample_on_device_mode`` says."""
    register_test_models: bool = False
    """Tenstorrent's plugin: also register its test models. ttbundle has none: accepted, no effect."""
    rank_binding: str | None = None
    """Multi-host only (tt-run rank-binding YAML); ttbundle serves one host: accepted, no effect."""
    mpi_args: str | None = None
    """Multi-host only (arguments for mpirun under tt-run): accepted, no effect."""
    extra_ttrun_args: str | None = None
    """Multi-host only (extra tt-run arguments): accepted, no effect."""
    config_pkl_dir: str | None = None
    """Multi-host only (where ranks exchange the pickled vLLM config): accepted, no effect."""
    env_passthrough: list[Annotated[str, StringConstraints(pattern=ENV_NAME)]] | None = None
    """Multi-host only (environment variable names passed to the other ranks): accepted, no effect."""
    output_tokens_per_step: int | None = Field(default=None, ge=1)
    """ttbundle: tokens a decode step produces per host round trip, at most what the package
    declares (its runtime.output_tokens_per_step, the default); 1 turns it off."""
    max_prefill_steps_between_decodes: int = Field(default=DEFAULT_MAX_PREFILL_STEPS, ge=1)
    """ttbundle: the most prefill steps that run in a row while a request waits to decode (the
    scheduler's waiting bound; see docs/runtime.md)."""


    def sample_mode(self, bundle_default: str) -> str:
        """Where sampling runs: ``off`` under ``always_compat_sampling``, else the option, else the
        bundle's ``runtime.sample_on_device_mode``."""
        if self.always_compat_sampling:
            return "off"
        return self.sample_on_device_mode or bundle_default

    def no_effect(self) -> list[str]:
        """The keys given that do nothing here (multi-host, test models), for a start-up note."""
        keys = [k for k in MULTI_HOST if getattr(self, k) is not None]
        return keys + (["register_test_models"] if self.register_test_models else [])


def parse(additional_config) -> TTOptions:
    """``TTOptions`` from vLLM's ``additional_config`` (a dict, or None). Raises InvalidInput
    listing every unknown or invalid key."""
    cfg = additional_config or {}
    if not isinstance(cfg, dict):
        raise InvalidInput(f"--additional-config must be a JSON object, got {type(cfg).__name__}")
    section = cfg.get(SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise InvalidInput(f'--additional-config: "{SECTION}" must be a JSON object of plugin options, '
                           f"got {section!r}")
    try:
        return TTOptions.model_validate(section)
    except ValidationError as e:
        problems = []
        fields = list(TTOptions.model_fields)
        for err in e.errors():
            key = ".".join(map(str, err["loc"]))
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(str(err["loc"][-1]), fields, n=1, cutoff=0.6)
                hint = f"did you mean `{close[0]}`?" if close else f"valid keys: {', '.join(fields)}"
                problems.append(f"{SECTION}.{key}: unknown option; {hint}")
            elif err["type"] in ("literal_error", "int_type", "bool_type", "string_type", "list_type"):
                problems.append(f"{SECTION}.{key}: {err['msg']}, got {err.get('input')!r}")
            else:
                problems.append(f"{SECTION}.{key}: {err['msg']}")
        raise InvalidInput("--additional-config: " + "; ".join(problems)) from None


# ---- environment ------------------------------------------------------------------------------------
_DEVICE_LIST = re.compile(r"^\s*\d+\s*(,\s*\d+\s*)*$")


class TTEnv(BaseModel):
    """Tenstorrent's environment variables, read at start-up (``env``). ``MESH_DEVICE`` is
    matched to the package's mesh by ``mesh.same_mesh`` (the platform); ``EXTRA_MODELS_DIR``
    is a search directory of ``registry.py``."""

    model_config = ConfigDict(extra="ignore")

    MESH_DEVICE: str | None = None
    TT_VISIBLE_DEVICES: list[int] | None = None
    """Device ids this process may open (Tenstorrent's device-control variable; with vLLM's
    data parallel each engine rank gets its own). The emulated mesh opens no device."""
    HF_MODEL: str | None = None
    """tt_transformers loads its HF checkpoint from it; a package carries its own weights:
    when it names something other than the package served, that is logged."""
    TT_CACHE_PATH: str | None = None
    """tt_transformers' weight-cache directory; a package carries its own ``tensorbin/`` cache."""
    EXTRA_MODELS_DIR: list[str] | None = None
    """Directories of packages (``os.pathsep``-separated), searched after the registered ones."""
    TT_VLLM_BUILTIN_MODELS: Literal["0", "1"] | None = None
    """Tenstorrent's plugin: ``0`` disables its built-in models; ttbundle only serves packages."""
    TT_LLAMA_TEXT_VER: str | None = None
    """Tenstorrent's plugin: which Llama implementation; a package has exactly one (its programs)."""
    TT_QWEN3_TEXT_VER: str | None = None
    """Tenstorrent's plugin: which Qwen3 implementation; a package has exactly one."""


def env(environ=None) -> TTEnv:
    """``TTEnv`` from ``environ`` (default ``os.environ``). Raises InvalidInput naming the
    variable, its value and what is valid."""
    environ = os.environ if environ is None else environ
    raw = {k: environ[k] for k in TTEnv.model_fields if environ.get(k, "") != ""}
    problems = []
    if "TT_VISIBLE_DEVICES" in raw:
        v = raw["TT_VISIBLE_DEVICES"]
        if not _DEVICE_LIST.match(v):
            problems.append(f"TT_VISIBLE_DEVICES={v!r}: must be comma-separated device ids, e.g. 0 or 0,1,2,3")
        else:
            ids = [int(x) for x in v.split(",")]
            if len(set(ids)) != len(ids):
                problems.append(f"TT_VISIBLE_DEVICES={v!r}: a device id is listed twice")
            raw["TT_VISIBLE_DEVICES"] = ids
    if "EXTRA_MODELS_DIR" in raw:
        raw["EXTRA_MODELS_DIR"] = [x for x in raw["EXTRA_MODELS_DIR"].split(os.pathsep) if x]
    if problems:
        raise InvalidInput("; ".join(problems))
    try:
        return TTEnv.model_validate(raw)
    except ValidationError as e:
        msgs = [f"{err['loc'][0]}={raw.get(err['loc'][0])!r}: {err['msg']}" for err in e.errors()]
        raise InvalidInput("; ".join(msgs)) from None
