"""DeepSeek's MLA attention and the mixture-of-experts ops (routing, GPT-OSS's clamped SwiGLU,
the weighted combine) as ttnn calls; the emulated backend's ``moe_kernels`` counterpart."""

from __future__ import annotations

from ...program import Step
from . import configs
from .calls import KV, T, W
from .emitter import BF16, DRAM, Lowerer, add_bias, filled, f32, tt_shape
from .text_ops import apply_rope, cache_write, merge_heads, rope_tables, row_groups, split_heads


def _mla_attention(lw: Lowerer, st: Step) -> None:
    """DeepSeek MLA with the absorbed projections (as the device does it): the cache holds
    ``latent | rope key`` per token; queries are moved into latent space with W_UK and the
    latent context out of it with W_UV (both cut from ``wkv_b`` once at setup)."""
    q, kvn = (a.name for a in st.ins)
    m = lw.traits["mla"]
    r, nope, rope, vd = m["kv_lora_rank"], m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
    for name, shp in ((a.name, a.shape) for a in st.ins):
        lw.shapes.setdefault(name, tt_shape(shp))
    H = lw.shapes[q][3] // (nope + rope)
    rows = lw.rows
    lt = lw.lt()
    # setup: wkv_b [r, H*(nope+v)] -> W_UK^T [1, H, nope, r] and W_UV [1, H, r, v]
    lw.setup_call(W("wkv_b", variant="h").key(lw.layer), "reshape", W("wkv_b"), [1, r, H, nope + vd],
                  shape=(1, r, H, nope + vd))
    lw.setup_call(W("wkv_b", variant="hp").key(lw.layer), "permute", W("wkv_b", variant="h"), [0, 2, 1, 3],
                  shape=(1, H, r, nope + vd))
    lw.setup_call(W("wkv_b", variant="uk").key(lw.layer), "slice", W("wkv_b", variant="hp"), [0, 0, 0, 0],
                  [1, H, r, nope], [1, 1, 1, 1], shape=(1, H, r, nope))
    lw.setup_call(W("wkv_b", variant="ukt").key(lw.layer), "transpose", W("wkv_b", variant="uk"), 2, 3,
                  shape=(1, H, nope, r))
    lw.setup_call(W("wkv_b", variant="uv").key(lw.layer), "slice", W("wkv_b", variant="hp"), [0, 0, 0, nope],
                  [1, H, r, nope + vd], [1, 1, 1, 1], shape=(1, H, r, vd))
    qh = split_heads(lw, q, H, nope + rope, "qh")  # prefill [1, H, S, nope+rope]; decode [1, B, H, nope+rope]
    s = lw.shapes[qh]
    q_nope = lw.call("slice", T(qh), [0, 0, 0, 0], [*s[:3], nope], [1, 1, 1, 1], out="q_nope", shape=(*s[:3], nope))
    q_rope = lw.call("slice", T(qh), [0, 0, 0, nope], list(s), [1, 1, 1, 1], out="q_rope", shape=(*s[:3], rope))
    ks = lw.shapes[kvn]
    latent = lw.call("slice", T(kvn), [0, 0, 0, 0], [1, 1, rows, r], [1, 1, 1, 1], out="latent", shape=(1, 1, rows, r))
    k_rope = lw.call("slice", T(kvn), [0, 0, 0, r], list(ks), [1, 1, 1, 1], out="k_rope", shape=(1, 1, rows, rope))
    if lw.decode:
        k_rope = lw.call("reshape", T(k_rope), [1, rows, 1, rope], out="k_rope.d", shape=(1, rows, 1, rope))
    il = bool(m.get("rope_interleave"))
    cos, sin = rope_tables(lw, rope, lt, interleaved=il)
    apply_rope(lw, q_rope, cos, sin, "q_rope.r", il)
    apply_rope(lw, k_rope, cos, sin, "k_rope.r", il)
    if lw.decode:
        lat = lw.call("reshape", T(latent), [1, rows, 1, r], out="latent.d", shape=(1, rows, 1, r))
        new = lw.call("concat", [T(lat), T("k_rope.r")], 3, out="kv_new", shape=(1, rows, 1, r + rope),
                      memory_config=DRAM)
    else:
        new = lw.call("concat", [T(latent), T("k_rope.r")], 3, out="kv_new", shape=(1, 1, rows, r + rope),
                      memory_config=DRAM)
    cache_write(lw, "kv_latent", new)
    # queries into latent space: q_nope @ W_UK^T per head
    if lw.decode:  # [1, B, H, nope] -> [1, H, B, nope]
        qn = lw.call("transpose", T(q_nope), 1, 2, out="q_nope.t", shape=(1, H, rows, nope), memory_config=DRAM)
    else:
        qn = q_nope
    q_lat = lw.call("matmul", T(qn), W("wkv_b", variant="ukt"), out="q_lat", shape=(1, H, rows, r),
                    memory_config=DRAM, compute_kernel_config=configs.compute_config())
    if lw.decode:
        q_lat = lw.call("transpose", T(q_lat), 1, 2, out="q_lat.t", shape=(1, rows, H, r), memory_config=DRAM)
    qs = lw.shapes[q_lat]
    q_full = lw.call("concat", [T(q_lat), T("q_rope.r")], 3, out="q_full", shape=(*qs[:3], r + rope),
                     memory_config=DRAM)
    scale = f32(lt.get("attn_scale", (nope + rope) ** -0.5))
    kernel = configs.compute_config()
    if lw.decode:
        o_lat = row_groups(lw, q_full, "o_lat", lambda q, out, cur_pos, pages: lw.call(  # verify: per row group
            "transformer.paged_flash_multi_latent_attention_decode", T(q), KV("kv_latent"), None, r, pages, out=out,
            shape=(1, lw.shapes[q][1], H, r), cur_pos_tensor=cur_pos, scale=scale,
            program_config=configs.sdpa_config(lw.grid, None), compute_kernel_config=kernel, memory_config=DRAM))
        o_lat = lw.call("transpose", T(o_lat), 1, 2, out="o_lat.t", shape=(1, H, rows, r), memory_config=DRAM)
    else:
        o_lat = lw.call("transformer.chunked_flash_mla_prefill", T(q_full), KV("kv_latent"), r, T("page_table"),
                        lw.chunk_start, out="o_lat", shape=(1, H, rows, r), scale=scale,
                        program_config=configs.sdpa_config(lw.grid, rows), compute_kernel_config=kernel,
                        memory_config=DRAM)
    o = lw.call("matmul", T(o_lat), W("wkv_b", variant="uv"), out="oh", shape=(1, H, rows, vd), memory_config=DRAM,
                compute_kernel_config=kernel)
    if lw.decode:
        o = lw.call("transpose", T(o), 1, 2, out="oh.t", shape=(1, rows, H, vd), memory_config=DRAM)
    merge_heads(lw, o, st.out.name)


