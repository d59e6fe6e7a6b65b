"""Qwen3-VL's vision part: the vision transformer with a learned position embedding interpolated
to each image's grid, the patch merger, and DeepStack (merged features of several vision layers
added into the first text layers).

The images, their patches and grids are Qwen2.5-VL's (HF's ``Qwen2VLImageProcessor``, here with
16-pixel patches and mean = std = 0.5), and so are the prompt's image tokens and its M-RoPE
positions (one owner: ``patch_grid.mrope_positions``; HF's Qwen3-VL ``get_rope_index``
gives images the same positions), the vision bucket (patches) and the spec's pixel budget: this
module reuses them and :class:`Qwen3VisionPart` extends Qwen2.5-VL's part.

What differs (HF ``Qwen3VLVisionModel``): the patch embedding has a bias and adds a learned
position embedding ``v_pos`` [num_position_embeddings, hidden] (a square table) resampled to
the image's patch grid bilinearly with aligned corners (per row the host gives 4 table rows and
their weights, :func:`pos_taps`); the encoder layers are LayerNorm (with bias) -> q/k/v (+bias)
-> 2-D rope -> attention over the whole image (no windows) -> out-proj (+bias) -> residual;
LayerNorm -> fc1 (+bias) -> gelu(tanh) -> fc2 (+bias) -> residual. The merger: LayerNorm over
hidden, 2x2 patches concatenated, fc1 + bias, GELU, fc2 + bias into the text hidden size. After
each layer of ``deepstack_visual_indexes`` a DeepStack merger (2x2 patches concatenated first,
then LayerNorm over 4 x hidden, fc1, GELU, fc2) makes one more set of soft-token features; the
text model adds set ``k`` to the image tokens' hidden states after its layer ``k``.

The vision program returns ``[soft tokens, (1 + deepstack) x text hidden]``: the soft tokens,
then each DeepStack set, side by side, so a request's images travel through the runtime as one
row per soft token; the text program's first layers read the extra columns.

Tensors are prefixed ``v_`` (DeepStack mergers ``v_ds{k}_``); default plan as Qwen2.5-VL's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from . import patch_grid, qwen2_5_vl_vision as q25
from .base import Dim, HFName, Linear, Local, Norm, Residual, TensorDecl

#: DeepStack mergers a vision config may have (each has its kernels: ``qwen3_deepstack{k}_*``)
MAX_DEEPSTACK = 8
NORM_EPS = 1e-6  # HF's vision LayerNorms (blocks and mergers) use a fixed epsilon
#: Qwen3-VL's image processor normalizes with mean = std = 0.5
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)


class Qwen3Vision(q25.QwenVisionBase):
    """Qwen3-VL's vision transformer (HF ``vision_config``) and the wrapper's image tokens."""

    depth: int = Field(default=27, gt=0)
    """Vision encoder layers."""
    hidden_size: int = Field(default=1152, gt=0)
    """Width of the vision transformer's residual stream."""
    intermediate_size: int = Field(default=4304, gt=0)
    """Width of the vision MLP's hidden layer."""
    num_heads: int = Field(default=16, gt=0)
    """Vision attention heads (head width = hidden_size / num_heads)."""
    patch_size: int = Field(default=16, gt=0)
    """Pixels per side of one patch."""
    num_position_embeddings: int = Field(default=2304, gt=0)
    """Rows of the learned position embedding (a square grid, resampled to each image)."""
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    """Vision layers whose merged features are added into the first text layers (DeepStack)."""
    hidden_act: Literal["gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    """Vision MLP activation."""

    @property
    def pos_side(self) -> int:
        """Rows per side of the learned position embedding's square grid."""
        return int(round(self.num_position_embeddings ** 0.5))

    @property
    def deepstack(self) -> int:
        return len(self.deepstack_visual_indexes)

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        if self.pos_side ** 2 != self.num_position_embeddings:
            out.append(("num_position_embeddings", f"{self.num_position_embeddings} is not a square number (the "
                        "learned position embedding is a square grid)"))
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            out.append(("deepstack_visual_indexes", f"{bad} are not layers of depth={self.depth}"))
        elif list(self.deepstack_visual_indexes) != sorted(set(self.deepstack_visual_indexes)):
            out.append(("deepstack_visual_indexes", "must be sorted and unique"))
        if self.deepstack > MAX_DEEPSTACK:
            out.append(("deepstack_visual_indexes", f"{self.deepstack} DeepStack layers; at most {MAX_DEEPSTACK} "
                        "are supported"))
        return out


HF_VISION_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                  "temporal_patch_size", "spatial_merge_size", "num_position_embeddings",
                  "deepstack_visual_indexes", "out_hidden_size", "hidden_act")
