"""A package is exactly its manifest, and only its own adapter runs (issue 15): bytecode, symlinked
directories and a ``main_class`` pointing elsewhere are refused at verification (``register``,
``serve``, the plugin's scan), and the engine imports the adapter from its verified file by path."""

from __future__ import annotations

import hashlib
import importlib._bootstrap_external as bootstrap
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from ttbundle.manifest import MANIFEST, METADATA
from ttbundle.package.names import PackageError
from ttbundle.package.verify import load_adapter, verify_package
from ttbundle.errors import TTBundleError
from ttbundle.runtime import registry
from ttbundle.runtime.packages import open_package

from test_build import ckpt  # noqa: F401  (session fixture)
from test_package import built  # noqa: F401  (the N300 package, built once per module)


@pytest.fixture
def pkg(built, tmp_path):
    dst = tmp_path / "out" / "N300" / built.name
    shutil.copytree(built, dst)
    return dst


def _adapter(pkg: Path) -> tuple[str, str]:
    mod, cls = json.loads((pkg / METADATA).read_text())["main_class"].split(":")
    return mod, cls


def _evil_source(marker: Path, cls: str) -> str:
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nclass {cls}:\n    pass\n"


def _plant_pyc(pkg: Path, marker: Path) -> Path:
    """A ``__pycache__`` bytecode file whose header matches the adapter's mtime and size, so a
    ``sys.path`` import would run it instead of the source."""
    mod, cls = _adapter(pkg)
    src = pkg / f"{mod}.py"
    st = os.stat(src)
    code = compile(_evil_source(marker, cls), str(src), "exec")
    data = bootstrap._code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size)
    pyc = Path(bootstrap.cache_from_source(str(src)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(data)
    return pyc


def _plant_symlinked_module_dir(pkg: Path, tmp_path: Path, marker: Path) -> None:
    """A symlinked directory named like the adapter module (a package wins over a same-named .py)."""
    mod, cls = _adapter(pkg)
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "__init__.py").write_text(_evil_source(marker, cls))
    os.symlink(evil, pkg / mod)


def _rehash(pkg: Path, rel: str) -> None:
    m = json.loads((pkg / MANIFEST).read_text())
    data = (pkg / rel).read_bytes()
    m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (pkg / MANIFEST).write_text(json.dumps(m))


def test_bytecode_in_the_package_is_refused(pkg, tmp_path):
    pyc = _plant_pyc(pkg, tmp_path / "marker")
    rel = pyc.relative_to(pkg).parent.as_posix()
    with pytest.raises(PackageError, match=rf"{rel}/: directory not in the manifest"):
        verify_package(pkg)
    shutil.rmtree(pyc.parent)
    verify_package(pkg)


def test_a_symlink_anywhere_is_refused(pkg, tmp_path):
    _plant_symlinked_module_dir(pkg, tmp_path, tmp_path / "marker")
    with pytest.raises(PackageError, match=rf"{_adapter(pkg)[0]}: a symlink"):
        verify_package(pkg, full=False)
    (pkg / _adapter(pkg)[0]).unlink()
    os.symlink(pkg / "config.json", pkg / "programs" / "extra.json")
    with pytest.raises(PackageError, match=r"programs/extra.json: a symlink"):
        verify_package(pkg)


@pytest.mark.parametrize("plant", ["pyc", "symlinked-dir"])
def test_engine_imports_only_the_verified_adapter(pkg, tmp_path, plant):
    """Even with verification bypassed, the engine's import runs the adapter file the manifest
    hashes: neither planted bytecode nor a same-named module directory runs."""
    from ttbundle.runtime.adapter import BundleModel
    from ttbundle.runtime.model_runner import model_class

    marker = tmp_path / "marker"
    p = open_package(pkg)
    if plant == "pyc":
        _plant_pyc(pkg, marker)
    else:
        _plant_symlinked_module_dir(pkg, tmp_path, marker)
    mod, _ = _adapter(pkg)
    before = list(sys.path)
    try:
        cls = model_class(p)
        assert not marker.exists(), "code outside the manifest ran"
        assert issubclass(cls, BundleModel) and os.path.samefile(cls.package_dir, pkg)
        assert str(pkg) not in sys.path and sys.path == before
    finally:
        sys.modules.pop(mod, None)
        sys.path[:] = before


def test_loading_writes_no_bytecode(pkg, monkeypatch):
    from ttbundle.runtime.model_runner import model_class

    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # an import from the folder would write it

    mod, _ = _adapter(pkg)
    try:
        model_class(open_package(pkg))
    finally:
        sys.modules.pop(mod, None)
    assert not (pkg / "__pycache__").exists()
    verify_package(pkg)


@pytest.mark.parametrize("main_class", ["this:x", "os:system", "json:loads", "{mod}:Other",
                                        "{mod}.sub:{cls}", "{mod}", ":{cls}", 7])
def test_main_class_must_be_the_packages_own_adapter(pkg, xdg, main_class, runner):
    """``vllm_metadata.json`` rewritten and its hash updated in the manifest: refused at open
    (serve, the engine), at ``register`` and in the plugin's scan; nothing is imported."""
    from ttbundle.cli import app

    mod, cls = _adapter(pkg)
    mc = main_class.format(mod=mod, cls=cls) if isinstance(main_class, str) else main_class
    meta = json.loads((pkg / METADATA).read_text())
    meta["main_class"] = mc
    (pkg / METADATA).write_text(json.dumps(meta))
    _rehash(pkg, METADATA)
    sys.modules.pop("this", None)
    with pytest.raises(PackageError, match="main_class"):
        open_package(pkg)
    good, bad = registry.scan_dir(pkg.parent)
    assert not good and len(bad) == 1 and "main_class" in bad[0][1]
    r = runner.invoke(app, ["register", "--dir", str(pkg.parent)])
    assert r.exit_code == 1 and "main_class" in r.output and "Traceback" not in r.output
    assert "this" not in sys.modules  # `this:x` was never imported
    # the same in the manifest itself (both rewritten, consistently)
    m = json.loads((pkg / MANIFEST).read_text())
    m["main_class"] = mc
    (pkg / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(PackageError, match="not this package's adapter|field main_class: input should "
                                                   "be a valid string, got 7"):
        verify_package(pkg)


def test_tampered_adapter_with_updated_hash_is_refused_at_load(pkg, tmp_path):
    """An adapter rewritten to run code (and re-hashed) passes the hash check but not the adapter
    whitelist: verification refuses it (every command: tests/test_package_verdicts.py), and the
    engine, with verification bypassed, refuses it before running a line."""
    mod, cls = _adapter(pkg)
    marker = tmp_path / "marker"
    src = pkg / f"{mod}.py"
    src.write_text(src.read_text() + f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    _rehash(pkg, f"{mod}.py")
    with pytest.raises(PackageError, match="generated adapter rejected"):
        open_package(pkg, check_hashes=False)
    m = json.loads((pkg / MANIFEST).read_text())
    with pytest.raises(TTBundleError, match="generated adapter rejected"):
        load_adapter(pkg, m)
    assert not marker.exists()

