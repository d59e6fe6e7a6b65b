"""`ttbundle init`: a commented, valid bundle spec from a Hugging Face ``config.json``.

``init_spec(hf_dir, output, ...)`` maps the config with :func:`spec.hf_config_to_arch`, writes the
family's default sharding plan and buckets out explicitly (buckets adjusted to the requested
limits), renders ``templates/spec.yaml.j2``, checks that the text loads with :func:`spec.loads`
and that the plan resolves on every target, and only then writes it atomically. Values reach the
template already rendered as YAML (``yaml.safe_dump``) and comments already sanitised, so a
strange directory name can neither break the YAML nor inject keys.
"""

from __future__ import annotations

import os
import re
import shlex
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from . import families, hub, mesh as meshmod, spec as specmod
from .plan.advice import fixes
from .plan.make import Plan, make_plan
from .plan.memory import shortfall
from .plan.sharding import replicate_undividable
from .errors import Diagnostic, InvalidInput, TTBundleError
from .families.base import GROUPS
from .fsutil import TEMPLATE_DIR, read_user_json, write_text_atomic
from .embed import init_task
from .errors import DoesNotFit
from .package.names import TOKENIZER_MODEL_FILES, has_tokenizer as makes_one
from .report import human

TEMPLATE = "spec.yaml.j2"
DEFAULT_MESH = "N150"
MAX_MODEL_LEN_CAP = 8192  # default max_model_len: min(max_position_embeddings, this)
WEIGHT_DTYPES = ("bf16", "bfp8", "bfp4")
COMMENT_WIDTH = 96
# Tried in order when the family default plan does not divide a target's mesh axes.
SHARDING_FALLBACKS: tuple[dict[str, str], ...] = (
    {"attention_heads": "pad"},
    {"kv_heads": "pad"},
    {"attention_heads": "pad", "kv_heads": "pad"},
)


@dataclass
class Entry:
    """One YAML key for the template: ``doc`` comment lines above it, then ``key: value``
    (``value`` already YAML), or ``key:`` and ``children`` (a nested mapping). ``disabled``
    entries are written commented out; ``note`` goes after the value as a trailing comment."""

    key: str
    value: str | None = None
    doc: list[str] = field(default_factory=list)
    children: list["Entry"] | None = None
    note: str = ""
    disabled: bool = False


@dataclass
class InitResult:
    path: Path
    text: str
    bundle: specmod.Bundle
    plans: dict[str, Plan]  # target -> plan (all resolve; some may not fit)
    notes: list[str]  # what init chose on the user's behalf, and why

    def summary(self) -> list[str]:
        """One line per target: fits, or does not fit with the command that explains why."""
        lines = []
        for t, p in self.plans.items():
            m = p.memory
            if p.fits:
                lines.append(f"{t}: fits ({human(m.total)} of {human(m.dram)} per chip; KV pool "
                             f"{p.kv['max_tokens_all_users']:,} tokens, {human(p.kv['bytes'])})")
            else:
                lines.append(f"{t}: does not fit ({shortfall(m, human)});"
                             f" see `ttbundle plan {shlex.quote(str(self.path))} --mesh {shlex.quote(t)}`")
        return lines


# ---- rendering helpers -------------------------------------------------------------------------
# What may not appear raw in a one-line YAML value or comment: line breaks (YAML counts \x85,
# \u2028, \u2029) and everything PyYAML's reader rejects as non-printable (incl. lone surrogates
# from undecodable file names).
_UNSAFE = re.compile("[^\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]|[\x85\u2028\u2029\ufeff]")


class _OneLineDumper(yaml.SafeDumper):
    """Strings with unsafe characters become double-quoted with escapes instead of being folded
    over several lines."""


_OneLineDumper.add_representer(str, lambda d, v: d.represent_scalar(
    "tag:yaml.org,2002:str", v, style='"' if _UNSAFE.search(v) else None))


