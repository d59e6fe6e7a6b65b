"""How the emulated mesh holds and multiplies its dense matmul weights on this host.

A decode step is mostly weight GEMMs of a few rows. A dense ``[D, K, N]`` weight is held as
:class:`Packed`: ``[N, K]`` matrices (a linear layer's layout), one per distinct shard (devices
that hold the same shard share one copy, ``package.shards.stack_shards``), or the shards side by
side as one. A shard several devices hold is multiplied once per call (:func:`grouped`): with all
their rows at once, or once where their rows are the same bits.

``TTBUNDLE_EMULATED_GEMM`` (documented in docs/runtime.md):

* ``auto`` (default, float32 on the CPU where torch has oneDNN): ``plain`` on an Intel CPU,
  ``packed`` on any other for a matrix of ``BLOCKED_MIN_BYTES`` (1 MiB) or more (:func:`blocked`). MKL, torch's sgemm on x86, takes its fast kernels on
  Intel CPUs only: on the AMD EPYC hosts measured (issue 38, 2026-12-06, 2 threads, this model's
  57 weights) MKL's one-row kernel took 33 ms where oneDNN's blocked layout took 19 ms, and at
  16 rows oneDNN on the plain matrix 43-45 ms where the blocked layout took 26-31 ms; on the
  Intel host measured in issue 38 the plain matrices were the faster (below).
* ``plain``: contiguous ``[N, K]`` matrices; one row multiplied by MKL's matrix-vector kernel
  (``F.linear``: transformers' own one-row kernel), several rows by oneDNN's inner product (on
  the plain matrix the same bits as on its blocked layout). On the Intel host measured in issue
  38 a one-row N150 step took 0.86x the blocked layout's time (interleaved, load ~8); at 32 rows
  oneDNN on the plain matrix took 1.0-1.09x the blocked layout's, MKL 1.15x (interleaved, 1 and
  2 threads, load ~5).
* ``packed``: the matrices reordered once into oneDNN's blocked layout (what ``torch.compile``'s
  CPU weight prepacking does), multiplied by oneDNN's inner product at any row count.
* ``torch``: torch's ``bmm`` on the plain ``[D, K, N]`` tensor.

Batch invariance (issue 38): by default a row's last bits may depend on how many rows share its
call (one row takes another kernel than several), as with vLLM's default kernels; tokens stay
transformers'. ``VLLM_BATCH_INVARIANT=1`` (vLLM's switch of the same name, read the same way)
keeps every row count on one kernel: oneDNN's inner product, a one-row product run as two rows
(the row twice, the first kept): a row's result is the same bits at any batch size (:func:`batch_invariant`; attention's side is ``kernels.attention``'s).
Weights are held once either way."""

from __future__ import annotations

import os

import torch

from ...errors import InvalidInput
from ...package.shards import SharedStack

