"""Replicas as lanes: served concurrency and time to first token at 64 and 128 streams, an
emulated T3K split into 8 replicas of 1x1 (8 lanes x 16 sequences) against one replica of the
same 1x1 program (an N150 package of the same spec, 32 sequences: the largest decode bucket),
both through vLLM's OpenAI server (`ttbundle serve`'s command), same machine, same run.

The model: a small Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, vocab 2048), random
bf16-exact weights, fp32. Each stream: a --prompt-token prompt, --tokens output tokens (ignore_eos),
streamed so the first token's arrival is seen. All streams start at once.

Per configuration and stream count it prints: served concurrency (the most sequences one decode
step ran, from the engine's step log, and the engine's limit), TTFT p50 / p99, aggregate output
tok/s and the wall time; then the ratios lanes / one replica, measured in this run. On the emulated
mesh every lane runs on the same host CPU (one lane after another within a step), so aggregate
tok/s does not grow with lanes as 8 chips would; what lanes change is how many sequences are
admitted at once, hence the TTFT of the streams beyond one replica's 32.

Run: .venv/bin/python benches/bench_lanes.py [--prompt 32] [--tokens 32] [--streams 64 128]
     [--cache out/bench-lanes] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_serve import pct, prompts, run_streams  # noqa: E402

SPEC = """
name: bench-lanes
description: ttbundle lanes benchmark model (random weights)
model:
  family: llama
  vocab_size: 2048
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 4
  num_attention_heads: 8
  num_key_value_heads: 4
  max_position_embeddings: 1024
targets: [N150, T3K]
buckets: {prefill: [32, 64, 128], decode: [1, 2, 4, 8, 16, 32], prefill_chunk: 128}
runtime: {max_model_len: 256, max_num_seqs: MAX_NUM_SEQS}
"""


def spec(per_replica: int, split: bool) -> str:
    text = SPEC.replace("MAX_NUM_SEQS", str(per_replica))
    return text + ("replicas: {T3K: {submesh: [1, 1]}}\n" if split else "")


def measure(pkg: Path, log_dir: Path, label: str, batches: dict[int, list], tokens: int) -> dict:
    from ttbundle.serving.serve import plan_serve, start, stop, wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = plan_serve(pkg, "127.0.0.1", port)
    steps = log_dir / f"{label}-steps.jsonl"
    steps.unlink(missing_ok=True)
    plan.env["TTBUNDLE_STEP_LOG"] = str(steps)
    limit = int(plan.argv[plan.argv.index("--max-num-seqs") + 1])
    out = {"max_num_seqs": limit}
    with open(log_dir / f"{label}-vllm.log", "wb") as log:
        proc = start(plan, log=log)
        try:
            wait_healthy(proc, plan.host, port, 900)
            asyncio.run(run_streams(plan.url, plan.name, batches[min(batches)][:1], 4))  # connections
            for n, batch in batches.items():
                before = len(steps.read_text().splitlines()) if steps.exists() else 0
                res = asyncio.run(run_streams(plan.url, plan.name, batch, tokens))
                assert all(r["tokens"] == tokens for r in res), f"{label}: token counts"
                rows = [json.loads(x) for x in steps.read_text().splitlines()[before:]]
                peak = max((len(s["rows"]) for s in rows if s["phase"] == "decode"), default=0)
                wall = max(r["end"] for r in res) - min(r["start"] for r in res)
                ttft = [r["ttft"] for r in res]
                # lanes run one after another on this host: the time a step spent on lanes
                # other than its slowest (on separate chips they would overlap)
                serial = sum(sum(s["lane_seconds"]) - max(s["lane_seconds"]) for s in rows
                             if s.get("lane_seconds"))
                out[n] = {"concurrency": peak, "ttft_p50_s": statistics.median(ttft),
                          "ttft_p99_s": pct(ttft, 99), "tok_s": n * tokens / wall, "wall_s": wall,
                          "decode_steps": sum(1 for s in rows if s["phase"] == "decode"),
                          "lanes_serial_s": serial}
                print(f"{label} {n} streams: {out[n]}", file=sys.stderr)
        finally:
            stop(proc)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--cache", type=Path, default=Path("out/bench-lanes"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    from ttbundle.serving.demo import build_package

    a.cache.mkdir(parents=True, exist_ok=True)
    lanes_pkg = build_package(spec(16, True), a.cache / "lanes", "T3K")
    one_pkg = build_package(spec(32, False), a.cache / "one", "N150")
    ps = prompts(max(a.streams), a.prompt, 2048)
    batches = {n: ps[:n] for n in sorted(a.streams)}
    res = {"prompt_tokens": a.prompt, "output_tokens": a.tokens,
           "one_replica": measure(one_pkg, a.cache, "one", batches, a.tokens),
           "lanes": measure(lanes_pkg, a.cache, "lanes", batches, a.tokens)}
    for n in batches:
        lo, la = res["one_replica"][n], res["lanes"][n]
        res[f"ratio_{n}"] = {"concurrency": la["concurrency"] / lo["concurrency"],
                             "ttft_p50": la["ttft_p50_s"] / lo["ttft_p50_s"],
                             "ttft_p99": la["ttft_p99_s"] / lo["ttft_p99_s"],
                             "tok_s": la["tok_s"] / lo["tok_s"]}
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"bench-lanes (hidden 256, 4 layers) on the emulated mesh, prompt {a.prompt}, {a.tokens} output "
          f"tokens, fp32, one run: 8 lanes x 16 (T3K as 8 x 1x1) vs one 1x1 replica x 32")
    print(f"  {'streams':>7} {'config':>12} {'concurrency':>16} {'TTFT p50':>10} {'TTFT p99':>10} {'tok/s':>8}")
    for n in batches:
        for key, label in (("one_replica", "one replica"), ("lanes", "8 lanes")):
            r, lim = res[key][n], res[key]["max_num_seqs"]
            print(f"  {n:>7} {label:>12} {r['concurrency']:>8} (max {lim:>3}) {r['ttft_p50_s'] * 1e3:>8.0f}ms "
                  f"{r['ttft_p99_s'] * 1e3:>8.0f}ms {r['tok_s']:>8.1f}")
        la = res["lanes"][n]
        print(f"  {n:>7} {'':>12} lanes ran one after another for {la['lanes_serial_s']:.1f} s of the "
              f"{la['wall_s']:.1f} s wall (time separate chips would overlap)")
        q = res[f"ratio_{n}"]
        print(f"  {n:>7} {'lanes/one':>12} {q['concurrency']:>15.2f}x {q['ttft_p50']:>9.2f}x {q['ttft_p99']:>9.2f}x "
              f"{q['tok_s']:>7.2f}x")


if __name__ == "__main__":
    main()
