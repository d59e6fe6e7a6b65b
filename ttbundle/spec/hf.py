"""A Hugging Face ``config.json`` read as a family's arch fields (``from_hf:``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import families
from ..errors import InvalidInput
from .. import formats
from ..fsutil import read_user_json


def import_hf(d: Path) -> dict:
    try:
        cfg = d / "config.json" if d.is_dir() or not d.suffix else d
    except OSError as e:  # a path too long to stat
        raise InvalidInput(f"{d}: cannot read: {e.strerror or e}") from None
    try:
        config = read_user_json(cfg, "config.json", inside=cfg.parent)
    except InvalidInput as e:
        if "no such" in e.message:
            raise InvalidInput(f"{cfg}: not found (from_hf needs a directory with config.json)") from None
        raise
    return hf_config_to_arch(config, str(cfg))


#: config.json keys that must be JSON objects (or null) when present
HF_OBJECT_KEYS = ("text_config", "rope_scaling", "rope_parameters", "quantization_config")
HF_MAX_INT = 2**63 - 1


def _check_hf_values(node, where: str, path: str = "") -> None:
    """Every number in a config.json bounded (no NaN/Inf, integers within int64) before any
    family reads it."""
    if isinstance(node, dict):
        for k, v in node.items():
            _check_hf_values(v, where, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_hf_values(v, where, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise InvalidInput(f"{where}: {path}: {node} is not a finite number")
    elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > HF_MAX_INT:
        raise InvalidInput(f"{where}: {path}: integer out of range (at most {HF_MAX_INT:,} in magnitude)")


def hf_config_to_arch(config: dict, where: str = "config.json") -> dict:
    """The arch fields a family reads from an HF config.json. The shape of the keys every family
    relies on is checked first; a family that still meets a value of an unexpected type raises
    InvalidInput naming the file (never a TypeError)."""
    if not isinstance(config, dict):
        raise InvalidInput(f"{where}: expected a JSON object")
    _check_hf_values(config, where)
    archs = config.get("architectures")
    if archs is None or archs == []:
        raise InvalidInput(f"{where}: no `architectures` entry; cannot tell the model family")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise InvalidInput(f"{where}: architectures: expected a list of class names such as "
                           f'["LlamaForCausalLM"], got {json.dumps(archs)[:60]}')
    for k in HF_OBJECT_KEYS:
        for cfg, at in ((config, k), (config.get("text_config"), f"text_config.{k}")):
            if isinstance(cfg, dict) and k in cfg and cfg[k] is not None and not isinstance(cfg[k], dict):
                raise InvalidInput(f"{where}: {at}: expected a JSON object (or null), got "
                                   f"{json.dumps(cfg[k])[:60]}")
    # the checkpoint's format, as vLLM detects it (an unsupported scheme: named, with what is read)
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    formats.scheme_of(qc, where)
    wrapper = None
    if "text_config" in config and isinstance(config["text_config"], dict):
        # multimodal wrappers (Gemma 3): the text model's dims live in text_config, the vision
        # part's beside it (``Family.from_hf_wrapper``)
        inner = dict(config["text_config"])
        inner.setdefault("architectures", archs)
        config, wrapper = inner, config
    family = families.by_hf_architecture(archs[0])
    try:
        out = family.from_hf(config)
        return out if wrapper is None else family.from_hf_wrapper(wrapper, out)
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
        raise InvalidInput(f"{where}: a value has the wrong type for a {family.name} config "
                           f"({type(e).__name__}: {e}); compare it with the model's published "
                           "config.json") from None
