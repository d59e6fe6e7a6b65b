"""Qwen2.5-VL and Qwen3-VL images on the TT device path (``runtime.ttdevice.TTDeviceModel``),
computed by the recording double (``backends/ttnn/recording.py`` + ``numerics.py``) on the
package's own tensorbin weights: the tiny Qwen2.5-VL and Qwen3-VL built with ``--backend ttnn``
on N150 and T3K (vision heads split over its 8 columns). The vision forward reads host-made
inputs besides the patches (Qwen2.5-VL: the patches in window order, each row's 2-D rope cos /
sin, the window and image masks from the vision part's per-row segments; Qwen3-VL: the image
mask, the rope, the learned position embedding's interpolation matrix: ``device.vision_inputs``)
and Qwen3-VL's returns its DeepStack features beside the soft tokens, which the image prefill
adds after the first text layers (``mm_deepstack.<k>``); the text forwards read the runner's
M-RoPE positions (``rope_positions.0/1/2``, Qwen3-VL's interleaved: a prefill chunk's
``[3, 1, S]``, a decode batch's ``[3, B, 1]`` or its rope deltas).

References: the emulated backend (the package's programs on its weight shards, fp32) for the
image features, the prefill and the decode logits; transformers' ``*ForConditionalGeneration``
(the checkpoint the package was built from, the same processor pixels and grids) for the greedy
token; a mutation each for the masks, the M-RoPE positions and the DeepStack inputs shows they
are read."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_helpers import TINY_Q3VL, TINY_QVL  # noqa: E402
from vision_double_helpers import device_model, emulated  # noqa: E402

REL = 0.03  # bf16 weights and activations on the double against the fp32 emulated backend
MESHES = ["N150", "T3K"]
SPECS = {"qwen2_5_vl": TINY_QVL, "qwen3_vl": TINY_Q3VL}
SRC = {"qwen2_5_vl": "src-tiny-qwen25-vl", "qwen3_vl": "src-tiny-qwen3-vl"}
SIZES = ((40, 72), (32, 24))  # grids 10x18 and 8x6 patches: 45 and 12 soft tokens, 228 patches (bucket 256)
BIG = ((64, 64), (64, 64))  # 16x16 patches each: 512 patches, the larger vision bucket
S = 128  # the prefill bucket the prompt pads to
MAX_LEN = 512


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from ttbundle.serving.demo import build_package
    out = tmp_path_factory.mktemp("ttqv")
    return {(f, m): build_package(text, out, m, backend="ttnn", warmup=False)
            for f, text in SPECS.items() for m in MESHES}, out


def _images(pkg, sizes, seed: int = 0) -> dict:
    """``pixel_values`` and ``image_grid_thw`` of random RGB images of ``sizes``, as the package's
    image processor (transformers') makes them."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    ims = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]
    return _part(pkg).image_inputs(pkg.bundle.vision, ims)


def _part(pkg):
    return pkg.bundle.family.vision_part(pkg.bundle.arch)


def _prompt(pkg, inputs) -> list[int]:
    part = _part(pkg)
    return [7, 8, 9] + part.image_tokens(inputs, 0) + [10, 11, 12, 13, 14] + part.image_tokens(inputs, 1) + [15, 16]


def _tokens(prompt):
    tokens = torch.zeros(1, S, dtype=torch.long)
    tokens[0, :len(prompt)] = torch.tensor(prompt)
    return tokens, torch.arange(1, 1 + MAX_LEN // 32)[None, :]  # block 0: vLLM's null block


def _rel(got, want) -> float:
    return float((got - want).abs().max()) / float(want.abs().max())


def _transformers_logits(pkg, src, prompt, inputs):
    """transformers' ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration``
    (``reference.load_model``: the class of the checkpoint's config) on the family's reference
    inputs (pixels, grids, image token types)."""
    from ttbundle import reference
    hf = reference.load_model(src)
    with torch.no_grad():
        return hf(input_ids=torch.tensor([prompt]), **_part(pkg).reference_kwargs(prompt, inputs, "cpu")).logits[0, -1]


@pytest.mark.parametrize("mesh", ["N150", pytest.param("T3K", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", list(SPECS))
def test_qwen_vl_images_on_the_tt_device_path_equal_the_emulated_mesh(built, family, mesh):
    from ttbundle.families.vision_part import decode_rope
    from ttbundle.runtime.images import prompt_inputs
    from ttbundle.runtime.sampling import DeviceSampling

    pkgs, out = built
    pkg, dev, kv, rec = device_model(pkgs[family, mesh], MAX_LEN)
    # every vision bucket has a forward, compiled at warm-up and captured as a trace
    vision = sorted(k for k in dev.runner.forwards if k[0] == "vision")
    assert [k[1] for k in vision] == pkg.bundle.vision.buckets == [256, 512]
    assert set(vision) <= set(dev.runner.traces) and dev.runner.stage == "captured"
    compiled_at_warmup = sum(e.compiled for e in rec.events)
    replays_before = sum(e.fn == "execute_trace" for e in rec.events)
    runs_before = dev.replay_count

    inputs, big = _images(pkg, SIZES), _images(pkg, BIG, seed=1)
    assert inputs["image_grid_thw"].tolist() == [[1, 10, 18], [1, 8, 6]]
    prompt = _prompt(pkg, inputs)
    n = len(prompt)
    tokens, pt = _tokens(prompt)
    px, thw = inputs["pixel_values"], inputs["image_grid_thw"]

    got_features = dev.encode_images(px, thw)  # vision bucket 256
    got_big = dev.encode_images(big["pixel_values"], big["image_grid_thw"])  # vision bucket 512
    # Tenstorrent's plugin's way: the request's pixels and grids; the call returns the rope deltas
    got, got_delta = dev.prefill_forward(tokens, pt, kv, [n], [0], pixel_values=[px], image_grid_thw=[thw])
    sampled, _ = dev.prefill_forward(tokens, pt, kv, [n], [0], DeviceSampling.from_params([], [], 1),
                                     pixel_values=[px], image_grid_thw=[thw])
    # ttbundle's runner's way: the chunk's soft tokens and its M-RoPE positions
    mm, pos = prompt_inputs(_part(pkg), prompt, px, thw, dev.encode_images, S)
    got_runner = dev.prefill_forward(tokens, pt, kv, [n], [0], mm=mm, **pos.chunk(0, n, S))
    # the next token decoded at cache position n: by its rope delta, and by the runner's positions
    nxt = torch.tensor([[int(got.argmax())]])
    dec_delta = dev.decode_forward(nxt, torch.tensor([n]), pt, kv, rope_deltas=got_delta)
    dec_runner = dev.decode_forward(nxt, torch.tensor([n]), pt, kv,
                                    rope_positions=decode_rope(torch.tensor([n]), torch.tensor([pos.delta])))
    # nothing compiled while serving: every step replayed a trace captured at warm-up
    assert sum(e.compiled for e in rec.events) == compiled_at_warmup
    # 2 encodes, 3 prefills each with its encode, 2 decodes
    assert sum(e.fn == "execute_trace" for e in rec.events) - replays_before == dev.replay_count - runs_before == 10
    assert rec.op_errors == [] and rec.violations == [] and rec.shape_mismatches == []

    emu, ekv = emulated(pkg, MAX_LEN)
    want_features = emu.encode_images(px, thw)
    width = pkg.bundle.arch.hidden_size * (1 + getattr(pkg.bundle.arch.vision, "deepstack", 0))  # + DeepStack sets
    assert got_features.shape == want_features.shape == (45 + 12, width)
    assert _rel(got_features, want_features) <= REL
    want_big = emu.encode_images(big["pixel_values"], big["image_grid_thw"])
    assert got_big.shape == want_big.shape == (128, width)
    assert _rel(got_big, want_big) <= REL

    want, want_delta = emu.prefill_forward(tokens, pt, ekv, [n], [0], pixel_values=[px], image_grid_thw=[thw])
    assert got_delta.tolist() == want_delta.tolist() == [pos.delta] and pos.delta < 0
    err = float((got - want).abs().max())
    assert err <= REL * float(want.abs().max()), err
    assert float((got_runner - want).abs().max()) <= REL * float(want.abs().max())
    want_dec = emu.decode_forward(nxt, torch.tensor([n]), pt, ekv, rope_deltas=want_delta)
    assert _rel(dec_delta, want_dec) <= REL and _rel(dec_runner, want_dec) <= REL

    ref = _transformers_logits(pkg, out / SRC[family], prompt, inputs)
    best = int(ref.argmax())
    for tok in (int(got.argmax()), int(sampled[0])):  # transformers' greedy token, up to a near tie bf16 may flip
        assert float(ref[best] - ref[tok]) <= 2 * err, (tok, best)


@pytest.mark.parametrize("family", list(SPECS))
def test_without_the_rope_positions_the_device_prefill_leaves_the_emulated_mesh(built, family, monkeypatch):
    """Mutation: the device's M-RoPE inputs filled with the cache positions (what the device path
    fed before, the runner's ``rope_positions`` dropped): the image prompt's logits leave the
    emulated mesh's."""
    from ttbundle.backends.ttnn import device

    pkgs, _ = built
    pkg, dev, kv, _ = device_model(pkgs[family, "N150"], MAX_LEN)
    inputs = _images(pkg, SIZES)
    prompt = _prompt(pkg, inputs)
    n = len(prompt)
    tokens, pt = _tokens(prompt)
    kw = dict(pixel_values=[inputs["pixel_values"]], image_grid_thw=[inputs["image_grid_thw"]])
    emu, ekv = emulated(pkg, MAX_LEN)
    want, _ = emu.prefill_forward(tokens, pt, ekv, [n], [0], **kw)
    intact, _ = dev.prefill_forward(tokens, pt, kv, [n], [0], **kw)
    err = float((intact - want).abs().max())
    rope = device.rope_position_inputs
    monkeypatch.setattr(device, "rope_position_inputs", lambda fw, qpos, rope_positions=None: rope(fw, qpos))
    plain, _ = dev.prefill_forward(tokens, pt, kv, [n], [0], **kw)
    assert float((plain - want).abs().max()) > max(5 * err, REL * float(want.abs().max()))


@pytest.mark.parametrize("family", list(SPECS))
def test_without_the_window_masks_the_device_images_leave_the_emulated_mesh(built, family, monkeypatch):
    """Mutation: the vision forward's masks all zero (every patch of the bucket attends to every
    other, the windows and the image bounds gone): its soft tokens leave the emulated mesh's."""
    from ttbundle.backends.ttnn import device

    pkgs, _ = built
    pkg, dev, _, _ = device_model(pkgs[family, "N150"], MAX_LEN)
    inputs = _images(pkg, SIZES)
    emu, _ = emulated(pkg, MAX_LEN)
    want = emu.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
    intact = dev.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
    made = device.vision_inputs

    def open_masks(fw, patches, meta):
        return {k: (np.zeros_like(v) if k.startswith("vision_mask") else v) for k, v in made(fw, patches, meta).items()}
    monkeypatch.setattr(device, "vision_inputs", open_masks)
    unmasked = dev.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
    assert _rel(unmasked, want) > max(5 * _rel(intact, want), REL)


def test_without_the_deepstack_inputs_the_qwen3_vl_prefill_leaves_the_emulated_mesh(built, monkeypatch):
    """Mutation: Qwen3-VL's image prefill with its DeepStack inputs left zero (the soft tokens
    merged, the feature sets not added after the first text layers): the logits leave the
    emulated mesh's."""
    from ttbundle.backends.ttnn import device

    pkgs, _ = built
    pkg, dev, kv, _ = device_model(pkgs["qwen3_vl", "N150"], MAX_LEN)
    inputs = _images(pkg, SIZES)
    prompt = _prompt(pkg, inputs)
    n = len(prompt)
    tokens, pt = _tokens(prompt)
    kw = dict(pixel_values=[inputs["pixel_values"]], image_grid_thw=[inputs["image_grid_thw"]])
    emu, ekv = emulated(pkg, MAX_LEN)
    want, _ = emu.prefill_forward(tokens, pt, ekv, [n], [0], **kw)
    intact, _ = dev.prefill_forward(tokens, pt, kv, [n], [0], **kw)
    err = float((intact - want).abs().max())
    made = device.image_inputs

    def no_deepstack(fw, mm):
        return {k: (np.zeros_like(v) if k.startswith("mm_deepstack") else v) for k, v in made(fw, mm).items()}
    monkeypatch.setattr(device, "image_inputs", no_deepstack)
    flat, _ = dev.prefill_forward(tokens, pt, kv, [n], [0], **kw)
    assert float((flat - want).abs().max()) > max(5 * err, REL * float(want.abs().max()))


def test_the_device_path_takes_qwen2_5_vl_and_refuses_a_vision_input_it_cannot_make(built, monkeypatch):
    """The Qwen2.5-VL and Qwen3-VL packages are no longer refused on a device (their vision
    forwards' host inputs are all ones ``device.vision_inputs`` makes); a vision forward reading an input the runner
    does not make still is, naming it and the way out, before anything opens."""
    from ttbundle.backends.ttnn import inputs as ttinputs
    from ttbundle.errors import InvalidInput
    from ttbundle.runtime import ttdevice
    from ttbundle.runtime.packages import open_package

    pkgs, _ = built
    for family in SPECS:  # nothing refused
        ttdevice.refuse_unlowered_vision(open_package(pkgs[family, "N150"]).loaded)
    pkg = open_package(pkgs["qwen2_5_vl", "N150"])
    monkeypatch.setattr(ttinputs, "VISION_HOST_INPUTS", ("patches",))
    with pytest.raises(InvalidInput, match=r"programs/vision-256.json lowered reads the host-made inputs "
                                           r"vision_cos, vision_mask.image, vision_mask.window, vision_sin, which "
                                           r"the TT device path does not make yet.*TTBUNDLE_EMULATED=1"):
        ttdevice.refuse_unlowered_vision(pkg.loaded)