HF_WRAPPER_KEYS = q25.HF_WRAPPER_KEYS


def from_hf(config: dict) -> dict | None:
    """The ``vision`` arch fields of a ``Qwen3VLForConditionalGeneration`` config.json."""
    vc = config.get("vision_config")
    if not isinstance(vc, dict):
        return None
    out = {k: vc[k] for k in HF_VISION_KEYS if vc.get(k) is not None}
    if "deepstack_visual_indexes" in out:
        out["deepstack_visual_indexes"] = tuple(out["deepstack_visual_indexes"])
    rp = vc.get("rope_parameters") or {}
    if rp.get("rope_theta") is not None:
        out["rope_theta"] = rp["rope_theta"]
    out.update({k: config[k] for k in HF_WRAPPER_KEYS if config.get(k) is not None})
    return out


def to_hf(v: Qwen3Vision) -> tuple[dict, dict]:
    """(HF vision_config, wrapper keys) for the reference model."""
    return patch_grid.hf_vision_config(v, HF_VISION_KEYS, HF_WRAPPER_KEYS, "qwen3_vl_vision",
                                       deepstack_visual_indexes=list(v.deepstack_visual_indexes))


# ---- declarations -------------------------------------------------------------------------------
def dims(v: Qwen3Vision, text_hidden: int) -> dict[str, Dim]:
    return {**patch_grid.encoder_dims(v, text_hidden),
            "pos": Dim("vision.num_position_embeddings", v.num_position_embeddings)}


def merger_names(k: int | None) -> tuple[str, str, str]:
    """(LayerNorm, fc1, fc2) of the merger (``k`` None) or DeepStack merger ``k``; each has a
    bias named ``<name>_b``."""
    return ("v_merge_ln", "v_merge1", "v_merge2") if k is None else (f"v_ds{k}_ln", f"v_ds{k}_fc1", f"v_ds{k}_fc2")


def _merger(k: int | None, d: dict, doc: str) -> list[TensorDecl]:
    vec = lambda n, dim, what: TensorDecl(n, "norms", (dim,), None, f"{doc} {what}", "vector")  # noqa: E731
    mat = lambda n, a, b, what: TensorDecl(n, "vision", (a, b), None, f"{doc} {what}")  # noqa: E731
    ln, fc1, fc2 = merger_names(k)
    norm = d["merge"] if k is not None else d["hid"]  # DeepStack: LayerNorm after the 2x2 shuffle
    return [vec(ln, norm, "LayerNorm"), vec(f"{ln}_b", norm, "LayerNorm bias"),
            mat(fc1, d["merge"], d["merge"], "fc1 (2x2 patches concatenated)"),
            vec(f"{fc1}_b", d["merge"], "fc1 bias"),
            mat(fc2, d["merge"], d["text"], "fc2 into the text model's hidden size"),
            vec(f"{fc2}_b", d["text"], "fc2 bias")]


