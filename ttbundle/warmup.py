"""Warm-up with a reference: each program run on a fixed input, its output recorded at build and
compared wherever the package is run again. This module records (the build) and verifies a
package (``cache verify``); the fixed input, the run, what is recorded, the tolerance and the
comparison are ``ttbundle.warmref``'s, which the serving runtime imports.

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
one stage's weights, at most the largest tensor in float32, whatever the depth (a routed-expert
stack one expert at a time: ``EmulatedModel._experts``).

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
import time
from pathlib import Path
from typing import Callable

from . import lower as lowermod
from .errors import WarmupMismatch
from .plan.make import Plan
from .program import program_name
from .warmref import FORMAT, FP32_RTOL, check_model, references, run, stage_count, summarize
from .package.load import assemble
from .package.speccheck import check_spec, load_checked
from .package.names import DRAFT_DIR

Progress = Callable[[dict], None]

DIR = "warmup"
RECORDED = "float32"  # the reference's compute dtype


def reference_file(name: str) -> str:
    return f"{DIR}/{name}.json"


def _torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


# ---- a model that holds one stage's weights ----------------------------------------------------------
def stage_model(loaded, dtype: str, programs: list):
    """The emulated model of ``programs`` of a package (``package.load.assemble`` /
    ``load_package``), computing in ``dtype``, holding one stage's weights at a time."""
    from .backends.emulated import EmulatedModel

    return EmulatedModel.from_package(loaded, dtype=_torch_dtype(dtype), lazy=True, programs=programs)


# ---- build ---------------------------------------------------------------------------------------------
def _warm(bundle, plan: Plan, pkg_dir: Path, todo: list, emit: Progress) -> list[dict]:
    """Run each (phase, bucket) of ``todo`` on its fixed input, layer by layer, from the package's
    weights in float32; per program a record for the manifest and the reference
    (``{"record": ..., "reference": ...}``; the reference goes to :func:`reference_file`)."""
    import torch

    parts = assemble(pkg_dir, {}, bundle, plan.mesh,
                     {k: f"programs/{program_name(*k)}.json" for k in lowermod.trace_set(bundle)})
    check_spec(parts)  # what the build wrote against its spec (serving trusts it, never re-checks)
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
        name = program_name(phase, b)
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


def verify_package(pkg: str | Path, dtypes=("float32",), log=None) -> dict:
    """``ttbundle cache verify``'s numeric half: the package's programs run from its weights on
    the emulated backend, layer by layer, compared with the build's references; a speculative
    draft's package inside it (``package.names.DRAFT_DIR``) too, its programs named
    ``draft/<program>``. ``{dtype: {program: diff}}``."""
    loaded = load_checked(Path(pkg))
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
    if f"{DRAFT_DIR}/manifest.json" in loaded.manifest["files"]:
        for dt, diffs in verify_package(Path(pkg) / DRAFT_DIR, dtypes, log).items():
            out[dt].update({f"{DRAFT_DIR}/{name}": v for name, v in diffs.items()})
    return out
