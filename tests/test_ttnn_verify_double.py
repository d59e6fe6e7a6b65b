"""Speculative decoding's verify step on the TT device path (``runtime.ttdevice.TTDeviceModel.
verify_forward``), computed by the recording double (``backends/ttnn/recording.py`` +
``numerics.py``) on the package's own tensorbin weights: a tiny Llama with ``speculative: {method:
ngram}`` built with ``--backend ttnn`` on N150 and T3K. The verify forward is decode's lowering over
``bucket x (k + 1)`` rows (each row a token at its own position over its sequence's pages; the KV
writes and the attention run per group of the sequences' row ``j``, ``verify_pos.<j>``, each a
decode batch), every row's logits back, acceptance on the host.

Reference: the emulated backend (``runtime.adapter.BundleModel``: the package's programs on its
weight shards, fp32) running the same verify steps on the same prompts; mutations of the lowering
(a sequence's later rows attending only up to its first row; its proposal rows' KV never
written) show the row positions and the KV writes are what the equality rests on."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "runtime"))
from vision_double_helpers import device_model, emulated  # noqa: E402

REL = 0.03  # bf16 weights and activations on the double against the fp32 emulated backend
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_LEN = 256
B = 8  # the decode bucket the steps run in (two sequences, six padding rows)
BLOCKS = MAX_LEN // 32  # page-table columns: one sequence's blocks at max_model_len
PROMPTS = [[10, 11, 12, 13, 14, 15, 16] * 3, [(7 * i + 3) % 500 + 8 for i in range(40)]]


def verify_spec() -> str:
    from runtime_helpers import spec_text
    d = yaml.safe_load(spec_text("llama"))
    d["name"] = "tiny-llama-verify"
    d["speculative"] = dict(NGRAM)
    d["buckets"] = {"prefill": [64], "decode": [1, 8], "prefill_chunk": 64}
    d["runtime"]["max_num_seqs"] = 8
    d["runtime"]["max_model_len"] = MAX_LEN
    return yaml.safe_dump(d, sort_keys=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from ttbundle.serving.demo import build_package
    out = tmp_path_factory.mktemp("ttverify")
    return {m: build_package(verify_spec(), out, m, backend="ttnn", warmup=False) for m in ("N150", "T3K")}


def _page_table(rows: int) -> torch.Tensor:
    """Sequence i in blocks 1 + i * BLOCKS ... (block 0: vLLM's null block)."""
    return torch.tensor([[1 + i * BLOCKS + j for j in range(BLOCKS)] for i in range(rows)], dtype=torch.long)


def _rel(got, want) -> float:
    return float((got - want).abs().max()) / float(want.abs().max())


def run_steps(model, kv, steps: int = 2):
    """Both prompts prefilled, then ``steps`` verify steps in decode bucket B = 8 (two sequences, six
    padding rows): each sequence's next token and its proposals (the first sequence k of them,
    the second one), then what greedy acceptance kept. Returns per step the verify logits
    [B, k + 1, V], the valid rows [B, k + 1], the tokens and the accepted tokens [B, k + 1]."""
    from ttbundle.runtime.sampling import DeviceSampling

    pt = _page_table(B)
    seqs, nxt = [], []
    for i, p in enumerate(PROMPTS):
        toks = torch.zeros(1, 64, dtype=torch.long)
        toks[0, :len(p)] = torch.tensor(p)
        logits = model.prefill_forward(toks, pt[i:i + 1], kv, [len(p)], [0])
        seqs.append(list(p))
        nxt.append(int(logits.reshape(-1).argmax()))
    out = []
    for step in range(steps):
        tokens = torch.zeros(B, K + 1, dtype=torch.long)
        start = torch.full((B,), -1, dtype=torch.long)
        n = torch.zeros(B, dtype=torch.long)
        for i, s in enumerate(seqs):
            d = PROMPTS[i][step:step + (K if i == 0 else 1)]
            tokens[i, 0] = nxt[i]
            tokens[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
            start[i], n[i] = len(s), 1 + len(d)
        logits = model.verify_forward(tokens, start, n, pt, kv)
        acc = model.verify_forward(tokens, start, n, pt, kv, DeviceSampling.from_params([], [], B))
        valid = torch.arange(K + 1)[None, :] < n[:, None]
        out.append((logits, valid, tokens, acc))
        for i, s in enumerate(seqs):
            kept = [int(t) for t in acc[i] if int(t) >= 0]
            s.append(nxt[i])
            s.extend(kept[:-1])
            nxt[i] = kept[-1]
    return out


def verify_differences(got_steps, want_steps) -> list[str]:
    bad = []
    for step, ((got, valid, tokens, acc), (want, _, _, want_acc)) in enumerate(zip(got_steps, want_steps)):
        for i in range(2):
            for j in range(K + 1):
                if not valid[i, j]:
                    continue
                g, w = got[i, j], want[i, j]
                diff = float((g - w).abs().max())
                if diff > REL * float(w.abs().max()):
                    bad.append(f"step {step} sequence {i} row {j}: logits differ by {diff:.3g} "
                               f"(largest {float(w.abs().max()):.3g})")
                tok = int(g.argmax())
                if float(w.max() - w[tok]) > 2 * diff:  # greedy, up to a near tie bf16 may flip
                    bad.append(f"step {step} sequence {i} row {j}: greedy token {tok}, emulated {int(w.argmax())}")
    return bad


@pytest.mark.parametrize("mesh", ["N150", pytest.param("T3K", marks=pytest.mark.slow)])
def test_verify_on_the_tt_device_path_equals_the_emulated_mesh(built, mesh):
    pkg, dev, kv, rec = device_model(built[mesh], MAX_LEN)
    verify = sorted(k for k in dev.runner.forwards if k[0] == "verify")
    # one host-sampled verify forward per decode bucket, warmed and captured as a trace
    assert verify == [("verify", 1, "host", 0), ("verify", B, "host", 0)]
    assert set(verify) <= set(dev.runner.traces) and dev.runner.stage == "captured"
    fw = dev.runner.forwards["verify", B, "host", 0]
    assert fw.rows == 32 and fw.outputs == ["logits.out"]
    compiled = sum(e.compiled for e in rec.events)
    replays = sum(e.fn == "execute_trace" for e in rec.events)
    got = run_steps(dev, kv)
    assert sum(e.compiled for e in rec.events) == compiled  # nothing compiled while serving
    assert sum(e.fn == "execute_trace" for e in rec.events) - replays == 2 + 2 * 2  # prefills, verifies
    assert rec.op_errors == [] and rec.violations == [] and rec.shape_mismatches == []

    emu, ekv = emulated(pkg, MAX_LEN)
    want = run_steps(emu, ekv)
    assert [v[:2].sum(1).tolist() for _, v, _, _ in want] == [[K + 1, 2]] * 2
    assert verify_differences(got, want) == []
    # greedy acceptance on the device's logits keeps what it keeps on the emulated mesh's
    for (_, _, _, a), (_, _, _, b) in zip(got, want):
        assert a[:2].tolist() == b[:2].tolist()


def _attend_to_the_first_row(row_groups):
    """The lowering's attention: every row group attends with group 0's positions (each row sees
    its sequence only up to its first row: the causal row mask lost); the KV writes intact."""
    from ttbundle.backends.ttnn.calls import T
    from ttbundle.backends.ttnn.inputs import verify_pos_input

    def groups(lw, x, out, fn):
        if out != "oh" or lw.phase != "verify":
            return row_groups(lw, x, out, fn)
        return row_groups(lw, x, out, lambda q, o, cur_pos, pages: fn(q, o, T(verify_pos_input(0)), pages))
    return groups


def _proposals_unwritten(row_groups):
    """The lowering's KV writes: only row group 0 (each sequence's first row) is written."""
    from ttbundle.backends.ttnn.inputs import verify_pos_input

    def groups(lw, x, out, fn):
        if not out.endswith(".w") or lw.phase != "verify":
            return row_groups(lw, x, out, fn)
        return row_groups(lw, x, out, lambda r, o, cur_pos, pages: fn(r, o, cur_pos, pages)
                          if cur_pos.name == verify_pos_input(0) else None)
    return groups


@pytest.mark.parametrize("mutation", [_attend_to_the_first_row, _proposals_unwritten], ids=["row-mask", "kv-writes"])
def test_a_wrong_row_mask_or_unwritten_proposals_leave_the_emulated_mesh(built, mutation, monkeypatch):
    """Mutations of the verify lowering: every row of a sequence attends only up to its first
    row (the causal row mask lost), or only its first row's K/V is written; each sequence's
    first row keeps the emulated logits, every later valid row leaves them."""
    from ttbundle.backends.ttnn import text_ops

    monkeypatch.setattr(text_ops, "row_groups", mutation(text_ops.row_groups))
    pkg, dev, kv, rec = device_model(built["N150"], MAX_LEN)
    got = run_steps(dev, kv, steps=1)
    emu, ekv = emulated(pkg, MAX_LEN)
    want = run_steps(emu, ekv, steps=1)
    rows = {b.split(":")[0] for b in verify_differences(got, want) if "logits differ" in b}
    later = {f"step 0 sequence {i} row {j}" for i in range(2) for j in range(1, K + 1) if want[0][1][i, j]}
    assert rows == later and len(later) == K + 1


def test_a_verify_forward_is_lowered_for_host_sampling_only(built):
    """Acceptance runs on the host from every row's logits (as on the emulated mesh): a verify
    program lowered for device sampling is refused, naming why."""
    from ttbundle.backends.ttnn.lowering import lower_forward
    from ttbundle.package.load import load_package

    pk = load_package(built["N150"])
    with pytest.raises(ValueError, match="lowered with sampling \\('host',\\), got 'device'"):
        lower_forward(pk.bundle, pk.mesh, pk.program_ir("verify", B), "device")
