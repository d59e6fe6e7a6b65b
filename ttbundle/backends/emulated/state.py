"""The state an emulated program call runs on: the paged KV cache (:class:`KVCache`, values held
in their declared dtype: :func:`kv_store`), and a call run a stage at a time (:class:`Stages`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import blockfloat


@dataclass
class KVCache:
    layers: list  # per layer {"k": [D, kvh, num_blocks * block, hd], "v": ...}
    num_blocks: int
    block_size: int


def kv_store(kv_dtype: str, compute: torch.dtype):
    """(storage dtype of the cache tensors, per-write rounding) for a declared KV dtype. The
    emulated cache holds the *values* the device's storage would (each written row rounded as
    it rounds them) in the compute dtype where that is wider (bf16 and block-float caches of a
    float32 model: float32 tensors), so reads need no conversion; this is the emulated
    backend's own memory (vLLM sizes its blocks at the model dtype's bytes, which this is)."""
    if kv_dtype == "bf16":
        if compute == torch.bfloat16:
            return torch.bfloat16, None

        def store_bf16(x: torch.Tensor) -> torch.Tensor:
            # held as the compute dtype (each value exactly a bf16 one, as the device's bf16
            # storage rounds it): attention reads its context straight into the matmul instead
            # of gathering bf16 and converting every step, every layer (issue 25)
            return x.to(torch.bfloat16).to(compute)
        return compute, store_bf16
    if kv_dtype in ("bfp8", "bfp4"):
        def store(x: torch.Tensor) -> torch.Tensor:
            # a block-float tile shares one exponent per 16 values of a row: a token's row
            # rounds alone, so rounding the written rows is what the tile storage holds
            shape = x.shape
            q = blockfloat.quantize(x.detach().float().cpu().reshape(-1, shape[-1]), kv_dtype)
            return q.reshape(shape).to(device=x.device)
        return compute if compute == torch.float32 else torch.float32, store
    raise ValueError(f"KV cache dtype {kv_dtype!r}: expected bf16 or bfp8")


class Stages:
    """One program call run a stage at a time (:meth:`EmulatedModel.stages`): iterating yields
    ``(kind, layer)`` before each stage runs; ``logits`` is set once it is exhausted. ``capture``
    (when asked for) gets each decoder layer's output ``[N, Tq, hidden]`` (device 0) as it runs;
    ``rows`` is how many leading rows of it are real (a chunk padded to its bucket)."""

    def __init__(self, gen, capture: list | None = None, rows: int | None = None):
        self._gen, self.capture, self.rows = gen, capture, rows
        self.logits = None
        self.done = False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._gen)
        except StopIteration as e:
            self.logits, self.done = e.value, True
            raise

    def drain(self) -> "Stages":
        for _ in self:
            pass
        return self
