"""Qwen2.5-VL on the serving side: vLLM's own Qwen2.5-VL processor without torchvision, and a
request's images and M-RoPE positions on the model runner.

**Processor.** vLLM preprocesses Qwen2.5-VL requests with its ``Qwen2_5_VLMultiModalProcessor``
(``pixel_values`` flat over the patches of all images, ``[patches, C*T*P*P]``, and
``image_grid_thw`` ``[images, 3]``; each image becomes ``grid_t*grid_h*grid_w / merge**2``
``<|image_pad|>`` tokens). Its processing info loads transformers' ``Qwen2_5_VLProcessor``, whose
``from_pretrained`` also loads the video processor, which needs torchvision. ttbundle serves
images only (Qwen2.5-VL's video input is not supported: a request with a video gets vLLM's 400),
so the processing info (:func:`processing_info`) declares images alone and loads
:class:`ImageOnlyQwen2_5_VLProcessor`: the same transformers processor class (its prompt
expansion and image handling are transformers' own) with no video processor; without
torchvision its image processor is transformers' PIL one (``Qwen2VLImageProcessorPil``, what
``AutoImageProcessor`` picks then).

**Runner.** A request's images arrive as vLLM ``mm_features`` (one per image: its
``pixel_values`` patches and its ``image_grid_thw``; its placeholder range marks its
``<|image_pad|>`` tokens). :func:`request_state` turns them into ``images.RequestImages``
(per-image token counts, no bidirectional blocks: Qwen2.5-VL's image tokens attend causally)
plus the request's M-RoPE positions ``[3, L]`` and rope delta, from the position rule's one
owner (``mrope_positions``). Prefill chunk ``[s, s+n)`` uses columns ``s..s+n`` of the
positions; decode at cache position ``p`` uses ``p + delta`` on all three axes.
"""

from __future__ import annotations

import torch

from ..families.qwen2_5_vl_vision import mrope_positions, soft_tokens
from .images import RequestImages, chunk_inputs

_CLASSES: dict = {}


