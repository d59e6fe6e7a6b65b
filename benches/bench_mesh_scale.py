"""What an emulated mesh costs as it grows: the same checkpoint on N150, N300, T3K and TG.

One checkpoint (a published 7B model's dims, Mistral-7B-v0.3 by default, ``--layers 1``, random
bf16 weights (``--dtype``: their storage; ``--compute``: check's compute dtype); ``--arch smollm2-135m --layers 30``: the issue's 135M model) on every mesh, each figure from its own process, all in one run, with ratios vs
N150 (issue 27's targets: check's peak memory on T3K and TG <= 1.3x N150's, its wall time <= 2x
N150's; a TG package <= 1.2x the N150 package's bytes):

* ``check``: ``ttbundle check SPEC --mesh M --random-weights --steps S --dtype C`` (build to a temporary
  package, transformers reference, the package on the emulated mesh): wall seconds and the
  process's peak RSS;
* ``package``: ``ttbundle build SPEC --mesh M --no-warmup`` from one saved random checkpoint:
  bytes of ``weights/`` (and of the whole package);
* ``checkpkg``: ``ttbundle check PACKAGE --steps S --dtype C`` on that package (the executor and
  quality verdicts without the build in the process, whose peak can hide the emulated side's):
  wall seconds and peak RSS;
* ``decode``: the built package loaded on the emulated mesh (``EmulatedModel.from_package``,
  float32), a 32-token prefill per row, then decode steps of a full decode bucket: RSS after
  the load, peak RSS, median milliseconds per step.

The host is shared: the 1-minute load average is printed before and after every figure.

    python benches/bench_mesh_scale.py [--arch mistral-7b] [--layers 1] [--steps 8] [--compute fp32]
                                       [--meshes N150,N300,T3K,TG] [--only check,package,checkpkg,decode]
                                       [--pythonpath OTHER_CHECKOUT] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHS = {
    # mistralai/Mistral-7B-v0.3's dims (its config.json), as bundles/mistral-7b-v0.3.yaml
    "mistral-7b": dict(family="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                       rms_norm_eps=1.0e-5, rope_theta=1000000.0, tie_word_embeddings="false", hidden_act="silu"),
    # HuggingFaceTB/SmolLM2-135M's dims (30 layers; 9 query / 3 KV heads: padded, as `init` pads)
    "smollm2-135m": dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1.0e-5, rope_theta=100000.0, tie_word_embeddings="true", hidden_act="silu"),
}
ARCH = ARCHS["mistral-7b"]
MESHES = ["N150", "N300", "T3K", "TG"]
TREE = str(ROOT)


def spec_text(layers: int, source: Path | None, dtype: str) -> str:
    dims = "\n".join(f"  {k}: {v}" for k, v in ARCH.items())
    src = f"  source: {source}\n" if source else ""
    pad = "sharding: {attention_heads: pad, kv_heads: pad}\n" if ARCH["num_attention_heads"] % 8 else ""
    return (f"name: mesh-scale\nmodel:\n  num_hidden_layers: {layers}\n{dims}\n"
            f"weights:\n{src}  dtypes: {{default: {dtype}}}\n{pad}tokenizer: false\n"
            f"targets: [{', '.join(MESHES)}]\n"
            "buckets: {prefill: [128, 512], decode: [1, 8, 32], prefill_chunk: 512}\n"
            "runtime: {max_model_len: 2048, max_num_seqs: 32, kv_cache_dtype: bf16}\n")


DECODE = r"""
import json, resource, statistics, sys, time
import torch
from ttbundle.package import load_package
from ttbundle.backends.emulated import EmulatedModel, Runner
pkg_dir, steps = sys.argv[1], int(sys.argv[2])
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
t = time.monotonic()
pkg = load_package(pkg_dir)
model = EmulatedModel.from_package(pkg)
load_s, load_rss = time.monotonic() - t, rss()
B = max(pkg.bundle.buckets.decode)
block = pkg.bundle.spec.runtime.kv_block_size
r = Runner(model, num_blocks=B * 2 + 1)
tables = [[1 + 2 * i, 2 + 2 * i] for i in range(B)]
g = torch.Generator().manual_seed(0)
vocab = pkg.bundle.arch.vocab_size
with torch.no_grad():
    toks = []
    for i in range(B):
        logits = r.prefill(torch.randint(0, vocab, (32,), generator=g).tolist(), tables[i])
        toks.append(int(logits.argmax()))
    times = []
    for s in range(steps):
        t = time.perf_counter()
        logits = r.decode(toks, [32 + s] * B, tables)
        times.append(time.perf_counter() - t)
        toks = logits.argmax(-1).tolist()
