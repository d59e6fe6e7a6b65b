"""Qwen3-VL: interleaved M-RoPE, the vision transformer (learned position embedding resampled to
each grid, patch merger, DeepStack) and the text model on the emulated mesh against Hugging Face
transformers' ``Qwen3VLForConditionalGeneration`` (the independent reference) with test images
of two sizes made here; the published 8B dims planned on T3K and N300."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from spec_helpers import TINY_Q3VL

from ttbundle import reference, spec
from ttbundle.plan.make import make_plan
from ttbundle.backends.emulated import kernel_table
from ttbundle.check import EXEC_BOUNDS, run_check
from ttbundle.families import qwen3_vl_vision as q3
from ttbundle.tables import mrope_cos_sin

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BUNDLES = Path(__file__).resolve().parent.parent / "bundles"


def tiny(text: str = TINY_Q3VL):
    return spec.loads(text, "spec.yaml")


def images(sizes=((40, 72), (48, 56)), seed: int = 0) -> list:
    """Random RGB images of two sizes: the processor gives them different patch grids."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]


# ---- the tables against transformers and torch ---------------------------------------------------
def test_interleaved_mrope_is_transformers_rotary_embedding():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    b = tiny()
    cfg = reference.hf_config(b).text_config
    rot = Qwen3VLTextRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 300, (3, 1, 40), generator=g)  # rows that differ: image tokens
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    ours_cos, ours_sin = mrope_cos_sin(pos[:, 0], b.arch.hd, b.arch.rope_theta, None, b.arch.mrope_section,
                                      torch.float32, interleaved=True)
    torch.testing.assert_close(ours_cos, cos[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_sin, sin[0], rtol=0, atol=1e-5)
    plain, _ = mrope_cos_sin(pos[:, 0], b.arch.hd, b.arch.rope_theta, None, b.arch.mrope_section, torch.float32)
    assert not torch.allclose(plain, cos[0], atol=1e-3)  # Qwen2.5-VL's sections in turn differ


@pytest.mark.parametrize("grid", [(1, 10, 18), (1, 4, 4), (1, 2, 30)])
def test_position_taps_resample_the_table_as_torch_bilinear_with_aligned_corners(grid):
    """Each row's 4 taps of the learned table give ``F.interpolate(bilinear, align_corners=True)``
    of the square table to the image's patch grid, at that row's patch (rows in merge-block order)."""
    v = tiny().arch.vision
    side, H = v.pos_side, 5
    table = torch.randn(side * side, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t, h, w = grid
    lay = q3.q25.patch_layout(v, [grid], t * h * w, windows=False)
    sizes = torch.tensor([[h, w]] * (t * h * w))
    idx, wt = q3.pos_taps(v, torch.cat([lay["hw"], sizes], dim=1), torch.float64)
    ours = (table[idx] * wt[:, :, None]).sum(1)
    ref = torch.nn.functional.interpolate(table.T.reshape(1, H, side, side), size=(h, w), mode="bilinear",
                                          align_corners=True)[0]
    hw = lay["hw"]
    torch.testing.assert_close(ours, ref[:, hw[:, 0], hw[:, 1]].T)


# ---- the model against transformers ---------------------------------------------------------------
def test_text_only_prompt_is_token_identical_to_transformers():
    r = run_check(tiny(), "N150", steps=6, random_weights=True, seed=1)
    assert r.tokens_agree and r.passed, (r.ref_tokens, r.emu_tokens, r.diverging())


@pytest.mark.parametrize("mesh", ["N150", "N300", "T3K"])
def test_check_with_images_is_token_identical_to_transformers(mesh):
    r = run_check(tiny(), mesh, steps=6, random_weights=True, seed=1, images=images())
    img = r.layers[0]
    # the soft tokens and both DeepStack sets against transformers' get_image_features
    assert img.step == "image" and img.err <= EXEC_BOUNDS["fp32"]
    assert r.tokens_agree and r.passed, (r.ref_tokens, r.emu_tokens, r.diverging())
    # 40x72 and 48x56 pixels: grids 10x18 and 12x14 patches = 180 + 168 patches in the 512 bucket;
    # 45 + 42 soft tokens, each image between vision start and end, after one text token
    assert ("vision", 512) in r.shapes_run
    assert r.prompt_len >= 1 + (45 + 2) + (42 + 2)


def test_without_deepstack_the_first_text_layer_diverges(monkeypatch):
    """The DeepStack additions are what the text layers must add: zeros in their place diverge at
    text layer 0 of the prefill, the image itself still matching."""
    monkeypatch.setitem(kernel_table.KERNELS, "deepstack", lambda ctx, layer, h: torch.zeros_like(h))
    r = run_check(tiny(), "N150", steps=2, random_weights=True, seed=1, images=images())
    assert not r.passed
    d = r.diverging()
    assert (d.step, d.layer) == ("prefill", 0) and d.err > EXEC_BOUNDS["fp32"]
    assert r.layers[0].step == "image" and r.layers[0].err <= EXEC_BOUNDS["fp32"]


def test_position_embedding_not_resampled_changes_the_image(monkeypatch):
    """Every row taking the table's first row in place of its resampled position fails at the image."""
    taps = q3.pos_taps

    def first_row(v, hw, dtype):
        idx, w = taps(v, hw, dtype)
        return torch.zeros_like(idx), torch.where(w.sum(1, keepdim=True) > 0, 0.25, 0.0).expand_as(w).to(dtype)
    monkeypatch.setattr(q3, "pos_taps", first_row)
    r = run_check(tiny(), "N150", steps=2, random_weights=True, seed=1, images=images())
    assert not r.passed
    d = r.diverging()
    assert d.step == "image" and d.err > EXEC_BOUNDS["fp32"]


# ---- the plan -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", ["T3K", "N300"])
def test_published_8b_plans_with_its_vision_programs(mesh):
    b = spec.load(BUNDLES / "qwen3-vl-8b-instruct.yaml")
    p = make_plan(b, mesh)
    kinds = [k for k, _, _ in p.vision]
    assert kinds[0] == "vision_embedding" and kinds[-1] == "vision_projector"
    assert [k for k in kinds if k.startswith("vision_deepstack")] == [f"vision_deepstack{k}" for k in range(3)]
    assert sum(n for k, n, _ in p.vision if k == "vision_layer") == 27
    t = {x.name: x for x in p.tensors}
    cols = 8 if mesh == "T3K" else 2
    assert t["v_wq"].device_shape == [1152, 1152 // cols]  # 16 heads over the columns
    assert t["v_ds2_fc2"].device_shape == [4608, 4096]  # the DeepStack mergers replicated
    assert p.fits
