"""A/B of two ttbundle trees on the refactor-sensitive paths, one process per tree and run.

Run it from a tree (its ``ttbundle`` is imported; the tree is the current directory):

    cd TREE && .venv/bin/python BENCHES/bench_ab.py [--tokens 24] [--prompt 64] [--label NAME]

and alternate trees (before, after, before, after) so a host load that changes during the
session touches both alike. Prints one JSON line per run:

* ``validate_s``: ``spec.load`` + ``make_plan`` of every spec in ``--bundles`` (give both trees
  the same directory) for every target (what ``ttbundle validate`` does), median of ``--passes``;
* ``lower_s``: ``make_plan`` + ``lower_all`` of the benchmark model (``bench_model.SPEC``) for N150
  and T3K, median of ``--passes``;
* ``n150_step_ms`` / ``t3k_step_ms``: the emulated decode step (median of ``--tokens`` steps, N150
  and T3K interleaved, as ``bench_decode``), and ``hf_step_ms``: transformers' forward of one token
  with its KV cache on the same model in the same process (the same-run reference).

The script needs nothing of the tree beyond the public names both sides have (``make_plan``
from ``ttbundle.plan.make`` or, before the plan package, ``ttbundle.plan``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.getcwd())
sys.path.insert(1, os.path.join(os.getcwd(), "benches"))

import torch  # noqa: E402

from ttbundle import lower, reference, spec, weights  # noqa: E402
from ttbundle.backends.emulated import EmulatedModel, Runner  # noqa: E402

try:
    from ttbundle.plan.make import make_plan  # noqa: E402
except ImportError:  # before the plan package
    from ttbundle.plan import make_plan  # noqa: E402

from bench_model import SPEC  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--passes", type=int, default=5, help="validate and lower passes (median)")
    ap.add_argument("--label", default=os.path.basename(os.getcwd()))
    ap.add_argument("--bundles", default="bundles", help="the specs to validate (the same set for both trees)")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = {"label": args.label, "load1": os.getloadavg()[0]}

    runs = []
    for _ in range(args.passes):
        t0 = time.perf_counter()
        for f in sorted(glob.glob(os.path.join(args.bundles, "*.yaml"))):
            b = spec.load(f)
            for t in b.spec.targets:
                make_plan(b, t)
        runs.append(time.perf_counter() - t0)
    out["validate_s"] = round(statistics.median(runs), 3)

    bundle = spec.loads(SPEC, "bench-160m.yaml")
    hf = reference.random_model(bundle, seed=0)
    canon = weights.from_state_dict(bundle.family, bundle.arch, hf.state_dict())
    models, runs = {}, []
    for _ in range(args.passes):
        t0 = time.perf_counter()
        progs = {}
        for mesh in ("N150", "T3K"):
            plan = make_plan(bundle, mesh)
            progs[mesh] = (plan, lower.lower_all(bundle, plan))
        runs.append(time.perf_counter() - t0)
    out["lower_s"] = round(statistics.median(runs), 4)
    for mesh, (plan, ps) in progs.items():
        models[mesh] = EmulatedModel.from_canonical(bundle, plan, canon, ps)

    prompt = torch.randint(0, 32000, (args.prompt,)).tolist()
    state, times = {}, {m: [] for m in models}
    with torch.no_grad():
        for mesh, model in models.items():
            r = Runner(model)
            pt = list(range(r.max_blocks))
            state[mesh] = (r, pt, [int(r.prefill(prompt, pt).argmax())])
        hf_times = []
        ids = torch.tensor([prompt])
        hf_out = hf(ids, use_cache=True)
        past, nxt = hf_out.past_key_values, hf_out.logits[:, -1:].argmax(-1)
        for i in range(args.tokens - 1):
            for mesh, (r, pt, toks) in state.items():
                t0 = time.perf_counter()
                toks.append(int(r.decode([toks[-1]], [len(prompt) + i], [pt])[0].argmax()))
                times[mesh].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            o = hf(nxt, past_key_values=past, use_cache=True)
            hf_times.append(time.perf_counter() - t0)
            past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
    out["n150_step_ms"] = round(statistics.median(times["N150"]) * 1e3, 2)
    out["t3k_step_ms"] = round(statistics.median(times["T3K"]) * 1e3, 2)
    out["hf_step_ms"] = round(statistics.median(hf_times) * 1e3, 2)
    out["same_tokens"] = state["N150"][2] == state["T3K"][2]
    out["load1_end"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
