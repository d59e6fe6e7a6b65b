"""``ttbundle validate``'s checks: a spec loaded and planned on each target mesh, every problem
reported at once (the schema's, then each mesh's divisibility errors), and the wording of a
target it does not fit. The CLI parses, calls these and prints."""

from __future__ import annotations

from pathlib import Path

from .. import mesh as meshmod, spec as specmod
from ..errors import InvalidInput, TTBundleError
from .advice import pool_diagnostic
from .make import Plan, make_plan
from .memory import shortfall
from .sharding import sharding_diagnostics


def targets(bundle, mesh: str | None) -> list[str]:
    """``[mesh]`` (an unknown mesh name is InvalidInput listing the valid ones), else the spec's
    targets."""
    if mesh:
        meshmod.resolve(mesh)
        return [mesh]
    return list(bundle.spec.targets)


def plan_targets(path: str | Path, mesh: str | None = None):
    """``(bundle, {target: Plan})`` for the spec at ``path`` on ``mesh`` (default: every target).
    A spec with errors raises ``InvalidSpec`` with the schema's diagnostics and, when the schema
    holds, each target mesh's divisibility errors; a plan that does not resolve raises
    InvalidInput listing every target's diagnostics. Plans that do not fit are returned (see
    :func:`does_not_fit`)."""
    try:
        bundle = specmod.load(path)
    except specmod.InvalidSpec as e:  # schema-valid: add each mesh's errors, all at once
        for t in [mesh] if mesh else e.bundle.spec.targets:
            if meshmod.try_resolve(t) is not None:
                e.diagnostics += sharding_diagnostics(e.bundle, t)
        raise
    diags, plans = [], {}
    for t in targets(bundle, mesh):
        try:
            plans[t] = make_plan(bundle, t)
        except TTBundleError as e:
            diags += e.diagnostics or []
    if diags:
        raise InvalidInput(f"{path}: invalid spec", diags)
    return bundle, plans


def does_not_fit(path, target: str, plan: Plan, bundle) -> list[str]:
    """The lines for a target ``plan`` does not fit: the shortfall (per replica when the target
    is split) with the command that shows the plan, and the KV pool's arithmetic and fix when the
    spec sets the pool (:func:`advice.pool_diagnostic`)."""
    m = plan.mesh
    each = f" (each of its {m.replicas} replicas on {m.rows}x{m.cols})" if m.target_shape else ""
    lines = [f"{path}: {target}{each}: does not fit: {shortfall(plan.memory)}; "
             f"run `ttbundle plan {path} --mesh {target}`"]
    pool = pool_diagnostic(bundle, plan)
    if pool is not None:
        lines.append(f"  {pool}")
    return lines
