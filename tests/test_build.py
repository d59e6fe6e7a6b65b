"""`ttbundle build`: HF safetensors -> package -> emulated backend, incremental and no-op builds,
atomicity under kill -9, locking, refused inputs. Helpers here are shared by test_package*.py."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ttbundle import build as buildmod, convert, fsutil, lower as lowermod, spec as specmod, txn
from ttbundle.manifest import METADATA
from ttbundle.package.load import load_package
from ttbundle.package.names import tensor_key, weight_file
from ttbundle.package.verify import verify_package
from ttbundle.errors import InvalidInput, TTBundleError
from ttbundle.plan.make import make_plan

ROOT = Path(__file__).resolve().parent.parent
# vocab 500 pads to 512 on an 8-wide axis (whole tiles); 2 KV heads are replicated on T3K/TG
ARCH = """\
model:
  family: llama
  vocab_size: 500
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 2
  num_attention_heads: 8
  num_key_value_heads: 2
  max_position_embeddings: 512
"""
REST = """\
targets: [N150, T3K, TG]
buckets: {prefill: [32, 64], decode: [1, 8], prefill_chunk: 64}
runtime: {max_model_len: 256, max_num_seqs: 8}
"""


def spec_text(source: Path | None = None, tokenizer: Path | None = None, name: str = "tiny",
              extra: str = "", rest: str = REST) -> str:
    head = f"name: {name}\ndescription: build test model\n" + ARCH
    if source is not None:
        head += f"weights:\n  source: {source}\n"
    if tokenizer is not None:
        head += f"tokenizer: {tokenizer}\n"
    return head + rest + extra


def make_tokenizer(d: Path, vocab: int = 500) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "eos_token": "t1"}))


def make_checkpoint(d: Path, seed: int = 0, shards: str | None = None) -> None:
    """A random model of ARCH saved as bf16 safetensors (so conversion is exact)."""
    import torch

    from ttbundle import reference
    b = specmod.loads(spec_text(), "arch.yaml")
    model = reference.random_model(b, seed).to(torch.bfloat16)
    kw = {"max_shard_size": shards} if shards else {}
    model.save_pretrained(str(d), safe_serialization=True, **kw)
    make_tokenizer(d)  # a build needs one (or the spec's `tokenizer: false`)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ckpt")
    make_checkpoint(d)
    make_tokenizer(d)
    return d


def write_spec(tmp: Path, ckpt: Path, **kw) -> Path:
    p = tmp / "spec.yaml"
    p.write_text(spec_text(ckpt, **kw))
    return p


def snapshot(root: Path) -> dict:
    """path -> (mtime_ns, inode, sha256) of every file under ``root``, and every directory."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in files + dirs:
            p = Path(dirpath) / n
            st = os.lstat(p)
            sha = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_ino, sha)
    return out


def registrable(mesh_dir: Path) -> list[Path]:
    """Folders the TT plugin would register under EXTRA_MODELS_DIR=mesh_dir."""
    if not mesh_dir.is_dir():
        return []
    return [d for d in mesh_dir.iterdir() if (d / METADATA).exists()]


# ---- round trip -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", ["T3K", "TG"])
def test_round_trip_package_tokens_match_check_and_hf(tmp_path, ckpt, mesh):
    import torch

    from ttbundle.backends.emulated import EmulatedModel, Runner
    from ttbundle.check import run_check

    spec = write_spec(tmp_path, ckpt)
    bundle = specmod.load(spec)
    res = buildmod.build(bundle, mesh, tmp_path / "out")
    assert res.status == "built"
    pkg = load_package(res.package, verify=True)
    assert pkg.mesh.name == mesh
    # every (phase, bucket) was warmed on the emulated backend and its output recorded
    warm = {k: v for k, v in pkg.manifest["artifacts"].items() if k.startswith("warmup:")}
    assert sorted(warm) == sorted(f"warmup:{p}-{b}" for p, b in [("prefill", 32), ("prefill", 64),
                                                                   ("decode", 1), ("decode", 8)])
    for k, v in warm.items():
        name = k.split(":")[1]
        assert v["ran"] and v["files"] == [f"warmup/{name}.json"] and v["files"][0] in pkg.manifest["files"]

    steps, prompt_len = 6, 70  # two prefill chunks of 64
    report = run_check(bundle, mesh, steps=steps, prompt_len=prompt_len)
    model = EmulatedModel.from_package(pkg)
    runner = Runner(model)
    prompt = report.prompt
    blocks = list(range(runner.max_blocks))
    if report.quality.natural_text:  # the package's tokenizer reads check's text: its next tokens follow
        import transformers

        from ttbundle.check.quality import default_text
        ids = transformers.AutoTokenizer.from_pretrained(str(res.package))(default_text())["input_ids"]
        assert prompt == ids[:prompt_len] and report.continuation == ids[prompt_len:prompt_len + steps - 1]
    else:  # random tokens, fed again as the decode steps (teacher forcing)
        assert prompt == torch.randint(0, bundle.arch.vocab_size, (prompt_len,),
                                       generator=torch.Generator().manual_seed(1)).tolist()
        assert report.continuation == prompt[:steps - 1]
    with torch.no_grad():
        tokens = [int(runner.prefill(prompt, blocks).argmax())]
        for i, t in enumerate(report.continuation):
            tokens.append(int(runner.decode([t], [prompt_len + i], [blocks])[0].argmax()))
    assert report.passed
    # the last prompt position's and each step's prediction
    assert tokens == report.ref_tokens[prompt_len - 1:] == report.emu_tokens[prompt_len - 1:]


