"""`ttbundle init --from-hf`: for every registered family a tiny HF config (saved with transformers)
becomes a spec that loads to the same architecture; bad input exits 2 without writing."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from ttbundle import families, spec as specmod
from ttbundle.layout import axes_of
from ttbundle.plan.make import make_plan
from ttbundle.plan.sharding import resolved_plan
from ttbundle.cli import app
from spec_helpers import llama_weights_one_chip, wh_dram
from ttbundle.init import derive_name, y

# Small enough to plan in milliseconds; keys a config class does not have are left out.
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
            moe_intermediate_size=64, n_routed_experts=8, num_experts=8, num_local_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, sliding_window=256)

ARCHS = [(f.name, a) for f in families.all_families().values() for a in f.hf_architectures]


@pytest.fixture
def runner():
    from ttbundle import cli
    for console in (cli.out, cli.err):  # created at import; pin their width too
        console.width = 200
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def config_class(arch: str):
    """transformers' config class for an architecture name, without importing model code."""
    from transformers.models.auto import configuration_auto, modeling_auto
    for n in dir(modeling_auto):
        if n.endswith("_MAPPING_NAMES"):
            for model_type, cls in getattr(modeling_auto, n).items():
                if cls == arch or (isinstance(cls, tuple) and arch in cls):
                    return configuration_auto.CONFIG_MAPPING[model_type]
    return None


def save_tiny(arch: str, d: Path, **over) -> Path:
    cls = config_class(arch)
    if cls is None:
        pytest.skip(f"transformers has no config for {arch}")
    dims = {**TINY, **over}
    defaults = cls().to_dict()
    kw = {k: v for k, v in dims.items() if k in defaults}
    if isinstance(defaults.get("text_config"), dict):  # multimodal wrapper (Gemma 3)
        kw["text_config"] = {k: v for k, v in dims.items() if k in defaults["text_config"]}
        # a vision tower that fits the tiny text model: 2x2 patches pooled to 4 soft tokens, the
        # image tokens inside the vocabulary
        v = dims["vocab_size"]
        if arch.startswith("Qwen2_5_VL"):  # window attention, a 2x2 patch merger, M-RoPE over 16 freqs
            kw["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                                                    "mrope_section": [4, 6, 6]}
            kw.update(vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                         out_hidden_size=dims["hidden_size"], fullatt_block_indexes=[1]),
                      image_token_id=v - 1, video_token_id=v - 2, vision_start_token_id=v - 4,
                      vision_end_token_id=v - 3)
        elif arch.startswith("Qwen3VL"):  # a learned 4x4 position table, DeepStack from vision layer 0
            kw["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6,
                                                    "mrope_section": [24, 20, 20], "mrope_interleaved": True}
            kw.update(vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8,
                                         num_position_embeddings=16, deepstack_visual_indexes=[0],
                                         out_hidden_size=dims["hidden_size"]),
                      image_token_id=v - 1, video_token_id=v - 2, vision_start_token_id=v - 4,
                      vision_end_token_id=v - 3)
        elif arch.startswith("Mistral3"):  # Pixtral: 8-pixel patches merged 2x2, [IMG] inside the vocabulary
            kw["text_config"].update(model_type="mistral", head_dim=32)
            kw.update(vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=8),
                      image_token_index=v - 1)
        else:
            kw.update(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14),
                      mm_tokens_per_image=4, image_token_index=v - 1, boi_token_index=v - 3, eoi_token_index=v - 2)
    cls(architectures=[arch], **kw).save_pretrained(d)
    return d


def llama(d: Path, **over) -> Path:
    from transformers import LlamaConfig
    dims = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaConfig(architectures=["LlamaForCausalLM"], **{**dims, **over}).save_pretrained(d)
    return d


def invoke(runner, *args):
    return runner.invoke(app, ["init", *map(str, args)])


def test_llama_is_registered():
    assert ("llama", "LlamaForCausalLM") in ARCHS


