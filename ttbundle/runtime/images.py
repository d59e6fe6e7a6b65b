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

from ..families.vision_part import image_features


@dataclass
class RequestImages:
    features: list  # vLLM MultiModalFeatureSpec, in prompt order
    positions: list[int]  # prompt positions of the soft tokens, image after image
    image_of: list[int]  # per soft token: which image
    blocks: torch.Tensor  # [prompt length] image block per position, -1: text (or causal image tokens)
    counts: list[int]  # soft tokens per image
    # how the family's vision part encodes features: ``(encode, features) -> soft tokens``
    # (``VisionPart.encode_features``)
    encode_features: Callable | None = None
    embeds: dict = field(default_factory=dict)  # image index -> soft tokens [mm, hidden]

    def first(self, i: int) -> int:
        """Index into ``positions`` of image ``i``'s first soft token."""
        return sum(self.counts[:i])

    def count(self, i: int) -> int:
        return self.counts[i]


def request_state(part, features, prompt: list[int]):
    """``(RequestImages | None, PromptPositions)`` of a new request: where the family's vision
    ``part`` puts its images (vLLM ``mm_features``) and the positions its prompt takes."""
    feats = image_features(features)
    layout, positions = part.request_layout(feats, list(prompt))
    if layout is None:
        return None, positions
    return RequestImages(feats, layout.positions, layout.image_of, layout.blocks, layout.counts,
                         part.encode_features), positions


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


def prompt_inputs(part, prompt: list[int], pixel_values, image_grid_thw, encode, bucket: int):
    """``(mm, PromptPositions)`` of a whole prompt prefilled in one call, the way Tenstorrent's
    plugin hands a request's images to ``prefill_forward``: its ``pixel_values`` (a tensor or a
    list of them, in prompt order; Gemma 3 [images, C, H, W], Qwen2.5-VL [patches, C*T*P*P]) and
    ``image_grid_thw`` where the family has it ([images, 3], or a list). ``mm`` is None without
    images (the positions are then the text's); the family's vision ``part`` lays the images
    out and refuses a prompt whose image tokens do not match them."""
    def parts(x):
        return [p for p in (x if isinstance(x, (list, tuple)) else [x]) if p is not None and p.numel()]

    px = parts(pixel_values)
    if not px:
        return None, part.positions(list(prompt), None)
    inputs = {"pixel_values": torch.cat([p if p.dim() != 3 else p[None] for p in px])}
    if image_grid_thw is not None:
        inputs["image_grid_thw"] = torch.cat([g.reshape(-1, 3) for g in parts(image_grid_thw)]).long()
    layout, positions = part.prompt_layout(list(prompt), inputs)
    out = encode(inputs["pixel_values"], inputs.get("image_grid_thw"))
    embeds, at = {}, 0
    for i, c in enumerate(layout.counts):
        embeds[i], at = out[at:at + c], at + c
    ri = RequestImages([None] * len(layout.counts), layout.positions, layout.image_of, layout.blocks,
                       layout.counts, embeds=embeds)
    return chunk_inputs(ri, encode, 0, len(prompt), bucket), positions


def request_pixels(pixel_values, rows: int, start: int):
    """The one request's images out of ``prefill_forward``'s ``pixel_values`` as Tenstorrent's
    plugin passes them (one entry per request of the batch, here ``rows`` = 1, or the request's
    images directly); images are merged into a prompt prefilled whole, so ``start`` must be 0."""
    px = pixel_values[0] if isinstance(pixel_values, (list, tuple)) and len(pixel_values) == rows else pixel_values
    if px is not None and start != 0:
        raise ValueError(f"pixel_values with a prefill starting at position {start}: images are merged "
                         "into a prompt prefilled whole (start_pos 0)")
    return px
