"""Host overhead of one decode step, emulated N150 against transformers (issue 38 part 1).

The one-row decode of ``bench_decode.py`` is within a few percent of transformers' step, and
both multiply by the same MKL kernel: what separates them is the per-step work around the
GEMMs (Python, torch dispatch). This bench measures that part alone: the benchmark model's
layout (Llama, 8 layers, GQA) shrunk until its arithmetic is negligible (hidden 64, vocab
512), one row, steps interleaved (emulated step, transformers step, ...) and timed in process
CPU time (one torch thread), so a loaded host changes the figure less than wall time would.

    python benches/bench_step_overhead.py [--steps 300]

Prints both per-step CPU times and their ratio (emulated / transformers: the overhead the
emulated mesh adds per step; a one-row step of the real model is ~25 ms, so 1 ms here is ~4%).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench_decode import HFSteps, emulated_runners  # noqa: E402
from bench_model import SPEC  # noqa: E402
from ttbundle import reference, spec, weights  # noqa: E402
from ttbundle.backends.emulated import Runner  # noqa: E402

TINY = {"vocab_size: 32000": "vocab_size: 512", "hidden_size: 1024": "hidden_size: 64",
        "intermediate_size: 2816": "intermediate_size: 128", "num_attention_heads: 16": "num_attention_heads: 4",
        "num_key_value_heads: 8": "num_key_value_heads: 2"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    text = SPEC
    for a, b in TINY.items():
        assert a in text, a
        text = text.replace(a, b)
    bundle = spec.loads(text, "bench-overhead.yaml")
    hf = reference.random_model(bundle, seed=0)
    canon = weights.from_state_dict(bundle.family, bundle.arch, hf.state_dict())
    model = emulated_runners(bundle, canon, ("N150",), "cpu")["N150"]
    prompt = torch.randint(0, 512, (1, args.prompt)).tolist()
    block = int(model.kv_layout["block_size"])
    blocks = list(range(-(-(args.prompt + args.steps) // block)))
    runner = Runner(model, num_blocks=len(blocks))
    warm = 20
    with torch.no_grad():
        tok = int(runner.prefill(prompt[0], blocks).argmax())
        ref = HFSteps(hf, prompt, "cpu")
        emu_s = hf_s = 0.0
        same = True
        for i in range(args.steps):
            a = time.process_time()
            e = int(runner.decode([tok], [args.prompt + i], [blocks]).argmax(-1)[0])
            b = time.process_time()
            h = ref.step([tok])[0]
            c = time.process_time()
            same &= e == h
            tok = h
            if i >= warm:
                emu_s, hf_s = emu_s + b - a, hf_s + c - b
    n = args.steps - warm
    print(f"one-row decode step, CPU time (1 thread, {n} steps, load average {os.getloadavg()[0]:.1f}): "
          f"emulated N150 {emu_s / n * 1e3:.3f} ms, transformers {hf_s / n * 1e3:.3f} ms; "
          f"emulated / transformers {emu_s / hf_s:.2f}x; greedy tokens equal: {same}")


if __name__ == "__main__":
    main()
