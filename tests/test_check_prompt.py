"""check's default prompt (docs/check.md, "The default prompt") and the shard cuts the expected
side rounds (``package.shards.cut`` / ``_scatter``: a view for a contiguous run of units)."""

from __future__ import annotations

import pytest
import torch

from test_emulated import TINY

from ttbundle import layout, spec
from ttbundle.check import CHECK_CHUNK, default_prompt, run_check
from ttbundle.families.base import Dim
from ttbundle.package.shards import _scatter, cut
from ttbundle.tiles import pick


def _pieces(n: int, chunk: int) -> list[int]:
    return [min(chunk, n - i) for i in range(0, n, chunk)]


@pytest.mark.parametrize("prefill,chunk", [([64, 128], 64), ([128, 1024], 1024), ([128, 1024, 2048, 4096], 4096),
                                           ([128, 512, 4096], 4096), ([256, 2048], 2048), ([4096], 4096)])
def test_default_prompt_crosses_a_chunk_with_real_rows(prefill, chunk):
    b = spec.Buckets(prefill=prefill, prefill_chunk=chunk)
    n, c = default_prompt(b, 1 << 20, 4)
    pieces = _pieces(n, c)
    assert len(pieces) >= 2, "chunked prefill must run: the prompt is longer than its chunk"
    assert c in prefill and (c <= CHECK_CHUNK or c == chunk == min(prefill))
    if chunk > CHECK_CHUNK and min(prefill) <= CHECK_CHUNK:
        # every call's rows are real tokens: each piece is exactly a prefill bucket
        assert all(pick(prefill, p) == p for p in pieces), pieces
    if chunk <= CHECK_CHUNK:
        assert (n, c) == (chunk + chunk // 3 + 1, chunk)  # small chunks: the package's own, as before


def test_default_prompt_fits_max_model_len():
    n, _ = default_prompt(spec.Buckets(prefill=[64, 128], prefill_chunk=64), 80, 4)
    assert n + 4 <= 80


def test_a_long_chunk_package_is_checked_in_chunks_of_at_most_1024():
    extra = """
targets: [N150]
buckets: {prefill: [128, 1024, 2048], decode: [1, 8], prefill_chunk: 2048}
runtime: {max_model_len: 4096, max_num_seqs: 8}
"""
    text = TINY["llama"].replace("max_position_embeddings: 1024", "max_position_embeddings: 4096")
    b = spec.loads(text + extra, "long-chunk.yaml")
    r = run_check(b, "N150", steps=2, random_weights=True, seed=1)
    assert r.passed, r.failure()
    assert (r.prompt_len, r.prefill_chunk) == (1024 + 128, 1024)
    assert sorted(s for s in r.shapes_run if s[0] == "prefill") == [("prefill", 128), ("prefill", 1024)]
    # --prompt-len runs the package's own chunking (its 2048-token chunk program)
    r = run_check(b, "N150", steps=2, random_weights=True, seed=1, prompt_len=300)
    assert r.prefill_chunk == 2048 and ("prefill", 1024) in r.shapes_run


@pytest.mark.parametrize("units", [[0, 1, 2], [2, 3], [1, 0], [0, -1], [3, -1, 1]])
@pytest.mark.parametrize("unit", [1, 4])
def test_cut_and_scatter_equal_the_element_index(units, unit):
    x = torch.randn(3, 4 * unit, 5)
    pos = layout.elements(units, unit)
    want = torch.stack([x[:, p] if p >= 0 else torch.zeros(3, 5) for p in pos], dim=1)
    got = cut(x, 1, units, unit)
    assert torch.equal(got, want)
    g = torch.full_like(x, 7.0)
    _scatter(g, got, [[0, 1, 2], units, [0, 1, 2, 3, 4]], (Dim("a", 3), Dim("b", 4, unit), Dim("c", 5)))
    for k, p in enumerate(pos):
        if p >= 0:
            assert torch.equal(g[:, p], x[:, p])
    untouched = sorted(set(range(4 * unit)) - {p for p in pos if p >= 0})
    assert torch.equal(g[:, untouched], torch.full((3, len(untouched), 5), 7.0))
