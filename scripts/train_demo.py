"""Train the demo bundle's model: a 4-layer Llama on the King James Bible, from scratch, on CPU.

    apt-get install -y bible-kjv-text        # the text (public domain) and its reader, `bible`
    python scripts/train_demo.py --out bundles/demo

Steps: (1) the KJV text from Debian's bible-kjv-text (31,102 verses; references stripped, one
verse per line, one document per chapter); (2) a byte-level BPE tokenizer of 2,048 ids with
chat special tokens and a chat template, saved with ``PreTrainedTokenizerFast.save_pretrained``
(loads under ``HF_HUB_OFFLINE=1``); (3) ``LlamaForCausalLM`` with bundles/demo.yaml's dims,
trained from scratch (AdamW, warmup + cosine, 256-token sequences, seeded) for a fixed number
of steps; (4) ``save_pretrained`` as bf16 safetensors, a model card, then greedy and sampled
continuations from the saved checkpoint.

Deterministic for a given torch build and thread count (``--threads``; CPU reductions split
differently with another count).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Debian's bible-kjv-text: a compressed text (format "EC02") that its reader `bible` (package
# bible-kjv, a Recommends of bible-kjv-text) decompresses.
KJV_DATA = Path("/usr/lib/bible.data")
KJV_RANGE = "Gen1:1-Rev22:21"
KJV_VERSES = 31102
VERSE_LINE = re.compile(r"^(?P<book>[1-3]?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.+)$")

# bundles/demo.yaml's `model:` (tests/test_demo_model.py checks they agree)
DIMS = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)

BOS, EOS, SYSTEM, USER, ASSISTANT = "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"
SPECIALS = [BOS, EOS, SYSTEM, USER, ASSISTANT]  # ids 0..4
#: One turn: ``<|role|>\n{content}<|eos|>\n``; the reply follows ``<|assistant|>\n`` and ends at <|eos|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PROMPTS = ["In the beginning", "And the LORD said unto Moses", "Blessed are the", "The LORD is my shepherd"]
CHAT_PROMPT = "And God said, Let there be light: and there was light."


class Missing(RuntimeError):
    pass


# ---- (1) text ------------------------------------------------------------------------------------
def kjv_verses(data: Path = KJV_DATA) -> list[tuple[str, int, int, str]]:
    """All verses as ``(book, chapter, verse, text)``, in canonical order."""
    if not data.is_file():
        raise Missing(f"{data} not found: the King James Bible comes from Debian's bible-kjv-text; "
                      "run `apt-get install -y bible-kjv-text`")
    if shutil.which("bible") is None:
        raise Missing(f"{data} is compressed and its reader `bible` is missing; run "
                      "`apt-get install -y bible-kjv` (apt installs it with bible-kjv-text unless "
                      "--no-install-recommends)")
    # -f turns pretty-printing off: one "Ge1:1 text" line per verse; -p: only the package's file
    out = subprocess.run(["bible", "-f", "-p", str(data.parent), "-d", data.name, KJV_RANGE],
                         capture_output=True, text=True, check=True, cwd="/").stdout
    verses = []
    for n, line in enumerate(out.splitlines(), 1):
        m = VERSE_LINE.match(line)
        if m is None:
            raise RuntimeError(f"bible output line {n} is not `RefC:V text`: {line[:80]!r}")
        verses.append((m["book"], int(m["chapter"]), int(m["verse"]), clean(m["text"])))
    if len(verses) != KJV_VERSES:
        raise RuntimeError(f"expected {KJV_VERSES} verses from `bible {KJV_RANGE}`, got {len(verses)}")
    return verses


def clean(text: str) -> str:
    return " ".join(text.split())


def chapters(verses) -> list[list[str]]:
    """Verse texts grouped by chapter, in order (1,189 chapters)."""
    out: list[list[str]] = []
    key = None
    for book, ch, _, text in verses:
        if (book, ch) != key:
            out.append([])
            key = (book, ch)
        out[-1].append(text)
    return out


def words(text: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[A-Za-z]+", text)]


def kjv_words(verses) -> set[str]:
    """The text's lower-cased words (the tests' dictionary)."""
    return {w for *_, t in verses for w in words(t)}


def kjv_bigrams(verses) -> set[tuple[str, str]]:
    """Pairs of lower-cased words adjacent within a verse (the tests' phrase list)."""
    out: set = set()
    for *_, t in verses:
        w = words(t)
        out.update(zip(w, w[1:]))
    return out


# ---- (2) tokenizer -------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=DIMS["vocab_size"], min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != DIMS["vocab_size"]:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, the model {DIMS['vocab_size']}")
    # encode() starts every text with <|bos|>, as every training chapter starts
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                 extra_special_tokens=[SYSTEM, USER, ASSISTANT], chat_template=CHAT_TEMPLATE,
                                 clean_up_tokenization_spaces=False, model_max_length=1024)
    hf.save_pretrained(out)
    return hf


