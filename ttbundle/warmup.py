"""Warm-up with a reference: each program run on a fixed input, its output recorded at build and
compared wherever the package is run again.

At build (``_warm``) each (phase, bucket) runs on the emulated backend from the package's own
weights, once per compute dtype the runtime may use (float32, bfloat16), on a fixed input:

- prefill ``B``: one sequence of ``B`` tokens ``(7 j + 1) mod vocab`` at positions ``0..B-1``;
  rows recorded: up to :data:`PREFILL_ROWS` positions evenly spaced, the last one included;
- decode ``B``: a full batch of ``B`` rows, row ``i`` token ``(13 i + 5) mod vocab`` at position
  ``i`` in its own blocks of a fresh (zero) KV cache, so attention mixes ``i + 1`` positions and
  the query/key weights matter; every row recorded.

Per row the reference holds the argmax token id, its margin over the runner-up, the row's mean,
rms and max, and :data:`SAMPLE` logits at fixed vocab ids; it is written to
``warmup/<phase>-<bucket>.json`` (listed, with its sha256, in the manifest) together with the
sha256 of the program file it was recorded with.

:func:`check_model` (serving start, the emulated runtime's warm-up) and :func:`verify_package`
(``ttbundle cache verify``) run the same input and compare; a mismatch raises
:class:`~ttbundle.errors.WarmupMismatch` naming the program, the row and expected vs got.

Tolerance, relative to the row's logit rms (:data:`RTOL`). float32: 1e-4. The same code on the
same weights and input is deterministic up to reduction order (torch's thread count, the CPU's
vector width), which moves float32 logits by at most ~1e-6 of their rms (rerunning with 1 thread
instead of all gives 0 here; ``tests/test_warmup.py`` asserts <= 1e-5); 1e-4 leaves 100x headroom
and still catches one weight changed by one bf16 ulp (measured 1.2e-4) and anything larger (one
element doubled: 7e-3; one output row negated: 0.24). bfloat16: 5e-2. bf16 logits of a model are
chaotic at the 1e-2 level: one weight changed by one bf16 ulp moves them by 1.7% of rms (a
rounding flip early on cascades), and so can another CPU's bf16 kernels (another accumulation
order) at serving; 5e-2 is 3x that floor and still catches a negated row (0.24), a zeroed tensor
(1.4) or a flipped exponent bit (3.7). An argmax may differ only where the reference's top-2
margin is within twice the tolerance (a near tie). ``cache verify`` checks float32, the serving
warm-up checks the dtype it serves in.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from . import lower as lowermod
from .errors import WarmupMismatch
from .plan import Plan

Progress = Callable[[dict], None]

FORMAT = "ttbundle.warmup/1"
DIR = "warmup"
DTYPES = ("float32", "bfloat16")  # the emulated runtime's compute dtypes (runtime/model_runner.py)
RTOL = {"float32": 1e-4, "bfloat16": 5e-2}
SAMPLE = 16  # logits recorded per row, at fixed vocab ids
PREFILL_ROWS = 16  # positions of a prefill recorded


def reference_file(name: str) -> str:
    return f"{DIR}/{name}.json"


def _torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def fixed_input(bundle, phase: str, b: int) -> dict:
    """The fixed input of program (phase, b): tensors for ``EmulatedModel.forward``, the KV
    blocks it needs, and the rows (as ``(n, t)`` index pairs with labels) recorded."""
    import torch

    vocab = bundle.arch.vocab_size
    bs = bundle.spec.runtime.kv_block_size
    if phase == "prefill":
        nblk = -(-b // bs)
        tokens = torch.tensor([[(7 * j + 1) % vocab for j in range(b)]])
        positions = torch.arange(b)[None, :]
        page_table = torch.arange(nblk)[None, :]
        n = min(PREFILL_ROWS, b)
        ts = sorted({round(k * (b - 1) / max(1, n - 1)) for k in range(n)})
        rows = [((0, t), f"position {t}") for t in ts]
    else:
        k = -(-b // bs)  # blocks per row: positions 0..b-1
        nblk = b * k
        tokens = torch.tensor([[(13 * i + 5) % vocab] for i in range(b)])
        positions = torch.arange(b)[:, None]
        page_table = torch.arange(nblk).reshape(b, k)
        rows = [((i, 0), f"row {i}") for i in range(b)]
    valid = torch.ones(tokens.shape, dtype=torch.bool)
    return {"tokens": tokens, "positions": positions, "valid": valid, "page_table": page_table,
            "num_blocks": nblk, "block_size": bs, "rows": rows}


def run(model, bundle, phase: str, b: int):
    """The recorded rows' logits [rows, vocab] (float32) of ``model`` on the fixed input."""
    import torch

    if phase == "vision":  # the vision encoder on b fixed images: some soft-token rows recorded
        inputs = bundle.family.vision_part(bundle.arch).warmup_inputs(bundle.arch.vision, bundle.vision, b)
        with torch.no_grad():
            out = model.encode_images(inputs["pixel_values"], inputs.get("image_grid_thw"))
        k = min(PREFILL_ROWS, out.shape[0])
        ts = sorted({round(j * (out.shape[0] - 1) / max(1, k - 1)) for j in range(k)})
        return out[ts].float(), [f"soft token {t}" for t in ts]
    x = fixed_input(bundle, phase, b)
    kv = model.allocate_kv_cache(x["num_blocks"], x["block_size"])
    with torch.no_grad():
        out = model.forward(model.program(phase, b), x["tokens"], x["positions"], x["valid"],
                            x["page_table"], kv)
    idx_n = torch.tensor([r[0][0] for r in x["rows"]])
    idx_t = torch.tensor([r[0][1] for r in x["rows"]])
    return out[idx_n, idx_t].float(), [r[1] for r in x["rows"]]