@pytest.mark.parametrize("family,arch", ARCHS, ids=[a for _, a in ARCHS])
def test_every_family_round_trips(tmp_path, runner, family, arch):
    hf = save_tiny(arch, tmp_path / "model")
    out = tmp_path / "spec.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out)
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.stdout
    assert "N150: " in r.stdout
    b = specmod.load(out)
    config = json.loads((hf / "config.json").read_text())
    want = families.get(family).arch_model.model_validate(specmod.hf_config_to_arch(config))
    assert b.arch.family == family
    assert b.arch.model_dump() == want.model_dump()
    # model: written out in full (family first), no from_hf
    data = yaml.safe_load(out.read_text())
    assert "from_hf" not in data and list(data["model"])[0] == "family"
    assert set(data["model"]) == set(type(b.arch).model_fields)
    # the default plan is written out for every tensor, and is what the plan uses
    fam = families.get(family)
    assert set(data["sharding"]["plan"]) == {t.name for t in fam.tensors(b.arch)}
    specs, _ = resolved_plan(b, "N150")
    for name, sp in fam.default_plan(b.arch).items():
        if name in specs:
            assert [axes_of(e) for e in specs[name]] == [axes_of(e) for e in sp]
    # max_model_len default: min(max_position_embeddings, 8192), chunked past the largest bucket
    assert b.spec.runtime.max_model_len == min(b.arch.max_position_embeddings, 8192)
    bk = b.buckets
    assert b.spec.runtime.max_model_len <= max(bk.prefill) or bk.prefill_chunk in bk.prefill
    assert b.spec.runtime.max_num_seqs <= max(bk.decode)


@pytest.mark.parametrize("family,arch", ARCHS, ids=[a for _, a in ARCHS])
def test_every_model_key_has_its_docstring_as_comment(tmp_path, runner, family, arch):
    hf = save_tiny(arch, tmp_path / "model")
    out = tmp_path / "spec.yaml"
    assert invoke(runner, "--from-hf", hf, "-o", out).exit_code == 0
    lines = out.read_text().splitlines()
    model = families.get(family).arch_model
    start = lines.index("model:")
    for name, f in model.model_fields.items():
        if not f.description:
            continue
        i = next(i for i in range(start, len(lines)) if lines[i].startswith(f"  {f.alias or name}:"))
        assert lines[i - 1].startswith("  # "), (name, lines[i - 1])
        first_words = " ".join(f.description.split())[:30]
        comment = " ".join(l.strip()[2:] for l in lines[start:i] if l.strip().startswith("#"))
        assert first_words in comment, name


def test_unsupported_architecture_exits_2_listing_supported(tmp_path, runner):
    hf = tmp_path / "m"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "hidden_size": 8}))
    out = tmp_path / "new" / "spec.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out)
    assert r.exit_code == 2
    assert r.stderr.startswith("[error] ")
    assert "'FooForCausalLM' is not supported" in r.stderr
    for _, a in ARCHS:
        assert a in r.stderr
    assert "Traceback" not in r.output
    assert not out.exists() and not out.parent.exists()  # the folder init made is gone again


@pytest.mark.parametrize("content,msg", [
    (None, "config.json: not found"),
    ("{not json", "not readable JSON"),
    ("{}", "no `architectures` entry"),
])
def test_bad_config_json_exits_2(tmp_path, runner, content, msg):
    hf = tmp_path / "m"
    hf.mkdir()
    if content is not None:
        (hf / "config.json").write_text(content)
    r = invoke(runner, "--from-hf", hf, "-o", tmp_path / "s.yaml")
    assert r.exit_code == 2 and msg in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "s.yaml").exists()


