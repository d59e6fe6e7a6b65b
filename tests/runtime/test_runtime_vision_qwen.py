"""End to end with Qwen2.5-VL images: `ttbundle serve` (vLLM's own OpenAI server, real vLLM
0.33.0) on a tiny random Qwen2.5-VL package, driven by the official `openai` client with
`image_url` base64 data URLs. vLLM preprocesses the images with its own Qwen2.5-VL processor from
the files the package carries. The reference is transformers' Qwen2_5_VLForConditionalGeneration
`generate` on the checkpoint the package was built from, its prompt made by HF's own chat template
(the tokenizer's) and HF's image processor (the PIL one: no torchvision here), the image
placeholder expanded as HF's Qwen2.5-VL processor does (grid t*h*w / merge^2 tokens)."""

from __future__ import annotations

import asyncio
import base64
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import spec_helpers  # noqa: E402
from runtime_helpers import (prefill_starts, served_package, step_lines,  # noqa: E402
                             random_image as image, data_url, image_message as message)

TINY_QVL = getattr(spec_helpers, "TINY_QVL", None)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(TINY_QVL is None, reason="the Qwen2.5-VL family (spec_helpers.TINY_QVL) is not here")]
MESH = "N150"
IMAGE, START, END = 500, 502, 503  # TINY_QVL's image_token_id, vision_start / vision_end


@pytest.fixture(scope="module")
def server(packages_dir, tmp_path_factory):
    with served_package(TINY_QVL, packages_dir, MESH, tmp_path_factory.mktemp("serve-qvl")) as srv:
        yield srv


_HF: dict = {}


def _hf(server):
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if "m" not in _HF:
        _HF["m"] = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            str(server.src), dtype=torch.float32).eval()
        _HF["tok"] = transformers.AutoTokenizer.from_pretrained(str(server.pkg))
        _HF["img"] = Qwen2VLImageProcessorPil.from_pretrained(str(server.pkg))
    return _HF["m"], _HF["tok"], _HF["img"]


def hf_prompt(server, text: str, images: list):
    """HF's side of a chat: the tokenizer's chat template on the same message (image parts as HF
    writes them), the image processor's pixels and grids, each image's placeholder expanded to
    grid.prod() / merge^2 image tokens (what HF's Qwen2.5-VL processor does)."""
    _, tok, ip = _hf(server)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
    kw = {}
    if images:
        r = ip(images=images, return_tensors="pt")
        kw = {"pixel_values": r["pixel_values"], "image_grid_thw": r["image_grid_thw"]}
        parts = rendered.split("<|image_pad|>")
        assert len(parts) == len(images) + 1
        merge = ip.merge_size
        rendered = parts[0] + "".join("<|image_pad|>" * (int(g.prod()) // merge ** 2) + p
                                      for g, p in zip(r["image_grid_thw"], parts[1:]))
    return tok(rendered, add_special_tokens=False)["input_ids"], kw


def hf_greedy(server, text: str, images: list, n: int):
    import torch

    from ttbundle import reference
    m, _, _ = _hf(server)
    ids, kw = hf_prompt(server, text, images)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = m.generate(x, max_new_tokens=n, do_sample=False, mm_token_type_ids=(x == IMAGE).int(),
                         past_key_values=reference.kv_cache(m, "bf16"), **kw)
    return ids, out[0, len(ids):].tolist()


def chat(server, messages, n=8):
    return server.client().chat.completions.create(
        model=server.name, messages=messages, max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})


def test_image_chat_is_greedy_identical_to_transformers(server):
    ims = [image(1), image(2, 64, 32)]
    r = chat(server, message("ba be bi", *ims))
    ids, want = hf_greedy(server, "ba be bi", ims, 8)
    assert r.prompt_token_ids == ids  # vLLM's processor made HF's prompt
    assert ids.count(START) == 2 and ids.count(IMAGE) == (40 // 8) * (56 // 8) + (64 // 8) * (32 // 8)
    assert r.choices[0].token_ids == want


def test_text_only_chat_on_the_same_server_is_identical_to_transformers(server):
    r = chat(server, [{"role": "user", "content": "ka ke ki ko ku"}])
    ids, want = hf_greedy(server, "ka ke ki ko ku", [], 8)
    assert r.prompt_token_ids == ids and IMAGE not in ids
    assert r.choices[0].token_ids == want


SIZES = [(24, 24), (40, 56), (64, 32), (32, 64), (56, 40), (48, 48), (16, 64), (64, 64)]


def test_8_concurrent_image_requests_of_different_sizes_equal_transformers(server):
    c = openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=300, max_retries=0)
    texts = [f"ba {'be ' * i}" for i in range(8)]

    async def one(i):
        return await c.chat.completions.create(
            model=server.name, messages=message(texts[i], image(i, *SIZES[i])), max_tokens=4,
            temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))
    rs = asyncio.run(main())
    counts = {r.prompt_token_ids.count(IMAGE) for r in rs}
    assert len(counts) >= 5  # different grids, different token counts
    for i, r in enumerate(rs):
        ids, want = hf_greedy(server, texts[i], [image(i, *SIZES[i])], 4)
        assert r.prompt_token_ids == ids, i
        assert r.choices[0].token_ids == want, i


def test_too_many_images_video_or_audio_get_400_and_the_server_keeps_serving(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.name, messages=message("ba", image(1), image(2), image(3)),
                                  max_tokens=2)
    assert "image" in str(e.value) and "2" in str(e.value)
    video = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"\0" * 64).decode()}},
        {"type": "text", "text": "ba"}]}]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=server.name, messages=video, max_tokens=2)
    audio = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"\0" * 64).decode(), "format": "wav"}},
        {"type": "text", "text": "ba"}]}]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=server.name, messages=audio, max_tokens=2)
    r = chat(server, message("ba", image(4)), n=3)
    assert len(r.choices[0].token_ids) == 3


def test_prefix_caching_with_images_keys_on_the_images_and_keeps_positions(server):
    """A repeated prompt with the same images reuses its cached blocks (vLLM's block hashes
    include the images'), so the first image is not sent nor encoded again, yet the rest of the
    prompt keeps its M-RoPE positions (the tokens equal transformers'); the same text with
    another first image does not hit the cache."""
    text = "ba be bi bo bu da de di"
    a, b = [image(17, 64, 64), image(18)], [image(19, 64, 64), image(18)]  # images no other test sends
    n0 = len(step_lines(server))
    first = chat(server, message(text, *a))
    assert first.prompt_token_ids.index(START) < 32 < len(first.prompt_token_ids) - 32
    n1 = len(step_lines(server))
    again = chat(server, message(text, *a))
    n2 = len(step_lines(server))
    other = chat(server, message(text, *b))
    assert prefill_starts(server, n0)[:1] == [0]
    assert prefill_starts(server, n1)[0] > first.prompt_token_ids.index(END), \
        "the repeated prompt's first image came from the cache (vLLM sends its grid, not its pixels)"
    assert prefill_starts(server, n2)[0] < 32, "another image must not hit the first image's blocks"
    _, want = hf_greedy(server, text, a, 8)
    assert again.choices[0].token_ids == first.choices[0].token_ids == want
    assert other.choices[0].token_ids == hf_greedy(server, text, b, 8)[1]
