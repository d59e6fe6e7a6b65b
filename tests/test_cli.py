"""The command line through typer's CliRunner: exit codes, exact lines on stdout / stderr, JSON."""

from __future__ import annotations

import copy
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from spec_helpers import DELETE, LLAMA_70B, TINY, col_of, deep_update, dump, line_of, spec_text
from test_mesh import GALAXIES, PLUGIN_SHAPES, WH_DRAM
from test_spec import BASE, mutated_specs
from ttbundle.cli import app

DEMO = Path(__file__).parent.parent / "bundles" / "demo.yaml"


def run(runner, *args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


# ---- validate ------------------------------------------------------------------------------------
def test_validate_ok_line(runner, tmp_path):
    demo = tmp_path / "demo.yaml"
    # the demo spec names its checkpoint relative to itself: copy the whole bundles/ entry
    shutil.copy(DEMO, demo)
    if (DEMO.parent / "demo").is_dir():
        shutil.copytree(DEMO.parent / "demo", tmp_path / "demo")
    r = run(runner, "validate", demo)
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0] == f"{demo}: valid; fits N150, N300, T3K"
    # then whether the emulated mesh fits this host, per target (tests/test_serve_memory.py)
    assert [x.split(":")[0] for x in lines[1:]] == [f"  {t}, emulated on this host" for t in ("N150", "N300", "T3K")]
    assert r.stderr == ""


def test_validate_one_mesh(runner, write_spec):
    p = write_spec(spec_text({"targets": ["N150", "T3K"]}))
    r = run(runner, "validate", p, "--mesh", "N300")
    assert r.exit_code == 0 and r.stdout.splitlines()[0] == f"{p}: valid; fits N300"
    assert len(r.stdout.splitlines()) == 2 and "N300, emulated on this host: " in r.stdout


def test_validate_invalid_lists_every_located_error_on_stderr(runner, write_spec):
    text = spec_text({"targets": ["N150", "T3000"], "buckets": {"decode": [1, 5, 32]},
                      "runtime": {"max_model_len": 8192}})
    p = write_spec(text)
    r = run(runner, "validate", p)
    assert r.exit_code == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines[0] == f"[error] {p}: invalid spec"
    assert len(lines) == 4
    assert lines[1].startswith(f"  {p}:{line_of(text, '- T3000')}:3: targets.1: unknown mesh 'T3000'; valid: N150, ")
    assert lines[2] == (f"  {p}:{line_of(text, '- 5')}:{col_of(text, '- 5')}: buckets.decode.1: decode batch 5 is not a "
                        "traceable size; use one of 1, 2, 4, 8, 16, 32")
    assert lines[3] == (f"  {p}:{line_of(text, 'max_model_len:')}:3: runtime.max_model_len: "
                        "max_model_len=8192 exceeds the model's max_position_embeddings=4096")


