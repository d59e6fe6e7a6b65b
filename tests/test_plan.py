"""Plan arithmetic against hand-computed cases: per-device shapes, DRAM bytes per dtype, KV cache,
activations, trace region, collectives and their traffic; divisibility errors; what `fixes` says.

Every expected number here is derived in the test from the rules ttnn follows (32x32 tiles;
interleaved pages round-robin over the DRAM banks, each bank holding ceil(pages / banks) pages
aligned to the DRAM alignment; bfp8 = 1,088 B and bfp4 = 576 B per tile) and from the chip facts
in shared/notes/ttnn-host.md, never copied from ttbundle's output.
"""

from __future__ import annotations

import math
import re

import pytest
import yaml

from spec_helpers import LLAMA_70B, SPEC_FILE, TINY, deep_update, line_of, col_of, spec_text
from ttbundle import mesh as meshmod, spec
from ttbundle.plan import advice
from ttbundle.plan.advice import pool_diagnostic
from ttbundle.plan.make import check_mesh, kv_blocks, make_plan
from ttbundle.plan.memory import tensor_bytes
from ttbundle.kvpool import pool_blocks, pool_tokens
from ttbundle.errors import InvalidInput

TILE = 32
TILE_BYTES = {"bf16": 32 * 32 * 2, "bfp8": 32 * 32 + 64, "bfp4": 32 * 32 // 2 + 64}
WH = dict(banks=12, align=32, dram=12 * 1_072_693_184)
BH = dict(banks=8, align=64, dram=8 * 4_277_141_376)


def dram(pages: int, page_bytes: int, chip=WH) -> int:
    """Interleaved buffer: every bank reserves ceil(pages / banks) aligned pages."""
    aligned = -(-page_bytes // chip["align"]) * chip["align"]
    return chip["banks"] * math.ceil(pages / chip["banks"]) * aligned


def tiles(rows: int, cols: int, lead: int = 1) -> int:
    return lead * math.ceil(rows / TILE) * math.ceil(cols / TILE)


def tile_bytes(shape, dtype="bf16", chip=WH) -> int:
    *lead, r, c = shape
    return dram(tiles(r, c, math.prod(lead)), TILE_BYTES[dtype], chip)


def row_major_bytes(shape, chip=WH) -> int:
    """bf16 ROW_MAJOR: a page per row; a 1-D tensor is stored as rows of 32."""
    if len(shape) == 1:
        return dram(math.ceil(shape[0] / 32), 32 * 2, chip)
    return dram(math.prod(shape[:-1]), shape[-1] * 2, chip)


def plan_of(changes=None, mesh="N150", base=None):
    text = spec_text(deep_update({"targets": [mesh]}, changes or {}), base=base)
    b = spec.loads(text, SPEC_FILE)
    return b, make_plan(b, mesh)


def by_name(p):
    return {t.name: t for t in p.tensors}


# ---- the allocator arithmetic itself -------------------------------------------------------------
def test_bf16_tile_tensor_on_wormhole():
    # [4096, 512] = 128 x 16 = 2048 tiles; 12 banks x ceil(2048 / 12) = 171 pages x 2048 B
    assert tensor_bytes([4096, 512], "bf16", "TILE", meshmod.resolve("N150")) == 12 * 171 * 2048


@pytest.mark.parametrize("dtype, per_tile", [("bf16", 2048), ("bfp8", 1088), ("bfp4", 576)])
def test_block_float_tile_sizes(dtype, per_tile):
    assert TILE_BYTES[dtype] == per_tile  # the notes' numbers, derived above from 32x32 elements
    # 24 tiles fill 12 banks exactly twice; 25 tiles take a third page in every bank
    m = meshmod.resolve("N150")
    assert tensor_bytes([32 * 4, 32 * 6], dtype, "TILE", m) == 24 * per_tile
    assert tensor_bytes([32 * 5, 32 * 5], dtype, "TILE", m) == 36 * per_tile


def test_partial_tiles_are_padded():
    # [40, 70] pads to [64, 96]: 2 x 3 = 6 tiles -> 1 page in each of 12 banks
    assert tensor_bytes([40, 70], "bf16", "TILE", meshmod.resolve("N150")) == 12 * 2048


def test_blackhole_banks_and_alignment():
    p150 = meshmod.resolve("P150")
    # 8 banks; a ROW_MAJOR page of 48 bf16 = 96 B is aligned to 128 B on Blackhole (64 B alignment)
    assert tensor_bytes([10, 48], "bf16", "ROW_MAJOR", p150) == 8 * 2 * 128
    assert tensor_bytes([10, 48], "bf16", "ROW_MAJOR", meshmod.resolve("N150")) == 12 * 1 * 96
    assert tensor_bytes([4096, 512], "bfp8", "TILE", p150) == 8 * 256 * 1088


def test_kv_pool_blocks_formula():
    # Tenstorrent's: ceil((max_tokens_all_users + block_size x max_num_seqs) / block_size)
    rt = spec.Runtime(max_model_len=2048, max_num_seqs=32, kv_block_size=32)
    assert pool_blocks(rt, 32 * 2048) == (32 * 2048 + 32 * 32) // 32 == 2080
    assert pool_tokens(rt, 2080) == 32 * 2048
    rt = spec.Runtime(max_model_len=1000, max_num_seqs=3, kv_block_size=64)
    assert pool_blocks(rt, 1000) == math.ceil((1000 + 64 * 3) / 64) == 19


# ---- per-device shapes and bytes on each mesh ----------------------------------------------------
# TINY: d=512, 8 heads x 64, 2 KV heads, intermediate 1536, vocab 4096, 2 layers.
# Default plan: embed [null, cols]; wq/wk/wv/w1/w3/lm_head [rows, cols]; wo/w2 [cols, rows].
D, H, HD, KV, I, V, L = 512, 8, 64, 2, 1536, 4096, 2


def expected_shapes(rows: int, cols: int, kv_per_dev: int) -> dict[str, list[int]]:
    return {
        "embed": [V, D // cols],
        "lm_head": [D // rows, V // cols],
        "wq": [D // rows, H // cols * HD], "wo": [H // cols * HD, D // rows],
        "wk": [D // rows, kv_per_dev * HD], "wv": [D // rows, kv_per_dev * HD],
        "w1": [D // rows, I // cols], "w3": [D // rows, I // cols], "w2": [I // cols, D // rows],
        "final_norm": [D], "attn_norm": [D], "ffn_norm": [D],
    }


# mesh -> (rows, cols, KV heads per device): 2 KV heads over 8 (T3K) or 4 (TG) cols are replicated
MESHES = {"N150": (1, 1, 2), "N300": (1, 2, 1), "T3K": (1, 8, 1), "TG": (8, 4, 1)}
DTYPES = {"attention": "bfp8", "mlp": "bfp4", "lm_head": "bfp8"}
GROUP = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention",
         "w1": "mlp", "w3": "mlp", "w2": "mlp", "lm_head": "lm_head"}


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "bfp8-bfp4"])
def test_per_device_shapes_and_bytes(mesh, mixed):
    rows, cols, kv_dev = MESHES[mesh]
    _, p = plan_of({"weights": {"dtypes": DTYPES}} if mixed else None, mesh)
    got = by_name(p)
    shapes = expected_shapes(rows, cols, kv_dev)
    assert set(got) == set(shapes)
    weights = {"bf16": 0, "bfp8": 0, "bfp4": 0}
    for name, shape in shapes.items():
        t = got[name]
        assert t.device_shape == shape, name
        count = 1 if name in ("embed", "lm_head", "final_norm") else L
        assert t.count == count, name
        if name == "embed" or name.endswith("norm"):
            assert (t.layout, t.dtype) == ("ROW_MAJOR", "bf16")
            nbytes = row_major_bytes(shape)
        else:
            dtype = DTYPES[GROUP[name]] if mixed else "bf16"
            assert (t.layout, t.dtype) == ("TILE", dtype), name
            nbytes = tile_bytes(shape, dtype)
        assert t.bytes_per_copy == nbytes, name
        assert t.bytes == nbytes * count
        weights[t.dtype] += nbytes * count
    assert p.memory.weights == sum(weights.values())
    assert p.memory.weights_by_dtype == {k: v for k, v in weights.items() if v}


def test_concrete_bytes_for_t3k_bfp8_and_bfp4():
    """Spelled out once: T3K w1 is [512, 1536/8=192] -> 16 x 6 = 96 tiles = 8 pages per bank."""
    _, p = plan_of({"weights": {"dtypes": DTYPES}}, "T3K")
    t = by_name(p)
    assert t["w1"].bytes_per_copy == 12 * 8 * 576
    assert t["wq"].bytes_per_copy == 12 * math.ceil(16 * 2 / 12) * 1088  # [512, 64]: 32 tiles
    assert t["lm_head"].bytes_per_copy == 12 * math.ceil(16 * 16 / 12) * 1088  # [512, 512]
    assert t["embed"].bytes_per_copy == 12 * math.ceil(4096 / 12) * 128  # 4096 rows of 64 bf16


def test_notation():
    _, p = plan_of(None, "TG")
    t = by_name(p)
    assert t["w1"].notation() == "bf16[512@rows, 1536@cols]"
    assert t["wo"].notation() == "bf16[512@cols, 512@rows]"
    assert t["embed"].notation() == "bf16[4096, 512@cols]"
    assert t["final_norm"].notation() == "bf16[512]"


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("kv_dtype", ["bf16", "bfp8"])
def test_kv_cache_bytes(mesh, kv_dtype):
    rows, cols, kv_dev = MESHES[mesh]
    _, p = plan_of({"runtime": {"kv_cache_dtype": kv_dtype}}, mesh)
    blocks = math.ceil((32 * 2048 + 32 * 32) / 32)
    per_layer = tile_bytes([blocks, kv_dev, 32, HD], kv_dtype)  # [blocks, heads/dev, block, head_dim]
    assert p.kv["num_blocks"] == blocks == 2080
    assert [e["device_shape"] for e in p.kv["entries"]] == [[blocks, kv_dev, 32, HD]] * 2
    assert p.memory.kv_cache == 2 * L * per_layer  # K and V of every layer


def test_kv_cache_scales_with_sequences_and_length():
    _, p = plan_of({"runtime": {"max_model_len": 1024, "max_num_seqs": 8, "kv_block_size": 64},
                    "buckets": {"decode": [1, 8], "prefill_chunk": 128, "prefill": [128, 512]}})
    blocks = math.ceil((8 * 1024 + 64 * 8) / 64)  # 136
    assert p.kv["num_blocks"] == blocks
    assert p.memory.kv_cache == 2 * L * tile_bytes([blocks, KV, 64, HD])


def test_explicit_pool_sets_the_blocks():
    _, p = plan_of({"runtime": {"max_tokens_all_users": 5000}})
    blocks = math.ceil((5000 + 32 * 32) / 32)  # 189: the pool plus one spare block per sequence
    assert p.kv["num_blocks"] == blocks and p.kv["max_tokens_all_users"] == 5000
    assert p.kv["pool_chosen"] == "spec"
    assert p.memory.kv_cache == 2 * L * tile_bytes([blocks, KV, 32, HD])
    # kv_blocks is what the worker and the ttnn backend use: the same number
    b, _ = plan_of({"runtime": {"max_tokens_all_users": 5000}})
    assert kv_blocks(b, "N150") == blocks


def test_auto_pool_is_the_largest_that_fits():
    """A context of 512k tokens x 32 sequences cannot fit one chip; the pool is what is left
    after weights, activations and trace region, in whole blocks."""
    changes = {"model": {"max_position_embeddings": 1 << 19}, "runtime": {"max_model_len": 1 << 19}}
    for pool in (None, "auto"):
        ch = deep_update(changes, {"runtime": {"max_tokens_all_users": pool}} if pool else {})
        _, p = plan_of(ch)
        m = p.memory
        left = WH["dram"] - m.weights - m.activations - m.trace_region
        # a block per layer and K/V: [1, 2 heads, 32, 64] bf16 = 4 tiles; 2 x L buffers of
        # [blocks, 2, 32, 64] take ceil(4 x blocks / 12) pages per bank of 2 KiB, 12 banks
        pages_per_bank = left // (2 * L * 12 * 2048)
        blocks = pages_per_bank * 12 // 4
        assert 2 * L * tile_bytes([blocks, KV, 32, HD]) <= left < 2 * L * tile_bytes([blocks + 1, KV, 32, HD])
        assert p.kv["num_blocks"] == blocks and p.fits
        assert 1 << 19 <= p.kv["max_tokens_all_users"] == blocks * 32 - 32 * 32 < 32 << 19
        assert p.kv["pool_chosen"] == "auto" and "largest pool" in p.kv["pool_why"]
        # one block more, explicitly, does not fit
        _, q = plan_of(deep_update(changes, {"runtime": {"max_tokens_all_users": (blocks + 1) * 32 - 32 * 32}}))
        assert not q.fits


def test_auto_pool_is_capped_at_every_sequence_at_full_length():
    _, p = plan_of({"runtime": {"max_tokens_all_users": "auto"}})
    assert p.kv["max_tokens_all_users"] == 32 * 2048 and p.kv["num_blocks"] == 2080
    assert "every sequence at full length" in p.kv["pool_why"]


def test_pool_below_max_model_len_is_refused_at_its_line():
    text = spec_text({"runtime": {"max_tokens_all_users": 1000}})
    with pytest.raises(InvalidInput) as e:
        spec.loads(text, SPEC_FILE)
    (d,) = e.value.diagnostics
    assert (d.path, d.line) == ("runtime.max_tokens_all_users", line_of(text, "max_tokens_all_users"))
    assert "max_tokens_all_users=1000 is below max_model_len=2048" in d.message
    assert "at least 2048" in d.message and "auto" in d.message


def test_explicit_pool_that_does_not_fit_gets_the_arithmetic_and_the_largest_that_fits():
    text = spec_text({"runtime": {"max_tokens_all_users": 50_000_000}})
    b = spec.loads(text, SPEC_FILE)
    p = make_plan(b, "N150")
    assert not p.fits
    d = pool_diagnostic(b, p)
    assert (d.path, d.line) == ("runtime.max_tokens_all_users", line_of(text, "max_tokens_all_users"))
    m = re.search(r"fix: max_tokens_all_users: (\d+) \(the largest that fits\)", d.message)
    best = int(m.group(1))
    assert f"{p.memory.kv_cache / 2**30:.2f} GiB per chip" in d.message
    ok = make_plan(spec.loads(spec_text({"runtime": {"max_tokens_all_users": best}}), SPEC_FILE), "N150")
    over = make_plan(spec.loads(spec_text({"runtime": {"max_tokens_all_users": best + 32}}), SPEC_FILE), "N150")
    assert ok.fits and not over.fits
    # the same number is among `plan`'s fixes
    assert any(f.startswith(f"runtime.max_tokens_all_users: 50000000 -> {best} ") for f in advice.fixes(b, p))


def acts_bytes(widths, tokens=512) -> int:
    """Each activation its own bf16 TILE buffer [tokens, width] (whole pages per bank), plus one
    tile row of logits over the full vocabulary."""
    return sum(tile_bytes([tokens, w]) for w in widths) + tile_bytes([32, V])


def test_activations_on_n150_and_n300():
    # Every named activation of one decoder layer live at once for the largest prefill shape
    # (min(largest bucket, chunk) = 512 tokens, bf16), plus one tile row of logits (the decode
    # batch padded to 32 rows) over the full vocabulary.
    # N150: h, x, attn_out, x2, mlp_out (D each); q, o (H*HD); k, v (KV*HD); g, u, gu (I).
    widths = [D] * 5 + [H * HD] * 2 + [KV * HD] * 2 + [I] * 3
    _, p = plan_of(None, "N150")
    assert p.activation_tokens == 512
    assert p.memory.activations == acts_bytes(widths)
    assert sorted(w for _, (t, w) in p.activation_buffers[:-1]) == sorted(widths)
    # N300 (cols=2): q, o, k, v, g, u, gu are split in half; the residual-stream ones are not.
    widths = [D] * 5 + [H * HD // 2] * 2 + [KV * HD // 2] * 2 + [I // 2] * 3
    _, p = plan_of(None, "N300")
    assert p.memory.activations == acts_bytes(widths)


def test_replicated_kv_heads_count_one_whole_head_per_device():
    # T3K: 2 KV heads replicated over 8 devices -> k and v hold one 64-wide head on each device
    widths = [D] * 5 + [H * HD // 8] * 2 + [1 * HD] * 2 + [I // 8] * 3
    _, p = plan_of(None, "T3K")
    assert p.memory.activations == acts_bytes(widths)


def test_trace_region_estimate():
    # 8 KiB per captured op (collectives included) per trace, rounded up to whole MiB.
    # N150 has no collectives: embed (1 op) + 2 layers x 13 ops + head (norm, lm_head, logits).
    ops = 1 + L * 13 + 3
    for mode, traces in (("all", 2 + 3), ("decode_only", 3), ("none", 0)):
        _, p = plan_of({"runtime": {"trace_mode": mode}})
        assert p.num_traces == traces
        assert p.trace_region_size == math.ceil(traces * ops * 8192 / 2**20) * 2**20
        assert p.memory.trace_region == trace_dram(p.trace_region_size)
    _, p = plan_of({"runtime": {"trace_region_size": 50_000_000}})
    assert p.trace_region_size == 50_000_000
    # each of the 12 banks gives ceil(50e6 / 12) = 4,166,667 B rounded up to 8 KiB: 4,169,728 B
    assert p.memory.trace_region == 12 * 4_169_728 == 50_036_736


def trace_dram(size: int, chip=WH) -> int:
    """The trace region ttnn carves out of every DRAM bank: ceil(size / banks) rounded to 8 KiB."""
    return chip["banks"] * math.ceil(math.ceil(size / chip["banks"]) / 8192) * 8192


@pytest.mark.parametrize("mesh", MESHES)
def test_total_and_fit(mesh):
    _, p = plan_of(None, mesh)
    m = p.memory
    assert m.total == m.weights + m.kv_cache + m.activations + m.trace_region
    assert m.dram == WH["dram"] and p.fits and m.free == m.dram - m.total


# ---- collectives ---------------------------------------------------------------------------------
def ring_all_reduce(payload: int, n: int) -> int:
    return 2 * (n - 1) * payload // n


def all_gather(payload: int, n: int) -> int:
    return (n - 1) * payload


def collectives(p):
    return sorted((c.layer, c.kind, c.axes, c.devices, c.payload_bytes_per_token,
                   c.traffic_bytes_per_token, c.count) for c in p.collectives)


def test_single_chip_has_no_collectives():
    _, p = plan_of(None, "N150")
    assert p.collectives == [] and p.decode_traffic_bytes_per_token == 0


@pytest.mark.parametrize("mesh, n", [("N300", 2), ("N150x4", 4), ("T3K", 8)])
def test_collectives_on_a_line_of_chips(mesh, n):
    # 1 x n: the embedding's hidden shards are gathered; each layer's attention and MLP outputs are
    # partial sums over cols (wo / w2 split their input dim) -> one all_reduce each; the logits'
    # vocab shards are gathered for sampling. Payload = per-device bf16 bytes per token.
    _, p = plan_of(None, mesh)
    emb, red, logits = D // n * 2, D * 2, V // n * 2
    want = sorted([
        ("embedding", "all_gather", ("cols",), n, emb, all_gather(emb, n), 1),
        ("decoder", "all_reduce", ("cols",), n, red, ring_all_reduce(red, n), L),
        ("decoder", "all_reduce", ("cols",), n, red, ring_all_reduce(red, n), L),
        ("head", "all_gather", ("cols",), n, logits, all_gather(logits, n), 1),
    ])
    assert collectives(p) == want
    assert p.decode_traffic_bytes_per_token == sum(w[5] * w[6] for w in want)
    if mesh == "T3K":  # spelled out: 7*128 + 2*2*(2*7/8*1024) + 7*1024
        assert p.decode_traffic_bytes_per_token == 896 + 4 * 1792 + 7168 == 15232


def test_collectives_on_galaxy():
    # TG 8x4 with 4 KV heads (one per col, no replication). The residual stream is replicated, the
    # weights split their input dim over rows (8) and their output over cols (4):
    # - q, k, v, g, u come out as partial sums over rows -> all_reduce(rows) before attention/SwiGLU;
    # - attn_out/mlp_out (wo, w2: [cols, rows]) are partial over cols and split over rows ->
    #   all_reduce(cols) then all_gather(rows) into the residual;
    # - logits: partial over rows, split over cols -> all_reduce(rows) then all_gather(cols).
    _, p = plan_of({"model": {"num_key_value_heads": 4}}, "TG")
    r, c = 8, 4
    q, k, g = H * HD // c * 2, 4 * HD // c * 2, I // c * 2
    out = D // r * 2
    emb, logits = D // c * 2, V // c * 2
    want = sorted([
        ("embedding", "all_gather", ("cols",), c, emb, all_gather(emb, c), 1),
        ("decoder", "all_reduce", ("rows",), r, q, ring_all_reduce(q, r), L),
        ("decoder", "all_reduce", ("rows",), r, k, ring_all_reduce(k, r), L),
        ("decoder", "all_reduce", ("rows",), r, k, ring_all_reduce(k, r), L),
        ("decoder", "all_reduce", ("rows",), r, g, ring_all_reduce(g, r), L),
        ("decoder", "all_reduce", ("rows",), r, g, ring_all_reduce(g, r), L),
        ("decoder", "all_reduce", ("cols",), c, out, ring_all_reduce(out, c), L),
        ("decoder", "all_reduce", ("cols",), c, out, ring_all_reduce(out, c), L),
        ("decoder", "all_gather", ("rows",), r, out, all_gather(out, r), L),
        ("decoder", "all_gather", ("rows",), r, out, all_gather(out, r), L),
        ("head", "all_reduce", ("rows",), r, logits, ring_all_reduce(logits, r), 1),
        ("head", "all_gather", ("cols",), c, logits, all_gather(logits, c), 1),
    ])
    assert collectives(p) == want
    assert p.decode_traffic_bytes_per_token == sum(w[5] * w[6] for w in want) == 22016
    # trace estimate counts the collectives as captured ops: embed 1+1, layer 13+9, head 3+2
    ops = 2 + L * 22 + 5
    assert p.trace_region_size == math.ceil(5 * ops * 8192 / 2**20) * 2**20
    assert p.memory.trace_region == trace_dram(p.trace_region_size)


def test_replicating_a_weight_removes_its_collective():
    # MLP fully replicated on T3K: no partial sums after w2, so only attention's all_reduce remains
    _, p = plan_of({"sharding": {"targets": {"T3K": {"w1": [None, None], "w3": [None, None],
                                                     "w2": [None, None]}}}}, "T3K")
    assert [(c.layer, c.op, c.kind) for c in p.collectives if c.layer == "decoder"] == \
        [("decoder", "residual += attn_out", "all_reduce")]
    assert by_name(p)["w1"].device_shape == [D, I]


# ---- divisibility and head/vocab policies --------------------------------------------------------
HEADS_28 = {"model": {"hidden_size": 28 * 128, "num_attention_heads": 28, "num_key_value_heads": 4,
                      "intermediate_size": 18944}}


def plan_error(changes, mesh):
    text = spec_text(deep_update({"targets": [mesh]}, changes))
    b = spec.loads(text, SPEC_FILE)
    with pytest.raises(InvalidInput) as ei:
        make_plan(b, mesh)
    assert ei.value.message == f"{SPEC_FILE}: sharding plan does not fit {meshmod.resolve(mesh).describe()}"
    return text, ei.value.diagnostics


def test_28_heads_on_t3k_shows_the_arithmetic_and_the_fix():
    text, diags = plan_error(HEADS_28, "T3K")
    (d,) = diags
    assert "num_attention_heads=28 is not divisible by mesh axis cols=8 (T3K 1x8)" in d.message
    assert d.message.startswith("wq, wo (family default plan): ")
    assert "fix: sharding.attention_heads: pad" in d.message and "replicate that dim (null)" in d.message
    # a family-default plan is blamed on the target that asked for the mesh
    assert (d.path, d.line, d.col) == ("targets.0", line_of(text, "- T3K"), col_of(text, "- T3K"))


def test_28_heads_fit_two_chips_and_pad_on_eight():
    _, p = plan_of(HEADS_28, "N300")
    assert by_name(p)["wq"].device_shape == [3584, 14 * 128]
    _, p = plan_of(deep_update(HEADS_28, {"sharding": {"attention_heads": "pad"}}), "T3K")
    wq = by_name(p)["wq"]
    assert wq.device_shape == [3584, 32 // 8 * 128]
    # 4 KV heads replicated on 2 devices each: every KV head's 7 query heads split 4 + 4 (padded)
    assert any(n.startswith("query heads padded 28 -> 32") for n in wq.notes)


def test_error_in_an_override_points_at_the_override():
    text, diags = plan_error(deep_update(HEADS_28, {"sharding": {"plan": {"wq": [None, "cols"]}}}), "T3K")
    (d,) = diags
    assert d.path == "sharding.plan.wq" and d.line == line_of(text, "wq:")
    assert "(family default plan)" not in d.message


def test_several_divisibility_errors_at_once():
    text, diags = plan_error(deep_update(HEADS_28, {"model": {"intermediate_size": 1540}}), "T3K")
    msgs = sorted(d.message for d in diags)
    assert len(msgs) == 2
    assert msgs[0].startswith("w1, w3, w2 (family default plan): intermediate_size=1540 is not "
                              "divisible by mesh axis cols=8 (T3K 1x8); fix: replicate that dim (null)")
    assert "num_attention_heads=28" in msgs[1]


def test_hidden_over_galaxy_rows():
    _, diags = plan_error({"model": {"hidden_size": 516, "head_dim": 64}}, "TG")
    assert any("hidden_size=516 is not divisible by mesh axis rows=8 (TG 8x4)" in d.message for d in diags)


@pytest.mark.parametrize("policy, kv, heads, mesh, per_dev, note", [
    ("replicate", 2, 8, "T3K", 1, "each KV head replicated on 4 devices"),
    ("replicate", 2, 8, "TG", 1, "each KV head replicated on 2 devices"),
    ("pad", 2, 8, "T3K", 1, "KV heads padded 2 -> 8"),
    ("pad", 3, 12, "T3K", 1, "KV heads padded 3 -> 8"),
    ("pad", 3, 12, "TG", 1, "KV heads padded 3 -> 4"),
    ("replicate", 4, 8, "N150x4", 1, None),  # divides: nothing to do
])
def test_kv_head_policies(policy, kv, heads, mesh, per_dev, note):
    changes = {"model": {"num_key_value_heads": kv, "num_attention_heads": heads, "hidden_size": heads * 64},
               "sharding": {"kv_heads": policy, "attention_heads": "pad"}}
    _, p = plan_of(changes, mesh)
    wk = by_name(p)["wk"]
    assert wk.device_shape[1] == per_dev * HD
    assert (note in wk.notes) if note else not wk.notes
    assert all(e["device_shape"][1] == per_dev for e in p.kv["entries"])


def test_kv_heads_that_cannot_replicate_or_are_refused():
    changes = {"model": {"num_key_value_heads": 3, "num_attention_heads": 12, "hidden_size": 768},
               "sharding": {"attention_heads": "pad"}}
    _, diags = plan_error(changes, "T3K")
    (d,) = diags
    assert ("num_key_value_heads=3 is not divisible by mesh axis cols=8 (T3K 1x8), and 8 is not a "
            "multiple of 3 so heads cannot be replicated; use sharding.kv_heads: pad") in d.message
    _, diags = plan_error({"sharding": {"kv_heads": "error"}}, "T3K")
    (d,) = diags
    assert "num_key_value_heads=2 is not divisible by mesh axis cols=8 (T3K 1x8)" in d.message
    assert "fix: sharding.kv_heads: replicate or pad" in d.message


@pytest.mark.parametrize("vocab", [4100, 4160])
def test_vocab_pads_to_whole_tiles_per_device(vocab):
    # 4100 does not divide by 8; 4160 does (520 per device) but not in whole 32-wide tiles.
    padded = math.ceil(vocab / (8 * 32)) * 8 * 32  # 4352
    _, p = plan_of({"model": {"vocab_size": vocab}}, "T3K")
    lm = by_name(p)["lm_head"]
    assert lm.device_shape == [D, padded // 8] and padded // 8 % 32 == 0
    assert f"vocab padded {vocab} -> {padded}" in lm.notes
    assert lm.bytes_per_copy == tile_bytes([D, padded // 8])
    _, diags = plan_error({"model": {"vocab_size": vocab}, "sharding": {"vocab": "error"}}, "T3K")
    (d,) = diags
    assert d.message.startswith(f"lm_head (family default plan): vocab_size={vocab}")
    assert "fix: sharding.vocab: pad" in d.message


def test_vocab_that_splits_in_tiles_is_not_padded():
    _, p = plan_of({"model": {"vocab_size": 128256}, "sharding": {"vocab": "error"}}, "T3K")
    assert by_name(p)["lm_head"].device_shape == [D, 16032] and 16032 % 32 == 0


def test_per_target_override_applies_to_that_target_only():
    changes = {"targets": ["N300", "T3K"],
               "sharding": {"targets": {"T3K": {"w1": [None, None]}}}}
    b = spec.loads(spec_text(changes), SPEC_FILE)
    assert by_name(make_plan(b, "T3K"))["w1"].device_shape == [D, I]
    assert by_name(make_plan(b, "N300"))["w1"].device_shape == [D, I // 2]


def test_override_keyed_by_a_tuple_target_as_written():
    changes = {"targets": ["(1, 8)"], "sharding": {"targets": {"(1, 8)": {"w1": [None, None]}}}}
    b = spec.loads(spec_text(changes), SPEC_FILE)
    assert by_name(make_plan(b, "(1, 8)"))["w1"].device_shape == [D, I]


# ---- does not fit: the user story ----------------------------------------------------------------
def l70_per_chip_weights_bf16_t3k() -> int:
    """Llama-3.1-70B, bf16, T3K (1x8): hand-computed per-chip weight bytes."""
    d, h, kv, hd, inter, v, layers = 8192, 64, 8, 128, 28672, 128256, 80
    n = 8
    per_layer = (
        2 * tile_bytes([d, h // n * hd])          # wq [8192, 1024], wo [1024, 8192]
        + 2 * tile_bytes([d, kv // n * hd])       # wk, wv: one KV head each [8192, 128]
        + 3 * tile_bytes([d, inter // n])         # w1, w3 [8192, 3584], w2 [3584, 8192]
        + 2 * row_major_bytes([d])                # attn_norm, ffn_norm
    )
    return (layers * per_layer
            + row_major_bytes([v, d // n])        # embed [128256, 1024] ROW_MAJOR
            + tile_bytes([d, v // n])             # lm_head [8192, 16032]
            + row_major_bytes([d]))               # final_norm


def l70(changes=None, mesh="T3K"):
    b = spec.loads(spec_text(changes, base=LLAMA_70B), SPEC_FILE)
    return b, make_plan(b, mesh)


def test_llama_70b_bf16_on_t3k_does_not_fit():
    b, p = l70()
    weights = l70_per_chip_weights_bf16_t3k()
    assert p.memory.weights == weights
    assert weights > 16 * 2**30  # 70.6e9 params x 2 B / 8 chips
    # KV: the weights leave nothing, so the auto pool is its minimum, one max_model_len=4096
    # sequence plus a spare block per sequence; one KV head of 128 per chip, bf16, 80 layers
    blocks = math.ceil((4096 + 32 * 32) / 32)
    assert p.memory.kv_cache == 2 * 80 * tile_bytes([blocks, 1, 32, 128])
    assert p.kv["max_tokens_all_users"] == 4096 and "not even one" in p.kv["pool_why"]
    assert p.memory.dram == WH["dram"]
    assert not p.fits and p.memory.total > WH["dram"]
    top = [name for name, _ in p.consumers()[:4]]
    assert {"w1 (bf16, x80)", "w3 (bf16, x80)", "w2 (bf16, x80)"} <= set(top)
    assert [n for _, n in p.consumers()] == sorted((n for _, n in p.consumers()), reverse=True)


def apply_fix(fix: str, base_changes: dict):
    """The spec change a fix line describes -> (changes, mesh or None)."""
    m = re.match(r"weights\.dtypes: (\{[^}]*\}): ", fix)
    if m:
        return deep_update(base_changes, {"weights": {"dtypes": yaml.safe_load(m.group(1))}}), None
    m = re.match(r"a bigger mesh: (\S+) ", fix)
    if m:
        return base_changes, m.group(1)
    m = re.match(r"runtime\.(\w+): (\d+) -> (\d+) ", fix)
    if m:
        return deep_update(base_changes, {"runtime": {m.group(1): int(m.group(3))}}), None
    raise AssertionError(f"fix not understood: {fix}")


def check_fixes(base: dict, changes: dict, mesh: str):
    b = spec.loads(spec_text(changes, base=base), SPEC_FILE)
    p = make_plan(b, mesh)
    assert not p.fits
    fixes = advice.fixes(b, p)
    assert fixes
    results = []
    for fix in fixes:
        new_changes, new_mesh = apply_fix(fix, changes)
        q = make_plan(spec.loads(spec_text(new_changes, base=base), SPEC_FILE), new_mesh or mesh)
        claims_fit = "(fits)" in fix or fix.startswith(("a bigger mesh", "runtime."))
        assert q.fits == claims_fit, fix
        if "still" in fix:
            assert re.search(r"\(still [\d.]+ GiB over\)$", fix), fix
        results.append((fix, new_changes, new_mesh, q))
    assert any(q.fits for *_, q in results)
    return p, results


def test_llama_70b_fixes_really_fit():
    p, results = check_fixes(LLAMA_70B, {}, "T3K")
    fixes = [f for f, *_ in results]
    # bfp8 weights leave room for a KV pool (auto: the largest that fits), so that is enough
    assert fixes[0].startswith("weights.dtypes: {attention: bfp8, mlp: bfp8, lm_head: bfp8}: ")
    assert fixes[0].endswith("(fits)")
    assert not any(f.startswith("weights.dtypes: {attention: bfp8, mlp: bfp4") for f in fixes)
    # the weights figures quoted are the re-planned ones
    q = results[0][3]
    assert f"-> {q.memory.weights / 2**30:.2f} GiB per chip" in fixes[0]
    assert q.kv["max_tokens_all_users"] >= 4096
    # the bigger mesh is the smallest Wormhole preset that fits
    (mesh_fix,) = [r for r in results if r[2]]
    chosen = meshmod.resolve(mesh_fix[2])
    assert chosen.chip.arch == "wormhole_b0" and chosen.num_devices > 8
    b = spec.loads(spec_text(base=LLAMA_70B), SPEC_FILE)
    for m in meshmod.PRESETS.values():
        if m.chip.arch == "wormhole_b0" and 8 < m.num_devices < chosen.num_devices:
            assert not make_plan(b, m).fits, m.name
    # weights alone exceed the chip, so shrinking the KV cache is not offered
    assert not any(f.startswith("runtime.") for f in fixes)


def test_kv_bound_spec_gets_the_largest_length_that_fits():
    """An auto pool that cannot hold even one max_model_len sequence: the fix is the longest
    context whose single sequence fits (the pool then takes what is left)."""
    changes = {"model": {"max_position_embeddings": 1 << 25}, "runtime": {"max_model_len": 1 << 24}}
    p, results = check_fixes(TINY, changes, "N150")
    assert p.memory.kv_cache > p.memory.total - p.memory.dram  # KV alone could absorb the excess
    by_field = {}
    for fix, new_changes, _, q in results:
        m = re.match(r"runtime\.(\w+): (\d+) -> (\d+) ", fix)
        if m:
            by_field[m.group(1)] = int(m.group(3))
    assert "max_model_len" in by_field
    # largest: one block more no longer fits
    mml = by_field["max_model_len"]
    assert mml % 32 == 0
    b = spec.loads(spec_text(deep_update(changes, {"runtime": {"max_model_len": mml + 32}})), SPEC_FILE)
    assert not make_plan(b, "N150").fits


def test_full_length_pool_gets_the_largest_sequence_count_that_fits():
    """A pool pinned to every sequence at full length (the pre-pool sizing) that does not fit:
    `plan` offers the largest pool that fits, checked by re-planning."""
    changes = {"model": {"max_position_embeddings": 1 << 20},
               "runtime": {"max_model_len": 1 << 19, "max_tokens_all_users": 32 << 19}}
    p, results = check_fixes(TINY, changes, "N150")
    fixes = [f for f, *_ in results]
    assert any(f.startswith("runtime.max_tokens_all_users: ") for f in fixes)


def test_check_mesh_returns_located_diagnostics():
    b = spec.loads(spec_text(deep_update(HEADS_28, {"targets": ["N300", "T3K"]})), SPEC_FILE)
    assert check_mesh(b, "N300") == []
    (d,) = check_mesh(b, "T3K")
    assert d.path == "targets.1" and d.file == SPEC_FILE


def test_plan_json_shape():
    _, p = plan_of(None, "T3K")
    j = p.to_json()
    assert j["fits"] is True and j["mesh"]["shape"] == [1, 8] and j["mesh"]["devices"] == 8
    assert j["mesh"]["dram_bytes_per_chip"] == WH["dram"]
    assert len(j["per_chip"]) == 8 and {c["bytes"] for c in j["per_chip"]} == {j["memory"]["total"]}
    assert j["memory"]["free"] == WH["dram"] - j["memory"]["total"]
    wq = next(t for t in j["tensors"] if t["name"] == "wq")
    assert wq["spec"] == [["rows"], ["cols"]] and wq["device_shape"] == [D, HD]
