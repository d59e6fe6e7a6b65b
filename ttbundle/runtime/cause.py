"""The cause of a failed start, for ``ttbundle serve``'s last line.

vLLM prints an error raised in its API server or engine process inside a traceback, among ~170
lines of its own; ``ttbundle serve`` only sees the exit code. So the plugin, where it raises one
of ttbundle's errors while vLLM starts (a ``--additional-config`` option or the package refused by
the platform's config check, a warm-up mismatch or a device error in the worker), also writes its
one-line message to the file ``TTBUNDLE_CAUSE_FILE`` names (set by ``serve.run``); the first cause
written wins. Nothing is written when the variable is unset (``vllm serve`` run by hand).
"""

from __future__ import annotations

import contextlib
import os

from ..errors import InvalidInput, TTBundleError

ENV = "TTBUNDLE_CAUSE_FILE"


def record(message: str) -> None:
    """Write ``message`` (its first line) as the cause, unless one is there already."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = (str(message).strip().splitlines() or [""])[0][:2000]
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the first cause wins
    except OSError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(line + "\n")


@contextlib.contextmanager
def recorded():
    """Record a ttbundle error raised inside (with its class name when it says more, e.g.
    ``WarmupMismatch``), then let it go on."""
    try:
        yield
    except TTBundleError as e:
        kind = type(e).__name__
        record(str(e) if type(e) in (TTBundleError, InvalidInput) else f"{kind}: {e}")
        raise


def read(path) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
