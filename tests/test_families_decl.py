"""Family declarations against Hugging Face transformers as the independent reference.

Each family gets tiny HF configs instantiated with random weights. Our declarations must account
for every parameter (count and shape), name every checkpoint key exactly once, read the config
(transformers>=5 layout, and the published transformers-4 config.json of the real model) as the
same dims HF reads, and refuse what they do not implement naming the config key. Every bundle
must validate and fit each of its targets.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ttbundle import families, spec
from ttbundle.plan.make import make_plan
from ttbundle.errors import InvalidInput  # noqa: E402
from ttbundle.families import transforms  # noqa: E402
from ttbundle.families.base import Embed, Linear, Local, Norm, Residual  # noqa: E402

BUNDLES = Path(__file__).resolve().parent.parent / "bundles"
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2)
GEMMA3_TEXT = dict(TINY, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                   sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
                   rope_scaling={"rope_type": "linear", "factor": 8.0})

# case -> (HF architecture, config factory); head_dim != hidden/heads where the family allows it
CASES = {
    "qwen2": ("Qwen2ForCausalLM", lambda: transformers.Qwen2Config(**TINY)),
    "qwen2-tied": ("Qwen2ForCausalLM", lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", lambda: transformers.Qwen3Config(
        **TINY, head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})),
    "mistral": ("MistralForCausalLM", lambda: transformers.MistralConfig(**TINY, sliding_window=None)),
    "mistral-swa": ("MistralForCausalLM", lambda: transformers.MistralConfig(**TINY, sliding_window=16)),
    "gemma2": ("Gemma2ForCausalLM", lambda: transformers.Gemma2Config(
        **TINY, head_dim=32, query_pre_attn_scalar=24, sliding_window=16)),
    "gemma3": ("Gemma3ForCausalLM", lambda: transformers.Gemma3TextConfig(**GEMMA3_TEXT)),
    "gemma3-mm": ("Gemma3ForConditionalGeneration", lambda: transformers.Gemma3Config(
        text_config=GEMMA3_TEXT, mm_tokens_per_image=4, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14))),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", lambda: transformers.Qwen2_5_VLConfig(
        text_config=dict(TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=127, video_token_id=126, vision_start_token_id=124, vision_end_token_id=125)),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", lambda: transformers.Qwen3VLConfig(
        text_config=dict(TINY, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                           "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=8, num_position_embeddings=16, deepstack_visual_indexes=[0, 2]),
        image_token_id=127, video_token_id=126, vision_start_token_id=124, vision_end_token_id=125)),
    "mistral3": ("Mistral3ForConditionalGeneration", lambda: transformers.Mistral3Config(
        text_config=dict(TINY, model_type="mistral", head_dim=32, sliding_window=None),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=2, image_size=64, patch_size=8, hidden_act="silu"),
        image_token_index=127, tie_word_embeddings=False)),
}


@functools.cache
def built(case: str):
    """(HF config, HF model with random weights, our family, our arch read from the config)."""
    arch, make = CASES[case]
    cfg = make()
    cfg.architectures = [arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).eval()
    imported = spec.hf_config_to_arch(cfg.to_dict())
    fam = families.get(imported["family"])
    return cfg, model, fam, fam.arch_model.model_validate(imported)


def hf_key(fam, key: str, a=None) -> str | None:
    """A checkpoint key as the family's name table spells it; None if deliberately unused (for
    arch ``a``: a multimodal arch uses its vision tower, a text-only one leaves it)."""
    for pat, rep in fam.hf_key_renames:
        key = re.sub(pat, rep, key)
    return None if any(re.match(p, key) for p in fam.ignored(a)) else key


def checkpoint(fam, model, a=None) -> dict:
    """The model's tensors as a saved checkpoint holds them: tied weights once (the first name)."""
    seen, out = set(), {}
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        if (name := hf_key(fam, k, a)) is not None:
            out[name] = v
    return out


# ---- (1) parameter count --------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_declared_tensors_count_every_hf_parameter(case):
    cfg, model, fam, a = built(case)
    decls = {t.name: t for t in fam.tensors(a)}
    ours = sum(math.prod(t.shape) * t.count for t in decls.values())
    if a.tie_word_embeddings:  # the device's lm_head is a transposed copy, HF's a second name
        ours -= math.prod(decls["lm_head"].shape)
    theirs = sum(p.numel() for n, p in model.named_parameters() if hf_key(fam, n, a) is not None)
    assert ours == theirs


