"""Images the way Tenstorrent's plugin hands them to a model: ``prefill_forward(...,
pixel_values=[per request])`` on a package's generated adapter (the tiny Gemma 3 multimodal
package on the emulated N300), the whole prompt prefilled in one call. The reference is
transformers' ``Gemma3ForConditionalGeneration`` on the checkpoint the package was built from,
fed the same pixels, the image tokens marked as HF's processor marks them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_VL  # noqa: E402

SOFT, IMAGE, BOI, EOI = 16, 500, 501, 502  # TINY_VL's mm_tokens_per_image and image token ids
PROMPT = [2, BOI] + [IMAGE] * SOFT + [EOI, 7, 11, BOI] + [IMAGE] * SOFT + [EOI, 9]


@pytest.fixture(scope="module")
def adapter(packages_dir):
    from ttbundle.serving.demo import build_package
    from ttbundle.runtime.model_runner import model_class
    from ttbundle.runtime.packages import open_package

    pkg = open_package(build_package(TINY_VL, packages_dir, "N300"))
    cls = model_class(pkg)  # the package's own adapter, as vllm_metadata.json names it
    model = cls.initialize_vllm_model(None, None, 8, 256, 1, None, package=pkg)
    return model, packages_dir / "src-tiny-gemma3-vl"


def test_pixel_values_as_tenstorrents_plugin_passes_them_equal_transformers(adapter):
    import transformers

    model, src = adapter
    g = torch.Generator().manual_seed(3)
    px = torch.randn(2, 3, 64, 64, generator=g)  # two images, already normalized
    kv = model.allocate_kv_cache((16, 4, 32, 32), torch.float32, 3)
    tokens = torch.zeros(1, 64, dtype=torch.long)
    tokens[0, :len(PROMPT)] = torch.tensor(PROMPT)
    page_table = torch.arange(1, 9)[None, :]
    got = model.prefill_forward(tokens=tokens, page_table=page_table, kv_cache=kv, prompt_lens=[len(PROMPT)],
                                start_pos=[0], enable_trace=True, pixel_values=[px], image_grid_thw=[None])
    without = model.prefill_forward(tokens=tokens, page_table=page_table, kv_cache=kv,
                                    prompt_lens=[len(PROMPT)], start_pos=[0])

    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=px, token_type_ids=(ids == IMAGE).long()).logits[0, -1]
    err = (got[0] - ref).abs().max().item()
    assert err < 1e-3 * max(1.0, ref.abs().max().item()), err
    # the images mattered: without pixel_values the image tokens stay plain embeddings
    assert (without[0] - ref).abs().max().item() > 100 * err


def test_pixel_values_that_do_not_match_the_image_tokens_are_refused(adapter):
    model, _ = adapter
    kv = model.allocate_kv_cache((16, 4, 32, 32), torch.float32, 3)
    tokens = torch.zeros(1, 64, dtype=torch.long)
    tokens[0, :len(PROMPT)] = torch.tensor(PROMPT)
    with pytest.raises(ValueError, match=r"3 image\(s\) in pixel_values need 48 image tokens"):
        model.prefill_forward(tokens, torch.arange(1, 9)[None, :], kv, [len(PROMPT)], [0],
                              pixel_values=[torch.randn(3, 3, 64, 64)])
