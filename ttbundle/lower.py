"""Plan + one (phase, bucket) -> the static per-device program a trace captures.

``lower(bundle, plan, phase, bucket)`` walks the plan's per-layer steps (``Plan.programs``) with a
concrete token count and returns the typed program (``program.Program``; its JSON form is what a
package holds): every op with the per-device shapes of its inputs, weight and output, every
collective with the bytes it moves, the weights it reads and where they live, a memory plan and
the trace region the captured program needs. The result depends only on the arch, the resolved sharding and
dtypes, the runtime's KV settings, the mesh, the phase and the bucket, never on the other buckets,
so adding a bucket leaves every other program byte-identical (``cache`` keys rely on that).

Which elements each device holds is ``layout``'s rule; shapes here come from it.

Shapes: activations are ``[rows, *features]`` per device, ``rows`` = prefill bucket tokens (one
sequence) or the decode batch padded to a tile row of 32 (tt_transformers pads decode rows to 32);
a verify program (speculative decoding) has ``bucket x (k + 1)`` rows padded to a tile
(``speculative.verify_rows``), its head on every row.
"""

from __future__ import annotations

import math

from .families.base import Combine, Dim, Embed, Linear, Local, Logits, Norm, Residual
from .layout import Policy, axes_of, local_len
from .mesh import AXES
from .plan.make import Plan
from .plan.memory import ACT_BYTES, TRACE_BYTES_PER_OP
from .program import FORMAT, Activation, LayerProgram, Op, Program, Step, WeightRef
from .speculative import rows_per_seq, verify_buckets, verify_rows
from .tiles import TILE, round_up as _round_up
from .traits import Dims, model_traits

PHASES = ("prefill", "decode", "verify", "vision")


# ---- the trace set -----------------------------------------------------------------------------
def trace_set(bundle) -> list[tuple[str, int]]:
    """Every (phase, bucket) the package holds a program for: prefill buckets, then decode, then
    verify (speculative decoding: one per decode bucket), then vision."""
    b = bundle.buckets
    vision = [("vision", n) for n in bundle.vision.buckets] if bundle.vision is not None else []
    verify = [("verify", n) for n in verify_buckets(bundle)]
    return [("prefill", n) for n in b.prefill] + [("decode", n) for n in b.decode] + verify + vision


def lower_all(bundle, plan: Plan) -> dict:
    """Every program of the package (:func:`trace_set`), keyed (phase, bucket); the model's
    traits built once for all of them."""
    traits = model_traits(bundle.family, bundle.arch)
    return {k: lower(bundle, plan, *k, traits=traits) for k in trace_set(bundle)}


def traced(bundle, phase: str) -> bool:
    mode = bundle.spec.runtime.trace_mode
    return mode == "all" or (mode == "decode_only" and phase in ("decode", "verify"))


