"""Llama 2/3.x (incl. llama3 rope scaling): RMSNorm, GQA attention with rope, SwiGLU MLP."""

from __future__ import annotations

from typing import Literal

from . import base
from .base import ArchBase, Family, LayerKind


class LlamaArch(ArchBase):
    """Llama architecture dims (HF ``LlamaForCausalLM``)."""

    family: Literal["llama"] = "llama"
    """Model family."""
    attention_bias: Literal[False] = False
    """Biases on q/k/v/o projections: not supported (no published Llama uses them)."""


class Llama(Family):
    name = "llama"
    hf_architectures = ("LlamaForCausalLM",)
    arch_model = LlamaArch
    summary = "Llama 2/3.x; llama3 and linear rope scaling"
    hf_keys = Family.hf_keys + ("attention_bias",)

    def tensors(self, a):
        L = (0, a.num_hidden_layers)
        return (base.embedding_tensors(a) + base.attention_tensors(a, L)
                + base.mlp_tensors(a, L) + base.norm_tensors(a, L))

    def default_plan(self, a):
        return dict(base.DENSE_PLAN)

    def layers(self, a):
        return [LayerKind("decoder", a.num_hidden_layers,
                          base.attention_ops() + base.mlp_ops())]

    def from_hf(self, config):
        return base.hf_import(self, config)

    def hf_names(self, a):
        return base.standard_hf_names(a)

    def kv_cache(self, a):
        return base.standard_kv(a, a.num_hidden_layers)
