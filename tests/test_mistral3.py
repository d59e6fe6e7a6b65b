"""Mistral 3: the Pixtral vision encoder (2-D rope over each image's patch grid, attention within
an image), the patch merger and projector, and the Mistral text model on the emulated mesh against
Hugging Face transformers' ``Mistral3ForConditionalGeneration`` (the independent reference) with
test images of two sizes made here; the image token layout against vLLM's Mistral 3 processor
info; the published Mistral-Small-3.1-24B config imported by ``init --from-hf`` and planned on T3K."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from spec_helpers import TINY_MISTRAL3
from test_families_decl import PUBLISHED

from ttbundle import reference, spec
from ttbundle.backends.emulated import kernel_table
from ttbundle.check import EXEC_BOUNDS, run_check
from ttbundle.cli import app
from ttbundle.families import mistral3_vision as mv
from ttbundle.families import qwen2_5_vl_vision as q25
from ttbundle.plan.make import make_plan

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BUNDLES = Path(__file__).resolve().parent.parent / "bundles"
PUBLISHED_24B = "mistral-small-3.1-24b-instruct.yaml"


def tiny(text: str = TINY_MISTRAL3):
    return spec.loads(text, "spec.yaml")


def images(sizes=((40, 72), (48, 56)), seed: int = 0) -> list:
    """Random RGB images of two sizes: the processor gives them different patch grids (40x72 is
    shrunk to a 64-pixel longer side, 48x56 is not)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]


def _err(text: str) -> str:
    from ttbundle.errors import InvalidInput
    with pytest.raises(InvalidInput) as e:
        tiny(text)
    return str(e.value) + "\n" + "\n".join(str(d) for d in getattr(e.value, "diagnostics", []) or [])


# ---- the host side against transformers and vLLM -------------------------------------------------
def test_rope_tables_are_pixtrals_rotary_embedding():
    from transformers.models.pixtral.modeling_pixtral import PixtralVisionRotaryEmbedding

    v = tiny().arch.vision
    rot = PixtralVisionRotaryEmbedding(reference.hf_config(tiny()).vision_config)
    hw = torch.randint(0, 16, (50, 2), generator=torch.Generator().manual_seed(0))
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), hw)
    ours_cos, ours_sin = mv.rope_tables(v, hw, torch.float32)
    torch.testing.assert_close(ours_cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_sin, sin, rtol=0, atol=1e-6)
    # Qwen2.5-VL's 2-D rope gives the columns the rows' frequencies: not Pixtral's
    qwen_cos, _ = q25.rope_tables(v, hw, torch.float32)
    assert not torch.allclose(qwen_cos, cos, atol=1e-3)


def test_patches_are_the_processors_pixels_and_tokens_vllms_grid():
    """Our patches and grids rebuild transformers' padded pixel_values and image_sizes exactly;
    each image's tokens are vLLM's Mistral 3 grid: rows of [IMG] per merge block, [IMG_BREAK]
    after a row, [IMG_END] last."""
    import transformers
    from ttbundle.runtime.registry import _pil_image_processors

    b = tiny()
    _pil_image_processors(b.family.vision_part(b.arch))  # as the plugin does without torchvision
    from vllm.model_executor.models.mistral3 import Mistral3HFEncoderInfo

    v, vs = b.arch.vision, b.vision
    ims = images(((40, 72), (48, 56), (130, 20)))
    ours = mv.image_inputs(v, vs, ims)
    proc = transformers.PixtralImageProcessorPil(size={"longest_edge": vs.longest_edge}, resample=3)
    theirs = proc(images=ims, patch_size={"height": v.factor, "width": v.factor}, return_tensors="pt")
    px, sizes = mv.to_images(v, ours["pixel_values"], ours["image_grid_thw"])
    assert sizes.tolist() == theirs["image_sizes"].tolist()
    torch.testing.assert_close(px, theirs["pixel_values"].float(), rtol=0, atol=0)
    part = b.family.vision_part(b.arch)
    info = Mistral3HFEncoderInfo(reference.hf_config(b), vs.longest_edge)
    for k, im in enumerate(ims):
        ncols, nrows = info.get_patch_grid_size(image_width=im.width, image_height=im.height)
        want = ([v.image_token_index] * ncols + [v.image_break_token_index]) * nrows
        want[-1] = v.image_end_token_index
        assert part.image_tokens(ours, k) == want
        assert part.soft_token_counts(ours)[k] == ncols * nrows


