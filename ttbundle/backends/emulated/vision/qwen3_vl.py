"""Qwen3-VL's vision transformer, mergers and DeepStack as emulated kernels
(``families.qwen3_vl_vision``): rows are the patches in the processor's order (no windows);
``ctx.vision`` holds the rope cos/sin and image segment per row and the position embedding's
taps. Its attention is Qwen2.5-VL's (``qwen2_5_vl.qwen_attention``) over whole images; the
text layers' ``deepstack`` step adds the DeepStack mergers' features at the image tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import Ctx
from .qwen2_5_vl import qwen_attention


def qwen3_vision_embed(ctx: Ctx, layer, pe):
    """Patch matmul output + conv bias + each row's learned position embedding: the 4 table rows
    of its bilinear resampling, weighted."""
    W, meta = ctx.weights, ctx.vision
    table = W("v_pos")  # [D, num_position_embeddings, H]
    idx, w = meta["pos_idx"].to(pe.device), meta["pos_w"].to(pe.device)
    pos = (table[:, idx.reshape(-1)].view(table.shape[0], *idx.shape, -1).float() * w[None, :, :, None]).sum(2)
    return pe + W("v_patch_b")[:, None, :] + pos.to(pe.dtype)


def qwen3_vision_attention(ctx: Ctx, layer, q, k, v):
    """q/k/v biases, the 2-D rope, then attention among the rows of one image, this device's heads."""
    return qwen_attention(ctx, layer, q, k, v, "image")


def _deepstack(k: int):
    def gelu(ctx: Ctx, layer, x):
        return F.gelu(x + ctx.weights(f"v_ds{k}_fc1_b")[:, None, :])

    def bias(ctx: Ctx, layer, x):
        return x + ctx.weights(f"v_ds{k}_fc2_b")[:, None, :]
    return {f"qwen3_deepstack{k}_gelu": gelu, f"qwen3_deepstack{k}_bias": bias}


def deepstack(ctx: Ctx, layer: int, h):
    """DeepStack (Qwen3-VL): zeros but at the image tokens' rows of a prefill carrying images,
    where text layer ``layer`` < the DeepStack count adds that set of the images' features
    (``ctx.vision["deepstack"]`` [image rows, sets x hidden], beside the soft tokens)."""
    out = torch.zeros_like(h)
    ds = ctx.vision
    if ds is None or "deepstack" not in ds:
        return out
    H = h.shape[-1]
    if (layer + 1) * H > ds["deepstack"].shape[-1]:
        return out
    out[:, ds["mask"]] = ds["deepstack"][:, layer * H:(layer + 1) * H].to(h.dtype)[None]
    return out


KERNELS = dict(qwen3_vision_embed=qwen3_vision_embed, qwen3_vision_attention=qwen3_vision_attention, deepstack=deepstack)
for _k in range(8):  # DeepStack merger k's kernels for every k a vision config may have (qwen3_vl_vision.MAX_DEEPSTACK)
    KERNELS.update(_deepstack(_k))
