"""Qwen2.5-VL's vision transformer and merger as emulated kernels (``families.qwen2_5_vl_vision``):
rows are the patches of the program's images in window order (``patch_grid.patch_layout``);
``ctx.vision`` holds the per-call metadata the host made: rope cos/sin per row, and each row's
window and image segment.
"""

from __future__ import annotations

import torch.nn.functional as F

from ..kernels import Ctx, activation
from ._common import rope_segment_attention, vision as _vision


def qwen_vision_attention(ctx: Ctx, layer, q, k, v):
    """q/k/v biases, the 2-D rope, then attention among the rows of one window (one image at the
    layers of ``fullatt_block_indexes``), this device's heads."""
    return qwen_attention(ctx, layer, q, k, v, "image" if layer in _vision(ctx).fullatt_block_indexes else "window")


def qwen_attention(ctx: Ctx, layer, q, k, v, which: str):
    """q/k/v biases, the 2-D rope, then attention among the rows of one segment of ``which``
    (the host's per-row segments: ``window`` or ``image``), this device's heads."""
    W = ctx.weights
    q, k, v = q + W("v_bq", layer)[:, None, :], k + W("v_bk", layer)[:, None, :], v + W("v_bv", layer)[:, None, :]
    return rope_segment_attention(ctx, q, k, v, which)


def qwen_vision_swiglu(ctx: Ctx, layer, g, u):
    W = ctx.weights
    return activation(_vision(ctx).hidden_act, g + W("v_b1", layer)[:, None, :]) * (u + W("v_b3", layer)[:, None, :])


def qwen_vision_merge(ctx: Ctx, layer, x):
    """Each merge block's patches (consecutive rows) concatenated into one row."""
    D, T, H = x.shape
    unit = _vision(ctx).merge_unit
    return x.reshape(D, T // unit, unit * H)


def qwen_vision_merge_gelu(ctx: Ctx, layer, x):
    return F.gelu(x + ctx.weights("v_merge1_b")[:, None, :])


def qwen_vision_merge_bias(ctx: Ctx, layer, x):
    return x + ctx.weights("v_merge2_b")[:, None, :]


KERNELS = dict(qwen_vision_attention=qwen_vision_attention, qwen_vision_swiglu=qwen_vision_swiglu,
               qwen_vision_merge=qwen_vision_merge, qwen_vision_merge_gelu=qwen_vision_merge_gelu,
               qwen_vision_merge_bias=qwen_vision_merge_bias)
