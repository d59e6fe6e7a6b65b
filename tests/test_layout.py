"""The layout rule (``ttbundle.layout``) against independent references.

* PyTorch DTensor (``LocalTensorMode`` simulates every rank of a ``DeviceMesh`` in one process):
  where dims divide evenly, every device's shard and every collective's result must be DTensor's.
* Padding and grouped query heads are ttbundle's own rule; there the properties that make a
  layout correct are checked directly: each group holds every element once, a device's query
  heads are exactly those of the KV heads it holds, scatter then gather is the identity.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ttbundle import layout, mesh as meshmod, spec as specmod
from ttbundle.families.base import Dim

logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
MESH_SHAPES = [(1, 1), (1, 2), (2, 1), (1, 8), (2, 4), (4, 2), (4, 8), (8, 4), (2, 3), (3, 2)]
SPECS = [(), ("rows",), ("cols",), ("rows", "cols"), ("cols", "rows")]


def _mesh(shape):
    return meshmod.resolve(f"({shape[0]},{shape[1]})")


# ---- DTensor --------------------------------------------------------------------------------------
@contextlib.contextmanager
def dtensor_mesh(shape):
    """A DTensor ``DeviceMesh`` of ``shape`` with every rank simulated in this process."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    n = shape[0] * shape[1]
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        with warnings.catch_warnings(), LocalTensorMode(n):
            warnings.simplefilter("ignore")
            yield init_device_mesh("cpu", shape, mesh_dim_names=("rows", "cols"))
    finally:
        dist.destroy_process_group()


def dt_placements(spec, partial=()):
    from torch.distributed.tensor import Partial, Replicate, Shard

    conv = {layout.Shard: lambda p: Shard(p.dim), layout.Replicate: lambda p: Replicate(),
            layout.Partial: lambda p: Partial()}
    return [conv[type(p)](p) for p in layout.placements(spec, partial)]


def local_shards(dt) -> dict[int, torch.Tensor]:
    t = dt.to_local()
    if hasattr(t, "_local_tensors"):
        return dict(t._local_tensors)
    return {r: t for r in range(dt.device_mesh.size())}  # the same on every rank (replicated)


def ours(x: torch.Tensor, dims, spec, m, policy) -> list[torch.Tensor]:
    """Each device's shard of ``x`` cut by hand from ``layout.positions`` (no emulated code)."""
    out = []
    for d in range(m.num_devices):
        t = x
        for k, (dim, e) in enumerate(zip(dims, spec)):
            pos = layout.positions(dim, layout.axes_of(e), m, policy)[d]
            t = t.index_select(k, torch.tensor(pos))
        out.append(t)
    return out


@st.composite
def even_cases(draw):
    shape = draw(st.sampled_from(MESH_SHAPES))
    m = _mesh(shape)
    # a 2-D tensor; each dim split over at most the axes the other does not use (DTensor's rule)
    free = ["rows", "cols"]
    spec = []
    for _ in range(2):
        choice = draw(st.sampled_from([(), ("rows",), ("cols",), ("rows", "cols")]))
        choice = tuple(a for a in choice if a in free)
        for a in choice:
            free.remove(a)
        spec.append(choice)
    dims = []
    for e, name in zip(spec, ("hidden_size", "intermediate_size")):
        n = layout.group_size(m, e)
        dims.append(Dim(name, n * draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))))
    return m, shape, tuple(dims), tuple(spec)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_even_shards_and_gathers_equal_dtensor(data):
    """Every device's shard equals DTensor's local shard for the same placements, and gathering
    it back over the spec's axes (the emulated mesh's all_gather) equals DTensor's redistribute
    to Replicate."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from ttbundle.backends.emulated.meshops import MeshOps

    m, shape, dims, spec = data.draw(even_cases())
    pol = specmod.Sharding()
    x = torch.randn([d.length for d in dims])
    mine = ours(x, dims, spec, m, pol)
    ops = MeshOps(m)
    stacked = torch.stack(mine)
    gathered = stacked
    for k, e in enumerate(spec):
        if e:
            gathered = ops.all_gather(gathered, e, k + 1, dims[k], pol)
    with dtensor_mesh(shape) as dm:
        dt = distribute_tensor(x, dm, dt_placements(spec))
        theirs = local_shards(dt)
        full = local_shards(dt.redistribute(dm, [Replicate(), Replicate()]))
    for d in range(m.num_devices):
        torch.testing.assert_close(mine[d], theirs[d], rtol=0, atol=0, msg=f"device {d} spec {spec}")
        torch.testing.assert_close(gathered[d], full[d], rtol=0, atol=0, msg=f"gather device {d} spec {spec}")


@pytest.mark.parametrize("shape", [(1, 2), (2, 4), (8, 4)])
def test_row_parallel_partial_sum_equals_dtensor(shape):
    """``x @ W`` with the contraction dim split over cols leaves a ``Partial()`` sum (DTensor);
    the emulated all_reduce over cols resolves it to DTensor's result on every device."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ttbundle.backends.emulated.meshops import MeshOps
    m = _mesh(shape)
    R, C = shape
    x, w = torch.randn(3, 8 * C), torch.randn(8 * C, 5)
    with dtensor_mesh(shape) as dm:
        y = distribute_tensor(x, dm, [Replicate(), Shard(1)]) @ distribute_tensor(w, dm, [Replicate(), Shard(0)])
        assert [type(p).__name__ for p in y.placements] == ["Replicate", "Partial"]
        want = local_shards(y.redistribute(dm, [Replicate(), Replicate()]))
    pol = specmod.Sharding()
    xs = ours(x, (Dim("t", 3), Dim("hidden_size", 8 * C)), ((), ("cols",)), m, pol)
    ws = ours(w, (Dim("hidden_size", 8 * C), Dim("o", 5)), (("cols",), ()), m, pol)
    partial = torch.stack([a @ b for a, b in zip(xs, ws)])
    got = MeshOps(m).all_reduce(partial, ("cols",))
    for d in range(m.num_devices):
        torch.testing.assert_close(got[d], want[d], rtol=1e-5, atol=1e-5)


