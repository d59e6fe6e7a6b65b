"""Layer-by-layer execution on the emulated mesh (``EmulatedModel.run_layer_major`` with a lazy
model that reads one layer's weights at a time): the same numbers as running each call whole, on
a model holding every weight, and only one layer's weights held at any stage."""

from __future__ import annotations

import pytest
import torch

from ttbundle.backends.emulated import EmulatedModel, Runner
from ttbundle.package.load import load_package
from ttbundle.serving.demo import build_package

from test_emulated import COMMON, TINY

SPEC = TINY["llama"] + COMMON


@pytest.mark.parametrize("mesh", ["N150", "T3K"])
def test_layer_major_lazy_equals_whole_calls(tmp_path, mesh):
    pkg = load_package(build_package(SPEC, tmp_path, mesh, warmup=False))
    whole = Runner(EmulatedModel.from_package(pkg), num_blocks=16)
    lazy_model = EmulatedModel.from_package(pkg, lazy=True)
    lazy = Runner(lazy_model, num_blocks=16)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (150,), generator=g).tolist()  # 3 chunks of <= 64
    cont = torch.randint(0, 512, (4,), generator=g).tolist()
    blocks = list(range(1, 8))

    cap_whole: list = []
    want = [whole.prefill(prompt, blocks, capture=cap_whole)]
    for i, t in enumerate(cont):
        want.append(whole.decode([t], [len(prompt) + i], [blocks], capture=cap_whole)[0])

    calls = lazy.prefill_calls(prompt, blocks, capture=True)
    calls += [lazy.decode_call([t], [len(prompt) + i], [blocks], capture=True) for i, t in enumerate(cont)]
    held = []
    order = []

    def after(stage):
        order.append(stage)
        held.append({layer for _, layer in lazy_model.lazy.held})

    logits = lazy_model.run_layer_major(calls, after_stage=after)
    layers = pkg.bundle.arch.num_hidden_layers
    assert order[0] == ("embedding", None) and order[-1] == ("head", None)
    assert [s[1] for s in order[1:-1]] == list(range(layers))
    # each stage held its own layer's weights only, and released them after
    assert all(h <= {stage[1]} for h, stage in zip(held, order))
    assert lazy_model.lazy.held == {}
    got = [logits[len(calls) - len(cont) - 1][0, 0]] + [lg[0, 0] for lg in logits[-len(cont):]]
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # every decoder layer's output of every call, identical
    n_pre = len(calls) - len(cont)
    assert len(cap_whole) == len(calls)
    for i, (c, w) in enumerate(zip(calls, cap_whole)):
        rows = [x[0, :c.rows] if i < n_pre else x[:c.rows, 0] for x in c.capture]
        # the embedding's output first, then each decoder layer's
        assert len(rows) == layers + 1 and all(torch.equal(a, b) for a, b in zip(rows, w))


def test_calls_with_other_stages_are_refused(tmp_path):
    pkg = load_package(build_package(SPEC, tmp_path, "N150", warmup=False))
    m = EmulatedModel.from_package(pkg, lazy=True)
    r = Runner(m, num_blocks=8)
    a = r.prefill_calls([1, 2, 3], [1])[0]
    b = r.prefill_calls([1, 2, 3], [2])[0]
    next(b)  # b one stage ahead
    from ttbundle.backends.emulated.model import ProgramMismatch
    with pytest.raises(ProgramMismatch, match="same stages"):
        m.run_layer_major([a, b])
