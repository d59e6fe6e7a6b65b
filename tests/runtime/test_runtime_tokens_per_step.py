"""Several decode tokens per host step (``runtime.output_tokens_per_step``, issue 25): the decode
program replayed in one engine step, each replay fed the previous one's sampled ids on the device,
the step read back once; vLLM schedules it as that many tokens a request (placeholder proposals,
all accepted).

* On the TT platform path with the timing device (its own process, ``timing_engine_run.py``): the
  token ids are the device's documented rule (``test_runtime_async.expected_tokens``, recomputed
  here), with async scheduling on and off, on one chip and on 8 lanes; each step's replays are all
  enqueued before its first readback; a batch with a host-sampled row, or a step scheduled while a
  prompt waits to prefill, runs one token a step.
* On the emulated mesh through vLLM's engine: the greedy tokens of 1 and 4 tokens a step equal
  transformers' ``generate``, async on and off, with a host-sampled request mixed in.
* The rule (``capabilities.tokens_per_step``) and the spec's checks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from runtime_helpers import hf_greedy, run_engine_script, spec_text

HERE = Path(__file__).resolve().parent
K = 4
STEP_MS = 20.0
PROMPTS = [5, 40, 3]
MAX_TOKENS = 12  # 11 after the prefill's: the last step's 4th token is dropped by vLLM


def declared(text: str, k: int = K) -> str:
    d = yaml.safe_load(text)
    d["runtime"]["output_tokens_per_step"] = k
    return yaml.safe_dump(d, sort_keys=False)


def _env(step_ms: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TTBUNDLE_EMULATED", "TTBUNDLE_TEST_TTNN")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    env["TTBUNDLE_DEVICE_MODEL"] = f"timing:{step_ms:g}ms"
    return env


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    from ttbundle.serving.demo import build_package

    pkg = build_package(declared(spec_text("llama")), tmp_path_factory.mktemp("k4"), "N150", backend="ttnn",
                        warmup=False)
    base = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    cases = {"async": {**base, "async": True},
             "sync": {**base, "async": False},
             "one": {**base, "async": True, "tt": {"output_tokens_per_step": 1}},
             "host": {**base, "async": True, "logprobs": [2]}}
    return run_engine_script(HERE / "timing_engine_run.py", pkg, cases, _env(STEP_MS))


def tokens_a_step(steps) -> list[tuple[bool, set]]:
    """Per decode step (step log dicts or ``Step``s): (whether a prefill step comes later, so a
    prompt was waiting when it was scheduled; the tokens its rows ran). In the order the steps
    were submitted (the log has an async decode when it is read back, after a later prefill)."""
    steps = sorted(steps, key=lambda s: s["at"] if isinstance(s, dict) else s.at)
    phases = [s["phase"] if isinstance(s, dict) else s.phase for s in steps]
    rows = [s["rows"] if isinstance(s, dict) else s.rows for s in steps]
    last_prefill = max((i for i, p in enumerate(phases) if p == "prefill"), default=-1)
    return [(i < last_prefill, {r[2] for r in rows[i]}) for i, p in enumerate(phases) if p == "decode"]


def assert_k_once_no_prompt_waits(steps, k: int = K) -> None:
    """K tokens a row in every decode step scheduled when no prompt waited to prefill, one while
    one did (a K-token step would hold it K device steps)."""
    got = tokens_a_step(steps)
    assert any(not waiting for waiting, _ in got), "no decode step after the last prefill"
    for waiting, counts in got:
        assert counts == ({1} if waiting else {k}), got


def decode_steps(res: dict) -> list[tuple[dict, list[dict], list[dict]]]:
    """Each decode step of the step log with its executes and its reads (the device's events of
    that step's programs), in step order."""
    ev = res["events"]
    ex = [(i, e) for i, e in enumerate(ev) if e["kind"] == "execute"]
    out, k = [], 0
    for s in res["steps"]:
        n = len(s["rows"]) if s["phase"] == "prefill" else max(r[2] for r in s["rows"]) * len(s["buckets"])
        mine = ex[k:k + n]
        k += n
        if s["phase"] == "decode":
            ids = {e["step"] for _, e in mine}
            reads = [(i, e) for i, e in enumerate(ev) if e["kind"] == "read" and e["step"] in ids]
            out.append((s, mine, reads))
    assert k == len(ex), "the step log and the device's programs disagree"
    return out


@pytest.mark.slow  # one engine process, four engines
def test_timing_device_tokens_are_its_rule_at_several_tokens_a_step(timed):
    from test_runtime_async import expected_tokens
    for name in ("async", "sync", "one"):  # (host-sampled rows: the timing device models no logits)
        res = timed[name]
        for prompt, toks in zip(res["prompts"], res["tokens"]):
            assert toks == expected_tokens(prompt, MAX_TOKENS, res["vocab"]), name
    assert timed["async"]["async_scheduling"] and not timed["sync"]["async_scheduling"]
    for name in ("async", "sync"):
        assert_k_once_no_prompt_waits(timed[name]["steps"])
    assert {r[2] for s in timed["one"]["steps"] if s["phase"] == "decode" for r in s["rows"]} == {1}


@pytest.mark.slow
def test_a_steps_replays_are_enqueued_before_its_first_readback(timed):
    """The K replays of a step go to the device back to back, each fed on the device (nothing is
    read back between them); with async scheduling the next step's replays are enqueued
    before this step is read back."""
    for name in ("async", "sync"):
        steps = decode_steps(timed[name])
        assert steps
        for s, ex, reads in steps:
            assert len(ex) == K and reads, s
            assert max(i for i, _ in ex) < min(i for i, _ in reads), (name, s["rows"])
    steps = decode_steps(timed["async"])
    assert sum(1 for (_, _, ra), (_, eb, _) in zip(steps, steps[1:]) if eb[0][0] < min(i for i, _ in ra)) \
        == len(steps) - 1


@pytest.mark.slow
def test_no_step_is_scheduled_once_a_requests_last_token_is_in_flight(timed):
    """With K tokens in flight a request whose max_tokens they reach gets no further step: every
    decode row starts before the request's last position (prompt + max_tokens - 1)."""
    for name in ("async", "sync"):
        res = timed[name]
        length = {}
        for s in res["steps"]:
            if s["phase"] == "prefill":
                for rid, start, n in s["rows"]:
                    length[rid] = max(length.get(rid, 0), start + n)
        decode_rows = [r for s in res["steps"] if s["phase"] == "decode" for r in s["rows"]]
        assert decode_rows
        for rid, start, n in decode_rows:
            assert start < length[rid] + MAX_TOKENS - 1, (name, rid, start)
        # ceil((MAX_TOKENS - 1) / K) decode steps a request: none wasted
        per_req = {}
        for rid, _, _ in decode_rows:
            per_req[rid] = per_req.get(rid, 0) + 1
        assert set(per_req.values()) == {-(-(MAX_TOKENS - 1) // K)}, (name, per_req)


@pytest.mark.slow
def test_a_batch_with_a_host_sampled_row_runs_one_token_a_step(timed):
    res = timed["host"]
    host_rid = [r[0] for s in res["steps"] for r in s["rows"] if r[0].startswith("2-")][0]
    for s in res["steps"]:
        if s["phase"] == "decode":
            with_host = any(r[0] == host_rid for r in s["rows"])
            assert {r[2] for r in s["rows"]} == ({1} if with_host else {K}), s
            assert (s["sampling"] == "host") == with_host


@pytest.fixture(scope="module")
def lanes_timed(tmp_path_factory):
    from test_runtime_lanes import PER_LANE, lanes_spec

    from ttbundle.serving.demo import build_package

    pkg = build_package(declared(lanes_spec()), tmp_path_factory.mktemp("k4lanes"), "T3K", backend="ttnn",
                        warmup=False)
    lens = [5, 40, 60, 3, 50, 17, 64, 9, 33, 1, 50, 12, 30, 26, 45, 8]  # 2 a lane, one chunk each
    cases = {"on": {"async": True, "prompts": lens, "max_tokens": MAX_TOKENS, "max_num_seqs": 8 * PER_LANE}}
    return run_engine_script(HERE / "timing_engine_run.py", pkg, cases, _env(STEP_MS))["on"]


@pytest.mark.slow
def test_lanes_run_several_tokens_a_step_side_by_side(lanes_timed):
    from test_runtime_async import expected_tokens
    res = lanes_timed
    assert res["async_scheduling"]
    for prompt, toks in zip(res["prompts"], res["tokens"]):
        assert toks == expected_tokens(prompt, MAX_TOKENS, res["vocab"])
    steps = decode_steps(res)
    assert_k_once_no_prompt_waits(res["steps"])
    full = [(s, ex) for s, ex, _ in steps if len(set(s["lanes"])) == 8 and s["rows"][0][2] == K]
    assert full
    # 8 lanes x K replays end within 2 K modeled steps (a lane may still be finishing a prefill
    # chunk): the submeshes ran side by side; in turn, the last would end 8 K - 1 steps after the first
    for s, ex in full:
        assert len(ex) == 8 * K
        assert max(e["done"] for _, e in ex) - min(e["done"] for _, e in ex) < 2 * K * STEP_MS / 1000


# -- the emulated mesh through vLLM's engine ---------------------------------------------------
@pytest.mark.slow
def test_emulated_tokens_equal_transformers_at_several_tokens_a_step(tmp_path_factory):
    from ttbundle.serving.demo import build_package
    from test_runtime_async import _engine_run

    d = tmp_path_factory.mktemp("k4emu")
    pkg = build_package(declared(spec_text("llama")), d, "N150")
    lens = (5, 100, 3, 64, 20)
    prompts = [{"prompt_token_ids": [(11 + 7 * i + n) % 500 + 8 for i in range(n)]} for n in lens]
    greedy = [dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * len(prompts)
    ref = [hf_greedy(d / "src-tiny-llama", p["prompt_token_ids"], MAX_TOKENS) for p in prompts]
    for async_scheduling in (True, False):
        toks, steps = _engine_run(pkg, async_scheduling, prompts, greedy)
        assert toks == ref, async_scheduling
        assert_k_once_no_prompt_waits(steps)
    mixed = greedy[:-1] + [dict(greedy[-1], logprobs=2)]
    toks, steps = _engine_run(pkg, True, prompts, mixed)
    assert toks == ref
    assert any(r[2] == 1 for s in steps if s.phase == "decode" for r in s.rows)


@pytest.mark.slow
def test_stop_tokens_and_seeded_sampling_as_at_one_token_a_step(tmp_path_factory):
    """A stop token met inside a K-token step ends the request there (vLLM drops the step's later
    tokens), and seeded stochastic rows (sampled on the emulated mesh, a generator per row) draw
    the same tokens as at one token a step (the option set to 1)."""
    from ttbundle.serving.demo import build_package
    from test_runtime_async import _engine_run

    pkg = build_package(declared(spec_text("llama")), tmp_path_factory.mktemp("k4stop"), "N150")
    prompts = [{"prompt_token_ids": [(11 + 7 * i + n) % 500 + 8 for i in range(n)]} for n in (5, 100, 3, 64, 20)]
    greedy, _ = _engine_run(pkg, True, prompts, [dict(max_tokens=20, temperature=0, ignore_eos=True)] * 5)
    params = [dict(max_tokens=20, temperature=0, stop_token_ids=[g[6]]) for g in greedy]  # mid-step
    params += [dict(max_tokens=20, temperature=0.9, top_k=20, seed=3 + i) for i in range(5)]
    got = {}
    for k in (1, K):
        got[k], steps = _engine_run(pkg, True, prompts * 2, params, additional_config={"tt": {"output_tokens_per_step": k}})
        assert {r[2] for s in steps if s.phase == "decode" for r in s.rows} >= {k}
    assert got[K] == got[1]
    assert [len(t) for t in got[K][:5]] == [g.index(g[6]) + 1 for g in greedy]


@pytest.mark.slow
def test_a_prompt_found_whole_in_the_prefix_cache_prefills_its_last_token(tmp_path_factory):
    """A prompt of 65 tokens sent again hits 64 in the prefix cache and prefills one token. vLLM's
    scheduler, told of K - 1 proposals a step, would pad that one token to a decode of K (and the
    runner would find its input tokens unknown); ttbundle's scheduler tells it of them in decode
    steps only. Host-sampled (logprobs) too."""
    from ttbundle.serving.demo import build_package
    from test_runtime_async import _engine_run

    d = tmp_path_factory.mktemp("k4cache")
    pkg = build_package(declared(spec_text("llama")), d, "N150")
    prompt = {"prompt_token_ids": [(7 * i) % 500 + 8 for i in range(65)]}
    ref = hf_greedy(d / "src-tiny-llama", prompt["prompt_token_ids"], MAX_TOKENS)
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for params in (greedy, dict(greedy, logprobs=1)):
        toks, steps = _engine_run(pkg, True, [prompt, prompt], [params, params], enable_prefix_caching=True,
                                  max_num_seqs=1)  # one at a time: the second finds the first's blocks
        assert toks == [ref, ref], params
        pre = [r for s in steps if s.phase == "prefill" for r in s.rows]
        assert tuple(pre[-1][1:]) == (64, 1), pre


@pytest.mark.slow
def test_emulated_lanes_tokens_equal_transformers_at_several_tokens_a_step(tmp_path_factory):
    """Lanes on the emulated mesh (synchronous steps): each lane's K replays on its own KV region."""
    from test_runtime_lanes import PER_LANE, _prompts, lanes_spec
    from test_runtime_async import _engine_run

    from ttbundle.serving.demo import build_package

    d = tmp_path_factory.mktemp("k4emulanes")
    pkg = build_package(declared(lanes_spec()), d, "T3K")
    prompts = _prompts([5, 40, 100, 3, 70, 17, 64, 9, 120, 33, 1, 50])
    greedy = [dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * len(prompts)
    toks, steps = _engine_run(pkg, True, prompts, greedy, max_num_seqs=8 * PER_LANE)
    assert toks == [hf_greedy(d / "src-tiny-llama-r1x1", p["prompt_token_ids"], MAX_TOKENS) for p in prompts]
    decodes = [s for s in steps if s.phase == "decode"]
    assert_k_once_no_prompt_waits(steps)
    assert max(len(set(s.lanes)) for s in decodes if s.rows[0][2] == K) > 1


# -- the rule ------------------------------------------------------------------------------------
def test_tokens_per_step_rule():
    from ttbundle import spec
    from ttbundle.runtime.capabilities import tokens_per_step

    from ttbundle.package.facts import of_bundle

    b = of_bundle(spec.loads(declared(spec_text("llama"), 8)))
    assert tokens_per_step(b, device=False) == 8
    assert tokens_per_step(b, device=False, requested=3) == 3
    assert tokens_per_step(b, device=False, sample_mode="off") == 1
    assert tokens_per_step(b, device=False, speculative=True) == 1
    with pytest.raises(ValueError, match="output_tokens_per_step=9 exceeds the package's "
                                         "runtime.output_tokens_per_step=8"):
        tokens_per_step(b, device=False, requested=9)


def test_a_device_runs_the_declared_tokens_a_step(monkeypatch):
    """ttnn lowers the feed (backends/ttnn/feed: a gather inside the decode trace), so a device
    runs what the package declares, as the emulated mesh and the timing device do."""
    from ttbundle import spec
    from ttbundle.runtime.capabilities import model_capabilities, tokens_per_step

    from ttbundle.package.facts import of_bundle

    b = of_bundle(spec.loads(declared(spec_text("llama"), 8)))
    monkeypatch.delenv("TTBUNDLE_DEVICE_MODEL", raising=False)  # ttnn: the feed is lowered (backends/ttnn/feed)
    assert tokens_per_step(b, device=True) == 8
    assert model_capabilities(b, device=True)["output_tokens_per_step"] == 8
    assert model_capabilities(b, device=False)["output_tokens_per_step"] == 8
    assert tokens_per_step(b, device=True, sample_mode="off") == 1
    monkeypatch.setenv("TTBUNDLE_DEVICE_MODEL", "timing:2ms")
    assert tokens_per_step(b, device=True) == 8


@pytest.mark.parametrize("change, words", [
    ({"runtime": {"sample_on_device_mode": "off"}}, "sample_on_device_mode is off"),
    ({"speculative": {"method": "ngram", "num_speculative_tokens": 3}}, "both schedule several tokens"),
])
def test_spec_refuses_several_tokens_a_step_where_they_cannot_run(change, words):
    from ttbundle import spec
    from ttbundle.errors import InvalidInput

    d = yaml.safe_load(declared(spec_text("llama")))
    for key, v in change.items():
        d[key] = {**d.get(key, {}), **v}
    text = yaml.safe_dump(d, sort_keys=False)
    with pytest.raises(InvalidInput) as e:
        spec.loads(text, "tiny.yaml")
    (diag,) = e.value.diagnostics
    line = next(i for i, x in enumerate(text.splitlines(), 1) if "output_tokens_per_step" in x)
    assert (diag.path, diag.line) == ("runtime.output_tokens_per_step", line)
    assert words in diag.message
