"""Run by tests/runtime/test_runtime_tt_speculative.py in its own process (vLLM resolves its
platform once per process): vLLM's engine in-process on the TT platform with the recording double
standing in for ttnn (TTBUNDLE_TEST_TTNN=recording), **computing** on the package's tensorbin
weights (a ``Recorder()`` put in place of the hook's fake-weight one), with and without vLLM's
``--speculative-config`` (n-gram). Prints one ``RESULT {json}`` line: per case the output token
ids of each batch, vLLM's spec-decode metrics, the model runner's step log, the forwards replayed
and the traces, the ops compiled while serving.

    python tt_spec_engine_run.py PACKAGE CASES_JSON
"""

from __future__ import annotations

from runtime_helpers import use_recording_double

use_recording_double()


def run_case(pkg: str, case: dict) -> dict:
    from vllm import LLM, SamplingParams

    from runtime_helpers import computing_recorder

    rec = computing_recorder()
    llm = LLM(model=pkg, dtype="float32", seed=0, disable_log_stats=False, speculative_config=case["speculative"])
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        model = runner.mesh_model
        n_setup, n_replays = len(rec.events), model.replay_count
        outs = []
        for prompts, params in case["batches"]:
            res = llm.generate(prompts, [SamplingParams(**p) for p in params], use_tqdm=False)
            outs.append([list(o.outputs[0].token_ids) for o in res])
        return {
            "tokens": outs,
            "metrics": {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name},
            "steps": [{"phase": s.phase, "rows": s.rows, "buckets": s.buckets, "sampling": s.sampling,
                       "lanes": list(getattr(s, "lanes", None) or [])} for s in runner.step_log],
            "replays": [list(k) for k in model.replays_since(n_replays)],
            "traced": [list(k) for k in model.runner.traces],
            "warmed": [list(k) for k in model.warmed],
            "compiled_serving": sum(1 for e in rec.events[n_setup:] if e.compiled),
            "violations": rec.violations + rec.op_errors,
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    from runtime_helpers import engine_main
    raise SystemExit(engine_main(run_case))