def tensors(v: Qwen3Vision, text_hidden: int) -> list[TensorDecl]:
    d = dims(v, text_hidden)
    L = (0, v.depth)
    hid, heads, inter = d["hid"], d["heads"], d["inter"]
    vec = lambda n, dim, doc, layers=L: TensorDecl(n, "norms", (dim,), layers, doc, "vector")  # noqa: E731
    mat = lambda n, a, b, doc, layers=L: TensorDecl(n, "vision", (a, b), layers, doc)  # noqa: E731
    out = [mat("v_patch", d["pix"], hid, "patch embedding (the Conv3d as a matmul)", None),
           vec("v_patch_b", hid, "patch embedding bias", None),
           TensorDecl("v_pos", "vision", (d["pos"], hid), None, "learned position embedding (square grid)"),
           vec("v_ln1", hid, "pre-attention LayerNorm"), vec("v_ln1_b", hid, "pre-attention LayerNorm bias"),
           mat("v_wq", hid, heads, "vision query projection"), mat("v_wk", hid, heads, "vision key projection"),
           mat("v_wv", hid, heads, "vision value projection"),
           vec("v_bq", heads, "vision query bias"), vec("v_bk", heads, "vision key bias"),
           vec("v_bv", heads, "vision value bias"),
           mat("v_wo", heads, hid, "vision output projection"), vec("v_bo", hid, "vision output projection bias"),
           vec("v_ln2", hid, "pre-MLP LayerNorm"), vec("v_ln2_b", hid, "pre-MLP LayerNorm bias"),
           mat("v_w1", hid, inter, "vision MLP fc1"), vec("v_b1", inter, "vision MLP fc1 bias"),
           mat("v_w2", inter, hid, "vision MLP fc2"), vec("v_b2", hid, "vision MLP fc2 bias")]
    out += _merger(None, d, "merger")
    for k, i in enumerate(v.deepstack_visual_indexes):
        out += _merger(k, d, f"DeepStack merger of vision layer {i}")
    return out


PLAN: dict[str, tuple] = {
    "v_wq": (None, "cols"), "v_wk": (None, "cols"), "v_wv": (None, "cols"),
    "v_bq": ("cols",), "v_bk": ("cols",), "v_bv": ("cols",), "v_wo": ("cols", None),
    "v_w1": (None, "cols"), "v_b1": ("cols",), "v_w2": ("cols", None),
}


def hf_names(v: Qwen3Vision) -> list[HFName]:
    p = "visual.blocks.{i}."
    n = [HFName("v_patch", ("visual.patch_embed.proj.weight",), "conv_patch"),
         HFName("v_patch_b", ("visual.patch_embed.proj.bias",), "id"),
         HFName("v_pos", ("visual.pos_embed.weight",), "id"),
         HFName("v_ln1", (p + "norm1.weight",), "id"), HFName("v_ln1_b", (p + "norm1.bias",), "id"),
         HFName("v_ln2", (p + "norm2.weight",), "id"), HFName("v_ln2_b", (p + "norm2.bias",), "id"),
         HFName("v_wo", (p + "attn.proj.weight",)), HFName("v_bo", (p + "attn.proj.bias",), "id"),
         HFName("v_w1", (p + "mlp.linear_fc1.weight",)), HFName("v_b1", (p + "mlp.linear_fc1.bias",), "id"),
         HFName("v_w2", (p + "mlp.linear_fc2.weight",)), HFName("v_b2", (p + "mlp.linear_fc2.bias",), "id")]
    for k, x in enumerate("qkv"):
        n.append(HFName(f"v_w{x}", (p + "attn.qkv.weight",), f"qkv_{k}"))
        n.append(HFName(f"v_b{x}", (p + "attn.qkv.bias",), f"qkv_{k}"))
    mergers = [(None, "visual.merger.")] + [(k, f"visual.deepstack_merger_list.{k}.") for k in range(v.deepstack)]
    for k, hf in mergers:
        ln, fc1, fc2 = merger_names(k)
        n += [HFName(ln, (hf + "norm.weight",), "id"), HFName(f"{ln}_b", (hf + "norm.bias",), "id"),
              HFName(fc1, (hf + "linear_fc1.weight",)), HFName(f"{fc1}_b", (hf + "linear_fc1.bias",), "id"),
              HFName(fc2, (hf + "linear_fc2.weight",)), HFName(f"{fc2}_b", (hf + "linear_fc2.bias",), "id")]
    return n


