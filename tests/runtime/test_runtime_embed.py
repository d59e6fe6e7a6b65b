"""Embedding packages (``task: embed``) served by vLLM's pooling runner at ``/v1/embeddings``:
a tiny random Qwen3 built for N150 and N300, asked through the ``openai`` client, against
transformers' last-token pooled, L2-normalized final hidden state on the checkpoint the package
was built from (its bf16 weights, computed in float32)."""

from __future__ import annotations

import json

import pytest
import yaml

from runtime_helpers import TINY_ARCH, serving

NAME = "tiny-embed"
PREFILL = [32, 64, 128]
CHUNK = 32  # a prompt longer than this prefills in chunks: the pooled row is its last chunk's


def embed_spec() -> str:
    return yaml.safe_dump({
        "name": NAME,
        "description": "tiny random qwen3 embedding model for runtime tests",
        "model": TINY_ARCH["qwen3"],
        "targets": ["N150", "N300"],
        "task": "embed",
        "embedding": {"pooling": "last", "normalize": True},
        "buckets": {"prefill": PREFILL, "prefill_chunk": CHUNK},
        "runtime": {"max_model_len": 128, "max_num_seqs": 8},
    }, sort_keys=False)


def hf_embeddings(src, prompts: list[list[int]]):
    """transformers: the base model's last hidden state (after the final norm) at each prompt's
    last token, L2-normalized (Qwen3-Embedding's pooling), one prompt at a time."""
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            h = m.model(input_ids=torch.tensor([p])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(h, dim=-1))
    return out


PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [11] * 3, list(range(20, 120)), [300, 301, 302, 303, 304] * 9]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["N150", "N300"])
def test_embeddings_equal_transformers(mesh, tmp_path):
    import torch

    from ttbundle.serving.demo import build_package

    pkg = build_package(embed_spec(), tmp_path / "packages", mesh)
    bundle_yaml = yaml.safe_load((pkg / "bundle.yaml").read_text())
    assert bundle_yaml["task"] == "embed" and bundle_yaml["buckets"]["decode"] == []
    assert sorted(p.name for p in (pkg / "programs").iterdir()) == sorted(f"prefill-{b}.json" for b in PREFILL)
    d = tmp_path / "serve"
    d.mkdir()
    with serving(pkg, d) as plan:
        import openai
        client = openai.OpenAI(base_url=plan.url, api_key="none", timeout=180, max_retries=0)
        r = client.embeddings.create(model=plan.name, input=PROMPTS)
        got = [torch.tensor(e.embedding) for e in sorted(r.data, key=lambda e: e.index)]
        one = client.embeddings.create(model=plan.name, input=[PROMPTS[0]], encoding_format="float")
        # a generation endpoint is not served by an embedding package
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model=plan.name, prompt=PROMPTS[0], max_tokens=2)
    want = hf_embeddings(pkg.parent.parent / f"src-{NAME}", PROMPTS)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape == (TINY_ARCH["qwen3"]["hidden_size"],)
        cos = float(torch.nn.functional.cosine_similarity(g, w, dim=0))
        print(f"{mesh} prompt {i}: cosine {cos:.7f}")
        assert cos >= 0.9999, (mesh, i, cos)
        assert abs(float(g.norm()) - 1.0) < 1e-4, (mesh, i, float(g.norm()))
    assert torch.allclose(torch.tensor(one.data[0].embedding), got[0], atol=1e-5)
    steps = [json.loads(x) for x in (d / "steps.jsonl").read_text().splitlines()]
    assert steps and all(s["phase"] == "prefill" for s in steps)
    # the 100- and 45-token prompts were prefilled in 32-token chunks (KV kept between them)
    assert any(row[1] > 0 for s in steps for row in s["rows"])
