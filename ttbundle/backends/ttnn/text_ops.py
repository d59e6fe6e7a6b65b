"""The text decoder's ops as ttnn calls: embedding, norms, matmuls, rope, attention (fused paged
SDPA, or explicit), the MLP activations, the residual add and the head's sampling.

Gemma 2's attention logit soft-capping (ttnn 0.81.1's SDPA kernels have no soft-cap): those
layers gather the sequence's K/V blocks from the paged cache (``gather`` by the page table) and
attend explicitly, ``softcap(q k^T * scale)`` plus a host-made mask input, then softmax and
``@ v`` (:func:`softcap_attention`) — correct, but O(max_model_len) per step, like the emulated
backend's attention. An image prefill whose soft tokens see their whole image takes the same
path without the soft-cap (the causal fused SDPA cannot say it).
"""

from __future__ import annotations

import hashlib

from ...program import Step
from . import configs
from .calls import KV, Attr, Const, New, T, W
from .layout import TILE, device_shape
from .emitter import BF16, DRAM, F32, RM, TILE_L, TOPK, U32, Lowerer, add_bias, filled, vector_view, f32, tt_shape
from .inputs import VERIFY_PAGES, image_mask, mask_input, mrope_position_input, verify_pos_input


def _embedding(lw: Lowerer, st: Step) -> None:
    rows, hid = st.out.shape
    e = lw.call("embedding", T("tokens"), W("embed", per_layer=False), out=f"{st.out.name}.e",
                shape=(1, rows, hid), layout=TILE_L, dtype=BF16, memory_config=DRAM)
    out = lw.call("reshape", T(e), [1, 1, rows, hid], out=st.out.name, shape=(1, 1, rows, hid))
    scale = lw.traits.get("embed_scale")
    if scale:
        lw.call("multiply", T(out), float(scale), out=out, shape=lw.shapes[out], memory_config=DRAM)


def _rms_norm(lw: Lowerer, st: Step) -> None:
    x, out = st.ins[0].name, st.out.name
    shp = tt_shape(st.ins[0].shape)
    lw.shapes.setdefault(x, shp)
    norm = lw.traits.get("norms", {}).get(st.w, {})
    eps = f32(norm.get("eps", lw.dims.rms_norm_eps))
    w = W(st.w, per_layer=lw.layer is not None)
    if norm.get("layer_norm"):  # LayerNorm with a bias (vision towers)
        lw.call("layer_norm", T(x), out=out, shape=shp, epsilon=eps, weight=w,
                bias=W(norm["bias"], per_layer=lw.layer is not None),
                compute_kernel_config=configs.compute_config(), memory_config=DRAM)
        return
    if lw.traits.get("norm_offset"):  # Gemma: x * (1 + w); the 1 is added once at setup
        w = W(st.w, per_layer=lw.layer is not None, variant="plus1")
        for layer in ([None] if lw.layer is None else [lw.layer]):
            t = lw.tensors[st.w]
            lw.setup_call(w.key(layer), "add", W(st.w, per_layer=lw.layer is not None), float(lw.traits["norm_offset"]),
                          memory_config=DRAM, shape=device_shape(t.device_shape, t.layout))
    features = norm.get("features")
    if features and features < shp[-1]:  # normalize the leading features, pass the rest through
        head = lw.call("slice", T(x), [0, 0, 0, 0], [*shp[:3], features], [1, 1, 1, 1], out=f"{out}.n",
                       shape=(*shp[:3], features))
        tail = lw.call("slice", T(x), [0, 0, 0, features], list(shp), [1, 1, 1, 1], out=f"{out}.r",
                       shape=(*shp[:3], shp[-1] - features))
        normed = lw.call("rms_norm", T(head), out=f"{out}.nn", shape=lw.shapes[head], epsilon=eps, weight=w,
                         compute_kernel_config=configs.compute_config(), memory_config=DRAM)
        lw.call("concat", [T(normed), T(tail)], 3, out=out, shape=shp, memory_config=DRAM)
        return
    lw.call("rms_norm", T(x), out=out, shape=shp, epsilon=eps, weight=w,
            compute_kernel_config=configs.compute_config(), memory_config=DRAM)


