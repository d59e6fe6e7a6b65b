"""What a model family declares: dims, tensors, default sharding plan, layer dataflow, HF import.

Shapes follow the device convention (tt_transformers): a linear weight is ``[in, out]`` so that
``y = x @ W``. Each tensor dim is a :class:`Dim` with a *unit*: ``wq``'s output dim is
``Dim("num_attention_heads", 32, unit=128)``, 32 heads of 128 columns, so a split over a mesh axis
is checked in heads, not columns, and the error can say ``num_attention_heads=28 is not divisible
by mesh axis cols=8``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import InvalidInput

# dtype policy groups a tensor can belong to (see spec.DtypePolicy)
GROUPS = ("embedding", "attention", "mlp", "experts", "router", "lm_head", "norms", "vision")


@dataclass(frozen=True)
class Dim:
    """One tensor dim: ``size`` units of ``unit`` elements each (length = size * unit)."""

    name: str
    size: int
    unit: int = 1
    #: query heads grouped under this many KV heads (grouped-query attention): a device holds the
    #: query heads of the KV heads it holds (``layout`` owns the rule); 0 = not grouped
    groups: int = 0

    @property
    def length(self) -> int:
        return self.size * self.unit


@dataclass(frozen=True)
class TensorDecl:
    """A tensor group: one weight of every layer it appears in (``count`` copies)."""

    name: str
    group: str  # one of GROUPS
    dims: tuple[Dim, ...]
    layers: tuple[int, int] | None = None  # [start, stop) of the layers holding it; None = global
    doc: str = ""
    # How ttnn holds it: "matrix" (TILE layout, any dtype), "vector" (1-D, bf16 only),
    # "embedding" (ROW_MAJOR bf16 for ttnn.embedding).
    kind: str = "matrix"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.length for d in self.dims)

    @property
    def count(self) -> int:
        return 1 if self.layers is None else self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class HFName:
    """Where a canonical tensor comes from in a Hugging Face checkpoint.

    ``hf`` keys may hold ``{i}`` (layer index) and ``{e}`` (expert index: one source per expert,
    stacked on a new leading dim). ``transform`` names a function in ``families.transforms``
    taking the list of source tensors (and the arch) and returning the canonical tensor; ``t``
    transposes an HF Linear weight ``[out, in]`` to the device's ``[in, out]``.
    """

    tensor: str
    hf: tuple[str, ...]
    transform: str = "t"


@dataclass(frozen=True)
class KVEntry:
    """Per token, per layer cache entry: ``heads`` x ``head_dim`` sharded like ``follows``'s dim."""

    name: str
    heads: Dim
    head_dim: int
    follows: tuple[str, int] | None  # (tensor, dim index) whose spec entry shards the heads
    count: int  # layers that have it


# ---- Layer dataflow, just enough for sharding propagation and collective accounting ---------
@dataclass(frozen=True)
class Embed:
    w: str
    out: str


@dataclass(frozen=True)
class Norm:
    """Normalization over the full feature dim: needs the whole row on every device."""

    x: str
    out: str
    w: str | None = None


@dataclass(frozen=True)
class Linear:
    """``out = x @ w`` (w is [K, N] or experts [E, K, N])."""

    x: str
    w: str
    out: str


@dataclass(frozen=True)
class Local:
    """Elementwise or per-head compute (rope, attention, SwiGLU): no data crosses devices if the
    inputs are sharded alike. ``out`` takes ``dims`` sharded like the first input's dims."""

    ins: tuple[str, ...]
    out: str
    what: str = ""
    out_dim: Dim | None = None  # the output's last feature dim; default: the first input's
    fn: str = ""  # name of the family's compute function; default: ``what``

    def out_dims(self, in_dims: tuple) -> tuple:
        """The output's feature dims: the first input's, its last one replaced by ``out_dim``."""
        return tuple(in_dims) if self.out_dim is None else tuple(in_dims[:-1]) + (self.out_dim,)

    @property
    def kernel(self) -> str:
        return self.fn or self.what


@dataclass(frozen=True)
class Combine:
    """Weighted sum over the expert dim of ``x`` [E, N] -> [N]."""

    x: str
    out: str


@dataclass(frozen=True)
class Residual:
    """``residual += x``; x must end up sharded like the residual stream."""

    x: str


@dataclass(frozen=True)
class Logits:
    """LM head output gathered for sampling (full vocab on every device)."""

    x: str


Op = Embed | Norm | Linear | Local | Combine | Residual | Logits


