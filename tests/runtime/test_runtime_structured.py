"""Structured output and tool calls through `ttbundle serve` (vLLM 0.33's OpenAI server) on the
emulated mesh, driven by the `openai` client: ``response_format`` (json_schema, json_object),
``structured_outputs`` choice and regex, and tool calls with ``--enable-auto-tool-choice
--tool-call-parser hermes`` passed through ``serve``.

The package is a tiny random Qwen3 whose tokenizer can spell JSON (``structured_helpers``). With
random weights nothing here happens by chance: each constrained request is paired with the same
request unconstrained, whose output is not what the constraint allows, so the constraint (vLLM's
grammar bitmask, applied on the host path: ``sampling.host_reasons``) is what did it. The step
log shows every step holding a structured-output request sampled on the host."""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest

from runtime_helpers import step_lines
from structured_helpers import served

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

COLORS = ["red", "green", "blue"]
SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "enum": COLORS}},
          "required": ["color"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]
REGEX = "[0-9]{3}-[a-z]{2}"
CITIES, UNITS = ["Paris", "Oslo"], ["C", "F"]


def _tool(strict: bool) -> list[dict]:
    return [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city", "strict": strict,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES},
                                                        "unit": {"type": "string", "enum": UNITS}},
                       "required": ["city", "unit"], "additionalProperties": False}}}]


MESSAGES = [{"role": "user", "content": "what is the weather like"}]


def _whitespace_ids(src) -> list[int]:
    """The tokens that are only whitespace."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    return [i for i in range(len(tok)) if tok.decode([i]) and not tok.decode([i]).strip()]


class _Server:
    def __init__(self, plan, d, src):
        self.url, self.name, self.d = plan.url, plan.name, d
        #: vLLM's JSON grammar in a tool call's structural tag allows any whitespace between
        #: tokens (``disable_any_whitespace`` does not reach it), and a random model can stay on
        #: whitespace for ever: the tool-call requests ban whitespace-only tokens (logit_bias)
        self.no_space = {str(i): -100 for i in _whitespace_ids(src)}
        self.step_log = d / "steps.jsonl"
        self.c = openai.OpenAI(base_url=plan.url, api_key="none", timeout=300, max_retries=0)

    def chat(self, **kw):
        kw.setdefault("max_tokens", 60)
        kw.setdefault("temperature", 0)
        return self.c.chat.completions.create(model=self.name, messages=kw.pop("messages", MESSAGES), **kw)

    def complete(self, prompt, **kw):
        return self.c.completions.create(model=self.name, prompt=prompt, max_tokens=kw.pop("max_tokens", 12),
                                         temperature=0, **kw).choices[0]

    def steps_of(self, response_id: str) -> list[dict]:
        """The logged steps holding a row of the request whose OpenAI id is ``response_id``
        (vLLM's engine request id is that id plus a suffix)."""
        out = []
        for line in step_lines(self):
            s = json.loads(line)
            if any(r[0].startswith(response_id + "-") for r in s["rows"]):
                out.append(s)
        return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("structured"),
                ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as (plan, d, src):
        yield _Server(plan, d, src)


def _json(text):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


def _assert_host_sampled(server, response_id):
    steps = server.steps_of(response_id)
    sampled = [s for s in steps if s["sampling"] != "none"]
    assert sampled and all(s["sampling"] == "host" for s in sampled), steps


def test_json_schema_enum(server):
    plain = server.chat().choices[0].message.content
    assert not (isinstance(_json(plain), dict) and _json(plain).get("color") in COLORS), plain
    r = server.chat(response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA}})
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert _json(c.message.content)["color"] in COLORS and set(_json(c.message.content)) == {"color"}
    _assert_host_sampled(server, r.id)
    plain_steps = [s for s in server.steps_of(server.chat().id) if s["sampling"] != "none"]
    assert {s["sampling"] for s in plain_steps} == {"device"}  # the unconstrained request: device