def _matmul(lw: Lowerer, st: Step) -> None:
    x, w, out = st.ins[0].name, st.w, st.out.name
    spec = lw.tensors[w].spec
    held = lw.shapes[x]
    inp = st.ins[0].shape
    k = lw.tensors[st.w].device_shape[-2]
    src = x
    if held[-1] != k:  # a replicated input meeting a split contraction: each device takes its part
        src = lw.partition(x, 3, spec[-2], f"{out}.in")
        if lw.shapes[src][-1] != k:
            raise ValueError(f"{w}: input {x} {held} partitioned to {lw.shapes[src]}, weight contracts {k}")
    fp32 = w in lw.traits.get("linear_fp32", ())
    dtype = F32 if fp32 else BF16
    if fp32:
        src = lw.call("typecast", T(src), F32, out=f"{out}.f32", shape=lw.shapes[src])
    if len(lw.tensors[st.w].device_shape) == 3:  # experts: every local expert on every token, one batched matmul
        E = lw.tensors[st.w].device_shape[0]
        if len(inp) == 2 or lw.shapes[src][1] != E:
            rep = lw.call("repeat", T(src), [1, E, 1, 1], out=f"{out}.rep",
                          shape=(1, E, lw.shapes[src][2], lw.shapes[src][3]), memory_config=DRAM)
        else:
            rep = src
        wb = W(w, variant="batched")
        lw.setup_call(wb.key(lw.layer), "reshape", W(w), [1, *lw.tensors[st.w].device_shape], shape=(1, *lw.tensors[st.w].device_shape))
        lw.call("matmul", T(rep), wb, out=out, shape=tt_shape(st.out.shape), dtype=dtype,
                memory_config=DRAM, compute_kernel_config=configs.compute_config(lw.tensors[st.w].dtype))
        return
    rows = lw.shapes[src][2]
    pc = configs.matmul_config(rows, k, lw.tensors[st.w].device_shape[-1], lw.grid)
    lw.call("linear", T(src), W(w, per_layer=lw.layer is not None), out=out, shape=tt_shape(st.out.shape),
            dtype=dtype, memory_config=DRAM, program_config=pc,
            compute_kernel_config=configs.compute_config(lw.tensors[st.w].dtype))


def rope_tables(lw: Lowerer, head_dim: int, lt: dict, interleaved: bool = False) -> tuple[T, T]:
    """cos / sin of every position up to max_model_len for one rope variant (host-made), and in
    decode each row's own position's row of them (an embedding lookup inside the trace)."""
    theta = lt["rope_theta"]
    # the layer's own scaling (Gemma 3's local layers have none where the arch scales), as JSON:
    # the constant's maker reads it back (``device.make_const``); the tag is stable across processes
    scaling = "" if lt.get("rope_scaling") is None else lt["rope_scaling"].model_dump_json(exclude_none=True)
    tag = f"rope.{head_dim}.{theta:g}.{hashlib.sha256(scaling.encode()).hexdigest()[:8]}" + (".il" if interleaved else "")
    L = lw.dims.max_model_len
    section = lw.traits.get("mrope_section")
    if section:
        return mrope_tables(lw, tag, head_dim, theta, scaling, section)
    for part in ("cos", "sin"):  # ROW_MAJOR [positions, head_dim]: what ttnn.embedding reads
        lw.consts[f"{tag}.{part}"] = Const(f"{tag}.{part}", (L, head_dim), "bf16", "ROW_MAJOR", "rope_" + part,
                                           (("head_dim", head_dim), ("theta", theta), ("scaling", scaling),
                                            ("interleaved", interleaved)))
    rows = lw.rows
    out = []
    for part in ("cos", "sin"):  # each row's position's row of the table, inside the trace
        name = f"{tag}.{part}.at"
        if name not in lw.shapes:
            lw.call("embedding", T("positions"), T(f"{tag}.{part}"), out=f"{name}.e", shape=(1, rows, head_dim),
                    layout=TILE_L, dtype=BF16, memory_config=DRAM)
            lw.call("reshape", T(f"{name}.e"), [1, 1, rows, head_dim], out=name, shape=(1, 1, rows, head_dim))
        out.append(T(name))
    return out[0], out[1]


