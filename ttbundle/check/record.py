"""Check records: the evidence a package ships with (docs/check.md, "Records").

``ttbundle check PACKAGE_DIR`` writes ``checks/<dtype>.json`` inside the package (``fp32`` or
``bf16``: the compute dtype checked), outside its manifest (``package.names.CHECKS_DIR``), so
recording a check changes no hash; the record names the manifest's sha256, and a record whose
manifest changed since (a rebuild) no longer counts. Field names follow tt-transformers'
``support.json`` (schema v1) where they fit: ``hardware[]`` of ``{sku, mesh, tp, dp}``,
``validation{date, git_sha, evidence}``; the figures are ``check --json``'s two verdicts.
``ttbundle ls`` shows the latest record's verdict; ``serve --require-checked`` refuses a package
without a passing record for its mesh."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
from pathlib import Path
from .. import __version__, cache
from ..manifest import MANIFEST
from ..package.load import load_package
from ..package.names import CHECKS_DIR, CHECK_RECORD_BYTES
from ..reference import _safetensors_files

SCHEMA = "ttbundle.check-record/1"


def manifest_digest(pkg_dir) -> str:
    """The sha256 of the package's ``manifest.json``: what a record is bound to."""
    return hashlib.sha256((Path(pkg_dir) / MANIFEST).read_bytes()).hexdigest()


def checkpoint_key(reference_dir) -> dict:
    """The checkpoint a check compared with: its directory and a content key (BLAKE3 over its
    safetensors files' own BLAKE3 digests, in name order; ``cache.source_records`` reuses a
    digest while size, mtime and inode match)."""
    import blake3

    d = Path(reference_dir)
    files = _safetensors_files(d)
    recs = cache.source_records(files, None, d)
    cache.fill_digests(recs)
    h = blake3.blake3()
    for r in sorted(recs, key=lambda r: r["name"]):
        h.update(f"{r['name']}\0{r['blake3']}\0".encode())
    rev = d.name if d.parent.name == "snapshots" else None
    hf_id = d.parent.parent.name.removeprefix("models--").replace("--", "/") if rev else None
    return {"dir": str(d.absolute()), "content_key": h.hexdigest(), "hf_id": hf_id, "revision": rev}


def _git_sha() -> str | None:
    """ttbundle's own commit where it runs from a git checkout (else None)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def make_record(report, pkg_dir, reference_dir) -> dict:
    """The record of ``report`` (a :class:`~ttbundle.check.CheckReport` of the package in
    ``pkg_dir`` against ``reference_dir``)."""
    import torch
    import transformers

    pkg = load_package(pkg_dir, verify=False)
    m = pkg.mesh
    ex, q = report.executor, report.quality
    return {
        "schema": SCHEMA, "name": report.bundle, "passed": report.passed, "failure": report.failure(),
        "manifest_sha256": manifest_digest(pkg_dir),
        "model": {"checkpoint": checkpoint_key(reference_dir), "hf_model": pkg.bundle.spec.hf_model},
        "hardware": [{"sku": m.name, "mesh": list(m.shape), "tp": m.num_devices, "dp": 1}],
        "dtypes": {"compute": report.dtype, **report.storage},
        "software": {"ttbundle": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "validation": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_sha": _git_sha(),
            "evidence": {"executor": {"passed": ex.passed, "failure": ex.failure(report.step_of),
                                      "bound": ex.bound, "worst_stage_error": max((s.err for s in ex.stages), default=None),
                                      "decisive_positions": len(ex.decisive), "compared": len(ex.margins)},
                         "quality": q.to_json(), "prompt_len": report.prompt_len, "steps": report.steps},
        },
    }


def write_record(pkg_dir, record: dict) -> Path:
    """``checks/<compute dtype>.json`` in the package, written to a temporary name and renamed."""
    d = Path(pkg_dir) / CHECKS_DIR
    d.mkdir(exist_ok=True)
    path = d / f"{record['dtypes']['compute']}.json"
    tmp = d / f".{path.name}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def records(pkg_dir) -> list[dict]:
    """The package's check records that are bound to its current manifest (newest first); a
    record of another manifest (the package was rebuilt since) or unreadable is left out."""
    d = Path(pkg_dir) / CHECKS_DIR
    if not d.is_dir():
        return []
    try:
        digest = manifest_digest(pkg_dir)
    except OSError:
        return []
    out = []
    for p in sorted(d.glob("*.json")):
        try:
            if p.is_symlink() or p.stat().st_size > CHECK_RECORD_BYTES:
                continue
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(r, dict) and r.get("schema") == SCHEMA and r.get("manifest_sha256") == digest:
            out.append(r)
    return sorted(out, key=lambda r: str(r.get("validation", {}).get("date", "")), reverse=True)


def passing(pkg_dir, mesh: str) -> dict | None:
    """The newest passing record of the package for ``mesh`` (its manifest unchanged), or None."""
    for r in records(pkg_dir):
        if r.get("passed") is True and any(h.get("sku") == mesh for h in r.get("hardware", [])):
            return r
    return None


def summary(pkg_dir) -> str:
    """One line for ``ttbundle ls``: the newest record's verdict, or that there is none."""
    rs = records(pkg_dir)
    if not rs:
        return "not checked"
    r = rs[0]
    q = r["validation"]["evidence"]["quality"]
    qual = f", top-1 {q['top1']:.2f}" if q.get("judged") else ""
    return (f"{'passed' if r['passed'] else 'failed'} ({r['dtypes']['compute']}"
            f"{qual}, {r['validation']['date'][:10]})")
