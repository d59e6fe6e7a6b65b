"""DeepSeek-V3 (HF ``DeepseekV3ForCausalLM``): multi-head latent attention (MLA) with a compressed
KV cache, first_k_dense_replace dense layers, then MoE layers with group-limited sigmoid routing
over n_routed_experts plus always-on shared experts."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from . import base, moe
from .base import ArchBase, Dim, Family, HFName, KVEntry, LayerKind, Linear, Local, Norm, Residual, TensorDecl


class Fp8Quantization(BaseModel):
    """HF ``quantization_config`` of DeepSeek's published fp8 checkpoints: every Linear weight of the
    decoder layers is e4m3 with one ``weight_scale_inv`` per block; ttbundle dequantizes on import
    (``ttbundle.formats``, which reads the checkpoint's own config.json; this record is for a
    checkpoint without one)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    quant_method: Literal["fp8"] = "fp8"
    """Quantization method; only DeepSeek's block-scaled fp8 is read."""
    fmt: Literal["e4m3"] = "e4m3"
    """fp8 format of the stored weights."""
    weight_block_size: tuple[int, int] = (128, 128)
    """Rows x columns of an HF weight ``[out, in]`` that share one scale."""
    activation_scheme: Literal["dynamic"] = "dynamic"
    """Activation quantization of the original model; ttbundle keeps activations bf16."""


