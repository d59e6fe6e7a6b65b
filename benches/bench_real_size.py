"""`ttbundle build` and `ttbundle check` of a Llama-3.1-8B-shaped checkpoint: peak memory flat in
depth, wall time against copying the checkpoint (issue 21).

Writes a random Llama-3.1-8B-shaped checkpoint (bf16, sharded safetensors + index, the dims of
``bundles/llama-3.1-8b.yaml``) with L decoder layers, streaming (one chunk of one tensor in memory
at a time), then measures, each in its own subprocess, in the same run:

* the reference: ``cp -r`` of the checkpoint + ``sha256sum`` of its files (page cache warm,
  dirty pages synced before each timed run);
* ``ttbundle build SPEC --mesh N150`` (or ``--mesh``; bfp8 weights, warm-up included): wall and peak RSS;
* the floor of that build: encoding its bfp8 tensors alone (no I/O, no hashing, every core);
* ``ttbundle check PACKAGE --steps 4``: wall and peak RSS, and its decoder layers' time per side
  (the emulated mesh, the expected run, the original checkpoint);
* the reference of check: one transformers forward (float32, eager) over the same tokens;

and prints, per L, the build wall over the reference (target <= 3x), the peak RSS (target
<= 4 GiB) and, with two L, the peak-RSS deltas between the largest and the smallest L (target:
4 minus 2 layers <= 0.75 GiB).

    python benches/bench_real_size.py                      # L = 2 and 4 (~6 GB on disk at a time)
    python benches/bench_real_size.py --layers 2           # one L
    python benches/bench_real_size.py --full               # + L = 32 (writes 16 GB; a quiet host)
    python benches/bench_real_size.py --layers 2 --mesh T3K  # built for and checked on T3K
    python benches/bench_real_size.py --no-check --json    # build only, figures as JSON

The checkpoint and packages go to ``--work`` (default: a temp dir under ``$TMPDIR``) and are
deleted per L unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# meta-llama/Llama-3.1-8B (bundles/llama-3.1-8b.yaml)
ARCH = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
            num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1.0e-5,
            rope_theta=500000.0)
ROPE = ("{rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
        "original_max_position_embeddings: 8192}")
SHARD_BYTES = 2 << 30  # checkpoint shard files of at most ~2 GiB (HF writes 5 GB for 8B)
CHUNK = 1 << 24  # elements generated at a time (64 MiB of fp32)


def tensors(layers: int) -> list[tuple[str, tuple[int, ...], float]]:
    """(HF key, shape, std) of every tensor, in HF's order; norms are 1 + noise."""
    h, i, v = ARCH["hidden_size"], ARCH["intermediate_size"], ARCH["vocab_size"]
    kv = h * ARCH["num_key_value_heads"] // ARCH["num_attention_heads"]
    out = [("model.embed_tokens.weight", (v, h), 0.02)]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        out += [(p + "self_attn.q_proj.weight", (h, h), 0.02), (p + "self_attn.k_proj.weight", (kv, h), 0.02),
                (p + "self_attn.v_proj.weight", (kv, h), 0.02), (p + "self_attn.o_proj.weight", (h, h), 0.02),
                (p + "mlp.gate_proj.weight", (i, h), 0.02), (p + "mlp.up_proj.weight", (i, h), 0.02),
                (p + "mlp.down_proj.weight", (h, i), 0.02), (p + "input_layernorm.weight", (h,), -0.1),
                (p + "post_attention_layernorm.weight", (h,), -0.1)]
    return out + [("model.norm.weight", (h,), -0.1), ("lm_head.weight", (v, h), 0.02)]


