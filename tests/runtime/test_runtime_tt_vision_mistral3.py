"""Mistral 3 images on the TT platform through vLLM's engine, without hardware:
``tt_vision_engine_run.py`` runs the engine on the tiny Mistral 3 package built with
``--backend ttnn`` (N150), the recording double computing on its tensorbin weights in place of
ttnn. vLLM's own Mistral 3 processor prepares the images; the model runner hands each chunk's
images to the TT device path, which encodes them with the lowered vision programs (the host-made
Pixtral rope and image mask filled from the vision part's metadata) and merges them in the
prefill. The reference is transformers' Mistral3ForConditionalGeneration ``generate`` with HF's
chat template and PixtralProcessor (test_runtime_vision_mistral3.hf_greedy)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_MISTRAL3  # noqa: E402

from runtime_helpers import run_engine_script  # noqa: E402
from test_runtime_vision_mistral3 import IMAGE, hf_greedy, image, message  # noqa: E402

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
TOKENS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from ttbundle.serving.demo import build_package

    d = tmp_path_factory.mktemp("ttm3")
    pkg = build_package(TINY_MISTRAL3, d, "N150", backend="ttnn", warmup=False)
    cases = {"all": {"tt": {}, "max_tokens": TOKENS,
                     "messages": [message("ba be bi", image(1, 40, 72), image(2, 64, 32)),
                                  message("ko ku", image(0)), [{"role": "user", "content": "ka ke ki ko ku"}]]}}
    env = {k: v for k, v in os.environ.items() if k != "TTBUNDLE_EMULATED"}
    res = run_engine_script(HERE / "tt_vision_engine_run.py", pkg, cases, env)["all"]
    return res, SimpleNamespace(pkg=pkg, src=d / "src-tiny-mistral3")


def test_image_chats_on_the_tt_device_path_are_greedy_identical_to_transformers(run):
    res, where = run
    images = [[image(1, 40, 72), image(2, 64, 32)], [image(0)], []]
    texts = ["ba be bi", "ko ku", None]
    for ids, got, ims, text in zip(res["prompts"][:2], res["tokens"][:2], images, texts):
        want_ids, want = hf_greedy(where, text, ims, TOKENS)
        assert ids == want_ids and ids.count(IMAGE) > 0
        assert got == want
    assert res["prompts"][2].count(IMAGE) == 0 and len(res["tokens"][2]) == TOKENS


def test_images_replay_the_vision_traces_and_nothing_compiles_while_serving(run):
    res, _ = run
    vision = [k for k in res["replays"] if k[0] == "vision"]
    # two images (40x64 and 64x32 pixels: 160 + 128 patches) pad to bucket 512, one (10x14) to 256
    assert sorted(k[1] for k in vision) == [256, 512]
    assert all(k in res["traced"] for k in vision)
    assert res["compiled_serving"] == 0 and res["violations"] == []
