"""Hugging Face transformers as the numerical reference: the same weights, the same tokens."""

from __future__ import annotations

import math
from pathlib import Path

from .errors import InvalidInput

# MoE experts as the modeling file writes them (a loop over the chosen experts), not transformers'
# default batched grouped_mm: the reference is the plain implementation
EXPERTS = "eager"


def hf_config(bundle):
    import transformers

    d = bundle.family.to_hf_config(bundle.arch)
    model_type = d.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError) as e:
        raise InvalidInput(f"transformers cannot build a {model_type!r} config: {e}") from None


def auto_class(model_type: str):
    """transformers' auto class for a model type: the causal LM one, or the image-text-to-text
    one for multimodal models transformers registers only there (Qwen2.5-VL)."""
    import transformers
    from transformers.models.auto import modeling_auto as m

    if model_type not in m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in m.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def random_model(bundle, seed: int = 0, dtype=None):
    """A tiny-or-not HF model of the bundle's architecture with random weights scaled so that
    activations stay O(1) and greedy tokens vary (HF's own init makes near-constant outputs)."""
    import torch
    import transformers

    cfg = hf_config(bundle)
    # eager attention: transformers' SDPA path ignores Gemma 2's attn_logit_softcapping
    model = auto_class(cfg.model_type).from_config(
        cfg, dtype=torch.float32, attn_implementation="eager", experts_implementation=EXPERTS).eval()
    g = torch.Generator().manual_seed(seed)
    traits = bundle.family.traits(bundle.arch)
    neutral = 0.0 if traits.get("norm_offset") else 1.0
    # scaled embeddings (Gemma) must not swamp the layers, or tied logits repeat the input token
    embed_std = 0.5 / (traits.get("embed_scale") or 1.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[-1]
                scale = embed_std if "embed" in name else 1.0 / math.sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:  # norm weights around their neutral value; sinks and biases around 0
                base = 0.0 if ("sinks" in name or "bias" in name) else neutral
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
        persistent = set(model.state_dict())
        for name, b in model.named_buffers():  # checkpoint buffers: DeepSeek's e_score_correction_bias
            if name in persistent and b.is_floating_point():
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    if dtype is not None:
        model = model.to(dtype)
    return model


def _quiet() -> None:
    """No progress bars from transformers: the CLI prints its own report (and --json)."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def load_model(directory: str | Path, dtype=None):
    import torch
    import transformers

    _quiet()
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        return auto_class(cfg.model_type).from_pretrained(
            str(directory), dtype=dtype or torch.float32, local_files_only=True,
            attn_implementation="eager", experts_implementation=EXPERTS).eval()
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{directory}: transformers cannot load it as a causal LM: {e}") from None


def checkpoint_state_dict(model) -> dict:
    """``model``'s tensors under their checkpoint names and layout, as ``save_pretrained`` writes
    them: transformers 5 fuses some in memory (DeepSeek's per-expert projections into one
    ``gate_up_proj``), the family name tables read checkpoints."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, model.state_dict())


def save_random(bundle, directory: str | Path, seed: int = 0, eos: bool = True) -> Path:
    """A random instance of the bundle's architecture (:func:`random_model`) saved as a bf16
    checkpoint (``config.json`` + safetensors), as a published checkpoint would be. Without
    ``eos`` its configs name no eos token (``generate`` then runs to max_new_tokens)."""
    import torch

    _quiet()
    d = Path(directory)
    model = random_model(bundle, seed).to(torch.bfloat16)
    if not eos:
        model.config.eos_token_id = None
        model.generation_config.eos_token_id = None
    model.save_pretrained(d)
    return d


def round_to_bf16(model) -> None:
    """Round every floating parameter and persistent buffer to the nearest bf16 value (kept in
    its dtype): the weights a package holds at its finest storage (bf16)."""
    import torch

    with torch.no_grad():
        persistent = set(model.state_dict())
        for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]:
            if t.is_floating_point() and t.dtype != torch.bfloat16:
                t.copy_(t.to(torch.bfloat16).to(t.dtype))


def kv_cache(model, storage: str | None = None):
    """A transformers cache for ``model`` that stores keys and values as a device cache of
    dtype ``storage`` holds them (``"bf16"``: rounded to bf16 on every write, as ttbundle's
    emulated cache does); ``None``: transformers' own cache in the compute dtype."""
    import torch
    from transformers.cache_utils import DynamicCache

    if storage is None:
        return DynamicCache(config=model.config)
    if storage != "bf16":
        raise ValueError(f"reference KV storage {storage!r}: only bf16 is modeled")

    class RoundingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k = key_states.to(torch.bfloat16).to(key_states.dtype)
            v = value_states.to(torch.bfloat16).to(value_states.dtype)
            return super().update(k, v, layer_idx, *args, **kwargs)

    return RoundingCache(config=model.config)