def _clamped_swiglu(lw: Lowerer, st: Step) -> None:
    """GPT-OSS: [gate | up] halves; gate clamped above, up on both sides; (up + 1) * gate *
    sigmoid(alpha * gate). Output [E, I] (the program keeps [E, 2I]: an over-estimate)."""
    (x,) = (a.name for a in st.ins)
    moe = lw.traits["moe"]
    lw.shapes.setdefault(x, tt_shape(st.ins[0].shape))
    src = add_bias(lw, x, "experts_b13", f"{x}.b") if lw.has("experts_b13") else x
    s = lw.shapes[src]
    half = s[3] // 2
    g = lw.call("slice", T(src), [0, 0, 0, 0], [*s[:3], half], [1, 1, 1, 1], out="eg", shape=(*s[:3], half))
    u = lw.call("slice", T(src), [0, 0, 0, half], list(s), [1, 1, 1, 1], out="eu", shape=(*s[:3], half))
    lim = float(moe["swiglu_limit"])
    lw.call("clamp", T(g), None, lim, out="eg.c", shape=lw.shapes[g], memory_config=DRAM)
    lw.call("clamp", T(u), -lim, lim, out="eu.c", shape=lw.shapes[u], memory_config=DRAM)
    lw.call("multiply", T("eg.c"), float(moe["swiglu_alpha"]), out="eg.a", shape=lw.shapes[g], memory_config=DRAM)
    lw.call("sigmoid", T("eg.a"), out="eg.s", shape=lw.shapes[g], memory_config=DRAM)
    lw.call("multiply", T("eg.c"), T("eg.s"), out="eg.g", shape=lw.shapes[g], memory_config=DRAM)
    lw.call("add", T("eu.c"), 1.0, out="eu.1", shape=lw.shapes[u], memory_config=DRAM)
    lw.call("multiply", T("eu.1"), T("eg.g"), out=st.out.name, shape=lw.shapes[u], memory_config=DRAM)


