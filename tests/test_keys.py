"""Content keys from the code's real dependencies: ``cache.module_sources`` walks a producer's
imports with ``ast``; the ``code.*`` fields hash exactly those files."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ttbundle import cache, families

ROOT = cache.ROOT  # the ttbundle directory


def rel(paths, root=ROOT) -> set[str]:
    return {str(p.relative_to(root)) for p in paths}


def write(root: Path, files: dict) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_walk_resolves_relative_lazy_and_submodule_imports(tmp_path):
    """A made-up package with every import form the walker must follow, and some it must not."""
    t = write(tmp_path / "ttbundle", {
        "__init__.py": "",
        "top.py": "from . import a\nfrom .pkg import sub\nimport os\n\n"
                  "def later():\n    from .lazy import thing  # inside a function\n    return thing\n",
        "a.py": "import ttbundle.deep.mod as m\nfrom numpy import array\n",
        "deep/__init__.py": "",
        "deep/mod.py": "from .. import errors\nfrom ..pkg.sub import f  # names, not modules\n",
        "pkg/__init__.py": "from .side import x\n",
        "pkg/sub.py": "def f(): pass\n",
        "pkg/side.py": "x = 1\n",
        "lazy.py": "thing = 1\n",
        "errors.py": "",
        "unused.py": "import ttbundle.top\n",  # imports top; top does not import it
        "families/__init__.py": "from . import llama\n",
        "families/llama.py": "",
        "fam_user.py": "from .families import llama\n",
    })
    got = rel(cache.module_sources(["ttbundle.top"], t), t)
    assert got == {"__init__.py", "top.py", "a.py", "deep/__init__.py", "deep/mod.py", "errors.py",
                   "pkg/__init__.py", "pkg/sub.py", "pkg/side.py", "lazy.py"}
    # the family registry (families/__init__.py imports every family) is the one module not walked
    assert rel(cache.module_sources(["ttbundle.fam_user"], t), t) == {"__init__.py", "fam_user.py",
                                                                      "families/llama.py"}


def test_producers_dependencies_are_what_they_import():
    deps = {k: rel(cache.module_sources(m)) for k, m in cache.PRODUCERS.items()}
    # weights: the conversion, the block-float encoder it calls lazily, the package format
    assert {"convert.py", "blockfloat.py", "package/shardfile.py", "package/names.py", "package/shards.py",
            "weights.py", "tiles.py"} <= deps["code.convert"]
    # the weights do not depend on the lowering: the package's reader (package/load.py, which
    # imports lower) is not the writer's (when the package was one module, it was)
    assert not {"lower.py", "package/load.py"} & deps["code.convert"]
    # the small files: their templates and names, not the package's reader or verifier
    assert {"package/__init__.py", "package/templates.py", "package/names.py"} <= deps["code.templates"]
    assert not {"package/load.py", "package/verify.py", "package/shards.py"} & deps["code.templates"]
    # warm-up: moe_kernels.py is imported only at the bottom of kernels.py (the hand list missed it)
    assert {"warmup.py", "warmref.py", "backends/emulated/kernels.py", "backends/emulated/moe_kernels.py",
            "backends/emulated/model.py", "backends/emulated/meshops.py"} <= deps["code.backend"]
    # layout.py and program.py (the layout rule, the program IR) came after the hand list; nobody
    # had to add them
    assert "layout.py" in deps["code.convert"]
    assert {"lower.py", "plan/make.py", "plan/propagate.py", "mesh.py", "layout.py", "program.py"} <= deps["code.lower"]
    # lowering uses no conversion, block-float or backend code: those edits keep the programs
    assert not {p for p in deps["code.lower"] if p in ("convert.py", "blockfloat.py", "warmup.py")
                or p.startswith("package/")
                or p.startswith("backends/")}
    # orchestration, transactions and UI are nobody's dependency
    for ui in ("progress.py", "build.py", "txn.py", "artifacts.py", "cli.py"):
        assert all(ui not in d for d in deps.values()), ui
    # no family's own module: those are keyed per family (family_code)
    fam = {f"families/{type(f).__module__.rpartition('.')[2]}.py" for f in families.all_families().values()}
    assert {"families/llama.py", "families/deepseek_v3.py", "families/qwen3_vl.py"} <= fam
    assert not any(p in fam or p.startswith("runtime/") or p == "families/__init__.py"
                   for d in deps.values() for p in d)


def test_family_code_is_per_family():
    src = {n: rel(cache.family_sources(f)) for n, f in families.all_families().items()}
    assert src["llama"] >= {"families/llama.py", "families/base.py"}
    assert "families/gemma2.py" in src["gemma3"]  # it extends gemma2
    assert "families/moe.py" in src["deepseek_v3"] and "families/moe.py" not in src["llama"]
    assert all(not p.startswith("families/") or p in ("families/llama.py", "families/base.py") for p in src["llama"])


@pytest.mark.parametrize("module", sorted({m for ms in cache.PRODUCERS.values() for m in ms}))
def test_walk_covers_what_python_imports(module):
    """Independent of the walker: the ttbundle modules Python has loaded after importing the producer
    (top-level imports, executed) are all among its key inputs."""
    code = (f"import sys, json, {module}\n"
            "print(json.dumps(sorted(m.__file__ for n, m in list(sys.modules.items())\n"
            "      if n.startswith('ttbundle') and not n.startswith('ttbundle.families')\n"
            "      and getattr(m, '__file__', None))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    assert loaded and {str(Path(f).resolve()) for f in loaded} <= {str(p) for p in cache.module_sources([module])}


BASE = {k: f"<{k}>" for k in cache.WEIGHTS_DEPS + cache.PROGRAM_DEPS + cache.WARMUP_DEPS}
TRACES = [("prefill", 128), ("decode", 1)]


def keys_of(root: Path) -> dict:
    return cache.artifact_keys({**BASE, **cache.code_fields(root)}, TRACES)


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of ttbundle's sources (the same relative paths, so the same digests)."""
    t = tmp_path / "ttbundle"
    shutil.copytree(ROOT, t, ignore=shutil.ignore_patterns("__pycache__"))
    return t


