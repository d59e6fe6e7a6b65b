"""Qwen2.5-VL: M-RoPE positions, the vision transformer (window attention, patch merger) and the
text model on the emulated mesh against Hugging Face transformers'
``Qwen2_5_VLForConditionalGeneration`` (the independent reference), with test images generated
here; the spec's pixel budget and its errors."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pkg_mutations import drop_first, edit_programs
from spec_helpers import TINY_QVL, line_of

from ttbundle import reference, spec
from ttbundle.plan.make import make_plan
from ttbundle.check import EXEC_BOUNDS, run_check
from ttbundle.errors import InvalidInput
from ttbundle.families import qwen2_5_vl_vision as qv

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny(text: str = TINY_QVL):
    return spec.loads(text, "spec.yaml")


def images(sizes=((40, 72), (48, 56)), seed: int = 0) -> list:
    """Random RGB images of two sizes: the processor gives them different patch grids."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]


# ---- M-RoPE positions against transformers' get_rope_index ------------------------------------------
@pytest.fixture(scope="module")
def hf_vl():
    import transformers
    b = tiny()
    return transformers.Qwen2_5_VLModel(reference.hf_config(b)).eval(), b.arch.vision


@pytest.mark.parametrize("grids", [[], [(1, 6, 8)], [(1, 10, 18), (1, 4, 12)]], ids=["text", "1 image", "2 images"])
def test_mrope_positions_are_transformers_rope_index(hf_vl, grids):
    model, v = hf_vl
    g = torch.Generator().manual_seed(len(grids))
    text = lambda n: torch.randint(0, 400, (n,), generator=g).tolist()  # noqa: E731
    prompt = text(3)
    for t, h, w in grids:
        prompt += [v.vision_start_token_id] + [v.image_token_id] * (t * h * w // 4) + [v.vision_end_token_id] + text(5)
    ids = torch.tensor([prompt])
    ours, delta = qv.mrope_positions(prompt, grids, v)
    if not grids:  # transformers: text-only prompts use the plain positions (no rope index)
        assert torch.equal(ours, torch.arange(len(prompt)).expand(3, -1)) and delta == 0
        return
    theirs, deltas = model.get_rope_index(ids, mm_token_type_ids=(ids == v.image_token_id).int(),
                                          image_grid_thw=torch.tensor(grids))
    assert torch.equal(ours, theirs[:, 0])
    assert delta == int(deltas[0, 0]) and delta < 0


def test_mrope_positions_refuse_a_placeholder_run_that_does_not_match_the_grid():
    v = tiny().arch.vision
    with pytest.raises(ValueError, match="needs 12 placeholder tokens at prompt position 1, found a run of 11"):
        qv.mrope_positions([7] + [v.image_token_id] * 11 + [7], [(1, 6, 8)], v)


def test_window_order_is_transformers_window_index():
    """``patch_layout``'s merge-block order and window boundaries against transformers'
    ``get_vision_window_index`` (two images; windows of 2x2 blocks with partial windows at the edges)."""
    from transformers.vision_utils import get_vision_window_index
    v = tiny().arch.vision
    grids = [(1, 10, 18), (1, 12, 14)]
    idx, cu = get_vision_window_index(torch.tensor(grids), v.spatial_merge_size, v.window_size, v.patch_size)
    lay = qv.patch_layout(v, grids, 512)
    n = sum(t * h * w for t, h, w in grids)
    assert torch.equal(lay["order"][::4] // 4, idx)
    starts = [i for i in range(n) if i == 0 or lay["window"][i] != lay["window"][i - 1]] + [n]
    assert starts == cu.tolist()
    assert set(lay["window"][n:].tolist()) == {int(lay["window"][:n].max()) + 1}  # padding: its own segment


# ---- the model against transformers ---------------------------------------------------------------
def test_text_only_prompt_is_token_identical_to_transformers():
    r = run_check(tiny(), "N150", steps=6, random_weights=True, seed=1)
    assert r.tokens_agree and r.passed, (r.ref_tokens, r.emu_tokens, r.diverging())


@pytest.mark.parametrize("mesh", ["N150", "N300", "T3K"])
def test_check_with_images_is_token_identical_to_transformers(mesh):
    r = run_check(tiny(), mesh, steps=6, random_weights=True, seed=1, images=images())
    img = r.layers[0]
    assert img.step == "image" and img.err <= EXEC_BOUNDS["fp32"]
    assert r.tokens_agree and r.passed, (r.ref_tokens, r.emu_tokens, r.diverging())
    # 40x72 and 48x56 pixels: grids 10x18 and 12x14 patches = 180 + 168 patches in the 512 bucket;
    # 45 + 42 soft tokens, each image between vision start and end, after one text token
    assert ("vision", 512) in r.shapes_run
    assert r.prompt_len >= 1 + (45 + 2) + (42 + 2)


def test_full_attention_in_place_of_window_attention_changes_the_image(monkeypatch):
    """Window layers attending over the whole image no longer match transformers."""
    layout = qv.patch_layout

    def no_windows(v, grid, bucket):
        lay = layout(v, grid, bucket)
        return {**lay, "window": lay["image"]}
    monkeypatch.setattr(qv, "patch_layout", no_windows)
    r = run_check(tiny(), "N150", steps=2, random_weights=True, seed=1, images=images())
    assert not r.passed
    d = r.diverging()
    assert d.step == "image" and d.err > EXEC_BOUNDS["fp32"]


def test_dropped_vision_all_reduce_fails_at_the_image():
    hook = lambda pkg: edit_programs(pkg, "vision_layer", drop_first(  # noqa: E731
        lambda s: s.get("collective") == "all_reduce" and s["act"] == "mlp_out"))
    r = run_check(tiny(), "T3K", steps=2, random_weights=True, seed=1, images=images(), package_hook=hook)
    assert not r.passed
    d = r.diverging()
    assert d.step == "image" and d.err > EXEC_BOUNDS["fp32"]


def test_plan_splits_vision_heads_and_mlp_and_lists_the_programs():
    p = make_plan(tiny(), "T3K")
    t = {x.name: x for x in p.tensors}
    # 8 vision heads of 8 over 8 columns: one head per device; the MLP's 96 over 8: 12 each
    assert t["v_wq"].device_shape == [64, 8] and t["v_w1"].device_shape == [64, 12]
    assert t["v_w3"].device_shape == [64, 12] and t["v_w2"].device_shape == [12, 64]
    # the merger is replicated: 4 patches x 64 = 256 in, the text hidden (256) out
    assert t["v_merge1"].device_shape == [256, 256] and t["v_merge2"].device_shape == [256, 256]
    assert [k for k, _, _ in p.vision] == ["vision_embedding", "vision_layer", "vision_projector"]
    reduces = [s.act for _, _, steps in p.vision for s in steps if s.kind == "all_reduce"]
    assert reduces == ["attn_out", "mlp_out"]


# ---- spec errors ---------------------------------------------------------------------------------
def _err(text: str) -> str:
    with pytest.raises(InvalidInput) as e:
        tiny(text)
    return "\n".join(f"{d.line}: {d.message}" for d in e.value.diagnostics)


def test_a_vision_bucket_too_small_for_the_images_is_a_cap_stated_as_a_warning():
    text = TINY_QVL.replace("buckets: [256, 512]}", "buckets: [256, 384]}")
    b = tiny(text)
    (w,) = [d for d in b.warnings if d.path == "vision.buckets"]
    assert w.line == line_of(text, "vision: {images_per_prompt: 2")
    # 4096 pixels / (4 x 2)^2 = 64 merge blocks = 256 patches per image, 2 images = 512
    assert "64 merge blocks = 256 patches each) need up to 512 patches, the largest vision bucket holds 384" \
        in w.message
    assert "refused (400)" in w.message


def test_a_vision_bucket_not_of_whole_merge_blocks_is_an_error():
    msg = _err(TINY_QVL.replace("buckets: [256, 512]}", "buckets: [256, 510]}"))
    assert "510 patches is not a multiple of 4" in msg


def test_an_image_longer_than_the_prefill_chunk_is_an_error():
    text = TINY_QVL.replace("max_pixels: 4096, buckets: [256, 512]", "max_pixels: 16384, buckets: [2048]")
    # 16384 / 64 = 256 soft tokens + vision start/end = 258 > a chunk of 128
    msg = _err(text)
    assert "is 258 tokens" in msg and "use a chunk >= 258" in msg


def test_a_bucket_that_is_not_whole_merge_blocks_is_an_error():
    assert "510 patches is not a multiple of 4" in _err(TINY_QVL.replace("[256, 512]", "[256, 510, 512]"))


def test_min_pixels_above_max_pixels_is_an_error():
    assert "min_pixels=8192 exceeds max_pixels=4096" in _err(TINY_QVL.replace("min_pixels: 256", "min_pixels: 8192"))


def test_default_vision_bucket_holds_the_default_pixel_budget():
    text = TINY_QVL.replace("vision: {images_per_prompt: 2, min_pixels: 256, max_pixels: 4096, buckets: [256, 512]}\n", "")
    text = text.replace("max_model_len: 512", "max_model_len: 1024")
    text = text.replace("buckets: {prefill: [64, 128], decode: [1, 8, 32], prefill_chunk: 128}",
                        "buckets: {prefill: [64, 128, 512], decode: [1, 8, 32], prefill_chunk: 512}")
    vs = tiny(text).vision
    # 256 soft tokens' worth of 8-pixel merge blocks; one image per prompt: 1024 patches
    assert (vs.images_per_prompt, vs.max_pixels, vs.buckets) == (1, 256 * 64, [1024])


def test_gemma_pixel_budget_is_an_error():
    from spec_helpers import TINY_VL
    text = TINY_VL.replace("vision: {images_per_prompt: 2, buckets: [1, 2]}",
                           "vision: {images_per_prompt: 2, buckets: [1, 2], max_pixels: 4096}")
    assert "max_pixels is Qwen2.5-VL's pixel budget" in _err(text)


# ---- the package and the plan ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def package(tmp_path_factory):
    from ttbundle.serving import demo
    return demo.build_package(TINY_QVL, tmp_path_factory.mktemp("qvl"), "N300")


def test_package_carries_the_tt_arch_processor_settings_and_chat_template(package):
    import json

    import transformers
    cfg = json.loads((package / "config.json").read_text())
    assert cfg["architectures"] == ["TTQwen2_5_VLForConditionalGeneration"]
    hf = transformers.Qwen2_5_VLConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert (hf.vision_config.depth, hf.vision_config.window_size, list(hf.vision_config.fullatt_block_indexes),
            hf.text_config.rope_parameters["mrope_section"]) == (3, 16, [1], [4, 6, 6])
    # the package's image processor resizes within the spec's budget: 40x72 stays (8-pixel blocks,
    # 2880 <= 4096 pixels) = 10x18 patches; 200x200 shrinks to at most 4096 pixels: 64x64 = 16x16
    proc = transformers.AutoImageProcessor.from_pretrained(package)
    out = proc(images=images(((40, 72), (200, 200))), return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 10, 18], [1, 16, 16]]
    assert list(out["pixel_values"].shape) == [180 + 256, 3 * 2 * 4 * 4]
    # the tokenizer's chat template puts Qwen's image placeholder where the image part is
    tok = transformers.AutoTokenizer.from_pretrained(package)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "ba"}]}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text)["input_ids"]
    k = ids.index(500)
    assert ids[k - 1:k + 2] == [502, 500, 503] and tok.image_token_id == 500


