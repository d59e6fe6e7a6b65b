"""The warm-up reference a build records and every later run compares with: the fixed input of
each program, the run, what is recorded of it, the tolerance and the comparison
(``ttbundle.warmup`` records at build and describes each in its docstring; the model runner
checks a package at serving start with :func:`check_model` and :func:`unchecked`)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

from .errors import WarmupMismatch
from .program import program_name

FORMAT = "ttbundle.warmup/2"
OLD_FORMATS = ("ttbundle.warmup/1",)  # refused: rebuild
SAMPLE = 16  # logits recorded per row, at fixed vocab ids
PREFILL_TOKENS = 8  # real tokens of a prefill call (at most the bucket)
DECODE_ROWS = 4  # real rows of a decode call (at most the bucket)
VISION_ROWS = 16  # soft-token rows of a vision program recorded
FP32_RTOL = 1e-4
BF16_SLOPE = 8.0  # see the module docstring and docs/build.md


def tolerance(dtype: str, layers: int) -> float:
    """The largest difference from the float32 reference, relative to the row's logit rms, that
    a run computing in ``dtype`` on a model of ``layers`` decoder layers may show."""
    if dtype == "float32":
        return FP32_RTOL
    if dtype == "bfloat16":
        return BF16_SLOPE * 2.0 ** -8 * math.sqrt(layers + 2)
    raise ValueError(f"no warm-up tolerance for compute dtype {dtype!r} (float32 or bfloat16)")


def real_rows(phase: str, b: int) -> int:
    """Rows of program (phase, b) that its warm-up call runs (:func:`fixed_input`)."""
    return {"prefill": min(b, PREFILL_TOKENS), "decode": min(b, DECODE_ROWS), "verify": min(b, DECODE_ROWS)}.get(phase, b)


# ---- the fixed input ---------------------------------------------------------------------------------
def fixed_input(program) -> dict:
    """The fixed input of ``program`` (a ``program.Program``, its phase and bucket): tensors for
    ``EmulatedModel.stages`` (the real rows only), the KV blocks it needs (in the program's block
    size), and the rows recorded (``(n, t)`` pairs, labels). The build records with it and the
    runtime checks with it, so it reads the program, never the spec."""
    import torch

    phase, b = program.phase, program.bucket
    vocab = program.dims.vocab_size
    bs = int(program.kv_cache["block_size"])
    if phase == "prefill":
        r = real_rows(phase, b)
        nblk = -(-r // bs)
        tokens = torch.tensor([[(7 * j + 1) % vocab for j in range(r)]])
        positions = torch.arange(r)[None, :]
        page_table = torch.arange(nblk)[None, :]
        rows = [((0, t), f"position {t}") for t in range(r)]
    else:
        n = real_rows(phase, b)
        k = -(-n // bs)  # blocks per row: positions 0..n-1
        nblk = n * k
        tokens = torch.tensor([[(13 * i + 5) % vocab] for i in range(n)])
        positions = torch.arange(n)[:, None]
        page_table = torch.arange(nblk).reshape(n, k)
        rows = [((i, 0), f"row {i}") for i in range(n)]
    valid = torch.ones(tokens.shape, dtype=torch.bool)
    return {"tokens": tokens, "positions": positions, "valid": valid, "page_table": page_table,
            "num_blocks": nblk, "block_size": bs, "rows": rows}


def _stage_signature(program) -> tuple:
    return tuple((lp.kind, lp.count) for lp in program.layers)


def run(model, bundle, programs: list, after_stage=None) -> dict:
    """``{(phase, bucket): (logits [rows, vocab] float32, row labels)}`` of ``model`` on each
    program's fixed input. Text programs run layer by layer together (one call each, each with
    its own KV cache; programs with other layer kinds in another pass); vision programs whole.
    ``after_stage(stage)`` after each stage."""
    import torch

    out = {}
    groups: dict = {}
    for phase, b in programs:
        if phase == "vision":
            part = bundle.family.vision_part(bundle.arch)
            inputs = part.warmup_inputs(bundle.vision, b)
            with torch.no_grad():
                soft = model.encode_images(inputs["pixel_values"], inputs.get("image_grid_thw"))
            model.release()
            k = min(VISION_ROWS, soft.shape[0])
            ts = sorted({round(j * (soft.shape[0] - 1) / max(1, k - 1)) for j in range(k)})
            out[(phase, b)] = (soft[ts].float().cpu(), [f"soft token {t}" for t in ts])
            if after_stage is not None:
                after_stage(("vision", b))
            continue
        prog = model.program(phase, b)
        groups.setdefault(_stage_signature(prog), []).append((phase, b, prog))
    for members in groups.values():
        calls, inputs = [], []
        for phase, b, prog in members:
            x = fixed_input(prog)
            kv = model.allocate_kv_cache(x["num_blocks"], x["block_size"])
            calls.append(model.stages(prog, x["tokens"], x["positions"], x["valid"], x["page_table"], kv))
            inputs.append(x)
        with torch.no_grad():
            logits = model.run_layer_major(calls, after_stage=after_stage)
        for (phase, b, _), x, lg in zip(members, inputs, logits):
            idx_n = torch.tensor([r[0][0] for r in x["rows"]])
            idx_t = torch.tensor([r[0][1] for r in x["rows"]])
            out[(phase, b)] = (lg[idx_n, idx_t].float().cpu(), [r[1] for r in x["rows"]])
    return out


def stage_count(model, programs: list) -> int:
    """How many stages :func:`run` runs for ``programs`` on ``model`` (a progress total)."""
    text = {_stage_signature(model.program(*k)) for k in programs if k[0] != "vision"}
    return sum(k[0] == "vision" for k in programs) + sum(sum(c for _, c in sig) for sig in text)


# ---- what is recorded ----------------------------------------------------------------------------------
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


def compare(name: str, ref: dict, got: dict, dtype: str, rtol: float) -> float:
    """Raise WarmupMismatch naming program ``name``, the row and expected vs got where ``got``
    (a :func:`summarize` of a run computing in ``dtype``) differs from ``ref`` by more than
    ``rtol`` x the row's rms; returns the largest difference seen, relative to the row's rms."""
    if got["rows"] != ref["rows"] or got["sample_ids"] != ref["sample_ids"]:
        raise WarmupMismatch(f"warm-up of {name}: the recorded rows {ref['rows'][:3]}... are not the rows "
                             f"run {got['rows'][:3]}... (reference format differs)")
    worst = 0.0
    for i, row in enumerate(ref["rows"]):
        scale = max(ref["rms"][i], 1e-30)
        tol = rtol * scale
        where = f"warm-up of {name} ({dtype}), {row}"
        pairs = [(f"logits {stat}", ref[stat][i], got[stat][i]) for stat in ("mean", "rms", "max")]
        pairs += [(f"logit of token {vid}", e, g) for vid, e, g in zip(ref["sample_ids"], ref["sample"][i],
                                                                       got["sample"][i])]
        for what, e, g in pairs:
            worst = max(worst, abs(g - e) / scale)
            if not abs(g - e) <= tol:
                raise WarmupMismatch(f"{where}: {what} expected {e:.6g}, got {g:.6g} "
                                     f"(tolerance {tol:.2g} = {rtol:.2g} x rms)")
        e, g = ref["argmax"][i], got["argmax"][i]
        if e != g and ref["margin"][i] > 2 * tol:
            raise WarmupMismatch(f"{where}: argmax expected token {e}, got token {g} (the reference's "
                                 f"top-2 margin {ref['margin'][i]:.3g} is no near tie)")
    return worst


# ---- checking a package against its references ------------------------------------------------------
def references(pkg_dir: Path, manifest: dict) -> dict:
    """``{(phase, bucket): reference}`` of every program the package has a reference for; a
    reference of an older format is refused, saying to rebuild."""
    out = {}
    for art, rec in sorted(manifest.get("artifacts", {}).items()):
        if art.startswith("warmup:") and rec.get("reference"):
            p = Path(pkg_dir) / rec["reference"]
            try:
                ref = json.loads(p.read_text(encoding="utf-8"))
                key = (ref["phase"], int(ref["bucket"]))
                fmt = ref.get("format")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WarmupMismatch(f"{p}: unreadable warm-up reference ({e})") from None
            if fmt != FORMAT:
                why = "recorded by an older ttbundle" if fmt in OLD_FORMATS else "unknown to this ttbundle"
                raise WarmupMismatch(f"{p}: warm-up reference format {fmt!r} ({why}; this one reads {FORMAT}): "
                                     f"rebuild the package (`ttbundle build SPEC` re-records the warm-up and "
                                     f"reuses its weights and programs)")
            out[key] = ref
    return out


def unchecked(manifest: dict) -> list[str]:
    """Programs the package has no reference for (built with ``--no-warmup``)."""
    return sorted(a.removeprefix("warmup:") for a, rec in manifest.get("artifacts", {}).items()
                  if a.startswith("warmup:") and not rec.get("reference"))


def check_model(model, bundle, pkg_dir: Path, manifest: dict, dtype: str, log=None) -> dict:
    """Run every program with a reference on ``model`` (an EmulatedModel computing in ``dtype``:
    the serving model, or ``warmup.stage_model``'s) layer by layer and compare with the float32
    reference at :func:`tolerance` ``(dtype)``; ``{program: worst relative difference}``. The
    program file must be the one the reference was recorded with."""
    refs = references(pkg_dir, manifest)
    for (phase, b), ref in refs.items():
        name = program_name(phase, b)
        prog = Path(pkg_dir) / f"programs/{name}.json"
        try:
            sha = hashlib.sha256(prog.read_bytes()).hexdigest()
        except OSError as e:
            raise WarmupMismatch(f"warm-up of {name}: cannot read {prog} ({e.strerror or e})") from None
        if sha != ref.get("program_sha256"):
            raise WarmupMismatch(f"warm-up of {name}: programs/{name}.json is not the program the reference "
                                 f"was recorded with (sha256 {sha[:16]}, recorded {str(ref.get('program_sha256'))[:16]})")
    if not refs:
        return {}
    rtol = tolerance(dtype, bundle.arch.num_hidden_layers)
    t = time.monotonic()
    got = run(model, bundle, sorted(refs))
    out = {}
    for key in sorted(refs):
        name = program_name(*key)
        out[name] = compare(name, refs[key], summarize(*got[key]), dtype, rtol)
    if log is not None:
        log(f"warm-up references ({dtype}, tolerance {rtol:.2g} x rms): {len(out)} programs ok, max difference "
            f"{max(out.values()):.2g} x rms, {time.monotonic() - t:.2f} s")
    return out
