"""The KV cache as a pool (``runtime.max_tokens_all_users``) through vLLM's own engine: a pool
smaller than max_num_seqs x max_model_len gives vLLM exactly the plan's blocks, vLLM preempts
when they run out (its own ``vllm:num_preemptions`` counter says so), and every request still
completes with transformers' greedy tokens."""

from __future__ import annotations

import math

import pytest
import yaml

from runtime_helpers import CHUNK, DECODE, PREFILL, TINY_ARCH, hf_greedy

SEQS, MAX_LEN, POOL = 8, 256, 256  # the pool holds one full-length sequence, not eight


def pool_spec() -> str:
    return yaml.safe_dump({
        "name": "tiny-pool",
        "model": TINY_ARCH["llama"],
        "targets": ["N150"],
        "buckets": {"prefill": PREFILL, "decode": DECODE, "prefill_chunk": CHUNK},
        "runtime": {"max_model_len": MAX_LEN, "max_num_seqs": SEQS, "max_tokens_all_users": POOL},
    }, sort_keys=False)


@pytest.mark.slow
def test_requests_beyond_the_pool_are_preempted_and_still_exact(tmp_path):
    import os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from ttbundle.serving.demo import build_package

    pkg = build_package(pool_spec(), tmp_path, "N150")
    src = tmp_path / "src-tiny-pool"
    llm = LLM(model=str(pkg), dtype="float32", seed=0, disable_log_stats=False)
    try:
        core = llm.llm_engine.engine_core.engine_core
        # vLLM's KV cache holds exactly the pool's blocks (Tenstorrent's formula, in the test)
        blocks = math.ceil((POOL + 32 * SEQS) / 32)
        assert blocks < math.ceil((SEQS * MAX_LEN + 32 * SEQS) / 32)
        assert core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks == blocks
        # eight requests of 70 + 60 tokens need 5 blocks each: 40 > the pool's 16
        prompts = [[(13 + 7 * i + 31 * r) % 500 + 8 for i in range(70)] for r in range(SEQS)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.finished and list(o.outputs[0].token_ids) == hf_greedy(src, p, 60)
        preempted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        assert preempted > 0
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("override", [None, 7])
@pytest.mark.parametrize("device", [False, True])
def test_worker_asks_vllm_for_the_pools_blocks_unless_overridden(override, device, monkeypatch):
    """A device: the plan's pool. The emulated mesh: the pool ``Package.host_plan`` gives this host
    (here the spec's explicit pool, which fits a large host: the same blocks)."""
    from types import SimpleNamespace

    from ttbundle import kvpool, spec
    from ttbundle.plan import host
    from ttbundle.plan.make import kv_blocks, make_plan
    from ttbundle.runtime.worker import TTWorker

    monkeypatch.setattr(kvpool, "available_memory", lambda: 1 << 40)
    bundle = spec.loads(pool_spec(), "pool.yaml")
    per_block = 12345
    plan = make_plan(bundle, "N150")
    fake = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks_override=override),
                           # a package's record is the plan's pool (tests/test_pool.py builds one)
                           package=SimpleNamespace(kv_blocks=kv_blocks(bundle, "N150"),
                                                   host_plan=lambda **k: host.host_plan(bundle, plan, **k)),
                           model_runner=SimpleNamespace(kv_bytes_per_block=lambda: per_block,
                                                        lane_plan=SimpleNamespace(lanes=1)),
                           tt=object() if device else None)
    fake._host_blocks = lambda lanes: TTWorker._host_blocks(fake, lanes)
    want = override or math.ceil((POOL + 32 * SEQS) / 32)
    assert TTWorker.determine_available_memory(fake) == want * per_block


def test_the_emulated_worker_sizes_an_auto_pool_for_the_host(monkeypatch):
    """``vllm serve PACKAGE`` on the emulated mesh, no override, ``auto``: the host's pool
    (``kvpool.host_pool``), fewer blocks than the device's on a small host."""
    from types import SimpleNamespace

    from ttbundle import kvpool, spec
    from ttbundle.plan import host
    from ttbundle.plan.make import make_plan
    from ttbundle.runtime.worker import TTWorker

    text = pool_spec().replace("max_tokens_all_users: 256", "max_tokens_all_users: auto") \
        .replace("max_model_len: 256", "max_model_len: 1024")
    bundle = spec.loads(text, "pool.yaml")
    plan = make_plan(bundle, "N150")
    big = host.host_plan(bundle, plan, available=1 << 40)
    avail = big.fixed + int(100.5 * big.kv_bytes_per_block / kvpool.HOST_KV_SHARE)  # the share: 100 blocks
    monkeypatch.setattr(kvpool, "available_memory", lambda: avail)
    monkeypatch.setattr(kvpool, "own_rss", lambda: 0)
    want = host.host_plan(bundle, plan, available=avail)
    assert want.chosen == "auto" and want.blocks == 100 < plan.kv["num_blocks"]
    fake = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks_override=None),
                           package=SimpleNamespace(kv_blocks=plan.kv["num_blocks"],
                                                   host_plan=lambda **k: host.host_plan(bundle, plan, **k)),
                           model_runner=SimpleNamespace(kv_bytes_per_block=lambda: 1,
                                                        lane_plan=SimpleNamespace(lanes=1)), tt=None)
    fake._host_blocks = lambda lanes: TTWorker._host_blocks(fake, lanes)
    assert TTWorker.determine_available_memory(fake) == want.blocks
