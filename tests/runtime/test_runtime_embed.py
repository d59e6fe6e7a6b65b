"""Embedding packages (``task: embed``) served by vLLM's pooling runner at ``/v1/embeddings``:
a tiny random Qwen3 built for N150 and N300 (last-token pooling, L2-normalized: Qwen3-Embedding's)
and a tiny random Mistral with a sliding window shorter than the prompts on N300 (mean pooling, not
normalized: the mean runs over every chunk of a chunked prefill), asked through the ``openai``
client, against transformers' pooled final hidden state on the checkpoint the package was built
from (its bf16 weights, computed in float32)."""

from __future__ import annotations

import json

import pytest
import yaml

from runtime_helpers import TINY_ARCH, serving

NAME = "tiny-embed"
PREFILL = [32, 64, 128]
CHUNK = 32  # a prompt longer than this prefills in chunks: the pooled row is its last chunk's


#: family -> (its tiny dims, the spec's embedding)
MODELS = {
    "qwen3": (TINY_ARCH["qwen3"], {"pooling": "last", "normalize": True}),
    "mistral": (dict(TINY_ARCH["llama"], family="mistral", sliding_window=16), {"pooling": "mean", "normalize": False}),
}


def embed_spec(family: str = "qwen3") -> str:
    arch, embedding = MODELS[family]
    return yaml.safe_dump({
        "name": NAME,
        "description": f"tiny random {family} embedding model for runtime tests",
        "model": arch,
        "targets": ["N150", "N300"],
        "task": "embed",
        "embedding": embedding,
        "buckets": {"prefill": PREFILL, "prefill_chunk": CHUNK},
        "runtime": {"max_model_len": 128, "max_num_seqs": 8},
    }, sort_keys=False)


def hf_embeddings(src, prompts: list[list[int]], pooling: str = "last", normalize: bool = True):
    """transformers: the base model's last hidden state (after the final norm) at each prompt's
    last token (``last``: Qwen3-Embedding's pooling) or averaged over the prompt (``mean``),
    L2-normalized if ``normalize``, one prompt at a time."""
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            rows = m.model(input_ids=torch.tensor([p])).last_hidden_state[0]
            h = rows[-1] if pooling == "last" else rows.mean(dim=0)
            out.append(torch.nn.functional.normalize(h, dim=-1) if normalize else h)
    return out


PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [11] * 3, list(range(20, 120)), [300, 301, 302, 303, 304] * 9]


@pytest.mark.slow
@pytest.mark.parametrize("family,mesh", [("qwen3", "N150"), ("qwen3", "N300"), ("mistral", "N300")])
def test_embeddings_equal_transformers(family, mesh, tmp_path):
    import torch

    from ttbundle.serving.demo import build_package

    arch, embedding = MODELS[family]
    pkg = build_package(embed_spec(family), tmp_path / "packages", mesh)
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
    want = hf_embeddings(pkg.parent.parent / f"src-{NAME}", PROMPTS, **embedding)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape == (arch["hidden_size"],)
        cos = float(torch.nn.functional.cosine_similarity(g, w, dim=0))
        print(f"{family} {mesh} prompt {i}: cosine {cos:.7f}, norm {float(g.norm()):.4f} (transformers {float(w.norm()):.4f})")
        assert cos >= 0.9999, (mesh, i, cos)
        # normalized: unit length; not normalized: transformers' length (the pooling is not rescaled)
        assert abs(float(g.norm()) - float(w.norm())) < 1e-3 * float(w.norm()), (mesh, i, float(g.norm()))
    assert torch.allclose(torch.tensor(one.data[0].embedding), got[0], atol=1e-5)
    steps = [json.loads(x) for x in (d / "steps.jsonl").read_text().splitlines()]
    assert steps and all(s["phase"] == "prefill" for s in steps)
    # the 100- and 45-token prompts were prefilled in 32-token chunks (KV kept between them)
    assert any(row[1] > 0 for s in steps for row in s["rows"])
