"""Images for multimodal bundles: preprocessing as the model's HF image processor does it, and
the token layout of a prompt carrying images.

vLLM preprocesses served requests with the HF processor the package carries
(``preprocessor_config.json``, :func:`preprocessor_config`); ``ttbundle check --image`` runs the
same image processor, so both sides of the comparison see the same ``pixel_values``.
"""

from __future__ import annotations

from pathlib import Path

from .errors import InvalidInput


def _vision(bundle):
    v = getattr(bundle.arch, "vision", None)
    if v is None:
        raise InvalidInput(f"{bundle.file}: the model has no vision part ({bundle.arch.family}, text only); "
                           "--image needs a multimodal model (model.vision)")
    return v


def preprocessor_config(bundle) -> dict:
    """HF ``preprocessor_config.json`` of the bundle's image processor (Gemma 3: resize to
    image_size, scale to [0, 1], normalize with mean = std = 0.5, no pan-and-scan)."""
    v = _vision(bundle)
    return {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "do_convert_rgb": True, "do_resize": True, "size": {"height": v.image_size, "width": v.image_size},
            "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": False}


def processor_config(bundle) -> dict:
    """HF ``processor_config.json``: the processor class vLLM's multimodal processor loads (with
    the package's tokenizer, whose special tokens name the image tokens) and its soft tokens."""
    v = _vision(bundle)
    return {"processor_class": "Gemma3Processor", "image_seq_length": v.mm_tokens_per_image}


def package_files(bundle) -> dict[str, bytes]:
    """The files a multimodal package carries for vLLM's processor ({} for a text model)."""
    import json

    if getattr(bundle.arch, "vision", None) is None:
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


def pixel_values(bundle, images):
    """[n, channels, image_size, image_size] float32 as the HF image processor makes them."""
    import transformers

    _vision(bundle)
    cfg = {k: v for k, v in preprocessor_config(bundle).items()
           if k not in ("image_processor_type", "processor_class")}
    proc = transformers.Gemma3ImageProcessor(**cfg)
    return proc(images=load_images(images), return_tensors="pt")["pixel_values"].float()


def image_tokens(v) -> list[int]:
    """One image in a prompt: begin-of-image, the soft-token placeholders, end-of-image."""
    return [v.boi_token_index] + [v.image_token_index] * v.mm_tokens_per_image + [v.eoi_token_index]


def prompt_with_images(bundle, prompt: list[int], n: int, chunk: int) -> tuple[list[int], dict]:
    """``prompt`` (random text tokens) with ``n`` images after its first token, special tokens
    kept out of the text; the placeholders' positions and every token's image block (-1: text).
    Every image lies within the first prefill chunk (an image's tokens are prefilled together)."""
    v = _vision(bundle)
    vs = bundle.vision
    if n > vs.images_per_prompt:
        raise InvalidInput(f"{n} images exceed vision.images_per_prompt={vs.images_per_prompt} of {bundle.file}")
    special = {v.image_token_index, v.boi_token_index, v.eoi_token_index}
    text = [t if t not in special else (t + 3) % bundle.arch.vocab_size for t in prompt]
    text = [t if t not in special else 0 for t in text]
    per = len(image_tokens(v))
    if 1 + n * per > chunk:
        raise InvalidInput(f"{n} images x {per} tokens after the first token need {1 + n * per} tokens in "
                           f"the first prefill chunk, which holds {chunk}; give fewer images")
    out = text[:1] + sum((image_tokens(v) for _ in range(n)), []) + text[1:]
    blocks, positions, b, prev = [], [], -1, False
    for i, t in enumerate(out):
        img = t == v.image_token_index
        if img and not prev:
            b += 1
        blocks.append(b if img else -1)
        if img:
            positions.append(i)
        prev = img
    return out, {"positions": positions, "blocks": blocks}