@dataclass
class LayerKind:
    """A run of identical layers (e.g. DeepSeek's dense first layers vs MoE layers)."""

    name: str
    count: int
    ops: list = field(default_factory=list)


# ---- Architecture models -----------------------------------------------------------------------
class RopeScaling(BaseModel):
    """HF ``rope_scaling``: the rope variants ttbundle implements."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True)

    rope_type: Literal["default", "linear", "llama3", "yarn"] = "default"
    """Scaling method; unknown types are rejected rather than silently ignored."""
    factor: float | None = None
    """Context extension factor."""
    original_max_position_embeddings: int | None = None
    """Context length the base model was trained with."""
    low_freq_factor: float | None = None
    """llama3: low-frequency wavelength factor."""
    high_freq_factor: float | None = None
    """llama3: high-frequency wavelength factor."""
    beta_fast: float | None = None
    """yarn: fast correction bound."""
    beta_slow: float | None = None
    """yarn: slow correction bound."""
    mscale: float | None = None
    """yarn (DeepSeek): attention scale multiplier."""
    mscale_all_dim: float | None = None
    """yarn (DeepSeek): mscale applied over all dims."""
    truncate: bool | None = None
    """yarn (GPT-OSS): whether correction range bounds are truncated to integers."""


def _lists_as_tuples(cls, data):
    """Strict models take a YAML or JSON list for a tuple field (strict mode alone refuses it);
    the items stay strict."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, f in cls.model_fields.items():
        v = out.get(name)
        if not isinstance(v, list):
            continue
        todo, tuples = [f.annotation], False
        while todo:
            t = todo.pop()
            tuples = tuples or typing.get_origin(t) is tuple or t is tuple
            todo += list(typing.get_args(t)) if typing.get_origin(t) is not tuple else []
        if tuples:
            out[name] = tuple(v)
    return out


class ArchBase(BaseModel):
    """Dims shared by every decoder family, named as in Hugging Face ``config.json``. Types are
    strict (a quoted number or `true` is not a number): a spec's `model:` and a `config.json`
    alike."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, strict=True)

    _tuples = model_validator(mode="before")(classmethod(_lists_as_tuples))

    vocab_size: int = Field(gt=0)
    """Tokens in the vocabulary (rows of the embedding)."""
    hidden_size: int = Field(gt=0)
    """Width of the residual stream."""
    intermediate_size: int = Field(gt=0)
    """Width of the dense MLP's hidden layer."""
    num_hidden_layers: int = Field(gt=0)
    """Decoder layers."""
    num_attention_heads: int = Field(gt=0)
    """Query heads."""
    num_key_value_heads: int | None = Field(default=None, gt=0)
    """Key/value heads (grouped-query attention); defaults to num_attention_heads."""
    head_dim: int | None = Field(default=None, gt=0)
    """Width of one head; defaults to hidden_size / num_attention_heads."""
    max_position_embeddings: int = Field(default=4096, gt=0)
    """Longest context the model supports."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the RMS norms."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    rope_scaling: RopeScaling | None = None
    """Rotary scaling (long-context variants)."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix (the device still holds a transposed copy)."""
    hidden_act: Literal["silu", "gelu_pytorch_tanh", "gelu"] = "silu"
    """MLP activation; others are rejected."""

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


