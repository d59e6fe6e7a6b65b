"""The emulated attention kernel (``kernels.attention``: KV cache held in the compute dtype,
rope in fewer passes, in-place score steps, index_copy_ writes) computes bit for bit what the
straightforward formula below does: write the new rows into a cache of the declared storage
dtype (bf16) slot by slot, read every sequence's context back slot by slot and convert it,
then scores = Q K^T (one matmul per device, KV head and sequence, as the kernel batches it),
scale, soft-cap, mask, sinks, softmax, P V. Random inputs over the variants the families use
(GQA, sliding windows, soft-capping, sinks, q/k norms with an offset, biases, M-RoPE, image
blocks), block tables interleaved as vLLM hands them out, decode and prefill shapes."""

from __future__ import annotations

import types

import pytest
import torch

from ttbundle.backends.emulated import kernels
from ttbundle.backends.emulated.kernels import Ctx
from ttbundle.backends.emulated.state import kv_store
from ttbundle.tables import mrope_cos_sin, rope_cos_sin

D, HD, BS = 2, 16, 4


def _rms(x, w, eps, offset):  # HF's RMSNorm in float32, scaled by (offset + w)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + w.float())).to(x.dtype) if offset else w * xf.to(x.dtype)


def _rotate(x, cos, sin):  # HF's rotate-half rope, x [D, T, heads, dim]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[None, :, None] + torch.cat([-x2, x1], dim=-1) * sin[None, :, None]


def reference(case, w, q, k, v, ref_cache):
    """The formula, with ``ref_cache`` {"k", "v"}: [D, kvh, slots, hd] in the storage dtype."""
    positions, slots, ctx_slots = case["positions"], case["slots"], case["ctx_slots"]
    N, Tq = positions.shape
    S = ctx_slots.shape[1]
    dt = q.dtype
    if "bq" in w:
        q, k, v = q + w["bq"][:, None], k + w["bk"][:, None], v + w["bv"][:, None]
    T = q.shape[1]
    q, k, v = q.view(D, T, -1, HD), k.view(D, T, -1, HD), v.view(D, T, -1, HD)
    if "q_norm" in w:
        q = _rms(q, w["q_norm"][:, None, None], 1e-6, case["offset"])
        k = _rms(k, w["k_norm"][:, None, None], 1e-6, case["offset"])
    if case["mrope"]:
        cos, sin = mrope_cos_sin(case["rope_positions"].reshape(3, -1), HD, 10000.0, None, [2, 3, 3], dt)
    else:
        cos, sin = rope_cos_sin(positions.reshape(-1), HD, 10000.0, None, dt)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    for t, s in enumerate(slots.tolist()):  # one slot at a time, rounded to the storage dtype
        if s >= 0:
            ref_cache["k"][:, :, s] = k[:, t].to(ref_cache["k"].dtype)
            ref_cache["v"][:, :, s] = v[:, t].to(ref_cache["v"].dtype)
    kvh = ref_cache["k"].shape[1]
    g = q.shape[2] // kvh
    K = torch.stack([ref_cache["k"][:, :, ctx_slots[n]] for n in range(N)], dim=2).to(dt)  # [D, kvh, N, S, hd]
    V = torch.stack([ref_cache["v"][:, :, ctx_slots[n]] for n in range(N)], dim=2).to(dt)
    kpos, qpos = torch.arange(S)[None, None], positions[:, :, None]
    allowed = kpos <= qpos
    if case["blocks"] is not None:
        kb = case["blocks"][:, :S]
        qb = kb.gather(1, positions.clamp(max=S - 1))
        allowed = allowed | ((qb[:, :, None] == kb[:, None]) & (qb[:, :, None] >= 0))
    if case["window"]:
        allowed = allowed & (kpos > qpos - case["window"])
    Q = q.view(D, N, Tq, kvh, g, HD).permute(0, 3, 1, 4, 2, 5).reshape(D, kvh, N, g * Tq, HD)
    scores = (Q @ K.transpose(-1, -2)).view(D, kvh, N, g, Tq, S) * case["scale"]
    if case["cap"]:
        scores = torch.tanh(scores / case["cap"]) * case["cap"]
    scores = scores.masked_fill(~allowed[None, None, :, None], float("-inf"))
    if "sinks" in w:
        sink = w["sinks"].view(D, kvh, 1, g, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        p = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1].to(dt)
    else:
        p = torch.softmax(scores.float(), dim=-1).to(dt)
    o = (p.reshape(D, kvh, N, g * Tq, S) @ V).view(D, kvh, N, g, Tq, HD).permute(0, 2, 4, 1, 3, 5)
    return o.reshape(D, T, -1)