def y(value) -> str:
    """``value`` as a one-line YAML flow value that ``yaml.safe_load`` reads back unchanged."""
    s = yaml.dump(value, Dumper=_OneLineDumper, default_flow_style=True, width=1 << 30,
                  allow_unicode=True, sort_keys=False)
    if s.endswith("\n...\n"):
        s = s[:-5]
    s = s.rstrip("\n")
    if "\n" in s:  # pragma: no cover - the dumper above never folds
        raise AssertionError(f"multi-line YAML for {value!r}")
    return s


def one_line(text: str) -> str:
    """``text`` safe inside a ``#`` comment: unsafe characters escaped, never a line break."""
    return _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], str(text))


def doc_lines(text: str | None, width: int = COMMENT_WIDTH) -> list[str]:
    if not text:
        return []
    return textwrap.wrap(" ".join(one_line(w) for w in text.split()), width) or []


def field_doc(model: type[BaseModel], name: str) -> list[str]:
    f = model.model_fields.get(name)
    return doc_lines(f.description if f else None)


def dim_label(d) -> str:
    return f"{d.name}={d.size}" + (f"x{d.unit}" if d.unit != 1 else "")


def model_entries(obj: BaseModel, top: bool = True, first: tuple[str, ...] = ()) -> list[Entry]:
    """Every field of ``obj`` with its docstring; nested models as nested mappings. ``None`` is
    written as ``null`` at the top level (visible, editable) and left out inside nested models."""
    cls = type(obj)
    dumped = obj.model_dump(mode="json", by_alias=True)
    names = list(first) + [n for n in cls.model_fields if n not in first]
    out = []
    for n in names:
        f = cls.model_fields[n]
        key = f.alias or n
        v = getattr(obj, n)
        if v is None and not top:
            continue
        if isinstance(v, BaseModel):
            kids = model_entries(v, top=False)
            out.append(Entry(key, doc=doc_lines(f.description), children=kids) if kids else
                       Entry(key, "{}", doc_lines(f.description)))
        else:
            out.append(Entry(key, y(dumped[key]), doc_lines(f.description)))
    return out


# ---- inputs ------------------------------------------------------------------------------------
def read_hf_config(hf_dir: Path) -> tuple[dict, Path]:
    cfg = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise InvalidInput(f"{hf_dir}: not a directory (--from-hf takes a Hugging Face model "
                           "directory holding config.json, a hub-cache snapshot, or a model id "
                           "ORG/NAME[@REVISION] in the Hugging Face cache)")
    try:
        return read_user_json(cfg, "config.json", inside=hf_dir), cfg
    except InvalidInput as e:
        if "no such" in e.message:
            raise InvalidInput(f"{cfg}: not found (--from-hf takes a directory holding config.json)") from None
        raise


def derive_name(hf_dir: Path, fallback: str) -> str:
    """A spec name (``spec.NAME_RE``) from the model's name: the directory's, or for a hub-cache
    snapshot the model's (``models--ORG--NAME``'s NAME, not the revision hash), e.g.
    ``Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b-instruct``."""
    snap = hub.snapshot_of(hf_dir)
    n = re.sub(r"[^a-z0-9_.-]+", "-", (snap.name if snap else hf_dir.resolve().name).lower())
    n = re.sub(r"^[^a-z0-9]+", "", n)[:64].rstrip("-_.")
    return n if specmod.NAME_RE.fullmatch(n) else fallback


HF_ID_RE = hub.HF_ID_RE  # a Hugging Face repo id (``org/name``): what ``hf_model`` holds


def derive_hf_id(hf_dir: Path, config: dict) -> tuple[str | None, str]:
    """The HF model id ``hf_dir`` holds and where it was read: a hub-cache snapshot path
    (``.../models--ORG--NAME/snapshots/<rev>``), else the config's ``_name_or_path`` when that
    is an id, not a local path; ``(None, why)`` when neither says."""
    snap = hub.snapshot_of(hf_dir)
    if snap is not None and HF_ID_RE.fullmatch(snap.repo_id):
        return snap.repo_id, f"the hub cache folder {snap.folder.name}"
    nop = config.get("_name_or_path")
    if isinstance(nop, str) and HF_ID_RE.fullmatch(nop) and not Path(nop).exists():
        return nop, "config.json's _name_or_path"
    return None, "neither a hub cache path nor config.json's _name_or_path names an id"


