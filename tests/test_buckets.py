"""Bucket analysis: the dynamic program against brute force, chunking, input formats, CLI, SVG."""

from __future__ import annotations

import itertools
import json
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings, strategies as st

from ttbundle import buckets as bk, spec as specmod
from ttbundle.errors import InvalidInput

from test_build import spec_text


def brute_force(piece_hist: dict, k: int, top: int | None) -> float:
    """Every ladder of at most k multiples of 32 up to the top (not only the DP's candidates)."""
    hi = top if top is not None else bk._ceil(max(piece_hist))
    values = list(range(32, hi + 1, 32))
    best = float("inf")
    for r in range(1, k + 1):
        for combo in itertools.combinations(values, r):
            if combo[-1] != hi:
                continue
            best = min(best, bk.cost(piece_hist, list(combo)))
    return best


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.integers(1, 320), st.integers(1, 50), min_size=1, max_size=12),
       st.integers(1, 4), st.booleans())
def test_dp_matches_brute_force(hist, k, with_top):
    top = bk._ceil(max(hist)) + (64 if with_top else 0) if with_top else None
    ladder, c = bk.optimal_ladder(hist, k, top)
    assert len(ladder) <= k and ladder == sorted(set(ladder)) and all(b % 32 == 0 for b in ladder)
    if top is not None:
        assert ladder[-1] == top
    assert bk.cost(hist, ladder) == pytest.approx(c)
    assert c == pytest.approx(brute_force(hist, k, top))


def test_dp_small_cases_by_hand():
    # 10 requests of 30 tokens, 1 of 300: two buckets [32, 320] pad 10*2 + 20
    ladder, c = bk.optimal_ladder({30: 10, 300: 1}, 2)
    assert ladder == [32, 320] and c == 10 * 32 + 320
    ladder, c = bk.optimal_ladder({30: 10, 300: 1}, 1)
    assert ladder == [320] and c == 11 * 320
    # more buckets than distinct lengths: one per length, no padding beyond the tile
    ladder, c = bk.optimal_ladder({32: 1, 64: 1, 96: 1}, 8)
    assert ladder == [32, 64, 96] and c == 192


def test_pieces_follow_the_runtime_chunking():
    assert bk.pieces({100: 1, 64: 2, 200: 3}, 64) == {36: 1, 8: 3, 64: 1 + 2 + 9}
    assert bk.pieces({100: 1}, None) == {100: 1}


@pytest.fixture
def bundle():
    return specmod.loads(spec_text(), "tiny.yaml")  # prefill [32, 64], chunk 64, max_model_len 256


def test_analyze_current_and_proposed(bundle):
    hist = {10: 100, 40: 5, 130: 2, 300: 1}  # 300 > max_model_len: left out
    r = bk.analyze(bundle, hist, 2)
    assert r.skipped == 1 and r.requests == 107
    assert r.current.buckets == [32, 64] and r.proposed.buckets[-1] == 64
    cur = {s.bucket: s for s in r.current.stats}
    # 130 = 64 + 64 + 2: two full chunks and a 2-token piece
    assert cur[32].pieces == 100 + 2 and cur[64].pieces == 5 + 4
    assert cur[32].real_tokens == 1000 + 4 and cur[32].padded_tokens == 102 * 32
    assert r.proposed.padded_per_request <= r.current.padded_per_request
    j = r.to_json()
    assert j["current"]["per_bucket"][0]["waste_tokens"] == 102 * 32 - 1004


def test_read_csv_and_jsonl_variants(tmp_path):
    f = tmp_path / "a.csv"
    f.write_text("length,count\n10,3\n20,1\n10,2\n")
    assert bk.read_lengths(f) == {10: 5, 20: 1}
    f.write_text("prompt_tokens\n7\n7\n9\n")
    assert bk.read_lengths(f) == {7: 2, 9: 1}
    f.write_text("5\n6,4\n")
    with pytest.raises(InvalidInput):
        bk.read_lengths(f)  # first row has one column: a lengths-only file
    f.write_text("5,1\n6,4\n")
    assert bk.read_lengths(f) == {5: 1, 6: 4}
    j = tmp_path / "a.jsonl"
    j.write_text('{"length": 3, "count": 2}\n\n{"prompt_len": 4}\n7\n')
    assert bk.read_lengths(j) == {3: 2, 4: 1, 7: 1}


@pytest.mark.parametrize("text,msg", [
    ("length,count\n10,x\n", r"a.csv:2: 'x' is not a number"),
    ("length,count\n-4,1\n", r"a.csv:2: length must be a positive integer"),
    ("length,count\n4.5,1\n", r"a.csv:2: length must be a positive integer"),
    ("size,count\n4,1\n", r"a.csv:1: no length column"),
    ("", "no request lengths"),
])
def test_read_errors_name_file_and_line(tmp_path, text, msg):
    f = tmp_path / "a.csv"
    f.write_text(text)
    with pytest.raises(InvalidInput, match=msg):
        bk.read_lengths(f)


def test_jsonl_errors(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text('{"length": 3}\n{"len": }\n')
    with pytest.raises(InvalidInput, match="b.jsonl:2: not JSON"):
        bk.read_lengths(f)
    f.write_text('{"length": 3, "count": -1}\n')
    with pytest.raises(InvalidInput, match="b.jsonl:1: count must be a non-negative"):
        bk.read_lengths(f)


def test_cli_buckets_table_json_and_svg(tmp_path, runner):
    from ttbundle import cli
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text())
    lengths = tmp_path / "l.csv"
    lengths.write_text("length,count\n" + "\n".join(f"{n},{(n * 7) % 13 + 1}" for n in range(1, 250, 3)))
    svg = tmp_path / "b.svg"
    r = runner.invoke(cli.app, ["buckets", str(spec), "--lengths", str(lengths), "--max-traces", "3",
                                "--svg", str(svg)])
    assert r.exit_code == 0, r.output
    assert "current prefill buckets [32, 64]" in r.output and "proposed prefill buckets" in r.output
    root = ET.fromstring(svg.read_text())
    assert root.tag.endswith("svg")
    texts = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    assert "current" in texts and "proposed" in texts
    r = runner.invoke(cli.app, ["buckets", str(spec), "--lengths", str(lengths), "-k", "3", "--json"])
    data = json.loads(r.output)
    assert len(data["proposed"]["buckets"]) <= 3 and data["proposed"]["buckets"][-1] == 64
    assert data["saving_pct"] >= 0
    r = runner.invoke(cli.app, ["buckets", str(spec), "--lengths", str(tmp_path / "nope.csv")])
    assert r.exit_code == 2 and "no such lengths file" in r.output


def test_svg_escapes_title(bundle):
    r = bk.analyze(bundle, {10: 1, 50: 2})
    svg = bk.render_svg(r, "<b>&'\"")
    ET.fromstring(svg)
    assert "<b>" not in svg
