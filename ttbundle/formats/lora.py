"""PEFT LoRA adapters merged into a checkpoint's weights as they are read: the one owner of the
merge arithmetic, used by the build's conversion and both sides of ``check`` (through
``weights.Checkpoint``), so the package and its reference hold the same merged weights.

An adapter is a directory with ``adapter_config.json`` and ``adapter_model.safetensors``, as
PEFT's ``save_pretrained`` writes them: ``base_model.model.<module>.lora_A.weight`` [r, in] and
``.lora_B.weight`` [out, r] per target module (``lora_embedding_A`` [r, vocab] /
``lora_embedding_B`` [hidden, r] for an embedding), and ``base_model.model.<module>.weight`` (and
``.bias``) for each of ``modules_to_save`` (a whole replacement). The merge is PEFT's
``merge_and_unload``: ``W + scaling * B @ A`` (an embedding: ``W + scaling * (B @ A)^T``),
``scaling = alpha / r`` (``use_rslora``: ``alpha / sqrt(r)``), ``r`` and ``alpha`` from
``rank_pattern`` / ``alpha_pattern`` where a pattern names the module; adapters apply in the
order given, in float32, the result rounded once by the package's storage.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidInput
from ..fsutil import read_user_json

PREFIX = "base_model.model."
#: adapter_config.json settings whose other values ttbundle cannot merge
REFUSED = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None)}


@dataclass
class Delta:
    """One low-rank update of a base tensor: ``scaling * B @ A`` (``embedding``: transposed)."""

    adapter: Path
    a: str
    b: str
    scaling: float
    embedding: bool = False


@dataclass
class Adapter:
    dir: Path
    config: dict
    shapes: dict = field(default_factory=dict)  # adapter key -> shape
    deltas: dict = field(default_factory=dict)  # base key -> Delta
    replaced: dict = field(default_factory=dict)  # base key -> adapter key (modules_to_save)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's ``get_pattern_key``: the first pattern that names ``module`` (a suffix match on
    whole names, as a regular expression)."""
    for pat, v in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pat})$", module):
            return v
    return default


def _targeted(targets, module: str) -> bool:
    """PEFT's target check: a list names modules by (dotted) suffix, a string is a regex that
    must match the whole name."""
    if targets is None:
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def read_adapter(d: Path) -> Adapter:
    """An adapter directory read (its config and tensor shapes; no values)."""
    from safetensors import safe_open

    d = Path(d)
    cfg_path, model = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not cfg_path.is_file() or not model.is_file():
        raise InvalidInput(f"{d}: not a PEFT adapter (needs adapter_config.json and adapter_model.safetensors"
                           f"{'; adapter_model.bin is not read, re-save with safetensors' if (d / 'adapter_model.bin').exists() else ''})")
    cfg = read_user_json(cfg_path, "adapter_config.json", inside=d)
    if not isinstance(cfg, dict):
        raise InvalidInput(f"{cfg_path}: expected a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidInput(f"{cfg_path}: peft_type={cfg.get('peft_type')!r}: ttbundle merges LoRA adapters only")
    for k, ok in REFUSED.items():
        if cfg.get(k) not in ok:
            raise InvalidInput(f"{cfg_path}: {k}={cfg[k]!r} cannot be merged by ttbundle (it merges plain LoRA: "
                               f"{k} {ok[0]!r})")
    r0, alpha0 = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r0, int) or r0 <= 0 or not isinstance(alpha0, (int, float)):
        raise InvalidInput(f"{cfg_path}: r={r0!r}, lora_alpha={alpha0!r}: expected a positive integer rank and a "
                           "number")
    ad = Adapter(d, cfg)
    try:
        with safe_open(str(model), framework="pt") as h:
            ad.shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
    except Exception as e:  # noqa: BLE001 - a corrupt file, whatever safetensors raises
        raise InvalidInput(f"{model}: not a readable safetensors file ({e})") from None
    save = cfg.get("modules_to_save") or []
    for k, shape in ad.shapes.items():
        if not k.startswith(PREFIX):
            raise InvalidInput(f"{model}: {k}: expected PEFT's names (base_model.model.<module>...)")
        name = k[len(PREFIX):]
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)(\.weight)?", name)
        if m is None:
            module = name.rsplit(".", 1)[0]
            if not any(module == s or module.endswith("." + s) for s in save):
                raise InvalidInput(f"{model}: {k} is neither a LoRA factor nor in modules_to_save "
                                   f"({save}); ttbundle merges lora_A/lora_B pairs and replaces modules_to_save")
            ad.replaced[name] = k
            continue
        module, part = m.group(1), m.group(2)
        if part.endswith("B"):
            continue
        if not _targeted(cfg.get("target_modules"), module):
            raise InvalidInput(f"{model}: {k}: module {module!r} is not in the adapter's target_modules "
                               f"({cfg.get('target_modules')!r})")
        emb = part == "lora_embedding_A"
        bk = k.replace("lora_embedding_A" if emb else "lora_A", "lora_embedding_B" if emb else "lora_B")
        if bk not in ad.shapes:
            raise InvalidInput(f"{model}: {k} has no {bk} beside it")
        r = _pattern_value(cfg.get("rank_pattern"), module, r0)
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, alpha0)
        ash, bsh = shape, ad.shapes[bk]
        if len(ash) != 2 or len(bsh) != 2 or ash[0] != r or bsh[1] != r:
            raise InvalidInput(f"{model}: {k} {list(ash)} and {bk} {list(bsh)} are not rank-{r} factors "
                               f"(A [r, in], B [out, r]; r from adapter_config.json)")
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        ad.deltas[module + ".weight"] = Delta(d, k, bk, scaling, emb)
    return ad


