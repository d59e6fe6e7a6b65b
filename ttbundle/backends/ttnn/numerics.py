"""What the recording double computes: ttnn's calls on per-device numpy arrays.

Each function here takes the call's arguments as the double resolves them (a tensor is its list
of per-device arrays, mesh order ``d = r * cols + c``; everything else as passed) and returns
the per-device result, following the ttnn 0.81.1 docstrings (``help(ttnn.all_gather)`` ...):

* collectives: ``all_gather(x, dim, cluster_axis)`` concatenates, on every device, the shards of
  the devices on its line along ``cluster_axis`` (0: the devices of its mesh column, in row
  order; 1: those of its mesh row, in column order; None: every device in mesh order);
  ``all_reduce`` sums over the same line; ``reduce_scatter`` sums, then keeps the device's own
  part; ``mesh_partition`` keeps the part of ``dim`` at the device's index on the line;
* mappers and composers: ``ShardTensor2dMesh(dims=(row_dim, col_dim))`` cuts ``row_dim`` over
  the mesh rows and ``col_dim`` over the columns (a dim named twice is cut rows outermost, as
  DTensor does; not checked against ttnn, and ``mappers.mapper_dims`` never asks for it);
  ``ConcatMesh2dToTensor`` is its inverse;
* ops: elementwise math, reductions, shapes, matmul, rms_norm, layer_norm, embedding, rotary embeddings,
  topk / gather / scatter, greedy sampling, the paged KV cache writes, paged SDPA and MLA.

Anything else is not computed (no entry in :data:`IMPLS_PER_DEVICE`, :data:`COLLECTIVES` or the
recorder's own few): the double marks the result unknown (:class:`Unknown`), which a later numeric
read refuses.
"""

from __future__ import annotations

import math
from math import erf

import numpy as np

from ... import layout
from ...blockfloat import quantize_array


class Unknown(Exception):
    """The double cannot say what a value is (the reason is the message)."""


# ---- dtypes ----------------------------------------------------------------------------------
FLOATS = {"bfloat16", "float32", "bfloat8_b", "bfloat4_b"}
INTS = {"uint32": np.uint32, "int32": np.int32, "uint16": np.uint16, "uint8": np.uint8}


def round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (round to nearest even), kept as float32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = u.view(np.float32)
    return np.where(np.isnan(a), a, out)


def as_dtype(a: np.ndarray, dtype: str | None) -> np.ndarray:
    """``a`` held as ttnn dtype ``dtype`` (None: as it is)."""
    if dtype is None:
        return a
    if dtype in INTS:
        return np.asarray(a).astype(INTS[dtype])
    if dtype == "float32":
        return np.asarray(a, dtype=np.float32)
    if dtype == "bfloat16":
        return round_bf16(a)
    if dtype in ("bfloat8_b", "bfloat4_b"):
        a = np.asarray(a, dtype=np.float32)
        return quantize_array(a, "bfp8" if dtype == "bfloat8_b" else "bfp4").reshape(a.shape)
    raise Unknown(f"dtype {dtype} is not modeled")


# ---- mesh lines ------------------------------------------------------------------------------
def line(shape: tuple[int, int], d: int, cluster_axis) -> list[int]:
    """The devices ``d`` exchanges with over ``cluster_axis``, in the order ttnn concatenates."""
    R, C = shape
    r, c = divmod(d, C)
    if cluster_axis is None:
        return list(range(R * C))
    if int(cluster_axis) == 0:
        return [i * C + c for i in range(R)]
    if int(cluster_axis) == 1:
        return [r * C + j for j in range(C)]
    raise ValueError(f"cluster_axis {cluster_axis!r} on a 2-D mesh")


def _dim(a: np.ndarray, dim: int) -> int:
    return dim % a.ndim


def all_gather(shape, xs, dim: int, cluster_axis=None, **_):
    return [np.concatenate([xs[e] for e in line(shape, d, cluster_axis)], axis=_dim(xs[d], dim))
            for d in range(len(xs))]


def all_reduce(shape, xs, cluster_axis=None, **_):
    return [np.sum([xs[e].astype(np.float32) for e in line(shape, d, cluster_axis)], axis=0).astype(xs[d].dtype)
            for d in range(len(xs))]


def reduce_scatter(shape, xs, dim: int, cluster_axis=None, **_):
    full = all_reduce(shape, xs, cluster_axis)
    return mesh_partition(shape, full, dim, cluster_axis)


