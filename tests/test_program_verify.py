"""The program verifier (``program.verify``): every lowered program of every published bundle
type-checks, and a package whose program lost a step, or reads a value another way than the steps
before it leave it, is refused when loaded (exit 1, one line naming program, layer and step)
instead of failing deep inside the executor."""

from __future__ import annotations

import glob
import json

import pytest

from ttbundle import spec as specmod
from ttbundle.lower import lower, trace_set
from ttbundle.plan.make import make_plan
from ttbundle.plan.sharding import target_mesh
from ttbundle.program import ProgramError
from ttbundle.serving.demo import build_package

from pkg_mutations import drop_first, edit_programs
from test_emulated import COMMON, TINY


@pytest.mark.parametrize("spec_file", sorted(glob.glob("bundles/*.yaml")))
def test_every_lowered_program_verifies(spec_file):
    b = specmod.load(spec_file)
    n = 0
    for t in b.spec.targets:
        plan = make_plan(b, target_mesh(b, t))
        for k in trace_set(b):
            lower(b, plan, *k).verify()
            n += 1
    assert n >= len(b.spec.targets)


@pytest.fixture(scope="module")
def t3k_package(tmp_path_factory):
    return build_package(TINY["llama"] + COMMON, tmp_path_factory.mktemp("pkg"), "T3K", warmup=False)


def _fresh(t3k_package, tmp_path):
    import shutil
    dst = tmp_path / "pkg"
    shutil.copytree(t3k_package, dst)
    return dst


def test_a_dropped_all_gather_is_refused_at_load_naming_program_layer_and_step(t3k_package, tmp_path, runner):
    from ttbundle.cli import app

    pkg = _fresh(t3k_package, tmp_path)
    assert edit_programs(pkg, "embedding", drop_first(lambda s: s.get("collective") == "all_gather")) > 0
    r = runner.invoke(app, ["check", str(pkg), "--steps", "2"])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    err = [x for x in r.output.splitlines() if x.startswith("[error]")]
    assert len(err) == 1
    assert "decoder step 0 (rms_norm)" in err[0] and "reads 'h'" in err[0] and "split" in err[0], err[0]


def test_a_step_reading_a_value_nothing_produced_is_refused(t3k_package, tmp_path):
    from ttbundle.package.load import load_package
    from ttbundle.package.names import PackageError

    pkg = _fresh(t3k_package, tmp_path)
    edit_programs(pkg, "decoder", drop_first(lambda s: s.get("op") == "swiglu"))
    with pytest.raises(PackageError, match=r"decoder step \d+ \(matmul\): reads 'gu', which no earlier step"):
        load_package(pkg).program_ir("prefill", 64)


def test_a_changed_dtype_or_weight_is_refused():
    b = specmod.load("bundles/llama-3.1-8b.yaml")
    plan = make_plan(b, target_mesh(b, b.spec.targets[0]))
    p = lower(b, plan, "decode", 1)
    d = p.to_json()
    for lp in d["layers"]:
        if lp["kind"] != "embedding":
            lp["steps"][1]["inputs"][0]["dtype"] = "fp32"
            break
    from ttbundle.program import Program
    with pytest.raises(ProgramError, match="as .* fp32"):
        Program.from_json(json.loads(json.dumps(d))).verify()
    d = p.to_json()
    d["layers"][1]["steps"][1]["w"] = "no_such_weight"
    with pytest.raises(ProgramError, match="weight 'no_such_weight'"):
        Program.from_json(d).verify()
