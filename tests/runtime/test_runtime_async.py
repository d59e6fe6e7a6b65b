"""Async decode with vLLM's async scheduling (issue 13).

* On the TT platform path with the timing device (``TTBUNDLE_DEVICE_MODEL``, in its own process:
  ``timing_engine_run.py``), from the device's own event order: with async scheduling decode step
  N+1 is enqueued before step N's readback; without it, or when a batch samples on the host, every
  readback comes before the next step is enqueued; a readback never returns before its modeled
  step is done; the token ids are the timing device's documented rule, recomputed here.
* On the emulated mesh through vLLM's engine: the same greedy tokens with async scheduling on and
  off, equal to transformers' ``generate``, and host-sampled batches run synchronous steps.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime_helpers import PREFILL, hf_greedy, pick, run_engine_script, spec_text

HERE = Path(__file__).resolve().parent
STEP_MS = 14.0
PROMPTS = [5, 40, 3]
MAX_TOKENS = 6
CASES = {
    "on": {"async": True, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
    "off": {"async": False, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
    "host": {"async": True, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": [2]},
    # rows joining and leaving the decode batch at different steps, past KV block boundaries: the
    # runner's persistent batch state rebuilt and reused (prompts within one prefill chunk)
    "long": {"async": True, "prompts": [5, 40, 3, 60, 20, 33], "max_tokens": 40},
}


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    from ttbundle.serving.demo import build_package

    pkg = build_package(spec_text("llama"), tmp_path_factory.mktemp("ttpkg"), "N150", backend="ttnn", warmup=False)
    env = {k: v for k, v in os.environ.items() if k not in ("TTBUNDLE_EMULATED", "TTBUNDLE_TEST_TTNN")}
    env["TTBUNDLE_DEVICE_MODEL"] = f"timing:{STEP_MS:g}ms"
    return run_engine_script(HERE / "timing_engine_run.py", pkg, CASES, env)


def decode_order(res: dict) -> list[tuple[int, int, int]]:
    """(step, index of its execute, index of its read) of every decode, from the device's events."""
    ev = res["events"]
    ex = {e["step"]: i for i, e in enumerate(ev) if e["kind"] == "execute" and e["key"][0] == "decode"}
    rd = {}
    for i, e in enumerate(ev):
        if e["kind"] == "read" and e["step"] in ex:
            rd.setdefault(e["step"], i)
    assert set(rd) == set(ex), "a decode step never read back"
    return sorted((s, ex[s], rd[s]) for s in ex)


def expected_tokens(prompt: list[int], n: int, vocab: int) -> list[int]:
    """The timing device's rule (timing.py): prefill (31 * sum(tokens) + bucket) % V, then each
    decode (31 * token + 7 * position + 1) % V."""
    out = [(31 * sum(prompt) + pick(PREFILL, len(prompt))) % vocab]
    while len(out) < n:
        out.append((31 * out[-1] + 7 * (len(prompt) + len(out) - 1) + 1) % vocab)
    return out


@pytest.mark.slow  # one engine process, three engines: about a minute
def test_async_decode_submits_the_next_step_before_reading_back(timed):
    res = timed["on"]
    assert res["async_scheduling"]
    order = decode_order(res)
    assert len(order) >= MAX_TOKENS - 2
    overlapped = [(a, b) for a, b in zip(order, order[1:]) if b[1] < a[2]]
    # every decode after the first was enqueued while the one before was still unread
    assert len(overlapped) == len(order) - 1, order
    assert {s["mode"] for s in res["steps"] if s["phase"] == "decode"} == {"async"}


@pytest.mark.slow  # one engine process, three engines: about a minute
def test_without_async_scheduling_each_step_is_read_before_the_next(timed):
    res = timed["off"]
    assert not res["async_scheduling"]
    order = decode_order(res)
    assert all(b[1] > a[2] for a, b in zip(order, order[1:])), order
    assert {s["mode"] for s in res["steps"]} == {"sync"}


@pytest.mark.slow  # one engine process, three engines: about a minute
def test_host_sampled_batches_fall_back_to_synchronous_steps(timed):
    res = timed["host"]
    assert res["async_scheduling"]  # on, but a host-sampled batch cannot use it
    decodes = [s for s in res["steps"] if s["phase"] == "decode"]
    assert decodes and {(s["sampling"], s["mode"]) for s in decodes} == {("host", "sync")}
    ev = res["events"]
    ex = [i for i, e in enumerate(ev) if e["kind"] == "execute"]
    groups, k = [], 0  # each engine step's programs: one per chunk of a prefill step, one per decode
    for s in res["steps"]:
        n = len(s["rows"]) if s["phase"] == "prefill" else 1
        groups.append(ex[k:k + n])
        k += n
    assert k == len(ex)
    # each step's outputs are read (logits to vLLM's sampler) before the next step is enqueued (a
    # prefill step's chunks are all enqueued before any is read back: on lanes they run side by side)
    for g, nxt in zip(groups, groups[1:]):
        for i in g:
            assert any(e["kind"] == "read" and e["step"] == ev[i]["step"] for e in ev[i + 1:nxt[0]]), (i, nxt[0])


