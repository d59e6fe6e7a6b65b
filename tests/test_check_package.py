"""`ttbundle check` on built packages: block-float weights and KV caches checked as stored, and
the mutations of a package (manifest re-hashed, so only numerics can catch them) that must fail.

The executor verdict compares the emulated mesh with transformers on the checkpoint stored as the
package declares it (``check.expected``), whatever the storage; quality (the package against the
original checkpoint) is reported beside it (docs/check.md, benches/check_figures.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pkg_mutations import drop_first, edit_programs, edit_tensor, flip_byte, rehash
from spec_helpers import SMOL, smol_spec
from test_emulated import TINY as DENSE, tiny as dense_tiny
from test_emulated_moe import TINY as MOE, moe_layers, tiny as moe_tiny

from ttbundle import layout, mesh as meshmod, spec as specmod
from ttbundle.package.names import weight_file
from ttbundle.package.verify import verify_package
from ttbundle.check import EXEC_BOUNDS, check_package, run_check
from ttbundle.cli import app

FAMILIES = sorted(DENSE) + sorted(MOE)
STORAGE = {
    "bfp8": {"default": "bfp8", "router": "bf16"},
    "bfp4": {"default": "bfp8", "router": "bf16", "mlp": "bfp4", "experts": "bfp4"},
}


def stored(family: str, storage: str, kv: str = "bfp8"):
    """The tiny bundle of ``family`` with block-float weights and KV cache."""
    b = dense_tiny(family) if family in DENSE else moe_tiny(family)
    s = b.spec
    w = s.weights.model_copy(update={"dtypes": specmod.DtypePolicy(**STORAGE[storage])})
    rt = s.runtime.model_copy(update={"kv_cache_dtype": kv})
    return dataclasses.replace(b, spec=s.model_copy(update={"weights": w, "runtime": rt}))


@pytest.mark.slow
@pytest.mark.parametrize("storage", sorted(STORAGE))
@pytest.mark.parametrize("mesh", ["N150", "T3K", "TG"])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_float_packages_pass_within_their_bounds(family, mesh, storage):
    # 16 steps, as docs/check.md's figures: with fewer, one near-tie decides the token agreement
    r = run_check(stored(family, storage), mesh, steps=16, random_weights=True, seed=3)
    assert r.quantized == storage
    assert r.storage["kv_cache"] == "bfp8" and storage in r.storage["weights"]
    assert r.passed, r.failure()
    # quantization is really there: the package's numbers are not the original checkpoint's
    assert r.quality.kl_mean > 0 and min(d["pcc"] for d in r.drift) < 0.999999


def test_bf16_packages_are_token_identical_and_block_floats_are_not_exact():
    """The same model, bf16 vs bfp8 storage: both run their own numbers to fp32 rounding (the
    executor verdict does not depend on the storage); bf16 is transformers-identical against the
    original checkpoint, bfp8 measurably less exact there."""
    b = dense_tiny("llama")
    r16 = run_check(b, "T3K", steps=8, random_weights=True, seed=3)
    assert r16.quantized is None and r16.tokens_agree and min(s.pcc for s in r16.layers) > 0.99999
    assert r16.quality.top1 == 1.0 and min(d["pcc"] for d in r16.drift) > 0.99999
    r8 = run_check(stored("llama", "bfp8"), "T3K", steps=8, random_weights=True, seed=3)
    assert r8.passed and max(s.err for s in r8.layers) < EXEC_BOUNDS["fp32"]
    assert min(d["pcc"] for d in r8.drift) < min(d["pcc"] for d in r16.drift)
    assert r8.quality.kl_mean > 10 * r16.quality.kl_mean


@pytest.mark.parametrize("storage", ["bfp8", "bfp4"])
def test_dropped_all_reduce_fails_a_block_float_package(storage):
    b = stored("llama", storage)
    hook = lambda pkg: edit_programs(pkg, "decoder", drop_first(  # noqa: E731
        lambda s: s.get("collective") == "all_reduce" and s["act"] == "attn_out"))
    r = run_check(b, "T3K", steps=4, random_weights=True, seed=3, package_hook=hook)
    assert not r.passed
    d = r.diverging()
    assert (d.step, d.layer) == ("prefill", 0) and d.err > EXEC_BOUNDS["fp32"]


def test_one_flipped_bfp8_exponent_byte_fails_and_names_its_layer():
    """One shared-exponent byte of one bfp8 tile of layer 1's gate projection on device 3,
    flipped and re-hashed: hashes pass, the numbers do not, and the check names layer 1."""
    b = stored("llama", "bfp8")

    def hook(pkg):
        flip_byte(pkg, weight_file(3), "w1.1", offset=0)
        verify_package(pkg, full=True)  # the manifest still verifies
    r = run_check(b, "T3K", steps=4, random_weights=True, seed=3, package_hook=hook)
    assert not r.passed
    d = r.diverging()
    assert d.layer == 1 and d.step == "prefill", d
    assert all(s.pcc > 0.999 for s in r.layers if s.layer == 0)  # layer 0 is untouched


# ---- MoE packages: an expert's bug named at its layer, whatever the storage -----------------------
def _dropped_expert_all_reduce(b):
    """The Combine's all-reduce over the expert-parallel axes dropped in every MoE program: wrong
    from the first MoE layer on."""
    kind = b.family.layers(b.arch)[-1].name

    def hook(pkg):
        assert edit_programs(pkg, kind, drop_first(
            lambda s: s.get("collective") == "all_reduce" and s["act"] == "moe_out"))
    return hook, moe_layers(b)[0]


def _zeroed_expert(b):
    """Device 0's first routed expert of the last layer zeroed (its down projection): the tokens
    routed to it lose its share there; every earlier layer is untouched."""
    last = b.arch.num_hidden_layers - 1

    def hook(pkg):
        assert edit_tensor(pkg, f"experts_w2.{last}", lambda t, d: t.index_fill(0, torch.tensor([0]), 0.0)
                           if d == 0 else t)
    return hook, last


@pytest.mark.parametrize("mutation", [_dropped_expert_all_reduce, _zeroed_expert], ids=["all_reduce", "expert"])
@pytest.mark.parametrize("storage", ["bf16", "bfp8"])
@pytest.mark.parametrize("family", sorted(MOE))
def test_moe_mutation_fails_at_its_layer(family, storage, mutation):
    """bf16 compute (routing near-ties excused only where the two sides chose differently) on
    bf16 or bfp8 weights and KV cache: the mutated package fails, named at the mutated layer at
    prefill, every earlier layer passing."""
    b = moe_tiny(family) if storage == "bf16" else stored(family, storage)
    hook, layer = mutation(b)
    r = run_check(b, "T3K", steps=4, dtype="bf16", random_weights=True, seed=3, package_hook=hook)
    assert not r.passed and not r.executor.passed
    bad = r.executor.first_wrong()
    assert bad is not None and (bad.step, bad.stage, bad.layer) == ("prefill", "layer", layer), \
        r.executor.failure(r.step_of)
    before = [s for s in r.executor.stages if s.step == "prefill" and s.stage in ("embed", "layer") and s.layer < layer]
    assert before and all(r.executor.stage_ok(s) for s in before)


# ---- heads that do not divide the mesh: SmolLM2's 9 query / 3 KV heads ---------------------------
def smol(mesh: str):
    """The 9/3-head model with the padding `ttbundle init` chooses for ``mesh``."""
    text, extra = smol_spec(mesh)
    return specmod.loads(text, "smol.yaml"), extra


@pytest.mark.parametrize("mesh,expect", [("N300", (6, 2)), ("T3K", (3, 1)), ("TG", (3, 1))])
def test_smollm_head_ratios_check_with_the_padding_init_chooses(mesh, expect):
    b, extra = smol(mesh)
    assert extra == {"attention_heads": "pad", "kv_heads": "pad"}
    m = meshmod.resolve(mesh)
    q = layout.units(b.family.tensors(b.arch)[3].dims[1], ("cols",), m, b.spec.sharding)  # wq's heads
    assert len(q[0]) == expect[0]
    r = run_check(b, mesh, steps=16, random_weights=True, seed=5)
    assert r.passed and r.tokens_agree, (r.first_token_divergence, r.diverging())
    # only the KV blocks the prompt and the steps need: not the serving pool
    need = -(-(r.prompt_len + r.steps) // b.spec.runtime.kv_block_size)
    assert r.kv_blocks == need + 1


def test_a_shifted_padded_shard_fails():
    """Device 1 of a 9/3-head N300 package holds query heads 6..8 and three padding heads; its
    wq shard shifted by one head (and re-hashed) computes wrong numbers."""
    b, _ = smol("N300")

    def hook(pkg):
        from safetensors.torch import load_file, save_file
        rel = weight_file(1)
        f = Path(pkg) / rel
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            meta = json.loads(fh.read(n))["__metadata__"]
        t = load_file(str(f))
        info = json.loads(meta["ttbundle"])["tensors"]["wq.0"]
        hd = SMOL["head_dim"]
        dim = 0 if info.get("transposed") else 1  # stored [out, in] or [in, out]
        t["wq.0"] = torch.roll(t["wq.0"], hd, dims=dim).contiguous()
        save_file(t, str(f), metadata=meta)
        rehash(pkg, rel)
    r = run_check(b, "N300", steps=4, random_weights=True, seed=5, package_hook=hook)
    assert not r.passed
    assert r.diverging().layer == 0


def test_check_cli_takes_a_package_directory(tmp_path):
    """`ttbundle check PACKAGE_DIR` finds the checkpoint its manifest records and checks the
    package as built; --mesh on a package is refused (exit 2)."""
    from ttbundle import reference
    from ttbundle.build import build

    b = stored("qwen3", "bfp8")
    ckpt = reference.save_random(b, tmp_path / "ckpt", seed=3)
    w = b.spec.weights.model_copy(update={"source": str(ckpt)})
    b = dataclasses.replace(b, spec=b.spec.model_copy(update={"weights": w, "tokenizer": False}))
    pkg = build(b, "T3K", tmp_path / "out", warmup=False).package
    runner = CliRunner()
    r = runner.invoke(app, ["check", pkg, "--steps", "4", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["quantized"] == "bfp8" and rep["passed"] and rep["mesh"] == "T3K"
    assert rep["executor"]["passed"] and rep["quality"]["judged"] is False
    assert rep["storage"]["kv_cache"] == "bfp8"
    same = check_package(pkg, ckpt, steps=4)
    assert same.emu_tokens == rep["emulated_tokens"]
    r = runner.invoke(app, ["check", pkg, "--mesh", "N150"])
    assert r.exit_code == 2 and "a package is checked as built" in r.output
    # the checkpoint changed since the build: say so instead of comparing with other weights
    (ckpt / "model.safetensors").write_bytes(b"x" * 10)
    r = runner.invoke(app, ["check", pkg])
    assert r.exit_code == 2 and "changed since the package was built" in r.output


@pytest.mark.parametrize("mesh", ["N300", "TG"])
def test_expected_lm_head_bands_are_the_whole_head_as_stored(mesh, monkeypatch):
    """check's expected side rounds a block-float LM head in bands of hidden rows (bounded memory
    at a 128k vocabulary), also where the plan splits the hidden dim over a mesh axis (TG): the
    bands together are, bit for bit, the whole head cut and rounded as the package stores it."""
    from ttbundle.check.expected import ExpectedWeights
    from ttbundle.package.load import load_package

    seen: dict = {}

    class Done(Exception):
        pass

    def compare(pkg):
        ew = ExpectedWeights(load_package(pkg), seen["src"])
        dim0 = ew.decls["lm_head"].dims[0]
        seen["split"] = any(list(u) != list(range(dim0.size)) for u in ew.weights.units["lm_head"][0])
        monkeypatch.setattr(ExpectedWeights, "HEAD_BAND", 24)  # bands not aligned to the split
        bands = list(ew.lm_head_bands())
        (_, _, srcs), = [j for j in ew.jobs if j[0] == "lm_head"]
        whole = ew._canonical_stored("lm_head", srcs)
        seen["bands"] = [(r0, r1) for r0, r1, _ in bands]
        seen["equal"] = torch.equal(torch.cat([rows for _, _, rows in bands]), whole)
        plain = ew.ck.get(srcs[0][1][0]).float()  # the checkpoint's own (bf16) values
        seen["rounded"] = not torch.equal(whole, plain.t() if plain.shape != whole.shape else plain)
        raise Done

    with pytest.raises(Done):
        run_check(stored("llama", "bfp8"), mesh, random_weights=True,
                  checkpoint_hook=lambda src: seen.update(src=src), package_hook=compare)
    assert seen["split"] == (mesh == "TG")  # N300 holds every hidden row on each device
    assert len(seen["bands"]) > 1 and seen["bands"][-1][1] == 256
    assert seen["equal"] and seen["rounded"]