def dense_route(lw: Lowerer, weights: str, idx: str, E: int, out: str) -> str:
    """[1, 1, rows, k] weights at expert indices -> [1, 1, rows, E] (zeros elsewhere)."""
    rows = lw.shapes[weights][2]
    zeros = filled(lw, "zeros", (1, 1, rows, E))  # bf16: scatter takes no fp32 tiles
    return lw.call("scatter", T(zeros), 3, T(idx), T(weights), out=out, shape=(1, 1, rows, E),
                   memory_config=DRAM)


def _topk_softmax(lw: Lowerer, st: Step) -> None:
    (x,) = (a.name for a in st.ins)
    lw.shapes.setdefault(x, tt_shape(st.ins[0].shape))
    src = add_bias(lw, x, "router_bias", f"{x}.b") if lw.has("router_bias") else x
    s = lw.shapes[src]
    k = int(lw.traits["moe"]["top_k"])
    lw.call("topk", T(src), k, 3, True, True, out=("route.v", "route.i"), shape=(*s[:3], k))
    lw.shapes["route.v"] = lw.shapes["route.i"] = (*s[:3], k)
    lw.call("softmax", T("route.v"), 3, out="route.p", shape=(*s[:3], k), memory_config=DRAM)
    dense_route(lw, "route.p", "route.i", s[3], st.out.name)


def _softmax_topk(lw: Lowerer, st: Step) -> None:
    """Qwen MoE: softmax over every expert's logit, top-k of the probabilities, renormalized to
    sum 1 (``norm_topk_prob``). Routing in bf16 on device (HF's softmax is fp32): ties between
    near-equal experts may break differently."""
    (x,) = (a.name for a in st.ins)
    lw.shapes.setdefault(x, tt_shape(st.ins[0].shape))
    s = lw.shapes[x]
    k = int(lw.traits["moe"]["top_k"])
    xb = lw.call("typecast", T(x), BF16, out="rt.x", shape=s)
    lw.call("softmax", T(xb), 3, out="rt.p", shape=s, memory_config=DRAM)
    lw.call("topk", T("rt.p"), k, 3, True, True, out=("rt.tv", "rt.ti"), shape=(*s[:3], k))
    lw.shapes["rt.tv"] = lw.shapes["rt.ti"] = (*s[:3], k)
    w = "rt.tv"
    if lw.traits["moe"].get("norm_topk_prob"):
        tot = lw.call("sum", T(w), 3, True, out="rt.sum", shape=(*s[:3], 1), memory_config=DRAM)
        w = lw.call("divide", T(w), T(tot), out="rt.wn", shape=(*s[:3], k), memory_config=DRAM)
    dense_route(lw, w, "rt.ti", s[3], st.out.name)


