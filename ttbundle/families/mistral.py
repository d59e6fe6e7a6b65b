"""Mistral 7B (v0.1-v0.3): the Llama layout with optional sliding-window attention."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from . import base
from .base import ArchBase, Family
from .llama import Llama


class MistralArch(ArchBase):
    """Mistral dims (HF ``MistralForCausalLM``)."""

    family: Literal["mistral"] = "mistral"
    """Model family."""
    sliding_window: int | None = Field(default=None, gt=0)
    """Each token attends to at most this many tokens (v0.1: 4096); null: full causal attention
    (v0.2, v0.3). The KV cache still holds max_model_len tokens per sequence."""


class Mistral(Llama):
    """The Llama layout and dataflow; only the window differs."""

    name = "mistral"
    hf_architectures = ("MistralForCausalLM",)
    arch_model = MistralArch
    summary = "Mistral 7B v0.1-v0.3; sliding-window attention"
    hf_keys = Family.hf_keys + ("sliding_window",)
    hf_defaults = {"sliding_window": 4096}  # MistralConfig's; v0.2+ write an explicit null

    def layer_traits(self, a, layer):
        return {"window": a.sliding_window}

    def from_hf(self, config):
        return base.hf_import(self, config, self.hf_defaults)

    def to_hf_config(self, a):
        return {**super().to_hf_config(a), "sliding_window": a.sliding_window}  # null is meaningful