def test_package_vision_program_is_transformers_image_features(package):
    """The built package's own vision program (its weight files) against transformers on the
    checkpoint it was built from."""
    import transformers

    from ttbundle.backends.emulated import EmulatedModel
    from ttbundle.package.load import load_package
    pkg = load_package(package)
    model = EmulatedModel.from_package(pkg)
    src = package.parent.parent / "src-tiny-qwen25-vl"
    hf = reference.load_model(src)
    reference.round_to_bf16(hf)
    proc = transformers.AutoImageProcessor.from_pretrained(package)
    x = proc(images=images(((40, 72), (32, 24))), return_tensors="pt")
    ours = model.encode_images(x["pixel_values"], x["image_grid_thw"])
    with torch.no_grad():
        theirs = torch.cat(hf.model.get_image_features(x["pixel_values"], x["image_grid_thw"]).pooler_output)
    assert ours.shape == theirs.shape == (45 + 12, 256)
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_plan_cli_lists_the_vision_programs(tmp_path):
    import json

    from typer.testing import CliRunner

    from ttbundle.cli import app
    (tmp_path / "spec.yaml").write_text(TINY_QVL)
    r = CliRunner().invoke(app, ["plan", str(tmp_path / "spec.yaml"), "--mesh", "T3K", "--json"])
    assert r.exit_code == 0, r.output
    vp = json.loads(r.stdout)["vision_programs"]
    # rows = the bucket's patches; two all_reduces per vision layer, 3 layers
    assert [(v["bucket"], v["rows"], v["collectives"]) for v in vp] == [(256, 256, 6), (512, 512, 6)]
    r = CliRunner().invoke(app, ["plan", str(tmp_path / "spec.yaml"), "--mesh", "T3K"])
    assert "vision programs" in r.stdout and "v_merge1" in r.stdout


