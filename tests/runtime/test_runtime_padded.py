"""Head counts that do not divide the mesh, served: SmolLM2's ratio of 9 query to 3 KV heads
with the padding `ttbundle init` chooses (query heads padded with their KV heads), through
vLLM's own engine on the emulated mesh, token for token against transformers."""

from __future__ import annotations

import pytest
import yaml

from runtime_helpers import hf_greedy

SMOL = {"family": "llama", "vocab_size": 512, "hidden_size": 144, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 16,
        "max_position_embeddings": 1024, "tie_word_embeddings": True, "rope_theta": 100000.0}


def spec_text(mesh: str) -> str:
    from ttbundle import init, plan as planmod, spec as specmod
    for extra in ({},) + init.SHARDING_FALLBACKS:
        doc = {"name": "tiny-smol", "description": "9 query / 3 KV heads", "model": SMOL, "targets": [mesh],
               "sharding": dict(extra), "buckets": {"prefill": [32, 64], "decode": [1, 2, 4, 8], "prefill_chunk": 64},
               "runtime": {"max_model_len": 256, "max_num_seqs": 8}}
        text = yaml.safe_dump(doc, sort_keys=False)
        if not planmod.check_mesh(specmod.loads(text, "smol.yaml"), mesh):
            assert extra == {"attention_heads": "pad", "kv_heads": "pad"}
            return text
    raise AssertionError(f"no padding fits {mesh}")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["N300", "T3K", "TG"])
def test_padded_heads_serve_transformers_identical_tokens(mesh, tmp_path):
    import os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from ttbundle.runtime.demo import build_package
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
