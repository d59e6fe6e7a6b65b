"""Lowering: per-device programs agree with the plan, shapes are the shards the weights have,
and a program depends on its own bucket only."""

from __future__ import annotations

import json
import math

import pytest

from ttbundle import lower, mesh as meshmod, spec as specmod
from ttbundle.plan.make import make_plan
from ttbundle.families.base import Dim
from ttbundle.tiles import round_up

from test_build import spec_text

MESHES = ["N150", "N300", "T3K", "TG", "(2,4)"]


@pytest.fixture(scope="module")
def bundle():
    return specmod.loads(spec_text() .replace("targets: [N150, T3K, TG]", "targets: [N150, N300, T3K, TG]"),
                         "tiny.yaml")


def programs(bundle, mesh):
    p = make_plan(bundle, mesh)
    return p, {(ph, b): lower.lower(bundle, p, ph, b).to_json() for ph, b in lower.trace_set(bundle)}


@pytest.mark.parametrize("mesh", MESHES)
def test_programs_agree_with_the_plan(bundle, mesh):
    p, progs = programs(bundle, mesh)
    tp = {t.name: t for t in p.tensors}
    plan_coll = sum(c.count for c in p.collectives)
    for (phase, b), prog in progs.items():
        json.dumps(prog)  # plain JSON data
        assert prog["phase"] == phase and prog["bucket"] == b
        assert prog["rows"] == (b if phase == "prefill" else 32)
        assert prog["totals"]["collectives"] == plan_coll
        assert [(l["kind"], l["count"]) for l in prog["layers"]] == [(k, c) for k, c, _ in p.programs]
        for layer in prog["layers"]:
            for s in layer["steps"]:
                if s.get("op") == "matmul":
                    assert s["w_shape"] == tp[s["w"]].device_shape and s["w_dtype"] == tp[s["w"]].dtype
                    assert s["in_shape"][-1] == s["w_shape"][-2]  # contraction matches the shard
                    assert s["out_shape"][-1] == s["w_shape"][-1]
                    lead = s["in_shape"][0]
                    assert s["flops"] == 2 * lead * s["w_shape"][-2] * s["w_shape"][-1]
                if s.get("collective"):
                    n = s["devices"]
                    assert n == math.prod(p.mesh.axis_size(a) for a in s["axes"]) > 1
                    assert s["payload_bytes"] == math.prod(s["shape"]) * 2
    # the traces' regions add up to the plan's trace region (rounded to 1 MiB, as the plan does)
    total = sum(pr["trace_region_bytes"] for pr in progs.values())
    assert round_up(total, 1 << 20) == p.trace_region_size


def test_collective_payloads_per_token_match_the_plan():
    # vocab 512: no padded dims (the plan sizes a padded activation as ceil(len / n), the program
    # as the tile-padded shard the device holds)
    bundle = specmod.loads(spec_text().replace("vocab_size: 500", "vocab_size: 512"), "t.yaml")
    p, progs = programs(bundle, "T3K")
    prog = progs[("decode", 1)]
    per_token = {}
    for layer in prog["layers"]:
        for s in layer["steps"]:
            if s.get("collective"):
                per_token.setdefault((layer["kind"], s["collective"]), []).append(s["payload_bytes"] // prog["rows"])
    for c in p.collectives:
        assert c.payload_bytes_per_token in per_token[(c.layer, c.kind)]


def test_a_program_depends_only_on_its_bucket(bundle):
    _, before = programs(bundle, "T3K")
    more = specmod.loads(spec_text().replace("prefill: [32, 64]", "prefill: [32, 64, 128]")
                         .replace("decode: [1, 8]", "decode: [1, 2, 8]"), "tiny.yaml")
    _, after = programs(more, "T3K")
    for k, prog in before.items():
        assert json.dumps(after[k], sort_keys=True) == json.dumps(prog, sort_keys=True), k


def test_trace_mode_decides_which_programs_are_traced(bundle):
    b = specmod.loads(spec_text().replace("runtime: {", "runtime: {trace_mode: decode_only, "), "t.yaml")
    p, progs = programs(b, "N150")
    assert [k for k, v in progs.items() if v["traced"]] == [("decode", 1), ("decode", 8)]
    assert progs[("prefill", 32)]["trace_region_bytes"] == 0


def test_prefill_head_runs_on_the_last_tile_row(bundle):
    _, progs = programs(bundle, "N150")
    head = progs[("prefill", 64)]["layers"][-1]
    mm = next(s for s in head["steps"] if s.get("op") == "matmul")
    assert mm["in_shape"][0] == 32 and mm["w"] == "lm_head"


