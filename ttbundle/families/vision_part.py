"""The vision part of a multimodal family: one interface every family's vision part implements
(:class:`VisionPart`), so that shared code (spec, check, the runtime's model runner, adapter
and device model) calls it without naming a family or probing for what it has.

An instance is bound to an arch's ``vision`` dims (``Family.vision_part(arch)``). What differs
between families lives in the subclass: the spec's ``vision:`` settings and their checks, the
HF image processor's files and pixels, a prompt's image tokens, what a vision bucket counts and
the vision program's per-call inputs, the transformers reference's inputs, the positions a
prompt's tokens take (:class:`PromptPositions`: plain for Gemma 3, M-RoPE for Qwen2.5-VL) and
how a served request's images (vLLM ``mm_features``) become soft tokens (:class:`ImageLayout`
and :meth:`VisionPart.encode_features`). The runtime keeps the per-request state
(``runtime.images.RequestImages``) and its chunking; the part says what goes into it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import InvalidInput


# ---- positions ---------------------------------------------------------------------------------
def chunk_rope(rope, delta: int, start: int, n: int, bucket: int):
    """``rope_positions`` [3, 1, bucket] of the prefill chunk ``[start, start + n)``: the prompt's
    M-RoPE columns, then (a resumed request recomputing its output tokens) cache position + delta;
    padding columns take position 0 (they are not valid tokens)."""
    import torch

    out = torch.zeros(3, 1, bucket, dtype=torch.long)
    cols = torch.arange(start, start + n)
    L = rope.shape[1]
    inside = cols < L
    out[:, 0, :n] = torch.where(inside[None], rope[:, cols.clamp(max=L - 1)], (cols + delta)[None].expand(3, -1))
    return out


def decode_rope(positions, deltas):
    """``rope_positions`` [3, B, 1] of a decode batch: each row's cache position plus its rope
    delta on all three axes (padding rows, position -1, take 0)."""
    import torch

    p = torch.where(positions >= 0, positions + deltas, torch.zeros_like(positions))
    return p[None, :, None].expand(3, -1, 1).clone()


@dataclass(frozen=True)
class PromptPositions:
    """The rope positions a prompt's tokens take. ``rope`` None: plain (each token at its cache
    position). Otherwise M-RoPE ``[3, L]`` (temporal, height, width) and ``delta``: a token at
    cache position ``p >= L`` (decoded, or an output token re-prefilled) is at ``p + delta`` on
    all three axes."""

    rope: object = None
    delta: int = 0

    @property
    def plain(self) -> bool:
        return self.rope is None

    def chunk(self, start: int, n: int, bucket: int) -> dict:
        """The prefill forward's keywords for the chunk ``[start, start + n)`` padded to
        ``bucket``: ``{}`` for plain positions, else its ``rope_positions`` [3, 1, bucket]."""
        return {} if self.rope is None else {"rope_positions": chunk_rope(self.rope, self.delta, start, n, bucket)}


PLAIN = PromptPositions()


# ---- a request's images ------------------------------------------------------------------------
@dataclass
class ImageLayout:
    """Where a prompt's images go: ``positions`` the prompt positions of the soft tokens (image
    after image), ``image_of`` per soft token its image, ``blocks`` [prompt length] the image
    block of each position (-1: text, or an image attending causally), ``counts`` soft tokens per
    image."""

    positions: list[int]
    image_of: list[int]
    blocks: object
    counts: list[int] = field(default_factory=list)


def image_features(features) -> list:
    """A request's image features (vLLM ``MultiModalFeatureSpec``) in prompt order."""
    return sorted((f for f in features or [] if f.modality == "image"), key=lambda f: f.mm_position.offset)