# ---- the model against transformers ---------------------------------------------------------------
def test_text_only_prompt_is_token_identical_to_transformers():
    r = run_check(tiny(), "N150", steps=6, random_weights=True, seed=1)
    assert r.tokens_agree and r.passed, (r.ref_tokens, r.emu_tokens, r.diverging())


@pytest.mark.parametrize("mesh", ["N150", "N300", "T3K"])
def test_check_with_images_is_token_identical_to_transformers(mesh):
    r = run_check(tiny(), mesh, steps=6, random_weights=True, seed=1, images=images())
    img = r.layers[0]
    assert img.step == "image" and img.err <= EXEC_BOUNDS["fp32"]  # against transformers' get_image_features
    assert r.tokens_agree and r.passed, (r.ref_tokens, r.emu_tokens, r.diverging())
    # 40x72 -> 40x64 pixels = 10x16 patches, 48x56 = 12x14 patches: 160 + 168 in the 512 bucket;
    # 5 rows of 8 + 6 rows of 7 soft tokens, each row closed by a break/end token, after one text token
    assert ("vision", 512) in r.shapes_run
    assert r.prompt_len >= 1 + 5 * 9 + 6 * 8


def test_patch_major_merge_diverges_at_the_image(monkeypatch):
    """The merger's rows must be channel-major (``F.unfold``); Qwen's patch-major concatenation
    of the same rows fails at the image already."""
    monkeypatch.setitem(kernel_table.KERNELS, "mistral3_unfold", kernel_table.KERNELS["qwen_vision_merge"])
    r = run_check(tiny(), "N150", steps=2, random_weights=True, seed=1, images=images())
    assert not r.passed
    d = r.diverging()
    assert d.step == "image" and d.err > EXEC_BOUNDS["fp32"]


def test_qwen_rope_diverges_at_the_image(monkeypatch):
    """Qwen2.5-VL's 2-D rope table in place of Pixtral's fails at the image."""
    monkeypatch.setattr(mv, "rope_tables", q25.rope_tables)
    r = run_check(tiny(), "N150", steps=2, random_weights=True, seed=1, images=images())
    assert not r.passed
    d = r.diverging()
    assert d.step == "image" and d.err > EXEC_BOUNDS["fp32"]


# ---- the spec's vision settings -------------------------------------------------------------------
def test_default_settings_bound_an_image_to_16_merge_blocks_a_side():
    text = TINY_MISTRAL3.replace("image_size: 64", "image_size: 1024").replace(
        "vision: {images_per_prompt: 2, longest_edge: 64, buckets: [256, 512]}", "vision: {images_per_prompt: 1}")
    text = text.replace("max_model_len: 512", "max_model_len: 1024").replace(
        "prefill: [64, 128], decode: [1, 8, 32], prefill_chunk: 128",
        "prefill: [64, 512], decode: [1, 8, 32], prefill_chunk: 512")
    vs = tiny(text).vision
    assert (vs.longest_edge, vs.buckets) == (16 * 8, [16 * 16 * 4])  # 8-pixel merge blocks, 4 patches each


@pytest.mark.parametrize("change,msg", [
    ("longest_edge: 64, buckets: [256, 512]", None),
    ("longest_edge: 72, buckets: [256, 512]", "longest_edge=72 exceeds the encoder's image_size=64"),
    ("longest_edge: 64, buckets: [256, 510]", "510 patches is not a multiple of 4"),
    ("longest_edge: 64, max_pixels: 4096, buckets: [256, 512]", "max_pixels is Qwen2.5-VL's pixel budget"),
])
def test_vision_settings_are_checked(change, msg):
    text = TINY_MISTRAL3.replace("longest_edge: 64, buckets: [256, 512]", change)
    if msg is None:
        assert tiny(text).vision.longest_edge == 64
    else:
        assert msg in _err(text)


