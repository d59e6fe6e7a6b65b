"""Lanes on the TT platform path through vLLM's engine, without hardware: the tiny llama split into
8 x 1x1 replicas of a T3K (``replicas:``), built with ``--backend ttnn``, served by one engine as 8
lanes; ``tt_lanes_engine_run.py`` runs it with the computing recording double in place of ttnn.
The model cuts the opened T3K with ``create_submeshes`` (the double's, in ttnn's order; the
wheel's own order is checked in tests/tt/test_submeshes_ttnn.py) and runs each lane on its
submesh. References: transformers' greedy ``generate`` on the checkpoint (as
test_runtime_lanes.py does for the emulated mesh) and the emulated mesh's lanes on the same
package and prompts; the double's events for where each lane's traces ran. On the timing device
(``timing_engine_run.py``, async decode on): the device's token rule, and every lane's step
enqueued before any is read back, so the 8 submeshes' modeled steps run side by side (decode
steps, and the chunks of a prefill step on different lanes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime_helpers import hf_greedy, pick, run_engine_script
from test_runtime_lanes import DECODE, PER_LANE, _prompts, lanes_spec

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
TOKENS = 6
# 2-3 per lane, each prompt within two 64-token chunks. Longer prompts may meet a near tie of the
# random model that bf16 flips (not a chunking bug: test_runtime_tt_chunks.py, docs/runtime.md)
LENS = [5, 40, 100, 3, 70, 17, 64, 9, 120, 33, 1, 50, 12, 90, 26, 65, 8, 44]


@pytest.fixture(scope="module")
def lanes_tt(tmp_path_factory):
    from ttbundle.serving.demo import build_package

    d = tmp_path_factory.mktemp("ttlanes")
    pkg = build_package(lanes_spec(), d, "T3K", backend="ttnn", warmup=False)
    prompts = [p["prompt_token_ids"] for p in _prompts(LENS)]
    cases = {"lanes": {"prompts": prompts, "max_tokens": TOKENS, "max_num_seqs": 8 * PER_LANE}}
    env = {k: v for k, v in os.environ.items() if k != "TTBUNDLE_EMULATED"}
    # the engine process imports this checkout's ttbundle (not whichever the venv installed)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    res = run_engine_script(HERE / "tt_lanes_engine_run.py", pkg, cases, env)["lanes"]
    return res, pkg, d / "src-tiny-llama-r1x1", prompts


def test_the_target_opens_whole_and_each_lane_gets_its_submesh(lanes_tt):
    from ttbundle import mesh as meshmod
    res, *_ = lanes_tt
    assert res["opened"] == [[1, 8]]  # the whole T3K, not one replica's 1x1
    want = meshmod.submesh_origins((1, 8), (1, 1))
    assert res["submeshes"] == [[[1, 1], list(o)] for o in want]
    assert res["lane_of_kv"] == list(range(8))
    # every submesh compiled its own programs in warm-up (its own program cache), none while serving
    per = res["compiled_warmup_per_lane"]
    assert per[0] > 0 and len(set(per)) == 1, per
    assert res["compiled_serving"] == 0 and res["violations"] == []


def test_data_parallel_on_a_device_is_still_refused_clearly(lanes_tt):
    res, *_ = lanes_tt
    msg = " ".join((res["dp_refused"] or "").split())
    assert "vLLM data parallel on a Tenstorrent device" in msg and "not implemented yet" in msg, msg
    assert "leave --data-parallel-size out" in msg


def test_lanes_tokens_equal_transformers_and_each_request_stays_on_its_submesh(lanes_tt):
    from ttbundle import mesh as meshmod
    res, _, src, prompts = lanes_tt
    for p, got in zip(prompts, res["tokens"]):
        assert got == hf_greedy(src, p, TOKENS), len(p)
    origin_lane = {tuple(o): i for i, o in enumerate(meshmod.submesh_origins((1, 8), (1, 1)))}
    lane_of, execs = {}, iter(res["executes"])
    # in submission order: with async decode (the token feed is lowered) a decode step is logged
    # when it is read back, after a prefill submitted later
    for s in sorted(res["steps"], key=lambda s: s["at"]):
        for (rid, _, _), lane in zip(s["rows"], s["lanes"]):
            assert lane_of.setdefault(rid, lane) == lane, f"{rid} moved from lane {lane_of[rid]} to {lane}"
        if s["phase"] == "decode":  # one trace per lane with rows, on that lane's submesh, in lane order
            per = {}
            for lane in s["lanes"]:
                per[lane] = per.get(lane, 0) + 1
            ran = [next(execs) for _ in per]
            assert [origin_lane[tuple(e["origin"])] for e in ran] == sorted(per)
            assert [e["key"][:2] for e in ran] == [["decode", pick(DECODE, per[ln])] for ln in sorted(per)]
        else:  # each prefill row on its lane's submesh
            for (rid, _, _), lane in zip(s["rows"], s["lanes"]):
                e = next(execs)
                assert e["key"][0] == "prefill" and origin_lane[tuple(e["origin"])] == lane
    assert next(execs, None) is None
    assert sorted(set(lane_of.values())) == list(range(8))


def test_lanes_tokens_equal_the_emulated_meshs_lanes(lanes_tt):
    """The same package and prompts on the emulated mesh's lanes (in this process)."""
    from vllm import LLM, SamplingParams
    res, pkg, _, prompts = lanes_tt
    llm = LLM(model=str(pkg), dtype="float32", seed=0, max_num_seqs=8 * PER_LANE)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == res["tokens"]