def mesh_partition(shape, xs, dim: int, cluster_axis=None, **_):
    out = []
    for d, x in enumerate(xs):
        members = line(shape, d, cluster_axis)
        k, n = _dim(x, dim), len(members)
        part = layout.even_slice(x.shape[k], n, members.index(d))
        if part is None:
            raise ValueError(f"mesh_partition: dim {dim} of {x.shape} does not divide over {n} devices")
        out.append(x[(slice(None),) * k + (part,)])
    return out


def shard_2d(shape, a: np.ndarray, dims) -> list[np.ndarray]:
    """``ShardTensor2dMesh(mesh_shape=shape, dims=dims)`` of host array ``a``."""
    R, C = shape
    out = []
    for d in range(R * C):
        r, c = divmod(d, C)
        x = a
        for dim, i, n in ((dims[0], r, R), (dims[1], c, C)):
            if dim is not None:
                part = layout.even_slice(x.shape[dim], n, i)
                if part is None:
                    raise ValueError(f"ShardTensor2dMesh: dim {dim} of {x.shape} does not divide over {n}")
                x = x[(slice(None),) * (dim % x.ndim) + (part,)]
        out.append(np.ascontiguousarray(x))
    return out


def concat_2d(shape, xs, dims) -> np.ndarray:
    """``ConcatMesh2dToTensor(mesh_shape=shape, dims=dims)``: the inverse of :func:`shard_2d`."""
    R, C = shape
    rows = [np.concatenate([xs[r * C + c] for c in range(C)], axis=dims[1]) for r in range(R)]
    return np.concatenate(rows, axis=dims[0])


# ---- ops (per device) ------------------------------------------------------------------------
def _binary(f):
    def op(a, b, **kw):
        return f(np.asarray(a, np.float32), np.asarray(b, np.float32))
    return op


def _unary(f):
    def op(x, **kw):
        return f(np.asarray(x, np.float32), **{k: v for k, v in kw.items() if k in ("fast_and_approximate_mode",)})
    return op


def _gelu(x, fast_and_approximate_mode=False):
    if fast_and_approximate_mode:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2))).astype(np.float32)


def _sigmoid(x, **_):
    return 1 / (1 + np.exp(-x))


def _softmax(x, dim=-1, **_):
    x = np.asarray(x, np.float32)
    m = x.max(axis=dim, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=dim, keepdims=True)


def _sum(x, dim=None, keepdim=False, **_):
    return np.sum(np.asarray(x, np.float32), axis=dim, keepdims=keepdim)


def _reshape(x, shape, *a, **_):
    return np.reshape(x, [int(s) for s in shape])


def _permute(x, dims, **_):
    return np.transpose(x, [int(d) for d in dims])


def _transpose(x, d0, d1, **_):
    return np.swapaxes(x, d0, d1)


def _slice(x, start, end, step=None, **_):
    step = step or [1] * len(start)
    return x[tuple(slice(a, b, s) for a, b, s in zip(start, end, step))]


def _concat(xs, dim, **_):
    return np.concatenate(list(xs), axis=dim)


def _repeat(x, repeats, **_):
    shp = repeats.args[0] if hasattr(repeats, "args") else repeats  # ttnn.Shape or a list
    return np.tile(x, [int(r) for r in shp])


def _repeat_interleave(x, n, dim, **_):
    return np.repeat(x, int(n), axis=dim)


def _clamp(x, lo=None, hi=None, **_):
    return np.clip(np.asarray(x, np.float32), lo, hi)


def _where(cond, a, b, **_):
    return np.where(np.asarray(cond) != 0, a, b).astype(np.float32)


def _softcap(x, cap, **_):
    return cap * np.tanh(np.asarray(x, np.float32) / cap)


def _matmul(a, b, transpose_a=False, transpose_b=False, bias=None, **_):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if transpose_a:
        a = np.swapaxes(a, -1, -2)
    if transpose_b:
        b = np.swapaxes(b, -1, -2)
    out = np.matmul(a, b)
    return out if bias is None else out + np.asarray(bias, np.float32)


def _vector(w, n: int) -> np.ndarray:
    """A vector held as rows of 32 (``[1, 1, ceil(n/32), 32]``) as its first ``n`` values."""
    return np.asarray(w, np.float32).reshape(-1)[:n]


def _rms_norm(x, epsilon=1e-12, weight=None, bias=None, **_):
    x = np.asarray(x, np.float32)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + epsilon)
    if weight is not None:
        y = y * _vector(weight, x.shape[-1])
    if bias is not None:
        y = y + _vector(bias, x.shape[-1])
    return y


def _layer_norm(x, epsilon=1e-12, weight=None, bias=None, **_):
    """``ttnn.layer_norm``: (x - mean) / sqrt(var + epsilon) over the last dim, then weight, bias."""
    x = np.asarray(x, np.float32)
    c = x - np.mean(x, axis=-1, keepdims=True)
    y = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + epsilon)
    if weight is not None:
        y = y * _vector(weight, x.shape[-1])
    if bias is not None:
        y = y + _vector(bias, x.shape[-1])
    return y