class Family:
    """Base class for a family module. Subclasses fill in the class attributes and methods."""

    name: ClassVar[str]
    hf_architectures: ClassVar[tuple[str, ...]]
    arch_model: ClassVar[type[ArchBase]]
    summary: ClassVar[str] = ""

    # -- declarations ---------------------------------------------------------------------------
    def tensors(self, a) -> list[TensorDecl]:
        raise NotImplementedError

    def default_plan(self, a) -> dict[str, tuple]:
        """PartitionSpec per tensor, declared once for every mesh; axes of size 1 are no-ops."""
        raise NotImplementedError

    def layers(self, a) -> list[LayerKind]:
        raise NotImplementedError

    def traits(self, a) -> dict:
        """Numerics the emulated kernels need beyond dims, as plain data: ``norm_offset``
        (Gemma's 1+w), ``embed_scale``, ``final_softcap``, ``act``."""
        return {}

    def layer_traits(self, a, layer: int) -> dict:
        """Per-layer numerics: ``window`` (sliding window), ``rope_theta``, ``rope_scaling``,
        ``attn_scale``, ``attn_softcap``, ``head_dim``."""
        return {}

    #: model_type of the HF config this family maps to (for building the reference model)
    hf_model_type: ClassVar[str] = ""
    #: mixture of experts: (class name of the HF router module, whose output's item 2 holds each
    #: token's top-k expert indices; name of the emulated routing kernel, whose output's nonzero
    #: entries are the chosen experts). `ttbundle check` records both sides' choices with them.
    hf_router: ClassVar[tuple[str, str] | None] = None

    def to_hf_config(self, a) -> dict:
        """An HF config dict for ``a`` (the numerical reference is built from it)."""
        d = a.model_dump(exclude={"family"}, exclude_none=True)
        d["architectures"] = [self.hf_architectures[0]]
        d["model_type"] = self.hf_model_type or self.name
        return d

    def embed_ops(self, a) -> list:
        """Ops before the first layer (token embedding into the residual stream ``h``)."""
        return [Embed("embed", "h")]

    def head_ops(self, a) -> list:
        """Ops after the last layer (final norm, LM head, logits gathered for sampling)."""
        return head_ops()

    def hf_names(self, a) -> list[HFName]:
        """Canonical tensor <- HF checkpoint keys; every tensor of ``tensors()`` appears once."""
        raise NotImplementedError

    def kv_cache(self, a) -> list[KVEntry]:
        raise NotImplementedError

    def check(self, a, bundle) -> list:
        """Family-specific spec checks; a list of ``Diagnostic`` (via ``bundle.locate``)."""
        return []

    def default_buckets(self, a) -> dict:
        return {"prefill": [128, 1024], "decode": [1, 8, 32], "prefill_chunk": 1024}

    # -- HF import ------------------------------------------------------------------------------
    #: HF config keys copied verbatim into the arch model (others are ignored unless listed in
    #: ``hf_required``); families extend it.
    hf_keys: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "hidden_act",
    )

    #: Checkpoint key rewrites ``(regex, replacement)`` applied before matching ``hf_names``, for
    #: wrappers that nest the text model (Gemma 3's ``model.language_model.`` -> ``model.``).
    hf_key_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: Checkpoint keys (regexes, after renaming) deliberately left unused, e.g. a vision tower.
    hf_ignored: ClassVar[tuple[str, ...]] = ()

    def hf_architecture(self, a) -> str:
        """The HF class name a package of arch ``a`` registers (TT-prefixed for the plugin)."""
        return self.hf_architectures[0]

    def ignored(self, a) -> tuple[str, ...]:
        """The checkpoint keys (regexes) left unused for arch ``a`` (default: ``hf_ignored``)."""
        return self.hf_ignored

    # -- vision (multimodal families) -----------------------------------------------------------
    #: what of the family's programs the ttnn backend does not lower yet (a ttnn build is refused
    #: naming it; the ttnn tests leave the family out); "": all of them
    ttnn_unlowered: str = ""
    #: the class of the family's vision part (a ``vision_part.VisionPart``), None: text only
    vision_class = None
    #: the HF class (of ``hf_architectures``) whose checkpoints carry the vision part
    vision_hf_architecture: str | None = None

    def vision_part(self, a):
        """Arch ``a``'s vision part (a ``vision_class`` bound to ``a.vision``), or None (text
        only). It owns what differs between families (image settings, preprocessing, prompt
        layout and positions, program inputs, the reference, served requests' images): shared
        code calls it, never a family name."""
        v = getattr(a, "vision", None)
        return None if self.vision_class is None or v is None else self.vision_class(v)

    def vision_programs(self, a) -> list | None:
        """(layer kind, count, ops) of the vision encoder's program, or None (text only). Its
        activations start from ``vision_inputs``; its tensors are part of ``tensors()``."""
        return None

    def vision_inputs(self, a) -> dict:
        """Feature dims of the activations a vision program starts from."""
        raise NotImplementedError

    def vision_rows(self, a, images: int) -> tuple[int, dict]:
        """(rows of a vision program for ``images`` images, per activation rows that differ)."""
        raise NotImplementedError

    def from_hf_wrapper(self, config: dict, out: dict) -> dict:
        """Arch fields from a multimodal wrapper config.json (``out``: its text_config's, read
        by :meth:`from_hf`); default: the text model only."""
        return out

    def from_hf(self, config: dict) -> dict:
        """Arch fields (a dict, validated later with the spec) from an HF ``config.json``."""
        out = {"family": self.name}
        for k in self.hf_keys:
            if k in config and config[k] is not None:
                out[k] = config[k]
        rs = out.get("rope_scaling")
        if isinstance(rs, dict):
            rs = dict(rs)
            if "type" in rs and "rope_type" not in rs:
                rs["rope_type"] = rs.pop("type")
            rs.pop("type", None)
            known = set(RopeScaling.model_fields)
            out["rope_scaling"] = {k: v for k, v in rs.items() if k in known}
            if rs.get("rope_type") not in ("default", "linear", "llama3", "yarn"):
                raise InvalidInput(
                    f"config.json: rope_scaling.rope_type={rs.get('rope_type')!r} is not supported "
                    "by ttbundle (supported: default, linear, llama3, yarn)")
        if "rope_parameters" in config and "rope_theta" not in out:  # transformers>=5 layout
            rp = config["rope_parameters"] or {}
            if "rope_theta" in rp:
                out["rope_theta"] = rp["rope_theta"]
        act = config.get("hidden_act") or config.get("hidden_activation")
        if act is not None:
            out["hidden_act"] = act
        return out