STEP_MS = 50.0


@pytest.fixture(scope="module")
def lanes_timed(lanes_tt):
    _, pkg, _, prompts = lanes_tt
    env = {k: v for k, v in os.environ.items() if k not in ("TTBUNDLE_EMULATED", "TTBUNDLE_TEST_TTNN")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    env["TTBUNDLE_DEVICE_MODEL"] = f"timing:{STEP_MS:g}ms"
    # 2 per lane, each prompt one prefill chunk (the device's token rule sums the prompt's last chunk)
    lens = [5, 40, 60, 3, 50, 17, 64, 9, 33, 1, 50, 12, 30, 26, 45, 8]
    cases = {"on": {"async": True, "prompts": lens, "max_tokens": TOKENS, "max_num_seqs": 8 * PER_LANE}}
    return run_engine_script(HERE / "timing_engine_run.py", pkg, cases, env)["on"]


def test_lanes_on_the_timing_device_run_async_side_by_side(lanes_timed):
    from test_runtime_async import expected_tokens
    res = lanes_timed
    assert res["async_scheduling"]
    for prompt, toks in zip(res["prompts"], res["tokens"]):
        assert toks == expected_tokens(prompt, TOKENS, res["vocab"])
    decodes = [s for s in res["steps"] if s["phase"] == "decode"]
    assert decodes and {s["mode"] for s in decodes} == {"async"}
    lane_of = {}
    for s in res["steps"]:
        for (rid, _, _), lane in zip(s["rows"], s["lanes"]):
            assert lane_of.setdefault(rid, lane) == lane
    # the decode executes of one engine step (one per lane with rows, enqueued back to back) end
    # within one modeled step of each other: the submeshes ran them side by side (in turn, the
    # last would end 7 steps after the first)
    ex = [e for e in res["events"] if e["kind"] == "execute" and e["key"] and e["key"][0] == "decode"]
    i, full = 0, 0
    for s in decodes:
        n = len(set(s["lanes"]))
        group = ex[i:i + n]
        i += n
        assert len(group) == n
        if n == 8:
            full += 1
            assert max(e["done"] for e in group) - min(e["done"] for e in group) < STEP_MS / 1000
    assert i == len(ex) and full >= TOKENS - 2


def test_a_prefill_steps_chunks_on_different_lanes_run_side_by_side(lanes_timed):
    """Every chunk of a prefill step is enqueued before any is read back: the chunks on different
    lanes (submeshes) run at the same time, each enqueued before the first of them is done (read
    back one by one, each would be enqueued after the one before it ended)."""
    res = lanes_timed
    pre = [e for e in res["events"] if e["kind"] == "execute" and e["key"] and e["key"][0] == "prefill"]
    i, side_by_side = 0, 0
    for s in res["steps"]:
        if s["phase"] != "prefill":
            continue
        group = pre[i:i + len(s["rows"])]  # one prefill program per chunk (no packing on a device)
        i += len(s["rows"])
        assert len(group) == len(s["rows"])
        if len(set(s["lanes"])) == len(s["lanes"]) > 1:
            side_by_side += 1
            first_done = min(e["done"] for e in group)
            assert all(e["at"] < first_done for e in group), group
    assert i == len(pre) and side_by_side >= 2
