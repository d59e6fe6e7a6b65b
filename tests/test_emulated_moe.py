"""DeepSeek-V3, GPT-OSS, Qwen3 MoE and Qwen2 MoE on the emulated mesh against Hugging Face transformers: greedy tokens
and every token's expert choice in fp32, the bf16 PCC bound, the MLA latent cache, the routing and
expert kernels against HF's own modules, and a dropped expert all-reduce caught."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pkg_mutations import drop_first, edit_programs  # noqa: E402
from test_emulated import COMMON, MESHES  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe as hf_q2  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_q3  # noqa: E402

from ttbundle import reference, spec
from ttbundle.plan.make import make_plan
from ttbundle.backends.emulated import moe_kernels  # noqa: E402
from ttbundle.backends.emulated.kernel_table import KERNELS  # noqa: E402
from ttbundle.backends.emulated.kernels import Ctx  # noqa: E402
from ttbundle.check import EXEC_BOUNDS, run_check  # noqa: E402
from ttbundle.check.verdict import FLIP_BOUND_BF16  # noqa: E402
from ttbundle.families import moe  # noqa: E402

# Tiny configs whose dims divide N150, N300, T3K and TG (8x4): hidden 64, 8 heads, 8 experts,
# vocab 512. DeepSeek: a dense first layer, q and KV low-rank, yarn with mscale, 4 groups of 2
# experts (top-2 groups, top-2 experts). GPT-OSS: sliding/full layers (window 16 < the prompt),
# YaRN, SwiGLU limit 1.0 so that the clamps act on random weights. Qwen3 MoE: a dense first layer
# (mlp_only_layers), q/k norm, top-2 of 8 experts renormalized. Qwen2 MoE: q/k/v biases, top-2 not
# renormalized, a sigmoid-gated shared expert.
TINY = {
    "deepseek_v3": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, max_position_embeddings=1024,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    "gpt_oss": dict(
        vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
        swiglu_limit=1.0, max_position_embeddings=1024,
        rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=128, beta_fast=32,
                          beta_slow=1, truncate=False)),
    "qwen3_moe": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=1024, rope_theta=1e6),
    "qwen2_moe": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024, rope_theta=1e6),
}
# The default plan splits experts over all devices (32 on TG); 8 experts go over TG's 8 rows
# instead (replicated over cols: the Combine's partial sum is reduced over rows only).
EXPERTS_ON_ROWS = {
    "deepseek_v3": ("experts_w1", "experts_w3", "experts_w2"),
    "gpt_oss": ("experts_w13", "experts_w2", "experts_b13", "experts_b2"),
    "qwen3_moe": ("experts_w1", "experts_w3", "experts_w2"),
    "qwen2_moe": ("experts_w1", "experts_w3", "experts_w2"),
}
FAMILIES = sorted(TINY)
ROUTERS = {"deepseek_v3": (hf_ds.DeepseekV3TopkRouter, "group_topk"),
           "gpt_oss": (hf_oss.GptOssTopKRouter, "topk_softmax"),
           "qwen3_moe": (hf_q3.Qwen3MoeTopKRouter, "softmax_topk"),
           "qwen2_moe": (hf_q2.Qwen2MoeTopKRouter, "softmax_topk")}
EXPERTS = {"deepseek_v3": "n_routed_experts", "gpt_oss": "num_local_experts", "qwen3_moe": "num_experts",
           "qwen2_moe": "num_experts"}


def tiny(family: str, model: dict | None = None, default_plan: bool = False):
    """The tiny bundle of ``family`` (``model`` overrides its dims; None = null); experts over
    TG's rows unless ``default_plan``."""
    doc = {"name": f"tiny-{family}", "model": {"family": family, **TINY[family], **(model or {})},
           **yaml.safe_load(COMMON)}
    if not default_plan:
        doc["sharding"] = {"targets": {"TG": {n: ["rows"] + [None] * (1 if n.endswith(("b13", "b2")) else 2)
                                              for n in EXPERTS_ON_ROWS[family]}}}
    return spec.loads(yaml.safe_dump(doc), f"tiny-{family}.yaml")