def has_weights(d: Path) -> bool:
    return (d / "model.safetensors.index.json").is_file() or any(d.glob("*.safetensors"))


def has_tokenizer(d: Path) -> bool:
    """Whether ``d`` has a tokenizer ``build`` accepts (``package.names.has_tokenizer``'s rule)."""
    return makes_one({n for n in TOKENIZER_MODEL_FILES if (d / n).is_file()})


def rel_path(target: Path, base_dir: Path) -> str:
    """``target`` relative to ``base_dir`` (real paths, so symlinked dirs resolve the same way)."""
    return Path(os.path.relpath(target.resolve(), base_dir.resolve())).as_posix()


def adjust_buckets(default: dict, max_model_len: int, max_num_seqs: int) -> tuple[dict, list[str]]:
    """The family's default buckets made to pass validation for these limits: prefill buckets
    past the first one covering max_model_len dropped; prefill_chunk set when max_model_len
    exceeds the largest prefill bucket; a decode bucket added for max_num_seqs if needed."""
    notes = []
    prefill = sorted(set(default.get("prefill") or specmod.Buckets().prefill))
    decode = sorted(set(default.get("decode") or specmod.Buckets().decode))
    chunk = default.get("prefill_chunk")
    cover = [p for p in prefill if p >= max_model_len]
    if cover and cover[0] != prefill[-1]:
        dropped = [p for p in prefill if p > cover[0]]
        prefill = [p for p in prefill if p <= cover[0]]
        notes.append(f"prefill buckets {dropped} dropped: longer than max_model_len={max_model_len}")
    if chunk is not None and chunk not in prefill:
        chunk = None
    if max_model_len > prefill[-1] and chunk is None:
        chunk = prefill[-1]
        notes.append(f"prefill_chunk={chunk}: max_model_len={max_model_len} exceeds the largest "
                     f"prefill bucket")
    if max_num_seqs > decode[-1]:
        size = next(s for s in specmod.DECODE_TRACE_SIZES if s >= max_num_seqs)
        decode = sorted(set(decode + [size]))
        notes.append(f"decode bucket {size} added for max_num_seqs={max_num_seqs}")
    return {"prefill": prefill, "decode": decode, "prefill_chunk": chunk}, notes


# ---- the spec ----------------------------------------------------------------------------------
@dataclass
class _Ctx:
    """Everything the template needs; values pre-rendered."""

    header: list[str]
    sections: dict[str, list[Entry]]
    docs: dict[str, list[str]]


