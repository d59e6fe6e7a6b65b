"""Mistral 3 (HF ``Mistral3ForConditionalGeneration``: Mistral-Small-3.1/3.2-24B): the Mistral text
model (the Llama layout, ``mistral``) plus the Pixtral vision encoder, patch merger and projector
(``mistral3_vision``). The text model reads the soft tokens in place of the ``[IMG]`` tokens at
plain positions, causally. Without ``vision`` the arch is the text model only (a multimodal
checkpoint's vision weights are left unused)."""

from __future__ import annotations

from typing import Literal

from . import base
from . import mistral3_vision as mv
from .mistral import Mistral, MistralArch


class Mistral3Arch(MistralArch):
    """Mistral 3 text dims (HF ``text_config``, a MistralConfig) and vision."""

    family: Literal["mistral3"] = "mistral3"
    """Model family."""
    vision: mv.PixtralVision | None = None
    """The Pixtral vision encoder, projector and image tokens; null: text only."""


class Mistral3(Mistral):
    name = "mistral3"
    hf_architectures = ("Mistral3ForConditionalGeneration",)
    vision_class = mv.Mistral3VisionPart
    vision_hf_architecture = "Mistral3ForConditionalGeneration"
    arch_model = Mistral3Arch
    summary = "Mistral 3 (Mistral-Small-3.1/3.2): Mistral text; Pixtral vision encoder with 2-D rope, patch merger"
    hf_model_type = "mistral3"
    # transformers>=5 nests the text model as model.language_model and the vision parts under
    # model.; published checkpoints (transformers 4.50) as language_model.model / language_model.lm_head
    hf_key_renames = ((r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
                      (r"^language_model\.lm_head\.", "lm_head."), (r"^model\.vision_tower\.", "vision_tower."),
                      (r"^model\.multi_modal_projector\.", "multi_modal_projector."))
    hf_ignored = (r"^(vision_tower|multi_modal_projector)\.",)
    # ttnn: the vision program is lowered (backends/ttnn/vision/mistral3.py); the TT device path refuses its
    # images until the device runner fills the host-made rope and mask inputs (as for Qwen2.5-VL)

    def ignored(self, a):
        return () if a is not None and a.vision is not None else self.hf_ignored

    def tensors(self, a):
        t = super().tensors(a)
        return t if a.vision is None else t + mv.tensors(a.vision, a.hidden_size)

    def default_plan(self, a):
        p = super().default_plan(a)
        return p if a.vision is None else {**p, **mv.PLAN}

    def hf_names(self, a):
        n = super().hf_names(a)
        return n if a.vision is None else n + mv.hf_names(a.vision)

    def traits(self, a):
        t = super().traits(a)
        return t if a.vision is None else {**t, "norms": {**t.get("norms", {}), **mv.norms(a.vision, a.rms_norm_eps)}}

    # -- vision ---------------------------------------------------------------------------------
    def vision_programs(self, a):
        return None if a.vision is None else mv.programs(a.vision)

    def vision_inputs(self, a):
        return mv.inputs(a.vision)

    def vision_rows(self, a, bucket: int):
        return mv.rows(a.vision, bucket)

    def check(self, a, bundle):
        d = super().check(a, bundle)
        if a.vision is not None:
            d += [bundle.locate(("model", "vision", f), m) for f, m in a.vision.problems()]
            for k in mv.TOKEN_KEYS:
                if getattr(a.vision, k) >= a.vocab_size:
                    d.append(bundle.locate(("model", "vision", k), f"{k}={getattr(a.vision, k)} is not a "
                                           f"token of the vocabulary (vocab_size={a.vocab_size})"))
        return d

    # -- HF import ------------------------------------------------------------------------------
    def from_hf(self, config):
        return {**super().from_hf(config), "family": self.name}

    def from_hf_wrapper(self, config, out):
        base.reject_hf(config, "multimodal_projector_bias", lambda v: not v,
                       "no published Mistral 3 has projector biases")
        base.reject_hf(config, "vision_feature_layer", lambda v: v == -1,
                       "the projector reads the last vision layer's output (-1) only")
        v = mv.from_hf(config)
        if config.get("tie_word_embeddings") is not None:  # HF's Mistral3ForConditionalGeneration ties by it
            out = {**out, "tie_word_embeddings": config["tie_word_embeddings"]}
        return out if v is None else {**out, "vision": v}

    def tiny_vision(self, a):
        """The smallest vision encoder (HF's class needs one, for a text-only arch)."""
        return mv.PixtralVision(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
                                image_size=32, patch_size=4, **{k: min(a.vocab_size - 1 - i,
                                                                        mv.PixtralVision.model_fields[k].default)
                                                                 for i, k in enumerate(mv.TOKEN_KEYS)})

    def to_hf_config(self, a):
        text = super().to_hf_config(a)
        text.pop("vision", None)
        text.pop("architectures", None)
        text["model_type"] = "mistral"
        vc, wrapper = mv.to_hf(a.vision or self.tiny_vision(a))
        return {"model_type": self.hf_model_type, "architectures": list(self.hf_architectures),
                "text_config": text, "vision_config": vc, "tie_word_embeddings": a.tie_word_embeddings, **wrapper}
