"""Issue 27: a shard several devices hold is stored once in the package, read once, held once by
the emulated mesh and multiplied once per call; the per-device arithmetic is unchanged, so a
wrong shard or a dropped collective still computes wrong numbers.

References: the checkpoint's own byte count (safetensors), shard values compared with
``torch.equal`` (what "the same shard" means, independent of the layout rule that decides it),
storage addresses (``untyped_storage().data_ptr()``) and ``torch.bmm`` per device."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pkg_mutations import flip_byte, rehash
from test_emulated import tiny

from ttbundle import reference
from ttbundle.package.load import load_package
from ttbundle.package.names import PackageError, WEIGHTS_FORMAT, weight_file
from ttbundle.package.shards import SharedStack
from ttbundle.package.verify import verify_package
from ttbundle.backends.emulated import EmulatedModel, gemm
from ttbundle.backends.emulated.replication import Classes
from ttbundle.build import build
from ttbundle.check import run_check


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """The tiny Llama (embedding split over TG's 4 columns, replicated over its 8 rows; norms
    replicated everywhere) built for N150, T3K and TG from one random bf16 checkpoint."""
    tmp = tmp_path_factory.mktemp("shared")
    b = tiny("llama")
    ckpt = reference.save_random(b, tmp / "ckpt", seed=3)
    w = b.spec.weights.model_copy(update={"source": str(ckpt)})
    b = dataclasses.replace(b, spec=b.spec.model_copy(update={"weights": w, "tokenizer": False}))
    return ckpt, {m: Path(build(b, m, tmp / "out", warmup=False).package) for m in ("N150", "T3K", "TG")}


def payload(f: Path) -> int:
    """Tensor bytes of a safetensors file (its header excluded)."""
    raw = f.read_bytes()
    return len(raw) - 8 - int.from_bytes(raw[:8], "little")


def header(f: Path) -> dict:
    raw = f.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


def test_a_tg_package_stores_each_distinct_shard_once(packages):
    ckpt, pkgs = packages
    # N150: one device holds everything, so its payload is the checkpoint's (all bf16)
    ck = sum(payload(f) for f in ckpt.glob("*.safetensors"))
    n150 = sum(payload(f) for f in (pkgs["N150"] / "weights").iterdir())
    assert n150 == ck
    tg = load = load_package(pkgs["TG"], verify=True)
    files = sorted((pkgs["TG"] / "weights").iterdir())
    assert len(files) == 32
    # the payload is one copy of every distinct shard, "distinct" judged by value
    want = 0
    for name in tg.weights.decls:
        for layer in tg.weights.layers_of(name):
            shards = tg.weights.shards(name, layer, torch.bfloat16)
            distinct: list = []
            for s in shards:
                if not any(torch.equal(s, x) for x in distinct):
                    distinct.append(s)
            want += len(distinct) * shards[0].numel() * 2
    assert sum(payload(f) for f in files) == want
    assert want <= 1.2 * n150  # issue 27: a TG package <= 1.2x the N150 package
    # a replicated tensor is in device 0's file only; the others' headers point there
    h0, h5 = header(files[0]), header(files[5])
    assert "attn_norm.1" in h0 and "attn_norm.1" not in h5
    meta5 = json.loads(h5["__metadata__"]["ttbundle"])
    assert meta5["format"] == WEIGHTS_FORMAT and meta5["tensors"]["attn_norm.1"]["stored_in"] == [0] * 32
    # the embedding: one copy per column (split over cols, replicated over rows)
    assert meta5["tensors"]["embed"]["stored_in"] == [d % 4 for d in range(32)]
    load.weights.close()


def held_bytes(model) -> int:
    """Bytes of the distinct storages behind every weight a (bf16, unpacked) model holds."""
    seen: dict = {}
    for v in model.w.values():
        for W in v if isinstance(v, list) else [v]:
            t = W.distinct if isinstance(W, SharedStack) else W
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_the_emulated_mesh_holds_one_copy_per_distinct_shard(packages):
    _, pkgs = packages
    tg = load_package(pkgs["TG"])
    norm = tg.weights.stack("attn_norm", 0)
    assert norm.shape[0] == 32 and len({norm[d].untyped_storage().data_ptr() for d in range(32)}) == 1
    assert torch.equal(norm[31], tg.weights.device(31, ["attn_norm.0"])["attn_norm.0"].float())
    embed = tg.weights.stack("embed")
    assert isinstance(embed, SharedStack) and embed.distinct.shape[0] == 4
    dense = embed.dense()
    for d in (0, 5, 31):  # each device sees its own file's shard
        assert torch.equal(dense[d], tg.weights.device(d, ["embed"])["embed"].float())
    # the whole model in bf16 (unpacked): TG holds about what N150 does, not 32x
    held = {m: held_bytes(EmulatedModel.from_package(load_package(pkgs[m]), dtype=torch.bfloat16))
            for m in ("N150", "TG")}
    assert held["TG"] <= 1.3 * held["N150"], held


def test_packed_weights_are_packed_once_per_distinct_shard():
    if not gemm.packs(torch.float32, "cpu"):
        pytest.skip("no oneDNN here")
    g = torch.Generator().manual_seed(0)
    one = torch.randn(64, 48, generator=g)
    W = one.unsqueeze(0).expand(8, 64, 48)
    p = gemm.Packed(W)
    assert len(p.per_shard) == 1
    cols = torch.randn(2, 64, 48, generator=g)
    shared = SharedStack(cols, [d % 2 for d in range(8)])
    q = gemm.Packed(shared)
    # the 2 distinct shards side by side in one matrix (merged), not one per device
    assert q.per_shard is None and tuple(q.merged.to_dense().shape) == (2 * 48, 64)
    x = torch.randn(8, 5, 64, generator=g)  # every device's rows differ
    ref = torch.bmm(x, shared.dense())
    for held in (q, shared):
        torch.testing.assert_close(gemm.matmul(x, held), ref, rtol=1e-5, atol=1e-5)
    assert q.merged is None and len(q.per_shard) == 2  # differing rows: one matrix per distinct shard
    torch.testing.assert_close(p.matmul(x), torch.bmm(x, W.contiguous()), rtol=1e-5, atol=1e-5)


def test_identical_rows_are_multiplied_once_and_differing_rows_each():
    g = torch.Generator().manual_seed(1)
    shared = SharedStack(torch.randn(2, 16, 8, generator=g), [0, 1, 0, 1])
    calls = []

    def mm(k, rows):
        calls.append((k, rows.shape[0]))
        return rows @ shared.distinct[k]
    same = torch.randn(1, 3, 16, generator=g).expand(4, 3, 16)  # provably identical (stride 0)
    y = gemm.grouped(same, shared.group, 8, mm)
    assert sorted(calls) == [(0, 3), (1, 3)]  # one product per distinct shard, one device's rows
    torch.testing.assert_close(y, torch.bmm(same.contiguous(), shared.dense()))
    calls.clear()
    x = same.clone()
    x[2, 1, 0] += 1.0  # device 2 differs from device 0, which holds the same shard
    y = gemm.grouped(x, shared.group, 8, mm)
    assert sorted(calls) == [(0, 6), (1, 3)]  # shard 0: both devices' rows; shard 1: checked equal
    torch.testing.assert_close(y, torch.bmm(x, shared.dense()))
    assert not torch.equal(y[2], y[0])


def test_the_one_stored_copy_of_a_replicated_norm_corrupted_fails_check():
    """Layer 1's attention norm is stored once for all 32 TG devices: one byte of it flipped (and
    re-hashed) reaches every device, and the check fails at layer 1."""
    def hook(pkg):
        flip_byte(pkg, weight_file(0), "attn_norm.1", offset=1)  # a bf16 high byte
        verify_package(pkg, full=True)
    r = run_check(tiny("llama"), "TG", steps=4, random_weights=True, seed=3, package_hook=hook)
    assert not r.passed and r.diverging().layer == 1


def _edit_headers(pkg: Path, edit) -> None:
    """Apply ``edit(device, tensors table)`` to every device file's ttbundle header, re-hashed
    (the file's data offsets are unchanged: only the metadata string is rewritten)."""
    for f in sorted((pkg / "weights").iterdir()):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        h = json.loads(raw[8:8 + n])
        meta = json.loads(h["__metadata__"]["ttbundle"])
        edit(meta["device"], meta["tensors"])
        h["__metadata__"]["ttbundle"] = json.dumps(meta, sort_keys=True)
        head = json.dumps(h, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        f.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])
        rehash(pkg, f"weights/{f.name}")


