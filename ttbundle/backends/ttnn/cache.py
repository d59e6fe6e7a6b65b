"""Per-device ``.tensorbin`` weight caches: what `ttbundle build --backend ttnn` adds to a package.

A serving host then never converts a weight at start-up: it ``ttnn.load_tensor``s each device's
file, joins a tensor's per-device host tensors with ``ttnn.from_host_shards`` and moves the
result to the mesh (``load_mesh_weights``). Layout (ttbundle's own; ``ttnn.as_tensor`` with a
mesh mapper writes one multi-device file per tensor instead, which needs an open mesh)::

    tensorbin/index.json                     format, mesh, devices, per tensor key: shape, dtype,
                                             layout, the mesh mapper ttnn would use (or null),
                                             ``stored_in``: per device, whose file holds its shard
    tensorbin/device-NNN/<key>.tensorbin     device NNN's shard of tensor <key> (``wq.3``), written
                                             for the first device holding that shard only

**Keys that cannot collide** (tt-metal #52176: Wormhole and Blackhole 4x8 meshes shared one weight
cache; PR #55795: cache files renamed under an unchanged key; PR #50550: a placeholder tensor
persisted on a miss). ``index.json`` records the caches' :func:`identity` (chip architecture, mesh
and its shape, the ttnn version whose file format is written, the converter's and this module's
source digests, the checkpoint's digest, every tensor's dtype and layout), and the artifact key
is a digest of it; it also lists every file it names with its sha256 and size. Before anything
is loaded (:func:`check_index`) the identity is compared with what the package's manifest says
its programs run on, field by field, and every file is checked present, of its size and sha256,
and no file it does not list is in ``tensorbin/``: a cache from another chip, a renamed file or a
placeholder is refused, naming the field or file. Nothing is ever written at load: a missing or
wrong file is an error, never filled in.

Each file is a single-device host tensor exactly as ``ttnn.dump_tensor`` writes one
(:mod:`ttbundle.tensorbin`), holding the shape, dtype and layout ttnn keeps the tensor in on
device (:mod:`.layout`): block floats as the package's own tiles (byte for byte what ttnn
packs), bf16 matrices tilized here (32x32 tiles of four 16x16 faces), bf16 vectors as rows of
32, embeddings row-major. The files are cut from the package's ``weights/device-NNN.safetensors``
(read raw: no torch, so this also runs in the Python 3.12 ttnn environment). A shard several
devices hold (a replicated tensor, or one split over one axis and replicated over the other) is
stored once, as the weights files store it (their ``stored_in``), and loaded once: every device
holding it gets that one host tensor in ``ttnn.from_host_shards`` (each chip's DRAM holds its own
copy on the device, as it must).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import types
from pathlib import Path
from typing import Callable

import numpy as np

from ... import tensorbin
from ...cache import code_digest, digest, dist_version, module_sources
from ...package.names import PackageError, weight_file
from ...package.shards import stored_shape
from .layout import TILE, device_shape
from .mappers import mapper_dims

FORMAT = "ttbundle.tensorbin/3"  # /2: one file per distinct shard (``stored_in``); /3: identity, file digests
DIR = "tensorbin"
INDEX = f"{DIR}/index.json"


def cache_file(d: int, key: str) -> str:
    return f"{DIR}/device-{d:03d}/{key}.tensorbin"


#: identity fields compared at load with what the manifest says (``code`` and ``tensors`` are in
#: the key; the tensors are checked one by one against the programs instead)
CHECKED = ("format", "arch", "mesh", "mesh_shape", "ttnn", "converter", "sources", "weights")


def identity(plan, fields: dict, weights_key: str) -> dict:
    """What the caches are, for their key and their index: ``plan``'s mesh (chip architecture,
    name, shape), the ttnn version whose ``.tensorbin`` format is written (``tensorbin.TTNN_VERSION``),
    the converter's source digest (``fields["code.convert"]``), this module's and its imports'
    (``code``), the checkpoint's digest (``fields["weights"]``), the weights' artifact key, and
    a digest of every tensor's dtype and layout."""
    mesh = plan.mesh
    return {"format": FORMAT, "arch": mesh.chip.arch, "mesh": mesh.name, "mesh_shape": list(mesh.shape),
            "ttnn": tensorbin.TTNN_VERSION, "converter": fields.get("code.convert"),
            "code": code_digest(module_sources([__name__])), "sources": fields.get("weights"),
            "weights": weights_key,
            "tensors": digest(sorted((t.name, t.dtype, t.layout) for t in plan.tensors))}


