"""How the emulated mesh holds and multiplies its dense matmul weights on this host.

A decode step is mostly weight GEMMs of a few rows. On x86 CPUs torch's ``matmul`` calls MKL's
sgemm, which on some CPUs (seen here: AMD EPYC) runs several times below what the cores and memory
allow; oneDNN's inner-product kernel with the weight reordered once into its blocked layout (what
``torch.compile``'s CPU weight prepacking does) reaches the memory bound for 16 rows. So a dense
``[D, K, N]`` weight is kept as oneDNN-packed matrices, one per distinct shard (devices that
hold the same shard share one copy, ``package.shards.stack_shards``): the same values, fp32 products
accumulated in fp32 (a different summation order than MKL's, as any two GEMMs), and each row's
result independent of the other rows in the call. A shard several devices hold is multiplied
once per call (:func:`grouped`): with all their rows at once, or once where their rows are the
same bits.

``TTBUNDLE_EMULATED_GEMM`` (documented in docs/runtime.md): ``auto`` (default: oneDNN where torch
has it, on the CPU, in float32) or ``torch`` (torch's ``bmm`` on the plain tensor).

Batch invariance (issue 38): by default a row's last bits may depend on how many rows share its
call: oneDNN (and MKL) pick another kernel for one row than for several (a one-row decode is a
matrix-vector product), so a sequence decoded alone and the same sequence in a bucket of 32 can
differ in the last bits, as vLLM's default kernels do. ``VLLM_BATCH_INVARIANT=1`` (vLLM's switch
of the same name, read the same way) keeps every row count on one kernel: a one-row product runs
as two rows (the row twice) and takes the first, so a row's result is the same bits at any batch
size (:func:`batch_invariant`; attention's side is ``kernels.attention``'s). Weights are held once
either way."""

from __future__ import annotations

import os

import torch

from ...errors import InvalidInput
from ...package.shards import SharedStack

