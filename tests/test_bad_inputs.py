"""Careless or hostile input never gives a Python traceback (issue 15): odd YAML scalars, broken
config.json files, tokenizer symlinks, unreadable or lying checkpoints, checkpoint dtypes a family
does not read, NaN weights, an output path that is not a directory and a full disk all end in an
error naming the file and what to do, with the documented exit code and any previous package
left as it was."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from ttbundle import build as buildmod, spec as specmod
from ttbundle.package.names import identifier, safe_name
from ttbundle.package.shardfile import ShardFile
from ttbundle.package.verify import verify_package
from ttbundle.errors import InvalidInput, TTBundleError

from spec_helpers import spec_text as tiny_text
from test_build import ckpt, make_tokenizer, snapshot, spec_text, write_spec  # noqa: F401  (session fixture)


def _cli(runner, *args):
    from ttbundle.cli import app
    r = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), (r.output, repr(r.exception))
    return r


# ---- spec scalars ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value, says", [
    ("1" * 5000, "characters"), ("2001-02-30", "not a valid timestamp"), ("!!int abc", "not a valid int"),
    ("!!float abc", "not a valid float"), ("!!timestamp garbage", "not a valid timestamp"),
    ("0b" + "1" * 20000, "characters"), ("1" * 4000, "integer out of range"),
    ("0x" + "f" * 100, "integer out of range"), (".inf", "not a finite number"), ("1.0e+999", "not a finite number"),
])
def test_spec_scalars_are_located_errors(tmp_path, runner, value, says):
    text = tiny_text().replace("  hidden_size: 512", f"  hidden_size: {value}")
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    line = text.splitlines().index(f"  hidden_size: {value}") + 1
    r = _cli(runner, "validate", p)
    assert r.exit_code == 2, r.output
    assert f"spec.yaml:{line}:16: model.hidden_size:" in r.output and says in r.output


def test_long_tokenizer_path_and_huge_mesh_are_errors(tmp_path, runner):
    p = tmp_path / "spec.yaml"
    p.write_text(tiny_text({"tokenizer": "a" * 300}))
    r = _cli(runner, "validate", p)
    assert r.exit_code == 2 and "tokenizer:" in r.output and "File name too long" in r.output, r.output
    for mesh in ["(1" + "0" * 5000 + ",1)", "(1" + "0" * 4000 + ",1)", "(\u0661,\u0662)", "(1,2)\n"]:
        p.write_text(tiny_text({"targets": [mesh]}))
        r = _cli(runner, "validate", p)
        assert r.exit_code == 2 and "targets.0" in r.output, (mesh[:20], r.output)


@pytest.mark.parametrize("name", ["tiny\n", "tiny\n\n", "\ntiny"])
def test_names_with_a_newline_are_refused(tmp_path, runner, name):
    p = tmp_path / "spec.yaml"
    p.write_text(tiny_text({"name": name}))
    r = _cli(runner, "validate", p)
    assert r.exit_code == 2 and "name:" in r.output, r.output
    with pytest.raises(InvalidInput):
        safe_name(name, "bundle name")
    with pytest.raises(InvalidInput):
        identifier("x\n", "module")
    from ttbundle import mesh as meshmod
    with pytest.raises(InvalidInput):
        meshmod.resolve("(1,2)\n")


# ---- config.json ----------------------------------------------------------------------------------
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 512,
      "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
      "max_position_embeddings": 4096}


@pytest.mark.parametrize("change, says", [
    ({"architectures": 7}, "architectures: expected a list"),
    ({"architectures": [7]}, "architectures: expected a list"),
    ("replace", "no `architectures` entry"),
    ({"rope_parameters": 5}, "rope_parameters: expected a JSON object"),
    ({"rope_scaling": [1]}, "rope_scaling: expected a JSON object"),
    ({"text_config": 5}, "text_config: expected a JSON object"),
    ({"hidden_size": 10**30}, "hidden_size: integer out of range"),
    ("nan", "NaN is not a number JSON allows"),
    ("bigint", "not readable JSON"),
])
def test_bad_config_json_is_an_error_naming_it(tmp_path, runner, change, says):
    d = tmp_path / "hf"
    d.mkdir()
    if change == "replace":
        text = json.dumps({"a": 1})
    elif change == "nan":
        text = json.dumps(HF)[:-1] + ', "rms_norm_eps": NaN}'
    elif change == "bigint":
        text = json.dumps(HF)[:-1] + ', "rope_theta": ' + "9" * 5000 + "}"
    else:
        text = json.dumps({**HF, **change})
    (d / "config.json").write_text(text)
    r = _cli(runner, "init", "--from-hf", d, "-o", tmp_path / "out.yaml")
    assert r.exit_code == 2 and "config.json" in r.output and says in r.output, r.output
    (tmp_path / "spec.yaml").write_text("name: t\nfrom_hf: hf\ntargets: [N150]\n")
    r = _cli(runner, "validate", tmp_path / "spec.yaml")
    assert r.exit_code == 2 and "from_hf" in r.output and says in r.output, r.output
    assert not (tmp_path / "out.yaml").exists()


def test_config_json_symlinked_out_of_its_directory_is_refused(tmp_path, runner):
    (tmp_path / "elsewhere.json").write_text(json.dumps(HF))
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").symlink_to(tmp_path / "elsewhere.json")
    r = _cli(runner, "init", "--from-hf", d, "-o", tmp_path / "out.yaml")
    assert r.exit_code == 2 and "symlink" in r.output and "outside" in r.output, r.output


def test_oversized_and_special_spec_files(tmp_path, runner):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate((16 << 20) + 1)
    r = _cli(runner, "validate", big)
    assert r.exit_code == 2 and "more than" in r.output
    for special in ("/dev/zero", "/proc/self"):
        r = _cli(runner, "validate", special)
        assert r.exit_code == 2 and "not a regular file" in r.output, r.output


# ---- tokenizer files --------------------------------------------------------------------------------
def test_tokenizer_symlink_out_of_its_directory_is_refused(tmp_path, ckpt, runner):
    tok = tmp_path / "tok"
    make_tokenizer(tok)
    (tok / "generation_config.json").symlink_to("/proc/self/environ")
    spec = write_spec(tmp_path, ckpt, tokenizer=tok)
    out = tmp_path / "out"
    r = _cli(runner, "build", spec, "--mesh", "N150", "-o", out, "--no-warmup")
    assert r.exit_code == 2, r.output
    assert "generation_config.json" in r.output and "outside" in r.output
    assert not (out / "N150" / "tiny").exists()
    # a symlink inside the directory is followed (it names a file of the tokenizer directory)
    (tok / "generation_config.json").unlink()
    (tok / "real.json").write_text("{}")
    (tok / "generation_config.json").symlink_to(tok / "real.json")
    r = _cli(runner, "build", spec, "--mesh", "N150", "-o", out, "--no-warmup")
    assert r.exit_code == 0, r.output
    assert (out / "N150" / "tiny" / "generation_config.json").read_text() == "{}"


# ---- checkpoints ------------------------------------------------------------------------------------
def _copy_ckpt(ckpt, d: Path, edit=None) -> Path:
    """``ckpt`` copied to ``d`` with ``edit(name, tensor) -> tensor`` applied to every tensor."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(ckpt, d)
    if edit:
        f = d / "model.safetensors"
        sd = load_file(str(f))
        save_file({k: edit(k, v).contiguous() for k, v in sd.items()}, str(f), metadata={"format": "pt"})
    return d


