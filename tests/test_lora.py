"""LoRA adapters merged at build (``weights.adapters``, ``ttbundle.formats.lora``): the package
built from a base checkpoint and a PEFT adapter is byte-identical to the package built from the
checkpoint merged independently here with PEFT's documented arithmetic (``W + alpha/r * B @ A``,
``rank_pattern`` / ``alpha_pattern``, ``use_rslora``, ``modules_to_save``; peft is not installed
here to run ``merge_and_unload`` itself), ``check`` passes against transformers on the same
merged weights, and an adapter that does not fit its base is exit 2 naming the tensor."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from test_emulated import tiny as dense_tiny  # noqa: E402

from ttbundle import reference  # noqa: E402
from ttbundle.build import build  # noqa: E402
from ttbundle.check import run_check  # noqa: E402
from ttbundle.errors import InvalidInput  # noqa: E402

P = "base_model.model."


def with_adapters(bundle, src, adapters):
    s = bundle.spec
    w = s.weights.model_copy(update={"source": str(src), "adapters": [str(a) for a in adapters]})
    return dataclasses.replace(bundle, spec=s.model_copy(update={"weights": w, "tokenizer": False}))


def write_adapter(d: Path, base: dict, cfg: dict, seed: int = 0, modules=("q_proj", "v_proj"), save_head=True):
    """A PEFT LoRA adapter for ``base`` (its tensors) as ``save_pretrained`` writes one."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    for k, w in base.items():
        m = k[:-len(".weight")] if k.endswith(".weight") else None
        if m is None or not m.endswith(modules):
            continue
        r = next((v for p, v in cfg.get("rank_pattern", {}).items() if m.endswith(p)), cfg["r"])
        t[f"{P}{m}.lora_A.weight"] = torch.randn(r, w.shape[1], generator=g) * 0.1
        t[f"{P}{m}.lora_B.weight"] = torch.randn(w.shape[0], r, generator=g) * 0.1  # trained: not zero
    if save_head:
        t[f"{P}lm_head.weight"] = torch.randn(base["lm_head.weight"].shape, generator=g) * 0.05
    d.mkdir(parents=True)
    save_file(t, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "bias": "none", "fan_in_fan_out": False, "use_dora": False,
        "target_modules": list(modules), "modules_to_save": ["lm_head"] if save_head else None, **cfg}))
    return d


def merge_by_hand(base: dict, adapters: list) -> dict:
    """PEFT's merge_and_unload, written out: per target module W + scaling * B @ A (scaling
    alpha / r, rsLoRA alpha / sqrt(r), per-module r and alpha from the patterns), modules_to_save
    replacing their weights; adapters in order."""
    out = {k: v.float().clone() for k, v in base.items()}
    for d in adapters:
        cfg = json.loads((d / "adapter_config.json").read_text())
        t = load_file(str(d / "adapter_model.safetensors"))
        for k, v in t.items():
            name = k[len(P):]
            if ".lora_A." in name:
                m = name.split(".lora_A.")[0]
                r = next((x for p, x in cfg.get("rank_pattern", {}).items() if m.endswith(p)), cfg["r"])
                a = next((x for p, x in cfg.get("alpha_pattern", {}).items() if m.endswith(p)), cfg["lora_alpha"])
                s = a / math.sqrt(r) if cfg.get("use_rslora") else a / r
                out[m + ".weight"] = out[m + ".weight"] + s * (t[k.replace("lora_A", "lora_B")].float() @ v.float())
            elif ".lora_B." not in name:
                out[name] = v.float()
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    b = dense_tiny("llama")
    d = reference.save_random(b, tmp_path_factory.mktemp("base") / "ck", seed=1)
    return b, d, load_file(str(d / "model.safetensors"))


def weight_digests(pkg) -> dict:
    m = json.loads((Path(pkg) / "manifest.json").read_text())
    return {k: v["sha256"] for k, v in m["files"].items() if k.startswith("weights/")}


