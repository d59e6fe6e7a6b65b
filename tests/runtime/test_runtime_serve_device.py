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
