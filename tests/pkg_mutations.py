"""Mutations of a built package that keep its manifest valid (every changed file re-hashed), so
only numerics can catch them: what ``ttbundle check PACKAGE`` must fail on."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def rehash(pkg: Path, rel: str) -> None:
    """Record ``rel``'s new size and sha256 in the package's manifest."""
    m_path = pkg / "manifest.json"
    m = json.loads(m_path.read_text())
    data = (pkg / rel).read_bytes()
    entry = m["files"][rel]
    entry["sha256"] = hashlib.sha256(data).hexdigest()
    entry["size"] = len(data)
    m_path.write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")


def edit_programs(pkg: Path, layer_kind: str, edit) -> int:
    """Apply ``edit(steps) -> steps`` to the steps of layer program ``layer_kind`` in every
    program of the package; returns how many programs changed."""
    changed = 0
    for p in sorted((pkg / "programs").glob("*.json")):
        prog = json.loads(p.read_text())
        for lp in prog["layers"]:
            if lp["kind"] == layer_kind:
                new = edit(list(lp["steps"]))
                if new != lp["steps"]:
                    lp["steps"] = new
                    changed += 1
        p.write_text(json.dumps(prog, sort_keys=True, indent=1) + "\n")
        rehash(pkg, f"programs/{p.name}")
    return changed


def drop_first(predicate):
    """An ``edit`` that deletes the first step matching ``predicate`` (a JSON step dict)."""
    def edit(steps):
        for i, s in enumerate(steps):
            if predicate(s):
                return steps[:i] + steps[i + 1:]
        raise AssertionError("no step matched")
    return edit


def storing_file(pkg: Path, dev: int, tensor_key: str) -> str:
    """The weights file that stores device ``dev``'s shard of ``tensor_key``: its own, or the
    one its header's ``stored_in`` names (a shard several devices hold is stored once)."""
    from ttbundle.package.names import weight_file
    from ttbundle.package.templates import render_bundle_yaml
    raw = (pkg / weight_file(dev)).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    info = json.loads(json.loads(raw[8:8 + n])["__metadata__"]["ttbundle"])["tensors"][tensor_key]
    return weight_file(info.get("stored_in", [dev] * (dev + 1))[dev])


def flip_byte(pkg: Path, rel: str, tensor_key: str, offset: int = 0) -> None:
    """Flip the bits of one byte inside tensor ``tensor_key`` of safetensors file ``rel``."""
    path = pkg / rel
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    start, end = header[tensor_key]["data_offsets"]
    pos = 8 + n + start + offset
    assert pos < 8 + n + end
    raw[pos] ^= 0xFF
    path.write_bytes(bytes(raw))
    rehash(pkg, rel)


def edit_program_json(pkg: Path, edit) -> int:
    """Apply ``edit(program dict)`` (in place) to every program of the package, each re-hashed;
    returns how many programs changed."""
    changed = 0
    for p in sorted((pkg / "programs").glob("*.json")):
        prog = json.loads(p.read_text())
        before = json.dumps(prog, sort_keys=True)
        edit(prog)
        if json.dumps(prog, sort_keys=True) != before:
            changed += 1
            p.write_text(json.dumps(prog, sort_keys=True, indent=1) + "\n")
            rehash(pkg, f"programs/{p.name}")
    return changed


def edit_json(pkg: Path, rel: str, edit) -> None:
    """Apply ``edit(doc)`` (in place) to JSON file ``rel`` of the package, re-hashed."""
    doc = json.loads((pkg / rel).read_text())
    edit(doc)
    (pkg / rel).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    rehash(pkg, rel)


def edit_bundle_yaml(pkg: Path, edit) -> None:
    """Apply ``edit(resolved spec dict)`` (in place) to the package's bundle.yaml, written back
    the way ``build`` writes it (``package.render_bundle_yaml``), re-hashed."""
    import yaml

    from ttbundle import __version__
    from ttbundle.package.names import weight_file
    from ttbundle.package.templates import render_bundle_yaml
    d = yaml.safe_load((pkg / "bundle.yaml").read_text())
    edit(d)
    (pkg / "bundle.yaml").write_text(render_bundle_yaml(d, __version__))
    rehash(pkg, "bundle.yaml")