@pytest.mark.parametrize("case", ["another-shard", "not-stored-there", "extra-copy-unlisted", "tables-differ"])
def test_a_header_pointing_at_the_wrong_copy_is_refused(packages, tmp_path, case):
    import shutil
    _, pkgs = packages
    pkg = tmp_path / "pkg"
    shutil.copytree(pkgs["T3K"], pkg)

    def edit(d, tensors):
        if case == "another-shard":  # device 1's wq shard "stored in" device 0's file: not its shard
            tensors["wq.0"]["stored_in"] = [0, 0] + list(range(2, 8))
        elif case == "not-stored-there":  # attn_norm said to be in device 3's own file
            tensors["attn_norm.0"]["stored_in"] = [0, 0, 0, 3, 0, 0, 0, 0]
        elif case == "extra-copy-unlisted":
            tensors["attn_norm.0"].pop("stored_in")  # format 2 without stored_in: every file holds it
        elif case == "tables-differ" and d == 2:
            tensors["attn_norm.0"]["stored_in"] = [0, 0, 2, 0, 0, 0, 0, 0]
    _edit_headers(pkg, edit)
    verify_package(pkg)  # the hashes pass
    want = {"another-shard": r"wq.0: stored_in \[0, 0, 2.*does not name",
            "not-stored-there": r"device-003.safetensors: attn_norm.0 is missing",
            "extra-copy-unlisted": r"device-001.safetensors: attn_norm.0 is missing",
            "tables-differ": r"device-002.safetensors: attn_norm.0 is missing"}[case]
    with pytest.raises(PackageError, match=want):
        load_package(pkg)


