"""Runtime tests: real vLLM 0.33.0 with the ttbundle platform, in-process and as a live server.

The emulated platform is *asked for* here (``TTBUNDLE_EMULATED=1``, what ``ttbundle serve``
sets) before anything resolves vLLM's platform; test_runtime_unit checks that without it vLLM
does not see ttbundle. Packages are built once per session with ``ttbundle build`` from a random
bf16 checkpoint (``serving.demo``), which is also the transformers reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("TTBUNDLE_EMULATED", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("vllm")

from runtime_helpers import CASES, spec_text  # noqa: E402


@pytest.fixture(scope="session")
def packages_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("packages")


@pytest.fixture(scope="session")
def make_package(packages_dir):
    """``make_package(family, mesh)`` -> (package dir, HF checkpoint dir), built once."""
    from ttbundle.serving.demo import build_package

    built = {}

    def make(family: str, mesh: str):
        if (family, mesh) not in built:
            pkg = build_package(spec_text(family), packages_dir, mesh)
            built[(family, mesh)] = (pkg, packages_dir / f"src-tiny-{family}")
        return built[(family, mesh)]
    return make


@pytest.fixture(params=CASES, ids=[f"{f}-{m}" for f, m in CASES])
def case(request):
    return request.param

