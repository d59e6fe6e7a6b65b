"""Program ops -> ttnn calls: the per-device program of one (phase, bucket) as a :class:`Forward`.

Input: the static program ``lower.lower`` writes into a package (per layer kind, every op with its
per-device shapes, every collective with its mesh axes). Output: for every layer (in order, with
its own index for weights and KV caches) the ttnn calls that compute it, the device inputs a run
writes first, the setup calls a model runs once, and the host-made constants. One small
function per op kind, in :data:`OPS` (the coverage test requires an entry for every kind the
families' programs use).

Tensors are 4-D as in tt_transformers: an activation ``[rows, f]`` is ``[1, 1, rows, f]``, an
expert activation ``[rows, E, f]`` is ``[1, E, rows, f]``; attention heads are ``[1, H, S, d]``
(prefill) and ``[1, B, H, d]`` (decode, one token per row). Weights are held as the package's
tensorbin caches say (``layout.py``); setup derives the few views the ops need (bias rows,
per-expert batches, MLA's absorbed projections).

Ops ttnn's fused kernels cannot express are lowered differently:

* Gemma 2's attention logit soft-capping (ttnn 0.81.1's SDPA kernels have no soft-cap): those
  layers gather the sequence's K/V blocks from the paged cache (``gather`` by the page table) and
  attend explicitly, ``softcap(q k^T * scale)`` plus a host-made mask input, then softmax and
  ``@ v`` — correct, but O(max_model_len) per step, like the emulated backend's attention.
* an image prefill (a model with a vision encoder): its image soft tokens attend to their whole
  image, which the causal fused SDPA cannot say, so its prefill attention is the explicit-mask
  path above without the soft-cap (the mask input holds the image blocks); the soft tokens
  themselves are merged after the embedding from two inputs (:func:`_merge_images`).
* DeepSeek's MLA prefill: ``chunked_flash_mla_prefill`` takes its chunk's start position as a
  static int, so a forward is lowered per chunk start (:func:`chunk_starts`; the runtime keys
  them ``(phase, bucket, sampling, start)``).
"""

from __future__ import annotations

import math
import struct
from typing import Callable

from ... import layout, tiles
from ...families.base import Dim
from ...layout import axes_of, tensor_layout
from ...mesh import AXES, Mesh
from . import configs
from .calls import KV, Attr, Call, Const, Forward, Layer, New, T, W
from .layout import TILE, device_shape

DRAM = Attr("DRAM_MEMORY_CONFIG")
BF16, F32, U32 = Attr("bfloat16"), Attr("float32"), Attr("uint32")
TILE_L, RM = Attr("TILE_LAYOUT"), Attr("ROW_MAJOR_LAYOUT")
# where a forward's tokens are sampled: "device" (top-k candidates, then ttnn.sampling with per-row
# k / p / temperature; greedy rows use k = 1, as tt_transformers does) or "host" (logits come back)
SAMPLING = ("device", "host")
TOPK = 32  # candidates ttnn.sampling draws from