def mrope_tables(lw: Lowerer, tag: str, head_dim: int, theta: float, scaling, section) -> tuple[T, T]:
    """M-RoPE (Qwen2.5-VL; Qwen3-VL interleaved, ``traits["mrope_interleaved"]``): cos / sin of
    each token from three position inputs (temporal, height, width). Each has its own table,
    zero outside the frequencies its ``mrope_section`` rotates (``tables.mrope_rows``); every
    frequency belongs to one section, so the sum of the three lookups is the token's cos / sin
    (text tokens: the same position in all three)."""
    L = lw.dims.max_model_len
    rows = lw.rows
    out = []
    for part in ("cos", "sin"):
        name = f"{tag}.{part}.at"
        if name not in lw.shapes:
            looked = []
            for r in range(3):
                lw.inputs[mrope_position_input(r)] = ((1, rows), "uint32", "ROW_MAJOR")
                tab = f"{tag}.{part}.m{r}"
                # M-RoPE positions exceed the cache positions by at most the prompt's rope delta
                # (negative for images), so the table of max_model_len rows covers them
                lw.consts[tab] = Const(tab, (L, head_dim), "bf16", "ROW_MAJOR", "rope_" + part,
                                       (("head_dim", head_dim), ("theta", theta), ("scaling", scaling),
                                        ("interleaved", False), ("mrope_section", tuple(section)), ("mrope_row", r),
                                        ("mrope_interleaved", bool(lw.traits.get("mrope_interleaved")))))
                e = lw.call("embedding", T(mrope_position_input(r)), T(tab), out=f"{name}.e{r}", shape=(1, rows, head_dim),
                            layout=TILE_L, dtype=BF16, memory_config=DRAM)
                looked.append(lw.call("reshape", T(e), [1, 1, rows, head_dim], out=f"{name}.{r}",
                                      shape=(1, 1, rows, head_dim)))
            s01 = lw.call("add", T(looked[0]), T(looked[1]), out=f"{name}.01", shape=(1, 1, rows, head_dim),
                          memory_config=DRAM)
            lw.call("add", T(s01), T(looked[2]), out=name, shape=(1, 1, rows, head_dim), memory_config=DRAM)
        out.append(T(name))
    return out[0], out[1]


def apply_rope(lw: Lowerer, x: str, cos: T, sin: T, out: str, interleaved: bool = False) -> str:
    """Rotate ``x`` ``[1, H, rows, d]`` by each row's position (cos / sin ``[1, 1, rows, d]``).
    Decode heads ``[1, B, H, d]`` are turned to ``[1, H, B, d]`` and back: the kernels' decode
    mode wants height-sharded L1 inputs, while one token per row is just a short sequence."""
    src = x
    if lw.decode:
        b, h, d = lw.shapes[x][1:]
        src = lw.call("transpose", T(x), 1, 2, out=f"{x}.t", shape=(1, h, b, d), memory_config=DRAM)
    dst = f"{out}.t" if lw.decode else out
    if interleaved:  # pairs (x0, x1), (x2, x3)...: Meta's layout, ttnn's rotary_embedding_llama
        lw.consts["rope.trans_mat"] = Const("rope.trans_mat", (1, 1, TILE, TILE), "bf16", "TILE", "trans_mat")
        lw.call("experimental.rotary_embedding_llama", T(src), cos, sin, T("rope.trans_mat"), out=dst,
                shape=lw.shapes[src], is_decode_mode=False)
    else:
        lw.call("experimental.rotary_embedding_hf", T(src), cos, sin, out=dst, shape=lw.shapes[src],
                is_decode_mode=False)
    if lw.decode:
        lw.call("transpose", T(dst), 1, 2, out=out, shape=lw.shapes[x], memory_config=DRAM)
    return out


