"""`ttbundle serve` (issue 43, after the watchdog and the plugin's recorded causes): a stop signal
while `serve.run` sets vLLM up (its logging configuration imports vLLM, seconds on a busy host)
is a clean stop too, and a failed start whose cause the plugin did not record (vLLM's own
validation) still ends in one line naming it, read from the first traceback in vLLM's output.

A stand-in plays vLLM (tests/test_serve_faults.py has the others); pydantic itself writes the
tracebacks the parser is checked on."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ttbundle.serving import serve as servemod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: serve.run of a stand-in that would leave a marker if it ever started; vLLM's logging set-up
#: (serve.quiet_logging_config) made to take 30 s, saying when it begins
SETUP_DRIVER = textwrap.dedent('''
    import sys, time
    from ttbundle.serving import serve
    def slow_quiet(directory):
        print("SETTING-UP", flush=True)
        time.sleep(30)
    serve.quiet_logging_config = slow_quiet
    marker, port = sys.argv[1], int(sys.argv[2])
    plan = serve.ServePlan(".", "tiny", "N150", [sys.executable, "-c", f"open({marker!r}, 'w')"], {},
                           "127.0.0.1", port)
    code = serve.run(plan, startup_timeout=60)
    print(f"RETURNED {code}", flush=True)
''')


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_while_vllm_is_set_up_is_clean(tmp_path, sig):
    """Was: the signal arrived before run's `try` (while it imported vLLM for its logging
    configuration): a KeyboardInterrupt traceback, exit 1 (rc 130 for SIGINT)."""
    (tmp_path / "driver.py").write_text(SETUP_DRIVER)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    marker = tmp_path / "vllm-started"
    drv = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(marker), str(_free_port())],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, TMPDIR=str(tmpdir)),
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert drv.stdout.readline().strip() == "SETTING-UP", drv.stderr.read()
        os.kill(drv.pid, sig)
        out, err = drv.communicate(timeout=20)
    finally:
        if drv.poll() is None:
            drv.kill()
            drv.communicate()
    assert drv.returncode == 0 and out.strip() == "RETURNED 0", (drv.returncode, out, err)
    assert "Traceback" not in err, err
    assert not marker.exists(), "vLLM was started after the stop"
    assert not list(tmpdir.iterdir()), "run's temporary directory was left"


def _pydantic_traceback(tmp_path, body: str) -> str:
    """What Python prints for an uncaught pydantic ValidationError raised by ``body``."""
    code = "import pydantic\nfrom pydantic import Field\n" + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback (most recent call last):" in r.stderr, r.stderr
    return r.stderr


FIELD_ERROR = '''
    @pydantic.dataclasses.dataclass
    class CacheConfig:
        gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)
    CacheConfig(gpu_memory_utilization=2.0)
'''
MODEL_ERROR = '''
    @pydantic.dataclasses.dataclass
    class VllmConfig:
        x: int = 0
        def __post_init__(self):
            raise ValueError("max_num_batched_tokens (8) is smaller than max_model_len (256)")
    VllmConfig()
'''


def test_first_exception_reads_pydantic_field_and_model_errors(tmp_path):
    field = _pydantic_traceback(tmp_path, FIELD_ERROR)
    model = _pydantic_traceback(tmp_path, MODEL_ERROR)
    assert servemod.first_exception(field) == ("ValidationError: 1 validation error for CacheConfig: "
                                               "gpu_memory_utilization: Input should be less than or equal to 1")
    assert servemod.first_exception(model) == ("ValidationError: 1 validation error for VllmConfig: "
                                               "max_num_batched_tokens (8) is smaller than max_model_len (256)")
    # the first traceback is the cause; vLLM's processes reporting each other's failure come after
    later = "\nTraceback (most recent call last):\n  File \"x\", line 1\nRuntimeError: Engine core initialization failed"
    logs = "INFO 12-05 07:57:25 [api_server.py:1] starting\n"
    assert servemod.first_exception(logs + field + later) == servemod.first_exception(field)
    # an engine process's lines carry vLLM's prefix
    prefixed = "\n".join(f"(EngineCore_DP0 pid=123) {x}" for x in field.splitlines())
    assert servemod.first_exception(prefixed) == servemod.first_exception(field)
    assert servemod.first_exception(logs + "ERROR something without a traceback\n") is None


FAILING = textwrap.dedent('''
    import pydantic
    from pydantic import Field
    print("INFO starting the API server", flush=True)
    @pydantic.dataclasses.dataclass
    class CacheConfig:
        gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)
    CacheConfig(gpu_memory_utilization=2.0)
''')


def test_vllms_own_error_is_serves_last_line(tmp_path):
    """A start that fails in vLLM itself (no cause recorded by the plugin): was `(its output
    above says why)`; the first exception of its output is on the line."""
    (tmp_path / "fake.py").write_text(FAILING)
    plan = servemod.ServePlan(".", "tiny", "N150", [sys.executable, str(tmp_path / "fake.py")], {}, "127.0.0.1",
                              _free_port())
    with pytest.raises(servemod.TTBundleError) as ei:
        servemod.run(plan, startup_timeout=60)
    assert str(ei.value) == ("vLLM exited with code 1 before it was healthy; the first exception in its output: "
                             "ValidationError: 1 validation error for CacheConfig: gpu_memory_utilization: Input "
                             "should be less than or equal to 1")


@pytest.mark.parametrize("exits_on_sigint", [True, False], ids=["stops", "ignores-sigint"])
def test_stop_ends_vllm_when_popens_wait_lock_was_left_held(exits_on_sigint):
    """Seen once: after Ctrl-C, `serve` hung for ever in `stop` with vLLM a zombie: CPython's
    timed `Popen.wait` (where `watch` spends serving) takes the Popen's wait lock before its
    `try`, so a KeyboardInterrupt landing there leaves it held, and `proc.wait()` then blocks for
    ever. The lock is held here as that leaves it: `stop` still sees vLLM end (its SIGINT, or
    SIGKILL after the grace), reaps it and returns its exit status."""
    code = "import time\n" + ("" if exits_on_sigint else
                              "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n") + \
        "print('up', flush=True)\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline() == b"up\n"
    assert proc._waitpid_lock.acquire(False)  # left held, as the interrupted wait leaves it
    try:
        done: list = []
        t = threading.Thread(target=lambda: done.append(servemod.stop(proc, grace=1.0)), daemon=True)
        t.start()
        t.join(servemod.REAP_S + 10)
        assert done, "stop blocked on the held wait lock"
        assert done[0] == (-signal.SIGINT if exits_on_sigint else -signal.SIGKILL)
        with pytest.raises(ChildProcessError):  # reaped: no zombie left
            os.waitpid(proc.pid, os.WNOHANG)
    finally:
        proc._waitpid_lock.release()
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize("code", [3, -signal.SIGKILL], ids=["exit-3", "sigkill"])
def test_watch_and_wait_healthy_see_vllm_end_when_popens_wait_lock_was_left_held(code):
    """The same held lock (above), met while serving: `Popen.wait` would block and `poll` never
    see the exit, so vLLM dying would go unnoticed (`watch`) or be waited out to the start-up
    timeout (`wait_healthy`). Both see it end within a second and say how it ended."""
    ends = "raise SystemExit(3)" if code == 3 else "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    for which in ("watch", "wait_healthy"):
        proc = subprocess.Popen([sys.executable, "-c", f"import time\ntime.sleep(1.0)\n{ends}\n"],
                                start_new_session=True)
        assert proc._waitpid_lock.acquire(False)  # left held, as an interrupted timed wait leaves it
        port = _free_port()  # nothing answers there: health checks fail, but not failures=100 of them
        t0 = time.monotonic()
        try:
            errors: list = []

            def run():
                try:
                    if which == "watch":
                        servemod.watch(proc, "127.0.0.1", port, every=0.2, failures=100, timeout=0.1)
                    else:
                        servemod.wait_healthy(proc, "127.0.0.1", port, timeout=30)
                except BaseException as e:  # noqa: BLE001  (what it raised is the answer)
                    errors.append(e)
            t = threading.Thread(target=run, daemon=True)
            t.start()
            t.join(15)
            assert errors, f"{which} did not see vLLM end with the wait lock held"
            assert time.monotonic() - t0 < 10
            assert proc.returncode == code
            msg = str(errors[0])
            assert re.search(r"code 3\b", msg) if code == 3 else ("signal 9 (SIGKILL)" in msg), msg
        finally:
            proc._waitpid_lock.release()
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