def f32(x: float) -> float:
    """``x`` rounded to float32: some ttnn bindings take a C++ ``float`` and refuse a Python float
    that float32 cannot hold exactly (``chunked_scaled_dot_product_attention(scale=0.1)`` raises
    "incompatible function arguments"; ``scale=float32(0.1)`` binds)."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def tt_shape(shape) -> tuple[int, ...]:
    """A program shape ``[rows, f]`` / ``[rows, E, f]`` as the 4-D ttnn tensor shape."""
    if len(shape) == 2:
        return (1, 1, shape[0], shape[1])
    if len(shape) == 3:
        return (1, shape[1], shape[0], shape[2])
    raise ValueError(f"activation of rank {len(shape)}: {shape}")


def tt_dim(shape, k: int) -> int:
    """Program dim ``k`` of an activation of ``shape`` as its ttnn dim."""
    return {2: (2, 3), 3: (2, 1, 3)}[len(shape)][k]


class _Emitter:
    """Emits calls on ``mesh``: the collectives and partitions of any step, with the per-device
    shapes each call leaves (``shapes``). ``policy``: the sharding policy of padded dims."""

    def __init__(self, mesh: Mesh, policy=None):
        self.mesh, self.policy = mesh, policy
        self.shapes: dict[str, tuple] = {}  # tensor name -> 4-D per-device shape (as lowered)
        self.calls: list[Call] = []
        self.op = ""

    def call(self, fn: str, *args, out=None, shape=None, **kwargs) -> str | None:
        c = Call(fn, tuple(args), tuple(sorted(kwargs.items())), out, tuple(shape) if shape else None, self.op)
        self.calls.append(c)
        if isinstance(out, str) and shape is not None:
            self.shapes[out] = tuple(shape)
        return out

    def topology(self, axes) -> Attr:
        n = math.prod(self.mesh.axis_size(a) for a in axes)
        return Attr("Topology.Ring" if self.mesh.topology in ("ring", "torus") and n > 2 else "Topology.Linear")

    def partition(self, x: str, dim: int, axes, out: str) -> str:
        """Each device keeps its slice of replicated ``x`` along ``dim`` split over ``axes``:
        one ``mesh_partition`` per axis in ``layout.partition_sequence`` order, which leaves
        device ``(r, c)`` the part at its group position (``layout.group_of``)."""
        cur = x
        split = [ax for ax in layout.partition_sequence(axes) if self.mesh.axis_size(ax) > 1]
        for i, ax in enumerate(split):
            shp = list(self.shapes[cur])
            part = layout.even_part(shp[dim], self.mesh.axis_size(ax))
            if part is None:
                raise ValueError(f"{out}: dim {dim} of {tuple(shp)} does not divide over mesh {ax}")
            shp[dim] = part
            nxt = out if i == len(split) - 1 else f"{out}.p{i}"
            cur = self.call("mesh_partition", T(cur), dim, AXES.index(ax), out=nxt, shape=shp,
                            memory_config=DRAM)
        return cur  # x itself when nothing is split on this mesh


class _Weight:
    """A weight as the program records it (``program.WeightRef``'s JSON: PartitionSpec,
    per-device shape, dtype, layers) and how ttnn holds it (``layout.tensor_layout`` of its kind)."""

    def __init__(self, ref: dict, layout_: str):
        self.spec = [axes_of(e) for e in ref["spec"]]
        self.device_shape = list(ref["device_shape"])
        self.dtype = ref["dtype"]
        self.layers = None if ref.get("layers") is None else tuple(ref["layers"])
        self.layout = layout_


class _Lowerer(_Emitter):
    """Lowers one program with what it records: the weights it reads (``weights``), its KV cache
    (dtype, block size) and its mesh; ``bundle`` gives the arch (family traits, dims) and the
    runtime limits. Nothing here reads a plan."""

    def __init__(self, bundle, mesh: Mesh, program: dict, sampling: str, grid: tuple[int, int] | None = None):
        super().__init__(mesh, program_policy(program, bundle))
        self.bundle, self.prog = bundle, program
        self.fam, self.a = bundle.family, bundle.arch
        self.phase, self.rows = program["phase"], program["rows"]
        self.decode = self.phase == "decode"
        self.sampling = sampling
        self.grid = grid or self.mesh.chip.compute_grid
        decls = {t.name: t for t in self.fam.tensors(self.a)}
        self.tensors = {n: _Weight(r, tensor_layout(decls[n])) for n, r in program["weights"].items()}
        self.traits = self.fam.traits(self.a)
        self.kv_dtype = program["kv_cache"]["dtype"]
        self.block_size = int(program["kv_cache"]["block_size"])
        self.layer: int | None = None
        self.setup: dict[str, Call] = {}
        self.consts: dict[str, Const] = {}
        self.gaps: list[str] = []
        self.inputs: dict[str, tuple] = {}
        self.chunk_start = 0  # MLA prefill: the static start this forward is lowered for

    # -- emitting ------------------------------------------------------------------------------
    def setup_call(self, key: str, fn: str, *args, shape=None, **kwargs) -> None:
        """A once-per-model call producing weight view ``key`` (run with this layer's weights);
        deduplicated."""
        if key not in self.setup:
            self.setup[key] = (self.layer, Call(fn, tuple(args), tuple(sorted(kwargs.items())), key,
                                                tuple(shape) if shape else None, "setup"))

    def has(self, w: str) -> bool:
        t = self.tensors.get(w)
        if t is None:
            return False
        return t.layers is None or self.layer is None or t.layers[0] <= self.layer < t.layers[1]

    def lt(self) -> dict:
        return self.fam.layer_traits(self.a, self.layer) if self.layer is not None else {}


# ---- op kinds ----------------------------------------------------------------------------------
def _embedding(lw: _Lowerer, st: dict) -> None:
    rows, hid = st["out_shape"]
    e = lw.call("embedding", T("tokens"), W("embed", per_layer=False), out=f"{st['out']}.e",
                shape=(1, rows, hid), layout=TILE_L, dtype=BF16, memory_config=DRAM)
    out = lw.call("reshape", T(e), [1, 1, rows, hid], out=st["out"], shape=(1, 1, rows, hid))
    scale = lw.traits.get("embed_scale")
    if scale:
        lw.call("multiply", T(out), float(scale), out=out, shape=lw.shapes[out], memory_config=DRAM)


def _rms_norm(lw: _Lowerer, st: dict) -> None:
    x, out = st["x"], st["out"]
    shp = tt_shape(st["in_shape"])
    lw.shapes.setdefault(x, shp)
    norm = lw.traits.get("norms", {}).get(st["w"], {})
    eps = f32(norm.get("eps", getattr(lw.a, "rms_norm_eps", 1e-6)))
    w = W(st["w"], per_layer=lw.layer is not None)
    if norm.get("layer_norm"):  # LayerNorm with a bias (vision towers)
        lw.call("layer_norm", T(x), out=out, shape=shp, epsilon=eps, weight=w,
                bias=W(norm["bias"], per_layer=lw.layer is not None),
                compute_kernel_config=configs.compute_config(), memory_config=DRAM)
        return
    if lw.traits.get("norm_offset"):  # Gemma: x * (1 + w); the 1 is added once at setup
        w = W(st["w"], per_layer=lw.layer is not None, variant="plus1")
        for layer in ([None] if lw.layer is None else [lw.layer]):
            t = lw.tensors[st["w"]]
            lw.setup_call(w.key(layer), "add", W(st["w"], per_layer=lw.layer is not None), float(lw.traits["norm_offset"]),
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


def _matmul(lw: _Lowerer, st: dict) -> None:
    x, w, out = st["x"], st["w"], st["out"]
    spec = lw.tensors[w].spec
    held = lw.shapes[x]
    inp = st["in_shape"]
    k = st["w_shape"][-2]
    src = x
    if held[-1] != k:  # a replicated input meeting a split contraction: each device takes its part
        src = lw.partition(x, 3, spec[-2], f"{out}.in")
        if lw.shapes[src][-1] != k:
            raise ValueError(f"{w}: input {x} {held} partitioned to {lw.shapes[src]}, weight contracts {k}")
    fp32 = w in lw.traits.get("linear_fp32", ())
    dtype = F32 if fp32 else BF16
    if fp32:
        src = lw.call("typecast", T(src), F32, out=f"{out}.f32", shape=lw.shapes[src])
    if len(st["w_shape"]) == 3:  # experts: every local expert on every token, one batched matmul
        E = st["w_shape"][0]
        if len(inp) == 2 or lw.shapes[src][1] != E:
            rep = lw.call("repeat", T(src), [1, E, 1, 1], out=f"{out}.rep",
                          shape=(1, E, lw.shapes[src][2], lw.shapes[src][3]), memory_config=DRAM)
        else:
            rep = src
        wb = W(w, variant="batched")
        lw.setup_call(wb.key(lw.layer), "reshape", W(w), [1, *st["w_shape"]], shape=(1, *st["w_shape"]))
        lw.call("matmul", T(rep), wb, out=out, shape=tt_shape(st["out_shape"]), dtype=dtype,
                memory_config=DRAM, compute_kernel_config=configs.compute_config(st["w_dtype"]))
        return
    rows = lw.shapes[src][2]
    pc = configs.matmul_config(rows, k, st["w_shape"][-1], lw.grid)
    lw.call("linear", T(src), W(w, per_layer=lw.layer is not None), out=out, shape=tt_shape(st["out_shape"]),
            dtype=dtype, memory_config=DRAM, program_config=pc,
            compute_kernel_config=configs.compute_config(st["w_dtype"]))


def _vector_view(lw: _Lowerer, w: str, shape: tuple, variant: str) -> W:
    """Vector weight ``w`` (held as rows of 32, ``[1, 1, ceil(n/32), 32]``, zero-padded) as a
    TILE tensor of ``shape`` (``n`` values), made once at setup: flatten, cut the padding,
    reshape, tilize."""
    t = lw.tensors[w]
    n = math.prod(t.device_shape)
    held = math.prod(device_shape(t.device_shape, t.layout))
    cur = W(w)
    steps = [("flat", "reshape", ([1, 1, 1, held],), (1, 1, 1, held))]
    if held != n:
        steps.append(("cut", "slice", ([0, 0, 0, 0], [1, 1, 1, n], [1, 1, 1, 1]), (1, 1, 1, n)))
    steps += [("shaped", "reshape", (list(shape),), tuple(shape)), ("", "to_layout", (TILE_L,), tuple(shape))]
    for suffix, fn, args, shp in steps:
        nxt = W(w, variant=f"{variant}.{suffix}" if suffix else variant)
        lw.setup_call(nxt.key(lw.layer), fn, cur, *args, shape=shp)
        cur = nxt
    return cur


def _bias(lw: _Lowerer, x: str, w: str, out: str) -> str:
    """``x + b`` for a bias vector ``w`` (made a broadcastable TILE row once at setup)."""
    shp = lw.shapes[x]
    per_expert = len(lw.tensors[w].device_shape) == 2  # [E, n]: one row per expert
    view = _vector_view(lw, w, (1, shp[1], 1, shp[3]) if per_expert else (1, 1, 1, shp[-1]), "row")
    return lw.call("add", T(x), view, out=out, shape=shp, memory_config=DRAM)


def _rope_tables(lw: _Lowerer, head_dim: int, lt: dict, interleaved: bool = False) -> tuple[T, T]:
    """cos / sin of every position up to max_model_len for one rope variant (host-made), and in
    decode each row's own position's row of them (an embedding lookup inside the trace)."""
    theta = lt.get("rope_theta", getattr(lw.a, "rope_theta", 10000.0))
    scaling = lt.get("rope_scaling", getattr(lw.a, "rope_scaling", None))
    tag = f"rope.{head_dim}.{theta:g}.{abs(hash(repr(scaling))) % 10 ** 8}" + (".il" if interleaved else "")
    L = lw.bundle.spec.runtime.max_model_len
    section = lw.traits.get("mrope_section")
    if section:
        return _mrope_tables(lw, tag, head_dim, theta, scaling, section)
    for part in ("cos", "sin"):  # ROW_MAJOR [positions, head_dim]: what ttnn.embedding reads
        lw.consts[f"{tag}.{part}"] = Const(f"{tag}.{part}", (L, head_dim), "bf16", "ROW_MAJOR", "rope_" + part,
                                           (("head_dim", head_dim), ("theta", theta), ("scaling", repr(scaling)),
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


def mrope_position_input(row: int) -> str:
    """The input holding each token's M-RoPE position of ``row`` (0 temporal, 1 height, 2 width)."""
    return f"rope_positions.{row}"


def _mrope_tables(lw: _Lowerer, tag: str, head_dim: int, theta: float, scaling, section) -> tuple[T, T]:
    """M-RoPE (Qwen2.5-VL): cos / sin of each token from three position inputs (temporal,
    height, width). Each has its own table, zero outside the frequencies its ``mrope_section``
    rotates; every frequency belongs to one section, so the sum of the three lookups is the
    token's cos / sin (text tokens: the same position in all three)."""
    L = lw.bundle.spec.runtime.max_model_len
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
                                       (("head_dim", head_dim), ("theta", theta), ("scaling", repr(scaling)),
                                        ("interleaved", False), ("mrope_section", tuple(section)), ("mrope_row", r)))
                e = lw.call("embedding", T(mrope_position_input(r)), T(tab), out=f"{name}.e{r}", shape=(1, rows, head_dim),
                            layout=TILE_L, dtype=BF16, memory_config=DRAM)
                looked.append(lw.call("reshape", T(e), [1, 1, rows, head_dim], out=f"{name}.{r}",
                                      shape=(1, 1, rows, head_dim)))
            s01 = lw.call("add", T(looked[0]), T(looked[1]), out=f"{name}.01", shape=(1, 1, rows, head_dim),
                          memory_config=DRAM)
            lw.call("add", T(s01), T(looked[2]), out=name, shape=(1, 1, rows, head_dim), memory_config=DRAM)
        out.append(T(name))
    return out[0], out[1]


