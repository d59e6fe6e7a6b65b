"""When the ttbundle platform activates. Kept free of heavy imports: vLLM calls
:func:`platform_plugin` in every process of every vLLM install that has ttbundle installed.

* ``TTBUNDLE_EMULATED=1``: the emulated mesh (torch on the host). ``ttbundle serve`` sets it;
  set it yourself for a direct ``vllm serve PACKAGE``.
* else a Tenstorrent device (``/dev/tenstorrent``) with ``ttnn`` importable, and Tenstorrent's
  own plugin not installed: the TT platform (``TTBUNDLE_TEST_TTNN=recording`` fakes both, for
  tests only: ``ttdevice.py``; so does the timing device ``TTBUNDLE_DEVICE_MODEL=timing:14ms``,
  for benches and tests: ``timing.py``).
* else None: a vLLM that did not ask for ttbundle never sees it.
"""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import entry_points
from multiprocessing import popen_fork
from pathlib import Path

ENV_EMULATED = "TTBUNDLE_EMULATED"
EMULATED = "ttbundle.runtime.platform.EmulatedMeshPlatform"
HARDWARE = "ttbundle.runtime.platform.TTMeshPlatform"


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


TEST_TTNN = "TTBUNDLE_TEST_TTNN"  # test-only: "recording" (runtime/ttdevice.py)
DEVICE_MODEL = "TTBUNDLE_DEVICE_MODEL"  # bench/test device: "timing:14ms" (runtime/timing.py)


def tt_hardware_missing() -> str | None:
    """Why this host cannot serve on a Tenstorrent device through ttbundle (None: it can): no
    device node, no ttnn, or Tenstorrent's own plugin installed (it owns the device then). The
    test-only hook ``TTBUNDLE_TEST_TTNN=recording`` stands the recording double in for all three,
    and so does the timing device ``TTBUNDLE_DEVICE_MODEL`` (benches and tests: ``timing.py``)."""
    if os.environ.get(TEST_TTNN) == "recording" or os.environ.get(DEVICE_MODEL):
        return None
    if not Path("/dev/tenstorrent").exists():
        return "no Tenstorrent device on this host (/dev/tenstorrent is missing)"
    if importlib.util.find_spec("ttnn") is None:
        return "ttnn is not installed (pip install ttnn; it drives the device)"
    if [e for e in entry_points(group="vllm.platform_plugins") if e.name == "tt"]:
        return ("Tenstorrent's own vLLM plugin is installed and owns the device: serve the package with "
                "it (`vllm serve PACKAGE`; the package's adapter runs there)")
    return None


def tt_hardware_present() -> bool:
    """A Tenstorrent device node, ttnn importable, and no Tenstorrent plugin to defer to. (Or the
    test-only hook ``TTBUNDLE_TEST_TTNN=recording``: the recording double stands in for both.)"""
    return tt_hardware_missing() is None


def active_platform() -> str | None:
    """The dotted path of the platform to activate, or None."""
    if _truthy(os.environ.get(ENV_EMULATED)):
        return EMULATED
    if tt_hardware_present():
        return HARDWARE
    return None


def platform_plugin() -> str | None:
    """``vllm.platform_plugins`` entry point: the platform's dotted path, or None (inactive)."""
    return active_platform()


class QuietStop:
    """A logging filter (in vLLM's handler, ``serve.quiet_logging_config``) dropping vLLM's
    ``[shutdown] ...`` step records below ERROR: ~20 lines per clean stop, and the two "force
    killing remaining process" warnings of vLLM's default abort-mode stop (the engine is killed
    on purpose then). Errors of a shutdown still pass."""

    def filter(self, record) -> bool:
        return record.levelno >= 40 or not str(record.msg).startswith("[shutdown]")


CHILD_SIGNALS = "TTBUNDLE_CHILD_SIGNALS"  # set by `ttbundle serve` (serving.serve.start): a file


PF_EXITING, PF_DUMPCORE = 0x4, 0x200  # linux/sched.h: the task exits / dumps core (a fatal signal)


def _exiting(pid: int) -> bool:
    """Whether process ``pid`` has begun to exit (Linux ``/proc/PID/stat``: a zombie, or its
    flags' ``PF_EXITING`` or ``PF_DUMPCORE``), so a signal sent now is not what ends it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & (PF_EXITING | PF_DUMPCORE))
    except (OSError, IndexError, ValueError):
        return False


def note_child_signals(path: str) -> None:
    """In a vLLM process (``ttbundle serve`` sets ``TTBUNDLE_CHILD_SIGNALS``): each child process it
    started with ``multiprocessing`` (vLLM's engine core) that a signal ended, a signal vLLM did
    not send itself (its ``terminate``/``kill`` of a shutdown), is appended to ``path`` as
    ``PID SIGNAL``, once, when vLLM reads the child's exit code. vLLM's own message does not
    always carry it (``Failed core proc(s): {}`` when it looked before the child was reaped); so
    ``serve`` can say which signal ended the engine (the kernel's OOM killer sends SIGKILL)."""
    cls = popen_fork.Popen
    if getattr(cls, "_ttbundle_notes", None) == path:
        return
    poll, send = getattr(cls, "_ttbundle_poll", cls.poll), getattr(cls, "_ttbundle_send", cls._send_signal)

    def _send_signal(self, sig):
        # a child already ended (noted by the poll) or exiting (killed, its memory still being
        # freed) ended of something else: only a signal to a running child is vLLM's own
        if poll_noting(self) is None and not _exiting(self.pid):
            self._ttbundle_sent = True
        return send(self, sig)

    def poll_noting(self, flag=os.WNOHANG):
        rc = poll(self, flag)
        if rc is not None and rc < 0 and not getattr(self, "_ttbundle_sent", False) \
                and not getattr(self, "_ttbundle_noted", False):
            self._ttbundle_noted = True
            try:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(f"{self.pid} {-rc}\n")
            except OSError:
                pass
        return rc
    cls._ttbundle_poll, cls._ttbundle_send, cls._ttbundle_notes = poll, send, path
    cls.poll, cls._send_signal = poll_noting, _send_signal


def general_plugin() -> None:
    """``vllm.general_plugins`` entry point: under ``ttbundle serve``, note the signals that end
    vLLM's children (:func:`note_child_signals`); register packages and refuse JSON schemas no
    value satisfies (``structured.hook_schema_check``), only when active."""
    if os.environ.get(CHILD_SIGNALS):
        note_child_signals(os.environ[CHILD_SIGNALS])
    if active_platform() is None:
        return
    from .registry import register_models
    from .structured import hook_schema_check
    register_models()
    hook_schema_check()