def test_json_object(server):
    r = server.chat(response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(_json(r.choices[0].message.content), dict), r.choices[0].message.content


@pytest.mark.parametrize("prompt", ["the answer is", "ba be bi", "is it going to rain today"])
def test_choice_and_regex_give_only_allowed_outputs(server, prompt):
    assert server.complete(prompt).text not in CHOICES
    assert not re.fullmatch(REGEX, server.complete(prompt).text)
    c = server.complete(prompt, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert c.text in CHOICES and c.finish_reason == "stop", c
    c = server.complete(prompt, extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c
    c = server.chat(messages=[{"role": "user", "content": prompt}],
                    extra_body={"structured_outputs": {"choice": CHOICES}}).choices[0]
    assert c.message.content in CHOICES


def _assert_weather_call(message):
    assert message.tool_calls and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in CITIES and args["unit"] in UNITS and set(args) == {"city", "unit"}, args


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_call_has_schema_valid_arguments(server, choice):
    """``tool_choice`` naming the function, or ``required``: vLLM constrains the output to the
    hermes parser's call format (a structural tag; with ``strict`` the arguments' schema too) and
    the hermes parser reads the call back from the model's text."""
    tc = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    none = server.chat(tools=_tool(True), tool_choice="none", logit_bias=server.no_space).choices[0].message
    assert not none.tool_calls and "<tool_call>" not in (none.content or "")
    # one call (``required`` allows several, one after another, and a random model need not stop)
    r = server.chat(tools=_tool(True), tool_choice=tc, logit_bias=server.no_space, parallel_tool_calls=False)
    assert r.choices[0].finish_reason in ("stop", "tool_calls"), r.choices[0].message
    _assert_weather_call(r.choices[0].message)
    _assert_host_sampled(server, r.id)


def test_auto_tool_choice_parses_the_models_call(server):
    """``tool_choice="auto"``: the hermes parser finds a call in whatever the model wrote. The
    model is made to write one with a regex; unconstrained it writes none."""
    r = server.chat(tools=_tool(False), tool_choice="auto")
    assert not r.choices[0].message.tool_calls
    call = ('<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Oslo)", '
            '"unit": "(C|F)"\\}\\}</tool_call>')
    r = server.chat(tools=_tool(False), tool_choice="auto", extra_body={"structured_outputs": {"regex": call}})
    assert r.choices[0].finish_reason == "tool_calls"
    _assert_weather_call(r.choices[0].message)


def test_structured_and_plain_requests_together(server):
    """Structured requests batched with device-sampled ones: the whole batch samples on the host
    while any row needs the bitmask, and the plain rows still get their own greedy tokens."""
    prompts = ["ba be bi bo", "the answer is", "zu ka lo mi ne", "is it going to rain today"]
    alone = [server.complete(p, max_tokens=16, extra_body={"ignore_eos": True}).text for p in prompts]

    def one(i):
        if i % 2:
            return server.complete(prompts[i // 2], extra_body={"structured_outputs": {"choice": CHOICES}}).text
        return server.complete(prompts[i // 2], max_tokens=16, extra_body={"ignore_eos": True}).text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    assert got[0::2] == alone
    assert all(t in CHOICES for t in got[1::2]), got
    assert "Traceback" not in (server.d / "vllm.log").read_text()


# ---- a schema no value satisfies (issue 43) -----------------------------------------------------------
#: each was HTTP 500 ("grammar rejected tokens", the request ended as an internal error): xgrammar
#: compiles a reference that only comes back to itself to a rule that only derives itself
UNSATISFIABLE = {
    "root-self": ({"$ref": "#"}, "$ref '#' is a loop"),
    "defs-loop": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                  "$ref '#/$defs/a' -> '#/$defs/b' -> '#/$defs/a' is a loop"),
    "anyof-self": ({"anyOf": [{"$ref": "#"}]}, "$ref '#' is a loop"),
}
#: recursion vLLM's backend generates around: answered as before
ANSWERED = {
    "tree": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
    "optional-dead": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}, "y": {"type": "integer"}},
                      "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "anyof-null": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]},
}


def test_a_schema_no_value_satisfies_is_a_400_naming_the_loop(server):
    for name, (schema, says) in UNSATISFIABLE.items():
        with pytest.raises(openai.BadRequestError) as ei:
            server.chat(max_tokens=20, response_format={"type": "json_schema",
                                                        "json_schema": {"name": name, "schema": schema}})
        assert says in str(ei.value) and "give the recursion a base case" in str(ei.value), str(ei.value)
    for name, schema in ANSWERED.items():
        r = server.chat(max_tokens=20, response_format={"type": "json_schema",
                                                        "json_schema": {"name": name, "schema": schema}})
        assert r.choices[0].finish_reason in ("stop", "length"), (name, r)
    assert server.chat(max_tokens=4).choices[0].finish_reason == "length"  # still serving
    assert "grammar rejected tokens" not in (server.d / "vllm.log").read_text()