def _tables(N: int, nblk: int, interleaved: bool):
    """Block tables as vLLM hands them out to N sequences growing together (interleaved) or one
    after another (runs of consecutive blocks); block 0 is never used (as vLLM reserves it)."""
    if interleaved:
        return torch.tensor([[1 + j * N + n for j in range(nblk)] for n in range(N)])
    return torch.tensor([[1 + n * nblk + j for j in range(nblk)] for n in range(N)])


def make_case(seed, *, N, Tq, start, heads=4, kvh=2, window=0, cap=None, sinks=False, norms=False,
              offset=0.0, bias=False, mrope=False, images=False, interleaved=True, scale=None,
              pad=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    positions = (torch.as_tensor(start)[:, None] + torch.arange(Tq)[None]).reshape(N, Tq)
    valid = torch.ones(N, Tq, dtype=torch.bool)
    if pad:  # a padded decode row (its slot -1: nothing written, its output ignored)
        valid[-1] = False
    S_needed = int(positions.max()) + 1
    nblk = -(-S_needed // BS)
    blocks = _tables(N, nblk, interleaved)
    slot = blocks.gather(1, positions // BS) * BS + positions % BS
    slots = torch.where(valid, slot, torch.full_like(slot, -1)).reshape(-1)
    ctx_slots = (blocks[:, :, None] * BS + torch.arange(BS)).reshape(N, -1)
    num_slots = (1 + N * nblk) * BS

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    w = {}
    if bias:
        w.update(bq=r(D, heads * HD), bk=r(D, kvh * HD), bv=r(D, kvh * HD))
    if norms:
        w.update(q_norm=r(D, HD, s=0.3), k_norm=r(D, HD, s=0.3))
    if sinks:
        w["sinks"] = r(D, heads)
    img = None
    if images:  # one image's soft tokens at positions 3..8 of every sequence
        img = torch.full((N, nblk * BS), -1)
        img[:, 3:9] = 0
    rope_positions = None
    if mrope:
        rope_positions = torch.stack([positions, positions // 3, positions % 5])
    history = r(D, kvh, num_slots, HD, s=2.0)  # what earlier steps wrote (bf16 values)
    return dict(seed=seed, positions=positions, valid=valid, slots=slots, ctx_slots=ctx_slots,
                blocks=img, context_blocks=blocks, window=window, cap=cap, mrope=mrope,
                rope_positions=rope_positions, offset=offset, heads=heads, kvh=kvh, dtype=dtype,
                scale=HD ** -0.5 if scale is None else scale, w=w,
                q=r(D, N * Tq, heads * HD, s=2.0), k=r(D, N * Tq, kvh * HD, s=2.0), v=r(D, N * Tq, kvh * HD),
                history=history.to(torch.bfloat16), mrope_traits=mrope)


def run_kernel(case):
    dt = case["dtype"]
    storage, store = kv_store("bf16", dt)
    cache = {"k": case["history"].to(storage), "v": case["history"].flip(-1).to(storage)}
    lt = {"rope_theta": 10000.0}
    if case["window"]:
        lt["window"] = case["window"]
    if case["cap"]:
        lt["attn_softcap"] = case["cap"]
    if case["scale"] != HD ** -0.5:
        lt["attn_scale"] = case["scale"]
    traits = {"norm_offset": case["offset"]}
    if case["mrope"]:
        traits["mrope_section"] = [2, 3, 3]
    w = case["w"]
    ctx = Ctx(None, traits, [lt], lambda name, layer: w.get(name), case["positions"], case["valid"],
              case["slots"], case["ctx_slots"], [cache], dt, store=store, blocks=case["blocks"],
              rope_positions=case["rope_positions"], dims=types.SimpleNamespace(head_dim=HD, rms_norm_eps=1e-6),
              context_blocks=case["context_blocks"], block_size=BS)
    return kernels.attention(ctx, 0, case["q"], case["k"], case["v"]), cache


CASES = {
    # decode: one token per sequence, contexts of different lengths, interleaved tables
    "decode": dict(N=5, Tq=1, start=[9, 17, 4, 30, 22]),
    "decode-gqa4-padded": dict(N=4, Tq=1, start=[12, 7, 25, 3], heads=8, kvh=2, pad=True),
    "decode-mha": dict(N=3, Tq=1, start=[5, 14, 9], heads=2, kvh=2),
    "decode-window-softcap-sinks": dict(N=4, Tq=1, start=[20, 11, 31, 6], window=8, cap=20.0, sinks=True),
    "decode-norms-offset-bias": dict(N=3, Tq=1, start=[13, 8, 19], norms=True, offset=1.0, bias=True,
                                     scale=0.11),
    "decode-norms": dict(N=2, Tq=1, start=[13, 8], norms=True),
    "decode-mrope": dict(N=3, Tq=1, start=[10, 21, 15], mrope=True),
    "decode-runs": dict(N=3, Tq=1, start=[10, 21, 15], interleaved=False),
    "decode-one": dict(N=1, Tq=1, start=[0]),
    # prefill: one sequence, from the start and a chunk after earlier context
    "prefill": dict(N=1, Tq=23, start=[0]),
    "prefill-chunk-window-sinks": dict(N=1, Tq=13, start=[10], window=6, sinks=True, cap=30.0),
    "prefill-images-mrope": dict(N=1, Tq=17, start=[0], images=True, mrope=True),
    "prefill-images-window-norms": dict(N=1, Tq=17, start=[0], images=True, window=5, norms=True, bias=True),
    "prefill-two-rows": dict(N=2, Tq=9, start=[0, 6], heads=6, kvh=3),
    "decode-bf16-compute": dict(N=4, Tq=1, start=[9, 17, 4, 30], dtype=torch.bfloat16, sinks=True, cap=10.0),
    "prefill-bf16-compute": dict(N=1, Tq=11, start=[3], dtype=torch.bfloat16, norms=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_is_the_formula_bit_for_bit(name):
    case = make_case(sorted(CASES).index(name), **CASES[name])
    got, cache = run_kernel(case)
    ref_cache = {"k": case["history"].clone(), "v": case["history"].flip(-1).clone()}  # bf16 storage
    want = reference(case, case["w"], case["q"], case["k"], case["v"], ref_cache)
    assert got.dtype == want.dtype and got.shape == want.shape
    valid = case["valid"].reshape(-1)
    assert torch.equal(got[:, valid], want[:, valid])
    # the cache holds exactly the bf16 values a bf16 cache holds (no extra precision kept)
    for e in ("k", "v"):
        assert torch.equal(cache[e].to(torch.bfloat16).to(cache[e].dtype), cache[e])
        assert torch.equal(cache[e], ref_cache[e].to(cache[e].dtype))


def test_attention_in_row_blocks_is_the_same(monkeypatch):
    """A long prefill's scores are computed a few query rows at a time (``ATTN_BLOCK``): the
    same numbers as in one block, up to the order of the products' sums. The row count of the
    Q K^T and P V products changes with the block, and MKL picks its kernel by it: on some CPUs
    (an AMD EPYC here) a row sums in another order, a few ulp (measured 3.1e-7 of the largest
    output); issue 38 allows attention a stated tolerance, here 2^-18 of the largest output (a
    wrong mask or block offset moves outputs by O(1))."""
    case = make_case(99, N=1, Tq=29, start=[3], window=9, sinks=True, cap=25.0)
    whole, _ = run_kernel(case)
    monkeypatch.setattr(kernels, "ATTN_BLOCK", 1)  # one query row per block
    rows, _ = run_kernel(case)
    torch.testing.assert_close(rows, whole, rtol=0, atol=2.0 ** -18 * float(whole.abs().max()))


def test_rope_in_fewer_passes_is_apply_rope():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 3, HD, generator=g)
    cos, sin = rope_cos_sin(torch.arange(7) * 37, HD, 10000.0, None, torch.float32)
    signed = torch.cat([-sin[:, :HD // 2], sin[:, HD // 2:]], dim=-1)
    assert torch.equal(kernels._rope4(x, *kernels._rope_views(cos, signed)), kernels.apply_rope(x, cos, sin))
    assert torch.equal(kernels._rope4(x, *kernels._rope_views(cos, signed)), _rotate(x, cos, sin))
