"""The bundle spec: a typed model of the YAML file, loading with line numbers, semantic checks.

``load(path)`` returns a :class:`Bundle` (the validated spec, the family and its arch dims, and
a locator for every key), or raises :class:`InvalidInput` carrying *all* problems found, each
located as ``file:line:col: key.path: message``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from . import families, mesh as meshmod
from .errors import Diagnostic, InvalidInput
from .tiles import TILE, round_up
from .yamlpos import load_yaml

DType = Literal["bf16", "bfp8", "bfp4"]
AxisName = Literal["rows", "cols"]
PartitionEntry = Union[None, AxisName, list[AxisName]]
PartitionSpec = list[PartitionEntry]

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")  # used with fullmatch: `$` passes a final "\n"
# tt_transformers traces decode for these batch sizes (rows are padded to 32 on device)
DECODE_TRACE_SIZES = (1, 2, 4, 8, 16, 32)


def _model_config(**kw):
    return ConfigDict(extra="forbid", use_attribute_docstrings=True, **kw)


class DtypePolicy(BaseModel):
    """Storage dtype per tensor group. bfp8/bfp4 are Tenstorrent block floats (32x32 tiles, one
    shared exponent per 16 values): 1,088 and 576 bytes per tile against bf16's 2,048."""

    model_config = _model_config()

    default: DType = "bf16"
    """Dtype of any group not named below."""
    embedding: DType | None = None
    """Token embedding table; ttnn's embedding op reads a ROW_MAJOR bf16 table, so bf16 only."""
    attention: DType | None = None
    """q/k/v/o projections (and MLA's low-rank projections)."""
    mlp: DType | None = None
    """Dense MLP gate/up/down projections (incl. shared experts)."""
    experts: DType | None = None
    """Routed MoE expert weights."""
    router: DType | None = None
    """MoE router (gate) weights."""
    lm_head: DType | None = None
    """Output projection to the vocabulary."""
    norms: DType | None = None
    """1-D tensors (norm weights, biases, attention sinks); ttnn keeps these bf16."""
    vision: DType | None = None
    """Vision encoder and multimodal projector matrices (multimodal families)."""
    tensors: dict[str, DType] = Field(default_factory=dict)
    """Per-tensor overrides by tensor name (see `ttbundle plan` for names), e.g. `wo: bf16`."""

    def dtype_of(self, name: str, group: str) -> str:
        if name in self.tensors:
            return self.tensors[name]
        return getattr(self, group, None) or self.default


class Weights(BaseModel):
    """Where the checkpoint is and how it is stored on device."""

    model_config = _model_config()

    source: str | None = None
    """Directory with `*.safetensors` (or `model.safetensors.index.json` for sharded
    checkpoints; bf16, fp16 or fp32), relative to the spec file, a Hugging Face hub-cache
    snapshot, or a model id `ORG/NAME[@REVISION]` found in the Hugging Face cache (downloaded
    unless `HF_HUB_OFFLINE=1`; a path that exists wins). Omit for a plan-only spec."""
    dtypes: DtypePolicy = Field(default_factory=DtypePolicy)
    """Storage dtype per tensor group."""


class Sharding(BaseModel):
    """How tensors split over the mesh axes `rows` and `cols`, in PartitionSpec notation: one
    entry per tensor dim, `null` (replicated), an axis name, or a list of axis names."""

    model_config = _model_config()

    plan: dict[str, PartitionSpec] = Field(default_factory=dict)
    """Overrides of the family's default plan, by tensor name, e.g. `wq: [null, cols]`."""
    targets: dict[str, dict[str, PartitionSpec]] = Field(default_factory=dict)
    """Per-target overrides, keyed by a name from `targets`, applied after `plan`."""
    kv_heads: Literal["replicate", "pad", "error"] = "replicate"
    """When KV heads do not divide their axis: `replicate` (each device holds the KV heads its
    query heads need; needs axis % kv_heads == 0), `pad` (zero heads up to a multiple), `error`."""
    attention_heads: Literal["pad", "error"] = "error"
    """When query heads do not divide their axis: `pad` with zero heads, or `error`."""
    vocab: Literal["pad", "error"] = "pad"
    """When the vocabulary does not divide its axis in whole tiles: `pad` (extra logits masked)
    or `error`."""


