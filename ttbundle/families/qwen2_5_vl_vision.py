"""Qwen2.5-VL's vision part: the vision transformer with window attention and the patch merger,
and the M-RoPE position rule of a prompt carrying images.

HF's processor (``Qwen2VLImageProcessor``) resizes an image so that both sides are multiples of
``patch_size * spatial_merge_size`` and its area lies in [min_pixels, max_pixels], then cuts it
into a grid ``(t, h, w)`` of patches (``t`` = 1 for an image: the frame is repeated
``temporal_patch_size`` times) and sends ``pixel_values`` ``[t*h*w, C * temporal * p * p]``, the
patches ordered by 2x2 merge blocks (block after block, row-major, each block row-major). The
patch embedding (HF's stride-patch Conv3d without bias) is a matmul on those rows.

Encoder layers (HF ``Qwen2_5_VLVisionBlock``): RMSNorm -> q/k/v (+bias, one fused ``qkv`` in the
checkpoint) -> 2-D rotary (height and width halves of each head) -> attention within one window
of ``window_size`` pixels (``window_size / patch_size / merge`` merge blocks per side), or within
the whole image at ``fullatt_block_indexes`` -> out-proj (+bias) -> residual; RMSNorm -> SiLU-gated
MLP with biases -> residual. The merger: RMSNorm, each merge block's 4 patches concatenated into
one row, Linear + bias, GELU, Linear + bias into the text hidden size: one soft token per block.

Window order: HF permutes the merge blocks so that each window is contiguous (``window_index``,
``cu_window_seqlens``) and un-permutes the soft tokens at the end. The host does that here
(``patch_grid.patch_layout``): the program's rows are the patches in window order, padded to the vision
bucket (a fixed patch count), and the per-row metadata the program reads (rotary angles, window
and image of each row) is made from ``image_grid_thw`` on the host, as a device would receive it.

Tensors are prefixed ``v_``; default plan: heads and the MLP's intermediate dim over ``cols``
(Megatron-style column then row parallel, one all_reduce per branch), the hidden dim replicated,
the merger replicated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .base import Dim, HFName, Linear, Local, Norm, Residual, TensorDecl, image_token_budget, vision_cap
from . import patch_grid, transforms
from .patch_grid import max_patches, mrope_positions, patch_layout, rope_tables, soft_tokens  # noqa: F401 (q25.*)
from .vision_part import ImageLayout, PromptPositions, VisionPart, blocks_of, must_equal

#: what a vision bucket counts
BUCKET_UNIT = "patches"
#: image placeholders attend causally, like text (no image-block mask)
BIDIRECTIONAL_IMAGES = False
#: the vision tokens as Qwen2.5-VL's tokenizer spells them, by the role its processor reads
#: (``image_token``, ``video_token``; the others are the chat template's): role -> (text, id field)
TOKENIZER_TOKENS = {"vision_start_token": ("<|vision_start|>", "vision_start_token_id"),
                    "vision_end_token": ("<|vision_end|>", "vision_end_token_id"),
                    "image_token": ("<|image_pad|>", "image_token_id"),
                    "video_token": ("<|video_pad|>", "video_token_id")}
#: the demo tokenizer's chat template (``serving.demo``) with Qwen's image placeholder: an image
#: part of a message is vision start, one ``<|image_pad|>`` (the processor repeats it per soft
#: token), vision end
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {% if m['content'] is string %}{{ m['content'] }} "
    "{% else %}{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|> {% elif c['type'] == 'text' %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endif %}<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
NORM_EPS = 1e-6  # HF's vision RMSNorms (blocks and merger) use a fixed epsilon


class QwenVisionBase(BaseModel):
    """What Qwen2.5-VL's and Qwen3-VL's vision configs share, with the same HF keys and defaults:
    the patch grid, a soft token's width, the 2-D rope's base and the wrapper's image tokens, and
    the head-width rule. Each family's class adds its sizes (the same keys, other defaults: other
    facts, so declared in each) and its own layers' settings."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    in_channels: int = Field(default=3, gt=0)
    """Color channels."""
    temporal_patch_size: int = Field(default=2, gt=0)
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = Field(default=2, gt=0)
    """Patches per side of one merge block (one soft token)."""
    out_hidden_size: int = Field(default=3584, gt=0)
    """Width of a soft token (the text model's hidden size)."""
    rope_theta: float = 10000.0
    """Rotary base of the 2-D vision rope."""
    image_token_id: int = Field(default=151655, ge=0)
    """Placeholder token (`<|image_pad|>`) the soft tokens replace."""
    video_token_id: int = Field(default=151656, ge=0)
    """Video placeholder token (videos are not served)."""
    vision_start_token_id: int = Field(default=151652, ge=0)
    """Token before an image's placeholders (`<|vision_start|>`)."""
    vision_end_token_id: int = Field(default=151653, ge=0)
    """Token after an image's placeholders (`<|vision_end|>`)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_pixels(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per soft token."""
        return self.spatial_merge_size ** 2

    @property
    def factor(self) -> int:
        """Image sides are resized to multiples of this many pixels."""
        return self.patch_size * self.spatial_merge_size

    def problems(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for settings the encoder cannot run."""
        if self.hidden_size % self.num_heads:
            return [("num_heads", f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")]
        if self.head_dim % 4:
            return [("num_heads", f"head width {self.head_dim} (hidden_size / num_heads) must be a multiple of "
                     "4: the 2-D rope gives height and width a rotary half each")]
        return []


class Qwen25Vision(QwenVisionBase):
    """Qwen2.5-VL's vision transformer (HF ``vision_config``) and the wrapper's image tokens."""

    depth: int = Field(default=32, gt=0)
    """Vision encoder layers."""
    hidden_size: int = Field(default=1280, gt=0)
    """Width of the vision transformer's residual stream."""
    intermediate_size: int = Field(default=3420, gt=0)
    """Width of the vision MLP's hidden layer (SiLU-gated)."""
    num_heads: int = Field(default=16, gt=0)
    """Vision attention heads (head width = hidden_size / num_heads)."""
    patch_size: int = Field(default=14, gt=0)
    """Pixels per side of one patch."""
    window_size: int = Field(default=112, gt=0)
    """Pixels per side of one attention window."""
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    """Layers attending over the whole image instead of a window."""
    hidden_act: Literal["silu"] = "silu"
    """Vision MLP activation."""
    tokens_per_second: int = 2
    """Videos only (not served): temporal position spacing."""

    @property
    def window_blocks(self) -> int:
        """Merge blocks per side of one attention window."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        if self.window_blocks < 1 or self.window_size % self.factor:
            out.append(("window_size", f"window_size={self.window_size} must be a positive multiple of "
                        f"patch_size x spatial_merge_size = {self.factor} pixels"))
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            out.append(("fullatt_block_indexes", f"{bad} are not layers of depth={self.depth}"))
        return out


HF_VISION_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                  "temporal_patch_size", "spatial_merge_size", "window_size", "fullatt_block_indexes",
                  "out_hidden_size", "hidden_act", "tokens_per_second")
HF_WRAPPER_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

#: the pixel budget's defaults: HF's processor's minimum (56 x 56 pixels); as maximum, images of
#: 256 soft tokens (HF's processor allows 16384, which a vision bucket would have to hold)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_TOKENS = 256


def from_hf(config: dict) -> dict | None:
    """The ``vision`` arch fields of a ``Qwen2_5_VLForConditionalGeneration`` config.json."""
    vc = config.get("vision_config")
    if not isinstance(vc, dict):
        return None
    vc = dict(vc)
    if "in_chans" in vc and "in_channels" not in vc:  # the published checkpoints' spelling
        vc["in_channels"] = vc["in_chans"]
    out = {k: vc[k] for k in HF_VISION_KEYS if vc.get(k) is not None}
    rp = vc.get("rope_parameters") or {}
    if rp.get("rope_theta") is not None:
        out["rope_theta"] = rp["rope_theta"]
    out.update({k: config[k] for k in HF_WRAPPER_KEYS if config.get(k) is not None})
    return out


def to_hf(v: Qwen25Vision) -> tuple[dict, dict]:
    """(HF vision_config, wrapper keys) for the reference model."""
    return patch_grid.hf_vision_config(v, HF_VISION_KEYS, HF_WRAPPER_KEYS, "qwen2_5_vl_vision",
                                       fullatt_block_indexes=list(v.fullatt_block_indexes))


# ---- declarations -------------------------------------------------------------------------------
def dims(v: Qwen25Vision, text_hidden: int) -> dict[str, Dim]:
    return patch_grid.encoder_dims(v, text_hidden)


def tensors(v: Qwen25Vision, text_hidden: int) -> list[TensorDecl]:
    d = dims(v, text_hidden)
    L = (0, v.depth)
    hid, heads, inter, merge = d["hid"], d["heads"], d["inter"], d["merge"]
    vec = lambda n, dim, doc, layers=L: TensorDecl(n, "norms", (dim,), layers, doc, "vector")  # noqa: E731
    mat = lambda n, a, b, doc, layers=L: TensorDecl(n, "vision", (a, b), layers, doc)  # noqa: E731
    return [mat("v_patch", d["pix"], hid, "patch embedding (the Conv3d as a matmul, no bias)", None),
            vec("v_ln1", hid, "pre-attention RMSNorm"),
            mat("v_wq", hid, heads, "vision query projection"), mat("v_wk", hid, heads, "vision key projection"),
            mat("v_wv", hid, heads, "vision value projection"),
            vec("v_bq", heads, "vision query bias"), vec("v_bk", heads, "vision key bias"),
            vec("v_bv", heads, "vision value bias"),
            mat("v_wo", heads, hid, "vision output projection"), vec("v_bo", hid, "vision output projection bias"),
            vec("v_ln2", hid, "pre-MLP RMSNorm"),
            mat("v_w1", hid, inter, "vision MLP gate"), vec("v_b1", inter, "vision MLP gate bias"),
            mat("v_w3", hid, inter, "vision MLP up"), vec("v_b3", inter, "vision MLP up bias"),
            mat("v_w2", inter, hid, "vision MLP down"), vec("v_b2", hid, "vision MLP down bias"),
            vec("v_merge_ln", hid, "merger RMSNorm", None),
            mat("v_merge1", merge, merge, "merger fc1 (2x2 patches concatenated)", None),
            vec("v_merge1_b", merge, "merger fc1 bias", None),
            mat("v_merge2", merge, d["text"], "merger fc2 into the text model's hidden size", None),
            vec("v_merge2_b", d["text"], "merger fc2 bias", None)]


PLAN: dict[str, tuple] = {
    "v_wq": (None, "cols"), "v_wk": (None, "cols"), "v_wv": (None, "cols"),
    "v_bq": ("cols",), "v_bk": ("cols",), "v_bv": ("cols",), "v_wo": ("cols", None),
    "v_w1": (None, "cols"), "v_b1": ("cols",), "v_w3": (None, "cols"), "v_b3": ("cols",),
    "v_w2": ("cols", None),
}


def hf_names(v: Qwen25Vision) -> list[HFName]:
    p = "visual.blocks.{i}."
    n = [HFName("v_patch", ("visual.patch_embed.proj.weight",), "conv_patch"),
         HFName("v_merge_ln", ("visual.merger.ln_q.weight",), "id"),
         HFName("v_merge1", ("visual.merger.mlp.0.weight",)), HFName("v_merge1_b", ("visual.merger.mlp.0.bias",), "id"),
         HFName("v_merge2", ("visual.merger.mlp.2.weight",)), HFName("v_merge2_b", ("visual.merger.mlp.2.bias",), "id"),
         HFName("v_ln1", (p + "norm1.weight",), "id"), HFName("v_ln2", (p + "norm2.weight",), "id"),
         HFName("v_wo", (p + "attn.proj.weight",)), HFName("v_bo", (p + "attn.proj.bias",), "id")]
    for k, x in enumerate("qkv"):
        n.append(HFName(f"v_w{x}", (p + "attn.qkv.weight",), f"qkv_{k}"))
        n.append(HFName(f"v_b{x}", (p + "attn.qkv.bias",), f"qkv_{k}"))
    for ours, hf in (("1", "gate_proj"), ("3", "up_proj"), ("2", "down_proj")):
        n.append(HFName(f"v_w{ours}", (f"{p}mlp.{hf}.weight",)))
        n.append(HFName(f"v_b{ours}", (f"{p}mlp.{hf}.bias",), "id"))
    return n


def _qkv(k: int):
    def part(src, a):
        """One third (q, k or v) of the fused ``qkv`` weight [3 * hidden, hidden] (-> [in, out]) or bias."""
        t = src[0]
        third = t.shape[0] // 3
        x = t[k * third:(k + 1) * third]
        return x.transpose(0, 1).contiguous() if x.dim() == 2 else x.contiguous()
    return part


for _k in range(3):
    transforms.register(f"qkv_{_k}", _qkv(_k))


# ---- dataflow -----------------------------------------------------------------------------------
def programs(v: Qwen25Vision) -> list[tuple[str, int, list]]:
    """(layer kind, count, ops): patch embedding, encoder layers, merger. Input ``patches``
    [bucket patches, patch_pixels] in window order; output ``image`` [bucket / 4, text hidden]."""
    full = list(v.fullatt_block_indexes)
    layer = [Norm("h", "x", "v_ln1"), Linear("x", "v_wq", "q"), Linear("x", "v_wk", "k"), Linear("x", "v_wv", "v"),
             Local(("q", "k", "v"), "o", f"+bias, 2-D rope, attention within each window (whole image at "
                   f"layers {full})", fn="qwen_vision_attention"),
             Linear("o", "v_wo", "attn_out"), Local(("attn_out",), "attn_outb", "+ bias", fn="vision_bias_o"),
             Residual("attn_outb"),
             Norm("h", "x2", "v_ln2"), Linear("x2", "v_w1", "g"), Linear("x2", "v_w3", "u"),
             Local(("g", "u"), "gu", "+ biases, SiLU-gated", fn="qwen_vision_swiglu"),
             Linear("gu", "v_w2", "mlp_out"), Local(("mlp_out",), "mlp_outb", "+ bias", fn="vision_bias_2"),
             Residual("mlp_outb")]
    merge = Dim("vision.merge_hidden", v.merge_unit * v.hidden_size)
    return [("vision_embedding", 1, [Linear("patches", "v_patch", "h")]),
            ("vision_layer", v.depth, layer),
            ("vision_projector", 1, [Norm("h", "hn", "v_merge_ln"),
                                     Local(("hn",), "hm", "each merge block's patches as one row", out_dim=merge,
                                           fn="qwen_vision_merge"),
                                     Linear("hm", "v_merge1", "m1"),
                                     Local(("m1",), "m1a", "+ bias, gelu", fn="qwen_vision_merge_gelu"),
                                     Linear("m1a", "v_merge2", "m2"),
                                     Local(("m2",), "image", "+ bias", fn="qwen_vision_merge_bias")])]


def inputs(v: Qwen25Vision) -> dict[str, tuple[Dim, ...]]:
    return {"patches": (Dim("vision.patch_pixels", v.patch_pixels),),
            "h": (Dim("vision.hidden_size", v.hidden_size),)}


def rows(v: Qwen25Vision, patches: int) -> tuple[int, dict[str, int]]:
    soft = patches // v.merge_unit
    return patches, {n: soft for n in ("hm", "m1", "m1a", "m2", "image")}


def norms(v: Qwen25Vision) -> dict:
    return {n: {"eps": NORM_EPS} for n in ("v_ln1", "v_ln2", "v_merge_ln")}


# ---- the vision part's functions (Qwen25VisionPart below calls them) -------------------------
def settings(v: Qwen25Vision, vs, norm: dict | None = None):
    """The spec's ``vision:`` settings with Qwen2.5-VL's defaults filled in: the pixel budget,
    the normalisation (``norm``: what the part fills in) and, unless given, one bucket of
    ``images_per_prompt`` images of ``max_pixels``."""
    upd = dict(norm or {})
    if vs.min_pixels is None:
        upd["min_pixels"] = DEFAULT_MIN_PIXELS
    if vs.max_pixels is None:
        upd["max_pixels"] = DEFAULT_MAX_TOKENS * v.factor ** 2
    if "buckets" not in vs.model_fields_set:
        upd["buckets"] = [vs.images_per_prompt * max_patches(v, upd.get("max_pixels", vs.max_pixels))]
    return vs.model_copy(update=upd) if upd else vs


def check_settings(b, vs) -> list:
    """Diagnostics for ``vs`` (buckets = patch counts) against the pixel and token budgets."""
    v, d, at = b.arch.vision, [], ("vision",)
    f2 = v.factor ** 2
    if vs.longest_edge is not None:
        d.append(b.locate(at + ("longest_edge",), "longest_edge is Mistral 3's image bound; this model bounds an "
                          "image's area: use max_pixels"))
    if vs.max_pixels < f2:
        d.append(b.locate(at + ("max_pixels",), f"max_pixels={vs.max_pixels} is less than one merge block "
                          f"({v.factor} x {v.factor} = {f2} pixels); raise it"))
        return d
    if vs.min_pixels > vs.max_pixels:
        d.append(b.locate(at + ("min_pixels",), f"min_pixels={vs.min_pixels} exceeds max_pixels={vs.max_pixels}"))
    per = max_patches(v, vs.max_pixels)
    cap_d, cap = vision_cap(b, at, vs, v.merge_unit, per, f"max_pixels={vs.max_pixels} ({vs.max_pixels} // "
                            f"{v.factor}^2 = {per // v.merge_unit} merge blocks")
    d += cap_d
    least = -(-vs.min_pixels // f2) * v.merge_unit  # the smallest image the processor makes, about
    if vs.buckets and cap < least:
        d.append(b.locate(at + ("buckets",), f"the largest vision bucket ({cap} patches) holds no image: the "
                          f"processor enlarges every image to at least min_pixels={vs.min_pixels} (ceil({vs.min_pixels} "
                          f"/ {v.factor}^2) merge blocks = {least} patches); add a bucket of {least} or more"))
    top = min(per, cap)  # the largest image a request may carry
    per_image = top // v.merge_unit + 2  # vision start, soft tokens, vision end
    d += image_token_budget(b, vs, per_image, f"an image of up to {top} patches (max_pixels={vs.max_pixels}, "
                            f"largest bucket {cap}) is {per_image} tokens ({top // v.merge_unit} soft tokens + "
                            "vision start/end)", "images_per_prompt or max_pixels",
                            "vision.max_pixels or the largest vision bucket")
    return d


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def preprocessor_config(v: Qwen25Vision, vs, processor: str = "Qwen2_5_VLProcessor") -> dict:
    """HF ``preprocessor_config.json`` of ``Qwen2VLImageProcessor``: sides resized to multiples
    of patch x merge pixels with the area in [min_pixels, max_pixels], normalized with the
    spec's ``image_mean`` and ``image_std``; ``processor``: the processor class that carries it."""
    mean, std = vs.image_mean, vs.image_std
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
            "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mean), "image_std": list(std),
            "min_pixels": vs.min_pixels, "max_pixels": vs.max_pixels,
            "size": {"shortest_edge": vs.min_pixels, "longest_edge": vs.max_pixels},
            "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
            "merge_size": v.spatial_merge_size}


