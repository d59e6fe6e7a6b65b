"""Programs handed to a ttnn process: a directory laid out like a package's (``bundle.yaml``,
``programs/<phase>-<bucket>.json``), so a built package is one too.

The kernel-cache fill (:mod:`.kernelcache`) and the mock validation (:mod:`.mockcheck`) run in a
process of their own (one mock cluster per process, ``ttbundle/ttnnproc.py``); the build, or a
test, hands them the programs ``lower`` produced, written by :func:`write`, and they read them
back with :func:`read`: the typed ``program.Program`` of each (phase, bucket), type-checked
(``Program.verify``) as a package load does, and their mesh. The resolved spec beside them
(``bundle.yaml``) is the package loader's to read (``ttnnproc.handed_over``): no backend imports
it. Nothing here plans or lowers: a process that gets no programs runs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from ... import mesh as meshmod
from ...program import Program, ProgramError

PROGRAMS = "programs"


def write(dest: str | Path, bundle_yaml: str, programs: dict) -> Path:
    """``dest`` holding ``bundle_yaml`` and every program of ``programs`` ((phase, bucket) ->
    ``Program``) as its JSON; returns ``dest``."""
    dest = Path(dest)
    (dest / PROGRAMS).mkdir(parents=True, exist_ok=True)
    (dest / "bundle.yaml").write_text(bundle_yaml, encoding="utf-8")
    for prog in programs.values():
        (dest / PROGRAMS / f"{prog.name}.json").write_text(json.dumps(prog.to_json(), sort_keys=True),
                                                           encoding="utf-8")
    return dest


def mesh_of(program: Program) -> meshmod.Mesh:
    """The mesh ``program`` runs on, as it records it: its target preset, or the submesh one
    replica of it runs on (``mesh.split``) where the recorded shape is smaller."""
    mesh = meshmod.resolve(program.mesh["name"])
    shape = tuple(program.mesh.get("shape") or mesh.shape)
    return mesh if tuple(mesh.shape) == shape else meshmod.split(mesh, shape)


def read(src: str | Path) -> tuple[meshmod.Mesh, dict]:
    """(the programs' mesh (:func:`mesh_of`), ``{(phase, bucket): Program}`` of ``src/programs/``),
    programs in (phase, bucket) order; a program that does not verify, or programs for different
    meshes, are a ``ProgramError`` naming the file."""
    src = Path(src)
    files = sorted((src / PROGRAMS).glob("*.json"))
    if not files:
        raise ProgramError(f"{src}/{PROGRAMS}: no programs")
    out = {}
    for f in files:
        prog = Program.from_json(json.loads(f.read_text(encoding="utf-8")), str(f))
        prog.verify(str(f))
        out[(prog.phase, prog.bucket)] = prog
    meshes = {json.dumps(p.mesh, sort_keys=True) for p in out.values()}
    if len(meshes) != 1:
        raise ProgramError(f"{src}/{PROGRAMS}: programs for different meshes: {sorted(meshes)}")
    order = {"prefill": 0, "decode": 1, "verify": 2, "vision": 3}
    return mesh_of(next(iter(out.values()))), dict(sorted(out.items(), key=lambda kv: (order.get(kv[0][0], 4), kv[0][1])))


__all__ = ["PROGRAMS", "mesh_of", "read", "write"]
