"""`ttbundle check`'s verdicts on models whose next-token predictions are near-ties: a correct
package passes (a near-tie is not a failure), its head is a stage of its own, a real bug in the
same package still fails, and a model with no decisive prediction at all cannot pass.

The case: a random GPT-OSS whose greedy output loops on one token (a constant feature in every
embedding that two almost equal LM head rows read, so those two tokens lead at every position
by a hair), stored bfp4 with a bfp4 LM head. A bfp4 LM head flips such a near-tie at every
position; checked greedy step by step against the reference's own tokens, that read as total
failure (agreement 0) blamed on a fine layer.

And a bf16 package whose layer weights were corrupted (and re-hashed) fails at that layer.
"""

from __future__ import annotations

import dataclasses
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pkg_mutations import drop_first, edit_programs  # noqa: E402
from test_check_package import stored  # noqa: E402

from ttbundle import reference  # noqa: E402
from ttbundle.check import EXEC_BOUNDS, MIN_DECISIVE, normalised_error, pcc, run_check  # noqa: E402

A, B = 7, 11  # the two tokens that tie


def looping(tmp_path):
    """The bundle (bfp4 MLP and experts, bfp4 LM head, bfp8 rest) and its looping checkpoint."""
    b = stored("gpt_oss", "bfp4")
    m = reference.random_model(b, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        m.get_input_embeddings().weight[:, 0] = 10.0
        W = m.get_output_embeddings().weight
        W[A] = W[B] + 0.01 * torch.randn(W.shape[1], generator=g)
        W[A, 0] = W[B, 0] = 4.0
    ckpt = tmp_path / "ckpt"
    m.to(torch.bfloat16).save_pretrained(ckpt)
    s = b.spec
    dtypes = s.weights.dtypes.model_copy(update={"lm_head": "bfp4"})
    w = s.weights.model_copy(update={"source": str(ckpt), "dtypes": dtypes})
    # a random checkpoint has no tokenizer: the package is token ids only
    return dataclasses.replace(b, spec=s.model_copy(update={"weights": w, "tokenizer": False})), ckpt


def test_a_model_whose_greedy_output_loops_passes_and_a_bug_in_it_fails(tmp_path):
    b, ckpt = looping(tmp_path)
    # transformers itself: greedy decoding repeats one of the two tokens
    hf = reference.load_model(ckpt)
    prompt = torch.randint(0, b.arch.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    out = hf.generate(prompt, max_new_tokens=16, do_sample=False)[0, 40:].tolist()
    assert max(out.count(A), out.count(B)) >= 12, out

    r = run_check(b, "T3K", steps=16, seed=3)
    assert r.storage["weights"].get("bfp4") and r.quantized == "bfp4"
    assert set(r.ref_tokens) <= {A, B}  # every compared position predicts one of the two
    # the expected side holds the same bfp4 LM head: every decisive prediction is identical, and
    # the decisive ones are decided by the expected side's margins, never the judged side's error
    ex = r.executor
    assert len(ex.decisive) >= MIN_DECISIVE and ex.tokens_agree
    head = [s for s in ex.stages if s.stage == "head"]
    assert len(head) == r.steps and all(s.layer == b.arch.num_hidden_layers for s in head)
    assert max(s.err for s in ex.stages) <= EXEC_BOUNDS["fp32"]
    assert ex.passed, ex.failure(r.step_of)
    # against the original checkpoint the bfp4 head flips near-ties: that is quality, not judged
    # on random tokens
    assert r.ref_tokens != r.emu_tokens and not r.quality.judged and r.passed

    # the same package with the attention's all_reduce dropped: fails in the prefill, at layer 0
    hook = lambda pkg: edit_programs(pkg, "decoder", drop_first(  # noqa: E731
        lambda s: s.get("collective") == "all_reduce" and s["act"] == "attn_out"))
    bad = run_check(b, "T3K", steps=4, seed=3, package_hook=hook)
    assert not bad.passed
    d = bad.diverging()
    assert (d.step, d.stage, d.layer) == ("prefill", "layer", 0) and d.err > EXEC_BOUNDS["fp32"], d


def test_corrupted_layer_weights_fail_at_their_layer(tmp_path):
    """Two rows of layer 1's gate projection swapped in a bf16 package (re-hashed, so the
    manifest verifies): the check fails at layer 1 of the prefill; layer 0 is untouched."""
    import json

    from pkg_mutations import rehash
    from safetensors.torch import load_file, save_file
    from test_emulated import tiny

    from ttbundle.package.names import weight_file
    from ttbundle.package.verify import verify_package

    def hook(pkg):
        rel = weight_file(0)
        f = pkg / rel
        with open(f, "rb") as fh:
            meta = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))["__metadata__"]
        t = load_file(str(f))
        w = t["w1.1"]
        t["w1.1"] = torch.cat([w[1:2], w[0:1], w[2:]]).contiguous()
        save_file(t, str(f), metadata=meta)
        rehash(pkg, rel)
        verify_package(pkg, full=True)

    r = run_check(tiny("llama"), "N150", steps=4, random_weights=True, seed=3, package_hook=hook)
    assert not r.passed
    d = r.diverging()
    assert (d.step, d.stage, d.layer) == ("prefill", "layer", 1), d
    assert all(s.err < 1e-5 for s in r.executor.stages if s.stage == "layer" and s.layer == 0)


