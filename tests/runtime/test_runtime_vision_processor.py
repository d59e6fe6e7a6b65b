"""Served images as the model's own processor sees them (issue 39), live: `ttbundle serve` (vLLM's
OpenAI server) on a tiny random Qwen3-VL package whose image settings are not the package defaults
(at least 4096 pixels, so a 32x32 image is enlarged; up to 65536, a budget a prompt's vision bucket
of 1024 patches caps), through the official `openai` client. The reference is transformers'
`Qwen3VLForConditionalGeneration.generate` on the checkpoint with the model's processor made here
from the same settings by transformers' own `Qwen2VLImageProcessorPil` (not read from the package):
small, odd-shaped and two-image chats give HF's prompt ids and greedy tokens; an image past the cap
is a 400 naming the limit, after which the server still answers; vLLM's warm-up logged no failure.
The same for a tiny Mistral 3 whose longest edge (48 pixels) is below its encoder's image size and
whose normalisation is its own, against a PixtralProcessor made here (32x32, 17x250 and 500x640
images; two images past the cap a 400)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_Q3VL  # noqa: E402
from runtime_helpers import served_package, random_image, image_message as message  # noqa: E402

pytestmark = [pytest.mark.slow]
MESH = "N150"
IMAGE = 500  # TINY_Q3VL's image_token_id
MIN_PIXELS, MAX_PIXELS = 4096, 65536
SPEC = TINY_Q3VL.replace("name: tiny-qwen3-vl", "name: tiny-qwen3-vl-proc").split("vision: {")[0].replace(
    "prefill: [64, 128]", "prefill: [64, 512]").replace("prefill_chunk: 128", "prefill_chunk: 512").replace(
    "max_model_len: 512", "max_model_len: 1024") + \
    f"vision: {{images_per_prompt: 2, min_pixels: {MIN_PIXELS}, max_pixels: {MAX_PIXELS}, buckets: [512, 1024]}}\n"


@pytest.fixture(scope="module")
def server(packages_dir, tmp_path_factory):
    with served_package(SPEC, packages_dir, MESH, tmp_path_factory.mktemp("serve-q3vl-proc")) as srv:
        yield srv


_HF: dict = {}


def hf_greedy(server, text: str, images: list, n: int):
    """(prompt ids, greedy tokens) of transformers with the model's processor (made here)."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ttbundle import reference
    if "m" not in _HF:
        _HF["m"] = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
            str(server.src), dtype=torch.float32).eval()
        _HF["tok"] = transformers.AutoTokenizer.from_pretrained(str(server.src))
        _HF["img"] = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                              patch_size=4, merge_size=2, temporal_patch_size=2,
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    m, tok, ip = _HF["m"], _HF["tok"], _HF["img"]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
    r = ip(images=images, return_tensors="pt")
    parts = rendered.split("<|image_pad|>")
    rendered = parts[0] + "".join("<|image_pad|>" * (int(g.prod()) // 4) + p
                                  for g, p in zip(r["image_grid_thw"], parts[1:]))
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = m.generate(x, max_new_tokens=n, do_sample=False, mm_token_type_ids=(x == IMAGE).int(),
                         past_key_values=reference.kv_cache(m, "bf16"), pixel_values=r["pixel_values"],
                         image_grid_thw=r["image_grid_thw"])
    return ids, out[0, len(ids):].tolist(), [int(g.prod()) // 4 for g in r["image_grid_thw"]]


def chat(server, messages, n=6):
    return server.client().chat.completions.create(
        model=server.name, messages=messages, max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.mark.parametrize("sizes", [[(32, 32)], [(60, 90)], [(17, 250), (40, 56)]],
                         ids=["32x32", "60x90", "odd-aspect-and-small"])
def test_served_images_have_the_models_tokens_and_greedy_tokens(server, sizes):
    ims = [random_image(i + 7, h, w) for i, (h, w) in enumerate(sizes)]
    r = chat(server, message("ba be", *ims))
    ids, want, counts = hf_greedy(server, "ba be", ims, 6)
    assert r.prompt_token_ids == ids and ids.count(IMAGE) == sum(counts)
    assert min(counts) >= MIN_PIXELS // 64  # a small image is enlarged as the model's processor does
    assert r.choices[0].token_ids == want


def test_an_image_past_the_cap_is_a_400_naming_it_and_the_server_keeps_serving(server):
    big = random_image(3, 300, 420)  # 126000 pixels -> about 65536: ~1000 merge blocks, past 1024 patches
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, message("ba", big))
    assert "at most 1024 patches per prompt" in str(e.value)
    im = random_image(4, 64, 64)
    r = chat(server, message("ba", im), n=3)
    ids, want, _ = hf_greedy(server, "ba", [im], 3)
    assert r.prompt_token_ids == ids and r.choices[0].token_ids == want


def test_vllms_multimodal_warmup_ran_clean(server):
    log = server.log.read_text(errors="replace")
    assert "Multi-modal warmup completed" in log, log[-2000:]
    assert "warmup failed" not in log


# ---- Mistral 3: a longest edge below the encoder's image_size, its own normalisation ----------------
from spec_helpers import TINY_MISTRAL3  # noqa: E402

M_IMAGE = 500  # TINY_MISTRAL3's image_token_index
M_EDGE, M_MEAN, M_STD = 48, [0.3, 0.4, 0.5], [0.2, 0.25, 0.3]
M_SPEC = TINY_MISTRAL3.replace("name: tiny-mistral3", "name: tiny-mistral3-proc").replace(
    "vision: {images_per_prompt: 2, longest_edge: 64, buckets: [256, 512]}",
    f"vision: {{images_per_prompt: 2, longest_edge: {M_EDGE}, image_mean: {M_MEAN}, image_std: {M_STD}, "
    "buckets: [64, 144]}")  # 48 px = 6 merge blocks a side = 144 patches: two such images are past the cap


@pytest.fixture(scope="module")
def mserver(packages_dir, tmp_path_factory):
    with served_package(M_SPEC, packages_dir, MESH, tmp_path_factory.mktemp("serve-mistral3-proc")) as srv:
        yield srv


def m_hf_greedy(server, text: str, images: list, n: int):
    """(prompt ids, greedy tokens) of transformers' Mistral 3 with a PixtralProcessor made here from
    the model's settings (transformers' classes; the tokenizer the package carries)."""
    import torch
    import transformers

    from ttbundle import reference
    from ttbundle.families.mistral3_vision import Mistral3VisionPart
    from ttbundle.runtime.registry import _pil_image_processors

    if "mm" not in _HF:
        _pil_image_processors(Mistral3VisionPart)  # no torchvision here: the PIL image processor
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
        _HF["mm"] = transformers.Mistral3ForConditionalGeneration.from_pretrained(
            str(server.src), dtype=torch.float32).eval()
        ip = transformers.PixtralImageProcessorPil(size={"longest_edge": M_EDGE}, image_mean=M_MEAN, image_std=M_STD)
        _HF["mproc"] = PixtralProcessor(image_processor=ip, tokenizer=transformers.AutoTokenizer.from_pretrained(
            str(server.pkg)), patch_size=4, spatial_merge_size=2, image_token="[IMG]",
            image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]")
    m, proc = _HF["mm"], _HF["mproc"]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = proc.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
    r = proc(text=rendered, images=images, return_tensors="pt", add_special_tokens=False)
    x = r["input_ids"]
    with torch.no_grad():
        out = m.generate(x, max_new_tokens=n, do_sample=False, past_key_values=reference.kv_cache(m, "bf16"),
                         pixel_values=r["pixel_values"], image_sizes=r["image_sizes"])
    return x[0].tolist(), out[0, x.shape[1]:].tolist()


@pytest.mark.parametrize("sizes", [[(32, 32)], [(17, 250)], [(500, 640)]], ids=["32x32", "17x250", "500x640"])
def test_mistral3_served_images_have_the_models_tokens_and_greedy_tokens(mserver, sizes):
    ims = [random_image(i + 11, h, w) for i, (h, w) in enumerate(sizes)]
    r = chat(mserver, message("ba be", *ims))
    ids, want = m_hf_greedy(mserver, "ba be", ims, 6)
    assert r.prompt_token_ids == ids and ids.count(M_IMAGE) > 0
    assert r.choices[0].token_ids == want


def test_mistral3_images_past_the_cap_are_a_400_and_the_server_keeps_serving(mserver):
    with pytest.raises(openai.BadRequestError) as e:  # two images of 6 x 6 merge blocks: 288 patches
        chat(mserver, message("ba", random_image(1, 48, 48), random_image(2, 300, 300)))
    assert "at most 144 patches per prompt" in str(e.value)
    im = random_image(5, 40, 30)
    r = chat(mserver, message("ba", im), n=3)
    ids, want = m_hf_greedy(mserver, "ba", [im], 3)
    assert r.prompt_token_ids == ids and r.choices[0].token_ids == want
    log = mserver.log.read_text(errors="replace")
    assert "Multi-modal warmup completed" in log and "warmup failed" not in log
