"""The ttnn backend's host side, in the main environment (no ttnn): `build --backend ttnn`'s
.tensorbin caches, mesh mappers as data, `mock-cluster`, and (below) the recording device double
that checks the order of compile warm-up, trace capture and replay.

What needs the real wheel is in tests/tt/ (the caches loading in ttnn, the allocator, the
descriptors, the lowering's ttnn calls against the wheel's signatures).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from test_build import ckpt, spec_text  # noqa: F401  (ckpt: the shared checkpoint fixture)
from ttbundle import build as buildmod, layout, mesh as meshmod, mockcluster, spec as specmod, tensorbin
from ttbundle.package.facts import of_bundle
from ttbundle.layout import axes_of
from ttbundle.plan.make import make_plan
from ttbundle.plan.memory import tensor_bytes
from ttbundle.package.names import weight_file
from ttbundle.package.templates import render_bundle_yaml, resolved_spec
from ttbundle.package.verify import read_manifest, verify_package
from ttbundle.backends.ttnn import cache, mappers
from ttbundle.cli import app
from ttbundle.errors import InvalidInput

DTYPES = "  dtypes: {mlp: bfp8, attention: bfp4}\n"


def write_spec(tmp: Path, ckpt: Path) -> Path:
    p = tmp / "spec.yaml"
    p.write_text(spec_text(ckpt).replace(f"  source: {ckpt}\n", f"  source: {ckpt}\n{DTYPES}"))
    return p


def st_shard(pkg: Path, d: int, key: str) -> tuple[bytes, dict]:
    with open(pkg / weight_file(d), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        a, b = head[key]["data_offsets"]
        f.seek(8 + n + a)
        return f.read(b - a), json.loads(head["__metadata__"]["ttbundle"])["tensors"][key]


# ---- build --backend ttnn ------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", ["T3K", "N150"])
def test_build_writes_a_tensorbin_per_device_and_tensor(tmp_path, ckpt, mesh):
    bundle = specmod.load(write_spec(tmp_path, ckpt))
    res = buildmod.build(bundle, mesh, tmp_path / "out", backend="ttnn", warmup=False)
    pkg = Path(res.package)
    m = verify_package(pkg)  # every tensorbin file is in the manifest, sha256 included
    assert "tensorbin" in res.rebuilt and "tensorbin" in m["artifacts"]
    p = make_plan(bundle, mesh)
    tp = {t.name: t for t in p.tensors}
    idx = cache.read_index(pkg)
    D = p.mesh.num_devices
    assert idx["devices"] == D and idx["mesh"] == {"name": mesh, "shape": list(p.mesh.shape), "arch": p.mesh.chip.arch}
    # the index lists every file it names with the manifest's sha256 (checked whole before a load)
    assert {r: m["files"][r] for r in idx["files"]} == idx["files"] and set(idx["files"]) | {cache.INDEX} == \
        set(m["artifacts"]["tensorbin"]["files"])
    assert idx["identity"] == m["artifacts"]["tensorbin"]["identity"] and idx["identity"]["arch"] == p.mesh.chip.arch
    keys = set(cache._RawSafetensors(pkg / weight_file(0)).meta["tensors"])
    assert set(idx["tensors"]) == keys
    listed = set(m["artifacts"]["tensorbin"]["files"])
    # one file per distinct shard: a replicated tensor's in device 0's folder only (layout's rule)
    holders = {k: layout.holders(layout.tensor_units(next(t for t in bundle.family.tensors(bundle.arch)
                                                          if t.name == info["tensor"]).dims,
                                                     tp[info["tensor"]].spec, p.mesh, bundle.spec.sharding), D)
               for k, info in idx["tensors"].items()}
    assert listed == {cache.cache_file(d, k) for k in keys for d in set(holders[k])} | {cache.INDEX}
    if D > 1:
        assert holders["attn_norm.0"] == [0] * D and holders["wq.0"] == list(range(D))
    for key, info in idx["tensors"].items():
        t = tp[info["tensor"]]
        assert info["stored_in"] == holders[key]
        for d in sorted(set(holders[key])):
            h, data = tensorbin.read_shard(pkg / cache.cache_file(d, key))
            assert (h.dtype, h.layout, h.shape) == (t.dtype, t.layout, info["shape"]), key
            assert h.mesh_shape == [1, 1] and len(h.shards) == 1
            raw, meta = st_shard(pkg, d, key)
            if t.dtype != "bf16":
                assert data == raw  # block-float tiles are the package's own bytes
            elif t.layout == "TILE":
                shp = meta["shape"]
                if meta.get("transposed"):  # stored in the checkpoint's [out, in] order
                    want = np.frombuffer(raw, dtype=np.uint16).reshape(shp[:-2] + shp[:-3:-1]).swapaxes(-1, -2)
                else:
                    want = np.frombuffer(raw, dtype=np.uint16).reshape(shp)
                np.testing.assert_array_equal(cache.untilize(data, shp), want)
            elif len(meta["shape"]) == 1:  # a vector as rows of 32
                n = meta["shape"][0]
                assert data[:2 * n] == raw and not any(data[2 * n:])
                assert info["shape"] == [1, 1, -(-n // 32), 32]
            else:
                assert data == raw  # the embedding, row-major
    # the tensorbins hold exactly the DRAM the plan charges for weights (one copy per layer)
    charged = sum(tensor_bytes(list(idx["tensors"][k]["shape"]), idx["tensors"][k]["dtype"],
                                       idx["tensors"][k]["layout"], p.mesh) for k in keys)
    assert charged == p.memory.weights


def test_backend_is_part_of_the_key_and_caches_are_reused(tmp_path, ckpt):
    bundle = specmod.load(write_spec(tmp_path, ckpt))
    out = tmp_path / "out"
    r1 = buildmod.build(bundle, "N300", out, backend="ttnn", warmup=False)
    assert buildmod.build(bundle, "N300", out, backend="ttnn", warmup=False).status == "up-to-date"
    r2 = buildmod.build(bundle, "N300", out, warmup=False)  # emulated: the caches go
    assert r2.status == "built" and "weights" in r2.reused and not (Path(r2.package) / "tensorbin").exists()
    verify_package(r2.package)
    r3 = buildmod.build(bundle, "N300", out, backend="ttnn", warmup=False)
    assert "tensorbin" in r3.rebuilt and "weights" in r3.reused and r3.key == r1.key
    # a rebuild that keeps the weights (a new bucket) links the caches instead of rewriting them
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec.read_text().replace("decode: [1, 8]", "decode: [1, 4, 8]"))
    before = (Path(r3.package) / cache.cache_file(1, "wq.0")).stat().st_ino
    r4 = buildmod.build(specmod.load(spec), "N300", out, backend="ttnn", warmup=False)
    assert "tensorbin" in r4.reused and "program:decode-4" in r4.rebuilt
    assert (Path(r4.package) / cache.cache_file(1, "wq.0")).stat().st_ino == before
    verify_package(r4.package)


def test_unknown_backend_and_cli_flag(tmp_path, ckpt):
    bundle = specmod.load(write_spec(tmp_path, ckpt))
    with pytest.raises(InvalidInput, match="unknown backend 'cuda'; one of emulated, ttnn"):
        buildmod.build(bundle, "N150", tmp_path / "out", backend="cuda")
    r = CliRunner().invoke(app, ["build", str(tmp_path / "spec.yaml"), "--mesh", "N150", "-o",
                                 str(tmp_path / "out"), "--backend", "ttnn", "--no-warmup"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "N150" / "tiny" / cache.INDEX).exists()


def test_tilize_round_trip_and_face_order():
    a = np.arange(40 * 70, dtype=np.uint16).reshape(40, 70)
    t = np.frombuffer(cache.tilize(a), dtype=np.uint16)
    assert t.size == 64 * 96  # padded to whole tiles
    # tile (0,0), face 1 (top-right) starts with element (0, 16); face 2 with (16, 0)
    assert t[256] == a[0, 16] and t[512] == a[16, 0] and t[:16].tolist() == a[0, :16].tolist()
    np.testing.assert_array_equal(cache.untilize(cache.tilize(a), a.shape), a)
    b = np.arange(2 * 3 * 33 * 65, dtype=np.uint16).reshape(2, 3, 33, 65)
    np.testing.assert_array_equal(cache.untilize(cache.tilize(b), b.shape), b)


# ---- mesh mappers --------------------------------------------------------------------------------
def test_mapper_dims_follow_the_plan():
    text = spec_text() + "sharding: {kv_heads: replicate}\n"
    b = specmod.loads(text, "s.yaml")
    p = make_plan(b, "T3K")
    tp = {t.name: t for t in p.tensors}
    assert mappers.mapper_dims(p, "attn_norm") == {"type": "ReplicateTensorToMesh"}
    want = [None, None]  # ShardTensor2dMesh dims: the tensor dim split over rows, over cols
    for i, e in enumerate(tp["wq"].spec):
        for ax in axes_of(e):
            want[("rows", "cols").index(ax)] = i
    assert mappers.mapper_dims(p, "wq") == {"type": "ShardTensor2dMesh", "dims": want}
    # 2 KV heads replicated over 8 devices and the vocab padded 500 -> 512 are ttbundle's own
    assert tp["wk"].notes and mappers.mapper_dims(p, "wk") is None
    assert mappers.mapper_dims(p, "lm_head") is None


# ---- mock-cluster ---------------------------------------------------------------------------------
def test_mock_cluster_descriptors_are_consistent():
    for name in mockcluster.supported():
        d = yaml.safe_load(mockcluster.descriptor(name))
        m = meshmod.PRESETS[name]
        chips = list(d["arch"])
        assert len(chips) == m.num_devices
        assert {d["arch"][c] for c in chips} == {m.chip.arch}
        board_chips = sorted(c for b in d["boards"] for part in b if "chips" in part for c in part["chips"])
        assert board_chips == chips
        for link in d["ethernet_connections"]:  # links join distinct chips of this cluster
            (a, b) = (link[0]["chip"], link[1]["chip"])
            assert a != b and a in chips and b in chips
        for b in d["boards"]:  # the board id carries its type (tt-umd reads it back)
            bid = next(p["board_id"] for p in b if "board_id" in p)
            kind = next(p["board_type"] for p in b if "board_type" in p)
            assert (bid >> 36) & 0xFFFFF == {"n150": 0x18, "n300": 0x14, "p150": 0x40, "p100": 0x36}[kind]
    t3k = yaml.safe_load(mockcluster.descriptor("T3K"))
    assert len(t3k["ethernet_connections"]) == 20 and len(t3k["chips_with_mmio"]) == 4


def test_mock_cluster_cli(tmp_path):
    r = CliRunner().invoke(app, ["mock-cluster", "--mesh", "P150", "-o", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0 and (tmp_path / "p.yaml").read_text() == mockcluster.descriptor("P150")
    r = CliRunner().invoke(app, ["mock-cluster", "--mesh", "QUAD_GALAXY", "-o", str(tmp_path / "q.yaml")])
    assert r.exit_code == 2 and "no descriptor for it yet" in r.output


# ---- lowering and the recording double ------------------------------------------------------------
from ttbundle import lower as lowermod  # noqa: E402
from ttbundle.backends.ttnn import device, lowering, recording, trace  # noqa: E402

BUNDLES = Path(__file__).resolve().parent.parent / "bundles"


def forwards_of(bundle, plan, sampling="device", keys=None):
    fws, traced = {}, set()
    for phase, b in keys or lowermod.trace_set(bundle):
        fws[(phase, b)] = lowering.lower_forward(bundle, plan.mesh, lowermod.lower(bundle, plan, phase, b), sampling)
        if lowermod.traced(bundle, phase):
            traced.add((phase, b))
    return fws, traced


def recorded_runner(bundle, mesh, sampling="device", keys=None):
    p = make_plan(bundle, mesh)
    fws, traced = forwards_of(bundle, p, sampling, keys)
    rec = recording.Recorder(unknown_reads="zeros")  # fake weights: every value read is unknown
    tt = rec.module()
    ex = device.Executor(tt, tt.open_mesh_device(tt.MeshShape(*p.mesh.shape)))
    ex.on_call = rec.on_call
    recording.populate(ex, p, fws.values())
    return rec, trace.TraceRunner(ex, fws, traced), fws


def host_inputs(fw):
    return {n: np.zeros(s) for n, (s, d, l) in fw.inputs.items()}


def test_warmup_then_capture_then_replay_and_no_compile_in_capture():
    bundle = specmod.load(BUNDLES / "llama-3.1-8b.yaml")
    rec, r, fws = recorded_runner(bundle, "N300")
    r.warmup()
    r.capture()
    n_capture = len(rec.events)
    for key in fws:
        r.run(key, host_inputs(fws[key]))
    ev = rec.events
    names = [e.fn for e in ev]
    begins = [i for i, n in enumerate(names) if n == "begin_trace_capture"]
    ends = [i for i, n in enumerate(names) if n == "end_trace_capture"]
    execs = [i for i, n in enumerate(names) if n == "execute_trace"]
    compiles = [i for i, e in enumerate(ev) if e.compiled]
    assert rec.violations == []
    # every bucket is traced here (trace_mode all): one capture each, after every compile
    assert len(begins) == len(ends) == len(fws) and compiles and max(compiles) < begins[0]
    assert not any(e.compiled for e in ev if e.capturing)
    # every bucket ran once eagerly before the first capture: each op kind of each bucket
    warm_ops = [e for e in ev[:begins[0]] if rec.is_op(e)]
    assert len(warm_ops) == sum(len(list(fw.calls())) for fw in fws.values())
    # replays: inputs written, then execute_trace; no op runs outside the trace any more
    assert len(execs) == len(fws) and min(execs) > max(ends)
    assert not [e for e in ev[n_capture:] if rec.is_op(e)]
    assert not [e for e in ev[begins[0]:] if e.fn == "allocate_tensor_on_device"]
    # each capture replays the calls its warm-up ran, op for op
    for k, (b, e) in enumerate(zip(begins, ends)):
        captured = [x.fn for x in ev[b:e] if rec.is_op(x)]
        assert len(captured) == len(list(fws[list(fws)[k]].calls()))


def test_replay_copies_only_the_inputs_whose_host_array_changed():
    """A replay writes an input only when its host array is not the one written last (the
    runner's persistent decode state passes the same page-table and sampling arrays step after
    step); a new array, even of equal values, is copied."""
    bundle = specmod.load(BUNDLES / "llama-3.1-8b.yaml")
    keys = [min(k for k in lowermod.trace_set(bundle) if k[0] == "decode")]
    rec, r, fws = recorded_runner(bundle, "N300", keys=keys)
    r.warmup()
    r.capture()
    key = keys[0]
    host = host_inputs(fws[key])

    def copies(h):
        n0 = len(rec.events)
        r.run(key, h)
        return [e for e in rec.events[n0:] if e.fn == "copy_host_to_device_tensor"]

    assert len(copies(host)) == len(fws[key].inputs) >= 2
    assert copies(dict(host)) == []  # the same arrays: the device tensors hold them already
    name = sorted(fws[key].inputs)[0]
    assert len(copies(dict(host, **{name: host[name].copy()}))) == 1
    assert rec.violations == []


def test_stages_out_of_order_are_refused():
    bundle = specmod.load(BUNDLES / "qwen3-8b.yaml")
    rec, r, fws = recorded_runner(bundle, "N300")
    with pytest.raises(trace.OrderError, match="capture\\(\\) needs stage 'warm'"):
        r.capture()
    with pytest.raises(trace.OrderError, match="run\\(\\) needs stage 'captured'"):
        r.run(next(iter(fws)), host_inputs(next(iter(fws.values()))))
    r.prepare()
    with pytest.raises(trace.OrderError, match="prepare\\(\\) at stage 'prepared'"):
        r.prepare()
    assert "begin_trace_capture" not in [e.fn for e in rec.events]


def test_the_double_catches_a_compile_inside_capture():
    """If a bucket skipped its warm-up, its first run would compile during capture: the double
    says so (and the runner itself refuses to capture a cold bucket)."""
    bundle = specmod.load(BUNDLES / "mistral-7b-v0.3.yaml")
    rec, r, fws = recorded_runner(bundle, "N300")
    cold = ("prefill", max(b for p, b in fws if p == "prefill"))
    r.prepare()
    r.forwards = {k: v for k, v in fws.items() if k != cold}
    r.warmup()  # every bucket but one
    r.forwards = fws
    with pytest.raises(trace.OrderError, match="never warmed"):
        r.capture()
    r.warm.add(cold)  # pretend: the double must then see compiles inside the capture
    r.capture()
    assert any("compiled inside trace capture" in v for v in rec.violations)


def lowered_bundles():
    """The example bundles of families the ttnn backend lowers (``Family.ttnn_unlowered`` empty):
    all of them today (``test_every_example_family_is_lowered``)."""
    return [p for p in sorted(BUNDLES.glob("*.yaml")) if not specmod.load(p).family.ttnn_unlowered]


@pytest.mark.parametrize("path", lowered_bundles(), ids=lambda p: p.stem)
def test_every_bundle_runs_through_the_executor(path):
    """Every family's lowered forwards run through the executor (every name they read exists
    when they read it) in both sampling modes, warm-up -> capture -> replay, no violation."""
    bundle = specmod.load(path)
    ts = lowermod.trace_set(bundle)
    keys = [min(k for k in ts if k[0] == "prefill"), min(k for k in ts if k[0] == "decode")]
    for sampling in lowering.SAMPLING:
        rec, r, fws = recorded_runner(bundle, bundle.spec.targets[0], sampling, keys)
        r.warmup()
        r.capture()
        key = next(k for k in fws if k[0] == "decode")
        outs = r.run(key, host_inputs(fws[key]))
        assert set(outs) == set(fws[key].outputs) and rec.violations == []


def test_every_program_op_kind_has_a_lowering():
    kinds, fams = set(), set()
    for path in lowered_bundles():
        bundle = specmod.load(path)
        fams.add(bundle.family.name)
        for mesh in bundle.spec.targets:
            p = make_plan(bundle, mesh)
            for phase, b in lowermod.trace_set(bundle):
                prog = lowermod.lower(bundle, p, phase, b)
                kinds |= {lowering.step_kind(st) for _, _, st in prog.steps()}
    from ttbundle import families
    assert fams == set(families.all_families())  # every family has a lowered example bundle
    assert kinds <= set(lowering.OPS), sorted(kinds - set(lowering.OPS))


def test_every_example_family_is_lowered():
    """No example bundle's family is left out of the ttnn lowering (Qwen3-VL was the last one:
    its vision program and DeepStack step are lowered now); ``build --backend ttnn`` still
    refuses a family that sets ``Family.ttnn_unlowered`` (``test_a_family_not_lowered_...``)."""
    left = sorted({specmod.load(p).family.name for p in BUNDLES.glob("*.yaml")} -
                  {specmod.load(p).family.name for p in lowered_bundles()})
    assert left == []


def test_a_family_not_lowered_yet_has_its_ttnn_build_refused(tmp_path, monkeypatch):
    from ttbundle import build as buildmod
    from ttbundle.errors import InvalidInput

    bundle = specmod.load(BUNDLES / "qwen3-vl-8b-instruct.yaml")
    monkeypatch.setattr(type(bundle.family), "ttnn_unlowered", "its vision program")
    with pytest.raises(InvalidInput, match="not yet: --backend ttnn for qwen3_vl"):
        buildmod.build(bundle, "T3K", tmp_path, backend="ttnn")


def test_constants_shared_by_name_have_one_shape():
    """A model's forwards share host-made constants by name (``model.open_model`` makes each
    once), so a name must mean one shape in every bucket (the MoE routing zeros did not)."""
    for path in lowered_bundles():
        bundle = specmod.load(path)
        p = make_plan(bundle, bundle.spec.targets[0])
        fws, _ = forwards_of(bundle, p)
        shapes: dict = {}
        for fw in fws.values():
            for c in fw.consts:
                shapes.setdefault(c.name, set()).add((c.shape, c.dtype, c.layout, c.kind, c.params))
        assert {n: s for n, s in shapes.items() if len(s) > 1} == {}, path.stem


def test_liveness_drops_each_binding_after_its_last_reader():
    from ttbundle.backends.ttnn.calls import Call, T
    calls = [(None, Call("a", (T("in"),), out="x")), (None, Call("b", (T("x"),), out="y")),
             (None, Call("c", (T("x"), T("y")), out="x")), (None, Call("d", (T("x"),), out="out"))]
    drops = device.liveness(calls, {"in", "out"})
    assert drops == [[], [], ["y"], ["x"]]


def test_generate_drives_prefill_then_decode_replays():
    """The host side of one greedy sequence (inputs per bucket, replays, reading the token back)
    on the double: one prefill replay, then one decode replay per new token, no op outside them."""
    bundle = specmod.load(BUNDLES / "llama-3.1-8b.yaml")
    rec, r, fws = recorded_runner(bundle, "N300")
    r.warmup()
    r.capture()
    start = len(rec.events)
    toks = device.generate(r, list(range(1, 200)), 4, 32)
    assert len(toks) == 4 and all(isinstance(t, int) for t in toks)
    # the weights are fake, so the double says each token read back is unknown (given as 0)
    assert len(rec.zero_reads) == 4 and all("fake tensor" in why for _, why in rec.zero_reads)
    execs = [e for e in rec.events[start:] if e.fn == "execute_trace"]
    assert len(execs) == 4 and not [e for e in rec.events[start:] if rec.is_op(e)]
    pre = device.prefill_inputs(fws[("prefill", 1024)], list(range(1, 200)), 32)
    assert pre["last_rows"][0, 0].argmax(axis=-1).tolist()[:7] == list(range(192, 199))


# ---- cache explain on ttnn builds; tt-metal kernel cache pre-fill ---------------------------------
from ttbundle.backends.ttnn import kernelcache  # noqa: E402

STUB = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "riscv-tt-elf-g++ (tenstorrent/sfpi:7.89.0[1050]) 15.1.0"; exit 0; fi
exit 1
"""
# a stand-in for a real compiler: answers --version and writes the object file it is asked for
FAKE_GXX = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "riscv-tt-elf-g++ (fake) 15.1.0"; exit 0; fi
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then shift; printf 'ELF' > "$1"; fi; shift; done
"""


def _compiler(root: Path, text: str) -> Path:
    gxx = root / "runtime" / "sfpi" / kernelcache.COMPILERS[0]
    gxx.parent.mkdir(parents=True)
    gxx.write_text(text)
    gxx.chmod(0o755)
    return root / "runtime" / "sfpi"


def test_sfpi_candidates_follow_tt_metal_and_a_stub_is_not_a_compiler(tmp_path):
    env = {"TT_METAL_HOME": "/th", "TT_METAL_RUNTIME_ROOT": "/rr"}
    assert kernelcache.candidates("/site/ttnn", env) == [Path("/rr/runtime/sfpi"), Path("/th/runtime/sfpi"),
                                                         Path("/site/ttnn/runtime/sfpi"), Path("/opt/tenstorrent/sfpi")]
    stub = _compiler(tmp_path / "a", STUB)
    s = kernelcache.detect([stub])
    assert not s.found and "compiles nothing" in s.reason and s.key() == "none"
    real = _compiler(tmp_path / "b", FAKE_GXX)
    s = kernelcache.detect([tmp_path / "missing", stub, real])  # the stub is skipped, the next one counts
    assert s.found and s.path == str(real) and s.version == "riscv-tt-elf-g++ (fake) 15.1.0"
    assert s.key() == "sfpi riscv-tt-elf-g++ (fake) 15.1.0"
    assert not kernelcache.detect([tmp_path / "missing"]).found


def test_ttnn_build_without_sfpi_records_an_unfilled_kernel_cache(tmp_path, ckpt, monkeypatch):
    monkeypatch.delenv(kernelcache.PYTHON_ENV, raising=False)
    spec = write_spec(tmp_path, ckpt)
    r = CliRunner().invoke(app, ["build", str(spec), "--mesh", "N150", "-o", str(tmp_path / "out"),
                                 "--backend", "ttnn", "--no-warmup", "--json"])
    assert r.exit_code == 0, r.output
    done = [json.loads(x) for x in r.output.splitlines() if '"event": "done"' in x][-1]
    assert any("kernel cache not pre-filled" in w and "no Python with ttnn" in w for w in done["warnings"])
    m = read_manifest(Path(done["package"]))
    kc = m["artifacts"]["kernel_cache"]
    assert kc["filled"] is False and kc["files"] == [] and "no Python with ttnn" in kc["reason"]
    assert m["key_fields"]["kernel_cache"] == "none" and m["key_fields"]["backend"] == "ttnn"
    assert not (Path(done["package"]) / kernelcache.CACHE_DIR).exists()
    assert kernelcache.runtime_cache_dir(done["package"], m, tmp_path / "c") is None


def test_cache_explain_on_a_ttnn_build_reports_nothing_changed(tmp_path, ckpt):
    spec = write_spec(tmp_path, ckpt)
    res = buildmod.build(specmod.load(spec), "N300", tmp_path / "out", backend="ttnn", warmup=False)
    e = buildmod.explain(res.package)
    assert [f["field"] for f in e["fields"] if f["changed"]] == []
    assert e["current_key"] == res.key
    # built --no-warmup: `build` (warm-up by default) would run only the warm-up
    assert not e["up_to_date"] and not e["warmed"] and e["would_rebuild"]
    assert all(a.startswith("warmup:") for a in e["would_rebuild"])
    spec.write_text(spec.read_text().replace("decode: [1, 8]", "decode: [1, 4, 8]"))
    e = buildmod.explain(res.package)
    # a new decode bucket is a new trace: the region the build reserves grows (tracebudget), and
    # with it the programs' key (their KV pool is what is left beside it)
    assert [f["field"] for f in e["fields"] if f["changed"]] == ["spec", "spec.buckets", "trace_region_size"]


def test_ttnn_build_with_sfpi_fills_and_hashes_the_kernel_cache(tmp_path, ckpt, monkeypatch):
    found = kernelcache.Sfpi(True, "/opt/tenstorrent/sfpi", "riscv-tt-elf-g++ (fake) 15.1.0")
    calls = []

    def fake_fill(python, bundle_yaml, programs, mesh, trace_region_size, dest, emit=None):
        calls.append((python, mesh, bundle_yaml, programs, trace_region_size))
        (dest / "kernels" / "rms_norm" / "123").mkdir(parents=True)
        (dest / "kernels" / "rms_norm" / "123" / "trisc0.elf").write_bytes(b"\x7fELF" + bytes(60))
        (dest / "firmware.hex").write_text("00")
        return kernelcache.digest_files(dest)

    monkeypatch.setattr(kernelcache, "status", lambda env=None: (found, "/py-with-ttnn"))
    monkeypatch.setattr(kernelcache, "fill", fake_fill)
    spec = write_spec(tmp_path, ckpt)
    res = buildmod.build(specmod.load(spec), "N300", tmp_path / "out", backend="ttnn", warmup=False)
    assert [c[:2] for c in calls] == [("/py-with-ttnn", "N300")] and "kernel_cache" in res.rebuilt
    # handed the package's own programs and bundle.yaml (nothing for the fill to re-plan or lower)
    from ttbundle.package.load import load_package
    pk = load_package(res.package)
    _, _, yml, progs, trs = calls[0]
    assert yml == (Path(res.package) / "bundle.yaml").read_text()
    assert set(progs) == set(pk.programs) and all(progs[k] == pk.program_ir(*k) for k in pk.programs)
    assert trs == pk.trace_region_size
    m = verify_package(res.package)  # every cache file hashed in the manifest
    kc = m["artifacts"]["kernel_cache"]
    want = {f"{kernelcache.CACHE_DIR}/kernels/rms_norm/123/trisc0.elf", f"{kernelcache.CACHE_DIR}/firmware.hex"}
    assert kc["filled"] and set(kc["files"]) == want and want <= set(m["files"])
    assert m["key_fields"]["kernel_cache"] == "sfpi riscv-tt-elf-g++ (fake) 15.1.0"
    assert not any("kernel cache" in w for w in res.warnings)
    (Path(res.package) / kernelcache.CACHE_DIR / "firmware.hex").write_text("11")  # tampering is caught
    with pytest.raises(Exception, match="firmware.hex"):
        verify_package(res.package)
    (Path(res.package) / kernelcache.CACHE_DIR / "firmware.hex").write_text("00")
    assert buildmod.build(specmod.load(spec), "N300", tmp_path / "out", backend="ttnn", warmup=False).status == "up-to-date"
    # the runtime's copy: writable, once per package key
    d = kernelcache.runtime_cache_dir(res.package, m, tmp_path / "xdg")
    assert d == tmp_path / "xdg" / "ttbundle" / "tt-metal-cache" / m["key"]
    assert (d / "kernels" / "rms_norm" / "123" / "trisc0.elf").read_bytes()[:4] == b"\x7fELF"
    # a host without SFPI sees the kernel_cache key field change: a build there would redo it
    monkeypatch.setattr(kernelcache, "status", lambda env=None: (kernelcache.Sfpi(False, reason="none here"), None))
    e = buildmod.explain(res.package)
    assert [f["field"] for f in e["fields"] if f["changed"]] == ["kernel_cache"]


def test_programs_handed_over_to_a_ttnn_process_read_back_as_lowered(tmp_path):
    """What the build (kernel cache) and the tests (mockcheck) hand a ttnn process: the programs
    ``lower`` made and the package's bundle.yaml; read back, the same typed programs on the same
    mesh, lowered to the same calls. A program that does not type-check is refused, naming it."""
    from ttbundle import __version__
    from ttbundle.backends.ttnn import handover
    from ttbundle.program import ProgramError
    from ttbundle.ttnnproc import handed_over
    bundle = specmod.load(BUNDLES / "llama-3.1-8b.yaml")
    p = make_plan(bundle, "N300")
    progs = lowermod.lower_all(bundle, p)
    yml = render_bundle_yaml(resolved_spec(bundle, p), __version__)
    d = handover.write(tmp_path / "h", yml, progs)
    mesh, got = handover.read(d)
    got_bundle, mesh2, got2 = handed_over(d)  # the process's entry point adds the loader's bundle
    assert (mesh2, got2) == (mesh, got)
    assert got == progs and list(got) == list(progs)
    assert (mesh.name, mesh.shape, mesh.chip) == (p.mesh.name, p.mesh.shape, p.mesh.chip)
    assert got_bundle.arch == bundle.arch and got_bundle.spec.runtime == bundle.spec.runtime
    key = ("decode", 1)
    assert lowering.lower_forward(got_bundle, mesh, got[key]) == \
        lowering.lower_forward(bundle, p.mesh, progs[key])
    f = d / handover.PROGRAMS / "decode-1.json"
    prog = json.loads(f.read_text())
    for lp in prog["layers"]:  # every all_gather dropped
        lp["steps"] = [st for st in lp["steps"] if st.get("collective") != "all_gather"]
    f.write_text(json.dumps(prog))
    with pytest.raises(ProgramError, match=r"decode-1\.json: .*(no earlier step|collective missing)"):
        handover.read(d)


def test_the_ttnn_processes_run_handed_over_programs_on_the_double(tmp_path, monkeypatch, capsys):
    """``python -m ttbundle.ttnnproc kernelcache|mockcheck`` (what the build and the mock-mesh
    tests start): the handed-over bundle.yaml read by the package loader, every program lowered
    and run once through ttnn's calls, here the recording double standing in for ttnn (it reports
    no compute grid: the mock mesh's 8x8 is given)."""
    import sys

    from spec_helpers import TINY, dump
    from ttbundle import __version__, lower as lowermod, ttnnproc
    from ttbundle.backends.ttnn import handover
    bundle = specmod.loads(dump({**TINY, "targets": ["N300"], "tokenizer": False}), "t.yaml")
    p = make_plan(bundle, "N300")
    progs = {k: lowermod.lower(bundle, p, *k) for k in (("prefill", min(bundle.buckets.prefill)), ("decode", 1))}
    d = handover.write(tmp_path / "h", render_bundle_yaml(resolved_spec(bundle, p), __version__), progs)
    monkeypatch.setitem(sys.modules, "ttnn", recording.Recorder(unknown_reads="zeros").module())
    monkeypatch.setattr(ttnnproc, "worker_grid", lambda device: (8, 8))
    assert ttnnproc.main(["kernelcache", str(d), "N300"]) == 0
    ran = capsys.readouterr().out.splitlines()
    assert sorted(ln.split(":")[0] for ln in ran) == sorted(
        f"{ph}-{b} {s}" for ph, b in progs for s in lowering.samplings(ph)), ran
    assert all(ln.endswith("refused []") for ln in ran), ran
    assert ttnnproc.main(["mockcheck", "N300", str(d)]) == 0
    results = [json.loads(ln[7:]) for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT ")]
    assert {(r["phase"], r["bucket"]) for r in results} == set(progs)
    assert all(r["calls"] > 0 and not r["refused"] for r in results), results
    assert ttnnproc.main(["lower"]) == 2 and "usage" in capsys.readouterr().err


def test_a_handed_over_program_runs_on_the_mesh_it_records():
    """The mesh a handed-over program is lowered for is the one it records: the preset, or one
    replica's submesh of it (as ``plan.target_mesh`` splits a target), the target's name kept."""
    from ttbundle import mesh as meshmod
    from ttbundle.backends.ttnn import handover
    prog = lowermod.lower(specmod.load(BUNDLES / "llama-3.1-8b.yaml"),
                          make_plan(specmod.load(BUNDLES / "llama-3.1-8b.yaml"), "N300"), "decode", 1)
    assert handover.mesh_of(prog) == meshmod.resolve("N300")
    import dataclasses
    quarter = handover.mesh_of(dataclasses.replace(prog, mesh={"name": "TG", "shape": [2, 4], "arch": "wormhole_b0"}))
    assert quarter == meshmod.split(meshmod.resolve("TG"), (2, 4))
    assert (quarter.name, quarter.shape, quarter.target_shape) == ("TG", (2, 4), (8, 4))


# ---- collectives as ttnn CCL calls (recording double) ---------------------------------------------
def _expected_ccl(bundle, p, prog) -> list[tuple]:
    """From the program's steps (independently of the lowering): per collective step, one call per
    mesh axis it spans (a gather's innermost axis first: the numbers are checked on the double in
    tests/test_ttnn_double.py), (op, cluster_axis, dim, topology). Topology as tt-metal's models pick it:
    Ring on the wrap-around systems (T3K's 8 chips, a Galaxy's 8- and 4-wide axes), Linear where an
    axis is 2 wide (N300) or the chips are not wired in a ring (P150x4)."""
    out = []
    for kind in prog["layers"]:
        count = kind["count"] if kind["kind"] not in ("embedding", "head") else 1
        steps = [st for st in kind["steps"] if "collective" in st]
        for _ in range(count):
            for st in steps:
                for ax in (st["axes"][::-1] if st["collective"] == "all_gather" else st["axes"]):
                    n = p.mesh.axis_size(ax)
                    topo = "Topology.Ring" if p.mesh.name in ("T3K", "TG") and n > 2 else "Topology.Linear"
                    dim = None if st["collective"] == "all_reduce" else lowering.tt_dim(st["shape"], st["dim"])
                    out.append((st["collective"], ("rows", "cols").index(ax), dim, topo))
    return out


@pytest.mark.parametrize("name", ["llama-3.1-70b", "qwen3-8b", "gpt-oss-120b", "deepseek-v3"])
@pytest.mark.parametrize("mesh", ["N300", "T3K", "TG", "P150x4"])
def test_every_collective_is_the_right_ccl_call(name, mesh):
    bundle = specmod.load(BUNDLES / f"{name}.yaml")
    p = make_plan(bundle, mesh)
    ts = lowermod.trace_set(bundle)
    keys = [min(k for k in ts if k[0] == "prefill"), min(k for k in ts if k[0] == "decode")]
    rec, r, fws = recorded_runner(bundle, mesh, "device", keys)
    r.warmup()
    ev = [e for e in rec.events if e.fn in ("all_reduce", "all_gather")]
    want = []
    for key in keys:
        want += _expected_ccl(bundle, p, lowermod.lower(bundle, p, *key).to_json())
    got = [(e.fn, e.kwargs["cluster_axis"], e.args[1] if e.fn == "all_gather" else None, e.kwargs["topology"].path)
           for e in ev]
    assert want, "no collective on a multi-chip mesh"
    assert got == want
    assert all(e.kwargs["num_links"] == 1 for e in ev)


# ---- lowering gaps closed: Gemma 2 attention softcap, MLA chunk starts ----------------------------
def test_gemma2_attention_is_softcapped_with_the_emulated_mask():
    import torch

    from ttbundle.backends.emulated import kernels
    bundle = specmod.load(BUNDLES / "gemma-2-9b.yaml")
    p = make_plan(bundle, "N300")
    cap = bundle.arch.attn_logit_softcapping
    for phase in ("prefill", "decode"):
        b = min(k[1] for k in lowermod.trace_set(bundle) if k[0] == phase)
        fw = lowering.lower_forward(bundle, p.mesh, lowermod.lower(bundle, p, phase, b))
        assert fw.gaps == []
        calls = [c for _, c in fw.calls()]
        fns = [c.fn for c in calls]
        assert not any("scaled_dot_product_attention" in f for f in fns)
        caps = [c for c in calls if c.fn == "softcap"]
        assert len(caps) == bundle.arch.num_hidden_layers and {c.args[1] for c in caps} == {cap}
        assert {"attn_mask", f"attn_mask.w{bundle.arch.sliding_window}"} <= set(fw.inputs)
        # softcap after the scale and before the mask, per layer
        i = fns.index("softcap")
        assert fns[i - 1] == "multiply" and fns[i + 1] == "add" and fns[i + 2] == "softmax"
    # the host-made masks equal the emulated backend's (causal, window) at the same positions
    fw = lowering.lower_forward(bundle, p.mesh, lowermod.lower(bundle, p, "decode", 1))
    R, L = fw.inputs["attn_mask"][0][0], fw.inputs["attn_mask"][0][3]
    qpos = np.full((R, 1), -1)
    qpos[0, 0] = 37
    pos = torch.tensor([[37]])
    ctx = type("C", (), {})()
    ctx.cache, ctx.positions, ctx.context_slots = {}, pos, torch.zeros(1, L, dtype=torch.long)
    for window in (0, bundle.arch.sliding_window):
        want = kernels._mask(ctx, window)[0, 0].numpy()
        got = device.mask_inputs(fw, qpos)[lowering.mask_input(window)][0, 0, 0]
        np.testing.assert_array_equal(got == 0, want)
    pad = device.mask_inputs(fw, qpos)["attn_mask"][1, 0, 0]
    assert (pad == 0).tolist() == [True] + [False] * (L - 1)  # a padding row sees one slot: no NaN


def test_mla_prefill_is_lowered_per_chunk_start():
    bundle = specmod.load(BUNDLES / "deepseek-v3.yaml")
    p = make_plan(bundle, bundle.spec.targets[0])
    chunk = bundle.buckets.prefill_chunk or max(bundle.buckets.prefill)
    b = min(bundle.buckets.prefill)
    prog = lowermod.lower(bundle, p, "prefill", b)
    facts = of_bundle(bundle)  # what its manifest records (the buckets)
    starts = lowering.chunk_starts(facts, prog)
    assert starts == list(range(0, bundle.spec.runtime.max_model_len, chunk)) and len(starts) > 1
    assert lowering.chunk_starts(facts, lowermod.lower(bundle, p, "decode", 1)) == [0]
    for start in (0, starts[-1]):
        fw = lowering.lower_forward(bundle, p.mesh, prog, chunk_start=start)
        mla = [c for _, c in fw.calls() if c.fn == "transformer.chunked_flash_mla_prefill"]
        assert mla and {c.args[4] for c in mla} == {start} and fw.gaps == []
    assert lowering.static_start(facts, prog, starts[1]) == starts[1]
    with pytest.raises(ValueError, match="chunks start at multiples"):
        lowering.static_start(facts, prog, starts[1] + 32)
    llama = specmod.load(BUNDLES / "llama-3.1-8b.yaml")  # dynamic start: one forward for every start
    lp = lowermod.lower(llama, make_plan(llama, llama.spec.targets[0]), "prefill", 1024)
    assert lowering.chunk_starts(of_bundle(llama), lp) == [0] and lowering.static_start(of_bundle(llama), lp, 2048) == 0


def test_a_later_prefill_chunk_writes_its_own_blocks():
    bundle = specmod.load(BUNDLES / "llama-3.1-8b.yaml")
    p = make_plan(bundle, "N300")
    fw = lowering.lower_forward(bundle, p.mesh, lowermod.lower(bundle, p, "prefill", 128))
    fills = [c for _, c in fw.calls() if c.fn == "experimental.paged_fill_cache"]
    assert fills and all(c.args[2].name == "fill_page_table" for c in fills)
    bs = p.kv["block_size"]
    table = np.arange(100, 100 + fw.inputs["page_table"][0][1])
    ins = device.prefill_host_inputs(fw, np.arange(128), 100, 4 * bs, table, bs, bundle.spec.runtime.max_model_len)
    assert ins["fill_page_table"][0].tolist() == table[4:4 + -(-128 // bs)].tolist()
    assert ins["chunk_start"].tolist() == [4 * bs] and ins["positions"][0, 0] == 4 * bs
    assert ins["last_rows"][0, 0].argmax(-1).tolist()[:4] == [96, 97, 98, 99]
    with pytest.raises(ValueError, match="start on a KV block"):
        device.prefill_host_inputs(fw, np.arange(128), 100, bs + 1, table, bs, 4096)
