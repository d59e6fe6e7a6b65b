"""Tests that need a Tenstorrent device (marked ``tt_hardware``; skipped anywhere else).

Run them on a TT host (docs/hardware.md)::

    MESH_DEVICE=N300 .venv-tt/bin/python -m pytest tests/tt -m tt_hardware -v

Each test works in its own process with a clean environment (no ``TT_METAL_MOCK_CLUSTER_DESC_PATH``:
the mock-cluster tests in this folder set it for their session), so they can share one pytest run
with the mock tests. Packages are built with ``$TTBUNDLE_MAIN_PYTHON`` (or the checkout's
``.venv/bin/python``), which needs torch; the greedy comparison also imports torch in the ttnn
environment (a TT host usually has it; ``pip install torch`` there otherwise).

None of these has run yet: this repository's machines have no device.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ttbundle import mesh as meshmod

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.tt_hardware


def device_present() -> bool:
    return Path("/dev/tenstorrent").exists() and importlib.util.find_spec("ttnn") is not None


def clean_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TT_METAL_MOCK_CLUSTER_DESC_PATH"}
    env.setdefault("TT_METAL_CACHE", f"{tmp / 'cache'}/")
    env["PYTHONPATH"] = str(ROOT)
    return env


def run(code: str, tmp: Path, *args, timeout: int = 1800) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=tmp, env=clean_env(tmp),
                       capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads(line[7:])


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> str:
    if not device_present():
        pytest.skip("no Tenstorrent device here (/dev/tenstorrent and ttnn needed)")
    if os.environ.get("MESH_DEVICE"):
        return meshmod.resolve(os.environ["MESH_DEVICE"]).name
    got = run("import ttnn, json; d = ttnn.open_mesh_device(); "
              "print('RESULT ' + json.dumps([d.get_num_devices(), str(d.arch())])); ttnn.close_mesh_device(d)",
              tmp_path_factory.mktemp("probe"))
    n, arch = got
    names = {("WORMHOLE", 1): "N150", ("WORMHOLE", 2): "N300", ("WORMHOLE", 8): "T3K",
             ("BLACKHOLE", 1): "P150", ("BLACKHOLE", 2): "P300", ("BLACKHOLE", 4): "P150x4"}
    name = names.get(("BLACKHOLE" if "BLACKHOLE" in arch else "WORMHOLE", n))
    if name is None:
        pytest.skip(f"{n} {arch} devices: set MESH_DEVICE")
    return name


def test_dram_banks_and_trace_region_as_planned(mesh, tmp_path):
    """The device's DRAM banks and bytes per bank are the planner's chip facts, and a trace
    region costs what ``plan.memory.trace_region_dram`` charges (measured on the mock allocator)."""
    from ttbundle.plan.memory import trace_region_dram
    m = meshmod.resolve(mesh)
    got = run("""
import json, sys, ttnn
out = []
for tr in (0, 1 << 20, 50_000_000):
    d = ttnn.open_mesh_device(ttnn.MeshShape(*json.loads(sys.argv[1])), trace_region_size=tr)
    mv = ttnn.get_memory_view(d, ttnn.BufferType.DRAM)
    out.append([tr, mv.num_banks, mv.total_bytes_per_bank, mv.total_bytes_allocated_per_bank])
    ttnn.close_mesh_device(d)
