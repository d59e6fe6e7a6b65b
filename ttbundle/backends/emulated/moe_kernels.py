"""Per-device kernels of the mixture-of-experts families: MLA attention over the latent KV cache,
expert routing, GPT-OSS's clamped SwiGLU, the expert Combine.

Same contract as ``kernels.py`` (device-batched ``[D, T, features]`` locals, a :class:`Ctx`, no
data crossing devices); collected with it in ``kernel_table.KERNELS``. What
differs between families is data from the family's ``traits``: ``traits["mla"]`` (latent rank,
head dims, interleaved rope) and ``traits["moe"]`` (top-k, groups, scaling, SwiGLU clamp).

The router kernels return ``route`` ``[D, T, E]``, each token's weight for every global expert (0
for experts it does not use, float32 as HF keeps them). The expert matmuls
(``EmulatedModel._experts``) compute only the (token, expert) pairs ``route`` chose, one local
expert's matrix at a time (as transformers' eager experts loop over the experts hit), into
``[D, T, E_local, ...]`` activations that are zero elsewhere; the Combine weights them by the
device's slice of ``route``, leaving a partial sum over the expert-parallel axes for the plan's
all-reduce. Tensor and activation names follow ``families.moe``.
"""

from __future__ import annotations

import torch

from .kernels import Ctx, _mask, _rope_tables, _writes, apply_rope

ROUTE = "route"  # the router kernel's output activation (families.moe.moe_ops)
EXPERTS_OUT = "experts_w2"  # its expert dim says which experts a device holds
EXPERTS_IN_BIAS = "experts_b13"  # optional: GPT-OSS's gate | up bias [E, 2I]
EXPERTS_OUT_BIAS = "experts_b2"  # optional: GPT-OSS's down bias [E, H]
LATENT_CACHE = "kv_latent"  # MLA's one cache entry per token: normalized latent | rope key


# ---- MLA --------------------------------------------------------------------------------------
def _deinterleave(x):
    """Rope dims stored as interleaved pairs (x0, x1), (x2, x3), ... -> [evens | odds], after which
    the rotate-half rope is HF's ``apply_rotary_pos_emb_interleave`` term for term."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def mla_attention(ctx: Ctx, layer: int, q, kvn):
    """Multi-head latent attention over the paged latent cache.

    q [D, T, H_local * (nope + rope)]; kvn [D, T, kv_lora_rank + rope]: the normalized latent and
    the (not yet rotated) shared rope key. The cache keeps ``latent | rotated rope key`` per token,
    one copy on every device. ``wkv_b`` [D, rank, H_local * (nope + v)] expands the cached latents:
    prefill materializes per-head keys and values (as HF does), decode absorbs ``W_UK`` into the
    query and ``W_UV`` into the output so the context stays in latent space (as the device does).
    Returns [D, T, H_local * v]."""
    m, lt = ctx.traits["mla"], ctx.layer_traits[layer]
    r, nope, rope, vd = m["kv_lora_rank"], m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
    D, T = q.shape[:2]
    q = q.view(D, T, -1, nope + rope)
    H = q.shape[2]
    wkv = ctx.weights("wkv_b", layer)
    if wkv.shape[-1] != H * (nope + vd):
        raise ValueError(f"mla_attention: wkv_b holds {wkv.shape[-1] // (nope + vd)} heads per device but "
                         f"the query {H}; split wkv_b's heads like wq_b's")
    wkv = wkv.view(D, r, H, nope + vd)
    w_uk, w_uv = wkv[..., :nope], wkv[..., nope:]  # [D, r, H, nope], [D, r, H, v]

    cos, sin = _rope_tables(ctx, rope, lt["rope_theta"], lt.get("rope_scaling"))
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    latent, k_rope = kvn[..., :r], kvn[..., r:]
    if m.get("rope_interleave"):
        q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
    q_rope = apply_rope(q_rope, cos, sin)
    k_rope = apply_rope(k_rope[:, :, None], cos, sin)[:, :, 0]

    cache = ctx.kv[layer][LATENT_CACHE][:, 0]  # [D, 1, slots, r + rope] -> [D, slots, r + rope]
    wsel, wslots = _writes(ctx)
    new = torch.cat([latent, k_rope], dim=-1)
    cache[:, wslots] = ctx.stored(new if wsel is None else new[:, wsel]).to(cache.dtype)

    N, Tq = ctx.positions.shape
    C = cache[:, ctx.context_slots].to(q.dtype)  # [D, N, S, r + rope]
    c_lat, c_rope = C[..., :r], C[..., r:]
    scale = lt.get("attn_scale", (nope + rope) ** -0.5)
    mask = ~_mask(ctx, None)[None, :, None]  # [1, N, 1, Tq, S]
    if Tq > 1:  # prefill: per-head keys [nope | shared rope] and values from the latents
        k_nope = torch.einsum("dnsr,drhe->dnshe", c_lat, w_uk)
        k = torch.cat([k_nope, c_rope[:, :, :, None].expand(-1, -1, -1, H, -1)], dim=-1)
        v = torch.einsum("dnsr,drhe->dnshe", c_lat, w_uv)
        qq = torch.cat([q_nope, q_rope], dim=-1).view(D, N, Tq, H, nope + rope)
        scores = torch.einsum("dnqhe,dnshe->dnhqs", qq, k) * scale
        p = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), dim=-1).to(q.dtype)
        o = torch.einsum("dnhqs,dnshe->dnqhe", p, v)
    else:  # decode: attend in latent space
        q_lat = torch.einsum("dthe,drhe->dthr", q_nope, w_uk).view(D, N, Tq, H, r)
        scores = (torch.einsum("dnqhr,dnsr->dnhqs", q_lat, c_lat)
                  + torch.einsum("dnqhe,dnse->dnhqs", q_rope.view(D, N, Tq, H, rope), c_rope)) * scale
        p = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), dim=-1).to(q.dtype)
        o_lat = torch.einsum("dnhqs,dnsr->dnqhr", p, c_lat)
        o = torch.einsum("dnqhr,drhe->dnqhe", o_lat, w_uv)
    return o.reshape(D, T, H * vd)


# ---- routing ----------------------------------------------------------------------------------
def _dense(weights, index, E: int):
    """[..., k] weights at expert ``index`` -> [..., E] (zeros elsewhere)."""
    return torch.zeros(*index.shape[:-1], E, dtype=weights.dtype, device=weights.device).scatter(-1, index, weights)


def group_topk(ctx: Ctx, layer: int, scores):
    """DeepSeek-V3 ``noaux_tc`` routing of router logits [D, T, E] (HF ``DeepseekV3TopkRouter``):
    sigmoid scores; selection on scores + ``e_score_correction_bias`` limited to the ``topk_group``
    groups with the largest sum of their top-2; weights are the chosen raw scores, renormalized
    (``norm_topk_prob``) and times ``routed_scaling_factor``. Float32 throughout, as HF."""
    m = ctx.traits["moe"]
    E, G = scores.shape[-1], m["n_group"]
    s = scores.float().sigmoid()
    choice = s + ctx.weights("e_score_correction_bias", layer).float()[:, None, :]
    groups = choice.view(*choice.shape[:-1], G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [D, T, G]
    keep = _dense(torch.ones_like(groups), groups.topk(m["topk_group"], dim=-1, sorted=False)[1], G)
    keep = keep.bool()[..., None].expand(*groups.shape, E // G).reshape(choice.shape)
    idx = choice.masked_fill(~keep, float("-inf")).topk(m["top_k"], dim=-1, sorted=False)[1]
    w = s.gather(-1, idx)
    if m.get("norm_topk_prob"):
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return _dense(w * m.get("routed_scaling_factor", 1.0), idx, E)


def topk_softmax(ctx: Ctx, layer: int, scores):
    """GPT-OSS routing (HF ``GptOssTopKRouter``): logits (+ ``router_bias``), top-k, softmax over
    the chosen logits in the logits' dtype."""
    b = ctx.weights("router_bias", layer)
    logits = scores if b is None else scores + b[:, None, :]
    top, idx = logits.topk(ctx.traits["moe"]["top_k"], dim=-1)
    return _dense(torch.softmax(top, dim=-1, dtype=top.dtype), idx, logits.shape[-1]).float()


