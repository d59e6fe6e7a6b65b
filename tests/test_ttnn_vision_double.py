"""Images on the TT device path (``runtime.ttdevice.TTDeviceModel``), computed by the recording
double (``backends/ttnn/recording.py`` + ``numerics.py``) on the package's own tensorbin weights:
the tiny Gemma 3 multimodal package built with ``--backend ttnn`` on N150 and N300. The vision
programs are lowered to ttnn calls and warmed (and traced) with the prefills; the prefill merges
the soft tokens at the image tokens and attends with the image-block mask.

References: the emulated backend (the package's programs on its weight shards, fp32) for the
image features and the prefill logits, transformers' ``Gemma3ForConditionalGeneration`` (the
checkpoint the package was built from, the same pixels, ``token_type_ids`` as HF's processor
marks them) for the greedy token."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pkg_mutations import edit_json  # noqa: E402
from spec_helpers import TINY_VL  # noqa: E402
from vision_double_helpers import device_model as _device_model, emulated as _emulated  # noqa: E402

SOFT, IMAGE, BOI, EOI = 16, 500, 501, 502  # TINY_VL's mm_tokens_per_image and image token ids
PROMPT = [2, BOI] + [IMAGE] * SOFT + [EOI, 7, 11, BOI] + [IMAGE] * SOFT + [EOI, 9]
REL = 0.03  # bf16 weights and activations on the double against the fp32 emulated backend
MESHES = ["N150", "N300"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from ttbundle.serving.demo import build_package
    out = tmp_path_factory.mktemp("ttv")
    return {m: build_package(TINY_VL, out, m, backend="ttnn", warmup=False) for m in MESHES}, out


def _inputs():
    g = torch.Generator().manual_seed(3)
    px = torch.randn(2, 3, 64, 64, generator=g)  # two images, already normalized
    tokens = torch.zeros(1, 64, dtype=torch.long)
    tokens[0, :len(PROMPT)] = torch.tensor(PROMPT)
    return px, tokens, torch.arange(1, 9)[None, :]  # block 0: vLLM's null block


def _transformers_logits(src, px):
    import transformers
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        return hf(input_ids=ids, pixel_values=px, token_type_ids=(ids == IMAGE).long()).logits[0, -1]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_images_on_the_tt_device_path_equal_the_emulated_backend_and_transformers(built, mesh):
    from ttbundle.runtime.sampling import DeviceSampling

    pkgs, out = built
    pkg, dev, kv, rec = _device_model(pkgs[mesh])
    # every vision bucket has a forward, compiled at warm-up and captured as a trace
    vision = sorted(k for k in dev.runner.forwards if k[0] == "vision")
    assert [k[1] for k in vision] == pkg.bundle.vision.buckets
    assert set(vision) <= set(dev.runner.traces) and dev.runner.stage == "captured"
    compiled_at_warmup = sum(e.compiled for e in rec.events)
    replays_before = sum(e.fn == "execute_trace" for e in rec.events)

    px, tokens, pt = _inputs()
    n = len(PROMPT)
    got_features = dev.encode_images(px)
    got = dev.prefill_forward(tokens, pt, kv, [n], [0], pixel_values=[px], image_grid_thw=[None])[0]
    sampled = int(dev.prefill_forward(tokens, pt, kv, [n], [0], DeviceSampling.from_params([], [], 1),
                                      pixel_values=[px])[0])
    without = dev.prefill_forward(tokens, pt, kv, [n], [0])[0]
    one = dev.encode_images(px[:1])  # vision bucket 1
    # nothing compiled while serving: every step replayed a trace captured at warm-up
    assert sum(e.compiled for e in rec.events) == compiled_at_warmup
    # 3 encodes of 2 images (alone, then in each pixel_values prefill), 3 prefills, 1 encode of 1
    assert sum(e.fn == "execute_trace" for e in rec.events) - replays_before == 3 + 3 + 1
    assert rec.op_errors == [] and rec.violations == [] and rec.shape_mismatches == []

    emu, ekv = _emulated(pkg)
    want_features = emu.encode_images(px)
    assert got_features.shape == want_features.shape == (2 * SOFT, pkg.bundle.arch.hidden_size)
    diff = float((got_features - want_features).abs().max())
    assert diff <= REL * float(want_features.abs().max()), diff
    assert float((one - want_features[:SOFT]).abs().max()) <= REL * float(want_features.abs().max())

    want = emu.prefill_forward(tokens, pt, ekv, [n], [0], pixel_values=[px])[0]
    err = float((got - want).abs().max())
    assert err <= REL * float(want.abs().max()), err
    # the images mattered: without them the image tokens stay plain embeddings
    assert float((without - want).abs().max()) > 10 * err

    ref = _transformers_logits(out / "src-tiny-gemma3-vl", px)
    best = int(ref.argmax())
    for tok in (int(got.argmax()), sampled):  # transformers' greedy token, up to a near tie bf16 may flip
        assert float(ref[best] - ref[tok]) <= 2 * err, (tok, best)


@pytest.mark.slow
def test_a_causal_only_image_mask_on_the_device_breaks_the_prefill(built, monkeypatch):
    """Mutation: the device's prefill mask without the image blocks (soft tokens attend causally
    only, as the fused SDPA kernels would): the logits leave the emulated backend's."""
    from ttbundle.backends.ttnn import device

    pkgs, _ = built
    pkg, dev, kv, _ = _device_model(pkgs["N150"])
    px, tokens, pt = _inputs()
    n = len(PROMPT)
    emu, ekv = _emulated(pkg)
    want = emu.prefill_forward(tokens, pt, ekv, [n], [0], pixel_values=[px])[0]
    intact = dev.prefill_forward(tokens, pt, kv, [n], [0], pixel_values=[px])[0]
    err = float((intact - want).abs().max())
    mask = device.mask_inputs
    monkeypatch.setattr(device, "mask_inputs",
                        lambda fw, qpos, blocks=None, rope_positions=None: mask(fw, qpos, None, rope_positions))
    causal = dev.prefill_forward(tokens, pt, kv, [n], [0], pixel_values=[px])[0]
    assert float((causal - want).abs().max()) > max(5 * err, REL * float(want.abs().max()))