# ---- dataflow -----------------------------------------------------------------------------------
def _merge_ops(k: int | None, v: Qwen3Vision, out: str, fn: str) -> list:
    """The merger (``k`` None: LayerNorm, then the 2x2 shuffle) or DeepStack merger ``k`` (the
    shuffle, then LayerNorm over 4 x hidden), fc1 + bias, GELU, fc2 + bias -> ``out``."""
    ln, fc1, fc2 = merger_names(k)
    merge = Dim("vision.merge_hidden", v.merge_unit * v.hidden_size)
    shuffle = Local(("hn",) if k is None else ("h",), "hm", "each merge block's patches as one row",
                    out_dim=merge, fn="qwen_vision_merge")
    ops = [Norm("h", "hn", ln), shuffle] if k is None else [shuffle, Norm("hm", "hmn", ln)]
    x = "hm" if k is None else "hmn"
    return ops + [Linear(x, fc1, "m1"), Local(("m1",), "m1a", "+ bias, gelu", fn=f"{fn}_gelu"),
                  Linear("m1a", fc2, "m2"), Local(("m2",), out, "+ bias", fn=f"{fn}_bias")]


def programs(v: Qwen3Vision) -> list[tuple[str, int, list]]:
    """(layer kind, count, ops): patch embedding, encoder layers with a DeepStack merger after
    each of ``deepstack_visual_indexes`` (its output ``deep``), the merger (output ``image``).
    Input ``patches`` [bucket patches, patch_pixels] in the processor's order."""
    layer = [Norm("h", "x", "v_ln1"), Linear("x", "v_wq", "q"), Linear("x", "v_wk", "k"), Linear("x", "v_wv", "v"),
             Local(("q", "k", "v"), "o", "+bias, 2-D rope, attention within each image",
                   fn="qwen3_vision_attention"),
             Linear("o", "v_wo", "attn_out"), Local(("attn_out",), "attn_outb", "+ bias", fn="vision_bias_o"),
             Residual("attn_outb"),
             Norm("h", "x2", "v_ln2"), Linear("x2", "v_w1", "g"),
             Local(("g",), "ga", "+ bias, gelu(tanh)", fn="vision_gelu"),
             Linear("ga", "v_w2", "mlp_out"), Local(("mlp_out",), "mlp_outb", "+ bias", fn="vision_bias_2"),
             Residual("mlp_outb")]
    out = [("vision_embedding", 1, [Linear("patches", "v_patch", "pe"),
                                    Local(("pe",), "h", "+ bias, + learned position embedding resampled to "
                                          "the grid", fn="qwen3_vision_embed")])]
    done = 0
    for k, i in enumerate(v.deepstack_visual_indexes):
        out.append(("vision_layer", i + 1 - done, layer))
        out.append((f"vision_deepstack{k}", 1, _merge_ops(k, v, "deep", f"qwen3_deepstack{k}")))
        done = i + 1
    if done < v.depth:
        out.append(("vision_layer", v.depth - done, layer))
    out.append(("vision_projector", 1, _merge_ops(None, v, "image", "qwen_vision_merge")))
    return out


def inputs(v: Qwen3Vision) -> dict[str, tuple[Dim, ...]]:
    return {"patches": (Dim("vision.patch_pixels", v.patch_pixels),),
            "h": (Dim("vision.hidden_size", v.hidden_size),)}


def rows(v: Qwen3Vision, patches: int) -> tuple[int, dict[str, int]]:
    soft = patches // v.merge_unit
    return patches, {n: soft for n in ("hm", "hmn", "m1", "m1a", "m2", "image", "deep")}


def norms(v: Qwen3Vision) -> dict:
    ln = {"eps": NORM_EPS, "layer_norm": True}
    names = ["v_ln1", "v_ln2"] + [merger_names(k)[0] for k in [None, *range(v.deepstack)]]
    return {n: {**ln, "bias": f"{n}_b"} for n in names}


