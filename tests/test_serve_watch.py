"""`ttbundle serve` does not exit 0 when vLLM or its engine dies (issue 15). A stand-in for vLLM's
API server (an HTTP server answering /health) plays what vLLM 0.33 does when its engine process
is killed: it answers 503 from then on, or shuts itself down with exit code 0."""

from __future__ import annotations

import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ttbundle.serving import serve as servemod

FAKE = textwrap.dedent('''
    import http.server, os, sys, threading, time
    mode, port = sys.argv[1], int(sys.argv[2])
    t0 = time.monotonic()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            dead = mode == "engine-dead" and time.monotonic() - t0 > 1.0
            self.send_response(503 if dead else 200)
            self.end_headers()
        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    time.sleep(1.5)
    if mode == "exit-0":      # the API server shutting down after EngineDeadError
        os._exit(0)
    if mode == "exit-3":
        os._exit(3)
    if mode == "killed":
        os.kill(os.getpid(), 9)
    time.sleep(60)            # engine-dead / healthy: keep serving (old code waited here, then got 0)
    os._exit(0)
''')


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(tmp_path: Path, mode: str) -> servemod.ServePlan:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE)
    port = _port()
    return servemod.ServePlan(tmp_path, "tiny", "N150", [sys.executable, str(script), mode, str(port)],
                              {}, "127.0.0.1", port)


@pytest.mark.parametrize("mode, code, says", [
    ("exit-0", 1, "exit code 0"), ("exit-3", 3, "exit code 3"), ("killed", 1, "killed by signal 9"),
    ("engine-dead", 1, "stopped answering"),
])
def test_serve_fails_when_vllm_or_its_engine_dies(tmp_path, mode, code, says):
    plan = _plan(tmp_path, mode)
    ready = []
    t0 = time.monotonic()
    with pytest.raises(servemod.ServeFailed) as ei:
        servemod.run(plan, on_ready=ready.append, startup_timeout=30, health_every=0.2)
    assert ready == [plan]
    assert ei.value.exit_code == code and says in str(ei.value) and "\n" not in str(ei.value)
    assert time.monotonic() - t0 < 30, "noticed only when the stand-in exited by itself"


def test_cli_serve_exits_non_zero_with_a_one_line_reason(tmp_path, runner, monkeypatch):
    from ttbundle.cli import app

    plan = _plan(tmp_path, "exit-0")
    monkeypatch.setattr(servemod, "resolve", lambda *a, **k: tmp_path)
    monkeypatch.setattr(servemod, "plan_serve", lambda *a, **k: plan)
    r = runner.invoke(app, ["serve", "tiny"])
    assert r.exit_code == 1, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("[error]")]
    assert len(lines) == 1 and "vLLM exited while serving (exit code 0)" in lines[0]
    assert "Traceback" not in r.output
