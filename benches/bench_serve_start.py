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

**Cold and warm start** (issue 41, item 5), as `vllm bench startup` measures them: that command
times ``LLM(...)`` in a fresh process, "cold" with a fresh ``VLLM_CACHE_ROOT`` and torch inductor
cache, "warm" with the caches a previous start left; it takes vLLM engine arguments only, so it
cannot time ``ttbundle serve`` (its build, its API server, the runtime's warm-up). Here the same
quantity is measured on `ttbundle serve`'s own command, from process start to ``/health`` 200,
three starts per case, each with its own cache directories (``VLLM_CACHE_ROOT``,
``TORCHINDUCTOR_CACHE_DIR``, ``XDG_CACHE_HOME``, ``TRITON_CACHE_DIR`` under the work folder):

* **cold, build included**: ``serve SPEC`` on an empty output directory, fresh caches;
* **cold**: the package up to date, fresh caches again (what `vllm bench startup` calls cold);
* **warm**: the package and the caches of the previous start.

``--model demo`` (bundles/demo.yaml) or ``smol-135m``; ``--mesh``; ``--device tt`` serves on the
TT path with the recording double standing in for ttnn (``TTBUNDLE_TEST_TTNN=recording``: the
package is built with the ttnn backend, tensorbin weight caches included; nothing runs on a
device). ``--vllm-startup`` also runs `vllm bench startup` itself (one cold, one warm iteration)
with the package's engine arguments from ``plan_serve`` (the emulated device only).

    python benches/bench_serve_start.py --model demo --mesh N150 --vllm-startup
    python benches/bench_serve_start.py --model smol-135m --mesh N150
    python benches/bench_serve_start.py --model demo --mesh N150 --device tt
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
targets: [N150, N300, T3K]
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


CACHE_VARS = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "TRITON_CACHE_DIR")


def cache_env(caches: Path) -> dict:
    """Every cache directory vLLM and torch write at start, under ``caches`` (made empty if new)."""
    caches.mkdir(parents=True, exist_ok=True)
    return {k: str(caches / k.lower()) for k in CACHE_VARS}


def serve_until_healthy(spec: Path, out: Path, log: Path, timeout: float = 900, mesh: str = "N300",
                        env: dict | None = None, device: str | None = None) -> float:
    """Seconds from starting ``ttbundle serve SPEC`` to ``/health`` 200."""
    port = free_port()
    cmd = [sys.executable, "-c", "from ttbundle.cli import main; main()", "serve", str(spec), "--mesh", mesh,
           "-o", str(out), "--port", str(port)] + (["--device", device] if device else [])
    full = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **(env or {}))
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full)
    try:
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise SystemExit(f"serve did not become healthy; see {log}:\n" + log.read_text()[-3000:])
            time.sleep(0.25)
        return time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


def vllm_bench_startup(package: Path, work: Path) -> dict:
    """`vllm bench startup` itself (1 cold, 1 warm-up, 1 warm iteration) with the package's
    engine arguments and environment as ``ttbundle serve`` would start vLLM (emulated device)."""
    import json

    from ttbundle.serving.serve import plan_serve
    plan = plan_serve(package, "127.0.0.1", free_port())
    args = plan.argv[plan.argv.index("serve") + 2:]  # after `serve PACKAGE`
    for flag in ("--host", "--port"):  # the API server's, not the engine's
        i = args.index(flag)
        del args[i:i + 2]
    out = work / "vllm-bench-startup.json"
    cmd = [str(Path(sys.executable).with_name("vllm")), "bench", "startup", "--model", str(package), *args,
           "--num-iters-cold", "1", "--num-iters-warmup", "1", "--num-iters-warm", "1", "--output-json", str(out)]
    env = dict(os.environ, **plan.env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(work / "vllm-bench-startup.log", "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        raise SystemExit(f"vllm bench startup exited {r.returncode}; see {work / 'vllm-bench-startup.log'}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, help="work here and keep the files")
    ap.add_argument("--model", choices=["smol-135m", "demo"], default="smol-135m")
    ap.add_argument("--mesh", default="N300")
    ap.add_argument("--device", choices=["emulated", "tt"], default="emulated",
                    help="tt: the TT path on the recording double (TTBUNDLE_TEST_TTNN=recording)")
    ap.add_argument("--vllm-startup", action="store_true", help="also run `vllm bench startup` (emulated)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ttbundle import reference, spec as specmod

    if args.device == "tt":
        os.environ["TTBUNDLE_TEST_TTNN"] = "recording"  # the double stands in for ttnn; serve builds for it
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-serve-start-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.model == "demo":
            spec, name = ROOT / "bundles" / "demo.yaml", "demo"
        else:
            spec, name = work / "smol-135m.yaml", "smol-135m"
            spec.write_text(SPEC)
            tok = work / "tokenizer"
            tok.mkdir(exist_ok=True)
            for f in TOKENIZER_FILES:
                shutil.copy(ROOT / "bundles" / "demo" / f, tok / f)
            t = time.monotonic()
            (work / "checkpoint").mkdir(exist_ok=True)  # the spec names it; save_random fills it
            reference.save_random(specmod.load(spec), work / "checkpoint", seed=0)
            print(f"checkpoint written in {time.monotonic() - t:.1f} s", flush=True)
        load = [os.getloadavg()[0]]
        print(f"load average before: {load[0]:.2f}", flush=True)
        for d in ("packages", "caches-1", "caches-2"):
            shutil.rmtree(work / d, ignore_errors=True)
        run = dict(mesh=args.mesh, device=args.device)
        cold_build = serve_until_healthy(spec, work / "packages", work / "serve-cold-build.log",
                                         env=cache_env(work / "caches-1"), **run)
        cold = serve_until_healthy(spec, work / "packages", work / "serve-cold.log",
                                   env=cache_env(work / "caches-2"), **run)
        warm = serve_until_healthy(spec, work / "packages", work / "serve-warm.log",
                                   env=cache_env(work / "caches-2"), **run)
        load.append(os.getloadavg()[0])
        where = f"{name} on {args.mesh}, " + ("TT path, recording double" if args.device == "tt" else "emulated mesh")
        print(f"{where}: process start to /health 200")
        print(f"  cold, build included (empty output directory, fresh caches): {cold_build:6.1f} s"
              + (f" ({cold_build / 120:.2f}x issue 21's 120 s target)" if name == "smol-135m" else ""))
        print(f"  cold (package up to date, fresh vLLM/torch caches):           {cold:6.1f} s")
        print(f"  warm (package and the previous start's caches):               {warm:6.1f} s")
        print(f"  the build's share {cold_build - cold:.1f} s, the caches' {cold - warm:.1f} s; "
              f"load average {load[0]:.2f} before, {load[-1]:.2f} after")
        if args.vllm_startup:
            r = vllm_bench_startup(work / "packages" / args.mesh / name, work)
            print(f"  vllm bench startup (LLM() in-process, no API server, no ttbundle runtime check): "
                  f"cold {r['avg_cold_startup_time']:.1f} s, warm {r['avg_warm_startup_time']:.1f} s")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
