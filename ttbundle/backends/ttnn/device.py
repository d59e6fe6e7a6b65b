"""Running lowered calls on a ttnn mesh: the executor, buffer lifetimes, and model setup.

:class:`Executor` turns :class:`~.calls.Call` records into ttnn calls (``getattr`` on the ttnn
module it is given, so the recording double in the tests can stand in for the wheel), binds
their results by name, and frees each intermediate after its last reader (:func:`liveness`, per
binding: a name rebound by a later call is a new tensor). Inputs, constants, weights, KV caches
and outputs are never dropped by a forward.

:func:`.model.open_model` puts these together for a package (it imports this module and
:mod:`.trace`, which imports this one too: so neither of them imports it).
"""

from __future__ import annotations

import numpy as np

from ...families.base import RopeScaling
from .calls import Call, Forward, resolve, resolve_attr
from .feed import FEED_INPUT, feed_index
from .inputs import (VERIFY_PAGES, VISION_POS_INTERP, VISION_ROPE, deepstack_input, verify_pos_input,
                     vision_mask_input)
from .layout import ttnn_dtype, ttnn_layout
from .lowering import mrope_position_input


def liveness(calls: list[tuple[int | None, Call]], keep: set[str]) -> list[list[str]]:
    """For each call, the names whose tensor nobody reads afterwards (backward liveness: a name
    rebound later is a new tensor), except ``keep`` (inputs, constants, outputs)."""
    live = set(keep)
    drops: list[list[str]] = [[] for _ in calls]
    for i in range(len(calls) - 1, -1, -1):
        c = calls[i][1]
        touched = list(dict.fromkeys(c.reads() + c.writes()))
        drops[i] = [n for n in touched if n not in live and n not in keep]
        live -= set(c.writes())
        live |= set(c.reads())
    return drops


class Executor:
    """Runs calls on ``ttnn`` against ``device``; ``env`` holds named tensors, ``env["weights"]``
    the weights (and their setup views), ``env["kv"][layer][entry]`` the KV cache."""

    def __init__(self, ttnn, device):
        self.ttnn, self.device = ttnn, device
        self.env: dict = {"weights": {}, "kv": {}}
        self.on_call = None  # hook(call, layer) for tracing what runs (tests, progress)

    def call(self, c: Call, layer: int | None):
        if self.on_call is not None:
            self.on_call(c, layer)
        fn = resolve_attr(self.ttnn, c.fn)
        args = [resolve(self.ttnn, a, self.env, layer) for a in c.args]
        kwargs = {k: resolve(self.ttnn, v, self.env, layer) for k, v in c.kwargs}
        return fn(*args, **kwargs)

    def run_setup(self, setup: list) -> None:
        """Setup calls: each derives a weight view, stored under its key (both as a weight and by
        name, so constants derived at setup are found either way)."""
        for layer, c in setup:
            if c.out in self.env["weights"]:
                continue
            out = self.call(c, layer)
            self.env["weights"][c.out] = out
            self.env[c.out] = out

    def run(self, fw: Forward, drops: list[list[str]] | None = None) -> dict:
        """Every call of ``fw`` in order; returns its outputs by name. Each intermediate is
        dropped after its last reader (its device buffer goes with its last Python reference:
        views such as reshapes share buffers, so nothing is deallocated explicitly)."""
        calls = list(fw.calls())
        drops = drops if drops is not None else liveness(calls, keep_names(fw))
        for i, (layer, c) in enumerate(calls):
            out = self.call(c, layer)
            if isinstance(c.out, str):
                self.env[c.out] = out
            elif isinstance(c.out, tuple):
                for name, t in zip(c.out, out):
                    if name:
                        self.env[name] = t
            for n in drops[i]:
                self.env.pop(n, None)
        return {n: self.env[n] for n in fw.outputs}


def keep_names(fw: Forward) -> set[str]:
    return set(fw.inputs) | {c.name for c in fw.consts} | set(fw.outputs) | set(fw.state)


