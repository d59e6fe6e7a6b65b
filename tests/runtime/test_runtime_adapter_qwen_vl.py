"""Qwen2.5-VL images the way Tenstorrent's plugin hands them to a model: ``prefill_forward(...,
pixel_values=[per request], image_grid_thw=[per request])`` on a package's generated adapter (the
tiny Qwen2.5-VL package on the emulated N150), the whole prompt in one call, returning
``(logits, rope_deltas)``; then ``decode_forward(..., rope_deltas=...)``. The reference is
transformers' ``Qwen2_5_VLForConditionalGeneration`` on the checkpoint the package was built
from, fed the same pixels and grids (its own M-RoPE positions and rope deltas)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import spec_helpers  # noqa: E402

TINY_QVL = getattr(spec_helpers, "TINY_QVL", None)
pytestmark = pytest.mark.skipif(TINY_QVL is None, reason="the Qwen2.5-VL family (spec_helpers.TINY_QVL) is not here")
IMAGE, START, END = 500, 502, 503  # TINY_QVL's image_token_id, vision_start / vision_end
GRIDS = torch.tensor([[1, 8, 12], [1, 16, 4]])  # two images of different shapes, in 4-pixel patches


def prompt():
    ids = [7]
    for g in GRIDS:
        ids += [START] + [IMAGE] * (int(g.prod()) // 4) + [END, 9]
    return ids + [11, 12]


@pytest.fixture(scope="module")
def adapter(packages_dir):
    from ttbundle.serving.demo import build_package
    from ttbundle.runtime.model_runner import model_class
    from ttbundle.runtime.packages import open_package

    pkg = open_package(build_package(TINY_QVL, packages_dir, "N150"))
    cls = model_class(pkg)  # the package's own adapter, as vllm_metadata.json names it
    model = cls.initialize_vllm_model(None, None, 8, 384, 1, None, package=pkg)
    return model, packages_dir / "src-tiny-qwen25-vl"


def test_pixel_values_and_grids_as_tenstorrents_plugin_passes_them_equal_transformers(adapter):
    import transformers

    model, src = adapter
    ids = prompt()
    g = torch.Generator().manual_seed(5)
    px = torch.randn(int(GRIDS.prod(dim=1).sum()), 3 * 2 * 4 * 4, generator=g)  # normalized patches
    kv = model.allocate_kv_cache((16, 2, 32, 32), torch.float32, 2)
    tokens = torch.zeros(1, 128, dtype=torch.long)
    tokens[0, :len(ids)] = torch.tensor(ids)
    table = torch.arange(1, 13)[None, :]
    got, deltas = model.prefill_forward(tokens=tokens, page_table=table, kv_cache=kv, prompt_lens=[len(ids)],
                                        start_pos=[0], enable_trace=True, pixel_values=[px], image_grid_thw=[GRIDS])
    from ttbundle import reference
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():  # image tokens marked as HF's processor marks them (its M-RoPE needs them)
        out = hf(input_ids=x, pixel_values=px, image_grid_thw=GRIDS, mm_token_type_ids=(x == IMAGE).int(),
                 past_key_values=reference.kv_cache(hf, "bf16"), use_cache=True)
    ref = out.logits[0, -1]
    err = (got[0] - ref).abs().max().item()
    assert err < 1e-3 * max(1.0, ref.abs().max().item()), err
    assert int(deltas[0]) == int(hf.model.rope_deltas[0]) != 0
    # the images mattered: the same tokens without pixels are another prompt
    without = model.prefill_forward(tokens, table, kv, [len(ids)], [0])
    assert (without[0] - ref).abs().max().item() > 100 * err
    # decode the next token at cache position len(ids) with the request's rope delta
    nxt = int(ref.argmax())
    with torch.no_grad():
        ref2 = hf(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True,
                  cache_position=torch.tensor([len(ids)])).logits[0, -1]
    model.prefill_forward(tokens=tokens, page_table=table, kv_cache=kv, prompt_lens=[len(ids)],
                          start_pos=[0], pixel_values=[px], image_grid_thw=[GRIDS])  # the KV again
    dec = torch.zeros(8, 1, dtype=torch.long)
    dec[0, 0] = nxt
    pos = torch.full((8,), -1, dtype=torch.long)
    pos[0] = len(ids)
    dtable = torch.zeros(8, 12, dtype=torch.long)
    dtable[0] = table[0]
    got2 = model.decode_forward(dec, pos, dtable, kv, rope_deltas=deltas)
    err2 = (got2[0] - ref2).abs().max().item()
    assert err2 < 1e-3 * max(1.0, ref2.abs().max().item()), err2
    plain = model.decode_forward(dec, pos, dtable, kv)  # cache positions as rope positions: wrong
    assert (plain[0] - ref2).abs().max().item() > 10 * err2


def prefill_with(model, pixel_values, grids):
    """One prefill of the two-image prompt with these images' patches and grids."""
    ids = prompt()
    kv = model.allocate_kv_cache((16, 2, 32, 32), torch.float32, 2)
    tokens = torch.zeros(1, 128, dtype=torch.long)
    tokens[0, :len(ids)] = torch.tensor(ids)
    return model.prefill_forward(tokens, torch.arange(1, 13)[None, :], kv, [len(ids)], [0],
                                 pixel_values=[pixel_values], image_grid_thw=[grids])


def test_grids_that_do_not_match_the_image_tokens_are_refused(adapter):
    model, _ = adapter
    with pytest.raises(ValueError, match=r"image 1 \(grid .*\) needs 32"):
        prefill_with(model, torch.randn(96 + 128, 96), torch.tensor([[1, 8, 12], [1, 8, 16]]))


def test_patches_that_do_not_match_the_grids_are_refused(adapter):
    model, _ = adapter
    with pytest.raises(ValueError, match=r"pixel_values hold 100 patches, image_grid_thw .* needs 160"):
        prefill_with(model, torch.randn(100, 96), GRIDS)
