"""Speculative decoding (the spec's ``speculative:``): its rules, its verify programs' shape and
the ``--speculative-config`` vLLM gets. One owner for all three (``spec.check`` calls
:func:`check`; ``lower`` and ``plan`` take :func:`verify_rows`; the build records :func:`vllm_config`
and :func:`rows_per_seq` in the package (``package.facts``), and ``serve`` and the platform read them
back with :func:`recorded_config` and compare with :func:`disagreements`: nothing after lowering
calls the spec readers here).

``method: draft``: another bundle (``model:``, a spec path relative to this spec) proposes. It
must load and validate, share this bundle's tokenizer (the same vocabulary, token for token),
have decode buckets covering this one's and room for this one's sequences, and split each
target as this one does (``replicas:``: the draft runs beside each replica) (:func:`check_draft`);
the plan counts its weights and KV cache as a line of their own
(:func:`draft_kv_blocks`: its KV region, one full-length sequence per ``max_num_seqs``), and the
build puts its package, with verify programs for its catch-up (:func:`draft_spec_text`), into
this one's (``package.names.DRAFT_DIR``).

A decode step with proposals runs a *verify* program instead of the decode program: the batch
padded to a decode bucket ``B``, each sequence's last token and its ``k`` proposals as ``k + 1``
rows (``B x (k + 1)`` rows, padded to a tile), every row's logits back. vLLM's scheduler
schedules the proposals (``scheduled_spec_decode_tokens``) and takes back the rejected ones.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import Diagnostic, InvalidInput
from .manifest import MANIFEST
from .tiles import TILE, round_up
from . import mesh as meshmod
from .tiles import blocks_per_seq

#: methods ttbundle serves
METHODS = ("ngram", "draft")
#: vLLM's name of each method (``--speculative-config``'s ``method``)
VLLM_METHOD = {"ngram": "ngram", "draft": "draft_model"}
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


def vllm_config(bundle, draft_dir=None) -> dict | None:
    """vLLM's ``--speculative-config`` for the package (None: no speculation). ``draft``:
    vLLM's ``draft_model`` with ``model`` the draft package inside the package (``draft_dir``,
    ``package.names.draft_dir``, when given; vLLM reads its ``config.json``, ttbundle's runner
    runs it)."""
    s = of(bundle)
    if s is None:
        return None
    if s.method == "draft":
        out = {"method": VLLM_METHOD[s.method], "num_speculative_tokens": s.num_speculative_tokens}
        if draft_dir is not None:
            out["model"] = str(Path(draft_dir).absolute())
        return out
    return {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens,
            "prompt_lookup_min": s.prompt_lookup_min, "prompt_lookup_max": s.prompt_lookup_max}


def recorded_config(serving, draft_dir=None) -> dict | None:
    """:func:`vllm_config` as a package recorded it (``serving``: its manifest's
    ``ServingRecord``), with ``model`` the draft package inside it (``draft_dir``) for ``draft``:
    what ``serve`` passes and the platform checks, read from the package, not its spec."""
    cfg = serving.speculative
    if cfg is None:
        return None
    out = dict(cfg)
    if out["method"] == VLLM_METHOD["draft"] and draft_dir is not None:
        out["model"] = str(Path(draft_dir).absolute())
    return out


def draft_path(bundle) -> Path | None:
    """The draft bundle's spec file (``speculative.model``, relative to the spec), or None."""
    s = of(bundle)
    if s is None or s.method != "draft" or s.model is None:
        return None
    return bundle.base_dir / s.model


def draft_spec_text(bundle, text: str) -> str:
    """The draft's spec (``text``, its file's) as the target's build builds it: with
    ``speculative: {method: ngram, num_speculative_tokens: k}`` (this bundle's ``k``) added, which
    gives the draft's package a verify program per decode bucket, ``k + 1`` rows per sequence
    with every row's logits: the draft proposer catches a request up on the tokens the last
    step added and takes its first proposal in one call of it (``runtime.draft``). The draft
    never serves on its own, so nothing else reads that block."""
    import yaml

    data = yaml.safe_load(text)
    data["speculative"] = {"method": "ngram", "num_speculative_tokens": of(bundle).num_speculative_tokens}
    return yaml.safe_dump(data, sort_keys=False)


