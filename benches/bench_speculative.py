"""Decode tokens/s with and without speculative decoding (ngram, or a draft model), same
package, same run.

The demo bundle (bundles/demo.yaml: the 4-layer Llama trained on the King James Bible) built for
N150 with `speculative: {method: ngram}` added, served by vLLM's own engine in-process on the
emulated mesh twice: once with the package's `--speculative-config`, once without it (the same
package: its decode programs, no verify step). The workload is repetitive (each prompt is a verse
written out three times, greedy continuation), the case prompt lookup is for. Prints, per
concurrency: generated tokens/s both ways, the ratio, and vLLM's spec-decode metrics (proposals,
acceptances, acceptance rate, tokens per verify step). Greedy tokens must be identical both ways
(checked).

``--method draft``: `speculative: {method: draft}` with a layer-skip draft of the demo itself
(its first ``--draft-layers`` decoder layers, the same embedding, final norm and head: the same
tokenizer by construction), on the same repetitive workload; then the draft proposer alone,
replaying that run's greedy tokens, two ways interleaved in the same process (A: a request's
catch-up in decode steps, one per token behind, as before the draft had catch-up programs; B:
the catch-up and the first proposal in one call of the draft's verify program): seconds, draft
calls, and whether both proposed the same tokens (``--proposer-rounds``, 0: skip).

Run: .venv/bin/python benches/bench_speculative.py [--tokens 96] [--streams 1,8] [--k 3]
     [--method ngram|draft] [--draft-layers 2] [--proposer-rounds 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TTBUNDLE_EMULATED", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VERSES = [
    "In the beginning God created the heaven and the earth.",
    "And God said, Let there be light: and there was light.",
    "The LORD is my shepherd; I shall not want.",
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel.",
    "Blessed are the meek: for they shall inherit the earth.",
    "And he said unto them, Go ye into all the world, and preach the gospel.",
    "For God so loved the world, that he gave his only begotten Son.",
    "And it came to pass in those days, that there went out a decree.",
]


def build(k: int, out: Path, method: str = "ngram", draft_layers: int = 2) -> tuple[Path, dict]:
    from ttbundle import spec as specmod
    from ttbundle.build import build as build_package
    from ttbundle.package.names import DRAFT_DIR
    from ttbundle.speculative import vllm_config

    d = yaml.safe_load((ROOT / "bundles" / "demo.yaml").read_text())
    d["weights"]["source"] = str(ROOT / "bundles" / "demo")
    d["tokenizer"] = str(ROOT / "bundles" / "demo")
    d["targets"] = ["N150"]
    if method == "draft":
        dd = dict(d, name="demo-draft", model=dict(d["model"], num_hidden_layers=draft_layers))
        dd["weights"] = {"source": str(_layer_skip(out / "demo-draft-src", draft_layers))}
        (out / "demo-draft.yaml").write_text(yaml.safe_dump(dd, sort_keys=False))
        d["speculative"] = {"method": "draft", "model": "demo-draft.yaml", "num_speculative_tokens": k}
    else:
        d["speculative"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 4}
    f = out / f"demo-with-{method}.yaml"
    f.write_text(yaml.safe_dump(d, sort_keys=False))
    bundle = specmod.load(f)
    pkg = Path(build_package(bundle, "N150", out).package)
    return pkg, vllm_config(bundle, pkg / DRAFT_DIR)


def _layer_skip(dst: Path, layers: int) -> Path:
    """The demo checkpoint cut to its first ``layers`` decoder layers (a layer-skip draft)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = ROOT / "bundles" / "demo"
    shutil.copytree(src, dst)
    sd = load_file(src / "model.safetensors")
    keep = {k: v for k, v in sd.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def serve(pkg: Path, spec_cfg: dict | None, streams: list[int], tokens: int):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(pkg), dtype="float32", seed=0, disable_log_stats=False, speculative_config=spec_cfg)
    try:
        sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        llm.generate([VERSES[0]], SamplingParams(max_tokens=4), use_tqdm=False)  # first-request costs
        res = {}
        for n in streams:
            prompts = [" ".join([VERSES[i % len(VERSES)]] * 3) for i in range(n)]
            before = _spec_metrics(llm)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            after = _spec_metrics(llm)
            toks = [list(o.outputs[0].token_ids) for o in outs]
            res[n] = (sum(map(len, toks)) / dt, toks, {k: after.get(k, 0) - before.get(k, 0) for k in after},
                      [list(o.prompt_token_ids) for o in outs])
        return res
    finally:
        llm.llm_engine.engine_core.shutdown()


