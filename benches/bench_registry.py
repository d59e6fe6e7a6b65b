"""How long `ttbundle register` and `ttbundle ls` take with 2,000 packages.

Builds one small package (a random 1-layer Llama, ``ttbundle build``), clones it into N packages
with distinct bundle names (``serving.demo.clone_package``: valid manifests, name-independent
files hard-linked) under ``DIR/N150/``, then times through the CLI (subprocesses, a private
``XDG_CONFIG_HOME``):

1. ``ttbundle register --dir DIR`` on a fresh registry (every package verified: sha256 of every
   file, spec, plan, weight headers, adapter);
2. ``ttbundle ls --json`` and ``ttbundle ls`` (answered from the verification cache);
3. ``ttbundle register --dir DIR`` again (cache hits);
4. ``ttbundle ls --json`` after one package's file was changed (that package re-checked and refused).

The budget: each of 2-4 in a few seconds (interpreter start-up included).

    python benches/bench_registry.py [--packages 2000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path



def ttbundle(env: dict, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "ttbundle.cli", *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--packages", type=int, default=2000)
    ap.add_argument("--keep", type=Path, help="build into this directory and keep it")
    args = ap.parse_args()

    from ttbundle.serving.demo import SMALL_SPEC, build_package, clone_package

    root = args.keep or Path(tempfile.mkdtemp(prefix="ttbundle-bench-registry-"))
    try:
        t0 = time.perf_counter()
        src = build_package(SMALL_SPEC, root / "build", "N150", warmup=False)
        out = root / "out"
        for i in range(args.packages):
            clone_package(src, out / "N150" / f"reg-{i:05d}", f"reg-{i:05d}")
        files = sum(1 for _ in (out / "N150" / "reg-00000").rglob("*") if _.is_file())
        print(f"{args.packages} packages of {files} files each made in {time.perf_counter() - t0:.1f} s "
              f"under {out}")
        env = dict(os.environ, XDG_CONFIG_HOME=str(root / "xdg"), TTBUNDLE_EMULATED="0")
        env.pop("EXTRA_MODELS_DIR", None)
        env.pop("MESH_DEVICE", None)
        figures = {}

        def timed(label, *a, expect=0):
            s, r = ttbundle(env, *a)
            if r.returncode != expect:
                sys.exit(f"{label}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
            figures[label] = s
            print(f"{label:<42} {s:6.2f} s")
            return r

        s0, _ = ttbundle(env, "version")
        print(f"{'ttbundle version (interpreter start-up)':<42} {s0:6.2f} s")
        r = timed("register (fresh registry, full verify)", "register", "--dir", str(out))
        assert r.stdout.count("registered ") == args.packages, r.stdout[-500:]
        r = timed("ls --json", "ls", "--json")
        assert len(json.loads(r.stdout)["packages"]) == args.packages
        timed("ls (table)", "ls")
        timed("register again (cached)", "register", "--dir", str(out))
        # one byte of one package's own file (bundle.yaml is rewritten per clone, not a hard link
        # shared by all: changing a shared inode changes its ctime in every package)
        victim = out / "N150" / "reg-00007" / "bundle.yaml"
        with open(victim, "r+b") as f:
            f.seek(len("# Resolved"))
            f.write(b"r")
        r = timed("ls --json after one package changed", "ls", "--json")
        doc = json.loads(r.stdout)
        assert len(doc["packages"]) == args.packages - 1 and len(doc["refused"]) == 1, doc["refused"]
        print(f"refused: {doc['refused'][0]['path']}: {doc['refused'][0]['reason']}")
        r = timed("register after one package changed", "register", "--dir", str(out))
        print(json.dumps({k: round(v, 2) for k, v in figures.items()}))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