# ---- image geometry (host side) -----------------------------------------------------------------
def pos_taps(v: Qwen3Vision, hw, dtype):
    """(indices [rows, 4], weights [rows, 4]): each row's learned position embedding as the
    bilinear resampling (aligned corners) of the ``pos_side`` x ``pos_side`` table to its
    image's grid: the 4 table rows around ``(row * (side - 1) / (h - 1), col * (side - 1) /
    (w - 1))`` and their weights. ``hw`` [rows, 4]: each row's patch row and column and its
    image's grid height and width (padding rows: weight 0)."""
    import torch

    side = v.pos_side

    def axis(pos, size):
        src = torch.where(size > 1, pos.double() * (side - 1) / (size - 1).clamp(min=1), torch.zeros_like(pos.double()))
        lo = src.floor().long().clamp(0, side - 1)
        hi = (lo + 1).clamp(max=side - 1)
        f = src - lo.double()
        return lo, hi, f

    r0, r1, fr = axis(hw[:, 0], hw[:, 2])
    c0, c1, fc = axis(hw[:, 1], hw[:, 3])
    idx = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], dim=1)
    w = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], dim=1)
    w = torch.where((hw[:, 2] > 0)[:, None], w, torch.zeros_like(w))
    return idx, w.to(dtype)


def program_inputs(v: Qwen3Vision, inputs: dict, bucket: int, dtype):
    """(patches [bucket, patch_pixels] in the processor's order, the per-call metadata (rope
    cos/sin per row, each row's image segment, the position embedding's taps), a function from
    the program's ``image`` rows to the soft tokens in prompt order: the identity)."""
    import torch

    px, grid = inputs["pixel_values"], inputs.get("image_grid_thw")
    if grid is None:
        raise ValueError("Qwen3-VL images need image_grid_thw (the processor's patch grid of each image)")
    grid = q25._grids(grid)
    want = sum(t * h * w for t, h, w in grid)
    if px.shape[0] != want or px.shape[-1] != v.patch_pixels:
        raise ValueError(f"pixel_values {list(px.shape)} do not match image_grid_thw {grid}: expected "
                         f"[{want}, {v.patch_pixels}]")
    lay = q25.patch_layout(v, grid, bucket, windows=False)  # no windows: the rows in the processor's order
    patches = torch.zeros(bucket, v.patch_pixels, dtype=dtype)
    patches[:want] = px.to(dtype)[lay["order"]]
    cos, sin = q25.rope_tables(v, lay["hw"], torch.float32)  # HF rotates in float32
    sizes = torch.zeros(bucket, 2, dtype=torch.long)
    sizes[:want] = torch.tensor(sum(([[h, w]] * (t * h * w) for t, h, w in grid), []), dtype=torch.long).reshape(-1, 2)
    idx, w = pos_taps(v, torch.cat([lay["hw"], sizes], dim=1), torch.float32)
    meta = {"cos": cos, "sin": sin, "image": lay["image"], "pos_idx": idx, "pos_w": w}
    unorder = lay["unorder"]
    return patches, meta, lambda out: out[unorder.to(out.device)]


# ---- the vision part ----------------------------------------------------------------------------
class Qwen3VisionPart(q25.Qwen25VisionPart):
    """Qwen3-VL's vision part: Qwen2.5-VL's images, tokens and positions; its own program inputs
    and DeepStack features beside the soft tokens."""

    VLLM_PROCESSOR = ("vllm.model_executor.models.qwen3_vl", "Qwen3VLMultiModalProcessor",
                      "Qwen3VLProcessingInfo", "Qwen3VLDummyInputsBuilder")
    IMAGE_ONLY_PROCESSOR = "Qwen3VLProcessor"
    PROCESSOR = "Qwen3VLProcessor"
    IMAGE_MEAN, IMAGE_STD = IMAGE_MEAN, IMAGE_STD

    def program_inputs(self, inputs, bucket, dtype):
        return program_inputs(self.v, inputs, bucket, dtype)

    def reference_features(self, hf, inputs, device):
        """transformers' soft tokens [soft tokens, text hidden] with each DeepStack set beside
        them (as the vision program returns them)."""
        import torch

        out = hf.model.get_image_features(inputs["pixel_values"].to(device), inputs["image_grid_thw"].to(device))
        sets = [torch.cat(list(out.pooler_output), dim=0)] + [torch.cat(list(f), dim=0) for f in out.deepstack_features]
        return torch.cat(sets, dim=-1)
