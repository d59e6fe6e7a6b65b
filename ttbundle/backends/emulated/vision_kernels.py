"""Per-device kernels of the vision encoders (Gemma 3's SigLIP tower and projector).

Kernels see device-batched local tensors ``[D, T, features]``; a vision program's rows are the
patches of its images, image after image (``T = images * num_patches``). Heads and the MLP's
intermediate dim arrive split as the program declares; biases are read as the device's shard of
the bias tensor (``ctx.weights``), so a bias follows its weight's split. Collected by name in
``kernel_table.KERNELS``; the pooling and rotate-half matrices the ttnn lowering multiplies by
are in ``ttbundle.tables``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import Ctx, activation, rotate_half


def _vision(ctx: Ctx):
    return ctx.arch.vision


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


def vision_bias_o(ctx: Ctx, layer, x):
    return x + ctx.weights("v_bo", layer)[:, None, :]


def vision_bias_2(ctx: Ctx, layer, x):
    return x + ctx.weights("v_b2", layer)[:, None, :]


def vision_gelu(ctx: Ctx, layer, x):
    return activation(_vision(ctx).hidden_act, x + ctx.weights("v_b1", layer)[:, None, :])


def vision_pool(ctx: Ctx, layer, x):
    """Average-pool each image's patch grid (row-major patches) to its soft tokens."""
    vis = _vision(ctx)
    D, T, H = x.shape
    n, side, k = T // vis.num_patches, vis.patches_per_side, vis.pool
    g = x.view(D * n, side, side, H).permute(0, 3, 1, 2)
    pooled = F.avg_pool2d(g, kernel_size=k, stride=k)  # [D*n, H, side/k, side/k]
    return pooled.flatten(2).transpose(1, 2).reshape(D, n * vis.mm_tokens_per_image, H)


GEMMA_VISION_KERNELS = dict(vision_embed=vision_embed, vision_attention=vision_attention, vision_bias_o=vision_bias_o,
                            vision_bias_2=vision_bias_2, vision_gelu=vision_gelu, vision_pool=vision_pool)


# ---- Qwen2.5-VL's vision transformer and merger ---------------------------------------------------
# rows are the patches of the program's images in window order (``patch_grid.patch_layout``);
# ``ctx.vision`` holds the per-call metadata the host made: rope cos/sin per row, and each row's
# window and image segment
def qwen_vision_attention(ctx: Ctx, layer, q, k, v):
    """q/k/v biases, the 2-D rope, then attention among the rows of one window (one image at the
    layers of ``fullatt_block_indexes``), this device's heads."""
    return _qwen_attention(ctx, layer, q, k, v, "image" if layer in _vision(ctx).fullatt_block_indexes else "window")


def _qwen_attention(ctx: Ctx, layer, q, k, v, which: str):
    """q/k/v biases, the 2-D rope, then attention among the rows of one segment of ``which``
    (the host's per-row segments: ``window`` or ``image``), this device's heads."""
    W = ctx.weights
    q, k, v = q + W("v_bq", layer)[:, None, :], k + W("v_bk", layer)[:, None, :], v + W("v_bv", layer)[:, None, :]
    return _rope_segment_attention(ctx, q, k, v, which)


def _rope_segment_attention(ctx: Ctx, q, k, v, which: str):
    """The host's 2-D rope (``ctx.vision`` cos/sin per row), then attention among the rows of one
    segment of ``which`` (the host's per-row segments), this device's heads."""
    vis, meta = _vision(ctx), ctx.vision
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


QWEN_VISION_KERNELS = dict(qwen_vision_attention=qwen_vision_attention, qwen_vision_swiglu=qwen_vision_swiglu,
                           qwen_vision_merge=qwen_vision_merge, qwen_vision_merge_gelu=qwen_vision_merge_gelu,
                           qwen_vision_merge_bias=qwen_vision_merge_bias)


# ---- Qwen3-VL's vision transformer, mergers and DeepStack ---------------------------------------
# rows are the patches in the processor's order (no windows); ``ctx.vision`` holds the rope
# cos/sin and image segment per row and the position embedding's taps (``qwen3_vl_vision``)
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
    return _qwen_attention(ctx, layer, q, k, v, "image")


def _deepstack(k: int):
    def gelu(ctx: Ctx, layer, x):
        return F.gelu(x + ctx.weights(f"v_ds{k}_fc1_b")[:, None, :])

    def bias(ctx: Ctx, layer, x):
        return x + ctx.weights(f"v_ds{k}_fc2_b")[:, None, :]
    return {f"qwen3_deepstack{k}_gelu": gelu, f"qwen3_deepstack{k}_bias": bias}


#: DeepStack merger k's kernels for every k a vision config may have (``qwen3_vl_vision.MAX_DEEPSTACK``)
QWEN3_VISION_KERNELS = dict(qwen3_vision_embed=qwen3_vision_embed, qwen3_vision_attention=qwen3_vision_attention)
for _k in range(8):
    QWEN3_VISION_KERNELS.update(_deepstack(_k))


# ---- Mistral 3's Pixtral encoder and projector ---------------------------------------------------
# rows are the patches in merge-block order (``mistral3_vision``); ``ctx.vision`` holds Pixtral's
# rope cos/sin and the image segment per row
def pixtral_attention(ctx: Ctx, layer, q, k, v):
    """Pixtral's 2-D rope, then attention among the rows of one image (no biases), this device's heads."""
    return _rope_segment_attention(ctx, q, k, v, "image")


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


MISTRAL3_VISION_KERNELS = dict(pixtral_attention=pixtral_attention, pixtral_gated=pixtral_gated,
                               mistral3_unfold=mistral3_unfold, mistral3_projector_act=mistral3_projector_act)
