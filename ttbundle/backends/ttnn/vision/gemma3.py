"""Gemma 3's vision encoder (SigLIP tower, average-pool projector) as ttnn calls
(``families.gemma3_vision``): rows are the patches of the program's images, image after image.
The emulated counterpart is ``backends/emulated/vision/gemma3.py``.
"""

from __future__ import annotations

from ....program import Step
from .. import configs
from ..calls import Const, T, W
from ..emitter import DRAM, TILE_L, Lowerer, add_bias, f32, one_input, tt_shape


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


OPS = {"vision_embed": _vision_embed, "vision_attention": _vision_attention, "vision_pool": _vision_pool}
