"""benches/bench_vllm_serve.py's reading of `vllm bench serve` results (issue 38, part 3).

``data/vllm_bench_serve_result.json`` is a file `vllm bench serve --save-result --save-detailed`
(vLLM 0.33.0) wrote against `ttbundle serve` of the demo on the emulated N150. vLLM's own
per-request arrays in it (``ttfts``, ``itls``, ``latencies``, ``output_lens``) are the
independent reference: the reduction this bench applies to transformers' timings must give
vLLM's own p50/p99 from them, or the two sides of the table would not be the same figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULT = Path(__file__).parent / "data" / "vllm_bench_serve_result.json"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vllm_serve", ROOT / "benches" / "bench_vllm_serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_reads_vllms_figures(bench):
    raw = json.loads(RESULT.read_text())
    got = bench.parse_result(RESULT, raw["num_prompts"])
    assert got["completed"] == raw["num_prompts"] == len(raw["ttfts"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert got[f"p50_{m}_ms"] == raw[f"median_{m}_ms"]  # vLLM's median and its p50 agree
        assert got[f"p99_{m}_ms"] == raw[f"p99_{m}_ms"]
    assert got["input_lens"] == raw["input_lens"] and sum(got["output_lens"]) == raw["total_output_tokens"]


def test_the_transformers_side_is_reduced_as_vllm_reduces(bench):
    """TTFT per request, TPOT = (latency - TTFT) / (tokens - 1), every ITL gap pooled: the same
    p50/p99 as vLLM printed from the same requests."""
    raw = json.loads(RESULT.read_text())
    tpots = [(lat - t) / (n - 1) for lat, t, n in zip(raw["latencies"], raw["ttfts"], raw["output_lens"])]
    itls = [x for req in raw["itls"] for x in req]
    mine = bench.latency_figures(raw["ttfts"], tpots, itls)
    for key, value in mine.items():
        assert value == pytest.approx(raw[key], rel=1e-9), key


def test_a_failed_request_or_a_missing_figure_is_refused(bench, tmp_path):
    raw = json.loads(RESULT.read_text())
    bad = tmp_path / "failed.json"
    bad.write_text(json.dumps(dict(raw, failed=1, completed=raw["completed"] - 1,
                                   errors=["", "Never received a valid chunk"])))
    with pytest.raises(bench.ResultError, match="1 request\\(s\\) failed: Never received a valid chunk"):
        bench.parse_result(bad)
    short = tmp_path / "short.json"
    short.write_text(json.dumps(raw))
    with pytest.raises(bench.ResultError, match=f"{raw['completed']} of 99 requests completed"):
        bench.parse_result(short, 99)
    nop99 = tmp_path / "nop99.json"
    nop99.write_text(json.dumps({k: v for k, v in raw.items() if k != "p99_itl_ms"}))
    with pytest.raises(bench.ResultError, match="no p99_itl_ms .*--metric-percentiles 50,99"):
        bench.parse_result(nop99)
