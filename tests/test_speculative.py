"""Speculative decoding without an engine: the spec's `speculative:` rules (located errors), the
verify programs it adds to the plan and the package's trace set, the n-gram proposer against
vLLM's own function, and the acceptance rule keeping the target distribution (a statistical
test over many seeds against sampling without speculation)."""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest
import torch

from spec_helpers import SPEC_FILE, line_of, spec_text
from ttbundle import lower as lowermod, speculative
from ttbundle.plan.make import make_plan

NGRAM = {"speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3}}


def one(diags):
    assert len(diags) == 1, "\n".join(map(str, diags))
    return diags[0]


# ---- the spec -------------------------------------------------------------------------------------
def test_ngram_spec_loads_and_gives_vllms_config(load):
    b = load(spec_text(NGRAM))
    assert speculative.vllm_config(b) == {"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert speculative.vllm_config(load(spec_text())) is None


def test_k_beyond_what_a_bucket_holds_is_located_with_the_arithmetic(diagnostics):
    # decode bucket 32 x (k + 1) rows against the step budget (largest prefill bucket 512): k <= 15
    text = spec_text({"speculative": {"num_speculative_tokens": 16}})
    d = one(diagnostics(text))
    assert d.path == "speculative.num_speculative_tokens" and d.file == SPEC_FILE
    assert d.line == line_of(text, "num_speculative_tokens: 16")
    assert "32 x (16 + 1) = 544 rows" in d.message and "use at most 15" in d.message
    load_ok = spec_text({"speculative": {"num_speculative_tokens": 15}})
    from ttbundle import spec
    spec.loads(load_ok, SPEC_FILE)


@pytest.mark.parametrize("changes, path, words", [
    ({"speculative": {"method": "draft", "model": "other.yaml"}}, "speculative.model", "no such spec file"),
    ({"speculative": {"model": "other.yaml"}}, "speculative.model", "method: draft"),
    ({"speculative": {"prompt_lookup_min": 4, "prompt_lookup_max": 2}}, "speculative.prompt_lookup_min",
     "prompt_lookup_min=4 is above prompt_lookup_max=2"),
    ({"speculative": {"method": "eagle"}}, "speculative.method", "ngram"),
    ({"speculative": {"num_speculative_tokens": 0}}, "speculative.num_speculative_tokens", "greater than 0"),
])
def test_speculative_mistakes_are_located(diagnostics, changes, path, words):
    d = one(diagnostics(spec_text(changes)))
    assert d.path == path and words in d.message, str(d)


# ---- plan and programs ------------------------------------------------------------------------------
def test_verify_programs_hold_k_plus_one_rows_per_sequence_and_their_memory(load):
    b, plain = load(spec_text(NGRAM)), load(spec_text())
    ts = lowermod.trace_set(b)
    assert [k for k in ts if k[0] == "verify"] == [("verify", n) for n in b.buckets.decode]
    assert [k for k in ts if k[0] != "verify"] == lowermod.trace_set(plain)
    p, p0 = make_plan(b, "N150"), make_plan(plain, "N150")
    for n in b.buckets.decode:
        prog = lowermod.lower(b, p, "verify", n)
        assert prog.rows == -(-n * 4 // 32) * 32  # n x (3 + 1) rows, whole tiles
        head = next(lp for lp in prog.layers if lp.kind == "head")
        assert all(st.ins[0].shape[0] == prog.rows for st in head.steps if st.ins)  # every row's logits
        # the decode program of the same bucket is untouched
        assert lowermod.lower(b, p, "decode", n).to_json() == lowermod.lower(plain, p0, "decode", n).to_json()
    # the verify logits of the largest bucket (128 rows) and the verify traces are charged
    assert p.memory.activations > p0.memory.activations
    # the trace region the plan reserves holds every traced program's, the verify ones included
    progs = [lowermod.lower(b, p, *k) for k in ts]
    assert all(pr.traced and pr.trace_region_bytes > 0 for pr in progs if pr.phase == "verify")
    assert sum(pr.trace_region_bytes for pr in progs) <= p.trace_region_size
    assert sum(pr.trace_region_bytes for pr in progs if pr.phase != "verify") * 1.5 < \
        sum(pr.trace_region_bytes for pr in progs)


# ---- the proposer against vLLM's ------------------------------------------------------------------
def _vllm_ngram():
    """vLLM 0.33's ``_find_longest_matched_ngram_and_propose_tokens``, its Python body: numba
    (which CPU vLLM does not install) stood in for by identity decorators while it imports."""
    shim = types.ModuleType("numba")
    shim.jit = shim.njit = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
    shim.prange = range
    shim.get_num_threads = lambda: 1
    shim.set_num_threads = lambda n: None
    saved = sys.modules.get("numba")
    sys.modules["numba"] = shim
    try:
        sys.modules.pop("vllm.v1.spec_decode.ngram_proposer", None)
        mod = importlib.import_module("vllm.v1.spec_decode.ngram_proposer")
    finally:
        if saved is None:
            sys.modules.pop("numba", None)
        else:
            sys.modules["numba"] = saved
        sys.modules.pop("vllm.v1.spec_decode.ngram_proposer", None)
    return mod._find_longest_matched_ngram_and_propose_tokens


def test_ngram_proposals_are_vllms():
    pytest.importorskip("vllm")
    from ttbundle.runtime.speculation import propose_ngram

    ref = _vllm_ngram()
    rng = np.random.default_rng(0)
    nonempty = 0
    for case in range(1500):
        n = int(rng.integers(0, 40))
        vocab = int(rng.integers(2, 8))
        toks = rng.integers(0, vocab, size=n).astype(np.int32)
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        max_len = n + int(rng.integers(0, 6))
        want = ref(toks, lo, hi, max_len, k).tolist()
        got = propose_ngram(toks, lo, hi, k, max_len)
        assert got == want, (toks.tolist(), lo, hi, k, max_len)
        nonempty += bool(want)
    assert nonempty > 500  # the cases exercise matches, not just empty proposals


# ---- acceptance -------------------------------------------------------------------------------------
def _pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit (cells with expected count >= 5; the rest pooled)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    keep = e > 0
    stat = float(((obs[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _batch(n: int, temperature: float, top_k: int = 0, top_p: float = 1.0, seed0: int = 0):
    from ttbundle.runtime.sampling import DeviceSampling

    gens = [torch.Generator().manual_seed(seed0 + i) for i in range(n)]
    return DeviceSampling(torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.long),
                          torch.full((n,), top_p), gens)


def test_greedy_acceptance_is_the_argmax_prefix():
    from ttbundle.runtime.sampling import accept

    V = 16
    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(1))
    am = logits.argmax(-1)
    drafts = torch.stack([am[0, :3], torch.tensor([am[1, 0], (am[1, 1] + 1) % V, am[1, 2]]),
                          torch.tensor([-1, am[2, 1], am[2, 2]])])
    out = accept(logits, drafts, torch.tensor([3, 3, 3]), _batch(3, 0.0))
    assert out[0].tolist() == am[0].tolist()  # all accepted, then the bonus token
    assert out[1].tolist() == [int(am[1, 0]), int(am[1, 1]), -1, -1]  # the argmax replaces the miss
    assert out[2].tolist() == [int(am[2, 0]), -1, -1, -1]  # a voided proposal is never accepted
    short = accept(logits, drafts, torch.tensor([1, 0, 2]), _batch(3, 0.0))
    assert short[0].tolist() == [int(am[0, 0]), int(am[0, 1]), -1, -1]  # only the real proposals count
    assert short[1].tolist() == [int(am[1, 0]), -1, -1, -1]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_stochastic_acceptance_keeps_the_target_distribution(temperature, top_k, top_p):
    """Over 6000 seeds: the first token equals sampling without speculation in distribution
    (``sample_on_device`` on the same logits and the closed form), and the token after an
    accepted proposal follows the second row's distribution."""
    from ttbundle.runtime.sampling import accept, sample_on_device, target_probs

    N, V = 6000, 12
    g = torch.Generator().manual_seed(7)
    row = torch.randn(3, V, generator=g) * 1.5
    logits = row.expand(N, 3, V).contiguous()
    s = _batch(N, temperature, top_k, top_p)
    p = target_probs(row, _batch(3, temperature, top_k, top_p)).double().numpy()
    d0 = int(np.argsort(p[0])[-2])  # a likely, not the likeliest, proposal: accepted and rejected often
    d1 = int(np.argsort(p[1])[-1])
    drafts = torch.tensor([[d0, d1]]).expand(N, 2).contiguous()
    out = accept(logits, drafts, torch.full((N,), 2), s).numpy()
    first = np.bincount(out[:, 0], minlength=V)
    assert _pvalue(first, p[0]) > 1e-3
    plain = sample_on_device(logits[:, 0], _batch(N, temperature, top_k, top_p, seed0=10**6)).numpy()
    assert _pvalue(np.bincount(plain, minlength=V), p[0]) > 1e-3
    # two samples, one law: the acceptance's first tokens against sampling without speculation
    both = np.stack([first, np.bincount(plain, minlength=V)])
    pooled = both.sum(0) / both.sum()
    assert _pvalue(both[0], pooled) > 1e-4
    after = out[out[:, 0] == d0][:, 1]
    assert len(after) > 500
    assert _pvalue(np.bincount(after, minlength=V), p[1]) > 1e-3
    assert (out[:, 0] == d0).mean() == pytest.approx(p[0][d0], abs=0.03)  # accepted with p(d0)


def test_capabilities_declare_ngram_speculation_on_both_meshes(load):
    """n-gram speculation on the emulated mesh and on a device (the verify programs lowered to
    ttnn: tests/test_ttnn_verify_double.py, tests/runtime/test_runtime_tt_speculative.py)."""
    from ttbundle.package.facts import of_bundle
    from ttbundle.runtime.capabilities import model_capabilities

    b, plain = of_bundle(load(spec_text(NGRAM))), of_bundle(load(spec_text()))
    for device in (False, True):
        caps = model_capabilities(b, device=device)
        assert caps["supports_spec_decode"] is True and caps["spec_requirements"]["num_speculative_tokens"] == 3
        assert caps["spec_requirements"]["methods"] == ["ngram"]
        assert model_capabilities(plain, device=device)["supports_spec_decode"] is False
        assert model_capabilities(plain, device=device)["spec_requirements"] == {}


def test_the_platform_takes_ngram_on_a_device_and_refuses_a_draft_model_there(load, tmp_path):
    """``--speculative-config`` with ``--device tt``: n-gram is served (the verify programs are
    lowered to ttnn); ``draft_model`` is refused naming the way out (the draft runs beside the
    emulated mesh only), and a disagreeing k still names both."""
    from types import SimpleNamespace

    from ttbundle.runtime.platform import _configure_speculative

    b = load(spec_text(NGRAM))
    from ttbundle.package.facts import of_bundle
    pkg = SimpleNamespace(bundle=b, serving=of_bundle(b).serving, path=tmp_path, name="tiny", mesh_name="N150")

    def config(**kw):
        return SimpleNamespace(speculative_config=SimpleNamespace(**dict(NGRAM["speculative"], model=None, **kw)))
    _configure_speculative(config(), pkg, False)  # accepted on a device
    with pytest.raises(ValueError, match="num_speculative_tokens: given 2, package 3"):
        _configure_speculative(config(num_speculative_tokens=2), pkg, False)
    with pytest.raises(ValueError) as ei:
        _configure_speculative(config(method="draft_model"), pkg, False)
    assert "'draft_model' on a Tenstorrent device" in str(ei.value) and "emulated mesh" in str(ei.value)