# ---- (2) name table: every key consumed once, transforms give the declared shapes ------------------
@pytest.mark.parametrize("case", CASES)
def test_hf_names_consume_every_checkpoint_key_once(case):
    cfg, model, fam, a = built(case)
    ck = checkpoint(fam, model, a)
    decls = {t.name: t for t in fam.tensors(a)}
    table = fam.hf_names(a)
    assert sorted(n.tensor for n in table) == sorted(decls)
    uses: Counter = Counter()
    for n in table:
        t = decls[n.tensor]
        for i in [None] if t.layers is None else range(*t.layers):
            keys = [k if i is None else k.replace("{i}", str(i)) for k in n.hf]
            missing = [k for k in keys if k not in ck]
            assert not missing, f"{n.tensor}: no {missing} in the HF checkpoint"
            uses.update(keys)
            w = transforms.apply(n.transform, [ck[k] for k in keys], a)
            assert tuple(w.shape) == t.shape, f"{n.tensor} layer {i}"
    assert sorted(set(ck) - set(uses)) == [], "HF tensors no declaration consumes"
    tied = {"model.embed_tokens.weight": 2} if a.tie_word_embeddings else {}
    # a fused q/k/v checkpoint tensor (Qwen2.5-VL's vision qkv) is read by its three parts, which
    # put back together are the tensor itself
    fused: dict = {}
    for n in table:
        if n.transform.startswith("qkv_"):
            fused.setdefault(n.hf[0], []).append(n)
    for key, parts in fused.items():
        assert sorted(p.transform for p in parts) == ["qkv_0", "qkv_1", "qkv_2"], key
        src = ck[key.replace("{i}", "0")]
        got = [transforms.apply(f"qkv_{k}", [src], a) for k in range(3)]
        back = torch.cat([g.transpose(0, 1) if g.dim() == 2 else g for g in got], dim=0)
        assert torch.equal(back, src), key
    fused_uses = {k.replace("{i}", str(i)): 3 for k in fused
                  for i in ([None] if "{i}" not in k else range(a.vision.depth))}
    assert {k: c for k, c in uses.items() if c != 1} == {**tied, **fused_uses}


# ---- (3) config import --------------------------------------------------------------------------
EXTRA = ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")


def view(a) -> dict:
    """What our arch says about the model, in terms HF configs can be asked about."""
    rope = {"rope_theta": a.rope_theta, "rope_type": "default"}
    rope |= a.rope_scaling.model_dump(exclude_none=True) if a.rope_scaling else {}
    v = dict(vocab=a.vocab_size, hidden=a.hidden_size, inter=a.intermediate_size, layers=a.num_hidden_layers,
             heads=a.num_attention_heads, kv_heads=a.kv_heads, head_dim=a.hd, max_pos=a.max_position_embeddings,
             eps=a.rms_norm_eps, tied=a.tie_word_embeddings, act=a.hidden_act, rope=rope)
    v |= {k: getattr(a, k) for k in EXTRA if k in type(a).model_fields}
    if hasattr(a, "kinds"):
        v["layer_types"] = list(a.kinds)
    if hasattr(a, "rope_local_base_freq"):
        v["local_rope"] = a.rope_local_base_freq
    if hasattr(a, "mrope_section"):
        v["mrope_section"] = list(a.mrope_section)
    return v


def hf_view(cfg, like: dict) -> dict:
    """The same facts read from an HF config object (only the keys ``like`` has)."""
    t = cfg.get_text_config()
    rp = t.rope_parameters
    full = rp.get("full_attention", rp)
    v = dict(vocab=t.vocab_size, hidden=t.hidden_size, inter=t.intermediate_size, layers=t.num_hidden_layers,
             heads=t.num_attention_heads, kv_heads=t.num_key_value_heads,
             head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
             max_pos=t.max_position_embeddings, eps=t.rms_norm_eps,
             tied=getattr(t, "tie_word_embeddings", None) if hasattr(t, "tie_word_embeddings") else cfg.tie_word_embeddings,
             act=getattr(t, "hidden_activation", None) or t.hidden_act,
             rope={k: full.get(k) for k in like["rope"]})
    v |= {k: getattr(t, k) for k in EXTRA if k in like}
    if "layer_types" in like:
        v["layer_types"] = list(t.layer_types)
    if "local_rope" in like:
        v["local_rope"] = rp["sliding_attention"]["rope_theta"]
    if "mrope_section" in like:
        v["mrope_section"] = list(rp["mrope_section"])
    return v


