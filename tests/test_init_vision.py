"""`ttbundle init --from-hf` of a multimodal checkpoint takes its image preprocessing from the
checkpoint's own processor files, so the package preprocesses an image as the model's processor
does. For every vision family a tiny config (transformers' config class) gets a processor saved by
transformers' own image processor class with settings the package's defaults do not have (another
pixel budget, longest edge, normalisation: the published Qwen3-VL budget of 65,536 to 16,777,216
pixels among them); the reference is that processor loaded back from the checkpoint
(``from_pretrained``): pixels and patch grids, and so each image's tokens, for images from 32x32 to
larger than the model's bound, at odd aspect ratios. vLLM's own processor (through ttbundle's
registration, from the files the package carries) expands a prompt to the same image tokens.
Settings the package cannot serve are refused naming the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from test_init import save_tiny

from ttbundle import vision
from ttbundle.errors import InvalidInput
from ttbundle.init import init_spec

SIZES = [(32, 32), (60, 90), (300, 420), (17, 250), (500, 640), (2000, 90)]


def images(sizes=SIZES):
    rng = np.random.default_rng(0)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]


def _qwen25(d: Path):
    import transformers
    transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 9, max_pixels=28 * 28 * 200, image_mean=[0.4, 0.5, 0.6],
                                          image_std=[0.2, 0.3, 0.25]).save_pretrained(d)


def _qwen3(d: Path):  # the published Qwen3-VL's budget (its preprocessor_config.json's `size`)
    import transformers
    transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=8,
                                          image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(d)


def _mistral3(d: Path):
    import transformers
    transformers.PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size={"height": 8, "width": 8},
                                          image_mean=[0.3, 0.4, 0.5]).save_pretrained(d)
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor", "patch_size": 8,
                                                         "spatial_merge_size": 2}))


def _gemma3(d: Path):
    import transformers
    transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, image_mean=[0.1, 0.2, 0.3],
                                         image_std=[0.6, 0.5, 0.4]).save_pretrained(d)


CASES = {"qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", _qwen25, "Qwen2VLImageProcessorPil"),
         "qwen3_vl": ("Qwen3VLForConditionalGeneration", _qwen3, "Qwen2VLImageProcessorPil"),
         "mistral3": ("Mistral3ForConditionalGeneration", _mistral3, "PixtralImageProcessorPil"),
         "gemma3": ("Gemma3ForConditionalGeneration", _gemma3, "Gemma3ImageProcessorPil")}


def made(family: str, tmp_path: Path):
    """(the spec init wrote for the tiny checkpoint with its processor, the checkpoint, its
    processor as transformers loads it)."""
    import transformers

    arch, save, cls = CASES[family]
    hf = save_tiny(arch, tmp_path / "model")
    save(hf)
    r = init_spec(hf, tmp_path / "spec.yaml")
    return r, hf, getattr(transformers, cls).from_pretrained(str(hf))


def hf_tokens(family: str, bundle, ip, ims) -> tuple[list[int], dict]:
    """Each image's soft tokens as the checkpoint's own processor makes them, and its output."""
    v = bundle.arch.vision
    if family == "gemma3":
        out = ip(images=ims, return_tensors="pt")
        return [v.mm_tokens_per_image] * len(ims), out
    if family == "mistral3":  # PixtralProcessor passes patch x merge
        out = ip(images=ims, patch_size={"height": v.factor, "width": v.factor}, return_tensors="pt")
        return [(h // v.factor) * (w // v.factor) for h, w in out["image_sizes"].tolist()], out
    out = ip(images=ims, return_tensors="pt")
    return [int(g.prod()) // v.merge_unit for g in out["image_grid_thw"]], out


@pytest.mark.parametrize("family", sorted(CASES))
def test_init_writes_the_checkpoints_preprocessing(family, tmp_path):
    r, hf, ip = made(family, tmp_path)
    vs = r.bundle.vision
    assert vs.image_mean == pytest.approx(list(ip.image_mean)) and vs.image_std == pytest.approx(list(ip.image_std))
    if family.startswith("qwen"):
        assert (vs.min_pixels, vs.max_pixels) == (ip.size["shortest_edge"], ip.size["longest_edge"])
    if family == "mistral3":
        assert vs.longest_edge == ip.size["longest_edge"] == 56
    # the package's processor files say the same
    pre = vision.preprocessor_config(r.bundle)
    assert pre["image_mean"] == vs.image_mean and pre["image_std"] == vs.image_std
    # images from 32x32 to past the model's bound, odd aspect ratios: the package's pixels and
    # grids are the model's processor's, so are each image's tokens
    ims = images()
    want, out = hf_tokens(family, r.bundle, ip, ims)
    ours = vision.image_inputs(r.bundle, ims)
    part = r.bundle.family.vision_part(r.bundle.arch)
    assert part.soft_token_counts(ours) == want
    if family == "mistral3":
        from ttbundle.families import mistral3_vision as m3
        px, sizes = m3.to_images(r.bundle.arch.vision, ours["pixel_values"], ours["image_grid_thw"])
        assert sizes.tolist() == out["image_sizes"].tolist()
        torch.testing.assert_close(px, out["pixel_values"].float())
    else:
        torch.testing.assert_close(ours["pixel_values"], out["pixel_values"].float())
    if family == "qwen2_5_vl":  # 9 to 200 merge blocks: the small images grow, the large shrink
        assert min(want) == 9 and max(want) <= 200 and len(set(want)) > 3


def test_a_budget_past_a_prefill_chunk_becomes_a_stated_cap(tmp_path):
    """The published Qwen3-VL budget (up to 16,777,216 pixels = 65,536 merge blocks at 16-pixel
    merge blocks here) cannot be one prefill chunk: init keeps the processor's budget (images are
    resized as the model's processor resizes them) and caps the vision bucket at the largest image
    whose tokens fit a chunk, saying so; the spec validates with the cap as a warning."""
    r, hf, ip = made("qwen3_vl", tmp_path)
    vs, bk = r.bundle.vision, r.bundle.buckets
    chunk = bk.prefill_chunk or max(bk.prefill)
    cap = max(vs.buckets)
    assert vs.max_pixels == 16777216
    assert cap // 4 + 2 <= chunk < (cap + 4) // 4 + 2  # the most merge blocks whose image fits the chunk
    assert any("a cap" in n and "refused (400)" in n for n in r.notes)
    assert "init: " in r.text and "a cap:" in r.text
    (w,) = [d.message for d in r.bundle.warnings if d.path == "vision.buckets"]
    assert f"the largest vision bucket holds {cap}" in w


def test_vllms_processor_from_the_package_files_gives_the_models_image_tokens(tmp_path):
    """A chat prompt with two images (one odd-shaped) through vLLM's own Qwen2.5-VL processor,
    registered as ttbundle registers it and reading the files the package carries: its image
    tokens per image are the checkpoint's processor's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "runtime"))
    from runtime_helpers import processor_model_dir, vllm_processor
    from vllm.multimodal.processing import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    r, hf, ip = made("qwen2_5_vl", tmp_path)
    ims = images([(60, 90), (17, 250)])
    want, _ = hf_tokens("qwen2_5_vl", r.bundle, ip, ims)
    d = processor_model_dir(r.bundle, tmp_path / "pkg")
    proc = vllm_processor(d, "Qwen2_5_VLForConditionalGeneration", {"image": 1})
    img = "<|vision_start|><|image_pad|><|vision_end|>"
    tok = proc.info.ctx.tokenizer
    got = []
    for im in ims:
        ids = tok.encode(f"<|user|> ba {img} bo <|end|>", add_special_tokens=False)
        out = proc.apply(ProcessorInputs(prompt=ids, mm_data_items=proc.info.parse_mm_data({"image": [im]})),
                         TimingContext(enabled=False))
        got.append(out["prompt_token_ids"].count(r.bundle.arch.vision.image_token_id))
    assert got == want


