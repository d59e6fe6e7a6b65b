"""The floor for benches/bench_host.py: vLLM itself with a null model and no ttbundle logic.

vLLM's own CPU platform, scheduler (its ``AsyncScheduler``, async scheduling kept on, as on our
TT path) and engine, on the HF checkpoint the package was built from (same tokenizer), with
:class:`NullWorker` as the worker: it builds no inputs and computes nothing, it only keeps the same
device clock as the timing device (``ttbundle.runtime.timing``: a step of the step time, off the
CPU, in order; the output of a step ready when its modeled step ends) and returns token ids
``(31 * last token + 7 * position + 1) % vocab``. So what it costs above the device bound is what
vLLM's engine (scheduler, output processing, detokenizer, API server) costs on this machine.

    python benches/null_engine.py serve SRC [vllm serve arguments]   # the API server, patched
The step time comes from ``BENCH_NULL_DEVICE_MODEL`` (spelled as ``TTBUNDLE_DEVICE_MODEL``, which would activate
ttbundle), the step log (JSON lines:
phase, rows, at, inputs, wait) goes to ``TTBUNDLE_STEP_LOG``.
"""

from __future__ import annotations

import json
import os
import sys
import time

WORKER = "null_engine.NullWorker"
#: the step time, as TTBUNDLE_DEVICE_MODEL spells it (that variable would activate ttbundle)
STEP_ENV = "BENCH_NULL_DEVICE_MODEL"


def patch_cpu_platform() -> None:
    """vLLM's CPU platform turns async scheduling off and picks the multiprocess executor; keep
    vLLM's decision on async scheduling and one process for the worker, as ttbundle's platform does."""
    from vllm.platforms import cpu

    orig = cpu.CpuPlatform.check_and_update_config.__func__

    def check(cls, vllm_config):
        want = vllm_config.scheduler_config.async_scheduling
        orig(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = want
        vllm_config.parallel_config.distributed_executor_backend = "uni"
        vllm_config.parallel_config.worker_cls = WORKER
    cpu.CpuPlatform.check_and_update_config = classmethod(check)


class _Out:
    """AsyncModelRunnerOutput: ready when the modeled step ends."""

    def __init__(self, out, ready: float, step: dict, log):
        self.out, self.ready, self.step, self.log = out, ready, step, log

    def get_output(self):
        t = time.perf_counter()
        if self.ready > t:
            time.sleep(self.ready - t)
        self.step["wait"] = time.perf_counter() - t
        self.log(self.step)
        return self.out

    def get_kv_connector_output(self):
        return None


def _make_worker_class():
    import torch
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
    from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

    from ttbundle.runtime import timing

    class Out(_Out, AsyncModelRunnerOutput):
        pass

    class NullWorker(WorkerBase):
        def __init__(self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker=False, **kw):
            super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
            self.times = timing.parse(os.environ.get(STEP_ENV, "timing:14ms"))
            self.free_at = 0.0
            self.last: dict[str, tuple[int, int]] = {}  # req -> (last token, its position)
            self.vocab = vllm_config.model_config.get_vocab_size()
            self.pending = None
            self.async_ = bool(vllm_config.scheduler_config.async_scheduling)
            self.step_log: list = []
            self._path = os.environ.get("TTBUNDLE_STEP_LOG")

        def init_device(self):
            self.device = torch.device("cpu")

        def load_model(self, *, load_dummy_weights: bool = False):
            self.model = torch.nn.Module()

        def get_model(self):
            return self.model

        def get_kv_cache_spec(self):
            from vllm.v1.kv_cache_interface import FullAttentionSpec
            return {"model.layers.0.self_attn.attn": FullAttentionSpec(
                block_size=self.cache_config.block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)}

        def determine_available_memory(self) -> int:
            spec = next(iter(self.get_kv_cache_spec().values()))
            return 4096 * spec.page_size_bytes

        def initialize_from_config(self, kv_cache_config) -> None:
            return

        def compile_or_warm_up_model(self):
            return CompilationTimes(language_model=0.0, encoder=0.0)

        def get_supported_tasks(self):
            return ("generate",)

        def check_health(self):
            return

        def _log(self, step):
            self.step_log.append(step)
            if self._path:
                with open(self._path, "a") as f:
                    f.write(json.dumps(step) + "\n")

        def execute_model(self, so):
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
            if not so.total_num_scheduled_tokens:
                return EMPTY_MODEL_RUNNER_OUTPUT
            t0 = time.perf_counter()
            for rid in so.finished_req_ids:
                self.last.pop(rid, None)
            ids, prefill_tokens, decodes, rows = [], 0, 0, []
            for nr in so.scheduled_new_reqs:
                self.last[nr.req_id] = (int(nr.prompt_token_ids[-1]) if nr.prompt_token_ids else 0,
                                        len(nr.prompt_token_ids or ()) - 1)
            for rid, n in so.num_scheduled_tokens.items():
                tok, pos = self.last[rid]
                nxt = (31 * tok + 7 * (pos + 1) + 1) % self.vocab
                self.last[rid] = (nxt, pos + 1)
                ids.append([nxt])
                rows.append([rid, pos, n])
                if n > 1:
                    prefill_tokens += n
                else:
                    decodes += 1
            # every step samples here (partial prefill chunks aside: not in this bench)
            phase = "prefill" if prefill_tokens else "decode"
            dur = (self.times.seconds("prefill", prefill_tokens) if prefill_tokens else 0.0) + \
                (self.times.seconds("decode", 1) if decodes else 0.0)
            start = max(t0, self.free_at)
            self.free_at = start + dur
            req_ids = list(so.num_scheduled_tokens)
            out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                    sampled_token_ids=ids, logprobs=None)
            step = {"phase": phase, "rows": rows, "at": t0, "inputs": time.perf_counter() - t0,
                    "mode": "async" if self.async_ else "sync"}
            self.pending = Out(out, self.free_at, step, self._log)
            return None

        def sample_tokens(self, grammar_output):
            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
            p, self.pending = self.pending, None
            if p is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return p if self.async_ else p.get_output()

        def shutdown(self):
            return

    return NullWorker


def __getattr__(name):
    if name == "NullWorker":
        cls = _make_worker_class()
        globals()["NullWorker"] = cls
        return cls
    raise AttributeError(name)


def main() -> int:
    """``null_engine.py serve SRC [args]``: vLLM's API server (its CLI) with the patch."""
    patch_cpu_platform()
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm"] + sys.argv[1:]
    return vllm_main()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
