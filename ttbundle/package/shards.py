"""Reading a package's weights: :class:`PackageWeights` (per device as stored, as the emulated
mesh holds them, or reassembled into global tensors), a shard several devices hold read and
decoded once and shared (:func:`stack_shards`, :class:`SharedStack`), large tensors decoded band
by band (:data:`BAND_BYTES`); and :func:`trim_heap`, which hands freed pages back between layers."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .names import PackageError, tensor_key, weight_file
from .. import blockfloat, layout
from ..layout import elements, unit_runs


class SharedStack:
    """A tensor's ``[D, *local]`` held as its distinct shards: ``distinct`` ``[G, *local]`` and
    ``group`` (per device, the index of its shard in ``distinct``). What :func:`stack_shards`
    gives where some but not all devices hold the same shard (split over one mesh axis and
    replicated over the other, replicated KV heads), which no strided ``[D, *local]`` view can
    express. Read-only: :meth:`dense` is a copy; the emulated mesh's GEMM works per distinct
    shard (``backends/emulated/gemm``)."""

    def __init__(self, distinct, group):
        self.distinct, self.group = distinct, tuple(int(g) for g in group)
        self.shape = (len(self.group), *distinct.shape[1:])
        self.dtype, self.device = distinct.dtype, distinct.device

    def dim(self) -> int:
        return len(self.shape)

    def members(self) -> list:
        """Per distinct shard, the devices holding it (mesh order)."""
        out: list = [[] for _ in range(self.distinct.shape[0])]
        for d, g in enumerate(self.group):
            out[g].append(d)
        return out

    def dense(self):
        """The plain ``[D, *local]`` tensor (a copy: one per device)."""
        import torch
        return self.distinct.index_select(0, torch.tensor(self.group, device=self.distinct.device))


def stack_shards(shards: list, device="cpu"):
    """Per-device shards as the emulated mesh holds them, one copy per distinct shard: devices
    whose entries are the same tensor object (``is``) share it. All one object: a ``[D, *local]``
    view of that one copy (``expand``: stride 0 over the devices); all distinct: ``torch.stack``;
    otherwise a :class:`SharedStack`. Nothing here compares values: sharing is what the caller
    says (the package's ``stored_in``, or ``layout.holders``)."""
    import torch
    ids: dict[int, int] = {}
    distinct: list = []
    group = []
    for x in shards:
        g = ids.setdefault(id(x), len(distinct))
        if g == len(distinct):
            distinct.append(x)
        group.append(g)
    return held_as(torch.stack(distinct).to(device), group)


def held_as(distinct, group):
    """``distinct`` (``[G, *local]``: each distinct shard once) held for the devices of
    ``group`` (per device, the index of its shard): itself when every device has its own (in
    device order), a stride-0 view of the one copy when all share it, else a
    :class:`SharedStack`. No copy is made."""
    D = len(group)
    if tuple(group) == tuple(range(D)) and distinct.shape[0] == D:
        return distinct
    if distinct.shape[0] == 1:
        return distinct.expand(D, *distinct.shape[1:])
    return SharedStack(distinct, group)


class PackageWeights:
    """Per-device shards of a package: ``device(d)`` as stored, ``device_stacks()`` as the
    emulated mesh holds them (``[D, *local]`` per tensor, one copy per distinct shard:
    :func:`stack_shards`), ``canonical()`` the global tensors they make up (padding dropped,
    per ``layout``). A shard several devices hold is stored once, in the file of the first of
    them (the header's ``stored_in``), read and decoded once, and shared."""

    def __init__(self, pkg: Path, bundle, mesh, refs: dict):
        self.pkg, self.bundle, self.mesh, self.refs = pkg, bundle, mesh, refs
        self.decls = {t.name: t for t in bundle.family.tensors(bundle.arch)}
        self.dtypes = {n: r.dtype for n, r in refs.items()}
        self.units = {n: layout.tensor_units(t.dims, refs[n].spec, mesh, bundle.spec.sharding)
                      for n, t in self.decls.items()}
        self._handles = None
        #: per tensor key, per device: the device whose file stores its shard (set by the load's
        #: header check, ``_check_headers``, from the files' ``stored_in``)
        self.stored_in: dict = {}

    def files(self) -> list[Path]:
        return [self.pkg / weight_file(d) for d in range(self.mesh.num_devices)]

    def device(self, d: int, names: list[str] | None = None) -> dict:
        """Device ``d``'s shards ``{key: tensor}`` (bf16; block floats decoded to float32), each
        read from the file that stores it (``stored_in``)."""
        handles, metas = self._open()
        return {key: self._read(self.source(d, key), key) for key in (names or metas[d])}

    def local_shape(self, name: str, layer: int | None = None) -> list[int]:
        """One device's shape of tensor ``name`` (of ``layer``), from the files' headers."""
        return [int(s) for s in self._open()[1][0][tensor_key(name, layer)]["shape"]]

    def source(self, d: int, key: str) -> int:
        """The device whose file stores device ``d``'s shard of ``key`` (itself, or the first
        device holding the same shard: ``stored_in``, checked at load)."""
        return int(self.stored_in[key][d])

    def _read(self, s: int, key: str):
        handles, metas = self._open()
        return _decode(handles[s].get_tensor(key), metas[s][key])

    def _open(self):
        """The device files' safetensors handles (memory-mapped) and headers, opened once."""
        if self._handles is None:
            from safetensors import safe_open
            try:
                handles = [safe_open(str(p), framework="pt") for p in self.files()]
                metas = [json.loads(h.metadata()["ttbundle"])["tensors"] for h in handles]
            except Exception as e:  # safetensors raises its own error types
                raise PackageError(f"{self.pkg}: weights unreadable: {e}") from None
            self._handles = (handles, metas)
        return self._handles

    def close(self) -> None:
        """Drop the open handles (their mmaps); the next read opens the files again."""
        self._handles = None

    def shards(self, name: str, layer: int | None = None, dtype=None) -> list:
        """Every device's shard of tensor ``name`` (of ``layer``), decoded from its file to
        ``dtype`` (bf16 values; bfp8/bfp4 tiles decoded as ttnn does). A shard stored once for
        several devices is read and decoded once: those devices' entries are one tensor."""
        import torch
        key = tensor_key(name, layer)
        src = [self.source(d, key) for d in range(self.mesh.num_devices)]
        one = {s: self._read(s, key).to(dtype or torch.float32) for s in dict.fromkeys(src)}
        return [one[s] for s in src]

    def stack(self, name: str, layer: int | None = None, dtype=None, device="cpu", nk: bool = False):
        """One tensor (of ``layer``) as the emulated mesh holds it: ``[D, *local]``, each
        device's shard exactly as its file holds it (the values of :meth:`shards`), one copy per
        distinct stored shard (``stored_in``, :func:`held_as`), each read band by band straight
        into one preallocated tensor (:data:`BAND_BYTES`): a large tensor never exists whole in
        another dtype or as a second copy. What a layer-by-layer reader loads.

        ``nk`` (a matrix, ``[D, K, N]``): the same values held with the last two dims swapped in
        memory (a ``[D, N, K]`` tensor, returned as its transposed view), what the emulated GEMM
        multiplies by: block-float tiles are decoded into that order directly
        (``blockfloat.decode_columns_t``), so no float32 transpose follows."""
        import torch

        handles, metas = self._open()
        key = tensor_key(name, layer)
        shape = [int(s) for s in metas[0][key]["shape"]]
        src, firsts = self._stored(key)
        if nk and len(shape) == 2:
            out = torch.empty([len(firsts), shape[1], shape[0]], dtype=dtype or torch.float32).transpose(1, 2)
        else:
            out = torch.empty([len(firsts)] + shape, dtype=dtype or torch.float32)
        for i, s in enumerate(firsts):
            _decode_into(handles[s], key, metas[s][key], out[i])
        return held_as(out.to(device), [firsts.index(s) for s in src])

    def distinct(self, name: str, layer: int | None = None) -> tuple[int, ...]:
        """Per device, the index of its shard of ``name`` (of ``layer``) among the distinct
        stored ones (what :meth:`stack`'s ``held_as`` groups by), without reading any."""
        src, firsts = self._stored(tensor_key(name, layer))
        return tuple(firsts.index(s) for s in src)

    def _stored(self, key: str) -> tuple[list[int], list[int]]:
        """(per device, the file that stores its shard of ``key``; those files, each once, in
        device order): how :meth:`stack`, :meth:`distinct` and :meth:`expert` number shards."""
        src = [self.source(d, key) for d in range(len(self._open()[0]))]
        return src, list(dict.fromkeys(src))

    def expert(self, name: str, layer: int | None, g: int, j: int, dtype=None):
        """Slice ``j`` along the first (expert) dim of distinct stored shard ``g`` (numbered as
        :meth:`distinct` numbers them) of ``name``: one expert's ``[*local[1:]]`` read and
        decoded alone (bf16 rows, or that expert's block-float tiles: ``blockfloat.row_band``),
        never the device's expert stack (issue 37: a check holds a few experts, not a layer's)."""
        import torch

        handles, metas = self._open()
        key = tensor_key(name, layer)
        s = self._stored(key)[1][g]
        info = metas[s][key]
        shape = [int(x) for x in info["shape"]]
        sl = handles[s].get_slice(key)
        if info.get("encoding", "bf16") == "bf16":
            t = _decode(sl[j:j + 1], info)[0]
        else:
            h, w = shape[-2], shape[-1]
            enc = info["encoding"]
            a, z = blockfloat.row_band(shape, enc, j, 0, h)
            data = sl[a:z].numpy()
            t = torch.empty(h, w, dtype=torch.float32)
            out = t.numpy()
            # bands of whole tile rows on one thread per core (tiles are row-local: the bands'
            # values are the matrix's); an expert is what a MoE layer's warm-up and check decode
            rows = min(BAND_BYTES // (4 * w), -(-h // len(os.sched_getaffinity(0))))
            step = max(1, -(-rows // blockfloat.TILE)) * blockfloat.TILE

            def one(r0):
                r1 = min(h, r0 + step)
                b0, b1 = blockfloat.row_band(shape, enc, j, r0, r1)
                out[r0:r1] = blockfloat.decode_array(data[b0 - a:b1 - a], [r1 - r0, w], enc)
            _parallel(one, list(range(0, h, step)))
        return t.to(dtype or torch.float32).contiguous()

    def layers_of(self, name: str) -> list:
        """``[None]`` for a global tensor, else the layer indices it has."""
        t = self.decls[name]
        return [None] if t.layers is None else list(range(*t.layers))

    def _each(self, combine, dtype):
        """``{tensor: combine(name, [shard of each device])}`` (a list per layer for layered
        tensors), every shard decoded from its file to ``dtype``."""
        out: dict = {}
        for name, t in self.decls.items():
            per_layer = [combine(name, self.shards(name, layer, dtype)) for layer in self.layers_of(name)]
            out[name] = per_layer[0] if t.layers is None else per_layer
        return out

    def device_stacks(self, dtype=None, device="cpu") -> dict:
        """Every tensor as ``[D, *local]`` (a list per layer for layered tensors): :meth:`stack`
        of each (bf16 values; bfp8/bfp4 tiles decoded as ttnn does)."""
        import torch
        dtype = dtype or torch.float32
        return {name: [self.stack(name, layer, dtype, device) for layer in self.layers_of(name)]
                if self.decls[name].layers is not None else self.stack(name, None, dtype, device)
                for name in self.decls}

    def canonical(self, dtype=None) -> dict:
        """Global tensors reassembled from every device's shards (padding dropped)."""
        import torch
        dtype = dtype or torch.float32

        def assemble(name, shards):
            t = self.decls[name]
            g = torch.zeros(t.shape, dtype=dtype)
            for d, shard in enumerate(shards):
                _scatter(g, shard, [u[d] for u in self.units[name]], t.dims)
            return g
        return self._each(assemble, dtype)


def cut(x, k: int, us, unit: int):
    """Dim ``k`` of ``x`` restricted to the units ``us`` (``-1``: padding, zeros): a view where
    ``us`` is one contiguous run (every plan's common case), else a gathered copy."""
    import torch

    run = unit_runs(us)
    if run is not None and (run[0] + run[1]) * unit <= x.shape[k]:
        return x.narrow(k, run[0] * unit, run[1] * unit)
    pos = torch.tensor(elements(list(us), unit), dtype=torch.long)
    out = x.index_select(k, pos.clamp(min=0))
    pad = (pos < 0).nonzero().reshape(-1)
    return out.index_fill(k, pad, 0.0) if len(pad) else out


def _scatter(g, shard, units_per_dim: list[list[int]], dims) -> None:
    """Write a device's shard back into global ``g`` (padding positions skipped): a copy into a
    view of ``g`` where every dim's units are one contiguous run."""
    import torch

    runs = [unit_runs(us) for us in units_per_dim]
    if all(r is not None and (r[0] + r[1]) * d.unit <= g.shape[k]
           for k, (r, d) in enumerate(zip(runs, dims))):
        view = g
        for k, (r, d) in enumerate(zip(runs, dims)):
            view = view.narrow(k, r[0] * d.unit, r[1] * d.unit)
        view.copy_(shard)
        return
    idx = []
    for k, (us, d) in enumerate(zip(units_per_dim, dims)):
        pos = torch.tensor(elements(us, d.unit), dtype=torch.long)
        keep = (pos >= 0).nonzero().reshape(-1)
        shard = shard.index_select(k, keep)
        shape = [1] * g.dim()
        shape[k] = -1
        idx.append(pos[keep].view(shape))
    g[tuple(idx)] = shard


#: bytes of one band: a large tensor is read and decoded this many bytes (of float32) at a time
#: (PackageWeights.stack), and a block-float shard encoded as much at a time (convert)
BAND_BYTES = 64 << 20


def _decode_into(handle, key: str, info: dict, out) -> None:
    """Device shard ``key`` from its file (``handle``: safetensors, memory-mapped) into ``out``
    (the device tensor, any float dtype), a band at a time, bands decoded on one thread per core:
    a large tensor never exists whole in another dtype or as a second copy. Decoding is
    :func:`_decode`'s (bf16 as stored, or transposed back; block-float tiles as the device
    decodes them)."""
    enc = info.get("encoding", "bf16")
    shape = [int(s) for s in info["shape"]]
    if enc != "bf16" and len(shape) == 2 and not out.is_contiguous() and out.t().is_contiguous() \
            and out.dtype.is_floating_point and out.dtype.itemsize == 4:
        _decode_into_t(handle.get_tensor(key).numpy(), shape, enc, out.t().numpy())
        return
    if out.numel() * 4 <= BAND_BYTES or len(shape) < 2:
        out.copy_(_decode(handle.get_tensor(key), info).reshape(out.shape))
        return
    sl = handle.get_slice(key)
    jobs = []  # (destination view, stored-slice bounds, info)
    if enc == "bf16":  # banded along the stored first dim
        flip = bool(info.get("transposed")) and len(shape) == 2
        stored0 = shape[-1] if flip else shape[0]
        row = (out[:, 0] if flip else out[0]).numel() * 4
        per = max(1, BAND_BYTES // max(1, row))
        for r0 in range(0, stored0, per):
            r1 = min(stored0, r0 + per)
            jobs.append((out[:, r0:r1] if flip else out[r0:r1], r0, r1, info))
    else:

        h, w = shape[-2], shape[-1]
        mats = out.reshape(-1, h, w)
        per = max(blockfloat.TILE, BAND_BYTES // (4 * w) // blockfloat.TILE * blockfloat.TILE)
        for b in range(mats.shape[0]):
            for r0 in range(0, h, per):
                r1 = min(h, r0 + per)
                a, z = blockfloat.row_band(shape, enc, b, r0, r1)
                jobs.append((mats[b, r0:r1], a, z, {**info, "shape": [r1 - r0, w]}))

    def one(job):
        dst, a, z, inf = job
        dst.copy_(_decode(sl[a:z], inf))
    _parallel(one, jobs)


def _decode_into_t(data, shape: list, enc: str, out_t) -> None:
    """A block-float matrix ``shape`` = ``[K, N]`` (its encoded bytes, ``data``) into ``out_t``,
    its transpose ``[N, K]`` (float32, C-contiguous numpy over the held tensor), in bands of
    output rows (:data:`BAND_BYTES`) decoded on one thread per core."""
    h, w = shape
    tiles = data.reshape(-1, blockfloat.tile_bytes(enc))
    wt = -(-w // blockfloat.TILE)
    per = max(1, BAND_BYTES // (4 * h * blockfloat.TILE))  # tile columns per band
    jobs = [(c0, min(wt, c0 + per)) for c0 in range(0, wt, per)]

    def one(job):
        c0, c1 = job
        blockfloat.decode_columns_t(tiles, h, w, enc, c0, c1, out_t[c0 * blockfloat.TILE: c1 * blockfloat.TILE])
    _parallel(one, jobs)


def _parallel(fn, jobs: list) -> None:
    """``fn`` over ``jobs`` on one thread per usable core (numpy and torch release the GIL)."""
    n = min(len(jobs), len(os.sched_getaffinity(0)), 8)
    if n <= 1:
        for j in jobs:
            fn(j)
        return
    with ThreadPoolExecutor(n, thread_name_prefix="ttbundle-read") as pool:
        for _ in pool.map(fn, jobs):
            pass


def stored_shape(shape, transposed: bool) -> list:
    """The shape a bf16 shard has in its weights file: the device shape, or with its last two dims
    swapped when the header marks it ``"transposed"`` (kept in the checkpoint's element order)."""
    return list(shape[:-2]) + [shape[-1], shape[-2]] if transposed else list(shape)


def _decode(t, info: dict):
    """A stored shard as the device tensor: block floats decoded, a shard stored in its
    checkpoint's element order (``"transposed"``, see ``convert._stored_transposed``) turned back
    into the device's ``[..., in, out]`` (a view)."""
    enc = info.get("encoding", "bf16")
    if enc == "bf16":
        return t.transpose(-1, -2) if info.get("transposed") else t
    return blockfloat.decode(t.numpy().tobytes(), info["shape"], enc)


def trim_heap() -> None:
    """Hand the heap's freed pages back to the system (glibc's ``malloc_trim``): a layer's
    tensors, once freed, would otherwise stay resident as fragments of the heap, and the peak
    would grow with the layer count. A no-op where the C library has none."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None
