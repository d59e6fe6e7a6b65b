"""The planner against ttnn's real DRAM allocator, on mock meshes (N150, N300, T3K, P150, P100).

For a bundle on a mesh, everything `ttbundle plan` charges to one chip is allocated on a mock
mesh of that shape (ttbundle.backends.ttnn.alloc): every weight shard as an interleaved DRAM
buffer of the plan's dtype, layout and per-device shape (one per layer), the KV cache per layer,
the activation buffers; the mesh is opened with the plan's trace region. Allocation must succeed
exactly when the plan fits and fail with ttnn's "Out of Memory" when it does not, right at the
boundary:

* ``max_model_len``: the largest (in whole KV blocks, one sequence) that fits, and one block more;
* ``max_num_seqs``: the largest that fits at the spec's max_model_len, and one more;
* bytes: at the largest max_model_len that fits, the largest ``trace_region_size`` that fits
  (the plan then has less than one 8 KiB trace granule per bank free) and one byte more.

Where it fits, the allocator's own figures must equal the plan's to the byte: bytes allocated per
bank = (total - trace region) / banks, bank size = chip bank size - trace region / banks.
Each mesh is one process (ttnn reads the mock cluster descriptor once).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ttbundle import mockcluster, spec as specmod
from ttbundle.plan.make import make_plan
from ttbundle.plan.memory import TRACE_BANK_ALIGN, tensor_bytes
from ttbundle.backends.ttnn import alloc

pytestmark = [pytest.mark.ttnn,
              pytest.mark.skipif(importlib.util.find_spec("ttnn") is None,
                                 reason="ttnn is not installed here (Python 3.12 env: scripts/setup_tt.sh)")]

BUNDLES = Path(__file__).resolve().parents[2] / "bundles"
# (mesh, example bundle): one that fills the chip at some max_model_len / max_num_seqs;
# T3K twice, a dense model and one with stacked experts ([E, K, N] TILE buffers)
CASES = [("N150", "llama-3.1-8b"), ("N300", "qwen3-8b"), ("T3K", "llama-3.1-70b"),
         ("T3K", "gpt-oss-20b"), ("P150", "gemma-2-9b"), ("P100", "mistral-7b-v0.3")]


def sfpi_ready() -> bool:
    spec = importlib.util.find_spec("ttnn")
    stub = Path(spec.origin).parent / "runtime" / "sfpi" / "compiler" / "bin" / "riscv-tt-elf-g++"
    return stub.exists() or Path("/opt/tenstorrent/sfpi").exists()


class Variants:
    """The example bundle on ``mesh`` with runtime fields changed."""

    def __init__(self, bundle: str, mesh: str):
        self.base = yaml.safe_load((BUNDLES / f"{bundle}.yaml").read_text())
        self.base["targets"] = [mesh]
        self.base.get("weights", {}).pop("source", None)  # plan-only: no checkpoint needed
        self.mesh = mesh

    def plan(self, **runtime):
        d = dict(self.base)
        d["runtime"] = {**self.base.get("runtime", {}), **runtime}
        rt = d["runtime"]
        if rt.get("max_tokens_all_users", "auto") == "auto" and not runtime.get("auto_pool"):
            # the pool pinned at every sequence at full length, so the boundaries below move
            # with max_model_len and max_num_seqs (an auto pool would shrink to fit instead)
            rt["max_tokens_all_users"] = rt.get("max_num_seqs", 32) * rt.get("max_model_len", 4096)
        rt.pop("auto_pool", None)
        return make_plan(specmod.loads(yaml.safe_dump(d), "variant.yaml"), self.mesh)

    def largest_fitting(self, field: str, step: int, top: int, **fixed) -> int | None:
        """Largest multiple of ``step`` in [step, top] for ``field`` whose plan fits (the plan's
        fit is monotone in it), or None if even ``step`` does not fit or ``top`` fits."""
        fits = lambda v: self.plan(**{field: v}, **fixed).fits  # noqa: E731
        if not fits(step) or fits(top):
            return None
        lo, hi = 1, top // step  # lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
        return lo * step


def boundary_plans(bundle: str, mesh: str) -> list[tuple[str, object]]:
    """Four pairs of plans, (fits, does not fit), one step apart."""
    v = Variants(bundle, mesh)
    v.base.setdefault("buckets", {})["decode"] = sorted(set(v.base["buckets"].get("decode", [1]) + [32]))
    block = v.base.get("runtime", {}).get("kv_block_size", 32)
    top_len = v.base["model"]["max_position_embeddings"] // block * block
    out = []
    # max_model_len at the fewest sequences (1, 2, 4, ...) whose full-length cache does not fit
    for seqs in (1, 2, 4, 8, 16, 32):
        n = v.largest_fitting("max_model_len", block, top_len, max_num_seqs=seqs)
        if n is not None:
            break
    assert n is not None, f"{bundle} on {mesh}: 32 sequences of {top_len} tokens fit; pick a bigger model"
    out += [(f"max_model_len={n} (max_num_seqs={seqs})", v.plan(max_model_len=n, max_num_seqs=seqs)),
            (f"max_model_len={n + block} (max_num_seqs={seqs})", v.plan(max_model_len=n + block, max_num_seqs=seqs))]
    # max_num_seqs at a context length where the boundary is within the 32 decode rows
    for k in range(1, 7):
        length = max(block, min(top_len, n * seqs >> k) // block * block)
        s = v.largest_fitting("max_num_seqs", 1, 32, max_model_len=length)
        if s is not None:
            break
    assert s is not None, f"{bundle} on {mesh}: no max_num_seqs boundary"
    out += [(f"max_num_seqs={s} (max_model_len={length})", v.plan(max_num_seqs=s, max_model_len=length)),
            (f"max_num_seqs={s + 1} (max_model_len={length})", v.plan(max_num_seqs=s + 1, max_model_len=length))]
    # the auto pool (the largest that fits) allocates; one block more does not
    # (32 sequences of an eighth of what fits: all at full length would not fit, one does)
    half = max(block, min(top_len, n * seqs // 8) // block * block)
    auto = v.plan(max_model_len=half, max_num_seqs=32, max_tokens_all_users="auto", auto_pool=True)
    assert auto.kv["max_tokens_all_users"] < 32 * half and "largest pool" in auto.kv["pool_why"]
    out += [(f"max_tokens_all_users=auto (max_model_len={half}, max_num_seqs=32)", auto),
            (f"max_tokens_all_users=auto + 1 block (max_model_len={half}, max_num_seqs=32)",
             v.plan(max_model_len=half, max_num_seqs=32,
                    max_tokens_all_users=auto.kv["max_tokens_all_users"] + block))]
    # bytes: the trace region that leaves less than one granule per bank free, and one byte more
    p = v.plan(max_model_len=n, max_num_seqs=seqs)
    banks = p.mesh.chip.dram_banks
    room = p.memory.dram - (p.memory.total - p.memory.trace_region)
    t = banks * (room // banks // TRACE_BANK_ALIGN * TRACE_BANK_ALIGN)
    for tr in (t, t + 1):
        out.append((f"trace_region_size={tr} (max_model_len={n}, max_num_seqs={seqs})",
                    v.plan(max_model_len=n, max_num_seqs=seqs, trace_region_size=tr)))
    return out


def run_cases(mesh: str, plans: list, tmp_path: Path) -> dict[str, dict]:
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([alloc.case(name, p) for name, p in plans]))
    env = mockcluster.mock_env(mesh, tmp_path)
    r = subprocess.run([sys.executable, "-m", "ttbundle.backends.ttnn.alloc", str(cases)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
            out[res["name"]] = res
    assert r.returncode == 0 and len(out) == len(plans), f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("mesh,bundle", CASES, ids=[f"{m}-{b}" for m, b in CASES])
def test_allocation_succeeds_exactly_when_the_plan_fits(mesh, bundle, tmp_path):
    if not sfpi_ready():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh installs it)")
    plans = boundary_plans(bundle, mesh)
    got = run_cases(mesh, plans, tmp_path)
    report = []
    for name, p in plans:
        r = got[name]
        m = p.memory
        report.append(f"{mesh} {bundle} {name}: plan free {m.free:+,} B -> allocator "
                      f"{'ok' if r['ok'] else 'OOM at ' + r['failed']}")
        assert r["ok"] == p.fits, "\n".join(report) + f"\n{r['error']}"
        banks = p.mesh.chip.dram_banks
        assert r["banks"] == banks
        # the trace region is carved out of every bank, exactly as the plan charges it
        assert r["bank_bytes"] == p.mesh.chip.dram_bank_bytes - m.trace_region // banks
        if r["ok"]:
            # every buffer lands where the plan said: the same bytes per bank, to the byte
            assert r["allocated_per_bank"] * banks == m.total - m.trace_region
        else:
            assert "Out of Memory" in r["error"] and "DRAM buffer" in r["error"]
    # the boundary is where the plan says: one side fits, the other does not
    fits = [p.fits for _, p in plans]
    assert fits == [True, False] * 4, "\n".join(report)
    print("\n".join(report))


def test_plan_buffers_cover_the_plan():
    """Every byte the plan charges a chip is in a buffer the allocator test allocates."""
    from ttbundle.backends.ttnn.layout import device_shape
    v = Variants("llama-3.1-8b", "N300")
    p = v.plan()
    bufs = alloc.plan_buffers(p)
    charged = sum(tensor_bytes(list(b.shape), b.dtype, b.layout, p.mesh) * b.count for b in bufs)
    assert charged == p.memory.total - p.memory.trace_region
    norm = next(b for b in bufs if b.name == "attn_norm")
    assert norm.shape == device_shape([4096], "ROW_MAJOR") == (1, 1, 128, 32) and norm.count == 32