def expected_identity(manifest: dict) -> dict:
    """The :data:`CHECKED` fields a package's caches must have: its manifest's mesh (the one its
    programs were lowered for), key fields and weights key."""
    m = manifest.get("mesh", {})
    kf = manifest.get("key_fields", {})
    return {"format": FORMAT, "arch": m.get("arch"), "mesh": m.get("name"), "mesh_shape": list(m.get("shape", [])),
            "ttnn": tensorbin.TTNN_VERSION, "converter": kf.get("code.convert"), "sources": kf.get("weights"),
            "weights": manifest.get("artifacts", {}).get("weights", {}).get("key")}


def artifact_key(ident: dict) -> str:
    """The caches' key: a digest of their whole :func:`identity`."""
    return digest(ident)


# ---- reading a package's device files without torch --------------------------------------------
class _RawSafetensors:
    """A safetensors file read as bytes: header dict, and each tensor's raw data."""

    def __init__(self, path: Path):
        self.f = open(path, "rb")
        n = struct.unpack("<Q", self.f.read(8))[0]
        self.header = json.loads(self.f.read(n))
        self.start = 8 + n
        self.meta = json.loads(self.header["__metadata__"]["ttbundle"])

    def source(self, key: str, d: int) -> int:
        """The device whose weights file stores device ``d``'s shard of ``key``."""
        src = self.meta["tensors"][key].get("stored_in")
        return d if src is None else int(src[d])

    def get(self, key: str) -> bytes:
        a, b = self.header[key]["data_offsets"]
        self.f.seek(self.start + a)
        return self.f.read(b - a)

    def close(self) -> None:
        self.f.close()