class DeepseekV3Arch(ArchBase):
    """DeepSeek-V3 architecture dims (HF ``DeepseekV3ForCausalLM``). ``intermediate_size`` is the
    dense layers' MLP; ``num_key_value_heads`` and ``head_dim`` do not apply to MLA."""

    family: Literal["deepseek_v3"] = "deepseek_v3"
    """Model family."""
    q_lora_rank: int | None = Field(gt=0)
    """Rank of the query down-projection (q_a_proj); null: a full-rank q_proj."""
    kv_lora_rank: int = Field(gt=0)
    """Width of the compressed KV latent that is cached per token."""
    qk_nope_head_dim: int = Field(gt=0)
    """Per-head query/key dims without rotary embedding."""
    qk_rope_head_dim: int = Field(gt=0)
    """Per-head query/key dims with rotary embedding (the key part is shared by all heads)."""
    v_head_dim: int = Field(gt=0)
    """Per-head value dims."""
    moe_intermediate_size: int = Field(gt=0)
    """Hidden width of one routed (and one shared) expert."""
    n_routed_experts: int = Field(gt=0)
    """Routed experts per MoE layer."""
    n_shared_experts: int = Field(gt=0)
    """Always-on experts per MoE layer, fused into one MLP of moe_intermediate_size * n_shared_experts."""
    num_experts_per_tok: int = Field(default=8, gt=0)
    """Routed experts each token uses."""
    n_group: int = Field(default=8, gt=0)
    """Expert groups for group-limited routing (n_routed_experts / n_group experts each)."""
    topk_group: int = Field(default=4, gt=0)
    """Groups a token may route to (ranked by the sum of each group's top-2 scores)."""
    routed_scaling_factor: float = 2.5
    """Multiplier of the routed experts' combined output."""
    norm_topk_prob: bool = True
    """Renormalize the chosen experts' weights to sum to 1."""
    scoring_func: Literal["sigmoid"] = "sigmoid"
    """Router score function; softmax (DeepSeek-V2) is not implemented."""
    topk_method: Literal["noaux_tc"] = "noaux_tc"
    """Expert selection: top-k of sigmoid scores + e_score_correction_bias within the chosen groups."""
    first_k_dense_replace: int = Field(default=3, ge=0)
    """Leading layers with a dense MLP instead of MoE."""
    moe_layer_freq: Literal[1] = 1
    """Every layer after the dense ones is MoE; other frequencies are not implemented."""
    rope_interleave: bool = True
    """Rotary embedding rotates interleaved pairs (HF permutes q/k rope dims at runtime)."""
    attention_bias: Literal[False] = False
    """Biases on the attention projections: not supported (DeepSeek-V3 has none)."""
    num_nextn_predict_layers: int = Field(default=0, ge=0)
    """Multi-token-prediction modules stored after the decoder layers; not loaded (no speculative
    decoding on TT)."""
    quantization_config: Fp8Quantization | None = None
    """Checkpoint quantization (DeepSeek publishes block fp8); null for a bf16 checkpoint."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers)


class DeepseekV3(Family):
    name = "deepseek_v3"
    hf_model_type = "deepseek_v3"
    hf_architectures = ("DeepseekV3ForCausalLM",)
    hf_router = ("DeepseekV3TopkRouter", "group_topk")
    arch_model = DeepseekV3Arch
    summary = "DeepSeek-V3/R1: MLA with latent KV cache, group-limited sigmoid MoE + shared experts"
    hf_keys = tuple(k for k in Family.hf_keys if k not in ("num_key_value_heads", "head_dim")) + (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
        "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "scoring_func",
        "topk_method", "first_k_dense_replace", "moe_layer_freq", "rope_interleave", "attention_bias",
        "num_nextn_predict_layers")
    # the multi-token-prediction module of the published checkpoint (after 61 decoder layers), as
    # HF's DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected
    hf_ignored = (r"model\.layers\.61\.",)

    def tensors(self, a):
        L, k = a.num_hidden_layers, a.dense_layers
        every, moe_layers = (0, L), (k, L)
        H, hid = a.num_attention_heads, Dim("hidden_size", a.hidden_size)
        kv_r = Dim("kv_lora_rank", a.kv_lora_rank)
        kv_a = Dim("kv_lora_rank+qk_rope_head_dim", a.kv_lora_rank + a.qk_rope_head_dim)
        heads_qk = Dim("num_attention_heads", H, a.qk_head_dim)  # per head: nope | rope
        heads_kv = Dim("num_attention_heads", H, a.qk_nope_head_dim + a.v_head_dim)  # per head: k_nope | v
        heads_v = Dim("num_attention_heads", H, a.v_head_dim)

        def vec(name, dim, doc, layers=every):
            return TensorDecl(name, "norms", (dim,), layers, doc, "vector")

        t = base.embedding_tensors(a) + base.norm_tensors(a, every)
        if a.q_lora_rank:
            q_r = Dim("q_lora_rank", a.q_lora_rank)
            t += [TensorDecl("wq_a", "attention", (hid, q_r), every, "query down-projection"),
                  vec("q_a_norm", q_r, "query latent RMSNorm"),
                  TensorDecl("wq_b", "attention", (q_r, heads_qk), every, "query up-projection")]
        else:
            t.append(TensorDecl("wq", "attention", (hid, heads_qk), every, "query projection"))
        t += [TensorDecl("wkv_a", "attention", (hid, kv_a), every, "down-projection to KV latent | rope key"),
              vec("kv_a_norm", kv_r, "KV latent RMSNorm"),
              TensorDecl("wkv_b", "attention", (kv_r, heads_kv), every, "latent -> per-head key (nope) | value"),
              TensorDecl("wo", "attention", (heads_v, hid), every, "output projection")]
        if k:
            t += base.mlp_tensors(a, (0, k))
        if k < L:
            E = Dim("n_routed_experts", a.n_routed_experts)
            shared = Dim("moe_intermediate_size*n_shared_experts", a.moe_intermediate_size * a.n_shared_experts)
            t += [TensorDecl("router", "router", (hid, E), moe_layers, "router (gate) logits"),
                  vec("e_score_correction_bias", E, "per-expert score bias, for selection only", moe_layers),
                  *moe.expert_tensors(a, moe_layers, E, Dim("moe_intermediate_size", a.moe_intermediate_size)),
                  TensorDecl("shared_w1", "mlp", (hid, shared), moe_layers, "shared experts' gate projection"),
                  TensorDecl("shared_w3", "mlp", (hid, shared), moe_layers, "shared experts' up projection"),
                  TensorDecl("shared_w2", "mlp", (shared, hid), moe_layers, "shared experts' down projection")]
        return t

    def default_plan(self, a):
        # wq_a / wkv_a (to the low ranks) replicated; heads over cols; wkv_b's latent dim replicated
        # so the weight-absorbed decode form (q_nope @ W_UK per head) needs no collective either
        return {**base.DENSE_PLAN, "wq_b": ("rows", "cols"), "wkv_b": (None, "cols"),
                "shared_w1": ("rows", "cols"), "shared_w3": ("rows", "cols"), "shared_w2": ("cols", "rows"),
                **{n: (moe.EP, None, None) for n in ("experts_w1", "experts_w3", "experts_w2")}}

    def layers(self, a):
        q = [Linear("x", "wq_a", "qa"), Norm("qa", "qn", "q_a_norm"), Linear("qn", "wq_b", "q")] \
            if a.q_lora_rank else [Linear("x", "wq", "q")]
        attn = [Norm("h", "x", "attn_norm"), *q, Linear("x", "wkv_a", "kva"),
                Norm("kva", "kvn", "kv_a_norm"),  # normalizes the latent part; the rope key passes (traits)
                # caches kvn (latent | rope key) and expands it with wkv_b, whose heads split like q's
                Local(("q", "kvn"), "o", "MLA: rope + attention over the latent cache (wkv_b)",
                      Dim("num_attention_heads", a.num_attention_heads, a.v_head_dim), fn="mla_attention"),
                Linear("o", "wo", "attn_out"), Residual("attn_out")]
        route = "sigmoid + e_score_correction_bias, group-limited top-k"
        kinds = [LayerKind("dense", a.dense_layers, attn + base.mlp_ops()),
                 LayerKind("moe", a.num_hidden_layers - a.dense_layers,
                           attn + moe.moe_ops(route, "group_topk", moe.SWIGLU_EXPERTS, shared=True))]
        return [k for k in kinds if k.count]

    def traits(self, a):
        return {
            "mla": {"kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
                    "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim,
                    "rope_interleave": a.rope_interleave},
            "moe": {"top_k": a.num_experts_per_tok, "n_group": a.n_group, "topk_group": a.topk_group,
                    "norm_topk_prob": a.norm_topk_prob, "routed_scaling_factor": a.routed_scaling_factor},
            # HF builds the low-rank norms with RMSNorm's default eps, not rms_norm_eps; the KV one
            # sees only the latent (kv_a_proj_with_mqa's first kv_lora_rank outputs)
            "norms": {"q_a_norm": {"eps": 1e-6}, "kv_a_norm": {"eps": 1e-6, "features": a.kv_lora_rank}},
            "linear_fp32": ("router",),  # HF: F.linear on float32 copies of x and the gate weight
        }

    def layer_traits(self, a, layer):
        # HF: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a scaled rope (yarn)
        scale, rs = a.qk_head_dim ** -0.5, a.rope_scaling
        if rs is not None and rs.rope_type != "default" and rs.mscale_all_dim and (rs.factor or 1) > 1:
            scale *= (0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0) ** 2
        return {"attn_scale": scale}

    def kv_cache(self, a):
        # one latent "head" per token, the same on every device (MLA expands it per head on the fly)
        return [KVEntry("kv_latent", Dim("kv_latent", 1), a.kv_lora_rank + a.qk_rope_head_dim, None,
                        a.num_hidden_layers)]

    def hf_names(self, a):
        p, k, L = "model.layers.{i}.", a.dense_layers, a.num_hidden_layers

        def lin(t, key):  # HF Linear weight (fp8 checkpoints: as ``formats`` decodes it)
            return HFName(t, (key + ".weight",))

        mlp = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
        n = [HFName("embed", ("model.embed_tokens.weight",), "id"),
             HFName("final_norm", ("model.norm.weight",), "id"),
             HFName("lm_head", ("model.embed_tokens.weight" if a.tie_word_embeddings else "lm_head.weight",)),
             HFName("attn_norm", (p + "input_layernorm.weight",), "id"),
             HFName("ffn_norm", (p + "post_attention_layernorm.weight",), "id"),
             lin("wkv_a", p + "self_attn.kv_a_proj_with_mqa"),
             HFName("kv_a_norm", (p + "self_attn.kv_a_layernorm.weight",), "id"),
             lin("wkv_b", p + "self_attn.kv_b_proj"), lin("wo", p + "self_attn.o_proj")]
        n += [lin("wq_a", p + "self_attn.q_a_proj"), lin("wq_b", p + "self_attn.q_b_proj"),
              HFName("q_a_norm", (p + "self_attn.q_a_layernorm.weight",), "id")] \
            if a.q_lora_rank else [lin("wq", p + "self_attn.q_proj")]
        if k:
            n += [lin(w, p + f"mlp.{m}") for w, m in mlp]
        if k < L:
            n += [HFName("router", (p + "mlp.gate.weight",)),
                  HFName("e_score_correction_bias", (p + "mlp.gate.e_score_correction_bias",), "id")]
            n += [lin(f"experts_{w}", p + "mlp.experts.{e}." + m) for w, m in mlp]
            n += [lin(f"shared_{w}", p + "mlp.shared_experts." + m) for w, m in mlp]
        return n

    def check(self, a, bundle):
        d = []
        E, g = a.n_routed_experts, a.n_group
        if E % g:
            d.append(bundle.locate(("model", "n_group"), f"n_routed_experts={E} is not divisible by n_group={g}"))
        elif a.topk_group > g:
            d.append(bundle.locate(("model", "topk_group"), f"topk_group={a.topk_group} exceeds n_group={g}"))
        elif a.num_experts_per_tok > a.topk_group * (E // g):
            d.append(bundle.locate(("model", "num_experts_per_tok"),
                                   f"num_experts_per_tok={a.num_experts_per_tok} exceeds the experts of "
                                   f"topk_group={a.topk_group} groups ({a.topk_group} * {E} / {g})"))
        return d

    def to_hf_config(self, a):
        # MLA has no KV heads (HF's default 128 would break its repeat_kv); a null q_lora_rank
        # (full-rank q_proj) must survive exclude_none; the reference holds dequantized weights
        d = {k: v for k, v in super().to_hf_config(a).items() if k != "quantization_config"}
        return {**moe.hf_rope_parameters(d, a), "q_lora_rank": a.q_lora_rank,
                "num_key_value_heads": a.num_attention_heads}

    def from_hf(self, config):
        for key, want, why in (
                ("scoring_func", "sigmoid", "DeepSeek-V3 routing uses sigmoid scores (softmax is DeepSeek-V2's)"),
                ("topk_method", "noaux_tc", "only noaux_tc (group-limited top-k, e_score_correction_bias) is implemented"),
                ("moe_layer_freq", 1, "every layer after first_k_dense_replace must be MoE"),
                ("attention_bias", False, "DeepSeek-V3 attention has no biases")):
            base.reject_hf(config, key, lambda v, w=want: v == w, why)
        # q_lora_rank: null means a full-rank q_proj; absent means HF's default
        out = base.hf_fill(config, {**super().from_hf(config), **base.hf_rope(config)}, {"q_lora_rank": 1536})
        q = config.get("quantization_config")
        if q and q.get("quant_method") == "fp8" and len(q.get("weight_block_size") or ()) == 2:
            # others: ``formats`` reads them from the checkpoint's config.json
            out["quantization_config"] = {f: q[f] for f in Fp8Quantization.model_fields if f in q}
        return out
