"""Programs lowered from a spec and handed to a ttnn process (``backends/ttnn/handover``): the
tests' side of the mock validation. The backend lowers nothing from a spec; the tests plan and
lower here, the way ``build`` does, and hand the programs over."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from ttbundle import __version__, lower as lowermod, spec as specmod
from ttbundle.backends.ttnn import handover
from ttbundle.package.templates import render_bundle_yaml, resolved_spec
from ttbundle.plan.make import make_plan


def one_layer_per_kind(program):
    """``program`` with each decoder layer kind repeated once (its layers run the same calls on
    the same shapes; only weights and caches differ): enough to validate every call. Each kind's
    layer keeps the traits of the kind's first layer, and the dims count the layers run
    (``program.verify`` wants one ``LayerTraits`` per layer run, and the dims' count to match)."""
    if program.phase == "vision":  # a vision program: the text's traits and dims, as they are
        return dataclasses.replace(program, layers=tuple(dataclasses.replace(lp, count=1) for lp in program.layers))
    traits, start = [], 0
    for lp in program.layers:
        if lp.kind not in ("embedding", "head"):
            traits.append(program.layer_traits[start])
            start += lp.count
    return dataclasses.replace(program, layers=tuple(dataclasses.replace(lp, count=1) for lp in program.layers),
                               layer_traits=tuple(traits),
                               dims=dataclasses.replace(program.dims, num_hidden_layers=len(traits)))


def for_mesh(spec_path, mesh_name: str, changes: dict | None = None):
    """The spec at ``spec_path`` with ``mesh_name`` its only target (per-target sharding of other
    targets dropped, no weights source; top-level ``changes`` set), loaded, and its plan on that
    mesh."""
    d = yaml.safe_load(open(spec_path))
    d.update(changes or {})
    d["targets"] = [mesh_name]
    sh = d.get("sharding") or {}
    if sh.get("targets"):  # per-target overrides of the other targets do not apply here
        sh["targets"] = {k: x for k, x in sh["targets"].items() if k == mesh_name}
    d.get("weights", {}).pop("source", None)
    bundle = specmod.loads(yaml.safe_dump(d), str(spec_path))
    return bundle, make_plan(bundle, mesh_name)


def smallest_programs(bundle, plan) -> dict:
    """The smallest prefill and decode bucket's program (and vision's, where the model has one;
    verify's, where it speculates), each decoder layer kind once."""
    ts = lowermod.trace_set(bundle)
    keys = [min(k for k in ts if k[0] == phase) for phase in ("prefill", "decode", "verify", "vision")
            if any(k[0] == phase for k in ts)]
    return {k: one_layer_per_kind(lowermod.lower(bundle, plan, *k)) for k in keys}


def hand_over(spec_paths, mesh_name: str, out: Path, changes: dict | None = None) -> list[str]:
    """For each spec (with top-level ``changes``): its smallest programs on ``mesh_name`` handed
    over in ``out/<spec stem>`` (what ``python -m ttbundle.ttnnproc mockcheck MESH DIR...``
    reads)."""
    dirs = []
    for path in spec_paths:
        bundle, plan = for_mesh(path, mesh_name, changes)
        yml = render_bundle_yaml(resolved_spec(bundle, plan), __version__)
        dirs.append(str(handover.write(Path(out) / Path(path).stem, yml, smallest_programs(bundle, plan))))
    return dirs
