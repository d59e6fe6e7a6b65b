"""The demo bundle's committed checkpoint (bundles/demo, made by scripts/train_demo.py): loads
offline, its tokenizer round-trips text, the emulated T3K mesh matches transformers on it, and
its greedy output reads as King James English rather than noise."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ttbundle import spec  # noqa: E402
from ttbundle.check import run_check  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "bundles" / "demo.yaml"
DEMO = ROOT / "bundles" / "demo"
MAX_BYTES = 20 * 1024 * 1024  # the limit on weights in git


def _train_demo():
    s = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(DEMO, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(
        DEMO, dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="module")
def kjv():
    """The KJV's words and adjacent word pairs, recomputed from Debian's bible-kjv-text, and
    the script's word splitter."""
    td = _train_demo()
    try:
        verses = td.kjv_verses()
    except td.Missing as e:
        return None, str(e)
    return (td.kjv_words(verses), td.kjv_bigrams(verses)), ""


def _kjv_failures(text: str, kjv) -> list[str]:
    """Why ``text`` does not read as KJV English (empty: it does). Dictionary words alone are not
    enough (a loop of "the" passes), so also: most adjacent word pairs are KJV phrases, and no
    single word is half the text. ``kjv`` None (text not installed): the shape checks only."""
    w = _train_demo().words(text)
    if len(w) < 20:  # 48 tokens should hold 20+ words, not punctuation or byte soup
        return [f"{len(w)} words"]
    out = []
    top = max(w.count(x) for x in set(w)) / len(w)
    if top >= 0.5:
        out.append(f"one word is {top:.0%} of the text")
    if kjv is None:
        return out
    vocab, bigrams = kjv
    known = sum(x in vocab for x in w) / len(w)
    if known <= 0.8:
        out.append(f"{known:.0%} of words in the KJV; unknown: {sorted(set(w) - vocab)}")
    pairs = list(zip(w, w[1:]))
    phr = sum(p in bigrams for p in pairs) / len(pairs)
    if phr <= 0.6:
        out.append(f"{phr:.0%} of word pairs occur in the KJV")
    return out


def _greedy(model, tok, prompt: str, n: int = 48) -> str:
    ids = tok.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


# ---- files -----------------------------------------------------------------------------------
def test_spec_points_at_the_checkpoint():
    b = spec.load(SPEC)
    assert b.spec.name == "demo" and b.spec.targets == ["N150", "N300", "T3K"]
    assert b.resolve_path(b.spec.weights.source).resolve() == DEMO
    assert b.resolve_path(b.spec.tokenizer).resolve() == DEMO


def test_checkpoint_architecture_is_the_specs():
    """config.json, imported the way ttbundle imports HF configs, gives the spec's `model:`."""
    b = spec.load(SPEC)
    cfg = json.loads((DEMO / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    ck = b.family.arch_model(**b.family.from_hf(cfg))
    assert ck.hd == b.arch.hd  # config.json spells head_dim out; the spec derives it
    assert ck.model_dump(exclude={"head_dim"}) == b.arch.model_dump(exclude={"head_dim"})


def test_committed_files_are_small_and_complete():
    names = {p.name for p in DEMO.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "README.md"} <= names
    assert sum(p.stat().st_size for p in DEMO.iterdir()) <= MAX_BYTES
    card = (DEMO / "README.md").read_text()
    assert "python scripts/train_demo.py --out bundles/demo" in card
    assert "bible-kjv-text" in card and "public domain" in card


# ---- transformers, offline -------------------------------------------------------------------
def test_loads_with_hub_offline_in_a_fresh_process():
    """As vLLM loads it: plain from_pretrained on the directory, HF_HUB_OFFLINE=1."""
    code = ("import sys, transformers as t; d = sys.argv[1]; tok = t.AutoTokenizer.from_pretrained(d); "
            "m = t.AutoModelForCausalLM.from_pretrained(d); "
            "print(type(tok).__name__, len(tok), type(m).__name__, str(m.dtype))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(DEMO)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["TokenizersBackend", "2048", "LlamaForCausalLM", "torch.bfloat16"]


def test_trained_weights(model, tok):
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == 2048
    # trained: Genesis 1:1-2 costs well under the ln(2048) = 7.6 nats/token of a uniform guess
    ids = torch.tensor([tok.encode("In the beginning God created the heaven and the earth.\nAnd the earth "
                                   "was without form, and void; and darkness was upon the face of the deep.")])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 4.5, loss


def test_tokenizer_round_trips(tok, model):
    assert len(tok) == model.config.vocab_size
    assert tok.bos_token_id == model.config.bos_token_id == 0
    assert tok.eos_token_id == model.config.eos_token_id == 1
    for text in ["In the beginning God created the heaven and the earth.",
                 "And the LORD spake unto Moses, saying,\nSpeak unto the children of Israel;",
                 "  leading spaces, tabs\tand unicode: café, naïve, Ζεύς, 主 — 🙂", "x", ""]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert all(0 <= i < 2048 for i in ids)


def test_chat_template_renders_turns(tok):
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Who made the light?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == ("<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nWho made the light?<|eos|>\n"
                    "<|assistant|>\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    # role markers are single special ids, not spelled out in bytes
    assert tok.convert_tokens_to_ids("<|user|>") in ids and tok.convert_tokens_to_ids("<|assistant|>") in ids


# ---- the emulated mesh on the real weights ---------------------------------------------------
def test_check_t3k_real_weights_identical_greedy_tokens():
    report = run_check(spec.load(SPEC), "T3K", steps=16)
    assert report.dtype == "fp32" and report.steps == 16
    assert report.tokens_agree, report.first_token_divergence
    assert report.passed


# ---- readable output -------------------------------------------------------------------------
def test_greedy_continuation_is_kjv_english(model, tok, kjv):
    text = _greedy(model, tok, "In the beginning")
    words, missing = kjv
    assert _kjv_failures(text, words) == [], text
    if words is None:
        pytest.skip(f"shape checked; dictionary and phrase checks skipped: {missing}")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_measure_rejects_random_weights(tok, kjv, seed):
    """The demo as it was (random weights, `check --random-weights`), with the same tokenizer,
    fails it: the measure tells training from stringing tokens together."""
    from ttbundle import reference

    words, missing = kjv
    if words is None:
        pytest.skip(missing)
    text = _greedy(reference.random_model(spec.load(SPEC), seed), tok, "In the beginning")
    assert _kjv_failures(text, words), text