# ---- every token's expert choice on both sides --------------------------------------------------
@pytest.fixture
def routing(monkeypatch):
    """Records the experts each token uses: HF's router modules (top-k indices) and the emulated
    router kernel (nonzero weights of device 0's ``route``). Returns ``install(family)``."""
    rec: dict = {"hf": [], "emu": []}

    def install(family):
        cls, kernel = ROUTERS[family]
        hf_forward, emu_kernel = cls.forward, KERNELS[kernel]

        def forward(self, x):
            out = hf_forward(self, x)
            rec["hf"].append([set(row) for row in out[2].tolist()])
            return out

        def emu(ctx, layer, scores):
            route = emu_kernel(ctx, layer, scores)
            rec["emu"].append([set(torch.nonzero(row).flatten().tolist()) for row in route[0]])
            return route

        monkeypatch.setattr(cls, "forward", forward)
        monkeypatch.setitem(KERNELS, kernel, emu)
        return rec

    return install


def moe_layers(bundle) -> list[int]:
    """Indices of the layers with routed experts (their program computes ``ea``)."""
    out, start = [], 0
    for k in bundle.family.layers(bundle.arch):
        if "ea" in {getattr(o, "out", "") for o in k.ops}:
            out += list(range(start, start + k.count))
        start += k.count
    return out


def expert_sets(rec, bundle, report) -> tuple[list, list]:
    """Both sides' choices as [step][moe layer][token] -> set of experts. The check runs layer
    by layer: each side routes an MoE layer once per call of its own (transformers: its
    prompt chunks, the emulated mesh: the package's prefill chunks; then each decode step)
    before the next layer; bucket padding dropped."""
    n = len(moe_layers(bundle))
    chunk = bundle.buckets.prefill_chunk
    P = report.prompt_len
    rows = [min(chunk, P - c) for c in range(0, P, chunk)] + [1] * (report.steps - 1)
    # per layer: the expected side's calls (the side the executor verdict compares), then the
    # original checkpoint's (the same numbers here: bf16 storage)
    per = len(rec["hf"]) // (2 * n)
    hf = [sum(rec["hf"][i:i + per], []) for i in range(0, len(rec["hf"]), 2 * per)]
    per_layer = [rec["emu"][i:i + len(rows)] for i in range(0, len(rec["emu"]), len(rows))]
    emu = [sum((call[:k] for call, k in zip(calls, rows)), []) for calls in per_layer]
    assert len(hf) == len(emu) == n and all(len(x) == P + report.steps - 1 for x in hf + emu)

    def by_step(layers):
        return [[x[:P] for x in layers]] + [[x[P + i - 1:P + i] for x in layers] for i in range(1, report.steps)]
    return by_step(hf), by_step(emu)


