"""vLLM's own engine in-process (``vllm.LLM``, no server) on a package: the worker, the model
runner, the scheduler and both sampling paths, checked against transformers and against the
rules of the recorded steps."""

from __future__ import annotations

import pytest

from runtime_helpers import CHUNK, DECODE, PREFILL, check_steps, hf_greedy, pick

PROMPT_LENS = (5, 100, 150, 20, 64, 65, 3, 200, 33, 1)


@pytest.fixture(scope="module")
def engine(make_package):
    import os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    pkg, src = make_package("llama", "N150")
    llm = LLM(model=str(pkg), dtype="float32", seed=0)
    core = llm.llm_engine.engine_core.engine_core
    yield llm, core.scheduler, core.model_executor.driver_worker.worker.model_runner, src
    llm.llm_engine.engine_core.shutdown()


def _prompts(lens, offset=10):
    return [{"prompt_token_ids": [(offset + 7 * i + n) % 500 + 8 for i in range(n)]} for n in lens]


def _generate(llm, prompts, params):
    from vllm import SamplingParams
    ps = params if isinstance(params, list) else [params] * len(prompts)
    return llm.generate(prompts, [SamplingParams(**p) for p in ps], use_tqdm=False)


def test_greedy_batch_matches_transformers_generate(engine):
    llm, sched, runner, src = engine
    prompts = _prompts(PROMPT_LENS)
    n0 = len(sched.records)
    outs = _generate(llm, prompts, dict(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(src, p["prompt_token_ids"], 12), len(p["prompt_token_ids"])
    # the steps that produced them: one phase each, chunked, padded, bounded waiting
    plens = {}
    records = list(sched.records)[n0:]
    ids = {rid for r in records for rid in r.tokens}
    for p, o in zip(prompts, outs):
        for rid in ids:
            if rid.startswith(f"{o.request_id}-"):
                plens[rid] = len(p["prompt_token_ids"])
    assert len(plens) == len(prompts)
    chunks = check_steps(records, plens, CHUNK, PREFILL, 1)
    assert max(len(c) for c in chunks.values()) == 4  # 200 tokens = 64 + 64 + 64 + 8


def test_runner_pads_every_batch_to_the_smallest_bucket(engine):
    llm, sched, runner, _ = engine
    _generate(llm, _prompts((7, 70, 3)), dict(max_tokens=5, temperature=0, ignore_eos=True))
    steps = list(runner.step_log)
    assert steps
    for s in steps:
        if s.phase == "decode":
            assert s.buckets == [pick(DECODE, len(s.rows))]
        else:  # one call per chunk padded to its bucket, or several chunks sharing one call
            assert_prefill_calls(s, PREFILL)
    model = runner.mesh_model
    assert model.sealed and set(model.programs_run) <= model.warmed
    assert model.warmed == {("prefill", b) for b in PREFILL} | {("decode", b) for b in DECODE}


def assert_prefill_calls(step, buckets):
    """A prefill step's program calls: each a bucket's rows, either one chunk padded to the
    smallest bucket holding it, or k chunks of R rows each (R a multiple of 32 dividing the
    bucket, k <= bucket / R <= 32), every chunk in exactly one call, and never more rows than
    one call per chunk would run."""
    lens = [n for _, _, n in step.rows]
    assert sum(k for _, _, k in step.calls) == len(lens)
    for S, R, k in step.calls:
        assert S in buckets and (R == S or (R % 32 == 0 and S % R == 0 and k <= S // R <= 32)), step.calls
    # the rows the calls run: at most the rows of one padded call per chunk
    assert sum(S for S, _, _ in step.calls) <= sum(pick(buckets, n) for n in lens), (step.calls, lens)
    for (_, _, n), b in zip(step.rows, step.buckets):
        assert b >= n and any(S == b and R >= n for S, R, _ in step.calls)


def test_several_short_prompts_share_one_prefill_call_and_match_transformers(engine):
    llm, sched, runner, src = engine
    lens = (20, 31, 5, 17, 32, 9, 1, 28)  # each pads to 32 rows: 4 per 128-row call
    prompts = _prompts(lens, offset=3)
    n0 = len(runner.step_log)
    outs = _generate(llm, prompts, dict(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(src, p["prompt_token_ids"], 8)
    prefills = [s for s in list(runner.step_log)[n0:] if s.phase == "prefill"]
    calls = [c for s in prefills for c in s.calls]
    # 8 chunks of <= 32 tokens: two calls of the 128 bucket, 4 sequences of 32 rows each
    assert sorted(map(tuple, calls)) == [(128, 32, 4), (128, 32, 4)], calls
    for s in prefills:
        assert_prefill_calls(s, PREFILL)


def test_unwarmed_or_unbucketed_shapes_are_refused(engine):
    import torch
    _, _, runner, _ = engine
    m = runner.mesh_model
    pt = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="padded to a bucket"):
        m.prefill_forward(torch.zeros(1, 40, dtype=torch.long), pt, runner.kv, [40], [0])
    m.warmed.discard(("prefill", 32))
    try:
        with pytest.raises(RuntimeError, match="refusing to capture a trace while serving"):
            m.prefill_forward(torch.zeros(1, 32, dtype=torch.long), pt, runner.kv, [32], [0])
    finally:
        m.warmed.add(("prefill", 32))


def test_host_fallback_is_chosen_per_batch(engine):
    llm, _, runner, src = engine
    prompts = _prompts((9, 17))
    n0 = len(runner.step_log)
    outs = _generate(llm, prompts, dict(max_tokens=6, temperature=0, ignore_eos=True))
    dev = [s.sampling for s in list(runner.step_log)[n0:] if s.sampling != "none"]
    assert dev and set(dev) == {"device"}
    n1 = len(runner.step_log)
    outs2 = _generate(llm, prompts, [dict(max_tokens=6, temperature=0, ignore_eos=True),
                                     dict(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)])
    host = [s.sampling for s in list(runner.step_log)[n1:] if s.sampling != "none"]
    assert "host" in host
    # same greedy tokens either way; logprobs came back from vLLM's sampler
    for a, b, p in zip(outs, outs2, prompts):
        ref = hf_greedy(src, p["prompt_token_ids"], 6)
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids) == ref
    lp = outs2[1].outputs[0].logprobs
    assert len(lp) == 6 and all(len(step) >= 3 for step in lp)


@pytest.mark.parametrize("extra", [{}, {"min_p": 0.05}], ids=["device", "host"])
def test_seeded_sampling_is_reproducible_whatever_the_batch(engine, extra):
    llm, *_ = engine
    p = dict(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True, **extra)
    prompt = _prompts((12,))
    alone = _generate(llm, prompt, p)[0].outputs[0].token_ids
    again = _generate(llm, prompt, p)[0].outputs[0].token_ids
    crowd = _generate(llm, _prompts((30, 12, 50), offset=3)[:1] + prompt,
                      [dict(max_tokens=10, temperature=1.0, ignore_eos=True), p])[1].outputs[0].token_ids
    other = _generate(llm, prompt, dict(p, seed=99))[0].outputs[0].token_ids
    assert list(alone) == list(again) == list(crowd)
    assert list(other) != list(alone)


def test_structured_output_runs_on_the_host(engine):
    from vllm.sampling_params import StructuredOutputsParams
    llm, _, runner, _ = engine
    n0 = len(runner.step_log)
    out = _generate(llm, _prompts((8,)), dict(max_tokens=4, temperature=0,
                                              structured_outputs=StructuredOutputsParams(choice=["beza", "daso"])))
    assert out[0].outputs[0].text.strip() in ("beza", "daso")  # the word-level detokenizer adds a space
    assert "host" in [s.sampling for s in list(runner.step_log)[n0:]]


# ---- configuration refused before anything loads ---------------------------------------------------
@pytest.mark.parametrize("kwargs, env, needle", [
    ({"tensor_parallel_size": 2}, {}, "-tp/--tensor-parallel-size 2 is not supported: the mesh replaces it"),
    ({"additional_config": {"tt": {"trace_mod": "all"}}}, {}, "tt.trace_mod: unknown option; did you mean `trace_mode`?"),
    ({"block_size": 16}, {}, "--block-size 16: the package's KV cache uses blocks of 32 tokens"),
    ({"dtype": "float16"}, {}, "--dtype float16 is not supported"),
    ({}, {"MESH_DEVICE": "T3K"}, "MESH_DEVICE=T3K but package tiny-llama was built for N150"),
    ({}, {"MESH_DEVICE": "(1,8)"}, "MESH_DEVICE=(1,8) but package tiny-llama was built for N150"),
])
def test_engine_config_refusals(make_package, monkeypatch, kwargs, env, needle):
    from vllm.engine.arg_utils import EngineArgs

    pkg, _ = make_package("llama", "N150")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(Exception) as e:
        EngineArgs(model=str(pkg), **{"dtype": "float32", **kwargs}).create_engine_config()
    assert needle in str(e.value)


def test_mesh_device_as_a_shape_matches_the_package(make_package, monkeypatch):
    """Tenstorrent's command lines give MESH_DEVICE as a shape: "(1,1)" is the N150 package."""
    from vllm.engine.arg_utils import EngineArgs

    pkg, _ = make_package("llama", "N150")
    monkeypatch.setenv("MESH_DEVICE", "(1,1)")
    cfg = EngineArgs(model=str(pkg), dtype="float32").create_engine_config()
    assert cfg.parallel_config.worker_cls == "ttbundle.runtime.worker.TTWorker"


def test_engine_config_caps_limits_to_the_package(make_package):
    from vllm.engine.arg_utils import EngineArgs

    pkg, _ = make_package("llama", "N150")
    cfg = EngineArgs(model=str(pkg), dtype="float32", max_num_seqs=256).create_engine_config()
    assert cfg.model_config.max_model_len == 256 and cfg.scheduler_config.max_num_seqs == 32
    assert cfg.cache_config.block_size == 32 and cfg.cache_config.enable_prefix_caching  # vLLM's default kept
    off = EngineArgs(model=str(pkg), dtype="float32", enable_prefix_caching=False).create_engine_config()
    assert not off.cache_config.enable_prefix_caching  # and the user's --no-enable-prefix-caching too
    # vLLM's async scheduling (its default) kept, over the phase rules; --no-async-scheduling kept too
    assert cfg.scheduler_config.async_scheduling
    assert cfg.scheduler_config.scheduler_cls == "ttbundle.runtime.scheduler.AsyncPhaseScheduler"
    sync = EngineArgs(model=str(pkg), dtype="float32", async_scheduling=False).create_engine_config()
    assert not sync.scheduler_config.async_scheduling
    assert sync.scheduler_config.scheduler_cls == "ttbundle.runtime.scheduler.PhaseScheduler"
    assert cfg.parallel_config.worker_cls == "ttbundle.runtime.worker.TTWorker"
    assert cfg.model_config.hf_config.architectures == ["TTLlamaForCausalLM"]


def test_prefix_caching_reuses_blocks_and_keeps_tokens_exact(engine):
    """Two prompts that share their first 5 KV blocks: the second request's prefill starts after
    the shared blocks (vLLM's prefix cache handed them over), and its greedy tokens still equal
    transformers' — the reused KV is the right KV."""
    llm, sched, runner, src = engine
    block = runner.block_size
    shared = [(3 + 11 * i) % 480 + 9 for i in range(5 * block)]
    a = shared + [17, 18, 19, 20, 21, 22, 23]
    b = shared + [301, 302, 303]
    n0 = len(runner.step_log)
    (oa,) = _generate(llm, [{"prompt_token_ids": a}], dict(max_tokens=6, temperature=0, ignore_eos=True))
    n1 = len(runner.step_log)
    (ob,) = _generate(llm, [{"prompt_token_ids": b}], dict(max_tokens=6, temperature=0, ignore_eos=True))
    first_a = [s for s in list(runner.step_log)[n0:n1] if s.phase == "prefill"][0]
    first_b = [s for s in list(runner.step_log)[n1:] if s.phase == "prefill"][0]
    assert first_a.rows[0][1] == 0
    assert first_b.rows[0][1] == 5 * block, first_b.rows  # started after the 5 shared blocks
    assert list(oa.outputs[0].token_ids) == hf_greedy(src, a, 6)
    assert list(ob.outputs[0].token_ids) == hf_greedy(src, b, 6)


def test_engine_config_refuses_a_bad_tt_environment(make_package, monkeypatch):
    """Tenstorrent's variables are checked at start-up, naming the variable and what is valid."""
    from vllm.engine.arg_utils import EngineArgs

    pkg, _ = make_package("llama", "N150")
    monkeypatch.setenv("TT_VISIBLE_DEVICES", "0,x")
    with pytest.raises(Exception, match="TT_VISIBLE_DEVICES='0,x': must be comma-separated device ids"):
        EngineArgs(model=str(pkg), dtype="float32").create_engine_config()
    monkeypatch.setenv("TT_VISIBLE_DEVICES", "0")
    cfg = EngineArgs(model=str(pkg), dtype="float32",
                     additional_config={"tt": {"rank_binding": "rb.yaml"}}).create_engine_config()
    assert cfg.parallel_config.worker_cls == "ttbundle.runtime.worker.TTWorker"


def test_prompt_logprobs_match_transformers_log_softmax(engine):
    """prompt_logprobs on the host path (vLLM's own computation on the mesh's logits): each
    prompt token's logprob and rank, and the top 3, against transformers' log-softmax of the
    prompt's logits. 150 tokens: three prefill chunks of 64, 64, 22."""
    import torch

    from runtime_helpers import hf_model
    llm, _, runner, src = engine
    prompts = _prompts((150, 6), offset=5)
    n0 = len(runner.step_log)
    outs = _generate(llm, prompts, [dict(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3),
                                    dict(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=0)])
    assert "host" in [s.sampling for s in list(runner.step_log)[n0:]]
    m = hf_model(str(src))
    for p, o, k in zip(prompts, outs, (3, 0)):
        ids = p["prompt_token_ids"]
        with torch.no_grad():
            ref = m(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        got = o.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None
        for i in range(1, len(ids)):
            want = ref[i - 1]
            entry = got[i]
            tok = ids[i]
            assert abs(entry[tok].logprob - float(want[tok])) < 2e-2, (i, entry[tok], float(want[tok]))
            tol = 2e-2  # bf16 KV cache storage against transformers' fp32
            lo, hi = (int((want > want[tok] + d).sum()) + 1 for d in (tol, -tol))
            assert lo <= entry[tok].rank <= hi, (i, entry[tok].rank, lo, hi)
            top = {t for t, lp in entry.items() if lp.rank <= k}
            assert len(top) == k and len(entry) in (k, k + 1)
            if k:  # the top k are transformers' top k (up to near ties)
                kth = float(want.topk(k).values[-1])
                assert all(float(want[t]) >= kth - tol for t in top), (i, top)
        assert list(o.outputs[0].token_ids) == hf_greedy(src, ids, 3)


def test_top_k_beyond_the_device_bound_samples_on_the_host(engine, monkeypatch):
    """With a device bound of 4 candidates (Tenstorrent's ttnn.sampling has 32), stochastic rows
    without top_k or with top_k above the bound sample on the host from the whole distribution:
    over many seeds their first tokens take more than 4 values, which truncation to the top 4
    could never give; rows within the bound stay on the device and keep to 4 values."""
    llm, _, runner, _ = engine
    monkeypatch.setattr(runner, "max_device_top_k", 4)
    prompt = _prompts((10,), offset=2) * 40

    def first_tokens(**kw):
        n0 = len(runner.step_log)
        outs = _generate(llm, prompt, [dict(max_tokens=1, temperature=2.0, seed=s, **kw) for s in range(40)])
        return {o.outputs[0].token_ids[0] for o in outs}, {s.sampling for s in list(runner.step_log)[n0:]}

    for kw in ({}, {"top_k": 50}):
        toks, where = first_tokens(**kw)
        assert where == {"host"} and len(toks) > 4, (kw, toks, where)
    toks, where = first_tokens(top_k=4)
    assert where == {"device"} and len(toks) <= 4

