"""Plan + one (phase, bucket) -> the static per-device program a trace captures.

``lower(bundle, plan, phase, bucket)`` walks the plan's per-layer steps (``Plan.programs``) with a
concrete token count and returns plain JSON data: every op with the per-device shapes of its
inputs, weight and output, every collective with the bytes it moves, a memory plan and the trace
region the captured program needs. The result depends only on the arch, the resolved sharding and
dtypes, the runtime's KV settings, the mesh, the phase and the bucket, never on the other buckets,
so adding a bucket leaves every other program byte-identical (``cache`` keys rely on that).

Which elements each device holds is ``layout``'s rule; shapes here come from it.

Shapes: activations are ``[rows, *features]`` per device, ``rows`` = prefill bucket tokens (one
sequence) or the decode batch padded to a tile row of 32 (tt_transformers pads decode rows to 32).
"""

from __future__ import annotations

import math

from .families.base import Combine, Dim, Embed, Linear, Local, Logits, Norm, Residual
from .layout import local_len
from .mesh import AXES
from .plan import ACT_BYTES, TILE, TRACE_BYTES_PER_OP, Plan

FORMAT = "ttbundle.program/1"
PHASES = ("prefill", "decode")


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


# ---- the trace set -----------------------------------------------------------------------------
def trace_set(bundle) -> list[tuple[str, int]]:
    """Every (phase, bucket) the package holds a program for: prefill buckets, then decode."""
    b = bundle.buckets
    return [("prefill", n) for n in b.prefill] + [("decode", n) for n in b.decode]


def traced(bundle, phase: str) -> bool:
    mode = bundle.spec.runtime.trace_mode
    return mode == "all" or (mode == "decode_only" and phase == "decode")


def program_name(phase: str, bucket: int) -> str:
    return f"{phase}-{bucket}"


