"""Replicas through vLLM's OpenAI server and the official `openai` client: an emulated T3K
split into 8 replicas of 1x1 served as 8 lanes by `ttbundle serve` (128 concurrent clients), and
plain `vllm serve PACKAGE --data-parallel-size 2` (two engine ranks of 4 lanes each), greedy
tokens compared with transformers on every rank and lane."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess

import pytest

from runtime_helpers import hf_greedy
from test_runtime_lanes import PER_LANE, lanes_package  # noqa: F401  (the session's package)

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(8, 500) for _ in range(rng.randrange(1, 120))]


class _Served:
    def __init__(self, proc, url, name, log, steps):
        self.proc, self.url, self.name, self.log, self.steps = proc, url, name, log, steps

    def steps_json(self):
        return [json.loads(x) for x in self.steps.read_text().splitlines()] if self.steps.exists() else []


def _serve(argv, env, port, d, name):
    from ttbundle.serving.serve import start, stop, wait_healthy, ServePlan
    plan = ServePlan(d, name, "T3K", argv, env, "127.0.0.1", port)
    log = d / "vllm.log"
    with open(log, "wb") as f:
        proc = start(plan, log=f)
    try:
        wait_healthy(proc, "127.0.0.1", port, timeout=600)
    except Exception:
        print(log.read_text()[-5000:])
        stop(proc)
        raise
    return proc, plan


@pytest.fixture(scope="module")
def lanes_server(lanes_package, tmp_path_factory):  # noqa: F811
    from ttbundle.serving.serve import plan_serve, stop
    pkg, src = lanes_package
    d = tmp_path_factory.mktemp("serve-lanes")
    port = _free_port()
    plan = plan_serve(pkg, "127.0.0.1", port)
    assert "--max-num-seqs" in plan.argv and plan.argv[plan.argv.index("--max-num-seqs") + 1] == str(8 * PER_LANE)
    plan.env["TTBUNDLE_STEP_LOG"] = str(d / "steps.jsonl")
    proc, _ = _serve(plan.argv, plan.env, port, d, plan.name)
    try:
        yield _Served(proc, plan.url, plan.name, d / "vllm.log", d / "steps.jsonl"), src
    finally:
        stop(proc)


def _run_clients(url, name, n_clients, lens):
    async def one(c, i):
        r = await c.completions.create(model=name, prompt=_prompt(i), max_tokens=lens[i], temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.id, r.usage.completion_tokens, r.choices[0].token_ids

    async def main():
        c = openai.AsyncOpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(n_clients))), 900)
        finally:
            await c.close()
    return asyncio.run(main())


def test_128_concurrent_clients_on_eight_lanes(lanes_server):
    served, src = lanes_server
    lens = [random.Random(1000 + i).randrange(4, 40) for i in range(128)]
    results = _run_clients(served.url, served.name, 128, lens)
    assert [n for _, n, _ in results] == lens  # every client got its token count
    steps = served.steps_json()
    lane_of, peak = {}, 0
    for s in steps:
        assert s["phase"] in ("prefill", "decode") and len(s["lanes"]) == len(s["rows"])
        for (rid, _, n), lane in zip(s["rows"], s["lanes"]):
            assert lane_of.setdefault(rid, lane) == lane, f"{rid} changed lane"
            assert (n == 1) if s["phase"] == "decode" else True
        if s["phase"] == "decode":
            peak = max(peak, len(s["rows"]))
    served_ids = {rid.rsplit("-", 2)[0] for rid in lane_of}
    assert {rid for rid, _, _ in results} <= served_ids
    assert set(lane_of.values()) == set(range(8))
    assert peak > 32  # one step decoded more sequences than a single replica's largest bucket
    # greedy tokens equal transformers in every lane (two requests per lane checked)
    lane_by_resp = {rid.rsplit("-", 2)[0]: lane for rid, lane in lane_of.items()}
    checked = {}
    for i, (rid, n, toks) in enumerate(results):
        lane = lane_by_resp[rid]
        if checked.get(lane, 0) < 2:
            assert toks == hf_greedy(src, _prompt(i), n), (i, lane)
            checked[lane] = checked.get(lane, 0) + 1
    assert sorted(checked) == list(range(8))


@pytest.fixture(scope="module")
def dp_server(lanes_package, tmp_path_factory):  # noqa: F811
    """Plain `vllm serve PACKAGE --data-parallel-size 2` (no ttbundle serve), emulated mesh."""
    from ttbundle.serving.serve import stop, vllm_command
    pkg, src = lanes_package
    d = tmp_path_factory.mktemp("serve-dp")
    port = _free_port()
    argv = vllm_command() + ["serve", str(pkg), "--host", "127.0.0.1", "--port", str(port), "--dtype",
                             "float32", "--data-parallel-size", "2", "--data-parallel-rpc-port",
                             str(_free_port()), "--served-model-name", "tiny-dp"]
    env = {"TTBUNDLE_EMULATED": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "TTBUNDLE_STEP_LOG": str(d / "steps.jsonl"), "TTBUNDLE_EMULATED_THREADS": "1"}
    proc, _ = _serve(argv, env, port, d, "tiny-dp")
    try:
        yield _Served(proc, f"http://127.0.0.1:{port}/v1", "tiny-dp", d / "vllm.log", d / "steps.jsonl"), src
    finally:
        stop(proc)


def test_vllm_data_parallel_2_greedy_on_every_rank(dp_server):
    served, src = dp_server
    log = served.log.read_text()
    assert "DP rank 0 of 2, 4 lane(s) (replicas [0, 1, 2, 3])" in log
    assert "DP rank 1 of 2, 4 lane(s) (replicas [4, 5, 6, 7])" in log
    lens = [random.Random(2000 + i).randrange(3, 12) for i in range(24)]
    results = _run_clients(served.url, served.name, 24, lens)
    assert [n for _, n, _ in results] == lens
    replica = {}
    for s in served.steps_json():
        for (rid, _, _), lane in zip(s["rows"], s["lanes"]):
            assert replica.setdefault(rid.rsplit("-", 2)[0], lane) == lane
    ranks = {}
    for i, (rid, n, toks) in enumerate(results):
        rank = replica[rid] // 4
        ranks.setdefault(rank, 0)
        ranks[rank] += 1
        assert toks == hf_greedy(src, _prompt(i), n), (i, rank)
    assert sorted(ranks) == [0, 1], ranks  # vLLM's DP load balancer used both ranks