def draft_kv_blocks(bundle, draft) -> int:
    """The draft's KV blocks on the target's mesh (one owner: the plan counts them, the draft
    proposer allocates them): every one of the target's ``max_num_seqs`` sequences at the
    target's ``max_model_len`` in the draft's blocks, plus vLLM's null block 0."""
    rt = bundle.spec.runtime
    return rt.max_num_seqs * blocks_per_seq(rt.max_model_len, draft.spec.runtime.kv_block_size) + 1


def disagreements(package: dict | None, given: dict) -> list[str]:
    """Keys where a ``--speculative-config`` (``given``, as vLLM reads it) differs from the
    package's (``package``, :func:`vllm_config`), as ``key: given X, package Y`` lines."""
    if package is None:
        return ["the package was built without `speculative:` (no verify programs)"]
    out = []
    for k in KEYS + ("model",):
        if k not in package:
            continue
        if k in given and given[k] is not None and given[k] != package[k]:
            out.append(f"{k}: given {given[k]!r}, package {package[k]!r}")
    return out


def check(b, load=None) -> list[Diagnostic]:
    """The mesh-independent rules of ``speculative:`` (called by ``spec.check``, which passes
    its ``load`` for the draft's spec: :func:`check_draft`)."""
    s = of(b)
    if s is None:
        return []
    at, d = ("speculative",), []
    if s.method not in METHODS:
        d.append(b.locate(at + ("method",), f"method: {s.method} is not implemented yet (ttbundle serves "
                          f"{', '.join(METHODS)}); use `method: ngram`"))
    if s.method == "draft" and s.model is None:
        d.append(b.locate(at + ("method",), "`method: draft` needs `model:`, the drafting bundle's spec "
                          "(a path relative to this spec, e.g. `model: draft.yaml`)"))
    elif s.method == "draft" and load is not None:
        d += check_draft(b, load)
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