def test_the_ttnn_rotate_half_matrix_is_rotate_half():
    """The ttnn lowering rotates by a matmul (``rotate_half_matrix``); transformers' own
    ``rotate_half`` (Qwen2.5-VL's modeling file) is the reference."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import rotate_half

    from ttbundle.tables import rotate_half_matrix
    x = torch.randn(3, 5, 80)
    assert torch.equal(x @ rotate_half_matrix(80), rotate_half(x))


def test_cli_check_with_image_files(tmp_path):
    from typer.testing import CliRunner

    from ttbundle.cli import app
    paths = []
    for i, im in enumerate(images()):
        im.save(tmp_path / f"im{i}.png")
        paths += ["--image", str(tmp_path / f"im{i}.png")]
    (tmp_path / "spec.yaml").write_text(TINY_QVL)
    r = CliRunner().invoke(app, ["check", str(tmp_path / "spec.yaml"), "--mesh", "N300", "--random-weights",
                                 "--steps", "3", "--seed", "1", *paths])
    assert r.exit_code == 0, r.output
    assert "image soft tokens" in r.output
    same = re.search(r"executor: (\d+)/(\d+) decisive next-token predictions identical", r.output)
    assert same and same[1] == same[2], r.output
    # three images exceed images_per_prompt=2: a clear error, no traceback
    r = CliRunner().invoke(app, ["check", str(tmp_path / "spec.yaml"), "--random-weights", "--steps", "1",
                                 *paths, "--image", paths[1]])
    assert r.exit_code != 0 and "images_per_prompt=2" in r.output and "Traceback" not in r.output


def test_ttnn_mrope_tables_give_transformers_rotary_embedding():
    """The ttnn lowering's M-RoPE: three host-made tables (each zero outside its section's
    frequencies) looked up by the temporal, height and width positions and summed, against
    transformers' ``Qwen2_5_VLRotaryEmbedding`` on the same 3-row positions."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    from ttbundle.backends.ttnn import device, lowering
    b = tiny()
    p = make_plan(b, "N150")
    prog = __import__("ttbundle.lower", fromlist=["lower"]).lower(b, p, "prefill", 64)
    fw = lowering.lower_forward(b, p.mesh, prog, "host")
    assert {lowering.mrope_position_input(r) for r in range(3)} <= set(fw.inputs)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 200, (3, 64), generator=g)
    got = {}
    for part in ("cos", "sin"):
        tabs = sorted((c for c in fw.consts if c.kind == f"rope_{part}"), key=lambda c: dict(c.params)["mrope_row"])
        assert len(tabs) == 3
        got[part] = sum(torch.from_numpy(device._rope_table(c))[pos[r]] for r, c in enumerate(tabs))
    cfg = reference.hf_config(b).text_config
    cos, sin = Qwen2_5_VLRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    assert torch.allclose(got["cos"], cos[0], atol=1e-5) and torch.allclose(got["sin"], sin[0], atol=1e-5)
    # the host fills the three inputs with each row's position for text (the same in all three)
    ins = device.rope_position_inputs(fw, torch.arange(64)[None].numpy())
    assert all((ins[lowering.mrope_position_input(r)] == torch.arange(64).numpy()).all() for r in range(3))


