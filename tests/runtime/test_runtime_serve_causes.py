"""Real vLLM through `ttbundle serve`, failing in its own validation (issue 43, item 4: one line
for every failure cause): the plugin records its own errors (tests/runtime/test_runtime_stop.py);
one of vLLM's, with no cause recorded, is read from the first traceback of vLLM's output."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime_helpers import free_port, spec_text
from ttbundle.serving.demo import build_package


@pytest.mark.slow
def test_vllms_own_validation_error_is_serves_last_line(tmp_path):
    """`--gpu-memory-utilization 2`: vLLM's CacheConfig refuses it (a pydantic ValidationError in
    its API server, inside a traceback); was `(its output above says why)`."""
    pkg = build_package(spec_text("llama"), tmp_path / "packages", "N150")
    r = subprocess.run([sys.executable, "-m", "ttbundle.cli", "serve", str(pkg), "--port", str(free_port()), "--",
                        "--gpu-memory-utilization", "2"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=tmp_path)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 1, lines[-20:]
    assert lines[-1] == ("[error] vLLM exited with code 1 before it was healthy; the first exception in its output: "
                         "ValidationError: 1 validation error for CacheConfig: gpu_memory_utilization: Input should "
                         "be less than or equal to 1"), lines[-20:]