def make_checkpoint(d: Path, layers: int, seed: int = 0) -> int:
    """Write the checkpoint into ``d`` (safetensors written by hand: header, then each tensor's
    bytes a chunk at a time); returns its bytes. ``std < 0``: ``1 + |std| * randn`` (a norm)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    shards: list[list] = [[]]
    size = 0
    for key, shape, std in tensors(layers):
        n = 2 * _numel(shape)
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((key, shape, std))
        size += n
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, _ in shard:
            header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + 2 * _numel(shape)]}
            off += 2 * _numel(shape)
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(d / name, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for key, shape, std in shard:
                left = _numel(shape)
                while left:
                    m = min(CHUNK, left)
                    x = torch.randn(m, generator=g)
                    x = 1 + (-std) * x if std < 0 else x * std
                    f.write(x.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
                    left -= m
                weight_map[key] = name
        total += off
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}, **ARCH}, indent=1))
    return total


def encode_floor(src: Path) -> float:
    """Seconds to encode every tensor the package stores in bfp8 (all 2-D weights but the
    embedding, which stays bf16) from the checkpoint's bf16 values, in 64 MiB row bands on one
    thread per core, with no read of the package, no write and no hash: the compute floor of a
    bfp8 build on this machine (``blockfloat``'s encoder, as ``convert`` runs it)."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors import safe_open

    from ttbundle import blockfloat

    t0 = time.monotonic()
    jobs = []
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                if key.endswith("embed_tokens.weight") or len(h.get_slice(key).get_shape()) != 2:
                    continue
                x = h.get_tensor(key)
                rows = max(32, (64 << 20) // (2 * x.shape[1]) // 32 * 32)
                jobs += [x[r:r + rows] for r in range(0, x.shape[0], rows)]
                with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
                    for _ in pool.map(lambda b: blockfloat.encode_array(b, "bfp8"), jobs):
                        pass
                jobs = []
    return time.monotonic() - t0


def hf_forward(src: Path, tokens: int) -> dict:
    """One transformers forward (float32, eager attention, as check's reference) of the
    checkpoint over ``tokens`` random tokens: the load and the forward, timed apart."""
    import torch

    from ttbundle import reference
    t0 = time.monotonic()
    model = reference.load_model(src)
    t1 = time.monotonic()
    ids = torch.randint(0, ARCH["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)
    return {"load_s": t1 - t0, "forward_s": time.monotonic() - t1}


def gemm_floor(tokens: int) -> float:
    """Seconds of one decoder layer's matrix products over ``tokens`` rows in float32 (q, k, v, o,
    gate, up, down; torch on every core; the best of two): the compute floor of one side's layer
    in check, which runs three (the emulated mesh, the expected run, the original checkpoint)."""
    import torch

    h, i = ARCH["hidden_size"], ARCH["intermediate_size"]
    kv = h * ARCH["num_key_value_heads"] // ARCH["num_attention_heads"]
    ws = [torch.randn(o, n) * 0.02 for o, n in ((h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i))]
    x, xi = torch.randn(tokens, h), torch.randn(tokens, i)
    best = float("inf")
    for _ in range(2):
        t = time.monotonic()
        for w in ws:
            torch.nn.functional.linear(xi if w.shape[1] == i else x, w)
        best = min(best, time.monotonic() - t)
    return best


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def spec_text(src: Path, layers: int, mesh: str = "N150") -> str:
    dims = "\n".join(f"  {k}: {v}" for k, v in ARCH.items())
    return (f"name: bench-8b\nmodel:\n  family: llama\n  num_hidden_layers: {layers}\n{dims}\n"
            f"  rope_scaling: {ROPE}\n  tie_word_embeddings: false\n"
            f"weights:\n  source: {src}\n  dtypes: {{default: bfp8}}\ntokenizer: false\n"
            # bundles/llama-3.1-8b.yaml's buckets and runtime
            f"targets: [{mesh}]\nbuckets: {{prefill: [128, 1024, 2048, 4096], decode: [1, 8, 32], prefill_chunk: 4096}}\n"
            "runtime: {max_model_len: 32768, max_num_seqs: 32, kv_cache_dtype: bfp8}\n")


def timed(cmd: list[str], env=None) -> tuple[float, int, str]:
    """(wall s, peak RSS bytes of the process tree it waited for, stdout) of one subprocess."""
    t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    out, err = p.communicate()
    wall = time.monotonic() - t
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{(out + err)[-3000:]}")
    return wall, _child_rss(), out


def _child_rss() -> int:
    """Peak RSS (bytes) of the largest waited-for descendant so far (``RUSAGE_CHILDREN``)."""
    import resource
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def measure(cmd: list[str], env=None) -> tuple[float, int, str]:
    """:func:`timed` in a fresh child interpreter, so that RUSAGE_CHILDREN's maximum is this
    command's own and not an earlier, larger one's."""
    r = subprocess.run([sys.executable, __file__, "--measure", json.dumps(cmd)], capture_output=True, text=True,
                       cwd=ROOT, env=env)
    if r.returncode != 0:
        raise SystemExit(r.stdout[-3000:] + r.stderr[-3000:])
    d = json.loads(r.stdout.splitlines()[-1])
    return d["wall"], d["rss"], d["out"]


def one_depth(work: Path, layers: int, check: bool, env: dict, prompt_len: int | None = None,
              mesh: str = "N150") -> dict:
    src = work / f"ckpt-{layers}"
    shutil.rmtree(src, ignore_errors=True)
    t = time.monotonic()
    total = make_checkpoint(src, layers)
    gen_s = time.monotonic() - t
    files = sorted(str(f) for f in src.iterdir())
    for f in files:  # the page cache warm for every side
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    subprocess.run(["sync"], check=True)
    dst = work / "cp"
    shutil.rmtree(dst, ignore_errors=True)
    cp_s, _, _ = measure(["cp", "-r", str(src), str(dst)])
    shutil.rmtree(dst)
    sha_s, _, _ = measure(["sha256sum", *files])
    ref_s = cp_s + sha_s
    r = subprocess.run([sys.executable, __file__, "--encode-floor", str(src)], capture_output=True, text=True,
                       cwd=ROOT, check=True)
    floor_s = float(r.stdout.split()[-1])
    spec = work / f"bench-{layers}.yaml"
    spec.write_text(spec_text(src, layers, mesh))
    out = work / f"out-{layers}"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    tt = [sys.executable, "-m", "ttbundle.cli"]
    b_wall, b_rss, stdout = measure(tt + ["build", str(spec), "--mesh", mesh, "-o", str(out), "--json"], env)
    done = [json.loads(x) for x in stdout.splitlines() if '"event": "done"' in x][-1]
    row = {"layers": layers, "mesh": mesh, "checkpoint_bytes": total, "generate_s": round(gen_s, 1), "cp_s": round(cp_s, 2),
           "sha256_s": round(sha_s, 2), "reference_s": round(ref_s, 2), "build_s": round(b_wall, 1),
           "encode_floor_s": round(floor_s, 1), "floor_over_reference": round(floor_s / ref_s, 2),
           "build_rss": b_rss, "build_over_reference": round(b_wall / ref_s, 2), "timings": done["timings"]}
    if check:
        extra = [] if prompt_len is None else ["--prompt-len", str(prompt_len)]
        try:
            c_wall, c_rss, c_out = measure(tt + ["check", done["package"], "--steps", "4", "--json",
                                                 "--no-record"] + extra, env)
        except SystemExit as e:  # a failed check keeps the build's figures and says why
            row.update(check_failed=str(e)[-2000:])
            return row
        rep = json.loads(c_out)
        # the reference of the same run: one transformers forward over the same tokens
        hf_wall, hf_rss, hf_out = measure([sys.executable, __file__, "--hf-forward", str(src),
                                           "--tokens", str(rep["prompt_len"] + rep["steps"] - 1)], env)
        hf = json.loads(hf_out.splitlines()[-1])
        floors = {}
        for n in (rep["prompt_len"] + rep["steps"] - 1, LONG_PROMPT + rep["steps"] - 1):
            r = subprocess.run([sys.executable, __file__, "--gemm-floor", str(n)], capture_output=True, text=True,
                               cwd=ROOT, check=True)
            floors[n] = round(float(r.stdout.split()[-1]), 2)
        row.update(gemm_floor_s=floors, check_chunk=rep.get("prefill_chunk"))
        row.update(check_prompt=rep["prompt_len"], check_s=round(c_wall, 1), check_rss=c_rss,
                   check_over_reference=round(c_wall / ref_s, 2), check_timings=rep["timings"],
                   check_passed=rep["passed"], hf_forward_s=round(hf["forward_s"], 1),
                   hf_load_s=round(hf["load_s"], 1), hf_rss=hf_rss,
                   check_over_hf_forward=round(c_wall / hf["forward_s"], 2))
    row["load"] = round(os.getloadavg()[0], 2)
    return row


#: check's default prompt before it ran chunks of at most 1024 tokens: the 4096-token chunk + a third
LONG_PROMPT = 5462


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4], help="decoder layer counts (default 2 4)")
    ap.add_argument("--full", action="store_true", help="also 32 layers (a 16 GB checkpoint)")
    ap.add_argument("--mesh", default="N150", help="the mesh built for and checked on (default N150; "
                    "issue 38: emulated / original layer <= 1.0 on N150, <= 1.3 on T3K and TG)")
    ap.add_argument("--no-check", action="store_true", help="measure the build only")
    ap.add_argument("--work", type=Path, help="work directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and packages")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--check-prompt-len", type=int, help="check's --prompt-len (default: check's own: "
                    "a 1,024-token chunk and a 128-token one here)")
    ap.add_argument("--gemm-floor", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--make-checkpoint", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--encode-floor", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--hf-forward", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=128, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        wall, rss, out = timed(json.loads(args.measure))
        print(json.dumps({"wall": wall, "rss": rss, "out": out}))
        return
    if args.hf_forward:
        print(json.dumps(hf_forward(args.hf_forward, args.tokens)))
        return
    if args.gemm_floor:
        print(gemm_floor(args.gemm_floor))
        return
    if args.encode_floor:
        print(encode_floor(args.encode_floor))
        return
    if args.make_checkpoint:
        print(make_checkpoint(args.make_checkpoint, args.layers[0]))
        return
    depths = sorted(set(args.layers) | ({32} if args.full else set()))
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_real_size_", dir=os.environ.get("TMPDIR")))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    rows = []
    try:
        for L in depths:
            rows.append(one_depth(work, L, not args.no_check, env, args.check_prompt_len, args.mesh))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # as measured, before the table
            if not args.keep:
                for p in (work / f"ckpt-{L}", work / f"out-{L}"):
                    shutil.rmtree(p, ignore_errors=True)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    gib = 2 ** 30
    print(f"Llama-3.1-8B-shaped random checkpoint (bf16), bfp8 weights on {args.mesh}; {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}")
    print()
    print("| layers | checkpoint | cp + sha256 (reference) | build wall | build / reference (target <= 3x) "
          "| build peak RSS (target <= 4 GiB) | check --steps 4 wall | check / reference | check peak RSS "
          "| load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        chk = (f"{r['check_s']:.1f} s | {r['check_over_reference']:.2f}x | {r['check_rss'] / gib:.2f} GiB"
               if "check_s" in r else "FAILED (below) | - | -" if "check_failed" in r else "- | - | -")
        print(f"| {r['layers']} | {r['checkpoint_bytes'] / 1e9:.2f} GB | {r['cp_s']:.1f} + {r['sha256_s']:.1f} s "
              f"= {r['reference_s']:.1f} s | {r['build_s']:.1f} s | **{r['build_over_reference']:.2f}x** "
              f"| **{r['build_rss'] / gib:.2f} GiB** | {chk} | {r['load']} |")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        print()
        d = (b["build_rss"] - a["build_rss"]) / gib
        line = (f"{b['layers']} minus {a['layers']} layers: build peak RSS {d:+.2f} GiB (target <= 0.75 GiB "
                f"for 4 - 2), build wall {b['build_s'] - a['build_s']:+.1f} s")
        if "check_rss" in a and "check_rss" in b:
            line += f"; check peak RSS {(b['check_rss'] - a['check_rss']) / gib:+.2f} GiB"
        print(line)
    for r in rows:
        if "check_failed" in r:
            print(f"check of {r['layers']} layers failed:\n{r['check_failed']}")
    for r in rows:
        if "check_timings" in r:
            t = r["check_timings"]
            print(f"check, {r['layers']} layers, prompt {r['check_prompt']} + 4 steps (passed: {r['check_passed']}): "
                  f"{r['check_s']:.1f} s = {r['check_over_hf_forward']:.2f}x one transformers forward over the "
                  f"same tokens ({r['hf_forward_s']:.1f} s; load {r['hf_load_s']:.1f} s, peak RSS "
                  f"{r['hf_rss'] / gib:.2f} GiB); its decoder layers: emulated {t['emulated']:.1f} s, expected "
                  f"{t['expected']:.1f} s, original {t['original']:.1f} s (of {t['total']:.1f} s; "
                  f"chunks of {r['check_chunk']})")
            L, fl = r["layers"], r["gemm_floor_s"]
            for n, f in fl.items():
                print(f"  floor of a decoder layer's products over {n} tokens (fp32, every core): {f:.2f} s a side; "
                      f"three sides x 32 layers: {3 * 32 * f / 60:.1f} min")
            per = (t["emulated"] + t["expected"] + t["original"]) / L
            print(f"  measured per decoder layer (three sides): {per:.1f} s; 32 layers: "
                  f"{(32 * per + t['outside']) / 60:.1f} min with the rest ({t['outside']:.1f} s); "
                  f"emulated / original layer: {t['emulated_over_original']}")
    for r in rows:
        print(f"floor, {r['layers']} layers: encoding the bfp8 tensors alone (no I/O, no hash, every core) "
              f"{r['encode_floor_s']:.1f} s = {r['floor_over_reference']:.2f}x the reference")
    for r in rows:
        print(f"build timings, {r['layers']} layers (s): "
              + ", ".join(f"{k} {v}" for k, v in r["timings"].items() if isinstance(v, (int, float))))


if __name__ == "__main__":
    main()
