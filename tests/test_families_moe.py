"""MoE families (DeepSeek-V3, GPT-OSS, Qwen3 MoE) against Hugging Face's own models built from tiny configs
with random weights: parameter counts, checkpoint names and shapes, expert math, config import,
unsupported features, and the expert-parallel plan."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
yaml = pytest.importorskip("yaml")
from transformers.core_model_loading import revert_weight_conversion  # noqa: E402

from ttbundle import spec, weights
from ttbundle.plan.make import make_plan
from ttbundle.families.base import Local  # noqa: E402
from ttbundle.errors import InvalidInput  # noqa: E402
from ttbundle.families import get, moe, transforms  # noqa: E402

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"
TINY = dict(vocab_size=128, hidden_size=64, max_position_embeddings=2048, num_attention_heads=8,
            tie_word_embeddings=False)
CONFIGS = {  # 8 heads and 8 experts so that T3K (1x8) splits both
    "deepseek_v3": ("DeepseekV3", dict(
        TINY, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1,
        q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
    # full-rank q_proj and no dense layer
    "deepseek_v3-q_proj": ("DeepseekV3", dict(
        TINY, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=0,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
    "gpt_oss": ("GptOss", dict(
        TINY, intermediate_size=32, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=16)),
    # a dense first layer (mlp_only_layers), then MoE layers
    "qwen3_moe": ("Qwen3Moe", dict(
        TINY, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])),
    # q/k/v biases, a sigmoid-gated shared expert
    "qwen2_moe": ("Qwen2Moe", dict(
        TINY, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=2, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)),
}


def hf_config(name: str):
    cls, kw = CONFIGS[name]
    config = getattr(transformers, cls + "Config")(**kw)
    config.architectures = [cls + "ForCausalLM"]
    return config


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf(request):
    cls, config = CONFIGS[request.param][0], hf_config(request.param)
    torch.manual_seed(0)
    model = getattr(transformers, cls + "ForCausalLM")(config).eval()
    # the checkpoint layout (per-expert keys for DeepSeek), not transformers 5's fused in-memory one
    ckpt = revert_weight_conversion(model, model.state_dict())
    arch_dict = spec.hf_config_to_arch(config.to_dict())
    family = get(arch_dict["family"])
    return SimpleNamespace(config=config, model=model, ckpt=ckpt, family=family,
                           arch=family.arch_model.model_validate(arch_dict), arch_dict=arch_dict)


def tiny_bundle(arch, tmp_path: Path, **extra):
    doc = {"name": "tiny", "model": arch.model_dump(mode="json"), "targets": ["T3K"],
           "runtime": {"max_model_len": 1024}, **extra}
    return spec.loads(yaml.safe_dump(doc), str(tmp_path / "tiny.yaml"), base_dir=tmp_path)


def test_parameter_count_matches_hf(hf):
    ours = sum(math.prod(t.shape) * t.count for t in hf.family.tensors(hf.arch))
    theirs = sum(p.numel() for p in hf.model.parameters())
    # DeepSeek's e_score_correction_bias is an nn.Buffer (not a parameter) but a checkpoint tensor
    # the router needs, so we declare it; rotary inv_freq buffers are recomputed, not loaded.
    theirs += sum(b.numel() for n, b in hf.model.named_buffers() if n.endswith("e_score_correction_bias"))
    # Untied embeddings: HF counts lm_head once, we declare it once. (Tied, HF would count one
    # matrix and we would declare two: the device keeps a transposed copy.)
    assert not hf.config.tie_word_embeddings
    assert ours == theirs


def expand(family, a):
    """(HFName, decl, layer, [source keys per hf entry]) with {i}/{e} expanded."""
    decls = {t.name: t for t in family.tensors(a)}
    for n in family.hf_names(a):
        t = decls[n.tensor]
        for i in [None] if t.layers is None else range(*t.layers):
            keys = [k.replace("{i}", str(i)) for k in n.hf]
            yield n, t, i, [[k.replace("{e}", str(e)) for e in range(t.dims[0].size)] if "{e}" in k else [k]
                            for k in keys]


def test_every_checkpoint_key_consumed_once_with_declared_shapes(hf):
    f, a, ckpt = hf.family, hf.arch, hf.ckpt
    assert sorted(n.tensor for n in f.hf_names(a)) == sorted(t.name for t in f.tensors(a))
    used = Counter()
    for n, t, i, keys in expand(f, a):
        used.update(k for ks in keys for k in ks)
        srcs = [torch.stack([ckpt[k] for k in ks]) if "{e}" in raw else ckpt[ks[0]] for raw, ks in zip(n.hf, keys)]
        assert tuple(transforms.apply(n.transform, srcs, a).shape) == t.shape, (n.tensor, i)
    assert set(used) == set(ckpt), (set(ckpt) - set(used), set(used) - set(ckpt))
    assert max(used.values()) == 1


def test_dataflow_reads_declared_weights_of_its_layers(hf):
    """Each op reads activations produced before it and weights declared for the layers of its
    layer kind (DeepSeek: dense MLP on the first layers, experts on the rest)."""
    decls = {t.name: t for t in hf.family.tensors(hf.arch)}
    start = 0
    for kind in hf.family.layers(hf.arch):
        have = {"h"}
        for op in kind.ops:
            assert set(op.ins if isinstance(op, Local) else (op.x,)) <= have, (kind.name, op)
            if getattr(op, "w", None):
                lo, hi = decls[op.w].layers
                assert lo <= start and start + kind.count <= hi, (kind.name, op.w)
            have.add(getattr(op, "out", "h"))
        start += kind.count
    assert start == hf.arch.num_hidden_layers


def test_routed_experts_reproduce_hf(hf):
    """The loader's canonical tensors (through our transforms) compute HF's router and experts."""
    f, a = hf.family, hf.arch
    can = weights.from_state_dict(f, a, hf.ckpt)
    L, E = a.num_hidden_layers - 1, can["router"][-1].shape[1]
    mlp = hf.model.model.layers[L].mlp
    torch.manual_seed(1)
    x = torch.randn(5, a.hidden_size)
    idx = torch.stack([torch.arange(5) % E, (torch.arange(5) + 3) % E], 1)
    gate_w = torch.rand(5, 2)
    with torch.no_grad():
        ref = mlp.experts(x, idx, gate_w)
        router_ref = torch.nn.functional.linear(x, mlp.router.weight if a.family == "gpt_oss" else mlp.gate.weight)
    router = x @ can["router"][-1]
    if a.family == "gpt_oss":
        router, router_ref = router + can["router_bias"][-1], router_ref + mlp.router.bias
        gu = torch.einsum("th,tkhn->tkn", x, can["experts_w13"][-1][idx]) + can["experts_b13"][-1][idx]
        g, u = gu.chunk(2, dim=-1)
        g, u = g.clamp(max=a.swiglu_limit), u.clamp(-a.swiglu_limit, a.swiglu_limit)
        act = (u + 1) * g * torch.sigmoid(a.swiglu_alpha * g)
        out = torch.einsum("tkn,tknh->tkh", act, can["experts_w2"][-1][idx]) + can["experts_b2"][-1][idx]
    else:
        g = torch.einsum("th,tkhn->tkn", x, can["experts_w1"][-1][idx])
        u = torch.einsum("th,tkhn->tkn", x, can["experts_w3"][-1][idx])
        out = torch.einsum("tkn,tknh->tkh", torch.nn.functional.silu(g) * u, can["experts_w2"][-1][idx])
    torch.testing.assert_close(router, router_ref)
    torch.testing.assert_close((out * gate_w[..., None]).sum(1), ref)


def test_hf_config_gives_valid_arch(hf, tmp_path):
    d, a = hf.arch_dict, hf.arch
    assert d["family"] == hf.family.name and a.num_hidden_layers == hf.config.num_hidden_layers
    assert (a.rope_scaling.rope_type if a.rope_scaling else "default") == hf.config.rope_parameters["rope_type"]
    if a.family == "gpt_oss":
        assert a.rope_scaling.truncate is False and a.num_local_experts == 8 and a.head_dim == 16
        # HF's layer_types (sliding on even layers) -> per-layer window
        assert [bool(hf.family.layer_traits(a, i)) for i in range(a.num_hidden_layers)] == \
            [t == "sliding_attention" for t in hf.config.layer_types]
    elif a.family == "qwen2_moe":
        assert a.num_experts == 8 and a.qkv_bias and a.shared_expert_intermediate_size == 48 and not a.norm_topk_prob
    elif a.family == "qwen3_moe":  # transformers 5 writes num_experts as num_local_experts
        assert "num_local_experts" in hf.config.to_dict() and a.num_experts == 8
        assert a.mlp_only_layers == (0,) and a.dense_layers == 1 and a.norm_topk_prob
    else:  # MLA has no KV heads / head_dim: HF's defaults (128 heads, head_dim = rope dim) are dropped
        assert "num_key_value_heads" not in d and "head_dim" not in d
        assert a.n_routed_experts == 8 and a.first_k_dense_replace == hf.config.first_k_dense_replace
    # and through the spec loader (from_hf: a directory with config.json)
    hf.config.to_json_file(tmp_path / "config.json")
    b = spec.loads("name: tiny\nfrom_hf: .\ntargets: [T3K]\nruntime: {max_model_len: 1024}\n",
                   str(tmp_path / "b.yaml"), base_dir=tmp_path)
    assert b.arch == a


def test_reference_config_round_trips(hf, tmp_path):
    """``to_hf_config`` (what ``ttbundle check`` builds its reference from) gives back the arch and
    a runnable HF model of the same size."""
    from ttbundle import reference

    b = tiny_bundle(hf.arch, tmp_path)
    cfg = reference.hf_config(b)
    assert hf.family.arch_model.model_validate(spec.hf_config_to_arch(
        {**cfg.to_dict(), "architectures": hf.config.architectures})) == hf.arch
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.model.parameters())
    with torch.no_grad():
        assert model(torch.arange(6)[None]).logits.shape == (1, 6, hf.arch.vocab_size)


UNSUPPORTED = [
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"topk_method": "group_limited_greedy"}, "topk_method"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "hqq"}}, "quantization_config.quant_method"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.5e5}}, "rope_type"),
    ("gpt_oss", {"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config.quant_method"),
]


@pytest.mark.parametrize("name, change, field", UNSUPPORTED, ids=[f"{n}-{f}" for n, _, f in UNSUPPORTED])
def test_unsupported_features_name_the_field(name, change, field):
    d = {**hf_config(name).to_dict(), **change}
    with pytest.raises(InvalidInput, match=field):
        spec.hf_config_to_arch(d)


@pytest.mark.parametrize("model, field", [
    ({"n_group": 3}, "n_group"), ({"num_experts_per_tok": 5}, "num_experts_per_tok")])
def test_deepseek_routing_checks(tmp_path, model, field):
    arch = spec.hf_config_to_arch({**hf_config("deepseek_v3").to_dict(), **model})
    with pytest.raises(InvalidInput) as e:
        tiny_bundle(get("deepseek_v3").arch_model.model_validate(arch), tmp_path)
    assert [d.path for d in e.value.diagnostics] == [f"model.{field}"]


def test_t3k_plan_is_expert_parallel(hf, tmp_path):
    p = make_plan(tiny_bundle(hf.arch, tmp_path), "T3K")
    experts = [t for t in p.tensors if t.group == "experts"]
    assert {t.name for t in experts} == ({"experts_w13", "experts_w2"} if hf.arch.family == "gpt_oss"
                                         else {"experts_w1", "experts_w3", "experts_w2"})
    for t in experts:  # 1/8 of the experts per device, each expert whole
        assert t.device_shape == [t.shape[0] // 8, *t.shape[1:]], t.name
    moe_kind = hf.family.layers(hf.arch)[-1].name  # DeepSeek's dense layers come first
    steps = next(s for name, _, s in p.programs if name == moe_kind)
    kinds = [(s.kind, s.act, type(s.op).__name__) for s in steps]
    combine = kinds.index(("op", "", "Combine"))
    reduce = kinds.index(("all_reduce", "moe_out", "NoneType"))
    assert combine < reduce and math.prod(map(p.mesh.axis_size, steps[reduce].axes)) == 8
    # the routed experts themselves need no communication before the Combine
    first_expert = next(i for i, s in enumerate(steps) if "experts_" in (getattr(s.op, "w", None) or ""))
    assert all(s.kind == "op" for s in steps[first_expert:combine])
    if hf.arch.family == "deepseek_v3":  # the latent KV cache is replicated: one 'head' per device
        (kv,) = p.kv["entries"]
        assert kv["device_shape"][1:] == [1, 32, hf.arch.kv_lora_rank + hf.arch.qk_rope_head_dim]


# ---- transforms ------------------------------------------------------------------------------------
def test_gate_up_deinterleave_round_trip():
    assert moe.gate_up_deinterleave([torch.arange(6)], None).tolist() == [0, 2, 4, 1, 3, 5]
    x = torch.randn(3, 4, 10)
    torch.testing.assert_close(torch.stack(moe.gate_up_deinterleave([x], None).chunk(2, -1), -1).flatten(-2), x)


def test_quantized_checkpoints_read_the_decoded_names():
    """The name tables read a quantized checkpoint's decoded view (``formats``): the dense names
    an unquantized checkpoint holds, whatever the spec's quantization_config says."""
    ds = spec.load(BUNDLES / "deepseek-v3.yaml")
    assert ds.arch.quantization_config is not None
    names = {n.tensor: n for n in ds.family.hf_names(ds.arch)}
    assert names["experts_w1"].hf == ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",)
    assert names["experts_w1"].transform == names["wq_a"].transform == "t"
    assert names["router"].transform == "t" and names["lm_head"].hf == ("lm_head.weight",)
    oss = spec.load(BUNDLES / "gpt-oss-20b.yaml")
    assert oss.arch.quantization_config is not None
    names = {n.tensor: n for n in oss.family.hf_names(oss.arch)}
    assert names["experts_w13"].hf == ("model.layers.{i}.mlp.experts.gate_up_proj",)
    assert names["experts_w13"].transform == "gate_up_deinterleave" and names["wq"].transform == "t"


