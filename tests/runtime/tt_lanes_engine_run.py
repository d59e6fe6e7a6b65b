"""Run by tests/runtime/test_runtime_tt_lanes.py in its own process (vLLM resolves its platform once
per process): vLLM's engine in-process on the TT platform serving a package split into replicas as
lanes, the recording double standing in for ttnn (TTBUNDLE_TEST_TTNN=recording) and **computing**
on the package's tensorbin weights (a ``Recorder()`` in place of the hook's fake-weight one).
Prints one ``RESULT {json}`` line: per case the output token ids, the step log (rows, lanes,
buckets), the submeshes the double handed out and, for every trace replayed while serving, its
forward key and the submesh it ran on.

    python tt_lanes_engine_run.py PACKAGE CASES_JSON
"""

from __future__ import annotations

from runtime_helpers import use_recording_double

use_recording_double()


def run_case(pkg: str, case: dict) -> dict:
    from vllm import LLM, SamplingParams

    from ttbundle.backends.ttnn import recording
    from ttbundle.runtime import ttdevice

    from vllm.engine.arg_utils import EngineArgs
    try:  # vLLM data parallel on a device: still refused (each rank would open its own chips)
        EngineArgs(model=pkg, dtype="float32", data_parallel_size=2).create_engine_config()
        refused = None
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        refused = str(e)
    ttdevice.RECORDER = rec = recording.Recorder()  # computing: weights from the tensorbin caches
    llm = LLM(model=pkg, dtype="float32", seed=0, max_num_seqs=case["max_num_seqs"])
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model = runner.mesh_model
    opened = [e for e in rec.events if e.fn == "open_mesh_device"]
    n_setup = len(rec.events)
    prompts = [{"prompt_token_ids": p} for p in case["prompts"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=case["max_tokens"], temperature=0, ignore_eos=True),
                        use_tqdm=False)
    traces = {}
    for r in model.lane_runners:
        for key, (tid, _) in r.traces.items():
            traces[tid.n] = list(key)
    serving = rec.events[n_setup:]
    res = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "steps": [{"phase": s.phase, "rows": s.rows, "lanes": s.lanes, "buckets": s.buckets, "at": s.at}
                  for s in runner.step_log],
        "opened": [list(e.args[0].args) for e in opened],
        "submeshes": [[list(d.shape), list(d.origin)] for d in (r.ex.device for r in model.lane_runners)],
        "lane_of_kv": [ln.kv.lane for ln in runner.lanes.lanes],
        "executes": [{"key": traces[e.args[1].n], "origin": list(e.args[0].origin)}
                     for e in serving if e.fn == "execute_trace"],
        "compiled_serving": sum(1 for e in serving if e.compiled),
        "compiled_serving_ops": [[e.fn, e.device, e.capturing] for e in serving if e.compiled][:20],
        "compiled_warmup_per_lane": [sum(1 for e in rec.events[:n_setup] if e.compiled and e.device == repr(d))
                                     for d in (r.ex.device for r in model.lane_runners)],
        "compiled_off_lanes": sum(1 for e in rec.events[:n_setup] if e.compiled and e.device is None),
        "violations": rec.violations + rec.op_errors,
        "dp_refused": refused,
    }
    llm.llm_engine.engine_core.shutdown()
    return res


if __name__ == "__main__":
    from runtime_helpers import engine_main
    raise SystemExit(engine_main(run_case))