def _embedding(ids, table, **_):
    ids = np.asarray(ids).astype(np.int64)
    table = np.asarray(table)
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= table.shape[0]:
        raise ValueError(f"embedding: ids outside [0, {table.shape[0]})")
    return table[ids]


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _rope_hf(x, cos, sin, is_decode_mode=False, **_):
    x = np.asarray(x, np.float32)
    return x * cos + _rotate_half(x) * sin


def _rope_llama(x, cos, sin, trans_mat, is_decode_mode=False, **_):
    """``x * cos + (x @ trans_mat) * sin`` per 32-wide tile of the head dim (pairs swapped; a head
    dim under a tile is zero-padded to one, as the TILE layout holds it)."""
    x = np.asarray(x, np.float32)
    t = np.asarray(trans_mat, np.float32).reshape(32, 32)
    *lead, d = x.shape
    w = -(-d // 32) * 32
    xp = np.concatenate([x, np.zeros((*lead, w - d), np.float32)], axis=-1) if w != d else x
    rot = (xp.reshape(*lead, w // 32, 32) @ t).reshape(*lead, w)[..., :d]
    return x * cos + rot * sin


def _nlp_concat_heads(x, **_):
    b, h, s, d = x.shape
    return np.transpose(x, (0, 2, 1, 3)).reshape(b, 1, s, h * d)


def _topk(x, k, dim=-1, largest=True, sorted=True, **_):
    x = np.asarray(x, np.float32)
    key = -x if largest else x
    idx = np.argsort(key, axis=dim, kind="stable")
    idx = np.take(idx, np.arange(int(k)), axis=dim)
    return np.take_along_axis(x, idx, axis=dim), idx.astype(np.uint16)


def _gather(x, dim, index, **_):
    return np.take_along_axis(np.asarray(x), np.asarray(index).astype(np.int64), axis=dim)


def _scatter(x, dim, index, src, **_):
    out = np.array(x, dtype=np.float32, copy=True)
    np.put_along_axis(out, np.asarray(index).astype(np.int64), np.asarray(src, np.float32), axis=dim)
    return out


def _sampling(values, ids, top_k, top_p, temperature, seed=0, **_):
    """Greedy rows only (k = 1): the candidate with the largest value. A random draw (k > 1) is
    not modeled."""
    k = np.asarray(top_k).reshape(-1)
    v = np.asarray(values, np.float32)
    rows = v.shape[-2]
    if not (k[:rows] == 1).all():
        raise Unknown("ttnn.sampling with top_k > 1 draws at random: not modeled by the double")
    best = np.argmax(v, axis=-1)  # [..., rows]
    tok = np.take_along_axis(np.asarray(ids), best[..., None], axis=-1)[..., 0]
    return tok.reshape(1, 1, 1, rows).astype(np.uint32)


#: per-device ops (a float result is held in ``dtype=``, else in its first input's dtype)
IMPLS_PER_DEVICE = {
    "add": _binary(np.add), "subtract": _binary(np.subtract), "multiply": _binary(np.multiply),
    "divide": _binary(np.divide),
    "silu": _unary(lambda x: x * _sigmoid(x)), "gelu": _unary(_gelu), "sigmoid": _unary(_sigmoid),
    "tanh": _unary(np.tanh), "exp": _unary(np.exp), "neg": _unary(np.negative),
    "relu": _unary(lambda x: np.maximum(x, 0)),
    "softcap": _softcap, "clamp": _clamp, "where": _where, "softmax": _softmax, "sum": _sum,
    "reshape": _reshape, "permute": _permute, "transpose": _transpose, "slice": _slice, "concat": _concat,
    "repeat": _repeat, "repeat_interleave": _repeat_interleave,
    "to_layout": lambda x, *a, **k: x, "to_memory_config": lambda x, *a, **k: x,
    "matmul": _matmul, "linear": _matmul, "rms_norm": _rms_norm, "layer_norm": _layer_norm, "embedding": _embedding,
    "experimental.rotary_embedding_hf": _rope_hf, "experimental.rotary_embedding_llama": _rope_llama,
    "experimental.nlp_concat_heads": _nlp_concat_heads,
    "topk": _topk, "gather": _gather, "scatter": _scatter, "sampling": _sampling,
}
#: the collectives: they take every device's array at once (``mesh shape, arrays, *args``)
COLLECTIVES = {"all_gather": all_gather, "all_reduce": all_reduce, "reduce_scatter": reduce_scatter,
               "mesh_partition": mesh_partition}


# ---- the paged KV cache and attention (per device) ---------------------------------------------
def paged_update_cache(cache, x, update_idxs=None, page_table=None):
    """Row ``b`` of ``x`` (``[1, B, kv_heads, d]``) into its sequence's slot at ``cur_pos[b]``
    (rows at -1 write nothing); in place."""
    bs = cache.shape[2]
    pos = np.asarray(update_idxs).reshape(-1)
    pt = np.asarray(page_table)
    for b, p in enumerate(pos):
        if p < 0:
            continue
        cache[int(pt[b, p // bs]), :, p % bs, :] = x[0, b]


def paged_fill_cache(cache, x, fill_page_table, batch_idx=None):
    """A prefill chunk ``x`` (``[1, kv_heads, S, d]``) into the blocks of ``fill_page_table``."""
    bs = cache.shape[2]
    pt = np.asarray(fill_page_table).reshape(-1)
    S = x.shape[2]
    for i in range(S):
        if i // bs < pt.size:
            cache[int(pt[i // bs]), :, i % bs, :] = x[0, :, i, :]


def _attend(q, keys, vals, scale, sink=None):
    """q [H, d] over keys/vals [kvh, L, d] (GQA: head h uses KV head h // (H / kvh))."""
    H, kvh = q.shape[0], keys.shape[0]
    rep = H // kvh
    k = np.repeat(keys, rep, axis=0)
    v = np.repeat(vals, rep, axis=0)
    s = np.einsum("hd,hld->hl", q, k) * scale
    if sink is not None:
        s = np.concatenate([s, sink.reshape(H, 1)], axis=1)
    p = _softmax(s, -1)
    if sink is not None:
        p = p[:, :-1]
    return np.einsum("hl,hld->hd", p, v)


def _tokens(cache, pt_row, n: int):
    """The first ``n`` tokens of a sequence whose blocks are ``pt_row``: ``[kv_heads, n, d]``."""
    bs = cache.shape[2]
    blocks = [cache[int(pt_row[j])] for j in range(-(-n // bs))]
    return np.concatenate(blocks, axis=1)[:, :n]


def paged_sdpa_decode(q, k, v, page_table, cur_pos=None, scale=1.0, sliding_window_size=None,
                      attention_sink=None):
    """``q`` [1, B, H, d]: row b attends its sequence's tokens 0..cur_pos[b] (a window keeps the
    last ``sliding_window_size``); rows at -1 give zeros."""
    out = np.zeros((*q.shape[:-1], v.shape[-1]), np.float32)
    pos = np.asarray(cur_pos).reshape(-1)
    for b, p in enumerate(pos):
        if p < 0:
            continue
        lo = max(0, p + 1 - sliding_window_size) if sliding_window_size else 0
        keys = _tokens(k, page_table[b], p + 1)[:, lo:]
        vals = _tokens(v, page_table[b], p + 1)[:, lo:]
        out[0, b] = _attend(np.asarray(q[0, b], np.float32), keys, vals, scale, attention_sink)
    return out


def chunked_sdpa(q, k, v, page_table, chunk_start=None, scale=1.0, sliding_window_size=None,
                 attention_sink=None):
    """``q`` [1, H, S, d] of the chunk at ``chunk_start``: query i sees tokens 0..start+i."""
    start = int(np.asarray(chunk_start).reshape(-1)[0])
    _, H, S, d = q.shape
    n = start + S
    keys, vals = _tokens(k, page_table[0], n), _tokens(v, page_table[0], n)
    out = np.zeros((*q.shape[:-1], v.shape[-1]), np.float32)
    for i in range(S):
        p = start + i
        lo = max(0, p + 1 - sliding_window_size) if sliding_window_size else 0
        out[0, :, i] = _attend(np.asarray(q[0, :, i], np.float32), keys[:, lo:p + 1], vals[:, lo:p + 1], scale,
                               attention_sink)
    return out


def mla_decode(q, cache, head_dim_v: int, page_table, cur_pos=None, scale=1.0):
    """``paged_flash_multi_latent_attention_decode`` without a V cache: one latent "head" per
    token, keys ``latent | rope key``, values its first ``head_dim_v`` (the latent)."""
    return paged_sdpa_decode(q, cache, cache[..., :head_dim_v], page_table, cur_pos, scale)


def mla_prefill(q, cache, head_dim_v: int, page_table, chunk_start: int, scale=1.0):
    """``chunked_flash_mla_prefill``: the chunk at the static ``chunk_start`` over the latent cache."""
    return chunked_sdpa(q, cache, cache[..., :head_dim_v], page_table, chunk_start, scale)
