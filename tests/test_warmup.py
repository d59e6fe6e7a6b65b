"""A warm-up that can fail: each program's output on a fixed input is recorded at build
(``warmup/<program>.json``) and compared at serving start and in ``ttbundle cache verify``.
Corruptions are re-hashed into the manifest, so only the numbers can catch them."""

import hashlib
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from test_build import ckpt, write_spec  # noqa: F401  (fixture)
from test_package import pkg  # noqa: F401  (a copy of this module's `built`)
from ttbundle import build as buildmod, package, spec as specmod, warmup
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
    """Change tensor ``key``'s bf16 values in device ``dev``'s file in place, then re-hash."""
    rel = package.weight_file(dev)
    data = bytearray((pkg / rel).read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    a, b = json.loads(data[8:8 + n])[key]["data_offsets"]
    t = torch.frombuffer(bytearray(data[8 + n + a:8 + n + b]), dtype=torch.bfloat16).clone()
    fn(t)
    data[8 + n + a:8 + n + b] = t.view(torch.uint8).numpy().tobytes()
    (pkg / rel).write_bytes(bytes(data))
    rehash(pkg, rel)


def test_build_records_a_reference_per_program(built):
    m = package.verify_package(built)
    refs = warmup.references(built, m)
    assert {f"{p}-{b}" for p, b in refs} == PROGRAMS
    for (phase, b), ref in refs.items():
        name = f"{phase}-{b}"
        assert f"warmup/{name}.json" in m["files"]  # hashed like every file
        assert ref["program_sha256"] == hashlib.sha256((built / f"programs/{name}.json").read_bytes()).hexdigest()
        for dt in ("float32", "bfloat16"):
            r = ref["by_dtype"][dt]
            # decode: every row of the full batch; prefill: positions, the last included
            assert len(r["rows"]) == (b if phase == "decode" else min(16, b))
            assert phase == "decode" or r["rows"][-1] == f"position {b - 1}"
            assert all(0 <= t < 500 for t in r["argmax"]) and len(r["sample"][0]) == len(r["sample_ids"])
    # the decode rows are distinct inputs: not one row repeated
    d8 = refs[("decode", 8)]["by_dtype"]["float32"]
    assert len(set(d8["argmax"])) > 1 or len({round(x, 4) for x in d8["rms"]}) > 1


def test_reference_is_what_transformers_computes(built, ckpt):  # noqa: F811
    """Independent of the emulated backend: the recorded fp32 prefill argmax and logits are
    transformers' for the same tokens from the checkpoint."""
    from ttbundle import reference
    ref = warmup.references(built, package.read_manifest(built))[("prefill", 64)]["by_dtype"]["float32"]
    hf = reference.load_model(ckpt)
    with torch.no_grad():
        logits = hf(torch.tensor([[(7 * j + 1) % 500 for j in range(64)]])).logits[0].float()
    pos = [int(r.split()[1]) for r in ref["rows"]]
    assert logits[pos].argmax(1).tolist() == ref["argmax"]
    # the package keeps its KV cache in its declared dtype (bf16) where transformers keeps fp32
    assert torch.allclose(logits[pos][:, ref["sample_ids"]], torch.tensor(ref["sample"]), atol=1e-2)


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
    assert max(again["float32"].values()) <= 1e-5 < warmup.RTOL["float32"]
    assert max(again["bfloat16"].values()) <= warmup.RTOL["bfloat16"] / 5


def test_one_weight_changed_by_one_ulp_and_rehashed_fails_in_float32(pkg):
    # a single element of layer 0's query projection on device 1, one bf16 ulp up
    mutate_tensor(pkg, 1, "wq.0", lambda t: t.__setitem__(1000, t[1000] * (1 + 2 ** -7)))
    package.verify_package(pkg)  # every sha256 matches: the manifest was re-hashed
    with pytest.raises(WarmupMismatch, match=r"warm-up of (prefill|decode)-\d+ \(float32\), (row|position) \d+: "
                                             r".* expected -?[\d.e+-]+, got -?[\d.e+-]+ \(tolerance"):
        warmup.verify_package(pkg)


def test_a_negated_row_fails_in_bfloat16_too(pkg):
    mutate_tensor(pkg, 0, "w2.1", lambda t: t.__setitem__(slice(0, 512), -t[0:512]))
    package.verify_package(pkg)
    with pytest.raises(WarmupMismatch, match=r"\(bfloat16\), (row|position) \d+"):
        warmup.verify_package(pkg, dtypes=("bfloat16",))


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
    package.verify_package(pkg)
    with pytest.raises(WarmupMismatch, match=r"warm-up of decode-8: programs/decode-8.json is not the program"):
        warmup.verify_package(pkg)
    # and by its numbers: the emulated backend runs the package's program, so even with the
    # reference re-pointed at the altered program, the dropped all_reduce shows in the logits
    ref_rel = "warmup/decode-8.json"
    ref = json.loads((pkg / ref_rel).read_text())
    ref["program_sha256"] = hashlib.sha256((pkg / rel).read_bytes()).hexdigest()
    (pkg / ref_rel).write_bytes(warmup.reference_bytes(ref))
    rehash(pkg, ref_rel)
    package.verify_package(pkg)
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
    with pytest.raises(WarmupMismatch, match=r"warm-up of \w+-\d+ \(bfloat16\)"):
        TTModelRunner._check_references(runner(torch.bfloat16))


def test_cli_cache_verify_runs_the_programs(pkg, runner):
    from ttbundle import cli
    r = runner.invoke(cli.app, ["cache", "verify", str(pkg)])
    assert r.exit_code == 0, r.output
    assert "4 programs match their warm-up references" in r.output
    mutate_tensor(pkg, 0, "embed", lambda t: t.mul_(1.5))
    r = runner.invoke(cli.app, ["cache", "verify", str(pkg)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "files verified" in r.output and "[error] warm-up of" in r.output
    assert runner.invoke(cli.app, ["cache", "verify", str(pkg), "--hashes-only"]).exit_code == 0


def test_no_warmup_packages_say_what_is_unchecked(tmp_path, ckpt):  # noqa: F811
    res = buildmod.build(specmod.load(write_spec(tmp_path, ckpt)), "N150", tmp_path / "out", warmup=False)
    m = package.read_manifest(Path(res.package))
    assert warmup.unchecked(m) == sorted(PROGRAMS) and warmup.verify_package(res.package) == {"float32": {}}


def test_one_flipped_byte_of_a_bfp8_tile_fails(tmp_path, ckpt):  # noqa: F811
    """Block-float weights: the reference is of the decoded tiles; one code byte of one tile
    changed (and re-hashed) shows in the numbers."""
    spec = write_spec(tmp_path, ckpt)
    spec.write_text(spec.read_text().replace(f"  source: {ckpt}\n", f"  source: {ckpt}\n  dtypes: {{mlp: bfp8}}\n"))
    res = buildmod.build(specmod.load(spec), "N150", tmp_path / "out")
    pkg = Path(res.package)
    assert warmup.verify_package(pkg).keys() == {"float32"}
    rel = package.weight_file(0)
    data = bytearray((pkg / rel).read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    h = json.loads(data[8:8 + n])
    assert h["w1.0"]["dtype"] == "U8"  # bfp8 tiles
    at = 8 + n + h["w1.0"]["data_offsets"][0] + 64 + 100  # tile 0: 64 exponents, then one byte per value
    data[at] ^= 0x40  # the value's top magnitude bit
    (pkg / rel).write_bytes(bytes(data))
    rehash(pkg, rel)
    package.verify_package(pkg)
    with pytest.raises(WarmupMismatch, match=r"warm-up of \w+-\d+ \(float32\), (row|position) \d+: .* expected"):
        warmup.verify_package(pkg)