class Buckets(BaseModel):
    """The fixed shapes traces are captured for."""

    model_config = _model_config()

    prefill: list[int] = Field(default_factory=lambda: [128, 1024])
    """Prefill sequence lengths (tokens), sorted, unique, multiples of 32."""
    decode: list[int] = Field(default_factory=lambda: [1, 8, 32])
    """Decode batch sizes, sorted, unique, each one of 1, 2, 4, 8, 16, 32."""
    prefill_chunk: int | None = None
    """Prompts longer than this are prefilled in chunks of this many tokens; must be one of the
    prefill buckets. Needed when max_model_len exceeds the largest prefill bucket."""


class Runtime(BaseModel):
    """Serving limits and plugin options (same names as Tenstorrent's vLLM plugin)."""

    model_config = _model_config()

    max_model_len: int = Field(default=4096, gt=0)
    """Longest sequence (prompt + output) served."""
    max_num_seqs: int = Field(default=32, gt=0)
    """Sequences decoded together (they share the KV pool, `max_tokens_all_users`)."""
    kv_block_size: int = Field(default=32, gt=0)
    """Tokens per paged-KV block; a multiple of 32."""
    kv_cache_dtype: Literal["bf16", "bfp8"] = "bf16"
    """KV cache storage dtype."""
    trace_mode: Literal["all", "decode_only", "none"] = "all"
    """Which phases run as captured traces."""
    sample_on_device_mode: Literal["all", "decode_only", "off"] = "all"
    """Where sampling runs on device (token ids come back instead of logits)."""
    trace_region_size: int | None = Field(default=None, gt=0)
    """Bytes reserved for captured traces; default: ttbundle's estimate (see `plan`)."""
    max_tokens_all_users: Annotated[int, Field(gt=0)] | Literal["auto"] | None = None
    """KV cache pool (Tenstorrent's name): tokens of KV cache shared by all sequences. vLLM gets
    ceil((max_tokens_all_users + kv_block_size x max_num_seqs) / kv_block_size) blocks and
    preempts a sequence when they run out. `auto` or absent: the largest pool that fits each
    chip after weights, activations and the trace region, capped at max_num_seqs x
    max_model_len (every sequence at full length); at least max_model_len (one full sequence)."""


class Replicas(BaseModel):
    """A target run as several replicas of the model, each on its own submesh (Tenstorrent's
    data parallel): a T3K as 8 replicas of [1, 1] or 4 of [1, 2], a TG as 4 of [8, 1] or
    [2, 4]. Each replica is planned and built exactly as a standalone mesh of the submesh
    shape; the package holds its weights once and every replica reads them."""

    model_config = _model_config()

    submesh: tuple[Annotated[int, Field(gt=0)], Annotated[int, Field(gt=0)]]
    """[rows, cols] of one replica's submesh; must tile the target (rows divide its rows, cols
    its cols)."""
    count: int | None = Field(default=None, gt=0)
    """Number of replicas; optional, and when given it must equal the target's chips divided by
    the submesh's."""


class Vision(BaseModel):
    """Image inputs of a multimodal model (its vision dims are the model's, `model.vision`)."""

    model_config = _model_config()

    images_per_prompt: int = Field(default=1, gt=0)
    """Most images one prompt may carry (vLLM's `limit_mm_per_prompt`; more is refused with a 400)."""
    buckets: list[int] = Field(default_factory=lambda: [1])
    """What the vision encoder is traced for, sorted and unique: Gemma 3, image counts (a
    prompt's images are encoded in one call padded to the smallest bucket holding them);
    Qwen2.5-VL, Qwen3-VL and Mistral 3, patch counts (a prompt's images' patches, padded
    likewise; default: the patches of `images_per_prompt` images of `max_pixels`, or of
    `longest_edge` squared)."""
    min_pixels: int | None = Field(default=None, gt=0)
    """Qwen2.5-VL: the image processor enlarges a smaller image to at least this many pixels
    (default 3136 = 56 x 56)."""
    max_pixels: int | None = Field(default=None, gt=0)
    """Qwen2.5-VL: the image processor shrinks a larger image to at most this many pixels, which
    bounds one image's patches (max_pixels / patch_size^2) and soft tokens (a quarter of them);
    default: 256 soft tokens' worth (200704 = 256 x 28 x 28 pixels at 14-pixel patches)."""
    longest_edge: int | None = Field(default=None, gt=0)
    """Mistral 3: the image processor shrinks an image whose longer side exceeds this many pixels
    (aspect kept), then rounds both sides up to merge blocks (patch_size x spatial_merge_size);
    at most the encoder's image_size; default: 16 merge blocks (448 pixels at 14-pixel patches)."""


