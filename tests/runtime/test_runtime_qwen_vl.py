"""Qwen2.5-VL requests on the serving side, before any model runs: vLLM 0.33's own Qwen2.5-VL
processor through ttbundle's ``TTQwen2_5_VLForConditionalGeneration`` registration (no torchvision
here: transformers' PIL image processor), and the runner's per-request state from the
``mm_features`` it makes (image tokens, M-RoPE positions and rope delta, soft tokens per chunk,
an image covered by the prefix cache). References: transformers' ``Qwen2VLImageProcessorPil``
and ``Qwen2_5_VLModel.get_rope_index``, vLLM's ``strip_covered_mm_data``, arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_QVL  # noqa: E402
from runtime_helpers import processor_model_dir, random_image, vllm_processor  # noqa: E402

IMAGE, START, END = 500, 502, 503  # TINY_QVL's image_token_id, vision_start / vision_end


def _bundle():
    from ttbundle import spec
    return spec.loads(TINY_QVL, "tiny-qwen25-vl.yaml")


def request_state(features, prompt, vision_cfg):
    """(images, M-RoPE positions [3, L], rope delta) of a new request: the runner's per-request
    state from the family's vision part."""
    from ttbundle.families.qwen2_5_vl_vision import Qwen25VisionPart
    from ttbundle.runtime import images

    ri, pos = images.request_state(Qwen25VisionPart(vision_cfg), features, prompt)
    return ri, pos.rope, pos.delta


@pytest.fixture(scope="module")
def vision_cfg():
    return _bundle().arch.vision


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return processor_model_dir(_bundle(), tmp_path_factory.mktemp("qwen-vl"))


@pytest.fixture(scope="module")
def processor(model_dir):
    return vllm_processor(model_dir, "Qwen2_5_VLForConditionalGeneration", {"image": 2, "video": 0})


def image(h, w, seed=0):
    return random_image(seed, h, w)


IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def apply(processor, text: str, images):
    from vllm.multimodal.processing import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    ids = processor.info.ctx.tokenizer.encode(text, add_special_tokens=False)
    return processor.apply(ProcessorInputs(prompt=ids, mm_data_items=processor.info.parse_mm_data({"image": images})),
                           TimingContext(enabled=False))