def softmax_topk(ctx: Ctx, layer: int, scores):
    """Qwen MoE routing (HF ``Qwen3MoeTopKRouter``): softmax over every expert's logit in float32,
    top-k, the chosen probabilities renormalized to sum 1 (``norm_topk_prob``), cast to the
    logits' dtype as HF hands them to its experts."""
    m = ctx.traits["moe"]
    top, idx = torch.softmax(scores, dim=-1, dtype=torch.float32).topk(m["top_k"], dim=-1)
    if m.get("norm_topk_prob"):
        top = top / top.sum(dim=-1, keepdim=True)
    return _dense(top.to(scores.dtype), idx, scores.shape[-1]).float()


# ---- experts ----------------------------------------------------------------------------------
def clamped_swiglu(ctx: Ctx, layer: int, gu):
    """GPT-OSS experts' activation on [D, T, E_local, 2I] laid out [gate | up] (``experts_b13``
    added first): gate clamped above and up on both sides at ``swiglu_limit``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``. Returns [D, T, E_local, I]."""
    m = ctx.traits["moe"]
    b = ctx.weights(EXPERTS_IN_BIAS, layer)
    if b is not None:
        gu = gu + b[:, None]
    g, u = gu.chunk(2, dim=-1)
    lim = m["swiglu_limit"]
    g, u = g.clamp(max=lim), u.clamp(min=-lim, max=lim)
    return (u + 1) * (g * torch.sigmoid(g * m["swiglu_alpha"]))


def combine(ctx: Ctx, layer: int, eo, acts: dict):
    """Weighted sum of this device's experts: eo [D, T, E_local, H] (+ ``experts_b2``) times the
    device's slice of ``route`` [D, T, E] -> [D, T, H], a partial sum over the expert-parallel axes.
    Accumulated in float32 like HF's fp32 routing weights."""
    b = ctx.weights(EXPERTS_OUT_BIAS, layer)
    if b is not None:
        eo = eo + b[:, None]
    mine = ctx.units(EXPERTS_OUT, 0)  # [D, E_local] global expert ids
    w = acts[ROUTE].gather(-1, mine[:, None, :].expand(-1, eo.shape[1], -1))  # [D, T, E_local]
    return torch.einsum("dteh,dte->dth", eo.float(), w.float()).to(eo.dtype)


def sigmoid_gate(ctx: Ctx, layer: int, x, g):
    """Qwen2 MoE's shared expert output x [D, T, N] scaled per token by ``sigmoid(g)``, g [D, T, 1]
    its gate logit (HF: ``F.sigmoid(shared_expert_gate(x)) * shared_expert(x)``)."""
    return x * torch.sigmoid(g)


def out_bias(ctx: Ctx, layer: int, x):
    """Output-projection bias ``bo`` added after the projection's all-reduce (sharded like x)."""
    return x + ctx.weights("bo", layer)[:, None, :]


MOE_KERNELS = {"mla_attention": mla_attention, "group_topk": group_topk, "topk_softmax": topk_softmax,
               "softmax_topk": softmax_topk, "clamped_swiglu": clamped_swiglu, "combine": combine, "out_bias": out_bias,
               "sigmoid_gate": sigmoid_gate}
