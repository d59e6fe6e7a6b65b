"""Head counts that do not divide the mesh, served: SmolLM2's ratio of 9 query to 3 KV heads
with the padding `ttbundle init` chooses (query heads padded with their KV heads), through
vLLM's own engine on the emulated mesh, token for token against transformers."""

from __future__ import annotations

import pytest

from runtime_helpers import hf_greedy
from spec_helpers import smol_spec


def spec_text(mesh: str) -> str:
    text, extra = smol_spec(mesh)
    assert extra == {"attention_heads": "pad", "kv_heads": "pad"}
    return text


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["N300", "T3K", "TG"])
def test_padded_heads_serve_transformers_identical_tokens(mesh, tmp_path):
    import os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from ttbundle.serving.demo import build_package
    pkg = build_package(spec_text(mesh), tmp_path, mesh)
    src = tmp_path / "src-tiny-smol"
    llm = LLM(model=str(pkg), dtype="float32", seed=0)
    try:
        prompts = [[(5 * i + n) % 500 + 8 for i in range(n)] for n in (3, 40, 70, 17)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert list(o.outputs[0].token_ids) == hf_greedy(src, p, 10), (mesh, len(p))
    finally:
        llm.llm_engine.engine_core.shutdown()
