"""The emulated mesh fits its host (issue 38, part 0): `auto` sizes the emulated KV pool from the
host's available memory (a stated share after weights, activations and runtime, at most the
device's pool), `serve` prints the pool and the expected peak before vLLM starts and refuses a
pool that cannot fit with the arithmetic, `plan` and `validate` say whether the emulated mesh fits
this host, and when vLLM's engine dies of a signal `serve` names it (SIGKILL: with the memory
arithmetic). The host's memory is injected (``kvpool.available_memory``)."""

from __future__ import annotations

import json
import signal
import socket
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from spec_helpers import TINY, dump
from ttbundle import spec
from ttbundle.errors import DoesNotFit, TTBundleError
from ttbundle import kvpool
from ttbundle.plan import host as hostmod
from ttbundle.plan.make import make_plan
from ttbundle.serving import serve as servemod

GiB = 1 << 30

# SmolLM-135M's architecture (the model): 30 layers, 9 query / 3 KV heads of 64, tied
# embeddings; on an N300 (2 chips) its heads are padded to 12 / 4 (as `init` writes the spec)
SMOL = """\
name: smol-135m
model:
  family: llama
  vocab_size: 49152
  hidden_size: 576
  intermediate_size: 1536
  num_hidden_layers: 30
  num_attention_heads: 9
  num_key_value_heads: 3
  max_position_embeddings: 8192
  rms_norm_eps: 1.0e-5
  tie_word_embeddings: true
targets: [N300]
sharding: {attention_heads: pad, kv_heads: pad}
buckets: {prefill: [128, 512, 2048], decode: [1, 8, 32], prefill_chunk: 2048}
runtime: {max_model_len: 8192, max_num_seqs: 32}
"""

# written out from the dims, not from ttbundle: K and V, 30 layers, 2 devices x 2 KV heads (3
# padded to 4 over 2 chips), head_dim 64, float32, 32 tokens a block
SMOL_KV_PER_BLOCK = 2 * 30 * 2 * 2 * 64 * 4 * 32
# every weight once in float32 (each of the 2 devices holds half of each matrix, heads padded:
# q 12 x 64 = 768, k/v 4 x 64 = 256), embedding and head apart, norms once
SMOL_WEIGHTS = 4 * (2 * 49152 * 576 + 30 * (2 * 576 * 768 + 2 * 576 * 256 + 3 * 576 * 1536 + 2 * 576) + 576)


@pytest.fixture
def smol(tmp_path):
    p = tmp_path / "smol.yaml"
    p.write_text(SMOL)
    return p


def _fake_memory(monkeypatch, n: int) -> None:
    monkeypatch.setattr(kvpool, "available_memory", lambda: n)


