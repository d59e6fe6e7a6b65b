"""Spec validation: every error class, its message and its file:line:col; all errors at once;
mutated valid specs always end valid or in a located error (hypothesis)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from spec_helpers import DELETE, SPEC_FILE, TINY, col_of, deep_update, dump, line_of, spec_text
from ttbundle import mesh as meshmod, spec
from ttbundle.plan.advice import fixes
from ttbundle.plan.make import make_plan
from ttbundle.plan.sharding import sharding_diagnostics
from ttbundle.errors import InvalidInput


def one(diags):
    assert len(diags) == 1, "\n".join(map(str, diags))
    return diags[0]


def at(d, text: str, needle: str, nth: int = 1, col: bool = True):
    """``d`` points at the line (and column) where ``needle`` starts in ``text``."""
    assert d.file == SPEC_FILE
    assert d.line == line_of(text, needle, nth), str(d)
    if col:
        assert d.col == col_of(text, needle, nth), str(d)
    assert str(d).startswith(f"{SPEC_FILE}:{d.line}:{d.col}: {d.path}: ")


# ---- valid specs ---------------------------------------------------------------------------------
def test_tiny_spec_loads_with_defaults(load):
    b = load(spec_text())
    assert b.spec.name == "tiny" and b.arch.family == "llama"
    assert b.arch.hd == 512 // 8 and b.arch.kv_heads == 2
    rt = b.spec.runtime
    assert (rt.kv_block_size, rt.kv_cache_dtype, rt.trace_mode, rt.sample_on_device_mode) == \
        (32, "bf16", "all", "all")
    assert b.spec.sharding.kv_heads == "replicate" and b.spec.sharding.vocab == "pad"
    assert b.warnings == []


def test_minimal_spec_takes_family_buckets(load):
    b = load(spec_text({"buckets": DELETE, "runtime": DELETE, "description": DELETE}))
    assert b.spec.buckets is None
    assert b.buckets.prefill == [128, 1024] and b.buckets.decode == [1, 8, 32]
    assert b.buckets.prefill_chunk == 1024


def test_demo_bundle_validates():
    b = spec.load(Path(__file__).parent.parent / "bundles" / "demo.yaml")
    for t in b.spec.targets:
        assert make_plan(b, t).fits


def test_missing_spec_file(tmp_path):
    with pytest.raises(InvalidInput) as ei:
        spec.load(tmp_path / "nope.yaml")
    assert ei.value.message == f"{tmp_path / 'nope.yaml'}: no such spec file"


def test_unreadable_spec_file(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(InvalidInput) as ei:
        spec.load(p)
    assert "cannot read spec" in ei.value.message


# ---- schema errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, needle, path, hint", [
    ({"runtime": {"max_num_seq": 3}}, "max_num_seq:", "runtime.max_num_seq", "did you mean `max_num_seqs`?"),
    ({"model": {"hiden_size": 3}}, "hiden_size:", "model.hiden_size", "did you mean `hidden_size`?"),
    ({"bucket": {}}, "bucket:", "bucket", "did you mean `buckets`?"),
    ({"sharding": {"kv_head": "pad"}}, "kv_head:", "sharding.kv_head", "did you mean `kv_heads`?"),
    ({"weights": {"dtypes": {"atention": "bfp8"}}}, "atention:", "weights.dtypes.atention",
     "did you mean `attention`?"),
    ({"zzz": 1}, "zzz:", "zzz", "keys here: name, description, model, from_hf, tokenizer, weights, targets"),
    ({"sharding": {"plan[0]": 1}}, "plan[0]:", "sharding.plan[0]", "did you mean `plan`?"),
])
def test_unknown_key_with_hint(diagnostics, changes, needle, path, hint):
    text = spec_text(changes)
    d = one(diagnostics(text))
    assert d.path == path
    assert d.message.startswith("unknown key; ") and hint in d.message
    at(d, text, needle)


def test_unknown_family_names_the_tag_and_the_supported_ones(diagnostics):
    text = spec_text({"model": {"family": "lama"}})
    d = one(diagnostics(text))
    assert d.path == "model.family"
    assert d.message.startswith("unknown family 'lama'; supported: ") and "llama" in d.message
    assert "vocab_size" not in d.message  # not the whole model mapping
    at(d, text, "family: lama")


def test_missing_family(diagnostics):
    text = spec_text({"model": {"family": DELETE}})
    d = one(diagnostics(text))
    assert d.path == "model" and "missing `family`; one of: " in d.message and "llama" in d.message
    at(d, text, "model:")


@pytest.mark.parametrize("changes, path, needle", [
    ({"model": {"hidden_size": DELETE}}, "model.hidden_size", "model:"),
    ({"model": {"num_hidden_layers": DELETE}}, "model.num_hidden_layers", "model:"),
    ({"name": DELETE}, "name", "description:"),  # nearest existing ancestor: the document
    ({"targets": DELETE}, "targets", "name:"),
])
def test_missing_field(diagnostics, changes, path, needle):
    text = spec_text(changes)
    d = one(diagnostics(text))
    assert d.path == path and d.message == "required key is missing"
    assert d.line == line_of(text, needle)


@pytest.mark.parametrize("section, key, value, expected", [
    ("runtime", "trace_mode", "sometimes", "'all', 'decode_only' or 'none'"),
    ("runtime", "sample_on_device_mode", "decode", "'all', 'decode_only' or 'off'"),
    ("runtime", "kv_cache_dtype", "bfp4", "'bf16' or 'bfp8'"),
    ("sharding", "kv_heads", "drop", "'replicate', 'pad' or 'error'"),
    ("sharding", "attention_heads", "replicate", "'pad' or 'error'"),
    ("sharding", "vocab", "truncate", "'pad' or 'error'"),
])
def test_bad_enum_values(diagnostics, section, key, value, expected):
    text = spec_text({section: {key: value}})
    d = one(diagnostics(text))
    assert d.path == f"{section}.{key}"
    assert expected in d.message and f"got {value!r}" in d.message
    at(d, text, f"{key}: {value}")


@pytest.mark.parametrize("changes, needle, path, expected", [
    ({"weights": {"dtypes": {"mlp": "fp8"}}}, "mlp: fp8", "weights.dtypes.mlp", "'bf16', 'bfp8' or 'bfp4'"),
    ({"weights": {"dtypes": {"tensors": {"wo": "int8"}}}}, "wo: int8", "weights.dtypes.tensors.wo",
     "'bf16', 'bfp8' or 'bfp4'"),
    ({"model": {"hidden_act": "relu"}}, "hidden_act: relu", "model.hidden_act", "'silu'"),
    ({"model": {"rope_scaling": {"rope_type": "dynamic"}}}, "rope_type: dynamic",
     "model.rope_scaling.rope_type", "'llama3'"),
    ({"model": {"attention_bias": True}}, "attention_bias: true", "model.attention_bias", "False"),
    ({"runtime": {"max_num_seqs": "many"}}, "max_num_seqs: many", "runtime.max_num_seqs", "valid integer"),
    ({"runtime": {"max_model_len": 0}}, "max_model_len: 0", "runtime.max_model_len", "greater than 0"),
    ({"model": {"num_attention_heads": -8}}, "num_attention_heads: -8", "model.num_attention_heads",
     "greater than 0"),
    ({"targets": "T3K"}, "targets: T3K", "targets", "valid list"),
    ({"targets": []}, "targets: []", "targets", "at least 1 item"),
    ({"name": "Llama 70B!"}, "name: Llama 70B!", "name", "lowercase letters, digits"),
    ({"model": 5}, "model: 5", "model", "valid dictionary"),
])
def test_type_and_value_errors(diagnostics, changes, needle, path, expected):
    text = spec_text(changes)
    d = one(diagnostics(text))
    assert d.path == path and expected in d.message, str(d)
    assert "Value error," not in d.message
    at(d, text, needle, col=False)


def test_bad_partition_entry_is_one_readable_diagnostic(diagnostics):
    text = spec_text({"sharding": {"plan": {"wq": [None, "colz"], "wk": [None, ["rows", 5]]}}})
    diags = diagnostics(text)
    assert [d.path for d in diags] == ["sharding.plan.wq.1", "sharding.plan.wk.1.1"], \
        "\n".join(map(str, diags))
    assert diags[0].message == ("a PartitionSpec entry is null, an axis name (rows, cols) or a list "
                                "of axis names, got 'colz'")
    at(diags[0], text, "- colz")
    assert diags[1].message.endswith("got 5")
    at(diags[1], text, "- 5")


def test_schema_errors_are_all_reported(diagnostics):
    text = spec_text({"runtime": {"max_num_seq": 3, "trace_mode": "x"}, "model": {"family": "llama",
                      "hidden_size": "wide"}, "extra": True})
    diags = diagnostics(text)
    assert {d.path for d in diags} == {"runtime.max_num_seq", "runtime.trace_mode", "model.hidden_size", "extra"}
    assert len({d.line for d in diags}) == 4


# ---- semantic errors -----------------------------------------------------------------------------
def test_unknown_mesh_lists_the_valid_ones(diagnostics):
    text = spec_text({"targets": ["N150", "T3000"]})
    d = one(diagnostics(text))
    assert d.path == "targets.1"
    assert d.message.startswith("unknown mesh 'T3000'; valid: ")
    for name in ("N150", "N300", "N150x4", "T3K", "TG", "P100", "P150", "P150x2", "P300", "P150x4",
                 "P150x8", "P300x2", "BH-Galaxy", '"(R,C)"'):
        assert name in d.message
    at(d, text, "- T3000")


def test_duplicate_targets(diagnostics):
    text = spec_text({"targets": ["N150", "N150"]})
    d = one(diagnostics(text))
    assert d.path == "targets" and d.message == "targets are listed twice"
    at(d, text, "targets:")


def test_tuple_targets_are_valid(load):
    assert load(spec_text({"targets": ["(1,2)", "(2,2)@blackhole"]})).spec.targets == ["(1,2)", "(2,2)@blackhole"]


def test_sharding_plan_errors(diagnostics):
    text = spec_text({"targets": ["N150", "T3K"], "sharding": {
        "plan": {"wk": ["rows"], "wv": ["cols", "cols"], "w1": [["rows", "cols"], "rows"], "foo": [None]},
        "targets": {"P150": {"wq": [None, None]}, "T3K": {"bar": [None]}}}})
    diags = diagnostics(text)
    by_path = {}
    for d in diags:
        by_path.setdefault(d.path, []).append(d)
    assert len(diags) == 6, "\n".join(map(str, diags))
    (d,) = by_path["sharding.plan.wk"]
    assert d.message == ("has 1 entries but wk has 2 dims [hidden_size, num_key_value_heads]; "
                         "give one entry per dim")
    at(d, text, "wk:")
    (d,) = by_path["sharding.plan.wv"]
    assert d.message.startswith("uses a mesh axis on two dims")
    at(d, text, "wv:")
    (d,) = by_path["sharding.plan.w1"]
    assert d.message.startswith("uses a mesh axis on two dims")  # rows in a list and again alone
    (d,) = by_path["sharding.plan.foo"]
    assert d.message.startswith("unknown tensor 'foo' for family llama; tensors: embed, ")
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "lm_head", "attn_norm", "ffn_norm", "final_norm"):
        assert name in d.message
    at(d, text, "foo:")
    (d,) = by_path["sharding.targets.P150"]
    assert d.message == "'P150' is not one of targets (N150, T3K)"
    at(d, text, "P150:")
    (d,) = by_path["sharding.targets.T3K.bar"]
    assert d.message.startswith("unknown tensor 'bar'")
    at(d, text, "bar:")


def test_dtype_layout_errors(diagnostics):
    text = spec_text({"weights": {"dtypes": {"embedding": "bfp8", "norms": "bfp4",
                                             "tensors": {"attn_norm": "bfp8", "nope": "bf16"}}}})
    diags = diagnostics(text)
    msgs = {(d.path, d.message.split(":")[0]) for d in diags}
    assert msgs == {
        ("weights.dtypes.embedding", "embed cannot be bfp8"),
        ("weights.dtypes.norms", "final_norm cannot be bfp4"),
        ("weights.dtypes.norms", "ffn_norm cannot be bfp4"),
        ("weights.dtypes.tensors.attn_norm", "attn_norm cannot be bfp8"),  # the override wins
        ("weights.dtypes.tensors.nope", "unknown tensor 'nope'; tensors"),
    }, "\n".join(map(str, diags))
    emb = next(d for d in diags if d.path == "weights.dtypes.embedding")
    assert "ROW_MAJOR" in emb.message and emb.message.endswith("use bf16")
    at(emb, text, "embedding: bfp8")
    norm = next(d for d in diags if d.path == "weights.dtypes.norms")
    assert "1-D tensors are kept ROW_MAJOR" in norm.message
    at(norm, text, "norms: bfp4")


def test_block_float_default_keeps_embedding_and_norms_bf16(load):
    b = load(spec_text({"weights": {"dtypes": {"default": "bfp4", "attention": "bfp8"}}}))
    p = make_plan(b, "N150")
    dt = {t.name: t.dtype for t in p.tensors}
    assert dt["embed"] == dt["final_norm"] == dt["attn_norm"] == "bf16"
    assert dt["wq"] == "bfp8" and dt["w1"] == dt["lm_head"] == "bfp4"


@pytest.mark.parametrize("buckets, runtime, problems", [
    # (path, message start, needle for the line)
    ({"prefill": [512, 128]}, {}, [("buckets.prefill", "must be sorted and unique, got [512, 128]; write [128, 512]",
                                     "prefill:")]),
    ({"prefill": [128, 128, 512]}, {}, [("buckets.prefill", "must be sorted and unique", "prefill:")]),
    ({"prefill": [100, 512]}, {}, [("buckets.prefill.0", "prefill bucket 100 is not a multiple of 32 "
                                    "(tile height); use 128", "- 100")]),
    ({"decode": [1, 3, 32]}, {}, [("buckets.decode.1", "decode batch 3 is not a traceable size; use one "
                                   "of 1, 2, 4, 8, 16, 32", "- 3")]),
    ({"decode": [1, 8, 64]}, {"max_num_seqs": 8}, [("buckets.decode.2", "decode batch 64 is not a traceable size",
                                                    "- 64")]),
    ({"decode": [1, 8, 16]}, {}, [("runtime.max_num_seqs", "max_num_seqs=32 exceeds the largest decode "
                                   "bucket 16; lower it or add a bucket (max 32)", "max_num_seqs:")]),
    ({"prefill_chunk": DELETE}, {}, [("buckets.prefill", "prompts up to max_model_len=2048 need a prefill "
                                      "bucket >= 2048 (largest is 512) or buckets.prefill_chunk (e.g. 512)",
                                      "prefill:")]),
    ({"prefill_chunk": 256}, {}, [("buckets.prefill_chunk", "prefill_chunk=256 must be one of the prefill "
                                   "buckets [128, 512]", "prefill_chunk:")]),
    ({}, {"kv_block_size": 48}, [("buckets.prefill_chunk", "prefill_chunk=512 is not a multiple of "
                                  "runtime.kv_block_size=48", "prefill_chunk:"),
                                 ("runtime.kv_block_size", "kv_block_size=48 is not a multiple of 32",
                                  "kv_block_size:")]),
    ({"prefill": [], "decode": []}, {}, [("buckets.prefill", "needs at least one bucket", "prefill:"),
                                         ("buckets.decode", "needs at least one bucket", "decode:")]),
    ({"prefill": [0, 512]}, {}, [("buckets.prefill.0", "0 must be positive", "- 0")]),
])
def test_bucket_rules(diagnostics, buckets, runtime, problems):
    text = spec_text({"buckets": buckets, "runtime": runtime})
    diags = diagnostics(text)
    assert len(diags) == len(problems), "\n".join(map(str, diags))
    for d, (path, msg, needle) in zip(diags, problems):
        assert d.path == path and d.message.startswith(msg), str(d)
        at(d, text, needle)


def test_prefill_bucket_covering_max_model_len_needs_no_chunk(load):
    b = load(spec_text({"buckets": {"prefill": [128, 2048], "prefill_chunk": DELETE}}))
    assert b.buckets.prefill_chunk is None


def test_max_model_len_beyond_max_position_embeddings(diagnostics):
    text = spec_text({"runtime": {"max_model_len": 8192}})
    d = one(diagnostics(text))
    assert d.path == "runtime.max_model_len"
    assert d.message == "max_model_len=8192 exceeds the model's max_position_embeddings=4096"
    at(d, text, "max_model_len:")


@pytest.mark.parametrize("model, path, message", [
    ({"num_key_value_heads": 3}, "model.num_key_value_heads",
     "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    ({"hidden_size": 500}, "model.hidden_size",
     "hidden_size=500 is not divisible by num_attention_heads=8; set head_dim"),
])
def test_architecture_consistency(diagnostics, model, path, message):
    text = spec_text({"model": model})
    d = one(diagnostics(text))
    assert (d.path, d.message) == (path, message)
    at(d, text, path.split(".")[-1] + ":")


def test_head_dim_makes_odd_hidden_valid(load):
    b = load(spec_text({"model": {"hidden_size": 500, "head_dim": 64}}))
    assert b.arch.hd == 64


def test_paths_that_do_not_exist(diagnostics, spec_dir):
    text = spec_text({"weights": {"source": "ckpt"}, "tokenizer": "tok"})
    diags = diagnostics(text)
    says = " does not exist (a directory, relative to the spec, or a model id ORG/NAME[@REVISION] in the Hugging Face cache)"
    assert [(d.path, d.message) for d in diags] == [
        ("weights.source", f"{spec_dir / 'ckpt'}{says}"),
        ("tokenizer", f"{spec_dir / 'tok'}{says}"),
    ]
    at(diags[0], text, "source: ckpt")
    at(diags[1], text, "tokenizer: tok")


def test_paths_resolve_relative_to_the_spec(load, spec_dir):
    (spec_dir / "ckpt").mkdir()
    (spec_dir / "ckpt" / "model.safetensors.index.json").write_text("{}")
    b = load(spec_text({"weights": {"source": "ckpt"}}))
    assert b.resolve_path(b.spec.weights.source) == spec_dir / "ckpt"


def test_model_and_from_hf_are_exclusive(diagnostics):
    text = spec_text({"from_hf": "hf"})
    d = one(diagnostics(text))
    assert d.path == "model" and "give exactly one of `model:`" in d.message
    at(d, text, "model:")
    text = spec_text({"model": DELETE})
    d = one(diagnostics(text))
    assert "give exactly one of `model:`" in d.message and d.line == 1


def test_from_hf_reads_config_json(load, diagnostics, spec_dir):
    (spec_dir / "hf").mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 4096, "hidden_size": 512,
           "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    (spec_dir / "hf" / "config.json").write_text(json.dumps(cfg))
    b = load(spec_text({"model": DELETE, "from_hf": "hf"}))
    assert (b.arch.family, b.arch.hidden_size, b.arch.kv_heads) == ("llama", 512, 2)
    text = spec_text({"model": DELETE, "from_hf": "nowhere"})
    d = one(diagnostics(text))
    assert d.path == "from_hf" and "config.json: not found" in d.message
    at(d, text, "from_hf:")


# ---- all errors at once --------------------------------------------------------------------------
def test_three_independent_mistakes_give_three_located_diagnostics(diagnostics):
    text = spec_text({"targets": ["N150", "T3000"],
                      "buckets": {"decode": [1, 5, 32]},
                      "runtime": {"max_model_len": 8192}})
    diags = diagnostics(text)
    assert [d.path for d in diags] == ["targets.1", "buckets.decode.1", "runtime.max_model_len"]
    assert [d.line for d in diags] == [line_of(text, "- T3000"), line_of(text, "- 5"),
                                       line_of(text, "max_model_len:")]
    assert all(d.file == SPEC_FILE and d.severity == "error" for d in diags)


def test_error_text_lists_every_diagnostic(diagnostics):
    text = spec_text({"targets": ["T3000"], "runtime": {"max_model_len": 8192}})
    with pytest.raises(InvalidInput) as ei:
        spec.loads(text, SPEC_FILE)
    lines = str(ei.value).splitlines()
    assert lines[0] == f"{SPEC_FILE}: invalid spec"
    assert lines[1].startswith(f"{SPEC_FILE}:{line_of(text, '- T3000')}:3: targets.0: unknown mesh")
    assert lines[2].startswith(f"{SPEC_FILE}:{line_of(text, 'max_model_len:')}:3: runtime.max_model_len: ")
    assert ei.value.exit_code == 2


# ---- json schema ---------------------------------------------------------------------------------
def test_json_schema_documents_every_field():
    s = spec.json_schema()
    assert s["$schema"].endswith("2020-12/schema")
    assert s["additionalProperties"] is False
    for model in s["$defs"].values():
        if model.get("type") == "object" and "properties" in model:
            assert model.get("additionalProperties") is False, model.get("title")
            for key, prop in model["properties"].items():
                assert prop.get("description"), f"{model.get('title')}.{key} has no docstring"


# ---- property-based: mutations end valid or in a clean located error -----------------------------
BASE = deep_update(TINY, {
    "targets": ["N150", "N300", "T3K"],
    "weights": {"dtypes": {"attention": "bfp8", "mlp": "bfp4", "tensors": {"wo": "bf16"}}},
    "sharding": {"kv_heads": "replicate", "plan": {"wq": ["rows", "cols"]},
                 "targets": {"T3K": {"w2": ["cols", None]}}},
    "runtime": {"kv_block_size": 32, "trace_mode": "decode_only", "kv_cache_dtype": "bfp8"},
})
NO_DIR = Path("/nonexistent-ttbundle-test-dir")

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**40, 2**40), st.integers(0, 70_000),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10),
    st.sampled_from(["N150", "T3K", "TG", "(2,4)", "(0,1)", "rows", "cols", "bf16", "bfp8", "bfp4",
                     "llama", "pad", "error", "replicate", "all", "none", 0, 1, 3, 32, 33, 4096, -1]))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                      | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=6)
keys = st.one_of(st.text(min_size=1, max_size=12),
                 st.sampled_from(["name", "model", "targets", "buckets", "runtime", "sharding", "plan",
                                  "weights", "dtypes", "family", "prefill", "decode", "head_dim"]))


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _get(node, path):
    for p in path:
        node = node[p]
    return node


@st.composite
def mutated_specs(draw):
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(data))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["delete", "replace", "replace", "rename", "insert"]))
        if not path:
            op = "insert"
        node = _get(data, path)
        if op == "insert":
            if isinstance(node, dict):
                node[draw(keys)] = draw(values)
            elif isinstance(node, list):
                node.insert(draw(st.integers(0, len(node))), draw(values))
            else:
                op = "replace"
        if op == "insert" or not path:
            continue
        parent, last = _get(data, path[:-1]), path[-1]
        if op == "delete":
            del parent[last]
        elif op == "replace":
            parent[last] = draw(values)
        elif op == "rename" and isinstance(parent, dict):
            new = draw(keys)
            parent[new] = parent.pop(last)
    return data


def assert_clean(text: str) -> str:
    """Load + plan every target (+ fixes when it does not fit); only InvalidInput may escape,
    and every diagnostic it carries is located. Returns "valid" or "invalid"."""
    try:
        b = spec.loads(text, SPEC_FILE, base_dir=NO_DIR)
        for t in b.spec.targets:
            p = make_plan(b, t)
            if not p.fits:
                assert fixes(b, p)
            assert p.memory.total == (p.memory.weights + p.memory.kv_cache + p.memory.activations
                                      + p.memory.trace_region)
    except InvalidInput as e:
        assert e.diagnostics, e.message
        if isinstance(e, spec.InvalidSpec):  # schema-valid: the mesh checks still run (validate)
            for t in e.bundle.spec.targets:
                if meshmod.try_resolve(t) is not None:
                    e.diagnostics += sharding_diagnostics(e.bundle, t)
        for d in e.diagnostics:
            assert d.file == SPEC_FILE and isinstance(d.line, int) and d.line >= 1, str(d)
            assert d.line <= max(1, text.count("\n") + 1), str(d)
        return "invalid"
    return "valid"


def test_base_of_mutations_is_valid():
    assert assert_clean(dump(BASE)) == "valid"


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_specs())
def test_mutated_specs_end_valid_or_located(data):
    assert_clean(dump(data))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_text_mutations_end_valid_or_located(data):
    text = dump(BASE)
    junk = data.draw(st.text(alphabet=":-[]{}&*!#|>'\"\n \t%@`,?<=abc019.", min_size=1, max_size=12))
    pos = data.draw(st.integers(0, len(text)))
    cut = data.draw(st.integers(0, 8))
    assert_clean(text[:pos] + junk + text[pos + cut:])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(meshmod.PRESETS)), st.integers(1, 8), st.sampled_from([1, 2, 4, 8, 16]))
def test_any_preset_plans_or_says_why(mesh_name, kv, heads_mul):
    heads = kv * heads_mul
    text = spec_text({"targets": [mesh_name], "model": {
        "num_attention_heads": heads, "num_key_value_heads": kv, "hidden_size": heads * 64}})
    assert_clean(text)


def test_published_bundles_name_the_hf_model_their_header_cites():
    """Each published bundle answers to the HF id its dims came from (``vllm serve ORG/NAME``):
    ``hf_model`` is the id its header comment cites."""
    root = Path(__file__).resolve().parents[1] / "bundles"
    for p in sorted(root.glob("*.yaml")):
        if p.name == "demo.yaml":
            continue
        b = spec.load(p)
        header = "".join(line for line in p.read_text().splitlines()[1:6] if line.startswith("#"))
        assert b.spec.hf_model and b.spec.hf_model in header, p.name


# ---- strict types (issue 43): no string or boolean taken for a number, nor the reverse ------------
@pytest.mark.parametrize("changes, where, needle, says", [
    ({"runtime": {"output_tokens_per_step": "4"}}, "runtime.output_tokens_per_step", "output_tokens_per_step:",
     "valid integer, got '4' (write the number without quotes)"),
    ({"runtime": {"output_tokens_per_step": True}}, "runtime.output_tokens_per_step", "output_tokens_per_step:",
     "valid integer, got True (true/false is not a number)"),
    ({"runtime": {"max_num_seqs": True}}, "runtime.max_num_seqs", "max_num_seqs:", "got True"),
    ({"runtime": {"max_model_len": "2048"}}, "runtime.max_model_len", "max_model_len:", "got '2048'"),
    ({"speculative": {"num_speculative_tokens": True}}, "speculative.num_speculative_tokens",
     "num_speculative_tokens:", "got True"),
    ({"targets": ["T3K"], "replicas": {"T3K": {"submesh": [True, True]}}}, "replicas.T3K.submesh.0", "- true",
     "got True"),
    ({"targets": ["T3K"], "replicas": {"T3K": {"submesh": ["1", "2"]}}}, "replicas.T3K.submesh.0", "- '1'",
     "got '1'"),
    ({"targets": ["T3K"], "replicas": {"T3K": {"submesh": [1]}}}, "replicas.T3K.submesh", "submesh:",
     "a submesh is [rows, cols]: 2 numbers, got 1"),
    ({"task": "embed", "embedding": {"normalize": "yes"}}, "embedding.normalize", "normalize:",
     "valid boolean, got 'yes' (write true or false)"),
    ({"description": 5}, "description", "description:", "valid string, got 5"),
    ({"buckets": {"decode": [1, True]}}, "buckets.decode.1", "- true", "got True"),
    ({"model": {"hidden_size": "512"}}, "model.hidden_size", "hidden_size:", "got '512'"),
    ({"model": {"num_hidden_layers": True}}, "model.num_hidden_layers", "num_hidden_layers:", "got True"),
    ({"model": {"rope_scaling": {"rope_type": "linear", "factor": "8"}}}, "model.rope_scaling.factor", "factor:",
     "got '8'"),
    ({"model": {"tie_word_embeddings": "yes"}}, "model.tie_word_embeddings", "tie_word_embeddings:",
     "got 'yes' (write true or false)"),
])
def test_spec_types_are_strict(diagnostics, runner, write_spec, changes, where, needle, says):
    """Each of these validated before (pydantic's lax mode: "4" -> 4, true -> 1, "yes" -> True);
    now each is an error at its own line, exit 2."""
    from ttbundle.cli import app

    text = spec_text(changes)
    d = next((d for d in diagnostics(text) if d.path == where), None)
    assert d is not None, [str(x) for x in diagnostics(text)]
    assert d.line == line_of(text, needle) and says in d.message, str(d)
    p = write_spec(text)
    r = runner.invoke(app, ["validate", str(p)])
    assert r.exit_code == 2 and f"spec.yaml:{d.line}:" in r.output and "Traceback" not in r.output, r.output


def test_a_plain_exponent_number_is_a_number_as_in_yaml_1_2(load, diagnostics):
    """PyYAML reads `1e-5` (no dot) as text; strict types would refuse it saying to drop quotes
    that are not there. A plain one is a number; a quoted one stays text (refused)."""
    text = spec_text().replace("  hidden_size: 512\n", "  hidden_size: 512\n  rms_norm_eps: 1e-5\n")
    assert "rms_norm_eps: 1e-5" in text and load(text).arch.rms_norm_eps == 1e-5
    quoted = text.replace("rms_norm_eps: 1e-5", "rms_norm_eps: '1e-5'")
    assert any(d.path == "model.rms_norm_eps" for d in diagnostics(quoted))


def test_strict_types_still_take_an_int_for_a_float_and_a_list_for_a_submesh(load):
    b = load(spec_text({"targets": ["T3K"], "replicas": {"T3K": {"submesh": [1, 2]}},
                        "model": {"rms_norm_eps": 1, "rope_theta": 500000}}))
    assert b.spec.replicas["T3K"].submesh == (1, 2) and b.arch.rms_norm_eps == 1.0
