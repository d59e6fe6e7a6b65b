"""Per-device compute for the emulated mesh, written once for every family.

Kernels see device-batched local tensors ``[D, T, features]`` and a :class:`Ctx` with the
batch layout, the paged KV cache and the family's traits (pure data from the family module:
norm offset, sliding windows, rope per layer, soft-capping, ...). Nothing here moves data
between devices: that is the collectives' job (meshops).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...tables import mrope_cos_sin, rope_cos_sin
from . import gemm


# ---- rope -------------------------------------------------------------------------------------
# the tables (both backends use them) live in ``ttbundle.tables``
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    """x [D, T, heads, dim]; cos/sin [T, dim] (HF's rotate-half layout)."""
    return x * cos[None, :, None, :] + rotate_half(x) * sin[None, :, None, :]


def _rope_views(cos, sin_signed):
    """The ``[1, T, 1, dim]`` broadcast views :func:`_rope4` multiplies by (made once per
    forward by :func:`_rope_signed`: a view costs a dispatch per call, 16 calls a step)."""
    half = cos.shape[-1] // 2
    return cos[None, :, None, :], sin_signed[None, :, None, :half], sin_signed[None, :, None, half:]


def _rope4(x, cos4, sin_lo, sin_hi):
    """:func:`apply_rope`'s numbers in fewer passes, on :func:`_rope_views` of (cos, sin with its
    first half negated): ``(-x2) * s`` is ``x2 * (-s)`` exactly, so rotate_half's negation and
    concatenation become two multiplies into the halves of one buffer; then ``x * cos`` plus that."""
    half = x.shape[-1] // 2
    dtype = x.dtype if x.dtype == cos4.dtype else torch.result_type(x, cos4)
    r = torch.empty(x.shape, dtype=dtype, device=x.device)
    torch.mul(x[..., half:], sin_lo, out=r[..., :half])
    torch.mul(x[..., :half], sin_hi, out=r[..., half:])
    out = x * cos4
    return out.add_(r)


# ---- elementwise --------------------------------------------------------------------------------
def rms_norm(x, w, eps: float, offset: float = 0.0, weight_fp32: bool = False):
    """RMSNorm in float32 like HF, scaled by (offset + w); returns x's dtype. ``weight_fp32``:
    the weight multiplies in float32 before the cast (GPT-OSS), as a nonzero offset does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset or weight_fp32:  # Gemma: (1 + w) applied in float32 before the cast
        return (xf * (offset + w.float())).to(dtype)
    return w * xf.to(dtype)


def activation(name: str, x):
    if name == "silu":
        return F.silu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    raise ValueError(f"unsupported activation {name!r}")


def softcap(x, cap):
    return x if not cap else torch.tanh(x / cap) * cap


# ---- batch context ------------------------------------------------------------------------------
@dataclass
class Ctx:
    """What the kernels of one forward need besides their inputs."""

    arch: object  # the arch's vision settings (``arch.vision``) for the vision kernels; sizes: ``dims``
    traits: dict
    layer_traits: list
    weights: object  # callable (name, layer) -> [D, ...] local tensor, or None
    positions: torch.Tensor  # [N, Tq]
    valid: torch.Tensor  # [N, Tq] bool
    slots: torch.Tensor  # [N*Tq] cache slot per token, -1 = do not write
    context_slots: torch.Tensor  # [N, S] cache slots of each sequence's context
    kv: list  # per layer: {"k": [D, kvh, slots, hd], "v": ...}
    dtype: torch.dtype
    cache: dict = field(default_factory=dict)  # rope tables etc. shared across layers
    units: object = None  # callable (tensor, dim) -> [D, L] global units each device holds (-1 = pad)
    store: object = None  # callable x -> x as the KV cache's declared dtype holds it (None: as is)
    #: [N, S] image block of each context position (-1: text): the soft tokens of one image
    #: attend to each other bidirectionally (Gemma 3's token_type_ids mask); None: no images
    blocks: object = None
    #: [3, N, Tq] M-RoPE positions (temporal, height, width) of the tokens when the family's
    #: traits carry ``mrope_section``; None: ``positions`` in all three rows
    rope_positions: object = None
    #: per-call inputs of a vision program besides its activations (the family's vision part
    #: makes them on the host: e.g. Qwen2.5-VL's rope angles and attention segments per row)
    vision: dict | None = None
    #: the model's sizes as the program records them (``traits.Dims``: head width, RMSNorm eps)
    dims: object = None
    #: [N, S / block_size] the cache blocks of ``context_slots`` (which are whole blocks, in
    #: order) and the block size: attention gathers whole blocks; None: gather slots
    context_blocks: object = None
    block_size: int = 0
    #: ``VLLM_BATCH_INVARIANT`` (``gemm.batch_invariant``), read once per forward: every product
    #: and attention of it takes one path at any batch size (an environment read per product
    #: was ~4% of a one-row step's host work)
    invariant: bool = False

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (new cache rows, last dim = one token's row) as the cache's storage holds it."""
        return x if self.store is None else self.store(x)


def _rope_tables(ctx: Ctx, dim: int, theta: float, scaling):
    key = ("rope", dim, theta, id(scaling))
    section = ctx.traits.get("mrope_section")
    if key not in ctx.cache and section:
        rp = getattr(ctx, "rope_positions", None)
        rp = ctx.positions[None].expand(3, -1, -1) if rp is None else rp
        ctx.cache[key] = mrope_cos_sin(rp.reshape(3, -1), dim, theta, scaling, section, ctx.dtype,
                                       ctx.traits.get("mrope_interleaved", False))
    if key not in ctx.cache:
        ctx.cache[key] = rope_cos_sin(ctx.positions.reshape(-1), dim, theta, scaling, ctx.dtype)
    return ctx.cache[key]


def _rope_signed(ctx: Ctx, dim: int, theta: float, scaling):
    """:func:`_rope_views` of (cos, sin with its first half negated) for :func:`_rope4`, once per
    forward."""
    key = ("rope-signed", dim, theta, id(scaling))
    if key not in ctx.cache:
        cos, sin = _rope_tables(ctx, dim, theta, scaling)
        ctx.cache[key] = _rope_views(cos, torch.cat([-sin[:, :dim // 2], sin[:, dim // 2:]], dim=-1))
    return ctx.cache[key]


def _writes(ctx: Ctx):
    """(token selector or None when all tokens are written, their cache slots), once per forward."""
    if "writes" not in ctx.cache:
        ok = ctx.slots >= 0
        ctx.cache["writes"] = (None, ctx.slots) if bool(ok.all()) else (ok, ctx.slots[ok])
    return ctx.cache["writes"]


def _mask(ctx: Ctx, window):
    """[N, Tq, S]: key position <= query position (and within the sliding window)."""
    key = ("mask", window)
    if key not in ctx.cache:
        S = ctx.context_slots.shape[1]
        kpos = torch.arange(S, device=ctx.positions.device)[None, None, :]
        qpos = ctx.positions[:, :, None]
        m = kpos <= qpos
        blocks = getattr(ctx, "blocks", None)  # (the ttnn tests build a bare context)
        if blocks is not None:  # OR(causal, same image), then the window (as HF composes them)
            kb = blocks[:, :S]
            qb = kb.gather(1, ctx.positions.clamp(max=S - 1))
            m |= (qb[:, :, None] == kb[:, None, :]) & (qb[:, :, None] >= 0)
        if window:
            m &= kpos > qpos - window
        ctx.cache[key] = m
    return ctx.cache[key]


def _masked(ctx: Ctx, window):
    """[N, Tq, S]: the keys each query must not see (``~_mask``), once per forward: the
    scores are filled in place through its broadcast view, no per-layer copy."""
    key = ("masked", window)
    if key not in ctx.cache:
        ctx.cache[key] = ~_mask(ctx, window)
    return ctx.cache[key]


#: at most this many runs of consecutive cache blocks are copied run by run (below)
CONTEXT_RUNS = 4


def _runs(ctx: Ctx):
    """The context's blocks as runs of consecutive cache blocks ``[(row, first block, count,
    first block of the row's context it fills)]``, or None where there are more than
    ``CONTEXT_RUNS`` (interleaved tables): worked out once per forward, on the host."""
    if "runs" not in ctx.cache:
        blocks = ctx.context_blocks.cpu()
        runs: list | None = []
        for n, row in enumerate(blocks.tolist()):
            start = 0
            for j in range(1, len(row) + 1):
                if j == len(row) or row[j] != row[j - 1] + 1:
                    runs.append((n, row[start], j - start, start))
                    start = j
            if len(runs) > CONTEXT_RUNS:
                runs = None
                break
        ctx.cache["runs"] = runs
    return ctx.cache["runs"]


def _block_rows(ctx: Ctx, outer: int, blocks: int):
    """The context's blocks as rows of a cache viewed ``[outer x blocks, block_size x hd]``
    (``outer`` = devices x heads, outermost): row ``o * blocks + b`` for each ``o``, then each
    context block ``b`` in order, once per forward and cache shape."""
    key = ("block rows", outer, blocks)
    if key not in ctx.cache:
        ctx.cache[key] = (torch.arange(outer, device=ctx.context_blocks.device)[:, None] * blocks
                          + ctx.context_blocks.reshape(1, -1)).reshape(-1)
    return ctx.cache[key]


def _context(ctx: Ctx, cache, N: int, S: int, dtype: torch.dtype | None = None):
    """[D, kvh, N, S, hd]: each sequence's context gathered from ``cache`` [D, kvh, slots, hd]
    as ``dtype`` (default the cache's). Given in blocks (``context_blocks``), a context whose
    blocks lie in a few runs of consecutive cache blocks (a sequence's table as it is usually
    handed out) is copied run by run, converting as it copies (one pass over the stored values);
    otherwise whole blocks of ``block_size`` contiguous slots are gathered (one copy of
    block_size rows per block instead of a row per slot), then converted: from a contiguous
    cache as rows of ``[devices x heads x blocks, block_size x hd]`` (index_select along dim 0
    copies each row with one memcpy; along the block dim it set up a strided copy per block). The emulated model's
    cache is held in the compute dtype (``state.kv_store``), so neither path converts there: the
    gather is the one pass that lays the context out for the batched matmul."""
    D, kvh, _, hd = cache.shape
    dtype = dtype or cache.dtype
    if getattr(ctx, "context_blocks", None) is not None:
        bs = ctx.block_size
        runs = _runs(ctx)
        if (runs is not None and N == 1 and len(runs) == 1 and dtype == cache.dtype
                and not ctx.invariant):
            # one sequence whose context is one run of consecutive blocks (a one-row decode, a
            # prefill chunk): the cache's own slots, viewed, are the matmuls' operand; nothing
            # copied (the several-row path's gather is another kernel's input: its last bits
            # may differ, within the attention tolerance; VLLM_BATCH_INVARIANT keeps the gather)
            _, b0, count, _ = runs[0]
            return cache[:, :, b0 * bs:(b0 + count) * bs].unsqueeze(2)
        if runs is not None:
            out = torch.empty(D, kvh, N, S, hd, dtype=dtype, device=cache.device)
            for n, b0, count, j0 in runs:
                out[:, :, n, j0 * bs:(j0 + count) * bs].copy_(cache[:, :, b0 * bs:(b0 + count) * bs])
            return out
        if cache.is_contiguous():  # one row per (device, head, block): index_select's dim-0 path
            rows = cache.view(-1, bs * hd).index_select(0, _block_rows(ctx, D * kvh, cache.shape[2] // bs))
            return rows.view(D, kvh, N, S, hd).to(dtype)
        got = cache.view(D, kvh, -1, bs, hd).index_select(2, ctx.context_blocks.reshape(-1)).view(D, kvh, N, S, hd)
        return got.to(dtype)
    return cache.index_select(2, ctx.context_slots.reshape(-1)).view(D, kvh, N, S, hd).to(dtype)


#: attention scores computed at a time (elements, float32): 32 Mi = 128 MiB per block
ATTN_BLOCK = 1 << 25


def attention(ctx: Ctx, layer: int, q, k, v):
    """GQA attention over the paged cache, with the optional pieces families use: q/k/v bias,
    per-head q/k RMSNorm, rope variants, sliding window, logit soft-capping, attention sinks.

    The numbers are those of the plain formula (tests/test_emulated_attention_exact.py checks
    them bit for bit): rope, write the new K/V rows rounded to the cache's storage, gather each
    sequence's context, scores = Q K^T as one matmul per (device, KV head, sequence), scale,
    soft-cap, mask, sinks, softmax, P V. What makes a decode step cheap is doing no more passes
    than that (issue 25): the cache holds its bf16 values in the compute dtype, so the context
    is gathered straight into the matmul's operand (no per-layer bf16 -> float32 conversion);
    rope is two multiplies and an add (:func:`_rope4`); the new rows go in with ``index_copy_``;
    scale, soft-cap and the mask (inverted once per forward, :func:`_masked`) act in place on
    the matmul's result."""
    dims, lt, W = ctx.dims, ctx.layer_traits[layer], ctx.weights
    hd = lt.get("head_dim", dims.head_dim)
    D, T = q.shape[:2]
    for name, t in (("bq", "q"), ("bk", "k"), ("bv", "v")):
        b = W(name, layer)
        if b is not None:
            if t == "q":
                q = q + b[:, None, :]
            elif t == "k":
                k = k + b[:, None, :]
            else:
                v = v + b[:, None, :]
    q, k, v = q.view(D, T, -1, hd), k.view(D, T, -1, hd), v.view(D, T, -1, hd)
    qn, kn = W("q_norm", layer), W("k_norm", layer)
    if qn is not None:
        q = rms_norm(q, qn[:, None, None, :], dims.rms_norm_eps, ctx.traits.get("norm_offset", 0.0))
        k = rms_norm(k, kn[:, None, None, :], dims.rms_norm_eps, ctx.traits.get("norm_offset", 0.0))
    tables = _rope_signed(ctx, hd, lt["rope_theta"], lt.get("rope_scaling"))
    q, k = _rope4(q, *tables), _rope4(k, *tables)

    cache = ctx.kv[layer]  # [D, kvh, slots, hd]
    wsel, wslots = _writes(ctx)
    kk, vv = (k, v) if wsel is None else (k[:, wsel], v[:, wsel])
    # the new rows copied along the slot dim (index_copy_: one strided copy per row, where
    # index_put with a middle-dim index went through the general advanced-indexing kernel)
    cache["k"].index_copy_(2, wslots, ctx.stored(kk.transpose(1, 2)).to(cache["k"].dtype))
    cache["v"].index_copy_(2, wslots, ctx.stored(vv.transpose(1, 2)).to(cache["v"].dtype))

    N, Tq = ctx.positions.shape
    S = ctx.context_slots.shape[1]
    kvh = cache["k"].shape[1]
    K, V = _context(ctx, cache["k"], N, S, q.dtype), _context(ctx, cache["v"], N, S, q.dtype)
    g = q.shape[2] // kvh  # query heads grouped under their KV head
    scale, cap, masked = lt.get("attn_scale", hd ** -0.5), lt.get("attn_softcap"), _masked(ctx, lt.get("window"))
    sinks = W("sinks", layer)
    Qv = q.view(D, N, Tq, kvh, g, hd)
    # query rows in blocks whose scores stay within ATTN_BLOCK elements (a long prefill's whole
    # [heads, Tq, S] scores, its softmax and mask copies were several GB); each row's result is
    # its own, so a call that fits one block (decode, short prefill) computes exactly as before
    rows = max(1, ATTN_BLOCK // max(1, D * kvh * N * g * S))
    out = None
    for t0 in range(0, Tq, rows):
        tb = min(Tq, t0 + rows) - t0
        Q = Qv[:, :, t0:t0 + tb].permute(0, 3, 1, 4, 2, 5).reshape(D, kvh, N, g * tb, hd)
        # the scores' elementwise steps in place on the matmul's result (the same operations
        # in the same order as ``* scale``, ``softcap``, ``masked_fill``: the same numbers)
        scores = (Q @ K.transpose(-1, -2)).view(D, kvh, N, g, tb, S).mul_(scale)
        if cap:
            scores.div_(cap).tanh_().mul_(cap)
        scores.masked_fill_(masked[:, t0:t0 + tb][None, None, :, None], float("-inf"))
        if sinks is not None:  # an extra logit per head that takes probability mass, then dropped
            sink = sinks.view(D, kvh, 1, g, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
            p = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1].to(q.dtype)
        else:
            p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        del scores
        o = (p.reshape(D, kvh, N, g * tb, S) @ V).view(D, kvh, N, g, tb, hd).permute(0, 2, 4, 1, 3, 5)
        if tb == Tq:
            return o.reshape(D, T, -1)
        if out is None:
            out = torch.empty(D, N, Tq, kvh, g, hd, dtype=o.dtype, device=o.device)
        out[:, :, t0:t0 + tb] = o
    return out.reshape(D, T, -1)


def swiglu(ctx: Ctx, layer: int, g, u):
    return activation(ctx.traits["act"], g) * u


KERNELS = {"attention": attention, "swiglu": swiglu}  # the whole table: kernel_table.KERNELS
