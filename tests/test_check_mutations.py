"""The mutation matrix of `check`'s executor verdict at depth (issue 36): a 32-layer model,
{fp32, bf16 compute} x {bf16, bfp8, bfp8 + bfp4 MLP storage} x six mutations of the built
package (each re-hashed, so the manifest verifies and only numbers can tell). Every mutation
fails the executor verdict at the stage it touched; every unmutated package passes.

The expected side stores the checkpoint as the package declares it, independently of the
package's bytes (``ttbundle/check/expected.py``), so a stored matrix that is not what the
declaration makes of the checkpoint (a zeroed head, a matrix rounded to bfp4 in a bf16 package,
two layers swapped, a flipped exponent) fails as surely as a program that drops a collective."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from pkg_mutations import drop_first, edit_programs, edit_tensor, flip_byte, swap_tensors
from ttbundle import blockfloat, reference, spec as specmod
from ttbundle.build import build
from ttbundle.check import check_package
from ttbundle.package.names import weight_file

LAYERS = 32
DEEP = 29  # the mutated layer: deep in the model
HD = 32
SPEC = f"""
name: deep-llama
model:
  family: llama
  vocab_size: 512
  hidden_size: 128
  intermediate_size: 256
  num_hidden_layers: {LAYERS}
  num_attention_heads: 4
  num_key_value_heads: 2
  max_position_embeddings: 1024
targets: [N300]
buckets: {{prefill: [64], decode: [1, 8], prefill_chunk: 64}}
runtime: {{max_model_len: 256, max_num_seqs: 8}}
"""
STORAGE = {
    "bf16": ({}, "bf16"),
    "bfp8": ({"default": "bfp8"}, "bfp8"),
    "bfp8+bfp4": ({"default": "bfp8", "mlp": "bfp4"}, "bfp8"),
}


def _bundle(storage: str):
    b = specmod.loads(SPEC, "deep-llama.yaml")
    dtypes, kv = STORAGE[storage]
    s = b.spec
    w = s.weights.model_copy(update={"dtypes": specmod.DtypePolicy(**dtypes)})
    rt = s.runtime.model_copy(update={"kv_cache_dtype": kv})
    return dataclasses.replace(b, spec=s.model_copy(update={"weights": w, "runtime": rt}))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One checkpoint, one package per storage."""
    root = tmp_path_factory.mktemp("deep")
    ckpt = reference.save_random(_bundle("bf16"), root / "ckpt", seed=3)
    out = {}
    for storage in STORAGE:
        b = _bundle(storage)
        w = b.spec.weights.model_copy(update={"source": str(ckpt)})
        b = dataclasses.replace(b, spec=b.spec.model_copy(update={"weights": w, "tokenizer": False}))
        out[storage] = build(b, "N300", root / storage, warmup=False).package
    return ckpt, out


def _zero_head(pkg):  # one attention head's output rows of wo (device 0's first head)
    def fn(t, d):
        if d == 0:
            t[:HD] = 0
        return t
    assert edit_tensor(pkg, f"wo.{DEEP}", fn)


def _zero_wo(pkg):
    assert edit_tensor(pkg, f"wo.{DEEP}", lambda t, d: torch.zeros_like(t))


def _bfp4_wo(pkg):  # the stored values replaced by their bfp4 rounding (same encoding, same size)
    assert edit_tensor(pkg, f"wo.{DEEP}", lambda t, d: blockfloat.quantize(t.contiguous(), "bfp4"))


def _swap_layers(pkg):
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        swap_tensors(pkg, f"{name}.{DEEP}", f"{name}.{DEEP + 1}")


def _drop_all_reduce(pkg):
    assert edit_programs(pkg, "decoder", drop_first(
        lambda s: s.get("collective") == "all_reduce" and s["act"] == "attn_out"))


def _flip_exponent(pkg):
    import json
    info = json.loads(json.loads((pkg / weight_file(0)).read_bytes()[8:8 + int.from_bytes(
        (pkg / weight_file(0)).read_bytes()[:8], "little")])["__metadata__"]["ttbundle"])["tensors"][f"w1.{DEEP}"]
    # a block-float tile starts with its shared exponents; a bf16 value's high byte holds its exponent
    flip_byte(pkg, weight_file(0), f"w1.{DEEP}", offset=0 if info["encoding"] != "bf16" else 1)


#: mutation -> (its hook, the stage it must fail at: (stage, layer), with every earlier stage passing)
MUTATIONS = {
    "head zeroed": (_zero_head, ("layer", DEEP)),
    "wo zeroed": (_zero_wo, ("layer", DEEP)),
    "wo as bfp4": (_bfp4_wo, ("layer", DEEP)),
    "layers swapped": (_swap_layers, ("layer", DEEP)),
    "all_reduce dropped": (_drop_all_reduce, ("layer", 0)),
    "exponent flipped": (_flip_exponent, ("layer", DEEP)),
}


def _check(pkg, ckpt, dtype):
    return check_package(pkg, ckpt, steps=4, dtype=dtype, prompt_len=70)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("storage", sorted(STORAGE))
def test_unmutated_deep_packages_pass(built, storage, dtype):
    ckpt, pkgs = built
    r = _check(pkgs[storage], ckpt, dtype)
    assert r.executor.passed, r.executor.failure(r.step_of)
    assert len(r.executor.decisive) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("storage", sorted(STORAGE))
