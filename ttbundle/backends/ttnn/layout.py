"""How ttnn holds each planned tensor: the shape, dtype and layout of its device buffer.

One rule per tensor kind (``families.base.TensorDecl.kind``), the same rules ``plan.memory.tensor_bytes``
charges for:

* matrices: ``TILE`` in the planned dtype, the per-device shape as is (``[K, N]`` or ``[E, K, N]``);
* vectors (norm weights, biases; ``ROW_MAJOR`` bf16): ``[1, 1, ceil(N/32), 32]``, zero-padded —
  rows of 32 values, as tt_transformers stores norm weights (``plan`` charges 64-byte pages);
* embeddings: ``ROW_MAJOR`` bf16 ``[vocab, hidden]`` (one page per row, what ``ttnn.embedding``
  reads);
* KV cache: ``TILE`` ``[blocks, kv_heads/device, block_size, head_dim]`` in the KV dtype;
* activations: ``TILE`` bf16 ``[rows, features]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...tiles import TILE, cdiv

DTYPES = {"bf16": "bfloat16", "bfp8": "bfloat8_b", "bfp4": "bfloat4_b", "f32": "float32",
          "uint32": "uint32", "int32": "int32"}  # ttbundle name -> ttnn attribute
LAYOUTS = {"TILE": "TILE_LAYOUT", "ROW_MAJOR": "ROW_MAJOR_LAYOUT"}


@dataclass(frozen=True)
class BufferSpec:
    """One interleaved DRAM buffer kind: ``count`` buffers of ``shape`` per chip."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # ttbundle name: bf16 | bfp8 | bfp4 | f32 | uint32 | int32
    layout: str  # TILE | ROW_MAJOR
    count: int = 1
    what: str = "weight"  # weight | kv_cache | activation


def device_shape(shape, layout: str) -> tuple[int, ...]:
    """The shape ttnn is given for a planned per-device shape (vectors as rows of 32)."""
    shape = tuple(int(s) for s in shape)
    if layout == "ROW_MAJOR" and len(shape) == 1:
        return (1, 1, cdiv(shape[0], TILE), TILE)
    return shape


def tensor_buffer(t) -> BufferSpec:
    """A ``plan.sharding.TensorPlan`` as the buffers ttnn holds on each chip."""
    return BufferSpec(t.name, device_shape(t.device_shape, t.layout), t.dtype, t.layout, t.count)


def ttnn_dtype(ttnn, dtype: str):
    return getattr(ttnn, DTYPES[dtype])


def ttnn_layout(ttnn, layout: str):
    return getattr(ttnn, LAYOUTS[layout])
