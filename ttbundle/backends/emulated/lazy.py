"""A package's weights read on demand, one tensor of one layer at a time (:class:`LazyWeights`),
and which weights the emulated GEMM holds packed (:func:`_packed_names`)."""

from __future__ import annotations

import math

import torch

from ...program import Op
from . import gemm

class LazyWeights:
    """A package's weights read on demand (``package.shards.PackageWeights.stack``: band by band into
    one tensor, a shared shard once), one tensor of one layer at a time, and held until
    :meth:`release`: what :meth:`EmulatedModel.run_layer_major` needs to hold one stage of a
    model of any depth (``check``, the warm-up, ``cache verify``)."""

    def __init__(self, source):
        self.source = source
        self.held: dict = {}
        self._pack, self._dtype, self._device, self._packs = frozenset(), torch.float32, "cpu", False

    def names(self) -> set:
        return set(self.source.refs)

    def bind(self, packed: set, dtype, device) -> "LazyWeights":
        self._pack, self._dtype, self._device = frozenset(packed), dtype, device
        self._packs = gemm.packs(dtype, device)
        return self

    def get(self, name: str, layer: int | None):
        """Weight ``name`` (of ``layer``), read on first use: a matmul weight packed as the
        whole model packs it (the same GEMM, so float32 results equal the serving model's) when
        one device's shard is at most ``gemm.PACK_BYTES``; a larger one (a vocabulary head)
        stays plain, since packing holds a second copy while it runs."""
        key = (name, layer)
        W = self.held.get(key)
        if W is None:
            shape = self.source.local_shape(name, layer)
            packed = (self._packs and name in self._pack and len(shape) == 2
                      and math.prod(shape) * self._dtype.itemsize <= gemm.PACK_BYTES)
            # a matrix to be packed is read as the GEMM holds it ([N, K] in memory): no transpose after
            W = self.source.stack(name, layer, self._dtype, self._device, nk=packed)
            # unmap the files: the pages a tensor was read from would otherwise stay resident
            # (counted in the process's RSS) until the stage ends, a vocabulary table's ~1 GB
            self.source.close()
            if packed:
                W = gemm.hold_one(W, self._dtype)
            self.held[key] = W
        return W

    def group(self, name: str, layer: int | None) -> tuple[int, ...]:
        """Per device, the index of its distinct stored shard of ``name`` (nothing read)."""
        return self.source.distinct(name, layer)

    def expert(self, name: str, layer: int | None, g: int, j: int):
        """Expert ``j`` (local index) of distinct shard ``g`` of an expert stack, read and decoded
        alone into the compute dtype, not held: the caller drops it after its product, so a MoE
        layer holds one expert's matrix at a time (``EmulatedModel._experts``)."""
        return self.source.expert(name, layer, g, j, self._dtype).to(self._device)

    def release(self) -> None:
        """Drop what was read, and close the package's files, so the pages mapped for one stage
        leave the process with it."""
        self.held.clear()
        self.source.close()


def _packed_names(traits: dict, programs) -> set:
    """The weights held packed where :func:`gemm.packs` says so: the matmul-only ones, except
    those a family computes in float32 (``linear_fp32``)."""
    return _matmul_only(programs) - set(traits.get("linear_fp32", ()))


def _matmul_only(programs) -> set:
    """Names of the weights that the programs' matmul steps read and no other step does."""
    matmul, other = set(), set()
    for p in programs:
        for lp in p.layers:
            for st in lp.steps:
                if st.w:
                    (matmul if st.op is Op.MATMUL else other).add(st.w)
    return matmul - other
