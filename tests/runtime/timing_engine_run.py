"""Run by tests/runtime/test_runtime_async.py in its own process (vLLM resolves its platform once
per process): vLLM's engine in-process on the TT platform with the timing device
(``TTBUNDLE_DEVICE_MODEL``, set by the caller), once per case. Prints one ``RESULT {json}`` line:
per case the token ids, the model runner's step log and the timing device's events, in order.

    python timing_engine_run.py PACKAGE CASES_JSON
"""

from __future__ import annotations

import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.pop("TTBUNDLE_EMULATED", None)


def run_case(pkg: str, case: dict) -> dict:
    from vllm import LLM, SamplingParams

    from ttbundle.runtime import ttdevice

    ttdevice.RECORDER = ttdevice.DEVICE = None  # a fresh device per engine
    llm = LLM(model=pkg, dtype="float32", seed=0, async_scheduling=case["async"],
              **({"max_num_seqs": case["max_num_seqs"]} if case.get("max_num_seqs") else {}),
              **({"additional_config": {"tt": case["tt"]}} if case.get("tt") else {}))
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    dev = ttdevice.DEVICE
    n_ev, n_steps = len(dev.events), len(runner.step_log)
    prompts = [{"prompt_token_ids": [(7 * i + n) % 500 + 8 for i in range(n)]} for n in case["prompts"]]
    params = [SamplingParams(max_tokens=case["max_tokens"], temperature=0, ignore_eos=True,
                             logprobs=2 if i in case.get("logprobs", []) else None) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    res = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "prompts": [p["prompt_token_ids"] for p in prompts],
        "vocab": dev.vocab,
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "steps": [{"phase": s.phase, "rows": s.rows, "buckets": s.buckets, "sampling": s.sampling, "mode": s.mode,
                   "lanes": s.lanes, "at": s.at}
                  for s in list(runner.step_log)[n_steps:]],
        "events": [{"kind": e.kind, "step": e.step, "key": list(e.key) if e.key else None, "at": e.at,
                    "done": e.done} for e in dev.events[n_ev:]],
    }
    llm.llm_engine.engine_core.shutdown()
    return res


if __name__ == "__main__":
    from runtime_helpers import engine_main
    raise SystemExit(engine_main(run_case))