def test_placements_say_what_dtensor_cannot():
    assert layout.placements([("rows", "cols"), None]) == (layout.Shard(0), layout.Shard(0))
    assert layout.placements([None, "cols"], partial=("rows",)) == (layout.Partial(), layout.Shard(1))
    with pytest.raises(ValueError, match="strided"):
        layout.placements([("cols", "rows")])
    with pytest.raises(ValueError, match="twice"):
        layout.placements(["rows", "rows"])


# ---- ttbundle's own rules: padding, replicas, grouped heads ----------------------------------------
POLICIES = [specmod.Sharding(kv_heads=k, attention_heads=a, vocab="pad")
            for k in ("replicate", "pad") for a in ("pad", "error")]


@settings(max_examples=150, deadline=None)
@given(shape=st.sampled_from(MESH_SHAPES), axes=st.sampled_from(SPECS),
       name=st.sampled_from(["hidden_size", "vocab_size", "num_key_value_heads"]),
       size=st.integers(1, 70), unit=st.sampled_from([1, 3]), pol=st.sampled_from(POLICIES))
def test_every_group_holds_every_unit_and_gather_restores_it(shape, axes, name, size, unit, pol):
    m = _mesh(shape)
    d = Dim(name, size, unit)
    s = layout.split(d, axes, m, pol)
    if s.error:
        with pytest.raises(ValueError):
            layout.units(d, axes, m, pol)
        return
    us = layout.units(d, axes, m, pol)
    assert all(len(u) == s.per_device for u in us)
    for g in layout.groups(m, axes):
        held = [u for dev in g for u in us[dev] if u >= 0]
        assert set(held) == set(range(size)), (axes, g)
        if not (name == "num_key_value_heads" and s.note and "replicated" in s.note):
            assert len(held) == size  # no unit twice unless replicated
    # gather: the concatenation in group order, re-indexed, is the global dim
    x = np.arange(d.length)
    pos = layout.positions(d, axes, m, pol)
    for g in layout.groups(m, axes):
        cat = np.concatenate([np.where(np.array(pos[dev]) >= 0, x[np.maximum(pos[dev], 0)], -1) for dev in g])
        inv = layout.gather_index(d, axes, m, pol)
        back = cat if inv is None else cat[inv]
        assert back.tolist() == x.tolist()


@settings(max_examples=200, deadline=None)
@given(shape=st.sampled_from(MESH_SHAPES), axes=st.sampled_from(SPECS[1:]), kv=st.integers(1, 9),
       g=st.integers(1, 5), pol=st.sampled_from(POLICIES))