# ---- model setup (hardware path) ------------------------------------------------------------------
def allocate(ttnn, device, shape, dtype: str, layout: str):
    return ttnn.allocate_tensor_on_device(ttnn.Shape(list(shape)), ttnn_dtype(ttnn, dtype),
                                          ttnn_layout(ttnn, layout), device, ttnn.DRAM_MEMORY_CONFIG)


def allocate_kv(ttnn, device, kv: dict) -> dict:
    """``{layer: {entry: tensor}}``: the paged KV cache ``kv`` describes (a program's
    ``kv_cache`` record, ``LoadedPackage.kv_cache``: dtype, entries with per-device shapes and
    layer counts, sized by the plan's pool), on every device, filled
    with zeros. Attention that gathers whole blocks of the page table (Gemma 2's softcapped
    attention) reads slots no request wrote; the additive mask cannot cancel whatever DRAM held
    there (``-1e30 + NaN`` is NaN, and ``0 * NaN`` in ``p @ v``), so the cache starts defined, as
    the emulated backend's does."""
    dtype, layout = ttnn_dtype(ttnn, kv["dtype"]), ttnn_layout(ttnn, "TILE")
    out: dict = {}
    for e in kv["entries"]:
        for layer in range(e["layers"]):
            out.setdefault(layer, {})[e["name"]] = ttnn.full(list(e["device_shape"]), 0.0, dtype=dtype, layout=layout,
                                                             device=device, memory_config=ttnn.DRAM_MEMORY_CONFIG)
    return out


def make_const(ttnn, device, c):
    """A host-made constant, replicated on every device of the mesh."""
    if c.kind in ("zeros", "ones"):
        fill = 0.0 if c.kind == "zeros" else 1.0
        return ttnn.full(list(c.shape), fill, dtype=ttnn_dtype(ttnn, c.dtype), layout=ttnn_layout(ttnn, c.layout),
                         device=device, memory_config=ttnn.DRAM_MEMORY_CONFIG)
    if c.kind == "trans_mat":  # rotary_embedding_llama's pair-swap matrix
        m = np.zeros((32, 32), dtype=np.float32)
        m[np.arange(0, 32, 2), np.arange(1, 32, 2)] = 1
        m[np.arange(1, 32, 2), np.arange(0, 32, 2)] = -1
        host = m.reshape(c.shape)
    elif c.kind == "rotate_half":  # x @ m = rotate_half(x) = [-x2, x1] (HF's rope layout)
        from ...tables import rotate_half_matrix  # torch: only where a constant is made
        host = rotate_half_matrix(dict(c.params)["dim"]).numpy().reshape(c.shape)
    elif c.kind in ("rope_cos", "rope_sin"):
        host = _rope_table(c)
    elif c.kind == "avg_pool":  # [soft tokens, patches]: each soft token the mean of its window
        from ...tables import pool_matrix  # torch: only where a constant is made
        p = dict(c.params)
        host = pool_matrix(p["images"], p["side"], p["window"]).numpy().reshape(c.shape)
    else:  # pragma: no cover - a lowering bug
        raise ValueError(f"unknown constant kind {c.kind!r}")
    t = ttnn.Tensor(np.ascontiguousarray(host, dtype=np.float32), ttnn_dtype(ttnn, c.dtype), None,
                    ttnn_layout(ttnn, c.layout))
    t = ttnn.distribute_tensor(t, ttnn.replicate_tensor_to_mesh_mapper(device), None)
    return ttnn.to_device(t, device, memory_config=ttnn.DRAM_MEMORY_CONFIG)


