"""The decode token feed (``backends/ttnn/feed``: a step's sampled ids gathered into the next
decode's token input, inside the decode trace) through ttnn 0.81.1's own op validation on mock
meshes (``feed_mockcheck.py``, one process per mock cluster; ``mockcheck`` says what a mock
device checks: shapes, dtypes, layouts, memory configs, up to kernel compilation, no numerics).

* N150 and T3K: Llama-3.1-8B's smallest decode forward with device sampling, lowered for the
  mock mesh's own worker grid, passes whole (its feed calls included), and its feed calls alone
  are accepted by ttnn;
* TG: there is no mock descriptor for a Galaxy (``mockcluster``), so TG's lowered decode forward's
  feed calls (per-device and identical on every chip: nothing in them is sharded or collective)
  are validated on a mock Wormhole N150 chip, the chip a TG is made of;
* not vacuous: an index of another rank than the gathered tensor and a copy into ids of another
  shape are refused by ttnn itself (TT_FATAL before kernel compilation).

The numerics of the feed are checked on the computing recording double through vLLM's engine
(tests/runtime/test_runtime_tt_feed.py); on a device, not yet.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ttnn
HERE = Path(__file__).resolve().parent
SPEC = HERE.parents[1] / "bundles" / "llama-3.1-8b.yaml"
FEED = ["reshape", "concat", "gather", "reshape", "copy"]


def run(mock: str, targets: list[str], tmp: Path) -> dict:
    import importlib.util

    from ttbundle import mockcluster
    spec = importlib.util.find_spec("ttnn")
    if not (Path(spec.origin).parent / "runtime/sfpi/compiler/bin/riscv-tt-elf-g++").exists():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh)")
    env = mockcluster.mock_env(mock, tmp)
    env["PYTHONPATH"] = str(HERE.parents[1])
    r = subprocess.run([sys.executable, str(HERE / "feed_mockcheck.py"), mock, str(SPEC), *targets], cwd=tmp, env=env,
                       capture_output=True, text=True, timeout=900)
    out = {x["case"]: x for x in (json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT "))}
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def on_n150(tmp_path_factory):
    return run("N150", ["N150", "TG"], tmp_path_factory.mktemp("feed-n150"))


def assert_feed_accepted(res: dict) -> None:
    assert res["feed_fns"] == FEED, res
    assert res["refused"] == {} and res["accepted"] == res["calls"] == len(FEED), res


def test_the_n150_decode_forward_with_its_feed_passes_ttnn_validation(on_n150):
    fw = on_n150["N150:forward"]
    assert fw["feed_fns"] == FEED and fw["fns"][:4] == FEED[:4] and fw["fns"][-1] == "copy"
    assert fw["refused"] == {} and fw["accepted"] == fw["calls"] > len(FEED), fw
    assert_feed_accepted(on_n150["N150:feed"])


def test_tgs_feed_calls_pass_ttnn_validation_on_a_mock_wormhole_chip(on_n150):
    assert_feed_accepted(on_n150["TG:feed"])


@pytest.mark.parametrize("case,why", [("bad:index_rank", "same number of dimensions"),
                                      ("bad:copy_shape", "does not match output tensor shape")])
def test_a_broken_feed_is_refused_by_ttnn(on_n150, case, why):
    r = on_n150[case]
    fn = "gather" if "index" in case else "copy"
    assert list(r["refused"]) == [fn] and why in r["refused"][fn][1] and "TT_FATAL" in r["refused"][fn][1], r


@pytest.mark.slow
def test_the_t3k_decode_forward_with_its_feed_passes_ttnn_validation(tmp_path):
    res = run("T3K", ["T3K"], tmp_path)
    fw = res["T3K:forward"]
    assert fw["feed_fns"] == FEED
    # every call accepted, the collectives (which need a fabric a mock mesh cannot start) by signature
    assert fw["refused"] == {} and fw["accepted"] + sum(fw["by_signature"].values()) == fw["calls"], fw
    assert_feed_accepted(res["T3K:feed"])