def test_device_shards_are_the_emulated_backends_shards(tmp_path, ckpt):
    """Where nothing is padded, each device file holds exactly what the emulated backend puts on
    that device (same PartitionSpec semantics)."""
    import torch

    from ttbundle import weights
    from ttbundle.backends.emulated import EmulatedModel

    bundle = specmod.load(write_spec(tmp_path, ckpt))
    res = buildmod.build(bundle, "T3K", tmp_path / "out", warmup=False)
    pkg = load_package(res.package)
    plan = make_plan(pkg.bundle, pkg.mesh)  # build time: the plan the package was built from
    emu = EmulatedModel.from_canonical(bundle, plan, weights.load_canonical(bundle.family, bundle.arch, ckpt),
                                       lowermod.lower_all(bundle, plan), dtype=torch.bfloat16)
    for d in (0, 5):
        dev = pkg.weights.device(d)
        for name in ("wq", "w2", "embed", "attn_norm", "wk"):
            for layer in ((None,) if name == "embed" else (0, 1)):
                key = tensor_key(name, layer)
                ref = emu.weight(name, layer)[d]
                assert torch.equal(dev[key], ref), (key, d)


def test_column_parallel_shards_are_the_checkpoints_bytes(tmp_path, ckpt):
    """Shards of a transposed checkpoint tensor keep its [out, in] order: on T3K, device d's wq
    (split over output features) is byte for byte rows d*32..(d+1)*32 of q_proj in the HF
    file (read with safetensors, not through ttbundle), and the header says it is transposed."""
    import struct

    def raw(path: Path, key: str) -> tuple[bytes, dict, dict]:  # the safetensors format, by hand
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            head = json.loads(f.read(n))
            a, b = head[key]["data_offsets"]
            f.seek(8 + n + a)
            return f.read(b - a), head[key], head.get("__metadata__", {})

    res = buildmod.build(specmod.load(write_spec(tmp_path, ckpt)), "T3K", tmp_path / "out", warmup=False)
    q, info, _ = raw(next(ckpt.glob("*.safetensors")), "model.layers.1.self_attn.q_proj.weight")
    assert info["dtype"] == "BF16" and info["shape"] == [256, 256]
    row = 256 * 2
    for d in (0, 7):
        got, info, meta = raw(Path(res.package) / weight_file(d), "wq.1")
        layout = json.loads(meta["ttbundle"])["tensors"]["wq.1"]
        assert layout["transposed"] is True and layout["shape"] == [256, 32]
        assert info["shape"] == [32, 256]
        assert got == q[d * 32 * row:(d + 1) * 32 * row]


def test_writer_threads_do_not_change_a_byte(tmp_path, ckpt, monkeypatch):
    """Device files written by one writer thread or by three are identical (``cmp``)."""
    outs = []
    for n in (1, 3):
        monkeypatch.setattr(convert, "WRITER_THREADS", n)
        res = buildmod.build(specmod.load(write_spec(tmp_path, ckpt)), "T3K", tmp_path / f"out{n}",
                             warmup=False)
        outs.append(Path(res.package))
    for d in range(8):
        a, b = (o / weight_file(d) for o in outs)
        assert subprocess.run(["cmp", str(a), str(b)]).returncode == 0, d


def test_source_digests_are_blake3_of_the_files(tmp_path, ckpt):
    import blake3

    res = buildmod.build(specmod.load(write_spec(tmp_path, ckpt)), "N150", tmp_path / "out", warmup=False)
    recs = json.loads((Path(res.package) / "manifest.json").read_text())["sources"]["weights"]
    assert recs
    for r in recs:
        assert r["blake3"] == blake3.blake3((ckpt / r["name"]).read_bytes()).hexdigest(), r["name"]


def test_sharded_checkpoint_with_index(tmp_path):
    src = tmp_path / "sharded"
    make_checkpoint(src, seed=3, shards="300KB")
    assert (src / "model.safetensors.index.json").exists()
    assert len(list(src.glob("*.safetensors"))) > 2
    bundle = specmod.load(write_spec(tmp_path, src))
    res = buildmod.build(bundle, "N150", tmp_path / "out", warmup=False)
    import torch

    from ttbundle import weights
    canon = load_package(res.package, verify=True).weights.canonical(torch.bfloat16)
    ref = weights.load_canonical(bundle.family, bundle.arch, src)
    for name, v in ref.items():
        for a, b in zip(v if isinstance(v, list) else [v], canon[name] if isinstance(v, list) else [canon[name]]):
            assert torch.equal(a.to(torch.bfloat16), b), name
    recs = json.loads((Path(res.package) / "manifest.json").read_text())["sources"]["weights"]
    assert recs[0]["name"] == "model.safetensors.index.json" and len(recs) > 3