def test_each_mutation_fails_at_its_stage(built, tmp_path, storage, dtype, mutation):
    ckpt, pkgs = built
    pkg = tmp_path / "pkg"
    shutil.copytree(pkgs[storage], pkg)
    hook, (stage, layer) = MUTATIONS[mutation]
    hook(pkg)
    r = _check(pkg, ckpt, dtype)
    ex = r.executor
    assert not ex.passed and not r.passed
    bad = ex.first_wrong()
    assert bad is not None and (bad.stage, bad.layer) == (stage, layer), (mutation, bad, ex.failure(r.step_of))
    assert bad.step == "prefill"
    # every stage before it passed: the verdict names the first wrong one
    before = [s for s in ex.stages if s.step == "prefill" and s.stage in ("embed", "layer") and s.layer < layer]
    assert all(ex.stage_ok(s) for s in before)


def test_the_deep_bfp4_mutation_fails_and_the_correct_package_passes(built, tmp_path):
    """The default suite's corner of the matrix: bfp8 + bfp4 MLP storage, bf16 compute (the
    performance mix that passed a zeroed wo at depth 30 before)."""
    ckpt, pkgs = built
    r = _check(pkgs["bfp8+bfp4"], ckpt, "bf16")
    assert r.executor.passed, r.executor.failure(r.step_of)
    pkg = tmp_path / "pkg"
    shutil.copytree(pkgs["bfp8+bfp4"], pkg)
    _zero_wo(pkg)
    r = _check(pkg, ckpt, "bf16")
    assert not r.passed and (r.diverging().stage, r.diverging().layer) == ("layer", DEEP)


def _plant_outlier(ckpt):
    """A massive activation as trained decoders grow one (|x| ~ 1,000 in a few residual channels
    at the first token, the attention sink): channel 5 of the embedding of the prompt's first
    token (the check's random prompt of ``seed`` 3; its decode steps feed the prompt again, so
    one decode step holds it too) set to 1,800, which rides the residual stream through every
    layer and dominates its PCC."""
    from safetensors.torch import load_file, save_file
    first = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(3 + 1))[0]
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    t["model.embed_tokens.weight"][first, 5] = 1800.0
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_massive_activation_channel_passes_in_bfp8_and_hides_no_bug(tmp_path, dtype):
    b = specmod.loads(SPEC.replace(f"num_hidden_layers: {LAYERS}", "num_hidden_layers: 4"), "outlier.yaml")
    s = b.spec
    w = s.weights.model_copy(update={"dtypes": specmod.DtypePolicy(default="bfp8")})
    b = dataclasses.replace(b, spec=s.model_copy(update={"weights": w, "runtime": s.runtime.model_copy(
        update={"kv_cache_dtype": "bfp8"})}))
    from ttbundle.check import run_check
    r = run_check(b, "N300", steps=4, dtype=dtype, random_weights=True, seed=3, prompt_len=70,
                  checkpoint_hook=_plant_outlier)
    assert r.executor.passed, r.executor.failure(r.step_of)
    # the channel is there: it dominates the prefill's residual stream (its PCC against the
    # original stays near 1 whatever the storage error in the other channels)
    assert min(d["pcc"] for d in r.drift if d["step"] == "prefill") > 0.999
    assert len(r.executor.decisive) >= 8

    def hook(pkg):
        assert edit_tensor(pkg, "wo.1", lambda t, d: torch.zeros_like(t))
    bad = run_check(b, "N300", steps=4, dtype=dtype, random_weights=True, seed=3, prompt_len=70,
                    checkpoint_hook=_plant_outlier, package_hook=hook)
    d = bad.diverging()
    assert not bad.passed and (d.stage, d.layer, d.step) == ("layer", 1, "prefill"), d
    # the same zeroed wo barely moves the PCC of the stream the massive channel dominates
    assert d.pcc > 0.99


@pytest.mark.slow
def test_at_depth_80_the_bound_is_the_same_and_a_deep_bug_is_named(tmp_path):
    """80 decoder layers (Llama-3.1-70B's depth) in the performance mix, bf16 compute: the
    correct package passes with the bounds of depth 1, and layer 77's zeroed wo fails there."""
    text = (SPEC.replace(f"num_hidden_layers: {LAYERS}", "num_hidden_layers: 80")
            .replace("hidden_size: 128", "hidden_size: 64").replace("intermediate_size: 256", "intermediate_size: 128")
            .replace("num_attention_heads: 4", "num_attention_heads: 2"))
    b = specmod.loads(text, "deep80.yaml")
    dtypes, kv = STORAGE["bfp8+bfp4"]
    s = b.spec
    b = dataclasses.replace(b, spec=s.model_copy(update={
        "weights": s.weights.model_copy(update={"dtypes": specmod.DtypePolicy(**dtypes)}),
        "runtime": s.runtime.model_copy(update={"kv_cache_dtype": kv})}))
    from ttbundle.check import run_check
    ok = run_check(b, "N300", steps=4, dtype="bf16", random_weights=True, seed=3, prompt_len=70)
    assert ok.executor.passed, ok.executor.failure(ok.step_of)
    assert len([s for s in ok.executor.stages if s.stage == "layer" and s.step == "prefill"]) == 80
    bad = run_check(b, "N300", steps=4, dtype="bf16", random_weights=True, seed=3, prompt_len=70,
                    package_hook=lambda pkg: edit_tensor(pkg, "wo.77", lambda t, d: torch.zeros_like(t)))
    d = bad.diverging()
    assert not bad.passed and (d.stage, d.layer, d.step) == ("layer", 77, "prefill"), d