def test_auto_on_an_emulated_n300_is_sized_for_the_host(smol, monkeypatch):
    b = spec.load(smol)
    p = make_plan(b, "N300")
    # the device's pool: every sequence at full length (the 8224 blocks; 15 GiB as float32 here)
    assert p.kv["num_blocks"] == -(-(32 * 8192 + 32 * 32) // 32) == 8224
    assert 8224 * SMOL_KV_PER_BLOCK > 15 * GiB
    _fake_memory(monkeypatch, 16 * GiB)
    h = hostmod.host_plan(b, p)
    assert h.kv_bytes_per_block == SMOL_KV_PER_BLOCK and h.weights == SMOL_WEIGHTS
    assert h.runtime == kvpool.RUNTIME_BYTES and h.activations > 0
    left = 16 * GiB - SMOL_WEIGHTS - h.activations - kvpool.RUNTIME_BYTES
    blocks = int(kvpool.HOST_KV_SHARE * left) // SMOL_KV_PER_BLOCK  # the largest that fits the share
    assert h.chosen == "auto" and h.blocks == blocks < 8224
    assert h.tokens == blocks * 32 - 32 * 32
    assert h.kv <= kvpool.HOST_KV_SHARE * left < h.kv + SMOL_KV_PER_BLOCK
    assert h.fits and h.peak == SMOL_WEIGHTS + h.activations + kvpool.RUNTIME_BYTES + blocks * SMOL_KV_PER_BLOCK
    # a large host: the device's pool, never more
    big = hostmod.host_plan(b, p, available=1 << 40)
    assert big.blocks == 8224 and big.tokens == 32 * 8192 and big.fits
    # too small a host for even one max_model_len sequence besides the weights: does not fit
    small = hostmod.host_plan(b, p, available=3 * GiB)
    assert small.blocks == -(-(8192 + 32 * 32) // 32) and not small.fits
    assert "does not fit: expected peak" in small.verdict()


def test_the_host_reading_is_memavailable(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683792 kB\nMemFree:  1 kB\nMemAvailable:   12345678 kB\n")
    monkeypatch.setattr(kvpool, "MEMINFO", meminfo)
    monkeypatch.setattr(kvpool, "_cgroup_room", lambda: None)
    assert kvpool.available_memory() == 12345678 * 1024
    monkeypatch.setattr(kvpool, "_cgroup_room", lambda: 1000)  # a container's limit is less
    assert kvpool.available_memory() == 1000


def _pkg(bundle, name="smol-135m", mesh="N300"):
    """What `serve` reads of a package (a built one: `test_serve_passes_the_host_pool_to_vllm...`)."""
    plan = make_plan(bundle, mesh)
    return SimpleNamespace(bundle=bundle, name=name, mesh_name=mesh,
                           host_plan=lambda **k: hostmod.host_plan(bundle, plan, **k))


def test_an_explicit_pool_that_cannot_fit_the_host_is_refused_with_the_arithmetic(smol, monkeypatch):
    _fake_memory(monkeypatch, 8 * GiB)
    b = spec.load(smol)
    with pytest.raises(DoesNotFit) as ei:  # vLLM's override: the 8224 blocks
        servemod.emulated_memory(_pkg(b), ["--num-gpu-blocks-override", "8224"])
    msg = str(ei.value)
    assert ei.value.exit_code == 3 and "\n" not in msg
    assert "smol-135m-N300 on the emulated mesh does not fit this host" in msg
    assert f"8,224 blocks x {SMOL_KV_PER_BLOCK:,} B" in msg and "8.00 GiB available" in msg
    kv_gib = 8224 * SMOL_KV_PER_BLOCK / GiB
    assert f"KV pool {kv_gib:.2f} GiB" in msg
    h = hostmod.host_plan(b, make_plan(b, "N300"), override_blocks=8224)
    best = (8 * GiB - h.fixed) // SMOL_KV_PER_BLOCK
    assert f"fix: --num-gpu-blocks-override {best} or less" in msg
    # the spec's own pool, the same
    b2 = spec.loads(SMOL.replace("max_num_seqs: 32}", "max_num_seqs: 32, max_tokens_all_users: 262144}"), "s.yaml")
    with pytest.raises(DoesNotFit, match=r"fix: runtime.max_tokens_all_users: [\d,]+ or less, or `auto`"):
        servemod.emulated_memory(_pkg(b2), [])
    # what fits is taken
    ok = servemod.emulated_memory(_pkg(b), ["--num-gpu-blocks-override", str(best)])
    assert ok.fits and ok.blocks == best and ok.chosen == "override"


def test_serve_passes_the_host_pool_to_vllm_and_prints_it_first(tmp_path, monkeypatch, runner):
    from ttbundle.cli import app
    from ttbundle.serving.demo import build_package

    text = dump({**TINY, "targets": ["N300"], "tokenizer": False})
    pkg = build_package(text, tmp_path / "pk", "N300", warmup=False)
    _fake_memory(monkeypatch, 64 * GiB)
    plan = servemod.plan_serve(pkg)
    b = spec.loads(text, "t.yaml")
    want = hostmod.host_plan(b, make_plan(b, "N300"), available=64 * GiB)
    a = plan.argv
    assert a[a.index("--num-gpu-blocks-override") + 1] == str(want.blocks)
    assert plan.memory.blocks == want.blocks and plan.memory.chosen == "auto"
    # the user's override is theirs (checked, not replaced)
    p2 = servemod.plan_serve(pkg, extra=["--num-gpu-blocks-override", "100"])
    assert p2.argv.count("--num-gpu-blocks-override") == 1 and p2.memory.blocks == 100

    # `serve` prints the pool and the expected peak before vLLM starts (a stand-in exits at once)
    fake = tmp_path / "fake_vllm.py"
    fake.write_text("import sys; sys.exit(1)\n")
    started = servemod.ServePlan(pkg, "tiny", "N300", [sys.executable, str(fake)], {}, "127.0.0.1", 1, plan.memory)
    monkeypatch.setattr(servemod, "resolve", lambda *a, **k: pkg)
    monkeypatch.setattr(servemod, "plan_serve", lambda *a, **k: started)
    r = runner.invoke(app, ["serve", "tiny", "--port", str(_port())])
    assert r.exit_code == 1
    lines = r.stderr.splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("emulated mesh on this host: KV pool"))
    assert lines[i + 1].startswith("starting vLLM")
    assert f"({want.blocks:,} blocks" in lines[i] and "expected peak" in lines[i] and "64.00 GiB available" in lines[i]


# the plugin's emulated pool against the plan's: an auto pool on two meshes, an explicit pool, an
# embedding bundle (one max_model_len prefill)
PLUGIN_CASES = {
    "auto-N150": ("N150", {}),
    "auto-T3K": ("T3K", {}),
    "spec-N300": ("N300", {"runtime": {"max_model_len": 2048, "max_num_seqs": 32, "max_tokens_all_users": 5000}}),
    "embed-N300": ("N300", {"task": "embed", "model": {**TINY["model"], "family": "mistral"}, "buckets": {"prefill": [128, 512]},
                            "runtime": {"max_model_len": 512, "max_num_seqs": 8}}),
}


@pytest.mark.parametrize("case", sorted(PLUGIN_CASES))
def test_the_plugins_emulated_pool_is_the_plans(tmp_path, monkeypatch, case):
    """The vLLM plugin (``Package.host_plan``) sizes the emulated mesh's pool from what the build
    recorded (manifest ``serving.host``, the programs' dims and pool) and imports no ``plan``; for
    hosts from the largest to too small, with lanes, engines and an override, its pool, peak and
    wording are those of ``plan.host.host_plan`` of the spec's own plan."""
    from ttbundle.runtime.packages import open_package
    from ttbundle.serving.demo import build_package

    mesh, over = PLUGIN_CASES[case]
    text = dump({**TINY, "targets": [mesh], "tokenizer": False, **over})
    pkg = open_package(build_package(text, tmp_path / "pk", mesh, warmup=False))
    b = spec.loads(text, "t.yaml")
    p = make_plan(b, mesh)
    assert pkg.loaded.serving.host.weights > 0 and pkg.kv_blocks == p.kv["num_blocks"]
    big = hostmod.host_plan(b, p, available=1 << 40)
    # hosts where auto takes the device's pool, a share of what is left, one sequence, nothing fits
    avails = [1 << 40, big.fixed + int(3.5 * big.kv_bytes_per_block / kvpool.HOST_KV_SHARE) + big.kv,
              big.fixed + int((p.kv["num_blocks"] // 2) * big.kv_bytes_per_block / kvpool.HOST_KV_SHARE),
              big.fixed + big.kv_bytes_per_block, 1 << 30]
    monkeypatch.setattr(kvpool, "available_memory", lambda: avails[2])
    seen = set()
    for avail in avails + [None]:
        for lanes, engines, override in ((1, 1, None), (2, 1, None), (1, 2, None), (1, 1, 7)):
            got = pkg.host_plan(lanes=lanes, engines=engines, override_blocks=override, available=avail)
            want = hostmod.host_plan(b, p, available=avail, lanes=lanes, engines=engines, override_blocks=override)
            assert (got.to_json(), got.pool_line(), got.verdict()) == \
                (want.to_json(), want.pool_line(), want.verdict()), (avail, lanes, engines, override)
            seen.add((want.chosen, want.why[:24], want.fits))
    # the hosts above reach several of the rule's branches (auto's four, each pool fitting or not)
    assert len(seen) >= (6 if case.startswith("auto") else 3), seen


def test_a_package_without_the_host_facts_is_refused_with_a_rebuild_hint(tmp_path):
    from ttbundle.package.load import load_package
    from ttbundle.package.names import PackageError
    from ttbundle.serving.demo import build_package

    pkg = build_package(dump({**TINY, "tokenizer": False}), tmp_path / "pk", "N150", warmup=False)
    m = json.loads((pkg / "manifest.json").read_text())
    assert set(m["serving"]["host"]) == set(kvpool.HOST_RECORD)
    del m["serving"]["host"]
    (pkg / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackageError, match=r"no host facts .*rebuild the package with `ttbundle build`"):
        load_package(pkg)


def test_host_facts_that_disagree_with_the_spec_are_refused_by_the_checks(tmp_path):
    """``speccheck`` counts the host facts from a plan of bundle.yaml on the package's mesh: a
    manifest whose weights were edited is refused, naming the field and both values."""
    from ttbundle.package.names import PackageError
    from ttbundle.package.speccheck import load_checked
    from ttbundle.serving.demo import build_package

    text = dump({**TINY, "targets": ["N300"], "tokenizer": False})
    pkg = build_package(text, tmp_path / "pk", "N300", warmup=False)
    load_checked(pkg)
    m = json.loads((pkg / "manifest.json").read_text())
    b = spec.loads(text, "t.yaml")
    want = hostmod.host_facts(b, make_plan(b, "N300")).weights
    assert m["serving"]["host"]["weights"] == want
    m["serving"]["host"]["weights"] = want // 2
    (pkg / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PackageError, match=r"serving facts disagree with bundle.yaml: host .*'weights': "
                                           rf"{want // 2}.*'weights': {want}"):
        load_checked(pkg)


def test_plan_and_validate_say_whether_the_emulated_mesh_fits_this_host(smol, monkeypatch, runner):
    from ttbundle.cli import app

    _fake_memory(monkeypatch, 64 * GiB)
    r = runner.invoke(app, ["validate", str(smol)])
    assert r.exit_code == 0
    assert r.stdout.splitlines()[1].startswith("  N300, emulated on this host: fits: KV pool ")
    j = json.loads(runner.invoke(app, ["plan", str(smol), "--json"]).stdout)["emulated_host"]
    assert j["fits"] and j["kv_bytes_per_block"] == SMOL_KV_PER_BLOCK and j["weights"] == SMOL_WEIGHTS
    _fake_memory(monkeypatch, 2 * GiB)
    r = runner.invoke(app, ["validate", str(smol)])
    assert r.exit_code == 0  # the device's verdict: the spec fits an N300
    line = r.stdout.splitlines()[1]
    assert line.startswith("  N300, emulated on this host: does not fit: expected peak") and "2.00 GiB available" in line
    r = runner.invoke(app, ["plan", str(smol)])
    assert any(x.startswith("emulated mesh on this host: does not fit") for x in r.stdout.splitlines())


# ---- a vLLM engine that dies of a signal -----------------------------------------------------
# A stand-in for vLLM 0.33's API server: it loads ttbundle's general plugin (vLLM calls the
# `vllm.general_plugins` entry point in its API server before it starts an engine), starts its
# engine core with multiprocessing (as vLLM does), the engine is killed by a signal before it is
# ready, and the API server says what vLLM said in the run that prompted this (its exit codes read
# before the engine was reaped: an empty dict), shuts the engine down as vLLM does (terminate,
# join) and exits 1. MODE "words": no plugin, and vLLM's message with the exit code in it; signal
# 0: the engine runs until vLLM's shutdown terminates it.
FAKE = textwrap.dedent('''
    import multiprocessing, os, signal, sys, time
    def engine(sig):
        if sig:
            os.kill(os.getpid(), sig)
        time.sleep(30)
    if __name__ == "__main__":
        sig, mode = int(sys.argv[1]), sys.argv[2]
        if mode == "plugin":
            from ttbundle.runtime.activation import general_plugin
            general_plugin()
        p = multiprocessing.Process(target=engine, args=(sig,), name="EngineCore_DP0")
        p.start()
        if sig:
            os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped yet
        else:
            time.sleep(0.5)  # a running engine: vLLM's shutdown below ends it
        finished = {} if mode == "plugin" else {p.name: p.exitcode}
        print("RuntimeError: Engine core initialization failed. See root cause above. "
              f"Failed core proc(s): {finished}", file=sys.stderr, flush=True)
        p.terminate()  # vLLM's shutdown: a signal it sends itself is not the cause
        p.join()
        sys.exit(1)
''')


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig, mode", [(signal.SIGKILL, "plugin"), (signal.SIGSEGV, "plugin"),
                                       (signal.SIGKILL, "words")])
def test_serve_names_the_signal_that_killed_the_engine(tmp_path, smol, sig, mode):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE)
    b = spec.load(smol)
    memory = hostmod.host_plan(b, make_plan(b, "N300"), available=8 * GiB)
    plan = servemod.ServePlan(tmp_path, "smol-135m", "N300", [sys.executable, str(script), str(int(sig)), mode],
                              {}, "127.0.0.1", _port(), memory)
    with pytest.raises(TTBundleError) as ei:
        servemod.run(plan, startup_timeout=60)
    msg = str(ei.value)
    assert "\n" not in msg
    assert f"was killed by signal {int(sig)} ({sig.name}) before it was healthy (vLLM exit code 1)" in msg
    assert msg.startswith("vLLM's engine process " + ("EngineCore_DP0" if mode == "words" else ""))
    assert ("OOM killer" in msg) == (sig == signal.SIGKILL)
    if sig == signal.SIGKILL:  # the arithmetic: this serve's expected peak against what the host had
        assert f"expected a peak of {memory.arithmetic()}, with 8.00 GiB available" in msg


def test_a_signal_vllm_sends_itself_is_not_the_cause(tmp_path):
    """vLLM fails its start-up for another reason and its shutdown terminates the running engine:
    serve says vLLM exited, not that a signal killed the engine."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE)
    plan = servemod.ServePlan(tmp_path, "x", "N150", [sys.executable, str(script), "0", "plugin"], {},
                              "127.0.0.1", _port())
    with pytest.raises(TTBundleError) as ei:
        servemod.run(plan, startup_timeout=60)
    assert str(ei.value) == "vLLM exited with code 1 before it was healthy (its output above says why)"


def test_engine_signal_reads_vllms_words():
    assert servemod.engine_signal("Failed core proc(s): {'EngineCore_DP0': -9}") == ("EngineCore_DP0", 9)
    assert servemod.engine_signal("Failed core proc(s): {'EngineCore_DP0': 1}") is None
    assert servemod.engine_signal("Process ApiServer_0 (PID: 12) died with exit code -11") == ("ApiServer_0", 11)
    assert servemod.engine_signal("vLLM exited") is None


def test_a_file_log_is_read_back_for_the_signal(tmp_path):
    """`start(plan, log=f)` (the tests' and benches' way): the signal is read from the file."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE)
    plan = servemod.ServePlan(tmp_path, "x", "N150", [sys.executable, str(script), "9", "words"], {}, "127.0.0.1",
                              _port())
    with open(tmp_path / "vllm.log", "wb") as f:
        proc = servemod.start(plan, log=f)
    try:
        with pytest.raises(TTBundleError, match=r"EngineCore_DP0 was killed by signal 9 \(SIGKILL\)"):
            servemod.wait_healthy(proc, plan.host, plan.port, 60)
    finally:
        servemod.stop(proc)
    assert Path(tmp_path / "vllm.log").read_text().count("Failed core proc(s)") == 1


ORPHAN = textwrap.dedent('''
    import os, signal, sys, time
    pid = os.fork()
    if pid == 0:                      # the engine: runs a while, then a signal kills it
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)   # dead, left unreaped
    os._exit(0)                       # the API server goes without reaping it (as vLLM may)
''')


def test_an_engine_its_api_server_left_unreaped_is_reaped_by_serve(tmp_path):
    """No plugin, no words: the engine, orphaned by its API server, becomes serve's child (a
    child subreaper) and serve reads the signal from its status."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(ORPHAN)
    plan = servemod.ServePlan(tmp_path, "x", "N150", [sys.executable, str(script)], {}, "127.0.0.1", _port())
    proc = servemod.start(plan)
    try:
        while proc.poll() is None:  # serve samples its processes while it waits (wait_healthy)
            servemod._sample(proc)
        engine = [p for p in proc.names if p != proc.pid]
        assert engine, "the engine was not seen"
        msg = servemod.died(proc, "before it was healthy")
        assert f"(pid {engine[0]}) was killed by signal 9 (SIGKILL) before it was healthy (vLLM exit code 0)" in msg
    finally:
        servemod.stop(proc)


def test_an_engine_killed_before_serve_saw_it_is_still_named(tmp_path):
    """The engine dies before serve's first sample (its name never seen, as when it is killed in
    its first half second): serve still finds it among its orphans in vLLM's process group and
    reads the signal from its status (the race behind a CI failure of the real-vLLM test)."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(ORPHAN.replace("time.sleep(1.0)", "pass"))
    plan = servemod.ServePlan(tmp_path, "x", "N150", [sys.executable, str(script)], {}, "127.0.0.1", _port())
    proc = servemod.start(plan)
    try:
        proc.wait(60)  # no sample: serve never saw the engine alive
        assert not [p for p in proc.names if p != proc.pid]
        msg = servemod.died(proc, "before it was healthy")
        assert "was killed by signal 9 (SIGKILL) before it was healthy (vLLM exit code 0)" in msg, msg
    finally:
        servemod.stop(proc)
