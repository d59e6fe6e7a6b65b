"""Plugin options: ``--additional-config '{"tt": {...}}'`` with Tenstorrent's own key names.

The keys and their meanings follow Tenstorrent's vLLM plugin so one command line works with
either plugin. Keys that only matter on real hardware (L1 sizes, fabric, dispatch axis) are
accepted and recorded; the emulated mesh has no use for them. Unknown keys are an error that
names the key and the closest valid one.
"""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class TTOptions(BaseModel):
    """``additional_config["tt"]``: Tenstorrent plugin options (defaults as in that plugin)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

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
    optimizations: Literal["performance", "accuracy"] | None = None
    """Model precision preset passed to ``initialize_vllm_model``."""
    max_prefill_steps_between_decodes: int = Field(default=DEFAULT_MAX_PREFILL_STEPS, ge=1)
    """ttbundle: the most prefill steps that run in a row while a request waits to decode (the
    scheduler's waiting bound; see docs/runtime.md)."""


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
            elif err["type"] == "literal_error":
                problems.append(f"{SECTION}.{key}: {err['msg']}, got {err.get('input')!r}")
            else:
                problems.append(f"{SECTION}.{key}: {err['msg']}")
        raise InvalidInput("--additional-config: " + "; ".join(problems)) from None
