"""The phase-constrained scheduler (vLLM's Scheduler subclass) over recorded step sequences.

Workloads arrive over time; a stand-in model samples a token whenever a request's scheduled
tokens reach the end of what it has. Every recorded step is checked (``check_steps``): one phase
per step, prefill chunks of exactly ``prefill_chunk`` tokens at chunk boundaries, padded prefill
within the largest bucket, every decode-ready request in each decode step, and the waiting bound.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime_helpers import CHUNK, PREFILL, check_steps

VOCAB = 512


def make_scheduler(pkg, K: int = 1, num_blocks: int | None = None):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from ttbundle.plan.make import kv_blocks
    from ttbundle.runtime.packages import open_package
    from ttbundle.runtime.scheduler import PhaseScheduler

    cfg = EngineArgs(model=str(pkg), dtype="float32",
                     additional_config={"tt": {"max_prefill_steps_between_decodes": K}}).create_engine_config()
    opened = open_package(pkg, check_hashes=False)
    n = num_blocks or kv_blocks(opened.bundle, opened.mesh_name)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=16, dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=n, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    cfg.cache_config.num_gpu_blocks = n
    return PhaseScheduler(cfg, kvc, StructuredOutputManager(cfg), block_size=32, log_stats=False)


def simulate(sched, arrivals: dict[int, list[tuple[str, int, int]]], max_steps: int = 5000):
    """``arrivals``: step -> [(request id, prompt length, max_tokens)]. Runs to completion;
    returns (records, prompt lengths, output lengths)."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    rng = random.Random(0)
    plens, outs = {}, {}
    for step in range(max_steps):
        for rid, plen, mt in arrivals.get(step, []):
            plens[rid] = plen
            sched.add_request(Request(rid, [rng.randrange(VOCAB) for _ in range(plen)],
                                      SamplingParams(max_tokens=mt, ignore_eos=True), None))
        if not sched.has_requests() and step > max(arrivals):
            break
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = sched.requests[rid]
            done = r.num_computed_tokens >= r.num_tokens  # this step computes its last token
            sampled.append([rng.randrange(VOCAB)] if done else [])
            if done:
                outs[rid] = outs.get(rid, 0) + 1
        sched.update_from_output(so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled))
    else:
        raise AssertionError("workload did not finish")
    return list(sched.records), plens, outs


@pytest.fixture(scope="module")
def pkg(make_package):
    return make_package("llama", "N150")[0]


@pytest.mark.parametrize("K", [1, 3])
def test_recorded_steps_keep_the_rules(pkg, K):
    rng = random.Random(K)
    arrivals = {}
    for i in range(40):
        step = rng.randrange(0, 60)
        arrivals.setdefault(step, []).append((f"r{i}", rng.choice([1, 5, 31, 63, 64, 65, 100, 129, 200]),
                                              rng.randrange(1, 30)))
    records, plens, outs = simulate(make_scheduler(pkg, K), arrivals)
    chunks = check_steps(records, plens, CHUNK, PREFILL, K)
    for rid, mt in ((rid, m) for reqs in arrivals.values() for rid, _, m in reqs):
        assert outs[rid] == mt, f"{rid}: {outs[rid]} tokens, max_tokens={mt}"
    # long prompts really were chunked, and both phases happened
    assert any(len(c) >= 3 for c in chunks.values())
    phases = [r.phase for r in records]
    assert "prefill" in phases and "decode" in phases
    # with decodes waiting, prefill steps never run more than K in a row
    run = 0
    for r in records:
        run = run + 1 if (r.phase == "prefill" and r.decode_ready) else 0
        assert run <= K


def test_prefill_batches_short_prompts_within_the_largest_bucket(pkg):
    records, plens, _ = simulate(make_scheduler(pkg), {0: [(f"s{i}", 20, 2) for i in range(6)]})
    first = records[0]
    assert first.phase == "prefill"
    # 20 tokens pad to 32; 128 / 32 = 4 prompts per prefill step
    assert list(first.tokens.values()) == [20, 20, 20, 20]


def test_a_long_prompt_takes_whole_chunks_and_decodes_interleave(pkg):
    arrivals = {0: [("short", 10, 40)], 3: [("long", 250, 2)]}
    records, plens, _ = simulate(make_scheduler(pkg, K=1), arrivals)
    long_steps = [i for i, r in enumerate(records) if "long" in r.tokens and r.phase == "prefill"]
    assert [records[i].tokens["long"] for i in long_steps] == [64, 64, 64, 58]
    assert [records[i].starts["long"] for i in long_steps] == [0, 64, 128, 192]
    for a, b in zip(long_steps, long_steps[1:]):  # "short" decodes between the chunks
        assert any(records[j].phase == "decode" and "short" in records[j].tokens for j in range(a + 1, b))


def test_preemption_under_a_small_kv_cache_keeps_the_rules(pkg):
    # 12 blocks of 32 tokens for requests that need up to 8 blocks each: vLLM preempts; the
    # recompute is a prefill again, still one phase per step
    arrivals = {0: [(f"p{i}", 100, 120) for i in range(4)]}
    sched = make_scheduler(pkg, num_blocks=12)
    records, plens, outs = simulate(sched, arrivals)
    assert all(outs[f"p{i}"] == 120 for i in range(4))
    restarts = sum(1 for r in records if r.phase == "prefill" for s in r.starts.values() if s == 0)
    assert restarts > 4, "the small cache should have forced at least one preemption"
    for i, r in enumerate(records):
        assert r.phase in ("prefill", "decode", "empty")
        if r.phase == "decode":
            assert all(n == 1 for n in r.tokens.values())
        if r.phase == "prefill":
            assert all(s % CHUNK == 0 for s in r.starts.values())
