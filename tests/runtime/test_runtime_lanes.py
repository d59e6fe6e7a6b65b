"""Replicas at run time (``runtime/lanes.py``): one engine driving the 8 replicas of a T3K split
into 1x1 submeshes as lanes, against transformers and the rules of its step log; the lane and
data-parallel arithmetic; the platform refusing impossible combinations."""

from __future__ import annotations

import json

import pytest
import yaml

from runtime_helpers import MAX_NUM_SEQS, hf_greedy, pick, spec_text

PER_LANE = 16
DECODE = [1, 2, 4, 8, 16, 32]


def lanes_spec(family: str = "llama", submesh=(1, 1), per_lane: int = PER_LANE) -> str:
    d = yaml.safe_load(spec_text(family))
    d["name"] = f"tiny-{family}-r{submesh[0]}x{submesh[1]}"
    d["runtime"]["max_num_seqs"] = per_lane
    d["replicas"] = {"T3K": {"submesh": list(submesh)}}
    return yaml.safe_dump(d, sort_keys=False)


@pytest.fixture(scope="session")
def lanes_package(packages_dir):
    from ttbundle.serving.demo import build_package
    pkg = build_package(lanes_spec(), packages_dir, "T3K")
    return pkg, packages_dir / "src-tiny-llama-r1x1"


@pytest.fixture(scope="module")
def engine(lanes_package, tmp_path_factory, monkeypatch_module):
    pkg, src = lanes_package
    log = tmp_path_factory.mktemp("steps") / "steps.jsonl"
    monkeypatch_module.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch_module.setenv("TTBUNDLE_STEP_LOG", str(log))
    from vllm import LLM
    llm = LLM(model=str(pkg), dtype="float32", seed=0, max_num_seqs=8 * PER_LANE)
    core = llm.llm_engine.engine_core.engine_core
    yield llm, core.scheduler, core.model_executor.driver_worker.worker.model_runner, src, log
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _prompts(lens, offset=3):
    return [{"prompt_token_ids": [(offset + 11 * i + n) % 500 + 8 for i in range(n)]} for n in lens]


