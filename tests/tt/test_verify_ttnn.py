"""Speculative decoding's verify programs against ttnn's own op validation on mock chips: real
bundles given ``speculative: {method: ngram, num_speculative_tokens: 3}``, their smallest decode
and verify programs (each decoder layer kind once) planned and lowered here, handed over, and run
by ``python -m ttbundle.backends.ttnn.mockcheck`` on a mock N150 and a mock T3K (as
test_lowering_coverage_ttnn does for prefill and decode). The verify forward is decode's lowering
over ``B x (k + 1)`` rows with host sampling (every row's logits back), its KV cache written by
``k + 1`` ``paged_update_cache`` calls per cache (one row of each sequence per call)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ttnn
BUNDLES = Path(__file__).resolve().parents[2] / "bundles"
K = 3
NGRAM = {"speculative": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3}}
VALIDATE = {"N150": ["gemma-3-27b", "llama-3.1-8b"],
            "T3K": ["llama-3.1-8b"]}


@pytest.mark.parametrize("mesh", [pytest.param(m, marks=pytest.mark.slow) if m == "T3K" else m for m in sorted(VALIDATE)])
def test_verify_programs_pass_ttnn_op_validation_on_a_mock_mesh(mesh, tmp_path):
    import importlib.util

    from handover_helpers import hand_over

    from ttbundle import mockcluster
    spec = importlib.util.find_spec("ttnn")
    if not (Path(spec.origin).parent / "runtime/sfpi/compiler/bin/riscv-tt-elf-g++").exists():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh)")
    env = mockcluster.mock_env(mesh, tmp_path)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # this checkout's ttbundle in the subprocess
    specs = [str(BUNDLES / f"{b}.yaml") for b in VALIDATE[mesh]]
    dirs = hand_over(specs, mesh, tmp_path / "programs", NGRAM)
    r = subprocess.run([sys.executable, "-m", "ttbundle.backends.ttnn.mockcheck", mesh, *dirs], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    results = [json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    verify = [x for x in results if x["phase"] == "verify"]
    decode = {x["dir"]: x for x in results if x["phase"] == "decode"}
    assert sorted(Path(x["dir"]).name for x in verify) == VALIDATE[mesh]
    bad = [f"{Path(x['dir']).name} {x['phase']}-{x['bucket']}: {fn} ({op}): {msg[:300]}"
           for x in results for fn, (op, msg) in x["refused"].items()]
    assert not bad, "\n".join(bad)
    assert all(x["accepted"] + sum(x["by_signature"].values()) == x["calls"] > 0 for x in results)
    # what was validated: the verify forward writes each cache k + 1 times where decode writes it
    # once (one row of each sequence per call), and its head returns logits (no sampling call)
    from ttbundle.backends.ttnn import handover
    from ttbundle.backends.ttnn.lowering import lower_forward
    for d in dirs:
        bundle, pmesh, progs = handover.read(d)
        fws = {ph: lower_forward(bundle, pmesh, p, "host" if ph == "verify" else "device")
               for (ph, _), p in progs.items() if ph in ("decode", "verify")}
        writes = {ph: sum(c.fn == "experimental.paged_update_cache" for _, c in fw.calls()) for ph, fw in fws.items()}
        assert writes["verify"] == (K + 1) * writes["decode"] > 0, writes
        assert fws["verify"].outputs == ["logits.out"]
        assert not any(c.fn == "sampling" for _, c in fws["verify"].calls())