ENV = "TTBUNDLE_EMULATED_GEMM"
#: vLLM's batch-invariant mode switch (``vllm.envs.VLLM_BATCH_INVARIANT``: an integer, 0 or 1)
INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
#: rows of every product of a plain (not packed) weight in batch-invariant mode (:func:`matmul`)
INVARIANT_ROWS = 16
#: the row count oneDNN's reorder is told to expect (a decode bucket); any row count works
ROWS_HINT = 16
#: a model reading one stage at a time (``LazyWeights``) packs matmul weights up to this many
#: bytes per device shard; larger ones (a vocabulary head) stay plain (packing copies them)
PACK_BYTES = 512 << 20
#: ``auto`` off Intel CPUs holds a matrix blocked from this size up; a smaller one stays plain:
#: oneDNN's call costs ~16 us where MKL's takes 4-6 us for a 64x64 or 256x256 matrix at one row,
#: and from 512x512 (1 MiB) up the blocked layout is the faster (AMD EPYC, 2026-12-06)
BLOCKED_MIN_BYTES = 1 << 20
#: a weight of several distinct shards is held merged (:class:`Packed`) up to this many bytes in
#: all: merging copies every shard at once while it packs; a larger one is packed shard by shard
MERGE_BYTES = 512 << 20


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether dense weights of this dtype on this device are held as :class:`Packed` (plain
    ``[N, K]`` or oneDNN-blocked, per ``TTBUNDLE_EMULATED_GEMM``)."""
    mode = _mode()
    return (mode != "torch" and torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "plain", "packed", "torch"):
        raise InvalidInput(f"environment variable {ENV}={mode!r}: expected 'auto' (the faster layout for this "
                           f"CPU: plain on Intel, packed elsewhere), 'plain' (plain weights: MKL's kernel for one "
                           f"row, oneDNN's for several), 'packed' (oneDNN's blocked weight layout) or 'torch' "
                           f"(torch's bmm); unset it for the default")
    return mode


_VENDOR: list[str] = []


def cpu_vendor() -> str:
    """The CPU's vendor string as the kernel reports it (``GenuineIntel``, ``AuthenticAMD``; ''
    where /proc/cpuinfo does not say), read once per process."""
    if not _VENDOR:
        vendor = ""
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("vendor_id"):
                        vendor = line.partition(":")[2].strip()
                        break
        except OSError:
            pass
        _VENDOR.append(vendor)
    return _VENDOR[0]


def blocked(nbytes: int | None = None) -> bool:
    """Whether a matmul weight of ``nbytes`` per matrix (None: a large one) is held in oneDNN's
    blocked layout: ``packed``, or ``auto`` on a CPU that is not Intel's (MKL's fast kernels are
    Intel's only: measured, module doc) for a matrix of at least :data:`BLOCKED_MIN_BYTES`."""
    mode = _mode()
    return mode == "packed" or (mode == "auto" and cpu_vendor() != "GenuineIntel"
                                and (nbytes is None or nbytes >= BLOCKED_MIN_BYTES))


