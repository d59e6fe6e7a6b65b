"""The bundle spec's schema: the typed model of the YAML file (pydantic), its names and limits.

``ttbundle.spec.load`` validates a file against :class:`BundleSpec`; ``json_schema()`` is what
``ttbundle schema`` prints.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .. import families

DType = Literal["bf16", "bfp8", "bfp4"]
AxisName = Literal["rows", "cols"]
PartitionEntry = Union[None, AxisName, list[AxisName]]
PartitionSpec = list[PartitionEntry]

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")  # used with fullmatch: `$` passes a final "\n"
# tt_transformers traces decode for these batch sizes (rows are padded to 32 on device)
DECODE_TRACE_SIZES = (1, 2, 4, 8, 16, 32)


def _model_config(**kw):
    """Every model of the spec's own keys: unknown keys refused, and strict types: no string or
    boolean is taken for a number (`"4"`, `true`), nor a string for a boolean (`"yes"`); an int is
    a float. (The families' architecture dims, `model:`, are strict the same way: ``ArchBase``.)"""
    return ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True, **kw)


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
    checkpoints; bf16, fp16 or fp32, or a quantized format its `config.json`'s
    `quantization_config` names: docs/build.md#quantized-checkpoints), relative to the spec file, a Hugging Face hub-cache
    snapshot, or a model id `ORG/NAME[@REVISION]` found in the Hugging Face cache (downloaded
    unless `HF_HUB_OFFLINE=1`; a path that exists wins). Omit for a plan-only spec."""
    dtypes: DtypePolicy = Field(default_factory=DtypePolicy)
    """Storage dtype per tensor group."""
    adapters: list[str] = Field(default_factory=list)
    """PEFT LoRA adapters merged into the checkpoint's weights at conversion, in order: each a
    directory with `adapter_config.json` and `adapter_model.safetensors` (relative to the spec
    file, a hub-cache snapshot or a model id, as `source`). `W + (lora_alpha / r) B A` per target
    module (`use_rslora`: `alpha / sqrt(r)`; `rank_pattern` / `alpha_pattern` honoured),
    `modules_to_save` replace their tensors; `check` runs transformers on the same merged weights."""


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
    output_tokens_per_step: int = Field(default=1, ge=1, le=32)
    """Tokens a decode step may produce per host round trip (Tenstorrent's
    `model_capabilities["output_tokens_per_step"]`): the decode program replayed that many times
    in one engine step, each replay's sampled ids fed into the next on the device, read back
    once. Needs sampling on the device and a device that feeds sampled ids (the emulated mesh,
    and the ttnn lowering's token feed: verified on the recording double and in mock mode); a
    batch with a row sampled on the host runs one token a step. vLLM sees it as that many tokens scheduled a step (every one accepted)."""
    trace_region_size: int | None = Field(default=None, gt=0)
    """Bytes reserved for captured traces; default: a ttnn build's count of the traces' need + 25% (`plan` shows an op-count estimate). Below the need: refused at build."""
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

    submesh: tuple[Annotated[int, Field(gt=0, strict=True)], Annotated[int, Field(gt=0, strict=True)]] = \
        Field(strict=False)  # a YAML list is the tuple; its items stay strict
    """[rows, cols] of one replica's submesh; must tile the target (rows divide its rows, cols
    its cols)."""
    count: int | None = Field(default=None, gt=0)
    """Number of replicas; optional, and when given it must equal the target's chips divided by
    the submesh's."""


    @field_validator("submesh", mode="before")
    @classmethod
    def _two(cls, v):
        if isinstance(v, (list, tuple)) and len(v) != 2:
            raise ValueError(f"a submesh is [rows, cols]: 2 numbers, got {len(v)} ({list(v)!r})")
        return v


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
    """Qwen2.5-VL and Qwen3-VL: the image processor enlarges a smaller image to at least this many
    pixels (default 3136 = 56 x 56; `ttbundle init` writes the checkpoint's)."""
    max_pixels: int | None = Field(default=None, gt=0)
    """Qwen2.5-VL and Qwen3-VL: the image processor shrinks a larger image to at most this many
    pixels, which bounds one image's patches (max_pixels / patch_size^2) and soft tokens (a
    quarter of them); default: 256 soft tokens' worth (200704 = 256 x 28 x 28 pixels at 14-pixel
    patches; `ttbundle init` writes the checkpoint's)."""
    longest_edge: int | None = Field(default=None, gt=0)
    """Mistral 3: the image processor shrinks an image whose longer side exceeds this many pixels
    (aspect kept), then rounds both sides up to merge blocks (patch_size x spatial_merge_size);
    at most the encoder's image_size; default: 16 merge blocks (448 pixels at 14-pixel patches)."""
    image_mean: list[float] | None = Field(default=None, min_length=3, max_length=3)
    """The image processor's per-channel (RGB) mean, subtracted after scaling to [0, 1]; default:
    the family's processor's (Gemma 3 and Qwen3-VL 0.5, Qwen2.5-VL and Mistral 3 CLIP's). `ttbundle
    init` writes the checkpoint's (`preprocessor_config.json`)."""
    image_std: list[float] | None = Field(default=None, min_length=3, max_length=3)
    """The image processor's per-channel (RGB) standard deviation (divides after the mean);
    default: the family's processor's, as `image_mean`."""