def _context(*, arch, family, hf_arch: str, cfg: Path, out_dir: Path, hf_dir: Path, name: str,
             meshes: list[str], weights_dtype: str, max_model_len: int, max_num_seqs: int,
             buckets: dict, bucket_notes: list[str], sharding_opts: dict[str, str],
             sharding_notes: dict[str, str], sharding_targets: dict | None = None, group_dtypes: dict[str, str] | None = None,
             dtype_note: str = "", pool_notes: list[str] | None = None,
             kv_dtype: str = "bf16", hf_model: str | None = None, hf_note: str = "",
             ref: str | None = None, embedding: dict | None = None, task_note: str = "",
             vision: dict | None = None, vision_note: str = "") -> _Ctx:
    B, W, D, S, K, R = (specmod.BundleSpec, specmod.Weights, specmod.DtypePolicy, specmod.Sharding,
                        specmod.Buckets, specmod.Runtime)
    tensors = family.tensors(arch)
    rel = ref or rel_path(hf_dir, out_dir)  # a model id as given, else the path from the spec
    sections: dict[str, list[Entry]] = {}
    sections["top"] = [
        Entry("name", y(name), field_doc(B, "name")),
        Entry("description", y(f"{hf_arch} imported from {rel}{'' if ref else '/config.json'} by ttbundle init"),
              field_doc(B, "description")),
        Entry("hf_model", y(hf_model or "ORG/NAME"), field_doc(B, "hf_model") + doc_lines(f"init: {hf_note}"),
              disabled=hf_model is None),
    ]
    sections["model"] = model_entries(arch, first=("family",))

    sources = []
    if has_tokenizer(hf_dir):
        sources.append(Entry("tokenizer", y(rel), field_doc(B, "tokenizer")))
    else:
        sources.append(Entry("tokenizer", y(rel), field_doc(B, "tokenizer")
                             + [f"(no tokenizer.json / tokenizer.model / vocab.json in {one_line(rel)})"],
                             disabled=True))
    sections["sources"] = sources

    weights = [Entry("source", y(rel), field_doc(W, "source"), disabled=not has_weights(hf_dir),
                     note="" if has_weights(hf_dir) else f"no *.safetensors in {one_line(rel)} yet")]
    groups_present = [g for g in GROUPS if g != "embedding"
                      and any(t.group == g and t.kind == "matrix" for t in tensors)]
    group_dtypes = group_dtypes or {}
    dtypes = [Entry("default", y(weights_dtype), field_doc(D, "default")
                    + doc_lines(dtype_note and f"init: {dtype_note}"))]
    if any(t.group == "embedding" for t in tensors):
        dtypes.append(Entry("embedding", y("bf16"), field_doc(D, "embedding")))
    for g in groups_present:
        dtypes.append(Entry(g, y(group_dtypes.get(g, weights_dtype)), field_doc(D, g),
                            disabled=g not in group_dtypes))
    # embedding-kind tensors outside the `embedding` group would inherit a block-float default
    odd = {t.name: "bf16" for t in tensors if t.kind == "embedding" and t.group != "embedding"}
    dtypes.append(Entry("tensors", y(odd), field_doc(D, "tensors")))
    weights.append(Entry("dtypes", doc=field_doc(W, "dtypes"), children=dtypes))
    sections["weights"] = weights

    sections["targets"] = [Entry("targets", y(meshes), field_doc(B, "targets"))]
    sections["task"] = [] if embedding is None else [  # task: embed (ttbundle/embed.py)
        Entry("task", y("embed"), field_doc(B, "task") + doc_lines(f"init: {task_note}")),
        Entry("embedding", doc=field_doc(B, "embedding"), children=[
            Entry(k, y(v), field_doc(specmod.Embedding, k)) for k, v in embedding.items()])]

    sections["vision"] = [] if vision is None else [  # a multimodal model's images (vision.py)
        Entry("vision", doc=field_doc(B, "vision") + doc_lines(f"init: {vision_note}"), children=[
            Entry(k, y(v), field_doc(specmod.Vision, k)) for k, v in vision.items() if v is not None])]

    default_plan = family.default_plan(arch)
    plan = []
    for t in tensors:
        spec = list(default_plan.get(t.name, (None,) * len(t.dims)))
        dims = ", ".join(dim_label(d) for d in t.dims)
        plan.append(Entry(t.name, y(spec), note=one_line(f"[{dims}] {t.doc}".strip())))
    sharding = [Entry("plan", doc=field_doc(S, "plan") + doc_lines(
        "Below: the family's default plan written out in full; after each tensor its dims, "
        "as name=size or, for heads, name=heads x head width."), children=plan)]
    for n, f in S.model_fields.items():
        if n in ("plan", "targets"):
            continue
        value = sharding_opts.get(n, f.default)
        sharding.append(Entry(n, y(value), doc_lines(f.description)
                              + doc_lines(sharding_notes.get(n))))
    sharding.append(Entry("targets", y(sharding_targets or {}), field_doc(S, "targets")
                          + doc_lines(sharding_targets and "init: replicated on those meshes, where the "
                                      "family default plan's split of these tensors is not whole tiles per device")))
    sections["sharding"] = sharding

    sections["buckets"] = [
        Entry(k, y(buckets[k]), field_doc(K, k)) for k in ("prefill", "decode", "prefill_chunk")]
    if bucket_notes:
        sections["buckets"][0].doc += doc_lines("init: " + "; ".join(bucket_notes))

    rt = specmod.Runtime(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         kv_cache_dtype=kv_dtype, max_tokens_all_users="auto")
    sections["runtime"] = model_entries(rt)
    for e in sections["runtime"]:
        if e.key == "max_tokens_all_users":
            e.doc += doc_lines("init: " + "; ".join(pool_notes)) if pool_notes else []
        if e.key == "kv_cache_dtype" and kv_dtype != "bf16":
            e.doc += doc_lines(dtype_note and f"init: {dtype_note}")

    # check's quality targets per storage, written out so they are visible and edited in one place
    Q = specmod.QualityTarget
    sections["quality"] = [
        Entry(st, doc=doc_lines(f"a package storing {st} at its coarsest"), children=[
            Entry(k, y(v), field_doc(Q, k)) for k, v in targets.items()])
        for st, targets in specmod.DEFAULT_QUALITY.items()]
    sections["quality"][0].doc = doc_lines("init: check's defaults (docs/check.md, \"Quality targets\")") \
        + sections["quality"][0].doc

    docs = {k: field_doc(B, k) for k in ("model", "weights", "sharding", "buckets", "runtime", "quality")}
    header = [
        f"Bundle spec {one_line(name)}: {one_line(hf_arch)} from {one_line(rel)}{'' if ref else '/config.json'}, "
        "written by `ttbundle init`.",
        "Every key is listed with its meaning; edit freely, then:",
        "  ttbundle validate <this file>          # exit 0 valid, 2 invalid, 3 does not fit",
        "  ttbundle plan <this file> --mesh <M>   # per-device shards, per-chip memory, collectives",
        "Reference: docs/spec-reference.md; JSON Schema for editors: `ttbundle schema`.",
    ]
    return _Ctx(header, sections, docs)