def test_text_only_arch_leaves_the_vision_weights_unused():
    """Without ``model.vision`` the arch is the text model (M-RoPE on text positions); the
    checkpoint's vision tower is left unused and the tokens still equal transformers'."""
    head, rest = TINY_QVL.split("  vision:\n")
    text = head + "targets:" + rest.split("targets:", 1)[1]
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("vision:")) + "\n"
    b = tiny(text)
    assert b.arch.vision is None and b.vision is None
    assert not any(t.name.startswith("v_") for t in b.family.tensors(b.arch))
    r = run_check(b, "N300", steps=4, random_weights=True, seed=2)
    assert r.tokens_agree and r.passed, (r.ref_tokens, r.emu_tokens, r.diverging())


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_images_that_leave_no_room_in_max_model_len_are_an_error(family):
    """One rule for both vision families (families.base.image_token_budget)."""
    from spec_helpers import TINY_VL
    if family == "gemma3":  # 2 images x (16 soft tokens + begin/end) = 36 tokens
        text, need = TINY_VL.replace("max_model_len: 256", "max_model_len: 36"), 2 * (16 + 2)
    else:  # 4096 pixels / (4 x 2)^2 = 64 soft tokens + start/end, 2 images = 132 tokens
        text, need = TINY_QVL.replace("max_model_len: 512", "max_model_len: 132"), 2 * (4096 // 64 + 2)
    msg = _err(text)
    assert f"{line_of(text, 'images_per_prompt: 2')}:" in msg
    assert f"2 images x {need // 2} tokens = {need} tokens leave no room in max_model_len={need}" in msg


def test_a_gemma_image_longer_than_the_prefill_chunk_is_an_error():
    from spec_helpers import TINY_VL
    text = TINY_VL.replace("prefill_chunk: 64", "prefill_chunk: 16").replace("prefill: [64, 128]", "prefill: [16, 64]")
    msg = _err(text)  # 16 soft tokens + begin/end of image = 18 > 16
    assert "one image is 18 tokens" in msg and "use a chunk >= 18" in msg


def test_plan_states_the_published_7b_image_cap_with_its_arithmetic():
    """The published 7B takes the model's own pixel budget (12,845,056 pixels: 16384 merge blocks of
    28 x 28 pixels, 65,536 patches an image); two such images (131,072 patches) are not one prefill
    chunk, so the largest bucket (8,160 patches) is a cap: plan states it, with the activations of
    the vision program each would need."""
    from ttbundle.lower import summary, lower, vision_cap
    from ttbundle.plan.make import make_plan
    from ttbundle.report import vision_cap_line

    b = spec.load(Path(__file__).resolve().parent.parent / "bundles" / "qwen2.5-vl-7b-instruct.yaml")
    p = make_plan(b, "N300")
    c = vision_cap(b, p)
    assert (c["need"], c["cap"], c["largest_image"]) == (2 * 12845056 // 28 ** 2 * 4, 8160, 65536)
    assert c["need_activation_bytes"] == summary(lower(b, p, "vision", 131072))["activation_bytes"]
    assert c["need_activation_bytes"] > c["cap_activation_bytes"] > 0
    assert c["largest_image_tokens"] == 16386 > c["prefill_chunk"] >= c["cap_image_tokens"] == 2042
    line = vision_cap_line(c)
    assert "need 131,072 patches" in line and "refused (400)" in line and "holds 8,160 patches" in line
    assert any("a cap" in w.message for w in b.warnings)


def test_a_largest_bucket_below_the_smallest_image_is_an_error():
    # min_pixels 1024 / 8^2 = 16 merge blocks = 64 patches: a bucket of 32 holds no image
    msg = _err(TINY_QVL.replace("min_pixels: 256, max_pixels: 4096, buckets: [256, 512]",
                                "min_pixels: 1024, max_pixels: 4096, buckets: [32]"))
    assert "the largest vision bucket (32 patches) holds no image" in msg and "add a bucket of 64" in msg