@pytest.mark.parametrize("family,change,msg", [
    ("qwen2_5_vl", {"patch_size": 16}, "patch_size is 16 but config.json's vision_config.patch_size is 14"),
    ("qwen2_5_vl", {"resample": 2}, "resample is 2, the package's image processor uses 3"),
    ("gemma3", {"size": {"height": 56, "width": 56}}, "config.json's vision_config.image_size is 28"),
    ("gemma3", {"do_pan_and_scan": True}, "do_pan_and_scan is True"),
    ("mistral3", {"rescale_factor": 0.5}, "rescale_factor is 0.5"),
])
def test_preprocessing_the_package_cannot_serve_is_refused(family, change, msg, tmp_path):
    arch, save, _ = CASES[family]
    hf = save_tiny(arch, tmp_path / "model")
    save(hf)
    pre = json.loads((hf / "preprocessor_config.json").read_text())
    (hf / "preprocessor_config.json").write_text(json.dumps({**pre, **change}))
    with pytest.raises(InvalidInput) as e:
        init_spec(hf, tmp_path / "spec.yaml")
    assert msg in e.value.message and "preprocessor_config.json" in e.value.message
    assert not (tmp_path / "spec.yaml").exists()


def test_a_checkpoint_without_processor_files_gets_the_family_defaults_said_so(tmp_path):
    hf = save_tiny("Qwen3VLForConditionalGeneration", tmp_path / "model")
    r = init_spec(hf, tmp_path / "spec.yaml")
    assert r.bundle.vision.min_pixels == 3136 and r.bundle.vision.image_mean == [0.5, 0.5, 0.5]
    assert any("no preprocessor_config.json" in n for n in r.notes)


def test_a_processor_config_holding_the_image_processor_is_read(tmp_path):
    """transformers 5 may save the image processor inside processor_config.json
    (``image_processor``) with no preprocessor_config.json: init reads it there."""
    hf = save_tiny("Qwen2_5_VLForConditionalGeneration", tmp_path / "model")
    _qwen25(hf)
    pre = json.loads((hf / "preprocessor_config.json").read_text())
    (hf / "preprocessor_config.json").unlink()
    (hf / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor",
                                                          "image_processor": pre}))
    r = init_spec(hf, tmp_path / "spec.yaml")
    assert (r.bundle.vision.min_pixels, r.bundle.vision.max_pixels) == (28 * 28 * 9, 28 * 28 * 200)
    assert r.bundle.vision.image_mean == [0.4, 0.5, 0.6]
    assert any("processor_config.json" in n for n in r.notes)
