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