@pytest.mark.parametrize("case", CASES)
def test_config_imports_as_hf_reads_it_and_exports_back(case):
    cfg, model, fam, a = built(case)
    assert view(a) == hf_view(cfg, view(a))
    d = fam.to_hf_config(a)  # what the numerical reference is built from
    back = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    assert hf_view(back, view(a)) == view(a)


# Published config.json files (transformers 4.x layout; only the keys a model reads), one per bundle
_LLAMA31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "hidden_act": "silu", "max_position_embeddings": 131072, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
PUBLISHED = {
    "llama-3.1-8b.yaml": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336,
                          "num_attention_heads": 32, "num_hidden_layers": 32},
    "llama-3.1-70b.yaml": {**_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672,
                           "num_attention_heads": 64, "num_hidden_layers": 80},
    "qwen2.5-7b.yaml": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 152064},
    "qwen3-8b.yaml": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936},
    "mistral-7b-v0.3.yaml": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32768},
    "gemma-2-9b.yaml": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 16,
        "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000},
    "gemma-3-27b.yaml": {  # the multimodal wrapper; text_config leaves most keys at Gemma3TextConfig's defaults
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                        "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
                        "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}},
    "gemma-3-4b-it.yaml": {  # imported with its vision tower (the bundle keeps it)
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}},
}


PUBLISHED["qwen2.5-vl-7b-instruct.yaml"] = {  # flat: the text dims beside vision_config (transformers 4.x)
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 128000, "max_window_layers": 28,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 152064, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}}
PUBLISHED["qwen3-vl-8b-instruct.yaml"] = {  # text_config and vision_config (transformers 4.57)
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
                    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
                    "intermediate_size": 12288, "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
                    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-06, "rope_theta": 5000000, "vocab_size": 151936,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}},
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_vl",
                      "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2}}
PUBLISHED["mistral-small-3.1-24b-instruct.yaml"] = {  # the published config (transformers 4.50): no tie_word_embeddings
    "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "image_token_index": 10,
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "vision_feature_layer": -1,
    "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
                    "intermediate_size": 32768, "max_position_embeddings": 131072, "model_type": "mistral",
                    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
    "vision_config": {"attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024,
                      "image_size": 1540, "intermediate_size": 4096, "model_type": "pixtral",
                      "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14,
                      "rope_theta": 10000.0}}
