"""vLLM's multimodal warm-up (``BaseRenderer._warmup_mm_processor``, run at server start: its
processor's dummy inputs for one item of each modality allowed) runs clean through ttbundle's
registration for every vision family. Qwen3-VL's own dummy-inputs builder also made a dummy video
from the video processor, which the images-only processor has not: vLLM logged "Multi-modal warmup
failed" ('NoneType' object has no attribute 'size'). The dummy image is the processor's largest
(vLLM's ``get_image_size_with_most_features``), so the warm-up preprocesses the biggest image the
package serves."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from spec_helpers import TINY_MISTRAL3, TINY_Q3VL, TINY_QVL, TINY_VL  # noqa: E402
from runtime_helpers import processor_model_dir, vllm_processor  # noqa: E402

CASES = {"gemma3": (TINY_VL, "Gemma3ForConditionalGeneration"),
         "qwen2_5_vl": (TINY_QVL, "Qwen2_5_VLForConditionalGeneration"),
         "qwen3_vl": (TINY_Q3VL, "Qwen3VLForConditionalGeneration"),
         "mistral3": (TINY_MISTRAL3, "Mistral3ForConditionalGeneration")}


@pytest.mark.parametrize("family", sorted(CASES))
def test_vllms_multimodal_warmup_runs_clean(family, tmp_path):
    from vllm.renderers.base import BaseRenderer

    from ttbundle import spec

    text, arch = CASES[family]
    bundle = spec.loads(text, "spec.yaml")
    processor = vllm_processor(processor_model_dir(bundle, tmp_path), arch, {"image": 2})
    assert {k for k, v in processor.info.allowed_mm_limits.items() if v > 0} == {"image"}
    # vLLM's own warm-up step (the renderer's ``warmup_mm`` catches what it raises and logs
    # "Multi-modal warmup failed"; called directly, it raises)
    renderer = SimpleNamespace(config=SimpleNamespace(scheduler_config=None))
    BaseRenderer._warmup_mm_processor(renderer, processor, None, log_prefix="Multi-modal")
    out = processor.get_dummy_mm_inputs({"image": 1}, cache=None, scheduler_config=None)
    assert set(out["mm_kwargs"]) == {"image"} and len(out["mm_kwargs"]["image"]) == 1
    assert len(out["prompt_token_ids"]) > 1
