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


def _tensor_bytes(raw: bytes):
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    info = json.loads(header["__metadata__"]["ttbundle"])["tensors"]
    return n, header, info


def edit_tensor(pkg: Path, key: str, fn) -> int:
    """Apply ``fn(tensor, device) -> tensor`` to every stored shard of ``key`` (the device's
    ``[..., in, out]`` values, block floats decoded), store it back in the shard's own encoding
    (bf16, or re-encoded tiles) and re-hash; returns how many files changed. The package still
    verifies: only numbers can tell."""
    import torch

    from ttbundle import blockfloat
    from ttbundle.package.names import weight_file
    from ttbundle.package.shards import _decode

    changed, d = 0, 0
    while (pkg / weight_file(d)).exists():
        rel = weight_file(d)
        raw = bytearray((pkg / rel).read_bytes())
        n, header, info = _tensor_bytes(bytes(raw))
        if key in header:
            a, z = header[key]["data_offsets"]
            meta = info[key]
            enc = meta.get("encoding", "bf16")
            data = bytes(raw[8 + n + a:8 + n + z])
            if enc == "bf16":
                t = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).reshape(header[key]["shape"])
                t = _decode(t, meta).float()
            else:
                t = blockfloat.decode(data, meta["shape"], enc)
            new = fn(t.clone(), d)
            if enc == "bf16":
                s = new.transpose(-1, -2) if meta.get("transposed") else new
                out = s.contiguous().to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
            else:
                out = blockfloat.encode(new.contiguous(), enc)
            assert len(out) == z - a
            raw[8 + n + a:8 + n + z] = out
            (pkg / rel).write_bytes(bytes(raw))
            rehash(pkg, rel)
            changed += 1
        d += 1
    return changed


def swap_tensors(pkg: Path, key_a: str, key_b: str) -> None:
    """Swap the stored bytes of two same-shaped tensors (two layers' weights) in every device
    file, re-hashed."""
    from ttbundle.package.names import weight_file

    d = 0
    while (pkg / weight_file(d)).exists():
        rel = weight_file(d)
        raw = bytearray((pkg / rel).read_bytes())
        n, header, _ = _tensor_bytes(bytes(raw))
        if key_a in header and key_b in header:
            (a0, a1), (b0, b1) = header[key_a]["data_offsets"], header[key_b]["data_offsets"]
            assert a1 - a0 == b1 - b0
            A, B = bytes(raw[8 + n + a0:8 + n + a1]), bytes(raw[8 + n + b0:8 + n + b1])
            raw[8 + n + a0:8 + n + a1], raw[8 + n + b0:8 + n + b1] = B, A
            (pkg / rel).write_bytes(bytes(raw))
            rehash(pkg, rel)
        d += 1