def _not_a_spec_file(path: Path) -> str | None:
    """Why ``path`` cannot be a draft's spec file (missing, a directory, a device or FIFO, a name
    the file system refuses), or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such spec file"
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            return "no such spec file (a part of the path is a file)"
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a spec file"
    if not stat.S_ISREG(st.st_mode):
        kind = "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else \
            "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a file"
        return f"is {kind}, not a regular spec file"
    return None


#: draft specs being loaded (a cycle of drafts is refused, not recursed into)
_LOADING: set[str] = set()


def check_draft(b, load) -> list[Diagnostic]:
    """``method: draft``: the draft's spec (``load``: ``spec.load``) loads and validates, has no
    ``speculative:`` of its own, the same vocabulary size and tokenizer (compared token for
    token), decode buckets covering this bundle's, and a ``max_model_len`` at least this one's."""
    at = ("speculative", "model")
    path = draft_path(b)
    why = _not_a_spec_file(path)
    if why:
        return [b.locate(at, f"{path}: {why}; `model:` names the drafting bundle's spec (a YAML file), "
                         "relative to this spec")]
    key = str(path.resolve())
    if key in _LOADING:  # a draft naming its target (or itself) as its draft
        return [b.locate(at, f"{path} is being loaded already: drafts name each other in a cycle; a draft "
                         "has no `speculative:` of its own")]
    _LOADING.add(key)
    try:
        dr = load(path)
    except InvalidInput as e:
        first = "; ".join(str(x) for x in (e.diagnostics or [])[:3]) or e.message
        return [b.locate(at, f"the draft spec {path} is invalid: {first}; fix it there")]
    finally:
        _LOADING.discard(key)
    d = []
    d += _split_differences(b, dr, path, at)
    sd = of(dr)
    built = (path.parent / MANIFEST).is_file()  # a package's draft/: the build wrote its block
    catch_up = ("ngram", of(b).num_speculative_tokens)  # the block draft_spec_text adds
    if sd is not None and not (built and (sd.method, sd.num_speculative_tokens) == catch_up):
        d.append(b.locate(at, f"the draft spec {path} has `speculative:` itself; a draft proposes alone: "
                          "remove it there"))
    if dr.spec.task != "generate":
        d.append(b.locate(at, f"the draft spec {path} is `task: {dr.spec.task}`; a draft generates"))
    va, vd = b.arch.vocab_size, dr.arch.vocab_size
    if va != vd:
        d.append(b.locate(at, f"the draft {dr.spec.name} has vocab_size={vd}, this bundle {va}: a draft "
                          "proposes token ids of the same vocabulary; use a draft of the same tokenizer"))
    else:
        why = _tokenizer_difference(b, dr)
        if why:
            d.append(b.locate(at, f"the draft {dr.spec.name}'s tokenizer differs from this bundle's ({why}); "
                              "use a draft of the same tokenizer"))
    mine, theirs = list(b.buckets.decode), list(dr.buckets.decode)
    if mine and (not theirs or max(theirs) < max(mine)):
        d.append(b.locate(at, f"the draft {dr.spec.name}'s decode buckets {theirs} do not cover this bundle's "
                          f"{mine}: it proposes for up to {max(mine)} sequences at once; add decode bucket "
                          f"{max(mine)} to the draft's spec"))
    k = of(b).num_speculative_tokens
    if theirs and dr.buckets.prefill and max(theirs) * (k + 1) > max(dr.buckets.prefill):
        d.append(b.locate(at, f"the draft {dr.spec.name}'s catch-up program of decode bucket {max(theirs)} holds "
                          f"{max(theirs)} x ({k} + 1) = {max(theirs) * (k + 1)} rows, more than its largest "
                          f"prefill bucket {max(dr.buckets.prefill)}; add a prefill bucket of at least "
                          f"{max(theirs) * (k + 1)} to the draft's spec, or lower num_speculative_tokens"))
    ml, dl = b.spec.runtime.max_model_len, dr.spec.runtime.max_model_len
    if dl < ml:
        d.append(b.locate(at, f"the draft {dr.spec.name} has max_model_len={dl}, below this bundle's {ml}: "
                          f"set the draft's runtime.max_model_len to at least {ml}"))
    return d


def _split_differences(b, dr, path, at) -> list[Diagnostic]:
    """The draft runs beside each replica of the target (its own copy and KV region per lane):
    it must split every target into the same submeshes (``replicas:``) as this bundle, so its
    package is built for the replica's mesh (the plan counts it there, ``plan.make.draft_memory``)."""
    out = []
    for name in dict.fromkeys(list(b.spec.replicas) + list(dr.spec.replicas)):
        target = meshmod.try_resolve(name)
        if target is None:
            continue  # reported at targets by spec.check
        try:
            mine, theirs = (meshmod.replica_mesh(target, x.spec.replicas) for x in (b, dr))
        except InvalidInput:
            continue  # a submesh that does not tile: reported by spec.check
        if (mine.shape, mine.replicas) == (theirs.shape, theirs.replicas):
            continue
        want = f"replicas: {{{name}: {{submesh: [{mine.rows}, {mine.cols}]}}}}" if mine.replicas > 1 \
            else f"no `replicas:` entry for {name}"
        out.append(b.locate(at, f"the draft {dr.spec.name} runs {name} as {theirs.describe()}, this bundle as "
                            f"{mine.describe()}: the draft runs beside each replica, on the same submesh; "
                            f"give the draft spec {path} {want}"))
    return out


def _tokenizer_difference(b, dr) -> str | None:
    """Why two bundles' tokenizers differ (None: the same vocabulary, token for token; or both
    serve token ids only)."""
    try:
        ta, td = b.tokenizer_dir(), dr.tokenizer_dir()
    except (InvalidInput, OSError):
        return None  # the paths' own checks say what is missing
    if ta is None and td is None:
        return None
    if (ta is None) != (td is None):
        return "one of them has `tokenizer: false`"
    va, vd = _vocab(ta), _vocab(td)
    if va is None or vd is None:
        return None if va is vd else f"no tokenizer in {ta if va is None else td}"
    if va == vd:
        return None
    diff = sorted((t for t in va.keys() | vd.keys() if va.get(t) != vd.get(t)),
                  key=lambda t: min(x for x in (va.get(t), vd.get(t)) if x is not None))
    return f"{len(diff)} token(s) with another id, e.g. " + ", ".join(
        f"{t!r}: {va.get(t, 'none')} here, {vd.get(t, 'none')} in the draft" for t in diff[:3])


def _vocab(d: Path) -> dict | None:
    """A tokenizer directory's vocabulary (token -> id, added tokens included): ``tokenizer.json``
    through the ``tokenizers`` library, else transformers' tokenizer."""
    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True)
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(d)).get_vocab()
    except Exception:  # noqa: BLE001 - no loadable tokenizer there
        return None
