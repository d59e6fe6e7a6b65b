"""`speculative: {method: draft}` without an engine: the draft spec's rules (located at
`speculative.model`, naming both sides' numbers), the tokenizer compared token for token, the
draft's memory as a line of the target's plan (against the draft's own plan), vLLM's
`--speculative-config` (`draft_model`, vLLM's own SpeculativeConfig parsing it)."""

from __future__ import annotations

import json

import pytest
import yaml

from spec_helpers import SPEC_FILE, TINY, deep_update, dump, line_of

DRAFT = deep_update(TINY, {"name": "tiny-draft", "model": {"hidden_size": 256, "intermediate_size": 512,
                                                            "num_hidden_layers": 1, "num_attention_heads": 4}})


def _write(spec_dir, target_changes=None, draft_changes=None, tokenizers=None):
    """The target spec (spec.yaml, `speculative: {method: draft, model: draft.yaml}`) and the
    draft spec beside it; ``tokenizers``: (target's dir, draft's dir) names under spec_dir."""
    t = deep_update(TINY, {"speculative": {"method": "draft", "model": "draft.yaml", "num_speculative_tokens": 3}})
    d = DRAFT
    if tokenizers:
        t = deep_update(t, {"tokenizer": tokenizers[0]})
        d = deep_update(d, {"tokenizer": tokenizers[1]})
    t = deep_update(t, target_changes or {})
    d = deep_update(d, draft_changes or {})
    text = dump(t)
    (spec_dir / SPEC_FILE).write_text(text, encoding="utf-8")
    (spec_dir / "draft.yaml").write_text(dump(d), encoding="utf-8")
    return text


def _diag(spec_dir):
    from ttbundle import spec
    from ttbundle.errors import InvalidInput

    with pytest.raises(InvalidInput) as ei:
        spec.load(spec_dir / SPEC_FILE)
    assert len(ei.value.diagnostics) == 1, "\n".join(map(str, ei.value.diagnostics))
    return ei.value.diagnostics[0]


def test_a_draft_of_another_vocabulary_is_refused_naming_both_sizes(spec_dir):
    text = _write(spec_dir, draft_changes={"model": {"vocab_size": 2048}})
    d = _diag(spec_dir)
    assert d.path == "speculative.model" and d.line == line_of(text, "model: draft.yaml")
    assert "vocab_size=2048" in d.message and "4096" in d.message and "same tokenizer" in d.message


