"""A clean stop of real vLLM through `ttbundle serve` (issue 23): SIGINT (Ctrl-C, a supervisor's
stop) on a healthy server prints what stopped and no more, exits 0 and leaves no process behind.
(The stand-in tests in tests/test_serve_faults.py cover SIGTERM, SIGHUP and SIGKILL.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from runtime_helpers import free_port, spec_text
from ttbundle.serving.demo import build_package
from ttbundle.serving.serve import healthy


def _reap(proc, tree) -> None:
    """Whatever a failed test left running: serve, and every process of its tree."""
    if proc.poll() is None:
        proc.kill()
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.mark.slow
def test_ctrl_c_stops_real_vllm_quietly(tmp_path):
    pkg = build_package(spec_text("llama"), tmp_path / "packages", "N150")
    port = free_port()
    log = tmp_path / "serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    exe = [os.path.join(os.path.dirname(sys.executable), "ttbundle")]
    with open(log, "w") as f:
        proc = subprocess.Popen(exe + ["serve", str(pkg), "--port", str(port)], stdout=f, stderr=subprocess.STDOUT,
                                env=env)
    try:
        t0 = time.monotonic()
        while not healthy("127.0.0.1", port):
            assert proc.poll() is None and time.monotonic() - t0 < 600, log.read_text()[-3000:]
            time.sleep(1)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 2  # vLLM's API server and its engine
        before = len(log.read_text().splitlines())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        after = [x for x in log.read_text().splitlines()[before:] if "GET /health" not in x]
        gone, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, f"left running: {alive}"
        text = "\n".join(after)
        assert len(after) <= 3, text
        for noise in ("Traceback", "ERROR", "nanobind", "force killing", "EngineDeadError"):
            assert noise not in text, text
        assert "vLLM stopped" in text
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigkill_of_serve_during_vllms_start_up_leaves_no_process(tmp_path):
    """Issue 43: SIGKILL of `ttbundle serve` once vLLM's API server has started its engine, before
    /health answers, left both running (vLLM defers its parent-death SIGTERM while it starts),
    answering completions 90 s later. The watchdog kills vLLM's process group."""
    pkg = build_package(spec_text("llama"), tmp_path / "packages", "N150")
    port = free_port()
    log = tmp_path / "serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ttbundle.cli", "serve", str(pkg), "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    tree = []
    try:
        t0 = time.monotonic()
        while True:  # vLLM's API server and its engine process both started, /health not yet
            assert proc.poll() is None and time.monotonic() - t0 < 600, log.read_text()[-3000:]
            try:
                tree = [p for p in psutil.Process(proc.pid).children(recursive=True)
                        if "-c" not in p.cmdline()[1:3]]  # not the watchdog
            except psutil.Error:
                tree = []
            if len(tree) >= 2 and "ttbundle: loaded" in log.read_text():
                break
            time.sleep(0.1)
        assert not healthy("127.0.0.1", port, 0.5), "healthy already: not the start-up phase"
        proc.kill()
        proc.wait(10)
        gone, alive = psutil.wait_procs(tree, timeout=20)
        assert not alive, f"left running after SIGKILL of serve during start-up: {alive}"
        time.sleep(1)
        assert not healthy("127.0.0.1", port, 1.0)
    finally:
        _reap(proc, tree)


def _starting(tmp_path, port, preexec=None):
    """`ttbundle serve` of a fresh package, returned once vLLM's API server and engine run and
    /health does not answer yet: (serve process, its log, vLLM's processes)."""
    pkg = build_package(spec_text("llama"), tmp_path / "packages", "N150")
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ttbundle.cli", "serve", str(pkg), "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                                preexec_fn=preexec)
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None and time.monotonic() - t0 < 600, log.read_text()[-3000:]
        try:
            tree = [p for p in psutil.Process(proc.pid).children(recursive=True) if "-c" not in p.cmdline()[1:3]]
        except psutil.Error:
            tree = []
        if len(tree) >= 2 and "ttbundle: loaded" in log.read_text():
            return proc, log, tree
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_vllms_start_up_is_one_line_and_leaves_no_process(tmp_path, sig):
    """Issue 43: Ctrl-C before /health answered printed two KeyboardInterrupt tracebacks (~50
    lines) from vLLM's processes; SIGTERM was deferred by vLLM's start-up. Now the group, which
    never served, is killed: `vLLM stopped`, exit 0, no traceback, nothing left. SIGINT is sent
    to a serve started with SIGINT ignored (`ttbundle serve ... &` in a script)."""
    port = free_port()
    ign = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sig == signal.SIGINT else None
    proc, log, tree = _starting(tmp_path, port, ign)
    try:
        assert not healthy("127.0.0.1", port, 0.5), "healthy already: not the start-up phase"
        before = len(log.read_text().splitlines())
        proc.send_signal(sig)
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(tree, timeout=20)
        assert not alive, f"left running: {alive}"
        after = log.read_text().splitlines()[before:]
        text = "\n".join(after)
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
        assert after[-1] == "vLLM stopped" and len(after) <= 5, text
    finally:
        _reap(proc, tree)


def _serve_until_exit(pkg, tmp_path, *extra) -> tuple[int, list[str]]:
    r = subprocess.run([sys.executable, "-m", "ttbundle.cli", "serve", str(pkg), "--port", str(free_port()),
                        *extra], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=tmp_path)
    return r.returncode, (r.stdout + r.stderr).strip().splitlines()


@pytest.mark.slow
def test_a_cause_raised_inside_vllms_processes_is_serves_last_line(tmp_path):
    """Issue 43: an option refused by the platform (vLLM's API server) or a warm-up mismatch (its
    engine process) ended in `[error] vLLM exited with code 1 before it was healthy (its output
    above says why)`, the cause only inside a traceback among ~170 lines. Now the last line says it."""
    import json as _json
    import shutil

    from pkg_mutations import flip_byte
    from ttbundle.package.names import weight_file

    pkg = build_package(spec_text("llama"), tmp_path / "packages", "N150")
    code, lines = _serve_until_exit(pkg, tmp_path, "--", "--additional-config",
                                    '{"tt": {"output_tokens_per_step": "4"}}')
    assert code == 1 and lines[-1] == ("[error] vLLM exited with code 1 before it was healthy: --additional-config: "
                                       "tt.output_tokens_per_step: Input should be a valid integer, got '4'"), lines[-5:]
    code, lines = _serve_until_exit(pkg, tmp_path, "--", "--additional-config",
                                    '{"tt": {"output_tokens_per_step": 5}}')
    assert code == 1 and lines[-1].startswith("[error] vLLM exited with code 1 before it was healthy: "
                                              "output_tokens_per_step=5 exceeds"), lines[-5:]
    bad = tmp_path / "changed" / "tiny-llama"
    shutil.copytree(pkg, bad)
    raw = (bad / weight_file(0)).read_bytes()
    header = _json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    key = sorted(k for k in header if "norm" in k and k != "__metadata__")[0]
    flip_byte(bad, weight_file(0), key, offset=1)  # re-hashed: only the warm-up's numbers can tell
    code, lines = _serve_until_exit(bad, tmp_path)
    assert code == 1 and lines[-1].startswith("[error] vLLM exited with code 1 before it was healthy: "
                                              "WarmupMismatch: "), lines[-5:]
    assert "row" in lines[-1]
