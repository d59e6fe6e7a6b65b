"""Qwen3-VL requests on the serving side, before any model runs: vLLM 0.33's own Qwen3-VL
processor through ttbundle's ``TTQwen3VLForConditionalGeneration`` registration (images only, no
torchvision: transformers' PIL image processor) and the runner's per-request state from the
``mm_features`` it makes. References: transformers' ``Qwen2VLImageProcessorPil`` (the processor
Qwen3-VL uses) and ``Qwen3VLModel.get_rope_index``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_Q3VL  # noqa: E402
from runtime_helpers import processor_model_dir, random_image, vllm_processor  # noqa: E402

IMAGE, START, END = 500, 502, 503  # TINY_Q3VL's image_token_id, vision_start / vision_end
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _bundle():
    from ttbundle import spec
    return spec.loads(TINY_Q3VL, "tiny-qwen3-vl.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return processor_model_dir(_bundle(), tmp_path_factory.mktemp("qwen3-vl"))


@pytest.fixture(scope="module")
def processor(model_dir):
    return vllm_processor(model_dir, "Qwen3VLForConditionalGeneration", {"image": 2, "video": 0})


def image(h, w, seed=0):
    return random_image(seed, h, w)


def test_vllms_processor_pixels_and_the_runners_positions_equal_transformers(processor, model_dir):
    from transformers import Qwen3VLModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.multimodal.processing import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    from ttbundle.runtime import images

    ims = [image(40, 56, 1), image(64, 32, 2)]
    ids = processor.info.ctx.tokenizer.encode(f"<|user|> ba {IMG} be bi {IMG} bo <|end|> <|assistant|>",
                                              add_special_tokens=False)
    out = processor.apply(ProcessorInputs(prompt=ids, mm_data_items=processor.info.parse_mm_data({"image": ims})),
                          TimingContext(enabled=False))
    ref = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))(images=ims, return_tensors="pt")
    got = torch.cat([x["pixel_values"].data for x in out["mm_kwargs"]["image"]])
    thw = torch.stack([x["image_grid_thw"].data for x in out["mm_kwargs"]["image"]])
    torch.testing.assert_close(got, ref["pixel_values"])
    assert torch.equal(thw, ref["image_grid_thw"]) and thw[0].tolist() != thw[1].tolist()
    ids = out["prompt_token_ids"]
    feats = [MultiModalFeatureSpec(data=item, modality="image", identifier=h, mm_position=pos)
             for item, h, pos in zip(out["mm_kwargs"]["image"], out["mm_hashes"]["image"],
                                     out["mm_placeholders"]["image"])]
    part = _bundle().family.vision_part(_bundle().arch)
    ri, pos = images.request_state(part, feats, ids)
    x = torch.tensor([ids])
    want, delta = Qwen3VLModel.from_pretrained(str(model_dir)).get_rope_index(x, (x == IMAGE).int(),
                                                                              image_grid_thw=thw)
    assert torch.equal(pos.rope, want[:, 0]) and pos.delta == int(delta) < 0
    assert ri.counts == [int(g.prod()) // 4 for g in thw] and ids.count(IMAGE) == sum(ri.counts)
