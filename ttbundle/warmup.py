"""Warm-up with a reference: each program run on a fixed input, its output recorded at build and
compared wherever the package is run again.

**Input** (:func:`fixed_input`): the real rows of a fixed input, not a whole padded bucket (the
emulated backend runs a program on any row count whose feature dims it declares, so the steps,
weights and collectives run are the program's own):

- prefill ``B``: one sequence of ``min(B, PREFILL_TOKENS)`` tokens ``(7 j + 1) mod vocab`` at
  positions ``0, 1, ...``; every position recorded (position ``j`` attends to ``j + 1`` tokens);
- decode ``B``: ``min(B, DECODE_ROWS)`` rows, row ``i`` token ``(13 i + 5) mod vocab`` at
  position ``i`` in its own blocks of a fresh (zero) KV cache, so attention mixes ``i + 1``
  positions and the query/key weights matter; every row recorded;
- vision ``B``: the family's fixed images filling the bucket; 16 soft-token rows recorded.

**Layer by layer** (:func:`run`): every program's call (each with its own small KV cache) goes
through the embedding, layer 0, ..., the head together (``EmulatedModel.run_layer_major``), on a
model that reads one tensor of one layer at a time from the package's memory-mapped files into
its compute dtype, in bands (:func:`stage_model`), and drops them (mappings included) after each
stage: each layer's weights are read and decoded once for all programs, and the warm-up holds
one stage's weights, at most the largest tensor in float32, whatever the depth.

**Reference** (format :data:`FORMAT`, ``warmup/<phase>-<bucket>.json``, listed with its sha256 in
the manifest): recorded in float32 only, from the stored values (bf16, or block-float tiles as
decoded): per row the argmax token id, its margin over the runner-up, the row's mean, rms and
max, and :data:`SAMPLE` logits at fixed vocab ids, with the sha256 of the program file. No
bfloat16 run at build: a CPU without native bf16 GEMMs runs it ~100x slower than float32.

**Checks**: :func:`check_model` (serving start, in the dtype the runtime serves; the model is the
serving model) and :func:`verify_package` (``ttbundle cache verify``, float32 on the bounded
reader) run the same calls and compare (:func:`compare`); a mismatch raises
:class:`~ttbundle.errors.WarmupMismatch` naming the program, the row and expected vs got. A
package recorded with format ``ttbundle.warmup/1`` (an older ttbundle: whole buckets, fp32 and
bf16) is refused with "rebuild": ``ttbundle build`` re-records only the warm-up (its key covers
this module), reusing weights and programs.

**Tolerance** (:func:`tolerance`), on ``|got - expected|`` of every recorded statistic and sampled
logit, relative to the reference row's logit rms:

- float32 against the float32 reference: 1e-4. The same code on the same weights and input is
  deterministic up to reduction order (thread count, the CPU's vector width, oneDNN-packed vs
  plain GEMMs at serving), which moves float32 logits by <= ~1e-6 of rms (``tests/test_warmup.py``
  asserts <= 1e-5); 1e-4 still catches one weight changed by one bf16 ulp (measured 1.2e-4) and
  anything larger (one element doubled: 7e-3; one output row negated: 0.24).
- bfloat16 compute against the float32 reference: ``BF16_SLOPE x 2**-8 x sqrt(layers + 2)``
  (``layers + 2``: the decoder layers, the embedding and the head). Every stage rounds its
  activations (and its K/V) to bf16, a relative error of up to 2**-8 per element; the errors of
  independent stages add in quadrature and a stage's rounding passes on to the logits about one
  to one (RMSNorm re-normalizes, the residual stream carries it), so the logits' error grows as
  ``2**-8 x sqrt(stages)`` times a factor. Measured (``max |bf16 - fp32| / rms`` over every
  recorded row of every program, N300): that factor is 3.2-3.3 for Llama, Qwen2, Qwen3, Mistral
  (2 layers), 3.9 / 4.2 for Gemma 2 / Gemma 3 (3 layers), 3.4 and 4.1 for Llama with 8 and 16
  layers; :data:`BF16_SLOPE` = 8 is 1.9x the worst. So 0.0625 x rms for 2 layers, 0.18 for 32. It
  still catches, same runs: one weight row negated 14.6-38 (units of ``2**-8 sqrt(L + 2)``, so
  1.8-4.8x the tolerance), a zeroed tensor 172-359, one flipped exponent bit 234-247 or
  non-finite logits (both fail). docs/build.md has the table.
- An argmax may differ only where the reference's top-2 margin is within twice the tolerance (a
  near tie).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable

from . import lower as lowermod
from .errors import WarmupMismatch
from .plan import Plan

Progress = Callable[[dict], None]

FORMAT = "ttbundle.warmup/2"
OLD_FORMATS = ("ttbundle.warmup/1",)  # refused: rebuild
DIR = "warmup"
RECORDED = "float32"  # the reference's compute dtype
SAMPLE = 16  # logits recorded per row, at fixed vocab ids
PREFILL_TOKENS = 8  # real tokens of a prefill call (at most the bucket)
DECODE_ROWS = 4  # real rows of a decode call (at most the bucket)
VISION_ROWS = 16  # soft-token rows of a vision program recorded
FP32_RTOL = 1e-4
BF16_SLOPE = 8.0  # see the module docstring and docs/build.md


def reference_file(name: str) -> str:
    return f"{DIR}/{name}.json"


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
    return {"prefill": min(b, PREFILL_TOKENS), "decode": min(b, DECODE_ROWS)}.get(phase, b)


def _torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


# ---- the fixed input ---------------------------------------------------------------------------------
def fixed_input(bundle, phase: str, b: int) -> dict:
    """The fixed input of program (phase, b): tensors for ``EmulatedModel.stages`` (the real
    rows only), the KV blocks it needs, and the rows recorded (``(n, t)`` pairs, labels)."""
    import torch

    vocab = bundle.arch.vocab_size
    bs = bundle.spec.runtime.kv_block_size
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
            inputs = part.warmup_inputs(bundle.arch.vision, bundle.vision, b)
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
            x = fixed_input(bundle, phase, b)
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


# ---- a model that holds one stage's weights ----------------------------------------------------------
def stage_model(loaded, dtype: str, programs: list):
    """The emulated model of ``programs`` of a package (``package.assemble`` /
    ``load_package``), computing in ``dtype``, holding one stage's weights at a time."""
    from .backends.emulated import EmulatedModel

    return EmulatedModel.from_package(loaded, dtype=_torch_dtype(dtype), lazy=True, programs=programs)