def split_heads(lw: Lowerer, x: str, n: int, d: int, out: str) -> str:
    """``[1, 1, rows, n*d]`` -> ``[1, n, S, d]`` (prefill) or ``[1, B, n, d]`` (decode)."""
    rows = lw.shapes[x][2]
    if lw.decode:
        return lw.call("reshape", T(x), [1, rows, n, d], out=out, shape=(1, rows, n, d))
    r = lw.call("reshape", T(x), [1, rows, n, d], out=f"{out}.r", shape=(1, rows, n, d))
    return lw.call("transpose", T(r), 1, 2, out=out, shape=(1, n, rows, d), memory_config=DRAM)


def merge_heads(lw: Lowerer, x: str, out: str) -> str:
    s = lw.shapes[x]
    if lw.decode:  # [1, B, H, d]
        return lw.call("reshape", T(x), [1, 1, s[1], s[2] * s[3]], out=out, shape=(1, 1, s[1], s[2] * s[3]))
    return lw.call("experimental.nlp_concat_heads", T(x), out=out, shape=(1, 1, s[2], s[1] * s[3]),
                   memory_config=DRAM)


def row_groups(lw: Lowerer, x: str, out: str, fn) -> str | None:
    """``fn(x, out, cur_pos, page_table)`` on a decode forward's rows ``x`` ``[1, B, n, d]``; on a
    verify forward's, once per row group ``j`` (row ``j`` of every sequence: rows ``j * bucket``
    up to ``(j + 1) * bucket``, ``inputs.verify_pos_input``) with the group's positions and the
    sequences' pages, as a decode batch of ``bucket`` rows, the groups' outputs concatenated
    along the rows (and zeros for the padding rows past them). ``fn`` returns its output's name."""
    if lw.phase != "verify":
        return fn(x, out, T("cur_pos"), T("page_table"))
    s = lw.shapes[x]
    B, K1, R = lw.prog.bucket, lw.prog.rows_per_seq, lw.rows
    parts = []
    for j in range(K1):
        xj = lw.call("slice", T(x), [0, j * B, 0, 0], [1, (j + 1) * B, s[2], s[3]], [1, 1, 1, 1], out=f"{x}.g{j}",
                     shape=(1, B, s[2], s[3]))
        parts.append(fn(xj, f"{out}.g{j}", T(verify_pos_input(j)), T(VERIFY_PAGES)))
    if parts[0] is None:  # nothing returned (the cache writes)
        return None
    o = lw.shapes[parts[0]]
    ts = [T(p) for p in parts]
    if R > K1 * B:
        ts.append(T(filled(lw, "zeros", (1, R - K1 * B, o[2], o[3]))))
    return lw.call("concat", ts, 1, out=out, shape=(1, R, o[2], o[3]), memory_config=DRAM)


def cache_write(lw: Lowerer, kv: str, x: str) -> None:
    src = x
    if lw.kv_dtype == "bfp8":
        src = lw.call("typecast", T(x), Attr("bfloat8_b"), out=f"{x}.c", shape=lw.shapes[x])
    if lw.decode:
        def write(rows: str, _out: str, cur_pos: T, pages: T) -> None:
            # paged_update_cache reads each row's heads from its own core: [1, B, n, d]
            _, b, _, d = lw.shapes[rows]  # height-sharded, one (32 x d) shard per row
            cores = New.factory("num_cores_to_corerangeset", "CoreRangeSet", b, configs.coord(*lw.grid), row_wise=True)
            mem = New.factory("create_sharded_memory_config", "MemoryConfig", shape=(TILE, d), core_grid=cores,
                              strategy=Attr("ShardStrategy.HEIGHT"), orientation=Attr("ShardOrientation.ROW_MAJOR"),
                              use_height_and_width_as_shard_shape=True)
            sh = lw.call("to_memory_config", T(rows), mem, out=f"{rows}.sh", shape=lw.shapes[rows])
            lw.call("experimental.paged_update_cache", KV(kv), T(sh), update_idxs_tensor=cur_pos, page_table=pages)
        row_groups(lw, src, f"{src}.w", write)  # verify: one call per row group (``inputs.verify_pos_input``)
    else:
        # the chunk's own blocks (the full page table would write it from position 0)
        lw.call("experimental.paged_fill_cache", KV(kv), T(src), T("fill_page_table"), batch_idx_tensor=T("seq_slot"))