def _render(ctx: _Ctx) -> str:
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
                             undefined=jinja2.StrictUndefined, autoescape=False,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    try:
        tpl = env.get_template(TEMPLATE)
    except jinja2.TemplateNotFound:
        raise TTBundleError(f"spec template {TEMPLATE_DIR / TEMPLATE} is missing; ttbundle init "
                            "needs the templates/ folder of a source checkout") from None
    return tpl.render(header=ctx.header, s=ctx.sections, doc=ctx.docs)


def _make_parents(d: Path) -> list[Path]:
    created = []
    p = d
    while not p.exists():
        created.append(p)
        p = p.parent
    for c in reversed(created):
        c.mkdir()
    return created


#: Weight dtypes ``init`` tries in order when none is asked for: (default, per-group overrides,
#: what the spec comment says). The last is tt_transformers' "performance" setting.
DTYPE_CHOICES: tuple[tuple[str, dict[str, str], str, str], ...] = (
    ("bf16", {}, "bf16", "bf16 weights"),
    ("bfp8", {}, "bf16", "bfp8 weights"),
    ("bfp8", {}, "bfp8", "bfp8 weights and KV cache"),
    ("bfp8", {"mlp": "bfp4", "experts": "bfp4"}, "bfp8", "bfp8 weights with bfp4 MLP/experts and a bfp8 KV cache"),
)


