"""Packed prefill: several prompts' chunks in one call of one prefill program (the emulated mesh).

``phases.pack_prefill`` plans a prefill step's program calls (the scheduler sizes steps with it,
the runner runs it); ``BundleModel.prefill_forward`` with tokens [N, R] runs N sequences of R
rows in the program of bucket N * R. Checked here: the plan's arithmetic worked by hand, and a
packed call's logits against transformers on each prompt alone (the engine-level token check is
test_runtime_engine's ``test_several_short_prompts_share_one_prefill_call...``).
"""

from __future__ import annotations

import pytest
import torch

from runtime_helpers import CASES, MAX_MODEL_LEN, PREFILL, hf_model

from ttbundle.runtime.phases import pack_prefill, prefill_rows


def test_sixty_four_token_prompts_fill_the_512_bucket_without_padding():
    # 8 x 64 = 512 rows: one call of the 512 bucket, 8 sequences of 64 rows, no padding
    assert pack_prefill([64] * 8, [128, 512]) == [(512, 64, list(range(8)))]
    # one per call would pad each to 128: 8 x 128 = 1024 rows
    assert prefill_rows([64] * 8, [128, 512], packed=False) == 1024
    assert prefill_rows([64] * 8, [128, 512]) == 512
    # 4 prompts: 2 calls of 128 (2 x 64 rows each) = 256 rows beat one 512 call and 4 x 128
    assert pack_prefill([64] * 4, [128, 512]) == [(128, 64, [0, 1]), (128, 64, [2, 3])]
    # with a 64 bucket, 16 prompts: two full 512 calls
    assert prefill_rows([64] * 16, [64, 128, 512]) == 1024
    assert [len(i) for _, _, i in pack_prefill([64] * 16, [64, 128, 512])] == [8, 8]


def test_rows_per_sequence_are_whole_tiles_dividing_the_bucket():
    # 70 tokens need 96 rows (3 tiles), which divides neither 128 nor 512: 128 rows each, alone
    assert pack_prefill([70, 70], [128, 512]) == [(128, 128, [0]), (128, 128, [1])]
    # 20-token chunks: 32 rows each, 4 per 128-row call, 2 more in a 64-row call
    assert pack_prefill([20] * 6, [32, 64, 128]) == [(128, 32, [0, 1, 2, 3]), (64, 32, [4, 5])]
    # a long chunk and a short one: packing would pad the short one to 512; alone it takes 128
    assert pack_prefill([500, 20], [128, 512]) == [(512, 512, [0]), (128, 128, [1])]
    # at most 32 sequences per call (the head's tile row): 40 one-token chunks in 1024 rows
    calls = pack_prefill([1] * 40, [1024])
    assert all(len(i) <= 32 for _, _, i in calls) and sum(len(i) for _, _, i in calls) == 40


def test_a_backend_without_packing_runs_one_call_per_chunk():
    assert pack_prefill([64] * 4, [128, 512], packed=False) == [(128, 128, [i]) for i in range(4)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{m}" for f, m in CASES])
def model(make_package, request):
    from ttbundle.runtime.packages import open_package

    pkg, src = make_package(*request.param)
    from ttbundle.runtime.adapter import BundleModel

    opened = open_package(pkg, check_hashes=False)
    m = BundleModel.initialize_vllm_model(None, opened.loaded.mesh, 32, MAX_MODEL_LEN, package=opened)
    return m, src, opened.bundle.spec.runtime.kv_block_size


def test_a_packed_call_gives_each_prompt_its_own_transformers_logits(model):
    from ttbundle import reference

    m, src, bs = model
    kv = m.allocate_kv_cache((64, 4, bs, 16))
    # 4 sequences of 32 rows: the 128 bucket's program (gemma3: longer than its 16-token window)
    lens = [20, 32, 5, 17]
    prompts = [[(7 * i + 3 * n) % 500 + 8 for i in range(n)] for n in lens]
    tokens = torch.zeros(4, 32, dtype=torch.long)
    for j, p in enumerate(prompts):
        tokens[j, :len(p)] = torch.tensor(p)
    table = torch.zeros(4, -(-MAX_MODEL_LEN // bs), dtype=torch.long)
    table[:, 0] = torch.tensor([3, 9, 1, 5])  # each sequence's own block (32 tokens fit one)
    with torch.no_grad():
        got = m.prefill_forward(tokens, table, kv, lens, [0] * 4)
    assert got.shape == (4, 512)
    assert m.programs_run == {("prefill", 128): 1}
    hf = hf_model(str(src))
    for j, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p]), past_key_values=reference.kv_cache(hf, "bf16")).logits[0, -1]
        torch.testing.assert_close(got[j], ref, atol=2e-4, rtol=2e-4)
        assert int(got[j].argmax()) == int(ref.argmax())


def test_a_packed_call_that_does_not_fill_a_bucket_is_refused(model):
    m, _, bs = model
    kv = m.allocate_kv_cache((8, 4, bs, 16))
    table = torch.zeros(3, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="filling a prefill bucket"):
        m.prefill_forward(torch.zeros(3, 32, dtype=torch.long), table, kv, [5, 5, 5], [0, 0, 0])
    with pytest.raises(ValueError, match="text chunks only"):
        m.prefill_forward(torch.zeros(4, 32, dtype=torch.long), table, kv, [5] * 4, [0] * 4,
                          return_prompt_logits=True)
    assert PREFILL == [32, 64, 128]  # the buckets the shapes above are chosen against
