"""Weight conversion: the checkpoint streamed one canonical tensor at a time (safetensors mmap,
sharded index supported): family name table -> transform -> dtype policy -> split per the plan ->
appended to one safetensors file per device whose header was computed up front, by writer threads
(write + sha256) while the next tensor is read and cut.

The ``weights`` content key is derived from this module's imports (``cache.module_sources``):
whatever it (transitively) imports is what a package's weights depend on."""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import layout as layoutmod
from .errors import InvalidInput
from .fsutil import fault as _fault
from .package.names import WEIGHTS_FORMAT, tensor_key, weight_file
from .package.shardfile import ShardFile, ST_DTYPE, encoded_nbytes
from .package.shards import BAND_BYTES, stored_shape, trim_heap
from .layout import axes_of
from . import blockfloat
from .families import transforms
from .families.base import Dim
from .weights import Checkpoint, bundle_adapters, check_source_dtypes, read_plan, spec_quantization

TRANSPOSE_BLOCK = 64  # source rows per step when cutting a transposed shard
WRITER_THREADS = None  # threads that write + sha256 device files (None: one per usable core)


def convert(bundle, plan, weights_dir: Path, tmp: Path, res, emit, files: dict) -> None:
    """Write ``tmp/weights/device_<d>.safetensors`` for every device of ``plan.mesh`` from the
    checkpoint in ``weights_dir``; each file's sha256 and size go into ``files``, byte counts and
    timings into ``res`` (a ``BuildResult``), progress events to ``emit``."""
    fam, a, mesh = bundle.family, bundle.arch, plan.mesh
    D = mesh.num_devices
    cpu0 = time.thread_time()
    # decoded as its format says (``formats``); its files: plain names in weights_dir (weights.shard_name)
    ck = Checkpoint(weights_dir, spec_quantization(a), bundle_adapters(bundle))
    jobs = read_plan(fam, a, ck.keys(), locate=bundle.locate)
    check_source_dtypes(fam, a, jobs, ck.dtypes)
    tp = {t.name: t for t in plan.tensors}
    decls = {t.name: t for t in fam.tensors(a)}
    units = {n: [layoutmod.units(d, axes_of(e), mesh, bundle.spec.sharding)
                 for d, e in zip(decls[n].dims, plan.specs[n])] for n in decls}
    # one header per device, computed before any tensor is read; a shard several devices hold
    # is stored once, in the file of the first of them (``stored_in``: layout.holders)
    transform = {n.tensor: n.transform for n in fam.hf_names(a)}
    entries, layout = [[] for _ in range(D)], {}
    for name, layer, sources in jobs:
        t = tp[name]
        key = tensor_key(name, layer)
        nbytes = encoded_nbytes(t.device_shape, t.dtype)
        flip = _stored_transposed(transform[name], decls[name], sources, t.dtype)
        shape = stored_shape(t.device_shape, flip) if t.dtype == "bf16" else [nbytes]
        owner = layoutmod.holders(units[name], D)
        for d in range(D):
            if owner[d] == d:
                entries[d].append((key, ST_DTYPE[t.dtype], shape, nbytes))
        layout[key] = {"tensor": name, "layer": layer, "encoding": t.dtype, "shape": t.device_shape,
                       "global_shape": list(decls[name].shape),
                       "spec": [list(axes_of(e)) or None for e in plan.specs[name]], "stored_in": owner}
        if flip:
            layout[key]["transposed"] = True
    (tmp / "weights").mkdir(exist_ok=True)
    writers, bg, enc = [], [], None
    # one torch thread: the writer and checkpoint-hash threads use the other cores, and
    # OpenMP workers competing with them make every copy slower
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for d in range(D):
            meta = {"format": WEIGHTS_FORMAT, "device": d, "coord": [d // mesh.cols, d % mesh.cols],
                    "mesh": mesh.name, "tensors": layout}
            writers.append(ShardFile(tmp / weight_file(d), entries[d],
                                     {"ttbundle": json.dumps(meta, sort_keys=True)}))
        total = sum(e[3] for es in entries for e in es)
        emit({"event": "phase", "phase": "weights", "total": len(jobs), "total_bytes": total,
                   "unit": "tensors"})
        # expert stacks are read, cut and written a few experts at a time (``_ExpertStream``)
        streams = {i: st for i, (n, _l, srcs) in enumerate(jobs)
                   if (st := _ExpertStream.plan(transform[n], decls[n], srcs, units[n], D, tp[n])) is not None}
        # one tensor's (one expert chunk's) distinct shards may wait for the writers while the next is read
        cap = max(streams[i].cap if i in streams else encoded_nbytes(tp[n].device_shape, tp[n].dtype) * D
                  for i, (n, _, _) in enumerate(jobs))
        # write + sha256 is most of the work: one thread per core, each owning whole device files
        nbg = max(1, min(D, WRITER_THREADS or len(os.sched_getaffinity(0))))
        bg = [_WriteBehind(cap) for _ in range(nbg)]
        pool = _BufferPool(2 * cap)
        # block-float tiles are encoded on one thread per core while this thread reads and decodes
        # the next tensor (chunk); a writer waits for a shard's tiles before writing them
        enc = _Encoder(min(len(os.sched_getaffinity(0)), 8), SOURCE_BYTES)
        for i, (name, layer, sources) in enumerate(jobs):
            t = tp[name]
            key = tensor_key(name, layer)
            keep = bool(layout[key].get("transposed"))
            if i in streams:
                parts = streams[i].shards(ck, a, decls[name], layer, sources, pool, keep, enc)
            else:
                c, nread = _read_canonical(ck, transform[name], a, decls[name], layer, sources, t.dtype)
                res.bytes_read += nread
                parts = _device_shards(c, units[name], decls[name].dims, D, t.dtype, pool, keep_source_order=keep,
                                       encoder=enc)
                del c
            written = 0
            for buf, devices, handle in parts:
                n = _nbytes(buf)
                d = layout[key]["stored_in"][devices[0]]  # the one file that stores it
                if d != devices[0]:
                    raise RuntimeError(f"{key}: devices {devices} hold one shard, stored_in says {d}")
                by = {d % nbg: [(writers[d], key)]}
                done = None if handle is None else _Countdown(len(by), lambda h=handle: pool.give(h))
                for j, targets in by.items():
                    bg[j].put(targets, buf, n, done)
                written += n
                del buf, handle
            del parts
            if i in streams:
                res.bytes_read += streams[i].nread
            res.bytes_written += written
            emit({"event": "advance", "phase": "weights", "item": key, "i": i + 1,
                       "n": len(jobs), "bytes": written})
            _fault(f"tensor:{key}")
        for w in bg:
            w.finish()
        enc.shutdown()
        res.timings["cpu_convert"] = round(time.thread_time() - cpu0, 3)
        res.timings["cpu_write"] = round(sum(w.cpu for w in bg), 3)
        res.timings["writer_threads"] = len(bg)
        t = time.monotonic()
        for d, wr in enumerate(writers):
            sha, size = wr.close()  # fsync: waits for the disk
            files[weight_file(d)] = {"sha256": sha, "size": size}
        res.timings["weights_fsync"] = round(time.monotonic() - t, 3)
    except BaseException:
        for w in bg:
            w.abort()
        if enc is not None:
            enc.shutdown(cancel_futures=True)
        for wr in writers:
            wr.abort()
        raise
    finally:
        torch.set_num_threads(threads)
        trim_heap()


# ---- conversion helpers -------------------------------------------------------------------------------
@dataclass
class _Canon:
    """One canonical tensor: ``base``, or ``base.transpose(-1, -2)`` when ``swap`` (the HF source
    itself, read by mmap; shards are cut from it without materializing the transpose)."""

    base: object
    swap: bool = False

    @property
    def shape(self) -> tuple:
        """The canonical tensor's shape (``base``'s, its last two dims swapped when ``swap``)."""
        shape = tuple(self.base.shape)
        return shape[:-2] + (shape[-1], shape[-2]) if self.swap else shape

    @classmethod
    def of(cls, x, tf: str, a) -> "_Canon":
        """``x`` under the name-table transform ``tf``: a :data:`VIEWED` one as a view (transposed
        without a copy), any other applied (materialized)."""
        if tf in VIEWED:
            return cls(x, tf == "t" and x.dim() >= 2)
        return cls(transforms.apply(tf, [x], a))

    def dim(self, k: int) -> int:
        """The dim of ``base`` holding canonical dim ``k``."""
        n = self.base.dim()
        if self.swap and k >= n - 2:
            return 2 * n - 3 - k
        return k


#: name-table transforms a canonical tensor takes as a view of its source (as is, or transposed)
VIEWED = ("t", "id")


def _is_view(tf: str, sources) -> bool:
    """A canonical tensor that is one checkpoint tensor as it is or transposed: read as a view."""
    return tf in VIEWED and len(sources) == 1 and "{e}" not in sources[0][0]


def _read_canonical(ck, tf: str, a, decl, layer, sources, dtype: str):
    """One canonical tensor from its checkpoint tensors (``tf``: its name-table transform).
    ``t``/``id`` of a single source stay a view of the source (mmap); other transforms run on
    the source dtype and are materialized. Returns (_Canon, bytes read)."""
    import torch

    where = f"{decl.name}{'' if layer is None else f' (layer {layer})'}"
    if _is_view(tf, sources):
        x = ck.get(sources[0][1][0])
        c = _Canon.of(x, tf, a)
        if c.shape != decl.shape:
            raise InvalidInput(f"{where}: checkpoint gives shape {list(c.shape)}, the architecture says "
                               f"{list(decl.shape)}")
        return c, x.numel() * x.element_size()
    nread, srcs = 0, []
    for pattern, keys in sources:
        ts = [ck.get(k) for k in keys]
        nread += sum(x.numel() * x.element_size() for x in ts)
        srcs.append(torch.stack(ts) if "{e}" in pattern else ts[0])
        del ts
    w = transforms.apply(tf, srcs, a)
    del srcs
    if tuple(w.shape) != decl.shape:
        raise InvalidInput(f"{where}: checkpoint gives shape {list(w.shape)}, the architecture says "
                           f"{list(decl.shape)}")
    return _Canon(w), nread


class _BufferPool:
    """Reused shard buffers: fresh memory costs a page fault per 4 KiB on first touch."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.free: dict[int, list] = {}
        self.lock = threading.Lock()

    def take(self, shape, dtype):
        import torch
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self.lock:
            bufs = self.free.get(nbytes)
            if bufs:
                self.held -= nbytes
                return bufs.pop().view(dtype).view(shape)
        return torch.empty(nbytes, dtype=torch.uint8).view(dtype).view(shape)

    def give(self, t) -> None:
        import torch
        flat = t.reshape(-1).view(torch.uint8)
        with self.lock:
            if self.held + flat.numel() <= self.limit:
                self.free.setdefault(flat.numel(), []).append(flat)
                self.held += flat.numel()


def _stored_transposed(tf: str, decl, sources, dtype: str) -> bool:
    """Whether a tensor's shards keep the checkpoint's element order (HF ``[out, in]``) instead of
    the canonical ``[in, out]``: bf16 tensors that are one checkpoint tensor transposed. Their
    shards are then plain cuts of the source (no transpose; often contiguous, written straight
    from the mmap) and the weights header marks them ``"transposed": true``; readers transpose
    back (``package.shards._decode``: a view). Block floats are always stored in device order: their
    tiles share exponents along the device's rows."""
    return dtype == "bf16" and tf == "t" and _is_view(tf, sources) and len(decl.shape) >= 2


class _Countdown:
    """Calls ``fn`` once ``n`` writer threads have each called it."""

    def __init__(self, n: int, fn):
        self.n, self.fn, self.lock = n, fn, threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.n -= 1
            last = self.n == 0
        if last:
            self.fn()


def _device_shards(c: _Canon, units_per_dim, dims, D: int, dtype: str, pool: "_BufferPool | None",
                   keep_source_order: bool, encoder):
    """Yield (bytes-like, [devices], pooled buffer or None) once per distinct shard: cut from the
    source view, then one copy that gathers, transposes and casts (bf16, or float32 for block
    floats, then encoded on ``encoder``'s threads: an :class:`_Encoding`). A pooled
    buffer goes back to ``pool`` once written. With
    ``keep_source_order`` (bf16 only, see :func:`_stored_transposed`) a shard stays in the
    source's element order: a contiguous cut is yielded as a view of the source, zero copies."""
    held: dict[int, list[int]] = {}
    for d, first in enumerate(layoutmod.holders(units_per_dim, D)):
        held.setdefault(first, []).append(d)
    for first, devices in held.items():
        sig = tuple(tuple(u[first]) for u in units_per_dim)
        buf, handle = _cut(c, sig, dims, dtype, pool, keep_source_order, encoder)
        yield buf, devices, handle
        del buf, handle


def _cut(c: _Canon, sig, dims, dtype: str, pool, keep_source_order: bool, encoder):
    """One device shard of ``c`` (``sig``: per dim, the units it holds): (bytes-like, pooled
    buffer or None), see :func:`_device_shards`."""
    import torch

    host = torch.bfloat16 if dtype == "bf16" else torch.float32
    v, pads = c.base, []
    for k, (units, dim) in enumerate(zip(sig, dims)):
        if len(units) == dim.size and units == tuple(range(dim.size)):
            continue
        sk = c.dim(k)
        run = layoutmod.unit_runs(units)
        if run is not None:
            v = v.narrow(sk, run[0] * dim.unit, run[1] * dim.unit)
            continue
        pos = torch.tensor(layoutmod.elements(units, dim.unit), dtype=torch.long)
        v = v.index_select(sk, pos.clamp(min=0))
        if bool((pos < 0).any()):
            pads.append((k, (pos < 0).nonzero().reshape(-1)))
    if keep_source_order:
        if dtype != "bf16":
            raise RuntimeError(f"source order is kept for bf16 shards only, not {dtype}")
        if not pads and v.is_contiguous() and v.dtype == torch.bfloat16:
            return v.reshape(-1).view(torch.uint8).numpy(), None
        x = pool.take(tuple(v.shape), host) if pool is not None else torch.empty(v.shape, dtype=host)
        x.copy_(v)
        del v
        for k, where in pads:
            x.index_fill_(c.dim(k), where, 0)
        return x.view(torch.uint8).numpy(), x if pool is not None else None
    shape = tuple(v.transpose(-1, -2).shape if c.swap else v.shape)
    if dtype != "bf16":
        data = _encode_bands(v.transpose(-1, -2) if c.swap else v, pads, dtype, encoder)
        return data, None
    x = pool.take(shape, host) if pool is not None else torch.empty(shape, dtype=host)
    if c.swap and v.shape[-2] > 16 * TRANSPOSE_BLOCK:
        # blocks of source rows (output columns): ~2x faster than one big strided copy
        for r in range(0, v.shape[-2], TRANSPOSE_BLOCK):
            x[..., r:r + TRANSPOSE_BLOCK].copy_(v[..., r:r + TRANSPOSE_BLOCK, :].transpose(-1, -2))
    else:
        x.copy_(v.transpose(-1, -2) if c.swap else v)
    del v
    for k, where in pads:
        x.index_fill_(k, where, 0)
    return x.view(torch.uint8).numpy(), x if pool is not None else None


#: canonical bytes (bf16) of the experts one step of an expert stack's conversion reads, decodes
#: and cuts (at least one expert): the memory bound of a MoE layer's conversion
EXPERT_CHUNK_BYTES = 128 << 20
#: name-table transforms that act on each expert alone (on the trailing dims): an expert stack
#: read through one of them converts expert by expert
EXPERT_WISE = frozenset({"t", "id", "gate_up_deinterleave"})


class _ExpertStream:
    """An expert stack ``[E, ...]`` converted a chunk of experts at a time: each chunk decoded
    from the checkpoint alone (``Checkpoint.get_rows`` of a stacked tensor, or its experts' own
    tensors), transformed, and cut into the pieces of every device shard holding some of its
    experts; a device shard is the concatenation of its experts' pieces in expert order (the
    expert dim is the outermost, in bf16 and in block-float tiles alike), appended to its file
    piece by piece. Memory: a chunk and its pieces, never the layer's stack."""

    def __init__(self, tf, held, n, cap, per_expert, dtype, dims):
        self.tf, self.held, self.n, self.cap = tf, held, n, cap
        self.per_expert, self.dtype, self.dims, self.nread = per_expert, dtype, dims, 0

    @classmethod
    def plan(cls, tf: str, decl, sources, units_per_dim, D: int, t):
        """The stream of one canonical tensor, or None where it converts whole: not an expert
        stack of an expert-wise transform, or a device holding its experts out of order or padded."""
        if decl.group != "experts" or len(decl.shape) < 3 or tf not in EXPERT_WISE or len(sources) != 1:
            return None
        held: dict = {}
        for d, first in enumerate(layoutmod.holders(units_per_dim, D)):
            held.setdefault(first, []).append(d)
        E, plans = decl.shape[0], []
        for first, devices in held.items():
            sig = tuple(tuple(u[first]) for u in units_per_dim)
            pos = layoutmod.elements(sig[0], decl.dims[0].unit)
            if not pos or min(pos) < 0 or pos != sorted(set(pos)):
                return None
            plans.append((devices, pos, sig[1:]))
        per_expert = math.prod(decl.shape[1:]) * 2
        n = max(1, min(E, EXPERT_CHUNK_BYTES // per_expert))
        piece = encoded_nbytes(t.device_shape, t.dtype) // len(plans[0][1])  # one expert of one shard
        cap = max(piece * sum(sum(1 for p in pos if e0 <= p < e0 + n) for _d, pos, _s in plans)
                  for e0 in range(0, E, n))
        return cls(tf, plans, n, cap, piece, t.dtype, decl.dims)

    def _chunk(self, ck, a, decl, layer, sources, e0: int, e1: int) -> _Canon:
        import torch

        pattern, keys = sources[0]
        if "{e}" in pattern:  # the experts' own tensors: a chunk of them stacked
            ts = [ck.get(k) for k in keys[e0:e1]]
            x = torch.stack(ts)
            del ts
        else:
            x = ck.get_rows(keys[0], e0, e1)
        # under t / id a view, transposed without a copy: the cut reads it so (a block-float
        # shard in the encoders' band copies, on every core), where a contiguous transpose of
        # the chunk first was half the main thread's time (DeepSeek-V3's per-expert FP8 tensors)
        c = _Canon.of(x, self.tf, a)
        shape = c.shape
        self.nread += x.numel() * x.element_size()
        del x
        want = (e1 - e0,) + tuple(decl.shape[1:])
        if shape != want:
            where = f"{decl.name}{'' if layer is None else f' (layer {layer})'}"
            raise InvalidInput(f"{where}: checkpoint gives shape {[decl.shape[0]] + list(shape[1:])} "
                               f"(experts {e0}..{e1 - 1}: {list(shape)}), the architecture says {list(decl.shape)}")
        return c

    def shards(self, ck, a, decl, layer, sources, pool, keep: bool, encoder):
        """Yield (bytes-like, [devices], pooled buffer or None): each chunk's piece of each device
        shard, chunks in expert order."""
        import torch

        self.nread = 0
        E = decl.shape[0]
        for e0 in range(0, E, self.n):
            e1 = min(E, e0 + self.n)
            c = self._chunk(ck, a, decl, layer, sources, e0, e1)
            for devices, pos, rest in self.held:
                sel = [p - e0 for p in pos if e0 <= p < e1]
                if not sel:
                    continue
                base = c.base
                if sel != list(range(sel[0], sel[0] + len(sel))):
                    base = base.index_select(0, torch.tensor(sel, dtype=torch.long))
                elif len(sel) != e1 - e0:
                    base = base.narrow(0, sel[0], len(sel))
                sub = _Canon(base, c.swap)
                dims = (Dim(self.dims[0].name, len(sel)),) + tuple(self.dims[1:])
                buf, handle = _cut(sub, (tuple(range(len(sel))),) + rest, dims, self.dtype, pool, keep, encoder)
                if _nbytes(buf) != self.per_expert * len(sel):
                    raise RuntimeError(f"{decl.name}: experts {sel[0] + e0}.. cut to {_nbytes(buf)} B, "
                                       f"expected {self.per_expert * len(sel)} B")
                yield buf, devices, handle
                del buf, handle, sub, base
            del c


class _Encoding:
    """A shard's block-float tiles being encoded on an encoder's threads: ``out`` (its size known
    up front) holds them once :meth:`result` returns; the source stays referenced until then."""

    def __init__(self, out, futures):
        self.out, self.futures = out, futures

    @property
    def nbytes(self) -> int:
        return self.out.nbytes

    def result(self):
        for f in self.futures:
            f.result()
        self.futures = ()
        return self.out


def _nbytes(buf) -> int:
    return buf.nbytes if isinstance(buf, _Encoding) else memoryview(buf).nbytes


def _encode_bands(v, pads, dtype: str, encoder):
    """The block-float tiles of shard ``v`` (device order, any strides; ``pads``: (dim, indices)
    zeroed), encoded a band of whole tile rows at a time (copies of at most ``BAND_BYTES``, in bf16
    for a bf16 source, which blockfloat encodes from its bits, else float32), so a shard never
    exists whole in float32: tiles are row-local, so the
    bands' tiles are the shard's (``blockfloat.row_band``). The bands are submitted to ``encoder``
    (the conversion's executor, one thread per core) and an :class:`_Encoding` is returned at once."""
    import numpy as np
    import torch

    shape = list(v.shape)
    h, w = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1])
    nd = len(shape)
    out = np.empty(encoded_nbytes(shape, dtype), np.uint8)
    band_dtype = torch.bfloat16 if v.dtype == torch.bfloat16 else torch.float32
    per = max(blockfloat.TILE, BAND_BYTES // (band_dtype.itemsize * w) // blockfloat.TILE * blockfloat.TILE)
    lead_pads = [(k, set(where.tolist())) for k, where in pads if k < nd - 2]
    jobs = []
    for b, idx in enumerate(itertools.product(*(range(n) for n in shape[:-2]))):
        m = v[idx] if idx else v.reshape(h, w)
        zero = any(idx[k] in where for k, where in lead_pads)
        jobs += [(b, m, zero, r0, min(h, r0 + per)) for r0 in range(0, h, per)]
    local = threading.local()

    def one(job):
        b, m, zero, r0, r1 = job
        if getattr(local, "buf", None) is None:
            local.buf = torch.empty(min(per, h) * w, dtype=band_dtype)
        xb = local.buf[:(r1 - r0) * w].view(r1 - r0, w)
        if zero:
            xb.zero_()
        else:
            src = m[r0:r1]
            if src.stride(-1) != 1 and w > 16 * TRANSPOSE_BLOCK:
                # a transposed source: blocks of its rows (our columns), ~2x one strided copy
                for c0 in range(0, w, TRANSPOSE_BLOCK):
                    xb[:, c0:c0 + TRANSPOSE_BLOCK].copy_(src[:, c0:c0 + TRANSPOSE_BLOCK])
            else:
                xb.copy_(src)
            for k, where in pads:
                if k == nd - 1:
                    xb.index_fill_(1, where, 0)
                elif k == nd - 2:
                    sel = where[(where >= r0) & (where < r1)] - r0
                    if len(sel):
                        xb.index_fill_(0, sel, 0)
        a, z = blockfloat.row_band(shape, dtype, b, r0, r1)
        enc = blockfloat.encode_array(xb, dtype).reshape(-1)
        if enc.size != z - a:
            raise RuntimeError(f"blockfloat.encode gave {enc.size} B for rows {r0}:{r1} of {shape} {dtype}, "
                               f"expected {z - a} B")
        out[a:z] = enc

    return _Encoding(out, encoder.run(one, jobs, v.numel() * v.element_size()))


#: bytes of the sources (decoded expert chunks, float32) that shards queued for the encoders or
#: being encoded may reference together: four canonical expert chunks' worth (two in float32)
SOURCE_BYTES = 4 * EXPERT_CHUNK_BYTES


class _Encoder:
    """The encoders' threads (one per core), and a bound on the source bytes their queued and
    running shards reference (``budget``): a shard's source lives until its last band is encoded,
    and a reader faster than the encoders (a slow host, or a cheap FP8 decode) would otherwise
    queue chunks up to the writers' cap, which counts *encoded* bytes (a bfp4 shard is an eighth
    of its float32 source): DeepSeek-V3's build reached 12 GiB so on a host with a slower disk.
    :meth:`run` blocks while the shards in flight hold ``budget`` (one larger than it waits for
    the others to finish and then runs alone)."""

    def __init__(self, threads: int, budget: int):
        self.ex = ThreadPoolExecutor(threads, thread_name_prefix="ttbundle-encode")
        self.budget, self.held, self.most = budget, 0, 0
        self.cv = threading.Condition()

    def run(self, fn, jobs: list, nbytes: int) -> list:
        """Submit ``fn(job)`` for each of one shard's ``jobs`` (its source ``nbytes``) once the
        shards in flight leave room for it; the futures."""
        n = min(nbytes, self.budget)
        with self.cv:
            while self.held and self.held + n > self.budget:
                self.cv.wait()
            self.held += n
            self.most = max(self.most, self.held)
        left = [len(jobs)]

        def done(_f=None):
            with self.cv:
                left[0] -= 1
                if left[0] <= 0:
                    self.held -= n
                    self.cv.notify_all()
        if not jobs:
            done()
            return []
        futures = [self.ex.submit(fn, j) for j in jobs]
        for f in futures:
            f.add_done_callback(done)
        return futures

    def shutdown(self, cancel_futures: bool = False) -> None:
        self.ex.shutdown(cancel_futures=cancel_futures)


class _WriteBehind:
    """A thread that appends shards to the device files (write + sha256) while the next tensor is
    read and cut; ``put`` blocks while more than ``cap`` bytes are waiting."""

    def __init__(self, cap: int):
        self.cap, self.pending = cap, 0
        self.q: collections.deque = collections.deque()
        self.cv = threading.Condition()
        self.err: BaseException | None = None
        self.closed = False
        self.cpu = 0.0  # the thread's CPU seconds
        self.t = threading.Thread(target=self._run, name="ttbundle-writer", daemon=True)
        self.t.start()

    def put(self, targets: list, buf, nbytes: int, on_done=None) -> None:
        with self.cv:
            while self.pending and self.pending + nbytes > self.cap and self.err is None:
                self.cv.wait()
            if self.err is not None:
                raise self.err
            self.q.append((targets, buf, nbytes, on_done))
            self.pending += nbytes
            self.cv.notify_all()

    def _run(self) -> None:
        c = time.thread_time()
        try:
            self._loop()
        finally:
            self.cpu = time.thread_time() - c

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.q and not self.closed:
                    self.cv.wait()
                if not self.q:
                    return
                targets, buf, nbytes, on_done = self.q.popleft()
            try:
                if isinstance(buf, _Encoding):
                    buf = buf.result()
                for f, key in targets:
                    f.write(key, buf)
            except BaseException as e:  # surfaced to the producer on its next put / finish
                with self.cv:
                    self.err = e
                    self.cv.notify_all()
                return
            del buf
            if on_done is not None:
                on_done()
            with self.cv:
                self.pending -= nbytes
                self.cv.notify_all()

    def finish(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.t.join()
        if self.err is not None:
            raise self.err

    def abort(self) -> None:
        with self.cv:
            self.q.clear()
            self.closed = True
            self.cv.notify_all()
        self.t.join()
