"""The vision encoders' ops as ttnn calls: Gemma 3's SigLIP tower (rows: the patches of the
program's images, image after image), Qwen2.5-VL's vision transformer (rows: the patches in
window order, host-made masks and rotary inputs per call), Qwen3-VL's (rows in the
processor's order; its learned position embedding resampled by a host-made interpolation matrix,
its DeepStack mergers' features beside the soft tokens) and Mistral 3's Pixtral encoder and
projector (rows: the patches in merge-block order, host-made rotary inputs and image mask), and
the text layers' DeepStack step; the
emulated ``vision_kernels`` counterpart."""

from __future__ import annotations

from ...program import Step
from . import configs
from .calls import Const, T, W
from .emitter import DRAM, TILE_L, Lowerer, add_bias, filled, one_input, f32, tt_shape
from .inputs import VISION_POS_INTERP, VISION_ROPE, deepstack_input, image_prefill, vision_mask_input
from .text_ops import split_heads, merge_heads


def _vision_embed(lw: Lowerer, st: Step) -> None:
    """Patch matmul output + the conv bias + each patch's position embedding (the table, made a
    TILE ``[1, 1, patches, hidden]`` once at setup, repeated for each image)."""
    x = add_bias(lw, one_input(lw, st), "v_patch_b", f"{st.out.name}.b")
    v = lw.a.vision
    rows, hid = lw.shapes[x][2], lw.shapes[x][3]
    pos = W("v_pos", variant="tile")
    lw.setup_call(pos.key(None), "to_layout", W("v_pos", per_layer=False), TILE_L, shape=(v.num_patches, hid))
    posr = W("v_pos", variant="tile4")
    lw.setup_call(posr.key(None), "reshape", pos, [1, 1, v.num_patches, hid], shape=(1, 1, v.num_patches, hid))
    rep = lw.call("repeat", posr, [1, 1, rows // v.num_patches, 1], out=f"{st.out.name}.pos", shape=(1, 1, rows, hid),
                  memory_config=DRAM)
    lw.call("add", T(x), T(rep), out=st.out.name, shape=(1, 1, rows, hid), memory_config=DRAM)


def _vision_attention(lw: Lowerer, st: Step) -> None:
    """q/k/v biases, then attention among the patches of each image (images as the batch, no
    mask), this device's heads, as matmuls and a softmax: ttnn's fused SDPA does not pad the
    head dim (SigLIP's is 72)."""
    q, k, v = (a.name for a in st.ins)
    for name, shp in ((a.name, a.shape) for a in st.ins):
        lw.shapes.setdefault(name, tt_shape(shp))
    vis = lw.a.vision
    hd, P = vis.head_dim, vis.num_patches
    rows, width = lw.shapes[q][2], lw.shapes[q][3]
    n, h = rows // P, width // hd
    heads = []
    for b, x in (("v_bq", q), ("v_bk", k), ("v_bv", v)):
        xb = add_bias(lw, x, b, f"{x}.b")
        r = lw.call("reshape", T(xb), [n, P, h, hd], out=f"{x}.r", shape=(n, P, h, hd))
        heads.append(lw.call("transpose", T(r), 1, 2, out=f"{x}.h", shape=(n, h, P, hd), memory_config=DRAM))
    kernel = configs.compute_config()
    qh, kh, vh = heads
    s = lw.call("matmul", T(qh), T(kh), out="vo.s", shape=(n, h, P, P), transpose_b=True, memory_config=DRAM,
                compute_kernel_config=kernel)
    s = lw.call("multiply", T(s), f32(hd ** -0.5), out="vo.ss", shape=(n, h, P, P), memory_config=DRAM)
    p = lw.call("softmax", T(s), -1, out="vo.p", shape=(n, h, P, P), memory_config=DRAM)
    o = lw.call("matmul", T(p), T(vh), out="vo.h", shape=(n, h, P, hd), memory_config=DRAM,
                compute_kernel_config=kernel)
    t = lw.call("transpose", T(o), 1, 2, out="vo.t", shape=(n, P, h, hd), memory_config=DRAM)
    lw.call("reshape", T(t), [1, 1, rows, width], out=st.out.name, shape=(1, 1, rows, width))


def _vision_bias(w: str):
    def fn(lw: Lowerer, st: Step) -> None:
        add_bias(lw, one_input(lw, st), w, st.out.name)
    return fn


def _vision_gelu(lw: Lowerer, st: Step) -> None:
    x = add_bias(lw, one_input(lw, st), "v_b1", f"{st.out.name}.b")
    lw.call("gelu", T(x), out=st.out.name, shape=lw.shapes[x], fast_and_approximate_mode=True, memory_config=DRAM)


def _vision_pool(lw: Lowerer, st: Step) -> None:
    """The average pool to soft tokens as one matmul by a host-made pooling matrix."""
    x = one_input(lw, st)
    v = lw.a.vision
    rows, hid = lw.shapes[x][2], lw.shapes[x][3]
    n = rows // v.num_patches
    soft = n * v.mm_tokens_per_image
    name = f"vision.pool.{n}"
    lw.consts[name] = Const(name, (1, 1, soft, rows), "bf16", "TILE", "avg_pool",
                            (("images", n), ("side", v.patches_per_side), ("window", v.pool)))
    lw.call("matmul", T(name), T(x), out=st.out.name, shape=(1, 1, soft, hid), memory_config=DRAM,
            compute_kernel_config=configs.compute_config())


def _qwen_vision_attention(lw: Lowerer, st: Step) -> None:
    """q/k/v biases, then the 2-D rope attention (:func:`_rope_attention`) with the window (or
    image, at full-attention layers) mask."""
    _rope_attention(lw, st, ("v_bq", "v_bk", "v_bv"), lw.layer in lw.a.vision.fullatt_block_indexes)


def _pixtral_attention(lw: Lowerer, st: Step) -> None:
    """Mistral 3's Pixtral attention: no biases; the 2-D rope attention within each image (the
    host's cos / sin are Pixtral's frequencies, the image mask its images)."""
    _rope_attention(lw, st, None, True)


def _rope_attention(lw: Lowerer, st: Step, biases: tuple | None, full: bool) -> None:
    """q/k/v ``biases`` (None: none), the 2-D rope (per-row cos / sin inputs; rotate-half by a
    matmul), then attention over all rows with the window (``full`` False) or image mask input,
    as matmuls and a softmax: this device's heads ``[1, h, rows, hd]``."""
    q, k, v = (a.name for a in st.ins)
    for name, shp in ((a.name, a.shape) for a in st.ins):
        lw.shapes.setdefault(name, tt_shape(shp))
    vis = lw.a.vision
    hd = vis.head_dim
    rows, width = lw.shapes[q][2], lw.shapes[q][3]
    h = width // hd
    cos_in, sin_in = VISION_ROPE
    for name in VISION_ROPE:
        lw.inputs[name] = ((1, 1, rows, hd), "bf16", "TILE")
    mask = vision_mask_input(full)
    lw.inputs[mask] = ((1, 1, rows, rows), "bf16", "TILE")
    heads = []
    for b, x in zip(biases or (None, None, None), (q, k, v)):
        xb = x if b is None else add_bias(lw, x, b, f"{x}.b")
        heads.append(split_heads(lw, xb, h, hd, f"{x}.h"))
    qh, kh, vh = heads
    kernel = configs.compute_config()
    # rotate-half as a matmul by a host-made [hd, hd] matrix (ttnn's rotary_embedding_hf wants a
    # head dim of 32 or a multiple of 64; 7B's vision heads are 80)
    rot = f"vision.rotate_half.{hd}"
    lw.consts[rot] = Const(rot, (1, 1, hd, hd), "bf16", "TILE", "rotate_half", (("dim", hd),))
    qr, kr = "vq.r", "vk.r"
    for x, out in ((qh, qr), (kh, kr)):
        shp = lw.shapes[x]
        xr = lw.call("matmul", T(x), T(rot), out=f"{out}.rh", shape=shp, memory_config=DRAM, compute_kernel_config=kernel)
        c = lw.call("multiply", T(x), T(cos_in), out=f"{out}.c", shape=shp, memory_config=DRAM)
        sn = lw.call("multiply", T(xr), T(sin_in), out=f"{out}.s", shape=shp, memory_config=DRAM)
        lw.call("add", T(c), T(sn), out=out, shape=shp, memory_config=DRAM)
    s = lw.call("matmul", T(qr), T(kr), out="vo.s", shape=(1, h, rows, rows), transpose_b=True, memory_config=DRAM,
                compute_kernel_config=kernel)
    s = lw.call("multiply", T(s), f32(hd ** -0.5), out="vo.ss", shape=(1, h, rows, rows), memory_config=DRAM)
    s = lw.call("add", T(s), T(mask), out="vo.sm", shape=(1, h, rows, rows), memory_config=DRAM)
    p = lw.call("softmax", T(s), -1, out="vo.p", shape=(1, h, rows, rows), memory_config=DRAM)
    o = lw.call("matmul", T(p), T(vh), out="vo.h", shape=(1, h, rows, hd), memory_config=DRAM,
                compute_kernel_config=kernel)
    merge_heads(lw, o, st.out.name)


def _qwen_vision_swiglu(lw: Lowerer, st: Step) -> None:
    g, u = (a.name for a in st.ins)
    for name, shp in ((a.name, a.shape) for a in st.ins):
        lw.shapes.setdefault(name, tt_shape(shp))
    gb, ub = add_bias(lw, g, "v_b1", f"{g}.b"), add_bias(lw, u, "v_b3", f"{u}.b")
    a = lw.call("silu", T(gb), out=f"{g}.a", shape=lw.shapes[gb], memory_config=DRAM)
    lw.call("multiply", T(a), T(ub), out=st.out.name, shape=lw.shapes[gb], memory_config=DRAM)


def _qwen_vision_merge(lw: Lowerer, st: Step) -> None:
    """Each merge block's patches (consecutive rows) as one row: a reshape."""
    x = one_input(lw, st)
    rows, hid = lw.shapes[x][2], lw.shapes[x][3]
    unit = lw.a.vision.merge_unit
    lw.call("reshape", T(x), [1, 1, rows // unit, unit * hid], out=st.out.name, shape=(1, 1, rows // unit, unit * hid))


def _qwen_vision_merge_gelu(lw: Lowerer, st: Step) -> None:
    x = add_bias(lw, one_input(lw, st), "v_merge1_b", f"{st.out.name}.b")
    lw.call("gelu", T(x), out=st.out.name, shape=lw.shapes[x], fast_and_approximate_mode=False, memory_config=DRAM)


def _qwen3_vision_embed(lw: Lowerer, st: Step) -> None:
    """Patch matmul output + the conv bias + each row's learned position embedding, resampled to
    its image's grid: the host-made interpolation matrix input ``[1, 1, rows, positions]`` (each
    row's bilinear taps and weights) times the table ``v_pos``."""
    x = add_bias(lw, one_input(lw, st), "v_patch_b", f"{st.out.name}.b")
    rows, hid = lw.shapes[x][2], lw.shapes[x][3]
    n = lw.a.vision.num_position_embeddings
    lw.inputs[VISION_POS_INTERP] = ((1, 1, rows, n), "bf16", "TILE")
    pos = lw.call("matmul", T(VISION_POS_INTERP), W("v_pos", per_layer=False), out=f"{st.out.name}.pos",
                  shape=(1, 1, rows, hid), memory_config=DRAM, compute_kernel_config=configs.compute_config())
    lw.call("add", T(x), T(pos), out=st.out.name, shape=(1, 1, rows, hid), memory_config=DRAM)


def _qwen3_vision_attention(lw: Lowerer, st: Step) -> None:
    """Qwen2.5-VL's attention with the image mask at every layer (no windows)."""
    _rope_attention(lw, st, ("v_bq", "v_bk", "v_bv"), True)


def _qwen3_deepstack(k: int) -> dict:
    def gelu(lw: Lowerer, st: Step) -> None:
        x = add_bias(lw, one_input(lw, st), f"v_ds{k}_fc1_b", f"{st.out.name}.b")
        lw.call("gelu", T(x), out=st.out.name, shape=lw.shapes[x], fast_and_approximate_mode=False,
                memory_config=DRAM)
    return {f"qwen3_deepstack{k}_gelu": gelu, f"qwen3_deepstack{k}_bias": _vision_bias(f"v_ds{k}_fc2_b")}


def _deepstack(lw: Lowerer, st: Step) -> None:
    """Qwen3-VL's DeepStack step of text layer ``l``: in an image prefill, for ``l`` below the
    DeepStack count, the input ``mm_deepstack.<l>`` (``inputs.deepstack_input``: the images'
    l-th feature set at their image tokens' rows, zeros elsewhere, host-made per step like
    ``mm_embeds``); otherwise zeros (decode, later layers)."""
    shp = lw.shapes.setdefault(st.ins[0].name, tt_shape(st.ins[0].shape))
    if image_prefill(lw.bundle, lw.prog) and lw.layer < lw.a.vision.deepstack:
        src = deepstack_input(lw.layer)
        lw.inputs[src] = (shp, "bf16", "TILE")
    else:
        src = filled(lw, "zeros", shp)
    lw.call("reshape", T(src), list(shp), out=st.out.name, shape=shp)


def _pixtral_gated(lw: Lowerer, st: Step) -> None:
    """``hidden_act``(gate) x up, no biases."""
    g, u = (a.name for a in st.ins)
    for name, shp in ((a.name, a.shape) for a in st.ins):
        lw.shapes.setdefault(name, tt_shape(shp))
    act = lw.a.vision.hidden_act
    kw = {"fast_and_approximate_mode": False} if act == "gelu" else {}
    a = lw.call(act, T(g), out=f"{g}.a", shape=lw.shapes[g], memory_config=DRAM, **kw)
    lw.call("multiply", T(a), T(u), out=st.out.name, shape=lw.shapes[g], memory_config=DRAM)


def _mistral3_unfold(lw: Lowerer, st: Step) -> None:
    """Each merge block's patches (consecutive rows) as one row, channel-major as ``F.unfold``
    makes it: ``[blocks, unit, hid]`` transposed to ``[blocks, hid, unit]``, then flattened."""
    x = one_input(lw, st)
    rows, hid = lw.shapes[x][2], lw.shapes[x][3]
    unit = lw.a.vision.merge_unit
    n = rows // unit
    r = lw.call("reshape", T(x), [1, n, unit, hid], out=f"{st.out.name}.r", shape=(1, n, unit, hid))
    t = lw.call("transpose", T(r), 2, 3, out=f"{st.out.name}.t", shape=(1, n, hid, unit), memory_config=DRAM)
    lw.call("reshape", T(t), [1, 1, n, unit * hid], out=st.out.name, shape=(1, 1, n, unit * hid))


def _mistral3_projector_act(lw: Lowerer, st: Step) -> None:
    x = one_input(lw, st)
    act = lw.a.vision.projector_hidden_act
    kw = {"gelu": {"fast_and_approximate_mode": False}, "gelu_pytorch_tanh": {"fast_and_approximate_mode": True}}
    fn = "silu" if act == "silu" else "gelu"
    lw.call(fn, T(x), out=st.out.name, shape=lw.shapes[x], memory_config=DRAM, **kw.get(act, {}))


OPS = {"vision_embed": _vision_embed, "vision_attention": _vision_attention, "vision_bias_o": _vision_bias("v_bo"),
       "vision_bias_2": _vision_bias("v_b2"), "vision_gelu": _vision_gelu, "vision_pool": _vision_pool,
       "qwen_vision_attention": _qwen_vision_attention, "qwen_vision_swiglu": _qwen_vision_swiglu,
       "qwen_vision_merge": _qwen_vision_merge, "qwen_vision_merge_gelu": _qwen_vision_merge_gelu,
       "qwen_vision_merge_bias": _vision_bias("v_merge2_b"),
       "qwen3_vision_embed": _qwen3_vision_embed, "qwen3_vision_attention": _qwen3_vision_attention,
       "deepstack": _deepstack,
       "pixtral_attention": _pixtral_attention, "pixtral_gated": _pixtral_gated,
       "mistral3_unfold": _mistral3_unfold, "mistral3_projector_act": _mistral3_projector_act}
for _k in range(8):  # every DeepStack merger a vision config may have (qwen3_vl_vision.MAX_DEEPSTACK)
    OPS.update(_qwen3_deepstack(_k))
