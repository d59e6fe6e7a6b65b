"""The *expected* weights: the original checkpoint's tensors stored as the package declares them.

``check``'s executor verdict runs transformers on these beside the emulated mesh. They are made
here from the checkpoint, independently of the package's bytes: each canonical tensor (the
family's name table and transform) is cut into the shards the plan gives each device
(``layout``: padding and replicas included), each distinct shard rounded as its declared
encoding stores it (bf16, or bfp8/bfp4 tiles: ``blockfloat.quantize``, byte-exact with ttnn's
packer and the package's decoder), put back into the global tensor (``package.shards``'s
reassembly) and then into the checkpoint's own layout (the inverse of the name table's
transform), so transformers loads them as it loads the checkpoint.

A package whose stored bytes are not what its declaration makes of the checkpoint (a zeroed
head, a swapped layer, a flipped exponent byte, a matrix rounded to bfp4 in a bfp8 package)
therefore runs other numbers than the expected side, and the executor verdict fails at the
stage that reads them. Only block-float matrices differ from the plain bf16 rounding the
reference already applies; bf16-stored tensors are left to it (the same values).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import InvalidInput
from .. import blockfloat
from ..families import transforms
from ..package.shards import _parallel, _scatter, cut
from ..weights import Checkpoint, bundle_adapters, read_plan, spec_quantization


def stored_values(c, units_per_dim: list, dims, devices: int, encoding: str):
    """The global tensor ``c`` (float32) as a package storing it in ``encoding`` holds it: each
    distinct device shard (``units_per_dim[k][d]``: the units of dim ``k`` device ``d`` holds,
    -1 for padding) cut, padded with zeros, rounded (``blockfloat.quantize``: one shared
    exponent per 16 values of a tile row, so the cut matters) and written back."""
    import torch

    sigs = list(dict.fromkeys(tuple(tuple(u[d]) for u in units_per_dim) for d in range(devices)))
    out = None
    for sig in sigs:
        shard = c
        for k, (us, dim) in enumerate(zip(sig, dims)):
            shard = cut(shard, k, us, dim.unit)
        q = _quantize(shard, encoding) if encoding != "bf16" else shard.to(torch.bfloat16).float()
        if len(sigs) == 1 and shard.shape == c.shape and shard.data_ptr() == c.data_ptr() \
                and shard.stride() == c.stride():
            return q  # one shard, the whole tensor (a one-device mesh, a replicated tensor)
        if out is None:
            out = c.float().clone() if c.dtype == torch.float32 else c.float()
        _scatter(out, q, [list(u) for u in sig], dims)
    return out


#: values rounded per thread at a time (:func:`_quantize`)
BAND_VALUES = 1 << 22


def _quantize(x, encoding: str):
    """``blockfloat.quantize`` of ``x`` in bands of rows on one thread per core (numpy releases
    the GIL): a block-float tile row's exponents do not reach across rows, so bands of whole
    rows round as the whole does."""
    import torch

    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty(flat.shape, dtype=torch.float32)
    step = max(1, BAND_VALUES // max(1, flat.shape[1]))
    jobs = [(a, min(a + step, flat.shape[0])) for a in range(0, flat.shape[0], step)]

    def one(job):
        a, z = job
        out[a:z] = blockfloat.quantize(flat[a:z].contiguous(), encoding)
    _parallel(one, jobs)
    return out.reshape(x.shape)


def _untranspose(c, sources):
    return [c.transpose(-1, -2)]


def _interleave(c, sources):
    """The inverse of ``gate_up_deinterleave``: ``[gate | up]`` back to (g0, u0, g1, u1, ...)."""
    import torch
    half = c.shape[-1] // 2
    return [torch.stack((c[..., :half], c[..., half:]), dim=-1).flatten(-2)]


def _conv_unpatch(c, sources):
    return [c.transpose(0, 1).reshape(sources[0].shape)]


def _qkv_part(k):
    def inv(c, sources):
        src = sources[0].clone()
        third = src.shape[0] // 3
        src[k * third:(k + 1) * third] = c.transpose(0, 1) if c.dim() == 2 else c
        return [src]
    return inv


#: name-table transform -> its inverse: the canonical tensor back in the checkpoint's layout
#: (given the checkpoint's tensors, for a transform that fills part of one)
INVERSES = {"t": _untranspose, "id": lambda c, s: [c], "gate_up_deinterleave": _interleave,
            "conv_patch": _conv_unpatch, **{f"qkv_{k}": _qkv_part(k) for k in range(3)}}


class ExpectedWeights:
    """Per checkpoint key, the tensor a package's declared storage makes of it (module
    docstring), computed one layer at a time as transformers loads that layer; ``None`` for a
    key whose tensors are stored as bf16 (the reference's own rounding gives those)."""

    def __init__(self, pkg, reference_dir: str | Path):
        bundle = pkg.bundle
        self.family, self.arch = bundle.family, bundle.arch
        self.weights = pkg.weights  # the plan's dtypes and shard units (not the stored bytes)
        self.devices = pkg.mesh.num_devices
        # decoded and adapters merged as the build reads it
        self.ck = Checkpoint(reference_dir, spec_quantization(self.arch), bundle_adapters(bundle))
        self.jobs = read_plan(self.family, self.arch, self.ck.keys(), locate=bundle.locate)
        self.table = {n.tensor: n for n in self.family.hf_names(self.arch)}
        self.decls = {t.name: t for t in self.family.tensors(self.arch)}
        # checkpoint key -> the quantized canonical tensors it feeds ((name, layer) jobs)
        self.by_key: dict = {}
        for name, layer, srcs in self.jobs:
            if self.weights.dtypes[name] == "bf16":
                continue
            tf = self.table[name].transform
            if tf not in INVERSES:
                raise InvalidInput(
                    f"{name}: stored {self.weights.dtypes[name]} from a checkpoint read through "
                    f"the {tf!r} transform (a quantized checkpoint): check's expected run cannot "
                    f"put such a tensor back in the checkpoint's layout; store {name} as bf16 or "
                    f"check against a bf16 checkpoint (--reference)")
            for _, keys in srcs:
                for k in keys:
                    self.by_key.setdefault(k, []).append((name, layer, srcs))
        self._cache: dict = {}

    @property
    def quantized(self) -> bool:
        return bool(self.by_key)

    def __call__(self, key: str):
        """The expected tensor of checkpoint ``key`` (float32, the checkpoint's layout), or None
        where its tensors are stored bf16. A key's jobs are computed together and kept until
        each of their keys was asked for once (a layer's keys are asked for together)."""
        if key not in self.by_key:
            return None
        if key not in self._cache:
            self._compute(key)
        return self._cache.pop(key)

    def _compute(self, key: str) -> None:
        import torch

        out: dict = {}
        for name, layer, srcs in self.by_key[key]:
            tf = self.table[name].transform
            q = self._canonical_stored(name, srcs)
            # a key fed by several jobs (one fused tensor split into q, k, v) takes each job's part
            current = [torch.stack([out.get(k, self.ck.get(k).float()) for k in ks]) if "{e}" in pat
                       else out.get(ks[0], self.ck.get(ks[0]).float()) for pat, ks in srcs]
            back = INVERSES[tf](q, current)
            for (pat, ks), b in zip(srcs, back):
                if "{e}" in pat:
                    for e, k in enumerate(ks):
                        out[k] = b[e].contiguous()
                else:
                    out[ks[0]] = b.contiguous()
        for k, t in out.items():
            if k in self.by_key:
                self._cache[k] = t

    def expert(self, key: str, e: int):
        """Expert ``e``'s part of checkpoint ``key`` as the package stores it (bf16, which holds
        block-float values exactly; the checkpoint's layout: rows ``[e:e + 1]`` of a tensor stacked over the experts, or the
        whole of a per-expert key), or None where it is stored bf16; only that expert is read,
        decoded (``Checkpoint.get_rows``) and rounded: a routed-expert stack is never whole
        (issue 37). Rounding is per expert matrix (a block-float tile never spans two experts),
        cut as each device holding the expert cuts it."""
        import torch

        if key not in self.by_key:
            return None
        acc: dict = {}
        for name, layer, srcs in self.by_key[key]:
            tf = self.table[name].transform
            decl = self.decls[name]

            def one(pat, ks):
                k = ks[e] if "{e}" in pat else ks[0]
                x = acc.get(k)
                if x is None:  # as decoded (bf16 for MXFP4 / FP8): block floats round from its bits
                    x = self.ck.get(k)[None] if "{e}" in pat else self.ck.get_rows(k, e, e + 1)
                return x
            parts = [one(pat, ks) for pat, ks in srcs]
            c = transforms.apply(tf, parts, self.arch)  # [1, *one expert's canonical]
            units = self.weights.units[name]
            holders = [d for d in range(self.devices) if e in units[0][d]]
            if len(units[0][0]) and decl.dims[0].unit != 1:
                raise RuntimeError(f"{name}: experts in units of {decl.dims[0].unit}")
            per = [[[0] for _ in holders]] + [[u[d] for d in holders] for u in units[1:]]
            q = stored_values(c, per, (replace(decl.dims[0], size=1),) + tuple(decl.dims[1:]), len(holders),
                              self.weights.dtypes[name])
            del c
            q = q.to(torch.bfloat16)  # block-float values are bf16 exactly: half the bytes from here
            for (pat, ks), b in zip(srcs, INVERSES[tf](q, parts)):
                k = ks[e] if "{e}" in pat else ks[0]
                acc[k] = b
        stacked = any(key == ks[0] and "{e}" not in pat for _, _, srcs in self.by_key[key] for pat, ks in srcs)
        return (acc[key] if stacked else acc[key][0]).contiguous()  # acc: [1, ...] per key

    #: rows of the LM head's ``[hidden, vocab]`` canonical tensor rounded at a time
    #: (:meth:`lm_head_bands`): a block-float tile row's exponents do not reach across rows, so
    #: a band of whole rows rounds as the whole tensor does (bounded memory for a 128k vocabulary)
    HEAD_BAND = 256

    def lm_head_bands(self):
        """The LM head as stored, ``(r0, r1, rows)`` bands of its ``[hidden, vocab]`` canonical
        tensor (``rows``: ``[r1 - r0, vocab]`` float32), or None where it is stored bf16 (the
        reference reads the checkpoint's own values). A tied LM head shares its checkpoint tensor
        with the embedding, which the package stores apart, in bf16: the head reads these."""
        name = "lm_head"
        if name not in self.decls or self.weights.dtypes.get(name, "bf16") == "bf16":
            return None
        (_, _, srcs), = [j for j in self.jobs if j[0] == name]
        decl, units, enc = self.decls[name], self.weights.units[name], self.weights.dtypes[name]
        tf = self.table[name].transform
        hidden = decl.dims[0].length
        if tf not in ("t", "id") or len(srcs) != 1 or decl.dims[0].unit != 1:
            return [(0, hidden, self._canonical_stored(name, srcs))]
        return self._bands(name, srcs, decl, units, enc, tf, hidden)

    def _bands(self, name, srcs, decl, units, enc, tf, hidden):
        """Bands of whole hidden rows: each device's rows of a band (its own rows there, the hidden
        dim may be split over a mesh axis as on TG; padding rows dropped: a row rounds alone) cut
        with its own vocab columns, as :meth:`_canonical_stored` cuts the whole tensor."""
        src = self.ck.get(srcs[0][1][0])  # [vocab, hidden] ("t") or [hidden, vocab] ("id")
        for r0 in range(0, hidden, self.HEAD_BAND):
            r1 = min(hidden, r0 + self.HEAD_BAND)
            c = (src[:, r0:r1].t() if tf == "t" else src[r0:r1]).float()
            dim0 = replace(decl.dims[0], size=r1 - r0, unit=1)
            rows = [[[i - r0 for i in u if r0 <= i < r1] for u in units[0]], units[1]]
            yield r0, r1, stored_values(c, rows, (dim0, decl.dims[1]), self.devices, enc)

    def _canonical_stored(self, name, srcs):
        """Canonical tensor ``name`` from its checkpoint sources (``{e}`` keys stacked, as
        ``weights.canonical`` reads them), as the package stores it."""
        import torch

        parts = [torch.stack([self.ck.get(k) for k in ks]) if "{e}" in pat else self.ck.get(ks[0])
                 for pat, ks in srcs]
        c = transforms.apply(self.table[name].transform, parts, self.arch).float()
        return stored_values(c, self.weights.units[name], self.decls[name].dims, self.devices,
                             self.weights.dtypes[name])