def test_overwrite_refused_without_force(tmp_path, runner):
    hf = llama(tmp_path / "m")
    out = tmp_path / "spec.yaml"
    out.write_text("keep me\n")
    r = invoke(runner, "--from-hf", hf, "-o", out)
    assert r.exit_code == 2
    assert f"[error] {out} exists; pass --force to overwrite it" in r.stderr
    assert out.read_text() == "keep me\n"
    r = invoke(runner, "--from-hf", hf, "-o", out, "--force")
    assert r.exit_code == 0, r.output
    assert specmod.load(out).spec.name == "m"


def test_bfp8_keeps_embedding_bf16(tmp_path, runner):
    hf = llama(tmp_path / "m")
    out = tmp_path / "spec.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out, "--weights-dtype", "bfp8")
    assert r.exit_code == 0, r.output
    b = specmod.load(out)
    assert b.spec.weights.dtypes.default == "bfp8"
    assert b.spec.weights.dtypes.embedding == "bf16"
    dt = {t.name: t.dtype for t in make_plan(b, "N150").tensors}
    assert dt["embed"] == "bf16"
    assert dt["wq"] == dt["w1"] == dt["lm_head"] == "bfp8"
    assert dt["attn_norm"] == "bf16"


@pytest.mark.parametrize("dtype", ["bfp4", "bf16"])
def test_other_weight_dtypes(tmp_path, runner, dtype):
    out = tmp_path / "spec.yaml"
    assert invoke(runner, "--from-hf", llama(tmp_path / "m"), "-o", out,
                  "--weights-dtype", dtype).exit_code == 0
    pol = specmod.load(out).spec.weights.dtypes
    assert (pol.default, pol.embedding) == (dtype, "bf16")


def test_weights_and_tokenizer_relative_to_spec(tmp_path, runner):
    hf = llama(tmp_path / "models" / "My Model_v2")
    (hf / "model.safetensors").write_bytes(b"")
    (hf / "tokenizer.json").write_text("{}")
    out = tmp_path / "specs" / "deep" / "spec.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out)
    assert r.exit_code == 0, r.output
    b = specmod.load(out)
    assert b.spec.weights.source == "../../models/My Model_v2"
    assert b.spec.tokenizer == "../../models/My Model_v2"
    assert b.resolve_path(b.spec.weights.source).resolve() == hf.resolve()
    assert b.spec.name == "my-model_v2"


def test_without_weights_source_and_tokenizer_are_left_out(tmp_path, runner):
    out = tmp_path / "spec.yaml"
    assert invoke(runner, "--from-hf", llama(tmp_path / "m"), "-o", out).exit_code == 0
    s = specmod.load(out).spec
    assert s.weights.source is None and s.tokenizer is None
    assert "# source: m" in out.read_text()


def test_sharded_index_counts_as_weights(tmp_path, runner):
    hf = llama(tmp_path / "m")
    (hf / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    out = tmp_path / "spec.yaml"
    assert invoke(runner, "--from-hf", hf, "-o", out).exit_code == 0
    assert specmod.load(out).spec.weights.source == "m"


def test_limits_and_buckets(tmp_path, runner):
    hf = llama(tmp_path / "m", max_position_embeddings=131072)
    out = tmp_path / "spec.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out, "--max-model-len", "32768", "--max-num-seqs", "12",
               "--name", "l.3-x")
    assert r.exit_code == 0, r.output
    b = specmod.load(out)
    rt, bk = b.spec.runtime, b.buckets
    assert (rt.max_model_len, rt.max_num_seqs, b.spec.name) == (32768, 12, "l.3-x")
    assert bk.prefill_chunk == max(bk.prefill) < 32768
    assert max(bk.decode) >= 12


def test_max_model_len_default_is_capped(tmp_path, runner):
    out = tmp_path / "spec.yaml"
    assert invoke(runner, "--from-hf", llama(tmp_path / "m", max_position_embeddings=131072),
                  "-o", out).exit_code == 0
    assert specmod.load(out).spec.runtime.max_model_len == 8192


