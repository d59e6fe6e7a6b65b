"""The emulated mesh's weight GEMM (``backends/emulated/gemm.py``): oneDNN-packed weights against
torch's own matmul in float64, and a package's model run both ways."""

from __future__ import annotations

import pytest
import torch

from ttbundle.backends.emulated import gemm
from ttbundle.backends.emulated.model import EmulatedModel
from ttbundle.errors import InvalidInput
from ttbundle.package.load import load_package
from ttbundle.package.shards import SharedStack
from ttbundle.serving.demo import build_package

from test_emulated import COMMON, TINY

needs_onednn = pytest.mark.skipif(not gemm.packs(torch.float32, torch.device("cpu")),
                                  reason="torch without oneDNN on this CPU")

SPEC = TINY["llama"] + COMMON  # test_emulated's tiny Llama (vocab 512), buckets 64/128 and 1/8/32


@needs_onednn
@pytest.mark.parametrize("D", [1, 3])
@pytest.mark.parametrize("rows", [1, 7, 16, 130])
def test_packed_matmul_is_the_fp32_product(D, rows):
    g = torch.Generator().manual_seed(rows * 10 + D)
    W = torch.randn(D, 96, 80, generator=g)
    x = torch.randn(D, rows, 96, generator=g)
    got = gemm.matmul(x, gemm.Packed(W))
    want = torch.bmm(x.double(), W.double())
    assert got.shape == (D, rows, 80) and got.dtype == torch.float32
    # an fp32 product's rounding (1e-5 of |x||w| summed over K=96), not a wrong device or layout
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4)
    # each device multiplies by its own shard: device 0's weight on every device would differ
    if D > 1:
        assert (torch.bmm(x, W[:1].expand(D, -1, -1)) - got).abs().max() > 1.0


@needs_onednn
def test_packed_matmul_of_expert_rows_and_a_strided_input():
    W = torch.randn(2, 64, 48)
    x = torch.randn(2, 5, 3, 64)  # [D, T, E, K]
    torch.testing.assert_close(gemm.matmul(x, gemm.Packed(W)), torch.einsum("dtek,dkn->dten", x, W),
                               rtol=1e-5, atol=1e-4)
    xt = torch.randn(2, 64, 9).transpose(1, 2)  # not contiguous
    torch.testing.assert_close(gemm.matmul(xt, gemm.Packed(W)), torch.bmm(xt, W), rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("mode", ["plain", "packed"])
def test_with_the_batch_invariant_switch_a_rows_result_does_not_depend_on_the_other_rows(monkeypatch, mode):
    # decode steps batch any sequences together; with VLLM_BATCH_INVARIANT a row's bits must not
    # change with its neighbours (by default they may: issue 38's decision)
    monkeypatch.setenv(gemm.ENV, mode)
    monkeypatch.setenv(gemm.INVARIANT_ENV, "1")
    W = gemm.Packed(torch.randn(1, 2816, 512))
    x = torch.randn(1, 32, 2816)
    full = gemm.matmul(x, W)
    for n in (1, 5, 16):
        assert torch.equal(gemm.matmul(x[:, :n], W), full[:, :n])
    # the blocked layout and the plain one give the same bits on the invariant path
    monkeypatch.setenv(gemm.ENV, "packed" if mode == "plain" else "plain")
    assert torch.equal(gemm.matmul(x, gemm.Packed(W.dense())), full)


@needs_onednn
def test_plain_one_row_is_transformers_kernel_and_several_the_blocked_layouts_bits(monkeypatch):
    # plain: MKL's F.linear on the plain [N, K] weight for one row (transformers' decode kernel),
    # bit for bit; several rows: oneDNN on the plain weight, the blocked layout's bits
    monkeypatch.setenv(gemm.ENV, "plain")
    monkeypatch.delenv(gemm.INVARIANT_ENV, raising=False)
    w = torch.randn(512, 2816)
    W = gemm.Packed(w.t().contiguous()[None])
    x = torch.randn(1, 32, 2816)
    assert torch.equal(gemm.matmul(x[:, :1].contiguous(), W)[0], torch.nn.functional.linear(x[0, :1], w))
    monkeypatch.setenv(gemm.ENV, "packed")
    blocked = gemm.Packed(w.t().contiguous()[None])
    assert torch.equal(gemm.matmul(x, W), gemm.matmul(x, blocked))


@needs_onednn
@pytest.mark.parametrize("vendor, is_blocked", [("GenuineIntel", False), ("AuthenticAMD", True), ("", True)])
def test_auto_holds_the_blocked_layout_except_on_intel(monkeypatch, vendor, is_blocked):
    # MKL's fast kernels are Intel's: elsewhere auto takes oneDNN's blocked layout (issue 38)
    monkeypatch.delenv(gemm.ENV, raising=False)
    monkeypatch.setattr(gemm, "_VENDOR", [vendor])
    assert gemm.blocked() is is_blocked
    assert gemm.describe().startswith("packed from 1 MiB" if is_blocked else "plain")
    assert gemm.describe().endswith(f"(auto, {vendor or 'vendor unknown'})")
    W = gemm.Packed(torch.randn(1, 512, 512))  # 1 MiB: blocked off Intel
    if is_blocked:  # a list of oneDNN-blocked matrices
        assert isinstance(W.per_shard, list) and W.per_shard[0].is_mkldnn
    else:  # one plain [G, N, K] tensor
        assert isinstance(W.per_shard, torch.Tensor) and not W.per_shard.is_mkldnn
    # a small matrix stays plain on any CPU (MKL's one-row call is the cheaper there), merged too
    small = gemm.Packed(torch.randn(1, 256, 511))
    assert isinstance(small.per_shard, torch.Tensor) and not small.per_shard.is_mkldnn
    merged = gemm.Packed(torch.randn(2, 512, 512))
    assert merged.merged.is_mkldnn is is_blocked
    x = torch.randn(2, 3, 512)
    torch.testing.assert_close(merged.matmul(x), torch.bmm(x, merged.dense()), rtol=1e-5, atol=1e-4)
    for mode, want in (("plain", False), ("packed", True), ("torch", False)):
        monkeypatch.setenv(gemm.ENV, mode)
        assert gemm.blocked() is want


def test_the_cpu_vendor_is_the_kernels_word():
    # an independent reader: the first vendor_id line of /proc/cpuinfo (where there is one)
    try:
        with open("/proc/cpuinfo") as f:
            want = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), "")
    except OSError:
        want = ""
    assert gemm.cpu_vendor() == want


