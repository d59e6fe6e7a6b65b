"""Images on the TT platform through vLLM's engine, without hardware: ``tt_vision_engine_run.py``
runs the engine on the tiny Gemma 3 multimodal package built with ``--backend ttnn`` (N300), the
recording double computing on its tensorbin weights in place of ttnn. vLLM's own Gemma 3
processor prepares the images (base64 data URLs in chat messages); the model runner hands each
chunk's images to the TT device path, which encodes them with the lowered vision programs and
merges them in the prefill. The reference is transformers' Gemma3ForConditionalGeneration
``generate`` on the checkpoint, fed vLLM's prompt ids and the package's HF image processor's
pixels (test_runtime_vision.hf_greedy)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_VL  # noqa: E402

from runtime_helpers import run_engine_script  # noqa: E402
from test_runtime_vision import IMAGE, SOFT, hf_greedy, image, message  # noqa: E402

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
TOKENS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from ttbundle.serving.demo import build_package

    d = tmp_path_factory.mktemp("ttvl")
    pkg = build_package(TINY_VL, d, "N300", backend="ttnn", warmup=False)
    cases = {"all": {"tt": {}, "max_tokens": TOKENS,
                     "messages": [message("ba be bi", image(1), image(2)), message("ko ku", image(0)),
                                  [{"role": "user", "content": "ka ke ki ko ku"}]]}}
    env = {k: v for k, v in os.environ.items() if k != "TTBUNDLE_EMULATED"}
    res = run_engine_script(HERE / "tt_vision_engine_run.py", pkg, cases, env)["all"]
    return res, SimpleNamespace(pkg=pkg, src=d / "src-tiny-gemma3-vl")


def test_image_chats_on_the_tt_device_path_are_greedy_identical_to_transformers(run):
    res, where = run
    images = [[image(1), image(2)], [image(0)], []]
    for ids, got, ims in zip(res["prompts"], res["tokens"], images):
        assert ids.count(IMAGE) == SOFT * len(ims)
        assert got == hf_greedy(where, ids, ims, TOKENS)


def test_images_replay_the_vision_traces_and_nothing_compiles_while_serving(run):
    res, _ = run
    vision = [k for k in res["replays"] if k[0] == "vision"]
    # the 2-image chat pads to vision bucket 2, the 1-image chat runs bucket 1; the text chat none
    assert sorted(k[1] for k in vision) == [1, 2]
    assert all(k in res["traced"] for k in vision)
    assert res["compiled_serving"] == 0 and res["violations"] == []
