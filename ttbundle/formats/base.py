"""What every checkpoint format shares: the decoded view of a checkpoint's stored keys
(:class:`View`, :class:`Entry`), a scheme's interface and the error for what is not read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import InvalidInput

#: quant_method values read, and what of each (the error for any other lists these)
SUPPORTED = ("fp8 (e4m3: per-tensor, or blocks: weight_block_size)", "mxfp4",
             "compressed-tensors (float-quantized fp8 per tensor, channel, group or block; "
             "pack-quantized / int-quantized / naive-quantized int4 or int8 weight-only, group or channel, "
             "symmetric or with zero points, with or without g_idx)",
             "awq (GEMM packing, 4-bit, zero points)", "gptq (2/4/8-bit, with or without act-order g_idx)")


@dataclass(frozen=True)
class Entry:
    """One dense tensor of the decoded view: read ``sources`` (stored keys, in order), then
    ``decode(tensors)`` -> the dense tensor of ``shape`` (bf16)."""

    sources: tuple
    decode: Callable
    shape: tuple
    scheme: str


@dataclass
class View:
    """A checkpoint's stored keys as an unquantized checkpoint's: ``decoded`` (dense key ->
    :class:`Entry`), ``dropped`` (stored keys read by nothing), the rest pass through."""

    scheme: str = "none"
    decoded: dict = field(default_factory=dict)
    dropped: set = field(default_factory=set)

    def keys(self, stored) -> list:
        """The view's keys from the stored keys (decoded keys replace their sources)."""
        used = {s for e in self.decoded.values() for s in e.sources} | self.dropped
        return [k for k in stored if k not in used] + list(self.decoded)


class Scheme:
    """A checkpoint format: ``name`` (for errors and docs) and :meth:`view` of the stored keys
    (``stored``: key -> (safetensors dtype, shape))."""

    name = "none"

    def view(self, stored: dict, where: str) -> View:
        return View()


NONE = Scheme()


def unsupported(where: str, what: str) -> InvalidInput:
    return InvalidInput(f"{where}: quantization_config.{what} is not supported by ttbundle; it reads "
                        f"unquantized checkpoints (bf16, fp16, fp32) and: {'; '.join(SUPPORTED)}")


def companions(stored: dict, suffixes: tuple) -> dict:
    """Module prefix -> its stored keys for each of ``suffixes`` (the first required, the others
    None where absent), for every key ending with the first suffix."""
    first, rest = suffixes[0], suffixes[1:]
    out = {}
    for k in stored:
        if k.endswith(first):
            p = k[:-len(first)]
            out[p] = (k,) + tuple(p + s if p + s in stored else None for s in rest)
    return out


def bad_shape(where: str, key: str, shape, want: str) -> InvalidInput:
    return InvalidInput(f"{where}: {key} has shape {list(shape)}; {want}")

