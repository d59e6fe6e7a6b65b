"""``VLLM_BATCH_INVARIANT`` on the emulated mesh (issue 38): with it, a sequence's decode logits are
the same bits whether it is decoded alone (the one-row bucket) or among other sequences of other
lengths (a padded bucket); without it, the one-row kernel may differ in the last bits, within an
fp32 product's rounding. The tokens-vs-transformers tests (test_emulated) hold in both modes."""

from __future__ import annotations

import pytest
import torch

from ttbundle import lower, reference, spec, weights
from ttbundle.backends.emulated import EmulatedModel, Runner, gemm
from ttbundle.errors import InvalidInput
from ttbundle.plan.make import make_plan

# intermediate 2816: a contraction (the down projection's) long enough that oneDNN's one-row
# kernel sums in another order than its several-row kernel on the CPUs seen here
SPEC = """
name: inv-llama
model:
  family: llama
  vocab_size: 512
  hidden_size: 256
  intermediate_size: 2816
  num_hidden_layers: 2
  num_attention_heads: 8
  num_key_value_heads: 8
  max_position_embeddings: 1024
targets: [N150, T3K]
buckets: {prefill: [64], decode: [1, 8, 32], prefill_chunk: 64}
runtime: {max_model_len: 256, max_num_seqs: 8}
"""

needs_onednn = pytest.mark.skipif(not gemm.packs(torch.float32, torch.device("cpu")),
                                  reason="torch without oneDNN on this CPU")


@pytest.fixture(scope="module")
def models():
    bundle = spec.loads(SPEC, "inv-llama.yaml")
    hf = reference.random_model(bundle, seed=0)
    canon = weights.from_state_dict(bundle.family, bundle.arch, hf.state_dict())
    out = {}
    for mesh in ("N150", "T3K"):
        plan = make_plan(bundle, mesh)
        out[mesh] = EmulatedModel.from_canonical(bundle, plan, canon, lower.lower_all(bundle, plan))
    return out


def _alone_and_together(model, steps=3):
    """Three sequences of different lengths, decoded ``steps`` tokens each alone (bucket 1, one
    cache per sequence) and all together (bucket 8, one cache): per sequence its logits [steps, vocab]
    both ways."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 17, 63)]
    tables = [[4 * i + b for b in range(4)] for i in range(3)]
    together = Runner(model, num_blocks=16)
    alone = [Runner(model, num_blocks=16) for _ in prompts]
    toks = []
    with torch.no_grad():
        for i, (p, t) in enumerate(zip(prompts, tables)):
            together.prefill(p, t)
            toks.append(int(alone[i].prefill(p, t).argmax()))
        a = [[] for _ in prompts]
        b = [[] for _ in prompts]
        cur = list(toks)
        for s in range(steps):
            pos = [len(p) + s for p in prompts]
            both = together.decode(cur, pos, tables)
            for i in range(3):
                one = alone[i].decode([cur[i]], [pos[i]], [tables[i]])[0]
                a[i].append(one)
                b[i].append(both[i])
            cur = [int(x.argmax()) for x in both]
    return [torch.stack(x) for x in a], [torch.stack(x) for x in b]


@needs_onednn
@pytest.mark.parametrize("mesh", ["N150", "T3K"])
def test_rows_are_the_same_bits_at_any_batch_size_with_the_switch(models, mesh, monkeypatch):
    monkeypatch.setenv(gemm.INVARIANT_ENV, "1")
    alone, together = _alone_and_together(models[mesh])
    for x, y in zip(alone, together):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("mesh", ["N150", "T3K"])
def test_without_the_switch_rows_agree_within_fp32_rounding(models, mesh, monkeypatch):
    monkeypatch.delenv(gemm.INVARIANT_ENV, raising=False)
    alone, together = _alone_and_together(models[mesh])
    for x, y in zip(alone, together):
        # an fp32 GEMM's summation order (a bf16 KV rounding may flip: 2^-8 of one key), not
        # another sequence's context leaking in (that moves logits by their own size, ~1)
        torch.testing.assert_close(x, y, rtol=1e-3, atol=2e-3)
        assert torch.equal(x.argmax(-1), y.argmax(-1))


@needs_onednn
def test_the_gemm_switch_pads_one_row_to_the_several_row_kernel(monkeypatch):
    monkeypatch.setenv(gemm.INVARIANT_ENV, "1")
    W = gemm.Packed(torch.randn(1, 2816, 1024))
    x = torch.randn(1, 40, 2816)
    full = gemm.matmul(x, W)
    for n in (1, 2, 7, 33):
        assert torch.equal(gemm.matmul(x[:, :n].contiguous(), W), full[:, :n])
    # a plain weight: every product INVARIANT_ROWS rows (MKL's GEMM sums a row in another order
    # at 2 rows than at 40 on an AMD EPYC host); each row's bits at any row count and position
    plain = torch.randn(1, 2816, 64)
    whole = gemm.matmul(x, plain)
    for n in (1, 2, 7, 33):
        assert torch.equal(gemm.matmul(x[:, :n].contiguous(), plain), whole[:, :n]), n
        assert torch.equal(gemm.matmul(x[:, -n:].contiguous(), plain), whole[:, -n:]), n


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("", False), (" 2 ", True)])
def test_the_switch_reads_as_vllm_reads_it(monkeypatch, value, on):
    monkeypatch.setenv(gemm.INVARIANT_ENV, value)
    assert gemm.batch_invariant() is on


def test_a_bad_switch_value_says_what_it_expects(monkeypatch):
    monkeypatch.setenv(gemm.INVARIANT_ENV, "yes")
    with pytest.raises(InvalidInput, match=r"VLLM_BATCH_INVARIANT='yes': expected 0 or 1"):
        gemm.batch_invariant()
