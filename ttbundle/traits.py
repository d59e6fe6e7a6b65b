"""The numerics a program's executors need beyond its shapes: the family's traits, typed.

A family says, as plain data, what its kernels compute beyond dims (``Family.traits(arch)``:
norms, activation, soft-caps, MoE and MLA settings, M-RoPE sections; ``Family.layer_traits(arch,
layer)``: sliding window, rope variant, attention scale). ``lower`` records them in every program
(:class:`Traits`, one :class:`LayerTraits` per decoder layer), the package's
``programs/*.json`` hold them, ``program.verify`` checks them at load, and both backends read
them from the program, never from the family.

Each record is a frozen dataclass, one per concern, and also a read-only mapping of its set
fields (``traits.get("norm_offset")``, ``traits["moe"]["top_k"]``, enums as their values): the
spelling the backends' op code uses. A field left ``None`` is absent from the mapping, as the
family's dict left it out; :class:`LayerTraits` always has ``rope_theta`` and ``rope_scaling``
(resolved per layer: ``None`` = no scaling, which may differ from the arch's).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from pydantic import ValidationError

from .families.base import RopeScaling


class TraitsError(ValueError):
    """Traits that are not valid for this program format (an unknown key, a wrong type)."""


class Act(str, enum.Enum):
    """The MLP activation (HF ``hidden_act``): the closed set the kernels implement."""

    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"
    GELU = "gelu"


class _Record(Mapping):
    """A frozen dataclass read as the mapping of its set fields (enums as their values)."""

    #: fields present in the mapping even when None (a None that means something)
    _keep_none: tuple[str, ...] = ()

    def _keys(self) -> tuple[str, ...]:
        # worked out once per record (it is frozen): the kernels read traits per layer per step
        keys = self.__dict__.get("_set_fields")
        if keys is None:
            keys = tuple(f.name for f in fields(self)
                         if f.name in self._keep_none or not _empty(getattr(self, f.name)))
            object.__setattr__(self, "_set_fields", keys)
        return keys

    def _values(self) -> dict:
        # the mapping as a plain dict, made once (the record is frozen): ``get`` on it is a dict
        # lookup, where Mapping.get went through __getitem__ and a KeyError per absent trait
        d = self.__dict__.get("_set_values")
        if d is None:
            d = {k: (v.value if isinstance(v, enum.Enum) else v) for k in self._keys() for v in (getattr(self, k),)}
            object.__setattr__(self, "_set_values", d)
        return d

    def __getitem__(self, key):
        return self._values()[key]

    def get(self, key, default=None):
        return self._values().get(key, default)

    def __contains__(self, key) -> bool:
        return key in self._values()

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    @classmethod
    def of(cls, d: Mapping, where: str):
        """The record of a family's (or a program file's) dict ``d``; unknown keys refused."""
        if not isinstance(d, Mapping):
            raise TraitsError(f"{where}: expected a mapping, got {type(d).__name__}")
        known = {f.name: f for f in fields(cls)}
        extra = sorted(set(d) - set(known))
        if extra:
            raise TraitsError(f"{where}: unknown trait(s) {', '.join(map(repr, extra))}; known: "
                              f"{', '.join(sorted(known))}")
        try:
            return cls(**{k: cls._convert(k, v, f"{where}.{k}") for k, v in d.items()})
        except TypeError as e:  # a required field missing
            raise TraitsError(f"{where}: {e}") from None

    @classmethod
    def _convert(cls, key: str, v, where: str):
        return v

    def to_json(self) -> dict:
        out = {}
        for k in self:
            v = getattr(self, k)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, _Record):
                v = v.to_json()
            elif isinstance(v, RopeScaling):
                v = v.model_dump(exclude_none=True)
            elif isinstance(v, dict):
                v = {n: x.to_json() for n, x in sorted(v.items())}
            elif isinstance(v, tuple):
                v = list(v)
            out[k] = v
        return out


def _empty(v) -> bool:
    return v is None or (isinstance(v, (tuple, dict)) and not v)


def _number(v, where: str, kind=float):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise TraitsError(f"{where}: expected {'an integer' if kind is int else 'a number'}, got {v!r}")
    return kind(v)


@dataclass(frozen=True, eq=True)
class NormTraits(_Record):
    """How one norm differs from the arch's RMSNorm: its eps, the leading features it
    normalizes (the rest pass), a LayerNorm with its bias weight (vision towers)."""

    eps: float | None = None
    features: int | None = None
    layer_norm: bool | None = None
    bias: str | None = None

    @classmethod
    def _convert(cls, key, v, where):
        if v is None:
            return None
        if key == "layer_norm":
            return bool(v)
        if key == "bias":
            if not isinstance(v, str):
                raise TraitsError(f"{where}: expected a weight name, got {v!r}")
            return v
        return _number(v, where, int if key == "features" else float)


@dataclass(frozen=True, eq=True)
class MLATraits(_Record):
    """Multi-head latent attention (DeepSeek-V3): latent rank, head dims, interleaved rope."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = False

    @classmethod
    def _convert(cls, key, v, where):
        return bool(v) if key == "rope_interleave" else _number(v, where, int)