def proposer_ab(pkg: Path, k: int, prompts: list[list[int]], outputs: list[list[int]], rounds: int) -> dict:
    """The draft proposer alone, replaying a greedy run (``prompts``, the target's ``outputs``):
    each step it proposes ``k`` tokens per sequence, the longest prefix agreeing with the target's
    tokens is kept plus the target's next token (what the verify step keeps, greedy). Two ways,
    interleaved ``rounds`` times in this process (the same load on both): A catches a request up
    with decode steps, one per token behind (a draft without catch-up programs); B with one call
    of the draft's verify program when any is two or more behind. Returns seconds, draft calls
    and steps per way, and whether both proposed the same tokens."""
    from ttbundle.runtime.draft import DraftProposer
    from ttbundle.runtime.packages import open_package

    target = open_package(pkg)
    p = DraftProposer(target, k, target.bundle.spec.runtime.max_model_len)
    rows = p.catch_up_rows
    out = {w: {"seconds": 0.0, "calls": 0, "steps": 0} for w in "AB"}
    proposals = {}
    for _ in range(rounds):
        for way in "AB":
            p.catch_up_rows, p.slots = (0 if way == "A" else rows), {}
            seqs = {f"s{i}": list(t) for i, t in enumerate(prompts)}
            done = {r: 0 for r in seqs}  # the target's tokens each sequence holds
            got, calls0 = [], sum(p.model.programs_run.values())
            while True:
                live = [(r, seqs[r]) for r in seqs if done[r] < len(outputs[int(r[1:])]) - 1]
                if not live:
                    break
                t0 = time.perf_counter()
                props = p.propose_batch(live)
                out[way]["seconds"] += time.perf_counter() - t0
                out[way]["steps"] += 1
                got.append(props)
                for (r, toks), pr in zip(live, props):
                    truth = outputs[int(r[1:])][done[r]:]
                    a = 0
                    while a < len(pr) and a < len(truth) - 1 and pr[a] == truth[a]:
                        a += 1
                    seqs[r] = toks + truth[:a + 1]
                    done[r] += a + 1
            out[way]["calls"] += sum(p.model.programs_run.values()) - calls0
            proposals.setdefault(way, got)
    out["same_proposals"] = proposals["A"] == proposals["B"]
    return out


def _spec_metrics(llm) -> dict:
    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_") and hasattr(m, "value")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--proposer-rounds", type=int, default=3,
                    help="draft: A/B rounds of the proposer alone (catch-up by decode steps vs one call)")
    args = ap.parse_args()
    streams = [int(x) for x in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        pkg, cfg = build(args.k, Path(tmp), args.method, args.draft_layers)
        with_spec = serve(pkg, cfg, streams, args.tokens)
        without = serve(pkg, None, streams, args.tokens)
        ab = {n: proposer_ab(pkg, args.k, with_spec[n][3], with_spec[n][1], args.proposer_rounds)
              for n in streams} if args.method == "draft" and args.proposer_rounds else {}
    how = (f"ngram k={args.k} (prompt_lookup {cfg['prompt_lookup_min']}-{cfg['prompt_lookup_max']})"
           if args.method == "ngram" else f"draft k={args.k} (the demo's first {args.draft_layers} layers)")
    print(f"demo bundle, N150 (emulated), greedy, {args.tokens} tokens per stream, {how}")
    print(f"| streams | without: tok/s | with {args.method}: tok/s | ratio | proposed | accepted | acceptance | "
          "tokens per verify | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in streams:
        a, ta, m, _ = with_spec[n]
        b, tb, _, _ = without[n]
        drafts, acc, steps = m.get("num_draft_tokens", 0), m.get("num_accepted_tokens", 0), m.get("num_drafts", 0)
        per = (acc + steps) / steps if steps else 0.0
        print(f"| {n} | {b:.1f} | {a:.1f} | {a / b:.2f}x | {drafts:.0f} | {acc:.0f} | "
              f"{acc / drafts if drafts else 0:.2f} | {per:.2f} | {ta == tb} |")

    if ab:
        print(f"\nthe draft proposer alone, replaying the greedy run, {args.proposer_rounds} interleaved A/B rounds "
              "(A: catch-up by decode steps; B: catch-up and first proposal in one call)")
        print("| streams | A: s | B: s | B/A time | A: draft calls | B: draft calls | steps | same proposals |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for n, r in ab.items():
            A, B = r["A"], r["B"]
            print(f"| {n} | {A['seconds']:.2f} | {B['seconds']:.2f} | {B['seconds'] / A['seconds']:.2f}x | "
                  f"{A['calls']} | {B['calls']} | {A['steps']} | {r['same_proposals']} |")


if __name__ == "__main__":
    main()