"""Speculative decoding (``speculative: {method: ngram}``) through vLLM's own engine, in-process:
greedy tokens identical to the same package served without speculation and to transformers,
proposals accepted on a repetitive prompt (vLLM's spec-decode metrics), stochastic speculation
keeping the distribution of sampling without speculation (a test over many seeds), on N150, T3K
and with lanes; ``serve`` passing ``--speculative-config`` and the platform refusing one that
disagrees with the package."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from runtime_helpers import greedy, hf_greedy, run_engine, spec_text

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PATTERN = [10, 11, 12, 13, 14, 15, 16]
REPETITIVE = {"prompt_token_ids": PATTERN * 6}
OTHERS = [{"prompt_token_ids": [(7 * i + 3) % 500 + 8 for i in range(40)]},
          {"prompt_token_ids": [(5 * i + n) % 400 + 20 for i, n in enumerate(range(70))]}]


def ngram_spec(name: str = "tiny-llama-ngram", replicas=None, per_lane=None) -> str:
    d = yaml.safe_load(spec_text("llama"))
    d["name"] = name
    d["speculative"] = dict(NGRAM)
    if replicas:
        d["replicas"] = {"T3K": {"submesh": list(replicas)}}
        d["runtime"]["max_num_seqs"] = per_lane
    return yaml.safe_dump(d, sort_keys=False)


@pytest.fixture(scope="session")
def ngram_package(packages_dir):
    from ttbundle.serving.demo import build_package

    built = {}

    def make(mesh: str):
        if mesh not in built:
            built[mesh] = build_package(ngram_spec(), packages_dir, mesh)
        return built[mesh], packages_dir / "src-tiny-llama-ngram"
    return make


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _run(pkg, speculative: bool, requests, **kw):
    return run_engine(pkg, dict(NGRAM) if speculative else None, requests, **kw)


def _check_verify_steps(steps, buckets):
    verify = [s for s in steps if s.phase == "verify"]
    assert verify, "no verify step ran"
    for s in verify:
        assert all(1 <= n <= K + 1 for _, _, n in s.rows)
        assert any(n > 1 for _, _, n in s.rows)
        assert s.sampling == "device"
        assert all(b in buckets for b in s.buckets)
    return verify


@pytest.mark.parametrize("mesh", ["N150", "T3K"])
def test_greedy_ngram_is_identical_without_speculation_and_to_transformers(ngram_package, mesh):
    from runtime_helpers import DECODE

    pkg, src = ngram_package(mesh)
    prompts = [REPETITIVE] + OTHERS
    # then a request that samples on the host (logprobs) beside one that proposes: their batch
    # runs the plain decode program (host fallback), the proposals all rejected
    batches = [(prompts, greedy(48)), ([REPETITIVE, OTHERS[0]], [dict(greedy(24), logprobs=1), greedy(24)])]
    (spec_out, spec_host), metrics, steps, runner = _run(pkg, True, batches)
    (plain_out, plain_host), plain_metrics, plain_steps, _ = _run(pkg, False, batches)
    assert spec_out == plain_out and spec_host == plain_host
    for p, toks in zip(prompts, spec_out):
        assert toks == hf_greedy(src, p["prompt_token_ids"], 48)
    assert spec_host[0] == hf_greedy(src, REPETITIVE["prompt_token_ids"], 24)
    assert spec_host[1] == hf_greedy(src, OTHERS[0]["prompt_token_ids"], 24)
    host = [s for s in steps if s.sampling == "host"]
    assert any(s.phase == "decode" for s in host) and not any(s.phase == "verify" for s in host)  # no verify
    # vLLM's own spec-decode metrics: proposals made and some accepted on the repetitive prompt
    assert metrics["vllm:spec_decode_num_draft_tokens"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert not plain_metrics.get("vllm:spec_decode_num_draft_tokens")
    _check_verify_steps(steps, DECODE)
    assert not any(s.phase == "verify" for s in plain_steps)
    model = runner.mesh_model
    assert {("verify", b) for b in DECODE} <= model.warmed and set(model.programs_run) <= model.warmed
    # fewer decode steps than tokens: accepted proposals came several per step
    assert sum(1 for s in steps if s.phase in ("decode", "verify")) < sum(1 for s in plain_steps if s.phase == "decode")


def _contingency_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's chi-square test that two count vectors come from one distribution (cells with
    an expected count below 5 pooled)."""
    tab = np.stack([a, b]).astype(float)
    exp = tab.sum(1, keepdims=True) * tab.sum(0, keepdims=True) / tab.sum()
    big = exp.min(0) >= 5
    t = np.concatenate([tab[:, big], tab[:, ~big].sum(1, keepdims=True)], axis=1)
    e = np.concatenate([exp[:, big], exp[:, ~big].sum(1, keepdims=True)], axis=1)
    keep = e[0] > 0
    stat = float(((t[:, keep] - e[:, keep]) ** 2 / e[:, keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow  # three engines, two on 400 requests: minutes on 2 CPU cores
def test_stochastic_ngram_keeps_the_distribution_of_sampling_without_speculation(ngram_package):
    """400 seeded requests, each 4 tokens (the 2nd to 4th can come from verify steps): per
    position, the tokens' distribution with speculation against without it. The prompt is the
    repetitive one followed by its greedy continuation (transformers'), which ends in a token
    repeated (the tiny random model's own loop): the proposals are likely, not certain, tokens."""
    pkg, src = ngram_package("N150")
    n = 400
    prompt = {"prompt_token_ids": REPETITIVE["prompt_token_ids"] + hf_greedy(src, REPETITIVE["prompt_token_ids"], 64)}
    params = [dict(max_tokens=4, temperature=0.7, top_k=3, seed=s, ignore_eos=True) for s in range(n)]
    batches = [([prompt] * n, params)]
    (spec_out,), metrics, steps, _ = _run(pkg, True, batches)
    (plain_out,), _, _, _ = _run(pkg, False, batches)
    assert metrics["vllm:spec_decode_num_draft_tokens"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    _check_verify_steps(steps, [1, 2, 4, 8, 16, 32])
    for pos in range(4):
        a = np.bincount([t[pos] for t in spec_out], minlength=512)
        b = np.bincount([t[pos] for t in plain_out], minlength=512)
        assert _contingency_pvalue(a, b) > 1e-3, pos
    # and each seed reproduces its own tokens with speculation
    (again,), _, _, _ = _run(pkg, True, [([prompt] * 8, params[:8])])
    assert again == spec_out[:8]


def test_lanes_verify_per_lane_identical_to_transformers(packages_dir):
    """A T3K split into 8 replicas of 1x1 served as lanes: each lane verifies its own rows."""
    from ttbundle.serving.demo import build_package

    pkg = build_package(ngram_spec("tiny-llama-ngram-r1x1", (1, 1), 4), packages_dir, "T3K")
    src = packages_dir / "src-tiny-llama-ngram-r1x1"
    prompts = [REPETITIVE] + OTHERS + [{"prompt_token_ids": PATTERN[::-1] * 5}]
    (out,), metrics, steps, runner = _run(pkg, True, [(prompts, greedy(32))], max_num_seqs=32)
    assert runner.lanes is not None and runner.lane_plan.lanes == 8
    for p, toks in zip(prompts, out):
        assert toks == hf_greedy(src, p["prompt_token_ids"], 32)
    verify = _check_verify_steps(steps, [1, 2, 4])
    assert len({lane for s in verify for lane in s.lanes}) > 1  # rows of several lanes verified
    assert metrics["vllm:spec_decode_num_draft_tokens"] > 0


def test_serve_passes_the_packages_speculative_config_and_refuses_another(ngram_package, make_package):
    from ttbundle.errors import InvalidInput
    from ttbundle.serving.serve import plan_serve

    pkg, _ = ngram_package("N150")
    argv = plan_serve(pkg).argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == NGRAM
    same = plan_serve(pkg, extra=["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": K})])
    assert same.argv.count("--speculative-config") == 1
    with pytest.raises(InvalidInput) as ei:
        plan_serve(pkg, extra=["-sc", json.dumps(dict(NGRAM, num_speculative_tokens=2))])
    assert "num_speculative_tokens: given 2, package 3" in str(ei.value)
    plain, _ = make_package("llama", "N150")
    assert "--speculative-config" not in plan_serve(plain).argv
    with pytest.raises(InvalidInput) as ei:
        plan_serve(plain, extra=["--speculative-config", json.dumps(NGRAM)])
    assert "built without `speculative:`" in str(ei.value)


def test_platform_refuses_a_speculative_config_that_disagrees_naming_both(ngram_package):
    from vllm import LLM

    pkg, _ = ngram_package("N150")
    with pytest.raises(Exception) as ei:
        LLM(model=str(pkg), dtype="float32", speculative_config=dict(NGRAM, prompt_lookup_max=5))
    msg = str(ei.value)
    assert "prompt_lookup_max: given 5, package 3" in msg, msg
