"""Lanes on a device cut the opened target with ttnn's ``MeshDevice.create_submeshes``
(``runtime/ttdevice.lane_submeshes``): the real wheel, on a mock T3K, hands the submeshes out in
the order ttbundle assigns replicas (``mesh.submesh_origins``: row-major over the grid of
submeshes, replica ``i`` on the chips at its origin), and the recording double's
``FakeDevice.create_submeshes`` (what the runtime tests and the timing device run on) cuts the
same way. Needs the SFPI stub to open the mesh (scripts/setup_tt.sh), as test_mockcluster_ttnn."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from ttbundle import mesh as meshmod, mockcluster
from test_mockcluster_ttnn import sfpi_ready

pytestmark = [pytest.mark.ttnn,
              pytest.mark.skipif(importlib.util.find_spec("ttnn") is None,
                                 reason="ttnn is not installed here (Python 3.12 env: scripts/setup_tt.sh)")]

PROBE = r"""
import json, sys
import ttnn
target, subs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
dev = ttnn.open_mesh_device(ttnn.MeshShape(*target))
out = {"parent": list(dev.get_device_ids()), "cuts": {}}
for s in subs:
    out["cuts"][f"{s[0]}x{s[1]}"] = [[list(m.shape), list(m.get_device_ids())]
                                      for m in dev.create_submeshes(ttnn.MeshShape(*s))]
ttnn.close_mesh_device(dev)
print("RESULT " + json.dumps(out))
"""

SUBS = [(1, 1), (1, 2), (1, 4)]


@pytest.fixture(scope="module")
def t3k_cuts(tmp_path_factory):
    if not sfpi_ready():
        pytest.skip("no SFPI stub to open the mesh (scripts/setup_tt.sh)")
    tmp = tmp_path_factory.mktemp("submesh")
    target = meshmod.PRESETS["T3K"].shape
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(target), json.dumps(SUBS)], cwd=tmp,
                       env=mockcluster.mock_env("T3K", tmp), capture_output=True, text=True, timeout=300)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return target, json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("sub", SUBS, ids=[f"{r}x{c}" for r, c in SUBS])
def test_create_submeshes_order_is_submesh_origins(t3k_cuts, sub):
    (R, C), got = t3k_cuts
    parent = got["parent"]  # row-major device ids of the opened 1x8 view
    cut = got["cuts"][f"{sub[0]}x{sub[1]}"]
    origins = meshmod.submesh_origins((R, C), sub)
    assert len(cut) == len(origins) == (R // sub[0]) * (C // sub[1])
    for (shape, ids), (r0, c0) in zip(cut, origins):
        assert shape == list(sub)
        want = [parent[(r0 + i) * C + c0 + j] for i in range(sub[0]) for j in range(sub[1])]
        assert ids == want


@pytest.mark.parametrize("sub", SUBS, ids=[f"{r}x{c}" for r, c in SUBS])
def test_the_recording_double_cuts_as_the_wheel(t3k_cuts, sub):
    from ttbundle.backends.ttnn import recording
    (R, C), got = t3k_cuts
    parent = got["parent"]
    rec = recording.Recorder()
    tt = rec.module()
    dev = tt.open_mesh_device(tt.MeshShape(R, C))
    subs = dev.create_submeshes(tt.MeshShape(*sub))
    wheel = got["cuts"][f"{sub[0]}x{sub[1]}"]
    assert [list(s.shape) for s in subs] == [w[0] for w in wheel]
    assert [[parent[(s.origin[0] + i) * C + s.origin[1] + j] for i in range(sub[0]) for j in range(sub[1])]
            for s in subs] == [w[1] for w in wheel]
