"""Qwen2.5-VL (HF ``Qwen2_5_VLForConditionalGeneration``): the Qwen2 text model with M-RoPE, plus
the vision transformer and patch merger (``qwen2_5_vl_vision``).

M-RoPE: every token has three rope positions (temporal, height, width); ``mrope_section`` splits
the head's rotary frequencies among them (the first ``mrope_section[0]`` frequencies rotate by
the temporal position, the next by the height, the last by the width), as HF's
``apply_multimodal_rotary_pos_emb`` does. Text tokens have equal positions in the three rows, so a
text-only prompt is ordinary rope; image placeholders take their merge block's grid position
(``patch_grid.mrope_positions``, the one owner of the rule). Without ``vision`` the arch is
the text model only (a multimodal checkpoint's vision weights are left unused)."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import Field

from . import base
from . import qwen2_5_vl_vision as qv
from .base import ArchBase, Local
from .qwen2 import Qwen2


class Qwen25VLArch(ArchBase):
    """Qwen2.5-VL text dims (HF ``text_config``, or the flat published config.json) and vision."""

    family: Literal["qwen2_5_vl"] = "qwen2_5_vl"
    """Model family."""
    mrope_section: tuple[int, ...] = (16, 24, 24)
    """Rotary frequencies (head_dim / 2 in all) rotated by the temporal, height and width positions."""
    vision: qv.Qwen25Vision | None = None
    """The vision transformer and image tokens; null: text only."""
    max_position_embeddings: int = Field(default=128000, gt=0)
    """Longest context the model supports."""


def _mrope(config: dict) -> tuple[dict, list | None]:
    """``config`` with its rope dicts' M-RoPE marks removed (``rope_type: mrope`` is the default
    rope with ``mrope_section``) and the section they gave."""
    config, section = dict(config), None
    for key in ("rope_scaling", "rope_parameters"):
        rp = config.get(key)
        if isinstance(rp, dict):
            rp = dict(rp)
            section = rp.pop("mrope_section", None) or section
            if rp.get("rope_type", rp.get("type")) == "mrope":
                rp.pop("type", None)
                rp["rope_type"] = "default"
            config[key] = rp
    return config, section


class Qwen25VL(Qwen2):
    name = "qwen2_5_vl"
    vision_class = qv.Qwen25VisionPart
    vision_hf_architecture = "Qwen2_5_VLForConditionalGeneration"
    hf_architectures = ("Qwen2_5_VLForConditionalGeneration",)
    arch_model = Qwen25VLArch
    summary = "Qwen2.5-VL: Qwen2 text with M-RoPE; vision transformer with window attention, patch merger"
    hf_model_type = "qwen2_5_vl"
    # transformers>=5 may nest the text model in memory; checkpoints keep model.layers / visual.
    hf_key_renames = ((r"^model\.language_model\.", "model."), (r"^model\.visual\.", "visual."))
    hf_ignored = (r"^visual\.",)
    #: the vision part's module (declarations, dataflow, HF config) and HF's text config type
    vision_module = qv
    hf_text_model_type = "qwen2_5_vl_text"
    #: the text rope's M-RoPE layout beyond ``mrope_section`` (traits and HF's rope_parameters)
    mrope_extra: dict = {}

    def ignored(self, a):
        return () if a is not None and a.vision is not None else self.hf_ignored

    def layers(self, a):
        # the attention's rope is M-RoPE: each token's three positions (``rope_positions``)
        kinds = super().layers(a)
        ops = [replace(o, what=o.what.replace("rope", "M-RoPE (temporal, height, width)", 1))
               if isinstance(o, Local) and o.kernel == "attention" else o for o in kinds[0].ops]
        return [replace(kinds[0], ops=ops)]

    def tensors(self, a):
        t = super().tensors(a)
        return t if a.vision is None else t + self.vision_module.tensors(a.vision, a.hidden_size)

    def default_plan(self, a):
        p = super().default_plan(a)
        return p if a.vision is None else {**p, **self.vision_module.PLAN}

    def hf_names(self, a):
        n = super().hf_names(a)
        return n if a.vision is None else n + self.vision_module.hf_names(a.vision)

    def traits(self, a):
        t = {**super().traits(a), "mrope_section": list(a.mrope_section), **self.mrope_extra}
        return t if a.vision is None else {**t, "norms": {**t.get("norms", {}), **self.vision_module.norms(a.vision)}}

    # -- vision ---------------------------------------------------------------------------------
    def vision_programs(self, a):
        return None if a.vision is None else self.vision_module.programs(a.vision)

    def vision_inputs(self, a):
        return self.vision_module.inputs(a.vision)

    def vision_rows(self, a, bucket: int):
        return self.vision_module.rows(a.vision, bucket)

    def check(self, a, bundle):
        d = super().check(a, bundle)
        if sum(a.mrope_section) != a.hd // 2:
            d.append(bundle.locate(("model", "mrope_section"), f"mrope_section={list(a.mrope_section)} sums to "
                                   f"{sum(a.mrope_section)} but a head has head_dim / 2 = {a.hd // 2} rotary "
                                   "frequencies; give sections that sum to it"))
        if a.vision is not None:
            d += [bundle.locate(("model", "vision", f), m) for f, m in a.vision.problems()]
            for k in self.vision_module.HF_WRAPPER_KEYS:
                if getattr(a.vision, k) >= a.vocab_size:
                    d.append(bundle.locate(("model", "vision", k), f"{k}={getattr(a.vision, k)} is not a "
                                           f"token of the vocabulary (vocab_size={a.vocab_size})"))
            if a.vision.out_hidden_size != a.hidden_size:
                d.append(bundle.locate(("model", "vision", "out_hidden_size"),
                                       f"out_hidden_size={a.vision.out_hidden_size} must equal the text "
                                       f"model's hidden_size={a.hidden_size} (soft tokens replace embeddings)"))
        return d

    # -- HF import ------------------------------------------------------------------------------
    def from_hf(self, config):
        config, section = _mrope(config)
        out = super().from_hf(config)
        out["family"] = self.name
        if section is not None:
            out["mrope_section"] = list(section)
        if "vision_config" in config:  # the flat published config.json: vision beside the text dims
            out = self.from_hf_wrapper(config, out)
        return out

    def from_hf_wrapper(self, config, out):
        v = self.vision_module.from_hf(config)
        if "mrope_section" not in out:
            _, section = _mrope(config)
            if section is not None:
                out = {**out, "mrope_section": list(section)}
        return out if v is None else {**out, "vision": v}

    def tiny_vision(self, a):
        """The smallest vision tower (for HF's class, which needs one, of a text-only arch)."""
        return qv.Qwen25Vision(depth=1, hidden_size=16, intermediate_size=16, num_heads=1,
                               out_hidden_size=a.hidden_size, fullatt_block_indexes=(0,),
                               **{k: min(a.vocab_size - 1 - i, qv.Qwen25Vision.model_fields[k].default)
                                  for i, k in enumerate(qv.HF_WRAPPER_KEYS)})

    def to_hf_config(self, a):
        d = a.model_dump(exclude={"family", "vision", "mrope_section", "rope_theta", "rope_scaling"},
                         exclude_none=True)
        d["model_type"] = self.hf_text_model_type
        d.update(bos_token_id=None, eos_token_id=None)  # HF's defaults are Qwen's ids, outside a small vocabulary
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": a.rope_theta,
                                "mrope_section": list(a.mrope_section), **self.mrope_extra}
        # a text-only arch still needs a vision tower in HF's class: the smallest one (unused)
        v = a.vision or self.tiny_vision(a)
        vc, wrapper = self.vision_module.to_hf(v)
        return {"model_type": self.hf_model_type, "architectures": list(self.hf_architectures), "text_config": d,
                "vision_config": vc, "tie_word_embeddings": a.tie_word_embeddings, **wrapper}
