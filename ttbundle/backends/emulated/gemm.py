"""How the emulated mesh holds and multiplies its dense matmul weights on this host.

A decode step is mostly weight GEMMs of a few rows. On x86 CPUs torch's ``matmul`` calls MKL's
sgemm, which on some CPUs (seen here: AMD EPYC) runs several times below what the cores and memory
allow; oneDNN's inner-product kernel with the weight reordered once into its blocked layout (what
``torch.compile``'s CPU weight prepacking does) reaches the memory bound for 16 rows. So a dense
``[D, K, N]`` weight is kept as D oneDNN-packed matrices, one per emulated device: the same values,
fp32 products accumulated in fp32 (a different summation order than MKL's, as any two GEMMs), and
each row's result independent of the other rows in the call.

``TTBUNDLE_EMULATED_GEMM`` (documented in docs/runtime.md): ``auto`` (default: oneDNN where torch
has it, on the CPU, in float32) or ``torch`` (torch's ``bmm`` on the plain tensor)."""

from __future__ import annotations

import os

import torch

from ...errors import InvalidInput

ENV = "TTBUNDLE_EMULATED_GEMM"
#: the row count oneDNN's reorder is told to expect (a decode bucket); any row count works
ROWS_HINT = 16


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether dense weights of this dtype on this device are held oneDNN-packed."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "torch"):
        raise InvalidInput(f"environment variable {ENV}={mode!r}: expected 'auto' (oneDNN-packed weights "
                           f"where torch has oneDNN) or 'torch' (torch's bmm); unset it for the default")
    return (mode == "auto" and torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Packed:
    """A dense weight ``[D, K, N]`` held as one oneDNN-packed ``[N, K]`` matrix per device."""

    def __init__(self, W: torch.Tensor):
        self.shape, self.dtype, self.device = W.shape, W.dtype, W.device
        self.per_device = [torch.ops.mkldnn._reorder_linear_weight(W[d].t().contiguous(), ROWS_HINT)
                           for d in range(W.shape[0])]

    def dim(self) -> int:
        return len(self.shape)

    def dense(self) -> torch.Tensor:
        """The plain ``[D, K, N]`` tensor (for a reader other than the GEMM; a copy)."""
        return torch.stack([p.to_dense().t() for p in self.per_device])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [D, ..., K] @ W -> [D, ..., N]``, each device's rows with its own shard."""
        def one(x, p):
            return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
        if len(self.per_device) == 1:
            return one(x, self.per_device[0])
        return torch.stack([one(x[d], p) for d, p in enumerate(self.per_device)])


def hold(weights: dict, matmul_only: set, dtype: torch.dtype, device) -> dict:
    """``weights`` with every dense 3-D tensor named in ``matmul_only`` (read by matmul steps and
    nothing else) packed, when :func:`packs` says so; the rest as given."""
    if not packs(dtype, device):
        return weights

    def one(W):
        return hold_one(W, dtype)
    return {name: (([one(x) for x in v] if isinstance(v, list) else one(v)) if name in matmul_only else v)
            for name, v in weights.items()}


def hold_one(W, dtype: torch.dtype):
    """One matmul-only weight as held where :func:`packs` holds: a dense ``[D, K, N]`` of the
    compute dtype packed, anything else (expert stacks ``[D, E, K, N]``) as given."""
    return Packed(W) if isinstance(W, torch.Tensor) and W.dim() == 3 and W.dtype == dtype else W


def matmul(x: torch.Tensor, W) -> torch.Tensor:
    """``x [D, T, K]`` or ``[D, T, E, K]`` times a dense weight ``[D, K, N]`` (plain or packed)."""
    if isinstance(W, Packed):
        return W.matmul(x)
    return torch.bmm(x, W) if x.dim() == 3 else torch.einsum("dtek,dkn->dten", x, W)