class Embedding(BaseModel):
    """How an embedding bundle (`task: embed`) makes one vector of a prompt's final hidden states
    (after the model's final norm), as sentence-transformers' `Pooling` and `Normalize` modules do."""

    model_config = _model_config()

    pooling: Literal["last", "mean", "cls"] = "last"
    """`last`: the last prompt token's hidden state (decoder embedding models, e.g.
    Qwen3-Embedding); `mean`: the mean over the prompt's tokens; `cls`: the first token's."""
    normalize: bool = True
    """L2-normalize the pooled vector (a request's `use_activation`, as vLLM names it, overrides)."""


class Speculative(BaseModel):
    """Speculative decoding (vLLM's `--speculative-config`): each decode step verifies up to
    `num_speculative_tokens` proposed tokens per sequence in one program call (a *verify*
    program per decode bucket: k + 1 rows per sequence) and keeps the longest prefix the model
    agrees with, plus one token of its own (rejection sampling as vLLM defines it)."""

    model_config = _model_config()

    method: Literal["ngram", "draft"] = "ngram"
    """`ngram`: prompt lookup (the proposals are the tokens that followed the longest earlier
    match of the sequence's last n-gram, vLLM's `ngram`); `draft`: another bundle (`model:`)
    proposes greedily (vLLM's `draft_model`); its package is built into this one."""
    num_speculative_tokens: int = Field(default=3, gt=0)
    """k: tokens proposed and verified per sequence and step."""
    prompt_lookup_min: int = Field(default=1, gt=0)
    """`ngram`: the shortest n-gram matched."""
    prompt_lookup_max: int = Field(default=3, gt=0)
    """`ngram`: the longest n-gram matched (at least `prompt_lookup_min`)."""
    model: str | None = None
    """`draft`: the drafting bundle's spec, relative to this spec: the same tokenizer (the same
    vocabulary, token for token), decode buckets covering this bundle's, `max_model_len` at least
    this bundle's, no `speculative:` of its own."""


