"""Models as people hold them (issue 21): a plain directory, a Hugging Face hub-cache snapshot
(every file a symlink into ``../../blobs``), a model id ``ORG/NAME[@REVISION]`` resolved in
huggingface_hub's cache, and fp16 checkpoints, through `init`, `validate`, `build` and `check`.

The hub cache here is built by hand with huggingface_hub's real layout and then checked by
huggingface_hub itself (``scan_cache_dir``, ``snapshot_download(local_files_only=True)``,
``try_to_load_from_cache``): the independent reference that the layout is the real one and that
ttbundle resolves a model id to the same snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ttbundle import hub, spec as specmod

from test_build import ARCH, make_tokenizer, spec_text as tiny_spec

ROOT = Path(__file__).resolve().parent.parent
REPO = "Acme/Tiny-Llama-7B-Instruct"
NAME = "tiny-llama-7b-instruct"  # what init names the bundle: the model's name, lower-cased
COMMIT = hashlib.sha1(b"tiny llama, first commit").hexdigest()  # a 40-hex commit hash, as refs hold
INIT = ["--max-model-len", "256", "--max-num-seqs", "8"]


# ---- checkpoints and a hub cache ------------------------------------------------------------------
def save_checkpoint(d: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A random model of test_build's tiny Llama saved as a published checkpoint would be
    (config.json, generation_config.json, model.safetensors in ``dtype``) with a tokenizer."""
    import torch

    from ttbundle import reference
    b = specmod.loads(tiny_spec(), "arch.yaml")
    model = reference.random_model(b, seed).to(getattr(torch, dtype))
    model.save_pretrained(str(d))
    make_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def ckpt_bf16(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("bf16"))


@pytest.fixture(scope="session")
def ckpt_fp16(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("fp16"), "float16", seed=1)


