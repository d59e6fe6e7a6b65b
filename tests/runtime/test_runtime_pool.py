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
def test_worker_asks_vllm_for_the_pools_blocks_unless_overridden(override):
    from types import SimpleNamespace

    from ttbundle import spec
    from ttbundle.plan.make import kv_blocks
    from ttbundle.runtime.worker import TTWorker

    bundle = spec.loads(pool_spec(), "pool.yaml")
    per_block = 12345
    fake = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks_override=override),
                           # a package's record is the plan's pool (tests/test_pool.py builds one)
                           package=SimpleNamespace(kv_blocks=kv_blocks(bundle, "N150")),
                           model_runner=SimpleNamespace(kv_bytes_per_block=lambda: per_block,
                                                        lane_plan=SimpleNamespace(lanes=1)))
    want = override or math.ceil((POOL + 32 * SEQS) / 32)
    assert TTWorker.determine_available_memory(fake) == want * per_block
