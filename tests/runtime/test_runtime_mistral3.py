"""Mistral 3 requests on the serving side, before any model runs: vLLM 0.33's own Mistral 3
processor (``Mistral3MultiModalProcessor``, HF-format checkpoints: transformers' PixtralProcessor
with the PIL image processor, no torchvision) through ttbundle's
``TTMistral3ForConditionalGeneration`` registration, and the runner's per-request state from the
``mm_features`` it makes. References: transformers' ``PixtralImageProcessorPil`` and
``PixtralProcessor``'s token rule (rows of ``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]`` last)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_MISTRAL3  # noqa: E402
from runtime_helpers import processor_model_dir, random_image, vllm_processor  # noqa: E402

IMAGE, BREAK, END = 500, 501, 502  # TINY_MISTRAL3's image_token_index, image_break / image_end


def _bundle():
    from ttbundle import spec
    return spec.loads(TINY_MISTRAL3, "tiny-mistral3.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return processor_model_dir(_bundle(), tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="module")
def processor(model_dir):
    return vllm_processor(model_dir, "Mistral3ForConditionalGeneration", {"image": 2})


def image(h, w, seed=0):
    return random_image(seed, h, w)


def test_vllms_processor_pixels_and_the_runners_image_tokens_equal_transformers(processor, model_dir):
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.multimodal.processing import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    from ttbundle.runtime import images

    ims = [image(40, 72, 1), image(48, 56, 2)]
    ids = processor.info.ctx.tokenizer.encode("<|user|> ba [IMG] be bi [IMG] bo <|end|> <|assistant|>",
                                              add_special_tokens=False)
    out = processor.apply(ProcessorInputs(prompt=ids, mm_data_items=processor.info.parse_mm_data({"image": ims})),
                          TimingContext(enabled=False))
    ref = PixtralImageProcessorPil.from_pretrained(str(model_dir))(
        images=ims, patch_size={"height": 8, "width": 8}, return_tensors="pt")
    got = [x["pixel_values"].data for x in out["mm_kwargs"]["image"]]
    for k, (h, w) in enumerate(ref["image_sizes"].tolist()):  # vLLM keeps each image unpadded
        torch.testing.assert_close(got[k], ref["pixel_values"][k, :, :h, :w])
    ids = out["prompt_token_ids"]
    # PixtralProcessor's rule: 40x72 -> 40x64 pixels = 5 rows of 8 merge blocks; 48x56 = 6 rows of 7
    want = []
    for rows, cols in ((5, 8), (6, 7)):
        t = ([IMAGE] * cols + [BREAK]) * rows
        t[-1] = END
        want.append(t)
    tok = processor.info.ctx.tokenizer
    assert ids == tok.encode("<|user|> ba", add_special_tokens=False) + want[0] + \
        tok.encode("be bi", add_special_tokens=False) + want[1] + \
        tok.encode("bo <|end|> <|assistant|>", add_special_tokens=False)
    feats = [MultiModalFeatureSpec(data=item, modality="image", identifier=h, mm_position=pos)
             for item, h, pos in zip(out["mm_kwargs"]["image"], out["mm_hashes"]["image"],
                                     out["mm_placeholders"]["image"])]
    part = _bundle().family.vision_part(_bundle().arch)
    ri, pos = images.request_state(part, feats, ids)
    assert pos.plain and ri.counts == [40, 42]
    assert [ids[p] for p in ri.positions] == [IMAGE] * 82
    # the runner's patches are the images' pixels, patch by patch (HF's padded layout rebuilt)
    from ttbundle.families import mistral3_vision as mv
    inputs = part.feature_inputs(feats)
    px, sizes = mv.to_images(part.v, inputs["pixel_values"], inputs["image_grid_thw"])
    assert sizes.tolist() == ref["image_sizes"].tolist()
    torch.testing.assert_close(px, ref["pixel_values"])
