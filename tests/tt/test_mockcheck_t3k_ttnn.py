"""mockcheck on a mock T3K is not vacuous: the same forward that passes (every non-collective
call accepted by ttnn, the collectives counted apart as checked by signature) is refused when
one argument is wrong. Each case edits one call of Llama-3.1-8B's smallest decode program on
T3K and runs :func:`mockcheck.validate` on the mock mesh (one process, one mesh):

* ``grid88``: lowered for the 8x8 grid ``compute_with_storage_grid_size()`` reports with the
  default dispatch: ttnn's program validation refuses the cores on row 7;
* ``axis2``: an all_gather over cluster_axis 2 of a 2-D mesh: refused by ttnn itself (before it
  looks for the fabric);
* ``axis0``: an all_gather over cluster_axis 0 (2 devices) where the lowering expects the
  gathered dim x4 (axis 1): refused by the output-spec arithmetic of ``check_by_signature``;
* ``kwarg``: an all_reduce given a keyword the wheel's all_reduce does not take: refused by the
  wheel's own binding ("incompatible function arguments"), before any fabric lookup;
* ``mem``: a non-collective call (the first ``linear``) told to write an L1 height-sharded output
  without a shard spec: refused by ttnn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ttnn
BUNDLES = Path(__file__).resolve().parents[2] / "bundles"

SCRIPT = r"""
import dataclasses, json, sys
import ttnn, yaml
from ttbundle import lower as lowermod, spec as specmod, mesh as meshmod
from ttbundle.plan.make import make_plan
from ttbundle.backends.ttnn import mockcheck
from ttbundle.backends.ttnn.calls import Attr
from ttbundle.backends.ttnn.lowering import lower_forward

d = yaml.safe_load(open(sys.argv[1])); d["targets"] = ["T3K"]; d.get("weights", {}).pop("source", None)
bundle = specmod.loads(yaml.safe_dump(d), sys.argv[1])
plan = make_plan(bundle, "T3K")
ts = lowermod.trace_set(bundle)
ir = lowermod.lower(bundle, plan, *min(k for k in ts if k[0] == "decode"))
ir = dataclasses.replace(ir, layers=tuple(dataclasses.replace(lp, count=1) for lp in ir.layers))  # each kind once
device = mockcheck.open_mesh(ttnn, meshmod.resolve("T3K"))
grid = mockcheck.worker_grid(device)

def edit(fw, fn, **kw):
    for layer in fw.layers:
        for i, c in enumerate(layer.calls):
            if c.fn == fn:
                layer.calls[i] = dataclasses.replace(c, kwargs=tuple(sorted({**dict(c.kwargs), **kw}.items())))
                return fw
    raise SystemExit(f"no {fn} call")

cases = {
    "ok": lambda: lower_forward(bundle, plan.mesh, ir, "device", grid=grid),
    "grid88": lambda: lower_forward(bundle, plan.mesh, ir, "device", grid=(8, 8)),
    "axis2": lambda: edit(lower_forward(bundle, plan.mesh, ir, "device", grid=grid), "all_gather", cluster_axis=2),
    "axis0": lambda: edit(lower_forward(bundle, plan.mesh, ir, "device", grid=grid), "all_gather", cluster_axis=0),
    "kwarg": lambda: edit(lower_forward(bundle, plan.mesh, ir, "device", grid=grid), "all_reduce", scatter_dim=3),
    "mem": lambda: edit(lower_forward(bundle, plan.mesh, ir, "device", grid=grid), "linear",
                        memory_config=Attr("L1_HEIGHT_SHARDED_MEMORY_CONFIG")),
}
try:
    for name, make in cases.items():
        r = mockcheck.validate(ttnn, device, ir, make())
        print("RESULT " + json.dumps({"case": name, "grid": list(grid), "calls": r.calls,
                                      "accepted": sum(r.accepted.values()), "by_signature": dict(r.by_signature),
                                      "refused_calls": sum(r.refusals.values()),
                                      "refused": {fn: list(v) for fn, v in r.refused.items()}}), flush=True)
finally:
    ttnn.close_mesh_device(device)
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    import importlib.util

    from ttbundle import mockcluster
    spec = importlib.util.find_spec("ttnn")
    if spec is None or not (Path(spec.origin).parent / "runtime/sfpi/compiler/bin/riscv-tt-elf-g++").exists():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh)")
    tmp = tmp_path_factory.mktemp("t3k")
    (tmp / "cases.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(tmp / "cases.py"), str(BUNDLES / "llama-3.1-8b.yaml")], cwd=tmp,
                       env=mockcluster.mock_env("T3K", tmp), capture_output=True, text=True, timeout=600)
    out = {x["case"]: x for x in (json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT "))}
    assert r.returncode == 0 and len(out) == 6, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_the_forward_passes_on_the_mock_t3ks_own_worker_grid(cases):
    ok = cases["ok"]
    assert ok["grid"] == [8, 7]  # what the mock T3K's chips (two harvested rows, worker dispatch row) report
    assert ok["refused"] == {}
    assert ok["by_signature"].get("all_gather", 0) > 0 and ok["by_signature"].get("all_reduce", 0) > 0
    assert ok["accepted"] + sum(ok["by_signature"].values()) == ok["calls"] > 0


def test_every_call_is_accepted_refused_or_checked_by_signature(cases):
    for r in cases.values():
        assert r["accepted"] + r["refused_calls"] + sum(r["by_signature"].values()) == r["calls"], r
        assert (r["refused_calls"] > 0) == bool(r["refused"]), r


def test_ops_configured_for_row_7_are_refused(cases):
    msgs = [m for _, m in cases["grid88"]["refused"].values()]
    # refused by the ops' own checks of the device grid: a matmul config "(8, 8) must fit within
    # device grid (8, 7)", SDPA decode "Cores available (64) exceeds grid size (56)" (8 x 7)
    assert "linear" in cases["grid88"]["refused"], cases["grid88"]["refused"]
    assert msgs and all("(8, 7)" in m or f"grid size ({8 * 7})" in m for m in msgs), cases["grid88"]["refused"]
    assert cases["grid88"]["accepted"] < cases["ok"]["accepted"]


@pytest.mark.parametrize("case,why", [("axis2", "index out of range"), ("axis0", "expects output shape"),
                                      ("kwarg", "incompatible function arguments")])
def test_a_wrong_collective_argument_is_refused(cases, case, why):
    r = cases[case]
    assert r["refused"], r
    fn = "all_reduce" if case == "kwarg" else "all_gather"
    assert fn in r["refused"] and why in r["refused"][fn][1], r["refused"]
    assert r["by_signature"].get(fn, 0) < cases["ok"]["by_signature"][fn]


def test_a_wrong_memory_config_on_a_compute_op_is_refused(cases):
    r = cases["mem"]
    assert list(r["refused"]) == ["linear"], r["refused"]
    assert r["accepted"] < cases["ok"]["accepted"]
