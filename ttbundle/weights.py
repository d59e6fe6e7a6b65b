"""Hugging Face checkpoints -> canonical tensors, through each family's name table.

A canonical weight set maps a tensor name to one tensor (global tensors) or to a list with one
tensor per layer of the tensor's layer range. Every HF tensor must be consumed and every
canonical tensor found: an unmapped or missing tensor is a loud error naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterable

from .errors import InvalidInput
from .families import transforms

# HF buffers that are not weights (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Checkpoint:
    """Lazy access to the tensors of a safetensors checkpoint (one file or a sharded index)."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        d = Path(directory)
        index = d / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise InvalidInput(f"{index}: not a safetensors index ({e})") from None
            files = {k: d / v for k, v in weight_map.items()}
        else:
            shards = sorted(d.glob("*.safetensors"))
            if not shards:
                raise InvalidInput(f"{d}: no *.safetensors files and no model.safetensors.index.json")
            files = {}
            for f in shards:
                with safe_open(f, framework="pt") as h:
                    for k in h.keys():
                        files[k] = f
        missing = sorted({str(f) for f in files.values() if not f.exists()})
        if missing:
            raise InvalidInput(f"{d}: index names missing shard files: {', '.join(missing)}")
        self.files = files
        self._open = safe_open

    def keys(self) -> set[str]:
        return set(self.files)

    def get(self, key: str):
        with self._open(self.files[key], framework="pt") as h:
            return h.get_tensor(key)


def _expand(key: str, layer: int | None, experts: int | None) -> list[str]:
    k = key.replace("{i}", str(layer)) if layer is not None else key
    if "{e}" in k:
        return [k.replace("{e}", str(e)) for e in range(experts or 0)]
    return [k]


def renamed(family, keys: Iterable[str]) -> dict[str, str]:
    """Family key name -> checkpoint key, after the family's renames (e.g. Gemma 3's multimodal
    ``language_model.model.`` prefix) and without the keys it deliberately ignores."""
    out = {}
    for k in keys:
        n = k
        for pat, rep in family.hf_key_renames:
            n = re.sub(pat, rep, n)
        if any(re.search(p, n) for p in family.hf_ignored):
            continue
        out[n] = k
    return out


def read_plan(family, a, keys: Iterable[str], aliases: dict[str, set[str]] | None = None
              ) -> list[tuple[str, int | None, list[tuple[str, list[str]]]]]:
    """What to read for each canonical tensor, checked both ways before anything is read:
    ``(tensor, layer, [(hf key pattern, [checkpoint keys])])`` in declaration order. A missing
    tensor or a checkpoint tensor no entry consumes is an error naming it. ``aliases`` maps a
    key to the keys sharing its storage (tied weights in a state_dict count as one)."""
    keymap = renamed(family, keys)
    decls = {t.name: t for t in family.tensors(a)}
    table = {n.tensor: n for n in family.hf_names(a)}
    if set(table) != set(decls):  # a family bug, not a user error
        raise RuntimeError(f"{family.name}: name table and tensors disagree: "
                           f"{sorted(set(table) ^ set(decls))}")
    jobs, used = [], set()
    for name, t in decls.items():
        entry = table[name]
        experts = t.dims[0].size if any("{e}" in k for k in entry.hf) else None
        for layer in ([None] if t.layers is None else range(*t.layers)):
            srcs = []
            for k in entry.hf:
                names = _expand(k, layer, experts)
                for n in names:
                    if n not in keymap:
                        where = f" (layer {layer})" if layer is not None else ""
                        raise InvalidInput(f"checkpoint has no tensor {n!r}, needed for {name}{where}")
                used.update(names)
                srcs.append((k, [keymap[n] for n in names]))
            jobs.append((name, layer, srcs))
    back = {orig: n for n, orig in keymap.items()}
    for k in list(used):  # a tied duplicate of a used tensor is used too
        used |= {back[o] for o in (aliases or {}).get(keymap[k], ()) if o in back}
    leftover = sorted(k for k in set(keymap) - used if not k.endswith(IGNORED_SUFFIXES))
    if leftover:
        more = f" (and {len(leftover) - 5} more)" if len(leftover) > 5 else ""
        raise InvalidInput(f"cannot map checkpoint tensor {leftover[0]!r} to any {family.name} tensor; "
                           f"unmapped: {', '.join(map(repr, leftover[:5]))}{more}")
    return jobs


def canonical(family, a, get: Callable[[str], object], keys: Iterable[str],
              aliases: dict[str, set[str]] | None = None) -> dict:
    """Canonical tensors of ``family`` from HF tensors (``get(key)``), through :func:`read_plan`."""
    import torch

    decls = {t.name: t for t in family.tensors(a)}
    table = {n.tensor: n for n in family.hf_names(a)}
    out: dict = {}
    for name, layer, srcs in read_plan(family, a, keys, aliases):
        t = decls[name]
        parts = [torch.stack([get(k) for k in ks]) if "{e}" in pat else get(ks[0]) for pat, ks in srcs]
        w = transforms.apply(table[name].transform, parts, a)
        if tuple(w.shape) != t.shape:
            raise InvalidInput(f"{name}{'' if layer is None else f' (layer {layer})'}: checkpoint "
                               f"gives shape {list(w.shape)}, the architecture says {list(t.shape)}")
        if t.layers is None:
            out[name] = w
        else:
            out.setdefault(name, []).append(w)
    return out


def load_canonical(family, a, directory: str | Path) -> dict:
    ck = Checkpoint(directory)
    return canonical(family, a, ck.get, ck.keys())


def from_state_dict(family, a, sd: dict) -> dict:
    """From an in-memory state_dict; keys sharing storage (tied embeddings) count as one."""
    groups: dict = {}
    for k, t in sd.items():
        groups.setdefault((t.data_ptr(), tuple(t.shape)), set()).add(k)
    aliases = {k: g for g in groups.values() for k in g}
    return canonical(family, a, sd.__getitem__, sd.keys(), aliases)