def _rope(lw: _Lowerer, x: str, cos: T, sin: T, out: str, interleaved: bool = False) -> str:
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


def _heads(lw: _Lowerer, x: str, n: int, d: int, out: str) -> str:
    """``[1, 1, rows, n*d]`` -> ``[1, n, S, d]`` (prefill) or ``[1, B, n, d]`` (decode)."""
    rows = lw.shapes[x][2]
    if lw.decode:
        return lw.call("reshape", T(x), [1, rows, n, d], out=out, shape=(1, rows, n, d))
    r = lw.call("reshape", T(x), [1, rows, n, d], out=f"{out}.r", shape=(1, rows, n, d))
    return lw.call("transpose", T(r), 1, 2, out=out, shape=(1, n, rows, d), memory_config=DRAM)


def _merge_heads(lw: _Lowerer, x: str, out: str) -> str:
    s = lw.shapes[x]
    if lw.decode:  # [1, B, H, d]
        return lw.call("reshape", T(x), [1, 1, s[1], s[2] * s[3]], out=out, shape=(1, 1, s[1], s[2] * s[3]))
    return lw.call("experimental.nlp_concat_heads", T(x), out=out, shape=(1, 1, s[2], s[1] * s[3]),
                   memory_config=DRAM)


def _cache_write(lw: _Lowerer, kv: str, x: str) -> None:
    src = x
    if lw.kv_dtype == "bfp8":
        src = lw.call("typecast", T(x), Attr("bfloat8_b"), out=f"{x}.c", shape=lw.shapes[x])
    if lw.decode:  # paged_update_cache reads each row's heads from its own core: [1, B, n, d]
        _, b, _, d = lw.shapes[src]  # height-sharded, one (32 x d) shard per row
        cores = New.factory("num_cores_to_corerangeset", "CoreRangeSet", b, configs.coord(*lw.grid), row_wise=True)
        mem = New.factory("create_sharded_memory_config", "MemoryConfig", shape=(TILE, d), core_grid=cores,
                          strategy=Attr("ShardStrategy.HEIGHT"), orientation=Attr("ShardOrientation.ROW_MAJOR"),
                          use_height_and_width_as_shard_shape=True)
        src = lw.call("to_memory_config", T(src), mem, out=f"{src}.sh", shape=lw.shapes[src])
        lw.call("experimental.paged_update_cache", KV(kv), T(src), update_idxs_tensor=T("cur_pos"),
                page_table=T("page_table"))
    else:
        # the chunk's own blocks (the full page table would write it from position 0)
        lw.call("experimental.paged_fill_cache", KV(kv), T(src), T("fill_page_table"), batch_idx_tensor=T("seq_slot"))