def test_dense_gives_back_the_exact_weight():
    W = torch.randn(2, 40, 24).bfloat16().float()
    assert torch.equal(gemm.Packed(W).dense(), W)


def test_the_switch_and_a_bad_value(monkeypatch):
    monkeypatch.setenv(gemm.ENV, "torch")
    assert not gemm.packs(torch.float32, torch.device("cpu"))
    W = torch.randn(1, 8, 4)
    held = gemm.hold({"w": W}, {"w"}, torch.float32, "cpu")
    assert held["w"] is W
    monkeypatch.setenv(gemm.ENV, "fast")
    with pytest.raises(InvalidInput, match="TTBUNDLE_EMULATED_GEMM='fast': expected 'auto'.*'packed'.*or 'torch'"):
        gemm.packs(torch.float32, torch.device("cpu"))
    monkeypatch.delenv(gemm.ENV)
    # never packed: other dtypes, other devices
    assert not gemm.packs(torch.bfloat16, torch.device("cpu"))
    assert not gemm.packs(torch.float32, torch.device("meta"))


@needs_onednn
@pytest.mark.parametrize("mesh", ["N150", "T3K"])
def test_a_packages_model_packed_and_plain_give_the_same_logits(tmp_path, monkeypatch, mesh):
    pkg = load_package(build_package(SPEC, tmp_path, mesh, warmup=False))
    packed = EmulatedModel.from_package(pkg)
    monkeypatch.setenv(gemm.ENV, "torch")
    plain = EmulatedModel.from_package(pkg)
    # what is packed: the matmul weights, not the embedding table or the norms
    assert isinstance(packed._held("wq", 0), gemm.Packed) and isinstance(packed._held("lm_head"), gemm.Packed)
    assert not isinstance(packed._held("embed"), gemm.Packed)
    assert all(not isinstance(v, gemm.Packed) for v in plain.w.values())
    # a reader other than the GEMM still gets the package's shard, exactly
    assert torch.equal(packed.weight("wq", 1), plain.weight("wq", 1))
    outs = []
    for m in (packed, plain):
        kv = m.allocate_kv_cache(16, pkg.bundle.spec.runtime.kv_block_size)
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(0, 512, (1, 64), generator=g)
        pos = torch.arange(64)[None]
        table = torch.arange(1, 5)[None]
        pre = m.forward(m.program("prefill", 64), tok, pos, pos >= 0, table, kv)
        dec = m.forward(m.program("decode", 1), pre[:, -1:].argmax(-1), torch.tensor([[64]]),
                        torch.tensor([[True]]), table, kv)
        outs.append((pre, dec))
    if mesh == "T3K":  # 8 distinct shards: the column-split query projection (its input gathered,
        # alike on every device) stays one merged matrix; the row-split output projection (each
        # device's own heads) went per shard on its first call
        assert packed._held("wq", 0).merged is not None and packed._held("wq", 0).per_shard is None
        assert packed._held("wo", 0).merged is None and len(packed._held("wo", 0).per_shard) == 8
    for a, b in zip(outs[0], outs[1]):
        # fp32 summation order, which can flip a bf16 rounding of a cached key (2^-8 of it): a
        # wrong shard or layout would be off by the logits' own size (std ~1)
        assert (a - b).abs().mean() < 1e-4 and (a - b).abs().max() < 5e-3
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_onednn
@pytest.mark.parametrize("group", [(0, 1, 2, 3), (0, 1, 1, 0)])
def test_a_several_shard_weight_is_one_call_for_same_rows_and_per_shard_for_differing_rows(group):
    # a column-split weight meets the same rows on every device (its input was gathered): one
    # oneDNN call on the shards side by side; a row-split one meets each device's own slice
    g = torch.Generator().manual_seed(7)
    G = max(group) + 1
    distinct = torch.randn(G, 96, 40, generator=g).bfloat16().float()
    W = distinct.index_select(0, torch.tensor(group))
    P = gemm.Packed(SharedStack(distinct, group) if G < 4 else W)
    assert P.merged is not None and P.per_shard is None
    assert torch.equal(P.dense(), W)  # a reader other than the GEMM gets the exact shards
    x = torch.randn(1, 5, 96, generator=g).expand(4, -1, -1)
    got = gemm.matmul(x, P)
    want = torch.bmm(x.double(), W.double())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4)
    assert P.merged is not None  # still one matrix
    # bit for bit what one call per shard computes (a token must not depend on the layout)
    for d in range(4):
        alone = gemm.Packed(W[d:d + 1])
        assert torch.equal(got[d], gemm.matmul(x[d:d + 1], alone)[0])
    xd = torch.randn(4, 3, 96, generator=g)  # rows that differ per device
    got = gemm.matmul(xd, P)
    torch.testing.assert_close(got.double(), torch.bmm(xd.double(), W.double()), rtol=0, atol=2e-4)
    assert P.merged is None and len(P.per_shard) == G and torch.equal(P.dense(), W)
    # and the same rows again, now per shard: the same results as the merged call gave
    torch.testing.assert_close(gemm.matmul(x, P), torch.bmm(x, W), rtol=0, atol=2e-4)