# ---- helpers shared by families ----------------------------------------------------------------
def query_heads(a, unit: int) -> Dim:
    """The query-head dim of grouped-query attention: ``unit`` elements per head, grouped under
    the KV heads (so padding and replication keep each head with its KV head)."""
    return Dim("num_attention_heads", a.num_attention_heads, unit, groups=a.kv_heads)


def attention_tensors(a, layers: tuple[int, int], bias: bool = False, qk_norm: bool = False) -> list[TensorDecl]:
    H, KV, hd, d = a.num_attention_heads, a.kv_heads, a.hd, a.hidden_size
    hid = Dim("hidden_size", d)
    t = [
        TensorDecl("wq", "attention", (hid, query_heads(a, hd)), layers, "query projection"),
        TensorDecl("wk", "attention", (hid, Dim("num_key_value_heads", KV, hd)), layers, "key projection"),
        TensorDecl("wv", "attention", (hid, Dim("num_key_value_heads", KV, hd)), layers, "value projection"),
        TensorDecl("wo", "attention", (query_heads(a, hd), hid), layers, "output projection"),
    ]
    if bias:
        t += [
            TensorDecl("bq", "norms", (query_heads(a, hd),), layers, "query bias", "vector"),
            TensorDecl("bk", "norms", (Dim("num_key_value_heads", KV, hd),), layers, "key bias", "vector"),
            TensorDecl("bv", "norms", (Dim("num_key_value_heads", KV, hd),), layers, "value bias", "vector"),
        ]
    if qk_norm:
        t += [
            TensorDecl("q_norm", "norms", (Dim("head_dim", hd),), layers, "per-head query RMSNorm", "vector"),
            TensorDecl("k_norm", "norms", (Dim("head_dim", hd),), layers, "per-head key RMSNorm", "vector"),
        ]
    return t


def mlp_tensors(a, layers: tuple[int, int], intermediate: int | None = None, prefix: str = "") -> list[TensorDecl]:
    hid = Dim("hidden_size", a.hidden_size)
    inter = Dim("intermediate_size", intermediate or a.intermediate_size)
    return [
        TensorDecl(prefix + "w1", "mlp", (hid, inter), layers, "gate projection"),
        TensorDecl(prefix + "w3", "mlp", (hid, inter), layers, "up projection"),
        TensorDecl(prefix + "w2", "mlp", (inter, hid), layers, "down projection"),
    ]


def embedding_tensors(a) -> list[TensorDecl]:
    return [
        TensorDecl("embed", "embedding", (Dim("vocab_size", a.vocab_size), Dim("hidden_size", a.hidden_size)),
                   None, "token embedding", "embedding"),
        TensorDecl("final_norm", "norms", (Dim("hidden_size", a.hidden_size),), None, "final RMSNorm", "vector"),
        TensorDecl("lm_head", "lm_head", (Dim("hidden_size", a.hidden_size), Dim("vocab_size", a.vocab_size)),
                   None, "output projection" + (" (tied: transposed copy of embed)" if a.tie_word_embeddings else "")),
    ]


def norm_tensors(a, layers: tuple[int, int], names=("attn_norm", "ffn_norm")) -> list[TensorDecl]:
    hid = Dim("hidden_size", a.hidden_size)
    return [TensorDecl(n, "norms", (hid,), layers, n.replace("_", " "), "vector") for n in names]