# ---- lowering ------------------------------------------------------------------------------------
def lower(bundle, plan: Plan, phase: str, bucket: int, traits=None) -> Program:
    """The static per-device program of ``bundle`` on ``plan.mesh`` for one (phase, bucket).
    ``traits``: :func:`traits.model_traits` of the bundle, when the caller has them already."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    mesh, policy, rt = plan.mesh, bundle.spec.sharding, bundle.spec.runtime
    fam, a = bundle.family, bundle.arch
    decls = {t.name: t for t in fam.tensors(a)}
    tplan = {t.name: t for t in plan.tensors}
    rows = bucket if phase == "prefill" else _round_up(bucket, TILE)
    if phase == "verify":  # each sequence's last token and its k proposals: every row's logits
        rows = verify_rows(bucket, rows_per_seq(bundle) - 1)
    # tokens each attention row sees: the bucket (prefill from position 0), or the longest context
    context = bucket if phase == "prefill" else rt.max_model_len

    hid = decls["embed"].dims[1] if "embed" in decls else Dim("hidden_size", a.hidden_size)
    dims: dict[str, tuple[Dim, ...]] = {"h": (hid,)}
    kinds, row_of = plan.programs, {}
    if phase == "vision":  # the vision encoder on ``bucket`` images: rows are their patches
        kinds = plan.vision
        rows, row_of = fam.vision_rows(a, bucket)
        context = rows
        dims.update(fam.vision_inputs(a))

    def act(name: str, spec, lead: int) -> Activation:
        lead = row_of.get(name, lead)
        sp = tuple(tuple(x) for x in spec)
        return Activation(name, (lead,) + tuple(local_len(d, ax, mesh, policy) for d, ax in zip(dims[name], sp)), sp)

    layers = []
    tot = {"ops": 0, "collectives": 0, "flops": 0, "collective_payload_bytes": 0,
           "collective_traffic_bytes": 0}
    peak_act = 0
    for kind, count, steps in kinds:
        out_steps = []
        live: dict[str, int] = {}
        cur: dict[str, tuple] = {}  # each activation's spec as the steps so far left it
        # the head runs on the last tile row of a prefill (the token sampled next)
        lead = min(rows, TILE) if kind == "head" and phase == "prefill" else rows
        for st in steps:
            if st.kind != "op":
                n = math.prod(mesh.axis_size(x) for x in st.axes)
                x = act(st.act, cur.get(st.act) or [() for _ in dims[st.act]], lead)
                payload = math.prod(x.shape) * ACT_BYTES
                traffic = 2 * (n - 1) * payload // n if st.kind == "all_reduce" else (n - 1) * payload
                out_steps.append(Step(Op(st.kind), (x,), axes=tuple(st.axes), devices=n,
                                      dim=st.dim + 1 if st.kind == "all_gather" else None,
                                      feature=st.feature, payload_bytes=payload, traffic_bytes=traffic))
                if st.kind == "all_gather":
                    cur[st.act] = tuple(() if i == st.dim else e for i, e in enumerate(x.spec))
                tot["collectives"] += count
                tot["collective_payload_bytes"] += payload * count
                tot["collective_traffic_bytes"] += traffic * count
                continue
            rec = _op_step(st.op, dict(st.specs), dims, decls, tplan, act, lead, context)
            out_steps.append(rec)
            if rec.out is not None:
                cur[rec.out.name] = rec.out.spec
                live[rec.out.name] = math.prod(rec.out.shape) * ACT_BYTES
            tot["ops"] += count
            tot["flops"] += rec.flops * count
        peak_act = max(peak_act, sum(live.values()))
        layers.append(LayerProgram(kind, count, tuple(out_steps)))

    is_traced = traced(bundle, phase)
    trace_ops = tot["ops"] + tot["collectives"]
    # the package reserves the sum over its traces, rounded up to 1 MiB (as ``make_plan`` does)
    trace_bytes = trace_ops * TRACE_BYTES_PER_OP if is_traced else 0
    mem = {"weights": plan.memory.weights, "kv_cache": plan.memory.kv_cache,
           "activations": peak_act, "trace_region": trace_bytes}
    mem["total"] = sum(mem.values())
    mem["dram"] = plan.memory.dram
    traits, layer_traits = traits or model_traits(fam, a)
    weights = {t.name: WeightRef(t.name, tuple(axes_of(e) for e in t.spec), tuple(t.device_shape), t.dtype,
                                 decls[t.name].layers) for t in plan.tensors}
    return Program(
        bundle=plan.bundle_name, family=plan.family,
        mesh={"name": mesh.name, "shape": list(mesh.shape), "arch": mesh.chip.arch},
        phase=phase, bucket=bucket, rows=rows, context=context, traced=is_traced,
        trace_region_bytes=trace_bytes,
        kv_cache={"dtype": plan.kv["dtype"], "num_blocks": plan.kv["num_blocks"],
                  "block_size": plan.kv["block_size"], "entries": [dict(e) for e in plan.kv["entries"]]},
        totals=tot, memory=mem, layers=tuple(layers), weights=weights,
        policy=Policy.of(policy).to_json(), traits=traits, layer_traits=layer_traits,
        dims=Dims.of_arch(a, rt.max_model_len),
        rows_per_seq=rows_per_seq(bundle) if phase == "verify" else 0)


def _op_step(op, specs: dict, dims: dict, decls: dict, tplan: dict, act, lead: int, context: int) -> Step:
    """One op: its input and output activations (per-device shapes) and an estimate of its FLOPs."""
    if isinstance(op, Embed):
        dims[op.out] = decls[op.w].dims[1:]
        return Step(Op.EMBEDDING, (), act(op.out, specs[op.out], lead), w=op.w)
    if isinstance(op, Norm):
        dims[op.out] = dims[op.x]
        x = act(op.x, specs[op.x], lead)
        return Step(Op.RMS_NORM, (x,), act(op.out, specs[op.out], lead), w=op.w, flops=4 * math.prod(x.shape))
    if isinstance(op, Linear):
        w, wd = tplan[op.w], decls[op.w].dims
        dims[op.out] = wd[:-2] + (wd[-1],) if len(wd) == 3 else (wd[-1],)
        k, n = w.device_shape[-2], w.device_shape[-1]
        experts = w.device_shape[0] if len(w.device_shape) == 3 else 1
        return Step(Op.MATMUL, (act(op.x, specs[op.x], lead),), act(op.out, specs[op.out], lead), w=op.w,
                    flops=2 * lead * k * n * experts)
    if isinstance(op, Local):
        dims[op.out] = op.out_dims(dims[op.ins[0]])
        ins = tuple(act(i, specs[i], lead) for i in op.ins)
        out = act(op.out, specs[op.out], lead)
        if "attention" in op.kernel:
            # QK^T and PV over the context (causal prefill: half of it on average)
            seen = context // 2 if lead == context else context
            flops = 4 * lead * seen * math.prod(out.shape[1:])
        else:
            flops = 4 * math.prod(out.shape)
        return Step(Op.LOCAL, ins, out, kernel=op.kernel, what=op.what, flops=flops)
    if isinstance(op, Combine):
        dims[op.out] = dims[op.x][1:]
        x = act(op.x, specs[op.x], lead)
        return Step(Op.COMBINE, (x,), act(op.out, specs[op.out], lead), flops=2 * math.prod(x.shape))
    if isinstance(op, Residual):
        x = act(op.x, specs[op.x], lead)
        return Step(Op.RESIDUAL_ADD, (x,), flops=math.prod(x.shape))
    if isinstance(op, Logits):
        return Step(Op.LOGITS, (act(op.x, specs[op.x], lead),))
    raise TypeError(op)  # pragma: no cover


def summary(program: Program) -> dict:
    """The figures `build --dry-run` lists per trace."""
    t = program.totals
    return {"phase": program.phase, "bucket": program.bucket, "rows": program.rows,
            "traced": program.traced, "ops": t["ops"], "collectives": t["collectives"],
            "flops_per_device": t["flops"], "trace_region_bytes": program.trace_region_bytes,
            "activation_bytes": program.memory["activations"],
            "collective_traffic_bytes": t["collective_traffic_bytes"]}


def vision_summaries(bundle, plan: Plan) -> list[dict]:
    """:func:`summary` of every vision program (``ttbundle plan`` lists them); [] without images."""
    return [summary(lower(bundle, plan, ph, n)) for ph, n in trace_set(bundle) if ph == "vision"]


def vision_cap(bundle, plan: Plan) -> dict | None:
    """Where the largest vision bucket holds fewer patches than ``images_per_prompt`` images of
    the processor's largest size need (a cap: requests needing more are refused), the arithmetic
    ``plan`` states: the patches needed and held, each as a vision program's activations per
    chip, the largest image's prompt tokens against a prefill chunk and ``max_model_len``, and
    the chip's memory; None without a cap."""
    vs = bundle.vision
    part = None if vs is None else bundle.family.vision_part(bundle.arch)
    per = None if part is None else part.largest_image(vs)
    if per is None or max(vs.buckets) >= vs.images_per_prompt * per:
        return None
    need, cap = vs.images_per_prompt * per, max(vs.buckets)
    bk = bundle.buckets
    return {"unit": part.BUCKET_UNIT, "images_per_prompt": vs.images_per_prompt, "largest_image": per,
            "need": need, "cap": cap,
            "need_activation_bytes": summary(lower(bundle, plan, "vision", need))["activation_bytes"],
            "cap_activation_bytes": summary(lower(bundle, plan, "vision", cap))["activation_bytes"],
            "largest_image_tokens": part.prompt_tokens_of(vs, per), "cap_image_tokens": part.prompt_tokens_of(vs, cap),
            "prefill_chunk": bk.prefill_chunk or max(bk.prefill), "max_model_len": bundle.spec.runtime.max_model_len,
            "per_chip_total": plan.memory.total, "dram": plan.memory.dram}


__all__ = ["AXES", "FORMAT", "PHASES", "lower", "lower_all", "summary", "trace_set", "traced",
           "vision_cap", "vision_summaries"]
