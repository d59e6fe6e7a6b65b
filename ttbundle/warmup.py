"""Build warm-up: each program run once on the emulated backend from the package's weights."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from . import lower as lowermod
from .errors import TTBundleError
from .plan import Plan

Progress = Callable[[dict], None]


def _warm(bundle, plan: Plan, pkg_dir: Path, todo: list, emit: Progress) -> list[dict]:
    """Load the package's weights into the emulated backend and run each (phase, bucket) once."""
    import torch

    from .backends.emulated import EmulatedModel, Runner
    from .package import assemble

    parts = assemble(pkg_dir, {}, bundle, plan.mesh,
                     {k: f"programs/{lowermod.program_name(*k)}.json" for k in lowermod.trace_set(bundle)})
    model = EmulatedModel.from_package(parts, dtype=torch.float32)
    # KV blocks for the longest prefill warmed (decode runs at position 0), not max_model_len
    bs = bundle.spec.runtime.kv_block_size
    need = -(-max([b for p, b in todo if p == "prefill"] + [1]) // bs) + 1
    runner = Runner(model, num_blocks=need)
    blocks = list(range(need))
    vocab = bundle.arch.vocab_size
    out = []
    with torch.no_grad():
        for i, (phase, b) in enumerate(todo):
            t = time.monotonic()
            runner.shapes_run.clear()
            if phase == "prefill":
                runner.chunk = b  # one chunk of exactly this bucket
                runner.prefill([(7 * j + 1) % vocab for j in range(b)], blocks)
            else:
                runner.decode([1] * b, [0] * b, [blocks] * b)
            ran = (phase, b) in runner.shapes_run
            out.append({"backend": "emulated", "ran": ran, "seconds": round(time.monotonic() - t, 3),
                        "shapes_run": sorted([list(s) for s in runner.shapes_run])})
            emit({"event": "advance", "phase": "warmup", "item": lowermod.program_name(phase, b),
                  "i": i + 1, "n": len(todo)})
            if not ran:
                raise TTBundleError(f"warm-up of {phase} bucket {b}: the emulated backend ran "
                                    f"{sorted(runner.shapes_run)} instead")
    return out