# ---- example bundles at published dims ---------------------------------------------------------------
PUBLISHED = {"deepseek-v3": 671.0e9, "gpt-oss-20b": 20.9e9, "gpt-oss-120b": 116.8e9, "qwen1.5-moe-a2.7b": 14.3e9,
             "qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235.1e9}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_example_bundles_fit_their_targets(name):
    b = spec.load(BUNDLES / f"{name}.yaml")
    params = sum(math.prod(t.shape) * t.count for t in b.family.tensors(b.arch))
    assert abs(params / PUBLISHED[name] - 1) < 0.005, params
    for target in b.spec.targets:
        p = make_plan(b, target)
        assert p.fits, (target, p.memory)
        for t in p.tensors:
            if t.group == "experts":
                assert t.device_shape[0] * p.mesh.num_devices == t.shape[0]


# config.json of the published checkpoints (transformers 4 layout: rope_theta + rope_scaling)
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "aux_loss_alpha": 0.001, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280}
GPT_OSS_20B_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "experts_per_token": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088}


@pytest.mark.parametrize("config, bundle", [(DEEPSEEK_V3_CONFIG, "deepseek-v3"),
                                            (GPT_OSS_20B_CONFIG, "gpt-oss-20b")])
def test_published_config_imports_to_the_example_bundle(config, bundle):
    b = spec.load(BUNDLES / f"{bundle}.yaml")
    assert b.family.arch_model.model_validate(spec.hf_config_to_arch(config)) == b.arch


