"""What the vision encoders' ttnn lowerings share: a bias add as an op (``bias_op``; SigLIP's and
Qwen2.5-VL's output-projection and second-MLP biases), the biased gelu of the first MLP matmul
(SigLIP's, Qwen3-VL's), and the 2-D rope attention over all rows
with a host-made window or image mask (``rope_attention``; Qwen's, Pixtral's). Each encoder's
own ops are in the module named after its family (``vision/<family>.py``).
"""

from __future__ import annotations

from ....program import Step
from .. import configs
from ..calls import Const, T
from ..emitter import DRAM, Lowerer, add_bias, f32, one_input, tt_shape
from ..inputs import VISION_ROPE, vision_mask_input
from ..text_ops import merge_heads, split_heads


def bias_op(w: str):
    """The op adding bias ``w`` (the layer's shard of it) to its one input."""
    def fn(lw: Lowerer, st: Step) -> None:
        add_bias(lw, one_input(lw, st), w, st.out.name)
    return fn


def vision_gelu(lw: Lowerer, st: Step) -> None:
    """+ the first MLP bias, then gelu (tanh approximation: SigLIP's, Qwen3-VL's MLP)."""
    x = add_bias(lw, one_input(lw, st), "v_b1", f"{st.out.name}.b")
    lw.call("gelu", T(x), out=st.out.name, shape=lw.shapes[x], fast_and_approximate_mode=True, memory_config=DRAM)


def rope_attention(lw: Lowerer, st: Step, biases: tuple | None, full: bool) -> None:
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


OPS = {"vision_bias_o": bias_op("v_bo"), "vision_bias_2": bias_op("v_b2"), "vision_gelu": vision_gelu}
