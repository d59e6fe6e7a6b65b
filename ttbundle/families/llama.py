"""Llama 2/3.x (incl. llama3 rope scaling): RMSNorm, GQA attention with rope, SwiGLU MLP."""

from __future__ import annotations

from typing import Literal

from . import base
from .base import ArchBase, Family, LayerKind


class LlamaArch(ArchBase):
    """Llama architecture dims (HF ``LlamaForCausalLM``)."""

    family: Literal["llama"] = "llama"
    """Model family."""
    attention_bias: bool = False
    """Biases on q/k/v/o projections (off for every published Llama)."""


class Llama(Family):
    name = "llama"
    hf_architectures = ("LlamaForCausalLM",)
    arch_model = LlamaArch
    summary = "Llama 2/3.x; llama3 and linear rope scaling"
    hf_keys = Family.hf_keys + ("attention_bias",)

    def tensors(self, a):
        L = a.num_hidden_layers
        return (base.embedding_tensors(a) + base.attention_tensors(a, L, bias=a.attention_bias)
                + base.mlp_tensors(a, L) + base.norm_tensors(a, L))

    def default_plan(self, a):
        return dict(base.DENSE_PLAN)

    def layers(self, a):
        return [LayerKind("decoder", a.num_hidden_layers,
                          base.attention_ops(bias=a.attention_bias) + base.mlp_ops())]

    def kv_cache(self, a):
        return base.standard_kv(a, a.num_hidden_layers)