# ---- whole models vs transformers ---------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mesh", MESHES)
def test_fp32_greedy_tokens_and_expert_choices_identical_to_hf(family, mesh, routing):
    rec = routing(family)
    b = tiny(family)
    r = run_check(b, mesh, steps=32, dtype="fp32", random_weights=True, seed=3)
    assert r.tokens_agree, (r.first_token_divergence, r.diverging())
    assert len(set(r.ref_tokens)) > 8  # the random model is not degenerate
    assert all(s.pcc > 0.99999 for s in r.layers), r.diverging()
    assert ("prefill", 64) in r.shapes_run and ("decode", 1) in r.shapes_run
    hf, emu = expert_sets(rec, b, r)
    assert hf == emu  # every token, every MoE layer, prefill and all 31 decode steps
    experts = getattr(b.arch, EXPERTS[family])
    for li in range(len(hf[0])):  # the routing varies: most experts see tokens in every layer
        used = set().union(*hf[0][li], *(step[li][0] for step in hf[1:]))
        assert len(used) >= experts - 2, (li, used)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_expert_parallel_plan_on_tg(family, routing):
    # 32 experts: one per TG device under the family's default plan (experts over rows x cols)
    rec = routing(family)
    model = {"n_routed_experts": 32, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 4} \
        if family == "deepseek_v3" else {EXPERTS[family]: 32, "num_experts_per_tok": 4}
    b = tiny(family, model, default_plan=True)
    p = make_plan(b, "TG")
    assert all(t.device_shape[0] == 1 for t in p.tensors if t.group == "experts")
    r = run_check(b, "TG", steps=8, dtype="fp32", random_weights=True, seed=3)
    assert r.tokens_agree and all(s.pcc > 0.99999 for s in r.layers), r.diverging()
    hf, emu = expert_sets(rec, b, r)
    assert hf == emu


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mesh", MESHES)
def test_bf16_pcc_bound_wherever_the_routing_agrees(family, mesh, routing):
    """bf16: every stage within the executor's bf16 bound, the positions a router near-tie sent
    to other experts on the two sides (on the same input: judged locally) set apart in their own
    layer's stage and held to FLIP_BOUND_BF16 there; no other stage or position is excused.
    Flips are rare."""
    rec = routing(family)
    b = tiny(family)
    r = run_check(b, mesh, steps=8, dtype="bf16", random_weights=True, seed=4)
    hf, emu = expert_sets(rec, b, r)
    layers = moe_layers(b)
    flips = {(si, layers[li]) for si in range(len(hf)) for li in range(len(layers)) if hf[si][li] != emu[si][li]}
    choices = sum(len(x) for step in hf for x in step)
    flipped = sum(a != e for hs, es in zip(hf, emu) for h, em in zip(hs, es) for a, e in zip(h, em))
    assert flipped <= 0.1 * choices, (flipped, choices)
    labels = ["prefill"] + [f"decode {i}" for i in range(1, r.steps)]
    for s in r.layers:  # the flipped positions are judged apart, in their own layer only
        assert s.err <= EXEC_BOUNDS["bf16"] if s.stage == "layer" else True, s
        if s.flipped:
            assert s.stage == "layer" and (labels.index(s.step), s.layer) in flips, (s, sorted(flips))
            assert s.flip_err <= FLIP_BOUND_BF16, s
    # the report applies the same rule itself, from choices it recorded on its own
    assert r.routing["choices"] == choices and r.routing["flipped"] == flipped
    assert {(labels.index(st), li) for st, li in r.routing["flips"]} == flips
    assert r.executor.passed, r.executor.failure(r.step_of)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_routing_rule_still_fails_a_real_bug(family):
    """A dropped expert all-reduce in bf16 is not excused as routing flips: the check fails and
    names the first MoE layer of the prefill."""
    b = tiny(family)
    kind = b.family.layers(b.arch)[-1].name
    hook = lambda pkg: edit_programs(pkg, kind, drop_first(  # noqa: E731
        lambda s: s.get("collective") == "all_reduce" and s["act"] == "moe_out"))
    r = run_check(b, "T3K", steps=4, dtype="bf16", random_weights=True, package_hook=hook)
    assert not r.passed
    d = r.diverging()
    assert d is not None and (d.step, d.layer) == ("prefill", moe_layers(b)[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_dropped_expert_all_reduce_is_caught(family):
    # the Combine leaves each device with its own experts' share; without the reduce it is wrong
    b = tiny(family)
    kind = b.family.layers(b.arch)[-1].name
    hook = lambda pkg: edit_programs(pkg, kind, drop_first(  # noqa: E731
        lambda s: s.get("collective") == "all_reduce" and s["act"] == "moe_out"))
    r = run_check(b, "T3K", steps=4, random_weights=True, package_hook=hook)
    assert not r.passed
    d = r.diverging()
    assert (d.step, d.layer) == ("prefill", moe_layers(b)[0]) and d.err > EXEC_BOUNDS["fp32"]


def test_deepseek_full_rank_query_no_dense_layer_plain_rope():
    b = tiny("deepseek_v3", {"q_lora_rank": None, "first_k_dense_replace": 0, "rope_interleave": False,
                             "rope_scaling": None, "norm_topk_prob": False, "routed_scaling_factor": 1.5,
                             "n_group": 1, "topk_group": 1})
    assert [k.name for k in b.family.layers(b.arch)] == ["moe"]
    for mesh in ("T3K", "TG"):
        r = run_check(b, mesh, steps=8, random_weights=True, seed=5)
        assert r.tokens_agree and all(s.pcc > 0.99999 for s in r.layers), (mesh, r.diverging())


# ---- MLA: the latent cache --------------------------------------------------------------------------
def test_mla_caches_one_latent_and_rope_key_per_token_on_every_device():
    b = tiny("deepseek_v3")
    p = make_plan(b, "T3K")
    (entry,) = p.kv["entries"]
    a = b.arch
    assert entry["name"] == moe_kernels.LATENT_CACHE
    assert entry["device_shape"][1:] == [1, b.spec.runtime.kv_block_size, a.kv_lora_rank + a.qk_rope_head_dim]
    # the attention program reads no per-head K/V activations: only the query and the latent
    steps = next(s for kind, _, s in p.programs if kind == "moe")
    mla = next(s for s in steps if s.kind == "op" and getattr(s.op, "fn", "") == "mla_attention")
    assert mla.op.ins == ("q", "kvn")


def test_mla_absorbed_decode_equals_expanded_prefill():
    """Decode attends in latent space (W_UK folded into the query, W_UV into the output); prefill
    expands per-head keys and values. Same cache, same query: the same output."""
    torch.manual_seed(0)
    D, H, r, nope, rope, vd, S = 2, 3, 8, 6, 4, 5, 7
    traits = {"mla": {"kv_lora_rank": r, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
                      "v_head_dim": vd, "rope_interleave": True}}
    w = {"wkv_b": torch.randn(D, r, H * (nope + vd), dtype=torch.float64)}
    cache = torch.zeros(D, 1, 16, r + rope, dtype=torch.float64)  # [D, heads, slots, dim]
    kvn = torch.randn(D, S, r + rope, dtype=torch.float64)
    q = torch.randn(D, S, H * (nope + rope), dtype=torch.float64)

    def ctx(pos):
        pos = torch.as_tensor(pos)
        return Ctx(None, traits, [{"rope_theta": 10000.0}], lambda n, layer: w.get(n), pos, torch.ones_like(pos, dtype=torch.bool),
                   pos.reshape(-1), torch.arange(int(pos.max()) + 1)[None], [{"kv_latent": cache}], torch.float64)

    full = moe_kernels.mla_attention(ctx(torch.arange(S)[None]), 0, q, kvn)  # prefill of S tokens
    last = moe_kernels.mla_attention(ctx([[S - 1]]), 0, q[:, -1:], kvn[:, -1:])  # decode of the last
    torch.testing.assert_close(last, full[:, -1:])


# ---- routing and expert kernels against HF's modules ----------------------------------------------
def _ctx(traits, weights):
    return Ctx(None, traits, [{}], lambda n, layer: weights.get(n), None, None, None, None, None, torch.float32)


def test_group_topk_matches_hf_router():
    torch.manual_seed(0)
    b = tiny("deepseek_v3", {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3})
    cfg = reference.hf_config(b)
    router = hf_ds.DeepseekV3TopkRouter(cfg)
    x = torch.randn(50, cfg.hidden_size)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.5)  # large: it moves the selection
        _, w, idx = router(x)
    ref = torch.zeros(50, 16).scatter(1, idx, w)
    traits = b.family.traits(b.arch)
    ours = moe_kernels.group_topk(_ctx(traits, {"e_score_correction_bias": router.e_score_correction_bias[None]}),
                                  0, (x @ router.weight.T)[None])
    torch.testing.assert_close(ours[0], ref)
    plain = moe_kernels.group_topk(_ctx(traits, {"e_score_correction_bias": torch.zeros(1, 16)}),
                                   0, (x @ router.weight.T)[None])
    assert not torch.equal((plain[0] > 0), (ref > 0))  # the bias changed some choices


def test_topk_softmax_and_clamped_swiglu_match_hf():
    torch.manual_seed(0)
    b = tiny("gpt_oss")
    cfg = reference.hf_config(b)
    router, experts = hf_oss.GptOssTopKRouter(cfg), hf_oss.GptOssExperts(cfg)
    x = torch.randn(40, cfg.hidden_size)
    with torch.no_grad():
        router.weight.normal_(), router.bias.normal_()
        _, w, idx = router(x)
    traits = b.family.traits(b.arch)
    ours = moe_kernels.topk_softmax(_ctx(traits, {"router_bias": router.bias[None]}), 0, (x @ router.weight.T)[None])
    torch.testing.assert_close(ours[0], torch.zeros(40, cfg.num_local_experts).scatter(1, idx, w))
    gu = 3 * torch.randn(40, 2 * cfg.intermediate_size)  # interleaved g0, u0, g1, u1, ...
    bias = torch.randn(2 * cfg.intermediate_size)
    ref = experts._apply_gate(gu + bias)
    ctx = _ctx(traits, {"experts_b13": moe.gate_up_deinterleave([bias], None)[None, None]})
    ours = moe_kernels.clamped_swiglu(ctx, 0, moe.gate_up_deinterleave([gu], None)[None, :, None])
    torch.testing.assert_close(ours[0, :, 0], ref)
    assert (gu.abs() > cfg.swiglu_limit).any()  # the clamps were exercised


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_check_bf16_reports_expert_choices(family, tmp_path, runner):
    import json

    from ttbundle.cli import app
    b = tiny(family)
    path = tmp_path / f"{family}.yaml"
    path.write_text(yaml.safe_dump(b.spec.model_dump(mode="json", exclude_none=True)))
    res = runner.invoke(app, ["check", str(path), "--mesh", "T3K", "--dtype", "bf16", "--steps", "8",
                              "--random-weights", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    r = rep["executor"]["routing"]
    assert rep["passed"] and r["choices"] > 0 and r["flipped"] <= 0.1 * r["choices"]
    assert r["moe_layers"] == moe_layers(b)
    res = runner.invoke(app, ["check", str(path), "--mesh", "T3K", "--dtype", "bf16", "--steps", "4",
                              "--random-weights"])
    assert res.exit_code == 0 and "expert choices:" in res.output, res.output


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_matches_hf_router(norm, dtype):
    """Qwen3 MoE routing against HF's own router module: the chosen experts and their weights
    (softmax over every expert in fp32, top-k, renormalized or not, in the logits' dtype)."""
    torch.manual_seed(0)
    b = tiny("qwen3_moe", {"norm_topk_prob": norm, "num_experts_per_tok": 3})
    cfg = reference.hf_config(b)
    router = hf_q3.Qwen3MoeTopKRouter(cfg).to(dtype)
    x = torch.randn(50, cfg.hidden_size, dtype=dtype)
    with torch.no_grad():
        router.weight.normal_()
        logits, w, idx = router(x)
    ref = torch.zeros(50, 8).scatter(1, idx, w.float())
    ours = moe_kernels.softmax_topk(_ctx(b.family.traits(b.arch), {}), 0, logits[None])
    torch.testing.assert_close(ours[0], ref, rtol=0, atol=0)
    assert torch.allclose(ours[0].sum(-1), torch.ones(50), atol=1e-2) == norm  # renormalized or not
