"""Expert-granular conversion (issue 37, item 1): an MXFP4 GPT-OSS and a block-FP8 DeepSeek-V3 convert
a few experts at a time. Every tensor the conversion's thread materializes (any torch op's output,
seen by a dispatch mode) is at most a few experts' size, never a layer's expert stack; and the
package is byte for byte the one the whole-stack conversion writes (bf16 and bfp8 experts, one
device and expert parallel over eight)."""

from __future__ import annotations

import dataclasses
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from quant_checkpoints import write_quantized  # noqa: E402
from test_emulated_moe import tiny as moe_tiny  # noqa: E402
from test_quantized_checkpoints import sourced  # noqa: E402

from ttbundle import build as buildmod, convert, spec as specmod  # noqa: E402

# 16 experts of [64, 128]: an expert is 8192 values, the stack 16x that; no other tensor is over
# 4 experts' float32 bytes (vocab 512 x hidden 64)
DIMS = {"gpt_oss": dict(num_local_experts=16, intermediate_size=64),
        "deepseek_v3": dict(n_routed_experts=16, n_group=4, moe_intermediate_size=128)}
SCHEME = {"gpt_oss": "mxfp4", "deepseek_v3": "fp8-block"}
EXPERT = 64 * 128  # values of one expert's matrix (both families)


class Largest(TorchDispatchMode):
    """The largest output (bytes) of any torch op run by this thread while active."""

    def __init__(self):
        super().__init__()
        self.nbytes, self.what = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                n = t.numel() * t.element_size()
                if n > self.nbytes:
                    self.nbytes, self.what = n, (str(func), tuple(t.shape), t.dtype)
        return out


def _bundle(tmp_path, family, experts="bf16"):
    b = moe_tiny(family, DIMS[family], default_plan=True)
    src = write_quantized(b, tmp_path / "ck", SCHEME[family])
    b = sourced(b, src)
    s = b.spec
    w = s.weights.model_copy(update={"dtypes": specmod.DtypePolicy(default="bf16", experts=experts)})
    return dataclasses.replace(b, spec=s.model_copy(update={"weights": w}))


def _weights(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("weights/*.safetensors"))}


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_conversion_materializes_a_few_experts_at_most(tmp_path, monkeypatch, family):
    b = _bundle(tmp_path, family)
    monkeypatch.setattr(convert, "EXPERT_CHUNK_BYTES", 2 * EXPERT * 2)  # two experts a step
    from ttbundle.formats import fp
    fp._mxfp4_table()  # MXFP4's lookup table: 256 KiB once per process, whatever the model's size
    seen = Largest()
    real = buildmod.convert

    def watched(*args, **kw):
        with seen:
            return real(*args, **kw)

    monkeypatch.setattr(buildmod, "convert", watched)
    buildmod.build(b, "N150", tmp_path / "pkg", warmup=False)
    # float32 scratch of two experts' decoding at most; the stack is 16 experts in bf16 (8x that)
    assert 0 < seen.nbytes <= 2 * EXPERT * 4, seen.what