# ---- (3) data and model --------------------------------------------------------------------------
def token_stream(tok, chs: list[list[str]], chat_pairs: int, rng: random.Random) -> list[int]:
    """Documents in a seeded random order, concatenated: each chapter as ``<|bos|>`` + verses
    joined by newlines + ``<|eos|>``; and ``chat_pairs`` one-turn chats (a verse, then the next
    verse as the reply) rendered by the chat template, so chat requests get a verse and stop."""
    enc = tok.backend_tokenizer.encode  # as tok.encode (with <|bos|>), without its max-length warning
    docs = [enc("\n".join(c)).ids + [tok.eos_token_id] for c in chs]
    pairs = [(c[i], c[i + 1]) for c in chs for i in range(len(c) - 1)]
    for u, a in rng.sample(pairs, chat_pairs):
        text = tok.apply_chat_template([{"role": "user", "content": u}, {"role": "assistant", "content": a}],
                                       tokenize=False)
        docs.append(enc(text, add_special_tokens=False).ids)
    rng.shuffle(docs)
    return [t for d in docs for t in d]


def make_model(tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**DIMS, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg).to(torch.float32)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))  # cosine to 10% of peak


def train(model, train_ids, val_ids, args) -> dict:
    import torch

    seq = args.seq_len
    n = (len(train_ids) - 1) // seq
    data = torch.tensor(train_ids[: n * seq + 1])
    windows = torch.arange(n) * seq  # start of each [seq+1] window (inputs and shifted labels)
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(n, generator=g)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    t0, pos, epoch, ema = time.perf_counter(), 0, 0, None
    for step in range(args.steps):
        if pos + args.batch > n:
            order, pos, epoch = torch.randperm(n, generator=g), 0, epoch + 1
        idx = windows[order[pos: pos + args.batch]]
        pos += args.batch
        batch = torch.stack([data[i: i + seq + 1] for i in idx.tolist()])  # [B, seq+1]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = _loss(model, batch, bf16=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.perf_counter() - t0
            print(f"step {step:5d}/{args.steps}  loss {loss.item():.3f}  (avg {ema:.3f})  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  epoch {epoch}  {el:6.0f}s", flush=True)
    train_s = time.perf_counter() - t0
    return {"train_seconds": round(train_s), "final_loss": round(ema, 3), "last_batch_loss": round(loss.item(), 3),
            "val_loss": round(evaluate(model, val_ids, seq), 3), "epochs": round(args.steps * args.batch / n, 2),
            "tokens_seen": args.steps * args.batch * seq, "train_tokens": len(train_ids)}


def _loss(model, batch, bf16: bool = False):
    """Mean next-token cross-entropy of ``batch`` [B, seq+1]; ``bf16``: matmuls in bf16 (CPU
    autocast; fp32 master weights), about 1.5x faster on CPUs with AMX/AVX512-BF16."""
    import torch
    import torch.nn.functional as F

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=batch[:, :-1]).logits  # [B, seq, V]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def evaluate(model, ids: list[int], seq: int) -> float:
    """Mean next-token loss (nats) over the held-out chapters, in whole windows."""
    import torch

    model.eval()
    n = (len(ids) - 1) // seq
    data = torch.tensor(ids[: n * seq + 1])
    losses = []
    with torch.no_grad():
        for i in range(0, n, 16):
            batch = torch.stack([data[j * seq: j * seq + seq + 1] for j in range(i, min(n, i + 16))])
            losses.append(_loss(model, batch).item() * len(batch))
    return sum(losses) / n


