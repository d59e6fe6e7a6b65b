"""Gemma 3 multimodal: the vision tower and projector on the emulated mesh against Hugging Face
transformers' ``Gemma3ForConditionalGeneration`` (the independent reference), with test images
generated here; the spec's image settings and their errors; ``check --image`` on the CLI."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from pkg_mutations import drop_first, edit_programs
from spec_helpers import TINY_VL, line_of

from ttbundle import spec
from ttbundle.plan.make import make_plan
from ttbundle.backends.emulated import model as emodel
from ttbundle.check import EXEC_BOUNDS, run_check
from ttbundle.cli import app
from ttbundle.errors import InvalidInput

os.environ.setdefault("HF_HUB_OFFLINE", "1")



def tiny_vl(text: str = TINY_VL):
    return spec.loads(text, "spec.yaml")


def images(n: int = 2, seed: int = 0) -> list:
    """Random RGB images of other sizes than the model's (the processor resizes them)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((40 + 8 * i, 72, 3)) * 255).astype("uint8")) for i in range(n)]


@pytest.mark.parametrize("mesh", ["N150", "N300", "T3K"])
def test_check_with_images_is_token_identical_to_transformers(mesh):
    r = run_check(tiny_vl(), mesh, steps=6, random_weights=True, seed=1, images=images())
    img = r.layers[0]
    assert img.step == "image" and img.err <= EXEC_BOUNDS["fp32"]
    assert r.tokens_agree and r.passed, (r.ref_tokens, r.emu_tokens, r.diverging())
    assert ("vision", 2) in r.shapes_run
    # the prompt carries both images' tokens: 1 text token, then 2 x (boi + 16 soft + eoi)
    assert r.prompt_len > 2 * 18


def test_images_change_what_the_reference_computes():
    """The comparison is not vacuous: other images give other image features on both sides."""
    a = run_check(tiny_vl(), "N150", steps=2, random_weights=True, seed=1, images=images(seed=0))
    b = run_check(tiny_vl(), "N150", steps=2, random_weights=True, seed=1, images=images(seed=5))
    assert a.passed and b.passed
    assert a.layers[0].max_abs < 1e-3 and b.layers[0].max_abs < 1e-3
    assert (a.ref_tokens, a.emu_tokens) != (b.ref_tokens, b.emu_tokens) or \
        a.layers[1].max_abs != b.layers[1].max_abs


def test_dropped_vision_all_reduce_fails_at_the_image():
    hook = lambda pkg: edit_programs(pkg, "vision_layer", drop_first(  # noqa: E731
        lambda s: s.get("collective") == "all_reduce" and s["act"] == "attn_out"))
    r = run_check(tiny_vl(), "T3K", steps=2, random_weights=True, seed=1, images=images(), package_hook=hook)
    assert not r.passed
    d = r.diverging()
    assert d.step == "image" and d.err > EXEC_BOUNDS["fp32"]


def test_soft_tokens_of_one_image_attend_to_each_other(monkeypatch):
    """Without the image-block mask (causal only) the prefill no longer matches transformers."""
    stages = emodel.EmulatedModel.stages  # what forward runs, and what check runs layer by layer

    def causal_only(self, *a, mm=None, **kw):
        if mm is not None:
            mm = {**mm, "blocks": torch.full_like(mm["blocks"], -1)}
        return stages(self, *a, mm=mm, **kw)
    monkeypatch.setattr(emodel.EmulatedModel, "stages", causal_only)
    r = run_check(tiny_vl(), "N150", steps=2, random_weights=True, seed=1, images=images())
    assert not r.passed
    assert r.diverging().step == "prefill"


def test_plan_holds_vision_tensors_and_program():
    b = tiny_vl()
    p = make_plan(b, "T3K")
    t = {x.name: x for x in p.tensors}
    # 8 vision heads of 8 over 8 columns: one head per device; the MLP's 128 over 8: 16 each
    assert t["v_wq"].device_shape == [64, 8] and t["v_w1"].device_shape == [64, 16]
    assert t["v_pos"].device_shape == [64, 64]  # replicated: 64 patches x 64
    kinds = [k for k, _, _ in p.vision]
    assert kinds == ["vision_embedding", "vision_layer", "vision_projector"]
    reduces = [s for _, _, steps in p.vision for s in steps if s.kind == "all_reduce"]
    assert [s.act for s in reduces] == ["attn_out", "mlp_out"]


# ---- spec errors ---------------------------------------------------------------------------------
def _err(text: str) -> str:
    with pytest.raises(InvalidInput) as e:
        tiny_vl(text)
    return "\n".join(f"{d.line}: {d.message}" for d in e.value.diagnostics)


def test_a_vision_bucket_too_small_for_the_images_is_an_error():
    text = TINY_VL.replace("vision: {images_per_prompt: 2, buckets: [1, 2]}",
                           "vision: {images_per_prompt: 3, buckets: [1, 2]}")
    msg = _err(text)
    assert f"{line_of(text, 'vision: {images_per_prompt: 3')}:" in msg
    assert "largest vision bucket (2 images) cannot hold images_per_prompt=3" in msg