def test_short_context_drops_uncovered_buckets(tmp_path, runner):
    out = tmp_path / "spec.yaml"
    assert invoke(runner, "--from-hf", llama(tmp_path / "m", max_position_embeddings=128),
                  "-o", out).exit_code == 0
    b = specmod.load(out)
    assert b.spec.runtime.max_model_len == 128
    assert b.buckets.prefill == [128]
    assert b.buckets.prefill_chunk is None


@pytest.mark.parametrize("args,msg", [
    (["--max-model-len", "9000"], "--max-model-len 9000: must be between 1 and the model's "
                                  "max_position_embeddings=4096"),
    (["--max-model-len", "0"], "--max-model-len 0"),
    (["--max-num-seqs", "64"], "--max-num-seqs 64: must be between 1 and 32"),
    (["--weights-dtype", "fp8"], "--weights-dtype 'fp8': one of bf16, bfp8, bfp4"),
    (["--name", "Bad Name"], "--name 'Bad Name'"),
    (["--mesh", "T4K"], "unknown mesh 'T4K'; valid: N150"),
])
def test_bad_options_exit_2(tmp_path, runner, args, msg):
    out = tmp_path / "spec.yaml"
    r = invoke(runner, "--from-hf", llama(tmp_path / "m"), "-o", out, *args)
    assert r.exit_code == 2, r.output
    assert msg in r.stderr and "Traceback" not in r.output
    assert not out.exists()


def test_several_meshes_and_padding_heads(tmp_path, runner):
    # 4 query heads on T3K's 8-wide cols axis: init pads the heads and says so
    out = tmp_path / "spec.yaml"
    r = invoke(runner, "--from-hf", llama(tmp_path / "m"), "-o", out, "-m", "N150", "-m", "T3K",
               "-m", "(2,4)")
    assert r.exit_code == 0, r.output
    assert "note: sharding.attention_heads: pad because wq, wo: num_attention_heads=4 is not " \
           "divisible by mesh axis cols=8 (T3K 1x8)" in r.stderr
    for m in ("N150", "T3K", "(2,4)"):
        assert f"  {m}: fits (" in r.stdout
    b = specmod.load(out)
    assert b.spec.targets == ["N150", "T3K", "(2,4)"]
    assert b.spec.sharding.attention_heads == "pad"
    v = runner.invoke(app, ["validate", str(out)])
    assert v.exit_code == 0, v.output


def test_does_not_fit_exits_3_with_the_arithmetic_and_fixes(tmp_path, runner):
    # Llama-3.1-70B dims on one N150: not even bfp8 weights with bfp4 MLP fit; nothing written
    hf = llama(tmp_path / "m", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
               max_position_embeddings=131072)
    out = tmp_path / "new" / "spec.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out)
    assert r.exit_code == 3, r.output
    assert not out.exists() and not out.parent.exists()
    assert "Traceback" not in r.output and "does not fit N150" in r.stderr
    w = llama_weights_one_chip(128256, 8192, 28672, 80, 64, 8, 128, "bfp4", "bfp8")
    assert w > 12 * 1_072_693_184  # the weights alone exceed the chip
    assert f"weights {w / 2**30:,.2f} GiB" in r.stderr
    m = re.search(r"a bigger mesh: (\S+) ", r.stderr)
    assert m, r.stderr
    # the mesh it names really takes the model
    r2 = invoke(runner, "--from-hf", hf, "-o", tmp_path / "big.yaml", "--mesh", m.group(1))
    assert r2.exit_code == 0, r2.output
    # an explicit dtype is kept as given: bf16 does not fit either, exit 3
    r3 = invoke(runner, "--from-hf", hf, "-o", out, "--weights-dtype", "bf16")
    assert r3.exit_code == 3 and "with bf16 weights" in r3.stderr