# ---- (4) samples and model card ------------------------------------------------------------------
def samples(directory: Path, seed: int) -> dict:
    """Greedy and sampled continuations from the saved checkpoint (as transformers loads it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True).eval()
    out: dict = {"greedy": {}, "sampled": {}, "chat": None}

    def gen(ids, **kw):
        with torch.no_grad():
            o = model.generate(torch.tensor([ids]), max_new_tokens=48, pad_token_id=tok.eos_token_id, **kw)
        return tok.decode(o[0, len(ids):], skip_special_tokens=True)

    for p in PROMPTS:
        out["greedy"][p] = p + gen(tok.encode(p), do_sample=False)
        torch.manual_seed(seed)
        out["sampled"][p] = p + gen(tok.encode(p), do_sample=True, temperature=0.8, top_p=0.95, top_k=0)
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True,
                                   tokenize=False)
    out["chat"] = {"user": CHAT_PROMPT, "assistant": gen(tok.encode(chat, add_special_tokens=False),
                                                         do_sample=False)}
    return out


def model_card(args, stats: dict, ex: dict, n_params: int) -> str:
    cmd = "python scripts/train_demo.py --out bundles/demo" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in sorted(vars(args).items())
        if k != "out" and v != DEFAULTS[k])
    greedy = "\n".join(f"- `{t}`" for t in (_one_line(s) for s in ex["greedy"].values()))
    sampled = "\n".join(f"- `{t}`" for t in (_one_line(s) for s in ex["sampled"].values()))
    d = DIMS
    return f"""---
license: other
license_name: public-domain-text-and-locally-trained-weights
language: [en]
library_name: transformers
pipeline_tag: text-generation
---
# ttbundle demo: a tiny Llama trained on the King James Bible

The model behind `bundles/demo.yaml`, the bundle the README's main command builds and serves.
It writes KJV-flavoured English; it knows nothing else and is not meant to be useful beyond
showing that served output is readable and matches Hugging Face transformers.

## Model
`LlamaForCausalLM`, {n_params / 1e6:.2f} M parameters: hidden {d['hidden_size']}, {d['num_hidden_layers']} layers,
{d['num_attention_heads']} heads, {d['num_key_value_heads']} KV heads, intermediate {d['intermediate_size']},
vocab {d['vocab_size']} (byte-level BPE), untied LM head. Trained on sequences of {args.seq_len} tokens:
quality degrades past that length although the config allows {d['max_position_embeddings']}.
Stored as bf16 safetensors (trained with fp32 master weights and bf16 autocast).

Special tokens: `<|bos|>` (0, added by `encode`), `<|eos|>` (1, ends a chapter and a chat turn;
the generation stop token), `<|system|>`, `<|user|>`, `<|assistant|>`. The chat template renders
each turn as `<|role|>\\n{{content}}<|eos|>\\n`; the model was shown one-turn chats whose reply is
the verse that follows the user's verse.

## Data and license
The King James Version (1611) of the Bible from Debian's `bible-kjv-text` package
(`{KJV_DATA}`, read with its `bible` reader): {KJV_VERSES:,} verses, verse references
stripped, one verse per line, one document per chapter. The text is in the public domain.
The weights and tokenizer were trained from scratch by `scripts/train_demo.py` in this
repository; no other model or data was used.

Held out: {args.val_chapters} randomly chosen chapters (validation). Training stream:
{stats['train_tokens']:,} tokens, of which {args.chat_pairs:,} one-turn chats.