def test_an_image_longer_than_the_prefill_chunk_is_an_error():
    text = TINY_VL.replace("mm_tokens_per_image: 16", "mm_tokens_per_image: 64")
    msg = _err(text)
    # 64 soft tokens + begin/end of image = 66 > a chunk of 64
    assert "one image is 66 tokens" in msg and "use a chunk >= 66" in msg


def test_vision_settings_on_a_text_model_are_an_error():
    text = TINY_VL.split("  vision:\n")[0] + TINY_VL.split("    eoi_token_index: 502\n")[1]
    assert "the model has no vision part" in _err(text)


def test_image_token_outside_the_vocabulary_is_an_error():
    assert "image_token_index=600 is not a token of the vocabulary (vocab_size=512)" in \
        _err(TINY_VL.replace("image_token_index: 500", "image_token_index: 600"))


# ---- CLI -----------------------------------------------------------------------------------------
def test_cli_check_with_image_files(tmp_path):
    paths = []
    for i, im in enumerate(images()):
        paths += ["--image", str(tmp_path / f"im{i}.png")]
        im.save(tmp_path / f"im{i}.png")
    (tmp_path / "spec.yaml").write_text(TINY_VL)
    r = CliRunner().invoke(app, ["check", str(tmp_path / "spec.yaml"), "--mesh", "N300", "--random-weights",
                                 "--steps", "3", "--seed", "1", *paths])
    assert r.exit_code == 0, r.output
    assert "image soft tokens" in r.output
    same = re.search(r"executor: (\d+)/(\d+) decisive next-token predictions identical", r.output)
    assert same and same[1] == same[2], r.output
    (tmp_path / "bad.png").write_text("not an image")
    r = CliRunner().invoke(app, ["check", str(tmp_path / "spec.yaml"), "--random-weights", "--steps", "1",
                                 "--image", str(tmp_path / "bad.png")])
    assert r.exit_code != 0 and "not an image PIL can read" in r.output and "Traceback" not in r.output


def test_plan_cli_lists_the_vision_programs(tmp_path):
    import json
    (tmp_path / "spec.yaml").write_text(TINY_VL)
    r = CliRunner().invoke(app, ["plan", str(tmp_path / "spec.yaml"), "--mesh", "T3K", "--json"])
    assert r.exit_code == 0, r.output
    vp = json.loads(r.stdout)["vision_programs"]
    # rows = images x (64 / 8)^2 patches; two all_reduces per vision layer, 2 layers
    assert [(v["bucket"], v["rows"], v["collectives"]) for v in vp] == [(1, 64, 4), (2, 128, 4)]
    r = CliRunner().invoke(app, ["plan", str(tmp_path / "spec.yaml"), "--mesh", "T3K"])
    assert "vision programs" in r.stdout and "v_wq" in r.stdout


def test_the_ttnn_pooling_matrix_is_the_average_pool():
    """The ttnn lowering pools by a matmul (``pool_matrix``); torch's avg_pool2d on the patch grid
    (as transformers' Gemma 3 projector pools) is the reference."""
    from ttbundle.tables import pool_matrix
    n, side, k, H = 2, 8, 2, 5
    x = torch.randn(n, side * side, H)
    ref = torch.nn.functional.avg_pool2d(x.transpose(1, 2).reshape(n, H, side, side), k, k)
    ref = ref.flatten(2).transpose(1, 2).reshape(-1, H)
    assert torch.allclose(pool_matrix(n, side, k) @ x.reshape(-1, H), ref, atol=1e-6)


def test_plan_charges_the_vision_encoders_activations_when_they_are_the_peak():
    """256x256 images of 8-pixel patches: 1024 patches each, 2 images per call = 2048 rows, more
    than the 128-token prefill. On N150 (nothing split) the vision layer holds h, x, q, k, v, o,
    attn_out, attn_outb, x2, mlp_out, mlp_outb (64 features) and f, fa (128), each a bf16 TILE
    buffer: tiles round-robin over 12 DRAM banks, 2,048 B each."""
    import math
    text = TINY_VL.replace("image_size: 64", "image_size: 256").replace("mm_tokens_per_image: 16",
                                                                       "mm_tokens_per_image: 64")
    text = text.replace("prefill_chunk: 64}", "prefill_chunk: 128}")
    p = make_plan(tiny_vl(text), "N150")
    banks = p.mesh.chip.dram_banks

    def buf(rows, f):
        return math.ceil(rows // 32 * f // 32 / banks) * banks * 2048
    assert p.memory.activations == 11 * buf(2048, 64) + 2 * buf(2048, 128)
    small = make_plan(tiny_vl(), "N150")  # 64-patch images: the text prefill is the peak
    assert any(n == "logits" for n, _ in small.activation_buffers)