class VisionPart:
    """A family's vision part bound to its arch's ``vision`` dims (``self.v``). Subclasses
    implement every method that raises here; the class attributes have the common defaults."""

    #: what a vision bucket counts ("images", "patches")
    BUCKET_UNIT: ClassVar[str] = "images"
    #: one image's soft tokens attend to each other bidirectionally in the text model
    BIDIRECTIONAL_IMAGES: ClassVar[bool] = False
    #: the image tokens as the family's tokenizer spells them: role -> (text, id field of ``v``)
    TOKENIZER_TOKENS: ClassVar[dict] = {}
    #: the demo tokenizer's chat template for this family (None: the demo's own)
    CHAT_TEMPLATE: ClassVar[str | None] = None
    #: vLLM's processor merges newline runs around images by their tokens (Gemma 3)
    NEWLINE_TOKENS: ClassVar[bool] = False
    #: vLLM's own processor for the HF class: (module, processor, processing info, dummy inputs
    #: builder) and the placeholder a chat message's image becomes (its ``get_placeholder_str``)
    VLLM_PROCESSOR: ClassVar[tuple[str, str, str, str]] = ("", "", "", "")
    PLACEHOLDER_STR: ClassVar[str] = ""
    #: transformers' processor class (by name) vLLM loads, made image-only (no video processor,
    #: which needs torchvision) by the runtime's registry; None: as vLLM loads it
    IMAGE_ONLY_PROCESSOR: ClassVar[str | None] = None
    #: transformers' torchvision image-processor modules vLLM's model module imports from, and
    #: the PIL module of the same processor: {torchvision module: (PIL module, {name: PIL name})}
    PIL_PROCESSORS: ClassVar[dict] = {}
    #: transformers' processor classes (not image processors) its lazy package gives as
    #: torchvision placeholders although they need torchvision only through the image processor
    #: ``PIL_PROCESSORS`` replaces: {package: (module, class name)} (Mistral 3's PixtralProcessor)
    PROCESSOR_CLASSES: ClassVar[dict] = {}

    #: transformers' PIL image processor (by name) that reads a checkpoint's preprocessing
    HF_IMAGE_PROCESSOR: ClassVar[str] = ""
    #: the family's processor's normalisation (the spec's ``image_mean`` / ``image_std`` default)
    IMAGE_MEAN: ClassVar[tuple] = (0.5, 0.5, 0.5)
    IMAGE_STD: ClassVar[tuple] = (0.5, 0.5, 0.5)
    #: the resampling filter the package's processor resizes with (PIL's code: 2 bilinear, 3 bicubic)
    RESAMPLE: ClassVar[int] = 3

    def __init__(self, v):
        self.v = v

    def _todo(self, what: str):
        return NotImplementedError(f"{type(self).__name__} has no {what}")

    # -- the spec's vision settings -------------------------------------------------------------
    def settings(self, vs):
        """The spec's ``vision:`` settings with the family's defaults filled in."""
        return vs

    def normalisation(self, vs) -> dict:
        """``image_mean`` / ``image_std`` the spec leaves out, filled with the family's."""
        return {k: list(d) for k, d in (("image_mean", self.IMAGE_MEAN), ("image_std", self.IMAGE_STD))
                if getattr(vs, k) is None}

    def processor_settings(self, hf_dir) -> dict:
        """The spec's ``vision:`` settings a checkpoint's own image processor gives
        (``preprocessor_config.json``, or ``processor_config.json``'s ``image_processor``, in
        ``hf_dir``, read by transformers' processor class): {} where it has none. What the
        package's processor cannot do as the checkpoint's does (another patch size, filter or
        scale, pan-and-scan) is an InvalidInput naming the file, the key and both values."""
        ip, where = load_image_processor(self.HF_IMAGE_PROCESSOR, hf_dir)
        if ip is None:
            return {}
        fixed = {"do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "resample": self.RESAMPLE}
        for k, want in fixed.items():
            got = getattr(ip, k, want)
            if got is not None and (abs(got - want) > 1e-9 if isinstance(want, float) else got != want):
                raise unsupported(where, k, got, want)
        out = {"image_mean": [float(x) for x in ip.image_mean], "image_std": [float(x) for x in ip.image_std]}
        out.update(self._processor_settings(ip, where, hf_dir))
        return out

    def _processor_settings(self, ip, where: str, hf_dir) -> dict:
        """The family's own settings of the checkpoint's image processor ``ip``."""
        raise self._todo("_processor_settings")

    def largest_image(self, vs) -> int | None:
        """What the largest image the processor makes under ``vs`` counts in ``BUCKET_UNIT``
        (None: buckets count images, each of one size)."""
        return None

    def prompt_tokens_of(self, vs, need: int) -> int:
        """Prompt tokens of the largest image of at most ``need`` (``BUCKET_UNIT``) under ``vs``."""
        raise self._todo("prompt_tokens_of")

    def check_settings(self, b, vs) -> list:
        """Diagnostics for the settings ``vs`` of bundle ``b``."""
        raise self._todo("check_settings")

    # -- the package's processor files and the HF image processor -------------------------------
    def preprocessor_config(self, vs) -> dict:
        raise self._todo("preprocessor_config")

    def processor_config(self, vs) -> dict:
        raise self._todo("processor_config")

    def image_inputs(self, vs, images: list) -> dict:
        """What transformers' image processor makes of PIL ``images`` (``pixel_values``, and
        what else the family's vision program needs), float32."""
        raise self._todo("image_inputs")

    # -- the prompt -----------------------------------------------------------------------------
    def special_tokens(self) -> tuple[int, ...]:
        raise self._todo("special_tokens")

    def placeholder(self) -> int:
        """The prompt token each soft token replaces."""
        raise self._todo("placeholder")

    def image_tokens(self, inputs, k: int) -> list[int]:
        """Image ``k`` of ``inputs`` in a prompt, its begin and end tokens included."""
        raise self._todo("image_tokens")

    def soft_token_counts(self, inputs: dict) -> list[int]:
        """Soft tokens of each image of ``inputs``."""
        raise self._todo("soft_token_counts")

    def positions(self, prompt: list[int], inputs: dict | None) -> PromptPositions:
        """The rope positions of ``prompt`` carrying the images of ``inputs`` (plain by default)."""
        return PLAIN

    # -- the vision program ---------------------------------------------------------------------
    def bucket_need(self, inputs: dict) -> int:
        """What a vision bucket must hold for ``inputs`` (in ``BUCKET_UNIT``)."""
        raise self._todo("bucket_need")

    def program_inputs(self, inputs: dict, bucket: int, dtype):
        """(patches [rows, patch_pixels], per-call metadata the program's kernels read or None, a
        function from the program's ``image`` rows to the soft tokens in prompt order)."""
        raise self._todo("program_inputs")

    def warmup_inputs(self, vs, bucket: int) -> dict:
        """Fixed pixels filling a vision bucket."""
        raise self._todo("warmup_inputs")

    # -- the transformers reference -------------------------------------------------------------
    def reference_kwargs(self, prompt: list[int], inputs: dict, device) -> dict:
        raise self._todo("reference_kwargs")

    def reference_features(self, hf, inputs: dict, device):
        raise self._todo("reference_features")

    # -- served requests ------------------------------------------------------------------------
    def feature_inputs(self, features: list) -> dict:
        """``inputs`` (as :meth:`image_inputs` makes them) of vLLM image ``features`` (each with
        its data)."""
        raise self._todo("feature_inputs")

    def request_layout(self, features: list, prompt: list[int]) -> tuple[ImageLayout | None, PromptPositions]:
        """Where a new request's images go in its ``prompt`` (None without images) and its
        positions. ``features``: :func:`image_features` of the request."""
        raise self._todo("request_layout")

    def prompt_layout(self, prompt: list[int], inputs: dict) -> tuple[ImageLayout, PromptPositions]:
        """Where the images of ``inputs`` go in a whole ``prompt`` (prefilled in one call), and
        its positions; a prompt whose image tokens do not match the images is a ValueError."""
        raise self._todo("prompt_layout")

    def encode_features(self, encode, features: list):
        """Soft tokens of vLLM image ``features`` (in order) from ``encode`` (the package's vision
        program: ``encode(pixel_values, image_grid_thw=None)``), one call."""
        inputs = self.feature_inputs(features)
        return encode(inputs["pixel_values"], inputs.get("image_grid_thw"))


def unsupported(where: str, key: str, got, want):
    return InvalidInput(f"{where}: {key} is {got!r}, the package's image processor uses {want!r}: images "
                        "would not be what the model's own processor makes of them; ttbundle does not "
                        "serve this preprocessing yet")


def load_image_processor(cls_name: str, hf_dir):
    """(transformers' ``cls_name`` from the checkpoint's processor files in ``hf_dir``, the file
    read) or (None, None) where it has none."""
    d = Path(hf_dir)
    pre, proc = d / "preprocessor_config.json", d / "processor_config.json"
    where = pre
    if not pre.is_file():
        try:
            if not proc.is_file() or "image_processor" not in json.loads(proc.read_text(encoding="utf-8")):
                return None, None
        except (OSError, ValueError) as e:
            raise InvalidInput(f"{proc}: cannot read it as JSON ({e})") from None
        where = proc
    import transformers

    try:
        return getattr(transformers, cls_name).from_pretrained(str(d), local_files_only=True), str(where)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise InvalidInput(f"{where}: transformers' {cls_name} cannot read it ({type(e).__name__}: {e})") from None


def processor_json(hf_dir) -> dict:
    """``processor_config.json`` of ``hf_dir`` ({} where there is none)."""
    p = Path(hf_dir) / "processor_config.json"
    if not p.is_file():
        return {}
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{p}: cannot read it as JSON ({e})") from None
    return d if isinstance(d, dict) else {}


def must_equal(where: str, key: str, got, arch_key: str, want) -> None:
    """A processor setting that is also an arch dim must be the config's."""
    if got is not None and got != want:
        raise InvalidInput(f"{where}: {key} is {got!r} but config.json's {arch_key} is {want!r}; the two "
                           "files disagree about the model")


def blocks_of(prompt_len: int, positions: list[int], image_of: list[int], bidirectional: bool):
    """[prompt_len] image block per position: each image's soft tokens one block where they attend
    to each other (``bidirectional``), else all -1 (causal)."""
    import torch

    blocks = torch.full((prompt_len,), -1, dtype=torch.long)
    if bidirectional and positions:
        blocks[positions] = torch.tensor(image_of, dtype=torch.long)
    return blocks