def _image_only_processor_class():
    if "processor" in _CLASSES:
        return _CLASSES["processor"]
    from transformers import Qwen2_5_VLProcessor

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """transformers' ``Qwen2_5_VLProcessor`` with no video processor (needs torchvision):
        ``from_pretrained`` loads the image processor and the tokenizer only."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
            self.video_processor = None

    _CLASSES["processor"] = ImageOnlyQwen2_5_VLProcessor
    return ImageOnlyQwen2_5_VLProcessor


def processing_info(base):
    """vLLM's ``Qwen2_5_VLProcessingInfo`` (``base``) for images only: its HF processor is
    :class:`ImageOnlyQwen2_5_VLProcessor` and it declares image inputs alone, so vLLM neither
    profiles nor accepts video (a video part is vLLM's 400)."""
    if "info" not in _CLASSES:
        proc_cls = _image_only_processor_class()

        class TTQwen2_5_VLProcessingInfo(base):
            def get_hf_processor(self, **kwargs):
                return self.ctx.get_hf_processor(proc_cls, **kwargs)

            def get_supported_mm_limits(self):
                return {"image": None}

            def get_mm_max_tokens_per_item(self, seq_len, mm_counts):
                return {"image": self.get_max_image_tokens()}

        _CLASSES["info"] = TTQwen2_5_VLProcessingInfo
    return _CLASSES["info"]


# -- the model runner ---------------------------------------------------------------------------
def feature_grid(feature) -> torch.Tensor:
    """[3] (t, h, w) of one image feature, in patches."""
    return feature.data["image_grid_thw"].data.reshape(3).long()


def feature_patches(feature) -> torch.Tensor:
    """[patches, C*T*P*P] of one image feature (vLLM's field is flat over the patches)."""
    return feature.data["pixel_values"].data


def request_state(features, prompt: list[int], vision):
    """``(images.RequestImages | None, rope positions [3, L], rope delta)`` of a new request.

    The image tokens are ``vision``'s ``image_token_id`` inside each feature's placeholder range;
    an image whose data vLLM did not send (its blocks came from the prefix cache) still has its
    grid, so the positions of every chunk are right. ``features`` of a request without images
    give ``(None, positions, 0)``: the text positions on all three axes."""
    feats = sorted((f for f in features or [] if f.modality == "image"), key=lambda f: f.mm_position.offset)
    grids = [_grid_of(f) for f in feats]
    thw = torch.stack(grids) if grids else torch.zeros(0, 3, dtype=torch.long)
    rope, delta = mrope_positions(list(prompt), thw, vision)
    if not feats:
        return None, rope, int(delta)
    positions, image_of, counts = [], [], []
    for i, f in enumerate(feats):
        lo, n = f.mm_position.offset, f.mm_position.length
        mine = [p for p in range(lo, lo + n) if prompt[p] == vision.image_token_id]
        want = soft_tokens(vision, grids[i])
        if len(mine) != want:
            raise ValueError(f"image {i}: grid {grids[i].tolist()} needs {want} image tokens, its placeholder "
                             f"holds {len(mine)}")
        positions += mine
        image_of += [i] * len(mine)
        counts.append(len(mine))
    blocks = torch.full((len(prompt),), -1, dtype=torch.long)  # causal: no image blocks
    return (RequestImages(feats, positions, image_of, blocks, counts=counts, encode_features=encode_features),
            rope, int(delta))


def _grid_of(feature) -> torch.Tensor:
    if feature.data is not None and "image_grid_thw" in feature.data:
        return feature_grid(feature)
    # vLLM keeps a prefix-cached image's grid for M-RoPE models (strip_covered_mm_data)
    raise RuntimeError("an image feature without image_grid_thw: vLLM sent no grid for it, so the "
                       "prompt's M-RoPE positions are unknown")


def encode_features(encode, feats) -> torch.Tensor:
    """Soft tokens of ``feats`` (in order) from the package's vision program: one call with
    their patches concatenated and their grids."""
    px = torch.cat([feature_patches(f) for f in feats])
    thw = torch.stack([feature_grid(f) for f in feats])
    return encode(px, image_grid_thw=thw)


def chunk_rope(rope: torch.Tensor, delta: int, start: int, n: int, bucket: int) -> torch.Tensor:
    """``rope_positions`` [3, 1, bucket] of the prefill chunk ``[start, start + n)``: the prompt's
    M-RoPE columns, then (a resumed request recomputing its output tokens) cache position + delta;
    padding columns take position 0 (they are not valid tokens)."""
    out = torch.zeros(3, 1, bucket, dtype=torch.long)
    cols = torch.arange(start, start + n)
    L = rope.shape[1]
    inside = cols < L
    out[:, 0, :n] = torch.where(inside[None], rope[:, cols.clamp(max=L - 1)], (cols + delta)[None].expand(3, -1))
    return out


def decode_rope(positions: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """``rope_positions`` [3, B, 1] of a decode batch: each row's cache position plus its rope
    delta on all three axes (padding rows, position -1, take 0)."""
    p = torch.where(positions >= 0, positions + deltas, torch.zeros_like(positions))
    return p[None, :, None].expand(3, -1, 1).clone()


def prompt_inputs(prompt: list[int], pixel_values, image_grid_thw, vision, encode, bucket: int):
    """``(mm, rope_positions [3, 1, bucket], rope_deltas [1])`` of a whole prompt prefilled in
    one call, the way Tenstorrent's plugin hands a Qwen2.5-VL request's images to
    ``prefill_forward``: its ``pixel_values`` ([patches, C*T*P*P], or a list of them) and
    ``image_grid_thw`` ([images, 3], or a list), in prompt order. ``mm`` is None without
    images (the positions are then the text's)."""

    def cat(x, width):
        parts = [p for p in (x if isinstance(x, (list, tuple)) else [x]) if p is not None and p.numel()]
        return torch.cat([p.reshape(-1, width) for p in parts]) if parts else torch.zeros(0, width)

    thw = cat(image_grid_thw, 3).long()
    rope, delta = mrope_positions(list(prompt), thw, vision)  # refuses grids that do not match the tokens
    rope_positions = chunk_rope(rope, int(delta), 0, len(prompt), bucket)
    deltas = torch.tensor([int(delta)], dtype=torch.long)
    if not thw.shape[0]:
        return None, rope_positions, deltas
    px = cat(pixel_values, pixel_values[0].shape[-1] if isinstance(pixel_values, (list, tuple))
             else pixel_values.shape[-1])
    if px.shape[0] != int(thw.prod(dim=1).sum()):
        raise ValueError(f"pixel_values hold {px.shape[0]} patches, image_grid_thw {thw.tolist()} needs "
                         f"{int(thw.prod(dim=1).sum())}")
    counts = [soft_tokens(vision, g) for g in thw]
    positions = [i for i, t in enumerate(prompt) if t == vision.image_token_id]
    image_of = sum(([i] * c for i, c in enumerate(counts)), [])
    out = encode(px, image_grid_thw=thw)
    embeds, at = {}, 0
    for i, c in enumerate(counts):
        embeds[i], at = out[at:at + c], at + c
    ri = RequestImages([None] * len(counts), positions, image_of, torch.full((len(prompt),), -1, dtype=torch.long),
                       embeds, counts=counts)
    return chunk_inputs(ri, encode, 0, len(prompt), bucket), rope_positions, deltas

