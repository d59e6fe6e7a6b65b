"""`ttbundle build --backend ttnn`: the per-device .tensorbin caches load in the real ttnn wheel.

The package is built beforehand by the main environment (torch is needed to convert a
checkpoint; this Python 3.12 environment has none): ``$TTBUNDLE_MAIN_PYTHON``, else the
checkout's ``.venv/bin/python``; without one the package tests skip. A tiny random Llama (vocab
500 padded to 512 on T3K, 2 KV heads replicated over 8 devices) with bfp8 MLP, bfp4 attention
and bf16 everything else, so every layout and both of ttbundle's own splits are in it.

Checked here: every file ``ttnn.load_tensor`` reads has the index's shape, dtype and layout and
the values of the package's device shard; bf16 tiles are ttnn's own (``ttnn.Tensor(...,
TILE_LAYOUT)`` of the same values gives the same bytes); on a mock T3K mesh the per-device files
join into mesh tensors (``from_host_shards`` + ``to_device``), and where the index names a ttnn
mapper, ttnn's own ``ShardTensor2dMesh`` / ``ReplicateTensorToMesh`` of the global tensor gives
each device exactly the bytes in its file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ttbundle import blockfloat, mockcluster
from ttbundle.backends.ttnn import cache

pytestmark = pytest.mark.ttnn
ROOT = Path(__file__).resolve().parents[2]

BUILD = r"""
import sys
from pathlib import Path
import torch
from ttbundle import build, reference, spec
out = Path(sys.argv[1])
ck = out / "ckpt"
text = '''name: tiny
model: {family: llama, vocab_size: 500, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2,
        num_attention_heads: 8, num_key_value_heads: 2, max_position_embeddings: 512}
weights: {source: ckpt, dtypes: {mlp: bfp8, attention: bfp4}}
targets: [T3K, N150]
buckets: {prefill: [32, 64], decode: [1, 8], prefill_chunk: 64}
runtime: {max_model_len: 256, max_num_seqs: 8}
tokenizer: false
'''
arch = spec.loads(text.replace("source: ckpt, ", ""), "arch.yaml")
reference.random_model(arch, 0).to(torch.bfloat16).save_pretrained(str(ck), safe_serialization=True)
(out / "spec.yaml").write_text(text)
b = spec.load(out / "spec.yaml")
for mesh in ("T3K", "N150"):
    r = build.build(b, mesh, out / "packages", backend="ttnn", warmup=False)
    print("PACKAGE", mesh, r.package)
