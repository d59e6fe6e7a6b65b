"""Build progress and results on the console (rich), for the CLI. A UI module: no content key
depends on it, so editing it rebuilds nothing."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .build import BuildResult


class ConsoleProgress:
    """Build events on the console. On a terminal, rich progress bars: one bar per phase with the
    current item and an ETA. Elsewhere (CI logs, ``serve > log``: ``console.is_terminal`` is
    false), whole lines instead of bars cut at the column width: each phase's start, a line at
    most every :attr:`LINE_EVERY_S` seconds while it advances, and its end, each with the stage,
    the count done of its total and the seconds elapsed in it."""

    LABELS = {"hash": "hashing checkpoint", "weights": "converting weights", "programs": "lowering programs",
              "tensorbin": "writing .tensorbin caches",
              "warmup": "warming traces"}
    LINE_EVERY_S = 10.0

    def __init__(self, console, prefix: str = "", clock=None):

        self.console, self.prefix = console, prefix
        self.clock = clock or time.monotonic
        self.lines = not console.is_terminal
        self.tasks: dict[str, int] = {}
        self.running = False
        # without a terminal: per phase [done, total, started, last line printed, last item]
        self.phases: dict[str, list] = {}
        self.current: str | None = None
        if not self.lines:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
            self.bars = Progress(TextColumn("{task.description:<28}"), BarColumn(bar_width=30), MofNCompleteColumn(),
                                 TextColumn("{task.fields[item]:<18}"), TimeElapsedColumn(), TextColumn("ETA"),
                                 TimeRemainingColumn(), console=console)

    def __call__(self, e: dict) -> None:
        ev = e["event"]
        if ev == "waiting":
            self._print(f"{self.prefix}waiting for another build of this package ({e['lock']})")
        elif self.lines:
            self._line_event(ev, e)
        elif ev == "phase":
            if not self.running:
                self.bars.start()
                self.running = True
            total = e["total"] if e["phase"] != "hash" else max(1, e["total"] >> 20)
            self.tasks[e["phase"]] = self.bars.add_task(f"{self.prefix}{self.LABELS.get(e['phase'], e['phase'])}",
                                                        total=total, item="")
        elif ev == "advance" and e["phase"] in self.tasks:
            step = (e.get("bytes", 0) >> 20) if e["phase"] == "hash" else 1
            self.bars.update(self.tasks[e["phase"]], advance=step, item=str(e.get("item", ""))[:18])
        elif ev == "done" and self.running:
            self.bars.stop()
            self.running = False

    # -- whole lines (no terminal) ----------------------------------------------------------------
    def _print(self, line: str) -> None:
        from rich.text import Text

        self.console.print(Text(line), soft_wrap=True, crop=False)

    def _line(self, phase: str, state: str = "") -> None:
        done, total, t0, _, item = self.phases[phase]
        unit = " MiB" if phase == "hash" else ""
        what = f" ({item})" if item and state != "done" else ""
        end = f", {state}" if state else ""
        self._print(f"{self.prefix}{self.LABELS.get(phase, phase)}: {done:,}/{total:,}{unit}{what} "
                    f"[{self.clock() - t0:.1f} s{end}]")
        self.phases[phase][3] = self.clock()

    def _end(self) -> None:
        if self.current is not None:
            self._line(self.current, "done")
            self.current = None

    def _line_event(self, ev: str, e: dict) -> None:
        if ev == "phase":
            self._end()
            total = e["total"] if e["phase"] != "hash" else max(1, e["total"] >> 20)
            now = self.clock()
            self.phases[e["phase"]] = [0, total, now, now, ""]
            self.current = e["phase"]
            self._line(e["phase"])
        elif ev == "advance" and e["phase"] in self.phases:
            st = self.phases[e["phase"]]
            st[0] += (e.get("bytes", 0) >> 20) if e["phase"] == "hash" else 1
            st[4] = str(e.get("item", ""))
            if self.clock() - st[3] >= self.LINE_EVERY_S:
                self._line(e["phase"])
        elif ev == "done":
            self._end()


def print_results(results: list[BuildResult], console) -> None:
    """The summary table after a build, or the trace set and estimates of a dry run."""
    from rich.table import Table
    for r in results:
        if r.status == "dry-run":
            t = Table(title=f"{r.bundle} on {r.mesh}: trace set (dry run, nothing written)",
                      title_justify="left", show_edge=False)
            for c in ("phase", "bucket", "rows", "ops", "coll", "trace", "act", "warm-up", "build"):
                t.add_column(c, justify="right", no_wrap=True)
            for s in r.traces:
                t.add_row(s["phase"], str(s["bucket"]), str(s["rows"]), str(s["ops"]), str(s["collectives"]),
                          _size(s["trace_region_bytes"]), _size(s["activation_bytes"]),
                          f"{s['warmup_seconds_est']:.2f} s", "new" if s["rebuild"] else "reuse")
            console.print(t)
            e = r.estimate
            console.print(f"  weights: {e['source_bytes']:,} B to convert into {e['devices']} device files "
                          f"({e['device_weight_bytes']:,} B of DRAM per device), est. {e['convert_seconds']} s; "
                          f"warm-up est. {e['warmup_seconds']} s; trace region {e['trace_region_bytes']:,} B")
            console.print(f"  package: {r.package}")
            console.print(f"  content key: {r.key}")
            console.print(f"  would rebuild: {', '.join(r.rebuilt) or 'nothing (up to date)'}")
            continue
    done = [r for r in results if r.status != "dry-run"]
    if not done:
        return
    t = Table(title="ttbundle build", title_justify="left", show_edge=False)
    for c in ("mesh", "status", "rebuilt", "reused", "files", "read", "written", "time"):
        t.add_column(c, justify="left" if c in ("mesh", "status") else "right", no_wrap=True)
    for r in done:
        t.add_row(r.mesh, r.status, str(len(r.rebuilt)), str(len(r.reused)), str(r.files),
                  _size(r.bytes_read), _size(r.bytes_written), f"{r.seconds:.1f} s")
    console.print(t)
    for r in done:
        console.print(f"{r.mesh}: {r.package} (key {r.key[:16]})")
        for w in r.warnings:
            console.print(f"  warning: {w}")
        if r.status == "built":
            console.print(f"  rebuilt: {', '.join(r.rebuilt) or 'nothing'}")
            console.print(f"  changed: {', '.join(r.changed_fields) or 'nothing'}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover
