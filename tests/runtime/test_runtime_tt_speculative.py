"""n-gram speculative decoding on the TT platform through vLLM's engine, without hardware:
``tt_spec_engine_run.py`` runs the engine on a tiny Llama built with ``speculative: {method:
ngram}`` and ``--backend ttnn`` (N150, T3K), the recording double computing on its tensorbin
weights in place of ttnn, once with vLLM's ``--speculative-config`` and once without. The
references: the same package served without speculation, transformers' greedy ``generate`` on the
checkpoint, and vLLM's own spec-decode metrics (proposals made and accepted on a repetitive
prompt). With lanes (a T3K split into 8 replicas of 1x1, one submesh each) every lane verifies its
own rows on its own submesh."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import yaml

from runtime_helpers import hf_model, pick
from test_runtime_speculative import NGRAM, OTHERS, REPETITIVE, K, ngram_spec

HERE = Path(__file__).resolve().parent
DECODE = [1, 4]
TOKENS = 32


def tt_ngram_spec(replicas=None) -> str:
    d = yaml.safe_load(ngram_spec("tiny-llama-ngram-tt" + ("-r1x1" if replicas else ""), replicas, max(DECODE)))
    d["buckets"] = {"prefill": [64], "decode": DECODE, "prefill_chunk": 64}
    d["runtime"]["max_num_seqs"] = max(DECODE)
    return yaml.safe_dump(d, sort_keys=False)


REL = 0.03  # the bf16 double against transformers' fp32 logits (as the double's other tests)


def transformers_disagreements(src, prompt: list[int], toks: list[int]) -> list[str]:
    """``toks`` generated after ``prompt``, teacher-forced through transformers (the checkpoint the
    package was built from, fp32): every token must be transformers' argmax after the prefix before
    it, up to a near tie bf16 may flip (within ``REL`` of the row's largest logit). One line per
    token that is not."""
    import torch
    with torch.no_grad():
        logits = hf_model(str(src))(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1:-1]
    bad = []
    for i, (t, row) in enumerate(zip(toks, logits)):
        gap = float(row.max() - row[t])
        if gap > REL * float(row.abs().max()):
            bad.append(f"token {i}: {t}, transformers' argmax {int(row.argmax())} ({gap:.3g} above it)")
    return bad


def _greedy(n, **kw):
    return dict(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from runtime_helpers import run_engine_script
    from ttbundle.serving.demo import build_package

    d = tmp_path_factory.mktemp("ttspec")
    prompts = [REPETITIVE] + OTHERS
    # then a request that samples on the host (logprobs) beside one that proposes: their batch
    # runs the plain decode program with host sampling, every proposal rejected
    batches = [(prompts, [_greedy(TOKENS)] * 3),
               ([REPETITIVE, OTHERS[0]], [_greedy(TOKENS // 2, logprobs=1), _greedy(TOKENS // 2)])]
    env = {k: v for k, v in os.environ.items() if k != "TTBUNDLE_EMULATED"}
    out = {}

    def run(mesh):
        if mesh not in out:
            lanes = mesh.endswith("-lanes")
            pkg = build_package(tt_ngram_spec((1, 1) if lanes else None), d, mesh.removesuffix("-lanes"),
                                backend="ttnn", warmup=False)
            cases = {"spec": {"speculative": dict(NGRAM), "batches": batches},
                     "plain": {"speculative": None, "batches": batches}}
            src = d / ("src-tiny-llama-ngram-tt" + ("-r1x1" if lanes else ""))
            out[mesh] = run_engine_script(HERE / "tt_spec_engine_run.py", pkg, cases, env), src
        return out[mesh]
    return run


@pytest.mark.parametrize("mesh", ["N150", pytest.param("T3K", marks=pytest.mark.slow)])
def test_greedy_ngram_on_the_tt_device_path_is_identical_without_speculation_and_to_transformers(runs, mesh):
    res, src = runs(mesh)
    spec, plain = res["spec"], res["plain"]
    assert spec["tokens"] == plain["tokens"]
    (first, second) = spec["tokens"]
    for p, toks in zip([REPETITIVE] + OTHERS + [REPETITIVE, OTHERS[0]], first + second):
        assert len(toks) == TOKENS if len(toks) > TOKENS // 2 else len(toks) == TOKENS // 2
        assert transformers_disagreements(src, p["prompt_token_ids"], toks) == []
    # vLLM's own spec-decode metrics: proposals made, and accepted on the repetitive prompt
    assert spec["metrics"]["vllm:spec_decode_num_draft_tokens"] > 0
    assert spec["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert not plain["metrics"].get("vllm:spec_decode_num_draft_tokens")
    # verify steps ran the lowered verify forward of their decode bucket, as captured traces
    verify = [s for s in spec["steps"] if s["phase"] == "verify"]
    assert verify and any(n > 1 for s in verify for _, _, n in s["rows"])
    assert all(1 <= n <= K + 1 for s in verify for _, _, n in s["rows"])
    replayed = [k for k in spec["replays"] if k[0] == "verify"]
    assert [k[:3] for k in replayed] == [["verify", pick(DECODE, len(s["rows"])), "host"] for s in verify]
    assert all(k in spec["traced"] for k in replayed)
    assert {("verify", b) for b in DECODE} <= {tuple(k) for k in spec["warmed"]}
    # the host-sampled batch ran plain decodes, never a verify
    host = [s for s in spec["steps"] if s["sampling"] == "host"]
    assert any(s["phase"] == "decode" for s in host) and not any(s["phase"] == "verify" for s in host)
    assert not any(s["phase"] == "verify" for s in plain["steps"])
    # a request of the first batch took fewer decode steps than its TOKENS - 1 tokens after the
    # prefill's: accepted proposals came several per step (without speculation: one per step)
    first_ids = {r for s in spec["steps"][:1] for r, _, _ in s["rows"]}
    per = Counter(r for s in spec["steps"] if s["phase"] in ("decode", "verify") for r, _, _ in s["rows"]
                  if r in first_ids)
    assert min(per.values()) < TOKENS - 1
    plain_ids = {r for s in plain["steps"][:1] for r, _, _ in s["rows"]}
    assert set(Counter(r for s in plain["steps"] if s["phase"] == "decode" for r, _, _ in s["rows"]
                       if r in plain_ids).values()) == {TOKENS - 1}
    assert spec["compiled_serving"] == plain["compiled_serving"] == 0
    assert spec["violations"] == plain["violations"] == []


@pytest.mark.slow  # a T3K of 8 lanes through vLLM's engine, twice
def test_greedy_ngram_with_lanes_on_the_tt_device_path_verifies_per_lane(runs):
    """8 lanes of 1x1 on one T3K: each lane's verify runs on its own submesh (its own KV); tokens
    identical to the same package without speculation and to transformers, proposals accepted."""
    res, src = runs("T3K-lanes")
    spec, plain = res["spec"], res["plain"]
    assert spec["tokens"] == plain["tokens"]
    (first, second) = spec["tokens"]
    for p, toks in zip([REPETITIVE] + OTHERS + [REPETITIVE, OTHERS[0]], first + second):
        assert transformers_disagreements(src, p["prompt_token_ids"], toks) == []
    assert spec["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    verify = [s for s in spec["steps"] if s["phase"] == "verify"]
    assert verify and len({lane for s in verify for lane in s["lanes"]}) > 1  # rows of several lanes verified
    assert spec["compiled_serving"] == plain["compiled_serving"] == 0
    assert spec["violations"] == plain["violations"] == []