def _attention(lw: Lowerer, st: Step) -> None:
    q, k, v = (a.name for a in st.ins)
    for name, shp in ((a.name, a.shape) for a in st.ins):
        lw.shapes.setdefault(name, tt_shape(shp))
    lt = lw.lt()
    hd = lt.get("head_dim", lw.dims.head_dim)
    nq, nkv = lw.shapes[q][3] // hd, lw.shapes[k][3] // hd
    for b, x in (("bq", q), ("bk", k), ("bv", v)):
        if lw.has(b):
            add_bias(lw, x, b, f"{x}.b")
    q0, k0, v0 = (f"{x}.b" if lw.has(b) else x for b, x in (("bq", q), ("bk", k), ("bv", v)))
    qh, kh, vh = split_heads(lw, q0, nq, hd, "qh"), split_heads(lw, k0, nkv, hd, "kh"), split_heads(lw, v0, nkv, hd, "vh")
    eps = f32(lw.dims.rms_norm_eps)
    if lw.has("q_norm"):
        for x, w in ((qh, "q_norm"), (kh, "k_norm")):
            wv = W(w)
            if lw.traits.get("norm_offset"):
                wv = W(w, variant="plus1")
                lw.setup_call(wv.key(lw.layer), "add", W(w), float(lw.traits["norm_offset"]), memory_config=DRAM,
                              shape=device_shape([hd], "ROW_MAJOR"))
            lw.call("rms_norm", T(x), out=x, shape=lw.shapes[x], epsilon=eps, weight=wv,
                    compute_kernel_config=configs.compute_config(), memory_config=DRAM)
    cos, sin = rope_tables(lw, hd, lt)
    apply_rope(lw, qh, cos, sin, "qr")
    apply_rope(lw, kh, cos, sin, "kr")
    cache_write(lw, "k", "kr")
    cache_write(lw, "v", vh)
    scale = f32(lt.get("attn_scale", hd ** -0.5))
    if lt.get("attn_softcap") or (not lw.decode and image_mask(lw.bundle, lw.prog)):
        # an image prefill's soft tokens attend to their whole image (a host-made mask input):
        # the fused SDPA kernels are causal only
        cap = float(lt["attn_softcap"]) if lt.get("attn_softcap") else None
        o = softcap_attention(lw, nq, nkv, hd, scale, cap, lt.get("window"))
        merge_heads(lw, o, st.out.name)
        return
    extra = {}
    if lt.get("window"):
        extra["sliding_window_size"] = int(lt["window"])
    if lw.has("sinks"):  # one logit per query head: prefill SDPA wants [1, H, 1, 1], decode [H, 1]
        extra["attention_sink"] = vector_view(lw, "sinks", (nq, 1) if lw.decode else (1, nq, 1, 1),
                                               "sink2" if lw.decode else "sink4")
    kernel = configs.compute_config()
    if lw.decode:  # verify: per row group, each a decode batch (``row_groups``)
        o = row_groups(lw, "qr", "oh", lambda q, out, cur_pos, pages: lw.call(
            "transformer.paged_scaled_dot_product_attention_decode", T(q), KV("k"), KV("v"), pages, out=out,
            shape=lw.shapes[q], cur_pos_tensor=cur_pos, scale=scale, program_config=configs.sdpa_config(lw.grid, None),
            compute_kernel_config=kernel, memory_config=DRAM, **extra))
    else:  # over the paged cache from the chunk's first position: prefix chunks included
        o = lw.call("transformer.chunked_scaled_dot_product_attention", T("qr"), KV("k"), KV("v"),
                    T("page_table"), out="oh", shape=lw.shapes["qr"], chunk_start_idx_tensor=T("chunk_start"),
                    scale=scale, program_config=configs.sdpa_config(lw.grid, lw.rows),
                    compute_kernel_config=kernel, memory_config=DRAM, **extra)
    merge_heads(lw, o, st.out.name)