def test_each_device_holds_the_query_heads_of_its_kv_heads(shape, axes, kv, g, pol):
    """The attention kernel groups a device's query heads under its KV heads in order
    (local q head j uses local KV head j // (q_local / kv_local)); that must be the global
    grouping (q head h uses KV head h // g), padding aside."""
    m = _mesh(shape)
    q = Dim("num_attention_heads", kv * g, 4, groups=kv)
    k = Dim("num_key_value_heads", kv, 4)
    sq, sk = layout.split(q, axes, m, pol), layout.split(k, axes, m, pol)
    if sk.error or sq.error:
        return
    qu, ku = layout.units(q, axes, m, pol), layout.units(k, axes, m, pol)
    for dev in range(m.num_devices):
        per = len(qu[dev]) // len(ku[dev])
        assert per * len(ku[dev]) == len(qu[dev])
        for j, h in enumerate(qu[dev]):
            if h >= 0:
                assert ku[dev][j // per] == h // g, (dev, qu[dev], ku[dev])


@pytest.mark.parametrize("mesh,kv,pol,expect", [
    # SmolLM2's 9 query / 3 KV heads: KV padded to the axis, each padded KV head a padded group
    ("N300", 3, "pad", [[0, 1, 2, 3, 4, 5], [6, 7, 8, -1, -1, -1]]),
    ("T3K", 3, "pad", [[0, 1, 2], [3, 4, 5], [6, 7, 8]] + [[-1, -1, -1]] * 5),
    # 2 KV heads replicated over 4 devices: each group of 3 split over 2 replicas, padded to 2+2
    ("(1,4)", 2, "replicate", [[0, 1], [2, -1], [3, 4], [5, -1]]),
])
def test_grouped_query_head_layouts(mesh, kv, pol, expect):
    m = meshmod.resolve(mesh)
    p = specmod.Sharding(kv_heads=pol, attention_heads="pad")
    q = Dim("num_attention_heads", 9 if kv == 3 else 6, 64, groups=kv)
    assert layout.units(q, ("cols",), m, p) == expect
    strict = specmod.Sharding(kv_heads=pol, attention_heads="error")
    assert "sharding.attention_heads: pad" in layout.split(q, ("cols",), m, strict).error


def test_replicated_kv_heads_follow_query_groups():
    m = meshmod.resolve("T3K")
    pos = layout.positions(Dim("num_key_value_heads", 2, 4), ("cols",), m, specmod.Sharding(kv_heads="replicate"))
    # 2 KV heads over 8 devices: devices 0-3 use KV head 0, devices 4-7 head 1
    assert pos == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4


@pytest.mark.parametrize("shape", [(2, 4), (4, 8), (8, 4), (3, 2)])
@pytest.mark.parametrize("axes", [("rows", "cols"), ("cols", "rows")])
def test_gather_sequence_gives_group_order(shape, axes):
    """Per-axis all_gathers (each concatenating over one mesh axis, as ttnn's cluster_axis does)
    in ``gather_sequence`` order leave every device with its group in group order."""
    m = _mesh(shape)
    R, C = shape
    held = {d: [d] for d in range(m.num_devices)}  # which device's shard, in order
    for ax in layout.gather_sequence(axes):
        nxt = {}
        for d in range(m.num_devices):
            r, c = divmod(d, C)
            line = [i * C + c for i in range(R)] if ax == "rows" else [r * C + j for j in range(C)]
            nxt[d] = [s for e in line for s in held[e]]
        held = nxt
    for d in range(m.num_devices):
        assert held[d] == layout.group_of(m, axes, d), (d, held[d])
    # and gathering in spec order instead would not (the bug this rule fixed)
    if R > 1 and C > 1:
        assert list(reversed(layout.gather_sequence(axes))) == list(axes)


@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from(MESH_SHAPES), a0=st.sampled_from(SPECS), a1=st.sampled_from(SPECS),
       pol=st.sampled_from(POLICIES), h=st.integers(1, 6), kv=st.sampled_from([1, 2, 3]))
def test_scatter_then_gather_is_identity(shape, a0, a1, pol, h, kv):
    """Cut every device's shard (build's rule), write them back (package's ``_scatter``): the
    global tensor comes back exactly, whatever the padding."""
    from ttbundle.package.shards import _scatter
    m = _mesh(shape)
    dims = (Dim("hidden_size", h * 2), Dim("num_attention_heads", kv * 2, 3, groups=kv))
    spec = (a0, a1)
    if set(a0) & set(a1) or any(layout.split(d, e, m, pol).error for d, e in zip(dims, spec)):
        return
    x = torch.randn([d.length for d in dims])
    tu = layout.tensor_units(dims, spec, m, pol)
    g = torch.full_like(x, float("nan"))
    for d, shard in enumerate(_padded_shards(x, dims, spec, m, pol)):
        _scatter(g, shard, [u[d] for u in tu], dims)
    assert torch.equal(g, x)