ENV = "TTBUNDLE_EMULATED_GEMM"
#: vLLM's batch-invariant mode switch (``vllm.envs.VLLM_BATCH_INVARIANT``: an integer, 0 or 1)
INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
#: the row count oneDNN's reorder is told to expect (a decode bucket); any row count works
ROWS_HINT = 16
#: a model reading one stage at a time (``LazyWeights``) packs matmul weights up to this many
#: bytes per device shard; larger ones (a vocabulary head) stay plain (packing copies them)
PACK_BYTES = 512 << 20
#: a weight of several distinct shards is held merged (:class:`Packed`) up to this many bytes in
#: all: merging copies every shard at once while it packs; a larger one is packed shard by shard
MERGE_BYTES = 512 << 20


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether dense weights of this dtype on this device are held oneDNN-packed."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "torch"):
        raise InvalidInput(f"environment variable {ENV}={mode!r}: expected 'auto' (oneDNN-packed weights "
                           f"where torch has oneDNN) or 'torch' (torch's bmm); unset it for the default")
    return (mode == "auto" and torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def batch_invariant() -> bool:
    """Whether ``VLLM_BATCH_INVARIANT`` asks for batch-invariant results (read as vLLM reads it:
    an integer, nonzero = on; unset or empty = off)."""
    raw = os.environ.get(INVARIANT_ENV, "").strip()
    if not raw:
        return False
    try:
        return bool(int(raw))
    except ValueError:
        raise InvalidInput(f"environment variable {INVARIANT_ENV}={raw!r}: expected 0 or 1 (1: every batch size "
                           f"on one kernel, bitwise repeatable rows); unset it for the default") from None


def shards_of(W) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A held weight ``[D, ...]`` as (its distinct shards ``[G, ...]``, per device the index of
    its shard): a :class:`~ttbundle.package.shards.SharedStack` as held, a view with stride 0 over the
    devices (one copy, ``package.shards.stack_shards``) as one shard, anything else one per device."""
    if isinstance(W, SharedStack):
        return W.distinct, W.group
    if W.shape[0] > 1 and W.stride(0) == 0:
        return W[:1], (0,) * W.shape[0]
    return W, tuple(range(W.shape[0]))


def dense(W):
    """A held weight as a plain ``[D, ...]`` tensor (a copy for packed and shared ones)."""
    return W.dense() if isinstance(W, (Packed, SharedStack)) else W


def same_rows(x: torch.Tensor) -> bool:
    """Whether every slice ``x[i]`` equals ``x[0]``, bit for bit: proven by a stride of 0 (one
    copy viewed several times), else checked (one read of ``x``)."""
    if x.shape[0] < 2 or x.stride(0) == 0:
        return True
    return torch.equal(x[1:], x[:1].expand_as(x[1:]))


def grouped(x: torch.Tensor, group: tuple, n_out: int, mm) -> torch.Tensor:
    """``x [D, ..., K]`` times per-device weights -> ``[D, ..., n_out]``, where device ``d``
    uses distinct shard ``group[d]`` and ``mm(g, rows [M, K]) -> [M, n_out]`` multiplies by
    shard ``g``. Each distinct shard is read once per call: the rows of every device holding it
    go through one product, or, where those devices' rows are bit-identical (:func:`same_rows`:
    a replicated step whose inputs really are replicated), one device's rows do and the others
    take that result. Rows that differ (a dropped collective leaves them so) are each computed,
    so a wrong program still computes wrong numbers."""
    D, K = x.shape[0], x.shape[-1]
    lead = x.shape[1:-1]
    x3 = x.reshape(D, -1, K)
    M = x3.shape[1]
    if D == 1:  # one device (N150): its product is the result, no stacking copy
        return mm(0, x3[0]).view(1, *lead, n_out)
    if group == tuple(range(D)):
        return torch.stack([mm(d, x3[d]) for d in range(D)]).view(D, *lead, n_out)
    members: dict[int, list[int]] = {}
    for d, g in enumerate(group):
        members.setdefault(g, []).append(d)
    if len(members) == 1 and same_rows(x3):
        return mm(0, x3[0]).unsqueeze(0).expand(D, M, n_out).view(D, *lead, n_out)
    out = x3.new_empty(D, M, n_out)
    for g, devs in members.items():
        idx = torch.tensor(devs, device=x.device)
        xg = x3.index_select(0, idx)
        if same_rows(xg):
            y = mm(g, xg[0]).unsqueeze(0).expand(len(devs), M, n_out)
        else:
            y = mm(g, xg.reshape(-1, K)).view(len(devs), M, n_out)
        out.index_copy_(0, idx, y)
    return out.view(D, *lead, n_out)


class Packed:
    """A dense weight ``[D, K, N]`` held oneDNN-packed, one copy per distinct shard (devices
    sharing one copy, :func:`shards_of`, share it), in one of two layouts:

    * **merged** (where there are several distinct shards): the shards side by side along N, one
      packed ``[G * N, K]`` matrix. Where every device's rows are the same (a column-split
      weight after its input was gathered or reduced: the usual tensor-parallel case), one call
      multiplies those rows by every shard at once; one oneDNN call instead of ``G``, which is
      what a one-row step on many emulated devices is made of. Each output element is the same
      dot product over the same ``K`` as in a per-shard call (bit for bit, tested).
    * **per shard**: one packed ``[N, K]`` matrix per distinct shard, for rows that differ per
      device (a row-split weight: each device multiplies its own slice of the input).

    A weight starts merged (up to ``MERGE_BYTES`` in all, else per shard); the first call whose
    rows differ re-packs it per shard, which it then stays (a weight fed differing rows once is a
    row-split one): one layout held at a time, never the weight twice."""

    def __init__(self, W):
        self.shape, self.dtype, self.device = tuple(W.shape), W.dtype, W.device
        distinct, self.group = shards_of(W)
        self.per_shard: list | None = None
        self.merged = None
        if distinct.shape[0] > 1 and distinct.numel() * distinct.element_size() <= MERGE_BYTES:
            self.merged = _pack(distinct.transpose(1, 2).reshape(-1, distinct.shape[1]))
        else:
            self.per_shard = [_pack(s.t()) for s in distinct]

    def dim(self) -> int:
        return len(self.shape)

    def _distinct(self) -> torch.Tensor:
        """The distinct shards ``[G, K, N]``, plain (a copy)."""
        if self.per_shard is not None:
            return torch.stack([p.to_dense().t() for p in self.per_shard])
        G, K, N = max(self.group) + 1, self.shape[1], self.shape[2]
        return self.merged.to_dense().view(G, N, K).transpose(1, 2)

    def dense(self) -> torch.Tensor:
        """The plain ``[D, K, N]`` tensor (for a reader other than the GEMM; a copy)."""
        distinct = self._distinct()
        if distinct.shape[0] == 1:
            return distinct.expand(self.shape[0], *distinct.shape[1:])
        return distinct.index_select(0, torch.tensor(self.group, device=distinct.device))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [D, ..., K] @ W -> [D, ..., N]``, each device's rows with its own shard."""
        D, K, N = x.shape[0], x.shape[-1], self.shape[-1]
        if self.merged is not None:
            x3 = x.reshape(D, -1, K)
            if same_rows(x3):
                M, G = x3.shape[1], max(self.group) + 1
                y = _linear(x3[0], self.merged).view(M, G, N)
                if self.group != tuple(range(G)):
                    y = y.index_select(1, torch.tensor(self.group, device=y.device))
                return y.transpose(0, 1).contiguous().view(*x.shape[:-1], N)
            self.per_shard = [_pack(s.t()) for s in self._distinct()]
            self.merged = None

        def one(g, rows):
            return _linear(rows, self.per_shard[g])
        return grouped(x, self.group, N, one)


def _pack(w_nk: torch.Tensor):
    """``[N, K]`` reordered into oneDNN's blocked layout for its inner-product kernel."""
    return torch.ops.mkldnn._reorder_linear_weight(w_nk.contiguous(), ROWS_HINT)


def _linear(rows: torch.Tensor, packed) -> torch.Tensor:
    if rows.shape[0] == 1 and batch_invariant():  # the several-row kernel, as in any bucket
        return torch.ops.mkldnn._linear_pointwise(rows.expand(2, -1).contiguous(), packed, None, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")


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
    dense3 = isinstance(W, (torch.Tensor, SharedStack)) and W.dim() == 3 and W.dtype == dtype
    return Packed(W) if dense3 else W


def matmul(x: torch.Tensor, W) -> torch.Tensor:
    """``x [D, T, K]`` or ``[D, T, E, K]`` times a dense weight ``[D, K, N]`` (plain, shared or
    packed): one product per distinct shard (:func:`grouped`), or one batched product where
    every device holds its own."""
    if isinstance(W, Packed):
        return W.matmul(x)
    if x.shape[1] == 1 and x.dim() == 3 and batch_invariant():  # one row: the several-row kernel
        return matmul(x.expand(-1, 2, -1).contiguous(), W)[:, :1]
    distinct, group = shards_of(W)
    if distinct.shape[0] != x.shape[0]:
        return grouped(x, group, distinct.shape[-1], lambda g, rows: rows @ distinct[g])
    return torch.bmm(x, W) if x.dim() == 3 else torch.einsum("dtek,dkn->dten", x, W)
