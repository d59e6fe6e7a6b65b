"""Gemma 3 text model: Gemma 2's layer plus per-head q/k RMSNorm, one global layer every
``sliding_window_pattern`` layers with its own rope (base rope_theta, optionally scaled) while
local layers use rope_local_base_freq; no soft-capping in published checkpoints. The multimodal
``Gemma3ForConditionalGeneration`` imports with its vision part (``vision``: SigLIP tower and
projector, ``gemma3_vision``); without ``vision`` the arch is the text model only."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from . import base
from . import gemma3_vision as gv
from ..errors import InvalidInput
from .gemma2 import Gemma2, GemmaArch


class Gemma3Arch(GemmaArch):
    """Gemma 3 text dims (HF ``Gemma3ForCausalLM``, or ``text_config`` of
    ``Gemma3ForConditionalGeneration``). ``rope_theta``/``rope_scaling`` apply to global layers."""

    family: Literal["gemma3"] = "gemma3"
    """Model family."""
    rope_local_base_freq: float = 10000.0
    """Rotary base of the local (sliding_attention) layers; they are never scaled."""
    sliding_window_pattern: int = Field(default=6, gt=0)
    """Every sliding_window_pattern-th layer is global, the others local (when layer_types is unset)."""
    vision: gv.Gemma3Vision | None = None
    """The vision tower and image tokens (``Gemma3ForConditionalGeneration``); null: text only."""

    def default_kind(self, layer: int) -> str:
        return "sliding_attention" if (layer + 1) % self.sliding_window_pattern else "full_attention"


class Gemma3(Gemma2):
    name = "gemma3"
    vision_class = gv.Gemma3VisionPart
    vision_hf_architecture = "Gemma3ForConditionalGeneration"
    hf_architectures = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    arch_model = Gemma3Arch
    summary = "Gemma 3 text; q/k norm, 5 local : 1 global layers, local/global rope"
    qk_norm = True
    hf_model_type = "gemma3_text"
    hf_keys = Gemma2.hf_keys + ("rope_local_base_freq", "sliding_window_pattern")
    # Gemma3TextConfig's defaults: published multimodal configs omit most text_config keys
    hf_defaults = {"vocab_size": 262208, "head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                   "rope_theta": 1_000_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                   "attn_logit_softcapping": None, "final_logit_softcapping": None}
    # Gemma3ForConditionalGeneration nests the text model (transformers>=4.52 and the published
    # checkpoint layout); its vision tower and projector are not used
    hf_key_renames = ((r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
                      (r"^language_model\.lm_head\.", "lm_head."))
    hf_key_renames += ((r"^vision_tower\.", "model.vision_tower."),
                       (r"^multi_modal_projector\.", "model.multi_modal_projector."),
                       (r"^model\.vision_tower\.(?!vision_model\.)", "model.vision_tower.vision_model."))
    # a text-only arch leaves the vision part of a multimodal checkpoint unused (``ignored``)
    hf_ignored = (r"^(model\.)?(vision_tower|multi_modal_projector)\.",)

    def hf_architecture(self, a):
        return "Gemma3ForConditionalGeneration" if a.vision is not None else self.hf_architectures[0]

    def ignored(self, a):
        # SigLIP's pooling head (vision_use_head) is never run: Gemma 3 reads the patch tokens
        return (r"^model\.vision_tower\.vision_model\.head\.",) if a is not None and a.vision is not None \
            else self.hf_ignored

    def tensors(self, a):
        t = super().tensors(a)
        return t if a.vision is None else t + gv.tensors(a.vision, a.hidden_size)

    def default_plan(self, a):
        p = super().default_plan(a)
        return p if a.vision is None else {**p, **gv.PLAN}

    def hf_names(self, a):
        n = super().hf_names(a)
        return n if a.vision is None else n + gv.hf_names(a.vision)

    def traits(self, a):
        t = super().traits(a)
        return t if a.vision is None else {**t, "norms": {**t.get("norms", {}), **gv.norms(a.vision)}}

    # -- vision ---------------------------------------------------------------------------------
    def vision_programs(self, a):
        return None if a.vision is None else gv.programs(a.vision)

    def vision_inputs(self, a):
        return gv.inputs(a.vision)

    def vision_rows(self, a, images: int):
        return gv.rows(a.vision, images)

    def check(self, a, bundle):
        d = super().check(a, bundle)
        if a.vision is not None:
            d += [bundle.locate(("model", "vision", f), m) for f, m in a.vision.problems()]
            for k in ("image_token_index", "boi_token_index", "eoi_token_index"):
                if getattr(a.vision, k) >= a.vocab_size:
                    d.append(bundle.locate(("model", "vision", k), f"{k}={getattr(a.vision, k)} is not a "
                                           f"token of the vocabulary (vocab_size={a.vocab_size})"))
        return d

    def from_hf_wrapper(self, config, out):
        v = gv.from_hf(config)
        return out if v is None else {**out, "vision": v}

    def layer_traits(self, a, layer):
        local = a.kinds[layer] == "sliding_attention"
        rope = {"rope_theta": a.rope_local_base_freq, "rope_scaling": None} if local else {}
        return {**super().layer_traits(a, layer), **rope}

    def from_hf(self, config):
        out = super().from_hf(config)
        if "_sliding_window_pattern" in config:  # transformers>=5 spelling
            out.setdefault("sliding_window_pattern", config["_sliding_window_pattern"])
        if "sliding_attention" in (config.get("rope_parameters") or {}):  # transformers>=5: per layer type
            local = base.hf_rope(config, "sliding_attention")
            if local["rope_scaling"]:
                raise InvalidInput(f"config.json: rope_parameters.sliding_attention.rope_type="
                                   f"{local['rope_scaling']['rope_type']!r} is not supported by ttbundle: "
                                   "local layers use unscaled rope")
            out["rope_local_base_freq"] = local.get("rope_theta", 10000.0)
            out.update(base.hf_rope(config, "full_attention"))
        return out

    def to_hf_config(self, a):
        d = super().to_hf_config(a)
        d.pop("vision", None)
        theta, local = d.pop("rope_theta"), d.pop("rope_local_base_freq")
        full = {"rope_type": "default", **(d.pop("rope_scaling", None) or {}), "rope_theta": theta}
        d["rope_parameters"] = {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        if a.vision is None:
            return d
        vc, wrapper = gv.to_hf(a.vision)
        d["architectures"] = ["Gemma3ForCausalLM"]
        return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                "text_config": d, "vision_config": vc, "tie_word_embeddings": a.tie_word_embeddings, **wrapper}
