"""The architecture as checks (docs/architecture.md): the import contracts in pyproject.toml
(``[tool.importlinter]``: the pipeline's layers, the vLLM plugin apart from the build and the
planner, the two backends independent, no backend reaching spec/plan/lower, no cycles between
siblings; every one counting indirect imports) run by import-linter, and no import cycle between any two of ttbundle's modules (grimp's graph: every
import statement, lazy ones inside functions included)."""

from __future__ import annotations

from pathlib import Path

import grimp
from importlinter.cli import lint_imports

import ttbundle

ROOT = Path(__file__).resolve().parents[1]


def test_the_checked_package_is_this_checkout():
    assert Path(ttbundle.__file__).resolve().parent == ROOT / "ttbundle"


def test_import_contracts_hold():
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_every_contract_counts_indirect_imports():
    """No contract is relaxed to direct imports only (``allow_indirect_imports``): the plugin
    reaches neither the compiler stages (``lower``, ``plan``) nor the build through any module,
    and no backend reaches ``spec``, ``plan`` or ``lower`` (docs/architecture.md, "Import
    contracts")."""
    import tomllib
    contracts = {c["id"]: c for c in
                 tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}
    assert [i for i, c in contracts.items() if c.get("allow_indirect_imports")] == []
    assert {"ttbundle.lower", "ttbundle.plan", "ttbundle.build"} <= set(contracts["plugin-not-build"]["forbidden_modules"])
    assert contracts["plugin-not-build"]["source_modules"] == ["ttbundle.runtime"]
    backends = set(contracts["backends-not-compiler"]["forbidden_modules"]) | \
        set(contracts["backends-not-spec"]["forbidden_modules"])
    assert backends == {"ttbundle.spec", "ttbundle.plan", "ttbundle.lower"}


def test_the_plugin_and_the_backends_reach_no_compiler_stage():
    """The same as the contracts, read from grimp's graph (every import, those inside functions
    too), so a contract edited out of pyproject.toml would still be caught."""
    g = grimp.build_graph("ttbundle", cache_dir=None)
    for src, stages in (("ttbundle.runtime", ("ttbundle.plan", "ttbundle.lower")),
                        ("ttbundle.backends", ("ttbundle.spec", "ttbundle.plan", "ttbundle.lower"))):
        for dst in stages:
            assert g.find_shortest_chains(importer=src, imported=dst, as_packages=True) == set(), (src, dst)


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle_between_modules():
    assert cycles(grimp.build_graph("ttbundle", cache_dir=None)) == []


def test_the_cycle_finder_finds_a_cycle():
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.a")
    g.add_import(importer="p.c", imported="p.a")
    assert cycles(g) == [["p.a", "p.b"]]


# each rule that was written more than once has one definition (docs/architecture.md, "Who owns
# which rule"): the pattern, and the one module allowed to hold it
ONE_OWNER = {
    r"^TILE = ": "ttbundle/tiles.py",
    r"^def _?(cdiv|round_up|ceil_div)\(": "ttbundle/tiles.py",
    r"^def blocks_per_seq\(": "ttbundle/tiles.py",
    r"^class DoesNotFit\b": "ttbundle/errors.py",
    r"^MANIFEST = ": "ttbundle/manifest.py",
    r"^METADATA = ": "ttbundle/manifest.py",
    r"^def (rope_cos_sin|mrope_rows|rotate_half_matrix|pool_matrix)\(": "ttbundle/tables.py",
    r"^def tensor_layout\(": "ttbundle/layout.py",
    r"^def axes_of\(": "ttbundle/layout.py",
    # the bucket a size pads to; the vision bucket images run in
    r"^def _?pick\(": "ttbundle/tiles.py",
    r"\.bucket_need\(": "ttbundle/vision.py",
    # a spec target named by a mesh, and the error when none is
    r"is not one of its targets": "ttbundle/mesh.py",
    # the wording of a plan that does not fit
    r"per chip, chip has": "ttbundle/plan/memory.py",
    # the wording of a plan's verdict (the plan table's, the SVG's)
    r"of DRAM used\)|of DRAM\), ": "ttbundle/plan/memory.py",
    # an even split (ttnn's mesh_partition / ShardTensor2dMesh): the part a device holds
    r"^def even_(part|slice)\(|np\.split\(|\]\s*//=\s*self\.mesh\.axis_size|size % n or": "ttbundle/layout.py",
    # the model's sizes an executor reads (recorded by lower, read back from the program)
    r"^class Dims\b": "ttbundle/traits.py",
    # a patch-grid encoder's weight dims and its HF vision config (the 2-D axial rope)
    r"^def encoder_dims\(|\"rope_type\": \"axial\"": "ttbundle/families/patch_grid.py",
    # the Qwen vision configs' shared settings and head-width rule
    r"^class QwenVisionBase\b|is not divisible by num_heads": "ttbundle/families/qwen2_5_vl_vision.py",
}