class BundleSpec(BaseModel):
    """A model deployment on Tenstorrent meshes: architecture, weights, sharding, buckets."""

    model_config = _model_config(title="ttbundle bundle spec")

    name: str
    """Bundle name: lowercase letters, digits, `-`, `_`, `.`; at most 64 characters."""
    description: str = ""
    """Free text shown in `ttbundle ls` and the generated model card."""
    model: Annotated[Union[families.arch_models()], Field(discriminator="family")] | None = None  # type: ignore[valid-type]
    """Architecture: `family` plus its dims (HF config.json names). Omit when using `from_hf`."""
    from_hf: str | None = None
    """Directory holding a Hugging Face `config.json` to import the architecture from (relative
    to the spec), or a model id `ORG/NAME[@REVISION]` (as `weights.source`). Exactly one of
    `model` / `from_hf`."""
    tokenizer: str | Literal[False] | None = None
    """Tokenizer directory (HF `tokenizer.json` etc.), relative to the spec, or a model id
    `ORG/NAME[@REVISION]` (as `weights.source`); defaults to `from_hf`'s directory or the
    weights directory. `build` needs one of `tokenizer.json`, `tokenizer.model`, `vocab.json`
    there; `false`: no tokenizer, the package serves token ids only (vLLM's
    `--skip-tokenizer-init`: prompts as token ids, no text out)."""
    weights: Weights = Field(default_factory=Weights)
    """Checkpoint location and storage dtypes."""
    targets: list[str] = Field(min_length=1)
    """Meshes to build for: MESH_DEVICE names (N150, N300, T3K, TG, P150, ...) or "(R,C)"."""
    sharding: Sharding = Field(default_factory=Sharding)
    """Sharding plan overrides (the family's default plan applies otherwise)."""
    buckets: Buckets | None = None
    """Trace buckets; default: the family's."""
    runtime: Runtime = Field(default_factory=Runtime)
    """Serving limits and plugin options. With `replicas`, `max_num_seqs` is per replica."""
    hf_model: str | None = None
    """The Hugging Face model id the bundle was made from, e.g. `meta-llama/Llama-3.1-8B-Instruct`:
    a registered package is served by this id as well as by its name (`vllm serve <id>`)."""
    replicas: dict[str, Replicas] = Field(default_factory=dict)
    """Per target (a name from `targets`): serve it as replicas on submeshes, e.g.
    `T3K: {submesh: [1, 1]}` (8 replicas; total concurrency 8 x `runtime.max_num_seqs`)."""
    vision: Vision | None = None
    """Image inputs (multimodal models only); default for a model with a vision part: one image
    per prompt, one vision bucket."""
    task: Literal["generate", "embed"] = "generate"
    """`generate`: a language model (completions, chat); `embed`: an embedding model, served by
    vLLM's pooling runner at `/v1/embeddings` (prefill programs only: no decode buckets; see
    `embedding`). `ttbundle init` sets `embed` for a sentence-transformers checkpoint."""
    embedding: Embedding | None = None
    """Pooling and normalization of a `task: embed` bundle; default: last-token pooling,
    normalized (Qwen3-Embedding's)."""
    speculative: Speculative | None = None
    """Speculative decoding (`method: ngram` or `draft`): the package gets a verify program per
    decode bucket (and, for `draft`, the draft's package inside it) and `serve` passes vLLM's
    `--speculative-config`; absent: none."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError("must be 1-64 characters of lowercase letters, digits, '-', '_', '.', "
                             "starting with a letter or digit (it names files and a Python module)")
        return v


def json_schema() -> dict:
    schema = BundleSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


# ---- loading ------------------------------------------------------------------------------------
@dataclass
class Bundle:
    """A loaded spec plus everything derived from it that later stages need."""

    spec: BundleSpec
    arch: object  # the family's ArchBase subclass instance
    family: object  # families.base.Family
    file: str
    base_dir: Path
    positions: dict = field(default_factory=dict)
    warnings: list[Diagnostic] = field(default_factory=list)

    @property
    def buckets(self) -> Buckets:
        bk = self.spec.buckets or Buckets(**self.family.default_buckets(self.arch))
        if self.spec.task == "embed":  # prefill programs only (``embed.check`` refuses decode buckets)
            bk = bk.model_copy(update={"decode": []})
        return bk

    @property
    def embedding(self) -> Embedding | None:
        """The pooling of a ``task: embed`` bundle (the spec's or the default), else None."""
        return (self.spec.embedding or Embedding()) if self.spec.task == "embed" else None

    @property
    def vision(self) -> Vision | None:
        """The image settings of a model with a vision part (the spec's or the default), else None."""
        if getattr(self.arch, "vision", None) is None:
            return None
        return self.family.vision_part(self.arch).settings(self.spec.vision or Vision())

    def locate(self, path: tuple, message: str, severity: str = "error") -> Diagnostic:
        return locate(self.file, self.positions, path, message, severity)

    def tokenizer_dir(self) -> Path | None:
        """The tokenizer's directory: `tokenizer:`, else from_hf's directory, else the weights
        directory (None: `tokenizer: false`, or none of them given)."""
        s = self.spec
        if s.tokenizer is False:  # token ids only
            return None
        for p in (s.tokenizer, s.from_hf, s.weights.source):
            if p is not None:
                d = self.resolve_path(p)
                return d if d.is_dir() else d.parent
        return None

    def resolve_path(self, p: str | None, download: bool = True) -> Path | None:
        """A spec path (``from_hf``, ``weights.source``, ``tokenizer``): relative to the spec's
        directory, or a model id ``ORG/NAME[@REVISION]`` in the Hugging Face cache (``hub.resolve``)."""
        from . import hub
        return None if p is None else hub.resolve(p, self.base_dir, download).path


class InvalidSpec(InvalidInput):
    """A spec that passed the schema but broke other rules; ``bundle`` lets callers add the
    per-mesh checks so every problem is reported at once."""

    def __init__(self, message: str, diagnostics: list[Diagnostic], bundle: Bundle):
        super().__init__(message, diagnostics)
        self.bundle = bundle


def locate(file, positions, path, message, severity="error") -> Diagnostic:
    """A diagnostic at ``path``, or at its nearest ancestor that exists in the file."""
    p = tuple(path)
    while p and p not in positions:
        p = p[:-1]
    line, col = positions.get(p, (None, None))
    return Diagnostic(message, ".".join(map(str, path)), file, line, col, severity)


def _pydantic_message(err: dict, data=None) -> str:
    t, msg = err["type"], err["msg"]
    if t == "extra_forbidden":
        return "unknown key; " + _key_hint(err["loc"], data)
    if t == "union_tag_invalid":
        return (f"unknown family {err.get('ctx', {}).get('tag', err.get('input'))!r}; supported: "
                f"{', '.join(families.all_families())}")
    if t == "value_error" and "error" in err.get("ctx", {}):
        return str(err["ctx"]["error"])
    if any(isinstance(p, str) and p.startswith(("literal['rows'", "list[literal['rows'"))
           for p in err["loc"]):
        return ("a PartitionSpec entry is null, an axis name (rows, cols) or a list of axis names, "
                f"got {_get(data, _loc_path(err['loc'], data))!r}")
    if t == "union_tag_not_found":
        return f"missing `family`; one of: {', '.join(families.all_families())}"
    if t == "literal_error":
        return f"{msg}, got {err.get('input')!r}"
    if t == "missing":
        return "required key is missing"
    return msg


def _get(data, path: tuple):
    for p in path:
        try:
            data = data[p]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _fields_at(loc: tuple, data) -> list[str]:
    """Field names of the model that holds the key at ``loc`` (pydantic's loc), or []."""
    import typing
    model = BundleSpec
    path = _loc_path(loc, data)[:-1]
    for i, seg in enumerate(path):
        f = model.model_fields.get(seg) if isinstance(seg, str) else None
        if f is None:
            return []
        todo, cands = [f.annotation], []
        while todo:
            t = todo.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                cands.append(t)
            elif typing.get_origin(t) in (Union, Annotated) or type(t).__name__ == "UnionType":
                todo += list(typing.get_args(t))
        if len(cands) > 1:  # the family union: pick by the `family` tag
            fam = _get(data, path[:i + 1] + ("family",))
            cands = [c for c in cands if "family" in c.model_fields
                     and c.model_fields["family"].default == fam]
        if len(cands) != 1:
            return []
        model = cands[0]
    return list(model.model_fields)


def _key_hint(loc: tuple, data) -> str:
    import difflib
    key, fields = loc[-1], _fields_at(loc, data)
    close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    if fields:
        return f"keys here: {', '.join(fields)}"
    return "check the spelling (`ttbundle schema` lists every key)"


def _loc_path(loc: tuple, data) -> tuple:
    """pydantic's ``loc`` as a path in ``data``: pydantic also puts the discriminator tag (e.g.
    "llama") and union member names ("literal['rows','cols']") into loc; those are not keys of
    the document (a user key may well contain "[")."""
    out, node = [], data
    for i, p in enumerate(loc):
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif (isinstance(node, list) and isinstance(p, int) and not isinstance(p, bool)
              and 0 <= p < len(node)):
            node = node[p]
        elif isinstance(node, dict) and i == len(loc) - 1:
            node = None  # a required key that is missing
        else:
            continue  # a union member tag
        out.append(p)
    return tuple(out)


def load(path: str | Path) -> Bundle:
    from .fsutil import read_user_text

    path = Path(path)
    return loads(read_user_text(path, "spec file"), str(path), base_dir=path.parent)


def loads(text: str, file: str = "<spec>", base_dir: Path | None = None) -> Bundle:
    data, positions = load_yaml(text, file)
    if not isinstance(data, dict):
        raise InvalidInput(f"{file}: invalid spec", [Diagnostic(
            "a bundle spec is a YAML mapping (name:, model: or from_hf:, targets:, ...)", "", file, 1, 1)])
    base_dir = base_dir or Path(".")
    diags: list[Diagnostic] = []
    hf_arch = None
    if "from_hf" in data and "model" not in data and isinstance(data["from_hf"], str):
        try:
            from . import hub
            hf_arch = _import_hf(hub.resolve(data["from_hf"], base_dir).path)
        except InvalidInput as e:
            diags.append(locate(file, positions, ("from_hf",), e.message))
    try:
        spec = BundleSpec.model_validate(data)
    except ValidationError as e:
        seen = set()
        for err in e.errors():
            path = _loc_path(err["loc"], data)
            if err["type"] == "union_tag_invalid":
                path += ("family",)
            if isinstance(err.get("input"), list) and any(
                    isinstance(p, str) and p.startswith("literal['rows'") for p in err["loc"]):
                continue  # a list entry: its items' errors say what is wrong
            if path in seen:  # a union reports one error per member; the first says it
                continue
            seen.add(path)
            diags.append(locate(file, positions, path, _pydantic_message(err, data)))
        raise InvalidInput(f"{file}: invalid spec", diags) from None
    if diags:
        raise InvalidInput(f"{file}: invalid spec", diags)

    if (spec.model is None) == (spec.from_hf is None):
        raise InvalidInput(f"{file}: invalid spec", [locate(
            file, positions, ("model",) if spec.model else (),
            "give exactly one of `model:` (family and dims) or `from_hf:` (a directory with config.json)")])
    if spec.model is not None:
        arch = spec.model
    else:
        try:
            arch = families.get(hf_arch["family"]).arch_model.model_validate(hf_arch)
        except ValidationError as e:
            raise InvalidInput(f"{file}: invalid spec", [locate(
                file, positions, ("from_hf",),
                f"config.json: {'.'.join(map(str, err['loc']))}: {_pydantic_message(err)}")
                for err in e.errors()]) from None
    bundle = Bundle(spec, arch, families.get(arch.family), file, base_dir, positions)
    diags = check(bundle)
    errors = [d for d in diags if d.severity == "error"]
    bundle.warnings = [d for d in diags if d.severity == "warning"]
    if errors:
        raise InvalidSpec(f"{file}: invalid spec", diags, bundle)
    return bundle


def _import_hf(d: Path) -> dict:
    from .fsutil import read_user_json

    try:
        cfg = d / "config.json" if d.is_dir() or not d.suffix else d
    except OSError as e:  # a path too long to stat
        raise InvalidInput(f"{d}: cannot read: {e.strerror or e}") from None
    try:
        config = read_user_json(cfg, "config.json", inside=cfg.parent)
    except InvalidInput as e:
        if "no such" in e.message:
            raise InvalidInput(f"{cfg}: not found (from_hf needs a directory with config.json)") from None
        raise
    return hf_config_to_arch(config, str(cfg))


#: config.json keys that must be JSON objects (or null) when present
HF_OBJECT_KEYS = ("text_config", "rope_scaling", "rope_parameters", "quantization_config")
HF_MAX_INT = 2**63 - 1


def _check_hf_values(node, where: str, path: str = "") -> None:
    """Every number in a config.json bounded (no NaN/Inf, integers within int64) before any
    family reads it."""
    if isinstance(node, dict):
        for k, v in node.items():
            _check_hf_values(v, where, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_hf_values(v, where, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise InvalidInput(f"{where}: {path}: {node} is not a finite number")
    elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > HF_MAX_INT:
        raise InvalidInput(f"{where}: {path}: integer out of range (at most {HF_MAX_INT:,} in magnitude)")


def hf_config_to_arch(config: dict, where: str = "config.json") -> dict:
    """The arch fields a family reads from an HF config.json. The shape of the keys every family
    relies on is checked first; a family that still meets a value of an unexpected type raises
    InvalidInput naming the file (never a TypeError)."""
    if not isinstance(config, dict):
        raise InvalidInput(f"{where}: expected a JSON object")
    _check_hf_values(config, where)
    archs = config.get("architectures")
    if archs is None or archs == []:
        raise InvalidInput(f"{where}: no `architectures` entry; cannot tell the model family")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise InvalidInput(f"{where}: architectures: expected a list of class names such as "
                           f'["LlamaForCausalLM"], got {json.dumps(archs)[:60]}')
    for k in HF_OBJECT_KEYS:
        for cfg, at in ((config, k), (config.get("text_config"), f"text_config.{k}")):
            if isinstance(cfg, dict) and k in cfg and cfg[k] is not None and not isinstance(cfg[k], dict):
                raise InvalidInput(f"{where}: {at}: expected a JSON object (or null), got "
                                   f"{json.dumps(cfg[k])[:60]}")
    wrapper = None
    if "text_config" in config and isinstance(config["text_config"], dict):
        # multimodal wrappers (Gemma 3): the text model's dims live in text_config, the vision
        # part's beside it (``Family.from_hf_wrapper``)
        inner = dict(config["text_config"])
        inner.setdefault("architectures", archs)
        config, wrapper = inner, config
    family = families.by_hf_architecture(archs[0])
    try:
        out = family.from_hf(config)
        return out if wrapper is None else family.from_hf_wrapper(wrapper, out)
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
        raise InvalidInput(f"{where}: a value has the wrong type for a {family.name} config "
                           f"({type(e).__name__}: {e}); compare it with the model's published "
                           "config.json") from None


# ---- semantic checks (mesh-independent) ---------------------------------------------------------
def check(b: Bundle) -> list[Diagnostic]:
    """Every mesh-independent rule; ``plan.make.check_mesh`` adds the per-target ones."""
    s, a, d = b.spec, b.arch, []
    names = {t.name: t for t in b.family.tensors(a)}

    for i, t in enumerate(s.targets):
        if meshmod.try_resolve(t) is None:
            d.append(b.locate(("targets", i), f"unknown mesh {t!r}; valid: {meshmod.valid_names()}"))
    if len(set(s.targets)) != len(s.targets):
        d.append(b.locate(("targets",), "targets are listed twice"))

    for tgt, rep in s.replicas.items():
        at = ("replicas", tgt)
        if tgt not in s.targets:
            d.append(b.locate(at, f"{tgt!r} is not one of targets ({', '.join(s.targets)})"))
            continue
        target = meshmod.try_resolve(tgt)
        if target is None:
            continue  # reported at targets
        try:
            sub = meshmod.split(target, rep.submesh)
        except InvalidInput as e:
            d.append(b.locate(at + ("submesh",), e.message))
            continue
        if rep.count is not None and rep.count != sub.replicas:
            d.append(b.locate(at + ("count",), f"count={rep.count}, but {target.describe()} "
                              f"({target.num_devices} chips) holds {target.num_devices} / "
                              f"{sub.num_devices} = {sub.replicas} replicas of {list(rep.submesh)}; "
                              f"write count: {sub.replicas} or leave it out"))

    # sharding: names, ranks, axes
    def check_plan(plan: dict, at: tuple):
        for tname, spec in plan.items():
            if tname not in names:
                d.append(b.locate(at + (tname,), f"unknown tensor {tname!r} for family "
                                  f"{a.family}; tensors: {', '.join(names)}"))
                continue
            rank = len(names[tname].dims)
            if len(spec) != rank:
                dims = ", ".join(f"{x.name}" for x in names[tname].dims)
                d.append(b.locate(at + (tname,), f"has {len(spec)} entries but {tname} has {rank} "
                                  f"dims [{dims}]; give one entry per dim"))
            used = []
            for e in spec:
                used += e if isinstance(e, list) else ([e] if e else [])
            if len(used) != len(set(used)):
                d.append(b.locate(at + (tname,), "uses a mesh axis on two dims; an axis can split "
                                  "one dim of a tensor"))
    check_plan(s.sharding.plan, ("sharding", "plan"))
    for tgt, plan in s.sharding.targets.items():
        if tgt not in s.targets:
            d.append(b.locate(("sharding", "targets", tgt), f"{tgt!r} is not one of targets "
                              f"({', '.join(s.targets)})"))
        check_plan(plan, ("sharding", "targets", tgt))

    # dtypes that ttnn cannot represent
    pol = s.weights.dtypes
    for tname in pol.tensors:
        if tname not in names:
            d.append(b.locate(("weights", "dtypes", "tensors", tname), f"unknown tensor {tname!r}; "
                              f"tensors: {', '.join(names)}"))
    for t in names.values():
        dt = pol.dtype_of(t.name, t.group)
        if dt == "bf16" or t.kind == "matrix":
            continue
        where = (("weights", "dtypes", "tensors", t.name) if t.name in pol.tensors else
                 ("weights", "dtypes", t.group) if getattr(pol, t.group, None) else
                 ("weights", "dtypes", "default"))
        if getattr(pol, t.group, None) is None and t.name not in pol.tensors:
            continue  # 1-D tensors and the embedding silently stay bf16 under a block-float default
        reason = ("block floats need TILE layout and ttnn's embedding reads a ROW_MAJOR table"
                  if t.kind == "embedding" else "block floats need 32x32 tiles; 1-D tensors are kept ROW_MAJOR")
        d.append(b.locate(where, f"{t.name} cannot be {dt}: {reason}; use bf16"))

    # buckets
    bk = b.buckets
    bpath = ("buckets",)
    for key in ("prefill", "decode") if s.task != "embed" else ("prefill",):
        vals = getattr(bk, key)
        if not vals:
            d.append(b.locate(bpath + (key,), "needs at least one bucket"))
            continue
        if vals != sorted(vals) or len(set(vals)) != len(vals):
            d.append(b.locate(bpath + (key,), f"must be sorted and unique, got {vals}; "
                              f"write {sorted(set(vals))}"))
        for i, v in enumerate(vals):
            if v <= 0:
                d.append(b.locate(bpath + (key, i), f"{v} must be positive"))
            elif key == "prefill" and v % TILE:
                d.append(b.locate(bpath + (key, i), f"prefill bucket {v} is not a multiple of {TILE} "
                                  f"(tile height); use {round_up(v, TILE)}"))
            elif key == "decode" and v not in DECODE_TRACE_SIZES:
                d.append(b.locate(bpath + (key, i), f"decode batch {v} is not a traceable size; "
                                  f"use one of {', '.join(map(str, DECODE_TRACE_SIZES))}"))
    rt = s.runtime
    if bk.decode and rt.max_num_seqs > max(bk.decode):
        more = ("" if s.replicas else "; or split a target into replicas (`replicas:`), "
                "each decoding max_num_seqs")
        d.append(b.locate(("runtime", "max_num_seqs"), f"max_num_seqs={rt.max_num_seqs} exceeds the "
                          f"largest decode bucket {max(bk.decode)}; lower it or add a bucket "
                          f"(max {max(DECODE_TRACE_SIZES)}){more}"))
    if bk.prefill:
        top = max(bk.prefill)
        if bk.prefill_chunk is not None:
            if bk.prefill_chunk not in bk.prefill:
                d.append(b.locate(bpath + ("prefill_chunk",), f"prefill_chunk={bk.prefill_chunk} "
                                  f"must be one of the prefill buckets {bk.prefill} (a chunk runs a "
                                  "traced prefill shape)"))
            elif bk.prefill_chunk % rt.kv_block_size:
                d.append(b.locate(bpath + ("prefill_chunk",), f"prefill_chunk={bk.prefill_chunk} "
                                  f"is not a multiple of runtime.kv_block_size={rt.kv_block_size}"))
        elif rt.max_model_len > top:
            d.append(b.locate(bpath + ("prefill",), f"prompts up to max_model_len={rt.max_model_len} "
                              f"need a prefill bucket >= {rt.max_model_len} (largest is {top}) or "
                              f"buckets.prefill_chunk (e.g. {top})"))
    # runtime
    if rt.kv_block_size % TILE:
        d.append(b.locate(("runtime", "kv_block_size"), f"kv_block_size={rt.kv_block_size} is not a "
                          f"multiple of {TILE}"))
    pool = rt.max_tokens_all_users
    if isinstance(pool, int) and pool < rt.max_model_len:
        d.append(b.locate(("runtime", "max_tokens_all_users"), f"max_tokens_all_users={pool} is "
                          f"below max_model_len={rt.max_model_len}: the KV pool must hold one "
                          f"full-length sequence; set it to at least {rt.max_model_len}, lower "
                          "max_model_len, or write `auto` (the largest pool that fits)"))
    if rt.max_model_len > a.max_position_embeddings:
        d.append(b.locate(("runtime", "max_model_len"), f"max_model_len={rt.max_model_len} exceeds the "
                          f"model's max_position_embeddings={a.max_position_embeddings}"))
    if rt.trace_mode == "none" and rt.sample_on_device_mode != "off":
        pass  # sampling on device works untraced too
    # architecture consistency
    if a.num_attention_heads % a.kv_heads:
        d.append(b.locate(("model", "num_key_value_heads"), f"num_attention_heads={a.num_attention_heads}"
                          f" is not a multiple of num_key_value_heads={a.kv_heads}"))
    if a.head_dim is None and a.hidden_size % a.num_attention_heads:
        d.append(b.locate(("model", "hidden_size"), f"hidden_size={a.hidden_size} is not divisible by "
                          f"num_attention_heads={a.num_attention_heads}; set head_dim"))
    # paths
    from .hub import NotCached
    for key, p in (("weights.source", s.weights.source), ("tokenizer", s.tokenizer)):
        if p is None or p is False:
            continue
        at, path = tuple(key.split(".")), b.base_dir / p
        try:
            path = b.resolve_path(p, download=False)  # validation never downloads a model id
            found = path.exists()
        except NotCached as e:  # a model id not downloaded yet: an error only when nothing will
            d.append(b.locate(at, e.message, "error" if e.final else "warning"))
            continue
        except InvalidInput as e:
            d.append(b.locate(at, e.message))
            continue
        except OSError as e:  # ENAMETOOLONG, ELOOP, ...
            d.append(b.locate(at, f"{path}: {e.strerror or e}; give a directory path that exists"))
            continue
        if not found:
            d.append(b.locate(at, f"{path} does not exist (a directory, relative to the spec, or a "
                              "model id ORG/NAME[@REVISION] in the Hugging Face cache)"))
    d += b.family.check(a, b)
    d += _check_vision(b)
    from . import embed, speculative
    d += embed.check(b)
    d += speculative.check(b, load)
    return d


def _check_vision(b: Bundle) -> list[Diagnostic]:
    """Image settings against the model's vision part and the token budget."""
    s, v = b.spec, getattr(b.arch, "vision", None)
    if v is None:
        if s.vision is not None:
            return [b.locate(("vision",), f"the model has no vision part ({b.arch.family} "
                             "text only); remove `vision:` or import a multimodal config")]
        return []
    d, vs, at = [], b.vision, ("vision",)
    bks = vs.buckets
    if not bks:
        return [b.locate(at + ("buckets",), "needs at least one entry")]
    if bks != sorted(set(bks)):
        d.append(b.locate(at + ("buckets",), f"must be sorted and unique, got {bks}; write {sorted(set(bks))}"))
    for i, n in enumerate(bks):
        if n <= 0:
            d.append(b.locate(at + ("buckets", i), f"{n} must be positive"))
    # what the buckets count, and what else must fit, is the family's vision part's rule
    return d + b.family.vision_part(b.arch).check_settings(b, vs)

