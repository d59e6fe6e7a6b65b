"""The KV pool: its block count from a token count (Tenstorrent's formula, :func:`pool_blocks`)
and back (:func:`pool_tokens`), and the pool a plan takes (:func:`choose_pool`: the spec's
``max_tokens_all_users``, or ``auto``, the largest that fits)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tiles import cdiv as _cdiv
from .memory import _gib

def pool_blocks(rt, tokens: int) -> int:
    """Blocks of a KV pool of ``tokens`` tokens (Tenstorrent's formula): ceil((tokens +
    kv_block_size x max_num_seqs) / kv_block_size), i.e. one spare block per sequence."""
    return _cdiv(tokens + rt.kv_block_size * rt.max_num_seqs, rt.kv_block_size)


def pool_tokens(rt, blocks: int, max_num_seqs: int | None = None) -> int:
    """The pool (``max_tokens_all_users``) that :func:`pool_blocks` turns into ``blocks`` (at
    ``max_num_seqs`` sequences; default the spec's)."""
    return blocks * rt.kv_block_size - rt.kv_block_size * (max_num_seqs or rt.max_num_seqs)


@dataclass
class _Pool:
    tokens: int  # max_tokens_all_users
    blocks: int
    chosen: str  # "spec" | "auto"
    why: str


def choose_pool(rt, kv_bytes, free: int, one_prefill: bool = False) -> _Pool:
    """The KV pool: the spec's ``max_tokens_all_users``, or (``auto`` / absent) the largest whole
    number of blocks whose KV bytes per chip (``kv_bytes(blocks)``, allocator-rounded, monotone)
    fit in ``free`` (DRAM left after weights, activations and trace region), between one
    ``max_model_len`` sequence and every sequence at full length. ``one_prefill`` (``task:
    embed``: nothing is decoded, a request leaves after its prefill): one ``max_model_len``
    sequence unless the spec says otherwise."""
    want = rt.max_tokens_all_users
    full = rt.max_num_seqs * rt.max_model_len
    if isinstance(want, int):
        return _Pool(want, pool_blocks(rt, want), "spec", "runtime.max_tokens_all_users")
    if one_prefill:
        return _Pool(rt.max_model_len, pool_blocks(rt, rt.max_model_len), "embed",
                     f"task: embed: prefill only, one max_model_len={rt.max_model_len} sequence")
    lo, hi = pool_blocks(rt, rt.max_model_len), pool_blocks(rt, full)
    if kv_bytes(hi) <= free:
        return _Pool(full, hi, "auto", f"auto: every sequence at full length fits (max_num_seqs="
                     f"{rt.max_num_seqs} x max_model_len={rt.max_model_len})")
    if kv_bytes(lo) > free:
        return _Pool(rt.max_model_len, lo, "auto", f"auto: not even one max_model_len="
                     f"{rt.max_model_len} sequence fits in the {_gib(max(free, 0))} left")
    a, b = lo, hi - 1  # kv_bytes(lo) fits, kv_bytes(hi) does not
    while a < b:
        mid = (a + b + 1) // 2
        if kv_bytes(mid) <= free:
            a = mid
        else:
            b = mid - 1
    return _Pool(pool_tokens(rt, a), a, "auto", f"auto: the largest pool that fits the "
                 f"{_gib(free)} left after weights, activations and trace region")