# rules with one owner that a module still writes again, not yet moved (docs/architecture.md,
# "Not yet one owner"): pattern -> those modules. check.py counts the vision bucket itself
# (another engineer's file while this was moved).
NOT_YET: dict = {}


def test_each_rule_has_one_definition():
    import re
    where: dict[str, set[str]] = {p: set() for p in ONE_OWNER}
    for f in sorted((ROOT / "ttbundle").rglob("*.py")):
        text = f.read_text(encoding="utf-8")
        for pattern in ONE_OWNER:
            if re.search(pattern, text, re.M):
                where[pattern].add(f.relative_to(ROOT).as_posix())
    assert where == {p: {owner} | NOT_YET.get(p, set()) for p, owner in ONE_OWNER.items()}


# module-level UPPER_CASE constants written as literals (numbers, strings, containers of them,
# arithmetic such as ``64 << 20``): one name in two modules is one idea written twice (BAND_BYTES
# was in convert and package/shards, ELEM_BYTES in plan/memory and tensorbin) unless the name
# means each module's own thing, listed here with what it is; those must still differ in value
PER_MODULE_NAMES = {
    "FORMAT": "each file format's version string (package, program, warm-up record, tensorbin)",
    "DIR": "each artifact's directory in a package (tensorbin/, warmup/)",
    "ENV": "each module's environment variable",
    "PREFIX": "LoRA's key prefix; serve's log-line prefix pattern",
    "HOOKED": "the marker attribute of each vLLM patch",
    "DTYPES": "tensorbin's ttnn DataType numbers; backends/ttnn/layout's ttnn dtype names",
    "CHAT_TEMPLATE": "each demo family's chat template",
    # a vision family's own facts (families/*_vision.py)
    "BIDIRECTIONAL_IMAGES": "", "BUCKET_UNIT": "", "HF_VISION_KEYS": "", "HF_WRAPPER_KEYS": "",
    "NORM_EPS": "", "TOKENIZER_TOKENS": "", "PLAN": "",
}
# the same name and value in several modules, not yet given one owner: name -> those modules
# (vision families, being moved to one module per encoder by issue 40 item 3: two encoders'
# sharding plan; the Qwen vision configs' norm eps, beside QwenVisionBase's shared settings)
SAME_VALUE_NOT_YET: dict[str, set[str]] = {
    "PLAN": {"ttbundle/families/gemma3_vision.py", "ttbundle/families/qwen3_vl_vision.py"},
    "NORM_EPS": {"ttbundle/families/qwen2_5_vl_vision.py", "ttbundle/families/qwen3_vl_vision.py"},
}


def literal_constants(path: Path) -> dict[str, object]:
    """``NAME = literal`` at a module's top level (a leading underscore dropped from the name)."""
    import ast
    import re
    out = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        try:
            v = ast.literal_eval(value)
        except ValueError:
            if not isinstance(value, ast.BinOp) or not all(
                    isinstance(n, (ast.BinOp, ast.Constant, ast.operator)) for n in ast.walk(value)):
                continue
            v = eval(compile(ast.Expression(value), str(path), "eval"), {"__builtins__": {}})
        for t in targets:
            if isinstance(t, ast.Name) and re.fullmatch(r"_?[A-Z][A-Z0-9_]*", t.id):
                out[t.id.lstrip("_")] = v
    return out