def test_a_format_1_package_still_loads_with_the_same_numbers(packages, tmp_path):
    """Format 1 (every device file holds every shard, no ``stored_in``): rewritten from a format 2
    package, it loads, holds a copy per device and computes the same logits."""
    import shutil

    from safetensors.torch import load_file, save_file
    _, pkgs = packages
    pkg = tmp_path / "v1"
    shutil.copytree(pkgs["T3K"], pkg)
    files = sorted((pkg / "weights").iterdir())
    stored = [load_file(str(f)) for f in files]
    for d, f in enumerate(files):
        meta = json.loads(header(f)["__metadata__"]["ttbundle"])
        tensors = {}
        for key, info in meta["tensors"].items():
            tensors[key] = stored[info.pop("stored_in")[d]][key].clone()
        meta["format"] = "ttbundle.weights/1"
        save_file(tensors, str(f), metadata={"ttbundle": json.dumps(meta, sort_keys=True)})
        rehash(pkg, f"weights/{f.name}")
    # (the manifest stays ttbundle.package/4: older manifests are refused, their programs lack traits and dims)
    old, new = load_package(pkg, verify=True), load_package(pkgs["T3K"])
    norm = old.weights.stack("attn_norm", 0)
    assert len({norm[d].data_ptr() for d in range(8)}) == 8  # one copy per device file
    tokens = torch.tensor([[5, 9, 17, 3]])
    outs = []
    for p in (old, new):
        from ttbundle.backends.emulated import Runner
        r = Runner(EmulatedModel.from_package(p))
        outs.append(r.prefill(tokens[0].tolist(), [1]))
    assert torch.equal(outs[0], outs[1])


# ---- compute once where replicas are alike; activations dropped after their last read ----------
@pytest.fixture(scope="module")
def qwen3():
    """A tiny Qwen3 (per-head q/k norms: weights the attention kernel reads) as transformers
    builds it, and its weights cut for N150 and TG as ``build`` cuts them."""
    from ttbundle import weights as wmod
    from ttbundle.plan.make import make_plan
    b = tiny("qwen3")
    canon = wmod.from_state_dict(b.family, b.arch, dict(reference.random_model(b, seed=5).state_dict()))
    return b, {m: (make_plan(b, m), canon) for m in ("N150", "TG")}


def _model(qwen3, mesh, **kw):
    b, plans = qwen3
    from ttbundle.lower import lower_all
    plan, canon = plans[mesh]
    kw.setdefault("programs", lower_all(b, plan))
    return EmulatedModel.from_canonical(b, plan, canon, **kw)


def _run(model, tokens=(5, 9, 17, 3, 44, 2, 71, 8, 100, 7), runner=None):
    """A prefill, then two decode steps (the second reads the cache the first wrote): logits
    ``[3, vocab]``. ``runner``: a list that gets the Runner (its KV cache)."""
    from ttbundle.backends.emulated import Runner
    r = Runner(model)
    if runner is not None:
        runner.append(r)
    with torch.no_grad():
        out = [r.prefill(list(tokens), [1, 2])]
        for s in range(2):
            out.append(r.decode([int(out[-1].argmax())], [len(tokens) + s], [[1, 2]])[0])
    return torch.stack(out)


