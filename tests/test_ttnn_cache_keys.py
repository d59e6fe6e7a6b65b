"""Weight and kernel caches whose keys cannot collide (issue 41, item 3), as three public ttnn
failures reproduced on ttbundle's own caches, each refused before anything loads:

* tt-metal #52176: a Wormhole and a Blackhole 4x8 (here 8x4: TG and BH-Galaxy) mesh shared one
  weight cache key, and gpt-oss-120b printed garbage;
* tt-metal PR #55795: cache files renamed under an unchanged key (every token ``<pad>``);
* tt-metal PR #50550's review: a ``torch.empty`` placeholder persisted on a miss and read back
  later as if it were the weights.

Each test builds real tiny packages (`build --backend ttnn`) and opens them with
``backends/ttnn/model.open_model`` on the recording double (no device is needed for what is
refused: it is refused before the mesh is touched).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from test_build import ckpt, spec_text  # noqa: F401  (ckpt: the shared checkpoint fixture)
from ttbundle import build as buildmod, spec as specmod, tensorbin
from ttbundle.backends.ttnn import cache, kernelcache, model as ttmodel, recording
from ttbundle.package.load import load_package
from ttbundle.package.names import PackageError


def build(tmp: Path, ckpt: Path, mesh: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    spec = tmp / "spec.yaml"
    text = spec_text(ckpt).replace("targets: [N150, T3K, TG]", "targets: [N150, N300, T3K, TG, BH-Galaxy]")
    spec.write_text(text)
    return Path(buildmod.build(specmod.load(spec), mesh, tmp / "out", backend="ttnn", warmup=False).package)


def open_on_double(pkg: Path):
    rec = recording.Recorder(unknown_reads="zeros")
    pk = pkg if hasattr(pkg, "program_ir") else load_package(pkg)  # a directory, or a package loaded
    return ttmodel.open_model(rec.module(), pk, "all", host_fallback=True), rec


def test_a_wormhole_cache_is_refused_on_a_blackhole_mesh_of_the_same_shape(tmp_path, ckpt):
    """#52176: TG (Wormhole 8x4) and BH-Galaxy (Blackhole 8x4) have one mesh shape. Their caches'
    keys and identities differ by chip architecture, and the Wormhole package opened on a
    Blackhole 8x4 mesh is refused by the architecture the mesh reports (``MeshDevice.arch()``),
    before any weight loads. (Before: only the mesh shape was compared, and it loaded.)"""
    wh = build(tmp_path / "wh", ckpt, "TG")
    bh = build(tmp_path / "bh", ckpt, "BH-Galaxy")
    mw, mb = (json.loads((p / "manifest.json").read_text()) for p in (wh, bh))
    assert mw["mesh"]["shape"] == mb["mesh"]["shape"] == [8, 4]
    assert mw["artifacts"]["tensorbin"]["key"] != mb["artifacts"]["tensorbin"]["key"]

    class Arch:  # what ttnn 0.81.1's MeshDevice.arch() returns: ttnn.device.Arch.<NAME>
        def __init__(self, name):
            self.name = name

    def opened_on(pkg, arch):
        rec = recording.Recorder(unknown_reads="zeros")
        tt = rec.module()
        dev = tt.open_mesh_device(tt.MeshShape(8, 4))
        dev.arch = lambda: Arch(arch)
        ttmodel.open_model(tt, load_package(pkg), "all", dev, host_fallback=True)
        return rec

    opened_on(wh, "WORMHOLE_B0")
    opened_on(bh, "BLACKHOLE")
    rec = None
    with pytest.raises(PackageError, match=r"caches and programs for wormhole_b0 chips, the mesh opened has "
                                           r"blackhole chips"):
        rec = opened_on(wh, "BLACKHOLE")
    assert rec is None
    assert (cache.read_index(wh)["identity"]["arch"], cache.read_index(bh)["identity"]["arch"]) \
        == ("wormhole_b0", "blackhole")


def test_renamed_cache_files_under_an_unchanged_key_are_refused(tmp_path, ckpt):
    """PR #55795: the files are renamed, the key and the index are not. Two shards of one shape
    and dtype (layers 0 and 1 of ``wq``) swapped by name (same sizes: before, the manifest's size
    check passed and each layer loaded the other's weights), and a file under a new name beside or
    instead of the old one (the manifest's file list already refused those): each is refused
    naming the file, before any file loads."""
    pkg = build(tmp_path, ckpt, "N300")
    a, b = pkg / cache.cache_file(0, "wq.0"), pkg / cache.cache_file(0, "wq.1")
    assert tensorbin.read_header(a).shape == tensorbin.read_header(b).shape  # a swap nothing else notices
    key_before = json.loads((pkg / "manifest.json").read_text())["artifacts"]["tensorbin"]["key"]
    tmp = a.with_suffix(".tmp")
    a.rename(tmp), b.rename(a), tmp.rename(b)
    with pytest.raises(PackageError, match=r"device-000/wq\.0\.tensorbin: sha256 .*not the file the build wrote"):
        open_on_double(pkg)
    with pytest.raises(PackageError, match=r"device-000/wq\.[01]\.tensorbin: sha256 mismatch"):
        open_on_double(load_package(pkg, verify=True))  # serve's way: the manifest's sha256, read once
    b.rename(tmp), a.rename(b), tmp.rename(a)  # back as built: loads
    open_on_double(pkg)
    open_on_double(load_package(pkg, verify=True))  # verified in full: the index is not hashed again
    idx = json.loads((pkg / cache.INDEX).read_text())
    assert idx["files"][cache.cache_file(0, "wq.0")] == json.loads((pkg / "manifest.json").read_text())["files"][
        cache.cache_file(0, "wq.0")]
    shutil.copy(a, a.with_name("wq.layer0.tensorbin"))  # a new naming scheme beside the old, same key
    assert json.loads((pkg / "manifest.json").read_text())["artifacts"]["tensorbin"]["key"] == key_before
    with pytest.raises(PackageError, match=r"wq\.layer0\.tensorbin: not (in the manifest|a file of this cache's index)"):
        open_on_double(pkg)
    a.unlink()  # only the new name left
    with pytest.raises(PackageError, match=r"device-000/wq\.0\.tensorbin: missing"):
        open_on_double(pkg)


def test_a_placeholder_written_on_a_miss_is_never_read_as_weights(tmp_path, ckpt):
    """PR #50550: a miss wrote an uninitialised tensor of the right shape (``torch.empty``) under
    the cache's name, and the next start read it as the weights. A placeholder with a valid
    header, shape, dtype and size is refused by its digest (before: the manifest's size check
    passed and zeros loaded as weights); a truncated file by its size. The
    kernel cache tt-metal writes into at run time (its runtime copy) keeps nothing a run wrote on
    a miss: the next start gets the package's files only."""
    pkg = build(tmp_path, ckpt, "N300")
    f = pkg / cache.cache_file(1, "wq.0")
    good = f.read_bytes()
    h, data = tensorbin.read_shard(f)
    head = tensorbin.header_bytes(h.shape, h.dtype, h.layout, len(data))
    f.write_bytes(struct.pack("<Q", len(head)) + head + bytes(len(data)))  # zeros where weights were
    assert tensorbin.read_header(f).shape == h.shape and f.stat().st_size == len(good)
    with pytest.raises(PackageError, match=r"device-001/wq\.0\.tensorbin: sha256"):
        open_on_double(pkg)
    f.write_bytes(good[:-64])
    with pytest.raises(PackageError, match=r"device-001/wq\.0\.tensorbin: (size \d+ B, manifest says|\d+ bytes, the index says)"):
        open_on_double(pkg)
    f.write_bytes(good)
    open_on_double(pkg)
    assert f.read_bytes() == good  # loading wrote nothing

    # the kernel cache's runtime copy: a file a run added on a miss, and one it overwrote, are gone
    kc = pkg / kernelcache.CACHE_DIR
    (kc / "kernels" / "k" / "1").mkdir(parents=True)
    (kc / "kernels" / "k" / "1" / "trisc0.elf").write_bytes(b"\x7fELF" + bytes(60))
    m = json.loads((pkg / "manifest.json").read_text())
    m["artifacts"]["kernel_cache"] = {"filled": True, "files": ["kernel_cache/kernels/k/1/trisc0.elf"]}
    m["files"].update(kernelcache.digest_files(kc))
    d = kernelcache.runtime_cache_dir(pkg, m, tmp_path / "xdg")
    (d / "kernels" / "k" / "1" / "trisc0.elf").write_bytes(bytes(64))  # a placeholder written on a miss
    (d / "kernels" / "miss" / "9").mkdir(parents=True)
    (d / "kernels" / "miss" / "9" / "trisc0.elf").write_bytes(bytes(64))
    d2 = kernelcache.runtime_cache_dir(pkg, m, tmp_path / "xdg")
    assert sorted(p.relative_to(d2).as_posix() for p in d2.rglob("*") if p.is_file()) == ["kernels/k/1/trisc0.elf"]
    assert (d2 / "kernels" / "k" / "1" / "trisc0.elf").read_bytes()[:4] == b"\x7fELF"
    m.pop("key", None)
    with pytest.raises(PackageError, match="no content key"):  # never one shared 'unkeyed' directory
        kernelcache.runtime_cache_dir(pkg, m, tmp_path / "xdg")