print("RESULT " + json.dumps({"load_s": load_s, "rss_after_load": load_rss, "rows": B,
                              "step_ms": 1000 * statistics.median(times[1:] or times)}))
"""


def timed(cmd: list[str], env=None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of that process, stdout)."""
    t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=TREE, env=env)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{out[-2000:]}\n{err[-3000:]}")
    return wall, ru.ru_maxrss * 1024, out


def load() -> float:
    return round(os.getloadavg()[0], 2)


def env() -> dict:
    return dict(os.environ, PYTHONPATH=TREE, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def weights_bytes(pkg: Path) -> tuple[int, int]:
    w = sum(f.stat().st_size for f in (pkg / "weights").iterdir())
    return w, sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="mistral-7b", choices=sorted(ARCHS))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--pythonpath", default=str(ROOT), help="the ttbundle checkout to measure (a before/after)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--decode-steps", type=int, default=5)
    ap.add_argument("--dtype", default="bf16", help="weights storage (bf16, bfp8)")
    ap.add_argument("--compute", default="fp32", help="check's compute dtype (its --dtype: fp32, bf16)")
    ap.add_argument("--meshes", default=",".join(MESHES))
    ap.add_argument("--only", default="check,package,decode")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    global ARCH, TREE
    ARCH, TREE = ARCHS[args.arch], args.pythonpath
    meshes, only = args.meshes.split(","), set(args.only.split(","))
    ttb = [sys.executable, "-m", "ttbundle.cli"]
    res: dict = {"arch": args.arch, "tree": TREE, "layers": args.layers, "dtype": args.dtype, "compute": args.compute,
                 "steps": args.steps,
                 "cpus": len(os.sched_getaffinity(0)), "meshes": {m: {} for m in meshes}}
    with tempfile.TemporaryDirectory(prefix="bench-mesh-") as tmp:
        tmp = Path(tmp)
        spec = tmp / "spec.yaml"
        spec.write_text(spec_text(args.layers, None, args.dtype))
        if "check" in only:
            for m in meshes:
                before = load()
                wall, peak, _ = timed(ttb + ["check", str(spec), "--mesh", m, "--random-weights",
                                             "--steps", str(args.steps), "--dtype", args.compute, "--json"], env())
                res["meshes"][m]["check"] = {"wall_s": round(wall, 1), "peak_rss": peak, "load": [before, load()]}
                print(f"check {m}: {wall:.1f} s, peak RSS {peak / 2**30:.2f} GiB (load {before} -> {load()})",
                      file=sys.stderr)
        if only & {"package", "decode", "checkpkg"}:
            ckpt = tmp / "ckpt"
            subprocess.run([sys.executable, "-c", "import sys; from ttbundle import reference, spec; "
                            "reference.save_random(spec.load(sys.argv[1]), sys.argv[2], 0)", str(spec), str(ckpt)],
                           check=True, cwd=TREE, env=env())
            spec.write_text(spec_text(args.layers, ckpt, args.dtype))
            for m in meshes:
                out = tmp / "out"
                _, _, text = timed(ttb + ["build", str(spec), "--mesh", m, "-o", str(out), "--no-warmup", "--json"],
                                   env())
                pkg = Path(next(json.loads(ln)["package"] for ln in text.splitlines()
                                if ln.startswith("{") and json.loads(ln).get("event") == "done"))
                w, total = weights_bytes(pkg)
                res["meshes"][m]["package"] = {"weights_bytes": w, "package_bytes": total,
                                               "files": len(list((pkg / "weights").iterdir()))}
                print(f"package {m}: weights {w / 2**20:.1f} MiB, package {total / 2**20:.1f} MiB", file=sys.stderr)
                if "checkpkg" in only:  # the same check on the built package: no build in the process
                    before = load()
                    wall, peak, _ = timed(ttb + ["check", str(pkg), "--steps", str(args.steps), "--dtype",
                                                 args.compute, "--json"], env())
                    res["meshes"][m]["checkpkg"] = {"wall_s": round(wall, 1), "peak_rss": peak, "load": [before, load()]}
                    print(f"check PACKAGE {m}: {wall:.1f} s, peak RSS {peak / 2**30:.2f} GiB (load {before} -> {load()})",
                          file=sys.stderr)
                if "decode" in only:
                    before = load()
                    _, peak, text = timed([sys.executable, "-c", DECODE, str(pkg), str(args.decode_steps)], env())
                    r = json.loads(next(ln for ln in text.splitlines() if ln.startswith("RESULT "))[7:])
                    r.update(peak_rss=peak, load=[before, load()])
                    res["meshes"][m]["decode"] = r
                    print(f"decode {m}: {r['step_ms']:.1f} ms/step ({r['rows']} rows), RSS after load "
                          f"{r['rss_after_load'] / 2**30:.2f} GiB, peak {peak / 2**30:.2f} GiB "
                          f"(load {before} -> {load()})", file=sys.stderr)
                shutil.rmtree(out)
    base = res["meshes"].get("N150", {})
    ratios: dict = {}
    for m, r in res["meshes"].items():
        q = {}
        for what, key in (("check", "wall_s"), ("check", "peak_rss"), ("checkpkg", "wall_s"), ("checkpkg", "peak_rss"),
                          ("package", "weights_bytes"),
                          ("decode", "step_ms"), ("decode", "peak_rss")):
            if what in r and what in base and base[what][key]:
                q[f"{what}.{key}"] = round(r[what][key] / base[what][key], 2)
        ratios[m] = q
    res["ratios_vs_N150"] = ratios
    if args.json:
        print(json.dumps(res, indent=1))
        return
    cols = ["check.wall_s", "check.peak_rss", "package.weights_bytes", "decode.step_ms", "decode.peak_rss"]
    print("| mesh | check s | check peak GiB | weights MiB | decode ms/step | decode peak GiB | ratios vs N150 "
          "(check s, check mem, weights, decode ms, decode mem) | load |")
    print("|---|---|---|---|---|---|---|---|")
    for m, r in res["meshes"].items():
        c, p, d = r.get("check", {}), r.get("package", {}), r.get("decode", {})
        gib = lambda v: f"{v / 2**30:.2f}" if v else "-"  # noqa: E731
        ld = (c.get("load") or d.get("load") or ["-"])
        print(f"| {m} | {c.get('wall_s', '-')} | {gib(c.get('peak_rss'))} | "
              f"{p.get('weights_bytes', 0) / 2**20:.0f} | {d.get('step_ms', 0):.1f} | {gib(d.get('peak_rss'))} | "
              f"{', '.join(str(ratios[m].get(k, '-')) for k in cols)} | {ld[0]} |")

    if any("checkpkg" in r for r in res["meshes"].values()):
        print("\n| mesh | check PACKAGE s | its peak GiB | ratios vs N150 (s, peak) | load |\n|---|---|---|---|---|")
        for m, r in res["meshes"].items():
            c = r.get("checkpkg", {})
            print(f"| {m} | {c.get('wall_s', '-')} | {c.get('peak_rss', 0) / 2**30:.2f} | "
                  f"{ratios[m].get('checkpkg.wall_s', '-')}, {ratios[m].get('checkpkg.peak_rss', '-')} | "
                  f"{(c.get('load') or ['-'])[0]} |")


if __name__ == "__main__":
    main()
