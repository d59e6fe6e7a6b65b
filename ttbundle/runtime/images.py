"""Images of one request on the model runner: vLLM's preprocessed ``mm_features`` (its own
processor made the ``pixel_values``) -> the soft tokens of the prompt chunk being prefilled.

A request's image tokens are the prompt tokens equal to the model's ``image_token_index``
(vLLM's placeholder ranges mark the same positions as embeddings); each image is one block of
them, and the soft tokens of one block attend to each other (``blocks``). Images are encoded
when the first chunk holding their tokens runs, all of that chunk's images in one vision
program; an image covered by the prefix cache has no data and is not encoded again (its KV is
cached), so prefix caching stays correct: vLLM's block hashes include the images' hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class RequestImages:
    features: list  # vLLM MultiModalFeatureSpec, in prompt order
    positions: list[int]  # prompt positions of the soft tokens, image after image
    image_of: list[int]  # per soft token: which image
    blocks: torch.Tensor  # [prompt length] image block per position, -1: text
    embeds: dict = field(default_factory=dict)  # image index -> soft tokens [mm, hidden]
    counts: list[int] | None = None  # soft tokens per image (Qwen2.5-VL: by its grid); None: uniform
    # how the vision part encodes features (``(encode, features) -> soft tokens``); None: the
    # features' pixel_values stacked, one ``encode`` call (Qwen2.5-VL sets ``qwen_vl.encode_features``)
    encode_features: Callable | None = None

    def first(self, i: int) -> int:
        """Index into ``positions`` of image ``i``'s first soft token."""
        if self.counts is None:
            return i * (len(self.positions) // len(self.features))
        return sum(self.counts[:i])

    def count(self, i: int) -> int:
        return len(self.positions) // len(self.features) if self.counts is None else self.counts[i]


def request_images(features, prompt: list[int], vision) -> RequestImages | None:
    """The images of a new request (None without images); the prompt must hold
    ``mm_tokens_per_image`` placeholders per image."""
    feats = sorted((f for f in features or [] if f.modality == "image"), key=lambda f: f.mm_position.offset)
    if not feats:
        return None
    positions = [i for i, t in enumerate(prompt) if t == vision.image_token_index]
    per = vision.mm_tokens_per_image
    if len(positions) != per * len(feats):
        raise ValueError(f"{len(feats)} image(s) need {per * len(feats)} image tokens in the prompt, found "
                         f"{len(positions)}")
    blocks = torch.full((len(prompt),), -1, dtype=torch.long)
    image_of = [k // per for k in range(len(positions))]
    blocks[positions] = torch.tensor(image_of, dtype=torch.long)
    return RequestImages(feats, positions, image_of, blocks)


def pixel_values(feature) -> torch.Tensor:
    """[1, C, H, W] of one image feature (vLLM's field is flat over the image's crops: one here)."""
    t = feature.data["pixel_values"].data
    return t[None] if t.dim() == 3 else t


def chunk_inputs(ri: RequestImages | None, encode, start: int, n: int, bucket: int) -> dict | None:
    """``mm`` for ``EmulatedModel.forward`` of the chunk ``[start, start + n)`` padded to
    ``bucket``: its soft tokens (encoding the chunk's images not encoded yet with ``encode``),
    where they go, and every position's image block; None when the chunk has no image token."""
    if ri is None:
        return None
    sel = [k for k, p in enumerate(ri.positions) if start <= p < start + n]
    if not sel:
        return None
    todo = sorted({ri.image_of[k] for k in sel} - set(ri.embeds))
    if todo:
        missing = [i for i in todo if ri.features[i].data is None or "pixel_values" not in ri.features[i].data]
        if missing:
            raise RuntimeError(f"image(s) {missing} are in the chunk but vLLM sent no pixel data")
        if ri.encode_features is None:
            out = encode(torch.cat([pixel_values(ri.features[i]) for i in todo]))
        else:  # the vision part's own encoding (Qwen2.5-VL: patches and grids, runtime.qwen_vl)
            out = ri.encode_features(encode, [ri.features[i] for i in todo])
        at = 0
        for i in todo:
            ri.embeds[i] = out[at:at + ri.count(i)]
            at += ri.count(i)
        if at != out.shape[0]:
            raise RuntimeError(f"the vision program returned {out.shape[0]} soft tokens for image(s) {todo}, "
                               f"their placeholders hold {at}")
    mask = torch.zeros(bucket, dtype=torch.bool)
    mask[[ri.positions[k] - start for k in sel]] = True
    embeds = torch.stack([ri.embeds[ri.image_of[k]][k - ri.first(ri.image_of[k])] for k in sel])
    blocks = torch.full((1, max(start + bucket, len(ri.blocks))), -1, dtype=torch.long)
    blocks[0, :len(ri.blocks)] = ri.blocks
    return {"mask": mask, "embeds": embeds, "blocks": blocks}


def prompt_inputs(prompt: list[int], pixel_values, vision, encode, bucket: int) -> dict | None:
    """``mm`` for a whole prompt prefilled in one call, the way Tenstorrent's plugin hands images
    to ``prefill_forward``: the request's ``pixel_values`` ([images, C, H, W], or a list of
    them) in prompt order, the prompt holding ``mm_tokens_per_image`` image tokens per image.
    None without images."""
    parts = [p for p in (pixel_values if isinstance(pixel_values, (list, tuple)) else [pixel_values])
             if p is not None and p.numel()]
    if not parts:
        return None
    px = torch.cat([p if p.dim() == 4 else p[None] for p in parts])  # [C, H, W] is one image
    positions = [i for i, t in enumerate(prompt) if t == vision.image_token_index]
    per, k = vision.mm_tokens_per_image, px.shape[0]
    if len(positions) != per * k:
        raise ValueError(f"{k} image(s) in pixel_values need {per * k} image tokens "
                         f"({vision.image_token_index}) in the prompt, found {len(positions)}")
    blocks = torch.full((len(prompt),), -1, dtype=torch.long)
    image_of = [j // per for j in range(len(positions))]
    blocks[positions] = torch.tensor(image_of, dtype=torch.long)
    out = encode(px)
    ri = RequestImages([None] * k, positions, image_of, blocks,
                       {i: out[i * per:(i + 1) * per] for i in range(k)})
    return chunk_inputs(ri, encode, 0, len(prompt), bucket)


def request_pixels(pixel_values, rows: int, start: int):
    """The one request's images out of ``prefill_forward``'s ``pixel_values`` as Tenstorrent's
    plugin passes them (one entry per request of the batch, here ``rows`` = 1, or the request's
    images directly); images are merged into a prompt prefilled whole, so ``start`` must be 0."""
    px = pixel_values[0] if isinstance(pixel_values, (list, tuple)) and len(pixel_values) == rows else pixel_values
    if px is not None and start != 0:
        raise ValueError(f"pixel_values with a prefill starting at position {start}: images are merged "
                         "into a prompt prefilled whole (start_pos 0)")
    return px