def test_engine_runs_eight_lanes_of_per_lane_batches(engine):
    llm, sched, runner, src, _ = engine
    lp = runner.lane_plan
    assert (lp.replicas, lp.dp, lp.lanes) == (8, 1, 8)
    assert sched.max_num_running_reqs == 8 * PER_LANE  # beyond the largest decode bucket (32)
    assert len(runner.lanes) == 8 and len({id(ln.kv) for ln in runner.lanes.lanes}) == 8
    # each lane its own region of the package's per-lane KV formula (rt.max_num_seqs per lane)
    # the tiny model's pool is every sequence at full length: ceil((16 x 256 + 32 x 16) / 32) = 144
    per = -(-(PER_LANE * 256 + 32 * PER_LANE) // 32)
    assert all(ln.num_blocks == per for ln in runner.lanes.lanes)


def test_greedy_tokens_equal_transformers_in_every_lane(engine):
    from vllm import SamplingParams
    llm, sched, runner, src, _ = engine
    lens = [5, 40, 100, 3, 70, 17, 64, 9, 130, 33, 1, 50, 12, 90, 26, 65]  # 2 per lane
    prompts = _prompts(lens)
    n0 = len(runner.step_log)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    steps = list(runner.step_log)[n0:]
    lane_of = {}
    for s in steps:
        for (rid, _, _), lane in zip(s.rows, s.lanes):
            lane_of.setdefault(rid, set()).add(lane)
    assert sorted(len(v) for v in lane_of.values()) == [1] * len(prompts)
    by_lane = {}
    for rid, v in lane_of.items():
        by_lane.setdefault(next(iter(v)), []).append(rid)
    assert sorted(by_lane) == list(range(8)), by_lane  # every lane served some of them
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(src, p["prompt_token_ids"], 8), len(p["prompt_token_ids"])


@pytest.mark.slow
def test_step_log_single_phase_and_no_request_changes_lane(engine):
    """128 requests at once (16 per lane): the step log (TTBUNDLE_STEP_LOG) shows every step one
    phase, each decode step one padded batch per lane, and each request in one lane throughout."""
    from vllm import SamplingParams
    llm, sched, runner, src, log = engine
    start = len(log.read_text().splitlines())
    prompts = _prompts([(7 * i) % 60 + 2 for i in range(128)], offset=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
    steps = [json.loads(x) for x in log.read_text().splitlines()[start:]]
    assert steps
    lane_of, peak = {}, 0
    for s in steps:
        assert s["phase"] in ("prefill", "decode")
        assert len(s["lanes"]) == len(s["rows"])
        for (rid, _, n), lane in zip(s["rows"], s["lanes"]):
            assert lane_of.setdefault(rid, lane) == lane, f"{rid} moved from lane {lane_of[rid]} to {lane}"
            if s["phase"] == "decode":
                assert n == 1
        if s["phase"] == "decode":
            per_lane = {}
            for lane in s["lanes"]:
                per_lane[lane] = per_lane.get(lane, 0) + 1
            assert max(per_lane.values()) <= PER_LANE
            assert s["buckets"] == [pick(DECODE, per_lane[ln]) for ln in sorted(per_lane)]
            peak = max(peak, len(s["rows"]))
    assert len(lane_of) == 128
    # replay the assignment rule: a request seen first at step k joins the lane with the fewest
    # live requests (lowest index on a tie); a request leaves after the last step it ran in
    last = {}
    for k, s in enumerate(steps):
        for rid, _, _ in s["rows"]:
            last[rid] = k
    live = {ln: set() for ln in range(8)}
    seen = set()
    for k, s in enumerate(steps):
        for ln in live:
            live[ln] = {r for r in live[ln] if last[r] >= k}
        for (rid, _, _), lane in zip(s["rows"], s["lanes"]):
            if rid not in seen:
                seen.add(rid)
                want = min(live, key=lambda ln: (len(live[ln]), ln))
                assert lane == want, (k, rid, lane, {ln: len(v) for ln, v in live.items()})
                live[lane].add(rid)
        assert max(len(v) for v in live.values()) <= PER_LANE
    assert peak > 64  # more sequences decoded in one step than one replica's largest bucket


# ---- arithmetic and refusals ------------------------------------------------------------------
def test_lane_plan_arithmetic_and_refusals():
    from ttbundle import mesh as meshmod
    from ttbundle.runtime.lanes import LaneError, plan_lanes
    sub = meshmod.split(meshmod.resolve("T3K"), (1, 1))
    lp = plan_lanes(sub, 16, dp=2, rank=1)
    assert (lp.lanes, lp.first_replica, lp.engine_seqs) == (4, 4, 64)
    assert plan_lanes(sub, 16, dp=8).lanes == 1
    with pytest.raises(LaneError, match=r"--data-parallel-size 3 does not divide the 8 replica"):
        plan_lanes(sub, 16, dp=3)
    with pytest.raises(LaneError, match=r"4 x 1 x 1 = 4, not 8; use tt_data_parallel_size=8"):
        plan_lanes(sub, 16, dp=1, tt_lanes=4)
    whole = meshmod.resolve("T3K")
    with pytest.raises(LaneError, match=r"\? x 2 x 8 = 8.*split the target"):
        plan_lanes(whole, 16, dp=2)


def test_platform_refuses_impossible_combinations(lanes_package, make_package):
    """Through vLLM's own config: a DP size that does not divide the replicas, a lane count that
    does not multiply to the chips, -dp on an unsplit package."""
    from vllm.engine.arg_utils import EngineArgs
    pkg, _ = lanes_package
    cases = [
        (pkg, dict(data_parallel_size=3), r"does not divide the 8 replica"),
        (pkg, dict(additional_config={"tt": {"tt_data_parallel_size": 2}}), r"2 x 1 x 1 = 2, not 8"),
        (make_package("llama", "T3K")[0], dict(data_parallel_size=2), r"\? x 2 x 8 = 8"),
    ]
    for p, kw, msg in cases:
        with pytest.raises(Exception, match=msg):
            EngineArgs(model=str(p), dtype="float32", **kw).create_engine_config()


def test_serve_command_for_lanes_and_data_parallel(lanes_package):
    """`ttbundle serve`'s vLLM command: --max-num-seqs is each engine's lanes x the per-replica
    max_num_seqs (8 x 16 alone, 4 x 16 with DP 2), DP passed once, a DP not dividing 8 refused."""
    from ttbundle.errors import InvalidInput
    from ttbundle.serving.serve import plan_serve
    pkg, _ = lanes_package

    def seqs(plan):
        return int(plan.argv[plan.argv.index("--max-num-seqs") + 1])
    assert seqs(plan_serve(pkg)) == 8 * PER_LANE
    p = plan_serve(pkg, data_parallel_size=2)
    assert seqs(p) == 4 * PER_LANE and p.argv.count("--data-parallel-size") == 1
    assert p.argv[p.argv.index("--data-parallel-size") + 1] == "2"
    p = plan_serve(pkg, extra=["--data-parallel-size", "8"])
    assert seqs(p) == PER_LANE and p.argv.count("--data-parallel-size") == 1
    with pytest.raises(InvalidInput, match=r"--data-parallel-size 3 does not divide the 8 replica"):
        plan_serve(pkg, data_parallel_size=3)
    with pytest.raises(InvalidInput, match="give it once"):
        plan_serve(pkg, extra=["-dp", "4"], data_parallel_size=2)


def test_lanes_refuse_a_pool_smaller_than_every_sequence_at_full_length(packages_dir):
    """A pinned pool below max_num_seqs x max_model_len per lane: vLLM's preemption is per engine,
    so lanes are refused (naming the numbers); one lane per engine (DP = replicas) is allowed."""
    from vllm.engine.arg_utils import EngineArgs

    from ttbundle.serving.demo import build_package
    d = yaml.safe_load(lanes_spec(per_lane=8))
    d["name"] = "tiny-small-pool"
    d["runtime"]["max_tokens_all_users"] = 1024  # < 8 x 256 = 2048
    pkg = build_package(yaml.safe_dump(d), packages_dir, "T3K")
    with pytest.raises(Exception, match=r"max_num_seqs=8 x max_model_len=256 = 2048 tokens, 72 blocks\); "
                                        r"the plan's pool is 40 blocks"):
        EngineArgs(model=str(pkg), dtype="float32").create_engine_config()
    from ttbundle.runtime.lanes import check_pool
    from ttbundle.runtime.packages import open_package
    p = open_package(pkg)
    check_pool(p, p.kv_blocks, 1)  # DP 8: one lane per engine, vLLM's accounting is the lane's
