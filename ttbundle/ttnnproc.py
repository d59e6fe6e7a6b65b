"""The ttnn processes the build and the tests start, one mock cluster (or set of chips) each:
``python -m ttbundle.ttnnproc kernelcache DIR MESH [TRACE_REGION_SIZE]`` (the kernel-cache fill,
``backends/ttnn/kernelcache.fill``) and ``python -m ttbundle.ttnnproc mockcheck MESH DIR...`` (ttnn's
op validation, ``backends/ttnn/mockcheck``). Each ``DIR`` holds programs as a package lays them
out (``backends/ttnn/handover``: ``bundle.yaml`` and ``programs/``; a built package is one).

The entry points live here, above the backends, because they load the handed-over
``bundle.yaml`` (``package.load.read_bundle``, which resolves the spec) and pass the bundle to the
ttnn lowering: no backend module imports the package loader or the spec."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import mesh as meshmod
from .backends.ttnn import handover
from .backends.ttnn.lowering import lower_forward, samplings
from .backends.ttnn.mockcheck import open_mesh, validate, worker_grid
from .package.load import read_bundle


def handed_over(src: str | Path) -> tuple[object, meshmod.Mesh, dict]:
    """(the bundle of ``src/bundle.yaml``, the programs' mesh, ``{(phase, bucket): Program}``):
    ``handover.read``'s programs and mesh with the bundle the package loader reads beside them."""
    mesh, programs = handover.read(src)
    return read_bundle(src), mesh, programs


def kernelcache(args: list[str]) -> int:
    """``DIR MESH [TRACE_REGION_SIZE]``: every program handed over in ``DIR``, both sampling
    variants, once through ttnn's calls on preset ``MESH`` (``TT_METAL_CACHE`` fills as they
    compile)."""
    import ttnn

    src, mesh_name = args[:2]
    trace_region_size = int(args[2]) if len(args) > 2 else 0
    bundle, pmesh, programs = handed_over(src)
    mesh = meshmod.resolve(mesh_name)
    device = ttnn.open_mesh_device(ttnn.MeshShape(*mesh.shape), trace_region_size=trace_region_size)
    try:
        for (phase, b), prog in programs.items():
            for sampling in samplings(phase):
                fw = lower_forward(bundle, pmesh, prog, sampling)
                r = validate(ttnn, device, prog, fw)
                print(f"{phase}-{b} {sampling}: {r.calls} calls, refused {sorted(r.refused)}", flush=True)
    finally:
        ttnn.close_mesh_device(device)
    return 0


def mockcheck(args: list[str]) -> int:
    """``MESH DIR...``: validate the programs handed over in each ``DIR`` on preset ``MESH``, each
    program as it is (the tests hand over programs with each decoder layer kind once:
    ``tests/handover_helpers.py``); one ``RESULT {json}`` line per program."""
    import ttnn

    mesh_name, dirs = args[0], args[1:]
    device = open_mesh(ttnn, meshmod.resolve(mesh_name))
    grid = worker_grid(device)
    try:
        for path in dirs:
            bundle, pmesh, programs = handed_over(path)
            for (phase, bucket), prog in programs.items():
                fw = lower_forward(bundle, pmesh, prog, samplings(phase)[0], grid=grid)  # verify: host
                r = validate(ttnn, device, prog, fw)
                print("RESULT " + json.dumps({"dir": path, "mesh": mesh_name, "phase": phase, "bucket": bucket,
                                              "calls": r.calls, "grid": list(grid),
                                              "accepted": sum(r.accepted.values()),
                                              "by_signature": dict(r.by_signature),
                                              "refused_calls": sum(r.refusals.values()),
                                              "refused": {fn: list(v) for fn, v in r.refused.items()}}), flush=True)
    finally:
        ttnn.close_mesh_device(device)
    return 0


COMMANDS = {"kernelcache": kernelcache, "mockcheck": mockcheck}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in COMMANDS:
        print(f"usage: python -m ttbundle.ttnnproc {{{'|'.join(COMMANDS)}}} ARGS...", file=sys.stderr)
        return 2
    return COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