def describe() -> str:
    """The weight GEMM's layout in a few words, for a benchmark's header: ``plain (auto, GenuineIntel)``,
    ``packed from 1 MiB a matrix, plain below (auto, AuthenticAMD)``."""
    mode = _mode()
    if mode == "torch":
        return "torch bmm"
    if mode != "auto":
        return mode
    vendor = cpu_vendor() or "vendor unknown"
    return (f"packed from {BLOCKED_MIN_BYTES >> 20} MiB a matrix, plain below (auto, {vendor})" if blocked()
            else f"plain (auto, {vendor})")


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
    """A dense weight ``[D, K, N]`` held as ``[N, K]`` matrices (plain, or oneDNN-blocked: :func:`_pack`), one copy per distinct shard (devices
    sharing one copy, :func:`shards_of`, share it), in one of two layouts:

    * **merged** (where there are several distinct shards): the shards side by side along N, one
      packed ``[G * N, K]`` matrix. Where every device's rows are the same (a column-split
      weight after its input was gathered or reduced: the usual tensor-parallel case), one call
      multiplies those rows by every shard at once; one GEMM call instead of ``G``, which is
      what a one-row step on many emulated devices is made of. Each output element is the same
      dot product over the same ``K`` as in a per-shard call (bit for bit, tested).
    * **per shard**: one ``[N, K]`` matrix per distinct shard (plain: one ``[G, N, K]`` tensor, one
      batched product where each device holds its own), for rows that differ per
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
            self.per_shard = _pack_shards(distinct)

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

    def matmul(self, x: torch.Tensor, invariant: bool | None = None) -> torch.Tensor:
        """``x [D, ..., K] @ W -> [D, ..., N]``, each device's rows with its own shard
        (``invariant``: :func:`batch_invariant` as the caller read it; None: read here)."""
        D, K, N = x.shape[0], x.shape[-1], self.shape[-1]
        if invariant is None:
            invariant = batch_invariant()
        if D == 1 and self.per_shard is not None:  # one device (N150): its one matrix, no grouping
            return _linear(x.reshape(-1, K), self.per_shard[0], invariant).view(*x.shape[:-1], N)
        if self.merged is not None:
            x3 = x.reshape(D, -1, K)
            if same_rows(x3):
                M, G = x3.shape[1], max(self.group) + 1
                y = _linear(x3[0], self.merged, invariant).view(M, G, N)
                if self.group != tuple(range(G)):
                    y = y.index_select(1, torch.tensor(self.group, device=y.device))
                return y.transpose(0, 1).contiguous().view(*x.shape[:-1], N)
            self.per_shard = _pack_shards(self._distinct())
            self.merged = None
        x3 = x.reshape(D, -1, K)
        if (isinstance(self.per_shard, torch.Tensor) and self.group == tuple(range(D)) and D > 1
                and x3.shape[1] == 1 and not invariant):
            # one row per device, each its own plain shard ([D, N, K]): one batched MKL product
            # for all of them, the one-row kernel's kind (a T3K one-row step's row-split weight:
            # one call where there were eight); several rows stay on oneDNN, shard by shard
            return torch.bmm(x3, self.per_shard.transpose(1, 2)).view(*x.shape[:-1], N)

        def one(g, rows):
            return _linear(rows, self.per_shard[g], invariant)
        return grouped(x, self.group, N, one)


def _pack_shards(distinct: torch.Tensor):
    """Distinct shards ``[G, K, N]`` held per shard: plain, one ``[G, N, K]`` tensor (its slices
    are the shards' matrices, and one batched product reads them all); blocked, a list."""
    if blocked(distinct[0].numel() * distinct.element_size()):
        return [_pack(s.t()) for s in distinct]
    return distinct.transpose(1, 2).contiguous()


def _pack(w_nk: torch.Tensor):
    """``[N, K]`` as the GEMM reads it: plain and contiguous (``plain``: what both MKL's one-row
    kernel and oneDNN's several-row kernel take as is), or reordered into oneDNN's blocked
    layout (:func:`blocked`)."""
    if blocked(w_nk.numel() * w_nk.element_size()):
        return torch.ops.mkldnn._reorder_linear_weight(w_nk.contiguous(), ROWS_HINT)
    return w_nk.contiguous()


def _linear(rows: torch.Tensor, w, invariant: bool | None = None) -> torch.Tensor:
    """``rows [M, K] @ w.T`` for a weight as :func:`_pack` holds it. Several rows: oneDNN's inner
    product (on a plain weight the blocked layout's bits, and a row's bits the same at any row
    count from 2 up, tested). One row on a plain weight (``plain``): MKL's matrix-vector kernel
    (``F.linear``, transformers' own one-row kernel), unless ``VLLM_BATCH_INVARIANT`` asks for
    one path at every batch size: then the row runs twice through the several-row kernel."""
    if rows.shape[0] == 1:
        if batch_invariant() if invariant is None else invariant:  # the several-row kernel, as in any bucket
            return torch.ops.mkldnn._linear_pointwise(rows.expand(2, -1).contiguous(), w, None, "none", [], "")[:1]
        if not w.is_mkldnn:
            return torch.nn.functional.linear(rows, w)
    return torch.ops.mkldnn._linear_pointwise(rows, w, None, "none", [], "")


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


def matmul(x: torch.Tensor, W, invariant: bool | None = None) -> torch.Tensor:
    """``x [D, T, K]`` or ``[D, T, E, K]`` times a dense weight ``[D, K, N]`` (plain, shared or
    packed): one product per distinct shard (:func:`grouped`), or one batched product where
    every device holds its own."""
    if isinstance(W, Packed):
        return W.matmul(x, invariant)
    if x.dim() == 3 and (batch_invariant() if invariant is None else invariant):
        # every product the same row count (INVARIANT_ROWS, zero rows padding the last): MKL's
        # GEMM picks its kernel and its K-blocking by the row count, and on some CPUs (an AMD
        # EPYC here) 2 and 40 rows sum a row in other orders; at one row count a row's bits are
        # its own, wherever it sits in the batch
        T, B = x.shape[1], INVARIANT_ROWS
        if T % B:
            x = torch.cat([x, x.new_zeros(x.shape[0], B - T % B, x.shape[2])], dim=1)
        return torch.cat([matmul(x[:, i:i + B], W, False) for i in range(0, x.shape[1], B)], dim=1)[:, :T]
    distinct, group = shards_of(W)
    if distinct.shape[0] != x.shape[0]:
        return grouped(x, group, distinct.shape[-1], lambda g, rows: rows @ distinct[g])
    return torch.bmm(x, W) if x.dim() == 3 else torch.einsum("dtek,dkn->dten", x, W)
