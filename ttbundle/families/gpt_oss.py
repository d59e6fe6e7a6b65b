"""GPT-OSS (HF ``GptOssForCausalLM``): GQA attention with q/k/v/o biases and per-head attention
sinks, sliding-window and full attention layers (``layer_types``), YaRN rope, and a MoE FFN in
every layer (biased router, experts with fused gate_up and a clamped SwiGLU)."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from . import base, moe
from .base import ArchBase, Dim, Family, HFName, LayerKind, Linear, Local, Residual, TensorDecl

LAYER_TYPES = ("sliding_attention", "full_attention")


class Mxfp4Quantization(BaseModel):
    """HF ``quantization_config`` of OpenAI's published checkpoints: the routed experts are MXFP4
    (``*_blocks`` + ``*_scales``); ttbundle dequantizes on import (``ttbundle.formats``, which reads
    the checkpoint's own config.json; this record is for a checkpoint without one)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    quant_method: Literal["mxfp4"] = "mxfp4"
    """Quantization method; only MXFP4 experts are read."""
    modules_to_not_convert: list[str] | None = None
    """Modules kept bf16 (attention, router, embeddings, lm_head in the published configs)."""


class GptOssArch(ArchBase):
    """GPT-OSS architecture dims (HF ``GptOssForCausalLM``). ``intermediate_size`` is one expert's
    hidden width; there is no dense MLP."""

    family: Literal["gpt_oss"] = "gpt_oss"
    """Model family."""
    num_local_experts: int = Field(gt=0)
    """Routed experts per layer."""
    num_experts_per_tok: int = Field(default=4, gt=0)
    """Experts each token uses (softmax over the chosen experts' router logits)."""
    sliding_window: int = Field(default=128, gt=0)
    """Tokens a sliding_attention layer attends to."""
    layer_types: list[Literal["sliding_attention", "full_attention"]] | None = None
    """Attention kind of each layer; default: sliding on even layers, full on odd ones (as HF)."""
    swiglu_limit: float = Field(default=7.0, gt=0)
    """Clamp of the experts' gate (above) and up projection (both sides) before the SwiGLU."""
    swiglu_alpha: float = 1.702
    """Sigmoid gain of the experts' SwiGLU: ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    attention_bias: bool = True
    """Biases on the q/k/v/o projections."""
    quantization_config: Mxfp4Quantization | None = None
    """Checkpoint quantization (OpenAI publishes MXFP4 experts); null for a bf16 checkpoint."""

    @property
    def types(self) -> list[str]:
        return self.layer_types or [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]


class GptOss(Family):
    name = "gpt_oss"
    hf_model_type = "gpt_oss"
    hf_architectures = ("GptOssForCausalLM",)
    hf_router = ("GptOssTopKRouter", "topk_softmax")
    arch_model = GptOssArch
    summary = "gpt-oss-20b/120b: attention sinks, alternating sliding/full attention, MoE, YaRN"
    hf_keys = Family.hf_keys + ("num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types",
                                "swiglu_limit", "swiglu_alpha", "attention_bias")

    def tensors(self, a):
        L = (0, a.num_hidden_layers)
        hid, E = Dim("hidden_size", a.hidden_size), Dim("num_local_experts", a.num_local_experts)
        inter = Dim("intermediate_size", a.intermediate_size)
        gate_up = Dim("2*intermediate_size", 2 * a.intermediate_size)  # [gate | up]: split experts, not this

        def vec(name, dims, doc):  # 1-D per layer (2-D for per-expert biases), ROW_MAJOR bf16
            return TensorDecl(name, "norms", dims, L, doc, "vector")

        t = base.embedding_tensors(a) + base.attention_tensors(a, L, bias=a.attention_bias)
        t += base.norm_tensors(a, L)
        t.append(vec("sinks", (base.query_heads(a, 1),), "per-head attention sink logit"))
        if a.attention_bias:
            t.append(vec("bo", (hid,), "output projection bias"))
        return t + [TensorDecl("router", "router", (hid, E), L, "router logits"),
                    vec("router_bias", (E,), "router bias"),
                    TensorDecl("experts_w13", "experts", (E, hid, gate_up), L, "experts' gate | up projections"),
                    vec("experts_b13", (E, gate_up), "experts' gate | up biases"),
                    TensorDecl("experts_w2", "experts", (E, inter, hid), L, "experts' down projections"),
                    vec("experts_b2", (E, hid), "experts' down biases")]

    def default_plan(self, a):
        return {**base.DENSE_PLAN, "sinks": ("cols",), "bo": ("rows",),  # bo: like wo's output
                "experts_w13": (moe.EP, None, None), "experts_w2": (moe.EP, None, None),
                "experts_b13": (moe.EP, None), "experts_b2": (moe.EP, None)}

    def layers(self, a):
        # the shared attention kernel adds q/k/v biases and the sinks; bo follows wo's all-reduce
        attn = [replace(op, what="rope + attention with sinks (+bias; sliding window on sliding layers)")
                if isinstance(op, Local) else op for op in base.attention_ops(bias=a.attention_bias)]
        if a.attention_bias:
            attn[-1:] = [Local(("attn_out",), "attn_ob", "+ o_proj bias", fn="out_bias"), Residual("attn_ob")]
        experts = [Linear("x2", "experts_w13", "egu"),  # [E, 2I] -> [E, I]
                   Local(("egu",), "ea", "clamped SwiGLU (+biases)", fn="clamped_swiglu",
                         out_dim=Dim("intermediate_size", a.intermediate_size))]
        return [LayerKind("decoder", a.num_hidden_layers,
                          attn + moe.moe_ops("top-k of logits, softmax over the chosen", "topk_softmax", experts))]

    def traits(self, a):
        # GptOssRMSNorm multiplies its weight in float32 before the cast (Llama's casts first)
        return {"norm_weight_fp32": True,
                "moe": {"top_k": a.num_experts_per_tok, "swiglu_alpha": a.swiglu_alpha,
                        "swiglu_limit": a.swiglu_limit}}

    def layer_traits(self, a, layer):
        return {"window": a.sliding_window} if a.types[layer] == "sliding_attention" else {}

    def kv_cache(self, a):
        # full-length K and V for every layer; sliding layers would need only sliding_window tokens
        return base.standard_kv(a, a.num_hidden_layers)

    def hf_names(self, a):
        p, e = "model.layers.{i}.", "model.layers.{i}.mlp.experts."
        n = [x for x in base.standard_hf_names(a, bias=a.attention_bias) if x.tensor not in ("w1", "w2", "w3")]
        n += [HFName("sinks", (p + "self_attn.sinks",), "id"),
              HFName("router", (p + "mlp.router.weight",)), HFName("router_bias", (p + "mlp.router.bias",), "id"),
              HFName("experts_b13", (e + "gate_up_proj_bias",), "gate_up_deinterleave"),
              HFName("experts_b2", (e + "down_proj_bias",), "id")]
        if a.attention_bias:
            n.append(HFName("bo", (p + "self_attn.o_proj.bias",), "id"))
        # HF stores experts [E, in, out] already (MXFP4 checkpoints: as ``formats`` decodes them);
        # gate_up interleaves gate and up columns
        return n + [HFName("experts_w13", (e + "gate_up_proj",), "gate_up_deinterleave"),
                    HFName("experts_w2", (e + "down_proj",), "id")]

    def check(self, a, bundle):
        d = []
        if a.layer_types is not None and len(a.layer_types) != a.num_hidden_layers:
            d.append(bundle.locate(("model", "layer_types"), f"has {len(a.layer_types)} entries for "
                                   f"num_hidden_layers={a.num_hidden_layers}; give one per layer"))
        if a.num_experts_per_tok > a.num_local_experts:
            d.append(bundle.locate(("model", "num_experts_per_tok"),
                                   f"num_experts_per_tok={a.num_experts_per_tok} exceeds "
                                   f"num_local_experts={a.num_local_experts}"))
        return d

    def to_hf_config(self, a):
        # the reference holds dequantized weights; rope and layer types explicit because HF's
        # defaults differ from ours (YaRN x32 when rope_parameters is absent)
        d = {k: v for k, v in super().to_hf_config(a).items() if k != "quantization_config"}
        return {**moe.hf_rope_parameters(d, a), "layer_types": a.types}

    def from_hf(self, config):
        base.reject_hf(config, "layer_types", lambda v: set(v) <= set(LAYER_TYPES),
                       f"layer types other than {', '.join(LAYER_TYPES)}")
        out = {**super().from_hf(config), **base.hf_rope(config)}
        q = config.get("quantization_config")
        if q and q.get("quant_method") == "mxfp4":  # others: ``formats`` reads them from config.json
            out["quantization_config"] = {f: q[f] for f in Mxfp4Quantization.model_fields if f in q}
        return out
