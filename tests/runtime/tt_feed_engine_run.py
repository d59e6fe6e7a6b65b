"""Run by tests/runtime/test_runtime_tt_feed.py in its own process (vLLM resolves its platform once
per process): vLLM's engine in-process on the TT platform, the recording double standing in for
ttnn (TTBUNDLE_TEST_TTNN=recording) and **computing** on the package's tensorbin weights, once per
case (async scheduling on or off, ``tt`` options). Prints one ``RESULT {json}`` line: per case
the output token ids and finish reasons, the step log, the runner's tokens a step, where the fed
rows took their tokens (``TTDeviceModel.feeds``) and what the double saw while serving.

    python tt_feed_engine_run.py PACKAGE CASES_JSON
"""

from __future__ import annotations

from runtime_helpers import use_recording_double

use_recording_double()


def run_case(pkg: str, case: dict) -> dict:
    from vllm import LLM, SamplingParams

    from runtime_helpers import computing_recorder

    rec = computing_recorder()  # weights from the package's tensorbin caches
    llm = LLM(model=pkg, dtype="float32", seed=0, async_scheduling=case["async"],
              additional_config={"tt": case.get("tt", {})})
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model = runner.mesh_model
    n_setup = len(rec.events)
    prompts = [{"prompt_token_ids": p} for p in case["prompts"]]
    params = [SamplingParams(**p) for p in case["params"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    serving = rec.events[n_setup:]
    res = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "finish": [o.outputs[0].finish_reason for o in outs],
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "tokens_per_step": runner.tokens_per_step,
        "steps": [{"phase": s.phase, "rows": s.rows, "mode": s.mode, "sampling": s.sampling, "at": s.at}
                  for s in runner.step_log],
        "feeds": dict(model.feeds),
        "compiled_serving": sum(1 for e in serving if e.compiled),
        "violations": rec.violations + rec.op_errors + rec.shape_mismatches,
    }
    llm.llm_engine.engine_core.shutdown()
    return res


if __name__ == "__main__":
    from runtime_helpers import engine_main
    raise SystemExit(engine_main(run_case))
