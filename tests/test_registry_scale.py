"""The registry at scale (issue 15): verification results are cached by fingerprint (manifest
sha256, and mode/size/mtime/ctime/inode of every entry) and re-checked in full when anything
changes, so `ls` and a second `register` verify nothing that did not change, and a changed
package is caught even by `ls`; a name shared by several packages is told apart by mesh or path,
with the choices listed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ttbundle.errors import InvalidInput
from ttbundle.runtime import registry
from ttbundle.serving.demo import SMALL_SPEC, build_package, clone_package

N = 120


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("regsrc")
    return {m: build_package(SMALL_SPEC, d, m, warmup=False) for m in ("N150", "N300")}


@pytest.fixture
def many(sources, tmp_path):
    out = tmp_path / "out"
    for i in range(N):
        clone_package(sources["N150"], out / "N150" / f"reg-{i:04d}", f"reg-{i:04d}")
    return out


@pytest.fixture
def verifications(monkeypatch):
    """Package directories verified in full (``registry.entry_of``), in order."""
    seen = []
    real = registry.entry_of

    def counting(path, check_hashes=True):
        seen.append((Path(path).name, check_hashes))
        return real(path, check_hashes)
    monkeypatch.setattr(registry, "entry_of", counting)
    return seen


def _flip(p: Path) -> None:
    """One byte of ``p`` changed in place, size and mtime kept (only sha256 can tell)."""
    st = os.stat(p)
    with open(p, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 1]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_register_then_ls_verify_each_package_once(many, xdg, runner, verifications):
    from ttbundle.cli import app

    r = runner.invoke(app, ["register", "--dir", str(many)])
    assert r.exit_code == 0 and r.output.count("registered ") == N, r.output[-500:]
    assert len(verifications) == N and all(h for _, h in verifications)  # full: sha256 too
    verifications.clear()
    r = runner.invoke(app, ["ls", "--json"])
    assert r.exit_code == 0 and len(json.loads(r.output)["packages"]) == N
    r = runner.invoke(app, ["register", "--dir", str(many)])
    assert r.exit_code == 0 and r.output.count("registered ") == N
    assert verifications == []  # answered from the cache
    print(f"{N} packages: {N} full verifications at register, 0 at ls and a second register")


@pytest.mark.parametrize("change", ["flip-a-byte", "add-a-file", "replace-a-file", "new-manifest"])
def test_any_change_re_verifies_that_package_in_full(many, xdg, verifications, change):
    registry.register_dir(many)
    verifications.clear()
    pkg = many / "N150" / "reg-0007"
    if change == "flip-a-byte":
        _flip(pkg / "bundle.yaml")
    elif change == "add-a-file":
        (pkg / "programs" / "extra.json").write_text("{}")
    elif change == "replace-a-file":
        data = (pkg / "bundle.yaml").read_bytes()
        os.unlink(pkg / "bundle.yaml")
        (pkg / "bundle.yaml").write_bytes(data[:-2] + b"x\n")
    else:
        # the same manifest written anew (other bytes, same content: an unknown key would now be
        # refused, the manifest is read strictly)
        m = json.loads((pkg / "manifest.json").read_text())
        (pkg / "manifest.json").write_text(json.dumps(m, indent=3))
    good, bad = registry.scan(check_hashes=False)  # what `ls` does
    assert verifications == [("reg-0007", True)]  # only the changed one, hashes included
    if change == "new-manifest":  # a harmless manifest change: re-verified, still good
        assert len(good) == N and not bad
    else:
        assert len(good) == N - 1 and [p.name for p, _ in bad] == ["reg-0007"], bad


def test_a_stale_or_foreign_cache_is_not_trusted(many, xdg, verifications):
    registry.register_dir(many)
    doc = json.loads(registry.cache_file().read_text())
    doc["ttbundle"] = "0.0.0"
    registry.cache_file().write_text(json.dumps(doc))
    verifications.clear()
    registry.scan()
    assert len(verifications) == N
    registry.cache_file().write_text("{not json")
    verifications.clear()
    good, _ = registry.scan()
    assert len(verifications) == N and len(good) == N


def test_a_refusal_is_cached_and_re_checked_once_fixed(many, xdg, verifications):
    pkg = many / "N150" / "reg-0003"
    saved = (pkg / "config.json").read_bytes()
    os.unlink(pkg / "config.json")  # a hard link: change this package's copy only
    (pkg / "config.json").write_bytes(saved)
    _flip(pkg / "config.json")
    good, bad = registry.register_dir(many)
    assert [p.name for p, _ in bad] == ["reg-0003"] and "config.json: sha256 mismatch" in bad[0][1]
    verifications.clear()
    assert [p.name for p, _ in registry.scan()[1]] == ["reg-0003"] and verifications == []
    (pkg / "config.json").write_bytes(saved)
    good, bad = registry.scan()
    # verified again and whole, but refused at register it never was registered: register it
    assert verifications == [("reg-0003", True)] and len(good) == N - 1
    assert [p.name for p, _ in bad] == ["reg-0003"] and "not registered" in bad[0][1]
    good, bad = registry.register_dir(many)
    assert len(good) == N and not bad and len(registry.scan()[0]) == N


def test_a_shared_name_is_resolved_by_mesh_or_path_with_the_choices_listed(sources, xdg, tmp_path, runner):
    from ttbundle.cli import app
    from ttbundle.serving import serve as servemod

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        for m in ("N150", "N300"):
            clone_package(sources[m], d / m / "shared", "shared")
        registry.register_dir(d)
    with pytest.raises(InvalidInput) as ei:
        registry.find("shared")
    assert "names 4 packages" in ei.value.message and "--mesh" in ei.value.message
    assert {str(x) for x in ei.value.diagnostics} == {
        f"shared-{m}: {d / m / 'shared'}" for d in (a, b) for m in ("N150", "N300")}
    with pytest.raises(InvalidInput) as ei:
        registry.find("shared", mesh="N300")
    assert "names 2 packages; give the package's path" in ei.value.message
    assert [str(x) for x in ei.value.diagnostics] == [f"shared-N300: {a / 'N300' / 'shared'}",
                                                     f"shared-N300: {b / 'N300' / 'shared'}"]
    with pytest.raises(InvalidInput, match="no package for mesh T3K; it has: N150, N300"):
        registry.find("shared", mesh="T3K")
    assert registry.find(str(b / "N300" / "shared")).path == b / "N300" / "shared"
    shutil.rmtree(a / "N300")
    assert registry.find("shared", mesh="N300").path == b / "N300" / "shared"
    assert servemod.resolve("shared", mesh="N300") == b / "N300" / "shared"
    r = runner.invoke(app, ["serve", "shared", "--print-command"])
    assert r.exit_code == 2 and "names 3 packages" in r.output and str(b / "N150" / "shared") in r.output
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["serve", "shared", "--mesh", "N300", "--print-command"])
    assert r.exit_code == 0 and str(b / "N300" / "shared") in r.output, r.output
    r = runner.invoke(app, ["serve", "x" * 300])
    assert r.exit_code == 2 and "no registered package" in r.output


# ---- parallel registers (issue 43) ----------------------------------------------------------------
_REGISTER_AT_ONCE = """
import os, sys, time
from ttbundle.cli import app
go = sys.argv[1]
while not os.path.exists(go):  # a barrier: every process imported, then all register at once
    time.sleep(0.005)
app(["register", "--dir", sys.argv[2]])
"""


def test_parallel_registers_of_many_directories_lose_nothing(sources, xdg, tmp_path):
    """Registers of many directories started together each record their directory (and their
    packages' verification results): the registry is read, changed and rewritten under a lock.
    Without it, each process rewrote the list it had read and most directories were lost."""
    import subprocess
    import sys
    import time

    n = 12
    dirs = []
    for i in range(n):
        d = tmp_path / f"dir-{i:02d}"
        clone_package(sources["N150"], d / "N150" / f"par-{i:02d}", f"par-{i:02d}")
        dirs.append(d)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _REGISTER_AT_ONCE, str(go), str(d)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for d in dirs]
    time.sleep(0.5)
    go.write_text("")
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all("recorded in" in o and "Traceback" not in o for o in outs), outs
    recorded = json.loads(registry.registry_file().read_text())["dirs"]
    assert sorted(recorded) == sorted(str(d.resolve()) for d in dirs)
    cached = json.loads(registry.cache_file().read_text())["packages"]
    assert {Path(p).name for p in cached} == {f"par-{i:02d}" for i in range(n)}
    good, bad = registry.scan()
    assert sorted(e.name for e in good) == [f"par-{i:02d}" for i in range(n)] and not bad