def test_each_literal_constant_has_one_definition():
    by_name: dict[str, dict[str, object]] = {}
    for f in sorted((ROOT / "ttbundle").rglob("*.py")):
        for name, v in literal_constants(f).items():
            by_name.setdefault(name, {})[f.relative_to(ROOT).as_posix()] = v
    twice = {n: sorted(w) for n, w in by_name.items() if len(w) > 1 and n not in PER_MODULE_NAMES}
    assert twice == {}, "one constant written in several modules: give it one owner and import it"
    same = {}
    for n, w in by_name.items():
        for a in w:
            alike = {b for b in w if b != a and w[b] == w[a]}
            if alike:
                same.setdefault(n, set()).update(alike | {a})
    assert same == SAME_VALUE_NOT_YET


def test_the_constant_finder_reads_literals_and_their_arithmetic(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("A = 64 << 20\n_B: dict = {'x': 1}\nc = 3\nD = f(1)\nE = TILE * 2\n")
    assert literal_constants(f) == {"A": 64 << 20, "B": {"x": 1}}


def test_block_float_tile_sizes_are_written_once():
    """A bfp8 tile's 1,088 bytes and a bfp4 tile's 576 come from ``blockfloat.Format.tile_bytes``
    (the format's bits); no module writes the numbers (plan/memory's TILE_BYTES did)."""
    import tokenize
    found = []
    for f in sorted((ROOT / "ttbundle").rglob("*.py")):
        with open(f, encoding="utf-8") as fh:
            for tok in tokenize.generate_tokens(fh.readline):
                if tok.type == tokenize.NUMBER and tok.string.replace("_", "") in ("1088", "576"):
                    found.append(f"{f.relative_to(ROOT).as_posix()}:{tok.start[0]}")
    assert found == []


# ttbundle's own modules are imported at module level (docs/architecture.md, "Imports inside
# functions"). A function imports one only where loading it costs what the importer's other users
# must not pay, or where vLLM would import it half-initialised, listed here: file -> the ttbundle
# modules it may import inside a function. The CLI: `ttbundle --help` loads none of the stages
# (0.2 s; spec/plan/build/check bring pydantic's models and numpy, 0.6-1.4 s more). check and
# warmup: the emulated backend brings torch (3-4 s), which check.record (`ls`, `serve
# --require-checked`) and the build's other steps do without.
LAZY_OWN = {
    "ttbundle/cli.py": {
        "ttbundle.build", "ttbundle.buckets", "ttbundle.check", "ttbundle.check.record",
        "ttbundle.init", "ttbundle.lower", "ttbundle.mockcluster", "ttbundle.package.verify",
        "ttbundle.plan.advice", "ttbundle.plan.host", "ttbundle.plan.make", "ttbundle.plan.validate",
        "ttbundle.report", "ttbundle.runtime.packages", "ttbundle.runtime.registry",
        "ttbundle.serving.launch", "ttbundle.serving.serve", "ttbundle.spec", "ttbundle.svg",
        "ttbundle.warmref", "ttbundle.warmup",
    },
    "ttbundle/check/__init__.py": {"ttbundle.backends.emulated", "ttbundle.backends.emulated.kernel_table"},
    "ttbundle/warmup.py": {"ttbundle.backends.emulated"},
    # tables imports torch: the ttnn backend loads without it, only a host-made constant needs it
    "ttbundle/backends/ttnn/device.py": {"ttbundle.tables"},
    # the vLLM plugins' entry points: vLLM imports this module in every process of every install
    # that has ttbundle; the registry (package loader, pydantic, numpy: ~0.7 s) only when active
    "ttbundle/runtime/activation.py": {"ttbundle.runtime.registry", "ttbundle.runtime.structured"},
    # vLLM imports the platform while it resolves `current_platform`; the model runner and the
    # pooling runner import vLLM's worker modules, which read `current_platform` as they load:
    # at module level vLLM fails with "cannot import name 'current_platform'"
    "ttbundle/runtime/platform.py": {"ttbundle.runtime.model_runner", "ttbundle.runtime.pooling"},
    # the emulated backend brings torch (3-4 s): the launchers (`serve`, `launch`) and the
    # registry (`ls`, `register`) open packages and never run one
    "ttbundle/runtime/packages.py": {"ttbundle.backends.emulated"},
}


def function_level_own_imports(path: Path, root: Path = ROOT) -> dict[str, list[int]]:
    """The ttbundle modules ``path`` imports inside a function body -> the lines; ``from P import
    x`` counts as ``P.x`` where that is a module, else as ``P``."""
    import ast
    pkg = path.relative_to(root).parts[:-1]  # the package a relative import starts from
    out: dict[str, list[int]] = {}

    def is_module(parts) -> bool:
        p = root.joinpath(*parts)
        return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()

    def visit(node, in_function: bool):
        for ch in ast.iter_child_nodes(node):
            if in_function and isinstance(ch, ast.ImportFrom):
                base = (pkg[:len(pkg) - ch.level + 1] if ch.level else ()) + tuple(
                    ch.module.split(".") if ch.module else ())
                if base[:1] == ("ttbundle",):
                    for a in ch.names:
                        mod = base + (a.name,) if is_module(base + (a.name,)) else base
                        out.setdefault(".".join(mod), []).append(ch.lineno)
            elif in_function and isinstance(ch, ast.Import):
                for a in ch.names:
                    if a.name.split(".")[0] == "ttbundle":
                        out.setdefault(a.name, []).append(ch.lineno)
            visit(ch, in_function or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return out


def test_ttbundle_modules_are_imported_at_module_level():
    found, used = {}, {}
    for f in sorted((ROOT / "ttbundle").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        lazy = function_level_own_imports(f)
        used[rel] = set(lazy) & LAZY_OWN.get(rel, set())
        extra = {m: lines for m, lines in lazy.items() if m not in LAZY_OWN.get(rel, set())}
        if extra:
            found[rel] = extra
    assert found == {}, "import ttbundle's modules at module level (or list why not in LAZY_OWN)"
    stale = {rel: sorted(ms - used.get(rel, set())) for rel, ms in LAZY_OWN.items() if ms - used.get(rel, set())}
    assert stale == {}, "LAZY_OWN lists imports no longer made inside a function: drop them"


def test_the_architecture_doc_names_every_import_left_inside_a_function():
    """docs/architecture.md's "Imports inside functions" names each file of ``LAZY_OWN`` and each
    module it imports inside a function (the reason is given beside it)."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc[doc.index("### Imports inside functions"):]
    section = section[:section.index("\n## ")]
    missing = [f"{rel}: {m}" for rel, ms in LAZY_OWN.items() if rel != "ttbundle/cli.py"
               for m in sorted(ms | {rel})
               if (m.removeprefix("ttbundle/").removeprefix("ttbundle.")) not in section]
    assert missing == []


def test_the_lazy_import_finder_resolves_relative_imports(tmp_path):
    (tmp_path / "ttbundle" / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (tmp_path / "ttbundle" / f).write_text("")
    f = tmp_path / "ttbundle" / "sub" / "c.py"
    f.write_text("from . import b\nimport json\n\ndef g():\n    from .. import a\n    from .b import x\n"
                 "    import ttbundle.sub\n    import torch\n    return lambda: __import__('os')\n")
    assert function_level_own_imports(f, tmp_path) == {
        "ttbundle.a": [5], "ttbundle.sub.b": [6], "ttbundle.sub": [7]}


def test_the_architecture_doc_draws_the_pipeline_contract():
    """docs/architecture.md's drawing of which code imports which lists pyproject's layers, top
    to bottom (a layer written ``a : b`` holds modules that do not import each other)."""
    import re
    import tomllib
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "pipeline")["layers"]
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = doc[doc.index("Which code imports which"):].split("```")[1]
    drawn = [re.split(r"\s{2,}", line.strip())[0] for line in block.strip().splitlines()]
    assert [[m.strip() for m in layer.split(":")] for layer in drawn] == \
        [[m.strip().removeprefix("ttbundle.") for m in layer.split(":")] for layer in layers]


def test_the_standard_library_is_imported_at_module_level():
    """Inside functions only costly or optional third-party modules (docs/architecture.md's
    table); the standard library's are cheap, imported at the top."""
    import ast
    import sys
    found = []
    for f in sorted((ROOT / "ttbundle").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        for fn in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(fn):
                names = ([n.module] if isinstance(n, ast.ImportFrom) and not n.level else
                         [a.name for a in n.names] if isinstance(n, ast.Import) else [])
                if any(x.split(".")[0] in sys.stdlib_module_names for x in names):
                    found.append(f"{rel}:{n.lineno}")
    assert sorted(set(found)) == []