def test_a_vision_program_the_lowering_cannot_translate_is_refused_on_a_device(built, tmp_path):
    """A vision op without a ttnn lowering (a family's vision op not lowered yet): the device
    path refuses the package naming the program and the op, before it opens anything; the
    emulated mesh still serves it."""
    from ttbundle.errors import InvalidInput
    from ttbundle.runtime import ttdevice
    from ttbundle.runtime.options import TTOptions
    from ttbundle.runtime.packages import open_package

    pkgs, _ = built
    d = tmp_path / "pkg"
    shutil.copytree(pkgs["N150"], d)

    def window(prog):
        st = next(s for k in prog["layers"] for s in k["steps"] if s.get("op") == "vision_attention")
        st["op"] = "vision_window_attention"
    edit_json(d, "programs/vision-2.json", window)
    pkg = open_package(d)
    with pytest.raises(InvalidInput, match=r"programs/vision-2.json uses vision_window_attention, which the ttnn "
                                           r"lowering does not translate yet.*TTBUNDLE_EMULATED=1"):
        ttdevice.TTDeviceModel.initialize_vllm_model(None, None, 8, 256, 1, None, package=pkg,
                                                     options=TTOptions(), sample_mode="all", ttnn=object())


def test_mistral3_images_on_the_tt_device_path_equal_the_emulated_backend(tmp_path):
    """The tiny Mistral 3 built with ``--backend ttnn`` on N150: its vision forward reads the
    host-made rope cos / sin and image mask (``device.vision_inputs`` from the vision part's
    per-row metadata) besides the patches; two images of different sizes give the emulated
    backend's soft tokens to bf16 level, and an image prefill the emulated logits. A mask that
    lets every row attend to every other (the images' segments dropped) does not."""
    import numpy as np
    from PIL import Image

    from spec_helpers import TINY_MISTRAL3
    from ttbundle.serving.demo import build_package

    pkg, dev, kv, rec = _device_model(build_package(TINY_MISTRAL3, tmp_path, "N150", backend="ttnn", warmup=False))
    part = pkg.bundle.family.vision_part(pkg.bundle.arch)
    rng = np.random.default_rng(0)
    ims = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in ((40, 72), (48, 56))]
    inputs = part.image_inputs(pkg.bundle.vision, ims)
    got = dev.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
    assert rec.op_errors == [] and rec.violations == [] and rec.shape_mismatches == []
    emu, ekv = _emulated(pkg)
    want = emu.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
    assert got.shape == want.shape == (40 + 42, pkg.bundle.arch.hidden_size)
    diff = float((got - want).abs().max())
    assert diff <= REL * float(want.abs().max()), diff
    # an image prompt's prefill: [IMG] rows of both images after one text token
    prompt = [2] + sum((part.image_tokens(inputs, k) for k in range(2)), []) + [7, 9]
    n = len(prompt)
    tokens = torch.zeros(1, 128, dtype=torch.long)
    tokens[0, :n] = torch.tensor(prompt)
    pt = torch.arange(1, 9)[None, :]
    px, thw = inputs["pixel_values"], inputs["image_grid_thw"]
    lg = dev.prefill_forward(tokens, pt, kv, [n], [0], pixel_values=[px], image_grid_thw=[thw])[0]
    ref = emu.prefill_forward(tokens, pt, ekv, [n], [0], pixel_values=[px], image_grid_thw=[thw])[0]
    err = float((lg - ref).abs().max())
    assert err <= REL * float(ref.abs().max()), err
    # one mask over the whole bucket: the images attend to each other (and the padding)
    from ttbundle.backends.ttnn import device
    real = device.vision_inputs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device, "vision_inputs",
                   lambda fw, patches, meta: real(fw, patches, {**meta, "image": torch.zeros_like(meta["image"])}))
        mixed = dev.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
    assert float((mixed - want).abs().max()) > 10 * diff