def test_package_layout_and_manifest(tmp_path, ckpt):
    bundle = specmod.load(write_spec(tmp_path, ckpt, tokenizer=ckpt))
    res = buildmod.build(bundle, "T3K", tmp_path / "out", warmup=False)
    pkg = Path(res.package)
    assert pkg == (tmp_path / "out" / "T3K" / "tiny").absolute()
    m = verify_package(pkg)
    meta = json.loads((pkg / "vllm_metadata.json").read_text())
    assert meta == {"arch": "LlamaForCausalLM", "main_class": meta["main_class"]}
    mod, cls = meta["main_class"].split(":")
    assert cls == "LlamaForCausalLM" and (pkg / f"{mod}.py").is_file()
    cfg = json.loads((pkg / "config.json").read_text())
    assert cfg["architectures"] == ["TTLlamaForCausalLM"] and cfg["vocab_size"] == 500
    for f in ("tokenizer.json", "tokenizer_config.json", "bundle.yaml", "README.md",
              "programs/prefill-32.json", "programs/decode-8.json", "weights/device-007.safetensors"):
        assert f in m["files"], f
    assert not (pkg / "weights/device-008.safetensors").exists()
    assert m["mesh"] == {"name": "T3K", "shape": [1, 8], "arch": "wormhole_b0", "devices": 8}
    assert m["buckets"] == {"prefill": [32, 64], "decode": [1, 8], "prefill_chunk": 64}
    assert m["spec_sha256"] == hashlib.sha256((pkg / "bundle.yaml").read_bytes()).hexdigest()
    for k in ("ttbundle", "vllm", "torch", "ttnn"):
        assert k in m["versions"]
    assert m["versions"]["vllm"] == "0.33.0"
    # the resolved spec loads as a spec and names every tensor's split
    b2 = specmod.load(pkg / "bundle.yaml")
    assert b2.spec.targets == ["T3K"] and b2.spec.weights.source is None
    assert set(b2.spec.sharding.plan) == {t.name for t in bundle.family.tensors(bundle.arch)}
    readme = (pkg / "README.md").read_text()
    assert "# tiny on T3K" in readme and "| prefill | 32 |" in readme and m["key"] in readme


# ---- incremental builds -----------------------------------------------------------------------------
def test_noop_rebuild_changes_no_file(tmp_path, ckpt):
    spec = write_spec(tmp_path, ckpt, tokenizer=ckpt)
    out = tmp_path / "out"
    first = buildmod.build(specmod.load(spec), "T3K", out, warmup=False)
    assert first.status == "built"
    before = snapshot(out)
    again = buildmod.build(specmod.load(spec), "T3K", out, warmup=False)
    assert again.status == "up-to-date" and again.rebuilt == [] and again.key == first.key
    assert snapshot(out) == before  # mtimes, inodes and contents of every file and directory


def test_a_build_asking_for_the_warmup_runs_it_after_a_no_warmup_build(tmp_path, ckpt):
    """The package of a ``--no-warmup`` build has the same content key; a build with the warm-up
    must not call it up to date (it would serve without references): it warms every program and
    reuses the weights and programs; a third build is then up to date."""
    spec = write_spec(tmp_path, ckpt)
    out = tmp_path / "out"
    first = buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    assert first.status == "built" and first.warmed == []
    # `cache explain` says what that build will do: not up to date, the warm-up to run
    ex = buildmod.explain(Path(first.package), None)
    assert not ex["up_to_date"] and not ex["warmed"] and not any(f["changed"] for f in ex["fields"])
    assert ex["would_rebuild"] and all(a.startswith("warmup:") for a in ex["would_rebuild"])
    second = buildmod.build(specmod.load(spec), "N150", out)
    assert second.status == "built" and second.key == first.key
    progs = sorted(a.split(":", 1)[1] for a in second.reused if a.startswith("program:"))
    assert progs and sorted(second.warmed) == progs and "weights" in second.reused
    m = json.loads((Path(second.package) / "manifest.json").read_text())
    assert all(r["ran"] for a, r in m["artifacts"].items() if a.startswith("warmup:"))
    assert buildmod.build(specmod.load(spec), "N150", out).status == "up-to-date"
    ex = buildmod.explain(Path(second.package), None)
    assert ex["up_to_date"] and ex["warmed"] and ex["would_rebuild"] == []
    # and a --no-warmup build after it keeps the references (up to date, nothing dropped)
    assert buildmod.build(specmod.load(spec), "N150", out, warmup=False).status == "up-to-date"


def test_noop_rebuild_cli_is_fast_and_touches_nothing(tmp_path, ckpt):
    spec = write_spec(tmp_path, ckpt)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ttbundle.cli", "build", str(spec), "--mesh", "N150", "-o", str(out),
           "--json", "--no-warmup"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    before = snapshot(out)
    t = time.monotonic()
    r = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    elapsed = time.monotonic() - t
    done = [json.loads(x) for x in r.stdout.splitlines() if '"done"' in x]
    assert done[-1]["status"] == "up-to-date"
    assert snapshot(out) == before
    assert elapsed < 5  # budget 2 s on an idle machine; generous for shared CI cores


def test_touched_checkpoint_is_rehashed_not_rebuilt(tmp_path, ckpt):
    src = tmp_path / "ck"
    shutil.copytree(ckpt, src)
    spec = write_spec(tmp_path, src)
    out = tmp_path / "out"
    buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    f = src / "model.safetensors"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    before = snapshot(out)
    r = buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    assert r.status == "up-to-date"
    assert snapshot(out) == before


