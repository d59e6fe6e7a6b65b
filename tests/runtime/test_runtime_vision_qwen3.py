"""End to end with Qwen3-VL images: `ttbundle serve` (vLLM's own OpenAI server, real vLLM 0.33.0)
on a tiny random Qwen3-VL package, driven by the official `openai` client with `image_url` base64
data URLs; vLLM preprocesses the images with its own Qwen3-VL processor (images only) from the
files the package carries. The reference is transformers' Qwen3VLForConditionalGeneration
`generate` on the checkpoint the package was built from, its prompt made by HF's own chat template
(the tokenizer's) and HF's image processor (the PIL one: no torchvision here), each image
placeholder expanded to grid t*h*w / merge^2 tokens as HF's Qwen3-VL processor does."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_Q3VL  # noqa: E402
from runtime_helpers import (assert_concurrent_image_chats, served_package,  # noqa: E402
                             random_image as image, data_url, image_message as message)

pytestmark = [pytest.mark.slow]
MESH = "N150"
IMAGE, START, END = 500, 502, 503  # TINY_Q3VL's image_token_id, vision_start / vision_end


@pytest.fixture(scope="module")
def server(packages_dir, tmp_path_factory):
    with served_package(TINY_Q3VL, packages_dir, MESH, tmp_path_factory.mktemp("serve-q3vl")) as srv:
        yield srv


_HF: dict = {}


def _hf(server):
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if "m" not in _HF:
        _HF["m"] = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
            str(server.src), dtype=torch.float32).eval()
        _HF["tok"] = transformers.AutoTokenizer.from_pretrained(str(server.pkg))
        _HF["img"] = Qwen2VLImageProcessorPil.from_pretrained(str(server.pkg))
    return _HF["m"], _HF["tok"], _HF["img"]


def hf_greedy(server, text: str, images: list, n: int):
    import torch

    from ttbundle import reference
    m, tok, ip = _hf(server)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
    kw = {}
    if images:
        r = ip(images=images, return_tensors="pt")
        kw = {"pixel_values": r["pixel_values"], "image_grid_thw": r["image_grid_thw"]}
        parts = rendered.split("<|image_pad|>")
        assert len(parts) == len(images) + 1
        rendered = parts[0] + "".join("<|image_pad|>" * (int(g.prod()) // ip.merge_size ** 2) + p
                                      for g, p in zip(r["image_grid_thw"], parts[1:]))
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = m.generate(x, max_new_tokens=n, do_sample=False, mm_token_type_ids=(x == IMAGE).int(),
                         past_key_values=reference.kv_cache(m, "bf16"), **kw)
    return ids, out[0, len(ids):].tolist()


def chat(server, messages, n=8):
    return server.client().chat.completions.create(
        model=server.name, messages=messages, max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})


def test_image_chat_with_two_images_of_different_sizes_is_greedy_identical_to_transformers(server):
    ims = [image(1), image(2, 64, 32)]
    r = chat(server, message("ba be bi", *ims))
    ids, want = hf_greedy(server, "ba be bi", ims, 8)
    assert r.prompt_token_ids == ids  # vLLM's processor made HF's prompt
    assert ids.count(START) == 2 and ids.count(IMAGE) == (40 // 8) * (56 // 8) + (64 // 8) * (32 // 8)
    assert r.choices[0].token_ids == want


def test_bad_image_input_is_a_4xx_and_the_server_keeps_serving(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError):  # three images, the limit is two
        c.chat.completions.create(model=server.name, messages=message("ba", image(1), image(2), image(3)),
                                  max_tokens=2)
    broken = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no png").decode()}},
        {"type": "text", "text": "ba"}]}]
    with pytest.raises(openai.BadRequestError):  # not an image
        c.chat.completions.create(model=server.name, messages=broken, max_tokens=2)
    r = chat(server, message("ba", image(4)), n=3)
    assert len(r.choices[0].token_ids) == 3
    ids, want = hf_greedy(server, "ba", [image(4)], 3)
    assert r.prompt_token_ids == ids and r.choices[0].token_ids == want


def test_8_concurrent_image_requests_of_different_sizes_equal_transformers(server):
    assert_concurrent_image_chats(server, image, message, hf_greedy, IMAGE)


def test_vllms_multimodal_warmup_ran_clean(server):
    """vLLM warmed its multimodal processor up at start (images only) without a failure logged."""
    log = server.log.read_text(errors="replace")
    assert "Multi-modal warmup completed" in log, log[-2000:]
    assert "warmup failed" not in log