def check_against(adapters: list, shapes: dict) -> None:
    """Every adapter tensor names a base tensor of the right shape (``shapes``: base key ->
    shape, the checkpoint's decoded view); else InvalidInput naming the tensor."""
    for ad in adapters:
        model = ad.dir / "adapter_model.safetensors"
        for base, dl in ad.deltas.items():
            if base not in shapes:
                raise InvalidInput(f"{model}: {dl.a} targets {base!r}, which the base checkpoint does not have")
            a, b = ad.shapes[dl.a], ad.shapes[dl.b]
            want = (a[1], b[0]) if dl.embedding else (b[0], a[1])
            if shapes[base] is not None and tuple(shapes[base]) != want:
                raise InvalidInput(f"{model}: {dl.a} {list(a)} with {dl.b} {list(b)}: their update gives "
                                   f"{list(want)}, the base {base} is {list(shapes[base])}: the adapter was trained "
                                   "for another model")
        for base, k in ad.replaced.items():
            if base not in shapes:
                raise InvalidInput(f"{model}: {k} (modules_to_save) replaces {base!r}, which the base checkpoint "
                                   "does not have")
            if shapes[base] is not None and tuple(shapes[base]) != ad.shapes[k]:
                raise InvalidInput(f"{model}: {k} is {list(ad.shapes[k])}, the base {base} is {list(shapes[base])}")


def merged(x, base: str, adapters: list, read):
    """Base tensor ``x`` of key ``base`` with every adapter applied in order (``read(adapter dir,
    key)`` reads an adapter tensor): float32, or ``x`` itself where no adapter touches it."""
    import torch

    out = None
    for ad in adapters:
        if base in ad.replaced:
            out = read(ad.dir, ad.replaced[base]).float()
        dl = ad.deltas.get(base)
        if dl is not None:
            if out is None:
                out = x.float().clone()
            a, b = read(ad.dir, dl.a).float(), read(ad.dir, dl.b).float()
            d = b @ a
            out += dl.scaling * (d.t() if dl.embedding else d)
    return x if out is None else out.to(torch.float32)
