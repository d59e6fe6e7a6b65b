"""Advice when a plan does not fit: the largest explicit KV pool that fits (:func:`largest_pool`,
:func:`pool_diagnostic`) and concrete changes, each verified by re-planning (:func:`fixes`)."""

from __future__ import annotations

from .. import mesh as meshmod
from ..errors import Diagnostic, InvalidInput
from ..kvpool import gib as _gib, pool_blocks, pool_tokens
from ..mesh import Mesh
from .make import Plan, make_plan


def largest_pool(bundle, mesh: Mesh) -> int | None:
    """The largest explicit ``max_tokens_all_users`` (whole blocks) with which ``bundle`` fits
    ``mesh``, by re-planning; None when not even one ``max_model_len`` sequence fits."""
    rt = bundle.spec.runtime

    def fits(blocks: int) -> bool:
        return make_plan(_with(bundle, max_tokens_all_users=pool_tokens(rt, blocks)), mesh).fits
    lo = pool_blocks(rt, rt.max_model_len)
    if not fits(lo):
        return None
    hi = lo * 2
    while fits(hi):  # grow until it does not fit (DRAM is finite)
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return pool_tokens(rt, lo)


def pool_diagnostic(bundle, p: Plan) -> Diagnostic | None:
    """For a plan that does not fit with an explicit ``runtime.max_tokens_all_users``: where,
    the arithmetic (pool bytes against what weights, activations and trace region leave) and
    the fix (the largest pool that fits, which `auto` picks)."""
    rt = bundle.spec.runtime
    if p.fits or not isinstance(rt.max_tokens_all_users, int):
        return None
    m, kv = p.memory, p.kv
    left = m.dram - (m.weights + m.activations + m.trace_region)
    msg = (f"max_tokens_all_users={rt.max_tokens_all_users:,} does not fit {p.mesh.describe()}: "
           f"the KV pool of {kv['num_blocks']:,} blocks x {kv['block_size']} takes {_gib(m.kv_cache)} "
           f"per chip, {_gib(max(left, 0))} is left after weights {_gib(m.weights)}, activations "
           f"{_gib(m.activations)} and trace region {_gib(m.trace_region)}")
    best = largest_pool(bundle, p.mesh)
    if best is not None:
        msg += f"; fix: max_tokens_all_users: {best} (the largest that fits) or `auto`"
    else:
        msg += (f"; not even one max_model_len={rt.max_model_len} sequence fits: use smaller weight "
                f"dtypes or a bigger mesh (`ttbundle plan --mesh {p.mesh.name}` lists fixes)")
    return bundle.locate(("runtime", "max_tokens_all_users"), msg)


def _with(bundle, **runtime):
    spec = bundle.spec.model_copy(update={"runtime": bundle.spec.runtime.model_copy(update=runtime)})
    return type(bundle)(spec, bundle.arch, bundle.family, bundle.file, bundle.base_dir, bundle.positions)


def _with_dtypes(bundle, **groups):
    pol = bundle.spec.weights.dtypes.model_copy(update=groups)
    w = bundle.spec.weights.model_copy(update={"dtypes": pol})
    spec = bundle.spec.model_copy(update={"weights": w})
    return type(bundle)(spec, bundle.arch, bundle.family, bundle.file, bundle.base_dir, bundle.positions)


def fixes(bundle, p: Plan) -> list[str]:
    """Concrete changes that would make ``p`` fit, each verified by re-planning."""
    out: list[str] = []
    mesh, rt = p.mesh, bundle.spec.runtime
    over = p.memory.total - p.memory.dram
    # smaller dtypes
    present = {t.group for t in p.tensors}
    for groups in ({"attention": "bfp8", "mlp": "bfp8", "experts": "bfp8", "lm_head": "bfp8"},
                   {"attention": "bfp8", "mlp": "bfp4", "experts": "bfp4", "lm_head": "bfp8"}):
        # the label is the exact YAML to write under weights.dtypes (groups this model has)
        label = "{" + ", ".join(f"{g}: {dt}" for g, dt in groups.items() if g in present) + "}"
        try:
            q = make_plan(_with_dtypes(bundle, **groups), mesh)
        except InvalidInput:
            continue
        if q.memory.weights < p.memory.weights:
            verdict = "fits" if q.fits else f"still {_gib(q.memory.total - q.memory.dram)} over"
            out.append(f"weights.dtypes: {label}: weights {_gib(p.memory.weights)} -> "
                       f"{_gib(q.memory.weights)} per chip ({verdict})")
            if q.fits:
                break
    # bigger mesh of the same chip
    for cand in sorted(meshmod.PRESETS.values(), key=lambda m: m.num_devices):
        if cand.chip.arch != mesh.chip.arch or cand.num_devices <= mesh.num_devices:
            continue
        try:
            q = make_plan(bundle, cand)
        except InvalidInput:
            continue
        if q.fits:
            out.append(f"a bigger mesh: {cand.describe()} ({cand.num_devices} chips) fits: weights "
                       f"{_gib(q.memory.weights)} per chip of {_gib(q.memory.dram)}, a KV pool of "
                       f"{q.kv['max_tokens_all_users']:,} tokens ({_gib(q.memory.kv_cache)})")
            break
    # KV: a smaller pool, a shorter context or fewer sequences
    kv_per_token = p.memory.kv_cache / max(1, p.kv["num_blocks"] * rt.kv_block_size)
    if isinstance(rt.max_tokens_all_users, int) and over < p.memory.kv_cache:
        best = largest_pool(bundle, mesh)
        if best is not None:
            out.append(f"runtime.max_tokens_all_users: {rt.max_tokens_all_users} -> {best} (the "
                       f"largest pool that fits, or `auto`; KV cache "
                       f"{kv_per_token * rt.kv_block_size / (1 << 20):.2f} MiB per block per chip)")
    if p.memory.kv_cache > 0 and over < p.memory.kv_cache:
        for field_name, step in (("max_model_len", rt.kv_block_size), ("max_num_seqs", 1)):
            cur = getattr(rt, field_name)
            if field_name == "max_model_len" and isinstance(rt.max_tokens_all_users, int):
                continue  # the pool, not the context, sizes an explicit pool's KV cache
            lo, hi, best = 1, (cur - 1) // step, None  # search in whole steps (blocks / sequences)
            while lo <= hi:  # largest value that fits, by re-planning
                mid = (lo + hi) // 2
                try:
                    ok = make_plan(_with(bundle, **{field_name: mid * step}), mesh).fits
                except InvalidInput:
                    ok = False
                if ok:
                    best, lo = mid * step, mid + 1
                else:
                    hi = mid - 1
            if best:
                out.append(f"runtime.{field_name}: {cur} -> {best} (KV cache "
                           f"{kv_per_token * rt.kv_block_size / (1 << 20):.2f} MiB per block per chip)")
    if not out:
        out.append("no single change found; combine smaller dtypes with a bigger mesh")
    return out
