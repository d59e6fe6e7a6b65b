"""`ttbundle check` holds one decoder layer at a time: its peak memory does not grow with the
layer count. The same architecture with 2 and with 6 layers (each layer 15 M parameters, so that
layers would dominate), each checked in a fresh process; the peak RSS (VmHWM) of the 6-layer check
stays within 1.5 layers' float32 bytes (90 MB; measured: within 20 MB, the allocator's noise)
of the 2-layer one's, where holding either side's model whole would add 4 x 60 MB."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from ttbundle import reference, spec as specmod
from ttbundle.build import build

SPEC = """
name: mem-{layers}
model:
  family: llama
  vocab_size: 2048
  hidden_size: 1024
  intermediate_size: 4096
  num_hidden_layers: {layers}
  num_attention_heads: 8
  num_key_value_heads: 2
  head_dim: 128
  max_position_embeddings: 1024
targets: [N150]
buckets: {{prefill: [64, 128], decode: [1], prefill_chunk: 64}}
runtime: {{max_model_len: 256, max_num_seqs: 1}}
"""
LAYER_PARAMS = 1024 * 1024 * 2 + 2 * 1024 * 256 + 3 * 1024 * 4096

# the process's own high-water mark (VmHWM: ru_maxrss would carry the parent's over the exec)
CHECK = """
import json, sys
from ttbundle.check import check_package
r = check_package(sys.argv[1], sys.argv[2], steps=4)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"passed": r.passed, "layers": max(s.layer for s in r.layers), "hwm_kib": hwm}))
"""


def peak_rss(tmp_path, layers: int) -> tuple[int, dict]:
    b = specmod.loads(SPEC.format(layers=layers), f"mem-{layers}.yaml")
    ckpt = reference.save_random(b, tmp_path / f"ckpt{layers}", seed=1)
    w = b.spec.weights.model_copy(update={"source": str(ckpt)})
    b = dataclasses.replace(b, spec=b.spec.model_copy(update={"weights": w, "tokenizer": False}))
    pkg = build(b, "N150", tmp_path / f"out{layers}", warmup=False).package
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHECK, str(pkg), str(ckpt)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    return rep["hwm_kib"] * 1024, rep


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_peak_memory_does_not_grow_with_the_layer_count(tmp_path):
    small, r2 = peak_rss(tmp_path, 2)
    large, r6 = peak_rss(tmp_path, 6)
    assert r2["passed"] and r6["passed"] and (r2["layers"], r6["layers"]) == (2, 6)  # the head's index
    layer_fp32 = 4 * LAYER_PARAMS  # 60 MB
    print(f"peak RSS: {small / 2**20:.0f} MiB (2 layers), {large / 2**20:.0f} MiB (6 layers)")
    assert large - small < 1.5 * layer_fp32, (small / 2**20, large / 2**20)
