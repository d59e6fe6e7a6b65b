"""benches/bench_serve.py's CPU accounting of the 16 streams (issue 38): the CPU seconds it
reads per role (engine core, API server, client) against what each process says of itself
(``time.process_time``), and the role taken from the command line as vLLM titles its processes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# burns ~0.4 s of CPU, prints its own CPU seconds, then waits to be read and stopped; run as a
# script whose file name stands for the process title (vLLM's engine core's command line is
# "VLLM::EngineCore", its API server's ".../bin/vllm serve ...")
BURN = ("import sys, time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.4: pass\n"
        "print(time.process_time(), flush=True)\n"
        "sys.stdin.read()\n")


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


@pytest.mark.parametrize("title,role", [("VLLM::EngineCore", "engine"), ("vllm-api", "api server"),
                                        ("something-else", "other")])
def test_cpu_seconds_reads_each_role_as_the_process_counts_itself(bench, tmp_path, title, role):
    script = tmp_path / f"{title}.py"
    script.write_text(BURN)
    p = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        own = float(p.stdout.readline())
        got = bench.cpu_seconds(p.pid)
    finally:
        p.stdin.close()
        p.wait(10)
    assert got[role] == pytest.approx(own, abs=0.05)  # the interpreter's start-up is in both
    assert {k for k in got if k != "client"} == {role}
    assert got["client"] > 0  # this process


def test_cpu_split_is_seconds_over_wall(bench):
    got = bench.cpu_split({"engine": 1.0, "client": 0.5}, {"engine": 4.0, "client": 0.8, "api server": 0.3}, 2.0)
    assert got == pytest.approx({"engine": 1.5, "client": 0.15, "api server": 0.15})