class Embedding(BaseModel):
    """How an embedding bundle (`task: embed`) makes one vector of a prompt's final hidden states
    (after the model's final norm), as sentence-transformers' `Pooling` and `Normalize` modules do."""

    model_config = _model_config()

    pooling: Literal["last", "mean", "cls"] = "last"
    """`last`: the last prompt token's hidden state (decoder embedding models, e.g.
    Qwen3-Embedding); `mean`: the mean over the prompt's tokens; `cls`: the first token's."""
    normalize: bool = True
    """L2-normalize the pooled vector (a request's `use_activation`, as vLLM names it, overrides)."""


#: per storage (the coarsest format a package stores: its weights' or KV cache's), the quality
#: targets `check` applies where a spec declares none: teacher-forced top-1 and top-5 agreement
#: with the original checkpoint, mean KL divergence (nats) and perplexity ratio, on natural text.
#: Measured: docs/check.md, "Quality targets" (the demo model in bfp8, bfp8 + bfp4 MLP and bfp4,
#: with tt-transformers' published Llama-3.1-8B N150 targets, top-1 >= 0.90 and top-5 >= 0.97,
#: for bfp8)
DEFAULT_QUALITY = {
    "bf16": {"top1": 0.97, "top5": 0.99, "kl_mean": 0.01, "ppl_ratio": 1.02},
    "bfp8": {"top1": 0.90, "top5": 0.97, "kl_mean": 0.03, "ppl_ratio": 1.05},
    "bfp4": {"top1": 0.75, "top5": 0.93, "kl_mean": 0.15, "ppl_ratio": 1.15},
}


class QualityTarget(BaseModel):
    """What `ttbundle check` requires of a package against its original checkpoint, teacher-forced
    on natural text (docs/check.md); a metric left out is reported, not judged."""

    model_config = _model_config()

    top1: Annotated[float, Field(ge=0, le=1)] | None = None
    """Share of positions where the package's most likely next token is the original's."""
    top5: Annotated[float, Field(ge=0, le=1)] | None = None
    """Share of positions where the original's most likely next token is in the package's top 5."""
    kl_mean: Annotated[float, Field(ge=0)] | None = None
    """Mean KL divergence of the package's next-token distribution from the original's (nats), at most."""
    ppl_ratio: Annotated[float, Field(gt=0)] | None = None
    """The package's perplexity of the text over the original's, at most."""


class Quality(BaseModel):
    """Quality targets per storage: the coarsest format the package stores (weights or KV cache);
    a storage left out takes `check`'s defaults (docs/check.md)."""

    model_config = _model_config()

    bf16: QualityTarget | None = None
    """A package storing bf16 only (weights and KV cache)."""
    bfp8: QualityTarget | None = None
    """A package whose coarsest storage is bfp8 (weights or KV cache)."""
    bfp4: QualityTarget | None = None
    """A package storing some weights as bfp4."""


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
    this bundle's, no `speculative:` of its own; with `replicas:`, the same split of each target
    (the draft runs beside each replica)."""


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
    quality: Quality | None = None
    """`ttbundle check`'s quality targets per storage (teacher-forced top-1/top-5, KL divergence,
    perplexity ratio against the original checkpoint on natural text); absent: its defaults."""
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
