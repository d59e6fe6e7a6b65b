"""tt-metal's kernel cache (``TT_METAL_CACHE``) filled at build time, when a real SFPI exists.

ttnn compiles each op's kernels (RISC-V, with the SFPI toolchain) the first time the op runs
with a new configuration and keeps the binaries in ``TT_METAL_CACHE``; a warm cache turns a
server's first warm-up from minutes of compiling into loading. ``build --backend ttnn`` fills
one for every traced program of the package (``kernel_cache/`` in the package, listed in the
manifest with every file's sha256 like any other file) **when a real SFPI compiler is present**;
the runtime copies it to a writable place and points ``TT_METAL_CACHE`` there
(:func:`runtime_cache_dir`).

Where SFPI is looked for is where tt-metal looks: ``runtime/sfpi`` under ``TT_METAL_RUNTIME_ROOT``,
``TT_METAL_HOME`` or the ttnn package, then ``/opt/tenstorrent/sfpi``; the compiler is
``compiler/bin/riscv-tt-elf-g++``. A compiler counts only if it compiles: scripts/setup_tt.sh's
stub (it answers ``--version`` so a mock mesh opens, and compiles nothing) does not.

Filling runs every traced (phase, bucket) once through ttnn's own calls on the package's mesh
(real chips if present, else a mock cluster), in a Python that has ttnn (this one, or
``TTBUNDLE_TTNN_PYTHON``): ``python -m ttbundle.ttnnproc kernelcache DIR MESH SIZE`` (:data:`PROCESS`), ``DIR``
holding the package's programs and ``bundle.yaml`` as the build hands them over (``handover``):
nothing re-plans or re-lowers. Nothing of this has run here: no machine of this project has SFPI (docs/hardware.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ... import mockcluster
from ...errors import TTBundleError
from ...package.names import PackageError
from . import handover

CACHE_DIR = "kernel_cache"
COMPILERS = ("compiler/bin/riscv-tt-elf-g++", "compiler/bin/riscv32-tt-elf-g++")
SYSTEM_SFPI = Path("/opt/tenstorrent/sfpi")
PYTHON_ENV = "TTBUNDLE_TTNN_PYTHON"
_PROBE = "int ttbundle_probe(int x) { return x + 1; }\n"
#: the filling process's module and command (``ttbundle/ttnnproc.py``: it loads the handed-over
#: bundle.yaml, which no backend does, and runs the programs)
PROCESS = ("ttbundle.ttnnproc", "kernelcache")


@dataclass
class Sfpi:
    """What was found: ``found`` only for a compiler that compiled a probe."""

    found: bool
    path: str | None = None
    version: str | None = None
    reason: str = ""
    looked: list[str] = field(default_factory=list)

    def key(self) -> str:
        """The key field a ttnn build records: the compiler's version, or ``none``."""
        return f"sfpi {self.version}" if self.found else "none"


def candidates(ttnn_dir: str | Path | None, env: dict | None = None) -> list[Path]:
    """SFPI directories in tt-metal's order of preference."""
    env = os.environ if env is None else env
    roots = [env.get("TT_METAL_RUNTIME_ROOT"), env.get("TT_METAL_HOME"), ttnn_dir]
    out = [Path(r) / "runtime" / "sfpi" for r in roots if r]
    out.append(SYSTEM_SFPI)
    return list(dict.fromkeys(out))


