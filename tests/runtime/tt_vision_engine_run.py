"""Run by tests/runtime/test_runtime_tt_vision.py in its own process (vLLM resolves its platform
once per process): vLLM's engine in-process on the TT platform with the recording double standing
in for ttnn (TTBUNDLE_TEST_TTNN=recording), **computing** on the package's tensorbin weights (a
``Recorder()`` put in place of the hook's fake-weight one), serving chats with images through
vLLM's own Gemma 3 processor. Prints one ``RESULT {json}`` line: per case the prompt and output
token ids, the forwards replayed while serving, and the ops compiled while serving.

    python tt_vision_engine_run.py PACKAGE CASES_JSON
"""

from __future__ import annotations

from runtime_helpers import use_recording_double

use_recording_double()


def run_case(pkg: str, case: dict) -> dict:
    from vllm import LLM, SamplingParams

    from runtime_helpers import computing_recorder

    rec = computing_recorder()
    llm = LLM(model=pkg, dtype="float32", seed=0, additional_config={"tt": case["tt"]},
              limit_mm_per_prompt={"image": 2})
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model = runner.mesh_model
    n_setup, n_replays = len(rec.events), model.replay_count
    params = SamplingParams(max_tokens=case["max_tokens"], temperature=0, ignore_eos=True)
    outs = llm.chat(case["messages"], params, use_tqdm=False)
    res = {
        "prompts": [list(o.prompt_token_ids) for o in outs],
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "replays": [list(k) for k in model.replays_since(n_replays)],
        "traced": [list(k) for k in model.runner.traces],
        "compiled_serving": sum(1 for e in rec.events[n_setup:] if e.compiled),
        "violations": rec.violations + rec.op_errors,
    }
    llm.llm_engine.engine_core.shutdown()
    return res


if __name__ == "__main__":
    from runtime_helpers import engine_main
    raise SystemExit(engine_main(run_case))
