"""`ttbundle serve` as an operator meets it (issue 23): a bad or busy address is exit 2 before
anything is built or started, and no server outlives `ttbundle serve`, however it dies.

A stand-in for vLLM plays what matters of vLLM 0.33's process tree: an API server (answering
/health) that starts an engine process and, on SIGTERM, stops it and exits (vLLM's shutdown)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_build import ckpt, write_spec  # noqa: F401  (session fixture)
from ttbundle.serving import serve as servemod

FAKE = textwrap.dedent('''
    import http.server, json, os, signal, subprocess, sys, threading, time
    port, pids = int(sys.argv[1]), sys.argv[2]
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    def term(*a):
        engine.terminate(); engine.wait(); os._exit(0)
    signal.signal(signal.SIGTERM, term)
    signal.signal(signal.SIGINT, term)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
    open(pids, "w").write(json.dumps([os.getpid(), engine.pid]))
    srv.serve_forever()
''')

DRIVER = textwrap.dedent('''
    import sys
    from ttbundle.serving import serve
    plan = serve.ServePlan(".", "tiny", "N150", [sys.executable, sys.argv[1], sys.argv[2], sys.argv[3]],
                           {}, "127.0.0.1", int(sys.argv[2]))
    sys.exit(serve.run(plan, on_ready=lambda p: print("ready", flush=True), startup_timeout=60, health_every=0.5))
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie not yet reaped by init counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def serving(tmp_path):
    """`serve.run` of the stand-in in a child process: (driver, port, [api pid, engine pid])."""
    (tmp_path / "fake.py").write_text(FAKE)
    (tmp_path / "driver.py").write_text(DRIVER)
    port = _free_port()
    pids = tmp_path / "pids.json"
    drv = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "fake.py"), str(port),
                            str(pids)], stdout=subprocess.PIPE, text=True)
    assert drv.stdout.readline().strip() == "ready"
    procs = json.loads(pids.read_text())
    yield drv, port, procs
    for p in [drv.pid] + procs:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    drv.wait()


def _gone(pids: list[int], within: float) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_nothing_outlives_serve(serving, sig):
    drv, port, procs = serving
    assert servemod.healthy("127.0.0.1", port) and all(_alive(p) for p in procs)
    os.kill(drv.pid, sig)
    code = drv.wait(30)
    assert _gone(procs, 10), f"after {sig.name} to serve, its vLLM stand-in (API server, engine) still runs"
    assert not servemod.healthy("127.0.0.1", port, 1.0)
    if sig != signal.SIGKILL:  # a clean stop: exit 0
        assert code == 0


@pytest.mark.parametrize("port, says", [(70000, "1..65535"), (-1, "1..65535"), (0, "1..65535")])
def test_a_bad_port_is_exit_2_before_anything_starts(runner, port, says, monkeypatch):
    from ttbundle.cli import app

    def never(*a, **k):
        raise AssertionError("resolved/built before the address was checked")
    monkeypatch.setattr(servemod, "resolve", never)
    t0 = time.monotonic()
    r = runner.invoke(app, ["serve", "bundles/demo.yaml", "--port", str(port)])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("[error]") and says in lines[0]
    assert time.monotonic() - t0 < 1.0


def test_a_bad_host_and_a_busy_port_are_exit_2(runner, monkeypatch):
    from ttbundle.cli import app

    monkeypatch.setattr(servemod, "resolve", lambda *a, **k: pytest.fail("resolved before the check"))
    r = runner.invoke(app, ["serve", "bundles/demo.yaml", "--host", "999.1.1.1"])
    assert r.exit_code == 2 and "--host 999.1.1.1" in r.output and "Traceback" not in r.output
    with socket.socket() as s:  # another server on the port
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        t0 = time.monotonic()
        r = runner.invoke(app, ["serve", "bundles/demo.yaml", "--port", str(busy)])
        assert r.exit_code == 2 and "already in use" in r.output, r.output
        assert time.monotonic() - t0 < 1.0
    # the same port once free is accepted (the check does not hold it)
    servemod.check_address("127.0.0.1", busy)


# ---- SIGKILL while vLLM starts (issue 43) ---------------------------------------------------------------
#: vLLM while it starts: an API server and its engine that ignore SIGTERM (vLLM ignores or defers it
#: until its server runs) and are not healthy yet
STARTING = textwrap.dedent('''
    import json, os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    port, pids = int(sys.argv[1]), sys.argv[2]
    engine = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open(pids, "w").write(json.dumps([os.getpid(), engine.pid]))
    time.sleep(600)
''')


def test_sigkill_of_serve_while_vllm_starts_leaves_nothing(tmp_path):
    """Was: the parent-death SIGTERM arrived while vLLM's start-up ignored it, and its API server
    and engine went on (re-parented to PID 1), serving 90 s later. The watchdog kills the group."""
    (tmp_path / "fake.py").write_text(STARTING)
    (tmp_path / "driver.py").write_text(DRIVER)
    pids = tmp_path / "pids.json"
    drv = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "fake.py"),
                            str(_free_port()), str(pids)])
    t0 = time.monotonic()
    while not pids.exists() and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    procs = json.loads(pids.read_text())
    try:
        time.sleep(0.3)
        assert all(_alive(p) for p in procs)
        os.kill(drv.pid, signal.SIGKILL)
        drv.wait(10)
        assert _gone(procs, 10), "after SIGKILL to serve during start-up, vLLM's stand-in still runs"
    finally:
        for p in procs:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---- Ctrl-C, SIGTERM and SIGHUP during `serve SPEC`'s build (issue 43) ------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_the_build_stops_serve_in_one_line_and_removes_the_temp_dir(tmp_path, ckpt, sig):
    """Was: SIGINT ignored when serve started with SIGINT ignored (`serve SPEC &` in a script):
    it built and served 18 s later; SIGTERM/SIGHUP killed it silently (rc 143) and left the build's
    temp dir. Now each stops it where it is: one line, exit 0, the temp dir gone, nothing served."""
    spec = write_spec(tmp_path, ckpt)
    out = tmp_path / "out"
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ttbundle.cli", "serve", str(spec), "--mesh", "N150", "-o",
                             str(out), "--port", str(port), "--device", "emulated"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    tmp = out / ".ttbundle" / "tmp"
    try:
        t0 = time.monotonic()
        while not (tmp.is_dir() and any(tmp.iterdir())):  # the build is writing its temp package
            assert proc.poll() is None and time.monotonic() - t0 < 120, proc.communicate()
            time.sleep(0.01)
        os.kill(proc.pid, sig)
        o, e = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # it went on (to serve): its own clean stop, vLLM included
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
    assert proc.returncode == 0, (proc.returncode, e)
    lines = [x for x in e.splitlines() if not x.startswith("build: ")]
    assert lines == [f"stopped by {'SIGINT (Ctrl-C)' if sig == signal.SIGINT else sig.name} before vLLM "
                     "started; nothing was served"], e
    assert "Traceback" not in o + e and not any(tmp.iterdir())
    assert not (out / "N150" / "tiny").exists()
    assert not servemod.healthy("127.0.0.1", port, 0.5)



SWALLOW = textwrap.dedent('''
    import gc, os, signal, sys
    from ttbundle.serving import serve
    serve.stop_on_signals()

    class Lock:  # as an import's module lock: its weakref callback runs where exceptions are ignored
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here: Python ignores it

    Lock(); gc.collect()
    print("went on", flush=True)
    try:
        serve.raise_swallowed()
    except serve.Stopped as e:
        print("stopped by", serve.stop_name(e))
        sys.exit(0)
    print("lost")
''')


def test_a_stop_signal_python_swallows_is_raised_at_the_next_step(tmp_path):
    """The CI failure of test_a_signal_during_the_build...: the signal landed in an import's module
    lock callback ("Exception ignored in: <function _get_module_lock.<locals>.cb>"), the stop was
    lost and the build went on. Now it is kept, unprinted, and raised at the build's next step."""
    script = tmp_path / "swallow.py"
    script.write_text(SWALLOW)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines() == ["went on", "stopped by SIGTERM"], (r.stdout, r.stderr)
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
