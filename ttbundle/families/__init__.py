"""Model families, registered in one table. Look-ups are exact: no fuzzy matching."""

from __future__ import annotations

from ..errors import InvalidInput
from .base import Family
from .deepseek_v3 import DeepseekV3
from .gemma2 import Gemma2
from .gemma3 import Gemma3
from .gpt_oss import GptOss
from .llama import Llama
from .mistral import Mistral
from .mistral3 import Mistral3
from .qwen2 import Qwen2
from .qwen2_moe import Qwen2Moe
from .qwen2_5_vl import Qwen25VL
from .qwen3 import Qwen3
from .qwen3_moe import Qwen3Moe
from .qwen3_vl import Qwen3VL

_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> None:
    if family.name in _FAMILIES:
        raise ValueError(f"family {family.name!r} registered twice")
    _FAMILIES[family.name] = family


for _f in (Llama(), Qwen2(), Qwen3(), Mistral(), Gemma2(), Gemma3(), DeepseekV3(), GptOss(), Qwen3Moe(), Qwen2Moe(), Qwen25VL(),
           Qwen3VL(), Mistral3()):
    register(_f)


def get(name: str) -> Family:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise InvalidInput(f"unknown family {name!r}; supported: {', '.join(_FAMILIES)}") from None


def all_families() -> dict[str, Family]:
    return dict(_FAMILIES)


def by_hf_architecture(arch: str) -> Family:
    for f in _FAMILIES.values():
        if arch in f.hf_architectures:
            return f
    supported = sorted(a for f in _FAMILIES.values() for a in f.hf_architectures)
    raise InvalidInput(f"config.json: architecture {arch!r} is not supported; "
                       f"supported: {', '.join(supported)}")


def vision_class_of(hf_arch: str):
    """The vision part class of the family whose multimodal HF class is ``hf_arch`` (None: a
    text-only class)."""
    for f in _FAMILIES.values():
        if f.vision_hf_architecture == hf_arch:
            return f.vision_class
    return None


def arch_models() -> tuple:
    return tuple(f.arch_model for f in _FAMILIES.values())