def _build(runner, tmp_path, src, *extra):
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(src, tokenizer=src))
    return _cli(runner, "build", spec, "--mesh", "N150", "-o", tmp_path / "out", "--no-warmup", *extra)


def _header(f: Path) -> tuple[int, dict]:
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


@pytest.mark.parametrize("damage", ["empty", "truncated", "lying-offsets", "header-too-long", "not-json"])
def test_broken_safetensors_is_an_error_naming_the_file(tmp_path, ckpt, runner, damage):
    src = _copy_ckpt(ckpt, tmp_path / "src")
    f = src / "model.safetensors"
    raw = f.read_bytes()
    n, header = _header(f)
    if damage == "empty":
        f.write_bytes(b"")
    elif damage == "truncated":
        f.write_bytes(raw[:len(raw) // 2])
    elif damage == "lying-offsets":
        k = next(k for k in header if k != "__metadata__")
        header[k]["data_offsets"][1] += 10**9
        h = json.dumps(header).encode()
        f.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    elif damage == "header-too-long":
        f.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    else:
        f.write_bytes(struct.pack("<Q", 8) + b"{not json" + raw[17:])
    r = _build(runner, tmp_path, src)
    assert r.exit_code == 2, r.output
    assert "model.safetensors: not a readable safetensors file" in r.output, r.output


@pytest.mark.parametrize("dtype", ["int32", "float64"])  # fp16 is read: tests/test_intake.py
def test_checkpoint_dtypes_the_family_does_not_read_are_refused(tmp_path, ckpt, runner, dtype):
    import torch
    want = getattr(torch, dtype)
    src = _copy_ckpt(ckpt, tmp_path / "src", lambda k, v: v.to(want) if "mlp" in k else v)
    r = _build(runner, tmp_path, src)
    assert r.exit_code == 2, r.output
    st = {"int32": "I32", "float64": "F64"}[dtype]
    assert "checkpoint dtypes llama does not read" in r.output
    assert f"model.layers.0.mlp.down_proj.weight: {st}, llama reads BF16, F16 or F32 here" in r.output
    assert not (tmp_path / "out" / "N150" / "tiny").exists()


def test_fp32_checkpoint_still_builds(tmp_path, ckpt, runner):
    import torch
    src = _copy_ckpt(ckpt, tmp_path / "src", lambda k, v: v.to(torch.float32))
    assert _build(runner, tmp_path, src).exit_code == 0


def test_nan_and_inf_weights_are_reported_per_tensor(tmp_path, ckpt, runner):
    def edit(k, v):
        if k == "model.layers.1.self_attn.q_proj.weight":
            return torch.full_like(v, float("nan"))
        if k == "model.norm.weight":
            v = v.clone()
            v[:3] = float("inf")
        return v
    import torch
    src = _copy_ckpt(ckpt, tmp_path / "src", edit)
    r = _build(runner, tmp_path, src)
    assert r.exit_code == 2, r.output
    assert "non-finite weights in 2 tensor(s)" in r.output
    n = 256 * 256
    assert f"model.layers.1.self_attn.q_proj.weight (model.safetensors): {n:,} NaN, 0 Inf" in r.output
    assert "model.norm.weight (model.safetensors): 0 NaN, 3 Inf" in r.output


# ---- output ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["file", "under-a-file", "/dev/null", "/proc/self"])
def test_output_that_is_not_a_directory(tmp_path, ckpt, runner, where):
    spec = write_spec(tmp_path, ckpt)
    if where in ("file", "under-a-file"):
        (tmp_path / "afile").write_text("mine")
        out = tmp_path / "afile" if where == "file" else tmp_path / "afile" / "sub"
    else:
        out = Path(where)
    r = _cli(runner, "build", spec, "--mesh", "N150", "-o", out, "--no-warmup")
    assert r.exit_code == 2, r.output
    assert "-o" in r.output
    if where.startswith("/"):
        assert "/dev/null" in r.output or "/proc" in r.output
    else:
        assert (tmp_path / "afile").read_text() == "mine"


def test_full_disk_is_an_error_and_the_previous_package_stays(tmp_path, ckpt, runner, monkeypatch):
    spec = write_spec(tmp_path, ckpt)
    out = tmp_path / "out"
    old = buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    before = snapshot(out / "N150")

    def full(self, buf):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
    monkeypatch.setattr(ShardFile, "_put", full)
    r = _cli(runner, "build", spec, "--mesh", "N150", "-o", out, "--no-warmup", "--force")
    assert r.exit_code == 1, r.output
    assert "No space left on device" in r.output and "free some space" in r.output
    assert "device-000.safetensors" in r.output and "unchanged" in r.output
    assert snapshot(out / "N150") == before
    assert verify_package(out / "N150" / "tiny")["key"] == old.key
    with pytest.raises(TTBundleError, match="No space left"):
        buildmod.build(specmod.load(spec), "N150", out, warmup=False, force=True)


@pytest.mark.parametrize("command", [["schema", "-o"], ["mock-cluster", "--mesh", "N150", "-o"]])
def test_writing_over_a_device_fifo_or_directory_is_refused(tmp_path, runner, command):
    """An atomic write renames a temp file over its target: over a FIFO (or /dev/null, as root)
    that would replace the node itself."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    for target in (fifo, tmp_path / "dir"):
        r = _cli(runner, *command, target)
        assert r.exit_code == 2 and "not a regular file" in r.output, r.output
    assert fifo.is_fifo() and (tmp_path / "dir").is_dir()


def test_check_on_a_broken_checkpoint_is_an_error(tmp_path, ckpt, runner):
    src = _copy_ckpt(ckpt, tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(src, tokenizer=src))
    r = _cli(runner, "check", spec, "--steps", "1")
    assert r.exit_code == 2 and "not a readable safetensors file" in r.output, r.output


def test_index_symlinked_to_a_device_is_refused_before_reading(tmp_path, ckpt, runner):
    src = _copy_ckpt(ckpt, tmp_path / "src")
    (src / "model.safetensors.index.json").symlink_to("/dev/zero")
    r = _build(runner, tmp_path, src)
    assert r.exit_code == 2 and "model.safetensors.index.json" in r.output, r.output


# ---- path components longer than the file system allows (issue 43) ---------------------------------
LONG = "a" * 300


@pytest.mark.parametrize("args", [
    ["init", "--from-hf", LONG, "-o", "x.yaml"],
    ["init", "--from-hf", f"/tmp/{LONG}/model", "-o", "x.yaml"],
    ["init", "--from-hf", "{ckpt}", "-o", f"{LONG}/spec.yaml"],
    ["init", "--from-hf", "{ckpt}", "-o", f"{LONG}.yaml"],
    ["check", LONG], ["check", f"{LONG}.yaml"],
    ["register", "--dir", LONG], ["register", "--dir", f"/tmp/{LONG}/x"],
], ids=["init-from-hf", "init-from-hf-dir", "init-o-dir", "init-o", "check", "check-spec", "register",
        "register-abs"])
def test_a_path_component_over_255_bytes_is_one_line_exit_2(tmp_path, ckpt, runner, monkeypatch, args):
    """Was `OSError: [Errno 36] File name too long` with a traceback, exit 1."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    r = _cli(runner, *[a.replace("{ckpt}", str(ckpt)) for a in args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "file name too long: a path component of" in lines[0] and "(at most 255)" in lines[0]
    assert list(tmp_path.glob("*.yaml")) == []  # nothing half-written


# ---- an MoE checkpoint whose expert count is not its config's -----------------------------------
@pytest.mark.parametrize("declared", [4, 16])
def test_expert_count_that_disagrees_with_the_checkpoint_is_a_located_error(tmp_path, runner, declared):
    """A Qwen3 MoE checkpoint of 8 experts per layer under a spec that says ``declared``: exit 2
    at the spec's num_experts line, saying both counts, before anything is written."""
    import yaml

    from ttbundle import reference
    from test_emulated_moe import tiny as moe_tiny

    src = reference.save_random(moe_tiny("qwen3_moe"), tmp_path / "ckpt", seed=1)
    doc = moe_tiny("qwen3_moe").spec.model_dump(mode="json", exclude_none=True)
    doc["model"]["num_experts"] = declared
    doc["model"]["num_experts_per_tok"] = 2
    doc.update(weights={"source": str(src)}, tokenizer=False, targets=["N150"])
    doc.pop("sharding", None)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    line = next(i for i, s in enumerate(spec.read_text().splitlines(), 1) if s.strip().startswith("num_experts:"))
    r = _cli(runner, "build", spec, "--mesh", "N150", "-o", tmp_path / "out")
    assert r.exit_code == 2, r.output
    assert f"spec.yaml:{line}" in r.output and "model.num_experts" in r.output, r.output
    assert f"stores 8 experts" in r.output and f"num_experts={declared}" in r.output, r.output
    assert not (tmp_path / "out" / "N150").exists() or not any((tmp_path / "out" / "N150").iterdir())
