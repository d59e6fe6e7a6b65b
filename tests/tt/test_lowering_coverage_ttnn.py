"""Every program op the families use has a ttnn lowering, and every ttnn call the backend makes
exists in the installed wheel and accepts the arguments it is given.

Not a hand-written list: the calls are what ``ttbundle.backends.ttnn.lowering`` emits for every
program (phase x bucket) of every example bundle on every target mesh, in both sampling modes,
plus what the runtime itself asks of ttnn (warm-up, capture, replay, weight loading, KV and input
allocation, constants), recorded by running it against the recording double. Each is checked
against the wheel's own signatures (``introspect``: nanobind ``__nb_signature__`` per overload,
names, keyword-only/positional, defaults, annotation types); config objects are constructed and
enum members resolved for real. A missing name, a wrong keyword, a value of the wrong kind or a
config the wheel refuses fails the test with the call and the reason.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from ttbundle import lower as lowermod, spec as specmod
from ttbundle.plan.make import make_plan
from ttbundle.backends.ttnn import cache, device, introspect, lowering, recording, trace

pytestmark = pytest.mark.ttnn
BUNDLES = Path(__file__).resolve().parents[2] / "bundles"


def all_forwards():
    for path in sorted(BUNDLES.glob("*.yaml")):
        bundle = specmod.load(path)
        if bundle.family.ttnn_unlowered:  # a family not lowered yet (none today), its ttnn build refused
            continue
        for mesh in bundle.spec.targets:
            p = make_plan(bundle, mesh)
            for phase, b in lowermod.trace_set(bundle):
                prog = lowermod.lower(bundle, p, phase, b)
                for sampling in lowering.SAMPLING:
                    yield bundle, p, prog, lowering.lower_forward(bundle, p.mesh, prog, sampling)


@pytest.fixture(scope="module")
def lowered():
    calls: dict[tuple, tuple] = {}  # distinct (fn, args, kwargs) -> (call, where)
    kinds, families, n = set(), set(), 0
    for bundle, p, prog, fw in all_forwards():
        n += 1
        families.add(bundle.family.name)
        kinds |= {lowering.step_kind(st) for _, _, st in prog.steps()}
        for _, c in list(fw.calls()) + list(fw.setup):
            calls.setdefault((c.fn, repr(c.args), repr(c.kwargs)),
                             (c, f"{bundle.spec.name} on {p.mesh.name} {fw.phase}-{fw.bucket} ({c.op})"))
    return {"calls": calls, "kinds": kinds, "families": families, "forwards": n}


def test_every_op_kind_of_every_family_has_a_lowering(lowered):
    from ttbundle import families
    assert lowered["families"] == set(families.all_families()), lowered["families"]
    missing = lowered["kinds"] - set(lowering.OPS)
    assert not missing, f"program ops without a ttnn lowering: {sorted(missing)}"


def test_every_lowered_call_exists_and_binds_in_the_wheel(ttnn, lowered):
    problems = defaultdict(list)
    for (fn, _, _), (c, where) in lowered["calls"].items():
        for why in introspect.check_call(ttnn, c):
            problems[why].append(where)
    report = "\n".join(f"{why}\n    e.g. {ws[0]} (+{len(ws) - 1} more)" for why, ws in problems.items())
    assert not problems, report
    fns = {c.fn for c, _ in lowered["calls"].values()}
    # what the families need: matmuls, norms, rope, paged attention fill/update/decode,
    # collectives, on-device sampling, MLA, MoE routing
    for fn in ("linear", "rms_norm", "experimental.rotary_embedding_hf", "experimental.paged_fill_cache",
               "experimental.paged_update_cache", "transformer.chunked_scaled_dot_product_attention",
               "transformer.paged_scaled_dot_product_attention_decode", "all_reduce", "all_gather", "topk",
               "sampling", "transformer.paged_flash_multi_latent_attention_decode", "mesh_partition"):
        assert fn in fns, fn
    print(f"{lowered['forwards']} forwards, {len(lowered['calls'])} distinct calls, {len(fns)} ttnn functions")


def test_the_checker_rejects_what_the_wheel_would(ttnn):
    from ttbundle.backends.ttnn.calls import Attr, New, T
    assert introspect.check(ttnn, "linearr", (T("x"), T("w")))
    assert introspect.check(ttnn, "linear", (T("x"), T("w")), {"program_cfg": None})
    assert introspect.check(ttnn, "linear", (T("x"), 3.0))
    assert introspect.check(ttnn, "all_gather", (T("x"), 3), {"topology": Attr("Topology.Rung")})
    assert introspect.check(ttnn, "all_gather", (T("x"), 3), {"topology": Attr("bfloat16")})
    assert introspect.check(ttnn, "linear", (T("x"), T("w")),
                            {"program_config": New.of("MatmulMultiCoreReuseMultiCastProgramConfig", in0_block_w=1)})
    assert not introspect.check(ttnn, "all_gather", (T("x"), 3), {"topology": Attr("Topology.Ring"), "cluster_axis": 1})


def test_the_runtimes_own_ttnn_calls_bind(ttnn, tmp_path):
    """Warm-up, capture, replay, reading outputs, KV / input allocation, constants and loading the
    tensorbin caches, run on the recording double; each recorded call checked against the wheel."""
    bundle = specmod.load(BUNDLES / "gpt-oss-20b.yaml")
    p = make_plan(bundle, "T3K")
    ts = lowermod.trace_set(bundle)
    keys = [min(k for k in ts if k[0] == "prefill"), min(k for k in ts if k[0] == "decode")]
    fws = {k: lowering.lower_forward(bundle, p.mesh, lowermod.lower(bundle, p, *k), "device") for k in keys}
    rec = recording.Recorder(unknown_reads="zeros")  # fake weights: the token read back is unknown
    tt = rec.module()
    dev = tt.open_mesh_device(tt.MeshShape(*p.mesh.shape), trace_region_size=p.trace_region_size)
    ex = device.Executor(tt, dev)
    ex.on_call = rec.on_call
    recording.populate(ex, p, fws.values())
    ex.env["kv"] = device.allocate_kv(tt, dev, p.kv)
    for c in {c.name: c for fw in fws.values() for c in fw.consts if c.kind != "rope_cos" and c.kind != "rope_sin"}.values():
        ex.env[c.name] = device.make_const(tt, dev, c)
    (tmp_path / "tensorbin").mkdir()
    (tmp_path / cache.INDEX).write_text(json.dumps({"mesh": {"shape": list(p.mesh.shape)}, "devices": 8,
                                                   "tensors": {"wq.0": {}}}))
    cache.load_mesh_weights(tt, dev, tmp_path)
    r = trace.TraceRunner(ex, fws, set(keys))
    r.warmup()
    r.capture()
    out = r.run(keys[1], {n: __import__("numpy").zeros(s) for n, (s, d, l) in fws[keys[1]].inputs.items()})
    r.read(out["next_tokens"])
    r.release()
    assert rec.violations == []
    problems, seen = defaultdict(list), set()
    for ev in rec.events:
        args, kwargs = rec.values_of(ev)
        key = (ev.fn, repr(args), repr(kwargs))
        if key in seen:
            continue
        seen.add(key)
        for why in introspect.check(ttnn, ev.fn, args, kwargs):
            problems[why].append(ev.fn)
    assert not problems, "\n".join(problems)
    used = {e.fn for e in rec.events}
    assert {"begin_trace_capture", "end_trace_capture", "execute_trace", "release_trace",
            "allocate_tensor_on_device", "copy_host_to_device_tensor", "load_tensor", "from_host_shards"} <= used


# ---- ttnn's own op validation on a mock chip -----------------------------------------------------------
VALIDATE = {"N150": ["gemma-3-27b", "gpt-oss-20b", "llama-3.1-8b", "mistral-7b-v0.3", "qwen2.5-7b", "qwen3-8b"],
            # one MoE layer of each fits a Blackhole; so does Gemma 2's softcapped attention, whose K/V
            # gathered from the paged cache (32 decode rows x 8K tokens, 1 GiB) does not fit an N150
            "P150": ["deepseek-v3", "gemma-2-9b", "gpt-oss-120b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b"],
            "N300": ["llama-3.1-8b", "qwen3-8b"],
            # the dense families on 8 chips (tensor-parallel attention and MLP, gathered logits); not
            # yet: Gemma 2 (ttnn's softcap is Blackhole-only), the MoE families (an all_reduce over
            # the 2-chip axis is refused by reduce_scatter's neighbour lookup; gpt-oss's combine
            # partitions a width that is not a tile multiple)
            "T3K": ["gemma-3-27b", "llama-3.1-8b", "mistral-7b-v0.3", "qwen2.5-7b", "qwen3-8b"]}


@pytest.mark.parametrize("mesh", [pytest.param(m, marks=pytest.mark.slow) if m == "T3K" else m for m in sorted(VALIDATE)])
def test_every_family_passes_ttnn_op_validation_on_a_mock_chip(mesh, tmp_path):
    """Every call of the smallest prefill and decode bucket (each layer kind once) on a mock chip:
    ttnn checks shapes, dtypes, layouts, memory and program configs before compiling kernels,
    which is where a mock device stops. Every call must get that far (``mockcheck``). Found this
    way and fixed: SDPA's scale must be a float32 value, paged_update_cache wants height-sharded
    heads, sinks are [1, H, 1, 1] in prefill and [H, 1] in decode, sampling reads uint32
    ROW_MAJOR ids, scatter takes no fp32 tiles, 1D matmul configs need a core rectangle.

    On N300 and T3K (``mockcheck``'s docstring) the ops are configured for the grid the mock device
    reports (8x7) and the all_gather / all_reduce calls, which need a fabric a mock mesh cannot
    start, are checked by signature and output spec and counted apart; single chips have none."""
    import importlib.util
    import subprocess
    import sys

    from ttbundle import mockcluster
    spec = importlib.util.find_spec("ttnn")
    if not (Path(spec.origin).parent / "runtime/sfpi/compiler/bin/riscv-tt-elf-g++").exists():
        pytest.skip("no SFPI stub: mock meshes do not open (scripts/setup_tt.sh)")
    env = mockcluster.mock_env(mesh, tmp_path)
    specs = [str(BUNDLES / f"{b}.yaml") for b in VALIDATE[mesh]]
    from handover_helpers import hand_over
    dirs = hand_over(specs, mesh, tmp_path / "programs")  # planned and lowered here, not in the backend
    r = subprocess.run([sys.executable, "-m", "ttbundle.ttnnproc", "mockcheck", mesh, *dirs], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    results = [json.loads(ln[7:]) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and len(results) == 2 * len(specs), r.stdout[-3000:] + r.stderr[-3000:]
    bad = [f"{Path(x['dir']).name} {x['phase']}-{x['bucket']}: {fn} ({op}): {msg[:300]}"
           for x in results for fn, (op, msg) in x["refused"].items()]
    assert not bad, "\n".join(bad)
    assert all(x["accepted"] + sum(x["by_signature"].values()) == x["calls"] > 0 for x in results)
    from ttbundle import mesh as meshmod
    if meshmod.resolve(mesh).num_devices > 1:  # every program reduces and gathers (attention, MLP, logits)
        assert all(x["by_signature"].get("all_reduce") and x["by_signature"].get("all_gather") for x in results)
    else:
        assert all(x["by_signature"] == {} for x in results)