def compiles(gxx: Path, run=subprocess.run) -> bool:
    """Does ``gxx`` compile a one-line C++ file into a non-empty object file?"""
    with tempfile.TemporaryDirectory(prefix="ttbundle-sfpi-") as d:
        src, obj = Path(d) / "probe.cpp", Path(d) / "probe.o"
        src.write_text(_PROBE)
        try:
            r = run([str(gxx), "-c", str(src), "-o", str(obj)], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return r.returncode == 0 and obj.is_file() and obj.stat().st_size > 0


def detect(dirs: list[Path], run=subprocess.run) -> Sfpi:
    """The first directory of ``dirs`` holding a compiler that compiles."""
    notes, looked = [], [str(d) for d in dirs]
    for d in dirs:
        for rel in COMPILERS:
            gxx = d / rel
            if not (gxx.is_file() and os.access(gxx, os.X_OK)):
                continue
            try:
                v = run([str(gxx), "--version"], capture_output=True, text=True, timeout=30)
                version = (v.stdout or "").splitlines()[0].strip() if v.returncode == 0 and v.stdout else None
            except (OSError, subprocess.TimeoutExpired):
                version = None
            if version is None:
                notes.append(f"{gxx} does not answer --version")
            elif not compiles(gxx, run):
                notes.append(f"{gxx} answers --version but compiles nothing (a stub, such as "
                             "scripts/setup_tt.sh's for mock meshes)")
            else:
                return Sfpi(True, str(d), version, "", looked)
    why = "; ".join(notes) if notes else "no SFPI compiler in " + ", ".join(looked)
    return Sfpi(False, None, None, why, looked)


def ttnn_python(env: dict | None = None) -> str | None:
    """A Python with ttnn: ``TTBUNDLE_TTNN_PYTHON``, else this one if ttnn is importable."""
    env = os.environ if env is None else env
    if env.get(PYTHON_ENV):
        return env[PYTHON_ENV]
    return sys.executable if importlib.util.find_spec("ttnn") is not None else None


def ttnn_dir(python: str) -> str | None:
    """Where ``python``'s ttnn package is (found, not imported)."""
    code = ("import importlib.util as u; s = u.find_spec('ttnn'); "
            "print(list(s.submodule_search_locations)[0] if s else '')")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = r.stdout.strip()
    return out if r.returncode == 0 and out else None


def status(env: dict | None = None) -> tuple[Sfpi, str | None]:
    """(SFPI, the Python with ttnn that would fill the cache) on this host."""
    py = ttnn_python(env)
    if py is None:
        return Sfpi(False, reason=f"no Python with ttnn (this one has none; set {PYTHON_ENV})"), None
    root = ttnn_dir(py)
    if root is None:
        return Sfpi(False, reason=f"{py} cannot import ttnn"), None
    return detect(candidates(root, env)), py


def digest_files(root: Path, prefix: str = CACHE_DIR) -> dict[str, dict]:
    """``{relpath: {sha256, size}}`` of every file under ``root`` (manifest records)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h = hashlib.sha256(p.read_bytes()).hexdigest()
            out[f"{prefix}/{p.relative_to(root).as_posix()}"] = {"sha256": h, "size": p.stat().st_size}
    return out


def fill(python: str, bundle_yaml: str, programs: dict, mesh_name: str, trace_region_size: int, dest: Path,
         emit=lambda e: None) -> dict:
    """Run every program of ``programs`` ((phase, bucket) -> ``program.Program``, the package's)
    on ``mesh_name`` with ``TT_METAL_CACHE=dest/`` (a mock cluster of the mesh unless chips are
    present), the mesh opened with ``trace_region_size``; the files written, as manifest records.
    The programs and the package's ``bundle.yaml`` are handed over in a directory
    (``handover.write``): the filling process lowers nothing."""
    dest = Path(dest).absolute()
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ttbundle-kc-") as work:
        env = dict(os.environ) if Path("/dev/tenstorrent").exists() else mockcluster.mock_env(mesh_name, work)
        env["TT_METAL_CACHE"] = f"{dest}/"
        handed = handover.write(Path(work) / "programs-in", bundle_yaml, programs)
        emit({"event": "phase", "phase": "kernel_cache", "total": 1, "unit": "runs"})
        r = subprocess.run([python, "-m", *PROCESS, str(handed), mesh_name,
                            str(int(trace_region_size or 0))], cwd=work, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise TTBundleError(f"filling the kernel cache failed: {(r.stderr or r.stdout)[-2000:]}")
    return digest_files(dest)


def record(sfpi: Sfpi, files: dict | None) -> dict:
    """The manifest's ``kernel_cache`` artifact (without its key)."""
    rec = {"filled": bool(sfpi.found and files), "sfpi": sfpi.version, "files": sorted(files or {})}
    if not rec["filled"]:
        rec["reason"] = sfpi.reason or "the fill wrote no files"
    return rec


def runtime_cache_dir(package_dir: str | Path, manifest: dict, base: str | Path | None = None) -> Path | None:
    """A writable copy of the package's kernel cache (tt-metal adds to it on a miss, and the package
    must stay as its manifest says), one per package content key; None when the build did not fill
    one. The copy is checked complete before use: every file the package lists, with the
    manifest's sha256, and nothing else. A copy that differs (a file a run wrote on a miss, a
    placeholder, a truncated copy) is replaced by a fresh copy, checked the same way: nothing a
    miss wrote outlives the run that wrote it. A manifest without a content key is refused (no
    two packages share one directory)."""
    art = manifest.get("artifacts", {}).get("kernel_cache", {})
    if not art.get("filled"):
        return None
    if not manifest.get("key"):
        raise PackageError(f"{package_dir}: manifest has no content key; its kernel cache would share a "
                           "directory with other packages; rebuild the package")
    want = {rel[len(CACHE_DIR) + 1:]: manifest["files"][rel]["sha256"] for rel in art.get("files", [])}
    base = Path(base or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ttbundle" / "tt-metal-cache"
    dst = base / str(manifest["key"])
    if dst.is_dir() and _holds(dst, want):
        return dst
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for rel in want:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(package_dir) / CACHE_DIR / rel, tmp / rel)
    if not _holds(tmp, want):
        shutil.rmtree(tmp, ignore_errors=True)
        raise PackageError(f"{package_dir}: {CACHE_DIR}/ does not hold the files its manifest lists with their "
                           "sha256; rebuild the package")
    if dst.is_dir():
        old = dst.with_name(dst.name + f".old{os.getpid()}")
        dst.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(dst)
    return dst


def _holds(root: Path, want: dict[str, str]) -> bool:
    """``root`` holds exactly the files of ``want`` (relative path -> sha256), each with its digest."""
    have = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}
    if have != set(want):
        return False
    return all(hashlib.sha256((root / rel).read_bytes()).hexdigest() == sha for rel, sha in want.items())


__all__ = ["CACHE_DIR", "Sfpi", "candidates", "compiles", "detect", "digest_files", "fill", "record",
           "runtime_cache_dir", "status", "ttnn_python"]
