"""Time to serve: `ttbundle serve SPEC` of a 135M model on N300, from the command to a healthy
/health, the build included (issue 21: target <= 2 minutes).

Writes a random instance of SmolLM-135M's architecture (HuggingFaceTB/SmolLM-135M: 30 layers,
hidden 576, 9 query / 3 KV heads, vocabulary 49,152, tied embeddings; bf16 checkpoint through
``reference.save_random``) with the demo bundle's tokenizer, then, in the same run:

* ``serve SPEC --mesh N300`` on an empty output directory: build (weights, programs, warm-up) +
  vLLM start + the runtime's reference check and warm-up, until /health answers;
* the same command again: the package is up to date, so this is serving start alone (the floor
  the build adds to);

and prints both, the build's share, and the ratio to the 120 s target.

    python benches/bench_serve_start.py            # ~2-4 minutes
    python benches/bench_serve_start.py --keep DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = """\
name: smol-135m
description: SmolLM-135M's architecture, random weights (bench_serve_start.py)
model:
  family: llama
  vocab_size: 49152
  hidden_size: 576
  intermediate_size: 1536
  num_hidden_layers: 30
  num_attention_heads: 9
  num_key_value_heads: 3
  max_position_embeddings: 2048
  rope_theta: 10000.0
  rms_norm_eps: 1.0e-5
  tie_word_embeddings: true
weights:
  source: checkpoint
tokenizer: tokenizer
targets: [N300]
sharding:
  attention_heads: pad   # 9 query / 3 KV heads on 2 chips: padded to 12 / 4 (as `init` writes it)
  kv_heads: pad
buckets:
  prefill: [128, 512, 2048]
  decode: [1, 8, 32]
  prefill_chunk: 2048
runtime:
  max_model_len: 2048
  max_num_seqs: 32
"""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serve_until_healthy(spec: Path, out: Path, log: Path, timeout: float = 900) -> float:
    port = free_port()
    exe = Path(sys.executable).with_name("ttbundle")
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([str(exe), "serve", str(spec), "--mesh", "N300", "-o", str(out), "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise SystemExit(f"serve did not become healthy; see {log}:\n" + log.read_text()[-3000:])
            time.sleep(0.25)
        return time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, help="work here and keep the files")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ttbundle import reference, spec as specmod

    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-serve-start-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        spec = work / "smol-135m.yaml"
        spec.write_text(SPEC)
        tok = work / "tokenizer"
        tok.mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copy(ROOT / "bundles" / "demo" / name, tok / name)
        t = time.monotonic()
        (work / "checkpoint").mkdir(exist_ok=True)  # the spec names it; save_random fills it
        reference.save_random(specmod.load(spec), work / "checkpoint", seed=0)
        print(f"checkpoint written in {time.monotonic() - t:.1f} s", flush=True)
        print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
        shutil.rmtree(work / "packages", ignore_errors=True)
        cold = serve_until_healthy(spec, work / "packages", work / "serve-cold.log")
        warm = serve_until_healthy(spec, work / "packages", work / "serve-warm.log")
        print(f"serve SPEC, build included: healthy after {cold:.1f} s ({cold / 120:.2f}x the 120 s target)")
        print(f"serve SPEC, package up to date: healthy after {warm:.1f} s (serving start alone)")
        print(f"the build's share: {cold - warm:.1f} s; load average after: {os.getloadavg()[0]:.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