# ---- host layouts ------------------------------------------------------------------------------
def tilize(a: np.ndarray) -> bytes:
    """``a`` (``[..., H, W]``, any element type) as ttnn's TILE layout: the last two dims
    zero-padded to multiples of 32, tiles row-major, each tile its four 16x16 faces (top-left,
    top-right, bottom-left, bottom-right), each face row-major."""
    if a.ndim < 2:
        a = a.reshape(1, -1)
    *lead, h, w = a.shape
    ph, pw = -(-h // TILE) * TILE, -(-w // TILE) * TILE
    if (ph, pw) != (h, w):
        p = np.zeros((*lead, ph, pw), dtype=a.dtype)
        p[..., :h, :w] = a
        a = p
    n = len(lead)
    t = a.reshape(*lead, ph // TILE, 2, 16, pw // TILE, 2, 16)
    # [..., th, fr, r, tw, fc, c] -> [..., th, tw, fr, fc, r, c]
    order = list(range(n)) + [n, n + 3, n + 1, n + 4, n + 2, n + 5]
    return np.ascontiguousarray(t.transpose(order)).tobytes()


def untilize(data: bytes, shape, dtype=np.uint16) -> np.ndarray:
    """Inverse of :func:`tilize` (padding dropped)."""
    shape = tuple(shape) if len(shape) >= 2 else (1, shape[0])
    *lead, h, w = shape
    ph, pw = -(-h // TILE) * TILE, -(-w // TILE) * TILE
    n = len(lead)
    t = np.frombuffer(data, dtype=dtype).reshape(*lead, ph // TILE, pw // TILE, 2, 2, 16, 16)
    order = list(range(n)) + [n, n + 2, n + 4, n + 1, n + 3, n + 5]
    return t.transpose(order).reshape(*lead, ph, pw)[..., :h, :w]


def host_bytes(raw: bytes, shape, encoding: str, layout: str,
               transposed: bool = False) -> tuple[bytes, tuple[int, ...]]:
    """A package shard (``raw``: bf16 elements, or block-float tiles) as the bytes and shape of
    the host tensor ttnn loads. ``transposed``: the shard is stored with its last two dims
    swapped (the checkpoint's order; the weights header says so)."""
    shp = device_shape(shape, layout)
    if encoding in ("bfp8", "bfp4"):
        return raw, shp  # already ttnn's tiles (ttbundle.blockfloat)
    if transposed:  # bf16 bit patterns, stored [..., out, in]
        stored = stored_shape(shape, True)
        a = np.ascontiguousarray(np.frombuffer(raw, dtype=np.uint16).reshape(stored).swapaxes(-1, -2))
    else:
        a = np.frombuffer(raw, dtype=np.uint16).reshape(shape)  # bf16 bit patterns
    if layout == "TILE":
        return tilize(a), shp
    if len(shape) == 1:  # a vector as rows of 32, zero-padded
        p = np.zeros(int(np.prod(shp)), dtype=np.uint16)
        p[: a.size] = a
        return p.tobytes(), shp
    return a.tobytes(), shp


# ---- writing -----------------------------------------------------------------------------------
def _write_file(path: Path, *chunks: bytes) -> dict:
    """Write ``chunks`` to a fresh file (fsynced); its sha256 and size for the manifest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    if path.exists():  # never write through a hard link into a previous package
        path.unlink()
    with open(path, "xb") as f:
        for c in chunks:
            f.write(c)
            h.update(c)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": h.hexdigest(), "size": sum(len(c) for c in chunks)}


def write_caches(pkg: str | Path, plan, policy=None,
                 progress: Callable[[dict], None] | None = None, ident: dict | None = None) -> dict[str, dict]:
    """Write ``tensorbin/`` into package directory ``pkg`` (its ``weights/`` already written) for
    ``plan``, its index recording ``ident`` (:func:`identity`) and every file's sha256. Returns
    ``{relative path: {"sha256", "size"}}`` of every file written."""
    pkg = Path(pkg)
    emit = progress or (lambda e: None)
    mesh = plan.mesh
    tp = {t.name: t for t in plan.tensors}
    D = mesh.num_devices
    files: dict[str, dict] = {}
    index: dict[str, dict] = {}
    readers = [_RawSafetensors(pkg / weight_file(d)) for d in range(D)]
    try:
        keys = list(readers[0].meta["tensors"])
        emit({"event": "phase", "phase": "tensorbin", "total": len(keys), "unit": "tensors"})
        for i, key in enumerate(keys):
            info = readers[0].meta["tensors"][key]
            t = tp[info["tensor"]]
            shp = device_shape(t.device_shape, t.layout)
            stored_in = [readers[0].source(key, d) for d in range(D)]
            index[key] = {"tensor": t.name, "layer": info.get("layer"), "shape": list(shp),
                          "dtype": t.dtype, "layout": t.layout,
                          "mesh_mapper": mapper_dims(plan, t.name, policy), "stored_in": stored_in}
            for d in sorted(set(stored_in)):  # each stored shard once, in its holder's file
                r = readers[d]
                rinfo = r.meta["tensors"][key]
                if rinfo["shape"] != t.device_shape or rinfo["encoding"] != t.dtype:
                    raise ValueError(f"{weight_file(d)}: {key} is {rinfo['encoding']}{rinfo['shape']}, "
                                     f"the plan says {t.dtype}{t.device_shape}")
                data, shape = host_bytes(r.get(key), t.device_shape, t.dtype, t.layout,
                                         transposed=bool(rinfo.get("transposed")))
                head = tensorbin.header_bytes(list(shape), t.dtype, t.layout, len(data))
                rel = cache_file(d, key)
                files[rel] = _write_file(pkg / rel, struct.pack("<Q", len(head)), head, data)
            emit({"event": "advance", "phase": "tensorbin", "item": key, "i": i + 1, "n": len(keys)})
    finally:
        for r in readers:
            r.close()
    doc = {"format": FORMAT, "mesh": {"name": mesh.name, "shape": list(mesh.shape), "arch": mesh.chip.arch},
           "devices": D, "identity": ident or {}, "layout": f"{DIR}/device-NNN/<key>.tensorbin",
           "files": dict(sorted(files.items())), "tensors": index}
    files[INDEX] = _write_file(pkg / INDEX, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    return files


def read_index(pkg: str | Path) -> dict:
    return json.loads((Path(pkg) / INDEX).read_text(encoding="utf-8"))


# ---- loading on a mesh (hardware path; also runs on a mock mesh) --------------------------------
def load_host_shards(ttnn, pkg: str | Path, key: str, devices: int, stored_in: list | None = None) -> list:
    """Device ``d``'s host tensor of ``key`` for every device, as ``ttnn.load_tensor`` reads it;
    a file ``stored_in`` names for several devices is loaded once and given to each of them."""
    src = list(range(devices)) if stored_in is None else [int(s) for s in stored_in]
    loaded = {s: ttnn.load_tensor(str(Path(pkg) / cache_file(s, key))) for s in dict.fromkeys(src)}
    return [loaded[s] for s in src]


def check_identity(pkg: str | Path, idx: dict, expect: dict) -> None:
    """The caches are the ones ``expect`` (:func:`expected_identity`) asks for, field by field
    (:data:`CHECKED`); PackageError naming the first field that differs and both values."""
    got = idx.get("identity") or {}
    for f in CHECKED:
        if got.get(f) != expect.get(f):
            raise PackageError(f"{pkg}: {INDEX}: caches for {f} {got.get(f)!r}, this package's programs need "
                               f"{expect.get(f)!r} (caches of another chip, mesh, ttnn, converter or checkpoint "
                               "are never used); rebuild the package")


def check_files(pkg: str | Path, idx: dict, verified_files: dict | None = None) -> None:
    """Every file the index names (each tensor's ``stored_in`` shards) is listed in its
    ``files``, present, of its size and sha256, and ``tensorbin/`` holds no other file: the cache
    is complete and is what the build wrote (a renamed, truncated or placeholder file is refused,
    named). Reads every file once, unless ``verified_files`` (the manifest's ``files`` of a
    package whose every sha256 was just checked, ``LoadedPackage.verified``) vouches for it: then
    each index record must equal the manifest's, and nothing is read twice."""
    pkg = Path(pkg)
    listed = idx.get("files") or {}
    need = {cache_file(int(d), key) for key, e in idx.get("tensors", {}).items()
            for d in set(e.get("stored_in") or [])}
    for rel in sorted(need - set(listed)):
        raise PackageError(f"{pkg}: {INDEX}: {rel} is read but not listed with its sha256; rebuild the package")
    on_disk = {p.relative_to(pkg).as_posix() for p in (pkg / DIR).rglob("*") if p.is_file()} - {INDEX}
    for rel in sorted(on_disk - set(listed)):
        raise PackageError(f"{pkg}: {rel}: not a file of this cache's index (renamed, or left by another "
                           "build); rebuild the package")
    for rel, rec in sorted(listed.items()):
        p = pkg / rel
        if not p.is_file():
            raise PackageError(f"{pkg}: {rel}: missing (the cache is incomplete); rebuild the package")
        if p.stat().st_size != rec.get("size"):
            raise PackageError(f"{pkg}: {rel}: {p.stat().st_size} bytes, the index says {rec.get('size')}; "
                               "rebuild the package")
        if verified_files is not None:
            if verified_files.get(rel) != rec:
                raise PackageError(f"{pkg}: {INDEX}: {rel} is recorded as {rec}, the manifest says "
                                   f"{verified_files.get(rel)}; rebuild the package")
            continue
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        if h.hexdigest() != rec.get("sha256"):
            raise PackageError(f"{pkg}: {rel}: sha256 {h.hexdigest()[:12]}..., the index says "
                               f"{str(rec.get('sha256'))[:12]}... (not the file the build wrote); rebuild the package")


def check_device_arch(mesh_device, idx: dict, pkg: str | Path = "") -> None:
    """The opened mesh's chips are the architecture the caches (and the programs) were made for
    (``MeshDevice.arch()``, ``Arch.WORMHOLE_B0`` / ``Arch.BLACKHOLE``): a Wormhole package on a
    Blackhole mesh of the same shape is refused before a weight loads. A device that does not
    say (a stand-in) is not checked."""
    arch = getattr(mesh_device, "arch", None)
    if not callable(arch):
        return
    a = arch()
    have = str(getattr(a, "name", str(a).rsplit(".", 1)[-1])).lower()
    want = (idx.get("identity") or {}).get("arch")
    if have != want:
        raise PackageError(f"{pkg}: {INDEX}: caches and programs for {want} chips, the mesh opened has {have} "
                           f"chips; build the package for a {have} mesh")


def check_installed_ttnn(ttnn, idx: dict) -> None:
    """The ttnn module about to load the caches reads the file format they were written in: the
    wheel's installed version equals the identity's (a stand-in module is not the wheel)."""
    if not (isinstance(ttnn, types.ModuleType) and ttnn.__name__ == "ttnn"):
        return
    have, want = dist_version("ttnn"), (idx.get("identity") or {}).get("ttnn")
    if have != want:
        raise PackageError(f"{INDEX}: caches in ttnn {want}'s tensorbin format, this host has ttnn {have}; "
                           f"install ttnn {want} or rebuild the package for it")


def check_index(pkg: str | Path, idx: dict, refs: dict, mesh_shape, stored_in: dict | None = None,
                expect: dict | None = None, verified_files: dict | None = None) -> None:
    """The caches hold what the package's programs read (``LoadedPackage.weight_refs``): the
    mesh shape, and per key a weight of the programs in its dtype and per-device shape (as ttnn
    holds it, :func:`.layout.device_shape`), each shard in the file the weights store it in
    (``stored_in``: ``PackageWeights.stored_in``, checked against the layout at load). With
    ``expect`` (:func:`expected_identity`), also the identity (:func:`check_identity`) and
    every file (:func:`check_files`). Raises PackageError naming the key and both."""
    if idx.get("format") != FORMAT:
        raise PackageError(f"{pkg}: {INDEX}: format {idx.get('format')!r}, this ttbundle reads {FORMAT}; "
                           "rebuild the package")
    if expect is not None:
        check_identity(pkg, idx, expect)
    if stored_in is not None:
        for key, e in idx["tensors"].items():
            if e.get("stored_in") != stored_in.get(key):
                raise PackageError(f"{pkg}: {INDEX}: {key} is stored in device files {e.get('stored_in')}, "
                                   f"the weights in {stored_in.get(key)}; rebuild the package")

    if list(idx["mesh"]["shape"]) != list(mesh_shape):
        raise PackageError(f"{pkg}: {INDEX}: caches for a {idx['mesh']['shape']} mesh, the programs run on "
                           f"{list(mesh_shape)}; rebuild the package")
    for key, e in idx["tensors"].items():
        ref = refs.get(e.get("tensor"))
        want = None if ref is None else (list(device_shape(ref.device_shape, e.get("layout"))), ref.dtype)
        if want != (list(e.get("shape", ())), e.get("dtype")):
            got = f"{e.get('dtype')}{e.get('shape')}"
            raise PackageError(f"{pkg}: {INDEX}: {key} is cached as {got}, the programs read "
                               + (f"{e.get('tensor')} as {want[1]}{want[0]}" if want else f"no weight {e.get('tensor')!r}")
                               + "; rebuild the package")
    if expect is not None:
        check_files(pkg, idx, verified_files)


def load_mesh_weights(ttnn, mesh_device, pkg: str | Path, keys: list[str] | None = None) -> dict:
    """Every cached tensor (or ``keys``) as one mesh tensor in DRAM: per-device files joined with
    ``ttnn.from_host_shards`` (device ``d`` = mesh coordinate ``(d // cols, d % cols)``)."""
    idx = read_index(pkg)
    shape = ttnn.MeshShape(*idx["mesh"]["shape"])
    out = {}
    for key in keys or list(idx["tensors"]):
        shards = load_host_shards(ttnn, pkg, key, idx["devices"], idx["tensors"][key].get("stored_in"))
        host = ttnn.from_host_shards(shards, shape)
        out[key] = ttnn.to_device(host, mesh_device, memory_config=ttnn.DRAM_MEMORY_CONFIG)
    return out