def features(out):
    """vLLM's ``MultiModalFeatureSpec`` per image, as the scheduler hands them to a runner."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    return [MultiModalFeatureSpec(data=item, modality="image", identifier=h, mm_position=pos)
            for item, h, pos in zip(out["mm_kwargs"]["image"], out["mm_hashes"]["image"],
                                    out["mm_placeholders"]["image"])]


_HF: dict = {}


def hf_rope_index(model_dir, ids, thw):
    from transformers import Qwen2_5_VLModel
    if "m" not in _HF:
        _HF["m"] = Qwen2_5_VLModel.from_pretrained(str(model_dir))
    x = torch.tensor([ids])
    return _HF["m"].get_rope_index(x, (x == IMAGE).int(), image_grid_thw=thw)


def test_vllms_processor_runs_without_torchvision_and_matches_hfs_image_processor(processor, model_dir):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ims = [image(40, 56, 1), image(64, 32, 2)]
    out = apply(processor, f"<|user|> {IMG} ba {IMG} be <|end|>", ims)
    ref = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    ids = out["prompt_token_ids"]
    for i, (im, item, pos) in enumerate(zip(ims, out["mm_kwargs"]["image"], out["mm_placeholders"]["image"])):
        r = ref(images=[im], return_tensors="pt")
        assert torch.equal(item["image_grid_thw"].data, r["image_grid_thw"][0])
        torch.testing.assert_close(item["pixel_values"].data, r["pixel_values"], rtol=0, atol=1e-6)
        n = int(r["image_grid_thw"][0].prod()) // 4  # one token per 2x2 merged patches
        assert ids[pos.offset:pos.offset + pos.length] == [IMAGE] * n, i
        assert ids[pos.offset - 1] == START and ids[pos.offset + n] == END
    g = [tuple(x["image_grid_thw"].data.tolist()) for x in out["mm_kwargs"]["image"]]
    assert g[0] != g[1]  # images of different sizes: different grids


def test_request_state_positions_equal_transformers_and_chunks_get_their_soft_tokens(processor, model_dir, vision_cfg):
    from ttbundle.families import vision_part
    from ttbundle.runtime.images import chunk_inputs

    ims = [image(40, 56, 1), image(64, 32, 2)]
    out = apply(processor, f"<|user|> ba {IMG} be bi {IMG} bo <|end|> <|assistant|>", ims)
    ids, feats = out["prompt_token_ids"], features(out)
    ri, rope, delta = request_state(feats, ids, vision_cfg)
    thw = torch.stack([f.data["image_grid_thw"].data for f in feats])
    ref, ref_delta = hf_rope_index(model_dir, ids, thw)
    assert torch.equal(rope, ref[:, 0]) and delta == int(ref_delta) and delta < 0
    # soft tokens: a fake vision program numbering its output rows; a chunk split between images
    calls = []

    def encode(px, image_grid_thw):
        calls.append(image_grid_thw.tolist())
        n = int(image_grid_thw.prod(dim=1).sum()) // 4
        assert px.shape[0] == 4 * n
        return torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 8) + 1000 * len(calls)

    split = feats[1].mm_position.offset - 1  # the first chunk ends before the second image
    a = chunk_inputs(ri, encode, 0, split, 64)
    b = chunk_inputs(ri, encode, split, len(ids) - split, 64)
    assert calls == [[thw[0].tolist()], [thw[1].tolist()]]  # each image encoded once, when reached
    n0, n1 = (int(g.prod()) // 4 for g in thw)
    assert a["mask"].nonzero().flatten().tolist() == list(range(feats[0].mm_position.offset, feats[0].mm_position.offset + n0))
    assert a["embeds"][:, 0].tolist() == [1000 + k for k in range(n0)]
    assert b["embeds"][:, 0].tolist() == [2000 + k for k in range(n1)]
    assert (a["blocks"] == -1).all()  # causal image tokens (no bidirectional blocks)
    # the chunk's rope positions, then decode at cache position p: p + delta on all axes
    r = vision_part.chunk_rope(rope, delta, split, len(ids) - split, 64)
    assert torch.equal(r[:, 0, :len(ids) - split], ref[:, 0, split:]) and (r[:, 0, len(ids) - split:] == 0).all()
    d = vision_part.decode_rope(torch.tensor([len(ids), len(ids) + 3, -1]), torch.tensor([delta, delta, 0]))
    assert d.shape == (3, 3, 1) and d[:, :, 0].tolist() == [[len(ids) + delta, len(ids) + 3 + delta, 0]] * 3
    assert len(ids) + delta == int(ref[:, 0].max()) + 1  # the next position after the prompt's last
    # a resumed request re-prefills its prompt's end and its output tokens: those at p + delta
    L = len(ids)
    r = vision_part.chunk_rope(rope, delta, L - 2, 4, 8)
    assert torch.equal(r[:, 0, :2], ref[:, 0, L - 2:])
    assert r[:, 0, 2:4].tolist() == [[L + delta, L + 1 + delta]] * 3


def test_an_image_covered_by_the_prefix_cache_is_not_encoded_yet_positions_stay_right(processor, model_dir, vision_cfg):
    """vLLM strips a covered image's pixels but keeps its grid for M-RoPE models
    (``strip_covered_mm_data(uses_mrope=True)``); the chunk after the cached prefix gets the
    second image's soft tokens and the prompt's true positions."""
    from vllm.multimodal.utils import strip_covered_mm_data

    from ttbundle.families import vision_part
    from ttbundle.runtime.images import chunk_inputs

    ims = [image(40, 56, 1), image(64, 32, 2)]
    out = apply(processor, f"<|user|> {IMG} ba be {IMG} bi <|end|>", ims)
    ids, feats = out["prompt_token_ids"], features(out)
    cached = feats[1].mm_position.offset - 1
    stripped = strip_covered_mm_data(feats, cached, uses_mrope=True)
    assert "pixel_values" not in stripped[0].data.keys()
    ri, rope, delta = request_state(stripped, ids, vision_cfg)
    thw = torch.stack([f.data["image_grid_thw"].data for f in feats])
    ref, ref_delta = hf_rope_index(model_dir, ids, thw)
    assert torch.equal(rope, ref[:, 0]) and delta == int(ref_delta)
    seen = []
    mm = chunk_inputs(ri, lambda px, image_grid_thw: seen.append(image_grid_thw.tolist()) or
                      torch.ones(int(image_grid_thw.prod()) // 4, 8), cached, len(ids) - cached, 64)
    assert seen == [[thw[1].tolist()]]
    assert mm["mask"].sum() == int(thw[1].prod()) // 4
    with pytest.raises(RuntimeError, match="no pixel data"):  # the covered one cannot be encoded
        chunk_inputs(ri, lambda *a, **k: None, 0, cached, 64)


def test_request_state_refuses_a_placeholder_that_does_not_match_the_grid(processor, vision_cfg):

    out = apply(processor, f"<|user|> {IMG} ba <|end|>", [image(40, 56, 1)])
    ids, feats = list(out["prompt_token_ids"]), features(out)
    pos = feats[0].mm_position
    ids[pos.offset + 3] = 7  # one placeholder token is text now
    with pytest.raises(ValueError, match="image 0"):
        request_state(feats, ids, vision_cfg)