# The tt_transformers-style 2D plan: hidden over rows, heads/intermediate/vocab over cols.
# On a 1xN mesh the rows entries are no-ops.
DENSE_PLAN: dict[str, tuple] = {
    "embed": (None, "cols"),
    "wq": ("rows", "cols"), "wk": ("rows", "cols"), "wv": ("rows", "cols"), "wo": ("cols", "rows"),
    "bq": ("cols",), "bk": ("cols",), "bv": ("cols",),
    "w1": ("rows", "cols"), "w3": ("rows", "cols"), "w2": ("cols", "rows"),
    "lm_head": ("rows", "cols"),
}


def attention_ops(bias: bool = False, qk_norm: bool = False) -> list:
    ops = [Norm("h", "x", "attn_norm"), Linear("x", "wq", "q"), Linear("x", "wk", "k"),
           Linear("x", "wv", "v")]
    ops.append(Local(("q", "k", "v"), "o", "rope + attention" + (" + qk-norm" if qk_norm else "")
                     + (" (+bias)" if bias else ""), fn="attention"))
    ops += [Linear("o", "wo", "attn_out"), Residual("attn_out")]
    return ops


def mlp_ops(prefix: str = "", norm: str = "ffn_norm") -> list:
    return [Norm("h", "x2", norm), Linear("x2", prefix + "w1", "g"), Linear("x2", prefix + "w3", "u"),
            Local(("g", "u"), "gu", "SwiGLU", fn="swiglu"), Linear("gu", prefix + "w2", "mlp_out"), Residual("mlp_out")]


def head_ops() -> list:
    return [Norm("h", "hf", "final_norm"), Linear("hf", "lm_head", "logits"), Logits("logits")]


def standard_hf_names(a, bias: bool = False, qk_norm: bool = False) -> list[HFName]:
    """HF Llama-style keys (Llama, Qwen2/3, Mistral)."""
    p = "model.layers.{i}."
    n = [HFName("embed", ("model.embed_tokens.weight",), "id"),
         HFName("final_norm", ("model.norm.weight",), "id"),
         HFName("lm_head", ("model.embed_tokens.weight",) if a.tie_word_embeddings else ("lm_head.weight",), "t"),
         HFName("wq", (p + "self_attn.q_proj.weight",)), HFName("wk", (p + "self_attn.k_proj.weight",)),
         HFName("wv", (p + "self_attn.v_proj.weight",)), HFName("wo", (p + "self_attn.o_proj.weight",)),
         HFName("w1", (p + "mlp.gate_proj.weight",)), HFName("w3", (p + "mlp.up_proj.weight",)),
         HFName("w2", (p + "mlp.down_proj.weight",)),
         HFName("attn_norm", (p + "input_layernorm.weight",), "id"),
         HFName("ffn_norm", (p + "post_attention_layernorm.weight",), "id")]
    if bias:
        n += [HFName(f"b{x}", (p + f"self_attn.{x}_proj.bias",), "id") for x in "qkv"]
    if qk_norm:
        n += [HFName(f"{x}_norm", (p + f"self_attn.{x}_norm.weight",), "id") for x in "qk"]
    return n


def standard_kv(a, count: int) -> list[KVEntry]:
    kv = Dim("num_key_value_heads", a.kv_heads)
    return [KVEntry("k", kv, a.hd, ("wk", 1), count), KVEntry("v", kv, a.hd, ("wv", 1), count)]


# ---- HF config import helpers (families' ``from_hf``) --------------------------------------------
def reject_hf(config: dict, key: str, ok, why: str) -> None:
    """InvalidInput naming config.json ``key`` when its value fails ``ok`` (absent or null passes)."""
    v = config.get(key)
    if v is not None and not ok(v):
        raise InvalidInput(f"config.json: {key}={v!r} is not supported by ttbundle: {why}")


def hf_fill(config: dict, out: dict, defaults: dict) -> dict:
    """Apply the HF config class's ``defaults`` for keys config.json omits (Gemma 3's text_config
    omits most dims); a key present as null stays null (null disables, e.g. softcapping)."""
    for k, v in defaults.items():
        if k not in config:
            out.setdefault(k, v)
        elif config[k] is None:
            out[k] = None
    return out