## Training
```
apt-get install -y bible-kjv-text
{cmd}
```
bf16 autocast (fp32 master weights), AdamW (lr {args.lr}, betas 0.9/0.95, weight decay {args.weight_decay}, grad clip 1.0),
{args.warmup} warmup steps then cosine decay to 10%, {args.steps} steps of {args.batch} x {args.seq_len} tokens
({stats['tokens_seen']:,} tokens, {stats['epochs']} epochs), seed {args.seed}, torch threads: {args.threads}.
The training loop took {stats['train_seconds']} s ({stats['train_seconds'] / 60:.1f} min), the whole
script {stats['total_seconds']} s ({stats['total_seconds'] / 60:.1f} min), on the machine it was made on
(2 CPU cores shared with other jobs, Xeon with AMX; torch {stats['torch']}, transformers
{stats['transformers']}, tokenizers {stats['tokenizers']}). The run is deterministic for a given torch
build and thread count; `training.json` records the arguments and numbers of this run.

Final training loss {stats['final_loss']} nats/token (moving average over the last steps);
held-out loss {stats['val_loss']} nats/token (bf16 weights as saved: {stats['val_loss_bf16']}).

## Samples (from the saved checkpoint, 48 new tokens)
Greedy decoding of a model this small soon repeats a phrase; sampling reads better.

Greedy:
{greedy}

Sampled (temperature 0.8, top-p 0.95, torch seed {args.seed}):
{sampled}

Chat (greedy): user `{ex['chat']['user']}` -> assistant `{_one_line(ex['chat']['assistant'])}`
"""


def _one_line(s: str) -> str:
    return s.replace("\n", " / ").replace("`", "'")


# ---- main ----------------------------------------------------------------------------------------
# One thread: on 2 shared cores a second thread waits on the busy one more than it helps.
DEFAULTS = dict(seed=0, threads=1, steps=1200, batch=8, seq_len=256, lr=2e-3, warmup=50,
                weight_decay=0.1, chat_pairs=2000, val_chapters=24, log_every=50)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory (e.g. bundles/demo)")
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    args = ap.parse_args(argv)

    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(args.seed)
    t_start = time.perf_counter()

    try:
        verses = kjv_verses()
    except Missing as e:
        print(f"[error] {e}", file=sys.stderr)
        return 1
    chs = chapters(verses)
    val_idx = set(rng.sample(range(len(chs)), args.val_chapters))
    train_chs = [c for i, c in enumerate(chs) if i not in val_idx]
    val_chs = [c for i, c in enumerate(chs) if i in val_idx]
    print(f"KJV: {len(verses):,} verses, {len(chs):,} chapters ({len(val_chs)} held out)")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():  # a fresh checkpoint: no file of an older run survives
        if f.is_file():
            f.unlink()
    tok = train_tokenizer(["\n".join(c) for c in train_chs], out)
    train_ids = token_stream(tok, train_chs, args.chat_pairs, rng)
    val_ids = [t for c in val_chs for t in tok.backend_tokenizer.encode("\n".join(c)).ids + [tok.eos_token_id]]
    print(f"tokenizer: {len(tok)} ids; {len(train_ids):,} training tokens, {len(val_ids):,} held out "
          f"({sum(len(t) for *_, t in verses) / (len(train_ids) + len(val_ids)):.2f} chars/token)")

    model = make_model(tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters; {args.steps} steps of {args.batch} x {args.seq_len}")
    stats = train(model, train_ids, val_ids, args)
    model.eval()
    model.generation_config.do_sample = False
    model.generation_config.max_length = None
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    stats["val_loss_bf16"] = round(evaluate(model.float(), val_ids, args.seq_len), 3)
    stats.update(torch=torch.__version__, transformers=transformers.__version__, tokenizers=tokenizers.__version__)

    ex = samples(out, args.seed)
    stats["total_seconds"] = round(time.perf_counter() - t_start)
    (out / "README.md").write_text(model_card(args, stats, ex, n_params))
    (out / "training.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"},
                                                   **stats}, indent=2) + "\n")
    print(json.dumps(stats, indent=2))
    for kind in ("greedy", "sampled"):
        print(f"\n{kind}:")
        for s in ex[kind].values():
            print(f"  {_one_line(s)}")
    print(f"\nchat: {ex['chat']['user']}\n   -> {_one_line(ex['chat']['assistant'])}")
    print(f"\nwrote {out} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
