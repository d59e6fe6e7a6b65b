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
