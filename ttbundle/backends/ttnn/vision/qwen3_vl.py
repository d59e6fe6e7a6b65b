"""Qwen3-VL's vision transformer (rows in the processor's order; its learned position embedding
resampled by a host-made interpolation matrix, its DeepStack mergers' features beside the soft
tokens) and the text layers' DeepStack step as ttnn calls (``families.qwen3_vl_vision``). The
emulated counterpart is ``backends/emulated/vision/qwen3_vl.py``.
"""

from __future__ import annotations

from ....program import Step
from .. import configs
from ..calls import T, W
from ..emitter import DRAM, Lowerer, add_bias, filled, one_input, tt_shape
from ..inputs import VISION_POS_INTERP, deepstack_input, image_prefill
from ._common import bias_op, rope_attention


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
    rope_attention(lw, st, ("v_bq", "v_bk", "v_bv"), True)


def _qwen3_deepstack(k: int) -> dict:
    def gelu(lw: Lowerer, st: Step) -> None:
        x = add_bias(lw, one_input(lw, st), f"v_ds{k}_fc1_b", f"{st.out.name}.b")
        lw.call("gelu", T(x), out=st.out.name, shape=lw.shapes[x], fast_and_approximate_mode=False,
                memory_config=DRAM)
    return {f"qwen3_deepstack{k}_gelu": gelu, f"qwen3_deepstack{k}_bias": bias_op(f"v_ds{k}_fc2_b")}


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


OPS = {"qwen3_vision_embed": _qwen3_vision_embed, "qwen3_vision_attention": _qwen3_vision_attention,
       "deepstack": _deepstack}
for _k in range(8):  # every DeepStack merger a vision config may have (qwen3_vl_vision.MAX_DEEPSTACK)
    OPS.update(_qwen3_deepstack(_k))