def image_inputs(v: Qwen25Vision, vs, images: list, cfg: dict | None = None) -> dict:
    """``pixel_values`` [patches, channels x temporal x patch^2] and ``image_grid_thw`` [n, 3]
    as transformers' Qwen2-VL image processor makes them (its PIL backend where torchvision is
    not installed, as transformers itself falls back)."""
    import transformers

    try:
        cls = transformers.Qwen2VLImageProcessorPil
    except AttributeError:  # pragma: no cover - transformers without the PIL backend's own name
        cls = transformers.Qwen2VLImageProcessor
    cfg = cfg or preprocessor_config(v, vs)
    keep = ("do_convert_rgb", "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize",
            "image_mean", "image_std", "size", "patch_size", "temporal_patch_size", "merge_size")
    out = cls(**{k: cfg[k] for k in keep})(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}


def special_tokens(v: Qwen25Vision) -> tuple[int, ...]:
    return tuple(getattr(v, k) for k in HF_WRAPPER_KEYS)


def placeholder(v: Qwen25Vision) -> int:
    return v.image_token_id


def image_tokens(v: Qwen25Vision, inputs, k: int) -> list[int]:
    """Image ``k`` in a prompt: vision start, one ``<|image_pad|>`` per merge block of its grid,
    vision end."""
    return [v.vision_start_token_id] + [v.image_token_id] * soft_tokens(v, inputs["image_grid_thw"][k]) \
        + [v.vision_end_token_id]


