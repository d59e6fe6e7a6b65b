"""Qwen3 MoE the way a user meets it: a checkpoint written by transformers' own
``Qwen3MoeForCausalLM`` (tiny, random), ``ttbundle init --from-hf`` for N150, N300 and T3K, then
``ttbundle check`` on each mesh: the package against transformers on the same checkpoint, every
expert choice recorded on both sides. The routing is exercised: a renormalized top-2 of 8 experts
behind a dense first layer (``mlp_only_layers``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
import yaml

from ttbundle import spec as specmod
from ttbundle.cli import app

MESHES = ["N150", "N300", "T3K"]
CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
              max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """transformers' Qwen3MoeForCausalLM with weights scaled so activations stay O(1) (its own
    init gives near-constant outputs), saved in bf16; no tokenizer (the check's prompt is then
    random token ids, not natural text a tiny word list would map to unknown tokens)."""
    d = tmp_path_factory.mktemp("qwen3-moe-tiny")
    cfg = transformers.Qwen3MoeConfig(**CONFIG)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape) * (0.5 if "embed" in name else p.shape[-1] ** -0.5))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
    model.to(torch.bfloat16).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def spec_file(checkpoint, tmp_path_factory):
    from typer.testing import CliRunner

    out = tmp_path_factory.mktemp("spec") / "tiny-qwen3-moe.yaml"
    r = CliRunner().invoke(app, ["init", "--from-hf", str(checkpoint), "-o", str(out),
                                 *[x for m in MESHES for x in ("--mesh", m)]])
    assert r.exit_code == 0, r.output
    assert "tokenizer: false" in r.output  # what init says to do without a tokenizer: done here
    out.write_text(out.read_text() + "\ntokenizer: false\n")
    return out


def test_init_reads_the_checkpoint_config(spec_file):
    b = specmod.load(spec_file)
    a = b.arch
    assert (a.family, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob, a.mlp_only_layers) == \
        ("qwen3_moe", 8, 2, True, (0,))
    assert [k.name for k in b.family.layers(a)] == ["dense", "moe"]
    assert b.spec.targets == MESHES


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_check_equals_transformers_on_every_mesh(spec_file, mesh, runner):
    r = runner.invoke(app, ["check", str(spec_file), "--mesh", mesh, "--steps", "16", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["passed"] and rep["executor"]["passed"] and rep["mesh"] == mesh
    assert rep["ref_tokens"] == rep["emulated_tokens"] and len(set(rep["ref_tokens"])) > 8
    routing = rep["executor"]["routing"]
    assert routing["moe_layers"] == [1, 2] and routing["choices"] > 0 and routing["flipped"] == 0
    assert all(s["pcc"] > 0.9999 for s in rep["executor"]["stages"] if s.get("pcc") is not None
               and not math.isnan(s["pcc"]))


def test_spec_round_trips_to_the_checkpoint_config(spec_file, checkpoint):
    """The reference config ttbundle builds from the spec is the checkpoint's own (what the
    check's transformers side runs)."""
    from ttbundle import reference
    b = specmod.load(spec_file)
    mine = reference.hf_config(b).to_dict()
    theirs = json.loads((checkpoint / "config.json").read_text())
    for k in ("num_local_experts", "num_experts_per_tok", "norm_topk_prob", "mlp_only_layers",
              "moe_intermediate_size", "head_dim", "num_key_value_heads", "decoder_sparse_step"):
        assert mine[k] == theirs[k], k
    assert yaml.safe_load(spec_file.read_text())["model"]["num_experts"] == 8
