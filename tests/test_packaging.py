"""The distribution: every subpackage is listed in pyproject.toml, and a wheel (not an editable
install) carries the templates that `init` and `build` render."""

from __future__ import annotations

import os
import subprocess
import sys

import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed():
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ttbundle").rglob("__init__.py")}
    listed = set(cfg["packages"])
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert cfg["package-dir"]["ttbundle._templates"] == "templates"
    assert sorted(p.name for p in (ROOT / "templates").glob("*.j2"))


@pytest.mark.slow
def test_wheel_ships_templates_and_renders_from_them(tmp_path):
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(wheels), str(ROOT)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = wheels.glob("ttbundle-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    want = {f"ttbundle/_templates/{p.name}" for p in (ROOT / "templates").glob("*.j2")}
    assert want <= names, sorted(want - names)
    # unpacked away from the checkout: the templates come from the wheel's copy
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    code = ("import ttbundle.package.templates as p, ttbundle.fsutil as f; "
            "assert f.TEMPLATE_DIR == f.Path(p.__file__).parents[1] / '_templates', f.TEMPLATE_DIR; "
            "print(p.render_adapter('demo', 'N150', 'TTLlamaForCausalLM', 'TTLlamaForCausalLM', '0'))")
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "class TTLlamaForCausalLM" in r.stdout
