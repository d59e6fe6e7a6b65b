"""``--reasoning-parser`` passed through `ttbundle serve` (with vLLM's ``--structured-outputs-config``):
the parser splits the model's ``reasoning`` from its ``content`` at ``</think>``, on the tiny
byte-level Qwen3 of ``structured_helpers``. A random model never writes ``</think>`` by itself,
so a regex makes it (``enable_in_reasoning``: vLLM applies the grammar from the first token,
reasoning included); unconstrained, everything it writes is reasoning."""

from __future__ import annotations

import re

import pytest

from structured_helpers import served

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    extra = ["--reasoning-parser", "deepseek_r1", "--structured-outputs-config", '{"enable_in_reasoning": true}']
    with served(tmp_path_factory.mktemp("reasoning"), extra) as (plan, _, _):
        yield plan


def test_reasoning_parser_splits_reasoning_from_content(server):
    c = openai.OpenAI(base_url=server.url, api_key="none", timeout=300, max_retries=0)
    kw = dict(model=server.name, messages=[{"role": "user", "content": "is it going to rain"}], temperature=0,
              max_tokens=30)
    plain = c.chat.completions.create(**kw).choices[0].message
    assert not plain.content and plain.reasoning and "</think>" not in plain.reasoning  # no end: all reasoning
    m = c.chat.completions.create(**kw, extra_body={"structured_outputs": {"regex": "[a-z]{3,8}</think>(yes|no)"}})
    m = m.choices[0].message
    assert re.fullmatch("[a-z]{3,8}", m.reasoning) and m.content in ("yes", "no"), m
