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
    # fp32: both sides route alike, but for a tie a correct GEMM's summation order decides
    # (verdict.router_tie; one of 2,044 choices on T3K on an AMD EPYC host): judged apart
    assert routing["moe_layers"] == [1, 2] and routing["choices"] > 0
    assert routing["flipped"] == routing["judged_apart"] <= routing["choices"] // 500
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


def test_router_tie_is_a_gap_within_fp32_summation_order():
    """``verdict.router_tie``: two expert choices differ by a tie only where every swapped pair's
    expected logits are within FP32_TIE x the row's rms."""
    from ttbundle.check.verdict import FP32_TIE, router_tie

    logits = torch.tensor([1.7, 1.5022689, 1.5022675, -0.3, 0.2, -1.1, 0.9, 0.4])
    assert router_tie(logits, {0, 1}, {0, 2})  # 1.4e-6 apart (rms ~1): the T3K case
    assert not router_tie(logits, {0, 1}, {0, 6})  # 0.6 apart
    assert not router_tie(logits, {0, 1}, {0, 2, 6})  # not a swap
    assert not router_tie(logits, {0, 1}, {0, 1})  # no difference is no tie to excuse
    rms = float(logits.pow(2).mean().sqrt())
    near = logits.clone()
    near[2] = near[1] - 2 * FP32_TIE * rms
    assert not router_tie(near, {0, 1}, {0, 2})


@pytest.mark.parametrize("tie", [False, True])
def test_fp32_check_fails_a_routing_flip_that_is_no_tie(spec_file, checkpoint, tmp_path, monkeypatch, tie):
    """fp32: a token of the prefill sent to another expert than its router chose (the lowest of
    its two swapped for the best unchosen: logits apart by far more than a tie) fails check at
    that layer; the same flip with the tie threshold widened past it is judged apart (and passes
    FLIP_BOUND_BF16): the threshold is what decides."""
    from ttbundle import build as buildmod
    from ttbundle.backends.emulated import kernel_table
    from ttbundle.check import check_package, verdict

    real = kernel_table.KERNELS["softmax_topk"]
    seen = []

    def flip(ctx, layer, scores):
        r = real(ctx, layer, scores)
        if layer == 2 and not seen:  # the prefill's call of the last MoE layer, one token
            seen.append(layer)
            row = r[:, 5].clone()
            chosen = (row[0] != 0).nonzero().flatten()
            low = chosen[row[0, chosen].argmin()]
            free = scores[0, 5].float().clone()
            free[chosen] = -float("inf")
            best = int(free.argmax())
            row[:, best], row[:, low] = row[:, low], 0
            r[:, 5] = row
        return r
    monkeypatch.setitem(kernel_table.KERNELS, "softmax_topk", flip)
    if tie:
        monkeypatch.setattr(verdict, "FP32_TIE", 1e9)
    res = buildmod.build(specmod.load(spec_file), "N150", tmp_path / "pkg", warmup=False)
    rep = check_package(res.package, checkpoint, steps=4, prompt_len=64)
    ex = rep.executor
    assert seen and ex.routing["flipped"] >= 1
    if tie:
        assert ex.passed, ex.failure(str)
        assert ex.routing["judged_apart"] == ex.routing["flipped"]
    else:
        assert not ex.passed
        bad = ex.first_wrong()
        assert (bad.step, bad.stage, bad.layer) == ("prefill", "layer", 2), bad
        assert ex.routing["judged_apart"] == 0
