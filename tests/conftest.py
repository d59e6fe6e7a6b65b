"""Shared fixtures: a pinned terminal, spec builders and error helpers.

Spec text is built from a dict with ``yaml.safe_dump`` so tests can say *what* they change and
then find the line a diagnostic must point at with :func:`line_of` (computed from the text, never
copied from ttbundle's output).
"""

from __future__ import annotations

import copy
import os

# Pin the terminal before anything imports rich: CliRunner output must not wrap at 80 columns.
os.environ["COLUMNS"] = "200"
os.environ["LINES"] = "50"
os.environ.pop("FORCE_COLOR", None)
os.environ["NO_COLOR"] = "1"

import pytest  # noqa: E402
import yaml  # noqa: E402

from spec_helpers import DELETE, LLAMA_70B, SPEC_FILE, TINY, _Delete, _matches, col_of, deep_update, dump, line_of, spec_text  # noqa: E402,F401


@pytest.fixture
def spec_dir(tmp_path):
    """Where spec files are written (weights/tokenizer paths resolve relative to it)."""
    return tmp_path


@pytest.fixture
def write_spec(spec_dir):
    def write(text: str, name: str = SPEC_FILE):
        p = spec_dir / name
        p.write_text(text, encoding="utf-8")
        return p
    return write


@pytest.fixture
def load(spec_dir):
    """``load(text)`` -> Bundle (file name ``spec.yaml``, paths relative to ``spec_dir``)."""
    from ttbundle import spec

    def _load(text: str):
        return spec.loads(text, SPEC_FILE, base_dir=spec_dir)
    return _load


@pytest.fixture
def diagnostics(spec_dir):
    """``diagnostics(text)`` -> the InvalidInput's diagnostics (fails if the spec loads)."""
    from ttbundle import spec
    from ttbundle.errors import InvalidInput

    def _diags(text: str):
        with pytest.raises(InvalidInput) as ei:
            spec.loads(text, SPEC_FILE, base_dir=spec_dir)
        assert ei.value.diagnostics, str(ei.value)
        return ei.value.diagnostics
    return _diags


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    """An empty user registry (XDG config dir), no EXTRA_MODELS_DIR, no MESH_DEVICE."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("EXTRA_MODELS_DIR", raising=False)
    monkeypatch.delenv("MESH_DEVICE", raising=False)
    return tmp_path / "xdg"


@pytest.fixture
def runner():
    from typer.testing import CliRunner

    from ttbundle import cli
    # The CLI's consoles are created at import; pin their width too.
    for console in (cli.out, cli.err):
        console.width = 200
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def pytest_terminal_summary(terminalreporter):
    """How many fuzz cases ran (tests/test_fuzz.py), and that none gave a traceback: a fuzz case
    that does fails its test, so a count printed after a passing run is the claim."""
    import sys
    fuzz = sys.modules.get("test_fuzz")
    counts = getattr(fuzz, "COUNTS", None)
    if counts:
        failed = bool(terminalreporter.stats.get("failed"))
        terminalreporter.write_line(
            f"fuzz: {sum(counts.values())} cases ran ("
            + ", ".join(f"{k}: {v}" for k, v in counts.items()) + "); "
            + ("see the failures above" if failed else "none gave a traceback"))