def test_a_vision_bucket_smaller_than_the_images_is_a_cap_stated_as_a_warning():
    """Two images of up to 64 pixels (8 x 8 merge blocks = 256 patches each) in a bucket of 256: a
    cap (a request needing more patches is refused), said with the arithmetic; the spec loads."""
    b = tiny(TINY_MISTRAL3.replace("longest_edge: 64, buckets: [256, 512]", "longest_edge: 64, buckets: [256]"))
    (w,) = [d.message for d in b.warnings if d.path == "vision.buckets"]
    assert "a cap" in w and "256 patches each) need up to 512 patches, the largest vision bucket holds 256" in w
    assert "refused (400)" in w


def test_an_image_longer_than_a_prefill_chunk_is_an_error():
    text = TINY_MISTRAL3.replace("prefill_chunk: 128", "prefill_chunk: 64")
    # 8 rows of 8 soft tokens + 8 row breaks = 72 tokens > 64
    assert "an image of up to 256 patches (longest_edge=64, largest bucket 512) is up to 72 tokens" in _err(text)


# ---- the published 24B: import and plan --------------------------------------------------------------
def test_published_24b_imports_with_init_and_plans_its_vision_programs_on_t3k(tmp_path):
    from ttbundle import cli
    for console in (cli.out, cli.err):
        console.width = 200
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    hf = tmp_path / "Mistral-Small-3.1-24B-Instruct-2503"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(PUBLISHED[PUBLISHED_24B]))
    out = tmp_path / "spec.yaml"
    r = runner.invoke(app, ["init", "--from-hf", str(hf), "-o", str(out), "--mesh", "T3K"])
    assert r.exit_code == 0, r.output
    b = spec.load(out)
    ours = spec.load(BUNDLES / PUBLISHED_24B)
    assert b.arch == ours.arch  # the bundle's dims are the published config's
    r = runner.invoke(app, ["plan", str(out), "--mesh", "T3K"])
    assert r.exit_code == 0, r.output
    assert "vision programs" in r.stdout and "fits" in r.stdout


def test_published_24b_bundle_plans_on_t3k_with_its_vision_programs():
    b = spec.load(BUNDLES / PUBLISHED_24B)
    p = make_plan(b, "T3K")
    kinds = [k for k, _, _ in p.vision]
    assert kinds == ["vision_embedding", "vision_layer", "vision_projector"]
    assert sum(n for k, n, _ in p.vision if k == "vision_layer") == 24
    t = {x.name: x for x in p.tensors}
    assert t["v_wq"].device_shape == [1024, 1024 // 8]  # 16 heads of 64 over T3K's 8 columns
    assert t["v_w2"].device_shape == [4096 // 8, 1024]
    assert t["mm_merge"].device_shape == [4 * 1024, 1024]  # the projector replicated
    assert t["mm_w2"].device_shape == [5120, 5120]
    assert p.fits
    # the largest image: ceil(1540 / 28) = 55 merge blocks a side = 12100 patches, one bucket
    assert max(b.vision.buckets) == 55 * 55 * 4


@pytest.mark.parametrize("key,value,msg", [
    ("multimodal_projector_bias", True, "multimodal_projector_bias=True is not supported by ttbundle: no published"),
    ("vision_feature_layer", [-1, -2], "vision_feature_layer=[-1, -2] is not supported by ttbundle: the projector"),
])
def test_unsupported_published_keys_exit_2_naming_them(tmp_path, key, value, msg):
    from ttbundle import cli
    for console in (cli.out, cli.err):
        console.width = 200
    hf = tmp_path / "m"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**PUBLISHED[PUBLISHED_24B], key: value}))
    out = tmp_path / "spec.yaml"
    r = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, ["init", "--from-hf", str(hf), "-o", str(out)])
    assert r.exit_code == 2 and msg in r.output, r.output
    assert not out.exists()