# ---- Qwen3 MoE: the published config.json files (tests/data/<model>/config.json) ----------------------
# Each with the mesh it is planned for and its parameter count as Keras Hub's presets publish it
# (an independent count: qwen3_moe_30b_a3b_en, qwen3_moe_235b_a22b_en).
DATA = Path(__file__).resolve().parent / "data"
QWEN3_MOE = {"qwen3-30b-a3b": ("T3K", 30_532_122_624), "qwen3-235b-a22b": ("TG", 235_093_634_560)}


@pytest.mark.parametrize("name", list(QWEN3_MOE))
def test_published_qwen3_moe_config_inits_to_a_spec_that_fits(name, tmp_path, runner):
    from ttbundle.cli import app

    mesh, params = QWEN3_MOE[name]
    out = tmp_path / "spec.yaml"
    r = runner.invoke(app, ["init", "--from-hf", str(DATA / name), "-o", str(out), "--mesh", mesh])
    assert r.exit_code == 0, r.output
    b = spec.load(out)
    assert b.family.name == "qwen3_moe" and b.arch.norm_topk_prob and b.arch.dense_layers == 0
    assert sum(math.prod(t.shape) * t.count for t in b.family.tensors(b.arch)) == params
    p = make_plan(b, mesh)
    assert p.fits, p.memory
    experts = [t for t in p.tensors if t.group == "experts"]
    assert len(experts) == 3
    for t in experts:  # 128 experts: 16 per T3K chip, 4 per Galaxy chip, each expert whole
        assert t.device_shape == [128 // p.mesh.num_devices, *t.shape[1:]], t.name
    # the example bundle under bundles/ has the published dims and fits its targets
    ex = spec.load(BUNDLES / f"{name}.yaml")
    assert ex.arch == b.arch and mesh in ex.spec.targets
    for target in ex.spec.targets:
        assert make_plan(ex, target).fits, target


def test_qwen3_moe_config_layouts_and_unsupported_settings():
    cfg = json.loads((DATA / "qwen3-30b-a3b" / "config.json").read_text())
    a = spec.hf_config_to_arch(cfg)
    # transformers 5 writes num_experts as num_local_experts; both import alike
    renamed = {**{k: v for k, v in cfg.items() if k != "num_experts"}, "num_local_experts": 128}
    assert spec.hf_config_to_arch(renamed) == a
    for change, field in (({"decoder_sparse_step": 2}, "decoder_sparse_step"),
                          ({"use_sliding_window": True}, "use_sliding_window"),
                          ({"attention_bias": True}, "attention_bias")):
        with pytest.raises(InvalidInput, match=field):
            spec.hf_config_to_arch({**cfg, **change})


@pytest.mark.parametrize("model, field, says", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok", "exceeds num_experts=8"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers", "not the leading layers"),
    ({"mlp_only_layers": [0, 3]}, "mlp_only_layers", "outside 0..2")])