def test_replicated_steps_run_once_per_class_with_the_n150_numbers(qwen3):
    """TG splits Qwen3's heads over its 4 columns and replicates them over its 8 rows: attention
    (q/k norms, rope, the paged cache) runs on 4 devices, the norms and residual adds on one,
    and the logits are N150's; the same TG with every step on all 32 devices gives the same
    numbers (so sharing the result is not what makes them agree)."""
    from ttbundle.backends.emulated.kernels import KERNELS
    seen = []

    def attention(ctx, layer, q, k, v):
        seen.append(q.shape[0])
        return KERNELS["attention"](ctx, layer, q, k, v)
    runner: list = []
    got = _run(_model(qwen3, "TG", kernels={"attention": attention}), runner=runner)
    assert seen and set(seen) == {4}, seen
    # every device's cache holds the rows its class's representative (row 0) wrote
    k = runner[0].kv.layers[0]["k"]  # [32, kv heads, slots, hd]
    assert torch.equal(k[8], k[0]) and torch.equal(k[31], k[3]) and not torch.equal(k[1], k[0])
    assert k[31].abs().sum() > 0
    ref = _run(_model(qwen3, "N150"))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    seen.clear()
    every = _model(qwen3, "TG", kernels={"attention": attention})
    every.rep.reps = lambda varies: None  # no class: every step on every device
    full = _run(every)
    assert set(seen) == {32}
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_a_weight_one_device_holds_apart_is_not_hidden_by_computing_once(qwen3):
    """Device 5 (row 1, column 1) holds its own, wrong copy of layer 0's q norm: the attention
    its column computes is no longer alike over the rows, so it runs on every device and
    device 5's wrong numbers reach the logits (through the all_reduce over the columns)."""
    good = _run(_model(qwen3, "TG"))
    bad = _model(qwen3, "TG")
    W = bad.w["q_norm"][0].contiguous().clone()  # one copy per device: none shared
    W[5] += 0.5
    bad.w["q_norm"][0] = W
    got = _run(bad)
    assert (got - good).abs().max() > 1e-2


def test_a_dropped_collective_still_gives_wrong_numbers_on_tg(qwen3):
    """q's all_reduce over the rows deleted from the decoder: each row's devices hold a partial
    q, so attention is not alike over the rows and runs on every device, wrongly."""
    import dataclasses as dc
    from ttbundle.program import Op
    good = _run(_model(qwen3, "TG"))
    b, plans = qwen3
    from ttbundle.lower import lower_all
    progs = {}
    for key, p in lower_all(b, plans["TG"][0]).items():
        layers = []
        for lp in p.layers:
            steps = list(lp.steps)
            if lp.kind == "decoder":
                i = next(i for i, s in enumerate(steps) if s.op is Op.ALL_REDUCE and s.act == "q")
                del steps[i]
            layers.append(dc.replace(lp, steps=tuple(steps)))
        progs[key] = dc.replace(p, layers=tuple(layers))
    got = _run(_model(qwen3, "TG", programs=progs))
    assert (got - good).abs().max() > 1e-2


def test_activations_are_dropped_after_their_last_read(qwen3):
    """After every step only the activations a later step reads are held (at most h, q, k, v
    in a decoder layer: never the whole layer's), the hidden state between layers is one copy
    viewed 32 times on TG, and a captured layer output holds device 0's copy alone."""
    from ttbundle.backends.emulated import Runner
    tg = _model(qwen3, "TG")
    most, between = {}, []

    def observe(kind, i, acts):
        live = [n for n, x in acts.items() if isinstance(x, (torch.Tensor, Classes)) and n != "tokens"]
        most[kind] = max(most.get(kind, 0), len(live))
        if kind == "decoder" and i == len(tg.programs[("prefill", 64)].layers[1].steps) - 1:
            between.append(sorted(live))
            h = acts["h"]
            assert h.shape[0] == 32 and h.stride(0) == 0
            assert h.untyped_storage().nbytes() == h[0].numel() * h.element_size()
    tg.observe = observe
    cap: list = []
    with torch.no_grad():
        Runner(tg).prefill(list(range(3, 40)), [1], capture=cap)
    assert most["decoder"] <= 4, most
    assert between and all(b == ["h"] for b in between), between
    assert len(cap[0]) == 3  # the embedding and each layer: the bucket's 64 rows of one device, not 32 devices'
    for x in cap[0]:
        assert x.untyped_storage().nbytes() == 64 * x.shape[-1] * x.element_size()
