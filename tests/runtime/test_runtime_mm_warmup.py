"""vLLM's multimodal warm-up (``BaseRenderer._warmup_mm_processor``, run at server start: its
processor's dummy inputs for one item of each modality allowed) runs clean through ttbundle's
registration for every vision family. Qwen3-VL's own dummy-inputs builder also made a dummy video
from the video processor, which the images-only processor has not: vLLM logged "Multi-modal warmup
failed" ('NoneType' object has no attribute 'size'). The dummy image is the processor's largest
(vLLM's ``get_image_size_with_most_features``), so the warm-up preprocesses the biggest image the
package serves."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_MISTRAL3, TINY_Q3VL, TINY_QVL, TINY_VL  # noqa: E402
from runtime_helpers import processor_model_dir, vllm_processor  # noqa: E402

CASES = {"gemma3": (TINY_VL, "Gemma3ForConditionalGeneration"),
         "qwen2_5_vl": (TINY_QVL, "Qwen2_5_VLForConditionalGeneration"),
         "qwen3_vl": (TINY_Q3VL, "Qwen3VLForConditionalGeneration"),
         "mistral3": (TINY_MISTRAL3, "Mistral3ForConditionalGeneration")}


@pytest.mark.parametrize("family", sorted(CASES))
def test_vllms_multimodal_warmup_runs_clean(family, tmp_path):
    from vllm.renderers.base import BaseRenderer

    from ttbundle import spec

    text, arch = CASES[family]
    bundle = spec.loads(text, "spec.yaml")
    processor = vllm_processor(processor_model_dir(bundle, tmp_path), arch, {"image": 2})
    assert {k for k, v in processor.info.allowed_mm_limits.items() if v > 0} == {"image"}
    # vLLM's own warm-up step (the renderer's ``warmup_mm`` catches what it raises and logs
    # "Multi-modal warmup failed"; called directly, it raises)
    renderer = SimpleNamespace(config=SimpleNamespace(scheduler_config=None))
    BaseRenderer._warmup_mm_processor(renderer, processor, None, log_prefix="Multi-modal")
    out = processor.get_dummy_mm_inputs({"image": 1}, cache=None, scheduler_config=None)
    assert set(out["mm_kwargs"]) == {"image"} and len(out["mm_kwargs"]["image"]) == 1
    assert len(out["prompt_token_ids"]) > 1


# ---- a package whose largest vision bucket caps a prompt's images ---------------------------------
#: the tiny Qwen3-VL with images of up to 16384 pixels (256 merge blocks = 1024 patches) in a
#: bucket of 512 patches: a cap, below the processor's largest image
CAPPED = TINY_Q3VL.split("vision: {")[0].replace("prefill: [64, 128]", "prefill: [64, 512]").replace(
    "prefill_chunk: 128", "prefill_chunk: 512") + "vision: {images_per_prompt: 2, min_pixels: 256, " \
    "max_pixels: 16384, buckets: [256, 512]}\n"


def _capped_processor(tmp_path):
    from ttbundle import spec
    from ttbundle.package.templates import render_bundle_yaml, resolved_spec
    from ttbundle.plan.make import make_plan

    bundle = spec.loads(CAPPED, "spec.yaml")
    assert any("a cap" in d.message for d in bundle.warnings)
    d = processor_model_dir(bundle, tmp_path)
    (d / "bundle.yaml").write_text(render_bundle_yaml(resolved_spec(bundle, make_plan(bundle, "N150")), "test"))
    return bundle, vllm_processor(d, "Qwen3VLForConditionalGeneration", {"image": 2})


def test_images_past_the_largest_vision_bucket_are_a_400_naming_the_limit(tmp_path):
    from vllm.exceptions import VLLMValidationError
    from vllm.multimodal.processing import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from runtime_helpers import random_image

    bundle, proc = _capped_processor(tmp_path)
    img = "<|vision_start|><|image_pad|><|vision_end|>"
    ids = proc.info.ctx.tokenizer.encode(f"<|user|> ba {img} {img} bo <|end|>", add_special_tokens=False)

    def apply(ims):
        return proc.apply(ProcessorInputs(prompt=ids[:], mm_data_items=proc.info.parse_mm_data({"image": ims})),
                          TimingContext(enabled=False))

    small = [random_image(1, 40, 56), random_image(2, 64, 32)]  # 35 + 32 merge blocks: within the cap
    out = apply(small)
    ref = Qwen2VLImageProcessorPil(**{k: v for k, v in vision_pre(bundle).items()})(images=small, return_tensors="pt")
    assert out["prompt_token_ids"].count(500) == int(ref["image_grid_thw"].prod(dim=1).sum()) // 4
    big = [random_image(3, 120, 120), random_image(4, 40, 56)]  # 120x120 -> 15 x 15 blocks = 900 patches
    with pytest.raises(VLLMValidationError) as e:
        apply(big)
    assert "need 1040 patches (225 + 35 soft tokens x 4)" in str(e.value)
    assert "at most 512 patches per prompt" in str(e.value)
    # vLLM's budget of one image is the cap's, and its warm-up's dummy image lies within it
    assert proc.info.get_mm_max_tokens_per_item(512, {"image": 1})["image"] <= 512 // 4 + 2
    from vllm.renderers.base import BaseRenderer
    BaseRenderer._warmup_mm_processor(SimpleNamespace(config=SimpleNamespace(scheduler_config=None)), proc, None,
                                      log_prefix="Multi-modal")


def vision_pre(bundle) -> dict:
    """The package's image processor settings as transformers' class takes them."""
    from ttbundle import vision
    pre = vision.preprocessor_config(bundle)
    keep = ("do_convert_rgb", "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize",
            "image_mean", "image_std", "size", "patch_size", "temporal_patch_size", "merge_size")
    return {k: pre[k] for k in keep}


def test_mistral3_counts_an_images_patches_not_its_row_breaks(tmp_path):
    """Mistral 3's placeholder holds the [IMG] tokens and a break per row: the cap counts the [IMG]s
    (soft tokens x 4 patches). Images of up to 64 pixels (8 x 8 merge blocks, 256 patches) in a
    bucket of 256: one 64x64 image is exactly the cap (64 [IMG] + 8 breaks), two are a 400."""
    from vllm.exceptions import VLLMValidationError
    from vllm.multimodal.processing import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    from ttbundle import spec
    from ttbundle.package.templates import render_bundle_yaml, resolved_spec
    from ttbundle.plan.make import make_plan
    from runtime_helpers import random_image

    bundle = spec.loads(TINY_MISTRAL3.replace("buckets: [256, 512]", "buckets: [256]"), "spec.yaml")
    d = processor_model_dir(bundle, tmp_path)
    (d / "bundle.yaml").write_text(render_bundle_yaml(resolved_spec(bundle, make_plan(bundle, "N150")), "test"))
    proc = vllm_processor(d, "Mistral3ForConditionalGeneration", {"image": 2})
    tok = proc.info.ctx.tokenizer

    def apply(n):
        ids = tok.encode("<|user|> ba " + "[IMG] " * n + "bo <|end|>", add_special_tokens=False)
        ims = [random_image(i, 64, 64) for i in range(n)]
        return proc.apply(ProcessorInputs(prompt=ids, mm_data_items=proc.info.parse_mm_data({"image": ims})),
                          TimingContext(enabled=False))

    out = apply(1)
    assert out["prompt_token_ids"].count(500) == 64 and out["prompt_token_ids"].count(501) == 7
    with pytest.raises(VLLMValidationError, match="need 512 patches .64 . 64 soft tokens x 4.; the package encodes "
                                                  "at most 256 patches"):
        apply(2)