def sample_ids(vocab: int) -> list[int]:
    """:data:`SAMPLE` fixed vocab ids spread over the vocabulary."""
    n = min(SAMPLE, vocab)
    return sorted({(k * vocab) // n + (k * 7) % max(1, vocab // n) for k in range(n)})


def summarize(logits, labels: list[str]) -> dict:
    """What is recorded of one run: per row argmax, top-2 margin, mean, rms, max and a sample."""
    import torch

    top = torch.topk(logits, min(2, logits.shape[1]), dim=1)
    ids = sample_ids(logits.shape[1])
    margin = (top.values[:, 0] - top.values[:, -1]) if logits.shape[1] > 1 else top.values[:, 0] * 0
    return {"rows": labels, "argmax": top.indices[:, 0].tolist(), "margin": margin.tolist(),
            "mean": logits.mean(1).tolist(), "rms": logits.pow(2).mean(1).sqrt().tolist(),
            "max": top.values[:, 0].tolist(), "sample_ids": ids, "sample": logits[:, ids].tolist()}


def compare(name: str, ref: dict, got: dict, dtype: str) -> float:
    """Raise WarmupMismatch naming program ``name``, the row and expected vs got where ``got``
    (a :func:`summarize` of a new run) differs from ``ref`` beyond :data:`RTOL` ``[dtype]``;
    returns the largest difference seen, relative to the row's rms."""
    rtol = RTOL[dtype]
    if got["rows"] != ref["rows"] or got["sample_ids"] != ref["sample_ids"]:
        raise WarmupMismatch(f"warm-up of {name}: the recorded rows {ref['rows'][:3]}... are not the rows "
                             f"run {got['rows'][:3]}... (reference format differs)")
    worst = 0.0
    for i, row in enumerate(ref["rows"]):
        scale = max(ref["rms"][i], 1e-30)
        tol = rtol * scale
        where = f"warm-up of {name} ({dtype}), {row}"
        for stat in ("mean", "rms", "max"):
            e, g = ref[stat][i], got[stat][i]
            worst = max(worst, abs(g - e) / scale)
            if not abs(g - e) <= tol:
                raise WarmupMismatch(f"{where}: logits {stat} expected {e:.6g}, got {g:.6g} "
                                     f"(tolerance {tol:.2g} = {rtol:g} x rms)")
        for vid, e, g in zip(ref["sample_ids"], ref["sample"][i], got["sample"][i]):
            worst = max(worst, abs(g - e) / scale)
            if not abs(g - e) <= tol:
                raise WarmupMismatch(f"{where}: logit of token {vid} expected {e:.6g}, got {g:.6g} "
                                     f"(tolerance {tol:.2g} = {rtol:g} x rms)")
        e, g = ref["argmax"][i], got["argmax"][i]
        if e != g and ref["margin"][i] > 2 * tol:
            raise WarmupMismatch(f"{where}: argmax expected token {e}, got token {g} (the reference's "
                                 f"top-2 margin {ref['margin'][i]:.3g} is no near tie)")
    return worst


def _model(loaded, dtype: str):
    """The emulated model of a package's parts (``package.assemble`` / ``load_package``): its
    programs and its weight files' shards, computing in ``dtype``, as the runtime builds it."""
    from .backends.emulated import EmulatedModel
    return EmulatedModel.from_package(loaded, dtype=_torch_dtype(dtype))


def _warm(bundle, plan: Plan, pkg_dir: Path, todo: list, emit: Progress) -> list[dict]:
    """Load the package's weights into the emulated backend and run each (phase, bucket) on its
    fixed input in every runtime dtype; per program a record for the manifest and the reference
    (``{"record": ..., "reference": ...}``; the reference goes to :func:`reference_file`)."""
    import torch

    from .package import assemble

    parts = assemble(pkg_dir, {}, bundle, plan.mesh,
                     {k: f"programs/{lowermod.program_name(*k)}.json" for k in lowermod.trace_set(bundle)})
    refs = {(p, b): {} for p, b in todo}
    seconds = {(p, b): 0.0 for p, b in todo}
    n = len(todo) * len(DTYPES)
    i = 0
    for dt in DTYPES:  # one model alive at a time
        model = _model(parts, dt)
        for phase, b in todo:
            t = time.monotonic()
            logits, labels = run(model, bundle, phase, b)
            if not bool(torch.isfinite(logits).all()):
                raise WarmupMismatch(f"warm-up of {lowermod.program_name(phase, b)} ({dt}): non-finite logits")
            refs[(phase, b)][dt] = summarize(logits, labels)
            seconds[(phase, b)] += time.monotonic() - t
            i += 1
            emit({"event": "advance", "phase": "warmup", "item": f"{lowermod.program_name(phase, b)} {dt}",
                  "i": i, "n": n})
        del model
    out = []
    for phase, b in todo:
        name = lowermod.program_name(phase, b)
        prog = (Path(pkg_dir) / f"programs/{name}.json").read_bytes()
        out.append({"record": {"backend": "emulated", "ran": True, "seconds": round(seconds[(phase, b)], 3),
                               "reference": reference_file(name), "dtypes": list(DTYPES)},
                    "reference": {"format": FORMAT, "program": name, "phase": phase, "bucket": b,
                                  "program_sha256": hashlib.sha256(prog).hexdigest(),
                                  "rtol": RTOL, "by_dtype": refs[(phase, b)]}})
    return out


def reference_bytes(ref: dict) -> bytes:
    return (json.dumps(ref, sort_keys=True, indent=1) + "\n").encode()


# ---- checking a package against its references ------------------------------------------------------
def references(pkg_dir: Path, manifest: dict) -> dict:
    """``{(phase, bucket): reference}`` of every program the package has a reference for."""
    out = {}
    for art, rec in sorted(manifest.get("artifacts", {}).items()):
        if art.startswith("warmup:") and rec.get("reference"):
            p = Path(pkg_dir) / rec["reference"]
            try:
                ref = json.loads(p.read_text(encoding="utf-8"))
                out[(ref["phase"], int(ref["bucket"]))] = ref
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WarmupMismatch(f"{p}: unreadable warm-up reference ({e})") from None
    return out


def unchecked(manifest: dict) -> list[str]:
    """Programs the package has no reference for (built with ``--no-warmup``)."""
    return sorted(a.removeprefix("warmup:") for a, rec in manifest.get("artifacts", {}).items()
                  if a.startswith("warmup:") and not rec.get("reference"))


def check_model(model, bundle, pkg_dir: Path, manifest: dict, dtype: str, log=None) -> dict:
    """Run every program with a reference on ``model`` (an EmulatedModel computing in ``dtype``)
    and compare; ``{program: worst relative difference}``. The program file must be the one the
    reference was recorded with."""
    out = {}
    for (phase, b), ref in references(pkg_dir, manifest).items():
        name = lowermod.program_name(phase, b)
        prog = Path(pkg_dir) / f"programs/{name}.json"
        try:
            sha = hashlib.sha256(prog.read_bytes()).hexdigest()
        except OSError as e:
            raise WarmupMismatch(f"warm-up of {name}: cannot read {prog} ({e.strerror or e})") from None
        if sha != ref.get("program_sha256"):
            raise WarmupMismatch(f"warm-up of {name}: programs/{name}.json is not the program the reference "
                                 f"was recorded with (sha256 {sha[:16]}, recorded {str(ref.get('program_sha256'))[:16]})")
        if dtype not in ref["by_dtype"]:
            raise WarmupMismatch(f"warm-up of {name}: no {dtype} reference (has {sorted(ref['by_dtype'])})")
        t = time.monotonic()
        logits, labels = run(model, bundle, phase, b)
        out[name] = compare(name, ref["by_dtype"][dtype], summarize(logits, labels), dtype)
        if log is not None:
            log(f"warm-up reference {name} ({dtype}): ok, max difference {out[name]:.2g} x rms "
                f"(tolerance {RTOL[dtype]:g}), {time.monotonic() - t:.2f} s")
    return out


def verify_package(pkg: str | Path, dtypes=("float32",), log=None) -> dict:
    """``ttbundle cache verify``'s numeric half: the package's programs run from its weights on
    the emulated backend, compared with the build's references. ``{dtype: {program: diff}}``."""
    from .package import load_package

    loaded = load_package(Path(pkg))
    out = {}
    for dt in dtypes:  # one model alive at a time
        model = _model(loaded, dt)
        out[dt] = check_model(model, loaded.bundle, Path(pkg), loaded.manifest, dt, log)
        del model
    return out