def _rope_table(c):
    """cos or sin of every position (``[max_model_len, head_dim]``), computed by the rope rule
    both backends share (``ttbundle.tables``; torch, on the serving host)."""
    import torch  # the ttnn wheel brings torch; loaded only where a rope constant is made

    from ...tables import mrope_rows, rope_cos_sin
    p = dict(c.params)
    scaling = RopeScaling.model_validate_json(p["scaling"]) if p.get("scaling") else None  # the layer's
    cos, sin = rope_cos_sin(torch.arange(c.shape[0]), p["head_dim"], p["theta"], scaling, torch.float32)
    t = cos if c.kind == "rope_cos" else sin
    if p.get("mrope_section"):  # M-RoPE: this position row's frequencies only (the others zero)
        keep = mrope_rows(p["mrope_section"], p["head_dim"], bool(p.get("mrope_interleaved"))) == p["mrope_row"]
        t = t * keep[None, :].to(t.dtype)
    if p.get("interleaved"):  # rotary_embedding_llama rotates pairs (x0, x1), (x2, x3)...: f0 f0 f1 f1 ...
        t = t[:, : p["head_dim"] // 2].repeat_interleave(2, dim=-1)
    return t.reshape(c.shape).numpy()


# ---- host inputs of one run -------------------------------------------------------------------------
def mask_inputs(fw: Forward, qpos, blocks=None, rope_positions=None) -> dict:
    """The additive attention masks an explicit-mask attention forward reads
    (``inputs.mask_input``: softcapped attention, an image prefill): ``[R, 1, Sq, L]``, 0 where
    key position l may be attended by the query at ``qpos[r, q]`` (l <= it, or l in the query's
    own image, ``blocks[r, l]`` the image block of position l, -1 for text; then within the
    window, as the emulated backend's mask composes them), -1e30 elsewhere; a query at -1 (a
    padding row) sees l = 0 only. With them, the M-RoPE position inputs
    (:func:`rope_position_inputs` of ``qpos`` and ``rope_positions``)."""
    out = {}
    kb = None
    for name, (shape, _, _) in fw.inputs.items():
        if not name.startswith("attn_mask"):
            continue
        window = int(name.split(".w")[1]) if ".w" in name else 0
        R, _, Sq, L = shape
        q = np.asarray(qpos, dtype=np.int64).reshape(R, Sq)[:, None, :, None]
        k = np.arange(L)[None, None, None, :]
        ok = (k <= q) | ((q < 0) & (k == 0))
        if blocks is not None:
            if kb is None:
                kb = np.full((R, L), -1, np.int64)
                given = np.asarray(blocks, dtype=np.int64).reshape(R, -1)[:, :L]
                kb[:, :given.shape[1]] = given
            qb = np.take_along_axis(kb, np.clip(q.reshape(R, Sq), 0, L - 1), axis=1)[:, None, :, None]
            ok |= (qb == kb[:, None, None, :]) & (qb >= 0) & (q >= 0)
        if window:
            ok &= k > q - window
        out[name] = np.where(ok, 0.0, -1e30).astype(np.float32)
    out.update(rope_position_inputs(fw, qpos, rope_positions))
    return out


def rope_position_inputs(fw: Forward, qpos, rope_positions=None) -> dict:
    """The M-RoPE position inputs a forward reads (``inputs.mrope_position_input``; families
    with ``mrope_section``): ``rope_positions`` [3, rows] when given, else each row's position
    ``qpos`` in all three (a text token's M-RoPE positions); padding rows (-1, or rows past
    those ``rope_positions`` gives: a decode batch [3, B, 1] in a forward of more rows) take 0."""
    names = [mrope_position_input(r) for r in range(3)]
    if names[0] not in fw.inputs:
        return {}
    rows = fw.inputs[names[0]][0][1]
    pos = np.asarray(qpos, dtype=np.int64).reshape(-1)[:rows]
    given = np.repeat(pos[None], 3, 0) if rope_positions is None else np.asarray(rope_positions, np.int64).reshape(3, -1)
    rp = np.zeros((3, rows), np.int64)  # a decode batch's rows past the given ones: padding, at 0
    rp[:, :min(rows, given.shape[1])] = given[:, :rows]
    return {n: rp[r].clip(min=0).astype(np.uint32)[None] for r, n in enumerate(names)}


def vision_inputs(fw: Forward, patches, meta: dict | None) -> dict:
    """A vision forward's host inputs: ``patches`` [rows, patch_pixels] (the vision part's
    ``program_inputs``) and, where its attention reads them (Qwen2.5-VL), the per-row 2-D rope
    ``cos`` / ``sin`` [rows, head_dim] of ``meta`` (``inputs.VISION_ROPE``) and the additive masks
    of its window and full-attention layers (``inputs.vision_mask_input``): 0 where two rows share
    a segment of ``meta["window"]`` / ``meta["image"]`` (the host's per-row segments, padding rows
    one of their own), -1e30 elsewhere; Qwen3-VL's position interpolation
    (``inputs.VISION_POS_INTERP``): row r holds weight ``meta["pos_w"][r, j]`` at column
    ``meta["pos_idx"][r, j]`` of each tap j. An input the forward reads that ``meta`` does not give
    is a ValueError naming it."""
    shape = fw.inputs["patches"][0]
    out = {"patches": np.asarray(patches, dtype=np.float32).reshape(shape)}
    rows = shape[2]
    wanted = {n: m for n, m in zip(VISION_ROPE, ("cos", "sin"))}
    wanted.update({vision_mask_input(False): "window", vision_mask_input(True): "image", VISION_POS_INTERP: "pos_w"})
    for name, key in wanted.items():
        if name not in fw.inputs:
            continue
        if meta is None or key not in meta:
            raise ValueError(f"vision forward {fw.phase}-{fw.bucket} reads {name}, made from the vision part's "
                             f"{key!r}, which its program inputs do not give")
        a = np.asarray(meta[key])
        if name == VISION_POS_INTERP:
            m = np.zeros(fw.inputs[name][0][2:], np.float32)
            idx = np.asarray(meta["pos_idx"], dtype=np.int64).reshape(rows, -1)
            np.add.at(m, (np.arange(rows)[:, None].repeat(idx.shape[1], 1), idx), a.astype(np.float32).reshape(rows, -1))
            out[name] = m.reshape(fw.inputs[name][0])
        elif name in VISION_ROPE:
            out[name] = a.astype(np.float32).reshape(fw.inputs[name][0])
        else:
            seg = a.astype(np.int64).reshape(rows)
            out[name] = np.where(seg[:, None] == seg[None, :], 0.0, -1e30).astype(np.float32).reshape(1, 1, rows, rows)
    missing = sorted(set(fw.inputs) - set(out))
    if missing:
        raise ValueError(f"vision forward {fw.phase}-{fw.bucket} reads host inputs {missing} the device runner "
                         "does not make")
    return out


def image_inputs(fw: Forward, mm: dict | None) -> dict:
    """An image prefill's merge inputs (``inputs.merge_images``): ``mm_keep`` 0 at the rows of
    ``mm["mask"]`` (the chunk's image tokens, ``runtime.images.chunk_inputs``) and 1 elsewhere,
    ``mm_embeds`` the soft tokens ``mm["embeds"]`` at those rows, 0 elsewhere; no ``mm``: text.
    Qwen3-VL's ``mm["embeds"]`` carry the DeepStack feature sets beside the soft tokens (hidden
    features each): set k goes to ``inputs.deepstack_input(k)`` at the same rows."""
    shape = fw.inputs["mm_keep"][0]
    sets: list[str] = []
    while deepstack_input(len(sets)) in fw.inputs:
        sets.append(deepstack_input(len(sets)))
    keep = np.ones(shape, np.float32)
    out = {n: np.zeros(shape, np.float32) for n in ["mm_embeds", *sets]}
    if mm is not None:
        rows = np.flatnonzero(np.asarray(mm["mask"], dtype=bool)[:shape[2]])
        e = np.asarray(mm["embeds"], dtype=np.float32).reshape(len(rows), -1)
        if e.shape[1] != shape[3] * (1 + len(sets)):
            raise ValueError(f"image soft tokens of {e.shape[1]} features for a prefill of {shape[3]}"
                             + (f" x (1 + {len(sets)} DeepStack sets)" if sets else ""))
        keep[0, 0, rows] = 0.0
        for k, n in enumerate(["mm_embeds", *sets]):
            out[n][0, 0, rows] = e[:, k * shape[3]:(k + 1) * shape[3]]
    return {"mm_keep": keep, **out}


def prefill_host_inputs(fw: Forward, tokens, n: int, start: int, page_table, block_size: int,
                        max_model_len: int, mm: dict | None = None, rope_positions=None) -> dict:
    """Host inputs of a prefill forward: ``tokens`` (the bucket's row, the first ``n`` real) at
    positions ``start``...; ``page_table`` the sequence's blocks (the chunk's own ones are
    ``fill_page_table``); the head's one-hot picks the tile row holding token ``n - 1``. ``mm``:
    the chunk's images (``runtime.images.chunk_inputs``; an image prefill forward only): their
    soft tokens merged, the attention mask with their image blocks. ``rope_positions`` [3, 1,
    rows]: the chunk's M-RoPE positions (an M-RoPE model; None: the cache positions)."""
    rows = fw.rows
    if not 0 < n <= rows:
        raise ValueError(f"chunk of {n} tokens for a prefill bucket of {rows}")
    if start % block_size:
        raise ValueError(f"prefill chunk at position {start}: chunks must start on a KV block ({block_size})")
    blocks = fw.inputs["page_table"][0][1]
    pt = np.zeros((1, blocks), np.int32)
    given = np.asarray(page_table, dtype=np.int64).reshape(-1)[:blocks]
    pt[0, :given.size] = given
    fill_n = fw.inputs["fill_page_table"][0][1]
    first = start // block_size
    fill = np.zeros((1, fill_n), np.int32)
    part = pt[0, first:first + fill_n]
    fill[0, :part.size] = part
    ins = {"tokens": np.zeros((1, rows), np.uint32),
           "positions": np.minimum(np.arange(start, start + rows), max_model_len - 1).astype(np.uint32)[None],
           "page_table": pt, "fill_page_table": fill, "chunk_start": np.array([start], np.int32),
           "seq_slot": np.zeros((1,), np.int32)}
    ins["tokens"][0, :n] = np.asarray(tokens).reshape(-1)[:n]
    head = fw.inputs["last_rows"][0][2]
    sel = np.zeros((1, 1, head, rows), np.float32)  # row i picks token first + i of the last tile row
    first_row = (n - 1) // head * head
    for i in range(head):
        if first_row + i < rows:
            sel[0, 0, i, first_row + i] = 1.0
    ins["last_rows"] = sel
    if mm is not None and "mm_keep" not in fw.inputs:
        raise ValueError("images for a prefill forward that takes none (a text-only model)")
    if "mm_keep" in fw.inputs:
        ins.update(image_inputs(fw, mm))
    blocks = None if mm is None else np.asarray(mm["blocks"], dtype=np.int64).reshape(1, -1)
    ins.update(mask_inputs(fw, np.arange(start, start + rows)[None], blocks, rope_positions))
    return ins


# ---- one sequence end to end (hardware tests, smoke runs) ------------------------------------------
def prefill_inputs(fw: Forward, tokens: list[int], block_size: int) -> dict:
    """Host inputs of a prefill forward for one sequence of ``tokens`` (at most the bucket),
    from position 0, using KV blocks 0, 1, ...; greedy sampling (k = 1)."""
    blocks = fw.inputs["page_table"][0][1]
    ins = prefill_host_inputs(fw, tokens, len(tokens), 0, np.arange(blocks), block_size, blocks * block_size)
    ins.update(_greedy(fw, fw.inputs["last_rows"][0][2]))
    return ins


def decode_inputs(fw: Forward, token: int, position: int) -> dict:
    """Host inputs of a decode forward: row 0 is the sequence (blocks 0, 1, ...), the other rows
    idle (position -1: nothing written, nothing attended)."""
    B = fw.rows
    blocks = fw.inputs["page_table"][0][1]
    ins = {"tokens": np.zeros((1, B), np.uint32), "positions": np.zeros((1, B), np.uint32),
           "cur_pos": np.full((B,), -1, np.int32), "page_table": np.zeros((B, blocks), np.int32)}
    ins["tokens"][0, 0], ins["positions"][0, 0], ins["cur_pos"][0] = token, position, position
    ins["page_table"][0] = np.arange(blocks, dtype=np.int32)
    ins.update(mask_inputs(fw, ins["cur_pos"][:, None]))
    ins.update(_greedy(fw, B))
    if FEED_INPUT in fw.inputs:  # the token feed (device sampling): every row keeps its written token
        ins[FEED_INPUT] = feed_index(B)
    return ins


def verify_inputs(fw: Forward, tokens, positions, page_table) -> dict:
    """Host inputs of a verify forward (speculative decoding): ``tokens`` / ``positions``
    [B, k + 1] (each sequence's last token and its proposals; position -1: a row that idles,
    nothing written, nothing attended), ``page_table`` [B, blocks] the sequences' pages. Forward
    rows are grouped by row of a sequence (:func:`verify_rows`: row ``j * B + i`` is row ``j`` of
    sequence ``i``; rows past ``B (k + 1)``: padding, at -1), each with its sequence's page-table
    row (``page_table``, read by softcapped attention, which attends every row at once);
    ``verify_pos.<j>`` holds group ``j``'s positions and ``verify_pages`` the sequences' pages
    (``inputs.verify_pos_input``)."""
    tokens, positions = np.asarray(tokens), np.asarray(positions, np.int64)
    B, K1 = tokens.shape
    R, blocks = fw.rows, fw.inputs["page_table"][0][1]
    groups = [verify_pos_input(j) for j in range(K1)]
    if B != fw.bucket or any(g not in fw.inputs for g in groups) or verify_pos_input(K1) in fw.inputs:
        raise ValueError(f"verify forward {fw.phase}-{fw.bucket} ({R} rows) cannot run {B} sequences of {K1} rows")
    n = B * K1
    pos = np.full(R, -1, np.int64)
    pos[:n] = positions.T.reshape(-1)
    toks = np.zeros(R, np.uint32)
    toks[:n] = np.clip(tokens.T.reshape(-1), 0, None)
    pages = np.zeros((B, blocks), np.int32)
    given = np.asarray(page_table)[:B, :blocks]
    pages[:, :given.shape[1]] = given
    pt = np.zeros((R, blocks), np.int32)
    pt[:n] = np.tile(pages, (K1, 1))
    ins = {"tokens": toks[None], "positions": np.maximum(pos, 0).astype(np.uint32)[None], "page_table": pt,
           VERIFY_PAGES: pages}
    ins.update({g: positions[:, j].astype(np.int32) for j, g in enumerate(groups)})
    ins.update(mask_inputs(fw, pos[:, None]))  # softcapped attention: every row's mask
    return ins


def verify_rows(fw: Forward, out, k1: int):
    """A verify forward's per-row output ``[rows, ...]`` as ``[B, k + 1, ...]`` (sequence, row of
    the sequence), its padding rows dropped (:func:`verify_inputs`' order)."""
    B = fw.bucket
    return out[:B * k1].reshape(k1, B, *out.shape[1:]).swapaxes(0, 1)


def _greedy(fw: Forward, rows: int) -> dict:
    if "top_k" not in fw.inputs:
        return {}
    return {"top_k": np.ones((rows,), np.uint32), "top_p": np.ones((rows,), np.float32),
            "temperature": np.ones((rows,), np.float32)}


def generate(runner, prompt: list[int], max_new: int, block_size: int) -> list[int]:
    """Greedy tokens after ``prompt`` for one sequence: a prefill in the smallest bucket that holds
    it, then decodes in the smallest decode bucket (row 0), each as a replayed trace."""
    def device_sampled(k):  # keys (phase, bucket) or (phase, bucket, sampling, start): from 0, on device
        return len(k) == 2 or (k[2] == "device" and k[3] == 0)
    pre = min((k for k in runner.forwards if k[0] == "prefill" and k[1] >= len(prompt) and device_sampled(k)),
              key=lambda k: k[1])
    dec = min(k for k in runner.forwards if k[0] == "decode" and device_sampled(k))
    fw = runner.forwards[pre]
    out = runner.run(pre, prefill_inputs(fw, prompt, block_size))
    ids = np.asarray(runner.read(out["next_tokens"])).reshape(-1)
    head = fw.inputs["last_rows"][0][2]
    tokens = [int(ids[(len(prompt) - 1) % head]) if ids.size > 1 else int(ids[0])]
    pos = len(prompt)
    while len(tokens) < max_new:
        out = runner.run(dec, decode_inputs(runner.forwards[dec], tokens[-1], pos))
        ids = np.asarray(runner.read(out["next_tokens"])).reshape(-1)
        tokens.append(int(ids[0]))
        pos += 1
    return tokens