@pytest.mark.slow  # one engine process, three engines: about a minute
def test_readback_waits_for_the_modeled_step(timed):
    for res in (timed["on"], timed["off"]):
        ex = {e["step"]: e for e in res["events"] if e["kind"] == "execute"}
        reads = [e for e in res["events"] if e["kind"] == "read"]
        assert reads
        for r in reads:
            assert r["done"] >= ex[r["step"]]["done"] - 1e-4  # not before the device is done
        # the device runs its queue in order: a step starts when the one before it ends
        steps = sorted(ex.values(), key=lambda e: e["step"])
        for a, b in zip(steps, steps[1:]):
            dur = (STEP_MS if b["key"][0] == "decode" else None)
            if dur is not None:
                assert b["done"] - max(b["at"], a["done"]) == pytest.approx(dur / 1000, abs=1e-6)


@pytest.mark.slow  # one engine process, three engines: about a minute
def test_timing_device_tokens_are_its_rule_with_async_on_and_off(timed):
    for name in ("on", "off", "long"):
        res = timed[name]
        n = CASES[name]["max_tokens"]
        for prompt, toks in zip(res["prompts"], res["tokens"]):
            assert toks == expected_tokens(prompt, n, res["vocab"]), name
    decodes = [s for s in timed["long"]["steps"] if s["phase"] == "decode"]
    assert {s["mode"] for s in decodes} == {"async"} and len({len(s["rows"]) for s in decodes}) > 2


def test_timing_switch_parses_and_refuses():
    from ttbundle.errors import InvalidInput
    from ttbundle.runtime import timing

    assert timing.parse("timing:14ms") == timing.StepTimes(14.0, 53.0)  # published 70B Galaxy TTFT
    assert timing.parse("timing:38") == timing.StepTimes(38.0, 104.0)  # published 8B N150 TTFT
    assert timing.parse("timing:5ms/20ms") == timing.StepTimes(5.0, 20.0)
    t = timing.parse("timing:5")
    assert t.prefill128_ms == 15.0 and t.seconds("prefill", 256) == pytest.approx(0.030)
    assert t.seconds("decode", 1) == t.seconds("decode", 32) == pytest.approx(0.005)
    for bad in ("timing", "14ms", "timing:-3", "timing:fast"):
        with pytest.raises(InvalidInput, match="TTBUNDLE_DEVICE_MODEL"):
            timing.parse(bad)


def test_timing_device_runs_each_submesh_queue_side_by_side():
    """Lanes on a device: each submesh (``create_submeshes`` of the recording double) has its own
    queue, so 8 lanes' decode steps enqueued at once end after one step of device time, and a
    second step on a submesh starts when that submesh's first one ends (ttnn's in-order queue)."""
    from types import SimpleNamespace

    from ttbundle.backends.ttnn import recording
    from ttbundle.runtime import timing

    dev = timing.TimingDevice(timing.parse("timing:50ms"))
    tt = dev.wrap(recording.Recorder().module())
    subs = tt.open_mesh_device(tt.MeshShape(1, 8)).create_submeshes(tt.MeshShape(1, 1))
    assert len(subs) == 8
    for i in range(8):
        dev._traces[i] = (("decode", 32, "device", 0), {}, {})
    for i, sub in enumerate(subs):
        tt.execute_trace(sub, SimpleNamespace(n=i), blocking=False)
    tt.execute_trace(subs[0], SimpleNamespace(n=0), blocking=False)
    ex = [e for e in dev.events if e.kind == "execute"]
    first = [e.done - e.at for e in ex[:8]]
    assert max(first) == pytest.approx(0.050, abs=0.01)  # side by side, not 8 x 50 ms
    assert ex[8].done == pytest.approx(ex[0].done + 0.050, abs=1e-6)  # submesh 0's queue, in order
    assert dev.busy == pytest.approx(9 * 0.050)
    ev = tt.record_event(subs[3])
    assert ev.at == ex[3].done  # an event on a submesh waits for that submesh's queue only


# -- the emulated mesh through vLLM's engine ---------------------------------------------------
def _engine_run(pkg, async_scheduling: bool, prompts, params, **engine_args):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(pkg), dtype="float32", seed=0, async_scheduling=async_scheduling, **engine_args)
    try:
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        n0 = len(runner.step_log)
        outs = llm.generate(prompts, [SamplingParams(**p) for p in params], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], list(runner.step_log)[n0:]
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_emulated_tokens_identical_with_async_on_and_off(make_package):
    pkg, src = make_package("llama", "N150")
    lens = (5, 100, 3, 64, 20)
    prompts = [{"prompt_token_ids": [(11 + 7 * i + n) % 500 + 8 for i in range(n)]} for n in lens]
    greedy = [dict(max_tokens=10, temperature=0, ignore_eos=True)] * len(prompts)
    on, steps_on = _engine_run(pkg, True, prompts, greedy)
    off, steps_off = _engine_run(pkg, False, prompts, greedy)
    ref = [hf_greedy(src, p["prompt_token_ids"], 10) for p in prompts]
    assert on == off == ref
    assert {s.mode for s in steps_on if s.phase == "decode"} == {"async"}
    assert {s.mode for s in steps_off} == {"sync"}
    # one host-sampled request (logprobs) makes every batch it is in synchronous, same tokens
    mixed = greedy[:-1] + [dict(greedy[-1], logprobs=2)]
    host, steps_host = _engine_run(pkg, True, prompts, mixed)
    assert host == ref
    last = f"{len(prompts) - 1}-"
    for s in steps_host:
        if s.phase == "decode" and any(r[0].startswith(last) for r in s.rows):
            assert (s.sampling, s.mode) == ("host", "sync")
