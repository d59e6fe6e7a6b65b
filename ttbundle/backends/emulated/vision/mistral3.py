"""Mistral 3's vision encoder (Pixtral) and projector as emulated kernels
(``families.mistral3_vision``): rows are the patches in merge-block order; ``ctx.vision`` holds
Pixtral's rope cos/sin and the image segment per row.
"""

from __future__ import annotations

from ..kernels import Ctx, activation
from ._common import rope_segment_attention, vision as _vision


def pixtral_attention(ctx: Ctx, layer, q, k, v):
    """Pixtral's 2-D rope, then attention among the rows of one image (no biases), this device's heads."""
    return rope_segment_attention(ctx, q, k, v, "image")


def pixtral_gated(ctx: Ctx, layer, g, u):
    """The gated MLP's hidden layer: ``hidden_act``(gate) x up (no biases)."""
    return activation(_vision(ctx).hidden_act, g) * u


def mistral3_unfold(ctx: Ctx, layer, x):
    """Each merge block's patches (consecutive rows) as one row, channel-major as ``F.unfold``
    makes it: feature ``c`` of the block's patch ``j`` at ``c * m^2 + j``."""
    D, T, H = x.shape
    unit = _vision(ctx).merge_unit
    return x.reshape(D, T // unit, unit, H).transpose(2, 3).reshape(D, T // unit, H * unit)


def mistral3_projector_act(ctx: Ctx, layer, x):
    return activation(_vision(ctx).projector_hidden_act, x)


KERNELS = dict(pixtral_attention=pixtral_attention, pixtral_gated=pixtral_gated,
               mistral3_unfold=mistral3_unfold, mistral3_projector_act=mistral3_projector_act)