def test_validate_divisibility_error(runner, write_spec):
    text = spec_text({"targets": ["N300", "T3K"], "model": {
        "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944}})
    p = write_spec(text)
    r = run(runner, "validate", p)
    assert r.exit_code == 2
    lines = r.stderr.splitlines()
    assert lines[0] == f"[error] {p}: invalid spec"
    assert lines[1].startswith(f"  {p}:{line_of(text, '- T3K')}:3: targets.1: wq, wo (family default plan): "
                               "num_attention_heads=28 is not divisible by mesh axis cols=8 (T3K 1x8); fix: ")
    assert len(lines) == 2
    assert run(runner, "validate", p, "--mesh", "N300").exit_code == 0


def test_validate_json(runner, write_spec):
    text = spec_text({"runtime": {"max_model_len": 8192}})
    r = run(runner, "validate", write_spec(text), "--json")
    assert r.exit_code == 2
    data = json.loads(r.stdout)
    assert data["valid"] is False
    (e,) = data["errors"]
    assert (e["path"], e["line"], e["col"], e["file"]) == ("runtime.max_model_len", line_of(text, "max_model_len:"),
                                                           3, str(write_spec(text)))
    r = run(runner, "validate", write_spec(spec_text({"targets": ["N150", "T3K"]})), "--json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert set(data.pop("emulated_host")) == {"N150", "T3K"}
    assert data == {"valid": True, "fits": {"N150": True, "T3K": True}, "warnings": []}


@pytest.mark.parametrize("args, needle", [
    (["validate", "{missing}"], "no such spec file"),
    (["plan", "{missing}"], "no such spec file"),
    (["validate", "{spec}", "--mesh", "T3000"], "unknown mesh 'T3000'; valid: N150, N300, N150x4, T3K, TG"),
    (["plan", "{spec}", "--mesh", "(0,8)"], "rows and cols must be >= 1"),
])
def test_bad_arguments_exit_2(runner, write_spec, tmp_path, args, needle):
    spec = write_spec(spec_text())
    args = [a.format(missing=tmp_path / "missing.yaml", spec=spec) for a in args]
    r = run(runner, *args)
    assert r.exit_code == 2
    assert r.stderr.startswith("[error] ") and needle in r.stderr


def test_yaml_errors_on_the_command_line(runner, write_spec):
    p = write_spec("name: x\nmodel: !!python/object/apply:os.system ['echo hi']\n")
    r = run(runner, "validate", p)
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        f"[error] {p}: invalid YAML",
        f"  {p}:2:8: model: unsupported YAML tag 'tag:yaml.org,2002:python/object/apply:os.system'; "
        "bundle specs use plain YAML values only"]
    p = write_spec("name: x\ntargets: [N150\n")
    r = run(runner, "validate", p)
    assert r.exit_code == 2 and r.stderr.splitlines()[1].startswith(f"  {p}:3:1: ")


# ---- plan ----------------------------------------------------------------------------------------
def test_plan_json(runner, write_spec):
    p = write_spec(spec_text({"targets": ["T3K"]}))
    r = run(runner, "plan", p, "--json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert data["fits"] is True and data["fixes"] == []
    assert data["mesh"]["name"] == "T3K" and data["mesh"]["shape"] == [1, 8]
    assert [c["device"] for c in data["per_chip"]] == [[0, c] for c in range(8)]
    mem = data["memory"]
    assert mem["total"] == mem["weights"] + mem["kv_cache"] + mem["activations"] + mem["trace_region"]
    assert all(c["bytes"] == mem["total"] for c in data["per_chip"])
    assert mem["dram"] == WH_DRAM and mem["free"] == WH_DRAM - mem["total"]
    assert {t["name"] for t in data["tensors"]} >= {"embed", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "lm_head"}
    assert data["decode_traffic_bytes_per_token"] == sum(c["traffic_bytes_per_token"] * c["count"]
                                                          for c in data["collectives"])


def test_plan_table(runner, write_spec):
    p = write_spec(spec_text({"targets": ["T3K"]}))
    r = run(runner, "plan", p)
    assert r.exit_code == 0
    out = r.stdout
    assert out.splitlines()[0] == "tiny (llama) on T3K 1x8: 8 x Wormhole B0, ring, axes rows=1 cols=8"
    assert re.search(r"w1 +│ bf16\[512@rows, 1536@cols\] +│ \[rows, cols\] +│ bf16\[512, 192\]", out)
    assert re.search(r"fits: [\d.]+ \w+ of [\d.]+ GiB per chip \(\d+\.\d+% of DRAM used\)", out)
    assert "decode traffic: 15,232 bytes per token per device" in out  # see test_plan: 896 + 4*1792 + 7168


def test_plan_defaults_to_first_target(runner, write_spec):
    r = run(runner, "plan", write_spec(spec_text({"targets": ["N300", "T3K"]})), "--json")
    assert json.loads(r.stdout)["mesh"]["name"] == "N300"


# ---- the user story: Llama-3.1-70B in bf16 on T3K ------------------------------------------------
def test_llama_70b_bf16_on_t3k_is_refused_with_reasons_and_fixes(runner, write_spec, tmp_path):
    p = write_spec(spec_text(base=LLAMA_70B))
    r = run(runner, "plan", p)
    assert r.exit_code == 3
    out = r.stdout
    assert re.search(r"does not fit: needs [\d.]+ GiB of [\d.]+ GiB per chip \(\d+\.\d% of DRAM\), [\d.]+ GiB over", out)
    # the KV pool is charged at its minimum (one max_model_len sequence) when nothing fits, so
    # the MLP matrices lead: 3 x 80 x 8192 x 28672 / 8 x 2 bytes
    consumers = out.split("largest consumers per chip:\n", 1)[1].splitlines()[:3]
    assert {c.split(":")[0].strip() for c in consumers} == {"w1 (bf16, x80)", "w3 (bf16, x80)", "w2 (bf16, x80)"}
    per = 80 * 8192 * 28672 // 8 * 2 / 2**30
    assert all(c.split(": ")[1] == f"{per:.2f} GiB" for c in consumers)
    assert "not even one max_model_len=" in out
    assert "suggested fixes" in out

    r = run(runner, "plan", p, "--json")
    assert r.exit_code == 3
    data = json.loads(r.stdout)
    assert data["fits"] is False and data["memory"]["total"] > data["memory"]["dram"] == WH_DRAM
    assert data["fixes"]
    for fix in data["fixes"]:  # each suggestion, applied to the spec, re-planned by the CLI
        fixed = copy.deepcopy(LLAMA_70B)
        mesh = "T3K"
        m = re.match(r"weights\.dtypes: (\{[^}]*\}): ", fix)
        if m:
            fixed["weights"] = {"dtypes": yaml.safe_load(m.group(1))}
        elif fix.startswith("a bigger mesh: "):
            mesh = fix.split()[3]
        else:
            raise AssertionError(fix)
        q = write_spec(dump(fixed), "fixed.yaml")
        code = run(runner, "plan", q, "--mesh", mesh, "--json").exit_code
        assert code == (3 if "still" in fix else 0), fix
    assert any("still" not in f for f in data["fixes"])

    r = run(runner, "validate", p)
    assert r.exit_code == 3
    assert r.stderr.startswith(f"{p}: T3K: does not fit: needs ")
    assert f"chip has {WH_DRAM:,} B; run `ttbundle plan {p} --mesh T3K`" in r.stderr
    assert r.stdout == ""


# ---- schema --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def schema_doc():
    from typer.testing import CliRunner
    r = CliRunner().invoke(app, ["schema"])
    assert r.exit_code == 0
    return json.loads(r.stdout)


def test_schema_is_json_schema(schema_doc):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema_doc)
    assert {"name", "model", "targets", "sharding", "buckets", "runtime", "weights", "from_hf"} <= \
        set(schema_doc["properties"])
    assert schema_doc["required"] == ["name", "targets"]
    assert schema_doc["additionalProperties"] is False


def test_schema_accepts_specs_and_rejects_unknown_keys(schema_doc):
    jsonschema = pytest.importorskip("jsonschema")
    v = jsonschema.Draft202012Validator(schema_doc)
    v.validate(yaml.safe_load(DEMO.read_text()))
    v.validate(BASE)
    v.validate(LLAMA_70B)
    for bad in (deep_update(TINY, {"colour": "blue"}), deep_update(TINY, {"runtime": {"max_num_seq": 3}}),
                deep_update(TINY, {"model": {"hiden_size": 3}}), deep_update(TINY, {"targets": DELETE}),
                deep_update(TINY, {"runtime": {"trace_mode": "sometimes"}}),
                deep_update(TINY, {"sharding": {"plan": {"wq": [None, "colz"]}}})):
        assert list(v.iter_errors(bad)), bad


def test_schema_to_file(runner, tmp_path):
    out = tmp_path / "schema.json"
    r = run(runner, "schema", "-o", out)
    assert r.exit_code == 0 and r.stdout == ""
    assert json.loads(out.read_text())["title"] == "ttbundle bundle spec"


# ---- meshes --------------------------------------------------------------------------------------
def test_meshes_json_lists_every_plugin_name(runner):
    r = run(runner, "meshes", "--json")
    assert r.exit_code == 0
    rows = {m["name"]: m for m in json.loads(r.stdout)}
    for name, shape in PLUGIN_SHAPES.items():
        assert rows[name]["shape"] == list(shape), name
        assert rows[name]["devices"] == shape[0] * shape[1]
    for name, (shape, hosts, arch) in GALAXIES.items():
        assert (rows[name]["shape"], rows[name]["hosts"], rows[name]["arch"]) == (list(shape), hosts, arch)
    assert rows["T3K"]["dram_bytes_per_chip"] == WH_DRAM


def test_meshes_table(runner):
    r = run(runner, "meshes")
    assert r.exit_code == 0
    for name in PLUGIN_SHAPES:
        assert re.search(rf"^ *{re.escape(name)} ", r.stdout, re.M), name
    assert re.search(r"^ *T3K +│ 1x8 +│ 8 +│ wormhole_b0 +│ 12,872,318,208 ", r.stdout, re.M)


def test_version(runner):
    from ttbundle import __version__
    r = run(runner, "version")
    assert r.exit_code == 0 and r.stdout == f"ttbundle {__version__}\n"


# ---- property-based: the CLI never shows a traceback ---------------------------------------------
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=mutated_specs(), command=st.sampled_from(["validate", "plan"]))
def test_cli_on_mutated_specs(runner, data, command):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "spec.yaml"
        p.write_text(dump(data), encoding="utf-8")
        r = run(runner, command, p)
        assert r.exit_code in (0, 2, 3), r.output
        if r.exit_code == 2:
            lines = r.stderr.splitlines()
            assert lines[0].startswith("[error] ")
            for line in lines[1:]:
                assert re.match(rf"  {re.escape(str(p))}:\d+:\d+: ", line), line


def test_control_characters_from_the_spec_are_escaped(runner, write_spec):
    # a YAML key may hold any character ("\e" is ESC); echoed raw it could rewrite the terminal
    p = write_spec(spec_text() + '"evil\\e[2J\\x1e": 1\n')
    r = run(runner, "validate", p)
    assert r.exit_code == 2
    assert "\x1b" not in r.stderr and "\x1e" not in r.stderr
    assert r.stderr.splitlines()[1].startswith(f"  {p}:{spec_text().count(chr(10)) + 1}:1: evil\\x1b[2J\\x1e: unknown key")


def test_validate_reports_spec_and_mesh_errors_together(runner, write_spec):
    # one rule broken in the spec, one only visible on a mesh: both come out in one run
    text = spec_text({"targets": ["N300", "T3K"], "buckets": {"decode": [1, 5, 32]}, "model": {
        "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944}})
    p = write_spec(text)
    r = run(runner, "validate", p)
    assert r.exit_code == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 3
    assert lines[1].startswith(f"  {p}:{line_of(text, '- 5')}:{col_of(text, '- 5')}: buckets.decode.1: ")
    assert lines[2].startswith(f"  {p}:{line_of(text, '- T3K')}:3: targets.1: wq, wo (family default plan): "
                               "num_attention_heads=28 is not divisible by mesh axis cols=8 (T3K 1x8)")
    r = run(runner, "validate", p, "--mesh", "N300")  # only the spec error on a mesh where 28 divides
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 2
