"""The architecture as checks (docs/architecture.md): the import contracts in pyproject.toml
(``[tool.importlinter]``: the pipeline's layers, the vLLM plugin apart from the build, the two
backends independent, no backend importing spec/plan/lower, no cycles between siblings) run by
import-linter, and no import cycle between any two of ttbundle's modules (grimp's graph: every
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