def test_merged_package_is_the_hand_merged_checkpoints(tmp_path, base):
    b, src, sd = base
    a1 = write_adapter(tmp_path / "a1", sd, {"r": 4, "lora_alpha": 8, "rank_pattern": {"layers.1.self_attn.v_proj": 2},
                                              "alpha_pattern": {"layers.0.self_attn.q_proj": 32}})
    a2 = write_adapter(tmp_path / "a2", sd, {"r": 8, "lora_alpha": 16, "use_rslora": True}, seed=1,
                       modules=("o_proj", "down_proj"), save_head=False)
    merged = tmp_path / "merged"
    merged.mkdir()
    save_file({k: v.contiguous() for k, v in merge_by_hand(sd, [a1, a2]).items()}, str(merged / "model.safetensors"))
    (merged / "config.json").write_text((src / "config.json").read_text())
    got = build(with_adapters(b, src, [a1, a2]), "N300", tmp_path / "out1", warmup=False)
    want = build(with_adapters(b, merged, []), "N300", tmp_path / "out2", warmup=False)
    plain = build(with_adapters(b, src, []), "N300", tmp_path / "out3", warmup=False)
    assert weight_digests(got.package) == weight_digests(want.package)
    assert weight_digests(got.package) != weight_digests(plain.package)  # the adapters changed something


def test_check_runs_the_merged_weights(tmp_path, base):
    b, src, sd = base
    a = write_adapter(tmp_path / "a", sd, {"r": 4, "lora_alpha": 8})
    r = run_check(with_adapters(b, src, [a]), "N300", steps=4, seed=3)
    assert r.passed and r.quality.top1 == 1.0, r.failure()


@pytest.mark.parametrize("edit,named", [
    (lambda t: t.update({f"{P}model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 7)}),
     r"q_proj.lora_A.weight \[4, 7\].*gives \[256, 7\].*the base model.layers.0.self_attn.q_proj.weight is \[256, 256\]"),
    (lambda t: t.update({f"{P}model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(4, 256),
                         f"{P}model.layers.0.mlp.gate_proj.lora_B.weight": torch.zeros(512, 4)}),
     r"mlp.gate_proj.lora_A.weight: module 'model.layers.0.mlp.gate_proj' is not in the adapter's target_modules"),
    (lambda t: t.update({f"{P}model.layers.0.self_attn.x_proj.lora_A.weight": torch.zeros(4, 256),
                         f"{P}model.layers.0.self_attn.x_proj.lora_B.weight": torch.zeros(256, 4)}),
     r"x_proj.lora_A.weight targets 'model.layers.0.self_attn.x_proj.weight', which the base checkpoint does not"),
])
def test_adapters_that_do_not_fit_are_exit_2_naming_the_tensor(tmp_path, base, edit, named):
    b, src, sd = base
    a = write_adapter(tmp_path / "a", sd, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "x_proj"]})
    t = load_file(str(a / "adapter_model.safetensors"))
    edit(t)
    save_file(t, str(a / "adapter_model.safetensors"))
    with pytest.raises(InvalidInput, match=named):
        build(with_adapters(b, src, [a]), "N300", tmp_path / "out", warmup=False)


def test_embedding_lora_is_merged_transposed(tmp_path, base):
    """PEFT's embedding LoRA: ``lora_embedding_A`` [r, vocab], ``lora_embedding_B`` [hidden, r],
    delta ``(B @ A)^T`` (PEFT's ``Embedding.get_delta_weight``)."""
    from ttbundle.weights import Checkpoint

    b, src, sd = base
    V, H = sd["model.embed_tokens.weight"].shape
    a, bb = torch.randn(2, V), torch.randn(H, 2)
    d = tmp_path / "emb"
    d.mkdir()
    save_file({f"{P}model.embed_tokens.lora_embedding_A": a, f"{P}model.embed_tokens.lora_embedding_B": bb},
              str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                       "target_modules": ["embed_tokens"]}))
    got = Checkpoint(src, adapters=[d]).get("model.embed_tokens.weight")
    want = sd["model.embed_tokens.weight"].float() + 2.0 * (bb @ a).t()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_a_changed_adapter_rebuilds_the_weights(tmp_path, base):
    """The adapters' files are in the weights' content key: the same spec over an edited adapter
    is another package (an unchanged one is left as it was)."""
    b, src, sd = base
    a = write_adapter(tmp_path / "a", sd, {"r": 4, "lora_alpha": 8}, save_head=False)
    first = weight_digests(build(with_adapters(b, src, [a]), "N150", tmp_path / "out", warmup=False).package)
    again = build(with_adapters(b, src, [a]), "N150", tmp_path / "out", warmup=False)
    assert weight_digests(again.package) == first
    cfg = json.loads((a / "adapter_config.json").read_text())
    (a / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 16}))
    assert weight_digests(build(with_adapters(b, src, [a]), "N150", tmp_path / "out", warmup=False).package) != first