def render_spec(hf_dir: str | Path, output: Path, meshes: list[str] | None = None,
                weights_dtype: str | None = None, max_model_len: int | None = None,
                max_num_seqs: int | None = None, name: str | None = None, hf_model: str | None = None,
                task: str | None = None):
    """The spec text for ``hf_dir`` as it would be written to ``output``, validated and fitting
    every mesh: returns ``(text, bundle, plans, notes)``. Without ``weights_dtype`` the first of
    :data:`DTYPE_CHOICES` that fits every mesh is taken (said in the file and in ``notes``); the
    KV pool is ``auto`` (the largest that fits each mesh; its size per mesh is written as a
    comment). Raises :class:`DoesNotFit` (exit 3) with the arithmetic and the fixes when nothing
    fits. ``output``'s directory must exist (paths are checked). ``hf_dir`` is a directory, a
    hub-cache snapshot or a model id ``ORG/NAME[@REVISION]`` (``hub.resolve``; a model id is
    written into the spec as given)."""
    meshes = list(dict.fromkeys(meshes or [DEFAULT_MESH]))
    for m in meshes:
        meshmod.resolve(m)
    if weights_dtype is not None and weights_dtype not in WEIGHT_DTYPES:
        raise InvalidInput(f"--weights-dtype {weights_dtype!r}: one of {', '.join(WEIGHT_DTYPES)}")
    if name is not None and not specmod.NAME_RE.fullmatch(name):
        raise InvalidInput(f"--name {name!r}: must be 1-64 characters of lowercase letters, digits, "
                           "'-', '_', '.', starting with a letter or digit")

    src = hub.resolve(hf_dir)
    hf_dir, ref = src.path, (str(hf_dir) if src.model else None)
    config, cfg = read_hf_config(hf_dir)
    arch_dict = specmod.hf_config_to_arch(config, str(cfg))
    family = families.get(arch_dict["family"])
    try:
        arch = family.arch_model.model_validate(arch_dict)
    except ValidationError as e:
        raise InvalidInput(f"{cfg}: not importable as {family.name}", [
            Diagnostic(specmod.pydantic_message(err), ".".join(map(str, err["loc"])),
                               str(cfg)) for err in e.errors()]) from None

    mpe = arch.max_position_embeddings
    if max_model_len is None:
        max_model_len = min(mpe, MAX_MODEL_LEN_CAP)
    elif not 0 < max_model_len <= mpe:
        raise InvalidInput(f"--max-model-len {max_model_len}: must be between 1 and the model's "
                           f"max_position_embeddings={mpe}")
    top = max(specmod.DECODE_TRACE_SIZES)
    buckets0 = family.default_buckets(arch)
    if max_num_seqs is None:
        max_num_seqs = min(specmod.Runtime().max_num_seqs, max(buckets0.get("decode") or [top]))
    elif not 0 < max_num_seqs <= top:
        raise InvalidInput(f"--max-num-seqs {max_num_seqs}: must be between 1 and {top} (the "
                           "largest decode batch a trace is captured for)")
    buckets, bucket_notes = adjust_buckets(buckets0, max_model_len, max_num_seqs)
    embedding, task_note = init_task(hf_dir, family.name, task)
    if embedding is not None:  # prefill only
        buckets, bucket_notes = dict(buckets, decode=[]), [n for n in bucket_notes if "decode" not in n]
    vision, vision_notes = init_vision(family.vision_part(arch), hf_dir,
                                       buckets.get("prefill_chunk") or max(buckets["prefill"]), max_model_len)
    name = name or derive_name(hf_dir, family.name)
    archs = config.get("architectures") or ["?"]
    if hf_model is not None:
        if not HF_ID_RE.fullmatch(hf_model):
            raise InvalidInput(f"--hf-model {hf_model!r}: not a Hugging Face model id (ORG/NAME, e.g. "
                               "meta-llama/Llama-3.1-8B-Instruct)")
        hf_note = "from --hf-model"
    else:
        hf_model, hf_note = derive_hf_id(hf_dir, config)
        hf_note = (f"from {hf_note}" if hf_model else
                   f"not set: {hf_note}; write the id here (or pass --hf-model) to serve it by that id")

    kw = dict(arch=arch, family=family, hf_arch=str(archs[0]), cfg=cfg, out_dir=output.parent,
              hf_dir=hf_dir, name=name, meshes=meshes,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs, buckets=buckets,
              bucket_notes=bucket_notes, hf_model=hf_model, hf_note=hf_note, ref=ref,
              embedding=embedding, task_note=task_note, vision=vision, vision_note="; ".join(vision_notes))
    choices = DTYPE_CHOICES if weights_dtype is None else (
        (weights_dtype, {}, "bf16", f"{weights_dtype} weights"),)
    tried = []
    for default, groups, kv_dtype, label in choices:
        ctx_kw = dict(kw, weights_dtype=default, group_dtypes=groups, kv_dtype=kv_dtype)
        text, bundle, plans, notes, ctx_kw = _resolve(meshes, output, cfg, ctx_kw)
        tried.append((label, bundle, plans))
        if all(p.fits for p in plans.values()):
            break
    else:
        raise _does_not_fit(cfg, meshes, tried, weights_dtype is None)
    pool_notes = [f"auto on {m} is {p.kv['max_tokens_all_users']:,} tokens ({p.kv['num_blocks']:,} "
                  f"blocks, {human(p.kv['bytes'])} per chip)" for m, p in plans.items()]
    dtype_note = ""
    if len(tried) > 1:
        why = "; ".join(f"{lab} does not fit {', '.join(m for m, p in pl.items() if not p.fits)}"
                        for lab, _, pl in tried[:-1])
        dtype_note = f"{label} chosen: {why}"
        notes = [f"weights: {dtype_note}"] + notes
    notes.append("runtime.max_tokens_all_users: " + "; ".join(pool_notes))
    text = _render(_context(**ctx_kw, dtype_note=dtype_note, pool_notes=pool_notes))
    bundle = specmod.loads(text, str(output), base_dir=output.parent)
    return text, bundle, plans, notes


