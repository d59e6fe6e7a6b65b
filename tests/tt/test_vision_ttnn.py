"""The vision encoder's ttnn lowering through ttnn's own op validation on a mock chip (as the
text families are in test_lowering_coverage_ttnn.py): every call of the smallest vision program
(each layer kind once) must get as far as kernel compilation, beside the multimodal model's
smallest prefill and decode. Specs: the tiny Gemma 3 VLM of the emulated tests, and Gemma-3-4B-it
at published dims (SigLIP: 4096 patches, head dim 72, which ttnn's fused SDPA cannot pad); the
tiny Qwen2.5-VL of the emulated tests and Qwen2.5-VL-7B-Instruct at published dims (window
attention by a host-made mask over the bucket's 5120 patches, 2-D rope by per-row cos / sin
inputs, the 2x2 patch merger as a reshape); the tiny Mistral 3 of the emulated tests (Pixtral's
2-D rope and image mask as Qwen's, no biases; the merger's channel-major unfold as a reshape,
a transpose and a reshape).

On a mock T3K the non-collective calls are validated the same way, on the worker grid the mock
device reports (8x7); all_gather / all_reduce need a fabric a mock mesh cannot start and are
checked by signature and output spec instead (``mockcheck``), counted apart and required: the
vision tower's tensor-parallel attention ends in an all_reduce (so does its MLP, except
Qwen2.5-VL-7B's, replicated on T3K)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spec_helpers import TINY_MISTRAL3, TINY_Q3VL, TINY_QVL, TINY_VL

BUNDLES = Path(__file__).resolve().parents[2] / "bundles"


@pytest.mark.parametrize("mesh", ["N150", pytest.param("T3K", marks=pytest.mark.slow)])
def test_vision_programs_pass_ttnn_op_validation_on_a_mock_chip(mesh, tmp_path):
    import importlib.util

    from ttbundle import mockcluster
    spec = importlib.util.find_spec("ttnn")
    if spec is None or not (Path(spec.origin).parent / "runtime/sfpi/compiler/bin/riscv-tt-elf-g++").exists():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh)")
    tiny = tmp_path / "tiny-vl.yaml"
    tiny.write_text(TINY_VL)
    tiny_q = tmp_path / "tiny-qwen-vl.yaml"
    tiny_q.write_text(TINY_QVL)
    tiny_q3 = tmp_path / "tiny-qwen3-vl.yaml"
    tiny_q3.write_text(TINY_Q3VL)
    tiny_m = tmp_path / "tiny-mistral3.yaml"
    tiny_m.write_text(TINY_MISTRAL3)
    specs = [str(tiny), str(BUNDLES / "gemma-3-4b-it.yaml"), str(tiny_q),
             str(BUNDLES / "qwen2.5-vl-7b-instruct.yaml"), str(tiny_q3), str(BUNDLES / "qwen3-vl-8b-instruct.yaml"),
             str(tiny_m)]
    env = mockcluster.mock_env(mesh, tmp_path)
    from handover_helpers import hand_over
    dirs = hand_over(specs, mesh, tmp_path / "programs")  # planned and lowered here, not in the backend
    r = subprocess.run([sys.executable, "-m", "ttbundle.ttnnproc", "mockcheck", mesh, *dirs], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    results = [json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and len(results) == 3 * len(specs), r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted({x["phase"] for x in results}) == ["decode", "prefill", "vision"]
    bad = [f"{Path(x['dir']).name} {x['phase']}-{x['bucket']}: {fn} ({op}): {msg[:300]}"
           for x in results for fn, (op, msg) in x["refused"].items()]
    assert not bad, "\n".join(bad)
    assert all(x["accepted"] + sum(x["by_signature"].values()) == x["calls"] > 0 for x in results)
    assert all(x["accepted"] > sum(x["by_signature"].values()) for x in results)
    if mesh == "T3K":
        assert all(x["grid"] == [8, 7] for x in results)
        assert all(x["by_signature"].get("all_reduce") for x in results)
        assert all(x["by_signature"].get("all_gather") for x in results if x["phase"] != "vision")
    else:
        assert all(x["by_signature"] == {} for x in results)
