"""`ttbundle serve --device tt|emulated`: the default follows whether a Tenstorrent device is
present (``activation.tt_hardware_missing``), `--device tt` without one is exit 2 saying why, a
device serves a package built with `--backend ttnn` in bf16 on the TT platform. The device is the
recording double (test-only hook ``TTBUNDLE_TEST_TTNN=recording``); this host has none."""

from __future__ import annotations

import socket

import pytest

from runtime_helpers import spec_text
from ttbundle.runtime import activation


@pytest.fixture(scope="module")
def ttnn_package(tmp_path_factory):
    from ttbundle.serving.demo import build_package
    return build_package(spec_text("llama"), tmp_path_factory.mktemp("serve-tt"), "N150", backend="ttnn",
                         warmup=False)


def _command(runner, *args):
    from ttbundle.cli import app
    return runner.invoke(app, ["serve", *args, "--print-command"])


def test_without_a_device_the_default_is_emulated_and_tt_is_refused(make_package, runner, monkeypatch):
    monkeypatch.delenv(activation.TEST_TTNN, raising=False)
    pkg, _ = make_package("llama", "N150")
    assert activation.tt_hardware_missing() == "no Tenstorrent device on this host (/dev/tenstorrent is missing)"
    r = _command(runner, str(pkg))
    assert r.exit_code == 0, r.output
    assert "TTBUNDLE_EMULATED=1" in r.output and "--dtype float32" in r.output
    r = _command(runner, str(pkg), "--device", "tt")
    assert r.exit_code == 2 and "--device tt: no Tenstorrent device on this host" in r.output
    assert "--device emulated" in r.output and "Traceback" not in r.output
    r = _command(runner, str(pkg), "--device", "gpu")
    assert r.exit_code == 2 and "--device gpu: choose one of tt, emulated" in r.output


def test_with_a_device_the_default_is_tt(ttnn_package, make_package, runner, monkeypatch):
    monkeypatch.setenv(activation.TEST_TTNN, "recording")
    r = _command(runner, str(ttnn_package))
    assert r.exit_code == 0, r.output
    assert "TTBUNDLE_EMULATED=0" in r.output and "--dtype bfloat16" in r.output and "MESH_DEVICE=N150" in r.output
    r = _command(runner, str(ttnn_package), "--device", "emulated")  # the emulated dtype stays fp32
    assert r.exit_code == 0 and "TTBUNDLE_EMULATED=1" in r.output and "--dtype float32" in r.output
    emulated_only, _ = make_package("llama", "N150")
    r = _command(runner, str(emulated_only))
    assert r.exit_code == 2 and "built for the emulated mesh only" in r.output
    assert "ttbundle build --backend ttnn" in r.output


