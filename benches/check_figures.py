"""The figures behind `ttbundle check`'s executor bounds (docs/check.md, "Executor bounds").

For each family's tiny test model, mesh, storage (bf16; bfp8 weights; bfp4 MLP/expert weights
with bfp8 elsewhere; the block-float ones with a bfp8 KV cache) and compute dtype, one run of
``ttbundle check`` (teacher-forced, random weights seed 3): the executor's worst stage error of
a correct package (normalised error against the expected run; the head's apart), its decisive
positions, the quality figures against the original checkpoint (random tokens: reported, not
judged), then the same package with the attention output's all_reduce deleted from its programs
(a real bug): the stage it fails at and that stage's error. Prints a Markdown table.

    .venv/bin/python benches/check_figures.py [--steps 16] [--meshes N150,T3K] [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pkg_mutations import drop_first, edit_programs  # noqa: E402
from test_check_package import FAMILIES, STORAGE, stored  # noqa: E402  (the tests' storages)
from test_emulated import TINY as DENSE, tiny as dense_tiny  # noqa: E402
from test_emulated_moe import tiny as moe_tiny  # noqa: E402

from ttbundle.check import EXEC_BOUNDS, HEAD_BOUNDS, run_check  # noqa: E402


def bundle(fam: str, storage: str):
    if storage != "bf16":
        return stored(fam, storage)
    return dense_tiny(fam) if fam in DENSE else moe_tiny(fam)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--meshes", default="N150,T3K")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--storage", default=",".join(["bf16"] + sorted(STORAGE, reverse=True)))
    args = ap.parse_args()
    print(f"executor bounds: layers {EXEC_BOUNDS}, head {HEAD_BOUNDS}")
    print("| family | mesh | storage | compute | worst stage error (stage) | worst head error | flipped positions "
          "(worst error) | decisive / compared | executor | quality top-1 / KL mean (random tokens) | "
          "dropped all_reduce: first wrong stage, error | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fam in args.families.split(","):
        for mesh in args.meshes.split(","):
            for st in args.storage.split(","):
                for dt in args.dtypes.split(","):
                    t0 = time.perf_counter()
                    b = bundle(fam, st)
                    r = run_check(b, mesh, steps=args.steps, dtype=dt, random_weights=True, seed=3)
                    ex = r.executor
                    body = [s for s in ex.stages if s.stage != "head"]
                    w = max(body, key=lambda s: s.err)
                    head = max(s.err for s in ex.stages if s.stage == "head")
                    fl = [s.flip_err for s in ex.stages if s.flip_err is not None]
                    flips = f"{sum(s.flipped for s in ex.stages)} ({max(fl):.3f})" if fl else "0"
                    bad = "n/a (1 chip)"
                    if mesh != "N150":
                        kind = b.family.layers(b.arch)[-1].name
                        hook = lambda pkg: edit_programs(pkg, kind, drop_first(  # noqa: E731
                            lambda s: s.get("collective") == "all_reduce" and s["act"] == "attn_out"))
                        m = run_check(b, mesh, steps=args.steps, dtype=dt, random_weights=True, seed=3,
                                      package_hook=hook)
                        d = m.diverging()
                        bad = "PASSED (!)" if m.executor.passed else f"{d.name} {d.step}, {d.err:.3g}"
                    print(f"| {fam} | {mesh} | {st} | {dt} | {w.err:.3g} ({w.name}, {w.step}) | {head:.3g} | {flips} | "
                          f"{len(ex.decisive)} / {len(ex.margins)} | {'pass' if ex.passed else 'FAIL'} | "
                          f"{r.quality.top1:.3f} / {r.quality.kl_mean:.3g} | {bad} | "
                          f"{time.perf_counter() - t0:.1f} |", flush=True)


if __name__ == "__main__":
    main()