def _padded_shards(x, dims, spec, m, pol):
    out = []
    for d in range(m.num_devices):
        t = x
        for k, (dim, e) in enumerate(zip(dims, spec)):
            pos = torch.tensor(layout.positions(dim, e, m, pol)[d])
            pad = torch.zeros_like(t.narrow(k, 0, 1))
            t = torch.cat([t, pad], k).index_select(k, torch.where(pos < 0, t.shape[k], pos))
        out.append(t)
    return out


# ---- every collective of real programs, on the emulated mesh, against DTensor ------------------------
def _program_collectives():
    from test_emulated import tiny
    from test_emulated_moe import tiny as moe_tiny

    from ttbundle import lower
    from ttbundle.plan.make import make_plan
    out = []
    for fam, b in (("llama", tiny("llama")), ("qwen3", tiny("qwen3")), ("deepseek_v3", moe_tiny("deepseek_v3"))):
        for m in ("N300", "T3K", "TG"):
            p = make_plan(b, m)
            for phase, bucket in (("decode", 8), ("prefill", 32)):
                prog = lower.lower(b, p, phase, bucket)
                for kind, i, st in prog.steps():
                    if st.op.collective:
                        out.append((f"{fam}-{m}-{prog.name}-{kind}-{i}", p.mesh, b.spec.sharding, st))
    return out


PROGRAM_COLLECTIVES = _program_collectives()


def test_program_collectives_cover_every_kind():
    kinds = {(st.op.value, len(st.axes)) for _, _, _, st in PROGRAM_COLLECTIVES}
    assert {("all_reduce", 1), ("all_gather", 1)} <= kinds
    assert len(PROGRAM_COLLECTIVES) > 50


@pytest.mark.parametrize("mesh_name", ["N300", "T3K", "TG"])
def test_every_program_collective_on_the_emulated_mesh_equals_dtensor_redistribute(mesh_name):
    """Each all_gather / all_reduce step of the tiny Llama, Qwen3 and DeepSeek programs (decode
    and prefill), run by the emulated mesh on shards cut by ``layout``, gives what DTensor's
    ``redistribute`` gives for the same placements on every device."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    from ttbundle.backends.emulated.meshops import MeshOps
    cases = [c for c in PROGRAM_COLLECTIVES if c[1].name == mesh_name]
    m = cases[0][1]
    ops = MeshOps(m)
    g = torch.Generator().manual_seed(0)
    ours_side = []  # computed outside the simulated ranks (inside, every tensor is a LocalTensor)
    for label, _, pol, st in cases:
        a = st.ins[0]
        rows, feats = a.shape[0], a.shape[1:]
        spec = ((),) + tuple(a.spec)
        if st.op.value == "all_gather":
            k = st.dim  # the activation dim gathered (0 = rows)
            full = [rows] + [f * layout.group_size(m, ax) for f, ax in zip(feats, a.spec)]
            if st.feature is not None and full[k] != st.feature.length:
                continue  # a padded or replicated dim: ttbundle's own rule (tested above)
            x = torch.randn(full, generator=g)
            dims = tuple(Dim(f"d{i}", n) for i, n in enumerate(full))
            shards = torch.stack(ours(x, dims, spec, m, pol))
            got = ops.all_gather(shards, st.axes, k + 1, st.feature and Dim(st.feature.name, full[k]), pol)
            ours_side.append((label, st, spec, x, got))
        else:
            x = torch.randn(m.num_devices, rows, *feats, generator=g)
            ours_side.append((label, st, spec, x, ops.all_reduce(x, st.axes)))
    results = []
    with dtensor_mesh(tuple(m.shape)) as dm:
        for label, st, spec, x, got in ours_side:
            if st.op.value == "all_gather":
                dt = distribute_tensor(x, dm, dt_placements(spec))
                after = [() if i == st.dim else e for i, e in enumerate(spec)]
                want = local_shards(dt.redistribute(dm, dt_placements(after)))
            else:
                place = list(dt_placements(spec))
                for ax in st.axes:
                    place[("rows", "cols").index(ax)] = Partial()
                d = DTensor.from_local(LocalTensor({r: x[r] for r in range(m.num_devices)}), dm, place,
                                       run_check=False)
                want = local_shards(d.redistribute(dm, [Replicate() if isinstance(p, Partial) else p
                                                        for p in place]))
            results.append((label, got, {r: want[r].clone() for r in want}))
    for label, got, want in results:  # compared outside the simulated ranks
        for dev in range(m.num_devices):
            torch.testing.assert_close(got[dev], want[dev], rtol=1e-5, atol=1e-5,
                                       msg=lambda s, dev=dev: f"{label} device {dev}: {s}")
    assert len(results) >= len(cases) // 2, (len(results), len(cases))