def _group_topk(lw: Lowerer, st: Step) -> None:
    """DeepSeek-V3 noaux_tc: sigmoid scores; choose on scores + bias within the top groups (by
    the sum of each group's two best); weights the raw scores, renormalized, scaled."""
    (x,) = (a.name for a in st.ins)
    moe = lw.traits["moe"]
    lw.shapes.setdefault(x, tt_shape(st.ins[0].shape))
    _, _, rows, E = lw.shapes[x]
    G, kg, k = int(moe["n_group"]), int(moe["topk_group"]), int(moe["top_k"])
    # routing in bf16 on device (the router matmul accumulates in fp32; where/scatter take no
    # fp32 tiles); HF keeps fp32 here, so ties between near-equal experts may break differently
    xb = lw.call("typecast", T(x), BF16, out="rt.x", shape=(1, 1, rows, E))
    s = lw.call("sigmoid", T(xb), out="rt.s", shape=(1, 1, rows, E), memory_config=DRAM)
    c = add_bias(lw, s, "e_score_correction_bias", "rt.c")
    grp = lw.call("reshape", T(c), [1, rows, G, E // G], out="rt.g", shape=(1, rows, G, E // G))
    lw.call("topk", T(grp), 2, 3, True, True, out=("rt.g2", "rt.g2i"), shape=(1, rows, G, 2))
    lw.shapes["rt.g2"] = lw.shapes["rt.g2i"] = (1, rows, G, 2)
    gs = lw.call("sum", T("rt.g2"), 3, True, out="rt.gs", shape=(1, rows, G, 1), memory_config=DRAM)
    gs = lw.call("reshape", T(gs), [1, 1, rows, G], out="rt.gs4", shape=(1, 1, rows, G))
    lw.call("topk", T(gs), kg, 3, True, False, out=("rt.kv", "rt.ki"), shape=(1, 1, rows, kg))
    lw.shapes["rt.kv"] = lw.shapes["rt.ki"] = (1, 1, rows, kg)
    ones, zeros = filled(lw, "ones", (1, 1, rows, kg)), filled(lw, "zeros", (1, 1, rows, G))
    lw.call("scatter", T(zeros), 3, T("rt.ki"), T(ones), out="rt.gm", shape=(1, 1, rows, G),
            memory_config=DRAM)
    lw.call("repeat_interleave", T("rt.gm"), E // G, 3, out="rt.em", shape=(1, 1, rows, E), memory_config=DRAM)
    lw.call("where", T("rt.em"), T(c), -1e30, out="rt.masked", shape=(1, 1, rows, E), memory_config=DRAM)
    lw.call("topk", T("rt.masked"), k, 3, True, False, out=("rt.tv", "rt.ti"), shape=(1, 1, rows, k))
    lw.shapes["rt.tv"] = lw.shapes["rt.ti"] = (1, 1, rows, k)
    w = lw.call("gather", T(s), 3, T("rt.ti"), out="rt.w", shape=(1, 1, rows, k), memory_config=DRAM)
    if moe.get("norm_topk_prob"):
        tot = lw.call("sum", T(w), 3, True, out="rt.sum", shape=(1, 1, rows, 1), memory_config=DRAM)
        w = lw.call("divide", T(w), T(tot), out="rt.wn", shape=(1, 1, rows, k), memory_config=DRAM)
    w = lw.call("multiply", T(w), float(moe.get("routed_scaling_factor", 1.0)), out="rt.ws", shape=(1, 1, rows, k),
                memory_config=DRAM)
    dense_route(lw, w, "rt.ti", E, st.out.name)


def _combine(lw: Lowerer, st: Step) -> None:
    """Σ over this device's experts of eo * route[local experts]: route's expert dim partitioned
    over the expert-parallel axes like the experts themselves."""
    x = st.ins[0].name
    lw.shapes.setdefault(x, tt_shape(st.ins[0].shape))
    src = x
    if lw.has("experts_b2"):
        s = lw.shapes[x]
        view = W("experts_b2", variant="batched")
        lw.setup_call(view.key(lw.layer), "reshape", W("experts_b2"), [1, s[1], 1, s[3]], shape=(1, s[1], 1, s[3]))
        src = lw.call("add", T(x), view, out=f"{x}.b", shape=s, memory_config=DRAM)
    experts_w = "experts_w2"
    axes = lw.tensors[experts_w].spec[0]
    local = lw.partition("route", 3, axes, "route.local")  # [1, 1, rows, E_local]
    _, _, rows, El = lw.shapes[local]
    wt = lw.call("transpose", T(local), 1, 3, out="route.t", shape=(1, El, rows, 1), memory_config=DRAM)
    wt = lw.call("typecast", T(wt), BF16, out="route.tb", shape=(1, El, rows, 1))
    prod = lw.call("multiply", T(src), T(wt), out=f"{x}.w", shape=lw.shapes[src], memory_config=DRAM)
    s = lw.call("sum", T(prod), 1, True, out=f"{st.out.name}.s", shape=(1, 1, rows, lw.shapes[src][3]),
                memory_config=DRAM)
    lw.call("reshape", T(s), [1, 1, rows, lw.shapes[src][3]], out=st.out.name, shape=(1, 1, rows, lw.shapes[src][3]))


def _sigmoid_gate(lw: Lowerer, st: Step) -> None:
    """Qwen2 MoE's shared expert output [.., rows, N] times sigmoid of its per-token gate logit
    [.., rows, 1] (broadcast over the width)."""
    x, g = (a.name for a in st.ins)
    for name, shp in ((a.name, a.shape) for a in st.ins):
        lw.shapes.setdefault(name, tt_shape(shp))
    s = lw.call("sigmoid", T(g), out=f"{g}.s", shape=lw.shapes[g], memory_config=DRAM)
    lw.call("multiply", T(x), T(s), out=st.out.name, shape=lw.shapes[x], memory_config=DRAM)


OPS = {"mla_attention": _mla_attention, "clamped_swiglu": _clamped_swiglu, "topk_softmax": _topk_softmax,
       "softmax_topk": _softmax_topk, "group_topk": _group_topk, "combine": _combine,
       "sigmoid_gate": _sigmoid_gate}