def _attention(lw: _Lowerer, st: dict) -> None:
    q, k, v = st["ins"]
    for name, shp in zip(st["ins"], st["in_shapes"]):
        lw.shapes.setdefault(name, tt_shape(shp))
    lt = lw.lt()
    hd = lt.get("head_dim", lw.a.hd)
    nq, nkv = lw.shapes[q][3] // hd, lw.shapes[k][3] // hd
    for b, x in (("bq", q), ("bk", k), ("bv", v)):
        if lw.has(b):
            _bias(lw, x, b, f"{x}.b")
    q0, k0, v0 = (f"{x}.b" if lw.has(b) else x for b, x in (("bq", q), ("bk", k), ("bv", v)))
    qh, kh, vh = _heads(lw, q0, nq, hd, "qh"), _heads(lw, k0, nkv, hd, "kh"), _heads(lw, v0, nkv, hd, "vh")
    eps = f32(getattr(lw.a, "rms_norm_eps", 1e-6))
    if lw.has("q_norm"):
        for x, w in ((qh, "q_norm"), (kh, "k_norm")):
            wv = W(w)
            if lw.traits.get("norm_offset"):
                wv = W(w, variant="plus1")
                lw.setup_call(wv.key(lw.layer), "add", W(w), float(lw.traits["norm_offset"]), memory_config=DRAM,
                              shape=device_shape([hd], "ROW_MAJOR"))
            lw.call("rms_norm", T(x), out=x, shape=lw.shapes[x], epsilon=eps, weight=wv,
                    compute_kernel_config=configs.compute_config(), memory_config=DRAM)
    cos, sin = _rope_tables(lw, hd, lt)
    _rope(lw, qh, cos, sin, "qr")
    _rope(lw, kh, cos, sin, "kr")
    _cache_write(lw, "k", "kr")
    _cache_write(lw, "v", vh)
    scale = f32(lt.get("attn_scale", hd ** -0.5))
    if lt.get("attn_softcap") or (not lw.decode and image_mask(lw.bundle, lw.prog)):
        # an image prefill's soft tokens attend to their whole image (a host-made mask input):
        # the fused SDPA kernels are causal only
        cap = float(lt["attn_softcap"]) if lt.get("attn_softcap") else None
        o = _softcap_attention(lw, nq, nkv, hd, scale, cap, lt.get("window"))
        _merge_heads(lw, o, st["out"])
        return
    extra = {}
    if lt.get("window"):
        extra["sliding_window_size"] = int(lt["window"])
    if lw.has("sinks"):  # one logit per query head: prefill SDPA wants [1, H, 1, 1], decode [H, 1]
        extra["attention_sink"] = _vector_view(lw, "sinks", (nq, 1) if lw.decode else (1, nq, 1, 1),
                                               "sink2" if lw.decode else "sink4")
    kernel = configs.compute_config()
    if lw.decode:
        o = lw.call("transformer.paged_scaled_dot_product_attention_decode", T("qr"), KV("k"), KV("v"),
                    T("page_table"), out="oh", shape=lw.shapes["qr"], cur_pos_tensor=T("cur_pos"), scale=scale,
                    program_config=configs.sdpa_config(lw.grid, None), compute_kernel_config=kernel,
                    memory_config=DRAM, **extra)
    else:  # over the paged cache from the chunk's first position: prefix chunks included
        o = lw.call("transformer.chunked_scaled_dot_product_attention", T("qr"), KV("k"), KV("v"),
                    T("page_table"), out="oh", shape=lw.shapes["qr"], chunk_start_idx_tensor=T("chunk_start"),
                    scale=scale, program_config=configs.sdpa_config(lw.grid, lw.rows),
                    compute_kernel_config=kernel, memory_config=DRAM, **extra)
    _merge_heads(lw, o, st["out"])


def mask_input(window) -> str:
    """The name of the additive attention-mask input (softcapped attention) for a window."""
    return f"attn_mask.w{int(window)}" if window else "attn_mask"


