"""Gemma 3's vision part: the SigLIP vision tower and the multimodal projector.

The tower (HF ``SiglipVisionModel`` without its pooling head) cuts an image of ``image_size``
pixels into ``(image_size / patch_size)**2`` patches; the patch embedding (a stride-``patch_size``
convolution) is a matmul on each flattened patch ``[channels * patch * patch]`` in the
convolution weight's (channel, row, column) order, plus a bias and a learned position embedding.
Encoder layers are pre-LayerNorm (with biases) bidirectional attention within one image and a
gelu(tanh) MLP, all projections with biases. The projector (HF ``Gemma3MultiModalProjector``)
average-pools the patch grid to ``mm_tokens_per_image`` soft tokens, applies Gemma's (1 + w)
RMSNorm and projects to the text model's hidden size. The text model then reads these soft tokens
in place of the ``image_token_index`` placeholders, which attend to each other bidirectionally
within one image (HF's ``token_type_ids`` mask, vLLM's ``is_mm_prefix_lm``).

Tensors are prefixed ``v_`` (tower) and ``mm_`` (projector); their layers are the tower's layers
``[0, vision.num_hidden_layers)``. Default plan: heads and the MLP's intermediate dim over
``cols`` (Megatron-style column then row parallel, one all_reduce per branch), the hidden dim
replicated (LayerNorm needs whole rows), the projector replicated.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .base import Dim, HFName, Linear, Local, Norm, Residual, TensorDecl, image_token_budget
from . import transforms
from .vision_part import PLAIN, ImageLayout, VisionPart, blocks_of, must_equal, processor_json, unsupported

#: what a vision bucket counts
BUCKET_UNIT = "images"
#: one image's soft tokens attend to each other bidirectionally in the text model (HF's
#: ``token_type_ids`` mask, vLLM's ``is_mm_prefix_lm``)
BIDIRECTIONAL_IMAGES = True
#: the image tokens as Gemma 3's tokenizer spells them, by the role its processor finds them by
#: (``extra_special_tokens``): role -> (text, the id's field)
TOKENIZER_TOKENS = {"boi_token": ("<start_of_image>", "boi_token_index"),
                    "image_token": ("<image_soft_token>", "image_token_index"),
                    "eoi_token": ("<end_of_image>", "eoi_token_index")}
#: vLLM's Gemma 3 processor merges newline runs around images by their tokens ("\n" .. "\n\n\n\n")
NEWLINE_TOKENS = True


class Gemma3Vision(BaseModel):
    """Gemma 3's vision tower (HF ``vision_config``, a SiglipVisionConfig) and image tokens."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    hidden_size: int = Field(default=1152, gt=0)
    """Width of the vision tower's residual stream."""
    intermediate_size: int = Field(default=4304, gt=0)
    """Width of the vision MLP's hidden layer."""
    num_hidden_layers: int = Field(default=27, gt=0)
    """Vision encoder layers."""
    num_attention_heads: int = Field(default=16, gt=0)
    """Vision attention heads (head width = hidden_size / num_attention_heads)."""
    image_size: int = Field(default=896, gt=0)
    """Images are resized to image_size x image_size pixels by the processor."""
    patch_size: int = Field(default=14, gt=0)
    """Pixels per side of one patch."""
    num_channels: int = Field(default=3, gt=0)
    """Color channels."""
    layer_norm_eps: float = 1e-6
    """Epsilon of the vision LayerNorms and of the projector's RMSNorm."""
    hidden_act: Literal["gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    """Vision MLP activation."""
    mm_tokens_per_image: int = Field(default=256, gt=0)
    """Soft tokens one image becomes (a square number; the patch grid is average-pooled to it)."""
    image_token_index: int = Field(default=262144, ge=0)
    """Placeholder token the soft tokens replace."""
    boi_token_index: int = Field(default=255999, ge=0)
    """Begin-of-image token."""
    eoi_token_index: int = Field(default=256000, ge=0)
    """End-of-image token."""

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_pixels(self) -> int:
        return self.num_channels * self.patch_size ** 2

    @property
    def pool(self) -> int:
        """Patches per side of one average-pooling window."""
        return self.patches_per_side // math.isqrt(self.mm_tokens_per_image)

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for dims that do not fit together."""
        out = []
        if self.image_size % self.patch_size:
            out.append(("image_size", f"image_size={self.image_size} is not a multiple of patch_size="
                        f"{self.patch_size}"))
        if self.hidden_size % self.num_attention_heads:
            out.append(("num_attention_heads", f"hidden_size={self.hidden_size} is not divisible by "
                        f"num_attention_heads={self.num_attention_heads}"))
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image:
            out.append(("mm_tokens_per_image", f"mm_tokens_per_image={self.mm_tokens_per_image} is not "
                        "a square number (the patch grid is pooled to a square)"))
        elif self.patches_per_side % side:
            out.append(("mm_tokens_per_image", f"{self.patches_per_side} patches per side "
                        f"(image_size / patch_size) do not pool evenly to {side} per side "
                        f"(sqrt of mm_tokens_per_image={self.mm_tokens_per_image})"))
        return out


HF_VISION_KEYS = tuple(k for k in Gemma3Vision.model_fields
                       if k not in ("mm_tokens_per_image", "image_token_index", "boi_token_index",
                                    "eoi_token_index"))
HF_WRAPPER_KEYS = ("mm_tokens_per_image", "image_token_index", "boi_token_index", "eoi_token_index")


def from_hf(config: dict) -> dict | None:
    """The ``vision`` arch fields of a ``Gemma3ForConditionalGeneration`` config.json (None when
    it has no vision_config)."""
    vc = config.get("vision_config")
    if not isinstance(vc, dict):
        return None
    # vision_use_head: SigLIP's pooling head, if the checkpoint has one, is left unused (Gemma 3
    # reads the patch tokens)
    out = {k: vc[k] for k in HF_VISION_KEYS if vc.get(k) is not None}
    out.update({k: config[k] for k in HF_WRAPPER_KEYS if config.get(k) is not None})
    return out


def to_hf(v: Gemma3Vision) -> tuple[dict, dict]:
    """(HF vision_config, wrapper keys) for the reference model."""
    vc = {k: getattr(v, k) for k in HF_VISION_KEYS}
    vc["model_type"] = "siglip_vision_model"
    vc["vision_use_head"] = False
    return vc, {k: getattr(v, k) for k in HF_WRAPPER_KEYS}


# ---- declarations -------------------------------------------------------------------------------
def dims(v: Gemma3Vision, text_hidden: int) -> dict[str, Dim]:
    return {"hid": Dim("vision.hidden_size", v.hidden_size),
            "heads": Dim("vision.num_attention_heads", v.num_attention_heads, v.head_dim),
            "inter": Dim("vision.intermediate_size", v.intermediate_size),
            "pix": Dim("vision.patch_pixels", v.patch_pixels),
            "patches": Dim("vision.num_patches", v.num_patches),
            "text": Dim("hidden_size", text_hidden)}


def tensors(v: Gemma3Vision, text_hidden: int) -> list[TensorDecl]:
    d = dims(v, text_hidden)
    L = (0, v.num_hidden_layers)
    hid, heads, inter = d["hid"], d["heads"], d["inter"]
    vec = lambda n, dim, doc, layers=L: TensorDecl(n, "norms", (dim,), layers, doc, "vector")  # noqa: E731
    t = [TensorDecl("v_patch", "vision", (d["pix"], hid), None, "patch embedding (the convolution as a matmul)"),
         vec("v_patch_b", hid, "patch embedding bias", None),
         TensorDecl("v_pos", "vision", (d["patches"], hid), None, "position embedding (one row per patch)"),
         vec("v_ln1", hid, "pre-attention LayerNorm weight"), vec("v_ln1_b", hid, "pre-attention LayerNorm bias"),
         TensorDecl("v_wq", "vision", (hid, heads), L, "vision query projection"),
         TensorDecl("v_wk", "vision", (hid, heads), L, "vision key projection"),
         TensorDecl("v_wv", "vision", (hid, heads), L, "vision value projection"),
         vec("v_bq", heads, "vision query bias"), vec("v_bk", heads, "vision key bias"),
         vec("v_bv", heads, "vision value bias"),
         TensorDecl("v_wo", "vision", (heads, hid), L, "vision output projection"),
         vec("v_bo", hid, "vision output projection bias"),
         vec("v_ln2", hid, "pre-MLP LayerNorm weight"), vec("v_ln2_b", hid, "pre-MLP LayerNorm bias"),
         TensorDecl("v_w1", "vision", (hid, inter), L, "vision MLP fc1"), vec("v_b1", inter, "vision MLP fc1 bias"),
         TensorDecl("v_w2", "vision", (inter, hid), L, "vision MLP fc2"), vec("v_b2", hid, "vision MLP fc2 bias"),
         vec("v_post_ln", hid, "post LayerNorm weight", None), vec("v_post_ln_b", hid, "post LayerNorm bias", None),
         vec("mm_norm", hid, "projector RMSNorm (1 + w)", None),
         TensorDecl("mm_proj", "vision", (hid, d["text"]), None, "projector into the text model's hidden size")]
    return t


PLAN: dict[str, tuple] = {
    "v_wq": (None, "cols"), "v_wk": (None, "cols"), "v_wv": (None, "cols"),
    "v_bq": ("cols",), "v_bk": ("cols",), "v_bv": ("cols",), "v_wo": ("cols", None),
    "v_w1": (None, "cols"), "v_b1": ("cols",), "v_w2": ("cols", None),
}


def hf_names(v: Gemma3Vision) -> list[HFName]:
    e, p = "model.vision_tower.vision_model.embeddings.", "model.vision_tower.vision_model.encoder.layers.{i}."
    n = [HFName("v_patch", (e + "patch_embedding.weight",), "conv_patch"),
         HFName("v_patch_b", (e + "patch_embedding.bias",), "id"),
         HFName("v_pos", (e + "position_embedding.weight",), "id"),
         HFName("v_post_ln", ("model.vision_tower.vision_model.post_layernorm.weight",), "id"),
         HFName("v_post_ln_b", ("model.vision_tower.vision_model.post_layernorm.bias",), "id"),
         HFName("mm_norm", ("model.multi_modal_projector.mm_soft_emb_norm.weight",), "id"),
         HFName("mm_proj", ("model.multi_modal_projector.mm_input_projection_weight",), "id")]
    for ours, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj")):
        n.append(HFName(f"v_w{ours}", (f"{p}self_attn.{hf}.weight",)))
        n.append(HFName(f"v_b{ours}", (f"{p}self_attn.{hf}.bias",), "id"))
    for ours, hf in (("1", "fc1"), ("2", "fc2")):
        n.append(HFName(f"v_w{ours}", (f"{p}mlp.{hf}.weight",)))
        n.append(HFName(f"v_b{ours}", (f"{p}mlp.{hf}.bias",), "id"))
    for ours, hf in (("v_ln1", "layer_norm1"), ("v_ln2", "layer_norm2")):
        n.append(HFName(ours, (f"{p}{hf}.weight",), "id"))
        n.append(HFName(ours + "_b", (f"{p}{hf}.bias",), "id"))
    return n


def conv_patch(src, a):
    """Conv2d weight [hidden, channels, p, p] -> matmul weight [channels * p * p, hidden]."""
    w = src[0]
    return w.reshape(w.shape[0], -1).transpose(0, 1).contiguous()


transforms.register("conv_patch", conv_patch)


# ---- dataflow -----------------------------------------------------------------------------------
def programs(v: Gemma3Vision) -> list[tuple[str, int, list]]:
    """(layer kind, count, ops) of the vision program: patch embedding, encoder layers, projector.
    The input activation is ``patches`` [images * num_patches, patch_pixels]; the output ``image``
    [images * mm_tokens_per_image, text hidden], replicated."""
    layer = [Norm("h", "x", "v_ln1"), Linear("x", "v_wq", "q"), Linear("x", "v_wk", "k"), Linear("x", "v_wv", "v"),
             Local(("q", "k", "v"), "o", "bidirectional attention within one image (+bias)", fn="vision_attention"),
             Linear("o", "v_wo", "attn_out"), Local(("attn_out",), "attn_outb", "+ bias", fn="vision_bias_o"),
             Residual("attn_outb"),
             Norm("h", "x2", "v_ln2"), Linear("x2", "v_w1", "f"), Local(("f",), "fa", "+ bias, gelu(tanh)", fn="vision_gelu"),
             Linear("fa", "v_w2", "mlp_out"), Local(("mlp_out",), "mlp_outb", "+ bias", fn="vision_bias_2"),
             Residual("mlp_outb")]
    return [("vision_embedding", 1, [Linear("patches", "v_patch", "pe"),
                                     Local(("pe",), "h", "+ bias + position embedding", fn="vision_embed")]),
            ("vision_layer", v.num_hidden_layers, layer),
            ("vision_projector", 1, [Norm("h", "hn", "v_post_ln"),
                                     Local(("hn",), "pooled", "average pool to soft tokens", fn="vision_pool"),
                                     Norm("pooled", "pn", "mm_norm"), Linear("pn", "mm_proj", "image")])]


def inputs(v: Gemma3Vision) -> dict[str, tuple[Dim, ...]]:
    """Activations a vision program starts from (feature dims)."""
    return {"patches": (Dim("vision.patch_pixels", v.patch_pixels),),
            "h": (Dim("vision.hidden_size", v.hidden_size),)}


def rows(v: Gemma3Vision, images: int) -> tuple[int, dict[str, int]]:
    """(rows of the vision program's activations, per activation the rows where they differ)."""
    soft = images * v.mm_tokens_per_image
    return images * v.num_patches, {"pooled": soft, "pn": soft, "image": soft}


def norms(v: Gemma3Vision) -> dict:
    """``traits["norms"]`` entries: LayerNorms with their bias, the projector's RMSNorm eps."""
    ln = {"eps": v.layer_norm_eps, "layer_norm": True}
    return {"v_ln1": {**ln, "bias": "v_ln1_b"}, "v_ln2": {**ln, "bias": "v_ln2_b"},
            "v_post_ln": {**ln, "bias": "v_post_ln_b"}, "mm_norm": {"eps": v.layer_norm_eps}}


# ---- the vision part's functions (Gemma3VisionPart below calls them) ------------------------
def settings(v: Gemma3Vision, vs, norm: dict | None = None):
    """The spec's ``vision:`` settings as they apply (Gemma 3: as written but the normalisation
    ``norm`` the part fills in; buckets count images)."""
    return vs.model_copy(update=norm) if norm else vs


def check_settings(b, vs) -> list:
    """Diagnostics for ``vs`` (buckets = image counts) against the token budget."""
    v, d, at = b.arch.vision, [], ("vision",)
    for k, what in (("min_pixels", "Qwen2.5-VL's pixel budget"), ("max_pixels", "Qwen2.5-VL's pixel budget"),
                    ("longest_edge", "Mistral 3's image bound")):
        if getattr(vs, k) is not None:
            d.append(b.locate(at + (k,), f"{k} is {what}; Gemma 3 resizes every image to "
                              f"image_size={v.image_size}: remove it"))
    bks = vs.buckets
    if bks and max(bks) < vs.images_per_prompt:
        d.append(b.locate(at + ("buckets",), f"the largest vision bucket ({max(bks)} images) cannot hold "
                          f"images_per_prompt={vs.images_per_prompt}: a prompt's images are encoded in one "
                          f"call; add a bucket of {vs.images_per_prompt} or lower images_per_prompt"))
    per_image = v.mm_tokens_per_image + 2  # begin-of-image, soft tokens, end-of-image
    d += image_token_budget(b, vs, per_image, f"one image is {per_image} tokens (mm_tokens_per_image="
                            f"{v.mm_tokens_per_image} + begin/end of image)", "images_per_prompt")
    return d


def preprocessor_config(v: Gemma3Vision, vs) -> dict:
    """HF ``preprocessor_config.json``: resize to image_size, scale to [0, 1], normalize with
    mean = std = 0.5, no pan-and-scan."""
    return {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "do_convert_rgb": True, "do_resize": True, "size": {"height": v.image_size, "width": v.image_size},
            "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": list(vs.image_mean), "image_std": list(vs.image_std), "do_pan_and_scan": False}


def processor_config(v: Gemma3Vision, vs) -> dict:
    return {"processor_class": "Gemma3Processor", "image_seq_length": v.mm_tokens_per_image}


def image_inputs(v: Gemma3Vision, vs, images: list) -> dict:
    """``pixel_values`` [n, channels, image_size, image_size] as transformers' Gemma 3 image
    processor makes them."""
    import transformers

    cfg = {k: x for k, x in preprocessor_config(v, vs).items() if k not in ("image_processor_type", "processor_class")}
    proc = transformers.Gemma3ImageProcessor(**cfg)
    return {"pixel_values": proc(images=images, return_tensors="pt")["pixel_values"].float()}


def special_tokens(v: Gemma3Vision) -> tuple[int, ...]:
    return (v.image_token_index, v.boi_token_index, v.eoi_token_index)


def placeholder(v: Gemma3Vision) -> int:
    """The prompt token each soft token replaces."""
    return v.image_token_index


def image_tokens(v: Gemma3Vision, inputs, k: int) -> list[int]:
    """Image ``k`` in a prompt: begin-of-image, the soft-token placeholders, end-of-image."""
    return [v.boi_token_index] + [v.image_token_index] * v.mm_tokens_per_image + [v.eoi_token_index]


def bucket_need(v: Gemma3Vision, inputs: dict) -> int:
    """What a vision bucket must hold for ``inputs``: images."""
    return inputs["pixel_values"].shape[0]


def program_inputs(v: Gemma3Vision, inputs: dict, bucket: int, dtype):
    """(patches [bucket images x num_patches, patch_pixels], per-call metadata (none), a function
    from the program's ``image`` rows to the images' soft tokens in prompt order)."""
    import torch

    px = inputs["pixel_values"]
    n = px.shape[0]
    pad = torch.zeros(bucket, *px.shape[1:], dtype=dtype)
    pad[:n] = px.to(dtype)
    p, side = v.patch_size, v.patches_per_side
    # [n, C, side, p, side, p] -> patches row-major, each (channel, row, column) like the conv weight
    patches = pad.view(bucket, v.num_channels, side, p, side, p).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(bucket * v.num_patches, v.patch_pixels), None, lambda out: out[:n * v.mm_tokens_per_image]


def warmup_inputs(v: Gemma3Vision, vs, bucket: int) -> dict:
    """Fixed pixels filling a vision bucket (the build records the program's output on them)."""
    import torch

    n = torch.arange(bucket * v.num_channels * v.image_size ** 2, dtype=torch.float64)
    return {"pixel_values": torch.sin(n * 0.37).reshape(bucket, v.num_channels, v.image_size, v.image_size).float()}


def reference_kwargs(v: Gemma3Vision, prompt: list[int], inputs: dict, device) -> dict:
    """transformers ``Gemma3ForConditionalGeneration`` inputs besides the prompt's ids."""
    import torch

    return {"pixel_values": inputs["pixel_values"].to(device),
            "token_type_ids": (torch.tensor([prompt]) == v.image_token_index).long().to(device)}


def reference_features(hf, inputs: dict, device):
    """transformers' soft tokens of the images [soft tokens, text hidden]."""
    out = hf.model.get_image_features(inputs["pixel_values"].to(device)).pooler_output
    return out.reshape(-1, out.shape[-1])


# ---- the vision part (shared code calls this class, never the functions above by name) --------
class Gemma3VisionPart(VisionPart):
    """Gemma 3's vision part: whole images of ``image_size``, a fixed count of soft tokens each,
    bidirectional within an image, plain positions."""

    BUCKET_UNIT = BUCKET_UNIT
    BIDIRECTIONAL_IMAGES = BIDIRECTIONAL_IMAGES
    TOKENIZER_TOKENS = TOKENIZER_TOKENS
    NEWLINE_TOKENS = NEWLINE_TOKENS
    VLLM_PROCESSOR = ("vllm.model_executor.models.gemma3_mm", "Gemma3MultiModalProcessor",
                      "Gemma3ProcessingInfo", "Gemma3DummyInputsBuilder")
    PLACEHOLDER_STR = "<start_of_image>"
    PIL_PROCESSORS = {"transformers.models.gemma3.image_processing_gemma3": (
        "transformers.models.gemma3.image_processing_pil_gemma3",
        {"Gemma3ImageProcessor": "Gemma3ImageProcessorPil"})}

    HF_IMAGE_PROCESSOR = "Gemma3ImageProcessorPil"
    RESAMPLE = 2

    def settings(self, vs):
        return settings(self.v, vs, self.normalisation(vs))

    def _processor_settings(self, ip, where, hf_dir):
        """Nothing of its own (Gemma 3 resizes every image to the encoder's ``image_size``, which
        the checkpoint's ``size`` must be); pan-and-scan is not served."""
        v = self.v
        size = (ip.size.get("height"), ip.size.get("width"))
        if size != (v.image_size, v.image_size):
            must_equal(where, "size", {"height": size[0], "width": size[1]}, "vision_config.image_size",
                       v.image_size)
        if getattr(ip, "do_pan_and_scan", None):
            raise unsupported(where, "do_pan_and_scan", True, False)
        must_equal(str(Path(hf_dir) / "processor_config.json"), "image_seq_length",
                   processor_json(hf_dir).get("image_seq_length"), "mm_tokens_per_image", v.mm_tokens_per_image)
        return {}

    def check_settings(self, b, vs):
        return check_settings(b, vs)

    def preprocessor_config(self, vs):
        return preprocessor_config(self.v, vs)

    def processor_config(self, vs):
        return processor_config(self.v, vs)

    def image_inputs(self, vs, images):
        return image_inputs(self.v, vs, images)

    def special_tokens(self):
        return special_tokens(self.v)

    def placeholder(self):
        return placeholder(self.v)

    def image_tokens(self, inputs, k):
        return image_tokens(self.v, inputs, k)

    def soft_token_counts(self, inputs):
        return [self.v.mm_tokens_per_image] * int(inputs["pixel_values"].shape[0])

    def bucket_need(self, inputs):
        return bucket_need(self.v, inputs)

    def program_inputs(self, inputs, bucket, dtype):
        return program_inputs(self.v, inputs, bucket, dtype)

    def warmup_inputs(self, vs, bucket):
        return warmup_inputs(self.v, vs, bucket)

    def reference_kwargs(self, prompt, inputs, device):
        return reference_kwargs(self.v, prompt, inputs, device)

    def reference_features(self, hf, inputs, device):
        return reference_features(hf, inputs, device)

    # -- served requests: vLLM's Gemma 3 processor's fields -------------------------------------
    def feature_inputs(self, features):
        """``pixel_values`` [images, C, H, W] (vLLM's field is flat over an image's crops: one)."""
        import torch

        px = [f.data["pixel_values"].data for f in features]
        return {"pixel_values": torch.cat([t[None] if t.dim() == 3 else t for t in px])}

    def _layout(self, prompt, n: int, what: str):
        v = self.v
        positions = [i for i, t in enumerate(prompt) if t == v.image_token_index]
        per = v.mm_tokens_per_image
        if len(positions) != per * n:
            raise ValueError(f"{n} image(s){what} need {per * n} image tokens ({v.image_token_index}) in the "
                             f"prompt, found {len(positions)}")
        image_of = [k // per for k in range(len(positions))]
        return ImageLayout(positions, image_of, blocks_of(len(prompt), positions, image_of, True), [per] * n)

    def request_layout(self, features, prompt):
        """The prompt holds ``mm_tokens_per_image`` placeholders per image, one block each."""
        return (self._layout(prompt, len(features), "") if features else None), PLAIN

    def prompt_layout(self, prompt, inputs):
        return self._layout(prompt, int(inputs["pixel_values"].shape[0]), " in pixel_values"), PLAIN