def test_a_draft_tokenizer_of_the_same_size_but_other_tokens_is_refused(spec_dir):
    from ttbundle import spec
    from ttbundle.serving.demo import make_tokenizer

    for name in ("tok-a", "tok-b", "tok-c"):
        make_tokenizer(spec_dir / name, 4096)
    _write(spec_dir, tokenizers=("tok-a", "tok-b"))
    assert spec.load(spec_dir / SPEC_FILE).spec.speculative.method == "draft"  # the same vocabulary
    # tok-c: two tokens' ids swapped (the size unchanged): the vocabulary differs
    p = spec_dir / "tok-c" / "tokenizer.json"
    doc = json.loads(p.read_text())
    vocab = doc["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    p.write_text(json.dumps(doc))
    _write(spec_dir, tokenizers=("tok-a", "tok-c"))
    d = _diag(spec_dir)
    assert d.path == "speculative.model" and "tokenizer differs" in d.message
    assert "2 token(s) with another id" in d.message
    assert f"{a!r}: 100 here, 101 in the draft" in d.message and f"{b!r}: 101 here, 100 in the draft" in d.message


@pytest.mark.parametrize("draft_changes, words", [
    ({"buckets": {"decode": [1, 8]}, "runtime": {"max_num_seqs": 8}}, ["decode buckets [1, 8]", "[1, 8, 32]", "add decode bucket 32"]),
    ({"runtime": {"max_model_len": 1024}}, ["max_model_len=1024", "below this bundle's 2048"]),
    # the draft's catch-up (verify) program of its largest decode bucket: 32 x (3 + 1) rows
    ({"buckets": {"prefill": [64], "prefill_chunk": 64}},
     ["catch-up program of decode bucket 32", "32 x (3 + 1) = 128 rows", "largest prefill bucket 64",
      "add a prefill bucket of at least 128"]),
    ({"speculative": {"method": "ngram"}}, ["has `speculative:` itself"]),
    ({"model": {"hidden_size": 250}}, ["draft spec", "is invalid", "hidden_size"]),
])
def test_draft_mistakes_are_located_at_model(spec_dir, draft_changes, words):
    _write(spec_dir, draft_changes=draft_changes)
    d = _diag(spec_dir)
    assert d.path == "speculative.model", str(d)
    for w in words:
        assert w in d.message, d.message


def test_a_cycle_of_drafts_is_refused(spec_dir):
    _write(spec_dir, draft_changes={"speculative": {"method": "draft", "model": SPEC_FILE}})
    d = _diag(spec_dir)
    assert d.path == "speculative.model" and "is invalid" in d.message and "cycle" in d.message, d.message


def test_a_draft_with_replicas_splits_the_target_as_the_target_does(spec_dir):
    """With `replicas:` the draft runs beside each replica (lanes): its spec must split the
    target into the same submeshes (its package is built for the replica's mesh); otherwise the
    message names both splits and the entry to write."""
    from ttbundle import spec
    from ttbundle.plan.make import make_plan

    split = {"targets": ["T3K"], "runtime": {"max_num_seqs": 8}, "buckets": {"decode": [1, 8]}}
    _write(spec_dir, target_changes=dict(split, replicas={"T3K": {"submesh": [1, 1]}}), draft_changes=split)
    d = _diag(spec_dir)
    assert d.path == "speculative.model", str(d)
    for w in ("T3K 1x8 as 8 replicas of 1x1", "T3K 1x8",
              "replicas: {T3K: {submesh: [1, 1]}}"):
        assert w in d.message, d.message
    _write(spec_dir, target_changes=dict(split, replicas={"T3K": {"submesh": [1, 1]}}),
           draft_changes=dict(split, replicas={"T3K": {"submesh": [1, 2]}}))
    assert "4 replicas of 1x2" in _diag(spec_dir).message
    _write(spec_dir, target_changes=split, draft_changes=dict(split, replicas={"T3K": {"submesh": [1, 2]}}))
    assert "no `replicas:` entry for T3K" in _diag(spec_dir).message
    _write(spec_dir, target_changes=dict(split, replicas={"T3K": {"submesh": [1, 1]}}),
           draft_changes=dict(split, replicas={"T3K": {"submesh": [1, 1]}}))
    target = spec.load(spec_dir / SPEC_FILE)
    plan = make_plan(target, "T3K")  # the draft counted on the replica's 1x1 mesh, as its own plan there
    assert plan.mesh.num_devices == 1 and plan.memory.draft == make_plan(spec.load(spec_dir / "draft.yaml"),
                                                                        "T3K").memory.weights \
        + plan.draft["kv_bytes"]


def test_a_missing_draft_spec_and_a_draft_without_model_are_located(spec_dir):
    text = _write(spec_dir)
    (spec_dir / "draft.yaml").unlink()
    d = _diag(spec_dir)
    assert d.path == "speculative.model" and "no such spec file" in d.message
    t = yaml.safe_load(text)
    del t["speculative"]["model"]
    (spec_dir / SPEC_FILE).write_text(dump(t))
    d = _diag(spec_dir)
    assert d.path == "speculative.method" and "needs `model:`" in d.message


@pytest.mark.parametrize("model, says", [
    ("/dev/zero", "/dev/zero: is a device, not a regular spec file"),  # was "no such spec file"
    (".", "is a directory, not a spec file"),
    ("draft.yaml/x.yaml", "no such spec file (a part of the path is a file)"),
    ("d" * 300 + ".yaml", "cannot be read (File name too long)"),
])
def test_a_draft_model_that_is_not_a_spec_file_says_what_it_is(spec_dir, model, says):
    _write(spec_dir, {"speculative": {"model": model}})
    d = _diag(spec_dir)
    assert d.path == "speculative.model" and says in d.message, d.message


def test_the_drafts_memory_is_a_line_of_the_targets_plan(spec_dir):
    """The target's plan with a draft: its total grows by the draft's weights (the draft's own
    plan on the same mesh) and the draft's KV region (max_num_seqs full-length sequences in the
    draft's blocks, + the null block, laid out as the draft's own plan lays out its pool)."""
    from ttbundle import spec
    from ttbundle.plan.make import make_plan
    from ttbundle.plan.memory import tensor_bytes
    from ttbundle.tiles import cdiv

    _write(spec_dir)
    target = spec.load(spec_dir / SPEC_FILE)
    with_draft = make_plan(target, "N150")
    plain = make_plan(spec.loads(dump(TINY), SPEC_FILE), "N150")
    dp = make_plan(spec.load(spec_dir / "draft.yaml"), "N150")
    blocks = TINY["runtime"]["max_num_seqs"] * cdiv(TINY["runtime"]["max_model_len"], 32) + 1
    kv = sum(tensor_bytes([blocks] + e["device_shape"][1:], "bf16", "TILE", dp.mesh) * e["layers"]
             for e in dp.kv["entries"])
    assert with_draft.memory.draft == dp.memory.weights + kv > 0
    assert with_draft.draft["kv_blocks"] == blocks
    assert with_draft.memory.weights == plain.memory.weights
    # the pool is chosen after the draft took its share (max_tokens_all_users: auto)
    assert with_draft.memory.total == (with_draft.memory.weights + with_draft.memory.kv_cache
                                       + with_draft.memory.activations + with_draft.memory.trace_region
                                       + with_draft.memory.draft)
    assert with_draft.to_json()["draft"]["bundle"] == "tiny-draft"
    assert any(n.startswith("draft model tiny-draft") for n, _ in with_draft.consumers())


def test_the_drafts_memory_line_in_the_text_plan_and_the_svg(spec_dir):
    """`ttbundle plan` and `ttbundle plan --svg` show the draft's line (its bundle, its KV blocks,
    its bytes): in the SVG a legend row and a segment of every chip's bar, as wide as its share
    of the bar (the plan's own numbers); a plan without a draft draws no draft segment."""
    import io
    import xml.etree.ElementTree as ET

    from rich.console import Console

    from ttbundle import spec
    from ttbundle.plan.make import make_plan
    from ttbundle.report import print_plan
    from ttbundle.svg import render_plan

    _write(spec_dir, draft_changes={"model": {"num_attention_heads": 8}})  # (8 heads: they split over T3K)
    p = make_plan(spec.load(spec_dir / SPEC_FILE), "T3K")
    mem, line = p.memory, p.draft_line()
    assert line.startswith("draft model tiny-draft") and f"{p.draft['kv_blocks']:,} blocks" in line
    out = io.StringIO()
    print_plan(p, Console(file=out, width=200))
    assert any(line in x and f"{mem.draft:,}" in x for x in out.getvalue().splitlines())
    ns = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(render_plan(p).encode())
    text = "\n".join("".join(t.itertext()) for t in root.iter(ns + "text"))
    assert line in text and f"{mem.draft:,} B" in text
    cls = lambda e: (e.get("class") or "").split()  # noqa: E731
    assert [e for e in root.iter() if "legend-draft" in cls(e)]
    segs = [e for e in root.iter() if "seg-draft" in cls(e)]
    frames = [e for e in root.iter() if "bar-frame" in cls(e)]
    assert len(segs) == len(frames) == p.mesh.num_devices
    for seg, fr in zip(segs, frames):
        assert int(seg.get("data-bytes")) == mem.draft
        share = mem.draft / max(mem.total, mem.dram) * float(fr.get("width"))
        assert abs(float(seg.get("width")) - share) <= 0.01
    plain = make_plan(spec.loads(dump(TINY), SPEC_FILE), "T3K")
    assert "seg-draft" not in render_plan(plain) and "draft model" not in render_plan(plain)


def test_vllms_speculative_config_parses_the_draft_config(spec_dir, tmp_path):
    """What `serve` passes is vLLM's `draft_model` with the draft package's path (vLLM's own
    SpeculativeConfig reading it: method kept, k, the model)."""
    from ttbundle import spec, speculative

    _write(spec_dir)
    b = spec.load(spec_dir / SPEC_FILE)
    cfg = speculative.vllm_config(b, tmp_path / "pkg" / "draft")
    assert cfg == {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tmp_path / "pkg" / "draft")}
    from vllm.config.speculative import get_args, SpeculativeMethod
    assert cfg["method"] in get_args(SpeculativeMethod)
    assert speculative.disagreements(cfg, dict(cfg, model=str(tmp_path / "other"))) == \
        [f"model: given {str(tmp_path / 'other')!r}, package {cfg['model']!r}"]
    assert speculative.disagreements(cfg, dict(cfg, num_speculative_tokens=2)) == \
        ["num_speculative_tokens: given 2, package 3"]


def test_a_draft_model_speculates_on_the_emulated_mesh_only(spec_dir):
    """The draft model runs beside the emulated mesh (``runtime.draft``): a device declares no
    speculation for a draft package (the platform refuses ``draft_model`` there)."""
    from ttbundle import spec
    from ttbundle.runtime.capabilities import model_capabilities

    _write(spec_dir)
    from ttbundle.package.facts import of_bundle

    b = of_bundle(spec.load(spec_dir / SPEC_FILE))
    assert model_capabilities(b, device=False)["supports_spec_decode"] is True
    assert model_capabilities(b, device=True)["supports_spec_decode"] is False
    assert model_capabilities(b, device=True)["spec_requirements"] == {}
