"""Demo and test packages: a word-level tokenizer and random-weight packages built locally.

Nothing here downloads anything (``HF_HUB_OFFLINE=1`` holds): the tokenizer is built with the
``tokenizers`` library and saved with ``PreTrainedTokenizerFast.save_pretrained``; the weights
are a random instance of the bundle's architecture (``reference.random_model``) saved as HF
safetensors, so transformers loads the same weights the server runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
#: A chat template in the tokenizer (vLLM's chat endpoint and HF's apply_chat_template use it).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def words(n: int) -> list[str]:
    """``n`` distinct pronounceable words: ba, be, ..., zu, then two-syllable ones."""
    syl = [c + v for c in _CONSONANTS for v in _VOWELS]
    out = list(syl)
    for a in syl:
        if len(out) >= n:
            break
        out += [a + b for b in syl]
    if len(out) < n:
        raise ValueError(f"at most {len(out)} demo words")
    return out[:n]


def make_tokenizer(directory: str | Path, vocab_size: int):
    """A word-level tokenizer of exactly ``vocab_size`` ids (special tokens first, then demo
    words), with a chat template; saved into ``directory``. Returns the HF tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIALS):
        raise ValueError(f"vocab_size must exceed {len(SPECIALS)}")
    vocab = {t: i for i, t in enumerate(SPECIALS + words(vocab_size - len(SPECIALS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>", pad_token="<pad>",
                                 additional_special_tokens=SPECIALS[4:])
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(directory))
    return hf


def bundle_yaml(bundle, mesh: str) -> str:
    """The resolved spec of ``bundle`` for a package: weights and tokenizer in the package
    directory, the one target it was built for."""
    d = bundle.spec.model_dump(mode="json", exclude_none=True)
    d.pop("from_hf", None)
    d["model"] = bundle.arch.model_dump(mode="json", exclude_none=True)
    d["weights"]["source"] = "."
    d["tokenizer"] = "."
    d["targets"] = [mesh]
    d["buckets"] = bundle.buckets.model_dump(mode="json", exclude_none=True)
    d.get("sharding", {}).pop("targets", None)
    return yaml.safe_dump(d, sort_keys=False)


def build_package(spec, out_dir: str | Path, mesh: str | None = None, seed: int = 0) -> Path:
    """A package directory from a spec (path, text or Bundle) with random weights.

    Layout as ``packages`` documents; ``out_dir`` is created (it must not exist or be empty)."""
    import torch

    from .. import reference, spec as specmod
    from ..families.base import Family  # noqa: F401  (families register on import)
    from .packages import METADATA, SPEC, write_manifest

    if isinstance(spec, (str, Path)) and Path(str(spec)).suffix in (".yaml", ".yml") and Path(str(spec)).exists():
        bundle = specmod.load(spec)
    elif isinstance(spec, str):
        bundle = specmod.loads(spec, "<spec>")
    else:
        bundle = spec
    mesh = mesh or bundle.spec.targets[0]
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    model = reference.random_model(bundle, seed)
    model.config.eos_token_id = None  # generate() must not stop early: tests compare lengths
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(out), safe_serialization=True)
    make_tokenizer(out, bundle.arch.vocab_size)
    (out / SPEC).write_text(bundle_yaml(bundle, mesh), encoding="utf-8")
    (out / METADATA).write_text(json.dumps({
        "arch": bundle.family.hf_architectures[0],
        "main_class": "ttbundle.runtime.adapter:EmulatedCausalLM"}, indent=2) + "\n")
    write_manifest(out, bundle.spec.name, mesh, bundle.buckets.model_dump(mode="json"),
                   {"dtype": str(torch.float32).removeprefix("torch.")})
    return out
