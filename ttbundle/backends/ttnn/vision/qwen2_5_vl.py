"""Qwen2.5-VL's vision transformer and merger as ttnn calls (``families.qwen2_5_vl_vision``):
rows are the patches in window order, host-made masks and rotary inputs per call. The emulated
counterpart is ``backends/emulated/vision/qwen2_5_vl.py``.
"""

from __future__ import annotations

from ....program import Step
from ..calls import T
from ..emitter import DRAM, Lowerer, add_bias, one_input, tt_shape
from ._common import bias_op, rope_attention


def _qwen_vision_attention(lw: Lowerer, st: Step) -> None:
    """q/k/v biases, then the 2-D rope attention (:func:`_rope_attention`) with the window (or
    image, at full-attention layers) mask."""
    rope_attention(lw, st, ("v_bq", "v_bk", "v_bv"), lw.layer in lw.a.vision.fullatt_block_indexes)


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


OPS = {"qwen_vision_attention": _qwen_vision_attention, "qwen_vision_swiglu": _qwen_vision_swiglu,
       "qwen_vision_merge": _qwen_vision_merge, "qwen_vision_merge_gelu": _qwen_vision_merge_gelu,
       "qwen_vision_merge_bias": bias_op("v_merge2_b")}
