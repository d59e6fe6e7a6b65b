"""Run by tests/runtime/test_runtime_tt.py in its own process (vLLM resolves its platform once per
process): vLLM's engine in-process on the TT platform, with the recording double standing in for
ttnn (the test-only hook TTBUNDLE_TEST_TTNN=recording), once per plugin-options case. Prints one
``RESULT {json}`` line: per case the outputs, the model runner's step log, the forwards and
traces, and the double's events (op / compile / capture / replay), in order.

    python tt_engine_run.py PACKAGE CASES_JSON
"""

from __future__ import annotations

from runtime_helpers import use_recording_double

use_recording_double()


def events(rec, tid_of) -> list:
    out = []
    for e in rec.events:
        if e.fn in ("begin_trace_capture", "end_trace_capture", "execute_trace"):
            out.append({"fn": e.fn, "trace": tid_of(e)})
        elif rec.is_op(e):
            out.append({"fn": e.fn, "compiled": e.compiled, "capturing": e.capturing})
    return out


def run_case(pkg: str, case: dict) -> dict:
    from vllm import LLM, SamplingParams

    from ttbundle.runtime import ttdevice

    ttdevice.RECORDER = None  # a fresh double (a fresh device) per engine
    llm = LLM(model=pkg, dtype="float32", seed=0, additional_config={"tt": case["tt"]})
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    model = runner.mesh_model
    rec = ttdevice.RECORDER
    n_setup = len(rec.events)
    prompts = [{"prompt_token_ids": [(7 * i + n) % 500 + 8 for i in range(n)]} for n in case["prompts"]]
    params = [SamplingParams(max_tokens=case["max_tokens"], temperature=0, ignore_eos=True,
                             logprobs=2 if i in case.get("logprobs", []) else None) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    res = {
        "tokens": [len(o.outputs[0].token_ids) for o in outs],
        "steps": [{"phase": s.phase, "rows": s.rows, "buckets": s.buckets, "sampling": s.sampling}
                  for s in runner.step_log],
        "forwards": [list(k) for k in model.runner.forwards],
        "traced": [list(k) for k in model.runner.traced],
        "traces": {str(t.n): list(k) for k, (t, _) in model.runner.traces.items()},
        "replays": [list(k) for k in model.replays],
        "violations": rec.violations,
        "events": events(rec, lambda e: e.args[1].n if len(e.args) > 1 and hasattr(e.args[1], "n") else None),
        "event_index_serving": sum(1 for e in rec.events[:n_setup] if e.fn in ("begin_trace_capture", "end_trace_capture",
                                                                             "execute_trace") or rec.is_op(e)),
    }
    if case.get("choice"):  # then one prompt unconstrained and with structured output (vLLM's choice)
        from vllm.sampling_params import StructuredOutputsParams
        n = len(runner.step_log)
        prompt = {"prompt_token_ids": prompts[0]["prompt_token_ids"]}
        constrained = StructuredOutputsParams(choice=case["choice"])
        plain, chosen = llm.generate([prompt, prompt], [
            SamplingParams(max_tokens=3, temperature=0),
            SamplingParams(max_tokens=3, temperature=0, structured_outputs=constrained)], use_tqdm=False)
        res["choice"] = {"plain": plain.outputs[0].text, "chosen": chosen.outputs[0].text,
                         "finish": chosen.outputs[0].finish_reason,
                         "sampling": [s.sampling for s in list(runner.step_log)[n:]]}
    llm.llm_engine.engine_core.shutdown()
    return res


if __name__ == "__main__":
    from runtime_helpers import engine_main
    raise SystemExit(engine_main(run_case))
