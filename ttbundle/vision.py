"""Images for multimodal bundles: preprocessing as the model's HF image processor does it, and
the token layout of a prompt carrying images.

vLLM preprocesses served requests with the HF processor the package carries
(``preprocessor_config.json``, :func:`preprocessor_config`); ``ttbundle check --image`` runs the
same image processor, so both sides of the comparison see the same ``pixel_values``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InvalidInput
from .tiles import pick


def vision_bucket(part, buckets: list[int], pixel_values, image_grid_thw=None) -> tuple[int, dict]:
    """The vision bucket images run in: the smallest of ``buckets`` (sorted) holding what the
    family's vision ``part`` (a ``VisionPart``) counts (``bucket_need``: Gemma 3 images,
    Qwen2.5-VL patches); and the inputs it counted (``pixel_values``, ``image_grid_thw`` if given),
    which ``part.program_inputs`` takes. The emulated model, the runtime adapter and the device
    model pick with it."""
    inputs = {"pixel_values": pixel_values}
    if image_grid_thw is not None:
        inputs["image_grid_thw"] = image_grid_thw
    return pick(buckets, part.bucket_need(inputs)), inputs


def _part(bundle):
    """The bundle's vision part (``Family.vision_part``): it owns what differs between families
    (processor settings, the prompt layout of an image, program inputs)."""
    part = bundle.family.vision_part(bundle.arch)
    if part is None:
        raise InvalidInput(f"{bundle.file}: the model has no vision part ({bundle.arch.family}, text only); "
                           "--image needs a multimodal model (model.vision)")
    return part


def preprocessor_config(bundle) -> dict:
    """HF ``preprocessor_config.json`` of the bundle's image processor (Gemma 3: resize to
    image_size, scale to [0, 1], normalize with mean = std = 0.5, no pan-and-scan; Qwen2.5-VL:
    resize within the spec's pixel budget to multiples of patch x merge pixels, CLIP's mean/std)."""
    return _part(bundle).preprocessor_config(bundle.vision)


def processor_config(bundle) -> dict:
    """HF ``processor_config.json``: the processor class vLLM's multimodal processor loads (with
    the package's tokenizer, whose special tokens name the image tokens) and its settings."""
    return _part(bundle).processor_config(bundle.vision)


def package_files(bundle) -> dict[str, bytes]:
    """The files a multimodal package carries for vLLM's processor ({} for a text model)."""
    if bundle.family.vision_part(bundle.arch) is None:
        return {}
    dump = lambda d: (json.dumps(d, indent=2, sort_keys=True) + "\n").encode()  # noqa: E731
    return {"preprocessor_config.json": dump(preprocessor_config(bundle)),
            "processor_config.json": dump(processor_config(bundle))}


def load_images(images) -> list:
    """PIL images from paths (or PIL images as they are); an unreadable file is InvalidInput."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for im in images:
        if isinstance(im, (str, Path)):
            try:
                with Image.open(im) as f:
                    out.append(f.convert("RGB"))
            except FileNotFoundError:
                raise InvalidInput(f"--image {im}: no such file") from None
            except (UnidentifiedImageError, OSError) as e:
                raise InvalidInput(f"--image {im}: not an image PIL can read ({e})") from None
        else:
            out.append(im.convert("RGB"))
    return out


def image_inputs(bundle, images) -> dict:
    """What the HF image processor makes of ``images`` with the package's settings, float32:
    ``pixel_values`` (Gemma 3: [n, channels, image_size, image_size]; Qwen2.5-VL: [patches,
    channels x temporal x patch^2]) and, where the family has it, ``image_grid_thw`` [n, 3]."""
    return _part(bundle).image_inputs(bundle.vision, load_images(images))


def pixel_values(bundle, images):
    """``image_inputs(bundle, images)["pixel_values"]``."""
    return image_inputs(bundle, images)["pixel_values"]


def prompt_with_images(bundle, prompt: list[int], n: int, chunk: int, inputs: dict | None = None) -> tuple[list[int], dict]:
    """``prompt`` (random text tokens) with ``n`` images after its first token, special tokens
    kept out of the text; the placeholders' positions and every token's image block (-1: text).
    Every image lies within the first prefill chunk (an image's tokens are prefilled together).
    ``inputs`` (:func:`image_inputs`): the images, for families whose images differ in length."""
    part = _part(bundle)
    v = bundle.arch.vision
    vs = bundle.vision
    if n > vs.images_per_prompt:
        raise InvalidInput(f"{n} images exceed vision.images_per_prompt={vs.images_per_prompt} of {bundle.file}")
    special = set(part.special_tokens())
    text = [t if t not in special else (t + 3) % bundle.arch.vocab_size for t in prompt]
    text = [t if t not in special else 0 for t in text]
    per = [part.image_tokens(inputs, k) for k in range(n)]
    if 1 + sum(map(len, per)) > chunk:
        raise InvalidInput(f"{n} images of {', '.join(str(len(p)) for p in per)} tokens after the first token need "
                           f"{1 + sum(map(len, per))} tokens in the first prefill chunk, which holds {chunk}; "
                           "give fewer or smaller images")
    out = text[:1] + sum(per, []) + text[1:]
    pad = part.placeholder()
    blocks, positions, b, prev = [], [], -1, False
    for i, t in enumerate(out):
        img = t == pad
        if img and not prev:
            b += 1
        blocks.append(b if img else -1)
        if img:
            positions.append(i)
        prev = img
    return out, {"positions": positions, "blocks": blocks}
