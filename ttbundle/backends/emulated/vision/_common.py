"""What the emulated vision encoders share: the vision config of a kernel's arch, the bias adds
of a vision layer's output projection and second MLP matmul (SigLIP's, Qwen2.5-VL's), the
biased activation of the first (SigLIP's, Qwen3-VL's), and the
2-D rope attention within one segment of rows (Qwen's, Pixtral's). Kernels see device-batched
local tensors ``[D, T, features]``; a vision program's rows are the patches of its images.
Each encoder's own kernels are in the module named after its family (``vision/<family>.py``).
"""

from __future__ import annotations

import torch

from ..kernels import Ctx, activation, rotate_half


def vision(ctx: Ctx):
    """The vision config of the kernel's arch."""
    return ctx.arch.vision


def vision_bias_o(ctx: Ctx, layer, x):
    return x + ctx.weights("v_bo", layer)[:, None, :]


def vision_bias_2(ctx: Ctx, layer, x):
    return x + ctx.weights("v_b2", layer)[:, None, :]


def vision_gelu(ctx: Ctx, layer, x):
    """+ the first MLP bias, then the vision config's ``hidden_act`` (SigLIP's, Qwen3-VL's MLP)."""
    return activation(vision(ctx).hidden_act, x + ctx.weights("v_b1", layer)[:, None, :])


def rope_segment_attention(ctx: Ctx, q, k, v, which: str):
    """The host's 2-D rope (``ctx.vision`` cos/sin per row), then attention among the rows of one
    segment of ``which`` (the host's per-row segments), this device's heads."""
    vis, meta = vision(ctx), ctx.vision
    D, T, _ = q.shape
    hd = vis.head_dim
    q, k, v = (x.view(D, T, -1, hd) for x in (q, k, v))
    cos, sin = meta["cos"].to(q.device), meta["sin"].to(q.device)
    q = (q.float() * cos[None, :, None] + rotate_half(q.float()) * sin[None, :, None]).to(q.dtype)
    k = (k.float() * cos[None, :, None] + rotate_half(k.float()) * sin[None, :, None]).to(k.dtype)
    key = ("vision_mask", which)
    if key not in ctx.cache:
        seg = meta[which].to(q.device)
        ctx.cache[key] = seg[:, None] == seg[None, :]
    allowed = ctx.cache[key]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [D, heads, T, hd]
    scores = (q @ k.transpose(-1, -2)) * hd ** -0.5
    scores = scores.masked_fill(~allowed[None, None], float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (p @ v).transpose(1, 2).reshape(D, T, -1)


KERNELS = dict(vision_bias_o=vision_bias_o, vision_bias_2=vision_bias_2, vision_gelu=vision_gelu)
