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
        if proc.poll() is None:
            proc.kill()
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass


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
        if proc.poll() is None:
            proc.kill()
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
