"""Mistral 3's vision part: the Pixtral vision encoder, the patch merger and the multimodal
projector (HF ``PixtralVisionModel`` and ``Mistral3MultiModalProjector``).

HF's processor (``PixtralImageProcessor``) shrinks an image whose longer side exceeds
``longest_edge`` (aspect kept, sides floored), then rounds each side up to a multiple of
``patch_size x spatial_merge_size`` pixels: a grid of ``h x w`` patches, ``h`` and ``w`` multiples
of the merge size, any size up to that bound (images of a prompt differ in size). In the prompt
an image is its rows of merge blocks: ``[IMG]`` per block of a row, ``[IMG_BREAK]`` after each
row, the last one ``[IMG_END]``; the soft tokens replace the ``[IMG]`` tokens only, which attend
causally like text, at plain positions.

The encoder (HF ``PixtralVisionModel``): the patch convolution without bias (a matmul on each
patch's ``[channels x p x p]`` pixels), RMSNorm ``ln_pre``, then per layer RMSNorm -> q/k/v (no
biases) -> 2-D rope -> attention within one image -> o -> residual; RMSNorm -> gated MLP
(``hidden_act``(gate) x up, no biases) -> residual. Its 2-D rope (``PixtralVisionRotaryEmbedding``)
rotates the first quarter of a head's frequencies ``theta^(-4j/hd)`` by the patch row and the
second quarter ``theta^(-(4j+2)/hd)`` by the column (:func:`rope_tables`). The projector: RMSNorm,
each ``m x m`` block of patches unfolded into one row channel-major (``F.unfold``: feature ``c``
of block patch ``j`` at ``c * m^2 + j``), ``merging_layer``, ``linear_1``, ``projector_hidden_act``,
``linear_2`` (no biases): one soft token per merge block, blocks row-major.

Host side, the program's rows are an image's patches in merge-block order (each block's m x m
patches together, blocks row-major, image after image: ``pixel_values`` [patches, C x p x p] with
``image_grid_thw`` (1, h, w) per image, the layout Qwen2.5-VL's part uses, so the bucket counts
patches and ``patch_grid.patch_layout`` (no windows) gives each row's patch position and
image); :func:`to_images` rebuilds HF's padded ``pixel_values`` and ``image_sizes``.

Tensors are prefixed ``v_`` (encoder) and ``mm_`` (projector); default plan: heads and the MLP's
intermediate dim over ``cols`` (column then row parallel), the hidden dim and projector replicated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidInput
from . import patch_grid, qwen2_5_vl_vision as q25
from .base import Dim, HFName, Linear, Local, Norm, Residual, TensorDecl, image_token_budget, vision_cap
from .vision_part import PLAIN, ImageLayout, VisionPart, blocks_of, must_equal, processor_json, unsupported

NORM_EPS = 1e-5  # Pixtral's RMSNorms (ln_pre, attention_norm, ffn_norm) use a fixed epsilon
#: Pixtral's image processor normalizes with CLIP's mean and std
IMAGE_MEAN, IMAGE_STD = q25.CLIP_MEAN, q25.CLIP_STD
#: the default ``vision.longest_edge``: 16 merge blocks per side at most (256 soft tokens), as
#: Qwen2.5-VL's default budget; the model's own bound is ``image_size``
DEFAULT_BLOCKS_PER_SIDE = 16
#: the image tokens as Mistral's tokenizer spells them, by the role PixtralProcessor reads
TOKENIZER_TOKENS = {"image_token": ("[IMG]", "image_token_index"),
                    "image_break_token": ("[IMG_BREAK]", "image_break_token_index"),
                    "image_end_token": ("[IMG_END]", "image_end_token_index")}
#: the demo tokenizer's chat template with Mistral's image placeholder: one ``[IMG]`` per image
#: part of a message (vLLM's processor replaces it by the image's rows)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {% if m['content'] is string %}{{ m['content'] }} "
    "{% else %}{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}[IMG] "
    "{% elif c['type'] == 'text' %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endif %}<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


class PixtralVision(BaseModel):
    """Mistral 3's vision encoder (HF ``vision_config``, a PixtralVisionConfig), its projector and
    image tokens (the wrapper's keys). Defaults: Mistral3Config's vision sub-config."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    hidden_size: int = Field(default=1024, gt=0)
    """Width of the vision encoder's residual stream."""
    intermediate_size: int = Field(default=4096, gt=0)
    """Width of the vision MLP's hidden layer (gated)."""
    num_hidden_layers: int = Field(default=24, gt=0)
    """Vision encoder layers."""
    num_attention_heads: int = Field(default=16, gt=0)
    """Vision attention heads (head width = hidden_size / num_attention_heads)."""
    num_channels: int = Field(default=3, gt=0)
    """Color channels."""
    image_size: int = Field(default=1540, gt=0)
    """Largest image side the encoder was trained for, in pixels (bounds `vision.longest_edge`)."""
    patch_size: int = Field(default=14, gt=0)
    """Pixels per side of one patch."""
    hidden_act: Literal["silu", "gelu"] = "gelu"
    """Vision MLP activation (of the gate)."""
    rope_theta: float = 10000.0
    """Rotary base of the 2-D vision rope."""
    spatial_merge_size: int = Field(default=2, gt=0)
    """Patches per side of one merge block (one soft token)."""
    projector_hidden_act: Literal["gelu", "silu", "gelu_pytorch_tanh"] = "gelu"
    """Activation between the projector's two linears."""
    multimodal_projector_bias: Literal[False] = False
    """Biases on the projector's linears: not supported (no published Mistral 3 has them)."""
    vision_feature_layer: Literal[-1] = -1
    """The encoder layer whose output the projector reads: only the last (-1) is supported."""
    image_token_index: int = Field(default=10, ge=0)
    """Placeholder token (`[IMG]`) the soft tokens replace."""
    image_break_token_index: int = Field(default=12, ge=0)
    """Token after each row of an image's merge blocks (`[IMG_BREAK]`; the tokenizer's id, not in
    config.json)."""
    image_end_token_index: int = Field(default=13, ge=0)
    """Token after an image's last row (`[IMG_END]`; the tokenizer's id, not in config.json)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_pixels(self) -> int:
        return self.num_channels * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per soft token."""
        return self.spatial_merge_size ** 2

    @property
    def factor(self) -> int:
        """Image sides are rounded up to multiples of this many pixels."""
        return self.patch_size * self.spatial_merge_size

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.hidden_size % self.num_attention_heads:
            out.append(("num_attention_heads", f"hidden_size={self.hidden_size} is not divisible by "
                        f"num_attention_heads={self.num_attention_heads}"))
        elif self.head_dim % 4:
            out.append(("num_attention_heads", f"head width {self.head_dim} (hidden_size / num_attention_heads) "
                        "must be a multiple of 4: the 2-D rope gives rows and columns a quarter of it each"))
        if len({self.image_token_index, self.image_break_token_index, self.image_end_token_index}) != 3:
            out.append(("image_break_token_index", "image_token_index, image_break_token_index and "
                        "image_end_token_index must be three different tokens"))
        return out


HF_VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                  "image_size", "patch_size", "hidden_act")
HF_WRAPPER_KEYS = ("spatial_merge_size", "projector_hidden_act", "multimodal_projector_bias",
                   "vision_feature_layer", "image_token_index")
