"""Checkpoint formats: how a checkpoint's stored tensors decode to the plain weights its model
reads. The one owner of every quantized format's decoding, used by the build's conversion
(``weights.Checkpoint`` -> ``convert``) and by both sides of ``check`` (the expected weights and
``reference.LayerwiseModel``), so the reference reads what the checkpoint stores exactly as the
build does.

The format is detected from ``config.json``'s ``quantization_config`` as vLLM detects it
(``quant_method``: ``fp8``, ``mxfp4``, ``compressed-tensors``, ``awq``, ``gptq``; see
:func:`scheme_of`), for every family. A scheme turns the checkpoint's stored keys into a *decoded
view* (:class:`View`): each quantized Linear's companions (``weight`` + ``weight_scale_inv``,
``qweight`` + ``qzeros`` + ``scales`` [+ ``g_idx``], ``weight_packed`` + ``weight_scale`` ...)
become the one dense tensor an unquantized checkpoint holds under that name, in the
checkpoint's own layout (``[out, in]``; GPT-OSS's experts ``[E, in, out]``), decoded tensor by
tensor when read (memory: one tensor and its float32 scratch, never a layer's stack: stacked
experts decode one expert at a time), rounded once to bf16. Keys a scheme reads but does not
need (activation scales: ttbundle keeps activations bf16) are dropped; every other key passes
through as stored. A scheme ttbundle cannot represent is ``InvalidInput`` naming it and listing
what is supported.

What is exact and what is re-rounded: docs/build.md#quantized-checkpoints.
"""

from __future__ import annotations

from ..errors import InvalidInput
from . import fp, intpack
from .base import NONE, SUPPORTED, Entry, Scheme, View, unsupported

__all__ = ["NONE", "SUPPORTED", "Entry", "Scheme", "View", "scheme_of", "unsupported"]


def scheme_of(qc, where: str = "config.json") -> Scheme:
    """The scheme of a ``quantization_config`` (None or empty: an unquantized checkpoint), as vLLM
    picks its quantization config from ``quant_method``. Unsupported: InvalidInput naming the
    scheme and what is supported."""
    if not qc:
        return NONE
    if not isinstance(qc, dict):
        raise InvalidInput(f"{where}: quantization_config: expected a JSON object")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method == "mxfp4":
        return fp.Mxfp4()
    if method == "fp8":
        return fp.Fp8.from_config(qc, where)
    if method == "compressed-tensors":
        return intpack.compressed_tensors(qc, where)
    if method == "awq":
        return intpack.Awq.from_config(qc, where)
    if method == "gptq":
        return intpack.Gptq.from_config(qc, where)
    raise unsupported(where, f"quant_method={qc.get('quant_method')!r}")
