"""The host-side geometry of the patch-grid vision encoders (Qwen2.5-VL, Qwen3-VL, Mistral 3's
Pixtral): how many patches and soft tokens an image makes, where each patch goes in a vision
program's rows (merge blocks, windows, padding), the 2-D rope's tables and a prompt's M-RoPE
positions. One owner for these rules; the vision parts call them with their settings ``v`` (a
``Qwen25Vision``, ``Qwen3Vision`` or ``PixtralVision``: the attributes each function reads)."""

from __future__ import annotations

from .base import Dim


def encoder_dims(v, text_hidden: int, heads: str = "num_heads", text: str = "vision.out_hidden_size") -> dict:
    """The dims a patch-grid encoder's weights are declared in (``base.Dim``), each named by the
    spec key that sets it: hidden, attention heads (``heads``: the family's key), MLP, a patch's
    pixels, a merge block's features and a soft token's width (``text``)."""
    return {"hid": Dim("vision.hidden_size", v.hidden_size),
            "heads": Dim(f"vision.{heads}", getattr(v, heads), v.head_dim),
            "inter": Dim("vision.intermediate_size", v.intermediate_size),
            "pix": Dim("vision.patch_pixels", v.patch_pixels),
            "merge": Dim("vision.merge_hidden", v.merge_unit * v.hidden_size),
            "text": Dim(text, text_hidden)}


def hf_vision_config(v, keys, wrapper_keys, model_type: str, **extra) -> tuple[dict, dict]:
    """(HF vision_config, wrapper keys) of settings ``v`` for the reference model: ``keys`` and
    ``extra`` in the vision config with its ``model_type`` and the 2-D (axial) rope's base."""
    vc = {k: getattr(v, k) for k in keys}
    vc.update(extra, model_type=model_type, rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    return vc, {k: getattr(v, k) for k in wrapper_keys}


def max_patches(v, max_pixels: int) -> int:
    """Patches of the largest image the processor makes under ``max_pixels`` (its sides are
    multiples of ``factor`` pixels with area <= max_pixels), a multiple of the merge unit."""
    blocks = max_pixels // (v.factor ** 2)
    return blocks * v.merge_unit


def soft_tokens(v, grid) -> int:
    t, h, w = (int(x) for x in grid)
    return t * h * w // v.merge_unit


def mrope_positions(prompt_ids: list[int], image_grid_thw, vision):
    """(positions [3, L] (temporal, height, width), delta): Qwen2.5-VL's M-RoPE positions of a
    prompt. Text tokens take one position in all three rows, counting on from the last; an
    image's placeholders (its ``soft_tokens`` run of ``image_token_id``) take ``start + t``,
    ``start + row``, ``start + column`` of their merge block, and the text after it continues at
    ``start + max(h, w) / merge``. ``delta`` = max position + 1 - L: a token decoded at cache
    position p has rope position p + delta in all three rows."""
    import torch

    grids = [tuple(int(x) for x in g) for g in (image_grid_thw if image_grid_thw is not None else [])]
    m = vision.spatial_merge_size
    rows: list[list[int]] = [[], [], []]
    cur, i, k, L = 0, 0, 0, len(prompt_ids)
    while i < L:
        if prompt_ids[i] != vision.image_token_id:
            for r in rows:
                r.append(cur)
            cur, i = cur + 1, i + 1
            continue
        if k >= len(grids):
            raise ValueError(f"prompt token {i} is an image placeholder ({vision.image_token_id}) but "
                             f"image_grid_thw has only {len(grids)} image(s)")
        t, h, w = grids[k]
        gh, gw = h // m, w // m
        n = t * gh * gw
        if prompt_ids[i:i + n] != [vision.image_token_id] * n:
            run = next((j for j in range(i, L) if prompt_ids[j] != vision.image_token_id), L) - i
            raise ValueError(f"image {k} (grid {t}x{h}x{w}) needs {n} placeholder tokens at prompt "
                             f"position {i}, found a run of {run}")
        for tt in range(t):
            for y in range(gh):
                for x in range(gw):
                    rows[0].append(cur + tt)
                    rows[1].append(cur + y)
                    rows[2].append(cur + x)
        cur += max(gh, gw)
        i, k = i + n, k + 1
    if k != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} images, the prompt's placeholders hold {k}")
    pos = torch.tensor(rows, dtype=torch.long).reshape(3, L)
    delta = int(pos.max()) + 1 - L if L else 0
    return pos, delta


def patch_layout(v, image_grid_thw, bucket: int, windows: bool = True) -> dict:
    """Where each patch of the images goes in a vision program of ``bucket`` rows, and what the
    program reads per row. Merge blocks are put in window order (each window contiguous: windows
    of ``window_blocks`` blocks per side, row-major, each row-major inside; one image after the
    other), their patches kept together; rows past the images are padding.

    ``order`` [patches]: the input row (in the processor's order) of each program row;
    ``window`` / ``image`` [bucket]: the attention segment of each row in window layers and in
    full-attention layers (padding rows form their own segment); ``hw`` [bucket, 2]: each row's
    patch row and column in its image (the 2-D rope); ``unorder`` [soft tokens]: the program's
    output row of each soft token in prompt order."""
    import torch

    m, unit = v.spatial_merge_size, v.merge_unit
    # no windows (Qwen3-VL): one window per frame, the blocks in the processor's order
    ws = v.window_blocks if windows else max([max(int(g[1]), int(g[2])) for g in image_grid_thw] + [1])
    order, window, image, hw, block_rows = [], [], [], [], []
    base, seg, frame = 0, 0, 0
    for t, h, w in (tuple(int(x) for x in g) for g in image_grid_thw):
        gh, gw = h // m, w // m
        for tt in range(t):
            for wy in range(0, gh, ws):
                for wx in range(0, gw, ws):
                    for y in range(wy, min(wy + ws, gh)):
                        for x in range(wx, min(wx + ws, gw)):
                            blk = tt * gh * gw + y * gw + x  # the block's index in the image
                            block_rows.append(base // unit + blk)
                            for j in range(unit):
                                order.append(base + blk * unit + j)
                                window.append(seg)
                                image.append(-1 - frame - tt)  # a frame attends over itself
                                hw.append((y * m + j // m, x * m + j % m))
                    seg += 1
        base, frame = base + t * h * w, frame + t
    if len(order) > bucket:
        raise ValueError(f"{len(order)} patches exceed the vision bucket of {bucket}")
    pad = bucket - len(order)
    pad_seg = seg  # padding rows: one segment of their own in both kinds of layer
    window += [pad_seg] * pad
    image += [pad_seg] * pad
    hw += [(0, 0)] * pad
    unorder = torch.argsort(torch.tensor(block_rows, dtype=torch.long)) if block_rows else torch.zeros(0, dtype=torch.long)
    return {"order": torch.tensor(order, dtype=torch.long), "window": torch.tensor(window, dtype=torch.long),
            "image": torch.tensor(image, dtype=torch.long), "hw": torch.tensor(hw, dtype=torch.long).reshape(-1, 2),
            "unorder": unorder}


def rope_tables(v, hw, dtype):
    """cos, sin [rows, head_dim] of the 2-D vision rope: the first half of the rotary angles from
    the patch row, the second from its column (head_dim / 4 frequencies each), repeated for the
    rotate-half layout."""
    import torch

    spatial = v.head_dim // 2
    inv = 1.0 / (v.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
    ang = torch.cat([hw[:, 0:1].float() * inv, hw[:, 1:2].float() * inv], dim=-1)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
