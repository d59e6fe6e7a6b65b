"""The published configs (bundles/*.yaml) with the KV pool: each plans to fit every target it
documents with a pool of at least one full-length sequence, `init` from the same model's
config.json fits each of those meshes at the bundle's limits, and the two examples of issue 14
(Llama-3.1-8B with bfp8 weights and KV for 32 users at 32k on one N150; Qwen3-8B in bf16 on an
N300) carry the largest pool that fits, in bytes computed here from the dims."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from spec_helpers import llama_weights_one_chip, wh_dram
from ttbundle import reference, spec
from ttbundle.plan.make import kv_blocks, make_plan
from ttbundle.cli import app

from test_build import ckpt  # noqa: F401  (session fixture)

BUNDLES = Path(__file__).resolve().parent.parent / "bundles"
PUBLISHED = sorted(p for p in BUNDLES.glob("*.yaml") if p.name != "demo.yaml")
WH_DRAM = 12 * 1_072_693_184


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: p.stem)
def test_published_bundle_plans_a_pool_on_every_target(path):
    b = spec.load(path)
    rt = b.spec.runtime
    for t in b.spec.targets:
        p = make_plan(b, t)
        assert p.fits, t
        tokens, blocks = p.kv["max_tokens_all_users"], p.kv["num_blocks"]
        assert rt.max_model_len <= tokens <= rt.max_num_seqs * rt.max_model_len, t
        # Tenstorrent's formula, written out
        assert blocks == -(-(tokens + rt.kv_block_size * rt.max_num_seqs) // rt.kv_block_size), t


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: p.stem)
def test_init_from_the_published_model_fits_its_documented_meshes(path, tmp_path):
    b = spec.load(path)
    hf = tmp_path / "model"
    reference.hf_config(b).save_pretrained(hf)
    rt = b.spec.runtime
    args = ["init", "--from-hf", str(hf), "-o", str(tmp_path / "spec.yaml"), "--max-model-len",
            str(rt.max_model_len), "--max-num-seqs", str(rt.max_num_seqs)]
    for t in b.spec.targets:
        args += ["--mesh", t]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    written = spec.load(tmp_path / "spec.yaml")
    for t in b.spec.targets:
        assert make_plan(written, t).fits, t


def test_llama_8b_on_n150_bfp8_32_users_32k_has_the_largest_pool():
    b = spec.load(BUNDLES / "llama-3.1-8b.yaml")
    rt = b.spec.runtime
    assert (rt.max_num_seqs, rt.max_model_len, rt.kv_cache_dtype) == (32, 32768, "bfp8")
    assert "N150" in b.spec.targets
    p = make_plan(b, "N150")
    assert p.memory.weights == llama_weights_one_chip(128256, 4096, 14336, 32, 32, 8, 128, "bfp8", "bfp8")
    # K and V of 32 layers, each [blocks, 8 heads, 32, 128] bfp8: 32 tiles of 1,088 B per block
    kv = lambda n: 2 * 32 * wh_dram(32 * n, 1088)  # noqa: E731
    rest = p.memory.weights + p.memory.activations + p.memory.trace_region
    n = p.kv["num_blocks"]
    assert p.memory.kv_cache == kv(n) and rest + kv(n) <= WH_DRAM < rest + kv(n + 1)
    assert p.kv["max_tokens_all_users"] == n * 32 - 32 * 32 >= 32768


def test_qwen3_8b_bf16_on_n300_has_the_largest_pool():
    b = spec.load(BUNDLES / "qwen3-8b.yaml")
    assert b.spec.weights.dtypes.default == "bf16" and "N300" in b.spec.targets
    rt = b.spec.runtime
    p = make_plan(b, "N300")
    # 8 KV heads over the 2 chips: [blocks, 4, 32, 128] bfp8 = 16 tiles per block, 36 layers x K, V
    kv = lambda n: 2 * 36 * wh_dram(16 * n, 1088)  # noqa: E731
    rest = p.memory.weights + p.memory.activations + p.memory.trace_region
    n = p.kv["num_blocks"]
    assert p.memory.kv_cache == kv(n) and rest + kv(n) <= WH_DRAM < rest + kv(n + 1)
    assert p.kv["max_tokens_all_users"] == n * 32 - 32 * rt.max_num_seqs >= rt.max_model_len


def test_a_built_package_records_and_allocates_the_pools_blocks(tmp_path_factory, ckpt):  # noqa: F811
    """One number wherever the block count is used: the package's programs, the emulated
    runner's default cache, the ttnn backend's KV buffers and ``plan.make.kv_blocks``."""
    from test_build import REST, spec_text as build_spec

    from ttbundle import build as buildmod
    from ttbundle.backends.emulated import EmulatedModel, Runner
    from ttbundle.backends.ttnn import alloc
    from ttbundle.package.load import load_package

    d = tmp_path_factory.mktemp("pool")
    rest = REST.replace("runtime: {max_model_len: 256, max_num_seqs: 8}",
                        "runtime: {max_model_len: 256, max_num_seqs: 8, max_tokens_all_users: 300}")
    assert rest != REST
    (d / "spec.yaml").write_text(build_spec(ckpt, rest=rest))
    res = buildmod.build(spec.load(d / "spec.yaml"), "T3K", d / "out", warmup=False)
    blocks = -(-(300 + 32 * 8) // 32)  # 18, where 8 sequences of 256 would take 72
    pkg = load_package(res.package)
    assert kv_blocks(pkg.bundle, "T3K") == blocks
    for phase, bucket in pkg.programs:
        kv = pkg.program(phase, bucket)["kv_cache"]
        assert kv["num_blocks"] == blocks and {e["device_shape"][0] for e in kv["entries"]} == {blocks}
    assert {b.shape[0] for b in alloc.plan_buffers(make_plan(pkg.bundle, pkg.mesh)) if b.what == "kv_cache"} == {blocks}
    runner = Runner(EmulatedModel.from_package(pkg))
    assert runner.kv.num_blocks == blocks
    # the serving side reads the package's record (nothing re-plans): the worker's block count,
    # and the pool Tenstorrent's plugin sizes its cache from through the generated adapter:
    # its ceil((tokens + block x seqs) / block) gives the package's blocks at any max_num_seqs
    from ttbundle.package.verify import load_adapter
    from ttbundle.runtime.packages import open_package
    opened = open_package(res.package)
    assert pkg.kv_cache["num_blocks"] == opened.kv_blocks == blocks
    cls = load_adapter(opened.path, opened.manifest, opened.metadata)
    for seqs in (8, 3):
        tokens = cls.get_max_tokens_all_users(max_num_seqs=seqs, max_model_len=256)
        assert -(-(tokens + 32 * seqs) // 32) == blocks


def test_programs_that_disagree_on_the_kv_cache_are_refused(tmp_path_factory, ckpt):  # noqa: F811
    """The KV record is one number in every program; a package whose programs disagree (one
    edited, manifest re-hashed) is refused when the runtime asks for its blocks."""
    import json

    from pkg_mutations import rehash
    from test_build import REST, spec_text as build_spec

    from ttbundle import build as buildmod
    from ttbundle.errors import TTBundleError
    from ttbundle.runtime.packages import open_package

    d = tmp_path_factory.mktemp("pool-disagree")
    (d / "spec.yaml").write_text(build_spec(ckpt, rest=REST))
    res = buildmod.build(spec.load(d / "spec.yaml"), "T3K", d / "out", warmup=False)
    pkgdir = Path(res.package)
    prog = sorted((pkgdir / "programs").glob("*.json"))[0]
    data = json.loads(prog.read_text())
    data["kv_cache"]["num_blocks"] += 1
    prog.write_text(json.dumps(data))
    rehash(pkgdir, str(prog.relative_to(pkgdir)))
    with pytest.raises(TTBundleError, match="disagree on the KV cache"):
        open_package(res.package).kv_blocks


def test_plan_shows_the_pool_in_text_and_json():
    import json
    path = str(BUNDLES / "llama-3.1-8b.yaml")
    runner = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})
    j = json.loads(runner.invoke(app, ["plan", path, "--mesh", "N150", "--json"]).stdout)
    kv = j["kv_cache"]
    blocks, tokens = kv["num_blocks"], kv["max_tokens_all_users"]
    assert tokens == blocks * 32 - 32 * 32 and kv["pool_chosen"] == "auto"
    assert kv["bytes"] == j["memory"]["kv_cache"] == 2 * 32 * wh_dram(32 * blocks, 1088)
    r = runner.invoke(app, ["plan", path, "--mesh", "N150"])
    assert r.exit_code == 0
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("KV pool: "))
    assert f"KV pool: {tokens:,} tokens (max_tokens_all_users) = {blocks:,} blocks x 32 = " in line
    assert f"{kv['bytes'] / 2**30:,.2f} GiB per chip" in line
    assert "shared by 32 sequences (1,048,576 tokens at full length)" in line
    assert "auto: the largest pool that fits" in line


def test_validate_names_an_explicit_pool_that_does_not_fit(tmp_path):
    text = (BUNDLES / "qwen3-8b.yaml").read_text().replace(
        "max_tokens_all_users: auto", "max_tokens_all_users: 1000000")
    (tmp_path / "q.yaml").write_text(text)
    line = next(i + 1 for i, ln in enumerate(text.splitlines()) if "max_tokens_all_users:" in ln)
    r = CliRunner().invoke(app, ["validate", str(tmp_path / "q.yaml"), "--mesh", "N300"])
    assert r.exit_code == 3
    assert f"q.yaml:{line}:3: runtime.max_tokens_all_users: max_tokens_all_users=1,000,000 does not fit" in r.stderr
    assert "(the largest that fits) or `auto`" in r.stderr and "Traceback" not in r.output
