"""`ttbundle plan --svg`: the drawing parses, has one box per chip, bars match the memory plan."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ttbundle import spec as specmod
from ttbundle.cli import app
from ttbundle.plan.make import make_plan
from ttbundle.plan.propagate import Collective
from ttbundle.plan.sharding import TensorPlan
from ttbundle.svg import render_plan

ROOT = Path(__file__).resolve().parents[1]
NS = "{http://www.w3.org/2000/svg}"

# Dims that divide every axis of N150 (1x1), T3K (1x8) and TG (8x4): hidden 256 over rows=8,
# 8 query / 4 KV heads and 768 intermediate over cols=4 or 8.
SMALL = """
name: svg-small
model:
  family: llama
  vocab_size: 2048
  hidden_size: 256
  intermediate_size: 768
  num_hidden_layers: 4
  num_attention_heads: 8
  num_key_value_heads: 4
  max_position_embeddings: 2048
targets: [N150, T3K, TG]
buckets: {prefill: [128, 512], decode: [1, 8, 32], prefill_chunk: 512}
runtime: {max_model_len: 1024, max_num_seqs: 32}
"""

# Llama-3.1-8B dims: 48 GiB per chip on N150 (does not fit), about half of DRAM on T3K, fits TG.
BIG = """
name: svg-big
model:
  family: llama
  vocab_size: 128256
  hidden_size: 4096
  intermediate_size: 14336
  num_hidden_layers: 32
  num_attention_heads: 32
  num_key_value_heads: 8
  max_position_embeddings: 131072