def bucket_need(v: Qwen25Vision, inputs: dict) -> int:
    """What a vision bucket must hold for ``inputs``: patches."""
    return int(inputs["pixel_values"].shape[0])


def program_inputs(v: Qwen25Vision, inputs: dict, bucket: int, dtype):
    """(patches [bucket, patch_pixels] in window order, the per-call metadata the program's
    attention reads (rope cos/sin per row, each row's window and image segment), a function from
    the program's ``image`` rows to the soft tokens in prompt order)."""
    import torch

    px, grid = inputs["pixel_values"], inputs.get("image_grid_thw")
    if grid is None:
        raise ValueError("Qwen2.5-VL images need image_grid_thw (the processor's patch grid of each image)")
    grid = [tuple(int(x) for x in g) for g in (grid.tolist() if hasattr(grid, "tolist") else grid)]
    want = sum(t * h * w for t, h, w in grid)
    if px.shape[0] != want or px.shape[-1] != v.patch_pixels:
        raise ValueError(f"pixel_values {list(px.shape)} do not match image_grid_thw {grid}: expected "
                         f"[{want}, {v.patch_pixels}]")
    lay = patch_layout(v, grid, bucket)
    patches = torch.zeros(bucket, v.patch_pixels, dtype=dtype)
    patches[:want] = px.to(dtype)[lay["order"]]
    cos, sin = rope_tables(v, lay["hw"], torch.float32)  # HF rotates in float32
    meta = {"cos": cos, "sin": sin, "window": lay["window"], "image": lay["image"]}
    unorder = lay["unorder"]
    return patches, meta, lambda out: out[unorder.to(out.device)]


