"""Real vLLM 0.33.0: when the engine process dies under a serving API server, `ttbundle serve`'s
watch notices and fails (issue 15: it used to exit 0, only vLLM's log showed EngineDeadError)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_killed_engine_fails_the_serve(make_package, tmp_path):
    from ttbundle.serving.serve import ServeFailed, plan_serve, start, stop, wait_healthy, watch

    pkg, _ = make_package("llama", "N150")
    plan = plan_serve(pkg, "127.0.0.1", _free_port())
    log = tmp_path / "vllm.log"
    with open(log, "wb") as f:
        proc = start(plan, log=f)
    try:
        wait_healthy(proc, plan.host, plan.port, timeout=600)
        engines = [p for p in _descendants(proc.pid) if p != proc.pid]
        assert engines, "no engine process under vLLM's API server"
        for p in engines:  # the engine core (and anything it started)
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t0 = time.monotonic()
        with pytest.raises(ServeFailed) as ei:
            watch(proc, plan.host, plan.port, every=1.0, memory=plan.memory)
        print(f"noticed in {time.monotonic() - t0:.1f} s: {ei.value}")
        assert ei.value.exit_code != 0
        # which signal (vLLM's API server reaped the engine: activation.note_child_signals noted
        # it, or it became serve's orphan), and for SIGKILL the memory arithmetic (issue 38)
        assert "was killed by signal 9 (SIGKILL) while serving" in str(ei.value)
        assert f"expected a peak of {plan.memory.arithmetic()}" in str(ei.value)
    except BaseException:
        print(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop(proc)


def test_engine_killed_before_healthy_names_the_signal(make_package, tmp_path):
    """vLLM's own message then says ``Failed core proc(s): {}`` (it looked before the engine was
    reaped): serve still names the signal, and for SIGKILL gives the memory arithmetic."""
    from ttbundle.errors import TTBundleError
    from ttbundle.serving.serve import group_processes, plan_serve, start, stop, wait_healthy

    pkg, _ = make_package("llama", "N150")
    plan = plan_serve(pkg, "127.0.0.1", _free_port())
    log = tmp_path / "vllm.log"
    with open(log, "wb") as f:
        proc = start(plan, log=f)
    try:
        t0 = time.monotonic()
        engine = None
        while engine is None and time.monotonic() - t0 < 300:
            engine = next((p for p, (name, _) in group_processes(proc.pid).items()
                           if name.startswith("VLLM::EngineCore")), None)
            time.sleep(0.05)
        assert engine is not None, "no engine process under vLLM's API server"
        # at once: a tiny package's engine can load, profile and hand-shake within a second of
        # taking its name (CI saw the server healthy 1 s after it), and then there is no race to lose
        os.kill(engine, signal.SIGKILL)
        with pytest.raises(TTBundleError) as ei:
            wait_healthy(proc, plan.host, plan.port, timeout=600, memory=plan.memory)
        msg = str(ei.value)
        print(msg)
        assert f"(pid {engine}) was killed by signal 9 (SIGKILL) before it was healthy" in msg
        assert f"expected a peak of {plan.memory.arithmetic()}" in msg
    except BaseException:
        print(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop(proc)
