"""Speculative decoding (the spec's ``speculative:``): its rules, its verify programs' shape and
the ``--speculative-config`` vLLM gets. One owner for all three (``spec.check`` calls
:func:`check`; ``lower`` and ``plan`` take :func:`verify_rows`; ``serve`` and the platform take
:func:`vllm_config` and :func:`disagreements`).

A decode step with proposals runs a *verify* program instead of the decode program: the batch
padded to a decode bucket ``B``, each sequence's last token and its ``k`` proposals as ``k + 1``
rows (``B x (k + 1)`` rows, padded to a tile), every row's logits back. vLLM's scheduler
schedules the proposals (``scheduled_spec_decode_tokens``) and takes back the rejected ones.
"""

from __future__ import annotations

from .errors import Diagnostic
from .tiles import TILE, round_up

#: methods ttbundle serves (``draft`` is declared in the spec and refused until it is built)
METHODS = ("ngram",)
#: the keys of vLLM's ``--speculative-config`` a package fixes
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def of(bundle):
    """The bundle's ``speculative`` settings, or None."""
    return getattr(bundle.spec, "speculative", None)


def rows_per_seq(bundle) -> int:
    """Rows of one sequence in a verify program: its last token and the k proposals (0: none)."""
    s = of(bundle)
    return 0 if s is None else s.num_speculative_tokens + 1


def verify_rows(bucket: int, k: int) -> int:
    """Rows of the verify program of decode bucket ``bucket`` with ``k`` proposals per sequence,
    padded to a whole tile row (as decode rows are)."""
    return round_up(bucket * (k + 1), TILE)


def verify_buckets(bundle) -> list[int]:
    """The decode buckets that get a verify program (all of them, with ``speculative:``)."""
    return list(bundle.buckets.decode) if of(bundle) is not None else []


def vllm_config(bundle) -> dict | None:
    """vLLM's ``--speculative-config`` for the package (None: no speculation)."""
    s = of(bundle)
    if s is None:
        return None
    return {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens,
            "prompt_lookup_min": s.prompt_lookup_min, "prompt_lookup_max": s.prompt_lookup_max}


def disagreements(package: dict | None, given: dict) -> list[str]:
    """Keys where a ``--speculative-config`` (``given``, as vLLM reads it) differs from the
    package's (``package``, :func:`vllm_config`), as ``key: given X, package Y`` lines."""
    if package is None:
        return ["the package was built without `speculative:` (no verify programs)"]
    out = []
    for k in KEYS:
        if k in given and given[k] is not None and given[k] != package[k]:
            out.append(f"{k}: given {given[k]!r}, package {package[k]!r}")
    return out


def check(b) -> list[Diagnostic]:
    """The mesh-independent rules of ``speculative:`` (called by ``spec.check``)."""
    s = of(b)
    if s is None:
        return []
    at, d = ("speculative",), []
    if s.method not in METHODS:
        d.append(b.locate(at + ("method",), f"method: {s.method} is not implemented yet (ttbundle serves "
                          f"{', '.join(METHODS)}); use `method: ngram`"))
    if s.model is not None and s.method != "draft":
        d.append(b.locate(at + ("model",), "`model:` names a drafting bundle for `method: draft`; "
                          "remove it for `method: ngram`"))
    if s.prompt_lookup_min > s.prompt_lookup_max:
        d.append(b.locate(at + ("prompt_lookup_min",), f"prompt_lookup_min={s.prompt_lookup_min} is above "
                          f"prompt_lookup_max={s.prompt_lookup_max}"))
    if b.spec.task == "embed":
        d.append(b.locate(at, "an embedding bundle (`task: embed`) decodes nothing; remove `speculative:`"))
        return d
    bk, rt = b.buckets, b.spec.runtime
    k = s.num_speculative_tokens
    if bk.decode and bk.prefill:
        top, step = max(bk.decode), max(bk.prefill)
        if top * (k + 1) > step:
            fits = step // top - 1
            d.append(b.locate(at + ("num_speculative_tokens",),
                              f"num_speculative_tokens={k}: the verify program of decode bucket {top} holds "
                              f"{top} x ({k} + 1) = {top * (k + 1)} rows, more than a step's token budget "
                              f"(the largest prefill bucket, {step}); "
                              + (f"use at most {fits}" if fits > 0 else "lower the largest decode bucket")
                              + " or add a larger prefill bucket"))
    if k + 1 >= rt.max_model_len:
        d.append(b.locate(at + ("num_speculative_tokens",), f"num_speculative_tokens={k} leaves no room "
                          f"in max_model_len={rt.max_model_len}"))
    return d