@dataclass(frozen=True, eq=True)
class MoETraits(_Record):
    """Expert routing: top-k, group-limited routing and its scaling (DeepSeek-V3), the clamped
    SwiGLU of GPT-OSS experts."""

    top_k: int
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool | None = None
    routed_scaling_factor: float | None = None
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    @classmethod
    def _convert(cls, key, v, where):
        if v is None or key == "norm_topk_prob":
            return v if v is None else bool(v)
        return _number(v, where, int if key in ("top_k", "n_group", "topk_group") else float)


@dataclass(frozen=True, eq=True)
class Traits(_Record):
    """The model's traits, the same for every layer (``Family.traits`` with ``act`` resolved
    from the arch's ``hidden_act`` where the family leaves it out)."""

    act: Act = Act.SILU
    norm_offset: float | None = None  # Gemma: x * (offset + w)
    norm_weight_fp32: bool | None = None  # GPT-OSS: the weight multiplied in float32
    embed_scale: float | None = None
    final_softcap: float | None = None
    norms: dict[str, NormTraits] = field(default_factory=dict)  # by the norm's weight name
    linear_fp32: tuple[str, ...] = ()  # matmuls computed in float32 (a router)
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool | None = None
    mla: MLATraits | None = None
    moe: MoETraits | None = None

    @classmethod
    def _convert(cls, key, v, where):
        if v is None:
            return None
        if key == "act":
            try:
                return Act(v)
            except ValueError:
                raise TraitsError(f"{where}: activation {v!r} is none of "
                                  f"{', '.join(a.value for a in Act)}") from None
        if key == "norms":
            if not isinstance(v, Mapping):
                raise TraitsError(f"{where}: expected a mapping of norm name -> settings")
            return {n: NormTraits.of(x, f"{where}.{n}") for n, x in v.items()}
        if key == "linear_fp32":
            return tuple(str(x) for x in v)
        if key == "mrope_section":
            return tuple(_number(x, where, int) for x in v)
        if key == "mla":
            return MLATraits.of(v, where)
        if key == "moe":
            return MoETraits.of(v, where)
        if key in ("norm_weight_fp32", "mrope_interleaved"):
            return bool(v)
        return _number(v, where)

    @classmethod
    def of_family(cls, family, arch) -> "Traits":
        """The family's traits of ``arch`` (``Family.traits``), typed; ``act`` from the arch."""
        d = dict(family.traits(arch))
        d.setdefault("act", getattr(arch, "hidden_act", Act.SILU.value))
        return cls.of(d, f"{family.name} traits")


@dataclass(frozen=True, eq=True)
class LayerTraits(_Record):
    """One decoder layer's traits (``Family.layer_traits``), its rope resolved against the arch."""

    _keep_none = ("rope_scaling",)

    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    head_dim: int | None = None
    window: int | None = None  # sliding-window attention
    attn_scale: float | None = None
    attn_softcap: float | None = None

    @classmethod
    def _convert(cls, key, v, where):
        if v is None:
            return None
        if key == "rope_scaling":
            try:
                return v if isinstance(v, RopeScaling) else RopeScaling.model_validate(v)
            except ValidationError as e:
                err = e.errors()[0]
                raise TraitsError(f"{where}.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        return _number(v, where, int if key in ("head_dim", "window") else float)

    @classmethod
    def of_family(cls, family, arch, layer: int) -> "LayerTraits":
        d = {"rope_theta": getattr(arch, "rope_theta", 10000.0), "rope_scaling": getattr(arch, "rope_scaling", None),
             **family.layer_traits(arch, layer)}
        return cls.of(d, f"{family.name} layer {layer} traits")


@dataclass(frozen=True, eq=True)
class Dims(_Record):
    """The model's sizes an executor needs beyond each step's shapes: the residual width (a
    whole ``h``), the vocabulary (logits), the decoder layers and their KV heads and head width
    (the KV cache, a layer's attention), the RMSNorm eps a norm falls back to, and the longest
    context the package serves (``runtime.max_model_len``: rope tables, page tables, vLLM's
    cap). ``lower`` records them from the arch and the spec; nothing after it reads those."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_model_len: int

    @classmethod
    def _convert(cls, key, v, where):
        return _number(v, where, float if key == "rms_norm_eps" else int)

    @classmethod
    def of_arch(cls, arch, max_model_len: int) -> "Dims":
        """The dims of ``arch`` (``families.base.ArchBase``) serving up to ``max_model_len``."""
        return cls(hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
                   num_hidden_layers=arch.num_hidden_layers, num_kv_heads=arch.kv_heads, head_dim=arch.hd,
                   rms_norm_eps=float(arch.rms_norm_eps), max_model_len=int(max_model_len))


def model_traits(family, arch) -> tuple[Traits, tuple[LayerTraits, ...]]:
    """What ``lower`` records in a program: the model's traits and each decoder layer's."""
    return (Traits.of_family(family, arch),
            tuple(LayerTraits.of_family(family, arch, i) for i in range(arch.num_hidden_layers)))


__all__ = ["Act", "Dims", "LayerTraits", "MLATraits", "MoETraits", "NormTraits", "Traits", "TraitsError", "model_traits"]