@needs_onednn
def test_a_weight_over_the_merge_limit_is_packed_per_shard(monkeypatch):
    monkeypatch.setattr(gemm, "MERGE_BYTES", 0)
    W = torch.randn(3, 64, 24)
    P = gemm.Packed(W)
    assert P.merged is None and len(P.per_shard) == 3
    x = torch.randn(1, 2, 64).expand(3, -1, -1)
    torch.testing.assert_close(gemm.matmul(x, P), torch.bmm(x, W), rtol=1e-5, atol=1e-4)


class _Handle:
    """A weights file's handle as ``package.shards`` reads it (``get_tensor``), over bytes."""

    def __init__(self, data: bytes):
        self.data = data

    def get_tensor(self, key):
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8)


@pytest.mark.parametrize("fmt", ["bfp8", "bfp4"])
def test_a_block_float_matrix_is_read_straight_into_the_gemm_layout(fmt, monkeypatch):
    """A packed matmul weight read transposed (``stack(nk=True)``): the decoder's values, in
    band jobs, held by :class:`gemm.Packed` with no copy (its plain matrix is the read tensor)."""
    import numpy as np
    from ttbundle import blockfloat
    from ttbundle.package import shards
    x = np.random.default_rng(0).standard_normal((200, 300)).astype(np.float32)
    data = blockfloat.encode(x, fmt)
    monkeypatch.setattr(shards, "BAND_BYTES", 4 * 200 * 32 * 2)  # two tile columns a band: 5 jobs
    nk = torch.empty(1, 300, 200)
    out = nk.transpose(1, 2)
    shards._decode_into(_Handle(data), "w", {"encoding": fmt, "shape": [200, 300]}, out[0])
    assert torch.equal(out[0], blockfloat.decode(data, [200, 300], fmt))
    monkeypatch.setenv(gemm.ENV, "plain")
    p = gemm.Packed(out)
    assert p.per_shard.data_ptr() == nk.data_ptr()  # held as read: no transpose copy
    rows = torch.randn(1, 3, 200)
    assert torch.equal(p.matmul(rows), gemm.Packed(out.contiguous()).matmul(rows))
