"""Qwen2 MoE (HF ``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention
(q/k/v biases, no q/k norm) and Qwen3 MoE's routed experts (softmax top-k, ``norm_topk_prob``),
plus one always-on shared expert whose output a sigmoid gate scales per token:
``sigmoid(x @ shared_gate) * shared_expert(x)``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from . import base, moe
from .base import Dim, HFName, LayerKind, Linear, Local, Residual, TensorDecl
from .qwen3_moe import Qwen3Moe, Qwen3MoeArch


class Qwen2MoeArch(Qwen3MoeArch):
    """Qwen2 MoE dims (HF ``Qwen2MoeForCausalLM``)."""

    family: Literal["qwen2_moe"] = "qwen2_moe"  # type: ignore[assignment]
    """Model family."""
    shared_expert_intermediate_size: int = Field(gt=0)
    """Hidden width of the shared expert (gated per token by ``sigmoid(x @ shared_gate)``)."""
    qkv_bias: bool = True
    """Biases on the q/k/v projections (every published Qwen2 MoE has them)."""


def gated_shared_expert_ops() -> list:
    """The shared expert on the FFN input ``x2``, scaled by ``sigmoid(x2 @ shared_gate)`` (one
    logit per token) before its residual add."""
    return [*base.mlp_ops("shared_")[1:-1], Linear("x2", "shared_gate", "sg"),
            Local(("mlp_out", "sg"), "shared_out", "x sigmoid(shared gate)", fn="sigmoid_gate"),
            Residual("shared_out")]


class Qwen2Moe(Qwen3Moe):
    name = "qwen2_moe"
    hf_model_type = "qwen2_moe"
    hf_architectures = ("Qwen2MoeForCausalLM",)
    hf_router = ("Qwen2MoeTopKRouter", "softmax_topk")
    arch_model = Qwen2MoeArch
    summary = "Qwen1.5-MoE / Qwen2-57B-A14B: Qwen2 attention (q/k/v bias), softmax top-k MoE + gated shared expert"
    hf_keys = tuple(k for k in Qwen3Moe.hf_keys if k != "attention_bias") + (
        "shared_expert_intermediate_size", "qkv_bias")
    #: Qwen2MoeConfig's defaults for keys a config.json may omit (Qwen1.5-MoE's has no qkv_bias)
    hf_defaults = {"intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                   "num_experts": 60, "num_experts_per_tok": 4}

    def tensors(self, a):
        L, k = a.num_hidden_layers, a.dense_layers
        every, moe_layers = (0, L), (k, L)
        t = (base.embedding_tensors(a) + base.attention_tensors(a, every, bias=a.qkv_bias)
             + base.norm_tensors(a, every))
        if k:
            t += base.mlp_tensors(a, (0, k))
        if k < L:
            hid, E = Dim("hidden_size", a.hidden_size), Dim("num_experts", a.num_experts)
            t += [TensorDecl("router", "router", (hid, E), moe_layers, "router logits"),
                  *moe.expert_tensors(a, moe_layers, E, Dim("moe_intermediate_size", a.moe_intermediate_size)),
                  *base.mlp_tensors(a, moe_layers, a.shared_expert_intermediate_size, prefix="shared_"),
                  TensorDecl("shared_gate", "router", (hid, Dim("shared_gate", 1)), moe_layers,
                             "shared expert's gate logit")]
        return t

    def default_plan(self, a):
        # the shared expert as a dense MLP; its gate replicated like the router
        return {**super().default_plan(a), "shared_w1": ("rows", "cols"), "shared_w3": ("rows", "cols"),
                "shared_w2": ("cols", "rows")}

    def layers(self, a):
        attn = base.attention_ops(bias=a.qkv_bias)
        route = "softmax over every expert, top-k" + (", renormalized" if a.norm_topk_prob else "")
        kinds = [LayerKind("dense", a.dense_layers, attn + base.mlp_ops()),
                 LayerKind("moe", a.num_hidden_layers - a.dense_layers,
                           attn + moe.moe_ops(route, "softmax_topk", moe.SWIGLU_EXPERTS) + gated_shared_expert_ops())]
        return [k for k in kinds if k.count]

    def hf_names(self, a):
        p = "model.layers.{i}."
        n = [x for x in base.standard_hf_names(a, bias=a.qkv_bias)
             if a.dense_layers or x.tensor not in ("w1", "w2", "w3")]
        if a.dense_layers < a.num_hidden_layers:
            e = p + "mlp.experts.{e}."
            n += [HFName("router", (p + "mlp.gate.weight",)),
                  HFName("experts_w1", (e + "gate_proj.weight",)), HFName("experts_w3", (e + "up_proj.weight",)),
                  HFName("experts_w2", (e + "down_proj.weight",)),
                  HFName("shared_w1", (p + "mlp.shared_expert.gate_proj.weight",)),
                  HFName("shared_w3", (p + "mlp.shared_expert.up_proj.weight",)),
                  HFName("shared_w2", (p + "mlp.shared_expert.down_proj.weight",)),
                  HFName("shared_gate", (p + "mlp.shared_expert_gate.weight",))]
        return n

    def from_hf(self, config):
        # Qwen2 MoE has no attention_bias key (its q/k/v biases are qkv_bias; o_proj has none)
        return super().from_hf({k: v for k, v in config.items() if k != "attention_bias"})
