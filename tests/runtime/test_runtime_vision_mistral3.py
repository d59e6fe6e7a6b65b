"""End to end with Mistral 3 images: `ttbundle serve` (vLLM's own OpenAI server, real vLLM 0.33.0)
on a tiny random Mistral 3 package, driven by the official `openai` client with `image_url` base64
data URLs; vLLM preprocesses the images with its own Mistral 3 processor (HF-format checkpoint:
transformers' PixtralProcessor, the PIL image processor: no torchvision here) from the files the
package carries. The reference is transformers' Mistral3ForConditionalGeneration `generate` on the
checkpoint the package was built from, its prompt made by HF's own chat template (the tokenizer's)
and transformers' PixtralProcessor (each [IMG] becomes the image's rows of [IMG] tokens, each row
closed by [IMG_BREAK], the last by [IMG_END])."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_MISTRAL3  # noqa: E402
from runtime_helpers import (assert_concurrent_image_chats, served_package,  # noqa: E402
                             random_image as image, data_url, image_message as message)

pytestmark = [pytest.mark.slow]
MESH = "N150"
IMAGE, BREAK, END = 500, 501, 502  # TINY_MISTRAL3's image_token_index, image_break / image_end


@pytest.fixture(scope="module")
def server(packages_dir, tmp_path_factory):
    with served_package(TINY_MISTRAL3, packages_dir, MESH, tmp_path_factory.mktemp("serve-mistral3")) as srv:
        yield srv


_HF: dict = {}


def _hf(server):
    import torch
    import transformers

    from ttbundle.families.mistral3_vision import Mistral3VisionPart
    from ttbundle.runtime.registry import _pil_image_processors

    if "m" not in _HF:
        _pil_image_processors(Mistral3VisionPart)  # PixtralProcessor with the PIL image processor
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
        _HF["m"] = transformers.Mistral3ForConditionalGeneration.from_pretrained(
            str(server.src), dtype=torch.float32).eval()
        _HF["proc"] = PixtralProcessor.from_pretrained(str(server.pkg))
    return _HF["m"], _HF["proc"]


def hf_greedy(server, text: str, images: list, n: int):
    import torch

    from ttbundle import reference
    m, proc = _hf(server)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = proc.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
    r = proc(text=rendered, images=images or None, return_tensors="pt", add_special_tokens=False)
    kw = {"pixel_values": r["pixel_values"], "image_sizes": r["image_sizes"]} if images else {}
    x = r["input_ids"]
    with torch.no_grad():
        out = m.generate(x, max_new_tokens=n, do_sample=False, past_key_values=reference.kv_cache(m, "bf16"), **kw)
    return x[0].tolist(), out[0, x.shape[1]:].tolist()


def chat(server, messages, n=8):
    return server.client().chat.completions.create(
        model=server.name, messages=messages, max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})


def test_image_chat_with_two_images_of_different_sizes_is_greedy_identical_to_transformers(server):
    ims = [image(1, 40, 72), image(2, 64, 32)]
    r = chat(server, message("ba be bi", *ims))
    ids, want = hf_greedy(server, "ba be bi", ims, 8)
    assert r.prompt_token_ids == ids  # vLLM's processor made HF's prompt
    # 40x72 -> 40x64 pixels = 5 rows of 8 merge blocks; 64x32 = 8 rows of 4
    assert ids.count(END) == 2 and ids.count(IMAGE) == 5 * 8 + 8 * 4 and ids.count(BREAK) == 4 + 7
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