def _softcap_attention(lw: _Lowerer, nq: int, nkv: int, hd: int, scale: float, cap: float | None,
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


def _mla_attention(lw: _Lowerer, st: dict) -> None:
    """DeepSeek MLA with the absorbed projections (as the device does it): the cache holds
    ``latent | rope key`` per token; queries are moved into latent space with W_UK and the
    latent context out of it with W_UV (both cut from ``wkv_b`` once at setup)."""
    q, kvn = st["ins"]
    m = lw.traits["mla"]
    r, nope, rope, vd = m["kv_lora_rank"], m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
    for name, shp in zip(st["ins"], st["in_shapes"]):
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
    qh = _heads(lw, q, H, nope + rope, "qh")  # prefill [1, H, S, nope+rope]; decode [1, B, H, nope+rope]
    s = lw.shapes[qh]
    q_nope = lw.call("slice", T(qh), [0, 0, 0, 0], [*s[:3], nope], [1, 1, 1, 1], out="q_nope", shape=(*s[:3], nope))
    q_rope = lw.call("slice", T(qh), [0, 0, 0, nope], list(s), [1, 1, 1, 1], out="q_rope", shape=(*s[:3], rope))
    ks = lw.shapes[kvn]
    latent = lw.call("slice", T(kvn), [0, 0, 0, 0], [1, 1, rows, r], [1, 1, 1, 1], out="latent", shape=(1, 1, rows, r))
    k_rope = lw.call("slice", T(kvn), [0, 0, 0, r], list(ks), [1, 1, 1, 1], out="k_rope", shape=(1, 1, rows, rope))
    if lw.decode:
        k_rope = lw.call("reshape", T(k_rope), [1, rows, 1, rope], out="k_rope.d", shape=(1, rows, 1, rope))
    il = bool(m.get("rope_interleave"))
    cos, sin = _rope_tables(lw, rope, lt, interleaved=il)
    _rope(lw, q_rope, cos, sin, "q_rope.r", il)
    _rope(lw, k_rope, cos, sin, "k_rope.r", il)
    if lw.decode:
        lat = lw.call("reshape", T(latent), [1, rows, 1, r], out="latent.d", shape=(1, rows, 1, r))
        new = lw.call("concat", [T(lat), T("k_rope.r")], 3, out="kv_new", shape=(1, rows, 1, r + rope),
                      memory_config=DRAM)
    else:
        new = lw.call("concat", [T(latent), T("k_rope.r")], 3, out="kv_new", shape=(1, 1, rows, r + rope),
                      memory_config=DRAM)
    _cache_write(lw, "kv_latent", new)
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
        o_lat = lw.call("transformer.paged_flash_multi_latent_attention_decode", T(q_full), KV("kv_latent"), None,
                        r, T("page_table"), out="o_lat", shape=(1, rows, H, r), cur_pos_tensor=T("cur_pos"),
                        scale=scale, program_config=configs.sdpa_config(lw.grid, None),
                        compute_kernel_config=kernel, memory_config=DRAM)
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
    _merge_heads(lw, o, st["out"])


def _activation(lw: _Lowerer, x: str, out: str) -> str:
    act = lw.traits.get("act", getattr(lw.a, "hidden_act", "silu"))
    if act in ("silu", "swish"):
        return lw.call("silu", T(x), out=out, shape=lw.shapes[x], memory_config=DRAM)
    approx = act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")
    return lw.call("gelu", T(x), out=out, shape=lw.shapes[x], fast_and_approximate_mode=approx, memory_config=DRAM)


def _swiglu(lw: _Lowerer, st: dict) -> None:
    g, u = st["ins"]
    for name, shp in zip(st["ins"], st["in_shapes"]):
        lw.shapes.setdefault(name, tt_shape(shp))
    ga = _activation(lw, g, f"{g}.act")
    lw.call("multiply", T(ga), T(u), out=st["out"], shape=lw.shapes[u], memory_config=DRAM)


def _clamped_swiglu(lw: _Lowerer, st: dict) -> None:
    """GPT-OSS: [gate | up] halves; gate clamped above, up on both sides; (up + 1) * gate *
    sigmoid(alpha * gate). Output [E, I] (the program keeps [E, 2I]: an over-estimate)."""
    (x,) = st["ins"]
    moe = lw.traits["moe"]
    lw.shapes.setdefault(x, tt_shape(st["in_shapes"][0]))
    src = _bias(lw, x, "experts_b13", f"{x}.b") if lw.has("experts_b13") else x
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
    lw.call("multiply", T("eu.1"), T("eg.g"), out=st["out"], shape=lw.shapes[u], memory_config=DRAM)


def _filled(lw: _Lowerer, kind: str, shape: tuple) -> str:
    """A host-made bf16 TILE constant of zeros or ones, named by its shape: a model's forwards
    share constants by name (``model.open_model``), and buckets differ in rows."""
    name = f"{kind}.{'x'.join(map(str, shape))}"
    lw.consts[name] = Const(name, tuple(shape), "bf16", "TILE", kind)
    return name


def _dense_route(lw: _Lowerer, weights: str, idx: str, E: int, out: str) -> str:
    """[1, 1, rows, k] weights at expert indices -> [1, 1, rows, E] (zeros elsewhere)."""
    rows = lw.shapes[weights][2]
    zeros = _filled(lw, "zeros", (1, 1, rows, E))  # bf16: scatter takes no fp32 tiles
    return lw.call("scatter", T(zeros), 3, T(idx), T(weights), out=out, shape=(1, 1, rows, E),
                   memory_config=DRAM)


def _topk_softmax(lw: _Lowerer, st: dict) -> None:
    (x,) = st["ins"]
    lw.shapes.setdefault(x, tt_shape(st["in_shapes"][0]))
    src = _bias(lw, x, "router_bias", f"{x}.b") if lw.has("router_bias") else x
    s = lw.shapes[src]
    k = int(lw.traits["moe"]["top_k"])
    lw.call("topk", T(src), k, 3, True, True, out=("route.v", "route.i"), shape=(*s[:3], k))
    lw.shapes["route.v"] = lw.shapes["route.i"] = (*s[:3], k)
    lw.call("softmax", T("route.v"), 3, out="route.p", shape=(*s[:3], k), memory_config=DRAM)
    _dense_route(lw, "route.p", "route.i", s[3], st["out"])


def _group_topk(lw: _Lowerer, st: dict) -> None:
    """DeepSeek-V3 noaux_tc: sigmoid scores; choose on scores + bias within the top groups (by
    the sum of each group's two best); weights the raw scores, renormalized, scaled."""
    (x,) = st["ins"]
    moe = lw.traits["moe"]
    lw.shapes.setdefault(x, tt_shape(st["in_shapes"][0]))
    _, _, rows, E = lw.shapes[x]
    G, kg, k = int(moe["n_group"]), int(moe["topk_group"]), int(moe["top_k"])
    # routing in bf16 on device (the router matmul accumulates in fp32; where/scatter take no
    # fp32 tiles); HF keeps fp32 here, so ties between near-equal experts may break differently
    xb = lw.call("typecast", T(x), BF16, out="rt.x", shape=(1, 1, rows, E))
    s = lw.call("sigmoid", T(xb), out="rt.s", shape=(1, 1, rows, E), memory_config=DRAM)
    c = _bias(lw, s, "e_score_correction_bias", "rt.c")
    grp = lw.call("reshape", T(c), [1, rows, G, E // G], out="rt.g", shape=(1, rows, G, E // G))
    lw.call("topk", T(grp), 2, 3, True, True, out=("rt.g2", "rt.g2i"), shape=(1, rows, G, 2))
    lw.shapes["rt.g2"] = lw.shapes["rt.g2i"] = (1, rows, G, 2)
    gs = lw.call("sum", T("rt.g2"), 3, True, out="rt.gs", shape=(1, rows, G, 1), memory_config=DRAM)
    gs = lw.call("reshape", T(gs), [1, 1, rows, G], out="rt.gs4", shape=(1, 1, rows, G))
    lw.call("topk", T(gs), kg, 3, True, False, out=("rt.kv", "rt.ki"), shape=(1, 1, rows, kg))
    lw.shapes["rt.kv"] = lw.shapes["rt.ki"] = (1, 1, rows, kg)
    ones, zeros = _filled(lw, "ones", (1, 1, rows, kg)), _filled(lw, "zeros", (1, 1, rows, G))
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
    _dense_route(lw, w, "rt.ti", E, st["out"])


def _combine(lw: _Lowerer, st: dict) -> None:
    """Σ over this device's experts of eo * route[local experts]: route's expert dim partitioned
    over the expert-parallel axes like the experts themselves."""
    x = st["x"]
    lw.shapes.setdefault(x, tt_shape(st["in_shape"]))
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
    s = lw.call("sum", T(prod), 1, True, out=f"{st['out']}.s", shape=(1, 1, rows, lw.shapes[src][3]),
                memory_config=DRAM)
    lw.call("reshape", T(s), [1, 1, rows, lw.shapes[src][3]], out=st["out"], shape=(1, 1, rows, lw.shapes[src][3]))


def _out_bias(lw: _Lowerer, st: dict) -> None:
    (x,) = st["ins"]
    lw.shapes.setdefault(x, tt_shape(st["in_shapes"][0]))
    _bias(lw, x, "bo", st["out"])


# ---- vision encoder (rows: the patches of the program's images, image after image) ---------------
def _one_input(lw: _Lowerer, st: dict) -> str:
    (x,) = st["ins"]
    lw.shapes.setdefault(x, tt_shape(st["in_shapes"][0]))
    return x


def _vision_embed(lw: _Lowerer, st: dict) -> None:
    """Patch matmul output + the conv bias + each patch's position embedding (the table, made a
    TILE ``[1, 1, patches, hidden]`` once at setup, repeated for each image)."""
    x = _bias(lw, _one_input(lw, st), "v_patch_b", f"{st['out']}.b")
    v = lw.a.vision
    rows, hid = lw.shapes[x][2], lw.shapes[x][3]
    pos = W("v_pos", variant="tile")
    lw.setup_call(pos.key(None), "to_layout", W("v_pos", per_layer=False), TILE_L, shape=(v.num_patches, hid))
    posr = W("v_pos", variant="tile4")
    lw.setup_call(posr.key(None), "reshape", pos, [1, 1, v.num_patches, hid], shape=(1, 1, v.num_patches, hid))
    rep = lw.call("repeat", posr, [1, 1, rows // v.num_patches, 1], out=f"{st['out']}.pos", shape=(1, 1, rows, hid),
                  memory_config=DRAM)
    lw.call("add", T(x), T(rep), out=st["out"], shape=(1, 1, rows, hid), memory_config=DRAM)


def _vision_attention(lw: _Lowerer, st: dict) -> None:
    """q/k/v biases, then attention among the patches of each image (images as the batch, no
    mask), this device's heads, as matmuls and a softmax: ttnn's fused SDPA does not pad the
    head dim (SigLIP's is 72)."""
    q, k, v = st["ins"]
    for name, shp in zip(st["ins"], st["in_shapes"]):
        lw.shapes.setdefault(name, tt_shape(shp))
    vis = lw.a.vision
    hd, P = vis.head_dim, vis.num_patches
    rows, width = lw.shapes[q][2], lw.shapes[q][3]
    n, h = rows // P, width // hd
    heads = []
    for b, x in (("v_bq", q), ("v_bk", k), ("v_bv", v)):
        xb = _bias(lw, x, b, f"{x}.b")
        r = lw.call("reshape", T(xb), [n, P, h, hd], out=f"{x}.r", shape=(n, P, h, hd))
        heads.append(lw.call("transpose", T(r), 1, 2, out=f"{x}.h", shape=(n, h, P, hd), memory_config=DRAM))
    kernel = configs.compute_config()
    qh, kh, vh = heads
    s = lw.call("matmul", T(qh), T(kh), out="vo.s", shape=(n, h, P, P), transpose_b=True, memory_config=DRAM,
                compute_kernel_config=kernel)
    s = lw.call("multiply", T(s), f32(hd ** -0.5), out="vo.ss", shape=(n, h, P, P), memory_config=DRAM)
    p = lw.call("softmax", T(s), -1, out="vo.p", shape=(n, h, P, P), memory_config=DRAM)
    o = lw.call("matmul", T(p), T(vh), out="vo.h", shape=(n, h, P, hd), memory_config=DRAM,
                compute_kernel_config=kernel)
    t = lw.call("transpose", T(o), 1, 2, out="vo.t", shape=(n, P, h, hd), memory_config=DRAM)
    lw.call("reshape", T(t), [1, 1, rows, width], out=st["out"], shape=(1, 1, rows, width))


def _vision_bias(w: str):
    def fn(lw: _Lowerer, st: dict) -> None:
        _bias(lw, _one_input(lw, st), w, st["out"])
    return fn


def _vision_gelu(lw: _Lowerer, st: dict) -> None:
    x = _bias(lw, _one_input(lw, st), "v_b1", f"{st['out']}.b")
    lw.call("gelu", T(x), out=st["out"], shape=lw.shapes[x], fast_and_approximate_mode=True, memory_config=DRAM)


def _vision_pool(lw: _Lowerer, st: dict) -> None:
    """The average pool to soft tokens as one matmul by a host-made pooling matrix."""
    x = _one_input(lw, st)
    v = lw.a.vision
    rows, hid = lw.shapes[x][2], lw.shapes[x][3]
    n = rows // v.num_patches
    soft = n * v.mm_tokens_per_image
    name = f"vision.pool.{n}"
    lw.consts[name] = Const(name, (1, 1, soft, rows), "bf16", "TILE", "avg_pool",
                            (("images", n), ("side", v.patches_per_side), ("window", v.pool)))
    lw.call("matmul", T(name), T(x), out=st["out"], shape=(1, 1, soft, hid), memory_config=DRAM,
            compute_kernel_config=configs.compute_config())


# ---- Qwen2.5-VL's vision transformer (rows: the patches in window order, host-made per call) ------
def vision_mask_input(full: bool) -> str:
    """The additive mask input of a Qwen2.5-VL vision layer (0 within a row's window, or its
    image at full-attention layers; -inf elsewhere), made on the host from ``image_grid_thw``."""
    return "vision_mask.image" if full else "vision_mask.window"


def _qwen_vision_attention(lw: _Lowerer, st: dict) -> None:
    """q/k/v biases, the 2-D rope (per-row cos / sin inputs; rotate-half by a matmul), then attention over
    all rows with the window (or image) mask input, as matmuls and a softmax: this device's
    heads ``[1, h, rows, hd]``."""
    q, k, v = st["ins"]
    for name, shp in zip(st["ins"], st["in_shapes"]):
        lw.shapes.setdefault(name, tt_shape(shp))
    vis = lw.a.vision
    hd = vis.head_dim
    rows, width = lw.shapes[q][2], lw.shapes[q][3]
    h = width // hd
    for name in ("vision_cos", "vision_sin"):
        lw.inputs[name] = ((1, 1, rows, hd), "bf16", "TILE")
    mask = vision_mask_input(lw.layer in vis.fullatt_block_indexes)
    lw.inputs[mask] = ((1, 1, rows, rows), "bf16", "TILE")
    heads = []
    for b, x in (("v_bq", q), ("v_bk", k), ("v_bv", v)):
        xb = _bias(lw, x, b, f"{x}.b")
        heads.append(_heads(lw, xb, h, hd, f"{x}.h"))
    qh, kh, vh = heads
    kernel = configs.compute_config()
    # rotate-half as a matmul by a host-made [hd, hd] matrix (ttnn's rotary_embedding_hf wants a
    # head dim of 32 or a multiple of 64; 7B's vision heads are 80)
    rot = f"vision.rotate_half.{hd}"
    lw.consts[rot] = Const(rot, (1, 1, hd, hd), "bf16", "TILE", "rotate_half", (("dim", hd),))
    qr, kr = "vq.r", "vk.r"
    for x, out in ((qh, qr), (kh, kr)):
        shp = lw.shapes[x]
        xr = lw.call("matmul", T(x), T(rot), out=f"{out}.rh", shape=shp, memory_config=DRAM, compute_kernel_config=kernel)
        c = lw.call("multiply", T(x), T("vision_cos"), out=f"{out}.c", shape=shp, memory_config=DRAM)
        sn = lw.call("multiply", T(xr), T("vision_sin"), out=f"{out}.s", shape=shp, memory_config=DRAM)
        lw.call("add", T(c), T(sn), out=out, shape=shp, memory_config=DRAM)
    s = lw.call("matmul", T(qr), T(kr), out="vo.s", shape=(1, h, rows, rows), transpose_b=True, memory_config=DRAM,
                compute_kernel_config=kernel)
    s = lw.call("multiply", T(s), f32(hd ** -0.5), out="vo.ss", shape=(1, h, rows, rows), memory_config=DRAM)
    s = lw.call("add", T(s), T(mask), out="vo.sm", shape=(1, h, rows, rows), memory_config=DRAM)
    p = lw.call("softmax", T(s), -1, out="vo.p", shape=(1, h, rows, rows), memory_config=DRAM)
    o = lw.call("matmul", T(p), T(vh), out="vo.h", shape=(1, h, rows, hd), memory_config=DRAM,
                compute_kernel_config=kernel)
    _merge_heads(lw, o, st["out"])


def _qwen_vision_swiglu(lw: _Lowerer, st: dict) -> None:
    g, u = st["ins"]
    for name, shp in zip(st["ins"], st["in_shapes"]):
        lw.shapes.setdefault(name, tt_shape(shp))
    gb, ub = _bias(lw, g, "v_b1", f"{g}.b"), _bias(lw, u, "v_b3", f"{u}.b")
    a = lw.call("silu", T(gb), out=f"{g}.a", shape=lw.shapes[gb], memory_config=DRAM)
    lw.call("multiply", T(a), T(ub), out=st["out"], shape=lw.shapes[gb], memory_config=DRAM)


def _qwen_vision_merge(lw: _Lowerer, st: dict) -> None:
    """Each merge block's patches (consecutive rows) as one row: a reshape."""
    x = _one_input(lw, st)
    rows, hid = lw.shapes[x][2], lw.shapes[x][3]
    unit = lw.a.vision.merge_unit
    lw.call("reshape", T(x), [1, 1, rows // unit, unit * hid], out=st["out"], shape=(1, 1, rows // unit, unit * hid))


def _qwen_vision_merge_gelu(lw: _Lowerer, st: dict) -> None:
    x = _bias(lw, _one_input(lw, st), "v_merge1_b", f"{st['out']}.b")
    lw.call("gelu", T(x), out=st["out"], shape=lw.shapes[x], fast_and_approximate_mode=False, memory_config=DRAM)


def _residual_add(lw: _Lowerer, st: dict) -> None:
    x = st["x"]
    lw.call("add", T("h"), T(x), out="h", shape=lw.shapes["h"], memory_config=DRAM)


def _logits(lw: _Lowerer, st: dict) -> None:
    """Sampling on device over the gathered logits (top-k candidates drawn by ``ttnn.sampling``
    with per-row k / p / temperature inputs), or the logits themselves for host sampling; padded
    vocabulary columns are sliced off first."""
    x = st["x"]
    s = lw.shapes[x]
    V = lw.a.vocab_size
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


def program_policy(program: dict, bundle=None):
    """The sharding policy a program was lowered with (its ``policy``; else the bundle's)."""
    return layout.Policy.from_json(program.get("policy"), None if bundle is None else bundle.spec.sharding)


def _collective(lw: _Emitter, st: dict) -> None:
    """One collective step: an all_reduce or all_gather of ``st["act"]`` over ``st["axes"]``,
    one ttnn call per mesh axis. A gather over several axes runs in ``layout.gather_sequence``
    order (innermost axis first), so every device ends with its group in group order; where the
    gathered dim (``st["feature"]``) is padded, ``layout.gather_index`` says where its elements
    are, and the padding (at the end) is sliced off."""
    x = st["act"]
    shp = tt_shape(st["shape"])
    lw.shapes.setdefault(x, shp)
    axes = tuple(st["axes"])
    if st["collective"] == "all_reduce":
        for ax in axes:  # a sum: any axis order gives it
            lw.call("all_reduce", T(x), out=x, shape=shp, cluster_axis=AXES.index(ax),
                    topology=lw.topology((ax,)), num_links=1, memory_config=DRAM)
        return
    dim = tt_dim(st["shape"], st["dim"])
    for ax in layout.gather_sequence(axes):
        nxt = list(lw.shapes[x])
        nxt[dim] *= lw.mesh.axis_size(ax)
        lw.call("all_gather", T(x), dim, out=x, shape=nxt, cluster_axis=AXES.index(ax),
                topology=lw.topology((ax,)), num_links=1, memory_config=DRAM)
    f = st.get("feature")
    inv = f and layout.gather_index(Dim(f["name"], int(f["size"]), int(f["unit"]), int(f.get("groups", 0))),
                                    axes, lw.mesh, lw.policy)
    if inv:
        if inv != list(range(len(inv))):  # padding inside the group, or replicas: no plan gathers one yet
            raise NotImplementedError(f"all_gather of {x} over {axes}: {f['name']} comes back out of order "
                                      f"(padding or replicas inside the group); the ttnn lowering only drops "
                                      f"padding at the end")
        end = list(lw.shapes[x])
        end[dim] = len(inv)
        lw.call("slice", T(x), [0, 0, 0, 0], end, [1, 1, 1, 1], out=x, shape=end)


def collective_calls(mesh: Mesh, st: dict, policy=None) -> list[Call]:
    """The ttnn calls ``lower_forward`` emits for collective program step ``st`` on ``mesh``
    (``policy``: the program's, :func:`program_policy`)."""
    em = _Emitter(mesh, policy or layout.Policy())
    em.op = st["collective"]
    _collective(em, st)
    return em.calls


def partition_calls(mesh: Mesh, x: str, shape, dim: int, axes, out: str) -> list[Call]:
    """The ``mesh_partition`` calls that leave each device its part of replicated ``x`` (4-D
    ``shape``) along ``dim`` split over ``axes`` (what the matmul and combine lowerings emit)."""
    em = _Emitter(mesh)
    em.shapes[x] = tuple(shape)
    em.partition(x, dim, axes, out)
    return em.calls


OPS: dict[str, Callable[[_Lowerer, dict], None]] = {
    "embedding": _embedding, "rms_norm": _rms_norm, "matmul": _matmul, "attention": _attention,
    "mla_attention": _mla_attention, "swiglu": _swiglu, "clamped_swiglu": _clamped_swiglu,
    "topk_softmax": _topk_softmax, "group_topk": _group_topk, "combine": _combine, "out_bias": _out_bias,
    "residual_add": _residual_add, "logits": _logits,
    "vision_embed": _vision_embed, "vision_attention": _vision_attention, "vision_bias_o": _vision_bias("v_bo"),
    "vision_bias_2": _vision_bias("v_b2"), "vision_gelu": _vision_gelu, "vision_pool": _vision_pool,
    "qwen_vision_attention": _qwen_vision_attention, "qwen_vision_swiglu": _qwen_vision_swiglu,
    "qwen_vision_merge": _qwen_vision_merge, "qwen_vision_merge_gelu": _qwen_vision_merge_gelu,
    "qwen_vision_merge_bias": _vision_bias("v_merge2_b"),
    # collectives (program steps with "collective")
    "all_reduce": _collective, "all_gather": _collective,
}


def step_kind(st: dict) -> str:
    return st.get("op") or st["collective"]


def inputs_of(program: dict, bundle) -> dict:
    """The device tensors a run writes before it starts (shape, dtype, layout); page tables in
    the program's KV blocks."""
    rows = program["rows"]
    if program["phase"] == "vision":  # the images' patches, flattened like the conv weight
        return {"patches": ((1, 1, rows, bundle.arch.vision.patch_pixels), "bf16", "TILE")}
    B = rows
    block_size = int(program["kv_cache"]["block_size"])
    blocks_per_seq = tiles.blocks_per_seq(bundle.spec.runtime.max_model_len, block_size)
    ins = {"tokens": ((1, rows), "uint32", "ROW_MAJOR"),
           "positions": ((1, rows), "uint32", "ROW_MAJOR")}
    if program["phase"] == "decode":
        ins["cur_pos"] = ((B,), "int32", "ROW_MAJOR")
        ins["page_table"] = ((B, blocks_per_seq), "int32", "ROW_MAJOR")
    else:
        ins["page_table"] = ((1, blocks_per_seq), "int32", "ROW_MAJOR")
        ins["chunk_start"] = ((1,), "int32", "ROW_MAJOR")
        ins["fill_page_table"] = ((1, -(-rows // block_size)), "int32", "ROW_MAJOR")  # the chunk's blocks
        ins["seq_slot"] = ((1,), "int32", "ROW_MAJOR")
        ins["last_rows"] = ((1, 1, min(rows, TILE), rows), "bf16", "TILE")  # one-hot: the last prompt tile row
        if image_prefill(bundle, program):  # the chunk's image soft tokens (_merge_images)
            hid = bundle.arch.hidden_size
            ins["mm_keep"] = ((1, 1, rows, hid), "bf16", "TILE")
            ins["mm_embeds"] = ((1, 1, rows, hid), "bf16", "TILE")
    head_rows = rows if program["phase"] == "decode" else min(rows, TILE)  # rows the head samples
    ins["top_k"] = ((head_rows,), "uint32", "ROW_MAJOR")
    ins["top_p"] = ((head_rows,), "bf16", "ROW_MAJOR")
    ins["temperature"] = ((head_rows,), "bf16", "ROW_MAJOR")
    return ins


def image_prefill(bundle, program: dict) -> bool:
    """Does this forward take images: a prefill of a model with a vision part. Its prefill takes
    the chunk's soft tokens as inputs (``mm_keep``, ``mm_embeds``: :func:`_merge_images`)."""
    return program["phase"] == "prefill" and bundle.family.vision_part(bundle.arch) is not None


def image_mask(bundle, program: dict) -> bool:
    """Does this image prefill attend with an explicit mask input: its family's image soft tokens
    see their whole image (the vision part's ``BIDIRECTIONAL_IMAGES``: Gemma 3), which the
    causal fused SDPA cannot say."""
    part = bundle.family.vision_part(bundle.arch) if program["phase"] == "prefill" else None
    return part is not None and part.BIDIRECTIONAL_IMAGES


def _merge_images(lw: _Lowerer) -> None:
    """The image soft tokens in place of their placeholder tokens, after the embedding (its scale
    included, as HF merges them) leaves ``h`` whole on every device: ``h * mm_keep + mm_embeds``,
    both host-made per step (``device.image_inputs``: 0 / the soft token at an image token's row,
    1 / 0 at a text token's), so every bucket keeps one forward and one trace."""
    h = lw.shapes["h"]
    if h[3] != lw.a.hidden_size:
        raise NotImplementedError(f"the embedding leaves h split ({h[3]} of {lw.a.hidden_size} features per "
                                  "device); merging image soft tokens needs it whole")
    lw.op = "merge_images"
    lw.call("multiply", T("h"), T("mm_keep"), out="h", shape=h, memory_config=DRAM)
    lw.call("add", T("h"), T("mm_embeds"), out="h", shape=h, memory_config=DRAM)


def unlowered_ops(program: dict) -> list[str]:
    """The op kinds of ``program`` that have no ttnn lowering (in :data:`OPS`), in order."""
    kinds = [step_kind(st) for kind in program["layers"] for st in kind["steps"]]
    return list(dict.fromkeys(k for k in kinds if k not in OPS))


def one_layer_per_kind(program: dict) -> dict:
    """``program`` with each decoder layer kind repeated once (its layers run the same calls on
    the same shapes; only weights and caches differ): enough to validate every call."""
    return {**program, "layers": [{**k, "count": 1} for k in program["layers"]]}


def static_prefill_start(bundle) -> bool:
    """Does this family's prefill attention take its chunk start as a static int (MLA)?"""
    return bool(bundle.family.traits(bundle.arch).get("mla"))


def chunk_starts(bundle, phase: str, bucket: int) -> list[int]:
    """The chunk starts a forward must be lowered for: ``[0]`` unless the start is static (MLA
    prefill), then every multiple of the prefill chunk below max_model_len for a bucket that can
    hold a chunk (the scheduler starts chunks only there)."""
    if phase != "prefill" or not static_prefill_start(bundle):
        return [0]
    b = bundle.buckets
    chunk = b.prefill_chunk or max(b.prefill)
    if bucket > chunk:
        return [0]
    return list(range(0, bundle.spec.runtime.max_model_len, chunk))


def static_start(bundle, phase: str, bucket: int, start: int) -> int:
    """The start part of a forward key for a chunk at ``start``."""
    starts = chunk_starts(bundle, phase, bucket)
    if starts == [0]:
        return 0
    if start not in starts:
        raise ValueError(f"prefill chunk at position {start}: chunks start at multiples of "
                         f"{starts[1] if len(starts) > 1 else 'the prefill chunk'}")
    return start


def lower_forward(bundle, mesh, program: dict, sampling: str = "device", grid: tuple[int, int] | None = None,
                  chunk_start: int = 0) -> Forward:
    """The ttnn calls of ``program`` (``lower.lower``'s JSON for one phase and bucket, as a
    package holds it) on ``mesh`` (the package's ``Mesh``; a build-time ``Plan`` gives its
    ``mesh``). Every weight's PartitionSpec, per-device shape and dtype, the KV cache's dtype and
    block size come from the program, nothing from a plan; a program for another mesh shape is
    refused. ``grid``: the compute grid to configure ops for (default: the mesh chip's);
    ``chunk_start``: the static chunk start of an MLA prefill (:func:`chunk_starts`)."""
    if sampling not in SAMPLING:
        raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
    mesh = getattr(mesh, "mesh", mesh)  # a Plan: its mesh
    name = f"{program['phase']}-{program['bucket']}"
    shape = list((program.get("mesh") or {}).get("shape", ()))
    if shape != list(mesh.shape):
        raise ValueError(f"program {name} is for a {shape} mesh, lowering for {mesh.describe()}")
    lw = _Lowerer(bundle, mesh, program, sampling, grid)
    lw.chunk_start = int(chunk_start)
    lw.inputs = inputs_of(program, bundle)
    if program["phase"] == "vision":
        lw.shapes["patches"] = lw.inputs["patches"][0]
    layers: list[Layer] = []
    index = 0
    for kind in program["layers"]:
        decoder = kind["kind"] not in ("embedding", "head", "vision_embedding", "vision_projector")
        for i in range(kind["count"] if decoder else 1):
            lw.layer = index if decoder else None
            lw.calls = []
            if kind["kind"] == "head" and program["phase"] == "prefill":
                # the head runs on the tile row holding the last prompt token: a [32, rows]
                # selector (an input, one-hot rows) picks it, so the trace needs no dynamic slice
                h = lw.shapes["h"]
                lw.op = "logits"
                lw.call("matmul", T("last_rows"), T("h"), out="h", shape=(1, 1, min(TILE, h[2]), h[3]),
                        memory_config=DRAM, compute_kernel_config=configs.compute_config())
            for st in kind["steps"]:
                k = step_kind(st)
                fn = OPS.get(k)
                if fn is None:
                    raise NotImplementedError(f"no ttnn lowering for program op {k!r}")
                lw.op = k
                fn(lw, st)
            if kind["kind"] == "embedding" and "mm_keep" in lw.inputs:
                _merge_images(lw)
            layers.append(Layer(kind["kind"], lw.layer, lw.calls))
            index += 1 if decoder else 0
    outputs = ["next_tokens"] if sampling == "device" else ["logits.out"]
    if program["phase"] == "vision":  # the soft tokens, replicated
        outputs = [program["layers"][-1]["steps"][-1]["out"]]
    elif sampling == "host":
        for k in ("top_k", "top_p", "temperature"):
            lw.inputs.pop(k)
    return Forward(program["phase"], program["bucket"], program["rows"], lw.inputs, layers, outputs,
                   list(lw.setup.values()), list(lw.consts.values()), lw.gaps)


__all__ = ["OPS", "SAMPLING", "chunk_starts", "collective_calls", "image_mask", "image_prefill",
           "partition_calls", "program_policy", "device_shape", "inputs_of", "lower_forward", "mask_input",
           "mrope_position_input", "static_start", "step_kind", "tt_dim", "tt_shape", "unlowered_ops",
           "vision_mask_input"]
