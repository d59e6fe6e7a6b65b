"""Qwen2 / Qwen2.5: the Llama layout plus biases on the q/k/v projections."""

from __future__ import annotations

from typing import Literal

from . import base
from .base import ArchBase, Family, LayerKind


class Qwen2Arch(ArchBase):
    """Qwen2/Qwen2.5 dims (HF ``Qwen2ForCausalLM``); q/k/v projections always carry a bias."""

    family: Literal["qwen2"] = "qwen2"
    """Model family."""


def reject_sliding(config: dict) -> None:
    """Qwen2/Qwen3 sliding-window attention (off in every published checkpoint) is not implemented."""
    why = "sliding-window attention is not implemented for Qwen (published checkpoints leave it off)"
    base.reject_hf(config, "use_sliding_window", lambda v: not v, why)
    base.reject_hf(config, "layer_types", lambda v: set(v) <= {"full_attention"}, why)


class Qwen2(Family):
    name = "qwen2"
    hf_architectures = ("Qwen2ForCausalLM",)
    arch_model = Qwen2Arch
    summary = "Qwen2 / Qwen2.5 dense; q/k/v bias"
    bias, qk_norm = True, False

    def tensors(self, a):
        L = (0, a.num_hidden_layers)
        return (base.embedding_tensors(a) + base.attention_tensors(a, L, self.bias, self.qk_norm)
                + base.mlp_tensors(a, L) + base.norm_tensors(a, L))

    def default_plan(self, a):
        # bq/bk/bv split over cols with their projection's heads (DENSE_PLAN); a per-head norm
        # weight is one head_dim vector every device needs whole
        return {**base.DENSE_PLAN, "q_norm": (None,), "k_norm": (None,)}

    def layers(self, a):
        return [LayerKind("decoder", a.num_hidden_layers,
                          base.attention_ops(self.bias, self.qk_norm) + base.mlp_ops())]

    def hf_names(self, a):
        return base.standard_hf_names(a, self.bias, self.qk_norm)

    def kv_cache(self, a):
        return base.standard_kv(a, a.num_hidden_layers)

    def from_hf(self, config):
        reject_sliding(config)
        return base.hf_import(self, config)