# ---- lowering ------------------------------------------------------------------------------------
def lower(bundle, plan: Plan, phase: str, bucket: int) -> dict:
    """The static per-device program of ``bundle`` on ``plan.mesh`` for one (phase, bucket)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    mesh, policy, rt = plan.mesh, bundle.spec.sharding, bundle.spec.runtime
    fam, a = bundle.family, bundle.arch
    decls = {t.name: t for t in fam.tensors(a)}
    tplan = {t.name: t for t in plan.tensors}
    rows = bucket if phase == "prefill" else _round_up(bucket, TILE)
    # tokens each attention row sees: the bucket (prefill from position 0), or the longest context
    context = bucket if phase == "prefill" else rt.max_model_len

    hid = decls["embed"].dims[1] if "embed" in decls else Dim("hidden_size", a.hidden_size)
    dims: dict[str, tuple[Dim, ...]] = {"h": (hid,)}

    def shape(name: str, spec, lead: int) -> list[int]:
        return [lead] + [local_len(d, tuple(ax), mesh, policy) for d, ax in zip(dims[name], spec)]

    layers = []
    tot = {"ops": 0, "collectives": 0, "flops": 0, "collective_payload_bytes": 0,
           "collective_traffic_bytes": 0}
    peak_act = 0
    for kind, count, steps in plan.programs:
        out_steps = []
        live: dict[str, int] = {}
        cur: dict[str, list] = {}  # each activation's spec as the steps so far left it
        # the head runs on the last tile row of a prefill (the token sampled next)
        lead = min(rows, TILE) if kind == "head" and phase == "prefill" else rows
        for st in steps:
            if st.kind != "op":
                n = math.prod(mesh.axis_size(x) for x in st.axes)
                spec_now = cur.get(st.act) or [[] for _ in dims[st.act]]
                shp = shape(st.act, spec_now, lead)
                payload = math.prod(shp) * ACT_BYTES
                traffic = 2 * (n - 1) * payload // n if st.kind == "all_reduce" else (n - 1) * payload
                out_steps.append({"collective": st.kind, "act": st.act, "axes": list(st.axes),
                                  "dim": st.dim + 1 if st.kind == "all_gather" else None,
                                  "devices": n, "shape": shp, "payload_bytes": payload,
                                  "traffic_bytes": traffic})
                if st.kind == "all_gather":
                    cur[st.act] = [[] if i == st.dim else x for i, x in enumerate(spec_now)]
                tot["collectives"] += count
                tot["collective_payload_bytes"] += payload * count
                tot["collective_traffic_bytes"] += traffic * count
                continue
            op = st.op
            specs = dict(st.specs)
            rec = _op_record(op, specs, dims, decls, tplan, shape, lead, context, a)
            out_steps.append(rec)
            if rec.get("out"):
                cur[rec["out"]] = rec["out_spec"]
                live[rec["out"]] = math.prod(rec["out_shape"]) * ACT_BYTES
            tot["ops"] += count
            tot["flops"] += rec["flops"] * count
        peak_act = max(peak_act, sum(live.values()))
        layers.append({"kind": kind, "count": count, "steps": out_steps})

    is_traced = traced(bundle, phase)
    trace_ops = tot["ops"] + tot["collectives"]
    # the package reserves the sum over its traces, rounded up to 1 MiB (as ``make_plan`` does)
    trace_bytes = trace_ops * TRACE_BYTES_PER_OP if is_traced else 0
    mem = {"weights": plan.memory.weights, "kv_cache": plan.memory.kv_cache,
           "activations": peak_act, "trace_region": trace_bytes}
    mem["total"] = sum(mem.values())
    mem["dram"] = plan.memory.dram
    return {
        "format": FORMAT,
        "bundle": plan.bundle_name,
        "family": plan.family,
        "mesh": {"name": mesh.name, "shape": list(mesh.shape), "arch": mesh.chip.arch},
        "phase": phase,
        "bucket": bucket,
        "rows": rows,
        "context": context,
        "traced": is_traced,
        "trace_region_bytes": trace_bytes,
        "kv_cache": {"dtype": plan.kv["dtype"], "num_blocks": plan.kv["num_blocks"],
                     "block_size": plan.kv["block_size"],
                     "entries": [dict(e) for e in plan.kv["entries"]]},
        "totals": tot,
        "memory": mem,
        "layers": layers,
    }


def _op_record(op, specs: dict, dims: dict, decls: dict, tplan: dict, shape, lead: int,
               context: int, a) -> dict:
    """One op: per-device input/weight/output shapes and an estimate of its FLOPs."""
    def sp(name):
        return [list(x) for x in specs[name]]

    if isinstance(op, Embed):
        w = tplan[op.w]
        dims[op.out] = decls[op.w].dims[1:]
        out = shape(op.out, specs[op.out], lead)
        return {"op": "embedding", "w": op.w, "w_shape": w.device_shape, "w_dtype": w.dtype,
                "out": op.out, "out_shape": out, "out_spec": sp(op.out), "flops": 0}
    if isinstance(op, Norm):
        dims[op.out] = dims[op.x]
        inp = shape(op.x, specs[op.x], lead)
        return {"op": "rms_norm", "x": op.x, "in_shape": inp, "w": op.w, "out": op.out,
                "out_shape": shape(op.out, specs[op.out], lead), "out_spec": sp(op.out),
                "flops": 4 * math.prod(inp)}
    if isinstance(op, Linear):
        w, wd = tplan[op.w], decls[op.w].dims
        dims[op.out] = wd[:-2] + (wd[-1],) if len(wd) == 3 else (wd[-1],)
        inp = shape(op.x, specs[op.x], lead)
        out = shape(op.out, specs[op.out], lead)
        k, n = w.device_shape[-2], w.device_shape[-1]
        experts = w.device_shape[0] if len(w.device_shape) == 3 else 1
        # a replicated input meeting a split weight: each device reads its slice of the input
        inp[-1] = k
        if len(inp) == 3 and len(w.device_shape) == 3:
            inp[1] = experts
        return {"op": "matmul", "x": op.x, "in_shape": inp, "w": op.w, "w_shape": w.device_shape,
                "w_dtype": w.dtype, "out": op.out, "out_shape": out, "out_spec": sp(op.out),
                "flops": 2 * lead * k * n * experts}
    if isinstance(op, Local):
        lead_in = op.ins[0]
        dims[op.out] = (op.out_dim,) if op.out_dim else dims[lead_in]
        ins = [shape(i, specs[i], lead) for i in op.ins]
        out = shape(op.out, specs[op.out], lead)
        if op.kernel in ("attention", "mla_attention") or "attention" in op.kernel:
            # QK^T and PV over the context (causal prefill: half of it on average)
            seen = context // 2 if lead == context else context
            flops = 4 * lead * seen * math.prod(out[1:])
        else:
            flops = 4 * math.prod(out)
        return {"op": op.kernel, "what": op.what, "ins": list(op.ins), "in_shapes": ins,
                "out": op.out, "out_shape": out, "out_spec": sp(op.out), "flops": flops}
    if isinstance(op, Combine):
        dims[op.out] = dims[op.x][1:]
        inp = shape(op.x, specs[op.x], lead)
        return {"op": "combine", "x": op.x, "in_shape": inp, "out": op.out,
                "out_shape": shape(op.out, specs[op.out], lead), "out_spec": sp(op.out),
                "flops": 2 * math.prod(inp)}
    if isinstance(op, Residual):
        inp = shape(op.x, specs[op.x], lead)
        return {"op": "residual_add", "x": op.x, "in_shape": inp, "flops": math.prod(inp)}
    if isinstance(op, Logits):
        inp = shape(op.x, specs[op.x], lead)
        return {"op": "logits", "x": op.x, "in_shape": inp, "flops": 0}
    raise TypeError(op)  # pragma: no cover


def summary(program: dict) -> dict:
    """The figures `build --dry-run` lists per trace."""
    t = program["totals"]
    return {"phase": program["phase"], "bucket": program["bucket"], "rows": program["rows"],
            "traced": program["traced"], "ops": t["ops"], "collectives": t["collectives"],
            "flops_per_device": t["flops"], "trace_region_bytes": program["trace_region_bytes"],
            "activation_bytes": program["memory"]["activations"],
            "collective_traffic_bytes": t["collective_traffic_bytes"]}


__all__ = ["AXES", "FORMAT", "PHASES", "lower", "program_name", "summary", "trace_set", "traced"]
