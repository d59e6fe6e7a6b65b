"""Speculative decoding with a draft model (``speculative: {method: draft}``) through vLLM's own
engine, in-process: the draft's package built into the target's (``draft/``, verified with it,
its key one of the target's), greedy tokens identical to the same package served without
speculation and to transformers, every proposal accepted when the draft is the target itself
and some (not all) when the draft is the target with noise added to its weights, stochastic
speculation keeping the distribution of sampling without speculation (a test over many seeds),
``serve`` passing vLLM's ``draft_model`` config and the platform refusing another draft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from runtime_helpers import greedy, hf_greedy, run_engine, spec_text
from test_runtime_speculative import OTHERS, PATTERN, REPETITIVE, _contingency_pvalue

K = 3
PROMPTS = [REPETITIVE] + OTHERS


def _noisy_copy(src, dst, scale: float, seed: int = 7):
    """``src``'s checkpoint with Gaussian noise (``scale`` x each tensor's std) added to every
    weight: a draft that agrees with the target often, not always."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in dst.glob("*.safetensors"):
        sd = load_file(f)
        for k, t in sd.items():
            if t.is_floating_point() and t.numel() > 1:
                x = t.float()
                sd[k] = (x + scale * x.std() * torch.randn(x.shape, generator=g)).to(t.dtype)
        save_file(sd, f, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def draft_packages(packages_dir):
    """``draft_packages(kind, mesh="N150", lanes=False)`` -> (package, checkpoint): the target
    whose draft is the target itself (``kind="self"``) or the target with a noisy draft
    (``"noisy"``), from one random checkpoint, built for ``mesh`` (the draft built for the same
    mesh into the target); ``lanes``: both split into T3K's 8 replicas of 1x1 (``replicas:``),
    4 sequences per lane."""
    from ttbundle import spec as specmod
    from ttbundle.build import build
    from ttbundle.serving.demo import make_source, spec_with_source

    out = packages_dir / "draft"
    out.mkdir()
    base = yaml.safe_load(spec_text("llama"))
    src = out / "src-target"
    make_source(specmod.loads(spec_text("llama")), src, 0)
    _noisy_copy(src, out / "src-noisy", 0.6)
    built = {}

    def make(kind: str, mesh: str = "N150", lanes: bool = False):
        if (kind, mesh, lanes) in built:
            return built[(kind, mesh, lanes)]
        dsrc = src if kind == "self" else out / "src-noisy"
        tag = f"{kind}-r1x1" if lanes else kind
        split = {"replicas": {"T3K": {"submesh": [1, 1]}}, "runtime": dict(base["runtime"], max_num_seqs=4)} \
            if lanes else {}
        d = dict(base, name=f"tiny-llama-draft-{tag}", **split)
        (out / f"draft-{tag}.yaml").write_text(spec_with_source(yaml.safe_dump(d), dsrc))
        t = dict(base, name=f"tiny-llama-dtarget-{tag}", **split,
                 speculative={"method": "draft", "model": f"draft-{tag}.yaml", "num_speculative_tokens": K})
        (out / f"target-{tag}.yaml").write_text(spec_with_source(yaml.safe_dump(t), src))
        res = build(specmod.load(out / f"target-{tag}.yaml"), mesh, out)
        built[(kind, mesh, lanes)] = (Path(res.package), src)
        return built[(kind, mesh, lanes)]
    return make


@pytest.fixture(autouse=True)
def _in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _config(pkg):
    return {"method": "draft_model", "model": f"{pkg}/draft", "num_speculative_tokens": K}


def _run(pkg, speculative: bool, requests, **kw):
    return run_engine(pkg, _config(pkg) if speculative else None, requests, **kw)


@pytest.mark.parametrize("kind, mesh", [("self", "N150"), ("noisy", "N150"), ("noisy", "T3K")])
def test_greedy_draft_is_identical_without_speculation_and_to_transformers(draft_packages, kind, mesh):
    """On N150 and on T3K (the target and its draft sharded over the 8 chips)."""
    pkg, src = draft_packages(kind, mesh)
    batches = [(PROMPTS, greedy(40))]
    (spec_out,), metrics, steps, runner = _run(pkg, True, batches)
    (plain_out,), plain_metrics, plain_steps, _ = _run(pkg, False, batches)
    assert spec_out == plain_out
    for p, toks in zip(PROMPTS, spec_out):
        assert toks == hf_greedy(src, p["prompt_token_ids"], 40)
    drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted > 0
    if kind == "self":  # the draft is the target: every proposal is the target's argmax
        assert accepted == drafted
    else:
        assert accepted < drafted
    assert not plain_metrics.get("vllm:spec_decode_num_draft_tokens")
    verify = [s for s in steps if s.phase == "verify"]
    assert verify and all(s.sampling == "device" for s in verify)
    assert sum(1 for s in steps if s.phase in ("decode", "verify")) < sum(1 for s in plain_steps if s.phase == "decode")
    draft = runner.proposer.model  # the draft package's own programs ran (prefill, decode, catch-up)
    ran = {p for p, _ in draft.programs_run}
    # every proposal accepted (self): the last was never fed, each request 2 behind: the catch-up call
    assert ran == ({"prefill", "decode", "verify"} if kind == "self" else ran & {"prefill", "decode", "verify"})
    assert {"prefill", "decode"} <= ran
    assert runner.proposer.package.path == pkg / "draft"
    # the draft sharded over the target's mesh (T3K: its 8 chips)
    assert runner.proposer.package.loaded.mesh.num_devices == runner.package.loaded.mesh.num_devices \
        == {"N150": 1, "T3K": 8}[mesh]


@pytest.mark.parametrize("mesh", ["N150", "T3K"])
def test_draft_proposals_are_the_drafts_greedy_tokens_after_acceptances_and_rejections(draft_packages, mesh):
    """The proposer alone: its k proposals are transformers' greedy continuation of the draft
    checkpoint, step after step, while each request keeps 0 to k of them and a token of its own
    (the draft's KV reused where proposals were accepted, rewritten where they were not)."""
    from ttbundle.runtime.draft import DraftProposer
    from ttbundle.runtime.packages import open_package

    pkg, _ = draft_packages("noisy", mesh)
    dsrc = pkg.parents[1] / "src-noisy"
    proposer = DraftProposer(open_package(pkg), K, 256)
    assert proposer.catch_up_rows == K + 1
    seqs = {f"r{i}": list(p["prompt_token_ids"]) for i, p in enumerate(PROMPTS)}
    for step in range(5):
        before = dict(proposer.model.programs_run)
        got = proposer.propose_batch(list(seqs.items()))
        for (rid, toks), props in zip(list(seqs.items()), got):
            assert props == hf_greedy(dsrc, toks, K), (step, rid)
        calls = {p: n - before.get(p, 0) for p, n in proposer.model.programs_run.items() if n > before.get(p, 0)}
        if step:  # the catch-up and the first proposal in one call, then k - 1 decode calls (bucket 4):
            # a request that kept all K proposals last step is 2 tokens behind (the last proposal
            # was never fed): the verify program's call; each 1 behind (step 1): a decode call
            one_behind = (step - 1) % (K + 1) == 0
            assert calls == ({("decode", 4): K} if one_behind else {("verify", 4): 1, ("decode", 4): K - 1}), \
                (step, calls)
        for i, ((rid, toks), props) in enumerate(zip(list(seqs.items()), got)):
            j = (step + i) % (K + 1)  # proposals kept; then the target's own token
            seqs[rid] = toks + props[:j] + [(props[j] + 1) % 512 if j < K else 5]
    proposer.release("r0")
    assert set(proposer.slots) == {"r1", "r2"}


def test_lanes_draft_per_lane_identical_to_transformers(draft_packages):
    """A T3K split into 8 replicas of 1x1 served as lanes, the draft (the target itself, split
    the same way) beside each: each lane's requests propose from the lane's own draft KV region
    (every proposal the target's argmax: accepted == drafted, which a request reading another
    lane's or another request's draft KV would break) and verify on the lane's target KV, greedy
    tokens those of transformers. 10 requests on 8 lanes: two lanes hold two."""
    pkg, src = draft_packages("self", "T3K", lanes=True)
    prompts = PROMPTS + [{"prompt_token_ids": PATTERN[::-1] * 5}] + \
        [{"prompt_token_ids": [(3 * i + 11 * j) % 450 + 30 for i in range(24 + 5 * j)]} for j in range(6)]
    (out,), metrics, steps, runner = _run(pkg, True, [(prompts, greedy(24))], max_num_seqs=32)
    assert runner.lanes is not None and runner.lane_plan.lanes == 8
    assert len(runner.proposer.kvs) == 8 and runner.proposer.kvs[0] is not runner.proposer.kvs[1]
    for p, toks in zip(prompts, out):
        assert toks == hf_greedy(src, p["prompt_token_ids"], 24)
    drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted == drafted
    verify = [s for s in steps if s.phase == "verify"]
    assert verify and all(s.sampling == "device" for s in verify)
    assert len({lane for s in verify for lane in s.lanes}) == 8  # rows of every lane verified
    assert max(sum(1 for s_lane in s.lanes if s_lane == lane) for s in verify for lane in set(s.lanes)) == 2
    # the last requests' slots (vLLM reports them finished with the next step): in their lane's region
    slots = runner.proposer.slots
    assert slots and all(s.lane == runner.lanes.of[rid].index for rid, s in slots.items())


@pytest.mark.slow  # two engines on 400 requests: minutes on 2 CPU cores
def test_stochastic_draft_keeps_the_distribution_of_sampling_without_speculation(draft_packages):
    """400 seeded requests, 4 tokens each, with the noisy draft: per position, the tokens'
    distribution with speculation against without it."""
    pkg, src = draft_packages("noisy")
    n = 400
    prompt = {"prompt_token_ids": REPETITIVE["prompt_token_ids"] + hf_greedy(src, REPETITIVE["prompt_token_ids"], 16)}
    params = [dict(max_tokens=4, temperature=0.8, top_k=4, seed=s, ignore_eos=True) for s in range(n)]
    batches = [([prompt] * n, params)]
    (spec_out,), metrics, steps, _ = _run(pkg, True, batches)
    (plain_out,), _, _, _ = _run(pkg, False, batches)
    assert metrics["vllm:spec_decode_num_draft_tokens"] > 0
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens"] < metrics["vllm:spec_decode_num_draft_tokens"]
    assert any(s.phase == "verify" for s in steps)
    for pos in range(4):
        a = np.bincount([t[pos] for t in spec_out], minlength=512)
        b = np.bincount([t[pos] for t in plain_out], minlength=512)
        assert _contingency_pvalue(a, b) > 1e-3, pos


def test_the_draft_is_part_of_the_package_verified_and_keyed_with_it(draft_packages, tmp_path):
    """Every draft file is listed in the target's manifest (size, sha256) and checked by
    ``package.verify``; the draft's key is a key field of the target's."""
    from ttbundle.package.names import PackageError
    from ttbundle.package.verify import read_manifest, verify_package

    pkg, _ = draft_packages("self")
    m = read_manifest(pkg)
    dm = read_manifest(pkg / "draft")
    assert {f"draft/{r}" for r in dm["files"]} | {"draft/manifest.json"} <= set(m["files"])
    assert m["key_fields"]["speculative.draft"] == dm["key"]
    assert m["artifacts"]["draft"]["bundle"] == "tiny-llama-draft-self"
    # the key: up to date as built; a changed draft spec changes the target's key through the field
    from ttbundle import spec as specmod
    from ttbundle.build import build, explain
    ex = explain(pkg)
    assert ex["up_to_date"], [f for f in ex["fields"] if f["changed"]]
    f = pkg.parents[1] / "draft-self.yaml"
    text = f.read_text()
    try:
        f.write_text(text.replace("description: tiny random llama", "description: another draft"))
        res = build(specmod.load(pkg.parents[1] / "target-self.yaml"), "N150", pkg.parents[1], dry_run=True)
        assert res.changed_fields == ["speculative.draft"] and res.key != m["key"]
    finally:
        f.write_text(text)
    # cache verify's numeric half runs the draft's programs against its build's references too
    from ttbundle.warmup import verify_package as verify_numbers
    diffs = verify_numbers(pkg)["float32"]
    assert {n for n in diffs if n.startswith("draft/")} == \
        {f"draft/{n}" for n in diffs if not n.startswith("draft/")}  # the draft's verify: its catch-up
    copy = tmp_path / "pkg"
    shutil.copytree(pkg, copy)
    verify_package(copy)
    w = copy / "draft" / "weights" / "device-000.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="draft/weights/device-000.safetensors: sha256 mismatch"):
        verify_package(copy)
    shutil.rmtree(copy)
    shutil.copytree(pkg, copy)
    (copy / "draft" / "extra.py").write_text("print(1)\n")
    with pytest.raises(PackageError, match="draft/extra.py: not in the manifest"):
        verify_package(copy)


def test_serve_passes_the_draft_config_and_the_platform_refuses_another_draft(draft_packages, tmp_path):
    from vllm import LLM

    from ttbundle.errors import InvalidInput
    from ttbundle.serving.serve import plan_serve

    pkg, _ = draft_packages("self")
    argv = plan_serve(pkg).argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == _config(pkg)
    with pytest.raises(InvalidInput) as ei:
        plan_serve(pkg, extra=["-sc", json.dumps(dict(_config(pkg), model=str(tmp_path)))])
    assert f"model: given {str(tmp_path)!r}" in str(ei.value)
    other, _ = draft_packages("noisy")
    with pytest.raises(Exception) as ei:
        LLM(model=str(pkg), dtype="float32", speculative_config=_config(other))
    assert "model: given" in str(ei.value) and str(pkg / "draft") in str(ei.value), str(ei.value)


@pytest.mark.slow  # a server with two engine processes on the shared 2-core host: minutes
def test_vllm_data_parallel_2_draft_on_every_rank(draft_packages, tmp_path, monkeypatch):
    """`ttbundle serve`'s command with `--data-parallel-size 2` on the lanes package: two engine
    ranks of 4 lanes, each with the draft's 4 KV regions, through vLLM's OpenAI server; greedy
    tokens those of transformers on both ranks, every proposal accepted (the draft is the
    target: vLLM's spec-decode counters on /metrics)."""
    import urllib.request

    from test_runtime_lanes_server import _free_port, _prompt, _run_clients, _serve
    from ttbundle.serving.serve import plan_serve, stop

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    pkg, src = draft_packages("self", "T3K", lanes=True)
    port = _free_port()
    plan = plan_serve(pkg, "127.0.0.1", port, data_parallel_size=2,
                      extra=["--data-parallel-rpc-port", str(_free_port())])
    assert "--speculative-config" in plan.argv
    plan.env.update(TTBUNDLE_STEP_LOG=str(tmp_path / "steps.jsonl"), TTBUNDLE_EMULATED_THREADS="1")
    proc, _ = _serve(plan.argv, plan.env, port, tmp_path, plan.name)
    try:
        log = (tmp_path / "vllm.log").read_text()
        assert "DP rank 0 of 2, 4 lane(s)" in log and "DP rank 1 of 2, 4 lane(s)" in log
        assert log.count("per lane, 4 lanes") >= 2, log[-3000:]  # each rank's draft: a KV region per lane
        lens = [6, 9, 12, 7, 10, 8, 11, 5, 9, 12, 6, 10]
        results = _run_clients(plan.url, plan.name, len(lens), lens)
        for i, (_, n, toks) in enumerate(results):
            assert toks == hf_greedy(src, _prompt(i), n), i
        metrics = urllib.request.urlopen(plan.url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
        vals = {}
        for line in metrics.splitlines():
            for name in ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
                if line.startswith(name + "{"):
                    vals[name] = vals.get(name, 0) + float(line.rsplit(" ", 1)[1])
        drafted = vals["vllm:spec_decode_num_draft_tokens_total"]
        accepted = vals["vllm:spec_decode_num_accepted_tokens_total"]
        assert drafted > 0 and accepted == drafted, vals
        steps = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
        verify_lanes = {lane for s in steps if s["phase"] == "verify" for lane in s["lanes"]}
        assert {lane // 4 for lane in verify_lanes} == {0, 1}  # both ranks verified proposals
    finally:
        stop(proc)


def test_a_tampered_draft_kv_block_count_is_refused_by_the_checks(draft_packages, tmp_path):
    """``speccheck`` counts the draft's KV blocks from the target's bundle.yaml and the draft
    package's (``speculative.draft_kv_blocks``), not from the manifest it checks: an edited
    ``serving.draft_kv_blocks`` is refused, naming both values; the package as built passes, and
    its emulated host pool counts the draft as the plan does."""
    from ttbundle import speculative
    from ttbundle.package.load import read_bundle
    from ttbundle.package.names import PackageError
    from ttbundle.package.speccheck import load_checked
    from ttbundle.plan.host import host_plan
    from ttbundle.plan.make import make_plan
    from ttbundle.runtime.packages import open_package

    pkg, _ = draft_packages("self")
    loaded = load_checked(pkg)
    want = speculative.draft_kv_blocks(loaded.bundle, read_bundle(pkg / "draft"))
    assert loaded.serving.draft_kv_blocks == want
    plan = make_plan(loaded.bundle, "N150")
    assert plan.memory.draft > 0
    assert open_package(pkg).host_plan(available=64 << 30).to_json() == \
        host_plan(loaded.bundle, plan, available=64 << 30).to_json()
    copy = tmp_path / "pkg"
    shutil.copytree(pkg, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["serving"]["draft_kv_blocks"] = want + 1
    (copy / "manifest.json").write_text(json.dumps(m, indent=1))
    with pytest.raises(PackageError, match=rf"serving facts disagree with bundle.yaml: draft_kv_blocks {want + 1} "
                                           rf"\(bundle.yaml: {want}\)"):
        load_checked(copy)