def test_changed_bucket_rebuilds_only_its_program(tmp_path, ckpt):
    out = tmp_path / "out"
    spec = write_spec(tmp_path, ckpt)
    buildmod.build(specmod.load(spec), "T3K", out)
    pkg = out / "T3K" / "tiny"
    before = snapshot(pkg)
    spec.write_text(spec_text(ckpt, rest=REST.replace("decode: [1, 8]", "decode: [1, 4, 8]")))
    r = buildmod.build(specmod.load(spec), "T3K", out)
    assert r.status == "built"
    assert sorted(r.rebuilt) == ["program:decode-4", "warmup:decode-4"]
    after = snapshot(pkg)
    changed = sorted(k for k in after if after[k] != before.get(k) and after[k][2] is not None)
    # the new program and its warm-up reference, plus the files that list the buckets
    assert changed == ["README.md", "bundle.yaml", "manifest.json", "programs/decode-4.json",
                       "warmup/decode-4.json"]
    for f in ("weights/device-000.safetensors", "programs/prefill-32.json", "config.json", "warmup/decode-8.json"):
        assert after[f] == before[f]  # same inode, mtime and bytes: hard-linked, not rewritten
    m = json.loads((pkg / "manifest.json").read_text())
    assert m["build"]["changed_fields"] == ["spec", "spec.buckets"]
    # removing it again: nothing rebuilt, only the small files differ
    spec.write_text(spec_text(ckpt))
    r = buildmod.build(specmod.load(spec), "T3K", out)
    assert r.rebuilt == [] and not (pkg / "programs/decode-4.json").exists()


def test_changed_weights_rebuild_weights_and_warmups_not_programs(tmp_path, ckpt):
    src = tmp_path / "ck"
    shutil.copytree(ckpt, src)
    out = tmp_path / "out"
    spec = write_spec(tmp_path, src)
    buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    make_checkpoint(src, seed=9)
    r = buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    assert r.rebuilt == ["weights"]
    assert r.changed_fields == ["weights"]


def test_cache_explain_names_changed_fields(tmp_path, ckpt, runner):
    from ttbundle import cli

    out = tmp_path / "out"
    spec = write_spec(tmp_path, ckpt)
    buildmod.build(specmod.load(spec), "N150", out)  # warmed: what `build` leaves (a --no-warmup package is not up to date)
    pkg = out / "N150" / "tiny"
    r = runner.invoke(cli.app, ["cache", "explain", str(pkg)])
    assert r.exit_code == 0, r.output
    assert "up to date" in r.output
    spec.write_text(spec_text(ckpt, rest=REST.replace("max_num_seqs: 8", "max_num_seqs: 4")))
    r = runner.invoke(cli.app, ["cache", "explain", str(pkg), "--json"])
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert [f["field"] for f in data["fields"] if f["changed"]] == ["spec", "spec.runtime"]
    traces = ("prefill-32", "prefill-64", "decode-1", "decode-8")
    assert sorted(data["would_rebuild"]) == sorted([f"program:{t}" for t in traces] + [f"warmup:{t}" for t in traces])
    assert "weights" not in data["would_rebuild"]


