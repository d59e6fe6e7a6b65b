"""The figures behind `ttbundle check`'s block-float bounds (docs/check.md).

For each family's tiny test model, mesh and storage (bfp8 weights; bfp4 MLP/expert weights with
bfp8 elsewhere; each with a bfp8 KV cache), one run of ``ttbundle check`` (teacher-forced, fp32
compute) against transformers: the worst decoder-layer PCC, the worst head (logits) PCC, the
next-token predictions that agree on decisive positions (reference margin above the bound) of
those compared, and the largest margin, in typical logit errors, at which a prediction differed
(what ``check.MARGIN_SIGMAS`` must exceed); then the same package mutated (a row-parallel
all_reduce deleted from its programs) to show where a real bug lands. Prints a Markdown table.

    .venv/bin/python benches/check_figures.py [--steps 16] [--meshes N150,T3K,TG] [--families ...]
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
from test_check_package import FAMILIES, STORAGE, stored as bundle  # noqa: E402  (the tests' storages)

from ttbundle.check import run_check  # noqa: E402


def reduce_step(b) -> tuple[str, str]:
    """(layer kind, activation) of the attention output's row-parallel all_reduce."""
    return b.family.layers(b.arch)[-1].name, "attn_out"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--meshes", default="N150,T3K,TG")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--storage", default=",".join(sorted(STORAGE, reverse=True)))
    args = ap.parse_args()
    print("| family | mesh | storage | worst layer PCC | worst head PCC | decisive agree / decisive / compared | "
          "largest differing margin (errors) | passed | dropped all_reduce: worst PCC | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for fam in args.families.split(","):
        for mesh in args.meshes.split(","):
            for st in args.storage.split(","):
                t0 = time.perf_counter()
                b = bundle(fam, st)
                r = run_check(b, mesh, steps=args.steps, random_weights=True, seed=3)
                worst = min(s.pcc for s in r.layers if s.stage == "layer")
                head = min(s.pcc for s in r.layers if s.stage == "head")
                flipped = set(r.routing["flipped_positions"]) if r.routing else set()
                differ = [r.margins[p] / r.logit_error for p, (a, e) in enumerate(zip(r.ref_tokens, r.emu_tokens))
                          if a != e and p not in flipped]
                dec = r.decisive
                agree = sum(r.ref_tokens[p] == r.emu_tokens[p] for p in dec)
                bad = "n/a (1 chip)"
                if mesh != "N150":
                    kind, act = reduce_step(b)
                    hook = lambda pkg: edit_programs(pkg, kind, drop_first(  # noqa: E731
                        lambda s: s.get("collective") == "all_reduce" and s["act"] == act))
                    m = run_check(b, mesh, steps=args.steps, random_weights=True, seed=3, package_hook=hook)
                    bad = f"{min(s.pcc for s in m.layers):.4f}" + (" (passed!)" if m.passed else "")
                print(f"| {fam} | {mesh} | {st} | {worst:.5f} | {head:.5f} | {agree} / {len(dec)} / "
                      f"{len(r.ref_tokens)} | {max(differ, default=0):.2f} | {'yes' if r.passed else 'NO'} | "
                      f"{bad} | {time.perf_counter() - t0:.1f} |", flush=True)


if __name__ == "__main__":
    main()