def test_llama_8b_on_n150_with_32_users_at_32k_gets_bfp8_and_the_largest_pool(tmp_path, runner):
    """The issue's example: Llama-3.1-8B, 32 users, max_model_len 32768 on one N150: bf16 and
    bfp8 weights with a bf16 KV cache leave no room for one sequence; bfp8 weights and KV do,
    and the pool is the largest that fits (bytes computed here from the dims)."""
    hf = llama(tmp_path / "m", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=131072)
    out = tmp_path / "spec.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out, "--mesh", "N150", "--max-model-len", 32768)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "init: bfp8 weights and KV cache chosen: bf16 weights does not fit N150" in " ".join(
        line.strip("# ") for line in text.splitlines())
    assert "bfp8 weights and KV cache chosen" in r.stderr
    b = specmod.load(out)
    assert b.spec.weights.dtypes.default == "bfp8" and b.spec.runtime.kv_cache_dtype == "bfp8"
    assert b.spec.runtime.max_tokens_all_users == "auto" and b.spec.runtime.max_num_seqs == 32
    p = make_plan(b, "N150")
    w = llama_weights_one_chip(128256, 4096, 14336, 32, 32, 8, 128, "bfp8", "bfp8")
    assert p.memory.weights == w
    # KV: per layer K and V, [blocks, 8 heads, 32, 128] bfp8 = 32 tiles per block
    kv = lambda blocks: 2 * 32 * wh_dram(32 * blocks, 1088)  # noqa: E731
    rest = w + p.memory.activations + p.memory.trace_region
    blocks = p.kv["num_blocks"]
    dram = 12 * 1_072_693_184
    assert p.memory.kv_cache == kv(blocks) and rest + kv(blocks) <= dram < rest + kv(blocks + 1)
    assert p.kv["max_tokens_all_users"] == blocks * 32 - 32 * 32 >= 32768
    assert f"KV pool {p.kv['max_tokens_all_users']:,} tokens" in r.stdout
    assert f"auto on N150 is {p.kv['max_tokens_all_users']:,} tokens" in text


def test_qwen3_8b_on_n300_keeps_bf16_and_fits(tmp_path, runner):
    """The issue's report: Qwen3-8B on N300 used to be written unfit (25.8 GiB per chip); now
    bf16 fits with the pool that remains, and `validate` agrees."""
    from transformers import Qwen3Config
    hf = tmp_path / "Qwen3-8B"
    Qwen3Config(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                tie_word_embeddings=False).save_pretrained(hf)
    out = tmp_path / "q.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out, "--mesh", "N300")
    assert r.exit_code == 0, r.output
    b = specmod.load(out)
    assert b.spec.weights.dtypes.default == "bf16" and "chosen" not in r.stderr
    p = make_plan(b, "N300")
    # 8 KV heads over 2 chips: [blocks, 4, 32, 128] bf16 = 16 tiles per block, 36 layers x K, V
    kv = lambda blocks: 2 * 36 * wh_dram(16 * blocks, 2048)  # noqa: E731
    rest = p.memory.weights + p.memory.activations + p.memory.trace_region
    blocks = p.kv["num_blocks"]
    assert p.memory.kv_cache == kv(blocks) and rest + kv(blocks) <= 12 * 1_072_693_184 < rest + kv(blocks + 1)
    assert p.kv["max_tokens_all_users"] >= b.spec.runtime.max_model_len
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0


def test_hostile_directory_name_cannot_inject_yaml(tmp_path, runner):
    hf = llama(tmp_path / "evil\nname: x\n#")
    (hf / "tokenizer.json").write_text("{}")
    out = tmp_path / "spec.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out)
    assert r.exit_code == 0, r.output
    b = specmod.load(out)
    assert b.spec.tokenizer == "evil\nname: x\n#"
    assert specmod.NAME_RE.fullmatch(b.spec.name)


@pytest.mark.parametrize("dirname,name", [
    ("Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct"),
    ("__Qwen2.5  7B", "qwen2.5-7b"),
    ("***", "llama"),
    ("x" * 100, "x" * 64),
])
def test_derive_name(tmp_path, dirname, name):
    assert derive_name(tmp_path / dirname, "llama") == name
    assert specmod.NAME_RE.fullmatch(name)


