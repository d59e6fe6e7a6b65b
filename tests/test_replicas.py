"""A target split into replicas on submeshes: the spec's `replicas`, each replica planned and
built as a standalone mesh of the submesh shape (compared against that standalone preset), the
plan's split and total concurrency, the package holding one replica's shards, `check` on it,
and `serve --print-launch` for multi-host targets (arithmetic done here)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from spec_helpers import SPEC_FILE, TINY, deep_update, line_of, spec_text
from ttbundle import mesh as meshmod, spec as specmod
from ttbundle.plan.make import make_plan
from ttbundle.cli import app
from ttbundle.errors import InvalidInput


def _bundle(changes, targets=("T3K",)):
    text = spec_text(deep_update({"targets": list(targets)}, changes))
    return text, specmod.loads(text, SPEC_FILE)


# ---- mesh.split ---------------------------------------------------------------------------------
@pytest.mark.parametrize("target,sub,count", [("T3K", (1, 1), 8), ("T3K", (1, 2), 4), ("T3K", (1, 4), 2),
                                              ("TG", (8, 1), 4), ("TG", (2, 4), 4), ("TG", (4, 4), 2),
                                              ("QUAD_GALAXY", (8, 8), 2)])
def test_split_counts_and_keeps_the_target_name(target, sub, count):
    whole = meshmod.resolve(target)
    m = meshmod.split(whole, sub)
    assert (m.name, m.shape, m.replicas, m.target_shape) == (target, sub, count, whole.shape)
    assert m.total_devices == whole.num_devices and m.chip == whole.chip
    origins = meshmod.submesh_origins(whole.shape, sub, whole.hosts)
    # the submeshes tile the mesh: every chip in exactly one replica
    chips = [(r0 + i, c0 + j) for r0, c0 in origins for i in range(sub[0]) for j in range(sub[1])]
    assert sorted(chips) == [(r, c) for r in range(whole.rows) for c in range(whole.cols)]


def test_split_refuses_a_submesh_that_does_not_tile():
    with pytest.raises(InvalidInput, match=r"submesh \[1, 3\] does not tile T3K 1x8: cols 8 % 3 = 2; "
                                           r"submeshes that do: \[1, 1\], \[1, 2\], \[1, 4\]"):
        meshmod.split(meshmod.resolve("T3K"), (1, 3))
    with pytest.raises(InvalidInput, match=r"rows 8 % 3 = 2"):
        meshmod.split(meshmod.resolve("TG"), (3, 4))


# ---- spec validation ----------------------------------------------------------------------------
def test_spec_errors_name_the_line_and_the_arithmetic():
    text = spec_text(deep_update({"targets": ["T3K", "TG"]},
                                 {"replicas": {"T3K": {"submesh": [1, 3]}, "TG": {"submesh": [2, 4], "count": 8},
                                               "N300": {"submesh": [1, 1]}}}))
    with pytest.raises(InvalidInput) as e:
        specmod.loads(text, SPEC_FILE)
    msgs = {d.path: (d.line, d.message) for d in e.value.diagnostics}
    assert msgs["replicas.T3K.submesh"][0] == line_of(text, "submesh:", 1)
    assert "cols 8 % 3 = 2" in msgs["replicas.T3K.submesh"][1]
    assert msgs["replicas.TG.count"][0] == line_of(text, "count:")
    assert "TG 8x4 (32 chips) holds 32 / 8 = 4 replicas" in msgs["replicas.TG.count"][1]
    assert "'N300' is not one of targets" in msgs["replicas.N300"][1]


def test_max_num_seqs_is_per_replica_and_the_decode_cap_says_so():
    text = spec_text({"runtime": {"max_num_seqs": 64}})
    with pytest.raises(InvalidInput, match="split a target into replicas"):
        specmod.loads(text, SPEC_FILE)


# ---- plan: a replica is planned as a standalone mesh of the submesh shape -------------------------
@pytest.mark.parametrize("target,sub,standalone", [("T3K", (1, 2), "N300"), ("T3K", (1, 1), "N150"),
                                                   ("T3K", (1, 4), "N150x4"), ("TG", (2, 4), "(2,4)")])
def test_replica_plan_equals_the_standalone_submesh_plan(target, sub, standalone):
    _, split = _bundle({"replicas": {target: {"submesh": list(sub)}}}, targets=(target,))
    _, alone = _bundle({}, targets=(standalone,))
    p, q = make_plan(split, target), make_plan(alone, standalone)
    assert p.mesh.shape == q.mesh.shape == sub
    assert [(t.name, t.device_shape, t.bytes) for t in p.tensors] == \
        [(t.name, t.device_shape, t.bytes) for t in q.tensors]
    assert p.memory == q.memory and p.kv == q.kv
    assert [(c.layer, c.kind, c.axes, c.devices) for c in p.collectives] == \
        [(c.layer, c.kind, c.axes, c.devices) for c in q.collectives]
    n = meshmod.resolve(target).num_devices // (sub[0] * sub[1])
    j = p.to_json()
    assert j["replicas"]["count"] == n and j["replicas"]["devices"] == meshmod.resolve(target).num_devices
    assert j["replicas"]["max_num_seqs_total"] == n * TINY["runtime"]["max_num_seqs"]


def test_cli_plan_shows_the_split_and_total_concurrency(tmp_path):
    text = spec_text(deep_update({"targets": ["T3K"]}, {"replicas": {"T3K": {"submesh": [1, 2]}},
                                                        "runtime": {"max_num_seqs": 16}}))
    f = tmp_path / "s.yaml"
    f.write_text(text)
    r = CliRunner().invoke(app, ["plan", str(f), "-m", "T3K"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "T3K 1x8 as 4 replicas of 1x2" in out
    assert "total concurrency 4 x 16 = 64 sequences" in out
    assert "replica origins (0,0), (0,2), (0,4), (0,6)" in out
    r = CliRunner().invoke(app, ["validate", str(f)])
    assert r.exit_code == 0, r.output


# ---- build: one replica's shards, byte for byte the standalone mesh's --------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import yaml

    from ttbundle.serving.demo import build_package
    out = tmp_path_factory.mktemp("rep")
    base = yaml.safe_load(spec_text({"runtime": {"max_num_seqs": 8, "max_model_len": 256},
                                     "buckets": {"prefill": [128], "decode": [1, 8], "prefill_chunk": 128},
                                     "model": {"num_hidden_layers": 1}}))
    split = dict(base, targets=["T3K"], replicas={"T3K": {"submesh": [1, 2]}})
    alone = dict(base, targets=["N300"])
    p1 = build_package(yaml.safe_dump(split), out / "a", "T3K")
    p2 = build_package(yaml.safe_dump(alone), out / "b", "N300")
    return p1, p2


def test_package_holds_one_replica_and_records_the_split(built):
    split, alone = built
    m = json.loads((split / "manifest.json").read_text())
    assert split.parent.name == "T3K" and m["mesh"]["name"] == "T3K" and m["mesh"]["shape"] == [1, 2]
    assert m["replicas"]["count"] == 4 and m["replicas"]["target_shape"] == [1, 8]
    assert m["replicas"]["max_num_seqs_total"] == 4 * 8
    weights = sorted(f for f in m["files"] if f.startswith("weights/"))
    assert weights == sorted(f for f in json.loads((alone / "manifest.json").read_text())["files"]
                             if f.startswith("weights/"))
    assert len(weights) == 2  # the submesh's 2 chips, once: every replica reads the same files
    from safetensors.torch import load_file
    for w in weights:
        a, b = load_file(str(split / w)), load_file(str(alone / w))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    for prog in sorted(f for f in m["files"] if f.startswith("programs/")):
        pa, pb = json.loads((split / prog).read_text()), json.loads((alone / prog).read_text())
        assert pa["mesh"]["shape"] == pb["mesh"]["shape"] == [1, 2]
        assert pa["layers"] == pb["layers"] and pa["weights"] == pb["weights"]
    from ttbundle.package.load import load_package
    loaded = load_package(split, verify=True)
    assert loaded.mesh.replicas == 4 and loaded.mesh.shape == (1, 2)


def test_check_runs_the_submesh_programs(built):
    split, _ = built
    r = CliRunner().invoke(app, ["check", str(split), "--steps", "4"])
    assert r.exit_code == 0, r.output
    assert "check passed" in r.output


# ---- serve --print-launch --------------------------------------------------------------------------
def _launch(tmp_path, target, sub, *args):
    text = spec_text(deep_update({"targets": [target]}, {"replicas": {target: {"submesh": list(sub)}},
                                                         "runtime": {"max_num_seqs": 16}}))
    f = tmp_path / "s.yaml"
    f.write_text(text)
    from ttbundle.serving.launch import launch_plan
    r = CliRunner().invoke(app, ["serve", str(f), "-m", target, "--print-launch", "-o", str(tmp_path / "out"),
                                 *args])
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "out").exists()  # builds nothing
    opt = dict(zip(args[::2], args[1::2]))
    hosts = opt["--hosts"].split(",") if "--hosts" in opt else None
    dp = int(opt["-dp"]) if "-dp" in opt else None
    return r.output, launch_plan(str(f), target, dp, hosts, output=tmp_path / "out")


def test_print_launch_dual_galaxy_8_replicas(tmp_path):
    out, lp = _launch(tmp_path, "DUAL_GALAXY", (2, 4), "--hosts", "gx-a,gx-b")
    # 64 chips, 2 hosts of 32; 8 replicas of 8 chips; DP 8 (one per replica), 4 ranks per host
    assert (lp.dp, lp.lanes, lp.replicas) == (8, 1, 8)
    binds = lp.rank_bindings()
    assert len(binds) == 8 and [b["mesh_id"] for b in binds] == list(range(8))
    for host in ("gx-a", "gx-b"):
        devs = [int(d) for b in binds if b["host"] == host for d in b["env_overrides"]["TT_VISIBLE_DEVICES"].split(",")]
        assert sorted(devs) == list(range(32))  # each host's 32 chips, each in one replica
    cmds = lp.vllm_commands()
    assert [h for h, _ in cmds] == ["gx-a", "gx-b"]
    for (h, argv), start in zip(cmds, (0, 4)):
        a = dict(zip(argv[3::1], argv[4::1]))
        assert a["--data-parallel-size"] == "8" and a["--data-parallel-size-local"] == "4"
        assert a["--data-parallel-start-rank"] == str(start) and a["--data-parallel-address"] == "gx-a"
        assert a["--max-num-seqs"] == "16"
    assert "--headless" in cmds[1][1] and "--headless" not in cmds[0][1]
    assert "8 x 16 = 128 in all" in out and "tt-run --rank-binding rank_bindings.yaml" in out


def test_print_launch_lanes_and_replicas_spanning_hosts(tmp_path):
    # QUAD_GALAXY (8,16) as 2 replicas of (8,8): each replica spans 2 hosts -> 2 tt-run ranks each
    _, lp = _launch(tmp_path, "QUAD_GALAXY", (8, 8))
    binds = lp.rank_bindings()
    assert [(b["mesh_id"], b["mesh_host_rank"], b["host"]) for b in binds] == \
        [(0, 0, "host0"), (0, 1, "host1"), (1, 0, "host2"), (1, 1, "host3")]
    assert [h for h, _ in lp.vllm_commands()] == ["host0", "host2"]
    # DUAL_GALAXY as 8 x (8,1) with DP 2: 4 lanes per rank, one rank per host
    _, lp = _launch(tmp_path, "DUAL_GALAXY", (8, 1), "-dp", "2")
    assert (lp.dp, lp.lanes) == (2, 4)
    cmds = dict(lp.vllm_commands())
    assert cmds["host1"][cmds["host1"].index("--max-num-seqs") + 1] == str(4 * 16)
    assert '{"tt":{"tt_data_parallel_size":4}}' in cmds["host0"]


def test_print_launch_refuses_impossible_dp(tmp_path):
    text = spec_text(deep_update({"targets": ["DUAL_GALAXY"]}, {"replicas": {"DUAL_GALAXY": {"submesh": [2, 4]}}}))
    f = tmp_path / "s.yaml"
    f.write_text(text)
    r = CliRunner().invoke(app, ["serve", str(f), "--print-launch", "-dp", "3"])
    assert r.exit_code == 2
    assert "? x 3 x 8 = 64" in " ".join(r.output.split())


def test_validate_says_a_replica_does_not_fit_its_chips(tmp_path):
    """Llama-70B on a T3K as 8 replicas of one chip: each replica is a standalone 1x1 plan (the
    N150's numbers), which does not fit; validate exits 3 naming the split."""
    from spec_helpers import LLAMA_70B
    text = spec_text(deep_update({"targets": ["T3K"]}, {"replicas": {"T3K": {"submesh": [1, 1]}}}), base=LLAMA_70B)
    alone = make_plan(specmod.loads(spec_text({"targets": ["N150"]}, base=LLAMA_70B), SPEC_FILE), "N150")
    assert not alone.fits
    f = tmp_path / "s.yaml"
    f.write_text(text)
    r = CliRunner().invoke(app, ["validate", str(f)])
    assert r.exit_code == 3, r.output
    out = " ".join(r.output.split())
    assert f"T3K (each of its 8 replicas on 1x1): does not fit: needs {alone.memory.total:,} B per chip" in out


def test_lane_submeshes_cut_the_whole_target_and_refuse_otherwise():
    """The TT device path's lanes (``runtime/ttdevice.lane_submeshes``) on the recording double:
    the opened T3K cut into the replica's 1x2 submeshes in ``submesh_origins`` order; one replica's
    mesh device, or a lane count other than the replicas, refused naming the numbers."""
    from types import SimpleNamespace

    from ttbundle.backends.ttnn import recording
    from ttbundle.runtime.ttdevice import lane_submeshes

    sub = meshmod.split(meshmod.resolve("T3K"), (1, 2))
    pkg = SimpleNamespace(loaded=SimpleNamespace(mesh=sub), name="tiny", mesh_name="T3K")
    tt = recording.Recorder().module()
    subs = lane_submeshes(tt, pkg, tt.open_mesh_device(tt.MeshShape(1, 8)), 4)
    assert [(s.shape, s.origin) for s in subs] == [((1, 2), o) for o in meshmod.submesh_origins((1, 8), (1, 2))]
    with pytest.raises(ValueError, match=r"the mesh device is 1x2; its 4 lanes are cut from the whole 1x8 target"):
        lane_submeshes(tt, pkg, tt.open_mesh_device(tt.MeshShape(1, 2)), 4)
    with pytest.raises(ValueError, match=r"2 lane\(s\) on one mesh device; .* every replica of the target as a lane \(4\)"):
        lane_submeshes(tt, pkg, tt.open_mesh_device(tt.MeshShape(1, 8)), 2)
    whole = SimpleNamespace(loaded=SimpleNamespace(mesh=meshmod.resolve("N150")), name="t", mesh_name="N150")
    dev = tt.open_mesh_device(tt.MeshShape(1, 1))
    assert lane_submeshes(tt, whole, dev, 1) == [dev]