"""


def main_python() -> str | None:
    p = os.environ.get("TTBUNDLE_MAIN_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(p).exists():
        return None
    ok = subprocess.run([p, "-c", "import torch, ttbundle.build"], capture_output=True, timeout=120)
    return p if ok.returncode == 0 else None


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    py = main_python()
    if py is None:
        pytest.skip("no main environment with torch to build a package (set TTBUNDLE_MAIN_PYTHON)")
    out = tmp_path_factory.mktemp("pkg")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TT_METAL")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([py, "-c", BUILD, str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return {ln.split()[1]: Path(ln.split()[2]) for ln in r.stdout.splitlines() if ln.startswith("PACKAGE ")}


def shard_values(pkg: Path, d: int, key: str) -> np.ndarray:
    """Device d's shard of ``key`` from the package's safetensors, as float32 (no torch): from
    the file its header's ``stored_in`` names (a shard several devices hold is stored once)."""
    path = pkg / "weights" / f"device-{d:03d}.safetensors"
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    src = json.loads(head["__metadata__"]["ttbundle"])["tensors"][key].get("stored_in", [d] * (d + 1))[d]
    with open(pkg / "weights" / f"device-{src:03d}.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        a, b = head[key]["data_offsets"]
        f.seek(8 + n + a)
        raw = f.read(b - a)
    info = json.loads(head["__metadata__"]["ttbundle"])["tensors"][key]
    if info["encoding"] == "bf16":
        bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        shp = info["shape"]
        if info.get("transposed"):  # stored in the checkpoint's [out, in] order
            return bits.view(np.float32).reshape(shp[:-2] + shp[:-3:-1]).swapaxes(-1, -2)
        return bits.view(np.float32).reshape(shp)
    return blockfloat.decode_array(raw, info["shape"], info["encoding"])


def host_values(ttnn, t) -> np.ndarray:
    if t.dtype == ttnn.bfloat16:  # no numpy bf16: widen on the host first
        t = ttnn.to_dtype(t, ttnn.float32)
    return t.to_numpy()


@pytest.mark.parametrize("mesh", ["T3K", "N150"])
def test_every_cache_file_loads_with_the_planned_shape_dtype_layout_and_values(ttnn, packages, mesh):
    pkg = packages[mesh]
    idx = cache.read_index(pkg)
    assert idx["format"] == cache.FORMAT and idx["devices"] == (8 if mesh == "T3K" else 1)
    dtypes = {"bf16": ttnn.bfloat16, "bfp8": ttnn.bfloat8_b, "bfp4": ttnn.bfloat4_b}
    layouts = {"TILE": ttnn.TILE_LAYOUT, "ROW_MAJOR": ttnn.ROW_MAJOR_LAYOUT}
    seen = set()
    for key, info in idx["tensors"].items():
        for d in range(idx["devices"]):
            t = ttnn.load_tensor(str(pkg / cache.cache_file(info["stored_in"][d], key)))
            assert list(t.shape) == info["shape"], key
            assert t.dtype == dtypes[info["dtype"]] and t.layout == layouts[info["layout"]], key
            want = shard_values(pkg, d, key)
            got = host_values(ttnn, t)
            if want.ndim == 1:  # a vector held as rows of 32, zero-padded
                got = got.reshape(-1)
                assert not got[want.size:].any()
                got = got[: want.size]
            np.testing.assert_array_equal(got, want, err_msg=f"{key} on device {d}")
            seen.add((info["dtype"], info["layout"], want.ndim))
    # a replicated tensor is one file, in device 0's folder, that every device loads
    if idx["devices"] > 1:
        norm = next(k for k, i in idx["tensors"].items() if i["tensor"] == "attn_norm")
        assert idx["tensors"][norm]["stored_in"] == [0] * idx["devices"]
        assert not (pkg / cache.cache_file(1, norm)).exists()
    # every kind of file was in the package: bfp8/bfp4/bf16 tiles, bf16 vectors, the embedding
    assert {("bfp8", "TILE", 2), ("bfp4", "TILE", 2), ("bf16", "TILE", 2), ("bf16", "ROW_MAJOR", 1),
            ("bf16", "ROW_MAJOR", 2)} <= seen


def test_bf16_tiles_are_ttnns_own(ttnn, host_bytes):
    rng = np.random.default_rng(0)
    for shape in [(32, 32), (40, 70), (2, 3, 33, 65), (1, 1000)]:
        bits = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        vals = (bits.astype(np.uint32) << 16).view(np.float32)
        t = ttnn.Tensor(vals, ttnn.bfloat16, None, ttnn.TILE_LAYOUT)
        assert host_bytes(t) == cache.tilize(bits), shape
        np.testing.assert_array_equal(cache.untilize(cache.tilize(bits), shape), bits)


MESH = r"""
import json, sys
import numpy as np
import ttnn
from ttbundle.backends.ttnn import cache, mappers
pkg = sys.argv[1]
idx = cache.read_index(pkg)
D = idx["devices"]
dev = ttnn.open_mesh_device(ttnn.MeshShape(*idx["mesh"]["shape"]))
out = {"mapped": 0, "own": 0}
loaded = cache.load_mesh_weights(ttnn, dev, pkg)
for key, info in idx["tensors"].items():
    t = loaded[key]
    assert str(t.storage_type()) == "StorageType.DEVICE" and list(t.shape) == info["shape"], key
    m = info["mesh_mapper"]
    if m is None:
        out["own"] += 1
        continue
    shards = cache.load_host_shards(ttnn, pkg, key, D, info["stored_in"])
    vals = [s.to_numpy() if s.dtype != ttnn.bfloat16 else ttnn.to_dtype(s, ttnn.float32).to_numpy() for s in shards]
    rows, cols = idx["mesh"]["shape"]
    if m["type"] == "ReplicateTensorToMesh":
        g = vals[0]
    else:  # the global tensor, from the shards ttbundle cut
        grid = [[vals[r * cols + c] for c in range(cols)] for r in range(rows)]
        dr, dc = m["dims"]
        line = [np.concatenate(row, axis=dc) if dc is not None else row[0] for row in grid]
        g = np.concatenate(line, axis=dr) if dr is not None else line[0]
    mapper = mappers.make_mapper(ttnn, dev, (rows, cols), m)
    dtype = {"bf16": ttnn.bfloat16, "bfp8": ttnn.bfloat8_b, "bfp4": ttnn.bfloat4_b}[info["dtype"]]
    layout = ttnn.TILE_LAYOUT if info["layout"] == "TILE" else ttnn.ROW_MAJOR_LAYOUT
    host = ttnn.Tensor(np.ascontiguousarray(g, dtype=np.float32), dtype, None, layout)
    parts = ttnn.get_device_tensors(ttnn.distribute_tensor(host, mapper, None))
    for d, p in enumerate(parts):
        ref = np.from_dlpack(p.host_buffer().get_shard(ttnn.MeshCoordinate(0, 0))).tobytes()
        mine = open(f"{pkg}/{cache.cache_file(info['stored_in'][d], key)}", "rb").read()
        assert mine.endswith(ref) and len(mine) - len(ref) == 8 + int.from_bytes(mine[:8], "little"), (key, d)
    out["mapped"] += 1
ttnn.close_mesh_device(dev)
print("RESULT " + json.dumps(out))
"""


def test_per_device_files_make_mesh_tensors_and_match_ttnns_mappers(packages, tmp_path):
    spec = importlib.util.find_spec("ttnn")
    if spec is None:
        pytest.skip("ttnn is not installed here")
    if not (Path(spec.origin).parent / "runtime/sfpi/compiler/bin/riscv-tt-elf-g++").exists():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh)")
    env = mockcluster.mock_env("T3K", tmp_path)
    r = subprocess.run([sys.executable, "-c", MESH, str(packages["T3K"])], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    # embeddings/lm_head over a padded vocab and k/v over replicated KV heads are ttbundle's own
    # splits; everything else is a plain ttnn mapper
    assert got["mapped"] > 0 and got["own"] > 0, got


ARCH = """
import json, sys
import ttnn
from ttbundle import mesh as meshmod
from ttbundle.backends.ttnn import cache
from ttbundle.package.names import PackageError
m = meshmod.resolve(sys.argv[1])
dev = ttnn.open_mesh_device(ttnn.MeshShape(*m.shape))
out = {"arch": str(dev.arch())}
cache.check_device_arch(dev, {"identity": {"arch": m.chip.arch}})
other = "blackhole" if m.chip.arch != "blackhole" else "wormhole_b0"
try:
    cache.check_device_arch(dev, {"identity": {"arch": other}})
    out["refused"] = None
except PackageError as e:
    out["refused"] = str(e)
cache.check_installed_ttnn(ttnn, {"identity": {"ttnn": "0.81.1"}})
try:
    cache.check_installed_ttnn(ttnn, {"identity": {"ttnn": "0.80.0"}})
    out["old"] = None
except PackageError as e:
    out["old"] = str(e)
ttnn.close_mesh_device(dev)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("mesh", ["N150", "P150"])
def test_the_mesh_reports_the_chip_arch_the_caches_are_keyed_by(mesh, tmp_path):
    """What ttnn 0.81.1's ``MeshDevice.arch()`` says on a mock Wormhole and Blackhole chip is
    the architecture a cache's identity records (``mesh.Chip.arch``): caches of the other one are
    refused, and so are caches in another ttnn's file format (issue 41: tt-metal #52176)."""
    spec = importlib.util.find_spec("ttnn")
    if spec is None:
        pytest.skip("ttnn is not installed here")
    if not (Path(spec.origin).parent / "runtime/sfpi/compiler/bin/riscv-tt-elf-g++").exists():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh)")
    r = subprocess.run([sys.executable, "-c", ARCH, mesh], cwd=tmp_path, env=mockcluster.mock_env(mesh, tmp_path),
                       capture_output=True, text=True, timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    want = {"N150": ("Arch.WORMHOLE_B0", "wormhole_b0", "blackhole"), "P150": ("Arch.BLACKHOLE", "blackhole", "wormhole_b0")}
    arch, mine, other = want[mesh]
    assert got["arch"] == arch
    assert f"caches and programs for {other} chips, the mesh opened has {mine} chips" in got["refused"]
    assert "caches in ttnn 0.80.0's tensorbin format, this host has ttnn 0.81.1" in got["old"]
