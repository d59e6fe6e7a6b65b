"""The emulated attention's context read from the paged KV cache (``kernels._context``): a
sequence's blocks copied run by run (consecutive cache blocks) or gathered block by block, both
against the slots read one by one from the cache in plain Python indexing."""

from __future__ import annotations

import pytest
import torch

from ttbundle.backends.emulated import kernels
from ttbundle.backends.emulated.kernels import Ctx


def _ctx(tables: list, bs: int) -> Ctx:
    blocks = torch.tensor(tables, dtype=torch.long)
    N, nblk = blocks.shape
    slots = (blocks[:, :, None] * bs + torch.arange(bs)).reshape(N, -1)
    zeros = torch.zeros(N, 1, dtype=torch.long)
    return Ctx(None, {}, [], None, zeros, zeros >= 0, zeros[:, 0], slots, [], torch.float32,
               context_blocks=blocks, block_size=bs)


@pytest.mark.parametrize("tables", [
    [[2, 3, 4]],                      # one run (one sequence, blocks handed out in order)
    [[5, 6, 1], [7, 8, 9]],           # three runs
    [[1, 3, 5], [0, 2, 4], [6, 7, 8]],  # interleaved: more runs than copied run by run
])
def test_the_context_is_each_sequences_slots_in_order_as_float32(tables):
    bs, D, kvh, hd = 4, 2, 3, 5
    g = torch.Generator().manual_seed(len(tables))
    cache = torch.randn(D, kvh, 10 * bs, hd, generator=g).bfloat16()
    ctx = _ctx(tables, bs)
    N, S = len(tables), len(tables[0]) * bs
    got = kernels._context(ctx, cache, N, S, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (D, kvh, N, S, hd)
    for n, row in enumerate(tables):
        want = [cache[:, :, b * bs + i].float() for b in row for i in range(bs)]
        assert torch.equal(got[:, :, n], torch.stack(want, dim=2))
    runs = kernels._runs(ctx)
    assert (runs is None) == (len(tables) == 3)
    # the cache's own dtype by default (a reader that converts later)
    assert torch.equal(kernels._context(_ctx(tables, bs), cache, N, S), got.bfloat16())