def init_vision(part, hf_dir: Path, chunk: int, max_model_len: int) -> tuple[dict | None, list[str]]:
    """A multimodal model's ``vision:`` settings (None for a text model) as its own image
    processor makes images (``preprocessor_config.json`` / ``processor_config.json``:
    ``VisionPart.processor_settings``), every one written out with the family's defaults filled
    in, and what the spec's comment says of them. The vision bucket holds ``images_per_prompt``
    images of the largest size the processor makes, or, where one such image's tokens do not
    fit a prefill ``chunk`` (an image is never split) or the images ``max_model_len``, the most
    patches that do: a cap, said in the notes, that requests beyond meet as a 400."""
    if part is None:
        return None, []
    got = part.processor_settings(hf_dir)
    vs = part.settings(specmod.Vision(**got))
    where = "preprocessor_config.json" if (hf_dir / "preprocessor_config.json").is_file() else "processor_config.json"
    notes = [f"the image settings of the checkpoint's own processor ({where}: {', '.join(sorted(got))}), so a "
             "served image has the tokens transformers' processor gives it" if got else
             "the checkpoint has no preprocessor_config.json: the family's default image settings; copy the "
             "model's own processor settings here, or images are not what its processor makes of them"]
    per = part.largest_image(vs)
    if per is not None:
        n = vs.images_per_prompt

        def fits(patches: int) -> bool:
            t = part.prompt_tokens_of(vs, patches)
            return t <= chunk and n * t < max_model_len

        unit = part.v.merge_unit
        if not fits(n * per):
            lo, hi = 0, n * per // unit  # the most merge blocks whose image fits: fits() is monotone
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid * unit) else (lo, mid - 1)
            if lo:
                t = part.prompt_tokens_of(vs, lo * unit)
                vs = vs.model_copy(update={"buckets": [lo * unit]})
                notes.append(f"a cap: {n} image(s) of the processor's largest size need {n * per} patches "
                             f"({part.prompt_tokens_of(vs, per)} prompt tokens each), more than a prefill chunk of "
                             f"{chunk} tokens or max_model_len={max_model_len} holds; the vision bucket holds "
                             f"{lo * unit} patches (an image of {t} tokens), and a request whose images need more "
                             "is refused (400). Raise buckets.prefill_chunk and max_model_len to lift it")
    return vs.model_dump(mode="json"), notes


def _does_not_fit(cfg: Path, meshes: list[str], tried: list, auto: bool) -> "DoesNotFit":
    """Exit 3: per mesh that does not fit, the per-chip arithmetic at the smallest dtype tried,
    and the fixes (each checked by re-planning)."""
    label, bundle, plans = tried[-1]
    diags = []
    for m, p in plans.items():
        if p.fits:
            continue
        mem = p.memory
        diags.append(Diagnostic(
            f"{m}: with {label}: weights {human(mem.weights)} + KV for one "
            f"max_model_len={bundle.spec.runtime.max_model_len} sequence {human(mem.kv_cache)} + "
            f"activations {human(mem.activations)} + trace region {human(mem.trace_region)} = "
            f"{human(mem.total)} per chip; a {p.mesh.chip.label} chip has {human(mem.dram)}"))
        for f in fixes(bundle, p):
            diags.append(Diagnostic(f"{m}: fix (from {label}): {f}"))
    what = "bf16, bfp8 or bfp4 MLP weights" if auto else label
    return DoesNotFit(f"{cfg}: does not fit {', '.join(m for m in meshes if not plans[m].fits)} "
                      f"with {what}; nothing written (pass a bigger --mesh, --weights-dtype or a "
                      "smaller --max-model-len)", diags)