_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()


@settings(max_examples=300, deadline=None)
@given(st.recursive(_scalars, lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8))
def test_y_round_trips_on_one_line(value):
    s = y(value)
    assert "\n" not in s and "\r" not in s
    assert yaml.safe_load(f"k: {s}\n") == {"k": value}


def test_a_tensor_that_cannot_divide_is_replicated_on_that_mesh(tmp_path, runner):
    # intermediate_size=100 over T3K's 8 columns is 12.5 per device: no padding option fixes
    # that, so init replicates the MLP on T3K only (a per-target override) and says so
    out = tmp_path / "spec.yaml"
    r = invoke(runner, "--from-hf", llama(tmp_path / "m", intermediate_size=100), "-o", out,
               "-m", "N150", "-m", "T3K")
    assert r.exit_code == 0, r.output
    assert "intermediate_size=100 is not divisible by mesh axis cols=8 (T3K 1x8)" not in r.stderr
    assert "sharding.targets.T3K: w1, w3, w2 replicated" in r.stderr
    b = specmod.load(out)
    assert set(b.spec.sharding.targets) == {"T3K"} and set(b.spec.sharding.targets["T3K"]) == {"w1", "w3", "w2"}
    p = make_plan(b, "T3K")  # T3K is 1x8: its rows axis splits nothing
    for w in (t for t in p.tensors if t.name in ("w1", "w3", "w2")):
        assert w.device_shape == w.shape, w  # the whole MLP on every device
    # attention still split over the 8 columns: 4 heads of 128 / 4 = 32 padded to 8, one per device
    assert next(t for t in p.tensors if t.name == "wq").device_shape[-1] == 128 // 4
    assert make_plan(b, "N150").fits


def test_hf_model_from_a_hub_cache_snapshot(tmp_path, runner):
    """A model downloaded by huggingface_hub lives in ``models--ORG--NAME/snapshots/<rev>``
    (huggingface_hub's own folder naming, asked of it here): init records that id."""
    from huggingface_hub.constants import REPO_ID_SEPARATOR
    folder = "models" + REPO_ID_SEPARATOR + REPO_ID_SEPARATOR.join(["Qwen", "Qwen3-8B"])
    hf = llama(tmp_path / "hub" / folder / "snapshots" / "0123abc")
    out = tmp_path / "s.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out)
    assert r.exit_code == 0, r.output
    assert specmod.load(out).spec.hf_model == "Qwen/Qwen3-8B"


def test_hf_model_from_name_or_path_or_the_option(tmp_path, runner):
    hf = llama(tmp_path / "m")
    cfg = json.loads((hf / "config.json").read_text())  # as configs saved by older transformers carry it
    (hf / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}))
    r = invoke(runner, "--from-hf", hf, "-o", tmp_path / "a.yaml")
    assert r.exit_code == 0, r.output
    assert specmod.load(tmp_path / "a.yaml").spec.hf_model == "meta-llama/Llama-3.1-8B-Instruct"
    r = invoke(runner, "--from-hf", hf, "-o", tmp_path / "b.yaml", "--hf-model", "me/my-finetune")
    assert r.exit_code == 0, r.output
    assert specmod.load(tmp_path / "b.yaml").spec.hf_model == "me/my-finetune"
    r = invoke(runner, "--from-hf", hf, "-o", tmp_path / "c.yaml", "--hf-model", "not an id")
    assert r.exit_code == 2 and "not a Hugging Face model id" in r.output and not (tmp_path / "c.yaml").exists()


def test_without_an_id_hf_model_is_left_commented_out(tmp_path, runner):
    hf = llama(tmp_path / "plain")
    out = tmp_path / "s.yaml"
    r = invoke(runner, "--from-hf", hf, "-o", out)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert specmod.load(out).spec.hf_model is None
    assert re.search(r"^# hf_model: ", text, re.M) and "--hf-model" in text