# ---- build ---------------------------------------------------------------------------------------------
def _warm(bundle, plan: Plan, pkg_dir: Path, todo: list, emit: Progress) -> list[dict]:
    """Run each (phase, bucket) of ``todo`` on its fixed input, layer by layer, from the package's
    weights in float32; per program a record for the manifest and the reference
    (``{"record": ..., "reference": ...}``; the reference goes to :func:`reference_file`)."""
    import torch

    from .package import assemble

    parts = assemble(pkg_dir, {}, bundle, plan.mesh,
                     {k: f"programs/{lowermod.program_name(*k)}.json" for k in lowermod.trace_set(bundle)})
    model = stage_model(parts, RECORDED, todo)
    n = stage_count(model, todo)
    emit({"event": "phase", "phase": "warmup", "total": n, "unit": "stages"})
    done = [0]
    t0 = time.monotonic()

    def advance(stage):
        done[0] += 1
        kind, layer = stage
        emit({"event": "advance", "phase": "warmup", "i": done[0], "n": n,
              "item": f"{kind}" if layer is None else f"{kind} {layer}"})

    got = run(model, bundle, todo, after_stage=advance)
    seconds = time.monotonic() - t0
    parts.weights.close()
    out = []
    for phase, b in todo:
        name = lowermod.program_name(phase, b)
        logits, labels = got[(phase, b)]
        if not bool(torch.isfinite(logits).all()):
            raise WarmupMismatch(f"warm-up of {name} ({RECORDED}): non-finite logits")
        prog = (Path(pkg_dir) / f"programs/{name}.json").read_bytes()
        out.append({"record": {"backend": "emulated", "ran": True, "seconds": round(seconds / len(todo), 3),
                               "reference": reference_file(name), "dtype": RECORDED},
                    "reference": {"format": FORMAT, "program": name, "phase": phase, "bucket": b,
                                  "program_sha256": hashlib.sha256(prog).hexdigest(), "dtype": RECORDED,
                                  "rtol_float32": FP32_RTOL, **summarize(logits, labels)}})
    return out


def reference_bytes(ref: dict) -> bytes:
    return (json.dumps(ref, sort_keys=True, indent=1) + "\n").encode()


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
    the serving model, or :func:`stage_model`'s) layer by layer and compare with the float32
    reference at :func:`tolerance` ``(dtype)``; ``{program: worst relative difference}``. The
    program file must be the one the reference was recorded with."""
    refs = references(pkg_dir, manifest)
    for (phase, b), ref in refs.items():
        name = lowermod.program_name(phase, b)
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
        name = lowermod.program_name(*key)
        out[name] = compare(name, refs[key], summarize(*got[key]), dtype, rtol)
    if log is not None:
        log(f"warm-up references ({dtype}, tolerance {rtol:.2g} x rms): {len(out)} programs ok, max difference "
            f"{max(out.values()):.2g} x rms, {time.monotonic() - t:.2f} s")
    return out


def verify_package(pkg: str | Path, dtypes=("float32",), log=None) -> dict:
    """``ttbundle cache verify``'s numeric half: the package's programs run from its weights on
    the emulated backend, layer by layer, compared with the build's references.
    ``{dtype: {program: diff}}``."""
    from .package import load_package

    loaded = load_package(Path(pkg))
    refs = references(Path(pkg), loaded.manifest)
    out = {}
    for dt in dtypes:  # one model alive at a time
        if not refs:
            out[dt] = {}
            continue
        model = stage_model(loaded, dt, sorted(refs))
        out[dt] = check_model(model, loaded.bundle, Path(pkg), loaded.manifest, dt, log)
        del model
        loaded.weights.close()
    return out