def _resolve(meshes, output, cfg, kw):
    """The spec for ``kw`` whose sharding plan resolves on every mesh (padding heads if the
    family default does not divide, then replicating per mesh the tensors that still do not):
    ``(text, bundle, plans, notes, kw)``."""
    def plans_for(bundle):
        plans, diags = {}, []
        for m in meshes:
            try:
                plans[m] = make_plan(bundle, m)
            except InvalidInput as e:
                diags += e.diagnostics or [Diagnostic(e.message)]
        return plans, diags

    def load(opts, why, targets):
        text = _render(_context(sharding_opts=opts, sharding_notes=why, sharding_targets=targets, **kw))
        try:
            return text, specmod.loads(text, str(output), base_dir=output.parent)
        except InvalidInput as e:
            # the arguments were checked above, so config.json (or the family) is at fault
            raise InvalidInput(f"{cfg}: the spec generated from it does not validate; nothing "
                               "written", e.diagnostics) from None

    reason, diags = "", []
    # padded heads first; then, if a tensor still does not divide, it is replicated on that mesh
    for replicate in (False, True):
        for opts in ({},) + SHARDING_FALLBACKS:
            why = {k: f"set by init: {reason}" for k in opts}
            text, bundle = load(opts, why, {})
            targets = {}
            if replicate:
                targets = {m: r for m in meshes if (r := replicate_undividable(bundle, m))}
                if not targets:
                    continue
                text, bundle = load(opts, why, targets)
            plans, diags = plans_for(bundle)
            if not diags:
                notes = [f"buckets: {n}" for n in kw["bucket_notes"]]
                notes += [f"vision: {kw['vision_note']}"] if kw.get("vision_note") else []
                if not has_tokenizer(cfg.parent):
                    notes.append(f"no tokenizer in {cfg.parent} (none of tokenizer.json, tokenizer.model, "
                                 "vocab.json): `ttbundle build` refuses the spec until `tokenizer:` names the "
                                 "model's tokenizer, or says `tokenizer: false` (token ids only)")
                notes += [f"sharding.{k}: {v} because {reason}" for k, v in opts.items()]
                notes += [f"sharding.targets.{m}: {', '.join(r)} replicated (their split is not whole "
                          "tiles per device there)" for m, r in targets.items()]
                return text, bundle, plans, notes, dict(kw, sharding_opts=opts, sharding_notes=why,
                                                        sharding_targets=targets)
            if not opts and not replicate:
                reason = diags[0].message.split("; fix:")[0]
    raise InvalidInput(f"{cfg}: the family's default plan does not divide over "
                       f"{', '.join(meshes)}, even with padded heads and undividable tensors replicated; nothing "
                       "written", diags)


def init_spec(hf_dir: str | Path, output: str | Path, meshes: list[str] | None = None,
              weights_dtype: str | None = None, max_model_len: int | None = None,
              max_num_seqs: int | None = None, name: str | None = None,
              force: bool = False, hf_model: str | None = None, task: str | None = None) -> InitResult:
    """Render, validate and atomically write the spec; refuses to overwrite without ``force``."""
    output = Path(output)
    if output.is_dir():
        raise InvalidInput(f"{output} is a directory; -o takes the spec file to write")
    if output.exists() and not force:
        raise InvalidInput(f"{output} exists; pass --force to overwrite it")
    created = _make_parents(output.parent)  # relative paths in the spec are checked from there
    try:
        text, bundle, plans, notes = render_spec(hf_dir, output, meshes, weights_dtype,
                                                 max_model_len, max_num_seqs, name, hf_model, task)
        write_text_atomic(output, text)
    except BaseException:
        for d in created:  # innermost first; only folders this call made, and only if empty
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return InitResult(output, text, bundle, plans, notes)