@pytest.mark.parametrize("experts", ["bf16", pytest.param("bfp8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family,mesh", [("gpt_oss", "T3K"), ("deepseek_v3", "N150"), ("deepseek_v3", "T3K")])
def test_streamed_package_is_the_whole_stack_package(tmp_path, monkeypatch, family, mesh, experts):
    b = _bundle(tmp_path, family, experts)
    monkeypatch.setattr(convert, "EXPERT_CHUNK_BYTES", 3 * EXPERT * 2)  # 3 experts: chunks cross shards
    calls = []
    real = convert._ExpertStream.shards

    def counted(self, *a, **kw):
        calls.append(self.n)
        return real(self, *a, **kw)

    monkeypatch.setattr(convert._ExpertStream, "shards", counted)
    # and one shard's source at a time with the encoders (convert._Encoder): the same bytes
    monkeypatch.setattr(convert, "SOURCE_BYTES", 1)
    buildmod.build(b, mesh, tmp_path / "streamed", warmup=False)
    monkeypatch.undo()
    assert calls and 3 in calls and max(calls) < 16  # w2 of GPT-OSS: [64, 64], 6 experts a step
    monkeypatch.setattr(convert._ExpertStream, "plan", classmethod(lambda cls, *a: None))
    buildmod.build(b, mesh, tmp_path / "whole", warmup=False)
    a, w = _weights(tmp_path / "streamed"), _weights(tmp_path / "whole")
    assert a.keys() == w.keys() and len(a) >= 1
    for k in a:
        assert a[k] == w[k], k


def test_reference_skeleton_allocates_no_parameter(tmp_path):
    """check's reference skeleton (``reference.LayerwiseModel``) of a block-FP8 DeepSeek-V3: no
    tensor of a parameter's size is allocated while transformers builds it (issue 37: the fused
    float32 experts of a real-size layer, 30 GB, were allocated before they moved to ``meta``)."""
    from ttbundle import reference

    b = _bundle(tmp_path, "deepseek_v3")
    seen = Largest()
    with seen:
        m = reference.LayerwiseModel(b.spec.weights.source)
    experts = [p for n, p in m.model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert experts and all(p.device.type == "meta" for p in m.model.parameters())
    # the largest real tensor is smaller than one expert's matrix: buffers (rotary tables) only
    assert seen.nbytes < EXPERT * 4, seen.what


# ---- the warm-up and both sides of check: a few experts at a time -------------------------------------
# 32 experts of [64, 160] (hidden 64, expert width 160: a shape no other weight or activation of these
# models has); the warm-up and check compute only the experts their tokens were routed to
MANY = {"gpt_oss": dict(num_local_experts=32, intermediate_size=160),
        "qwen3_moe": dict(num_experts=32, moe_intermediate_size=160),
        "deepseek_v3": dict(n_routed_experts=32, n_group=4, moe_intermediate_size=160)}
MANY_SCHEME = {"gpt_oss": "mxfp4", "qwen3_moe": None, "deepseek_v3": "fp8-block"}


class Experts(TorchDispatchMode):
    """The most experts' matrices any torch op run by this thread makes, or any matrix product
    reads, at once: a tensor whose last two dims are an expert matrix's (``shapes``) counts its
    leading elements (a stack of ``E`` experts counts ``E``), whatever its dtype. An op's view of
    its input is not counted (a memory-mapped file viewed whole and sliced reads only the slice)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.most, self.what = set(shapes), 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(a, torch.Tensor) and a.device.type != "meta"]
        ptrs = {a.untyped_storage().data_ptr() for a in ins}
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in ptrs]
        # what an op makes, and what a product reads (a matrix decoded outside torch: block floats)
        for t in outs + (ins if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) else []):
            if t.dim() >= 2 and tuple(t.shape[-2:]) in self.shapes:
                n = t.numel() // (t.shape[-1] * t.shape[-2])
                if n > self.most:
                    self.most, self.what = n, (str(func), tuple(t.shape), t.dtype)
        return out


def _many(tmp_path, family, experts="bf16"):
    from ttbundle import reference

    b = moe_tiny(family, MANY[family], default_plan=True)
    if MANY_SCHEME[family] is None:
        src = reference.save_random(b, tmp_path / "ck")
    else:
        src = write_quantized(b, tmp_path / "ck", MANY_SCHEME[family])
    b = sourced(b, src)
    s = b.spec
    w = s.weights.model_copy(update={"dtypes": specmod.DtypePolicy(default="bf16", experts=experts)})
    return dataclasses.replace(b, spec=s.model_copy(update={"weights": w})), src


@pytest.mark.parametrize("family,mesh,experts", [
    *((f, "N150", "bf16") for f in sorted(MANY)),
    pytest.param("gpt_oss", "T3K", "bfp8", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "N300", "bfp8", marks=pytest.mark.slow)])
def test_warmup_and_check_hold_a_few_experts_at_most(tmp_path, monkeypatch, family, mesh, experts):
    """Issue 37: the build's warm-up, check's emulated side and its two transformers sides (the
    expected one reading block-float experts as stored: ``ExpectedWeights.expert``) never hold
    more than two experts' matrices at once (a layer has 32), and the check still passes."""
    from ttbundle import warmup
    from ttbundle.backends.emulated import EmulatedModel
    from ttbundle.check import check_package
    from ttbundle import reference

    H, inter = 64, 160
    shapes = {(H, inter), (inter, H), (H, 2 * inter), (2 * inter, H)}
    b, src = _many(tmp_path, family, experts)
    sides = {"warm-up": Experts(shapes), "emulated": Experts(shapes), "transformers": Experts(shapes)}

    def watch(owner, attr, mode):
        real = getattr(owner, attr)

        def watched(*a, **kw):
            with mode:
                return real(*a, **kw)
        monkeypatch.setattr(owner, attr, watched)

    watch(warmup, "_warm", sides["warm-up"])
    watch(EmulatedModel, "run_layer_major", sides["emulated"])
    watch(reference.LayerwiseModel, "run_layer", sides["transformers"])
    res = buildmod.build(b, mesh, tmp_path / "pkg", warmup=True)
    r = check_package(res.package, src, steps=4)
    assert r.passed, r
    too_many = {side: (mode.most, mode.what) for side, mode in sides.items() if not 1 <= mode.most <= 2}
    assert not too_many, too_many


@pytest.mark.parametrize("family,mesh", [("gpt_oss", "T3K"), ("deepseek_v3", "N150")])
def test_expected_experts_one_at_a_time_equal_the_whole_stack(tmp_path, family, mesh):
    """check's expected side reads a block-float expert stack one expert at a time
    (``ExpectedWeights.expert``): each expert's values equal that expert of the whole-stack
    computation (``ExpectedWeights(key)``, the path every other tensor takes), MXFP4 / FP8
    decoding and bfp8 tile rounding included."""
    from ttbundle.check.expected import ExpectedWeights
    from ttbundle.package.load import load_package

    b = _bundle(tmp_path, family, experts="bfp8")
    res = buildmod.build(b, mesh, tmp_path / "pkg", warmup=False)
    ew = ExpectedWeights(load_package(res.package), b.spec.weights.source)
    keys = [k for k, jobs in ew.by_key.items() if any(ew.decls[n].group == "experts" for n, _, _ in jobs)]
    assert keys
    for k in keys:
        whole = ExpectedWeights(load_package(res.package), b.spec.weights.source)(k)
        nums = [int(p) for p in k.split(".") if p.isdigit()]
        if len(nums) >= 2:  # a per-expert key (DeepSeek): model.layers.L.mlp.experts.E....
            assert torch.equal(ew.expert(k, nums[-1]), whole), k
        else:  # stacked over the experts (GPT-OSS)
            assert whole.shape[0] == 16
            for e in range(16):
                assert torch.equal(ew.expert(k, e), whole[e:e + 1]), (k, e)


def test_one_expert_decoded_in_bands_is_that_expert_of_the_stack(tmp_path, monkeypatch):
    """``PackageWeights.expert`` decodes a block-float expert in bands of tile rows on every core
    (the warm-up's and check's expert reads): each expert's values are its slice of the device's
    whole decoded shard, with bands of one tile row and with one band."""
    from ttbundle.package import shards
    from ttbundle.package.load import load_package

    b = _bundle(tmp_path, "gpt_oss", experts="bfp8")
    res = buildmod.build(b, "N300", tmp_path / "pkg", warmup=False)
    pw = load_package(res.package).weights
    names = [n for n, t in pw.decls.items() if t.group == "experts" and len(t.shape) == 3]
    assert names
    for band in (32 * 4 * 64, shards.BAND_BYTES):  # a tile row of the narrowest matrix; whole
        monkeypatch.setattr(shards, "BAND_BYTES", band)
        for name in names:
            for layer in pw.layers_of(name):
                per_device = pw.shards(name, layer, torch.float32)
                for d, g in enumerate(pw.distinct(name, layer)):
                    whole = per_device[d]
                    for j in range(whole.shape[0]):
                        assert torch.equal(pw.expert(name, layer, g, j), whole[j]), (name, layer, g, j, band)


@pytest.mark.parametrize("family,mesh", [("gpt_oss", "T3K"), ("qwen3_moe", "N150")])
def test_experts_over_a_band_of_tokens_at_a_time_compute_the_same(tmp_path, monkeypatch, family, mesh):
    """A long call's routed experts run a band of tokens at a time (their ``[D, T, E_local, N]``
    activations over ``MOE_ACT_BYTES``: gpt-oss-120b's 1,024-token prefill held 3 GB each): the
    warm-up's logits of every program equal those of the whole call at once."""
    from ttbundle import warmref
    from ttbundle.backends.emulated import model as emodel
    from ttbundle.package.load import load_package
    from ttbundle.warmup import stage_model

    from ttbundle import reference

    b = moe_tiny(family, default_plan=True)
    src = reference.save_random(b, tmp_path / "ck")
    b = sourced(b, src)
    res = buildmod.build(b, mesh, tmp_path / "pkg", warmup=False)
    pkg = load_package(res.package)
    todo = sorted(k for k in pkg.programs if k[0] != "vision")
    whole = warmref.run(stage_model(pkg, "float32", todo), b, todo)
    bands = []
    real = emodel.EmulatedModel._moe_segment

    def seg(self, steps, i, acts):
        r = real(self, steps, i, acts)
        if r is not None:
            bands.append(r[1])
        return r
    monkeypatch.setattr(emodel, "MOE_ACT_BYTES", 3 * 4 * 64 * 8)  # 3 tokens of 8 experts x 64 (T3K: 1 expert)
    monkeypatch.setattr(emodel.EmulatedModel, "_moe_segment", seg)
    banded = warmref.run(stage_model(pkg, "float32", todo), b, todo)
    assert bands and max(bands) >= 3
    for k in todo:
        torch.testing.assert_close(banded[k][0], whole[k][0], rtol=1e-5, atol=1e-5 * float(whole[k][0].abs().max()))


@pytest.mark.parametrize("family,mesh", [("gpt_oss", "T3K"), ("deepseek_v3", "N300"), ("qwen3_moe", "N150")])
def test_layer_major_calls_decode_each_expert_once_per_stage(tmp_path, monkeypatch, family, mesh):
    """Several calls run layer by layer on a lazy model (the warm-up's programs) decode each
    routed expert once per stage for all of them (``expert_major``), where each call alone
    decodes those it routes to: every program's logits are bit for bit those of the program
    run alone, no expert of a layer is decoded twice, and fewer are decoded than by the calls
    one at a time."""
    from collections import Counter

    from ttbundle import reference, warmref
    from ttbundle.backends.emulated import expert_major, lazy
    from ttbundle.package.load import load_package
    from ttbundle.warmup import stage_model

    b = moe_tiny(family, MANY[family], default_plan=True)
    b = sourced(b, reference.save_random(b, tmp_path / "ck"))
    s = b.spec
    w = s.weights.model_copy(update={"dtypes": specmod.DtypePolicy(default="bf16", experts="bfp8")})
    b = dataclasses.replace(b, spec=s.model_copy(update={"weights": w}))
    pkg = load_package(buildmod.build(b, mesh, tmp_path / "pkg", warmup=False).package)
    todo = sorted(k for k in pkg.programs if k[0] != "vision")
    assert len(todo) >= 3
    decoded = Counter()
    real = lazy.LazyWeights.expert

    def counted(self, name, layer, g, j):
        decoded[(name, layer, g, j)] += 1
        return real(self, name, layer, g, j)
    monkeypatch.setattr(lazy.LazyWeights, "expert", counted)
    together = warmref.run(stage_model(pkg, "float32", todo), b, todo)
    once = dict(decoded)
    decoded.clear()
    alone = {k: warmref.run(stage_model(pkg, "float32", [k]), b, [k])[k] for k in todo}
    for k in todo:
        assert torch.equal(together[k][0], alone[k][0]), k
    assert once and max(once.values()) == 1, max(once.values())
    assert sum(once.values()) < sum(decoded.values()), (sum(once.values()), sum(decoded.values()))
    # calls whose parked activations exceed GROUP_BYTES run in groups of one: as alone
    singles = dict(decoded)
    decoded.clear()
    monkeypatch.setattr(expert_major, "GROUP_BYTES", 1)
    grouped = warmref.run(stage_model(pkg, "float32", todo), b, todo)
    assert dict(decoded) == singles
    for k in todo:
        assert torch.equal(grouped[k][0], alone[k][0]), k


def test_an_error_in_one_layer_major_call_is_raised_and_leaves_no_thread(tmp_path, monkeypatch):
    """A call that fails after its experts ran with the others' (the Combine of the second call
    raises) fails the whole run with that error; the other calls, parked at their experts or
    not yet started, are unwound, and no call thread is left behind."""
    import threading

    from ttbundle import reference, warmref
    from ttbundle.backends.emulated import kernel_table
    from ttbundle.package.load import load_package
    from ttbundle.warmup import stage_model

    b = moe_tiny("gpt_oss", MANY["gpt_oss"], default_plan=True)
    b = sourced(b, reference.save_random(b, tmp_path / "ck"))
    pkg = load_package(buildmod.build(b, "N150", tmp_path / "pkg", warmup=False).package)
    todo = sorted(k for k in pkg.programs if k[0] != "vision")
    real = kernel_table.KERNELS["combine"]
    calls = []

    def combine(ctx, layer, *a):
        calls.append(layer)
        if len(calls) == 2:
            raise RuntimeError("combine failed")
        return real(ctx, layer, *a)
    monkeypatch.setitem(kernel_table.KERNELS, "combine", combine)
    with pytest.raises(RuntimeError, match="combine failed"):
        warmref.run(stage_model(pkg, "float32", todo), b, todo)
    assert len(calls) == 2
    assert not [t for t in threading.enumerate() if t.name.startswith("ttbundle-call-")]