def softcap_attention(lw: Lowerer, nq: int, nkv: int, hd: int, scale: float, cap: float | None,
                       window) -> str:
    """Attention with logit soft-capping (``cap``; None: none, an image prefill's explicit mask
    alone), as the emulated backend computes it: the rows' K/V
    blocks gathered from the paged cache by the page table into ``[R, nkv, L, hd]`` (L = the page
    table's tokens), heads repeated for GQA, ``scores = softcap(q k^T * scale, cap) + mask``
    (the mask input: causal, window, validity; made on the host per step), softmax, ``@ v``.
    Writes ``oh`` shaped like ``qr``."""
    blocks = lw.inputs["page_table"][0][1]
    bs = lw.block_size
    L = blocks * bs
    R = lw.rows if lw.decode else 1  # sequences (page-table rows)
    Sq = 1 if lw.decode else lw.rows  # queries per sequence
    mname = mask_input(window)
    lw.inputs[mname] = ((R, 1, Sq, L), "bf16", "TILE")
    if "sc.idx" not in lw.shapes:  # the gather index: each block's page id over its whole block
        lw.call("reshape", T("page_table"), [R * blocks, 1, 1, 1], out="sc.pt", shape=(R * blocks, 1, 1, 1))
        lw.call("typecast", T("sc.pt"), U32, out="sc.pt32", shape=(R * blocks, 1, 1, 1))
        lw.call("repeat", T("sc.pt32"), [1, nkv, bs, hd], out="sc.idx", shape=(R * blocks, nkv, bs, hd),
                memory_config=DRAM)
    seq = {}
    for name in ("k", "v"):
        g = lw.call("gather", KV(name), 0, T("sc.idx"), out=f"sc.{name}g", shape=(R * blocks, nkv, bs, hd),
                    memory_config=DRAM)
        if lw.kv_dtype != "bf16":
            g = lw.call("typecast", T(g), BF16, out=f"sc.{name}b", shape=(R * blocks, nkv, bs, hd))
        g = lw.call("reshape", T(g), [R, blocks, nkv, bs * hd], out=f"sc.{name}r", shape=(R, blocks, nkv, bs * hd))
        g = lw.call("permute", T(g), [0, 2, 1, 3], out=f"sc.{name}p", shape=(R, nkv, blocks, bs * hd))
        g = lw.call("reshape", T(g), [R, nkv, L, hd], out=f"sc.{name}s", shape=(R, nkv, L, hd))
        if nq != nkv:
            g = lw.call("repeat_interleave", T(g), nq // nkv, 1, out=f"sc.{name}h", shape=(R, nq, L, hd),
                        memory_config=DRAM)
        seq[name] = g
    q = "qr"
    if lw.decode:  # [1, B, nq, hd] -> [B, nq, 1, hd]
        q = lw.call("reshape", T("qr"), [R, nq, 1, hd], out="sc.q", shape=(R, nq, 1, hd))
    kernel = configs.compute_config()
    s = lw.call("matmul", T(q), T(seq["k"]), out="sc.s", shape=(R, nq, Sq, L), transpose_b=True,
                memory_config=DRAM, compute_kernel_config=kernel)
    s = lw.call("multiply", T(s), scale, out="sc.ss", shape=(R, nq, Sq, L), memory_config=DRAM)
    if cap is not None:
        s = lw.call("softcap", T(s), cap, out="sc.cap", shape=(R, nq, Sq, L), memory_config=DRAM)
    s = lw.call("add", T(s), T(mname), out="sc.m", shape=(R, nq, Sq, L), memory_config=DRAM)
    p = lw.call("softmax", T(s), -1, out="sc.p", shape=(R, nq, Sq, L), memory_config=DRAM)
    o = lw.call("matmul", T(p), T(seq["v"]), out="sc.o", shape=(R, nq, Sq, hd), memory_config=DRAM,
                compute_kernel_config=kernel)
    if lw.decode:
        return lw.call("reshape", T(o), [1, R, nq, hd], out="oh", shape=lw.shapes["qr"])
    return lw.call("reshape", T(o), list(lw.shapes["qr"]), out="oh", shape=lw.shapes["qr"])