def test_a_spec_served_on_a_device_is_built_for_it(ttnn_package, runner, monkeypatch, tmp_path):
    """The README's `ttbundle serve SPEC --mesh M` on a device host: the package is built with the
    ttnn backend (tensorbin weights) and served on the TT platform."""
    import json

    monkeypatch.setenv(activation.TEST_TTNN, "recording")
    spec = ttnn_package.parent.parent / "tiny-llama.yaml"  # build_package keeps the spec there
    r = _command(runner, str(spec), "--mesh", "N150", "-o", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    built = tmp_path / "out" / "N150" / "tiny-llama"
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["key_fields"]["backend"] == "ttnn" and (built / "tensorbin" / "index.json").is_file()
    assert "TTBUNDLE_EMULATED=0" in r.output and str(built) in r.output


@pytest.mark.slow
def test_serve_on_the_device_answers_completions(ttnn_package, monkeypatch, tmp_path):
    """The whole `ttbundle serve --device tt` command line through real `vllm serve` on the TT
    platform (the double's weights are fake: the token count is checked, not the tokens)."""
    import openai

    from ttbundle.serving.serve import plan_serve, start, stop, wait_healthy

    monkeypatch.setenv(activation.TEST_TTNN, "recording")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = plan_serve(ttnn_package, "127.0.0.1", port, [], "tt")
    log = tmp_path / "vllm.log"
    with open(log, "wb") as f:
        proc = start(plan, log=f)
    try:
        wait_healthy(proc, plan.host, plan.port, timeout=600)
        c = openai.OpenAI(base_url=plan.url, api_key="none", timeout=300, max_retries=0)
        r = c.completions.create(model=plan.name, prompt=[5, 17, 99, 3], max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        text = log.read_text()  # while serving (vLLM's own shutdown may log the engine's exit)
        assert "on a Tenstorrent N150 mesh" in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
    finally:
        stop(proc)


# ---- serve --require-precompiled (issue 41, item 4) ------------------------------------------------
def test_require_precompiled_names_what_would_compile_on_the_device(ttnn_package, runner, monkeypatch):
    """Built without an SFPI compiler, the package's kernel cache is empty: on a TT device every
    program's kernels (and the traces captured from them) would compile at start, so
    `--require-precompiled` is exit 2 before vLLM starts, naming each program and why. The
    manifest lists what the package brings compiled."""
    import json

    monkeypatch.setenv(activation.TEST_TTNN, "recording")
    m = json.loads((ttnn_package / "manifest.json").read_text())
    pre = m["precompiled"]
    assert pre["programs"] == sorted(a.split(":", 1)[1] for a in m["artifacts"] if a.startswith("program:"))
    assert pre["kernels"] == [] and "kernels_missing_reason" in pre
    r = _command(runner, str(ttnn_package), "--device", "tt", "--require-precompiled")
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "--require-precompiled: tiny-llama-N150 on the tt device would compile" in out
    assert f"the kernels of {len(pre['programs'])} programs, not in the package's kernel cache (" in out
    for name in pre["programs"]:
        assert f" {name} (" in out
    assert "decode-1 (device/host sampling, 2 traces captured from them)" in out
    assert "Traceback" not in r.output and "vllm" not in out.split("fix:")[0].lower().replace("--require", "")
    r = _command(runner, str(ttnn_package), "--device", "tt")  # without the flag it starts (and compiles)
    assert r.exit_code == 0, r.output


def test_require_precompiled_passes_with_a_filled_kernel_cache(tmp_path, runner, monkeypatch):
    """A package whose build filled the kernel cache for every program (a fake SFPI fill, as in
    test_ttnn_backend) starts under `--require-precompiled` on the device; a TT_METAL_CACHE of
    the caller's would replace the package's cache and is refused by name."""
    from ttbundle.backends.ttnn import kernelcache
    from ttbundle.serving.demo import build_package

    found = kernelcache.Sfpi(True, "/opt/tenstorrent/sfpi", "riscv-tt-elf-g++ (fake) 15.1.0")

    def fake_fill(python, bundle_yaml, programs, mesh, trace_region_size, dest, emit=None):
        (dest / "kernels").mkdir(parents=True)
        (dest / "kernels" / "k.elf").write_bytes(b"\x7fELF" + bytes(60))
        return kernelcache.digest_files(dest)

    monkeypatch.setattr(kernelcache, "status", lambda env=None: (found, "/py-with-ttnn"))
    monkeypatch.setattr(kernelcache, "fill", fake_fill)
    pkg = build_package(spec_text("llama"), tmp_path, "N150", backend="ttnn", warmup=False)
    monkeypatch.setenv(activation.TEST_TTNN, "recording")
    monkeypatch.delenv("TT_METAL_CACHE", raising=False)
    r = _command(runner, str(pkg), "--device", "tt", "--require-precompiled")
    assert r.exit_code == 0, r.output
    monkeypatch.setenv("TT_METAL_CACHE", str(tmp_path / "elsewhere") + "/")
    r = _command(runner, str(pkg), "--device", "tt", "--require-precompiled")
    assert r.exit_code == 2 and "TT_METAL_CACHE=" in r.output and "unset it" in " ".join(r.output.split())


def test_require_precompiled_on_the_emulated_mesh(make_package, runner, monkeypatch, tmp_path):
    """On the emulated mesh nothing compiles at start (vLLM's compilation is off there), so a
    complete package starts; a program the manifest does not list as lowered at build is named."""
    import json
    import shutil

    monkeypatch.delenv(activation.TEST_TTNN, raising=False)
    pkg, _ = make_package("llama", "N150")
    r = _command(runner, str(pkg), "--device", "emulated", "--require-precompiled")
    assert r.exit_code == 0, r.output
    cut = tmp_path / "cut"
    shutil.copytree(pkg, cut)
    m = json.loads((cut / "manifest.json").read_text())
    m["precompiled"]["programs"].remove("prefill-32")
    (cut / "manifest.json").write_text(json.dumps(m))
    r = _command(runner, str(cut), "--device", "emulated", "--require-precompiled")
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "on the emulated device would compile before serving" in out, r.output
    assert "program prefill-32: not lowered at build" in out and "Traceback" not in r.output


# ---- trace_region_size against what the package's traces need (issue 41, item 2) --------------------
#: ttnn functions that build a memory config on the host (dispatch nothing into a trace)
HOST_SIDE = {"num_cores_to_corerangeset", "create_sharded_memory_config"}


def test_trace_need_counts_what_the_runtime_captures(ttnn_package):
    """The need is what the TT runtime captures: each traced forward (both sampling variants:
    the host-sampled fallback is traced too) with the calls the recording double records inside
    its capture, each trace padded as tt-metal pads it after PR #47122 (total across banks, a
    trace rounded up to 8 KiB pages on each of the 12 Wormhole banks)."""
    from ttbundle.backends.ttnn import model as ttmodel, recording
    from ttbundle import tracebudget
    from ttbundle.package.load import load_package

    pk = load_package(ttnn_package)
    tn = tracebudget.package_need(pk)
    rec = recording.Recorder(unknown_reads="zeros")
    runner = ttmodel.open_model(rec.module(), pk, "all", host_fallback=True)
    runner.ex.on_call = rec.on_call
    runner.warmup()
    begin = len(rec.events)
    runner.capture()
    per_trace, n = [], None
    for ev in rec.events[begin:]:
        if ev.fn == "begin_trace_capture":
            n = 0
        elif ev.fn == "end_trace_capture":
            per_trace.append(n)
            n = None
        elif n is not None and ev.capturing and ev.fn.split(".")[-1][:1].islower() and ev.fn not in HOST_SIDE:
            n += 1  # an op; config objects (MatmulMultiCore...Config, CoreCoord) are host-side
    assert len(per_trace) == len(runner.traced) == len(tn.traces) == 2 * 9  # 3 prefill + 6 decode, x2
    assert [t[0] for t in tn.traces] == [k for k in runner.forwards if k in runner.traced]
    assert [t[1] for t in tn.traces] == per_trace
    banks = 12  # Wormhole DRAM banks
    for _, calls, b in tn.traces:
        unit = 8192 * banks
        assert b == -(-calls * 8192 // unit) * unit and b - unit < calls * 8192 <= b
    assert tn.need == sum(t[2] for t in tn.traces) and tn.suggested >= 1.25 * tn.need
    assert tn.suggested % (1 << 20) == 0


def test_a_trace_region_override_below_the_need_is_refused(ttnn_package, runner, monkeypatch, tmp_path):
    """`--additional-config '{"tt": {"trace_region_size": N}}'` (or the spec's
    runtime.trace_region_size) below the need: exit 3 before vLLM starts, with the arithmetic;
    at the need it starts. The plan's own estimate below the need is a warning with the size to
    pass."""
    import json

    from ttbundle import tracebudget
    from ttbundle.cli import app
    from ttbundle.package.load import load_package
    from ttbundle.serving.demo import build_package

    monkeypatch.setenv(activation.TEST_TTNN, "recording")
    need = tracebudget.package_need(load_package(ttnn_package)).need

    def cfg(n):  # after --print-command (_command appends it): vLLM's arguments come after --
        return ["--print-command", "--", "--additional-config", json.dumps({"tt": {"trace_region_size": n}})]

    r = runner.invoke(app, ["serve", str(ttnn_package), "--device", "tt", *cfg(need - 1)])
    out = " ".join(r.output.split())
    assert r.exit_code == 3, r.output
    assert f"trace_region_size {need - 1:,} B (--additional-config tt.trace_region_size) is below" in out
    assert f"= {need:,} B, total across the chip's DRAM banks" in out and "1 B short" in out
    assert "Traceback" not in r.output and "vllm serve" not in r.output
    r = runner.invoke(app, ["serve", str(ttnn_package), "--device", "tt", *cfg(need)])
    assert r.exit_code == 0 and "trace_region_size" in r.output and "warning" not in r.output, r.output
    r = _command(runner, str(ttnn_package), "--device", "tt")  # the package's own size: the need + headroom
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    r = runner.invoke(app, ["serve", str(ttnn_package), "--device", "emulated", *cfg(1)])  # no traces on the emulated mesh
    assert r.exit_code == 0, r.output
    import yaml
    d = yaml.safe_load(spec_text("llama"))
    d["runtime"]["trace_region_size"] = 1 << 20
    spec = yaml.safe_dump(d, sort_keys=False)
    from ttbundle.errors import DoesNotFit
    with pytest.raises(DoesNotFit) as ei:  # refused at build, at the spec's line, with the arithmetic
        build_package(spec, tmp_path, "N150", backend="ttnn", warmup=False)
    msg = " ".join(str(ei.value).split())
    assert f"runtime.trace_region_size {1 << 20:,} B is below what" in msg and ".yaml:" in msg
    assert f"= {need:,} B, total across the chip's DRAM banks" in msg
    assert not list((tmp_path / "N150").glob("*/manifest.json"))  # nothing half-written
    d["runtime"]["trace_region_size"] = need  # at the need it builds, and serve opens the mesh with it
    spec = yaml.safe_dump(d, sort_keys=False)
    ok = build_package(spec, tmp_path / "ok", "N150", backend="ttnn", warmup=False)
    assert load_package(ok).trace_region_size == need
    r = _command(runner, str(ok), "--device", "tt")
    assert r.exit_code == 0 and "warning" not in r.output, r.output


def test_a_ttnn_package_opens_its_mesh_with_the_traces_need(ttnn_package, monkeypatch):
    """The one owner of the size (``tracebudget``): a ttnn build reserves the need of its
    programs' traces (as the recording double captures them) plus the headroom, records it, and
    the TT runtime opens the mesh with that size; the first plan's op-count estimate is below it
    (what the runtime used to be opened with)."""
    from ttbundle import tracebudget
    from ttbundle.package.load import load_package
    from ttbundle.plan.make import make_plan

    pk = load_package(ttnn_package)
    tn = tracebudget.package_need(pk)
    rec = pk.manifest["trace_region"]
    assert rec["need"] == tn.need and rec["size"] == pk.trace_region_size == tn.suggested
    assert rec["source"] == "need + headroom" and rec["traces"] == len(tn.traces)
    assert make_plan(pk.bundle, pk.mesh.name).trace_region_size < tn.need  # the estimate it replaces
    assert pk.manifest["trace_region_bytes"] >= tn.suggested  # the DRAM the plan gave up for it