def test_qwen3_moe_checks_name_the_field(tmp_path, model, field, says):
    arch = spec.hf_config_to_arch({**hf_config("qwen3_moe").to_dict(), **model})
    with pytest.raises(InvalidInput) as e:
        tiny_bundle(get("qwen3_moe").arch_model.model_validate(arch), tmp_path)
    assert [d.path for d in e.value.diagnostics] == [f"model.{field}"]
    assert says in str(e.value.diagnostics[0])


def test_qwen2_moe_config_import():
    """Qwen1.5-MoE's published config.json has no qkv_bias (HF's default: biases); one that says
    false declares no bias tensors; a sparse step other than 1 is refused naming the field."""
    d = hf_config("qwen2_moe").to_dict()
    a = get("qwen2_moe").arch_model.model_validate(spec.hf_config_to_arch({k: v for k, v in d.items() if k != "qkv_bias"}))
    assert a.qkv_bias and {"bq", "bk", "bv", "shared_gate"} <= {t.name for t in get("qwen2_moe").tensors(a)}
    a = get("qwen2_moe").arch_model.model_validate(spec.hf_config_to_arch({**d, "qkv_bias": False}))
    assert not {"bq", "bk", "bv"} & {t.name for t in get("qwen2_moe").tensors(a)}
    with pytest.raises(InvalidInput, match="decoder_sparse_step"):
        spec.hf_config_to_arch({**d, "decoder_sparse_step": 2})
