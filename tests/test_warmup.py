"""A warm-up that can fail: each program's output on a fixed input is recorded at build
(``warmup/<program>.json``, float32, layer by layer) and compared at serving start (in the dtype
served) and in ``ttbundle cache verify``. Corruptions are re-hashed into the manifest, so only
the numbers can catch them."""

import hashlib
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pkg_mutations import storing_file
from test_build import ckpt, write_spec  # noqa: F401  (fixture)
from test_package import pkg  # noqa: F401  (a copy of this module's `built`)
from ttbundle import build as buildmod, spec as specmod, warmref, warmup
from ttbundle.package import shards
from ttbundle.package.load import load_package
from ttbundle.package.names import weight_file
from ttbundle.package.verify import read_manifest, verify_package
from ttbundle.errors import WarmupMismatch

PROGRAMS = {"prefill-32", "prefill-64", "decode-1", "decode-8"}


@pytest.fixture(scope="module")
def built(tmp_path_factory, ckpt):  # noqa: F811
    d = tmp_path_factory.mktemp("warm")
    res = buildmod.build(specmod.load(write_spec(d, ckpt, tokenizer=ckpt)), "N300", d / "out")
    return Path(res.package)


def rehash(pkg: Path, rel: str) -> None:
    m = json.loads((pkg / "manifest.json").read_text())
    data = (pkg / rel).read_bytes()
    m["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (pkg / "manifest.json").write_text(json.dumps(m))


def mutate_tensor(pkg: Path, dev: int, key: str, fn) -> None:
    """Change device ``dev``'s shard of tensor ``key`` (bf16 values) in place in the file that
    stores it (every device sharing that copy sees the change), then re-hash."""
    rel = storing_file(pkg, dev, key)
    data = bytearray((pkg / rel).read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    a, b = json.loads(data[8:8 + n])[key]["data_offsets"]
    t = torch.frombuffer(bytearray(data[8 + n + a:8 + n + b]), dtype=torch.bfloat16).clone()
    fn(t)
    data[8 + n + a:8 + n + b] = t.view(torch.uint8).numpy().tobytes()
    (pkg / rel).write_bytes(bytes(data))
    rehash(pkg, rel)


def test_build_records_a_reference_per_program(built):
    m = verify_package(built)
    refs = warmref.references(built, m)
    assert {f"{p}-{b}" for p, b in refs} == PROGRAMS
    for (phase, b), r in refs.items():
        name = f"{phase}-{b}"
        assert f"warmup/{name}.json" in m["files"]  # hashed like every file
        assert r["format"] == warmref.FORMAT and r["dtype"] == "float32"
        assert r["program_sha256"] == hashlib.sha256((built / f"programs/{name}.json").read_bytes()).hexdigest()
        # the real rows of the fixed input: prefill min(B, 8) positions, decode min(B, 4) rows
        want = [f"position {t}" for t in range(min(8, b))] if phase == "prefill" else \
            [f"row {i}" for i in range(min(4, b))]
        assert r["rows"] == want
        assert all(0 <= t < 500 for t in r["argmax"]) and len(r["sample"][0]) == len(r["sample_ids"])
        assert m["artifacts"][f"warmup:{name}"]["ran"] is True
    # the decode rows are distinct inputs: not one row repeated
    d8 = refs[("decode", 8)]
    assert len(set(d8["argmax"])) > 1 or len({round(x, 4) for x in d8["rms"]}) > 1


def test_reference_is_what_transformers_computes(built, ckpt):  # noqa: F811
    """Independent of the emulated backend: the recorded prefill argmax and logits are
    transformers' (float32) for the same tokens from the checkpoint."""
    from ttbundle import reference
    ref = warmref.references(built, read_manifest(built))[("prefill", 64)]
    hf = reference.load_model(ckpt)
    with torch.no_grad():
        logits = hf(torch.tensor([[(7 * j + 1) % 500 for j in range(8)]])).logits[0].float()
    assert logits.argmax(1).tolist() == ref["argmax"]
    # the package keeps its KV cache in its declared dtype (bf16) where transformers keeps fp32
    assert torch.allclose(logits[:, ref["sample_ids"]], torch.tensor(ref["sample"]), atol=1e-2)


def test_intact_package_passes_and_a_rerun_agrees_far_inside_the_tolerance(pkg):
    got = warmup.verify_package(pkg, dtypes=("float32", "bfloat16"))
    assert set(got["float32"]) == set(got["bfloat16"]) == PROGRAMS
    # the tolerance's premise: the same machine, another thread count, agrees to ~1e-5 of rms
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = warmup.verify_package(pkg, dtypes=("float32", "bfloat16"))
    finally:
        torch.set_num_threads(threads)
    assert max(again["float32"].values()) <= 1e-5 < warmref.tolerance("float32", 2)
    # bf16 compute against the fp32 reference: well inside its tolerance, and not exact
    assert 1e-4 < max(again["bfloat16"].values()) <= warmref.tolerance("bfloat16", 2) / 1.5


def test_one_weight_changed_by_one_ulp_and_rehashed_fails_in_float32(pkg):
    # a single element of layer 0's query projection on device 1, one bf16 ulp up
    mutate_tensor(pkg, 1, "wq.0", lambda t: t.__setitem__(1000, t[1000] * (1 + 2 ** -7)))
    verify_package(pkg)  # every sha256 matches: the manifest was re-hashed
    with pytest.raises(WarmupMismatch, match=r"warm-up of (prefill|decode)-\d+ \(float32\), (row|position) \d+: "
                                             r".* expected -?[\d.e+-]+, got -?[\d.e+-]+ \(tolerance"):
        warmup.verify_package(pkg)


def test_a_negated_row_fails_in_both_dtypes(pkg):
    mutate_tensor(pkg, 0, "w2.1", lambda t: t.__setitem__(slice(0, 512), -t[0:512]))
    verify_package(pkg)
    for dt in ("float32", "bfloat16"):
        with pytest.raises(WarmupMismatch, match=rf"\({dt}\), (row|position) \d+"):
            warmup.verify_package(pkg, dtypes=(dt,))


def test_an_altered_program_fails_naming_it(pkg):
    rel = "programs/decode-8.json"
    prog = json.loads((pkg / rel).read_text())
    n = 0
    for layer in prog["layers"]:  # delete every all_reduce step
        kept = [st for st in layer["steps"] if st.get("collective") != "all_reduce"]
        n += len(layer["steps"]) - len(kept)
        layer["steps"] = kept
    assert n > 0
    (pkg / rel).write_text(json.dumps(prog, sort_keys=True, indent=1) + "\n")
    rehash(pkg, rel)
    verify_package(pkg)
    with pytest.raises(WarmupMismatch, match=r"warm-up of decode-8: programs/decode-8.json is not the program"):
        warmup.verify_package(pkg)
    # and by its numbers: the emulated backend runs the package's program, so even with the
    # reference re-pointed at the altered program, the dropped all_reduce shows in the logits
    ref_rel = "warmup/decode-8.json"
    ref = json.loads((pkg / ref_rel).read_text())
    ref["program_sha256"] = hashlib.sha256((pkg / rel).read_bytes()).hexdigest()
    (pkg / ref_rel).write_bytes(warmup.reference_bytes(ref))
    rehash(pkg, ref_rel)
    verify_package(pkg)
    with pytest.raises(WarmupMismatch, match=r"warm-up of decode-8 \(float32\), row \d+: .* expected"):
        warmup.verify_package(pkg)


def test_serving_warm_up_checks_its_dtype_and_fails_on_corruption(pkg):
    """The runtime hook (TTModelRunner._check_references) on the package's model class."""
    from ttbundle.runtime.adapter import BundleModel
    from ttbundle.runtime.model_runner import TTModelRunner
    from ttbundle.runtime.packages import open_package

    def runner(dtype):
        p = open_package(pkg)
        m = BundleModel.initialize_vllm_model(None, None, 8, 256, package=p, dtype=dtype)
        return SimpleNamespace(package=p, dtype=dtype, mesh_model=m)

    for dt in (torch.float32, torch.bfloat16):
        TTModelRunner._check_references(runner(dt))
    mutate_tensor(pkg, 1, "attn_norm.1", lambda t: t.view(torch.int16).__ixor__(0x4000))  # exponent bits
    for dt in ("float32", "bfloat16"):
        with pytest.raises(WarmupMismatch, match=rf"warm-up of \w+-\d+ \({dt}\)"):
            TTModelRunner._check_references(runner(getattr(torch, dt)))


def test_cli_cache_verify_runs_the_programs(pkg, runner):
    from ttbundle import cli
    r = runner.invoke(cli.app, ["cache", "verify", str(pkg)])
    assert r.exit_code == 0, r.output
    assert "4 programs match their warm-up references" in r.output
    assert "tolerance 0.0001 x rms" in r.output
    mutate_tensor(pkg, 0, "embed", lambda t: t.mul_(1.5))
    r = runner.invoke(cli.app, ["cache", "verify", str(pkg)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "files verified" in r.output and "[error] warm-up of" in r.output
    assert runner.invoke(cli.app, ["cache", "verify", str(pkg), "--hashes-only"]).exit_code == 0


def test_no_warmup_packages_say_what_is_unchecked(tmp_path, ckpt):  # noqa: F811
    res = buildmod.build(specmod.load(write_spec(tmp_path, ckpt)), "N150", tmp_path / "out", warmup=False)
    m = read_manifest(Path(res.package))
    assert warmref.unchecked(m) == sorted(PROGRAMS) and warmup.verify_package(res.package) == {"float32": {}}


def test_one_flipped_byte_of_a_bfp8_tile_fails(tmp_path, ckpt):  # noqa: F811
    """Block-float weights: the reference is of the decoded tiles; one code byte of one tile
    changed (and re-hashed) shows in the numbers."""
    spec = write_spec(tmp_path, ckpt)
    spec.write_text(spec.read_text().replace(f"  source: {ckpt}\n", f"  source: {ckpt}\n  dtypes: {{mlp: bfp8}}\n"))
    res = buildmod.build(specmod.load(spec), "N150", tmp_path / "out")
    pkg = Path(res.package)
    assert warmup.verify_package(pkg).keys() == {"float32"}
    rel = weight_file(0)
    data = bytearray((pkg / rel).read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    h = json.loads(data[8:8 + n])
    assert h["w1.0"]["dtype"] == "U8"  # bfp8 tiles
    at = 8 + n + h["w1.0"]["data_offsets"][0] + 64 + 100  # tile 0: 64 exponents, then one byte per value
    data[at] ^= 0x40  # the value's top magnitude bit
    (pkg / rel).write_bytes(bytes(data))
    rehash(pkg, rel)
    verify_package(pkg)
    with pytest.raises(WarmupMismatch, match=r"warm-up of \w+-\d+ \(float32\), (row|position) \d+: .* expected"):
        warmup.verify_package(pkg)


def test_a_reference_of_the_old_format_is_refused_saying_rebuild(pkg, runner):
    from ttbundle import cli
    rel = "warmup/decode-8.json"
    ref = json.loads((pkg / rel).read_text())
    ref["format"] = "ttbundle.warmup/1"
    (pkg / rel).write_bytes(warmup.reference_bytes(ref))
    rehash(pkg, rel)
    with pytest.raises(WarmupMismatch, match=r"decode-8.json: warm-up reference format 'ttbundle.warmup/1' "
                                             r"\(recorded by an older ttbundle.*rebuild the package"):
        warmup.verify_package(pkg)
    r = runner.invoke(cli.app, ["cache", "verify", str(pkg)])
    assert r.exit_code == 1 and "Traceback" not in r.output and "rebuild the package" in r.output


# ---- several families: layer by layer = whole calls; both dtypes pass; corruption fails ---------------
FAMILIES = ["llama", "qwen3", "gemma2"]


@pytest.fixture(scope="module")
def family_pkgs(tmp_path_factory):
    from test_emulated import COMMON, TINY
    from ttbundle.serving.demo import build_package
    d = tmp_path_factory.mktemp("fam")
    common = COMMON.replace("targets: [N150, N300, T3K, TG]", "targets: [N300]")
    return {f: build_package(TINY[f] + common, d / f, "N300") for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_by_layer_warm_up_equals_whole_forward_on_the_recorded_rows(family_pkgs, family):
    """The warm-up's model (one stage's weights, read in bands) run layer by layer gives, for
    every program, the logits of the whole-model forward (every weight held, as served) of the
    same rows, bit for bit (same GEMMs), and the reference records them."""
    from ttbundle.backends.emulated import EmulatedModel
    loaded = load_package(family_pkgs[family])
    progs = sorted(loaded.programs)
    got = warmref.run(warmup.stage_model(loaded, "float32", progs), loaded.bundle, progs)
    whole = EmulatedModel.from_package(loaded)
    refs = warmref.references(loaded.dir, loaded.manifest)
    for phase, b in progs:
        x = warmref.fixed_input(loaded.program_ir(phase, b))
        kv = whole.allocate_kv_cache(x["num_blocks"], x["block_size"])
        with torch.no_grad():
            out = whole.forward(whole.program(phase, b), x["tokens"], x["positions"], x["valid"],
                                x["page_table"], kv)
        rows = torch.stack([out[n, t] for (n, t), _ in x["rows"]])
        assert torch.equal(got[(phase, b)][0], rows), (phase, b)
        assert warmref.summarize(rows, [lab for _, lab in x["rows"]]) == {
            k: v for k, v in refs[(phase, b)].items() if k in ("rows", "argmax", "margin", "mean", "rms", "max",
                                                                 "sample_ids", "sample")}


@pytest.mark.parametrize("family", FAMILIES)
def test_families_pass_in_both_dtypes_and_corruptions_fail_in_both(family_pkgs, family, tmp_path):
    import shutil
    src = family_pkgs[family]
    got = warmup.verify_package(src, dtypes=("float32", "bfloat16"))
    assert max(got["float32"].values()) <= 1e-5
    assert max(got["bfloat16"].values()) <= warmref.tolerance("bfloat16", 3) / 1.5
    corruptions = {"negated row": ("w2.1", lambda t: t.__setitem__(slice(0, 256), -t[0:256])),
                   "zeroed tensor": ("wo.0", lambda t: t.zero_()),
                   "exponent bit": ("attn_norm.1", lambda t: t.view(torch.int16)[:1].__ixor__(0x4000))}
    for what, (key, fn) in corruptions.items():
        pkg = tmp_path / what.replace(" ", "-")
        shutil.copytree(src, pkg)
        mutate_tensor(pkg, 1, key, fn)
        for dt in ("float32", "bfloat16"):
            with pytest.raises(WarmupMismatch, match=rf"\({dt}\)"):
                warmup.verify_package(pkg, dtypes=(dt,))


def test_reading_in_bands_gives_the_stored_values(family_pkgs, monkeypatch):
    """``PackageWeights.stack`` with bands of a few rows: bf16 stored transposed, bf16 as is and
    block floats (bands of whole tile rows) equal each shard decoded whole (``shards``)."""
    loaded = load_package(family_pkgs["llama"])
    monkeypatch.setattr(shards, "BAND_BYTES", 4096)
    w = loaded.weights
    _, metas = w._open()
    assert metas[0]["wq.0"].get("transposed") and not metas[0]["attn_norm.0"].get("transposed")
    for name, layer in [("wq", 0), ("w2", 1), ("embed", None), ("attn_norm", 0)]:
        assert torch.equal(w.stack(name, layer, torch.float32), torch.stack(w.shards(name, layer, torch.float32)))


def test_block_float_weights_read_and_written_in_bands_are_the_whole_tensors(tmp_path, ckpt, monkeypatch):  # noqa: F811
    """bfp8: conversion encoding bands of tile rows writes the bytes of one whole-tensor encode,
    and the banded reader (``PackageWeights.stack``) decodes them as a whole-shard decode does."""
    from ttbundle import blockfloat, convert
    spec = write_spec(tmp_path, ckpt)
    spec.write_text(spec.read_text().replace(f"  source: {ckpt}\n", f"  source: {ckpt}\n  dtypes: {{default: bfp8}}\n"))
    a = Path(buildmod.build(specmod.load(spec), "N300", tmp_path / "a", warmup=False).package)
    monkeypatch.setattr(convert, "BAND_BYTES", 4096)  # 32-row bands of every block-float shard
    b = Path(buildmod.build(specmod.load(spec), "N300", tmp_path / "b", warmup=False).package)
    loaded = load_package(a)
    w = loaded.weights
    for d in range(2):
        assert (a / weight_file(d)).read_bytes() == (b / weight_file(d)).read_bytes()
    # independent of convert: the stored tiles are blockfloat.encode of the whole shard
    shard = w.shards("w1", 0)[1]
    assert w.device(1)["w1.0"].shape == shard.shape
    assert bytes(blockfloat.encode(shard, "bfp8")) == w._open()[0][1].get_tensor("w1.0").numpy().tobytes()
    monkeypatch.setattr(shards, "BAND_BYTES", 4096)
    for name, layer in [("w1", 0), ("w2", 1), ("lm_head", None)]:
        assert torch.equal(w.stack(name, layer, torch.float32), torch.stack(w.shards(name, layer, torch.float32)))