def test_ui_edit_changes_no_key_and_a_dependency_edit_does(tree):
    before = keys_of(tree)
    assert before == keys_of(ROOT)
    with open(tree / "progress.py", "a") as f:
        f.write("\n# a new progress bar colour\n")
    with open(tree / "txn.py", "a") as f:
        f.write("\n# a locking tweak\n")
    assert keys_of(tree) == before  # nothing rebuilt for a UI edit

    with open(tree / "blockfloat.py", "a") as f:
        f.write("\n# an encoder change\n")
    after = keys_of(tree)
    assert after["weights"] != before["weights"]
    assert all(after[k] == before[k] for k in before if k.startswith("program:"))  # lowering untouched
    assert all(after[k] != before[k] for k in before if k.startswith("warmup:"))  # warm-up runs the weights


def test_backend_kernel_edit_reruns_warmup_only(tree):
    before = keys_of(tree)
    with open(tree / "backends" / "emulated" / "moe_kernels.py", "a") as f:
        f.write("\n# a routing fix\n")
    after = keys_of(tree)
    assert after["weights"] == before["weights"]
    assert {k for k in before if after[k] != before[k]} == {k for k in before if k.startswith("warmup:")}


def test_a_family_edit_changes_that_familys_code_only(tree):
    def code(root):
        return {n: cache.code_digest(cache.family_sources(f, root), root.parent)
                for n, f in families.all_families().items()}
    before = code(tree)
    with open(tree / "families" / "gemma2.py", "a") as f:
        f.write("\n# a gemma2 fix\n")
    after = code(tree)
    assert {n for n in before if after[n] != before[n]} == {"gemma2", "gemma3"}
