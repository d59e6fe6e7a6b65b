"""Qwen3-VL (HF ``Qwen3VLForConditionalGeneration``): the Qwen3 text model (per-head q/k RMSNorm,
no biases) with interleaved M-RoPE and DeepStack, plus the vision transformer, patch merger and
DeepStack mergers (``qwen3_vl_vision``).

Interleaved M-RoPE: the head's rotary frequencies take the temporal, height and width positions
in turn (frequency j: height where j % 3 == 1 and j < 3 x mrope_section[1], width where
j % 3 == 2 and j < 3 x mrope_section[2], else temporal), as HF's ``Qwen3VLTextRotaryEmbedding``
does (``tables.mrope_rows``). The prompt's positions are Qwen2.5-VL's rule (one owner,
``patch_grid.mrope_positions``). DeepStack: after text layer ``k`` (k < the count of
``vision.deepstack_visual_indexes``) the image tokens' hidden states add the k-th DeepStack
features of their image (a ``deepstack`` step then a residual add in every text layer: zeros
where there is nothing to add). Everything else is Qwen2.5-VL's family (``qwen2_5_vl``), which
this one extends. Without ``vision`` the arch is the text model only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import Field

from . import qwen3_vl_vision as q3
from .base import ArchBase, Local, Residual
from .qwen2 import reject_sliding
from .qwen2_5_vl import Qwen25VL
from . import base


class Qwen3VLArch(ArchBase):
    """Qwen3-VL text dims (HF ``text_config``) and vision."""

    family: Literal["qwen3_vl"] = "qwen3_vl"
    """Model family."""
    mrope_section: tuple[int, ...] = (24, 20, 20)
    """Rotary frequencies (head_dim / 2 in all) rotated by the temporal, height and width positions
    (interleaved)."""
    vision: q3.Qwen3Vision | None = None
    """The vision transformer and image tokens; null: text only."""
    max_position_embeddings: int = Field(default=262144, gt=0)
    """Longest context the model supports."""


class Qwen3VL(Qwen25VL):
    name = "qwen3_vl"
    hf_architectures = ("Qwen3VLForConditionalGeneration",)
    vision_class = q3.Qwen3VisionPart
    vision_hf_architecture = "Qwen3VLForConditionalGeneration"
    arch_model = Qwen3VLArch
    summary = ("Qwen3-VL: Qwen3 text with interleaved M-RoPE and DeepStack; vision transformer with learned "
               "position embedding, patch merger")
    hf_model_type = "qwen3_vl"
    hf_text_model_type = "qwen3_vl_text"
    bias, qk_norm = False, True
    vision_module = q3
    mrope_extra = {"mrope_interleaved": True}

    def layers(self, a):
        kinds = super().layers(a)
        if a.vision is None:
            return kinds
        ds = Local(("h",), "ds", f"DeepStack: + the images' features of vision layer "
                   f"{list(a.vision.deepstack_visual_indexes)}[layer] at the image tokens (layers < "
                   f"{a.vision.deepstack}; zeros elsewhere)", fn="deepstack")
        return [replace(kinds[0], ops=list(kinds[0].ops) + [ds, Residual("ds")])]

    def check(self, a, bundle):
        d = super().check(a, bundle)
        if a.vision is not None and a.vision.deepstack > a.num_hidden_layers:
            d.append(bundle.locate(("model", "vision", "deepstack_visual_indexes"),
                                   f"{a.vision.deepstack} DeepStack sets need as many text layers; the text "
                                   f"model has num_hidden_layers={a.num_hidden_layers}"))
        return d

    def from_hf(self, config):
        reject_sliding(config)
        base.reject_hf(config, "attention_bias", lambda v: not v, "no published Qwen3-VL has q/k/v/o biases")
        return super().from_hf(_plain_rope(config))

    def from_hf_wrapper(self, config, out):
        return super().from_hf_wrapper(_plain_rope(config), out)

    def to_hf_config(self, a):
        cfg = super().to_hf_config(a)
        cfg["text_config"]["head_dim"] = a.hd  # HF's default is 128, not hidden / heads
        return cfg

    def tiny_vision(self, a):
        return q3.Qwen3Vision(depth=1, hidden_size=16, intermediate_size=16, num_heads=1, num_position_embeddings=4,
                              deepstack_visual_indexes=(), out_hidden_size=a.hidden_size,
                              **{k: min(a.vocab_size - 1 - i, q3.Qwen3Vision.model_fields[k].default)
                                 for i, k in enumerate(q3.HF_WRAPPER_KEYS)})


def _plain_rope(config: dict) -> dict:
    """``config`` without ``mrope_interleaved`` in its rope dicts: Qwen3-VL's text rope always
    interleaves (HF's ``Qwen3VLTextRotaryEmbedding`` does whatever the flag says)."""
    config = dict(config)
    for key in ("rope_scaling", "rope_parameters"):
        rp = config.get(key)
        if isinstance(rp, dict) and "mrope_interleaved" in rp:
            config[key] = {k: x for k, x in rp.items() if k != "mrope_interleaved"}
    return config
