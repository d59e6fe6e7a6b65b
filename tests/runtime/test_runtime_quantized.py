"""Quantized checkpoints served: a tiny Llama stored as AWQ, GPTQ act-order, FP8 blocks and
compressed-tensors int4 with zero points (the producers' layouts, tests/quant_checkpoints.py; the
last with a PEFT adapter on top), built,
served by vLLM's OpenAI server and driven by the official client: greedy tokens equal
transformers ``generate`` on the same dequantized (and merged) weights, written out as a dense
checkpoint from the decoded view."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: quant_checkpoints, test_lora

from runtime_helpers import hf_greedy, serving, spec_text  # noqa: E402

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def dense_copy(src: Path, d: Path, adapters=()) -> Path:
    """The checkpoint as ttbundle reads it (decoded, adapters merged), saved dense for
    transformers; no eos, so ``generate`` runs to max_new_tokens as the server does."""
    from safetensors.torch import save_file

    from ttbundle.weights import Checkpoint

    ck = Checkpoint(src, adapters=adapters)
    d.mkdir(parents=True)
    save_file({k: ck.get(k).contiguous() for k in sorted(ck.keys())}, str(d / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["eos_token_id"] = None
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("scheme,lora", [("awq", False), ("ct-int4-asym", True), ("gptq-act-order", False),
                                         ("fp8-block", False)])
def test_served_greedy_tokens_equal_transformers_on_the_dequantized_weights(tmp_path, scheme, lora):
    import yaml
    from quant_checkpoints import write_quantized
    from safetensors.torch import load_file
    from test_lora import write_adapter

    from ttbundle import spec as specmod
    from ttbundle.build import build
    from ttbundle.serving.demo import make_tokenizer

    doc = yaml.safe_load(spec_text("llama"))
    b = specmod.loads(yaml.safe_dump(doc), "q.yaml")
    src = write_quantized(b, tmp_path / "ck", scheme)
    make_tokenizer(src, b.arch.vocab_size, None)
    adapters = []
    if lora:
        base = {k: v for k, v in load_file(str(dense_copy(src, tmp_path / "plain") / "model.safetensors")).items()}
        adapters = [write_adapter(tmp_path / "lora", base, {"r": 4, "lora_alpha": 8}, save_head=False)]
    ref = dense_copy(src, tmp_path / "dense", adapters)
    doc["weights"] = {"source": str(src), "adapters": [str(a) for a in adapters]}
    doc["tokenizer"] = str(src)
    spec_file = tmp_path / "q.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    pkg = Path(build(specmod.load(spec_file), "N150", tmp_path / "out").package)
    with serving(pkg, tmp_path) as plan:
        client = openai.OpenAI(base_url=plan.url, api_key="none", timeout=180, max_retries=0)
        for n, seed in ((5, 1), (40, 2)):
            import random
            rng = random.Random(seed)
            ids = [rng.randrange(3, b.arch.vocab_size) for _ in range(n)]
            r = client.completions.create(model=plan.name, prompt=ids, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            assert r.choices[0].token_ids == hf_greedy(ref, ids, 10), (n, scheme)
