"""`ttbundle register --dir` / `ttbundle ls` and the registry vLLM reads at start: tampered or
incompatible packages are refused naming the file; the good ones still register."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from ttbundle.runtime import registry


@pytest.fixture
def repo(tmp_path, make_package):
    """OUT/<mesh>/<bundle> with two good packages (llama on N150 and T3K)."""
    out = tmp_path / "out"
    for mesh in ("N150", "T3K"):
        pkg, _ = make_package("llama", mesh)
        shutil.copytree(pkg, out / mesh / pkg.name)
    return out


def _tamper(pkg, rel="config.json"):
    p = pkg / rel
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the hash can tell
    p.write_bytes(bytes(data))
    return p


def test_register_records_the_directory_and_ls_lists_packages(repo, xdg, runner):
    from ttbundle.cli import app

    r = runner.invoke(app, ["register", "--dir", str(repo)])
    assert r.exit_code == 0, r.output
    assert f"registered tiny-llama-N150 (LlamaForCausalLM) {repo / 'N150' / 'tiny-llama'}" in r.output
    assert f"registered tiny-llama-T3K (LlamaForCausalLM) {repo / 'T3K' / 'tiny-llama'}" in r.output
    assert json.loads((xdg / "ttbundle" / "registry.json").read_text())["dirs"] == [str(repo.resolve())]
    r = runner.invoke(app, ["ls", "--json"])
    assert r.exit_code == 0, r.output
    got = {(p["name"], p["mesh"]): p for p in json.loads(r.output)["packages"]}
    assert set(got) == {("tiny-llama", "N150"), ("tiny-llama", "T3K")}
    assert got[("tiny-llama", "T3K")]["prefill"] == [32, 64, 128]
    assert got[("tiny-llama", "T3K")]["decode"] == [1, 2, 4, 8, 16, 32]
    r = runner.invoke(app, ["ls"])
    assert "tiny-llama" in r.output and "32 64 128" in r.output
    assert registry.find("tiny-llama-T3K").mesh == "T3K"
    with pytest.raises(Exception, match="names 2 packages"):
        registry.find("tiny-llama")


def test_mesh_device_picks_among_meshes(repo, xdg, monkeypatch):
    registry.register_dir(repo)
    monkeypatch.setenv("MESH_DEVICE", "T3K")
    assert registry.find("tiny-llama").mesh == "T3K"
    # Tenstorrent's tuple form names the preset of that shape and chip
    monkeypatch.setenv("MESH_DEVICE", "(1,8)")
    assert registry.find("tiny-llama").mesh == "T3K"
    monkeypatch.setenv("MESH_DEVICE", "(1,1)")
    assert registry.find("tiny-llama").mesh == "N150"


def test_tampered_package_refused_naming_the_file_others_register(repo, xdg, runner):
    from ttbundle.cli import app

    bad = _tamper(repo / "T3K" / "tiny-llama", "weights/device-000.safetensors")
    r = runner.invoke(app, ["register", "--dir", str(repo)])
    assert r.exit_code == 0, r.output
    assert "registered tiny-llama-N150" in r.output
    assert "registered tiny-llama-T3K" not in r.output
    assert "refused" in r.output and "weights/device-000.safetensors: sha256 mismatch" in r.output
    assert f"refused {bad.parent.parent}: weights/device-000.safetensors: sha256 mismatch" in r.output
    good, refused = registry.scan()
    assert [(e.name, e.mesh) for e in good] == [("tiny-llama", "N150")]


def test_incompatible_or_foreign_packages_are_refused(repo, xdg):
    pkg = repo / "N150" / "tiny-llama"
    m = json.loads((pkg / "manifest.json").read_text())
    m["format"] = "ttbundle.package/99"
    (pkg / "manifest.json").write_text(json.dumps(m))
    other = repo / "T3K" / "tiny-llama"  # built by a newer ttbundle
    m = json.loads((other / "manifest.json").read_text())
    m["versions"]["ttbundle"] = "9.1.0"
    (other / "manifest.json").write_text(json.dumps(m))
    shutil.copytree(other, repo / "T3K" / "tiny-llama-old")
    foreign = repo / "N150" / "tt-style"  # Tenstorrent's own layout: metadata, no manifest
    foreign.mkdir()
    (foreign / "vllm_metadata.json").write_text('{"arch": "LlamaForCausalLM", "main_class": "m:C"}')
    m["versions"]["ttbundle"] = "0.1.0"
    (repo / "T3K" / "tiny-llama-old" / "manifest.json").write_text(json.dumps(m))
    good, refused = registry.register_dir(repo)
    assert [(e.path.name, e.mesh) for e in good] == [("tiny-llama-old", "T3K")]
    why = dict((f"{p.parent.name}/{p.name}", w) for p, w in refused)
    assert "manifest.json: not a ttbundle.package/4 manifest" in why["N150/tiny-llama"]
    assert "built by ttbundle 9.1.0, this is ttbundle 0.1.0" in why["T3K/tiny-llama"]
    assert "not a ttbundle package (no manifest.json)" in why["N150/tt-style"]


def test_nothing_registered_is_an_error(tmp_path, xdg, runner):
    from ttbundle.cli import app

    r = runner.invoke(app, ["register", "--dir", str(tmp_path)])
    assert r.exit_code == 2 and "no packages found" in r.output
    assert not (xdg / "ttbundle" / "registry.json").exists()


def test_vllm_start_registers_good_packages_and_warns_about_bad(repo, xdg, monkeypatch):
    """The general plugin: every family's TT<arch>, the packages of registered directories and
    EXTRA_MODELS_DIR, a warning naming each refused package."""
    from vllm import ModelRegistry

    _tamper(repo / "T3K" / "tiny-llama")
    monkeypatch.setenv("EXTRA_MODELS_DIR", str(repo / "T3K"))
    registry.register_dir(repo / "N150")
    monkeypatch.delenv(registry.VERIFIED_ENV, raising=False)
    seen = []
    h = logging.Handler()
    h.emit = lambda rec: seen.append(rec.getMessage())
    log = logging.getLogger("vllm.ttbundle.registry")
    log.addHandler(h)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        registry.register_models()
    finally:
        log.removeHandler(h)
        log.setLevel(level)
    assert {"TTLlamaForCausalLM", "TTQwen3ForCausalLM", "TTGemma3ForCausalLM"} <= set(
        ModelRegistry.get_supported_archs())
    assert any("skipping package" in m and "config.json: sha256 mismatch" in m for m in seen), seen
    assert any("registered 1 package(s): tiny-llama-N150" in m for m in seen), seen


# ---- what register recorded: each package's manifest digest (issue 43) -----------------------------
def test_serve_by_name_refuses_a_package_changed_and_re_hashed_since_register(repo, xdg, runner):
    """A weight changed and its manifest entry re-hashed passes every hash check (`cache verify`,
    serving the directory), but it is not the package that was registered: serving it by name is
    refused until it is registered again."""
    from pkg_mutations import rehash
    from ttbundle.cli import app
    from ttbundle.errors import TTBundleError
    from ttbundle.runtime.packages import open_package
    from ttbundle.serving import serve as servemod

    registry.register_dir(repo)
    pkg = repo / "N150" / "tiny-llama"
    rel = "weights/device-000.safetensors"
    _tamper(pkg, rel)
    rehash(pkg, rel)
    open_package(pkg, check_hashes=True)  # every hash matches its (re-written) manifest
    with pytest.raises(TTBundleError, match="changed since it was registered") as ei:
        registry.find("tiny-llama-N150")
    assert "re-register after a rebuild" in str(ei.value) and f"ttbundle register --dir {repo}" in str(ei.value)
    assert registry.find("tiny-llama-T3K").mesh == "T3K"  # the other package is untouched
    r = runner.invoke(app, ["serve", "tiny-llama-N150", "--print-command"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"registered package tiny-llama-N150 ({pkg}) is refused: manifest.json changed" in r.output
    r = runner.invoke(app, ["ls", "--json"])
    doc = json.loads(r.stdout)
    assert [(p["name"], p["mesh"]) for p in doc["packages"]] == [("tiny-llama", "T3K")]
    assert [x["path"] for x in doc["refused"]] == [str(pkg)]
    # the directory itself is trusted as it is (`check` is the numeric proof)
    assert servemod.resolve(str(pkg)) == pkg
    r = runner.invoke(app, ["register", "--dir", str(repo)])
    assert r.exit_code == 0 and "registered tiny-llama-N150" in r.output
    assert registry.find("tiny-llama-N150").path == pkg


def test_a_package_that_appeared_after_register_or_an_old_registry_is_not_registered(repo, xdg, runner):
    from ttbundle.cli import app

    registry.register_dir(repo)
    shutil.copytree(repo / "T3K" / "tiny-llama", repo / "T3K" / "later")
    bad = dict(registry.scan()[1])
    assert "not registered" in bad[repo / "T3K" / "later"] and f"ttbundle register --dir {repo}" in \
        bad[repo / "T3K" / "later"]
    # a registry written before digests were recorded: nothing is served by name until registered
    registry.registry_file().write_text(json.dumps({"dirs": [str(repo)]}))
    good, bad = registry.scan()
    assert good == [] and len(bad) == 3 and all("not registered" in w for _, w in bad)
    r = runner.invoke(app, ["serve", "tiny-llama-N150", "--print-command"])
    assert r.exit_code == 1 and "is refused: not registered" in r.output, r.output
    registry.register_dir(repo)
    assert len(registry.scan()[0]) == 3


def test_serve_name_of_a_registered_package_that_no_longer_verifies_names_the_file(repo, xdg, runner):
    """Was: "no registered package named 'tiny-llama-N150' (registered: none ...)"."""
    from ttbundle.cli import app

    registry.register_dir(repo)
    _tamper(repo / "N150" / "tiny-llama", "weights/device-000.safetensors")
    r = runner.invoke(app, ["serve", "tiny-llama-N150", "--print-command"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "tiny-llama-N150" in r.output and "weights/device-000.safetensors: sha256 mismatch" in r.output
    assert "no registered package" not in r.output
    r = runner.invoke(app, ["serve", "tiny-llama", "--mesh", "N150", "--print-command"])
    assert r.exit_code == 1 and "sha256 mismatch" in r.output, r.output


# ---- a corrupt registry file (issue 23) --------------------------------------------------------------
@pytest.mark.parametrize("text, says", [
    ('{"dirs": [5]}', "dirs.0"),
    ('{"dirs": "abc"}', "field dirs"),
    ('{"dirs": [], "dirs": ["/x"]}', "'dirs' appears twice"),
    ('{"dirs": [], "extra": 1}', "field extra"),
    ('["/x"]', "registry field"),
    ('{"dirs": ["relative/dir"]}', "not an absolute path"),
    ('{"dirs": [], "manifests": {"relative": "' + "0" * 64 + '"}}', "not an absolute path"),
    ('{"dirs": [], "manifests": {"/x": "abc"}}', "not a sha256"),
    ('{"dirs": [], "manifests": {"/x": 5}}', "manifests./x"),
    ('{"dirs": [], "manifests": ["/x"]}', "field manifests"),
    ('{"dirs": [NaN]}', "not readable JSON"),
    ('{"dirs": [', "not readable JSON"),
])
@pytest.mark.parametrize("cmd", [["ls"], ["register", "--dir", "."]])
def test_a_corrupt_registry_is_exit_2_naming_the_file_and_field(xdg, runner, text, says, cmd, repo):
    from ttbundle.cli import app

    f = xdg / "ttbundle" / "registry.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    r = runner.invoke(app, cmd if cmd[0] == "ls" else ["register", "--dir", str(repo)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and str(f) in r.output and says in r.output


def test_the_plugin_ignores_a_corrupt_registry_and_still_finds_extra_models_dir(xdg, repo, monkeypatch, caplog):
    f = xdg / "ttbundle" / "registry.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text('{"dirs": [5]}')
    monkeypatch.setenv("EXTRA_MODELS_DIR", str(repo))
    with pytest.raises(Exception, match="dirs.0"):
        registry.scan()
    with caplog.at_level(logging.WARNING):
        good, _ = registry.scan(strict=False)
    assert {(e.name, e.mesh) for e in good} == {("tiny-llama", "N150"), ("tiny-llama", "T3K")}
    assert "ignoring the registry" in caplog.text


def test_registry_fuzz_never_crashes():
    from hypothesis import given, settings, strategies as st

    from ttbundle.errors import InvalidInput

    leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    value = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                         max_leaves=8)
    doc = st.dictionaries(st.sampled_from(["dirs", "x"]), value, max_size=2) | value

    @settings(max_examples=200, deadline=None)
    @given(doc)
    def one(d):
        try:
            dirs = registry.parse_registry(json.dumps(d), "registry.json")
        except InvalidInput:
            return
        # accepted only as the one shape: a list of absolute paths
        assert isinstance(d, dict) and set(d) <= {"dirs"} and all(isinstance(x, str) and x.startswith("/")
                                                                 for x in d.get("dirs", []))
        assert dirs == [Path(x) for x in d.get("dirs", [])]
    one()