# ---- refused inputs ----------------------------------------------------------------------------------
def test_block_float_shards_are_device_tiles(tmp_path, ckpt):
    """bfp8/bfp4 shards hold Tenstorrent tiles (1,088 / 576 B each) of each device's own shard,
    and read back as the values the device computes with (blockfloat.quantize of the shard)."""
    bf = pytest.importorskip("ttbundle.blockfloat")
    import torch

    from ttbundle import weights
    from ttbundle.backends.emulated import EmulatedModel

    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(ckpt).replace(f"  source: {ckpt}\n",
                                            f"  source: {ckpt}\n  dtypes: {{mlp: bfp8, attention: bfp4}}\n"))
    bundle = specmod.load(spec)
    res = buildmod.build(bundle, "T3K", tmp_path / "out", warmup=False)
    pkg = load_package(res.package, verify=True)
    plan = make_plan(pkg.bundle, pkg.mesh)  # build time: the plan the package was built from
    emu = EmulatedModel.from_canonical(bundle, plan, weights.load_canonical(bundle.family, bundle.arch, ckpt),
                                       lowermod.lower_all(bundle, plan), dtype=torch.bfloat16)
    from safetensors import safe_open
    with safe_open(str(Path(res.package) / weight_file(3)), framework="pt") as f:
        w1 = f.get_tensor("w1.0")
        wq = f.get_tensor("wq.1")
        assert w1.dtype == torch.uint8 and w1.numel() == (256 // 32) * (64 // 32) * 1088
        assert wq.numel() == (256 // 32) * (32 // 32) * 576
        assert "attn_norm.0" not in f.keys()  # replicated: stored once, in device 0's file
    with safe_open(str(Path(res.package) / weight_file(0)), framework="pt") as f:
        assert f.get_tensor("attn_norm.0").dtype == torch.bfloat16
    dev = pkg.weights.device(3)
    for name, fmt in (("w1", "bfp8"), ("w2", "bfp8"), ("wq", "bfp4"), ("wo", "bfp4")):
        want = bf.quantize(emu.weight(name, 1)[3], fmt)
        assert torch.equal(dev[f"{name}.1"], want), name
    canon = pkg.weights.canonical(torch.float32)
    assert canon["w1"][0].shape == (256, 512)
    assert res.status == "built"


def test_index_naming_a_file_outside_is_refused(tmp_path):
    src = tmp_path / "evil"
    make_checkpoint(src, seed=1, shards="300KB")
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = "../../etc/passwd"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(InvalidInput, match="refusing shard file '../../etc/passwd'"):
        buildmod.build(specmod.load(write_spec(tmp_path, src)), "N150", tmp_path / "out")


def test_unmapped_and_missing_checkpoint_tensors(tmp_path, ckpt):
    import torch
    from safetensors.torch import load_file, save_file

    sd = load_file(str(ckpt / "model.safetensors"))
    bad = tmp_path / "extra"
    bad.mkdir()
    save_file({**sd, "model.layers.0.mlp.surprise.weight": torch.zeros(2, 2, dtype=torch.bfloat16)},
              str(bad / "model.safetensors"))
    with pytest.raises(InvalidInput, match="cannot map checkpoint tensor 'model.layers.0.mlp.surprise.weight'"):
        buildmod.build(specmod.load(write_spec(tmp_path, bad, tokenizer=ckpt)), "N150", tmp_path / "out")
    sd.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(InvalidInput, match=r"no tensor 'model.layers.1.self_attn.k_proj.weight', needed for wk \(layer 1\)"):
        buildmod.build(specmod.load(write_spec(tmp_path, bad, tokenizer=ckpt)), "N150", tmp_path / "out")
    assert registrable(tmp_path / "out" / "N150") == []


def test_spec_names_cannot_escape_or_inject(tmp_path, ckpt):
    # the spec schema refuses such names; the package layer refuses them again for API callers
    bundle = specmod.load(write_spec(tmp_path, ckpt))
    for evil in ("../../escape", "a/b", "..", ".hidden", "x\ny", "tiny'; import os #"):
        forged = bundle.spec.model_copy(update={"name": evil})
        b2 = specmod.Bundle(forged, bundle.arch, bundle.family, bundle.file, bundle.base_dir)
        with pytest.raises(InvalidInput, match="cannot name a directory"):
            buildmod.build(b2, "N150", tmp_path / "out")
    assert not (tmp_path / "out").exists() or registrable(tmp_path / "out" / "N150") == []
    # a description full of quotes and code ends up as data only
    evil = '"""\nimport os; os.system("touch /tmp/pwned")\n\'\'\' {{ 7*7 }} <script>|`'
    spec = tmp_path / "d.yaml"
    spec.write_text(spec_text(ckpt).replace("description: build test model", f"description: {json.dumps(evil)}"))
    res = buildmod.build(specmod.load(spec), "N150", tmp_path / "out", warmup=False)
    pkg = Path(res.package)
    adapter = pkg / (json.loads((pkg / "vllm_metadata.json").read_text())["main_class"].split(":")[0] + ".py")
    assert "os.system" not in adapter.read_text()
    readme = (pkg / "README.md").read_text()
    assert "<script>" not in readme and "49" not in readme.split("## Serve")[0]


def test_does_not_fit_exits_3(tmp_path, ckpt, runner):
    from ttbundle import cli
    spec = tmp_path / "big.yaml"
    # a trace region as big as the chip's DRAM cannot fit
    spec.write_text(spec_text(ckpt, rest=REST.replace("max_num_seqs: 8", "max_num_seqs: 8, trace_region_size: 12884901888")))
    r = runner.invoke(cli.app, ["build", str(spec), "--mesh", "N150", "-o", str(tmp_path / "out")])
    assert r.exit_code == 3, r.output
    assert "does not fit N150" in r.output
    assert not (tmp_path / "out").exists()


def test_dry_run_writes_nothing_and_lists_traces(tmp_path, ckpt, runner):
    from ttbundle import cli
    spec = write_spec(tmp_path, ckpt)
    r = runner.invoke(cli.app, ["build", str(spec), "--mesh", "T3K", "-o", str(tmp_path / "out"),
                                "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "out").exists()
    done = json.loads(r.output.splitlines()[-1])
    assert done["status"] == "dry-run" and len(done["key"]) == 64
    assert [(t["phase"], t["bucket"]) for t in done["traces"]] == [("prefill", 32), ("prefill", 64),
                                                                   ("decode", 1), ("decode", 8)]
    assert all(t["trace_region_bytes"] > 0 and t["warmup_seconds_est"] >= 0 for t in done["traces"])
    # the key it prints is the key a build records
    res = buildmod.build(specmod.load(spec), "T3K", tmp_path / "out", warmup=False)
    assert res.key == done["key"]
    r = runner.invoke(cli.app, ["build", str(spec), "--mesh", "T3K", "-o", str(tmp_path / "out"), "--dry-run"])
    assert "would rebuild: nothing (up to date)" in r.output


def test_cli_build_json_events_and_table(tmp_path, ckpt, runner):
    from ttbundle import cli
    spec = write_spec(tmp_path, ckpt)
    r = runner.invoke(cli.app, ["build", str(spec), "--mesh", "N150", "-o", str(tmp_path / "out"),
                                "--json", "--no-warmup"])
    assert r.exit_code == 0, r.output
    events = [json.loads(x) for x in r.output.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "phase" and kinds[-1] == "done"
    tensors = [e for e in events if e["event"] == "advance" and e["phase"] == "weights"]
    assert len(tensors) == 3 + 9 * 2 and tensors[-1]["i"] == tensors[-1]["n"]
    r = runner.invoke(cli.app, ["build", str(spec), "--mesh", "N150", "-o", str(tmp_path / "out"), "--no-warmup"])
    assert r.exit_code == 0
    assert "up-to-date" in r.output


# ---- atomicity -----------------------------------------------------------------------------------------
def _check_invariant(out: Path, mesh: str, specs_ok: set) -> None:
    """What a serving host could see right now: at most the one package, complete and verified,
    built from one of the allowed specs (resolved-spec sha256); nothing else registrable."""
    found = registrable(out / mesh)
    assert [p.name for p in found] in ([], ["tiny"]), found
    if found:
        m = verify_package(found[0])
        assert m["spec_sha256"] in specs_ok


def _spec_sha(res) -> str:
    return json.loads((Path(res.package) / "manifest.json").read_text())["spec_sha256"]


def test_interrupted_at_every_stage_leaves_old_package(tmp_path, ckpt):
    """Stop the build at every point it can be interrupted (each tensor, file, the swap) and check
    what is on disk at that instant: a kill -9 there leaves exactly this state."""
    out = tmp_path / "out"
    spec = write_spec(tmp_path, ckpt)
    old = buildmod.build(specmod.load(spec), "T3K", out, warmup=False)
    spec.write_text(spec_text(ckpt, rest=REST.replace("prefill: [32, 64]", "prefill: [32, 64, 96]")
                              .replace("prefill_chunk: 64", "prefill_chunk: 96")))
    stages = []

    class Killed(BaseException):
        pass

    def hook(stage):
        stages.append(stage)
        if stage == "after-swap":  # the new package is in place
            m = verify_package(out / "T3K" / "tiny")
            assert m["buckets"]["prefill"] == [32, 64, 96] and registrable(out / "T3K") == [out / "T3K" / "tiny"]
            raise Killed()
        _check_invariant(out, "T3K", {_spec_sha(old)})
    fsutil.fault_hook = hook
    try:
        with pytest.raises(Killed):
            buildmod.build(specmod.load(spec), "T3K", out, force=True, warmup=False)
    finally:
        fsutil.fault_hook = None
    assert stages[0].startswith("tensor:") and "before-swap" in stages and stages[-1] == "after-swap"
    assert sum(s.startswith("tensor:") for s in stages) == 21 and "wrote:manifest" in stages
    # stopped after the exchange: the new package is in place and complete
    new = verify_package(out / "T3K" / "tiny")
    assert new["buckets"]["prefill"] == [32, 64, 96]
    r = buildmod.build(specmod.load(spec), "T3K", out, warmup=False)
    assert r.status == "up-to-date" and list((out / ".ttbundle" / "tmp").iterdir()) == []


def test_failed_build_cleans_up_and_keeps_old(tmp_path, ckpt):
    out = tmp_path / "out"
    spec = write_spec(tmp_path, ckpt)
    old = buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    before = snapshot(out / "N150")

    def hook(stage):
        if stage.startswith("tensor:w2"):
            raise RuntimeError("disk on fire")
    fsutil.fault_hook = hook
    try:
        with pytest.raises(RuntimeError, match="disk on fire"):
            buildmod.build(specmod.load(spec), "N150", out, force=True, warmup=False)
    finally:
        fsutil.fault_hook = None
    assert snapshot(out / "N150") == before
    assert list((out / ".ttbundle" / "tmp").iterdir()) == []
    assert verify_package(out / "N150" / "tiny")["key"] == old.key



def test_an_encoder_threads_failure_fails_the_build_and_keeps_the_old(tmp_path, ckpt, monkeypatch):
    """Block-float tiles are encoded on worker threads while the next tensor is read
    (``convert._Encoding``): an error there reaches the build (through the writer that waits for
    the tiles), nothing half-written is left, the old package stays, and no worker outlives it."""
    import threading

    from ttbundle import blockfloat

    out = tmp_path / "out"
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(ckpt).replace(f"  source: {ckpt}\n",
                                            f"  source: {ckpt}\n  dtypes: {{mlp: bfp8}}\n"))
    old = buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    before = snapshot(out / "N150")
    real, calls = blockfloat.encode_array, []

    def failing(x, fmt):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise RuntimeError("encoder on fire")
        return real(x, fmt)

    monkeypatch.setattr(blockfloat, "encode_array", failing)
    with pytest.raises(RuntimeError, match="encoder on fire"):
        buildmod.build(specmod.load(spec), "N150", out, force=True, warmup=False)
    assert len(calls) >= 3 and all(n.startswith("ttbundle-encode") for n in calls), calls
    assert snapshot(out / "N150") == before
    assert list((out / ".ttbundle" / "tmp").iterdir()) == []
    assert verify_package(out / "N150" / "tiny")["key"] == old.key
    assert not [t for t in threading.enumerate() if t.name.startswith(("ttbundle-encode", "ttbundle-writer"))]


def test_fallback_swap_without_renameat2_recovers(tmp_path, ckpt, monkeypatch):
    out = tmp_path / "out"
    spec = write_spec(tmp_path, ckpt)
    old = buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    monkeypatch.setattr(txn, "_exchange", lambda a, b: False)

    class Killed(BaseException):
        pass

    def hook(stage):
        if stage == "mid-swap":
            raise Killed()
    fsutil.fault_hook = hook
    try:
        with pytest.raises(Killed):
            buildmod.build(specmod.load(spec), "N150", out, force=True, warmup=False)
    finally:
        fsutil.fault_hook = None
    assert not (out / "N150" / "tiny").exists()  # killed between the two renames
    r = buildmod.build(specmod.load(spec), "N150", out, warmup=False)  # recovery restores the old one
    assert r.status == "up-to-date" and r.key == old.key
    verify_package(out / "N150" / "tiny")


CHILD = textwrap.dedent("""
    import sys
    from ttbundle import build, spec
    b = spec.load(sys.argv[1])
    print("ready", flush=True)
    r = build.build(b, sys.argv[2], sys.argv[3], warmup=sys.argv[4] == "1", force=sys.argv[5] == "1")
    print(r.status, r.key, flush=True)
""")


def _child(spec, mesh, out, warmup=True, force=False):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(spec), mesh, str(out), "1" if warmup else "0",
                             "1" if force else "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


@pytest.mark.slow
def test_kill_9_at_random_points_never_leaves_a_broken_package(tmp_path, ckpt):
    out = tmp_path / "out"
    spec_a = write_spec(tmp_path, ckpt)
    spec_b = tmp_path / "b.yaml"
    spec_b.write_text(spec_text(ckpt, rest=REST.replace("decode: [1, 8]", "decode: [1, 2, 8]")))
    a = buildmod.build(specmod.load(spec_a), "T3K", out, warmup=False)
    a_sha = _spec_sha(a)
    # time a full child build (after its imports) to spread the kills over it
    p = _child(spec_b, "T3K", tmp_path / "timing", force=True)
    p.stdout.readline()
    t = time.monotonic()
    p.stdout.readline()
    duration = time.monotonic() - t
    assert p.wait() == 0
    b_sha = json.loads((tmp_path / "timing" / "T3K" / "tiny" / "manifest.json").read_text())["spec_sha256"]
    rng = random.Random(1234)
    outcomes = []
    for i in range(12):
        spec = spec_b if i % 2 == 0 else spec_a
        p = _child(spec, "T3K", out, force=True)
        assert p.stdout.readline().strip() == "ready"
        delay = rng.uniform(0, duration * 1.2)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        _check_invariant(out, "T3K", {a_sha, b_sha})
        m = json.loads((out / "T3K" / "tiny" / "manifest.json").read_text())
        outcomes.append((round(delay, 2), "b" if m["spec_sha256"] == b_sha else "a"))
    # after all that, a normal build still works and cleans the temp area
    r = buildmod.build(specmod.load(spec_a), "T3K", out, warmup=False)
    assert r.status in ("built", "up-to-date") and _spec_sha(r) == a_sha
    assert list((out / ".ttbundle" / "tmp").iterdir()) == []
    verify_package(out / "T3K" / "tiny")
    print("kill points (s, finished):", outcomes)


@pytest.mark.slow
def test_concurrent_builds_serialize_on_the_lock(tmp_path, ckpt):
    out = tmp_path / "out"
    spec = write_spec(tmp_path, ckpt)
    procs = [_child(spec, "N150", out, warmup=False) for _ in range(2)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        results.append(stdout.split()[1])
    assert sorted(results) == ["built", "up-to-date"]
    verify_package(out / "N150" / "tiny")
    assert list((out / ".ttbundle" / "tmp").iterdir()) == []


def test_error_type_for_library_callers():
    assert issubclass(buildmod.DoesNotFit, TTBundleError) and buildmod.DoesNotFit.exit_code == 3


def test_refuses_to_replace_what_is_not_a_package(tmp_path, ckpt):
    out = tmp_path / "out"
    spec = write_spec(tmp_path, ckpt)
    target = out / "N150" / "tiny"
    target.mkdir(parents=True)
    (target / "precious.txt").write_text("mine")
    with pytest.raises(InvalidInput, match="exists and is not a ttbundle package"):
        buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    assert (target / "precious.txt").read_text() == "mine"
    shutil.rmtree(target)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target.symlink_to(elsewhere)
    with pytest.raises(InvalidInput, match="not a package directory"):
        buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    assert target.is_symlink() and elsewhere.is_dir()


def test_recovery_only_touches_its_own_temp_dirs(tmp_path):
    state = tmp_path / ".ttbundle"
    mine, other = state / "tmp" / "T3K@tiny@12.ab", state / "tmp" / "T3K@tiny.v2@13.cd"
    for d in (mine, other):
        d.mkdir(parents=True)
    buildmod._recover(state, tmp_path / "T3K" / "tiny")
    assert not mine.exists() and other.exists()


FAMILIES = {
    # biases on q/k/v
    "qwen2": """model: {family: qwen2, vocab_size: 512, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2,
  num_attention_heads: 8, num_key_value_heads: 4, max_position_embeddings: 1024}""",
    # 1+w norms, sliding windows, soft-capping
    "gemma2": """model: {family: gemma2, vocab_size: 512, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 3,
  num_attention_heads: 8, num_key_value_heads: 4, head_dim: 32, max_position_embeddings: 1024, sliding_window: 48,
  attn_logit_softcapping: 20.0, final_logit_softcapping: 15.0, query_pre_attn_scalar: 32}""",
    # routed experts stacked from per-expert checkpoint keys, router, sinks
    "gpt_oss": """model: {family: gpt_oss, vocab_size: 128, hidden_size: 64, intermediate_size: 32, num_hidden_layers: 3,
  num_attention_heads: 8, num_key_value_heads: 2, head_dim: 16, num_local_experts: 8, num_experts_per_tok: 2,
  sliding_window: 16, max_position_embeddings: 2048}""",
    # experts stacked from per-expert keys (transformers 5 fuses them in memory), q/k norm, a dense first layer
    "qwen3_moe": """model: {family: qwen3_moe, vocab_size: 128, hidden_size: 64, intermediate_size: 96, num_hidden_layers: 3,
  num_attention_heads: 8, num_key_value_heads: 2, head_dim: 16, moe_intermediate_size: 32, num_experts: 8,
  num_experts_per_tok: 2, norm_topk_prob: true, mlp_only_layers: [0], max_position_embeddings: 2048}""",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_convert_exactly(tmp_path, family):
    import torch

    from ttbundle import reference, weights
    text = f"name: tiny-{family.replace('_', '-')}\n" + FAMILIES[family] + "\n" + REST.replace(
        "targets: [N150, T3K, TG]", "targets: [N300, T3K]")
    b = specmod.loads(text, "x.yaml")
    reference.random_model(b, 0).to(torch.bfloat16).save_pretrained(str(tmp_path / "ckpt"))
    (tmp_path / "s.yaml").write_text(text + "weights: {source: ckpt}\ntokenizer: false\n")
    b = specmod.load(tmp_path / "s.yaml")
    res = buildmod.build(b, "T3K", tmp_path / "out", warmup=False)
    got = load_package(res.package, verify=True).weights.canonical(torch.bfloat16)
    ref = weights.load_canonical(b.family, b.arch, tmp_path / "ckpt")
    for name, v in ref.items():
        for x, y in zip(v if isinstance(v, list) else [v], got[name] if isinstance(v, list) else [got[name]]):
            assert torch.equal(x.to(torch.bfloat16), y), name


def test_ui_edit_rebuilds_nothing_and_an_encoder_edit_rebuilds_weights(tmp_path, ckpt):
    """`ttbundle build` run from a copy of ttbundle's sources: editing the progress bars leaves
    the package up to date; editing blockfloat.py (which the conversion imports) rebuilds the
    weights, and no program."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "ttbundle", src / "ttbundle", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "templates", src / "templates")
    spec = write_spec(tmp_path, ckpt)
    out = tmp_path / "out"
    first = buildmod.build(specmod.load(spec), "N150", out, warmup=False)

    def build_from_copy():
        env = {**os.environ, "PYTHONPATH": str(src)}
        r = subprocess.run([sys.executable, "-m", "ttbundle.cli", "build", str(spec), "--mesh", "N150",
                            "-o", str(out), "--json", "--no-warmup"], capture_output=True, text=True,
                           cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        return [json.loads(x) for x in r.stdout.splitlines() if '"done"' in x][-1]

    with open(src / "ttbundle" / "progress.py", "a") as f:
        f.write("\nConsoleProgress.LABELS['weights'] = 'converting the weights'\n")
    ui = build_from_copy()
    assert ui["status"] == "up-to-date" and ui["key"] == first.key, ui
    with open(src / "ttbundle" / "blockfloat.py", "a") as f:
        f.write("\n# an encoder edit\n")
    enc = build_from_copy()
    assert enc["status"] == "built" and "code.convert" in enc["changed_fields"]
    assert "weights" in enc["rebuilt"] and not [a for a in enc["rebuilt"] if a.startswith("program:")]


def test_the_encoders_hold_a_bounded_source(tmp_path):
    """``convert._Encoder``: the reader waits while the shards queued for the encoders or being
    encoded reference ``budget`` bytes of source (a slow encoder never lets decoded expert chunks
    pile up behind it); one shard over the budget waits for the others and runs alone; every
    shard's jobs run."""
    import threading

    from ttbundle import convert

    enc = convert._Encoder(2, 100)
    gate, ran = threading.Event(), []

    def job(j):
        assert gate.wait(10)
        ran.append(j)
    first = enc.run(job, [1, 2], 60)
    later: list = []
    producer = threading.Thread(target=lambda: later.extend(enc.run(job, [3], 60)))
    producer.start()
    producer.join(0.3)
    assert producer.is_alive() and enc.held == 60  # 60 + 60 > 100: the reader waits
    gate.set()
    producer.join(10)
    assert not producer.is_alive()
    for f in first + later:
        f.result(10)
    big = enc.run(job, [4], 500)  # over the budget: alone, counted as the whole budget
    big[0].result(10)
    assert sorted(ran) == [1, 2, 3, 4] and enc.most <= 100
    assert enc.run(job, [], 50) == []
    enc.shutdown()
    assert enc.held == 0
