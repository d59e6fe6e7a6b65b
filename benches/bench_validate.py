"""How long `ttbundle validate` takes: 200 generated specs in-process, then the CLI's start-up.

The budget: validating 200 specs (every target of each) in under 2 s in-process. The bench writes
200 distinct valid specs as YAML into a temp dir (families from ``families.all_families()``,
varying dims, targets, buckets, runtime and dtypes), then times what `ttbundle validate` does for
each file: ``spec.load`` + ``plan.make_plan`` for every target. Separately it times N
`ttbundle validate FILE` subprocesses, whose cost is almost all interpreter + import start-up.

    python benches/bench_validate.py [--specs 200] [--repeat 3] [--cli-runs 20] [--seed 0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from ttbundle import families, mesh as meshmod, spec as specmod
from ttbundle.plan.make import make_plan
from ttbundle.errors import TTBundleError

BUDGET_S = 2.0
# Wormhole and Blackhole meshes, 1x1 up to 8x8; axis sizes 1, 2, 4, 8 so power-of-two dims divide.
MESHES = ("N150", "N300", "N150x4", "T3K", "TG", "DUAL_GALAXY", "P150", "P300", "P150x4", "P150x8",
          "BH-Galaxy")

# Extra arch fields a family needs beyond the dims every family shares (ArchBase), as a function of
# the random source and the shared dims. A family not listed gets its required fields filled with
# random powers of two (ints) by ``_extras``; it is skipped if no such spec validates.
FAMILY_EXTRAS: dict[str, object] = {
    "llama": lambda rng, dims: {},
}
PROBES = 200  # candidate specs tried per family before it is skipped


def _extras(rng: random.Random, family: str, dims: dict) -> dict:
    if family in FAMILY_EXTRAS:
        return FAMILY_EXTRAS[family](rng, dims)
    out = {}
    for name, f in families.get(family).arch_model.model_fields.items():
        if name in dims or not f.is_required():
            continue
        if f.annotation is int:
            out[name] = rng.choice((1, 2, 4, 8, 16, 32, 64, 128))
        elif f.annotation is float:
            out[name] = rng.choice((0.5, 1.0))
        elif f.annotation is bool:
            out[name] = rng.random() < 0.5
    return out


def _arch(rng: random.Random, family: str) -> dict:
    heads = rng.choice((8, 16, 32, 64))
    head_dim = rng.choice((64, 128))
    hidden = heads * head_dim
    dims = {
        "family": family,
        "vocab_size": rng.choice((2048, 32000, 32768, 50257, 128256, 151936)),
        "hidden_size": hidden,
        "intermediate_size": 256 * rng.randint(hidden // 256, 4 * hidden // 256),
        "num_hidden_layers": rng.randint(1, 48),
        "num_attention_heads": heads,
        "num_key_value_heads": rng.choice([k for k in (1, 2, 4, 8, heads) if heads % k == 0]),
        "max_position_embeddings": rng.choice((4096, 8192, 32768, 131072)),
        "rope_theta": rng.choice((10000.0, 500000.0, 1000000.0)),
    }
    if rng.random() < 0.2:
        dims["tie_word_embeddings"] = True
    dims.update(_extras(rng, family, dims))
    return dims


def _spec(rng: random.Random, i: int, family: str) -> dict:
    arch = _arch(rng, family)
    prefill = sorted(rng.sample((32, 128, 256, 512, 1024, 2048, 4096), rng.randint(1, 4)))
    decode = sorted(rng.sample((1, 2, 4, 8, 16, 32), rng.randint(1, 4)))
    block = rng.choice((32, 64))
    top = prefill[-1]
    max_len = rng.choice([n for n in (512, 1024, 2048, 4096, 8192, 16384)
                          if n <= arch["max_position_embeddings"]])
    buckets: dict = {"prefill": prefill, "decode": decode}
    if max_len > top or rng.random() < 0.3:
        chunks = [p for p in prefill if p % block == 0]
        if not chunks:
            max_len = min(max_len, top)  # no prefill bucket can be a chunk: cap the context
        else:
            buckets["prefill_chunk"] = rng.choice(chunks)
    spec: dict = {
        "name": f"bench-{family}-{i:03d}",
        "description": f"generated spec {i}",
        "model": arch,
        "targets": rng.sample(MESHES, rng.randint(1, 4)),
        "buckets": buckets,
        "runtime": {"max_model_len": max_len, "max_num_seqs": rng.choice([d for d in (1, 2, 4, 8, 16, 32)
                                                                          if d <= decode[-1]]),
                    "kv_block_size": block, "kv_cache_dtype": rng.choice(("bf16", "bfp8")),
                    "trace_mode": rng.choice(("all", "decode_only", "none"))},
    }
    r = rng.random()
    if r < 0.3:
        spec["weights"] = {"dtypes": {"attention": "bfp8", "mlp": rng.choice(("bfp8", "bfp4")),
                                      "lm_head": "bfp8"}}
    elif r < 0.4:
        spec["weights"] = {"dtypes": {"tensors": {"wo": "bfp8", "w2": "bfp4"}}}
    if rng.random() < 0.2:
        spec["sharding"] = {"kv_heads": "pad"}
    return spec


def generate(n: int, seed: int, out: Path) -> tuple[list[Path], dict[str, int]]:
    """``n`` distinct specs that load and plan on every target, written as ``out/NNN.yaml``."""
    rng = random.Random(seed)
    fams = list(families.all_families())
    usable, skipped = [], {}
    for fam in fams:  # a family is used if one of PROBES generated specs of it validates
        probe = random.Random(seed)
        for _ in range(PROBES):
            try:
                _check(yaml.safe_dump(_spec(probe, 0, fam), sort_keys=False))
            except TTBundleError as e:
                skipped[fam] = "; ".join(str(d) for d in e.diagnostics[:2]) or e.message
                continue
            usable.append(fam)
            skipped.pop(fam, None)
            break
    for fam, why in skipped.items():
        print(f"skipping family {fam}: none of {PROBES} generated specs validated (last: {why}); "
              f"give it a generator in FAMILY_EXTRAS")
    if not usable:
        raise SystemExit("no family could be generated")
    seen: set[str] = set()
    paths, per_family = [], {f: 0 for f in usable}
    attempts = 0
    while len(paths) < n:
        attempts += 1
        if attempts > 50 * n:
            raise SystemExit(f"only {len(paths)} valid specs after {attempts} attempts")
        fam = usable[len(paths) % len(usable)]
        d = _spec(rng, len(paths), fam)
        text = yaml.safe_dump(d, sort_keys=False)
        key = yaml.safe_dump({k: v for k, v in d.items() if k not in ("name", "description")})
        if key in seen:
            continue
        try:
            _check(text)
        except TTBundleError:
            continue  # e.g. a dim that does not divide one target's axis
        seen.add(key)
        p = out / f"{len(paths):03d}.yaml"
        p.write_text(text, encoding="utf-8")
        paths.append(p)
        per_family[fam] += 1
    return paths, per_family


def _check(text: str) -> None:
    b = specmod.loads(text)
    for t in b.spec.targets:
        make_plan(b, t)


def validate_all(paths: list[Path]) -> tuple[int, int]:
    """What `ttbundle validate` does per file, for every file: (plans made, plans that fit)."""
    plans = fits = 0
    for path in paths:
        bundle = specmod.load(path)
        for t in bundle.spec.targets:
            try:
                p = make_plan(bundle, t)
            except TTBundleError:
                continue
            plans += 1
            fits += p.fits
    return plans, fits


def _cli() -> list[str]:
    exe = Path(sys.executable).parent / "ttbundle"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ttbundle.cli"]


def _time_runs(cmds: list[list[str]]) -> list[float]:
    out = []
    for cmd in cmds:
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        out.append(time.perf_counter() - t0)
        if r.returncode not in (0, 3):  # 3: valid, does not fit a target
            raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3, help="timed passes over all specs (median reported)")
    ap.add_argument("--cli-runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, help="write the specs here and keep them")
    a = ap.parse_args(argv)

    tmp = None
    if a.keep:
        out = a.keep
        out.mkdir(parents=True, exist_ok=True)
    else:
        out = Path(tmp := tempfile.mkdtemp(prefix="ttbundle-bench-"))
    try:
        paths, per_family = generate(a.specs, a.seed, out)
        targets = [t for p in paths for t in specmod.load(p).spec.targets]
        meshes = sorted({meshmod.resolve(t).describe() for t in targets})
        fams = ", ".join(f"{f}: {n}" for f, n in per_family.items())
        print(f"generated {len(paths)} distinct valid specs ({fams}) in {out}")
        print(f"  {len(targets)} (spec, target) plans over {len(meshes)} meshes: {', '.join(meshes)}")

        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            plans, fits = validate_all(paths)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"validate {len(paths)} specs: {med:.2f} s (target < {BUDGET_S:g} s: "
              f"{med / BUDGET_S:.2f}x of budget)")
        print(f"  median of {a.repeat} in-process passes (min {min(times):.2f} s, max {max(times):.2f} s); "
              f"{1000 * med / len(paths):.2f} ms per spec, {1000 * med / plans:.2f} ms per plan; "
              f"{fits} of {plans} plans fit")

        if a.cli_runs:
            cli = _cli()
            runs = _time_runs([cli + ["validate", str(paths[i % len(paths)])] for i in range(a.cli_runs)])
            bare = _time_runs([[sys.executable, "-c", "pass"]] * 5)
            imp = _time_runs([[sys.executable, "-c", "import ttbundle.cli, ttbundle.plan, ttbundle.spec"]] * 5)
            per = statistics.median(runs)
            work = med / len(paths)
            print(f"cli: {a.cli_runs} x `ttbundle validate FILE`: {sum(runs):.2f} s total, "
                  f"{1000 * per:.0f} ms per run (median)")
            b, i = statistics.median(bare), statistics.median(imp)
            print(f"  start-up ~{1000 * (per - work):.0f} ms per run (run minus {1000 * work:.1f} ms of "
                  f"in-process work): interpreter {1000 * b:.0f} ms (python -c pass), importing "
                  f"ttbundle.cli/spec/plan {1000 * (i - b):.0f} ms, the rest {1000 * (per - work - i):.0f} ms "
                  f"(typer/rich set-up, command imports, exit)")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
