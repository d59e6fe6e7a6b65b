"""Gemma 2: GQA with logit soft-capping, alternating local (sliding-window) / global layers,
RMSNorm before *and after* attention and MLP, GeGLU, (1 + w) norms, sqrt(hidden)-scaled and tied
embeddings."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import Field

from . import base
from .base import ArchBase, Family, HFName, LayerKind, Local, Norm, Residual

AttentionKind = Literal["sliding_attention", "full_attention"]


class GemmaArch(ArchBase):
    """Fields Gemma 2 and Gemma 3 share (not a family by itself)."""

    hidden_act: Literal["gelu_pytorch_tanh", "gelu"] = "gelu_pytorch_tanh"
    """GeGLU activation (HF ``hidden_activation``)."""
    tie_word_embeddings: bool = True
    """LM head shares the embedding matrix (every published Gemma)."""
    query_pre_attn_scalar: int = Field(default=256, gt=0)
    """Attention scores are scaled by query_pre_attn_scalar**-0.5, not head_dim**-0.5."""
    sliding_window: int | None = Field(default=4096, gt=0)
    """Tokens a local (sliding_attention) layer attends to; null: local layers attend to all."""
    layer_types: tuple[AttentionKind, ...] | None = None
    """Attention kind of each layer; default: the family's pattern."""
    attn_logit_softcapping: float | None = Field(default=None, gt=0)
    """Attention scores become cap * tanh(score / cap); null: no capping."""
    final_logit_softcapping: float | None = Field(default=None, gt=0)
    """Output logits become cap * tanh(logit / cap); null: no capping."""

    def default_kind(self, layer: int) -> str:
        raise NotImplementedError

    @property
    def kinds(self) -> tuple[str, ...]:
        """Attention kind of every layer."""
        return self.layer_types or tuple(map(self.default_kind, range(self.num_hidden_layers)))


class Gemma2Arch(GemmaArch):
    """Gemma 2 dims (HF ``Gemma2ForCausalLM``)."""

    family: Literal["gemma2"] = "gemma2"
    """Model family."""
    attn_logit_softcapping: float | None = Field(default=50.0, gt=0)
    """Attention scores become cap * tanh(score / cap); null: no capping."""
    final_logit_softcapping: float | None = Field(default=30.0, gt=0)
    """Output logits become cap * tanh(logit / cap); null: no capping."""

    def default_kind(self, layer: int) -> str:
        return "full_attention" if layer % 2 else "sliding_attention"


# canonical name -> HF module; ffn_norm is the pre-MLP norm as in Llama (whose HF name for it,
# post_attention_layernorm, is Gemma's norm *after* attention)
NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "post_ffn_norm": "post_feedforward_layernorm"}


def post_norm(ops: list, norm: str) -> list:
    """A residual branch whose output goes through RMSNorm ``norm`` before the residual add."""
    *body, res = ops
    return body + [Norm(res.x, res.x + "_normed", norm), Residual(res.x + "_normed")]


class Gemma2(Family):
    name = "gemma2"
    hf_architectures = ("Gemma2ForCausalLM",)
    arch_model = Gemma2Arch
    summary = "Gemma 2; soft-capping, local/global layers, sandwich norms"
    qk_norm = False
    hf_keys = Family.hf_keys + ("query_pre_attn_scalar", "sliding_window", "layer_types",
                                "attn_logit_softcapping", "final_logit_softcapping")
    # Gemma2Config's defaults for keys a config.json may omit (null stays null: disabled)
    hf_defaults = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

    def tensors(self, a):
        L = (0, a.num_hidden_layers)
        return (base.embedding_tensors(a) + base.attention_tensors(a, L, qk_norm=self.qk_norm)
                + base.mlp_tensors(a, L) + base.norm_tensors(a, L, tuple(NORMS)))

    def default_plan(self, a):
        return {**base.DENSE_PLAN, "q_norm": (None,), "k_norm": (None,)}

    def layers(self, a):
        mlp = [replace(o, what="GeGLU") if isinstance(o, Local) else o for o in base.mlp_ops()]
        return [LayerKind("decoder", a.num_hidden_layers,
                          post_norm(base.attention_ops(qk_norm=self.qk_norm), "post_attn_norm")
                          + post_norm(mlp, "post_ffn_norm"))]

    def traits(self, a):
        return {"norm_offset": 1.0, "embed_scale": a.hidden_size ** 0.5,
                "final_softcap": a.final_logit_softcapping}

    def layer_traits(self, a, layer):
        local = a.kinds[layer] == "sliding_attention"
        return {"window": a.sliding_window if local else None, "attn_scale": a.query_pre_attn_scalar ** -0.5,
                "attn_softcap": a.attn_logit_softcapping}

    def hf_names(self, a):
        p = "model.layers.{i}."
        return ([n for n in base.standard_hf_names(a, qk_norm=self.qk_norm) if n.tensor not in NORMS]
                + [HFName(t, (f"{p}{k}.weight",), "id") for t, k in NORMS.items()])

    def kv_cache(self, a):
        return base.standard_kv(a, a.num_hidden_layers)

    def check(self, a, bundle):
        if a.layer_types is not None and len(a.layer_types) != a.num_hidden_layers:
            return [bundle.locate(("model", "layer_types"), f"has {len(a.layer_types)} entries but "
                                  f"num_hidden_layers={a.num_hidden_layers}; give one per layer")]
        return []

    def from_hf(self, config):
        base.reject_hf(config, "attention_bias", lambda v: not v, "no published Gemma has attention biases")
        base.reject_hf(config, "use_bidirectional_attention", lambda v: not v,
                       "bidirectional (encoder) attention is not supported")
        return base.hf_import(self, config, self.hf_defaults)

    def to_hf_config(self, a):
        d = super().to_hf_config(a)
        d["hidden_activation"] = d.pop("hidden_act")
        d["layer_types"] = list(a.kinds)
        # null disables these; left out, HF's defaults would switch them on
        return d | {k: getattr(a, k) for k in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")}
