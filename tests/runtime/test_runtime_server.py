"""End to end: `ttbundle serve`'s vLLM command (vLLM's own OpenAI server, real vLLM 0.33.0) on a
package, on 127.0.0.1, driven by the official `openai` client; outputs compared with
transformers `generate` on the checkpoint the package was built from. One server per
(family, mesh) in ``CASES``; families join by adding a tiny arch to runtime_helpers."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime_helpers import CASES, DECODE, MAX_MODEL_LEN, PREFILL, assert_prefill_plan, hf_greedy, pick, serving

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


@dataclass
class Server:
    url: str
    name: str
    src: Path
    step_log: Path
    log: Path

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url, api_key="none", timeout=120, max_retries=0, **kw)


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{m}" for f, m in CASES])
def server(request, make_package, tmp_path_factory):
    family, mesh = request.param
    pkg, src = make_package(family, mesh)
    d = tmp_path_factory.mktemp(f"serve-{family}-{mesh}")
    with serving(pkg, d) as plan:
        yield Server(plan.url, plan.name, src, d / "steps.jsonl", d / "vllm.log")


@pytest.fixture(scope="module")
def tok(server):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(server.src))


def _text(n: int, seed: int) -> str:
    from ttbundle.serving.demo import words
    rng = random.Random(seed)
    w = words(300)
    return " ".join(rng.choice(w) for _ in range(n))


@pytest.mark.parametrize("n_words", [1, 7, 40, 63, 64, 65, 150, 230])
def test_greedy_completion_matches_transformers(server, tok, n_words):
    text = _text(n_words, n_words)
    r = server.client().completions.create(model=server.name, prompt=text, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = tok(text).input_ids
    c = r.choices[0]
    assert c.prompt_token_ids == ids
    assert c.token_ids == hf_greedy(server.src, ids, 12)
    assert r.usage.completion_tokens == 12 and c.finish_reason == "length"


def test_chat_uses_the_tokenizer_chat_template(server, tok):
    messages = [{"role": "system", "content": _text(5, 1)}, {"role": "user", "content": _text(9, 2)}]
    r = server.client().chat.completions.create(model=server.name, messages=messages, max_tokens=10,
                                                temperature=0, extra_body={"ignore_eos": True,
                                                                           "return_token_ids": True})
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    ref = hf_greedy(server.src, ids, 10)
    assert r.choices[0].token_ids == ref
    assert r.choices[0].message.content.strip() == tok.decode(ref, skip_special_tokens=True)


def test_streaming_gives_the_same_text(server):
    c = server.client()
    kw = dict(model=server.name, prompt=_text(20, 3), max_tokens=15, temperature=0, extra_body={"ignore_eos": True})
    full = c.completions.create(**kw).choices[0].text
    parts = [ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices]
    # streamed in pieces, not one blob: vLLM's server merges the deltas of outputs that queued
    # while it was busy (RequestOutputCollector), and with async scheduling the engine runs a
    # step ahead, so how many pieces arrive depends on the machine's load, not on us
    assert len([p for p in parts if p]) >= 2
    assert "".join(parts) == full
    chat = list(c.chat.completions.create(model=server.name, stream=True, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": _text(4, 4)}],
                                          extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices).strip()


def test_stop_strings_and_max_tokens(server):
    c = server.client()
    prompt = _text(12, 5)
    words = c.completions.create(model=server.name, prompt=prompt, max_tokens=10, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text.split()
    i = next(i for i in range(2, len(words)) if words[i] not in words[:i])  # first new word
    r = c.completions.create(model=server.name, prompt=prompt, max_tokens=10, temperature=0, stop=[words[i]],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == words[i]
    assert r.choices[0].text.split() == words[:i]
    for n in (1, 5, 33):
        r = c.completions.create(model=server.name, prompt=prompt, max_tokens=n, temperature=0.7,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(server):
    c = server.client()
    kw = dict(model=server.name, prompt=_text(10, 6), max_tokens=16, temperature=1.0, top_p=0.9,
              extra_body={"ignore_eos": True, "top_k": 40})
    a = [c.completions.create(seed=11, **kw).choices[0].text for _ in range(2)]
    b = c.completions.create(seed=12, **kw).choices[0].text
    assert a[0] == a[1] and b != a[0]


def test_32_concurrent_clients(server):
    """32 clients, 3 requests each, in a bounded loop: every one completes with its token count."""
    async def client(i, c):
        rng = random.Random(i)
        got = []
        for k in range(3):
            n = rng.randrange(2, 14)
            kw = dict(model=server.name, max_tokens=n, temperature=rng.choice([0, 0.8]), seed=i * 10 + k,
                      extra_body={"ignore_eos": True})
            if k == 1:
                r = await c.chat.completions.create(messages=[{"role": "user", "content": _text(rng.randrange(1, 90), i)}], **kw)
            else:
                r = await c.completions.create(prompt=_text(rng.randrange(1, 120), i + k), **kw)
            got.append((r.usage.completion_tokens, n))
        return got

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=300, max_retries=0)
        try:
            return await asyncio.wait_for(asyncio.gather(*(client(i, c) for i in range(32))), 900)
        finally:
            await c.close()

    results = asyncio.run(main())
    assert len(results) == 32
    for got in results:
        assert [a for a, _ in got] == [b for _, b in got]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    c = server.client()
    bad = [
        (dict(prompt=_text(MAX_MODEL_LEN + 10, 7), max_tokens=4), openai.BadRequestError, "maximum context length"),
        (dict(prompt="ba", max_tokens=4, temperature=-1), openai.BadRequestError, "temperature"),
        (dict(prompt="ba", max_tokens=MAX_MODEL_LEN * 4), openai.BadRequestError, ""),
        (dict(prompt="ba", max_tokens=4, top_p=7), openai.BadRequestError, "top_p"),
    ]
    for kw, exc, needle in bad:
        with pytest.raises(exc) as e:
            c.completions.create(model=server.name, **kw)
        assert 400 <= e.value.status_code < 500 and needle in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="ba", max_tokens=2)
    r = c.completions.create(model=server.name, prompt=_text(5, 8), max_tokens=3, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_host_fallback_features_work(server):
    c = server.client()
    r = c.completions.create(model=server.name, prompt=_text(6, 9), max_tokens=5, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True, "min_p": 0.01})
    assert len(r.choices[0].logprobs.tokens) == 5
    r = c.completions.create(model=server.name, prompt=_text(6, 9), max_tokens=3, temperature=0,
                             logit_bias={"300": 100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].token_ids == [300, 300, 300]


def test_every_step_was_one_phase_padded_to_its_bucket(server):
    steps = [json.loads(x) for x in server.step_log.read_text().splitlines()]
    assert len(steps) > 50
    kinds = {s["phase"] for s in steps}
    assert kinds == {"prefill", "decode"}
    for s in steps:
        if s["phase"] == "decode":
            assert all(n == 1 for _, _, n in s["rows"]) and s["buckets"] == [pick(DECODE, len(s["rows"]))]
        else:  # one call per chunk padded to its bucket, or several chunks packed into one call
            lens = [n for _, _, n in s["rows"]]
            assert_prefill_plan(lens, PREFILL, f"step {s}")
            assert sum(k for _, _, k in s["calls"]) == len(lens), s  # every chunk in one call
            assert sum(S for S, _, _ in s["calls"]) <= max(PREFILL), s
            assert all(b in PREFILL and b >= n for b, n in zip(s["buckets"], lens)), s
    assert {"device", "host"} <= {s["sampling"] for s in steps}
    assert max(len(s["rows"]) for s in steps if s["phase"] == "decode") > 8  # concurrency batched
    assert "Traceback" not in server.log.read_text()
