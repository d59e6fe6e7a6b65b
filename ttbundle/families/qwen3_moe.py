"""Qwen3 MoE (HF ``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention
(GQA, per-head q/k RMSNorm, no biases) and a mixture-of-experts FFN: a router whose softmax over
every expert picks the top-k (renormalized to sum 1 with ``norm_topk_prob``), SwiGLU experts
sharded expert-parallel over the whole mesh, no shared expert. Layers listed in
``mlp_only_layers`` keep a dense MLP of ``intermediate_size``; ttbundle takes them as leading
layers only (every published Qwen3 MoE has none)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..errors import InvalidInput
from . import base, moe
from .base import ArchBase, Dim, Family, HFName, LayerKind, TensorDecl
from .qwen2 import reject_sliding


class Qwen3MoeArch(ArchBase):
    """Qwen3 MoE dims (HF ``Qwen3MoeForCausalLM``). ``intermediate_size`` is the dense MLP of the
    ``mlp_only_layers`` (unused when every layer is MoE, as in the published models)."""

    family: Literal["qwen3_moe"] = "qwen3_moe"
    """Model family."""
    moe_intermediate_size: int = Field(gt=0)
    """Hidden width of one routed expert."""
    num_experts: int = Field(gt=0)
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = Field(default=8, gt=0)
    """Experts each token uses (the top-k of a softmax over every expert's router logit)."""
    norm_topk_prob: bool = False
    """Renormalize the chosen experts' probabilities to sum to 1 (true in the published models)."""
    decoder_sparse_step: Literal[1] = 1
    """Every layer not in ``mlp_only_layers`` is MoE; other steps (MoE every n-th layer) are not
    implemented."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers with a dense MLP instead of experts: ttbundle takes leading layers only (0, 1, ...)."""
    attention_bias: Literal[False] = False
    """Biases on q/k/v/o projections: not supported (no published Qwen3 MoE has them)."""

    @property
    def dense_layers(self) -> int:
        """Leading layers with a dense MLP (``mlp_only_layers`` = 0 .. n-1; the family's check
        refuses any other set)."""
        return len(set(self.mlp_only_layers))


class Qwen3Moe(Family):
    name = "qwen3_moe"
    hf_model_type = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    hf_router = ("Qwen3MoeTopKRouter", "softmax_topk")
    arch_model = Qwen3MoeArch
    summary = "Qwen3-30B-A3B / 235B-A22B: Qwen3 attention (q/k norm), softmax top-k MoE"
    hf_keys = Family.hf_keys + ("moe_intermediate_size", "num_experts", "num_experts_per_tok",
                                "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "attention_bias")
    #: Qwen3MoeConfig's defaults for the keys a config.json may omit
    hf_defaults = {"intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                   "num_experts_per_tok": 8}

    def tensors(self, a):
        L, k = a.num_hidden_layers, a.dense_layers
        every, moe_layers = (0, L), (k, L)
        t = (base.embedding_tensors(a) + base.attention_tensors(a, every, qk_norm=True)
             + base.norm_tensors(a, every))
        if k:
            t += base.mlp_tensors(a, (0, k))
        if k < L:
            E = Dim("num_experts", a.num_experts)
            t += [TensorDecl("router", "router", (Dim("hidden_size", a.hidden_size), E), moe_layers, "router logits"),
                  *moe.expert_tensors(a, moe_layers, E, Dim("moe_intermediate_size", a.moe_intermediate_size))]
        return t

    def default_plan(self, a):
        # attention as Qwen3 dense; the router replicated (every device routes every token); each
        # device holds whole experts, 1/N of them (expert parallel over the whole mesh)
        return {**base.DENSE_PLAN, "q_norm": (None,), "k_norm": (None,),
                **{n: (moe.EP, None, None) for n in ("experts_w1", "experts_w3", "experts_w2")}}

    def layers(self, a):
        attn = base.attention_ops(qk_norm=True)
        route = "softmax over every expert, top-k" + (", renormalized" if a.norm_topk_prob else "")
        kinds = [LayerKind("dense", a.dense_layers, attn + base.mlp_ops()),
                 LayerKind("moe", a.num_hidden_layers - a.dense_layers,
                           attn + moe.moe_ops(route, "softmax_topk", moe.SWIGLU_EXPERTS))]
        return [k for k in kinds if k.count]

    def traits(self, a):
        return {"moe": {"top_k": a.num_experts_per_tok, "norm_topk_prob": a.norm_topk_prob}}

    def kv_cache(self, a):
        return base.standard_kv(a, a.num_hidden_layers)

    def hf_names(self, a):
        p, e = "model.layers.{i}.", "model.layers.{i}.mlp.experts.{e}."
        n = [x for x in base.standard_hf_names(a, qk_norm=True)
             if a.dense_layers or x.tensor not in ("w1", "w2", "w3")]
        if a.dense_layers < a.num_hidden_layers:
            # the published layout: one Linear per expert (transformers 5 fuses them in memory)
            n += [HFName("router", (p + "mlp.gate.weight",)),
                  HFName("experts_w1", (e + "gate_proj.weight",)), HFName("experts_w3", (e + "up_proj.weight",)),
                  HFName("experts_w2", (e + "down_proj.weight",))]
        return n

    def check(self, a, bundle):
        d, L = [], a.num_hidden_layers
        if a.num_experts_per_tok > a.num_experts:
            d.append(bundle.locate(("model", "num_experts_per_tok"),
                                   f"num_experts_per_tok={a.num_experts_per_tok} exceeds num_experts={a.num_experts}"))
        dense = sorted(set(a.mlp_only_layers))
        if dense and (dense[0] < 0 or dense[-1] >= L):
            d.append(bundle.locate(("model", "mlp_only_layers"),
                                   f"layer {dense[0] if dense[0] < 0 else dense[-1]} is outside 0..{L - 1} "
                                   f"(num_hidden_layers={L})"))
        elif dense != list(range(len(dense))):
            d.append(bundle.locate(("model", "mlp_only_layers"),
                                   f"{dense} are not the leading layers 0..{len(dense) - 1}: ttbundle runs dense "
                                   "MLP layers only before the MoE ones (as DeepSeek's first_k_dense_replace)"))
        return d

    def to_hf_config(self, a):
        d = super().to_hf_config(a)
        return {**d, "mlp_only_layers": list(a.mlp_only_layers)}

    def from_hf(self, config):
        reject_sliding(config)
        base.reject_hf(config, "attention_bias", lambda v: not v, "no published Qwen MoE has q/k/v/o attention_bias")
        base.reject_hf(config, "decoder_sparse_step", lambda v: v == 1,
                       "only every layer MoE (decoder_sparse_step=1, dense layers listed in mlp_only_layers) "
                       "is implemented")
        if "num_experts" not in config and "num_local_experts" in config:  # transformers 5's to_dict
            config = {**config, "num_experts": config["num_local_experts"]}
        out = base.hf_import(self, config, self.hf_defaults)
        if out.get("mlp_only_layers") is not None and not isinstance(out["mlp_only_layers"], list):
            raise InvalidInput(f"config.json: mlp_only_layers={out['mlp_only_layers']!r}: expected a list of "
                               "layer indices")
        return out
