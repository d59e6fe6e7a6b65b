"""A tiny package whose tokenizer can spell JSON (byte-level BPE) and whose chat template renders
tools, for the structured-output and tool-call tests (``test_runtime_structured.py``).

The demo tokenizer (``serving.demo``) is word-level: it cannot spell ``{`` or ``"``, so no JSON
grammar could ever be satisfied with it. This one covers every byte, as GPT-2/Qwen's do, so
vLLM's grammar backend (xgrammar) builds a bitmask over it like over a real model's."""

from __future__ import annotations

import contextlib
from pathlib import Path

import yaml

from runtime_helpers import TINY_ARCH

VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>"]
#: as Qwen's tokenizers have them: added tokens that are not special (they stay in the text)
TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
#: Hermes/Qwen style: tools listed in the system turn, a call is <tool_call>{json}</tool_call>
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>You may call one of these functions:"
    "{% for t in tools %} {{ t | tojson }}{% endfor %}"
    " Answer with <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call><|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NAME = "tiny-tools"
MAX_MODEL_LEN = 512


def _corpus() -> list[str]:
    from ttbundle.serving.demo import words

    w = words(400)
    json_bits = ['{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"color": "red"}',
                 '[{"name": "x", "parameters": {}}]', '"type": "object", "properties": {}, "required": []',
                 '"enum": ["red", "green", "blue"]', "true false null 0123456789"]
    return [" ".join(w[i:i + 20]) for i in range(0, len(w), 20)] + json_bits * 4


def make_tokenizer(directory: str | Path):
    """Byte-level BPE of exactly ``VOCAB`` ids (specials, the 256 bytes, merges, then
    ``TEXT_TOKENS``) with a chat template that renders tools; saved into ``directory``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(TEXT_TOKENS), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TEXT_TOKENS])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", additional_special_tokens=SPECIALS[4:])
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(directory))
    return hf


def spec_text() -> str:
    return yaml.safe_dump({
        "name": NAME,
        "description": "tiny random qwen3 with a byte-level tokenizer, for structured output and tools",
        "model": dict(TINY_ARCH["qwen3"], vocab_size=VOCAB),
        "targets": ["N150"],
        "buckets": {"prefill": [32, 64, 128], "decode": [1, 2, 4, 8], "prefill_chunk": 128},
        "runtime": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8},
    }, sort_keys=False)


def build(out_dir: Path, mesh: str = "N150") -> tuple[Path, Path]:
    """The package (random weights, this tokenizer) and its source checkpoint."""
    from ttbundle import reference
    from ttbundle import spec as specmod
    from ttbundle.build import build as build_package
    from ttbundle.serving.demo import spec_with_source

    out = Path(out_dir).absolute()
    src = out / f"src-{NAME}"
    text = spec_text()
    if not (src / "config.json").exists():
        reference.save_random(specmod.loads(text, "<spec>"), src, 0, eos=False)
        make_tokenizer(src)
    spec_file = out / f"{NAME}.yaml"
    spec_file.write_text(spec_with_source(text, src), encoding="utf-8")
    res = build_package(specmod.load(spec_file), mesh, out)
    return Path(res.package), src


@contextlib.contextmanager
def served(out: Path, extra: list[str]):
    """The package built into ``out/packages`` and served (``runtime_helpers.serving``, vLLM's
    arguments ``extra``) from ``out/serve``: yields (serve plan, serve directory, checkpoint)."""
    from runtime_helpers import serving

    pkg, src = build(out / "packages")
    d = out / "serve"
    d.mkdir()
    with serving(pkg, d, extra=extra) as plan:
        yield plan, d, src
