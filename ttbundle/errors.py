"""The one error type library code raises, and the diagnostics it carries.

Only ``cli.py`` turns these into exit codes (see docs/cli.md):

* 0 success
* 1 a check or a run failed (numerics disagree, a server did not start, ...)
* 2 invalid input: a spec, a config.json, an argument
* 3 the bundle does not fit the mesh's memory
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_DOES_NOT_FIT = 3


@dataclass(frozen=True)
class Diagnostic:
    """One located problem: ``file:line:col: key.path: message``."""

    message: str
    path: str = ""
    file: str | None = None
    line: int | None = None
    col: int | None = None
    severity: str = "error"  # "error" | "warning"

    def location(self) -> str:
        parts = []
        if self.file:
            parts.append(self.file)
            if self.line is not None:
                parts.append(str(self.line))
                if self.col is not None:
                    parts.append(str(self.col))
        return ":".join(parts)

    def __str__(self) -> str:
        head = _printable(self.location())
        path, message = _printable(self.path), _printable(self.message)
        body = f"{path}: {message}" if path else message
        if self.severity == "warning":
            body = f"warning: {body}"
        return f"{head}: {body}" if head else body

    def to_json(self) -> dict:
        return {
            "severity": self.severity,
            "file": self.file,
            "line": self.line,
            "col": self.col,
            "path": self.path,
            "message": self.message,
        }


def _printable(s: str) -> str:
    """``s`` with control characters escaped: keys and values come from the user's file and must
    not reach the terminal raw (an ESC sequence in a YAML key could rewrite the screen)."""
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


class TTBundleError(Exception):
    """A user-facing failure. ``diagnostics`` holds every problem found, not just the first."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, diagnostics: list[Diagnostic] | None = None):
        super().__init__(message)
        self.message = message
        self.diagnostics = list(diagnostics or [])

    def __str__(self) -> str:
        if not self.diagnostics:
            return _printable(self.message)
        return "\n".join([_printable(self.message)] + [str(d) for d in self.diagnostics])


class InvalidInput(TTBundleError):
    """A spec, config.json or argument is wrong; exit code 2."""

    exit_code = EXIT_INVALID


class WarmupMismatch(TTBundleError):
    """A program's output on its fixed warm-up input differs from the reference the build recorded
    (``ttbundle.warmup``): the package's weights or program are not what was built; exit 1."""


class DoesNotFit(TTBundleError):
    """A valid request whose model does not fit the mesh's memory (``init --mesh``, ``build``, a
    plan that does not fit); exit code 3. The one class: catching it catches every stage's."""

    exit_code = EXIT_DOES_NOT_FIT
