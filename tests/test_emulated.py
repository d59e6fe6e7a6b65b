"""The emulated mesh against independent references: explicit per-device loops for the
collectives, Hugging Face transformers for whole models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ttbundle import mesh as meshmod, spec
from ttbundle.plan.make import make_plan
from ttbundle.backends.emulated.meshops import MeshOps
from ttbundle.check import run_check

from pkg_mutations import drop_first, edit_programs
from ttbundle.errors import InvalidInput
from ttbundle.families.base import Dim

# Tiny configs whose dims divide every mesh below (TG is 8 rows x 4 cols).
TINY = {
    "llama": """
name: tiny-llama
model:
  family: llama
  vocab_size: 512
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 2
  num_attention_heads: 8
  num_key_value_heads: 4
  max_position_embeddings: 1024
  rope_scaling: {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,
                 original_max_position_embeddings: 256}
""",
    "qwen2": """
name: tiny-qwen2
model:
  family: qwen2
  vocab_size: 512
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 2
  num_attention_heads: 8
  num_key_value_heads: 4
  max_position_embeddings: 1024
""",
    "qwen3": """
name: tiny-qwen3
model:
  family: qwen3
  vocab_size: 512
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 2
  num_attention_heads: 8
  num_key_value_heads: 4
  head_dim: 64
  max_position_embeddings: 1024
""",
    "mistral": """
name: tiny-mistral
model:
  family: mistral
  vocab_size: 512
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 2
  num_attention_heads: 8
  num_key_value_heads: 4
  max_position_embeddings: 1024
  sliding_window: 48
""",
    "gemma2": """
name: tiny-gemma2
model:
  family: gemma2
  vocab_size: 512
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 3
  num_attention_heads: 8
  num_key_value_heads: 4
  head_dim: 32
  max_position_embeddings: 1024
  sliding_window: 48
  attn_logit_softcapping: 20.0
  final_logit_softcapping: 15.0
  query_pre_attn_scalar: 32
""",
    "gemma3": """
name: tiny-gemma3
model:
  family: gemma3
  vocab_size: 512
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 3
  num_attention_heads: 8
  num_key_value_heads: 4
  head_dim: 32
  max_position_embeddings: 1024
  sliding_window: 48
  query_pre_attn_scalar: 32
""",
}
COMMON = """
targets: [N150, N300, T3K, TG]
buckets: {prefill: [64, 128], decode: [1, 8, 32], prefill_chunk: 64}
runtime: {max_model_len: 256, max_num_seqs: 8}
"""
MESHES = ["N150", "N300", "T3K", "TG"]


def tiny(family: str, extra: str = ""):
    return spec.loads(TINY[family] + COMMON + extra, f"tiny-{family}.yaml")


# ---- collectives vs explicit loops -----------------------------------------------------------
@pytest.mark.parametrize("name", ["N300", "T3K", "TG", "(2,3)"])
def test_collectives_match_per_device_loops(name):
    m = meshmod.resolve(name)
    ops = MeshOps(m)
    R, C = m.shape
    x = torch.randn(m.num_devices, 3, 5)
    coords = [(d // C, d % C) for d in range(m.num_devices)]
    for axes in (("rows",), ("cols",), ("rows", "cols")):
        got = ops.all_reduce(x, axes)
        for d, (r, c) in enumerate(coords):
            group = [e for e, (r2, c2) in enumerate(coords)
                     if (r2 == r or "rows" in axes) and (c2 == c or "cols" in axes)]
            torch.testing.assert_close(got[d], sum(x[e] for e in group))
        g = ops.all_gather(x, axes, 2)
        for d, (r, c) in enumerate(coords):
            if axes == ("cols",):
                order = [r * C + c2 for c2 in range(C)]
            elif axes == ("rows",):
                order = [r2 * C + c for r2 in range(R)]
            else:
                order = list(range(m.num_devices))
            torch.testing.assert_close(g[d], torch.cat([x[e] for e in order], dim=1))


# ---- whole models vs transformers -------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("mesh", MESHES)
def test_fp32_greedy_tokens_identical_to_hf(family, mesh):
    r = run_check(tiny(family), mesh, steps=32, dtype="fp32", random_weights=True, seed=3)
    assert r.tokens_agree, (r.first_token_divergence, r.diverging())
    # the random model is not degenerate (with tied embeddings, as in Gemma, greedy settles on
    # few tokens; the per-layer PCC below is the fine-grained check)
    assert len(set(r.ref_tokens)) > (1 if tiny(family).arch.tie_word_embeddings else 4)
    assert all(s.pcc > 0.99999 for s in r.layers)
    # a prompt longer than one chunk ran as several prefill chunks, decode padded to bucket 1
    assert ("prefill", 64) in r.shapes_run and ("decode", 1) in r.shapes_run


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("mesh", ["N150", "T3K"])
def test_bf16_pcc_bound(family, mesh):
    r = run_check(tiny(family), mesh, steps=8, dtype="bf16", random_weights=True, seed=4)
    assert r.passed, r.diverging()


def test_a_plan_that_splits_inputs_differently_still_computes_right():
    # q replicated but k/v split by heads, w1 replicated but w3 split: the plan must gather
    b = tiny("llama", "sharding:\n  plan:\n    wq: [null, null]\n    w1: [null, null]\n    wo: [null, cols]\n")
    p = make_plan(b, "T3K")
    kinds = [(c.op, c.kind) for c in p.collectives]
    assert ("rope + attention", "all_gather") in kinds
    r = run_check(b, "T3K", steps=8, random_weights=True)
    assert r.tokens_agree


def test_missing_collective_is_caught_and_located():
    # the row-parallel wo without its all-reduce, deleted from the package's programs (manifest
    # re-hashed): every device adds only its partial sum
    b = tiny("llama")
    hook = lambda pkg: edit_programs(pkg, "decoder", drop_first(  # noqa: E731
        lambda s: s.get("collective") == "all_reduce" and s["act"] == "attn_out"))
    r = run_check(b, "T3K", steps=4, random_weights=True, package_hook=hook)
    assert not r.passed
    d = r.diverging()
    assert (d.step, d.layer) == ("prefill", 0)
    assert d.pcc < 0.99


def test_wrong_gather_order_is_caught():
    # the LM head's vocab split over both TG axes: its logits are gathered over (rows, cols);
    # the same gather in the package's program as (cols, rows) puts the shards in the wrong order
    b = tiny("llama", "sharding:\n  plan:\n    lm_head: [null, [rows, cols]]\n")
    ok = run_check(b, "TG", steps=2, random_weights=True)
    assert ok.passed

    def swap(steps):
        out = [dict(s, axes=s["axes"][::-1]) if s.get("collective") == "all_gather" and len(s["axes"]) == 2
               else s for s in steps]
        assert out != steps
        return out
    r = run_check(b, "TG", steps=2, random_weights=True, package_hook=lambda pkg: edit_programs(pkg, "head", swap))
    assert not r.passed and r.first_token_divergence == 0


def test_checkpoint_name_errors_are_loud(tmp_path):
    from ttbundle import reference, weights
    b = tiny("llama")
    sd = dict(reference.random_model(b).state_dict())
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    with pytest.raises(InvalidInput, match="cannot map checkpoint tensor 'model.layers.0.mlp.extra.weight'"):
        weights.from_state_dict(b.family, b.arch, sd)
    del sd["model.layers.0.mlp.extra.weight"]
    del sd["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(InvalidInput, match=r"no tensor 'model.layers.1.self_attn.k_proj.weight', needed for wk \(layer 1\)"):
        weights.from_state_dict(b.family, b.arch, sd)
