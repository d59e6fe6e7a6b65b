"""The package format: verification catches any changed byte, names refuse to escape, generated
code is data-only whatever the spec says."""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from ttbundle import build as buildmod, spec as specmod
from ttbundle.package.load import load_package
from ttbundle.package.names import PackageError, identifier, mesh_slug, module_name, package_path
from ttbundle.package.templates import check_adapter_source, code, md, pyrepr, render_adapter, size
from ttbundle.package.verify import load_adapter, read_manifest, verify_package
from ttbundle.errors import InvalidInput, TTBundleError

from test_build import write_spec, ckpt  # noqa: F401  (session fixture)


@pytest.fixture(scope="module")
def built(tmp_path_factory, ckpt):  # noqa: F811
    d = tmp_path_factory.mktemp("pkg")
    bundle = specmod.load(write_spec(d, ckpt, tokenizer=ckpt))
    res = buildmod.build(bundle, "N300", d / "out", warmup=False)
    return Path(res.package)


@pytest.fixture
def pkg(built, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(built, dst)
    return dst


def test_verify_accepts_the_built_package(pkg):
    m = verify_package(pkg)
    assert len(m["files"]) >= 12


@pytest.mark.parametrize("rel", ["weights/device-001.safetensors", "programs/decode-8.json", "config.json",
                                 "vllm_metadata.json", "README.md", "tokenizer.json"])
def test_a_flipped_byte_is_caught_and_named(pkg, rel):
    p = pkg / rel
    data = bytearray(p.read_bytes())
    i = len(data) // 2
    data[i] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(PackageError, match=rf"{rel}: sha256 mismatch"):
        verify_package(pkg)
    # the quick check (sizes only) hashes nothing; it reads only the files it vets for code (the
    # adapter, the top-level JSON files: no auto_map), so it refuses a flip only where that file
    # no longer parses, naming it
    try:
        verify_package(pkg, full=False)
    except PackageError as e:
        assert "/" not in rel and rel.endswith(".json") and f"{rel}: not readable JSON" in str(e)


def test_missing_truncated_and_extra_files(pkg):
    (pkg / "programs/prefill-64.json").unlink()
    with pytest.raises(PackageError, match="programs/prefill-64.json: missing"):
        verify_package(pkg)
    shutil.copy(pkg / "config.json", pkg / "programs/prefill-64.json")
    with pytest.raises(PackageError, match="programs/prefill-64.json: size"):
        verify_package(pkg)


def test_extra_file_is_refused(pkg):
    (pkg / "evil.py").write_text("import os\n")
    with pytest.raises(PackageError, match="evil.py: not in the manifest"):
        verify_package(pkg)


def test_first_bad_file_in_sorted_order(pkg):
    for rel in ("weights/device-000.safetensors", "README.md"):
        p = pkg / rel
        b = bytearray(p.read_bytes())
        b[-1] ^= 0xFF
        p.write_bytes(bytes(b))
    with pytest.raises(PackageError, match="README.md"):
        verify_package(pkg)


@pytest.mark.parametrize("evil", ["../outside", "/etc/passwd", "a/../../b", ".hidden", "weights/./x", "x\\y", ""])
def test_manifest_paths_cannot_escape(pkg, evil):
    m = json.loads((pkg / "manifest.json").read_text())
    m["files"][evil] = {"sha256": "0" * 64, "size": 1}
    (pkg / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackageError, match="refusing file path"):
        verify_package(pkg)


def test_not_a_package(tmp_path):
    with pytest.raises(PackageError, match="not a ttbundle package"):
        verify_package(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(PackageError, match="unreadable manifest"):
        verify_package(tmp_path)


def test_load_package_checks_headers_against_the_plan(pkg):
    lp = load_package(pkg, verify=True)
    assert lp.mesh.name == "N300" and sorted(lp.programs) == [("decode", 1), ("decode", 8),
                                                              ("prefill", 32), ("prefill", 64)]
    prog = lp.program("decode", 8)
    assert prog["phase"] == "decode" and prog["rows"] == 32
    # a bundle.yaml that disagrees with the weight files is caught
    text = (pkg / "bundle.yaml").read_text().replace("intermediate_size: 512", "intermediate_size: 1024")
    (pkg / "bundle.yaml").write_text(text)
    m = json.loads((pkg / "manifest.json").read_text())
    m["files"]["bundle.yaml"]["size"] = len(text.encode())
    (pkg / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackageError, match=r"bundle.yaml's model gives w1 \[256, 512\] per device, "
                                                   r"the programs \[256, 256\]"):
        load_package(pkg)


def test_cli_cache_verify(pkg, runner):
    from ttbundle import cli
    r = runner.invoke(cli.app, ["cache", "verify", str(pkg)])
    assert r.exit_code == 0 and "files verified" in r.output
    p = pkg / "weights/device-000.safetensors"
    b = bytearray(p.read_bytes())
    b[100] ^= 4
    p.write_bytes(bytes(b))
    r = runner.invoke(cli.app, ["cache", "verify", str(pkg)])
    assert r.exit_code == 1
    assert "weights/device-000.safetensors: sha256 mismatch" in r.output


# ---- names -----------------------------------------------------------------------------------------
def test_package_path_and_mesh_slugs(tmp_path):
    assert package_path(tmp_path, "llama-3.1-8b", "T3K") == tmp_path.absolute() / "T3K" / "llama-3.1-8b"
    assert mesh_slug("(2,4)") == "2x4"
    assert mesh_slug("(8,4)@blackhole") == "8x4-blackhole"
    for bad in ("..", "../x", "a/b", ".x", "-x", "", "a\0b", "x" * 200):
        with pytest.raises(InvalidInput):
            package_path(tmp_path, bad, "T3K")
    with pytest.raises(InvalidInput):
        package_path(tmp_path, "ok", "../../T3K")


def test_module_names_are_identifiers_and_unique():
    names = {module_name(b, m) for b in ("a.b", "a_b", "a-b", "9lives") for m in ("T3K", "(1,8)")}
    assert len(names) == 8
    assert all(n.isidentifier() for n in names)


# ---- generated code -----------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.text())
def test_pyrepr_round_trips_any_string(s):
    out = pyrepr(s)
    assert ast.literal_eval(out) == s
    tree = ast.parse(f"X = {out}")
    assert isinstance(tree.body[0].value, ast.Constant)


def test_pyrepr_refuses_non_data():
    for v in (object(), float("nan"), {1: 2}, print, b"bytes"):
        with pytest.raises(InvalidInput):
            pyrepr(v)


@pytest.mark.parametrize("name", ["x; import os", "a b", "class", "__import__('os')", "1abc", "é", "a\nb", ""])
def test_identifiers_refused(name):
    with pytest.raises(InvalidInput):
        identifier(name, "name")
    with pytest.raises(InvalidInput):
        render_adapter("b", "T3K", "LlamaForCausalLM", name, "0.1.0")


EVIL = ['"""', "'''", '"; import os; os.system("id") #', "\\", "\n\nimport os\n", "{{ 7*7 }}", "\x00",
        "'+__import__('os').system('id')+'", "\u2028", "}}{%"]


@pytest.mark.parametrize("evil", EVIL)
def test_adapter_values_stay_data(evil):
    src = render_adapter(evil, evil, evil, "LlamaForCausalLM", evil)
    ns: dict = {}
    tree = ast.parse(src)
    consts = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}
    assert consts["BUNDLE"] == evil and consts["MESH"] == evil and consts["ARCH"] == evil
    assert "system" not in src or repr(evil) in src
    del ns


def test_adapter_whitelist_rejects_code():
    good = render_adapter("b", "T3K", "LlamaForCausalLM", "LlamaForCausalLM", "0.1.0")
    check_adapter_source(good, "LlamaForCausalLM")
    for inject in ("import subprocess\n", "os.system('id')\n", "X = open('/etc/passwd').read()\n",
                   "def f():\n    pass\n", "class Other(BundleModel):\n    pass\n"):
        with pytest.raises(TTBundleError, match="generated adapter rejected"):
            check_adapter_source(good + inject, "LlamaForCausalLM")
    body_inject = good.replace("    package_dir = PACKAGE_DIR", "    package_dir = __import__('os').getcwd()")
    with pytest.raises(TTBundleError, match="generated adapter rejected"):
        check_adapter_source(body_inject, "LlamaForCausalLM")


def test_generated_adapter_imports_and_subclasses_the_runtime(pkg):
    """The adapter loads from its verified file by path (``package.load_adapter``, what the
    engine does) and subclasses the runtime's BundleModel."""
    import sys

    meta = json.loads((pkg / "vllm_metadata.json").read_text())
    mod, cls = meta["main_class"].split(":")
    try:
        C = load_adapter(pkg, read_manifest(pkg), meta)
        from ttbundle.runtime.adapter import BundleModel
        assert C.__name__ == cls and issubclass(C, BundleModel)
        assert os.path.samefile(C.package_dir, pkg) and C.arch == "LlamaForCausalLM" and C.mesh_name == "N300"
    finally:
        sys.modules.pop(mod, None)
    verify_package(pkg)  # nothing written into the package


def test_markdown_and_code_filters():
    assert "<" not in md("<script>alert(1)</script>")
    assert "|" not in md("a|b").replace("\\|", "")
    assert "`" not in code("a`b") and "\\|" in code("a|b")
    assert size(512) == "512 B" and size(3 << 30) == "3.00 GiB"