def warmup_inputs(v: Qwen25Vision, vs, bucket: int) -> dict:
    """Fixed pixels of one image filling a vision bucket (grid 1 x merge x bucket / merge)."""
    import torch

    m = v.spatial_merge_size
    grid = (1, m, bucket // m)
    n = torch.arange(bucket * v.patch_pixels, dtype=torch.float64)
    return {"pixel_values": torch.sin(n * 0.37).reshape(bucket, v.patch_pixels).float(),
            "image_grid_thw": torch.tensor([grid], dtype=torch.long)}


def rope_positions(v: Qwen25Vision, prompt: list[int], inputs: dict | None):
    """(M-RoPE positions [3, L], delta) of a prompt (:func:`mrope_positions`)."""
    return mrope_positions(prompt, None if inputs is None else inputs.get("image_grid_thw"), v)


def reference_kwargs(v: Qwen25Vision, prompt: list[int], inputs: dict, device) -> dict:
    """transformers ``Qwen2_5_VLForConditionalGeneration`` inputs besides the prompt's ids."""
    import torch

    return {"pixel_values": inputs["pixel_values"].to(device), "image_grid_thw": inputs["image_grid_thw"].to(device),
            "mm_token_type_ids": (torch.tensor([prompt]) == v.image_token_id).int().to(device)}


def reference_features(hf, inputs: dict, device):
    """transformers' soft tokens of the images [soft tokens, text hidden], in prompt order."""
    import torch

    out = hf.model.get_image_features(inputs["pixel_values"].to(device), inputs["image_grid_thw"].to(device))
    return torch.cat(list(out.pooler_output), dim=0)


# ---- the vision part (shared code calls this class, never the functions above by name) --------
def _grids(grid) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in g) for g in (grid.tolist() if hasattr(grid, "tolist") else grid)]


