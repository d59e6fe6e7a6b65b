"""Declarations shared by the mixture-of-experts families (DeepSeek-V3, GPT-OSS): routed-expert
tensors and dataflow, and the named transform of GPT-OSS's interleaved gate_up (quantized
checkpoints, MXFP4 experts and fp8 blocks included, are decoded by ``ttbundle.formats`` first).

Routed experts are one ``[E, in, out]`` tensor per layer; their expert dim is split over every
mesh device (expert parallel, ``EP``): 1/8 per chip on T3K, 1/32 on a Galaxy.
"""

from __future__ import annotations

from . import base, transforms
from .base import Combine, Dim, Linear, Local, Norm, Residual, TensorDecl

EP = ("rows", "cols")  # expert parallel over the whole mesh; on a 1xN mesh this is just cols


def expert_tensors(a, layers: tuple[int, int], experts: Dim, inter: Dim) -> list[TensorDecl]:
    """Routed experts with separate gate (w1), up (w3) and down (w2) projections."""
    hid = Dim("hidden_size", a.hidden_size)
    return [TensorDecl("experts_w1", "experts", (experts, hid, inter), layers, "routed experts' gate projections"),
            TensorDecl("experts_w3", "experts", (experts, hid, inter), layers, "routed experts' up projections"),
            TensorDecl("experts_w2", "experts", (experts, inter, hid), layers, "routed experts' down projections")]


def moe_ops(route: str, route_fn: str, act_ops: list, shared: bool = False) -> list:
    """FFN half of a MoE layer: router, every expert on the (replicated) token, Combine over the
    expert dim (partial sums on the expert-parallel axes), optional shared expert, residual adds.
    ``act_ops`` turn ``x2`` into the experts' activated hidden ``ea`` [E, I]."""
    ops = [Norm("h", "x2", "ffn_norm"), Linear("x2", "router", "scores"),
           Local(("scores",), "route", route, fn=route_fn), *act_ops,
           Linear("ea", "experts_w2", "eo"), Combine("eo", "moe_out"), Residual("moe_out")]
    return ops + (base.mlp_ops("shared_")[1:] if shared else [])


SWIGLU_EXPERTS = [Linear("x2", "experts_w1", "eg"), Linear("x2", "experts_w3", "eu"),
                  Local(("eg", "eu"), "ea", "SwiGLU", fn="swiglu")]


def hf_rope_parameters(d: dict, a) -> dict:
    """HF config dict ``d`` with ``rope_theta`` / ``rope_scaling`` replaced by transformers 5's
    ``rope_parameters`` (explicit even for default rope: GPT-OSS's config defaults to YaRN)."""
    d = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    rs = a.rope_scaling.model_dump(exclude_none=True) if a.rope_scaling else {"rope_type": "default"}
    return {**d, "rope_parameters": {**rs, "rope_theta": a.rope_theta}}


# ---- transforms (registered in families.transforms) -----------------------------------------------
def gate_up_deinterleave(src, a):
    """GPT-OSS fused gate_up ``[..., 2I]`` stored interleaved (g0, u0, g1, u1, ...) -> ``[gate | up]``
    halves, so a device slices gate and up instead of striding. Weight and bias alike."""
    import torch

    x = src[0]
    *lead, n = x.shape
    if n % 2:
        raise ValueError(f"gate_up has {n} columns: gate and up interleave pairs")
    out = torch.empty(x.shape, dtype=x.dtype)
    # one strided copy: [..., I, 2] pairs -> [..., 2, I] halves (~25% faster than cat of two slices)
    out.view(*lead, 2, n // 2).copy_(x.reshape(*lead, n // 2, 2).transpose(-1, -2))
    return out


TRANSFORMS = {"gate_up_deinterleave": gate_up_deinterleave}
for _name, _fn in TRANSFORMS.items():
    transforms.register(_name, _fn)
