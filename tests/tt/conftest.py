"""Tests against the real ttnn wheel, in mock-cluster mode (no Tenstorrent device).

They run in the Python 3.12 environment that scripts/setup_tt.sh builds (ttnn 0.81.1, numpy, no
torch): ``.venv-tt/bin/python -m pytest tests/tt -q``. Anywhere ``import ttnn`` fails (the main
Python 3.11 venv) every test here is skipped.

ttnn is imported once per session by the ``ttnn`` fixture, after pointing everything it writes
into a temp dir: the JIT cache (``TT_METAL_CACHE``, trailing slash), OpenMPI's ``TMPDIR``, and the
``generated/`` folder it creates in the working directory. The mock cluster descriptor is, in
order: ``$TT_METAL_MOCK_CLUSTER_DESC_PATH``, ``../shared/tt-mock/wormhole_N150.yaml`` next to
the checkout, or a built-in single-N150 descriptor written to the temp dir.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # blockfloat_cases (shared with tests/test_blockfloat.py)
    sys.path.insert(0, str(TESTS))

SHARED_N150 = TESTS.parents[1] / "shared" / "tt-mock" / "wormhole_N150.yaml"

# A UMD cluster descriptor for one Wormhole N150 (the "boards" format ttnn 0.81.1 wants).
N150_DESCRIPTOR = """\
arch:
  0: wormhole_b0
chips:
  0: [0, 0, 0, 0]
ethernet_connections: []
chips_with_mmio:
  - 0: 0
harvesting:
  0:
    noc_translation: true
    harvest_mask: 64
    dram_harvesting_mask: 0
    eth_harvesting_mask: 0
    pcie_harvesting_mask: 0
chip_to_boardtype:
  0: n150
boards:
  -
    - board_id: 72059269368820857  # the id encodes the board type: an n150 (tt-umd test data)
    - board_type: n150
    - chips:
        - 0
"""


def pytest_configure(config):
    config.addinivalue_line("markers", "ttnn: needs the ttnn wheel (Python 3.10/3.12 env); mock cluster")


def pytest_collection_modifyitems(config, items):
    """Every ``ttnn``-marked test skips where the wheel is absent, fixture or not."""
    if importlib.util.find_spec("ttnn") is not None:
        return
    skip = pytest.mark.skip(reason="ttnn is not installed here (Python 3.12 env: scripts/setup_tt.sh)")
    for item in items:
        if "ttnn" in item.keywords:
            item.add_marker(skip)


def _descriptor(work: Path) -> str:
    if os.environ.get("TT_METAL_MOCK_CLUSTER_DESC_PATH"):
        return os.environ["TT_METAL_MOCK_CLUSTER_DESC_PATH"]
    if SHARED_N150.exists():
        return str(SHARED_N150)
    p = work / "wormhole_N150.yaml"
    p.write_text(N150_DESCRIPTOR)
    return str(p)


@pytest.fixture(scope="session")
def ttnn(tmp_path_factory):
    """The ``ttnn`` module on a mock N150 cluster, with cwd in a temp dir for the session."""
    if importlib.util.find_spec("ttnn") is None:
        pytest.skip("ttnn is not installed here (Python 3.12 env: scripts/setup_tt.sh)")
    work = tmp_path_factory.mktemp("ttnn")
    (work / "tmp").mkdir()
    os.environ.setdefault("TT_METAL_CACHE", f"{work / 'cache'}/")
    os.environ["TMPDIR"] = str(work / "tmp")
    os.environ["TT_METAL_MOCK_CLUSTER_DESC_PATH"] = _descriptor(work)
    old = os.getcwd()
    os.chdir(work)
    try:
        import ttnn as mod
    except Exception as e:  # a broken install: skip, saying why
        os.chdir(old)
        pytest.skip(f"import ttnn failed: {type(e).__name__}: {e}")
    yield mod
    os.chdir(old)


@pytest.fixture(scope="session")
def tt_dtype(ttnn):
    """ttbundle format name -> ttnn DataType."""
    return {"bfp8": ttnn.bfloat8_b, "bfp4": ttnn.bfloat4_b, "bf16": ttnn.bfloat16, "f32": ttnn.float32}


@pytest.fixture(scope="session")
def host_bytes(ttnn):
    """Raw bytes of a single-device host tensor (its buffer exported via DLPack)."""
    import numpy as np

    def get(t) -> bytes:
        return np.from_dlpack(t.host_buffer().get_shard(ttnn.MeshCoordinate(0, 0))).tobytes()
    return get


@pytest.fixture(scope="session")
def to_tt(ttnn, tt_dtype):
    """numpy float32 array -> ttnn host tensor of ``fmt`` in TILE layout.

    ``ttnn.Tensor(ndarray, dtype, device, layout)`` is the constructor ``ttnn.from_torch`` calls
    (the array arrives through DLPack), so no torch is needed."""
    def make(a, fmt: str, layout=None):
        return ttnn.Tensor(a, tt_dtype[fmt], None, layout or ttnn.TILE_LAYOUT)
    return make