def put_in_cache(cache: Path, repo_id: str, src: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """``src``'s files stored as huggingface_hub stores a download: ``blobs/<content hash>``,
    ``snapshots/<commit>/<file>`` a relative symlink to ``../../blobs/<hash>``, ``refs/<ref>``
    holding the commit. Returns the snapshot directory."""
    from huggingface_hub.file_download import repo_folder_name
    folder = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snap = folder / "snapshots" / commit
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache named by HF_HUB_CACHE, offline (HF_HUB_OFFLINE=1). huggingface_hub reads
    both into ``huggingface_hub.constants`` once, when first imported, and reads those constants
    afterwards (vLLM too); this process imported it long before the test, so the constants are
    set along with the environment. ``test_a_fresh_process_honours_the_environment`` covers the
    environment alone."""
    import huggingface_hub.constants as hc
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    return cache


def _cli(runner, *args, cwd: Path | None = None):
    from ttbundle.cli import app
    old = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        r = runner.invoke(app, [str(a) for a in args])
    finally:
        os.chdir(old)
    assert "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), (r.output, repr(r.exception))
    return r


def _spec(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# ---- the layout and the resolver ----------------------------------------------------------------------
def test_the_fake_cache_is_huggingface_hubs_layout_and_ids_resolve_as_it_resolves_them(tmp_path, hf_cache, ckpt_bf16):
    from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache
    snap = put_in_cache(hf_cache, REPO, ckpt_bf16)
    info = scan_cache_dir(hf_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and [r.commit_hash for r in repo.revisions] == [COMMIT]
    assert next(iter(repo.revisions)).refs == frozenset({"main"})
    want = Path(snapshot_download(REPO, local_files_only=True, cache_dir=hf_cache))
    assert want == snap.resolve()
    assert Path(try_to_load_from_cache(REPO, "config.json", cache_dir=hf_cache)) == snap / "config.json"
    # ttbundle asks huggingface_hub the same question, with the cache from HF_HUB_CACHE
    for text in (REPO, f"{REPO}@main", f"{REPO}@{COMMIT}"):
        src = hub.resolve(text, tmp_path)
        assert src.path == want and src.model == (REPO, text.partition("@")[2] or None), text
    s = hub.snapshot_of(snap)
    assert (s.repo_id, s.folder, s.path, s.name) == (REPO, snap.parent.parent, snap, "Tiny-Llama-7B-Instruct")
    assert hub.snapshot_of(ckpt_bf16) is None


@pytest.mark.parametrize("text, parsed", [
    ("Acme/Tiny", ("Acme/Tiny", None)), ("Acme/Tiny@v1.0", ("Acme/Tiny", "v1.0")),
    ("Acme/Tiny@refs/pr/1", ("Acme/Tiny", "refs/pr/1")), ("bundles/foo", ("bundles/foo", None)),
    ("/abs/path", None), ("./Acme/Tiny", None), ("../x/y", None), ("a/b/c", None), ("Acme", None),
    ("Acme/Tiny@", None), ("Acme/Tiny@../../etc", None), ("Acme/..", None),
])
def test_what_is_written_as_a_model_id(text, parsed):
    assert hub.model_id(text) == parsed


def test_a_path_that_exists_is_a_path_even_when_it_reads_as_a_model_id(tmp_path, hf_cache, ckpt_bf16):
    put_in_cache(hf_cache, REPO, ckpt_bf16)
    local = tmp_path / REPO  # ./Acme/Tiny-Llama-7B-Instruct, a different model
    local.parent.mkdir()
    save_checkpoint(local, seed=5)
    assert hub.resolve(REPO, tmp_path).path == local and hub.resolve(REPO, tmp_path).model is None


# ---- init --------------------------------------------------------------------------------------------
def test_init_from_a_hub_cache_snapshot(tmp_path, hf_cache, ckpt_bf16, runner):
    snap = put_in_cache(hf_cache, REPO, ckpt_bf16)
    out = tmp_path / "specs" / "s.yaml"
    r = _cli(runner, "init", "--from-hf", snap, "-o", out, *INIT)
    assert r.exit_code == 0, r.output
    d = _spec(out)
    assert d["name"] == NAME and d["hf_model"] == REPO  # named after the model, not the commit hash
    assert (out.parent / d["weights"]["source"]).resolve() == snap.resolve()
    assert (out.parent / d["tokenizer"]).resolve() == snap.resolve()
    b = specmod.load(out)
    assert b.arch.hidden_size == 256 and b.resolve_path(b.spec.weights.source).resolve() == snap.resolve()


@pytest.mark.parametrize("rev", [None, "main", COMMIT])
def test_init_from_a_model_id(tmp_path, hf_cache, ckpt_bf16, runner, rev):
    snap = put_in_cache(hf_cache, REPO, ckpt_bf16)
    text = REPO + (f"@{rev}" if rev else "")
    out = tmp_path / "s.yaml"
    r = _cli(runner, "init", "--from-hf", text, "-o", out, *INIT, cwd=tmp_path)
    assert r.exit_code == 0, r.output
    d = _spec(out)
    # the id is written as given: the spec works wherever that model is in the cache
    assert d["weights"]["source"] == text and d["tokenizer"] == text
    assert d["name"] == NAME and d["hf_model"] == REPO
    b = specmod.load(out)
    assert b.resolve_path(b.spec.weights.source) == snap.resolve()
    assert b.resolve_path(b.spec.tokenizer) == snap.resolve()


def test_init_prefers_an_existing_directory_to_the_cache(tmp_path, hf_cache, ckpt_bf16, runner):
    put_in_cache(hf_cache, REPO, ckpt_bf16)
    from transformers import LlamaConfig
    local = tmp_path / REPO
    cfg = json.loads((ckpt_bf16 / "config.json").read_text())
    LlamaConfig(**{**cfg, "num_hidden_layers": 3}).save_pretrained(local)
    out = tmp_path / "s.yaml"
    r = _cli(runner, "init", "--from-hf", REPO, "-o", out, *INIT, cwd=tmp_path)
    assert r.exit_code == 0, r.output
    assert specmod.load(out).arch.num_hidden_layers == 3  # ./Acme/..., not the cached model (2 layers)


def test_a_model_id_not_in_the_cache_offline_is_exit_2(tmp_path, hf_cache, runner):
    out = tmp_path / "s.yaml"
    r = _cli(runner, "init", "--from-hf", "Acme/Missing@v2", "-o", out, cwd=tmp_path)
    assert r.exit_code == 2, r.output
    msg = " ".join(r.output.split())
    assert "Acme/Missing@v2" in msg and str(hf_cache) in msg and "HF_HUB_OFFLINE" in msg, msg
    assert "hf download Acme/Missing --revision v2" in msg and "HF_HUB_CACHE" in msg, msg
    assert not out.exists()
    # a relative path that does not exist and reads as an id: both readings are named
    r = _cli(runner, "init", "--from-hf", "bundles/foo", "-o", out, cwd=tmp_path)
    assert r.exit_code == 2 and "no directory bundles/foo" in " ".join(r.output.split()), r.output


def test_validate_a_spec_naming_a_model_id_not_in_the_cache(tmp_path, hf_cache, runner, monkeypatch):
    text = tiny_spec(Path("Acme/Missing"), Path("Acme/Missing"))
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    line = text.splitlines().index("  source: Acme/Missing") + 1
    r = _cli(runner, "validate", p)
    assert r.exit_code == 2, r.output
    assert f"spec.yaml:{line}:3: weights.source: Acme/Missing: no directory" in r.output and "HF_HUB_OFFLINE" in r.output
    # online, validate does not download: a warning that the build will
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    r = _cli(runner, "validate", p)
    assert r.exit_code == 0, r.output
    assert "weights.source" in r.output and "`ttbundle build` or `check` will" in " ".join(r.output.split())


def test_a_fresh_process_honours_the_environment(tmp_path, ckpt_bf16):
    """`ttbundle init ORG/NAME` in a new process: HF_HOME alone names the cache (``HF_HOME/hub``)
    and HF_HUB_OFFLINE=1 keeps it offline, read by huggingface_hub as it is imported."""
    home = tmp_path / "home"
    snap = put_in_cache(home / "hub", REPO, ckpt_bf16)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "s.yaml"
    cmd = [sys.executable, "-m", "ttbundle.cli", "init", "--from-hf", REPO, "-o", str(out), *INIT]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _spec(out)["name"] == NAME
    code = "from ttbundle import spec; b = spec.load('s.yaml'); print(b.resolve_path(b.spec.weights.source))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and Path(r.stdout.strip()) == snap.resolve(), r.stderr
    env["HF_HOME"] = str(tmp_path / "elsewhere")
    r = subprocess.run(cmd + ["--force"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 2 and str(tmp_path / "elsewhere" / "hub") in " ".join(r.stderr.split()), r.stderr


# ---- symlinks out of a snapshot ------------------------------------------------------------------------
def _relink(link: Path, target: Path) -> None:
    link.unlink()
    link.symlink_to(os.path.relpath(target, link.parent))


@pytest.mark.parametrize("to", ["outside", "other-repo"])
def test_a_snapshot_file_linking_out_of_its_repo_folder_is_refused(tmp_path, hf_cache, ckpt_bf16, runner, to):
    snap = put_in_cache(hf_cache, REPO, ckpt_bf16)
    if to == "outside":  # e.g. /etc/passwd: anywhere outside models--Acme--...
        target = tmp_path / "secret.json"
        target.write_text((ckpt_bf16 / "config.json").read_text())
    else:  # another repo's blob in the same cache
        other = put_in_cache(hf_cache, "Evil/Other", ckpt_bf16)
        target = (other / "config.json").resolve()
    _relink(snap / "config.json", target)
    out = tmp_path / "s.yaml"
    r = _cli(runner, "init", "--from-hf", snap, "-o", out)
    assert r.exit_code == 2, r.output
    msg = " ".join(r.output.split())
    assert f"{snap / 'config.json'}" in msg and "outside its hub-cache folder" in msg, msg
    assert "models--Acme--Tiny-Llama-7B-Instruct" in msg and not out.exists()


@pytest.mark.parametrize("victim", ["model.safetensors", "generation_config.json"])
def test_a_checkpoint_or_tokenizer_file_linking_out_is_refused_at_build(tmp_path, hf_cache, ckpt_bf16, runner, victim):
    snap = put_in_cache(hf_cache, REPO, ckpt_bf16)
    out = tmp_path / "s.yaml"
    assert _cli(runner, "init", "--from-hf", REPO, "-o", out, *INIT, cwd=tmp_path).exit_code == 0
    stray = tmp_path / f"stray-{victim}"
    stray.write_bytes((snap / victim).read_bytes())
    _relink(snap / victim, stray)
    r = _cli(runner, "build", out, "-o", tmp_path / "pkgs", "--no-warmup")
    assert r.exit_code == 2, r.output
    msg = " ".join(r.output.split())
    assert victim in msg and "outside its hub-cache folder" in msg, msg
    assert not (tmp_path / "pkgs" / "N150" / NAME).exists()


# ---- build and check -------------------------------------------------------------------------------------
def _check_json(runner, target, *extra) -> dict:
    r = _cli(runner, "check", target, "--steps", "4", "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{"):])


@pytest.fixture(scope="session")
def ckpt_sharded(tmp_path_factory, ckpt_bf16) -> Path:
    """``ckpt_bf16`` re-saved as 3+ shards with ``model.safetensors.index.json``."""
    import shutil

    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(str(ckpt_bf16)).save_pretrained(str(d), max_shard_size="400KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt_bf16 / f, d / f)
    return d


@pytest.mark.parametrize("form", ["model id", "sharded snapshot"])
def test_build_and_check_a_model_id_or_snapshot_spec_and_its_recorded_snapshot(
        tmp_path, hf_cache, ckpt_bf16, ckpt_sharded, runner, form):
    from ttbundle import cache
    src = ckpt_sharded if form == "sharded snapshot" else ckpt_bf16
    snap = put_in_cache(hf_cache, REPO, src)
    if form == "sharded snapshot":
        assert (snap / "model.safetensors.index.json").is_symlink() and len(list(snap.glob("*.safetensors"))) > 2
    spec = tmp_path / "s.yaml"
    model = REPO if form == "model id" else snap
    assert _cli(runner, "init", "--from-hf", model, "-o", spec, *INIT, cwd=tmp_path).exit_code == 0
    rep = _check_json(runner, spec)  # built into a temporary package, run against transformers
    assert rep["passed"] and rep["executor"]["tokens_agree"], rep["failure"]
    r = _cli(runner, "build", spec, "-o", tmp_path / "pkgs", "--no-warmup")
    assert r.exit_code == 0, r.output
    pkg = tmp_path / "pkgs" / "N150" / NAME
    man = json.loads((pkg / "manifest.json").read_text())
    recs = man["sources"]["weights"]
    assert {r["dir"] for r in recs} == {str(snap.resolve())}  # the snapshot path is recorded
    for rec in recs:  # and the digests are the blobs' (what the links point at)
        blob = (snap / rec["name"]).resolve()
        assert blob.parent.name == "blobs" and rec["blake3"] == cache.blake3_file(blob)
    toks = {r["name"] for r in man["sources"]["tokenizer"]}
    assert {"tokenizer.json", "generation_config.json"} <= toks
    assert (pkg / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    rep = _check_json(runner, pkg)  # the package's recorded checkpoint: the snapshot
    assert rep["passed"] and rep["executor"]["tokens_agree"], rep["failure"]
    rep = _check_json(runner, pkg, "--reference", f"{REPO}@{COMMIT}")  # the same, named by id
    assert rep["passed"] and rep["executor"]["tokens_agree"], rep["failure"]


def test_an_fp16_checkpoint_is_stored_as_its_values_rounded_to_bf16_and_checks(tmp_path, ckpt_fp16, runner):
    import torch
    from safetensors.torch import load_file

    from ttbundle import reference
    from ttbundle.package.load import load_package
    hf16 = load_file(str(ckpt_fp16 / "model.safetensors"))
    assert {t.dtype for t in hf16.values()} == {torch.float16}
    spec = tmp_path / "s.yaml"
    r = _cli(runner, "init", "--from-hf", ckpt_fp16, "-o", spec, "--weights-dtype", "bf16", *INIT)
    assert r.exit_code == 0, r.output
    r = _cli(runner, "build", spec, "--mesh", "N150", "-o", tmp_path / "pkgs", "--no-warmup")
    assert r.exit_code == 0, r.output
    pkg = tmp_path / "pkgs" / "N150" / spec_name(spec)
    held = load_package(pkg).weights.canonical(torch.float32)
    # what the package holds: each fp16 value rounded to the nearest bf16 (not bit-copied)
    emb = hf16["model.embed_tokens.weight"]
    assert torch.equal(held["embed"], emb.to(torch.bfloat16).float())
    assert not torch.equal(emb.to(torch.bfloat16).float(), emb.float())  # the rounding is real
    q0 = hf16["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(held["wq"][0], q0.to(torch.bfloat16).float().T)
    # check's reference holds exactly those values
    hf = reference.load_model(ckpt_fp16)
    reference.round_to_bf16(hf)
    assert torch.equal(hf.model.embed_tokens.weight, held["embed"])
    assert torch.equal(hf.model.layers[0].self_attn.q_proj.weight.T, held["wq"][0])
    rep = _check_json(runner, pkg)
    assert rep["passed"] and rep["executor"]["tokens_agree"], rep["failure"]


def spec_name(spec: Path) -> str:
    return _spec(spec)["name"]
