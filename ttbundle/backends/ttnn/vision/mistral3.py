"""Mistral 3's vision encoder (Pixtral) and projector as ttnn calls (``families.mistral3_vision``):
rows are the patches in merge-block order, host-made rotary inputs and image mask. The emulated
counterpart is ``backends/emulated/vision/mistral3.py``.
"""

from __future__ import annotations

from ....program import Step
from ..calls import T
from ..emitter import DRAM, Lowerer, one_input, tt_shape
from ._common import rope_attention


def _pixtral_attention(lw: Lowerer, st: Step) -> None:
    """Mistral 3's Pixtral attention: no biases; the 2-D rope attention within each image (the
    host's cos / sin are Pixtral's frequencies, the image mask its images)."""
    rope_attention(lw, st, None, True)


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


OPS = {"pixtral_attention": _pixtral_attention, "pixtral_gated": _pixtral_gated,
       "mistral3_unfold": _mistral3_unfold, "mistral3_projector_act": _mistral3_projector_act}