print("RESULT " + json.dumps(out))
""", tmp_path, json.dumps(list(m.shape)))
    base = got[0]
    assert base[1] == m.chip.dram_banks and base[3] == 0
    assert base[2] == m.chip.dram_bank_bytes, "a real device reserves DRAM the mock does not: update mesh.py"
    for tr, banks, bank, _ in got[1:]:
        assert (base[2] - bank) * banks == trace_region_dram(tr, m)


def test_planner_vs_allocator_on_the_device(mesh, tmp_path):
    """The boundary cases of test_allocator_ttnn.py, on the real allocator."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_allocator_ttnn import CASES, boundary_plans

    from ttbundle.backends.ttnn import alloc
    bundles = [b for m, b in CASES if m == mesh] or ["llama-3.1-8b"]
    for bundle in bundles:
        plans = boundary_plans(bundle, mesh)
        (tmp_path / "cases.json").write_text(json.dumps([alloc.case(n, p) for n, p in plans]))
        r = subprocess.run([sys.executable, "-m", "ttbundle.backends.ttnn.alloc", str(tmp_path / "cases.json")],
                           cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=1800)
        got = {json.loads(ln[7:])["name"]: json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")}
        assert len(got) == len(plans), r.stdout[-3000:] + r.stderr[-3000:]
        for name, p in plans:
            assert got[name]["ok"] == p.fits, f"{bundle} {name}: plan free {p.memory.free}, allocator {got[name]}"


BUILD = r"""
import json, sys
from pathlib import Path
import torch
from ttbundle import build, reference, spec
out, mesh = Path(sys.argv[1]), sys.argv[2]
text = '''name: tiny
model: {family: llama, vocab_size: 512, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2,
        num_attention_heads: 8, num_key_value_heads: 8, max_position_embeddings: 512}
weights: {source: ckpt}
targets: [%s]
buckets: {prefill: [32, 64], decode: [1, 8], prefill_chunk: 64}
runtime: {max_model_len: 256, max_num_seqs: 8}
''' % mesh
arch = spec.loads(text.replace("weights: {source: ckpt}\n", ""), "a.yaml")
reference.random_model(arch, 0).to(torch.bfloat16).save_pretrained(str(out / "ckpt"), safe_serialization=True)
(out / "spec.yaml").write_text(text)
r = build.build(spec.load(out / "spec.yaml"), mesh, out / "packages", backend="ttnn")
print("RESULT " + json.dumps({"package": r.package}))
"""


@pytest.fixture(scope="module")
def package(mesh, tmp_path_factory) -> Path:
    py = os.environ.get("TTBUNDLE_MAIN_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(py).exists():
        pytest.skip("no environment with torch to build a package (TTBUNDLE_MAIN_PYTHON)")
    tmp = tmp_path_factory.mktemp("hwpkg")
    r = subprocess.run([py, "-c", BUILD, str(tmp), mesh], capture_output=True, text=True, timeout=1800,
                       env={**clean_env(tmp)})
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return Path(json.loads(line[7:])["package"])


def test_tensorbin_weights_read_back_from_the_device(package, tmp_path):
    got = run("""
import json, sys
import numpy as np
import ttnn
from ttbundle.backends.ttnn import cache
pkg = sys.argv[1]
idx = cache.read_index(pkg)
dev = ttnn.open_mesh_device(ttnn.MeshShape(*idx["mesh"]["shape"]))
bad = []
for key, t in cache.load_mesh_weights(ttnn, dev, pkg).items():
    back = ttnn.get_device_tensors(ttnn.from_device(t))
    for d, b in enumerate(back):
        want = ttnn.load_tensor(f"{pkg}/{cache.cache_file(idx['tensors'][key]['stored_in'][d], key)}")
        if b.dtype == ttnn.bfloat16:
            b, want = ttnn.to_dtype(b, ttnn.float32), ttnn.to_dtype(want, ttnn.float32)
        if not np.array_equal(b.to_numpy(), want.to_numpy()):
            bad.append(f"{key}@{d}")
ttnn.close_mesh_device(dev)
print("RESULT " + json.dumps(bad))
""", tmp_path, package)
    assert got == []


def test_greedy_tokens_match_the_emulated_backend(package, tmp_path):
    """Warm-up, capture, then a traced prefill and 8 traced decodes on the device, against the
    emulated mesh (torch) on the same package. Numerics differ (bf16 on device, float32 emulated),
    so: the first token equal, at least 6 of 8 equal, and a second run identical to the first."""
    got = run("""
import json, sys
import torch
import ttnn
from ttbundle.backends.emulated import EmulatedModel, Runner
from ttbundle.backends.ttnn import device, model as ttmodel
from ttbundle.package import load_package
pkg = load_package(sys.argv[1])
prompt = [(7 * j + 3) % 500 for j in range(40)]
runner = ttmodel.open_model(ttnn, pkg)
runner.warmup()
runner.capture()
bs = pkg.bundle.spec.runtime.kv_block_size
first = device.generate(runner, prompt, 8, bs)
again = device.generate(runner, prompt, 8, bs)
emu = EmulatedModel.from_package(pkg, dtype=torch.float32)
r = Runner(emu, num_blocks=16)
blocks = list(range(16))
ref = [int(r.prefill(prompt, blocks).argmax())]
for i in range(7):
    ref.append(int(r.decode([ref[-1]], [len(prompt) + i], [blocks])[0].argmax()))
print("RESULT " + json.dumps({"device": first, "again": again, "emulated": ref}))
""", tmp_path, package)
    dev, emu = got["device"], got["emulated"]
    assert got["again"] == dev, "trace replays are not deterministic"
    assert dev[0] == emu[0] and sum(a == b for a, b in zip(dev, emu)) >= 6, got


def test_kernel_cache_prefilled_by_the_build(package, tmp_path):
    """A build on a host with SFPI compiles every traced program into the package's
    ``kernel_cache/``; a serving process pointed at its runtime copy (as the worker points
    TT_METAL_CACHE) warms up and captures every forward without compiling: tt-metal writes a
    kernel into TT_METAL_CACHE on a miss, so the copy must hold the same files afterwards."""
    m = json.loads((package / "manifest.json").read_text())
    kc = m["artifacts"]["kernel_cache"]
    if not kc.get("filled"):
        pytest.skip(f"the build did not fill the kernel cache here: {kc.get('reason')}")
    got = run("""
import json, os, sys
from pathlib import Path
from ttbundle.backends.ttnn import kernelcache
pkg = sys.argv[1]
m = json.loads(Path(pkg, "manifest.json").read_text())
d = kernelcache.runtime_cache_dir(pkg, m, sys.argv[2])
os.environ["TT_METAL_CACHE"] = f"{d}/"
files = lambda: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
before = files()
import ttnn
from ttbundle.backends.ttnn import model as ttmodel
from ttbundle.package.load import load_package
runner = ttmodel.open_model(ttnn, load_package(pkg))
runner.warmup()
runner.capture()
print("RESULT " + json.dumps({"before": before, "after": files()}))
""", tmp_path, package, tmp_path / "xdg")
    assert got["before"] and got["after"] == got["before"], sorted(set(got["after"]) - set(got["before"]))[:20]