def activation(lw: Lowerer, x: str, out: str) -> str:
    act = lw.traits["act"]
    if act in ("silu", "swish"):
        return lw.call("silu", T(x), out=out, shape=lw.shapes[x], memory_config=DRAM)
    approx = act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")
    return lw.call("gelu", T(x), out=out, shape=lw.shapes[x], fast_and_approximate_mode=approx, memory_config=DRAM)


def _swiglu(lw: Lowerer, st: Step) -> None:
    g, u = (a.name for a in st.ins)
    for name, shp in ((a.name, a.shape) for a in st.ins):
        lw.shapes.setdefault(name, tt_shape(shp))
    ga = activation(lw, g, f"{g}.act")
    lw.call("multiply", T(ga), T(u), out=st.out.name, shape=lw.shapes[u], memory_config=DRAM)


def _out_bias(lw: Lowerer, st: Step) -> None:
    (x,) = (a.name for a in st.ins)
    lw.shapes.setdefault(x, tt_shape(st.ins[0].shape))
    add_bias(lw, x, "bo", st.out.name)


def _residual_add(lw: Lowerer, st: Step) -> None:
    x = st.ins[0].name
    lw.call("add", T("h"), T(x), out="h", shape=lw.shapes["h"], memory_config=DRAM)


def _logits(lw: Lowerer, st: Step) -> None:
    """Sampling on device over the gathered logits (top-k candidates drawn by ``ttnn.sampling``
    with per-row k / p / temperature inputs), or the logits themselves for host sampling; padded
    vocabulary columns are sliced off first."""
    x = st.ins[0].name
    s = lw.shapes[x]
    V = lw.dims.vocab_size
    if s[3] != V:
        x = lw.call("slice", T(x), [0, 0, 0, 0], [*s[:3], V], [1, 1, 1, 1], out="logits.v", shape=(*s[:3], V))
        s = lw.shapes[x]
    cap = lw.traits.get("final_softcap")
    if cap:
        lw.call("multiply", T(x), 1.0 / float(cap), out="logits.c", shape=s, memory_config=DRAM)
        lw.call("tanh", T("logits.c"), out="logits.t", shape=s, memory_config=DRAM)
        x = lw.call("multiply", T("logits.t"), float(cap), out="logits.s", shape=s, memory_config=DRAM)
    if lw.sampling == "host":
        lw.call("typecast", T(x), F32, out="logits.out", shape=s)
        return
    lw.call("topk", T(x), TOPK, 3, True, True, out=("cand.v", "cand.i"), shape=(*s[:3], TOPK))
    lw.shapes["cand.v"] = lw.shapes["cand.i"] = (*s[:3], TOPK)
    # ttnn.sampling reads the candidates' ids as uint32 rows (ROW_MAJOR)
    lw.call("typecast", T("cand.i"), U32, out="cand.i32", shape=(*s[:3], TOPK))
    lw.call("to_layout", T("cand.i32"), RM, out="cand.ids", shape=(*s[:3], TOPK))
    lw.call("sampling", T("cand.v"), T("cand.ids"), T("top_k"), T("top_p"), T("temperature"), out="next_tokens",
            shape=(1, 1, 1, s[2]), seed=0)


OPS = {"embedding": _embedding, "rms_norm": _rms_norm, "matmul": _matmul, "attention": _attention,
       "swiglu": _swiglu, "out_bias": _out_bias, "residual_add": _residual_add, "logits": _logits}