TOKEN_KEYS = ("image_token_index", "image_break_token_index", "image_end_token_index")


def from_hf(config: dict) -> dict | None:
    """The ``vision`` arch fields of a ``Mistral3ForConditionalGeneration`` config.json (None
    without a vision_config). ``head_dim`` must be hidden / heads (HF's Pixtral computes it)."""
    vc = config.get("vision_config")
    if not isinstance(vc, dict):
        return None
    hd = vc.get("head_dim")
    if hd is not None and vc.get("hidden_size") and vc.get("num_attention_heads") \
            and hd * vc["num_attention_heads"] != vc["hidden_size"]:
        raise InvalidInput(f"config.json: vision_config.head_dim={hd} is not hidden_size / num_attention_heads "
                           f"= {vc['hidden_size']} / {vc['num_attention_heads']} (HF's Pixtral computes it so)")
    out = {k: vc[k] for k in HF_VISION_KEYS if vc.get(k) is not None}
    rp = vc.get("rope_parameters") or {}
    theta = rp.get("rope_theta", vc.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = theta
    out.update({k: config[k] for k in HF_WRAPPER_KEYS if config.get(k) is not None})
    if "image_token_id" in config and "image_token_index" not in config:
        out["image_token_index"] = config["image_token_id"]
    return out


def to_hf(v: PixtralVision) -> tuple[dict, dict]:
    """(HF vision_config, wrapper keys) for the reference model."""
    return patch_grid.hf_vision_config(v, HF_VISION_KEYS, HF_WRAPPER_KEYS, "pixtral")


# ---- declarations -------------------------------------------------------------------------------
def dims(v: PixtralVision, text_hidden: int) -> dict[str, Dim]:
    return patch_grid.encoder_dims(v, text_hidden, heads="num_attention_heads", text="hidden_size")


def tensors(v: PixtralVision, text_hidden: int) -> list[TensorDecl]:
    d = dims(v, text_hidden)
    L = (0, v.num_hidden_layers)
    hid, heads, inter = d["hid"], d["heads"], d["inter"]
    vec = lambda n, doc, layers=L: TensorDecl(n, "norms", (hid,), layers, doc, "vector")  # noqa: E731
    mat = lambda n, a, b, doc, layers=L: TensorDecl(n, "vision", (a, b), layers, doc)  # noqa: E731
    return [mat("v_patch", d["pix"], hid, "patch embedding (the convolution as a matmul, no bias)", None),
            vec("v_ln_pre", "RMSNorm before the encoder (ln_pre)", None),
            vec("v_ln1", "pre-attention RMSNorm"),
            mat("v_wq", hid, heads, "vision query projection"), mat("v_wk", hid, heads, "vision key projection"),
            mat("v_wv", hid, heads, "vision value projection"), mat("v_wo", heads, hid, "vision output projection"),
            vec("v_ln2", "pre-MLP RMSNorm"),
            mat("v_w1", hid, inter, "vision MLP gate"), mat("v_w3", hid, inter, "vision MLP up"),
            mat("v_w2", inter, hid, "vision MLP down"),
            vec("mm_norm", "projector RMSNorm", None),
            mat("mm_merge", d["merge"], hid, "patch merger (m x m patches unfolded, channel-major)", None),
            mat("mm_w1", hid, d["text"], "projector linear_1 into the text model's hidden size", None),
            mat("mm_w2", d["text"], d["text"], "projector linear_2", None)]


PLAN: dict[str, tuple] = {
    "v_wq": (None, "cols"), "v_wk": (None, "cols"), "v_wv": (None, "cols"), "v_wo": ("cols", None),
    "v_w1": (None, "cols"), "v_w3": (None, "cols"), "v_w2": ("cols", None),
}


def hf_names(v: PixtralVision) -> list[HFName]:
    """Checkpoint keys after the family's renames (``vision_tower.``, ``multi_modal_projector.``)."""
    p = "vision_tower.transformer.layers.{i}."
    n = [HFName("v_patch", ("vision_tower.patch_conv.weight",), "conv_patch"),
         HFName("v_ln_pre", ("vision_tower.ln_pre.weight",), "id"),
         HFName("v_ln1", (p + "attention_norm.weight",), "id"), HFName("v_ln2", (p + "ffn_norm.weight",), "id"),
         HFName("mm_norm", ("multi_modal_projector.norm.weight",), "id"),
         HFName("mm_merge", ("multi_modal_projector.patch_merger.merging_layer.weight",)),
         HFName("mm_w1", ("multi_modal_projector.linear_1.weight",)),
         HFName("mm_w2", ("multi_modal_projector.linear_2.weight",))]
    for x in "qkvo":
        n.append(HFName(f"v_w{x}", (f"{p}attention.{x}_proj.weight",)))
    for ours, hf in (("1", "gate_proj"), ("3", "up_proj"), ("2", "down_proj")):
        n.append(HFName(f"v_w{ours}", (f"{p}feed_forward.{hf}.weight",)))
    return n


# ---- dataflow -----------------------------------------------------------------------------------
def programs(v: PixtralVision) -> list[tuple[str, int, list]]:
    """(layer kind, count, ops): patch embedding and ln_pre, encoder layers, projector. Input
    ``patches`` [bucket patches, patch_pixels] in merge-block order; output ``image`` [bucket /
    m^2, text hidden]."""
    layer = [Norm("h", "x", "v_ln1"), Linear("x", "v_wq", "q"), Linear("x", "v_wk", "k"), Linear("x", "v_wv", "v"),
             Local(("q", "k", "v"), "o", "2-D rope (rows, columns), attention within each image",
                   fn="pixtral_attention"),
             Linear("o", "v_wo", "attn_out"), Residual("attn_out"),
             Norm("h", "x2", "v_ln2"), Linear("x2", "v_w1", "g"), Linear("x2", "v_w3", "u"),
             Local(("g", "u"), "gu", f"{v.hidden_act}(gate) x up", fn="pixtral_gated"),
             Linear("gu", "v_w2", "mlp_out"), Residual("mlp_out")]
    merge = Dim("vision.merge_hidden", v.merge_unit * v.hidden_size)
    return [("vision_embedding", 1, [Linear("patches", "v_patch", "pe"), Norm("pe", "h", "v_ln_pre")]),
            ("vision_layer", v.num_hidden_layers, layer),
            ("vision_projector", 1, [Norm("h", "hn", "mm_norm"),
                                     Local(("hn",), "hm", "each merge block's patches unfolded into one row "
                                           "(channel-major)", out_dim=merge, fn="mistral3_unfold"),
                                     Linear("hm", "mm_merge", "hp"), Linear("hp", "mm_w1", "m1"),
                                     Local(("m1",), "m1a", v.projector_hidden_act, fn="mistral3_projector_act"),
                                     Linear("m1a", "mm_w2", "image")])]


def inputs(v: PixtralVision) -> dict[str, tuple[Dim, ...]]:
    return {"patches": (Dim("vision.patch_pixels", v.patch_pixels),),
            "h": (Dim("vision.hidden_size", v.hidden_size),)}


def rows(v: PixtralVision, patches: int) -> tuple[int, dict[str, int]]:
    soft = patches // v.merge_unit
    return patches, {n: soft for n in ("hm", "hp", "m1", "m1a", "image")}


def norms(v: PixtralVision, text_eps: float) -> dict:
    """The encoder's RMSNorms (eps 1e-5); the projector's takes the text model's rms_norm_eps."""
    return {**{n: {"eps": NORM_EPS} for n in ("v_ln_pre", "v_ln1", "v_ln2")}, "mm_norm": {"eps": text_eps}}


# ---- image geometry (host side) -----------------------------------------------------------------
def blocks_per_side(v: PixtralVision, longest_edge: int) -> int:
    """Merge blocks on the longer side of the largest image the processor makes under
    ``longest_edge`` (its sides rounded up to multiples of ``factor``)."""
    return -(-longest_edge // v.factor)


def rope_tables(v: PixtralVision, hw, dtype):
    """cos, sin [rows, head_dim] of Pixtral's 2-D rope (HF ``PixtralVisionRotaryEmbedding``):
    ``inv = theta^(-2i/hd)`` for i < hd/2; the first hd/4 angles are the patch row times the even
    frequencies, the next hd/4 the column times the odd ones, repeated for the rotate-half layout."""
    import torch

    hd = v.head_dim
    inv = 1.0 / (v.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.cat([hw[:, 0:1].float() * inv[0::2], hw[:, 1:2].float() * inv[1::2]], dim=-1)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def to_patches(v: PixtralVision, image):
    """One image [C, h, w] (sides multiples of ``factor``) -> (patches [h/p x w/p, C x p x p] in
    merge-block order, grid (1, h/p, w/p))."""
    C, h, w = image.shape
    p, m = v.patch_size, v.spatial_merge_size
    if h % v.factor or w % v.factor:
        raise ValueError(f"an image of {h}x{w} pixels: its sides must be multiples of patch_size x "
                         f"spatial_merge_size = {v.factor} (as the processor makes them)")
    x = image.reshape(C, h // v.factor, m, p, w // v.factor, m, p)  # c, by, ki, py, bx, kj, px
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # by, bx, ki, kj, c, py, px
    return x.reshape(-1, v.patch_pixels), (1, h // p, w // p)


def to_images(v: PixtralVision, patches, grid):
    """The inverse of :func:`to_patches` over a batch: HF's ``pixel_values`` [n, C, H, W] (zero
    padded to the largest sides) and ``image_sizes`` [n, 2] (each image's height and width)."""
    import torch

    grids = q25._grids(grid)
    p, m, C = v.patch_size, v.spatial_merge_size, v.num_channels
    H = max(g[1] for g in grids) * p
    W = max(g[2] for g in grids) * p
    out = torch.zeros(len(grids), C, H, W, dtype=patches.dtype)
    base = 0
    for k, (_, h, w) in enumerate(grids):
        x = patches[base:base + h * w].reshape(h // m, w // m, m, m, C, p, p).permute(4, 0, 2, 5, 1, 3, 6)
        out[k, :, :h * p, :w * p] = x.reshape(C, h * p, w * p)
        base += h * w
    return out, torch.tensor([[h * p, w * p] for _, h, w in grids], dtype=torch.long)


def soft_tokens(v: PixtralVision, grid) -> int:
    _, h, w = (int(x) for x in grid)
    return h * w // v.merge_unit


def image_tokens(v: PixtralVision, grid) -> list[int]:
    """An image in a prompt: per row of merge blocks ``[IMG]`` per block then ``[IMG_BREAK]``,
    the last ``[IMG_BREAK]`` replaced by ``[IMG_END]`` (PixtralProcessor's rule)."""
    m = v.spatial_merge_size
    _, h, w = (int(x) for x in grid)
    out = ([v.image_token_index] * (w // m) + [v.image_break_token_index]) * (h // m)
    out[-1] = v.image_end_token_index
    return out


# ---- the spec's settings --------------------------------------------------------------------------
def settings(v: PixtralVision, vs, norm: dict | None = None):
    """The spec's ``vision:`` settings with Mistral 3's defaults: ``longest_edge`` (16 merge blocks
    per side, at most image_size), the normalisation (``norm``: what the part fills in) and,
    unless given, one bucket of ``images_per_prompt`` images of the largest size."""
    upd = dict(norm or {})
    if vs.longest_edge is None:
        upd["longest_edge"] = min(v.image_size, DEFAULT_BLOCKS_PER_SIDE * v.factor)
    if "buckets" not in vs.model_fields_set:
        n = blocks_per_side(v, upd.get("longest_edge", vs.longest_edge))
        upd["buckets"] = [vs.images_per_prompt * n * n * v.merge_unit]
    return vs.model_copy(update=upd) if upd else vs


def check_settings(b, vs) -> list:
    """Diagnostics for ``vs`` (buckets = patch counts) against the image size and token budgets."""
    v, d, at = b.arch.vision, [], ("vision",)
    for k in ("min_pixels", "max_pixels"):
        if getattr(vs, k) is not None:
            d.append(b.locate(at + (k,), f"{k} is Qwen2.5-VL's pixel budget; Mistral 3 bounds an image's longer "
                              "side: use longest_edge"))
    if vs.longest_edge > v.image_size:
        d.append(b.locate(at + ("longest_edge",), f"longest_edge={vs.longest_edge} exceeds the encoder's "
                          f"image_size={v.image_size} (vLLM's Pixtral has rope tables up to it); lower it"))
    side = blocks_per_side(v, vs.longest_edge)
    per = side * side * v.merge_unit
    cap_d, cap = vision_cap(b, at, vs, v.merge_unit, per, f"longest_edge={vs.longest_edge} pixels (ceil("
                            f"{vs.longest_edge} / {v.factor}) = {side} merge blocks per side")
    d += cap_d
    top = min(per, cap)  # the largest image a request may carry, in patches
    # its rows of [IMG] tokens, each closed by a break / end: at most `side` rows
    per_image = min(side * (side + 1), top // v.merge_unit + side)
    d += image_token_budget(b, vs, per_image, f"an image of up to {top} patches (longest_edge={vs.longest_edge}, "
                            f"largest bucket {cap}) is up to {per_image} tokens (its soft tokens + a break per row "
                            f"of at most {side})", "images_per_prompt or longest_edge",
                            "vision.longest_edge or the largest vision bucket")
    return d


def preprocessor_config(v: PixtralVision, vs) -> dict:
    """HF ``preprocessor_config.json`` of ``PixtralImageProcessor``: the longer side shrunk to at
    most ``longest_edge``, sides rounded up to patches (PixtralProcessor passes patch x merge),
    scaled to [0, 1] and normalized with CLIP's mean and std."""
    return {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
            "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(vs.image_mean),
            "image_std": list(vs.image_std), "size": {"longest_edge": vs.longest_edge},
            "patch_size": {"height": v.patch_size, "width": v.patch_size}}


def image_inputs(v: PixtralVision, vs, images: list) -> dict:
    """``pixel_values`` [patches, C x p x p] in merge-block order and ``image_grid_thw`` [n, 3]
    (1, rows, columns of patches) of what transformers' Pixtral image processor (its PIL backend,
    with PixtralProcessor's patch x merge) makes of ``images``."""
    import torch
    import transformers

    cfg = preprocessor_config(v, vs)
    keep = ("do_convert_rgb", "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize",
            "image_mean", "image_std", "size")
    proc = transformers.PixtralImageProcessorPil(**{k: cfg[k] for k in keep})
    out = proc(images=images, patch_size={"height": v.factor, "width": v.factor}, return_tensors="pt")
    parts = [to_patches(v, px[:, :int(h), :int(w)].float()) for px, (h, w) in
             zip(out["pixel_values"], out["image_sizes"].tolist())]
    return {"pixel_values": torch.cat([p for p, _ in parts]),
            "image_grid_thw": torch.tensor([g for _, g in parts], dtype=torch.long)}


def program_inputs(v: PixtralVision, inputs: dict, bucket: int, dtype):
    """(patches [bucket, patch_pixels], the per-call metadata the attention reads (rope cos/sin
    and image segment per row), a function from the program's ``image`` rows to the soft tokens
    in prompt order: the blocks' own order)."""
    import torch

    px, grid = inputs["pixel_values"], inputs.get("image_grid_thw")
    if grid is None:
        raise ValueError("Mistral 3 images need image_grid_thw (each image's patch grid)")
    grid = q25._grids(grid)
    want = sum(t * h * w for t, h, w in grid)
    if px.shape[0] != want or px.shape[-1] != v.patch_pixels:
        raise ValueError(f"pixel_values {list(px.shape)} do not match the patch grids {grid}: expected "
                         f"[{want}, {v.patch_pixels}]")
    lay = q25.patch_layout(v, grid, bucket, windows=False)  # merge-block order: the rows as given
    patches = torch.zeros(bucket, v.patch_pixels, dtype=dtype)
    patches[:want] = px.to(dtype)[lay["order"]]
    cos, sin = rope_tables(v, lay["hw"], torch.float32)  # HF computes the angles in float32
    unorder = lay["unorder"]
    return patches, {"cos": cos, "sin": sin, "image": lay["image"]}, lambda out: out[unorder.to(out.device)]


def warmup_inputs(v: PixtralVision, vs, bucket: int) -> dict:
    """Fixed pixels of one image filling a vision bucket (m x bucket / m patches)."""
    import torch

    m = v.spatial_merge_size
    n = torch.arange(bucket * v.patch_pixels, dtype=torch.float64)
    return {"pixel_values": torch.sin(n * 0.37).reshape(bucket, v.patch_pixels).float(),
            "image_grid_thw": torch.tensor([(1, m, bucket // m)], dtype=torch.long)}


# ---- the vision part ------------------------------------------------------------------------------
class Mistral3VisionPart(VisionPart):
    """Mistral 3's vision part: images of any size up to ``longest_edge`` as patch grids, rows of
    ``[IMG]`` tokens closed by ``[IMG_BREAK]`` / ``[IMG_END]``, causal, plain positions."""

    BUCKET_UNIT = "patches"
    BIDIRECTIONAL_IMAGES = False
    TOKENIZER_TOKENS = TOKENIZER_TOKENS
    CHAT_TEMPLATE = CHAT_TEMPLATE
    VLLM_PROCESSOR = ("vllm.model_executor.models.mistral3", "Mistral3MultiModalProcessor",
                      "Mistral3ProcessingInfo", "Mistral3DummyInputsBuilder")
    PLACEHOLDER_STR = "[IMG]"
    PIL_PROCESSORS = {"transformers.models.pixtral.image_processing_pixtral": (
        "transformers.models.pixtral.image_processing_pil_pixtral",
        {"PixtralImageProcessor": "PixtralImageProcessorPil",
         "get_resize_output_image_size": "get_resize_output_image_size",
         "_num_image_tokens": "_num_image_tokens"})}
    PROCESSOR_CLASSES = {"transformers.models.pixtral": ("transformers.models.pixtral.processing_pixtral",
                                                         "PixtralProcessor")}

    IMAGE_MEAN, IMAGE_STD = tuple(IMAGE_MEAN), tuple(IMAGE_STD)
    HF_IMAGE_PROCESSOR = "PixtralImageProcessorPil"

    def settings(self, vs):
        return settings(self.v, vs, self.normalisation(vs))

    def check_settings(self, b, vs):
        return check_settings(b, vs)

    def _processor_settings(self, ip, where, hf_dir):
        """``longest_edge`` (the image processor's ``size``); the patch and merge sizes
        PixtralProcessor passes (``processor_config.json``) must be the vision config's."""
        v = self.v
        proc = processor_json(hf_dir)
        at = str(Path(hf_dir) / "processor_config.json")
        must_equal(at, "patch_size", proc.get("patch_size"), "vision_config.patch_size", v.patch_size)
        must_equal(at, "spatial_merge_size", proc.get("spatial_merge_size"), "spatial_merge_size",
                   v.spatial_merge_size)
        edge = ip.size.get("longest_edge") if hasattr(ip.size, "get") else None
        if not edge:
            raise unsupported(where, "size", dict(ip.size), {"longest_edge": "N"})
        return {"longest_edge": int(edge)}

    def largest_image(self, vs):
        side = blocks_per_side(self.v, vs.longest_edge)
        return side * side * self.v.merge_unit

    def prompt_tokens_of(self, vs, need):
        side = blocks_per_side(self.v, vs.longest_edge)  # rows of [IMG], each closed by a break / end
        return min(side * (side + 1), min(need, self.largest_image(vs)) // self.v.merge_unit + side)

    def preprocessor_config(self, vs):
        return preprocessor_config(self.v, vs)

    def processor_config(self, vs):
        v = self.v
        return {"processor_class": "PixtralProcessor", "patch_size": v.patch_size,
                "spatial_merge_size": v.spatial_merge_size, "image_token": "[IMG]",
                "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}

    def image_inputs(self, vs, images):
        return image_inputs(self.v, vs, images)

    def special_tokens(self):
        return tuple(getattr(self.v, k) for k in TOKEN_KEYS)

    def placeholder(self):
        return self.v.image_token_index

    def image_tokens(self, inputs, k):
        return image_tokens(self.v, q25._grids(inputs["image_grid_thw"])[k])

    def soft_token_counts(self, inputs):
        return [soft_tokens(self.v, g) for g in q25._grids(inputs["image_grid_thw"])]

    def bucket_need(self, inputs):
        return int(inputs["pixel_values"].shape[0])

    def program_inputs(self, inputs, bucket, dtype):
        return program_inputs(self.v, inputs, bucket, dtype)

    def warmup_inputs(self, vs, bucket):
        return warmup_inputs(self.v, vs, bucket)

    def reference_kwargs(self, prompt, inputs, device):
        """transformers ``Mistral3ForConditionalGeneration`` inputs: padded images and their sizes."""
        px, sizes = to_images(self.v, inputs["pixel_values"], inputs["image_grid_thw"])
        return {"pixel_values": px.to(device), "image_sizes": sizes.to(device)}

    def reference_features(self, hf, inputs, device):
        """transformers' soft tokens [soft tokens, text hidden], image after image."""
        import torch

        px, sizes = to_images(self.v, inputs["pixel_values"], inputs["image_grid_thw"])
        out = hf.model.get_image_features(pixel_values=px.to(device), image_sizes=sizes.to(device))
        return torch.cat(list(out.pooler_output), dim=0)

    # -- served requests: vLLM's Mistral 3 processor's fields -----------------------------------
    def feature_inputs(self, features):
        """vLLM's ``pixel_values`` per image [C, h, w] (unpadded) as patches and grids."""
        import torch

        parts = [to_patches(self.v, f.data["pixel_values"].data.float()) for f in features]
        return {"pixel_values": torch.cat([p for p, _ in parts]),
                "image_grid_thw": torch.tensor([g for _, g in parts], dtype=torch.long)}

    def _layout(self, prompt, counts: list[int], spans: list[tuple[int, int]] | None):
        positions, image_of = [], []
        for i, want in enumerate(counts):
            lo, hi = spans[i] if spans is not None else (0, len(prompt))
            mine = [p for p in range(lo, hi) if prompt[p] == self.v.image_token_index]
            if spans is None:  # a whole prompt: the images' [IMG] tokens in turn
                mine = mine[len(positions):len(positions) + want]
            if len(mine) != want:
                raise ValueError(f"image {i} needs {want} image tokens ({self.v.image_token_index}), the prompt "
                                 f"holds {len(mine)} for it")
            positions += mine
            image_of += [i] * want
        if spans is None:
            extra = sum(t == self.v.image_token_index for t in prompt) - len(positions)
            if extra:
                raise ValueError(f"the prompt holds {extra} image tokens more than its images' "
                                 f"{sum(counts)} soft tokens")
        return ImageLayout(positions, image_of, blocks_of(len(prompt), positions, image_of, False), list(counts))

    def request_layout(self, features, prompt):
        """The soft tokens are the ``[IMG]`` tokens inside each feature's placeholder range, as
        many as its image's merge blocks (an image vLLM sent no data for, covered by the prefix
        cache, counts its range's ``[IMG]`` tokens)."""
        if not features:
            return None, PLAIN
        prompt = list(prompt)
        spans = [(f.mm_position.offset, f.mm_position.offset + f.mm_position.length) for f in features]
        counts = []
        for f, (lo, hi) in zip(features, spans):
            if f.data is None or "pixel_values" not in f.data:
                counts.append(sum(t == self.v.image_token_index for t in prompt[lo:hi]))
            else:
                _, h, w = f.data["pixel_values"].data.shape
                counts.append((h // self.v.factor) * (w // self.v.factor))
        return self._layout(prompt, counts, spans), PLAIN

    def prompt_layout(self, prompt, inputs):
        return self._layout(list(prompt), self.soft_token_counts(inputs), None), PLAIN
