"""docs/ stays true to the code: generated files are current, hand-written ones name only real
commands, options and keys, their links resolve, and the quickstart's example spec behaves as
the text says."""

from __future__ import annotations

import difflib
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from pydantic import BaseModel
from typer.testing import CliRunner

from ttbundle import errors, families, mesh as meshmod, spec as specmod
from ttbundle.plan.make import make_plan
from ttbundle.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REGEN = "run `python scripts/gen_docs.py`"
OWN_DOCS = ("quickstart.md", "cli.md", "spec-reference.md", "meshes.md")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return _gen_docs().generate()


@pytest.fixture(scope="module")
def commands():
    return typer.main.get_command(app).commands


def test_generated_docs_are_up_to_date(generated):
    problems = []
    for name, text in generated.items():
        p = DOCS / name
        if not p.is_file():
            problems.append(f"docs/{name} is missing; {REGEN}")
            continue
        have = p.read_text(encoding="utf-8")
        if have != text:
            diff = difflib.unified_diff(have.splitlines(), text.splitlines(), f"docs/{name}",
                                        "generated", lineterm="", n=1)
            problems.append(f"docs/{name} is out of date; {REGEN}\n" + "\n".join(list(diff)[:30]))
    assert not problems, "\n\n".join(problems)


def test_gen_docs_script_out_and_check(tmp_path, generated):
    script = [sys.executable, str(ROOT / "scripts" / "gen_docs.py")]
    r = subprocess.run(script + ["--out", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name, text in generated.items():
        assert (tmp_path / name).read_text(encoding="utf-8") == text
    r = subprocess.run(script + ["--check", "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (tmp_path / "meshes.md").write_text("stale\n")
    r = subprocess.run(script + ["--check", "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 1
    assert f"{tmp_path / 'meshes.md'} is out of date; {REGEN}" in r.stderr


def test_schema_file_is_what_the_cli_prints(generated):
    r = CliRunner().invoke(app, ["schema"])
    assert r.exit_code == 0
    assert r.stdout == generated["bundle.schema.json"]


def _key_paths(model: type[BaseModel], prefix: str) -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        out.append(path)
        for t in [f.annotation, *getattr(f.annotation, "__args__", ())]:
            if isinstance(t, type) and issubclass(t, BaseModel) and name != "model":
                out += _key_paths(t, path)
    return out


def test_reference_lists_every_key_of_every_family(generated):
    text = generated["spec-reference.md"]
    paths = _key_paths(specmod.BundleSpec, "")
    for fam in families.all_families().values():
        paths += _key_paths(fam.arch_model, "model")
        assert f"### `model` with `family: {fam.name}`" in text
        for arch in fam.hf_architectures:
            assert f"`{arch}`" in text
    missing = [p for p in paths if f"| `{p}` |" not in text]
    assert not missing, f"not in docs/spec-reference.md: {missing}; {REGEN}"
    # a sample row: type, default and docstring
    assert ("| `runtime.kv_cache_dtype` | one of `bf16`, `bfp8` | `\"bf16\"` | KV cache storage dtype. |"
            in text)
    assert "| `name` | string | **required** |" in text
    assert "| `buckets.prefill` | list of integer | `[128, 1024]` |" in text


def test_meshes_doc_lists_every_preset(generated):
    text = generated["meshes.md"]
    for m in meshmod.PRESETS.values():
        row = next((l for l in text.splitlines() if l.startswith(f"| `{m.name}` |")), None)
        assert row, m.name
        assert f"| {m.rows}x{m.cols} | {m.num_devices} |" in row
        assert f"{m.chip.dram_bytes:,} B" in row and f"{m.chip.l1_bytes:,} B" in row
        assert f"| {m.topology} |" in row
    assert '`"(R,C)"`' in text and '`"(R,C)@blackhole"`' in text


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start: nxt if nxt != -1 else len(text)]


def _leaf_commands(commands, prefix=""):
    """("cache explain", command) for every runnable command, descending into groups."""
    for name, cmd in commands.items():
        if getattr(cmd, "commands", None):
            yield from _leaf_commands(cmd.commands, f"{prefix}{name} ")
        else:
            yield prefix + name, cmd


def test_cli_doc_covers_every_command_and_option(commands):
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    missing = []
    for name, cmd in _leaf_commands(commands):
        heading = f"## `ttbundle {name}`"
        if heading not in text:
            missing.append(f"a section `{heading}`")
            continue
        sec = _section(text, heading)
        for p in cmd.params:
            for opt in p.opts:
                if opt.startswith("--") and f"`{opt}" not in sec:
                    missing.append(f"`{opt}` under {heading}")
    assert not missing, "docs/cli.md lacks: " + "; ".join(missing)
    codes = _section(text, "## Exit codes")
    for code in (errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_INVALID, errors.EXIT_DOES_NOT_FIT):
        assert f"\n| {code} | " in codes


def _code_blocks(text: str, lang: str | None = None) -> list[str]:
    pat = r"```" + (re.escape(lang) if lang else r"[a-z]*") + r"\n(.*?)```"
    return re.findall(pat, text, flags=re.S)


@pytest.mark.parametrize("doc", ["quickstart.md", "cli.md"])
def test_documented_command_lines_use_real_commands_and_options(doc, commands):
    text = (DOCS / doc).read_text(encoding="utf-8")
    seen = 0
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" | ")[0].split("  #")[0].strip()
            if not line.startswith("ttbundle "):
                continue
            words = shlex.split(re.sub(r"\[|\]|\.\.\.", " ", line))[1:]
            assert words[0] in commands, f"{doc}: `{line}`: no command {words[0]!r}"
            cmd = commands[words.pop(0)]
            while getattr(cmd, "commands", None):  # a group: the next word is its subcommand
                assert words and words[0] in cmd.commands, f"{doc}: `{line}`: no such subcommand"
                cmd = cmd.commands[words.pop(0)]
            opts = {o for p in cmd.params for o in p.opts}
            for w in words:
                if w.startswith("-") and w != "-":
                    assert w.split("=")[0] in opts, f"{doc}: `{line}`: no option {w}"
            seen += 1
    assert seen >= 3


def _slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    ids = set(re.findall(r'<a id="([^"]+)"></a>', text))
    ids |= {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    return ids


@pytest.mark.parametrize("doc", OWN_DOCS)
def test_links_resolve(doc, generated):
    text = generated.get(doc) or (DOCS / doc).read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (DOCS / file) if file else DOCS / doc
        assert path.exists(), f"docs/{doc}: link to {target}: {path} does not exist"
        if anchor and path.suffix == ".md":
            body = generated.get(path.name) if path.parent == DOCS else None
            body = body or path.read_text(encoding="utf-8")
            assert anchor in _anchors(body), f"docs/{doc}: link to {target}: no such anchor"


@pytest.fixture(scope="module")
def quickstart_bundle():
    text = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    return specmod.loads(_code_blocks(text, "yaml")[0], "quickstart.md", base_dir=ROOT)


def test_quickstart_example_behaves_as_described(quickstart_bundle):
    text = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    t3k, n300 = make_plan(quickstart_bundle, "T3K"), make_plan(quickstart_bundle, "N300")
    assert t3k.fits and not n300.fits
    w1 = next(t for t in t3k.tensors if t.name == "w1")
    assert w1.notation() == "bfp8[4096@rows, 14336@cols]" and w1.device_shape == [4096, 1792]
    assert f"`{w1.notation()}`" in text and f"`bfp8[{', '.join(map(str, w1.device_shape))}]`" in text
    # the replicated-rows variant quoted in the text
    spec = quickstart_bundle.spec.model_copy(update={"sharding": specmod.Sharding(
        plan={"w1": [None, "cols"]})})
    b = specmod.Bundle(spec, quickstart_bundle.arch, quickstart_bundle.family, "q", ROOT)
    w1 = next(t for t in make_plan(b, "T3K").tensors if t.name == "w1")
    assert w1.notation().replace("bfp8", "bf16") == "bf16[4096, 14336@cols]"
    kinds = {(c.kind, c.axes) for c in t3k.collectives}
    assert kinds == {("all_reduce", ("cols",)), ("all_gather", ("cols",))}
