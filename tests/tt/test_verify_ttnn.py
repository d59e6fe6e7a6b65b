"""Speculative decoding's verify programs against ttnn's own op validation on mock chips: real
bundles given ``speculative: {method: ngram, num_speculative_tokens: 3}``, their smallest decode
program and every verify program (each decoder layer kind once) planned and lowered here, handed
over, and run by ``python -m ttbundle.ttnnproc mockcheck`` on a mock N150 and a mock T3K (as
test_lowering_coverage_ttnn does for prefill and decode). The verify forward is decode's lowering
over ``B x (k + 1)`` rows with host sampling (every row's logits back), its KV writes and
attention run per group of the sequences' row ``j`` (``k + 1`` decode batches of ``B`` rows): the
largest bucket's 128 rows as one height-sharded write would ask for 128 cores (ttnn refuses:
"Target number of cores 128 is greater than total number of available cores 64")."""

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

    from handover_helpers import for_mesh, one_layer_per_kind

    from ttbundle import __version__, lower as lowermod, mockcluster
    from ttbundle.backends.ttnn import handover
    from ttbundle.package.templates import render_bundle_yaml, resolved_spec
    spec = importlib.util.find_spec("ttnn")
    if not (Path(spec.origin).parent / "runtime/sfpi/compiler/bin/riscv-tt-elf-g++").exists():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh)")
    env = mockcluster.mock_env(mesh, tmp_path)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # this checkout's ttbundle in the subprocess
    specs = [str(BUNDLES / f"{b}.yaml") for b in VALIDATE[mesh]]
    dirs, handed = [], set()
    for path in specs:  # the smallest decode program and every verify program
        bundle, plan = for_mesh(path, mesh, NGRAM)
        ts = lowermod.trace_set(bundle)
        keys = [min(k for k in ts if k[0] == "decode")] + [k for k in ts if k[0] == "verify"]
        yml = render_bundle_yaml(resolved_spec(bundle, plan), __version__)
        progs = {k: one_layer_per_kind(lowermod.lower(bundle, plan, *k)) for k in keys}
        dirs.append(str(handover.write(tmp_path / "programs" / Path(path).stem, yml, progs)))
        handed |= {(dirs[-1], b) for ph, b in keys if ph == "verify"}
    r = subprocess.run([sys.executable, "-m", "ttbundle.ttnnproc", "mockcheck", mesh, *dirs], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    results = [json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    verify = [x for x in results if x["phase"] == "verify"]
    decode = {x["dir"]: x for x in results if x["phase"] == "decode"}
    assert {(x["dir"], x["bucket"]) for x in verify} == handed and len(verify) == len(handed)
    assert max(b for _, b in handed) == 32  # 128 rows: more than a chip's cores
    bad = [f"{Path(x['dir']).name} {x['phase']}-{x['bucket']}: {fn} ({op}): {msg[:300]}"
           for x in results for fn, (op, msg) in x["refused"].items()]
    assert not bad, "\n".join(bad)
    assert all(x["accepted"] + sum(x["by_signature"].values()) == x["calls"] > 0 for x in results)
    # what was validated: the verify forward writes each cache k + 1 times where decode writes it
    # once (one row of each sequence per call), and its head returns logits (no sampling call)
    from ttbundle.backends.ttnn.lowering import lower_forward
    from ttbundle.ttnnproc import handed_over
    for d in dirs:
        bundle, pmesh, progs = handed_over(d)
        fws = {k: lower_forward(bundle, pmesh, p, "host" if k[0] == "verify" else "device") for k, p in progs.items()}
        writes = {k: sum(c.fn == "experimental.paged_update_cache" for _, c in fw.calls()) for k, fw in fws.items()}
        (dec,) = [k for k in fws if k[0] == "decode"]
        for k, fw in fws.items():
            if k[0] == "verify":
                assert writes[k] == (K + 1) * writes[dec] > 0, writes
                assert fw.outputs == ["logits.out"] and not any(c.fn == "sampling" for _, c in fw.calls())


def test_the_kernel_cache_fill_runs_the_verify_programs_host_sampled(tmp_path):
    """``python -m ttbundle.ttnnproc kernelcache DIR MESH`` (what ``build --backend ttnn`` runs
    to fill the kernel cache) runs a verify program once, host-sampled, its calls accepted by the
    mock chip; decode in both sampling variants."""
    import importlib.util

    from handover_helpers import hand_over

    from ttbundle import mockcluster
    spec = importlib.util.find_spec("ttnn")
    if not (Path(spec.origin).parent / "runtime/sfpi/compiler/bin/riscv-tt-elf-g++").exists():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh)")
    env = mockcluster.mock_env("N150", tmp_path)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    (d,) = hand_over([str(BUNDLES / "llama-3.1-8b.yaml")], "N150", tmp_path / "programs", NGRAM)
    r = subprocess.run([sys.executable, "-m", "ttbundle.ttnnproc", "kernelcache", d, "N150"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = [ln.split(":")[0] for ln in r.stdout.splitlines() if " calls, refused " in ln]
    assert [x for x in runs if x.startswith(("decode", "verify"))] == ["decode-1 device", "decode-1 host", "verify-1 host"]
    assert all(ln.endswith("refused []") for ln in r.stdout.splitlines() if " calls, refused " in ln), r.stdout
