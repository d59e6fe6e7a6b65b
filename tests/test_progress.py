"""Build progress a person can read in a log (issue 38, part 4): without a terminal (CI logs,
`serve > log`) the build prints whole lines (stage, count done of its total, seconds elapsed),
never a bar cut at the column width ("237/2…"); on a terminal it keeps rich's bars."""

from __future__ import annotations

import io
import re

from rich.console import Console

from ttbundle.progress import ConsoleProgress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _events(clock: Clock, n: int = 237):
    """A build's events as `build` emits them: hash (bytes), weights (one per tensor), done."""
    yield {"event": "phase", "phase": "hash", "total": 300 << 20, "unit": "bytes"}
    for _ in range(3):
        clock.t += 1.0
        yield {"event": "advance", "phase": "hash", "bytes": 100 << 20}
    yield {"event": "phase", "phase": "weights", "total": n, "total_bytes": 1, "unit": "tensors"}
    for i in range(n):
        clock.t += 0.25
        yield {"event": "advance", "phase": "weights", "item": f"model.layers.{i}.mlp.down_proj.weight", "i": i + 1}
    yield {"event": "done", "status": "built"}


def test_without_a_terminal_progress_is_whole_lines():
    buf, clock = io.StringIO(), Clock()
    console = Console(file=buf, width=40, force_terminal=False, color_system=None)  # a narrow log
    p = ConsoleProgress(console, prefix="build: ", clock=clock)
    for e in _events(clock):
        p(e)
    lines = buf.getvalue().splitlines()
    assert not any("…" in x for x in lines), lines
    assert all(x.startswith("build: ") for x in lines), lines  # none wrapped onto a second line
    assert lines[0] == "build: hashing checkpoint: 0/300 MiB [0.0 s]"
    assert lines[1] == "build: hashing checkpoint: 300/300 MiB [3.0 s, done]"
    assert lines[2] == "build: converting weights: 0/237 [0.0 s]"
    # while it advances: a line at most every LINE_EVERY_S seconds (237 x 0.25 s = 59.25 s: 5 of them)
    during = [x for x in lines[3:-1]]
    assert len(during) == int(237 * 0.25 // ConsoleProgress.LINE_EVERY_S)
    for x in during:
        m = re.fullmatch(r"build: converting weights: (\d+)/237 \(model\.layers\.(\d+)\.mlp\.down_proj\.weight\) "
                         r"\[([\d.]+) s\]", x)
        assert m, x
        done, layer, secs = int(m[1]), int(m[2]), float(m[3])
        assert layer == done - 1 and secs == done * 0.25  # the count, its last item, the time it took
    assert lines[-1] == "build: converting weights: 237/237 [59.2 s, done]"


def test_on_a_terminal_progress_keeps_its_bars():
    buf, clock = io.StringIO(), Clock()
    console = Console(file=buf, width=120, force_terminal=True, color_system=None)
    p = ConsoleProgress(console, prefix="build: ", clock=clock)
    for e in _events(clock, 5):
        p(e)
    out = buf.getvalue()
    assert "converting weights" in out and "5/5" in out
    assert "[0.0 s]" not in out and "done]" not in out  # the bars, not the lines