class Qwen25VisionPart(VisionPart):
    """Qwen2.5-VL's vision part: patches and grids, causal image tokens, M-RoPE positions."""

    BUCKET_UNIT = BUCKET_UNIT
    BIDIRECTIONAL_IMAGES = BIDIRECTIONAL_IMAGES
    TOKENIZER_TOKENS = TOKENIZER_TOKENS
    CHAT_TEMPLATE = CHAT_TEMPLATE
    VLLM_PROCESSOR = ("vllm.model_executor.models.qwen2_5_vl", "Qwen2_5_VLMultiModalProcessor",
                      "Qwen2_5_VLProcessingInfo", "Qwen2_5_VLDummyInputsBuilder")
    PLACEHOLDER_STR = "<|vision_start|><|image_pad|><|vision_end|>"
    IMAGE_ONLY_PROCESSOR = "Qwen2_5_VLProcessor"
    #: the transformers processor class the package names, and its image processor's mean and std
    PROCESSOR = "Qwen2_5_VLProcessor"
    IMAGE_MEAN, IMAGE_STD = tuple(CLIP_MEAN), tuple(CLIP_STD)
    HF_IMAGE_PROCESSOR = "Qwen2VLImageProcessorPil"
    PIL_PROCESSORS = {"transformers.models.qwen2_vl.image_processing_qwen2_vl": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
        {"Qwen2VLImageProcessor": "Qwen2VLImageProcessorPil", "smart_resize": "smart_resize"})}

    def settings(self, vs):
        return settings(self.v, vs, self.normalisation(vs))

    def check_settings(self, b, vs):
        return check_settings(b, vs)

    def _processor_settings(self, ip, where, hf_dir):
        """The pixel budget (transformers' ``size``: shortest_edge = min_pixels, longest_edge =
        max_pixels, the ``min_pixels`` / ``max_pixels`` keys taking precedence as transformers
        reads them); the patch, merge and temporal sizes must be the vision config's."""
        v = self.v
        for key, got, arch_key, want in (("patch_size", ip.patch_size, "vision_config.patch_size", v.patch_size),
                                         ("merge_size", ip.merge_size, "vision_config.spatial_merge_size",
                                          v.spatial_merge_size),
                                         ("temporal_patch_size", ip.temporal_patch_size,
                                          "vision_config.temporal_patch_size", v.temporal_patch_size)):
            must_equal(where, key, got, arch_key, want)
        return {"min_pixels": int(ip.size["shortest_edge"]), "max_pixels": int(ip.size["longest_edge"])}

    def largest_image(self, vs):
        return max_patches(self.v, vs.max_pixels)

    def prompt_tokens_of(self, vs, need):
        return min(need, self.largest_image(vs)) // self.v.merge_unit + 2  # vision start, soft tokens, end

    def preprocessor_config(self, vs):
        return preprocessor_config(self.v, vs, self.PROCESSOR)

    def processor_config(self, vs):
        return {"processor_class": self.PROCESSOR}

    def image_inputs(self, vs, images):
        return image_inputs(self.v, vs, images, self.preprocessor_config(vs))

    def special_tokens(self):
        return special_tokens(self.v)

    def placeholder(self):
        return placeholder(self.v)

    def image_tokens(self, inputs, k):
        return image_tokens(self.v, inputs, k)

    def soft_token_counts(self, inputs):
        return [soft_tokens(self.v, g) for g in _grids(inputs["image_grid_thw"])]

    def positions(self, prompt, inputs):
        rope, delta = rope_positions(self.v, prompt, inputs)
        return PromptPositions(rope, int(delta))

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

    # -- served requests: vLLM's Qwen2.5-VL processor's fields ----------------------------------
    @staticmethod
    def feature_grid(feature):
        """[3] (t, h, w) of one image feature, in patches. vLLM keeps a prefix-cached image's
        grid for M-RoPE models (``strip_covered_mm_data``), so every image has one."""
        if feature.data is None or "image_grid_thw" not in feature.data:
            raise RuntimeError("an image feature without image_grid_thw: vLLM sent no grid for it, so the "
                               "prompt's M-RoPE positions are unknown")
        return feature.data["image_grid_thw"].data.reshape(3).long()

    def feature_inputs(self, features):
        """``pixel_values`` [patches, C*T*P*P] (vLLM's field is flat over each image's patches)
        and ``image_grid_thw`` [images, 3]."""
        import torch

        return {"pixel_values": torch.cat([f.data["pixel_values"].data for f in features]),
                "image_grid_thw": torch.stack([self.feature_grid(f) for f in features])}

    def request_layout(self, features, prompt):
        """The image tokens are ``image_token_id`` inside each feature's placeholder range
        (causal: no blocks); the positions are M-RoPE from every image's grid (an image whose
        data vLLM did not send, covered by the prefix cache, still has its grid)."""
        import torch

        grids = [self.feature_grid(f) for f in features]
        thw = torch.stack(grids) if grids else torch.zeros(0, 3, dtype=torch.long)
        pos = self.positions(list(prompt), {"image_grid_thw": thw})
        if not features:
            return None, pos
        positions, image_of, counts = [], [], []
        for i, f in enumerate(features):
            lo, n = f.mm_position.offset, f.mm_position.length
            mine = [p for p in range(lo, lo + n) if prompt[p] == self.v.image_token_id]
            want = soft_tokens(self.v, grids[i])
            if len(mine) != want:
                raise ValueError(f"image {i}: grid {grids[i].tolist()} needs {want} image tokens, its placeholder "
                                 f"holds {len(mine)}")
            positions += mine
            image_of += [i] * len(mine)
            counts.append(len(mine))
        return ImageLayout(positions, image_of, blocks_of(len(prompt), positions, image_of, False), counts), pos

    def prompt_layout(self, prompt, inputs):
        if inputs.get("image_grid_thw") is None:
            raise ValueError("Qwen2.5-VL images need image_grid_thw (the processor's patch grid of each image)")
        pos = self.positions(list(prompt), inputs)  # refuses grids that do not match the tokens
        thw = inputs["image_grid_thw"]
        px = inputs["pixel_values"]
        need = int(thw.prod(dim=1).sum())
        if px.shape[0] != need:
            raise ValueError(f"pixel_values hold {px.shape[0]} patches, image_grid_thw {thw.tolist()} needs {need}")
        counts = self.soft_token_counts(inputs)
        positions = [i for i, t in enumerate(prompt) if t == self.v.image_token_id]
        image_of = sum(([i] * c for i, c in enumerate(counts)), [])
        return ImageLayout(positions, image_of, blocks_of(len(prompt), positions, image_of, False), counts), pos