targets: [N150, T3K, TG]
buckets: {prefill: [128, 1024, 4096], decode: [1, 8, 32], prefill_chunk: 4096}
runtime: {max_model_len: 8192, max_num_seqs: 32}
"""


def plan_of(text: str, mesh: str):
    return make_plan(specmod.loads(text), mesh)


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg.encode("utf-8"))


def classes(el: ET.Element) -> list[str]:
    return (el.get("class") or "").split()


def with_class(root: ET.Element, cls: str, tag: str | None = None) -> list[ET.Element]:
    return [e for e in root.iter() if cls in classes(e) and (tag is None or e.tag == NS + tag)]


def all_text(root: ET.Element) -> str:
    return "\n".join("".join(t.itertext()) for t in root.iter(NS + "text"))


def f(el: ET.Element, attr: str) -> float:
    return float(el.get(attr))


@pytest.mark.parametrize("mesh,devices", [("N150", 1), ("T3K", 8), ("TG", 32)])
def test_one_box_per_chip(mesh, devices):
    p = plan_of(SMALL, mesh)
    assert p.mesh.num_devices == devices
    root = parse(render_plan(p))
    chips = with_class(root, "chip", "rect")
    assert len(chips) == devices
    assert sorted(c.get("data-device") for c in chips) == sorted(
        f"{r},{c}" for r in range(p.mesh.rows) for c in range(p.mesh.cols))
    assert len(with_class(root, "bar-frame")) == devices
    # TG's 32 boxes are laid out rows x cols and stay inside the drawing
    xs = sorted({f(c, "x") for c in chips})
    ys = sorted({f(c, "y") for c in chips})
    assert (len(ys), len(xs)) == p.mesh.shape
    width = f(root, "width")
    assert all(f(c, "x") + f(c, "width") <= width for c in chips)


@pytest.mark.parametrize("mesh", ["N150", "T3K", "TG"])
def test_bar_segments_proportional_to_memory(mesh):
    p = plan_of(BIG, mesh)
    mem = p.memory
    # expected fractions of the bar, computed here from the plan's numbers
    scale = max(mem.weights + mem.kv_cache + mem.activations + mem.trace_region, mem.dram)
    parts = [mem.weights, mem.kv_cache, mem.activations, mem.trace_region,
             max(mem.dram - mem.weights - mem.kv_cache - mem.activations - mem.trace_region, 0)]
    names = ["weights", "kv_cache", "activations", "trace_region", "free"]
    root = parse(render_plan(p))
    frames = with_class(root, "bar-frame")
    segs = with_class(root, "seg")
    assert len(segs) == len(names) * len(frames) == len(names) * p.mesh.num_devices
    for i, fr in enumerate(frames):
        bar_w, x = f(fr, "width"), f(fr, "x")
        for name, n, seg in zip(names, parts, segs[i * len(names):(i + 1) * len(names)]):
            assert f"seg-{name}" in classes(seg)
            assert abs(f(seg, "width") - n / scale * bar_w) <= 1.0, (name, f(seg, "width"))
            assert abs(f(seg, "x") - x) <= 1.0  # stacked left to right, no gaps
            x += f(seg, "width")
        if p.fits:
            assert abs(x - (f(fr, "x") + bar_w)) <= 1.0
    # something visible: on T3K the 8B plan uses about half of each chip
    if mesh == "T3K":
        assert p.fits and 0.3 < mem.total / mem.dram < 0.9
        w = {n: f(s, "width") for n, s in zip(names, segs[:5])}
        assert w["kv_cache"] > w["weights"] > w["activations"] > 1


def test_over_capacity_marker():
    over = plan_of(BIG, "N150")
    assert not over.fits
    root = parse(render_plan(over))
    marked = with_class(root, "over-capacity")
    assert marked, "no over-capacity marker"
    chip = with_class(root, "chip", "rect")[0]
    assert "over-capacity" in classes(chip) and chip.get("stroke") == "#d62728"
    # the chip's capacity sits where DRAM ends on a bar scaled to the total needed
    fr = with_class(root, "bar-frame")[0]
    cap = with_class(root, "capacity", "line")
    assert len(cap) == 1
    want = f(fr, "x") + over.memory.dram / over.memory.total * f(fr, "width")
    assert abs(f(cap[0], "x1") - want) <= 1.0
    assert "DOES NOT FIT" in all_text(root)

    ok = parse(render_plan(plan_of(BIG, "T3K")))
    assert not with_class(ok, "over-capacity") and not with_class(ok, "capacity")


def test_header():
    p = plan_of(BIG, "T3K")
    text = all_text(parse(render_plan(p)))
    head = text.splitlines()[:3]
    assert head[0] == "svg-big (llama) on T3K 1x8"
    assert "wormhole_b0" in head[1] and "8 x Wormhole B0" in head[1]
    pct = f"{100 * p.memory.total / p.memory.dram:.1f}%"
    assert head[2].startswith("fits: ") and f"({pct} of DRAM used)" in head[2]


def test_tensor_blocks_follow_the_axes():
    p = plan_of(SMALL, "TG")  # rows=8, cols=4
    root = parse(render_plan(p))
    groups = {g.get("data-name"): g for g in with_class(root, "tensor", "g")}
    assert set(groups) == {t.name for t in p.tensors}
    for t in p.tensors:
        n = math.prod(p.mesh.axis_size(a) if a else 1
                      for e in t.spec for a in ([e] if isinstance(e, str) or e is None else e))
        shards = with_class(groups[t.name], "shard", "rect")
        assert len(shards) == n, t.name
        assert len(with_class(groups[t.name], "own")) == 1
    assert len(with_class(groups["wq"], "shard")) == 32  # [rows, cols]
    assert len(with_class(groups["embed"], "shard")) == 4  # [null, cols]
    assert len(with_class(groups["final_norm"], "shard")) == 1  # replicated
    wq = " ".join("".join(t.itertext()) for t in groups["wq"].iter(NS + "text"))
    assert "wq bf16[256@rows, 256@cols] -> [32, 64] per chip" in wq


def test_replicated_kv_heads_drawn_as_shared_blocks():
    p = plan_of(SMALL, "T3K")  # 4 KV heads on cols=8: each head held by 2 chips
    wk = next(t for t in p.tensors if t.name == "wk")
    assert wk.device_shape == [256, 32] and wk.shape == [256, 128]
    root = parse(render_plan(p))
    g = next(g for g in with_class(root, "tensor", "g") if g.get("data-name") == "wk")
    assert len(with_class(g, "shard")) == 4
    assert "each KV head replicated on 2 devices" in " ".join(g.itertext())


def test_collectives_listed_with_bytes():
    p = plan_of(SMALL, "T3K")
    root = parse(render_plan(p))
    rows = with_class(root, "collective", "g")
    assert len(rows) == len(p.collectives) > 0
    assert [int(r.get("data-bytes")) for r in rows] == [
        c.traffic_bytes_per_token * c.count for c in p.collectives]
    assert f"decode total: {p.decode_traffic_bytes_per_token:,} B" in all_text(root)

    none = all_text(parse(render_plan(plan_of(SMALL, "N150"))))
    assert "none: nothing is split across devices" in none


def test_text_is_escaped():
    p = plan_of(SMALL, "T3K")
    p.tensors[0].notes.append('odd <note> & "quotes"\x01')
    p.collectives.append(Collective("decoder", "x <&> y", "all_gather", ("cols",), 8, 64, 448, 4))
    # a 3-D (expert-stacked) tensor draws too
    p.tensors.append(TensorPlan("experts<w>", "experts", "bf16", "TILE", [8, 256, 512],
                                ["cols", None, None], [1, 256, 512], 4, 1 << 20, []))
    svg = render_plan(p)
    assert "&lt;note&gt; &amp; &quot;quotes&quot;" in svg and "x &lt;&amp;&gt; y" in svg
    root = parse(svg)  # well-formed despite the control character
    text = all_text(root)
    assert 'odd <note> & "quotes"' in text and "x <&> y" in text
    assert any(g.get("data-name") == "experts<w>" for g in with_class(root, "tensor", "g"))


def test_self_contained_and_deterministic():
    a = render_plan(plan_of(SMALL, "TG"))
    b = render_plan(plan_of(SMALL, "TG"))
    assert a == b
    root = parse(a)
    assert root.tag == NS + "svg"
    for el in root.iter():
        assert not el.tag.endswith(("script", "image", "foreignObject", "use"))
        for k, v in el.attrib.items():
            assert "href" not in k and "url(" not in v and "@import" not in v


def test_cli_writes_svg(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out.svg"
    r = CliRunner().invoke(app, ["plan", "bundles/demo.yaml", "--mesh", "T3K", "--svg", str(out)])
    assert r.exit_code == 0, r.output
    root = parse(out.read_text(encoding="utf-8"))
    assert len(with_class(root, "chip", "rect")) == 8
    assert "demo (llama) on T3K 1x8" in all_text(root)
