"""Qwen3 MoE and Qwen2 MoE served end to end: `ttbundle serve`'s vLLM command (vLLM's own OpenAI
server) on a tiny package built for T3K (8 experts, one per chip, top-2; Qwen2 MoE adds its gated
shared expert), driven by the official `openai` client; greedy tokens equal transformers
`generate` on the checkpoint the package was built from (transformers' own classes)."""

from __future__ import annotations

import random

import pytest

from runtime_helpers import hf_greedy, serving

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


@pytest.mark.parametrize("family", sorted(ARCH))
def test_served_greedy_tokens_equal_transformers(make_package, tmp_path, family):
    import json

    from transformers import AutoTokenizer

    from ttbundle.serving.demo import words

    pkg, src = make_package(family, "T3K")
    assert json.loads((src / "config.json").read_text())["architectures"] == [ARCH[family]]
    tok = AutoTokenizer.from_pretrained(str(src))
    w = words(300)
    with serving(pkg, tmp_path) as plan:
        client = openai.OpenAI(base_url=plan.url, api_key="none", timeout=120, max_retries=0)
        seen = set()
        for n in (3, 40, 65, 150):  # one prefill chunk, and over the 64-token chunk
            rng = random.Random(n)
            text = " ".join(rng.choice(w) for _ in range(n))
            r = client.completions.create(model=plan.name, prompt=text, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            ids = tok(text).input_ids
            c = r.choices[0]
            assert c.prompt_token_ids == ids
            assert c.token_ids == hf_greedy(src, ids, 16), n
            seen |= set(c.token_ids)
        assert len(seen) > 8  # the random model is not degenerate: the routing and tokens vary
