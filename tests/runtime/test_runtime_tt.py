"""The TT platform through vLLM's engine, without hardware: ``tt_engine_run.py`` runs the engine
in its own process (vLLM picks a platform once per process) with the test-only hook
``TTBUNDLE_TEST_TTNN=recording``, so ``ttbundle.runtime.ttdevice`` drives the recording double
instead of ttnn. Checked from the double's events, independently of the runner's own
bookkeeping: every forward compiles in warm-up before the first capture, nothing compiles inside
a capture or while serving, each step replays the trace of the bucket the scheduler's rows pad
to (the buckets recomputed here), where sampling happens follows ``sample_on_device_mode`` (the
captured program ends in ``sampling`` or not), and every request gets its tokens. Numerics are
not checked here (tests/test_ttnn_double.py compares the double's forwards with the emulated
backend)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runtime_helpers import DECODE, PREFILL, pick, run_engine_script, spec_text

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 4
PROMPTS = [5, 40, 100, 3]
CHOICES = ["ba", "be", "bi"]  # words of the demo tokenizer
CASES = {
    "all": {"tt": {}, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": [3], "choice": CHOICES},
    "decode_only": {"tt": {"sample_on_device_mode": "decode_only"}, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
    "trace_decode_only": {"tt": {"trace_mode": "decode_only"}, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from ttbundle.serving.demo import build_package

    pkg = build_package(spec_text("llama"), tmp_path_factory.mktemp("ttpkg"), "T3K", backend="ttnn", warmup=False)
    env = {k: v for k, v in os.environ.items() if k != "TTBUNDLE_EMULATED"}
    return run_engine_script(HERE / "tt_engine_run.py", pkg, CASES, env)


def check_order(res: dict) -> None:
    """Compile warm-up of every forward, then captures, then replays only (events of the double)."""
    ev = res["events"]
    begins = [i for i, e in enumerate(ev) if e["fn"] == "begin_trace_capture"]
    compiles = [i for i, e in enumerate(ev) if e.get("compiled")]
    assert compiles, "nothing compiled"
    assert not begins or max(compiles) < begins[0], "a compile after the first capture began"
    assert not any(e.get("compiled") for e in ev if e.get("capturing")), "a compile inside a capture"
    assert not any(e.get("compiled") for e in ev[res["event_index_serving"]:]), "a compile while serving"
    assert len(begins) == len(res["traced"]) == len(res["traces"])
    assert res["violations"] == []


def expected_runs(res: dict) -> list[list]:
    """(phase, bucket, sampling) of every forward the steps needed, from the step log's rows:
    each prefill row alone padded to its bucket, each decode batch padded to its bucket; a
    partial chunk returns logits (host), a sampled row where the step says."""
    out = []
    for s in res["steps"]:
        mode = "device" if s["sampling"] == "device" else "host"
        if s["phase"] == "decode":
            out.append(["decode", pick(DECODE, len(s["rows"])), mode])
            continue
        for rid, start, n in s["rows"]:
            last = any(r[0] == rid and r[1] > start for t in res["steps"] for r in t["rows"]
                       if t["phase"] == "decode")  # its prompt ended here if it decoded later
            final = last and not any(t["phase"] == "prefill" and r[0] == rid and r[1] > start
                                     for t in res["steps"] for r in t["rows"])
            out.append(["prefill", pick(PREFILL, n), mode if final else "host"])
    return out


def replayed(res: dict) -> list[list]:
    """(phase, bucket, sampling) of every execute_trace while serving, by its trace id."""
    ev = res["events"][res["event_index_serving"]:]
    return [res["traces"][str(e["trace"])][:3] for e in ev if e["fn"] == "execute_trace"]


def captured_ops(res: dict) -> dict:
    """The ops of each capture, by the captured forward's key (end_trace_capture names the id)."""
    out, cur = {}, None
    for e in res["events"]:
        if e["fn"] == "begin_trace_capture":
            cur = set()
        elif e["fn"] == "end_trace_capture":
            out[tuple(res["traces"][str(e["trace"])])] = cur
            cur = None
        elif cur is not None:
            cur.add(e["fn"])
    return out


def test_requests_complete_with_their_tokens(results):
    for name, res in results.items():
        assert res["tokens"] == [MAX_TOKENS] * len(PROMPTS), name


def test_warmup_compiles_everything_before_any_capture(results):
    for name, res in results.items():
        check_order(res)
        forwards = {tuple(k) for k in res["forwards"]}
        # every bucket, device and host sampling variants where the mode allows them
        assert {(k[0], k[1]) for k in forwards} == {("prefill", b) for b in PREFILL} | {("decode", b) for b in DECODE}


def test_each_step_replays_the_trace_of_its_padded_bucket(results):
    res = results["all"]
    assert replayed(res) == expected_runs(res)
    assert {tuple(k) for k in res["traced"]} == {tuple(k) for k in res["forwards"]}  # trace_mode all


def test_trace_mode_decode_only_replays_decodes_and_runs_prefills_eagerly(results):
    res = results["trace_decode_only"]
    assert {k[0] for k in res["traced"]} == {"decode"}
    assert replayed(res) == [k for k in expected_runs(res) if k[0] == "decode"]
    serving = res["events"][res["event_index_serving"]:]
    assert any(e["fn"] not in ("execute_trace",) for e in serving)  # prefill ops ran eagerly, compiled before


def test_sample_on_device_mode_moves_sampling(results):
    for name, res in results.items():
        ops = captured_ops(res)
        assert len(ops) == len(res["traced"]), name
        for key, fns in ops.items():  # a device-sampling program ends in ttnn.sampling, a host one does not
            assert ("sampling" in fns) == (key[2] == "device"), (name, key)
    a, d = results["all"], results["decode_only"]
    assert any(k[0] == "prefill" and k[2] == "device" for k in replayed(a))
    assert all(k[2] == "host" for k in replayed(d) if k[0] == "prefill")
    assert all(k[2] == "device" for k in replayed(d) if k[0] == "decode")
    assert not any(k[0] == "prefill" and k[2] == "device" for k in d["forwards"])
    assert {s["sampling"] for s in d["steps"] if s["phase"] == "prefill"} <= {"host", "none"}
    assert "host" in {s["sampling"] for s in a["steps"]}  # the logprobs request's batches


def test_structured_output_samples_on_the_host_with_the_grammar(results):
    """A request with structured output (vLLM's choice) on the device path: its batches run the
    host-logits programs and vLLM's sampler applies the grammar bitmask (the same prompt
    unconstrained says something else, so the constraint did it)."""
    c = results["all"]["choice"]
    assert c["chosen"].strip() in CHOICES and c["finish"] == "stop", c  # (word-level: " ba")
    assert c["plain"].split()[0] not in CHOICES, c
    assert "host" in c["sampling"] and "device" in c["sampling"], c  # the plain row decodes on the device


def test_the_checks_catch_a_broken_order(results):
    """The same checks on altered event logs: a compile moved into a capture, a replay of
    another bucket's trace."""
    res = json.loads(json.dumps(results["all"]))
    i = next(i for i, e in enumerate(res["events"]) if e.get("capturing"))
    res["events"][i]["compiled"] = True
    with pytest.raises(AssertionError, match="compile"):
        check_order(res)
    res = json.loads(json.dumps(results["all"]))
    serving = [e for e in res["events"][res["event_index_serving"]:] if e["fn"] == "execute_trace"]
    other = next(t for t, k in res["traces"].items() if k[:3] != replayed(res)[0])
    serving[0]["trace"] = int(other)
    assert replayed(res) != expected_runs(res)
