"""Operators' faults (issue 23, items 2, 3, 4, 8, 9, 11): one verifier gives one verdict on a
package at `register`, `ls`, `cache verify`, `check` and `serve` (adapter vetting, no remote
code, a strict manifest); `serve` refuses `--trust-remote-code` and a package without a
tokenizer before vLLM starts; `build` refuses a checkpoint without a tokenizer unless the spec
says `tokenizer: false`, and reports an up-to-date package in a read-only output directory."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ttbundle import build as buildmod, spec as specmod
from ttbundle.manifest import MANIFEST, METADATA
from ttbundle.package.names import PackageError, TOKENIZER_FILES, has_tokenizer
from ttbundle.package.verify import read_manifest, verify_package
from ttbundle.errors import InvalidInput
from ttbundle.serving import serve as servemod

from pkg_mutations import edit_json, rehash
from test_build import ckpt, spec_text, write_spec  # noqa: F401  (session fixture)
from test_package import built  # noqa: F401  (the N300 package, built once per module)

ROOT = Path(__file__).resolve().parent.parent
CODE = Path(buildmod.__file__).resolve().parent.parent  # the ttbundle under test (for subprocesses)


@pytest.fixture
def pkg(built, tmp_path):
    dst = tmp_path / "out" / "N300" / built.name
    shutil.copytree(built, dst)
    return dst


@pytest.fixture
def no_vllm(monkeypatch):
    """`serve` must refuse before vLLM starts: starting it fails the test."""
    def start(*a, **k):
        raise AssertionError("vLLM was started")
    monkeypatch.setattr(servemod, "start", start)


def _adapter(pkg: Path) -> str:
    return json.loads((pkg / METADATA).read_text())["main_class"].split(":")[0] + ".py"


def _add_file(pkg: Path, rel: str, data: bytes) -> None:
    (pkg / rel).write_bytes(data)
    m = json.loads((pkg / MANIFEST).read_text())
    m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (pkg / MANIFEST).write_text(json.dumps(m, indent=1))


def _drop_files(pkg: Path, *rels: str) -> None:
    m = json.loads((pkg / MANIFEST).read_text())
    for rel in rels:
        (pkg / rel).unlink()
        m["files"].pop(rel)
    (pkg / MANIFEST).write_text(json.dumps(m, indent=1))


def _one_error_line(r) -> str:
    """The refusal: exactly one `[error]` line, no traceback; returns it."""
    assert "Traceback" not in r.output, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("[error]")]
    assert len(errors) == 1, r.output
    return errors[0]


def _verdicts(pkg: Path, runner, monkeypatch) -> dict:
    """What register, ls, cache verify, check and serve say about ``pkg``: {command: (exit code,
    output)}; serve must answer before vLLM starts."""
    from ttbundle.cli import app

    out = {}
    r = runner.invoke(app, ["register", "--dir", str(pkg.parent)])
    out["register"] = (r.exit_code, r.output)
    monkeypatch.setenv("EXTRA_MODELS_DIR", str(pkg.parent))
    r = runner.invoke(app, ["ls", "--json"])
    doc = json.loads(r.stdout)
    out["ls"] = (len(doc["packages"]), " ".join(x["reason"] for x in doc["refused"]))
    r = runner.invoke(app, ["cache", "verify", str(pkg), "--hashes-only"])
    out["cache verify"] = (r.exit_code, r.output)
    r = runner.invoke(app, ["check", str(pkg), "--steps", "1"])
    out["check"] = (r.exit_code, r.output)
    t = time.monotonic()
    r = runner.invoke(app, ["serve", str(pkg), "--port", str(_free_port())])
    out["serve"] = (r.exit_code, r.output, time.monotonic() - t)
    return out


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_one_verdict(v: dict, pattern: str) -> None:
    """Every command refuses, for the reason ``pattern`` matches; serve in one line, quickly."""
    assert v["register"][0] == 1 and re.search(pattern, v["register"][1]), v["register"]
    assert v["ls"][0] == 0 and re.search(pattern, v["ls"][1]), v["ls"]
    for cmd in ("cache verify", "check"):
        assert v[cmd][0] == 1 and re.search(pattern, v[cmd][1]), (cmd, v[cmd])
        assert "Traceback" not in v[cmd][1]
    code, output, seconds = v["serve"]
    assert code == 1 and re.search(pattern, output), output
    assert "starting vLLM" not in output
    line = _one_error_line(type("R", (), {"output": output})())
    assert re.search(pattern, line)
    assert seconds < 1.0, f"serve took {seconds:.2f} s to refuse"


# ---- item 3: one verdict on a tampered adapter ---------------------------------------------------
def test_tampered_adapter_gets_one_verdict_everywhere(pkg, tmp_path, xdg, runner, monkeypatch, no_vllm):
    """The generated adapter with `os.system` added (re-hashed): register, ls, cache verify,
    check and serve all refuse it, with the same reason, and nothing of it runs; serve answers in
    one line before vLLM starts (it used to start vLLM and fail 48 s later, three tracebacks)."""
    marker = tmp_path / "ran"
    rel = _adapter(pkg)
    src = pkg / rel
    src.write_text(src.read_text() + f"\nimport os\nos.system('touch {marker}')\n")
    rehash(pkg, rel)
    with pytest.raises(PackageError, match=rf"{rel}: generated adapter rejected"):
        verify_package(pkg)
    with pytest.raises(PackageError, match=rf"{rel}: generated adapter rejected"):
        verify_package(pkg, full=False)  # the cheap verification (ls) vets it too
    _assert_one_verdict(_verdicts(pkg, runner, monkeypatch), rf"{re.escape(rel)}: generated adapter rejected")
    assert not marker.exists()


# ---- item 2: no remote code ---------------------------------------------------------------------------
def test_extra_python_file_is_refused(pkg, xdg, runner, monkeypatch, no_vllm):
    _add_file(pkg, "modeling_evil.py", b"import os\nos.system('id')\n")
    with pytest.raises(PackageError, match=r"modeling_evil.py: Python code that is not the package's adapter"):
        verify_package(pkg, full=False)
    _assert_one_verdict(_verdicts(pkg, runner, monkeypatch), r"modeling_evil.py: Python code")


@pytest.mark.parametrize("rel,where", [("config.json", "auto_map"), ("config.json", "text_config.auto_map"),
                                       ("tokenizer_config.json", "auto_map")])
def test_auto_map_is_refused(pkg, xdg, runner, monkeypatch, no_vllm, rel, where):
    """`auto_map` (Hugging Face's pointer to remote code) in config.json or tokenizer_config.json,
    re-hashed, with the .py it names listed too: refused wherever the package is verified."""
    def edit(doc):
        at = doc
        for k in where.split(".")[:-1]:
            at = at.setdefault(k, {})
        at["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    edit_json(pkg, rel, edit)
    with pytest.raises(PackageError, match=rf"{rel}: {re.escape(where)}: Hugging Face remote code"):
        verify_package(pkg)
    _assert_one_verdict(_verdicts(pkg, runner, monkeypatch), rf"{rel}: {re.escape(where)}: Hugging Face remote code")


@pytest.mark.parametrize("arg", ["--trust-remote-code", "--trust_remote_code", "--trust-remote-code=true",
                                 "--trust-remote_code", "--trust-remote", "--trust", "--trust_remote_code=1"])
def test_trust_remote_code_is_refused(built, runner, arg):
    from ttbundle.cli import app

    r = runner.invoke(app, ["serve", str(built), "--print-command", "--", "--max-num-seqs", "1", arg])
    assert r.exit_code == 2
    assert "never need remote code" in _one_error_line(r)


def test_trust_remote_code_in_a_vllm_config_file_is_refused(built, runner, tmp_path):
    from ttbundle.cli import app

    cfg = tmp_path / "args.yaml"
    cfg.write_text("max-num-seqs: 1\ntrust_remote_code: true\n")
    r = runner.invoke(app, ["serve", str(built), "--print-command", "--", "--config", str(cfg)])
    assert r.exit_code == 2 and "never need remote code" in _one_error_line(r)
    cfg.write_text("max-num-seqs: 1\ntrust-remote-code: false\n")
    r = runner.invoke(app, ["serve", str(built), "--print-command", "--", "--config", str(cfg)])
    assert r.exit_code == 0, r.output


def test_other_flags_pass(built, runner):
    from ttbundle.cli import app

    r = runner.invoke(app, ["serve", str(built), "--print-command", "--", "--no-trust-remote-code",
                            "--tokenizer-mode", "auto"])
    assert r.exit_code == 0, r.output
    assert "--no-trust-remote-code" in r.stdout


# ---- item 4: a tokenizer, or token ids only -------------------------------------------------------
def _ckpt_without_tokenizer(ckpt: Path, d: Path) -> Path:
    src = d / "weights-only"
    src.mkdir()
    for f in ckpt.iterdir():
        if f.name.endswith(".safetensors") or f.name in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, src / f.name)
    return src


def test_build_without_a_tokenizer_says_so(ckpt, tmp_path, runner):
    from ttbundle.cli import app

    src = _ckpt_without_tokenizer(ckpt, tmp_path)
    spec = write_spec(tmp_path, src)
    r = runner.invoke(app, ["build", str(spec), "--mesh", "N150", "-o", str(tmp_path / "out"), "--no-warmup"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    text = " ".join(r.output.split())
    assert "no tokenizer" in text and "tokenizer.json, tokenizer.model, vocab.json" in text
    assert str(src) in text and "tokenizer: false" in text
    assert not (tmp_path / "out" / "N150").exists()


def test_token_ids_only_package(ckpt, tmp_path, runner):
    """`tokenizer: false`: the build succeeds without tokenizer files, the package says so in its
    bundle.yaml, and serve runs vLLM with --skip-tokenizer-init."""
    from ttbundle.cli import app

    src = _ckpt_without_tokenizer(ckpt, tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(src, extra="tokenizer: false\n"))
    res = buildmod.build(specmod.load(spec), "N150", tmp_path / "out", warmup=False)
    pkg = Path(res.package)
    assert "\ntokenizer: false\n" in (pkg / "bundle.yaml").read_text()
    assert not has_tokenizer(json.loads((pkg / MANIFEST).read_text())["files"])
    r = runner.invoke(app, ["serve", str(pkg), "--print-command"])
    assert r.exit_code == 0, r.output
    assert "--skip-tokenizer-init" in r.stdout.split()


def test_serve_refuses_a_package_without_a_tokenizer(pkg, runner, no_vllm):
    from ttbundle.cli import app

    _drop_files(pkg, *[f for f in TOKENIZER_FILES if (pkg / f).exists()])
    t = time.monotonic()
    r = runner.invoke(app, ["serve", str(pkg), "--port", str(_free_port())])
    seconds = time.monotonic() - t
    assert r.exit_code == 2
    line = _one_error_line(r)
    assert "no tokenizer in the package" in line and "tokenizer: false" in line
    assert seconds < 1.0, f"{seconds:.2f} s"
    # a tokenizer given to vLLM explicitly is the operator's call
    r = runner.invoke(app, ["serve", str(pkg), "--print-command", "--", "--tokenizer", "/some/tokenizer"])
    assert r.exit_code == 0, r.output


# ---- item 9: a strict manifest ------------------------------------------------------------------------
def _manifest_text(pkg: Path) -> str:
    return (pkg / MANIFEST).read_text()


MUTATIONS = {
    # name: (edit of the parsed manifest, or of its text; what the error names)
    "duplicate key": (lambda t: t.replace('"bundle":', '"bundle": "other",\n "bundle":', 1), r"key 'bundle' appears twice"),
    "size as a string": (lambda m: m["files"]["config.json"].update(size=str(m["files"]["config.json"]["size"])),
                         r'field files\."config\.json"\.size: input should be a valid integer, got \'\d+\''),
    "size as a bool": (lambda m: m["files"]["README.md"].update(size=True), r'files\."README\.md"\.size: input should be a valid integer'),
    "negative size": (lambda m: m["files"]["README.md"].update(size=-1), r'files\."README\.md"\.size: input should be greater'),
    "unknown key": (lambda m: m.update(extra_code="x"), r"field extra_code: unknown key"),
    "unknown key in a file record": (lambda m: m["files"]["config.json"].update(mode=493),
                                     r'files\."config\.json"\.mode: unknown key'),
    "sha256 not hex": (lambda m: m["files"]["config.json"].update(sha256="z" * 64), r'files\."config\.json"\.sha256'),
    "mesh shape of strings": (lambda m: m["mesh"].update(shape=["1", "2"]), r"field mesh\.shape\.0"),
    "buckets missing": (lambda m: m.pop("buckets"), r"field buckets: missing"),
    "NaN": (lambda t: t.replace('"trace_region_bytes": ', '"trace_region_bytes": NaN, "x": ', 1), r"not readable JSON"),
    "not UTF-8": (lambda t: t.replace('"bundle"', '"bu\udcffndle"', 1), r"not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_manifest_is_read_strictly(pkg, runner, case):
    from ttbundle.cli import app

    edit, pattern = MUTATIONS[case]
    text = _manifest_text(pkg)
    if case in ("duplicate key", "NaN", "not UTF-8"):
        raw = edit(text).encode("utf-8", "surrogateescape")
    else:
        m = json.loads(text)
        edit(m)
        raw = json.dumps(m, indent=1).encode()
    (pkg / MANIFEST).write_bytes(raw)
    with pytest.raises(PackageError, match=r"manifest\.json: .*" + pattern) as e:
        read_manifest(pkg)
    assert str(pkg / MANIFEST) in str(e.value)
    r = runner.invoke(app, ["cache", "verify", str(pkg), "--hashes-only"])
    assert r.exit_code == 1
    assert re.search(pattern, _one_error_line(r)), r.output


def test_an_oversized_manifest_is_not_read(pkg, runner):
    """100 MB (sparse; an unknown key at its start): refused by its size, before it is read."""
    from ttbundle.cli import app

    p = pkg / MANIFEST
    m = json.loads(p.read_text())
    m["padding"] = "x"
    p.write_text(json.dumps(m))
    os.truncate(p, 100 << 20)
    t = time.monotonic()
    with pytest.raises(PackageError, match=r"manifest\.json: 104,857,600 B, over the 67,108,864 B"):
        read_manifest(pkg)
    assert time.monotonic() - t < 0.5
    r = runner.invoke(app, ["register", "--dir", str(pkg)])
    assert r.exit_code == 1 and "104,857,600 B" in r.output and "Traceback" not in r.output


def test_every_manifest_a_build_writes_reads_back(built):
    """The model accepts what `build` writes (one line per key: ttbundle/manifest.py)."""
    from ttbundle import manifest as manifest_schema

    m = json.loads(_manifest_text(built))
    assert manifest_schema.problem(m, "m") is None
    assert set(m) <= set(manifest_schema.Manifest.model_fields)


# ---- item 8: a read-only output directory ------------------------------------------------------------
def _unshare_ro(out: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` with ``out`` bind-mounted read-only over itself in a private mount namespace
    (writes there fail with EROFS, as on a read-only file system, for root too)."""
    script = ('mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" || exit 97; '
              'touch "$0/.probe" 2>/dev/null && exit 98; exec "$@"')
    return subprocess.run(["unshare", "-m", "sh", "-c", script, str(out), *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(CODE)})


def test_read_only_output_with_an_up_to_date_package(ckpt, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    spec = write_spec(tmp_path, ckpt, tokenizer=ckpt)
    out = tmp_path / "out"
    buildmod.build(specmod.load(spec), "N150", out, warmup=False)
    cli = [sys.executable, "-c", "from ttbundle.cli import main; main()"]
    r = _unshare_ro(out, cli + ["build", str(spec), "--mesh", "N150", "-o", str(out), "--no-warmup"])
    if r.returncode in (97, 98):
        pytest.skip(f"cannot make a read-only bind mount here (unshare -m: {r.stderr.strip()[:200]})")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"N150 +│ up-to-date", r.stdout), r.stdout
    r = _unshare_ro(out, cli + ["build", str(spec), "--mesh", "N150", "-o", str(out), "--no-warmup", "--force"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Read-only file system; choose a writable -o" in " ".join(r.stderr.split())
    assert "Traceback" not in r.stderr


# ---- item 11: what --api-key covers ---------------------------------------------------------------------
def test_runtime_docs_name_the_prefixes_api_key_guards():
    """docs/runtime.md lists the path prefixes vLLM's --api-key middleware guards, as vLLM 0.33's
    source has them, and the routes outside them that it names exist in vLLM."""
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX

    doc = (ROOT / "docs" / "runtime.md").read_text()
    section = doc.split("### `--api-key`", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    listed = re.search(r"guards paths starting with ([^.]*)\.", " ".join(section.split())).group(1)
    assert sorted(re.findall(r"`(/[a-z0-9_]+)`", listed)) == sorted(GUARDED_PREFIX)
    vllm_src = Path(sys.modules["vllm"].__file__).parent / "entrypoints"
    routes = " ".join(p.read_text() for p in vllm_src.rglob("api_router.py")) + \
        (vllm_src / "serve" / "instrumentator" / "metrics.py").read_text()
    for route in re.findall(r"`(/[a-z_]+)`", section.split("guards paths starting with", 1)[1]):
        if route.startswith(tuple(GUARDED_PREFIX)):
            continue
        assert f'"{route}"' in routes, route
    assert "127.0.0.1" in section


def test_init_says_when_there_is_no_tokenizer(tmp_path, runner):
    from transformers import LlamaConfig

    from ttbundle.cli import app

    hf = tmp_path / "hf"
    LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=256, intermediate_size=512,
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=512).save_pretrained(hf)
    r = runner.invoke(app, ["init", "--from-hf", str(hf), "-o", str(tmp_path / "s.yaml")])
    assert r.exit_code == 0, r.output
    assert "note: no tokenizer in" in r.output and "tokenizer: false" in " ".join(r.output.split())
    (hf / "tokenizer_config.json").write_text("{}")  # configures a tokenizer; is none
    r = runner.invoke(app, ["init", "--from-hf", str(hf), "-o", str(tmp_path / "s.yaml"), "--force"])
    assert "note: no tokenizer in" in r.output