def hf_rope(config: dict, layer_type: str | None = None) -> dict:
    """``rope_theta`` and ``rope_scaling`` from either config layout: ``rope_theta`` +
    ``rope_scaling`` (transformers<5) or ``rope_parameters`` (>=5: flat, or keyed by layer type
    as in Gemma 3, pick one with ``layer_type``). Unknown rope types raise naming the key."""
    rp, where = config.get("rope_parameters"), "rope_parameters"
    if isinstance(rp, dict) and layer_type in rp:
        rp, where = rp[layer_type], f"rope_parameters.{layer_type}"
    if not isinstance(rp, dict) or "rope_type" not in rp and "type" not in rp:
        rp, where = {"rope_theta": config.get("rope_theta"), **(config.get("rope_scaling") or {})}, "rope_scaling"
    rs = {k: v for k, v in rp.items() if k != "rope_theta"}
    rtype = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
    supported = RopeScaling.model_fields["rope_type"].annotation.__args__
    if rtype not in supported:
        raise InvalidInput(f"config.json: {where}.rope_type={rtype!r} is not supported by ttbundle "
                           f"(supported: {', '.join(supported)})")
    out = {} if rp.get("rope_theta") is None else {"rope_theta": rp["rope_theta"]}
    out["rope_scaling"] = None if rtype == "default" else \
        {"rope_type": rtype, **{k: v for k, v in rs.items() if k in RopeScaling.model_fields}}
    return out


def hf_import(family: Family, config: dict, defaults: dict | None = None) -> dict:
    """``Family.from_hf`` plus rope from either layout (:func:`hf_rope`), the HF class's
    ``defaults`` for omitted keys (:func:`hf_fill`), and the activation checked under the key
    config.json uses (``hidden_act`` or Gemma's ``hidden_activation``)."""
    acts = family.arch_model.model_fields["hidden_act"].annotation.__args__
    for k in ("hidden_act", "hidden_activation"):
        reject_hf(config, k, acts.__contains__, f"supported: {', '.join(acts)}")
    return hf_fill(config, {**Family.from_hf(family, config), **hf_rope(config)}, defaults or {})


def vision_cap(b, at: tuple, vs, merge_unit: int, per: int, image: str) -> tuple[list, int]:
    """Diagnostics of a merging vision part's buckets, for every such family, and the cap: each
    bucket a multiple of ``merge_unit`` patches, and ``images_per_prompt`` images of up to ``per``
    patches (``image`` says how many pixels make that) held by the largest bucket, or a warning
    stating the cap (a prompt's images are encoded in one call; beyond the cap a 400). Returns
    (diagnostics, the cap in patches)."""
    d = []
    for i, n in enumerate(vs.buckets):
        if n > 0 and n % merge_unit:
            d.append(b.locate(at + ("buckets", i), f"{n} patches is not a multiple of {merge_unit} "
                              f"(spatial_merge_size^2: patches merge {merge_unit} to a soft token); "
                              f"use {-(-n // merge_unit) * merge_unit}"))
    need = vs.images_per_prompt * per
    cap = max(vs.buckets) if vs.buckets else need
    if cap < need:
        d.append(b.locate(at + ("buckets",), f"a cap: images_per_prompt={vs.images_per_prompt} images of up to "
                          f"{image} = {per} patches each) need up to {need} patches, the largest vision bucket "
                          f"holds {cap} (a prompt's images are encoded in one call): a request whose images need "
                          f"more is refused (400) naming this limit; add a bucket of {need} to serve every image",
                          "warning"))
    return d, cap


def image_token_budget(b, vs, per_image: int, image: str, fewer: str, smaller: str | None = None) -> list:
    """Diagnostics of a vision part's prompt budget, for every vision family: one image's
    ``per_image`` tokens (``image`` says what they are) must fit one prefill chunk (an image is
    never split over two chunks), and ``images_per_prompt`` of them must leave room in
    ``max_model_len``. ``fewer`` names what to lower for the second, ``smaller`` what else shrinks
    an image."""
    d, bk = [], b.buckets
    chunk = bk.prefill_chunk or (max(bk.prefill) if bk.prefill else 0)
    if chunk and per_image > chunk:
        d.append(b.locate(("buckets", "prefill_chunk" if bk.prefill_chunk else "prefill"),
                          f"{image} but a prefill chunk holds {chunk}; an image is never split over two chunks: "
                          f"use a chunk >= {per_image}" + (f" or lower {smaller}" if smaller else "")))
    need, room = vs.images_per_prompt * per_image, b.spec.runtime.max_model_len
    if need >= room:
        d.append(b.locate(("vision", "images_per_prompt"), f"{vs.images_per_prompt} images x {per_image} tokens "
                          f"= {need} tokens leave no room in max_model_len={room}; lower {fewer}, or raise "
                          "runtime.max_model_len"))
    return d
