"""Demo and test packages: a word-level tokenizer and random-weight packages built locally.

Nothing here downloads anything (``HF_HUB_OFFLINE=1`` holds): the tokenizer is built with the
``tokenizers`` library and saved with ``PreTrainedTokenizerFast.save_pretrained``; the weights
are a random instance of the bundle's architecture (``reference.random_model``) saved as HF
safetensors, then ``ttbundle build`` makes the package, so transformers (on the checkpoint)
and the server (on the package) run the same numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import yaml

from .. import __version__, reference, spec as specmod
from ..build import build
from ..manifest import MANIFEST, METADATA
from ..package.names import module_name, safe_name
from ..package.templates import metadata_json, render_adapter
from ..package.verify import read_manifest

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
#: A chat template in the tokenizer (vLLM's chat endpoint and HF's apply_chat_template use it).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def words(n: int) -> list[str]:
    """``n`` distinct pronounceable words: ba, be, ..., zu, then two-, three-syllable ones."""
    syl = [c + v for c in _CONSONANTS for v in _VOWELS]
    out, level = list(syl), list(syl)
    while len(out) < n:
        level = [a + b for a in level for b in syl]
        out += level
    return out[:n]


def make_tokenizer(directory: str | Path, vocab_size: int, part=None):
    """A word-level tokenizer of exactly ``vocab_size`` ids (special tokens first, then demo
    words), with a chat template; saved into ``directory``. With ``part`` (a multimodal arch's
    vision part, ``Family.vision_part``) the image tokens take their ids (its
    ``TOKENIZER_TOKENS``: role -> (text, id field)) and its chat template, if it has one, is the
    tokenizer's. Returns the HF tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIALS):
        raise ValueError(f"vocab_size must exceed {len(SPECIALS)}")
    names = SPECIALS + words(vocab_size - len(SPECIALS))
    extra, newlines = {}, []
    vision = None if part is None else part.v
    if vision is not None:
        for role, (text, field) in part.TOKENIZER_TOKENS.items():
            names[getattr(vision, field)] = text
            extra[role] = text
    if vision is not None and part.NEWLINE_TOKENS:
        # vLLM's Gemma 3 processor puts "\n\n" around each image and merges newline runs by
        # their tokens (Gemma's vocabulary has 1-4 newlines as tokens): the top free ids. A
        # single "\n" stays whitespace in text (the chat's separator between two images'
        # placeholders), so two images' "\n\n" runs merge and split back symmetrically
        used = {getattr(vision, f) for _, f in part.TOKENIZER_TOKENS.values()}
        free = [i for i in range(vocab_size - 1, len(SPECIALS) - 1, -1) if i not in used][:4]
        for k, i in enumerate(free):
            names[i] = "\n" * (k + 1)
            newlines.append(names[i])
    vocab = {t: i for i, t in enumerate(names)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>", pad_token="<pad>",
                                 additional_special_tokens=SPECIALS[4:] + list(extra.values()),
                                 **({"extra_special_tokens": extra} if extra else {}))
    if newlines:
        from tokenizers import AddedToken
        hf.add_tokens([AddedToken(t, normalized=False, special=False) for t in newlines[1:]])
    hf.chat_template = (part is not None and part.CHAT_TEMPLATE) or CHAT_TEMPLATE
    hf.save_pretrained(str(directory))
    return hf


def make_source(bundle, directory: str | Path, seed: int = 0) -> Path:
    """A Hugging Face checkpoint of ``bundle``'s architecture with random weights rounded to
    bf16 (what packages store, so transformers and the package hold the same numbers), plus the
    demo tokenizer. ``config.json`` has no eos_token_id: ``generate`` runs to max_new_tokens."""
    out = reference.save_random(bundle, directory, seed, eos=False)
    make_tokenizer(out, bundle.arch.vocab_size, bundle.family.vision_part(bundle.arch))
    return out


def spec_with_source(spec_text: str, source: str | Path) -> str:
    """``spec_text`` with ``weights.source`` and ``tokenizer`` set to ``source``."""
    d = yaml.safe_load(spec_text)
    d.pop("from_hf", None)
    d.setdefault("weights", {})["source"] = str(source)
    d["tokenizer"] = str(source)
    return yaml.safe_dump(d, sort_keys=False)


def build_package(spec_text: str, out_dir: str | Path, mesh: str, seed: int = 0, backend: str = "emulated",
                  warmup: bool = True) -> Path:
    """Random weights for the spec's architecture, then ``ttbundle build`` for ``mesh``: the
    package directory (``out_dir/<mesh>/<name>``). The checkpoint stays in ``out_dir/src-<name>``
    (the reference for tests) and the spec in ``out_dir/<name>.yaml``."""
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    bundle = specmod.loads(spec_text, "<spec>")
    src = out / f"src-{bundle.spec.name}"
    if not (src / "config.json").exists():
        make_source(bundle, src, seed)
    spec_file = out / f"{bundle.spec.name}.yaml"
    spec_file.write_text(spec_with_source(spec_text, src), encoding="utf-8")
    res = build(specmod.load(spec_file), mesh, out, backend=backend, warmup=warmup)
    return Path(res.package)


#: The smallest useful package (1-layer Llama, vocab 128): what registry tests and benches clone.
SMALL_SPEC = """\
name: reg
model:
  family: llama
  vocab_size: 128
  hidden_size: 64
  intermediate_size: 128
  num_hidden_layers: 1
  num_attention_heads: 2
  num_key_value_heads: 1
  max_position_embeddings: 256
targets: [N150, N300]
buckets: {prefill: [32], decode: [1]}
runtime: {max_model_len: 32, max_num_seqs: 1}
"""


def clone_package(src: str | Path, dst: str | Path, name: str) -> Path:
    """A copy of package ``src`` at ``dst`` renamed to bundle ``name``: a valid package (its
    manifest lists every file with its size and sha256) for registry tests and benches. Files
    that do not depend on the name are hard links to ``src``'s (no extra disk); the spec, the
    adapter module, ``vllm_metadata.json`` and the manifest are rewritten."""
    src, dst = Path(src), Path(dst)
    m = read_manifest(src)
    mesh, arch = m["mesh"]["name"], m["arch"]
    old_mod = m["main_class"].split(":")[0]
    mod = module_name(safe_name(name, "bundle name"), mesh)
    shutil.copytree(src, dst, copy_function=os.link)
    os.unlink(dst / f"{old_mod}.py")
    new = {
        f"{mod}.py": render_adapter(name, mesh, arch, arch, __version__).encode(),
        METADATA: metadata_json(arch, f"{mod}:{arch}").encode(),
        "bundle.yaml": (src / "bundle.yaml").read_text(encoding="utf-8").replace(
            f"\nname: {m['bundle']}\n", f"\nname: {name}\n", 1).encode(),
    }
    files = dict(m["files"])
    files.pop(f"{old_mod}.py")
    for rel, data in new.items():
        if (dst / rel).exists():
            os.unlink(dst / rel)  # a hard link into ``src``: never write through it
        (dst / rel).write_bytes(data)
        files[rel] = {**files.get(rel, {}), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    m.update(bundle=name, main_class=f"{mod}:{arch}", files=files)
    os.unlink(dst / MANIFEST)
    (dst / MANIFEST).write_text(json.dumps(m, indent=2) + "\n", encoding="utf-8")
    return dst