# the vision dims transformers reads, per family: (name in the HF vision config, name in ours)
VISION_KEYS = {
    "gemma3": [(k, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "image_size", "patch_size", "layer_norm_eps")],
    "qwen2_5_vl": [(k, k) for k in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                    "patch_size", "temporal_patch_size", "spatial_merge_size", "window_size",
                                    "out_hidden_size", "hidden_act")]
    + [("fullatt_block_indexes", "fullatt_block_indexes")],
    "qwen3_vl": [(k, k) for k in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                  "patch_size", "temporal_patch_size", "spatial_merge_size", "num_position_embeddings",
                                  "out_hidden_size", "hidden_act")]
    + [("deepstack_visual_indexes", "deepstack_visual_indexes")],
    "mistral3": [(k, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                  "num_channels", "image_size", "patch_size", "hidden_act")],
}
WRAPPER_KEYS = {
    "gemma3": [("mm_tokens_per_image", "mm_tokens_per_image"), ("image_token_id", "image_token_index"),
               ("boi_token_index", "boi_token_index"), ("eoi_token_index", "eoi_token_index")],
    "qwen2_5_vl": [(k, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                    "vision_end_token_id")],
    "qwen3_vl": [(k, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id")],
    "mistral3": [(k, k) for k in ("image_token_index", "spatial_merge_size", "projector_hidden_act",
                                  "multimodal_projector_bias", "vision_feature_layer")],
}


@pytest.mark.parametrize("bundle", sorted(PUBLISHED))
def test_published_config_imports_to_the_bundle_dims(bundle):
    cfg = PUBLISHED[bundle]
    imported = spec.hf_config_to_arch(cfg)
    a = families.get(imported["family"]).arch_model.model_validate(imported)
    ours = spec.load(BUNDLES / bundle).arch
    if "vision_config" in cfg and ours.vision is None:  # a text-only bundle of a multimodal model
        a = a.model_copy(update={"vision": None})
    assert a == ours
    hf = transformers.AutoConfig.for_model(**cfg)
    assert hf_view(hf, view(a)) == view(a)
    if getattr(a, "vision", None) is not None:  # the vision dims as transformers reads them
        vc = hf.vision_config
        norm = lambda x: list(x) if isinstance(x, (list, tuple)) else x  # noqa: E731
        assert {h: norm(getattr(vc, h)) for h, _ in VISION_KEYS[a.family]} == \
            {h: norm(getattr(a.vision, o)) for h, o in VISION_KEYS[a.family]}
        assert {h: getattr(hf, h) for h, _ in WRAPPER_KEYS[a.family]} == \
            {h: getattr(a.vision, o) for h, o in WRAPPER_KEYS[a.family]}


@pytest.mark.parametrize("name,model_type", [("mistral", "mistral"), ("gemma2", "gemma2"), ("gemma3", "gemma3_text")])
def test_hf_defaults_are_the_config_class_defaults(name, model_type):
    hf = transformers.AutoConfig.for_model(model_type)
    rp = hf.rope_parameters
    for k, v in families.get(name).hf_defaults.items():
        theirs = rp.get("full_attention", rp)["rope_theta"] if k == "rope_theta" else getattr(hf, k)
        assert (k, theirs) == (k, v)


def test_gemma3_multimodal_checkpoint_layouts_map_to_text_model_keys():
    fam = families.get("gemma3")
    for key in ("model.language_model.layers.3.mlp.up_proj.weight",  # transformers>=4.52
                "language_model.model.layers.3.mlp.up_proj.weight"):  # published google/gemma-3-*-it
        assert hf_key(fam, key) == "model.layers.3.mlp.up_proj.weight"
    assert hf_key(fam, "language_model.lm_head.weight") == "lm_head.weight"
    for key in ("vision_tower.vision_model.post_layernorm.weight", "model.multi_modal_projector.mm_soft_emb_norm.weight"):
        assert hf_key(fam, key) is None


# ---- (4) unsupported features are refused naming the config key --------------------------------
def _set(**kw):
    return lambda d: d.update(kw)


def _v4_rope(d):  # transformers 4 layout with a rope type ttbundle does not implement
    d.pop("rope_parameters")
    d.update(rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0})


UNSUPPORTED = [
    ("qwen2", _set(use_sliding_window=True), "use_sliding_window=True"),
    ("qwen2", _set(layer_types=["sliding_attention"] * 4), "layer_types="),
    ("qwen2", _set(hidden_act="relu"), "hidden_act='relu'"),
    ("qwen3", _set(attention_bias=True), "attention_bias=True"),
    ("mistral", _set(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type='dynamic'"),
    ("mistral", _v4_rope, "rope_scaling.rope_type='dynamic'"),
    ("gemma2", _set(hidden_activation="relu"), "hidden_activation='relu'"),
    ("gemma2", _set(attention_bias=True), "attention_bias=True"),
    ("gemma2", _set(layer_types=["sliding_attention"] * 3), "layer_types: has 3 entries"),
    ("gemma2", _set(layer_types=["chunked_attention"] * 4), "layer_types.0"),
    ("gemma3", lambda d: d["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0),
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ("gemma3", _set(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma3-mm", lambda d: d["text_config"].update(attention_bias=True), "attention_bias=True"),
]


@pytest.mark.parametrize("case,change,named", UNSUPPORTED, ids=[f"{c}-{n}" for c, _, n in UNSUPPORTED])
def test_unsupported_config_is_refused_naming_the_key(tmp_path, case, change, named):
    d = built(case)[0].to_dict()
    change(d)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(d))
    with pytest.raises(InvalidInput) as ei:
        spec.loads("name: t\nfrom_hf: hf\ntargets: [N150]\n", "spec.yaml", base_dir=tmp_path)
    assert named in str(ei.value)


# ---- per-layer numerics and dataflow ------------------------------------------------------------
def _decoder(model):
    inner = model.model
    return getattr(inner, "language_model", inner)


@pytest.mark.parametrize("case", CASES)
def test_traits_match_hf_modules(case):
    cfg, model, fam, a = built(case)
    t, dec = cfg.get_text_config(), _decoder(model)
    rp = t.rope_parameters
    traits = fam.traits(a)
    assert traits.get("embed_scale") == getattr(dec.embed_tokens, "embed_scale", torch.tensor(float("nan"))).item() \
        or "embed_scale" not in traits and not hasattr(dec.embed_tokens, "embed_scale")
    assert traits.get("final_softcap") == getattr(t, "final_logit_softcapping", None)
    # a freshly built HF norm holds its neutral weight: 1 for x*w, 0 for Gemma's x*(1+w)
    assert dec.norm.weight.unique().tolist() == [1.0 - traits.get("norm_offset", 0.0)]
    for i, layer in enumerate(dec.layers):
        at, lt = layer.self_attn, fam.layer_traits(a, i)
        assert lt.get("attn_scale", a.hd ** -0.5) == pytest.approx(at.scaling)
        assert lt.get("window") == getattr(at, "sliding_window", getattr(t, "sliding_window", None))
        assert lt.get("attn_softcap") == getattr(at, "attn_logit_softcapping", None)
        layer_rp = rp.get(getattr(t, "layer_types", [None] * t.num_hidden_layers)[i], rp)
        scaling = lt.get("rope_scaling", a.rope_scaling)
        assert (lt.get("rope_theta", a.rope_theta), scaling.rope_type if scaling else "default") == \
            (layer_rp["rope_theta"], layer_rp["rope_type"])


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_layer_dataflow_uses_declared_weights_and_produced_activations(name):
    cfg, model, fam, a = built(name)
    decls = {t.name: t for t in fam.tensors(a)}
    for kind in fam.layers(a):
        have = {"h"}
        for op in kind.ops:
            ins = {Norm: lambda o: [o.x], Linear: lambda o: [o.x], Local: lambda o: list(o.ins),
                   Residual: lambda o: [o.x], Embed: lambda o: []}[type(op)](op)
            assert set(ins) <= have, f"{kind.name}: {op} reads an activation nothing produced"
            w = getattr(op, "w", None)
            assert w is None or w in decls, f"{op} uses undeclared {w}"
            have.add(getattr(op, "out", "h"))
    layered = {t.layers for t in decls.values() if t.layers is not None}
    assert layered == {(0, a.num_hidden_layers)}
    assert [e.count for e in fam.kv_cache(a)] == [a.num_hidden_layers] * 2


# ---- transforms ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(6, 4), (3, 6, 4)], ids=["linear", "experts"])
def test_transpose_round_trips_and_matches_nn_linear(shape):
    w = torch.randn(shape)
    d = transforms.apply("t", [w], None)
    assert d.shape == shape[:-2] + (shape[-1], shape[-2]) and d.is_contiguous()
    assert torch.equal(transforms.apply("t", [d], None), w)
    x = torch.randn(5, shape[-1])
    torch.testing.assert_close(x @ d, torch.einsum("tk,...nk->...tn", x, w))  # HF Linear: x @ W.T
    assert transforms.apply("id", [w], None) is w


def test_every_transform_a_family_names_exists():
    for case in CASES:
        _, _, fam, a = built(case)
        assert {n.transform for n in fam.hf_names(a)} <= set(transforms.TRANSFORMS), case


# ---- bundles ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(BUNDLES.glob("*.yaml")), ids=lambda p: p.name)
def test_bundle_validates_and_fits_each_target(path):
    b = spec.load(path)
    for target in b.spec.targets:
        p = make_plan(b, target)
        assert p.fits, f"{target}: needs {p.memory.total:,} B per chip of {p.memory.dram:,}"
