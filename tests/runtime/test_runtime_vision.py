"""End to end with images: `ttbundle serve` (vLLM's own OpenAI server, real vLLM 0.33.0) on a tiny
Gemma 3 multimodal package, driven by the official `openai` client with `image_url` base64 data
URLs. vLLM preprocesses the images with its own Gemma 3 processor from the files the package
carries; the reference is transformers' Gemma3ForConditionalGeneration `generate` on the
checkpoint the package was built from, fed the prompt vLLM built and the pixels of the package's
HF image processor."""

from __future__ import annotations

import asyncio
import base64
import sys
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_VL  # noqa: E402

from runtime_helpers import (prefill_starts, served_package, step_lines,  # noqa: E402
                             data_url, image_message as message)

pytestmark = pytest.mark.slow
MESH = "N300"
SOFT, IMAGE, BOI, EOI = 16, 500, 501, 502  # TINY_VL's mm_tokens_per_image and image token ids


@pytest.fixture(scope="module")
def server(packages_dir, tmp_path_factory):
    with served_package(TINY_VL, packages_dir, MESH, tmp_path_factory.mktemp("serve-vl")) as srv:
        yield srv


def image(seed: int):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((48 + 4 * seed, 80, 3)) * 255).astype("uint8"))


def hf_greedy(server, ids: list[int], images: list, n: int) -> list[int]:
    """transformers generate on the checkpoint (bf16 KV cache as the package's), the pixels from
    the package's own HF image processor, image tokens marked as HF's processor marks them."""
    import torch
    import transformers

    from ttbundle import reference
    m = _hf(str(server.src))
    kw = {}
    if images:
        proc = transformers.AutoProcessor.from_pretrained(str(server.pkg))
        kw["pixel_values"] = proc.image_processor(images=images, return_tensors="pt")["pixel_values"]
        kw["token_type_ids"] = (torch.tensor([ids]) == IMAGE).long()
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         past_key_values=reference.kv_cache(m, "bf16"), **kw)
    return out[0, len(ids):].tolist()


_MODELS: dict = {}


def _hf(src: str):
    import torch
    import transformers
    if src not in _MODELS:
        _MODELS[src] = transformers.AutoModelForImageTextToText.from_pretrained(
            src, dtype=torch.float32, attn_implementation="eager").eval()
    return _MODELS[src]


def chat(server, messages, n=8):
    return server.client().chat.completions.create(
        model=server.name, messages=messages, max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})


def test_image_chat_is_greedy_identical_to_transformers(server):
    ims = [image(1), image(2)]
    r = chat(server, message("ba be bi", *ims))
    ids = r.prompt_token_ids
    # each image became begin-of-image, 16 soft tokens, end-of-image (vLLM's processor)
    assert ids.count(IMAGE) == 2 * SOFT and ids.count(BOI) == 2 and ids.count(EOI) == 2
    first = ids.index(BOI)
    assert ids[first:first + SOFT + 2] == [BOI] + [IMAGE] * SOFT + [EOI]
    assert r.choices[0].token_ids == hf_greedy(server, ids, ims, 8)


def test_text_only_chat_on_the_same_server_is_identical_to_transformers(server):
    r = chat(server, [{"role": "user", "content": "ka ke ki ko ku"}])
    assert IMAGE not in r.prompt_token_ids
    assert r.choices[0].token_ids == hf_greedy(server, r.prompt_token_ids, [], 8)


def test_8_concurrent_image_requests_complete(server):
    c = openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=300, max_retries=0)

    async def one(i):
        return await c.chat.completions.create(
            model=server.name, messages=message(f"ba {'be ' * i}", image(i % 3)), max_tokens=4,
            temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))
    rs = asyncio.run(main())
    assert all(len(r.choices[0].token_ids) == 4 for r in rs)
    # batching does not change a request's tokens: two of them against transformers
    for i in (0, 5):
        assert rs[i].choices[0].token_ids == hf_greedy(server, rs[i].prompt_token_ids, [image(i % 3)], 4)


def test_too_many_images_or_audio_get_400_and_the_server_keeps_serving(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.name, messages=message("ba", image(1), image(2), image(3)),
                                  max_tokens=2)
    assert "image" in str(e.value) and "2" in str(e.value)
    audio = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"\0" * 64).decode(), "format": "wav"}},
        {"type": "text", "text": "ba"}]}]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=server.name, messages=audio, max_tokens=2)
    r = chat(server, message("ba", image(4)), n=3)
    assert len(r.choices[0].token_ids) == 3


def test_prefix_caching_with_images_keys_on_the_images(server):
    """A repeated prompt with the same images reuses its cached blocks (vLLM's block hashes
    include the images'); the same text with another image does not, and still equals
    transformers for its own image."""
    text = "ba be bi bo bu da de di"
    a, b = [image(7), image(8)], [image(7), image(9)]
    n0 = len(step_lines(server))
    first = chat(server, message(text, *a))
    assert len(first.prompt_token_ids) > 32  # the first 32-token block holds image tokens
    n1 = len(step_lines(server))
    again = chat(server, message(text, *a))
    n2 = len(step_lines(server))
    other = chat(server, message(text, *b))
    assert prefill_starts(server, n0)[:1] == [0]
    assert prefill_starts(server, n1)[0] >= 32, "the repeated prompt's first block came from the cache"
    assert prefill_starts(server, n2)[0] < 32, "another image must not hit the first image's blocks"
    assert again.choices[0].token_ids == first.choices[0].token_ids == hf_greedy(server, first.prompt_token_ids, a, 8)
    assert other.choices[0].token_ids == hf_greedy(server, other.prompt_token_ids, b, 8)
