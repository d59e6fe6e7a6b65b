"""Qwen3 dense: the Llama layout plus a per-head RMSNorm on q and k (before rope), no biases."""

from __future__ import annotations

from typing import Literal

from . import base
from .base import ArchBase
from .qwen2 import Qwen2, reject_sliding


class Qwen3Arch(ArchBase):
    """Qwen3 dims (HF ``Qwen3ForCausalLM``); head_dim is explicit (128) and independent of hidden_size."""

    family: Literal["qwen3"] = "qwen3"
    """Model family."""


class Qwen3(Qwen2):
    name = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    arch_model = Qwen3Arch
    summary = "Qwen3 dense; per-head q/k RMSNorm"
    bias, qk_norm = False, True

    def from_hf(self, config):
        reject_sliding(config)
        base.reject_hf(config, "attention_bias", lambda v: not v, "no published Qwen3 has q/k/v/o biases")
        return base.hf_import(self, config)
