"""Embedding bundles (``task: embed``): which families can pool, the spec rules, and what
``init`` reads from a sentence-transformers checkpoint.

An embedding bundle is a model whose prompts are prefilled and whose final hidden states (after
the model's final norm) are pooled into one vector per prompt (``Embedding.pooling``: the last
token's, the mean, or the first token's) and optionally L2-normalized, as sentence-transformers'
``Pooling`` and ``Normalize`` modules do. It runs prefill programs only: no decode bucket, and a
KV pool for one ``max_model_len`` prefill (``kvpool.choose_pool``). vLLM serves it with its pooling
runner (``--runner pooling``, ``/v1/embeddings``); the plugin's side is ``runtime/pooling.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import Diagnostic, InvalidInput
from .fsutil import read_user_json

#: families whose packages ttbundle can serve as embedding models, with the pooling their published
#: embedding checkpoints use: Qwen3-Embedding, and e5-mistral-7b-instruct / SFR-Embedding-Mistral
#: (causal attention, last token, normalized). Embedders of other families that attend both ways
#: (gte-Qwen2, LLM2Vec, NV-Embed) would need a non-causal prefill program and are not listed.
POOLING_FAMILIES = {"qwen3": "last", "mistral": "last"}

#: sentence-transformers' pooling_mode_* flags -> ``Embedding.pooling``
ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def check(b) -> list[Diagnostic]:
    """The mesh-independent rules of ``task`` and ``embedding`` (called by ``spec.check``)."""
    s, d = b.spec, []
    if s.task != "embed":
        if s.embedding is not None:
            d.append(b.locate(("embedding",), "`embedding:` applies to `task: embed` only; add "
                              "`task: embed` or remove `embedding:`"))
        return d
    fam = b.arch.family
    if fam not in POOLING_FAMILIES:
        d.append(b.locate(("task",), f"task: embed: family {fam} has no pooling support in ttbundle "
                          f"(embedding bundles: {', '.join(sorted(POOLING_FAMILIES))}); use "
                          "`task: generate`"))
    if s.buckets is not None and s.buckets.decode and "decode" in s.buckets.model_fields_set:
        d.append(b.locate(("buckets", "decode"), f"decode buckets {s.buckets.decode} are meaningless "
                          "for `task: embed`: an embedding is one prefill, nothing is decoded; remove "
                          "`decode:` (or write `decode: []`)"))
    if s.replicas:
        d.append(b.locate(("replicas",), "task: embed is served by one replica per engine (no lanes); "
                          "remove `replicas:` or use vLLM's --data-parallel-size"))
    return d


def sentence_transformers_pooling(hf_dir: Path) -> dict | None:
    """``{"pooling": ..., "normalize": ...}`` from a sentence-transformers checkpoint's
    ``modules.json`` (its ``Pooling`` module's folder, e.g. ``1_Pooling/config.json``, and whether a
    ``Normalize`` module follows), or None when ``hf_dir`` is not one. A pooling mode ttbundle does
    not have (max, weighted mean, ...) is InvalidInput naming it."""
    modules = Path(hf_dir) / "modules.json"
    if not modules.is_file():
        return None
    mods = read_user_json(modules, "modules.json", inside=Path(hf_dir))
    if not isinstance(mods, list):
        return None
    types = [str(m.get("type", "")) for m in mods if isinstance(m, dict)]
    pool = next((m for m in mods if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if pool is None:
        return None
    cfg_file = Path(hf_dir) / str(pool.get("path") or "1_Pooling") / "config.json"
    cfg = read_user_json(cfg_file, "pooling config.json", inside=Path(hf_dir)) if cfg_file.is_file() else {}
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    modes = [ST_MODES[k] for k in on if k in ST_MODES]
    if len(on) != 1 or len(modes) != 1:
        raise InvalidInput(f"{cfg_file}: pooling {', '.join(on) or 'none'}: ttbundle pools one of "
                         f"{', '.join(sorted(ST_MODES))}")
    return {"pooling": modes[0], "normalize": any(t.endswith(".Normalize") for t in types)}


def pooling_config_json(embedding) -> str:
    """vLLM's ``--pooler-config`` for an ``Embedding`` (sequence pooling type and activation)."""
    kind = {"last": "LAST", "mean": "MEAN", "cls": "CLS"}[embedding.pooling]
    return json.dumps({"seq_pooling_type": kind, "use_activation": embedding.normalize}, separators=(",", ":"))


def init_task(hf_dir: Path, family: str, task: str | None) -> tuple[dict | None, str]:
    """What ``ttbundle init`` writes for ``task`` (``--task``; None: detected): the
    ``embedding:`` values of an embedding bundle and why, or (None, "") for a generative one."""
    if task not in (None, "generate", "embed"):
        raise InvalidInput(f"--task {task!r}: one of generate, embed")
    if task == "generate":
        return None, ""
    found = sentence_transformers_pooling(hf_dir)
    if task is None and found is None:
        return None, ""
    if family not in POOLING_FAMILIES:
        why = "--task embed" if task == "embed" else f"{hf_dir}/modules.json (a sentence-transformers model)"
        raise InvalidInput(f"{why}: family {family} has no pooling support in ttbundle (embedding bundles: "
                           f"{', '.join(sorted(POOLING_FAMILIES))}); pass --task generate to import it as a "
                           "language model")
    if found is not None:
        return found, (f"from {hf_dir}/modules.json: sentence-transformers pooling {found['pooling']}"
                       f"{', normalized' if found['normalize'] else ''}")
    return {"pooling": POOLING_FAMILIES[family], "normalize": True}, (
        f"--task embed: {family}'s embedding models' pooling ({POOLING_FAMILIES[family]}, normalized)")


def serve_args(bundle, extra: list[str]) -> list[str]:
    """vLLM arguments ``ttbundle serve`` adds for an embedding package (unless ``extra`` gives them);
    here, beside the pooler config it writes, so that ``serve`` reads them without importing the
    plugin (torch and vLLM: seconds before a refusal that needs neither)."""
    if getattr(bundle.spec, "task", "generate") != "embed":  # the launcher's spec (before a package is opened)
        return []
    out = []
    if not any(a == "--runner" or a.startswith("--runner=") for a in extra):
        out += ["--runner", "pooling"]
    if not any(a == "--pooler-config" or a.startswith("--pooler-config=") for a in extra):
        out += ["--pooler-config", pooling_config_json(bundle.embedding)]
    return out
