"""bench_serve's model work, interleaved in one process: what a shared, loaded host still lets us
compare. Per round, back to back: the ceiling step (one 16-row step's bare weight matmuls, best of
bench_serve.ceiling_layouts: two plain layouts and oneDNN packed, as bench_serve measures it), one 16-row decode step of the package
(``BundleModel.decode_forward``), and the 16 prompts' prefill twice: as the previous code ran it
(one call per prompt padded to its bucket, the head over every row) and as the runner runs it now
(``phases.pack_prefill``'s calls through ``prefill_forward``, the head on each sequence's last
row). Ratios are per round (the same seconds of load), medians over the rounds.

Run: .venv/bin/python benches/bench_serve_steps.py [--prefill-buckets 128,512] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_model import SPEC  # noqa: E402
from bench_serve import ceiling_layouts, ceiling_mats  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-buckets", default="128,512")
    ap.add_argument("--cache", type=Path, default=Path("out/bench-serve"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import torch

    from ttbundle.runtime.adapter import BundleModel
    from ttbundle.serving.demo import build_package
    from ttbundle.runtime.packages import open_package
    from ttbundle.runtime.phases import pack_prefill, pick
    from ttbundle.runtime.sampling import DeviceSampling
    from ttbundle.runtime.worker import emulated_threads

    spec, cache = SPEC, a.cache
    if a.prefill_buckets != "128,512":
        spec = SPEC.replace("prefill: [128, 512]", f"prefill: [{a.prefill_buckets}]")
        cache = a.cache / ("prefill-" + a.prefill_buckets.replace(",", "-"))
    pkg = open_package(build_package(spec, cache, "N150"), check_hashes=False)
    threads = emulated_threads()
    torch.set_num_threads(threads)
    m = BundleModel.initialize_vllm_model(None, pkg.loaded.mesh, 32, 1024, package=pkg)
    bs = pkg.bundle.spec.runtime.kv_block_size
    per = -(-1024 // bs)
    kv = m.allocate_kv_cache((1 + a.streams * per, 0, bs, 0))
    table = torch.tensor([[1 + i * per + j for j in range(per)] for i in range(a.streams)])
    buckets = sorted(pkg.bundle.buckets.prefill)
    n, S = a.prompt, a.streams
    prompts = torch.randint(8, 32000, (S, n))
    greedy = lambda rows: DeviceSampling.from_params([], [], rows)  # noqa: E731

    # the ceiling's weights: every linear weight of the model ([out, in] as torch.nn.Linear holds
    # them), in each of bench_serve's ceiling layouts
    em = m.model
    ws = [em.weight(name, li)[0].t().contiguous() for name, t in em.decls.items()
          if name in em.w and t.kind == "matrix" and len(t.dims) == 2
          for li in ([None] if t.layers is None else range(*t.layers))]
    layouts = {lay: ceiling_mats(lay, ws, S) for lay in ceiling_layouts()}
    xs = {k: torch.randn(S, k) for k in {w.shape[1] for w in ws}}

    def ceiling_step():
        best = float("inf")
        for mats, mul in layouts.values():
            t0 = time.perf_counter()
            for w, k in mats:
                mul(xs[k], w)
            best = min(best, time.perf_counter() - t0)
        return best

    def decode_step(pos):
        t0 = time.perf_counter()
        m.decode_forward(torch.randint(8, 32000, (S, 1)), torch.full((S,), pos), table, kv, greedy(S))
        return time.perf_counter() - t0

    def prefill_previous():
        """One call per prompt padded to its bucket, logits of every row (the previous code)."""
        t0 = time.perf_counter()
        for i in range(S):
            b = pick(buckets, n)
            tok = torch.zeros(1, b, dtype=torch.long)
            tok[0, :n] = prompts[i]
            valid = torch.arange(b)[None] < n
            pos = torch.where(valid, torch.arange(b)[None], 0)
            logits = m.model.forward(m.model.program("prefill", b), tok, pos, valid, table[i:i + 1], kv)
            logits[:, n - 1].argmax(-1)
        return time.perf_counter() - t0, S * pick(buckets, n), S

    def prefill_packed():
        t0 = time.perf_counter()
        rows = calls = 0
        for step in (list(range(S))[k:k + 8] for k in range(0, S, 8)):  # the scheduler's steps of 8
            for b, R, idx in pack_prefill([n] * len(step), buckets):
                N = b // R
                tok = torch.zeros(N, R, dtype=torch.long)
                lens = [0] * N
                for j, i in enumerate(idx):
                    tok[j, :n], lens[j] = prompts[step[i]], n
                pt = torch.zeros(N, per, dtype=torch.long)
                pt[:len(idx)] = table[[step[i] for i in idx]]
                m.prefill_forward(tok, pt, kv, lens, [0] * N, greedy(N))
                rows, calls = rows + b, calls + 1
        return time.perf_counter() - t0, rows, calls

    out = {"rounds": [], "prefill_buckets": a.prefill_buckets, "threads": threads,
           "load_average_1min": [round(os.getloadavg()[0], 2)]}
    with torch.no_grad():
        prefill_packed(), decode_step(n)  # warm
        for r in range(a.rounds):
            c = min(ceiling_step() for _ in range(3))
            d = statistics.median(decode_step(n + k) for k in range(5))
            (po, rows_o, calls_o), (pn, rows_n, calls_n) = prefill_previous(), prefill_packed()
            out["rounds"].append({"ceiling_step_s": c, "decode_step_s": d, "prefill_previous_s": po,
                                  "prefill_packed_s": pn, "rows_previous": rows_o, "rows_packed": rows_n,
                                  "calls_previous": calls_o, "calls_packed": calls_n})
            print(f"round {r}: ceiling step {c * 1e3:.1f} ms, decode step {d * 1e3:.1f} ms, prefill of {S} "
                  f"prompts previous {po:.2f} s ({calls_o} calls, {rows_o} rows) / packed {pn:.2f} s "
                  f"({calls_n} calls, {rows_n} rows)", file=sys.stderr)
    out["load_average_1min"].append(round(os.getloadavg()[0], 2))
    rs = out["rounds"]
    med = lambda f: statistics.median(f(x) for x in rs)  # noqa: E731
    out["decode_step_vs_ceiling_step"] = med(lambda x: x["ceiling_step_s"] / x["decode_step_s"])
    out["prefill_packed_speedup"] = med(lambda x: x["prefill_previous_s"] / x["prefill_packed_s"])
    # the run bench_serve makes (S prompts, then 127 decode steps), from this round's step costs
    steps = 127

    def run_ratio(x, pre):  # the run's tokens / its modeled seconds, over the ceiling's S / step
        return (steps + 1) * S / (pre + steps * x["decode_step_s"]) / (S / x["ceiling_step_s"])

    out["modeled_vs_ceiling_previous"] = med(lambda x: run_ratio(x, x["prefill_previous_s"]))
    out["modeled_vs_ceiling_packed"] = med(lambda x: run_ratio(x, x["prefill_packed_s"]))
    if a.json:
        print(json.dumps(out, indent=2))
        return
    from ttbundle.backends.emulated.gemm import describe as gemm_layout
    print(f"bench-160m, emulated N150, {threads} torch threads, weight GEMMs {gemm_layout()}, "
          f"prefill buckets {a.prefill_buckets}, "
          f"{len(rs)} rounds, load average {out['load_average_1min'][0]} -> {out['load_average_1min'][-1]}")
    print(f"  16-row decode step / ceiling step (bare weight matmuls): {out['decode_step_vs_ceiling_step']:.2f}x")
    print(f"  prefill of {S} x {n}-token prompts, packed vs previous: {out['prefill_packed_speedup']:.2f}x faster")
    print(f"  the bench's run from these step costs (prefill + 127 decode steps) vs the ceiling: previous "
          f"{out['modeled_vs_ceiling_previous']:.2f}x, packed {out['modeled_vs_ceiling_packed']:.2f}x")


if __name__ == "__main__":
    main()
