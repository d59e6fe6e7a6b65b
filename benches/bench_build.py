"""How fast `ttbundle build` converts weights, how much memory it needs, how fast a no-op is.

All ratios come from one run on one machine, against `cp` of the same checkpoint files:

* bf16 conversion of a >= 500 MB bf16 checkpoint (sharded, with an index) to T3K shards:
  source MB/s of the weight phase, and of the whole `ttbundle build` process, vs `cp -r`
  (target: >= 0.5x cp);
* peak RSS of the build process (`--no-warmup`: conversion, programs, package) vs the largest
  tensor (target: <= 3x the largest tensor + 0.5 GB);
* no-op rebuild: wall time of `ttbundle build` on an up-to-date package (target: < 2 s);
* bfp8 conversion MB/s (when ``ttbundle.blockfloat`` exists).

    python benches/bench_build.py [--layers 4] [--repeat 3] [--keep DIR]
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
# Llama dims that divide a T3K (8 columns): 16 heads, 8 KV heads, vocab 32000 = 125 tiles of 256.
ARCH = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
            num_key_value_heads=8, max_position_embeddings=4096)


def spec_text(src: Path, layers: int, dtype: str = "bf16") -> str:
    dims = "\n".join(f"  {k}: {v}" for k, v in ARCH.items())
    return (f"name: bench\nmodel:\n  family: llama\n  num_hidden_layers: {layers}\n{dims}\n"
            f"weights:\n  source: {src}\n  dtypes: {{default: {dtype}}}\ntokenizer: false\n"
            "targets: [T3K]\nbuckets: {prefill: [128, 1024], decode: [1, 8, 32], prefill_chunk: 1024}\n"
            "runtime: {max_model_len: 4096, max_num_seqs: 32}\n")


def make_checkpoint(d: Path, layers: int) -> tuple[int, int]:
    """A random bf16 Llama checkpoint in two shards plus an index; returns (bytes, largest tensor)."""
    import torch
    from safetensors.torch import save_file

    h, i, v = ARCH["hidden_size"], ARCH["intermediate_size"], ARCH["vocab_size"]
    kv = h * ARCH["num_key_value_heads"] // ARCH["num_attention_heads"]
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    d.mkdir(parents=True, exist_ok=True)
    shards = [{"model.embed_tokens.weight": t(v, h), "model.norm.weight": t(h)}, {"lm_head.weight": t(v, h)}]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        sd = shards[0] if layer < layers // 2 else shards[1]
        sd.update({p + "self_attn.q_proj.weight": t(h, h), p + "self_attn.k_proj.weight": t(kv, h),
                   p + "self_attn.v_proj.weight": t(kv, h), p + "self_attn.o_proj.weight": t(h, h),
                   p + "mlp.gate_proj.weight": t(i, h), p + "mlp.up_proj.weight": t(i, h),
                   p + "mlp.down_proj.weight": t(h, i), p + "input_layernorm.weight": t(h),
                   p + "post_attention_layernorm.weight": t(h)})
    weight_map, total, largest = {}, 0, 0
    for n, sd in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sd, str(d / name), metadata={"format": "pt"})
        for k, x in sd.items():
            weight_map[k] = name
            total += x.numel() * 2
            largest = max(largest, x.numel() * 2)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total, largest


LAST_CPU = [0.0]


def write_and_hash(src: Path, dst: Path) -> None:
    """The floor under any converter whose manifest lists a sha256 per output file: the
    checkpoint's bytes written into 8 files with sha256 on the fly, by one thread per core
    (512 KiB pieces, hashed while in cache), then fsynced. Prints two wall times (s): before
    and after the fsync."""
    import hashlib
    import mmap
    import threading

    files = sorted(f for f in src.iterdir() if f.suffix == ".safetensors")
    views = []
    for f in files:
        with open(f, "rb") as fh:
            views.append(memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)))
    total = sum(v.nbytes for v in views)
    cuts = [(i * total // 8, (i + 1) * total // 8) for i in range(8)]
    dst.mkdir(parents=True)
    outs = [open(dst / f"device-{i}", "wb") for i in range(8)]

    def run(mine):
        for i in mine:
            a, b = cuts[i]
            h, pos = hashlib.sha256(), 0
            for v in views:
                lo, hi = max(a - pos, 0), min(b - pos, v.nbytes)
                for j in range(lo, hi, 1 << 19):
                    piece = v[j:min(j + (1 << 19), hi)]
                    outs[i].write(piece)
                    h.update(piece)
                pos += v.nbytes
            outs[i].flush()
    n = min(8, len(os.sched_getaffinity(0)))
    t = time.monotonic()
    ths = [threading.Thread(target=run, args=(range(k, 8, n),)) for k in range(n)]
    for x in ths:
        x.start()
    for x in ths:
        x.join()
    w = time.monotonic() - t
    for o in outs:
        os.fsync(o.fileno())
        o.close()
    print(w, time.monotonic() - t)


def timed(cmd: list[str], env=None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of that process, stdout); its CPU seconds in LAST_CPU."""
    t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    out_chunks = []
    # read while waiting so a full pipe cannot stall the child
    for line in p.stdout:
        out_chunks.append(line)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t
    LAST_CPU[0] = ru.ru_utime + ru.ru_stime
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr.read()[-3000:]}")
    return wall, ru.ru_maxrss * 1024, "".join(out_chunks)


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (4: ~0.65 GB)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per figure (median)")
    ap.add_argument("--keep", type=Path, help="work in this directory and keep it")
    ap.add_argument("--make-checkpoint", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--write-and-hash", type=Path, nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_checkpoint:
        print(*make_checkpoint(args.make_checkpoint, args.layers))
        return
    if args.write_and_hash:
        write_and_hash(*args.write_and_hash)
        return

    work = args.keep or Path(tempfile.mkdtemp(prefix="bench_build_", dir=os.environ.get("TMPDIR")))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "ckpt"
    if src.exists():
        shutil.rmtree(src)
    # in a child: a fork of a big parent would count the parent's pages in the children's peak RSS
    r = subprocess.run([sys.executable, __file__, "--make-checkpoint", str(src), "--layers", str(args.layers)],
                       check=True, capture_output=True, text=True, cwd=ROOT)
    total, largest = map(int, r.stdout.split())
    spec = work / "bench.yaml"
    spec.write_text(spec_text(src, args.layers))
    tt = [sys.executable, "-m", "ttbundle.cli", "build", str(spec), "--mesh", "T3K", "--json", "--no-warmup"]
    # warm the page cache for both sides
    for f in src.iterdir():
        f.read_bytes()

    # every timed run starts with no dirty pages (sync), so earlier writes do not throttle it
    cp_times, cp_sync = [], []
    for _ in range(args.repeat):
        dst = work / "cp"
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        w, _, _ = timed(["cp", "-r", str(src), str(dst)])
        t = time.monotonic()
        subprocess.run(["sync"], check=True)
        cp_times.append(w)
        cp_sync.append(w + time.monotonic() - t)
        shutil.rmtree(dst)
    cp_s, cps_s = statistics.median(cp_times), statistics.median(cp_sync)
    floor, floor_sync = [], []
    for _ in range(args.repeat):
        dst = work / "floor"
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        _, _, out = timed([sys.executable, __file__, "--write-and-hash", str(src), str(dst)])
        a, b = map(float, out.split())
        floor.append(a)
        floor_sync.append(b)
        shutil.rmtree(dst)
    fl_s, fls_s = statistics.median(floor), statistics.median(floor_sync)

    runs = []
    for _ in range(args.repeat):
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        wall, rss, stdout = timed(tt + ["-o", str(out)])
        done = [json.loads(x) for x in stdout.splitlines() if '"event": "done"' in x][-1]
        done["cpu"] = LAST_CPU[0]
        runs.append((wall, rss, done))
    wall_s = statistics.median(r[0] for r in runs)
    conv_s = statistics.median(r[2]["timings"]["weights"] for r in runs)
    nosync_s = statistics.median(r[2]["timings"]["weights"] - r[2]["timings"]["weights_fsync"] for r in runs)
    rss = max(r[1] for r in runs)
    done = runs[-1][2]
    pkg = Path(done["package"])
    out_bytes = dir_bytes(pkg / "weights")

    noop = []
    for _ in range(args.repeat):
        w, _, stdout = timed(tt + ["-o", str(work / "out")])
        d = [json.loads(x) for x in stdout.splitlines() if '"event": "done"' in x][-1]
        if d["status"] != "up-to-date":  # the tree changed under us (code digests): not a no-op
            print(f"note: rebuild was not a no-op, changed: {d['changed_fields']}", file=sys.stderr)
            continue
        noop.append(w)
    noop_s = statistics.median(noop) if noop else float("nan")
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import ttbundle.cli"], check=True, cwd=ROOT)
    import_s = time.monotonic() - t

    bfp8 = None
    try:
        import ttbundle.blockfloat  # noqa: F401
        spec8 = work / "bench8.yaml"
        shutil.rmtree(work / "out8", ignore_errors=True)
        subprocess.run(["sync"], check=True)
        spec8.write_text(spec_text(src, args.layers, "bfp8"))
        w, rss8, stdout = timed([sys.executable, "-m", "ttbundle.cli", "build", str(spec8), "--mesh", "T3K",
                                 "--json", "--no-warmup", "-o", str(work / "out8")])
        d8 = [json.loads(x) for x in stdout.splitlines() if '"event": "done"' in x][-1]
        bfp8 = (d8["timings"]["weights"], w, rss8, dir_bytes(Path(d8["package"]) / "weights"))
    except ImportError:
        pass

    mb = total / 1e6
    bound = 3 * largest + 512 * 2**20
    print(f"checkpoint: {mb:,.0f} MB bf16 in 2 shards + index ({args.layers} layers), largest tensor "
          f"{largest / 1e6:,.0f} MB; T3K package weights: {out_bytes / 1e6:,.0f} MB in 8 files")
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print()
    cpu = statistics.median(r[2]["cpu"] for r in runs)
    # the weight phase's three threads (cut shards, write + sha256, hash the checkpoint): on an idle
    # machine it takes about max(the busiest thread, their sum / cores)
    th = {k: statistics.median(r[2]["timings"].get(k, 0.0) for r in runs)
          for k in ("cpu_convert", "cpu_write", "cpu_hash")}
    idle_s = max(max(th.values()), sum(th.values()) / (os.cpu_count() or 1))
    fsync_s = statistics.median(r[2]["timings"]["weights_fsync"] for r in runs)
    print("| what | figure |")
    print("|---|---|")
    print(f"| `cp -r` of the checkpoint (median of {args.repeat}) | {cp_s:.2f} s, **{mb / cp_s:,.0f} MB/s** |")
    print(f"| `cp -r` + `sync` (data on disk) | {cps_s:.2f} s, {mb / cps_s:,.0f} MB/s |")
    print(f"| floor: write the bytes into 8 files + sha256, {min(8, len(os.sched_getaffinity(0)))} threads "
          f"(median) | {fl_s:.2f} s, {mb / fl_s:,.0f} MB/s = {cp_s / fl_s:.2f}x cp; with fsync {fls_s:.2f} s, "
          f"{mb / fls_s:,.0f} MB/s = {cps_s / fls_s:.2f}x cp + sync |")
    print(f"| bf16 -> T3K shards, weight phase without the final fsync (median) | {nosync_s:.2f} s, "
          f"**{mb / nosync_s:,.0f} MB/s = {cp_s / nosync_s:.2f}x cp** (target >= 0.5x), "
          f"{fl_s / nosync_s:.2f}x the floor |")
    print(f"| bf16 -> T3K shards, weight phase incl. fsync (median) | {conv_s:.2f} s, {mb / conv_s:,.0f} MB/s = "
          f"**{cps_s / conv_s:.2f}x cp + sync**, {fls_s / conv_s:.2f}x the floor with fsync |")
    print(f"| weight phase CPU (median): cut shards {th['cpu_convert']:.2f} s, write + sha256 (all writer threads) "
          f"{th['cpu_write']:.2f} s, hash checkpoint {th['cpu_hash']:.2f} s | CPU-bound estimate for an idle "
          f"machine: ~{idle_s:.2f} s (+ fsync {fsync_s:.2f} s) = ~{mb / idle_s:,.0f} MB/s = ~{cp_s / idle_s:.2f}x cp |")
    print(f"| whole `ttbundle build --no-warmup` process (median) | {wall_s:.2f} s, {mb / wall_s:,.0f} MB/s = "
          f"{cp_s / wall_s:.2f}x cp |")
    print(f"| of which (last run, s) | {', '.join(f'{k} {v:.2f}' for k, v in done['timings'].items())}; "
          f"process CPU {cpu:.1f} s on {os.cpu_count()} cores (load avg {os.getloadavg()[0]:.1f}) |")
    print(f"| peak RSS of the build process | **{rss / 2**20:,.0f} MiB** vs 3 x largest + 0.5 GiB = "
          f"{bound / 2**20:,.0f} MiB ({rss / bound:.2f}x of the bound) |")
    print(f"| no-op rebuild, `ttbundle build` wall (median of {args.repeat}) | **{noop_s:.2f} s** (target < 2 s); "
          f"`import ttbundle.cli` alone {import_s:.2f} s |")
    if bfp8:
        conv8, wall8, rss8, b8 = bfp8
        print(f"| bfp8 -> T3K shards, weight phase | {conv8:.2f} s, **{mb / conv8:,.0f} MB/s** of bf16 source "
              f"({b8 / 1e6:,.0f} MB written); whole process {wall8:.2f} s, peak RSS {rss8 / 2**20:,.0f} MiB |")
    else:
        print("| bfp8 conversion | ttbundle.blockfloat not available |")
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
