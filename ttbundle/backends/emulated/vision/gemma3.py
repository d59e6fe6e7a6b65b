"""Gemma 3's vision encoder (SigLIP tower and average-pool projector) as emulated kernels
(``families.gemma3_vision``): rows are the patches of the program's images, image after image
(``T = images * num_patches``); heads arrive split as the program declares, biases as the
device's shard of the bias tensor. The pooling matrix the ttnn lowering multiplies by is in
``ttbundle.tables``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import Ctx
from ._common import vision as _vision


def vision_embed(ctx: Ctx, layer, pe):
    """Patch matmul output + conv bias + the position embedding of each patch."""
    v, W = _vision(ctx), ctx.weights
    D, T, H = pe.shape
    pos = W("v_pos")  # [D, num_patches, H]
    x = pe + W("v_patch_b")[:, None, :]
    return (x.view(D, T // v.num_patches, v.num_patches, H) + pos[:, None]).view(D, T, H)


def vision_attention(ctx: Ctx, layer, q, k, v):
    """Bidirectional attention among the patches of one image (+ q/k/v biases), this device's heads."""
    vis, W = _vision(ctx), ctx.weights
    D, T, _ = q.shape
    hd, n = vis.head_dim, T // vis.num_patches
    q = q + W("v_bq", layer)[:, None, :]
    k = k + W("v_bk", layer)[:, None, :]
    v = v + W("v_bv", layer)[:, None, :]
    shape = (D, n, vis.num_patches, -1, hd)
    q, k, v = (x.view(shape).transpose(2, 3) for x in (q, k, v))  # [D, n, heads, P, hd]
    scores = (q @ k.transpose(-1, -2)) * hd ** -0.5
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (p @ v).transpose(2, 3).reshape(D, T, -1)


def vision_pool(ctx: Ctx, layer, x):
    """Average-pool each image's patch grid (row-major patches) to its soft tokens."""
    vis = _vision(ctx)
    D, T, H = x.shape
    n, side, k = T // vis.num_patches, vis.patches_per_side, vis.pool
    g = x.view(D * n, side, side, H).permute(0, 3, 1, 2)
    pooled = F.avg_pool2d(g, kernel_size=k, stride=k)  # [D*n, H, side/k, side/k]
    return pooled.flatten(2).transpose(1, 2).reshape(D, n * vis.mm_tokens_per_image, H)


KERNELS = dict(vision_embed=vision_embed, vision_attention=vision_attention, vision_pool=vision_pool)
