"""Hugging Face checkpoints -> canonical tensors, through each family's name table.

A canonical weight set maps a tensor name to one tensor (global tensors) or to a list with one
tensor per layer of the tensor's layer range. Every HF tensor must be consumed and every
canonical tensor found: an unmapped or missing tensor is a loud error naming it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable

from .errors import Diagnostic, InvalidInput
from .families import transforms
from . import formats
from .formats import lora
from .fsutil import read_user_json, user_file

# HF buffers that are not weights (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


#: Checkpoint dtypes (safetensors names) the name tables read: bf16, fp16 or fp32 (the storage
#: dtype decides: conversion casts each value to the package's bf16, or through float32 to a block
#: float). A quantized checkpoint is read through its format's decoded view (``formats``), which
#: gives bf16; an integer, fp8 or fp64 tensor outside it is refused.
FLOAT_SOURCES = frozenset({"BF16", "F16", "F32"})
#: dtypes whose values are checked for NaN/Inf as they are read
CHECKED_FINITE = frozenset({"BF16", "F16", "F32", "F64"})
FINITE_CHUNK = 1 << 22  # elements per isfinite() pass: bounded scratch memory on big tensors


def shard_name(index: Path, name) -> str:
    """A shard file named by a safetensors index: a plain file name in the index's directory
    (never a path into another one); else InvalidInput."""
    if not isinstance(name, str) or "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        raise InvalidInput(f"{index}: refusing shard file {name!r} (must be a file name in {index.parent})")
    return name


class Checkpoint:
    """Lazy access to the tensors of a safetensors checkpoint (one file or a sharded index).
    Every file must be a regular file inside ``directory``; an unreadable, truncated or lying
    file is InvalidInput naming it, and every tensor read is checked for NaN/Inf (all
    non-finite tensors are listed, each with its counts)."""

    def __init__(self, directory: str | Path, quantization: dict | None = None, adapters=()):
        d = Path(directory)
        self.dir = d
        self.dtypes: dict[str, str] = {}
        shapes: dict[str, tuple] = {}
        index = d / "model.safetensors.index.json"
        if index.exists():
            data = read_user_json(index, "safetensors index", inside=d)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise InvalidInput(f"{index}: not a safetensors index (needs \"weight_map\": "
                                   "{tensor name: file name})")
            files = {k: d / shard_name(index, v) for k, v in weight_map.items()}
            missing = sorted({str(f) for f in files.values() if not f.exists()})
            if missing:
                raise InvalidInput(f"{d}: index names missing shard files: {', '.join(missing)}")
            shards = sorted(set(files.values()))
        else:
            shards = sorted(d.glob("*.safetensors"))
            if not shards:
                raise InvalidInput(f"{d}: no *.safetensors files and no model.safetensors.index.json")
            files = None
        listed: dict = {}
        for f in shards:
            user_file(f, "checkpoint file", d)
            with self._safe_open(f) as h:
                for k in h.keys():
                    listed[k] = f
                    sl = self._call(f, lambda: h.get_slice(k))
                    self.dtypes[k], shapes[k] = sl.get_dtype(), tuple(sl.get_shape())
        if files is None:
            files = listed
        else:
            absent = sorted(k for k, f in files.items() if listed.get(k) != f)
            if absent:
                raise InvalidInput(f"{index}: {absent[0]!r} is not in {files[absent[0]].name} "
                                   f"({len(absent)} tensor(s) the index names are missing)")
        self.files = files
        stored = {k: (self.dtypes[k], shapes[k]) for k in files}
        self._decoded_view(quantization, stored)
        self._merge_adapters(adapters, stored)

    def _decoded_view(self, quantization, stored: dict) -> None:
        """The checkpoint as its format decodes it (``formats``): the scheme of its config.json's
        ``quantization_config`` (without a config.json: ``quantization``, the spec's), its
        quantized tensors' companions replaced by the dense tensors they decode to (bf16)."""
        cfg = self.dir / "config.json"
        where = str(cfg)
        if cfg.is_file():
            c = read_user_json(cfg, "config.json", inside=self.dir)
            c = c if isinstance(c, dict) else {}
            quantization = c.get("quantization_config") or (c.get("text_config") or {}).get("quantization_config")
        else:
            where = f"{self.dir} (the spec's model.quantization_config)"
        self.scheme = formats.scheme_of(quantization, where)
        self.view = self.scheme.view(stored, str(self.dir))
        self.raw_dtypes = dict(self.dtypes)
        self.dtypes = {k: "BF16" if k in self.view.decoded else self.raw_dtypes[k]
                       for k in self.view.keys(stored)}

    def _merge_adapters(self, adapters, stored: dict) -> None:
        """PEFT LoRA adapters (directories) merged into the decoded view as tensors are read
        (``formats.lora``); every adapter tensor checked against the base first."""
        self.adapters = [lora.read_adapter(Path(a)) for a in adapters]
        shapes = {k: (stored[k][1] if k in stored else self.view.decoded[k].shape) for k in self.dtypes}
        lora.check_against(self.adapters, shapes)
        #: keys an adapter changes (read merged, float32)
        self.merged = {k for ad in self.adapters for k in (*ad.deltas, *ad.replaced)}
        for k in self.merged:
            self.dtypes[k] = "F32"

    def derived(self, key: str) -> bool:
        """Whether tensor ``key`` is not a stored tensor as stored (decoded or merged)."""
        return key in self.view.decoded or key in self.merged

    @staticmethod
    def _call(f: Path, fn):
        from safetensors import SafetensorError

        try:
            return fn()
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise InvalidInput(f"{f}: not a readable safetensors file ({e}); re-download or re-save "
                               "the checkpoint") from None

    def _safe_open(self, f: Path):
        from safetensors import safe_open
        return self._call(f, lambda: safe_open(str(f), framework="pt"))

    def keys(self) -> set[str]:
        """The checkpoint's tensors as its format decodes them (:meth:`_decoded_view`)."""
        return set(self.dtypes)

    def get(self, key: str):
        """Tensor ``key`` of the decoded view: a stored tensor as stored, a quantized one decoded
        from its stored companions (bf16)."""
        if key in self.merged:
            return lora.merged(self._decoded(key), key, self.adapters, _read_adapter)
        return self._decoded(key)

    def _decoded(self, key: str):
        e = self.view.decoded.get(key)
        if e is None:
            return self.stored(key)
        x = e.decode([self.stored(k) for k in e.sources])
        if e.shape is not None and tuple(x.shape) != tuple(e.shape):  # a scheme's bug
            raise RuntimeError(f"{key}: {e.scheme} decoded shape {list(x.shape)}, expected {list(e.shape)}")
        nan, inf = nonfinite(x)
        if nan or inf:
            raise InvalidInput(f"{self.dir}: {key} decodes ({e.scheme}, from {', '.join(e.sources)}) to {nan:,} NaN "
                               f"and {inf:,} Inf values; its scales are not finite: fix or re-export the checkpoint")
        return x

    def get_rows(self, key: str, r0: int, r1: int):
        """Rows ``r0:r1`` of tensor ``key``'s leading dim (a stacked expert tensor [E, ...]: experts
        ``r0:r1``) as :meth:`get` gives them, decoding only those rows: a quantized stack's
        companions that share its leading dim are read for those rows only (MXFP4 blocks and
        scales, a stacked fp8 weight and its block scales); a per-tensor scale whole."""
        if key in self.merged:  # a LoRA-merged tensor: merged whole (adapters are small models)
            return self.get(key)[r0:r1]
        e = self.view.decoded.get(key)
        if e is None:
            return self._stored_rows(key, r0, r1)
        lead = e.shape[0] if e.shape else None
        srcs = []
        for k in e.sources:
            sh = self._stored_shape(k)
            srcs.append(self._stored_rows(k, r0, r1) if len(sh) >= 3 and sh[0] == lead else self.stored(k))
        x = e.decode(srcs)
        want = (r1 - r0,) + tuple(e.shape[1:])
        if tuple(x.shape) != want:  # a scheme's bug
            raise RuntimeError(f"{key}[{r0}:{r1}]: {e.scheme} decoded shape {list(x.shape)}, expected {list(want)}")
        nan, inf = nonfinite(x)
        if nan or inf:
            raise InvalidInput(f"{self.dir}: {key} decodes ({e.scheme}, from {', '.join(e.sources)}) to {nan:,} NaN "
                               f"and {inf:,} Inf values; its scales are not finite: fix or re-export the checkpoint")
        return x

    def _stored_shape(self, key: str) -> tuple:
        f = self.files[key]
        with self._safe_open(f) as h:
            return tuple(self._call(f, lambda: h.get_slice(key)).get_shape())

    def _stored_rows(self, key: str, r0: int, r1: int):
        f = self.files[key]
        with self._safe_open(f) as h:
            x = self._call(f, lambda: h.get_slice(key)[r0:r1])
        if self.raw_dtypes.get(key) in CHECKED_FINITE and nonfinite(x) != (0, 0):
            self.refuse_nonfinite()
        return x

    def stored(self, key: str):
        """Stored tensor ``key`` as the file holds it."""
        f = self.files[key]
        with self._safe_open(f) as h:
            x = self._call(f, lambda: h.get_tensor(key))
        if self.raw_dtypes.get(key) in CHECKED_FINITE and nonfinite(x) != (0, 0):
            self.refuse_nonfinite()
        return x

    def refuse_nonfinite(self):
        """Every tensor of the checkpoint with NaN or Inf values, in one error."""
        bad = []
        for k in sorted(self.files):
            if self.raw_dtypes.get(k) in CHECKED_FINITE:
                with self._safe_open(self.files[k]) as h:
                    nan, inf = nonfinite(self._call(self.files[k], lambda: h.get_tensor(k)))
                if nan or inf:
                    bad.append(f"{k} ({self.files[k].name}): {nan:,} NaN, {inf:,} Inf")
        raise InvalidInput(f"{self.dir}: the checkpoint holds non-finite weights in {len(bad)} "
                           "tensor(s); fix or re-export it", [Diagnostic(b, file=str(self.dir)) for b in bad])


def _read_adapter(d: Path, key: str):
    """Tensor ``key`` of adapter directory ``d``, checked finite."""
    from safetensors import safe_open

    f = Path(d) / "adapter_model.safetensors"
    with safe_open(str(f), framework="pt") as h:
        x = h.get_tensor(key)
    if x.is_floating_point() and nonfinite(x) != (0, 0):
        raise InvalidInput(f"{f}: {key} holds NaN or Inf values")
    return x


def nonfinite(x) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating tensor. One ``aminmax`` pass decides (NaN propagates
    into both, an Inf is the min or the max; ~10 GB/s, no scratch memory); only a tensor that
    fails it is counted, in chunks of bounded scratch memory."""
    import torch

    if x.numel() == 0:
        return 0, 0
    lo, hi = torch.aminmax(x)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0, 0
    flat = x.reshape(-1)
    nan = inf = 0
    for i in range(0, flat.numel(), FINITE_CHUNK):
        c = flat[i:i + FINITE_CHUNK]
        if bool(torch.isfinite(c).all()):
            continue
        nan += int(torch.isnan(c).sum())
        inf += int(torch.isinf(c).sum())
    return nan, inf


def check_source_dtypes(family, a, jobs, dtypes: dict[str, str]) -> None:
    """Every checkpoint tensor a read plan uses is bf16, fp16 or fp32 as the checkpoint's format
    decodes it (quantized tensors decode to bf16); lists every offending tensor."""
    bad = {}
    for _name, _layer, srcs in jobs:
        for _pat, keys in srcs:
            for k in keys:
                if dtypes.get(k, "BF16") not in FLOAT_SOURCES:
                    bad.setdefault(k, dtypes[k])
    if bad:
        lines = [f"{k}: {dt}, {family.name} reads BF16, F16 or F32 here" for k, dt in sorted(bad.items())]
        raise InvalidInput(f"checkpoint dtypes {family.name} does not read in {len(bad)} tensor(s); save the "
                           "checkpoint in bf16, fp16 or fp32, or in a quantized format named by config.json's "
                           "quantization_config (docs/build.md#quantized-checkpoints)",
                           [Diagnostic(x) for x in lines[:20]])


def bundle_adapters(bundle) -> list[Path]:
    """The spec's ``weights.adapters`` as directories (relative to the spec, hub snapshots, model
    ids: ``Bundle.resolve_path``)."""
    return [bundle.resolve_path(p) for p in bundle.spec.weights.adapters]


def spec_quantization(a) -> dict | None:
    """The spec's ``model.quantization_config`` (GPT-OSS, DeepSeek), for a checkpoint without a
    config.json of its own."""
    q = getattr(a, "quantization_config", None)
    return q.model_dump(mode="json") if q is not None else None


def _expand(key: str, layer: int | None, experts: int | None) -> list[str]:
    k = key.replace("{i}", str(layer)) if layer is not None else key
    if "{e}" in k:
        return [k.replace("{e}", str(e)) for e in range(experts or 0)]
    return [k]


def renamed(family, keys: Iterable[str], a=None) -> dict[str, str]:
    """Family key name -> checkpoint key, after the family's renames (e.g. Gemma 3's multimodal
    ``language_model.model.`` prefix) and without the keys it deliberately ignores."""
    out = {}
    for k in keys:
        n = k
        for pat, rep in family.hf_key_renames:
            n = re.sub(pat, rep, n)
        if any(re.search(p, n) for p in family.ignored(a)):
            continue
        out[n] = k
    return out


def _expert_count(decls: dict, table: dict, keymap: dict, a, locate) -> None:
    """The experts a checkpoint stores one key each (``{e}``) are as many as the architecture
    declares: else an error saying both counts and the field to change, before any other."""
    for name, t in decls.items():
        pats = [k for k in table[name].hf if "{e}" in k]
        if not pats or t.layers is None or t.layers[0] >= t.layers[1]:
            continue
        layer, dim = t.layers[0], t.dims[0]
        pat = pats[0].replace("{i}", str(layer))
        rx = re.compile(re.escape(pat).replace(re.escape("{e}"), r"(\d+)") + "$")
        found = {int(m.group(1)) for k in keymap if (m := rx.match(k))}
        if not found or found == set(range(dim.size)):  # none at all: the missing key's error names it
            continue
        n = max(found) + 1
        stores = f"{len(found)} experts ({pat.replace('{e}', '0')} .. {pat.replace('{e}', str(n - 1))})" \
            if found == set(range(n)) else f"{len(found)} experts (indices {sorted(found)[:8]})"
        msg = (f"the checkpoint stores {stores} for {name} of layer {layer}, but {dim.name}={dim.size}: "
               f"make {dim.name} the checkpoint's expert count, or use the checkpoint this model came with")
        if locate:
            raise InvalidInput(f"{dim.name} disagrees with the checkpoint", [locate(("model", dim.name), msg)])
        raise InvalidInput(f"{dim.name} disagrees with the checkpoint: {msg}")


def read_plan(family, a, keys: Iterable[str], aliases: dict[str, set[str]] | None = None, locate=None
              ) -> list[tuple[str, int | None, list[tuple[str, list[str]]]]]:
    """What to read for each canonical tensor, checked both ways before anything is read:
    ``(tensor, layer, [(hf key pattern, [checkpoint keys])])`` in declaration order. A missing
    tensor or a checkpoint tensor no entry consumes is an error naming it; so is a per-expert
    checkpoint whose expert count is not the architecture's (located with ``locate(path,
    message)``, a bundle's ``locate``, when given). ``aliases`` maps a key to the keys sharing
    its storage (tied weights in a state_dict count as one)."""
    keymap = renamed(family, keys, a)
    decls = {t.name: t for t in family.tensors(a)}
    table = {n.tensor: n for n in family.hf_names(a)}
    if set(table) != set(decls):  # a family bug, not a user error
        raise RuntimeError(f"{family.name}: name table and tensors disagree: "
                           f"{sorted(set(table) ^ set(decls))}")
    _expert_count(decls, table, keymap, a, locate)
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
    ck = Checkpoint(directory, spec_quantization(a))
    check_source_dtypes(family, a, read_plan(family, a, ck.keys()), ck.dtypes)
    return canonical(family, a, ck.get, ck.keys())


def from_state_dict(family, a, sd: dict) -> dict:
    """From an in-memory state_dict; keys sharing storage (tied embeddings) count as one."""
    groups: dict = {}
    for k, t in sd.items():
        groups.setdefault((t.data_ptr(), tuple(t.shape)), set()).add(k)
    aliases = {k: g for g in groups.values() for k in g}
    return canonical(family, a, sd.__getitem__, sd.keys(), aliases)