def test_no_decisive_position_cannot_pass(tmp_path):
    """Two LM head rows exactly equal and a constant feature that makes them lead everywhere:
    every prediction is an exact tie, none is decisive, and the verdict says what to do instead
    of passing on an empty set (``all([])`` passed before)."""
    b, ckpt = looping(tmp_path)
    m = reference.load_model(ckpt)
    with torch.no_grad():
        W = m.get_output_embeddings().weight
        W[A] = W[B]
    m.to(torch.bfloat16).save_pretrained(ckpt)
    s = b.spec
    dtypes = s.weights.dtypes.model_copy(update={"lm_head": "bf16"})
    b = dataclasses.replace(b, spec=s.model_copy(update={"weights": s.weights.model_copy(update={"dtypes": dtypes})}))
    r = run_check(b, "N150", steps=4, seed=3)
    ex = r.executor
    assert len(ex.decisive) < MIN_DECISIVE and not ex.passed and not r.passed
    assert "decisive" in ex.failure(r.step_of) and "--text" in ex.failure(r.step_of)


def test_the_metric_sees_error_a_massive_channel_hides_from_pcc():
    """A residual stream with one channel at ~1,800 (a trained model's massive activation) and a
    10% error on every ordinary channel: PCC over the stream stays above 0.999, the normalised
    error is ~0.1, far over the bf16 bound."""
    g = torch.Generator().manual_seed(0)
    inp = torch.randn(64, 256, generator=g)
    inp[:, 3] = 1800.0
    upd = torch.randn(64, 256, generator=g)
    ref = inp + upd
    emu = ref + 0.1 * torch.randn(64, 256, generator=g) * upd.std()
    emu[:, 3] = ref[:, 3]
    assert pcc(ref, emu) > 0.999
    err = normalised_error(ref, emu, inp)
    assert 0.08 < err < 0.12 and err > EXEC_BOUNDS["bf16"]
    # two bf16 computations of the same layer (the input shared, the update differing by bf16
    # rounding, the sum rounded to bf16 on each side) stay within the bound, the massive channel
    # included
    inp16 = inp.to(torch.bfloat16).float()
    a = (inp16 + upd).to(torch.bfloat16).float()
    b = (inp16 + upd.to(torch.bfloat16).float() * (1 + 2 ** -8 * torch.randn(64, 256, generator=g))
         ).to(torch.bfloat16).float()
    assert normalised_error(a, b, inp16, "bf16") < EXEC_BOUNDS["bf16"] / 2


def test_the_expected_weights_are_the_package_bytes_of_a_correct_build(tmp_path):
    """Two independent paths to the same numbers: the converter's shards as the package stores
    them (read back, reassembled) and check's expected weights (the checkpoint cut and rounded by
    ``check.expected``), bit for bit, on a sharded bfp8 + bfp4 package; and the rounding in bands
    of rows on threads equals the whole tensor's."""
    import ttbundle.check.expected as E

    from ttbundle import blockfloat
    from ttbundle.build import build
    from ttbundle.package.load import load_package
    from ttbundle.weights import load_canonical

    b = stored("llama", "bfp4")
    b = dataclasses.replace(b, spec=b.spec.model_copy(update={"tokenizer": False}))
    ckpt = reference.save_random(b, tmp_path / "ckpt", seed=3)
    b = dataclasses.replace(b, spec=b.spec.model_copy(update={"weights": b.spec.weights.model_copy(
        update={"source": str(ckpt)})}))
    pkg = load_package(build(b, "T3K", tmp_path / "out", warmup=False).package)
    held = pkg.weights.canonical()
    orig = load_canonical(b.family, b.arch, ckpt)
    for name in ("wq", "wo", "w1", "w2", "lm_head"):
        enc = pkg.weights.dtypes[name]
        c, h = (orig[name][1], held[name][1]) if isinstance(orig[name], list) else (orig[name], held[name])
        dims = {t.name: t for t in b.family.tensors(b.arch)}[name].dims
        want = E.stored_values(c.float(), pkg.weights.units[name], dims, pkg.mesh.num_devices, enc)
        assert enc in ("bfp8", "bfp4") and torch.equal(want, h), name
    x = torch.randn(3, 200, 96) * torch.logspace(-3, 3, 96)
    old, E.BAND_VALUES = E.BAND_VALUES, 1000
    try:
        assert torch.equal(E._quantize(x, "bfp4"), blockfloat.quantize(x.contiguous(), "bfp4"))
    finally:
        E.BAND_VALUES = old
