"""The recording double computes (``backends/ttnn/recording.py`` + ``numerics.py``), checked
against independent references:

* PyTorch DTensor (``LocalTensorMode``: every rank of a ``DeviceMesh`` in one process) for
  every collective and partition the ttnn lowering emits: on synthetic steps over random meshes
  and placements (hypothesis), and on every collective step of real Llama / Qwen3 programs on
  N300, T3K and TG. The per-device inputs are cut by ``layout.positions``.
* torch for the ops (matmul, rms_norm, softmax, rope, topk...), as ttnn's docstrings define them.
* the emulated backend for whole lowered forwards of tiny packages (Llama on T3K and TG, padded
  9/3 heads, block-float weights and KV cache, GPT-OSS, DeepSeek-V3).

Mutations the checks must catch: the 2-axis gather in spec order (the bug ``layout.gather_sequence``
fixed), partitions in the wrong order, a deleted all_reduce (one step's calls, and a package
program's step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from test_layout import MESH_SHAPES, _mesh, dt_placements, dtensor_mesh, local_shards
from ttbundle import layout, lower as lowermod, spec as specmod
from ttbundle.plan.make import make_plan
from ttbundle.plan.sharding import target_mesh
from ttbundle.backends.ttnn import device, lowering, numerics, recording
from ttbundle.backends.ttnn import model as ttmodel
from ttbundle.backends.ttnn.calls import Call, Forward, Layer, T
from ttbundle.families.base import Dim
from ttbundle.mesh import AXES
from ttbundle.program import Activation, Op, Step

BUNDLES = Path(__file__).resolve().parent.parent / "bundles"
POLICY = specmod.Sharding()


# ---- running calls on the double -----------------------------------------------------------------
def double(mesh_shape, **kw):
    rec = recording.Recorder(**kw)
    tt = rec.module()
    ex = device.Executor(tt, tt.open_mesh_device(tt.MeshShape(*mesh_shape)))
    ex.on_call = rec.on_call
    return rec, tt, ex


def run_calls(mesh, calls: list[Call], inputs: dict[str, list[np.ndarray]], out: str) -> list[np.ndarray]:
    """``calls`` through the backend's executor on the double; ``out``'s per-device arrays."""
    rec, _, ex = double(mesh.shape, max_elements=1 << 28)
    for name, arrays in inputs.items():
        ex.env[name] = rec.tensor(arrays)
    res = ex.run(Forward("decode", 0, 0, {}, [Layer("step", None, list(calls))], [out]))
    assert rec.op_errors == [] and rec.shape_mismatches == [], rec.op_errors + rec.shape_mismatches
    return res[out].arrays()


def to_tt(a: torch.Tensor) -> np.ndarray:
    """A program activation ``[rows, f]`` / ``[rows, E, f]`` as its 4-D ttnn tensor (``tt_shape``)."""
    a = a.numpy()
    return a[None, None] if a.ndim == 2 else a.transpose(1, 0, 2)[None]


def from_tt(a: np.ndarray, rank: int) -> np.ndarray:
    return a[0, 0] if rank == 2 else a[0].transpose(1, 0, 2)


def differences(what: str, got: list[np.ndarray], want: dict[int, torch.Tensor], ref: str) -> list[str]:
    out = []
    for d, g in enumerate(got):
        w = want[d].numpy()
        if g.shape != w.shape:
            out.append(f"{what}: device {d} holds {g.shape}, {ref} {w.shape}")
        elif not np.array_equal(g, w):
            at = tuple(int(i) for i in np.argwhere(g != w)[0])
            out.append(f"{what}: device {d} differs from {ref} at {at}: {g[at]} != {w[at]}")
    return out


def typed(st: dict) -> Step:
    """A collective step as the program JSON writes it (what these tests describe), as the typed
    IR step the lowering takes."""
    f = st.get("feature")
    return Step(Op(st["collective"]), (Activation(st["act"], tuple(st["shape"])),), axes=tuple(st["axes"]),
                dim=st["dim"], devices=int(st.get("devices", 1)),
                feature=None if f is None else Dim(f["name"], int(f["size"]), int(f["unit"]), int(f.get("groups", 0))))


def check_step(mesh, st: dict, calls: list[Call] | None = None, seed: int = 0, where: str = "",
               policy=POLICY) -> list[str]:
    """Run collective step ``st``'s lowered calls (default: ``lowering.collective_calls``) on the
    double and compare every device's result with DTensor's ``redistribute`` of the same global
    activation (a padded gathered dim, which DTensor cannot say: with the global activation
    itself). Returns the differences, each naming the activation, the step and the device."""
    calls = lowering.collective_calls(mesh, typed(st), policy) if calls is None else calls
    g = torch.Generator().manual_seed(seed)
    shape, axes, rank = list(st["shape"]), tuple(st["axes"]), len(st["shape"])
    D = mesh.num_devices
    n = layout.group_size(mesh, axes)
    what = f"{where}{st['collective']} of {st['act']} over {axes} (dim {st['dim']}) on {mesh.describe()}"
    if st["collective"] == "all_gather":
        k = st["dim"]
        glob = list(shape)
        glob[k] *= n
        f = st.get("feature")
        dim = Dim(f["name"], f["size"], f["unit"], f.get("groups", 0)) if f else Dim("act", glob[k])
        padded = dim.length != glob[k]
        glob[k] = dim.length
        x = torch.randint(-8, 8, glob, generator=g).float()  # integers: every sum is exact
        pos = torch.tensor(layout.positions(dim, axes, mesh, policy))
        zero = torch.zeros_like(x.narrow(k, 0, 1))
        shards = [torch.cat([x, zero], k).index_select(k, torch.where(pos[d] < 0, dim.length, pos[d]))
                  for d in range(D)]
        spec = [axes if i == k else () for i in range(rank)]
        try:
            placements = None if padded else dt_placements(spec)
        except ValueError:  # ("cols", "rows"): DTensor needs a strided shard; the result is x itself
            placements = None
        if placements is None:
            want, ref = {d: x for d in range(D)}, "the global activation"
        else:
            from torch.distributed.tensor import Replicate, distribute_tensor
            with dtensor_mesh(mesh.shape) as dm:
                dt = distribute_tensor(x, dm, placements)
                theirs = local_shards(dt)
                want = local_shards(dt.redistribute(dm, [Replicate(), Replicate()]))
            bad = differences(f"{what} (input shards)", [s.numpy() for s in shards], theirs, "DTensor's shard")
            assert not bad, bad  # layout.positions is DTensor's split (tests/test_layout.py)
            ref = "DTensor's redistribute"
    else:  # a pending sum over axes; any other axis holds its own part of the last dim
        from torch.distributed._local_tensor import LocalTensor
        from torch.distributed.tensor import DTensor, Replicate
        shards = [torch.randint(-8, 8, shape, generator=g).float() for _ in range(D)]
        others = tuple(a for a in AXES if a not in axes and mesh.axis_size(a) > 1)
        spec = [() for _ in range(rank - 1)] + [others]
        with dtensor_mesh(mesh.shape) as dm:
            dt = DTensor.from_local(LocalTensor(dict(enumerate(shards))), dm, dt_placements(spec, axes),
                                    run_check=False)
            want = local_shards(dt.redistribute(dm, dt_placements(spec)))
        ref = "DTensor's redistribute"
    got = run_calls(mesh, calls, {st["act"]: [to_tt(s) for s in shards]}, st["act"])
    return differences(what, [from_tt(a, rank) for a in got], want, ref)


# ---- the double's primitives ---------------------------------------------------------------------
def test_collectives_follow_cluster_axis_lines():
    """ttnn's docstrings: all_gather / all_reduce / mesh_partition along ``cluster_axis`` act on
    the devices of one mesh column (0) or row (1); None spans the mesh. Here on a 2x4 mesh with
    device d holding the value d."""
    xs = [np.full((1, 1, 1, 1), float(d), np.float32) for d in range(8)]
    gather = numerics.all_gather((2, 4), xs, 3, cluster_axis=0)
    assert [g.ravel().tolist() for g in gather][:2] == [[0, 4], [1, 5]] and gather[6].ravel().tolist() == [2, 6]
    gather = numerics.all_gather((2, 4), xs, 3, cluster_axis=1)
    assert gather[5].ravel().tolist() == [4, 5, 6, 7]
    assert numerics.all_gather((2, 4), xs, 3)[3].ravel().tolist() == list(range(8))
    red = numerics.all_reduce((2, 4), xs, cluster_axis=0)
    assert [float(r.ravel()[0]) for r in red] == [4, 6, 8, 10] * 2
    rows = [np.arange(8, dtype=np.float32).reshape(1, 1, 1, 8)] * 8
    part = numerics.mesh_partition((2, 4), rows, 3, cluster_axis=1)
    assert [p.ravel().tolist() for p in part[4:]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    scat = numerics.reduce_scatter((2, 4), rows, 3, cluster_axis=1)
    assert scat[1].ravel().tolist() == [8, 12]


@pytest.mark.parametrize("shape", [(2, 4), (4, 8), (1, 2)])
@pytest.mark.parametrize("dims", [(0, 1), (1, 0), (None, 1), (0, None), (1, 1)])
def test_shard_tensor_2d_mesh_is_dtensors_shard_and_concat_inverts_it(shape, dims):
    """``ShardTensor2dMesh(dims=(row_dim, col_dim))`` through the double equals DTensor's
    ``distribute_tensor`` with ``[Shard(row_dim), Shard(col_dim)]``; ``ConcatMesh2dToTensor``
    (``aggregate_tensor``) gives the tensor back."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    R, C = shape
    x = torch.randn(R * C * 2, R * C * 3)
    rec, tt, ex = double(shape)
    dev = ex.device
    host = tt.Tensor(x.numpy(), tt.float32, None, tt.ROW_MAJOR_LAYOUT)
    mapper = tt.ShardTensor2dMesh(dev, mesh_shape=shape, dims=dims)
    t = tt.to_device(tt.distribute_tensor(host, mapper, dev), dev)
    with dtensor_mesh(shape) as dm:
        placements = [Replicate() if d is None else Shard(d) for d in dims]
        want = local_shards(distribute_tensor(x, dm, placements))
    assert not differences(f"ShardTensor2dMesh{dims}", t.arrays(), want, "DTensor's shard")
    if None not in dims and dims[0] != dims[1]:
        back = tt.aggregate_tensor(tt.from_device(t), tt.ConcatMesh2dToTensor(dev, mesh_shape=shape, dims=dims))
        np.testing.assert_array_equal(back.to_numpy(), x.numpy())


def test_host_tensors_replicate_load_and_read_back(tmp_path):
    """``ttnn.Tensor`` rounds to its dtype; the replicate mapper copies to every device;
    ``from_host_shards`` joins per-device files that ``load_tensor`` reads (a ``.tensorbin``
    written by ttbundle.tensorbin, TILE bf16 and bfp8); ``get_device_tensors`` splits them."""
    from ttbundle import blockfloat, tensorbin
    from ttbundle.backends.ttnn import cache
    rec, tt, ex = double((1, 2))
    dev = ex.device
    x = np.array([[1.0, 1.00390625 + 2 ** -9]], np.float32)
    h = tt.Tensor(x, tt.bfloat16, None, tt.ROW_MAJOR_LAYOUT)
    assert h.to_numpy().tolist() == torch.tensor(x).bfloat16().float().tolist()
    rep = tt.distribute_tensor(h, tt.replicate_tensor_to_mesh_mapper(dev), None)
    assert [a.tolist() for a in rep.arrays()] == [h.to_numpy().tolist()] * 2
    w = [torch.randn(40, 70) for _ in range(2)]
    for d in range(2):
        bits = w[d].bfloat16().view(torch.int16).numpy().view(np.uint16)
        tensorbin.write(tmp_path / f"w{d}.tensorbin", cache.tilize(bits), [40, 70], "bf16", "TILE")
        tensorbin.write(tmp_path / f"q{d}.tensorbin", blockfloat.encode(w[d], "bfp8"), [40, 70], "bfp8", "TILE")
    for kind, ref in (("w", lambda a: a.bfloat16().float()), ("q", lambda a: blockfloat.quantize(a, "bfp8"))):
        shards = [tt.load_tensor(str(tmp_path / f"{kind}{d}.tensorbin")) for d in range(2)]
        t = tt.to_device(tt.from_host_shards(shards, tt.MeshShape(1, 2)), dev)
        for d, part in enumerate(tt.get_device_tensors(tt.from_device(t))):
            np.testing.assert_array_equal(part.to_numpy(), ref(w[d]).numpy(), err_msg=f"{kind} device {d}")


def _tt(rec, *arrays):
    return [rec.tensor([np.asarray(a, np.float32)]) for a in arrays]


def test_ops_follow_torch():
    """Each op the lowering emits against its torch definition (one device)."""
    from ttbundle import tables
    from ttbundle.backends.emulated import kernels
    rec, tt, _ = double((1, 1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 2, 8, 64, generator=g), torch.randn(1, 2, 64, 16, generator=g)
    w = torch.randn(64, generator=g)
    tx, ty = _tt(rec, x, y)
    f32 = tt.float32

    def same(t, ref, tol=1e-5):
        np.testing.assert_allclose(t.arrays()[0], ref.numpy(), rtol=tol, atol=tol)

    same(tt.matmul(tx, ty, dtype=f32), x @ y)
    same(tt.matmul(tx, tx, transpose_b=True, dtype=f32), x @ x.transpose(-1, -2), 1e-4)
    same(tt.add(tx, 2.0, dtype=f32), x + 2)
    same(tt.multiply(tx, tx, dtype=f32), x * x)
    same(tt.silu(tx, dtype=f32), torch.nn.functional.silu(x))
    same(tt.gelu(tx, fast_and_approximate_mode=True, dtype=f32), torch.nn.functional.gelu(x, approximate="tanh"))
    same(tt.softmax(tx, -1, dtype=f32), torch.softmax(x, -1))
    same(tt.sum(tx, 3, True, dtype=f32), x.sum(3, keepdim=True), 1e-4)
    same(tt.permute(tx, [0, 2, 1, 3]), x.permute(0, 2, 1, 3))
    same(tt.transpose(tx, 1, 2), x.transpose(1, 2))
    same(tt.reshape(tx, [1, 1, 16, 64]), x.reshape(1, 1, 16, 64))
    same(tt.slice(tx, [0, 0, 2, 0], [1, 2, 6, 32], [1, 1, 1, 1]), x[:, :, 2:6, :32])
    same(tt.concat([tx, tx], 3), torch.cat([x, x], 3))
    same(tt.repeat(tx, [1, 3, 1, 1]), x.repeat(1, 3, 1, 1))
    same(tt.repeat_interleave(tx, 2, 1), x.repeat_interleave(2, 1))
    same(tt.experimental.nlp_concat_heads(tx), x.transpose(1, 2).reshape(1, 1, 8, 128))
    held = torch.cat([w, torch.zeros(32 * 2 - 64)]).reshape(1, 1, 2, 32)  # a vector as rows of 32
    (tw,) = _tt(rec, held)
    same(tt.rms_norm(tx, epsilon=1e-5, weight=tw), kernels.rms_norm(x, w, 1e-5), 1e-4)
    pos = torch.arange(8)
    cos, sin = tables.rope_cos_sin(pos, 64, 10000.0, None, torch.float32)
    tc, ts = _tt(rec, cos.reshape(1, 1, 8, 64), sin.reshape(1, 1, 8, 64))
    same(tt.experimental.rotary_embedding_hf(tx, tc, ts, is_decode_mode=False),
         kernels.apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2), 1e-5)  # its x is [D, T, heads, dim]
    v, i = tt.topk(tx, 4, 3, True, True)
    tv, ti = torch.topk(x, 4, 3)
    same(v, tv)
    assert i.arrays()[0].astype(np.int64).tolist() == ti.tolist()
    ids = rec.tensor([np.array([[3, 0, 5]], np.uint32)], dtype="uint32")
    (table,) = _tt(rec, torch.arange(60.0).reshape(6, 10))
    same(tt.embedding(ids, table, dtype=f32), torch.arange(60.0).reshape(6, 10)[torch.tensor([[3, 0, 5]])])
    b = tt.typecast(tx, tt.bfloat16)
    assert b.dtype == "bfloat16" and np.array_equal(b.arrays()[0], x.bfloat16().float().numpy())


def test_an_op_it_does_not_model_is_unknown_and_refuses_reads():
    rec, tt, _ = double((1, 2))
    (x,) = [rec.tensor([np.ones((1, 1, 2, 2), np.float32)] * 2)]
    y = tt.experimental.some_fused_kernel(x)
    z = tt.add(y, 1.0)
    assert not z.known and "ttnn.experimental.some_fused_kernel is not computed by the double" in z.why
    with pytest.raises(recording.UnknownValue, match="some_fused_kernel is not computed"):
        tt.get_device_tensors(tt.from_device(z))[0].to_numpy()
    lax = recording.Recorder(unknown_reads="zeros")
    t = lax.module().experimental.some_fused_kernel(lax.tensor([np.ones((2, 2))]))
    assert t.to_numpy().shape == (1,) and lax.zero_reads and "not computed" in lax.zero_reads[0][1]


def test_a_trace_computes_at_replay_on_the_inputs_written_then():
    """Ops inside a capture compute nothing then (as a device); each execute_trace replays them
    on the input buffer's current contents."""
    rec, tt, ex = double((1, 2))
    dev = ex.device
    buf = tt.allocate_tensor_on_device(tt.Shape([1, 1, 1, 4]), tt.float32, tt.ROW_MAJOR_LAYOUT, dev,
                                       tt.DRAM_MEMORY_CONFIG)
    assert not buf.known and "never written" in buf.why
    tid = tt.begin_trace_capture(dev)
    out = tt.multiply(buf, 3.0)
    tt.end_trace_capture(dev, tid)
    assert not out.known and "computed at its execute_trace" in out.why
    for v in (1.0, 2.0):
        host = tt.Tensor(np.full((1, 1, 1, 4), v, np.float32), tt.float32, None, tt.ROW_MAJOR_LAYOUT)
        tt.copy_host_to_device_tensor(tt.distribute_tensor(host, tt.replicate_tensor_to_mesh_mapper(dev), None), buf)
        tt.execute_trace(dev, tid, blocking=False)
        assert [a.ravel().tolist() for a in out.arrays()] == [[3 * v] * 4] * 2


def test_paged_cache_and_decode_attention_follow_the_emulated_kernel():
    """paged_update_cache writes each row at its position through the page table;
    paged SDPA decode attends positions 0..cur_pos (GQA) as a plain softmax(q k^T * scale) v."""
    rng = np.random.default_rng(0)
    blocks, kvh, bs, hd, H, B = 4, 2, 4, 8, 4, 2
    cache_k = np.full((blocks, kvh, bs, hd), np.nan, np.float32)
    cache_v = cache_k.copy()
    pt = np.array([[2, 0], [1, 3]], np.int32)
    ks, vs = rng.standard_normal((B, 6, kvh, hd)), rng.standard_normal((B, 6, kvh, hd))
    for p in range(6):
        cur = np.array([p, p if p < 3 else -1])
        numerics.paged_update_cache(cache_k, ks[:, p][None], cur, pt)
        numerics.paged_update_cache(cache_v, vs[:, p][None], cur, pt)
    q = rng.standard_normal((1, B, H, hd)).astype(np.float32)
    cur = np.array([5, 2])
    out = numerics.paged_sdpa_decode(q, cache_k, cache_v, pt, cur, scale=0.3)
    for b, p in enumerate(cur):
        k = torch.tensor(ks[b, :p + 1]).float().repeat_interleave(H // kvh, 1)  # [L, H, d]
        v = torch.tensor(vs[b, :p + 1]).float().repeat_interleave(H // kvh, 1)
        s = torch.einsum("hd,lhd->hl", torch.tensor(q[0, b]), k) * 0.3
        want = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
        np.testing.assert_allclose(out[0, b], want.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"row {b}")


# ---- collectives and partitions against DTensor ------------------------------------------------------
GATHER_AXES = [("rows",), ("cols",), ("rows", "cols"), ("cols", "rows")]


@st.composite
def collective_steps(draw):
    shape = draw(st.sampled_from(MESH_SHAPES[:8]))  # 1x1 ... 8x4
    m = _mesh(shape)
    kind = draw(st.sampled_from(["all_gather", "all_reduce"]))
    axes = draw(st.sampled_from(GATHER_AXES if kind == "all_gather" else [("rows",), ("cols",), ("rows", "cols")]))
    rank = draw(st.sampled_from([2, 3]))
    local = [draw(st.integers(1, 3)) * 2 for _ in range(rank)]
    dim = draw(st.integers(0, rank - 1)) if kind == "all_gather" else None
    step = {"collective": kind, "act": "x", "axes": list(axes), "dim": dim, "shape": local,
            "devices": layout.group_size(m, axes)}
    return m, step


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=collective_steps(), seed=st.integers(0, 2 ** 16))
def test_every_lowered_collective_equals_dtensor_redistribute(case, seed):
    m, step = case
    assert check_step(m, step, seed=seed) == []


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(MESH_SHAPES[:8]), axes=st.sampled_from(GATHER_AXES), dim=st.integers(2, 3),
       seed=st.integers(0, 2 ** 16))
def test_every_lowered_partition_gives_each_device_its_shard(shape, axes, dim, seed):
    """``mesh_partition`` calls of the lowering (matmul inputs, MoE routes) on a replicated
    tensor leave each device the shard ``layout.positions`` says, which is DTensor's shard."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    m = _mesh(shape)
    n = layout.group_size(m, axes)
    x = torch.randn([1, 1, 4, 2 * n] if dim == 3 else [1, 1, 2 * n, 4], generator=torch.Generator().manual_seed(seed))
    got = run_calls(m, lowering.partition_calls(m, "x", x.shape, dim, axes, "x.p"),
                    {"x": [x.numpy()] * m.num_devices}, "x" if n == 1 else "x.p")
    pos = layout.positions(Dim("act", x.shape[dim]), axes, m, POLICY)
    want = {d: x.index_select(dim, torch.tensor(pos[d])) for d in range(m.num_devices)}
    assert differences(f"partition over {axes} on {shape}", got, want, "layout.positions") == []
    spec = [axes if i == dim else () for i in range(4)]
    if axes != ("cols", "rows"):
        with dtensor_mesh(shape) as dm:
            whole = distribute_tensor(x, dm, [Replicate(), Replicate()])
            theirs = local_shards(whole.redistribute(dm, dt_placements(spec)))
        assert differences(f"partition over {axes} on {shape}", got, theirs, "DTensor's shard") == []


def test_a_two_axis_gather_in_spec_order_gives_wrong_numbers(monkeypatch):
    """Mutation: gathering over rows then cols (the spec order; what the lowering did before
    ``layout.gather_sequence``) leaves device (r, c) the group in order c*R + r. The double's
    numbers then differ from DTensor's, and the report names the activation and the device."""
    m = _mesh((2, 4))
    step = {"collective": "all_gather", "act": "h", "axes": ["rows", "cols"], "dim": 1, "shape": [4, 6], "devices": 8}
    assert check_step(m, step) == []
    monkeypatch.setattr(lowering.layout, "gather_sequence", lambda axes: layout.axes_of(axes))
    bad = check_step(m, step)
    assert bad and all("all_gather of h over ('rows', 'cols')" in b and "differs from DTensor's redistribute" in b
                       for b in bad)
    assert any(b.split(": device ")[1].startswith("0 ") for b in bad)  # every device, device 0 included
    assert len(bad) == 8


def test_partitions_in_the_wrong_order_give_wrong_shards(monkeypatch):
    m = _mesh((2, 4))
    x = torch.arange(1 * 1 * 2 * 16.0).reshape(1, 1, 2, 16)
    monkeypatch.setattr(lowering.layout, "partition_sequence", lambda axes: tuple(reversed(layout.axes_of(axes))))
    calls = lowering.partition_calls(m, "x", x.shape, 3, ("rows", "cols"), "x.p")
    got = run_calls(m, calls, {"x": [x.numpy()] * 8}, "x.p")
    pos = layout.positions(Dim("act", 16), ("rows", "cols"), m, POLICY)
    bad = differences("partition of x", got, {d: x.index_select(3, torch.tensor(pos[d])) for d in range(8)},
                      "layout.positions")
    assert len(bad) == 6 and "device 1 differs" in bad[0]  # devices 0 and 7 hold the same part either way


# ---- every collective step of real programs ---------------------------------------------------------
def program_steps(bundle, p, key):
    """(layer index, kind, step, the calls lower_forward emitted for it) for every collective
    step of the forward ``key``; the calls are checked to be ``collective_calls`` of the step."""
    ir = lowermod.lower(bundle, p, *key)
    prog = ir.to_json()
    fw = lowering.lower_forward(bundle, p.mesh, ir)
    kinds = {k["kind"]: [s for s in k["steps"] if "collective" in s] for k in prog["layers"]}
    policy = lowering.program_policy(ir, bundle)
    out = []
    for layer in fw.layers:
        calls = [c for c in layer.calls if c.op in ("all_reduce", "all_gather")]
        i = 0
        for step in kinds[layer.kind]:
            want = lowering.collective_calls(p.mesh, typed(step), policy)
            assert calls[i:i + len(want)] == want, (layer.kind, step)
            out.append((layer.index, layer.kind, step, calls[i:i + len(want)], policy))
            i += len(want)
        assert i == len(calls)
    return out


def _bundle(name: str):
    if name == "tiny-llama":  # the tests' tiny model: vocab 500 padded to 512, KV heads replicated
        from test_build import spec_text as tiny
        return specmod.loads(tiny(), "tiny.yaml")
    return specmod.load(BUNDLES / f"{name}.yaml")


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b", "tiny-llama"])
@pytest.mark.parametrize("mesh", ["N300", "T3K", "TG"])
def test_every_program_collective_equals_dtensor_redistribute(name, mesh):
    """The decode program's collective steps (and the smallest prefill's for the tiny model;
    every layer's, one check per distinct step) as lowered, run on the double, equal DTensor's
    redistribute of the same global activation."""
    bundle = _bundle(name)
    p = make_plan(bundle, mesh)
    ts = lowermod.trace_set(bundle)
    keys = [min(k for k in ts if k[0] == phase) for phase in ("decode", "prefill")[:2 if name == "tiny-llama" else 1]]
    steps = [(key, *s) for key in keys for s in program_steps(bundle, p, key)]
    assert steps, "no collective on a multi-chip mesh"
    seen, bad = set(), []
    for key, index, kind, step, calls, policy in steps:
        sig = (kind, step["collective"], step["act"], tuple(step["axes"]), step["dim"], tuple(step["shape"]), key[0])
        if sig in seen:
            continue
        seen.add(sig)
        bad += check_step(p.mesh, step, calls, where=f"{name} {key[0]}-{key[1]} layer {index} ({kind}): ",
                          policy=policy)
    assert bad == []
    if name == "tiny-llama" and mesh != "N300":  # vocab 500 over 8-wide axes: padded to 512 at the end
        assert any(s[2] == "logits" and s[3] == ("cols",) for s in seen)
        padded = [st for *_, st, _, _ in steps
                  if st.get("feature") and st["feature"]["size"] != st["shape"][1] * st["devices"]]
        assert padded and bad == []
    if mesh == "TG":
        assert {s[1:4] for s in seen} >= {("all_reduce", "q", ("rows",)), ("all_gather", "logits", ("cols",))}


def test_a_deleted_all_reduce_is_caught():
    """Mutation: drop the lowered all_reduce of one step (TG's row-parallel q projection): the
    report names the step, the activation and the devices whose numbers are wrong."""
    bundle = specmod.load(BUNDLES / "llama-3.1-8b.yaml")
    p = make_plan(bundle, "TG")
    index, kind, step, calls, _ = next(s for s in program_steps(bundle, p, ("decode", 1))
                                       if s[2]["collective"] == "all_reduce")
    assert check_step(p.mesh, step, calls) == []
    bad = check_step(p.mesh, step, [], where=f"layer {index} ({kind}): ")
    assert len(bad) == 32 and bad[0].startswith(f"layer {index} ({kind}): all_reduce of {step['act']}")


# ---- a whole lowered forward, numerically ------------------------------------------------------------
from test_build import ckpt, spec_text  # noqa: E402,F401  (ckpt: the shared tiny checkpoint fixture)


def ttnn_package(ckpt, tmp_path_factory, mesh: str) -> Path:  # noqa: F811
    from ttbundle import build as buildmod
    d = tmp_path_factory.mktemp(mesh)
    (d / "spec.yaml").write_text(spec_text(ckpt))
    res = buildmod.build(specmod.load(d / "spec.yaml"), mesh, d / "out", backend="ttnn", warmup=False)
    return Path(res.package)


@pytest.fixture(scope="module")
def t3k_package(ckpt, tmp_path_factory):  # noqa: F811
    return ttnn_package(ckpt, tmp_path_factory, "T3K")


def forward_differences(pkg: Path, prompt: list[int], steps: int, rel: float = 0.03) -> list[str]:
    """A prompt's prefill, then ``steps`` greedy decodes, through the ttnn lowering of the
    package's own programs on the double (weights from its tensorbin caches, every forward warmed,
    captured and replayed) and through the emulated backend on the same weights. One line per
    forward whose logits differ by more than ``rel`` of the largest logit (bf16 level), whose
    greedy token differs (unless the reference ranks it within that difference of its best: a
    near tie bf16 may flip), or whose on-device sampled token is not the greedy one."""
    from ttbundle.package.load import LoadedPackage, load_package
    from ttbundle.backends.emulated import EmulatedModel, Runner
    rec = recording.Recorder()
    pk = load_package(pkg)
    r = ttmodel.open_model(rec.module(), pk, "all", host_fallback=True)
    r.warmup()
    r.capture()
    emu = Runner(EmulatedModel.from_package(pk, dtype=torch.float32))  # its programs as typed IR
    blocks = list(range(emu.max_blocks))
    bs, V = pk.bundle.spec.runtime.kv_block_size, pk.bundle.arch.vocab_size
    bad = []

    def tie(tok, want, diff):  # a token the reference ranks within the logits' difference of its best
        return want.max() - want[tok] <= 2 * diff

    def compare(what, key, inputs, want, row):
        got = r.read(r.run(key, inputs(r.forwards[key]))["logits.out"]).reshape(-1, V)[row]
        diff, top = float(np.abs(got - want).max()), float(np.abs(want).max())
        tok = int(np.argmax(got))
        if not diff <= rel * top or not tie(tok, want, diff):
            bad.append(f"{what} {key[:2]}: logits differ from the emulated backend by {diff:.3g} "
                       f"(largest logit {top:.3g}); greedy token {tok} vs {int(np.argmax(want))}")
        sampled = (*key[:2], "device", 0)
        if key[0] == "decode" and sampled in r.forwards:
            out = r.read(r.run(sampled, inputs(r.forwards[sampled]))["next_tokens"])
            tok = int(np.asarray(out).reshape(-1)[0])
            if tok != int(np.argmax(got)) and not tie(tok, want, diff):
                bad.append(f"{what} {sampled[:3]}: sampled token {tok}, greedy {int(np.argmax(want))}")

    pre = min(k for k in r.forwards if k[0] == "prefill" and k[2] == "host" and k[1] >= len(prompt))
    fw = r.forwards[pre]
    with torch.no_grad():
        want = emu.prefill(prompt, blocks).numpy()
        compare("prefill", pre, lambda f: device.prefill_inputs(f, prompt, bs), want,
                (len(prompt) - 1) % fw.inputs["last_rows"][0][2])
        dec = min(k for k in r.forwards if k[0] == "decode" and k[2] == "host")
        pos, tok = len(prompt), int(np.argmax(want))
        for i in range(steps):  # teacher-forced by the emulated tokens: errors do not compound
            want = emu.decode([tok], [pos], [blocks])[0].numpy()
            compare(f"decode {i} (position {pos})", dec, lambda f: device.decode_inputs(f, tok, pos), want, 0)
            pos, tok = pos + 1, int(np.argmax(want))
    bad += rec.op_errors + rec.shape_mismatches + rec.violations
    return bad


def test_a_lowered_forward_on_t3k_equals_the_emulated_backend(t3k_package):
    """A tiny Llama's package on T3K: the ttnn lowering's prefill and decodes, computed on the
    double (collectives, partitions, paged KV cache, SDPA, sampling), give the emulated backend's
    logits to bf16 level and its greedy tokens."""
    assert forward_differences(t3k_package, [5, 17, 99, 3, 250, 42, 7], 3) == []


def test_a_lowered_forward_on_tg_equals_the_emulated_backend(ckpt, tmp_path_factory):  # noqa: F811
    """The same on TG (4x8): row-parallel sums over the rows, gathers over both axes' lines."""
    pkg = ttnn_package(ckpt, tmp_path_factory, "TG")
    assert forward_differences(pkg, [5, 17, 99, 3, 250, 42, 7, 11, 300], 2) == []


def test_a_deleted_all_reduce_step_breaks_the_forward(t3k_package, monkeypatch):
    """Mutation: the decode program the ttnn lowering reads (``lower_forward``'s typed program)
    without its first decoder all_reduce (the attention output's row-parallel sum over the 8
    chips); the emulated reference runs the package's intact program. Every decode's numbers are
    wrong, and the report says which forward."""
    import dataclasses
    lower_forward, dropped = ttmodel.lower_forward, []

    def without_all_reduce(bundle, mesh, prog, *a, **k):
        if prog.phase == "decode":
            layers = list(prog.layers)
            for j, lp in enumerate(layers):
                steps = list(lp.steps)
                i = next((i for i, s in enumerate(steps) if s.op is Op.ALL_REDUCE), None)
                if i is not None:
                    dropped.append(steps.pop(i).act)
                    layers[j] = dataclasses.replace(lp, steps=tuple(steps))
                    break
            prog = dataclasses.replace(prog, layers=tuple(layers))
        return lower_forward(bundle, mesh, prog, *a, **k)
    monkeypatch.setattr(ttmodel, "lower_forward", without_all_reduce)
    bad = forward_differences(t3k_package, [5, 17, 99, 3, 250, 42, 7], 2)
    assert dropped and set(dropped) == {"attn_out"}
    assert [b.split(":")[0] for b in bad if "logits differ" in b] == \
        ["decode 0 (position 7) ('decode', 1)", "decode 1 (position 8) ('decode', 1)"]


def test_the_ttnn_path_runs_the_package_without_a_planner(t3k_package, monkeypatch):
    """Nothing after ``lower`` re-plans: with the planner gone (``make_plan``, ``kv_blocks``
    raise), the package still loads, lowers (every weight's PartitionSpec and shape, the KV dtype
    and block size, the mesh and trace region from its programs and manifest) and gives the
    emulated backend's numbers on the double. Before, ``open_model`` lowered ``pkg.plan``, a
    re-plan of bundle.yaml."""
    from ttbundle.plan import make as planmake

    def no_planner(*a, **k):
        raise AssertionError("re-planned at run time")
    monkeypatch.setattr(planmake, "make_plan", no_planner)
    monkeypatch.setattr(planmake, "kv_blocks", no_planner)
    assert forward_differences(t3k_package, [5, 17, 99, 3, 250, 42, 7], 1) == []


def _mutated(src: Path, tmp: Path) -> Path:
    import shutil
    dst = tmp / src.name
    shutil.copytree(src, dst)
    return dst


def _set_spec(name: str, spec: list):
    def edit(prog):
        prog["weights"][name]["spec"] = spec
    return edit


def _set_kv_dtype(prog):
    prog["kv_cache"]["dtype"] = "bfp8"


def _swap_w1(d):  # w1 row-parallel instead of column-parallel: a placement the programs do not run
    d["sharding"]["plan"]["w1"] = ["cols", "rows"]


@pytest.mark.parametrize("where,edit,needle", [
    # bundle.yaml from a spec that differs only in w1's placement (per-device shapes computed
    # with the programs' spec still agree, so only comparing the placements catches it)
    ("bundle.yaml", _swap_w1, "weight w1 is split [rows, cols] (PartitionSpec), bundle.yaml says [cols, rows] "),
    # every program records wq over the columns only: the same per-device shape on 1x8
    ("programs", _set_spec("wq", [[], ["cols"]]), "weight wq is split [null, cols] (PartitionSpec), bundle.yaml "
                                                  "says [rows, cols] "),
    ("programs", _set_kv_dtype, "KV cache dtype bfp8, bundle.yaml says bf16 "),
])
def test_a_package_whose_spec_and_programs_disagree_is_refused(t3k_package, tmp_path, where, edit, needle):
    """bundle.yaml and the programs edited apart (the manifest re-hashed, as a rebuilt file
    would be): the package's check against its spec (``speccheck.load_checked``: the build,
    ``check PACKAGE``, ``cache verify``; serving no longer re-resolves the spec at every load)
    refuses it, naming the program, the weight (or the KV field), both values and the bundle.yaml
    line, instead of running one and describing the other."""
    import re

    from pkg_mutations import edit_bundle_yaml, edit_program_json
    from ttbundle.package.names import PackageError
    pkg = _mutated(t3k_package, tmp_path)
    if where == "bundle.yaml":
        edit_bundle_yaml(pkg, edit)
    else:
        assert edit_program_json(pkg, edit) == len(list((pkg / "programs").glob("*.json")))
    from ttbundle.package.speccheck import load_checked
    with pytest.raises(PackageError) as e:
        load_checked(pkg)
    msg = str(e.value)
    assert needle in msg, msg
    assert re.search(r"programs/(prefill|decode)-\d+\.json \(and its \d+ other program", msg), msg
    at = re.search(r"bundle\.yaml:(\d+): (sharding\.plan\.(w1|wq)|runtime\.kv_cache_dtype)\)", msg)
    assert at, msg
    key = at.group(2).split(".")[-1]  # the line named holds that key
    assert f"{key}: " in (pkg / "bundle.yaml").read_text().splitlines()[int(at.group(1)) - 1]


def test_check_refuses_a_package_whose_spec_and_programs_disagree(t3k_package, tmp_path):
    """`ttbundle check PACKAGE` on the swapped-placement package: exit 1 (a bad package,
    docs/cli.md) with the disagreement, no traceback."""
    from typer.testing import CliRunner

    from pkg_mutations import edit_bundle_yaml
    from ttbundle.cli import app
    pkg = _mutated(t3k_package, tmp_path)
    edit_bundle_yaml(pkg, _swap_w1)
    r = CliRunner().invoke(app, ["check", str(pkg), "--steps", "1"])
    out = " ".join(r.output.split())  # rich wraps long lines
    assert r.exit_code == 1, r.output
    assert "weight w1 is split [rows, cols] (PartitionSpec), bundle.yaml says [cols, rows]" in out, out
    assert "Traceback" not in r.output and not isinstance(r.exception, AssertionError)


def test_tensorbin_caches_that_disagree_with_the_programs_are_refused(t3k_package, tmp_path):
    """The ttnn path's weights come from ``tensorbin/``: an index whose dtype for a key is not
    the programs' is refused at open, naming the key and both (before, the caches were loaded as
    the index said)."""
    from pkg_mutations import edit_json
    from ttbundle.package.load import load_package
    from ttbundle.package.names import PackageError
    pkg = _mutated(t3k_package, tmp_path)

    def bfp8(idx):
        idx["tensors"]["wq.0"]["dtype"] = "bfp8"
    edit_json(pkg, "tensorbin/index.json", bfp8)
    with pytest.raises(PackageError, match=r"tensorbin/index.json: wq.0 is cached as bfp8\[.*\], the programs "
                                           r"read wq as bf16\["):
        ttmodel.open_model(recording.Recorder().module(), load_package(pkg), "all")


def test_the_lowering_follows_the_programs_kv_record_not_the_spec():
    """A program's ``kv_cache`` record edited (bfp8 blocks of 64 tokens, where the spec and its
    plan say bf16 blocks of 32): the lowered forward writes the cache through a typecast to
    bfloat8_b and its page tables hold ceil(max_model_len / 64) blocks; the program as lowered
    has neither."""
    import dataclasses

    bundle = _bundle("tiny-llama")
    p = make_plan(bundle, "T3K")  # build time: the program a package would hold
    rt = bundle.spec.runtime
    assert (rt.kv_cache_dtype, rt.kv_block_size, rt.max_model_len) == ("bf16", 32, 256)
    for phase, bucket, write in (("decode", 1, "experimental.paged_update_cache"),
                                 ("prefill", 32, "experimental.paged_fill_cache")):
        prog = lowermod.lower(bundle, p, phase, bucket)
        edited = dataclasses.replace(prog, kv_cache={**prog.kv_cache, "dtype": "bfp8", "block_size": 64})
        for fw, cast, blocks in ((lowering.lower_forward(bundle, p.mesh, prog), False, 256 // 32),
                                 (lowering.lower_forward(bundle, p.mesh, edited), True, 256 // 64)):
            calls = [c for _, c in fw.calls()]
            casts = [c for c in calls if c.fn == "typecast" and "bfloat8_b" in repr(c.args)]
            writes = [c for c in calls if c.fn == write]
            assert writes and (len(casts) == len(writes) if cast else not casts), (phase, cast)
            assert fw.inputs["page_table"][0][1] == blocks
            if phase == "prefill":
                assert fw.inputs["fill_page_table"][0][1] == -(-32 // (64 if cast else 32))


def test_a_program_for_another_mesh_is_not_lowered(t3k_package):
    """``lower_forward`` lowers a program on the mesh it records: a T3K program on N300 is
    refused naming both."""
    from ttbundle.package.load import LoadedPackage, load_package
    pk = load_package(t3k_package)
    with pytest.raises(ValueError, match=r"program decode-1 is for a \[1, 8\] mesh, lowering for N300"):
        lowering.lower_forward(pk.bundle, target_mesh(pk.bundle, "N300"), pk.program_ir("decode", 1))


def test_a_cache_write_of_an_unknown_value_leaves_the_cache_unknown():
    """A never-written cache starts as garbage (NaN) when first written; once a write of an
    unknown value made it unknown, later writes do not make it known again."""
    rec, tt, ex = double((1, 1))
    cache = tt.allocate_tensor_on_device(tt.Shape([2, 1, 4, 8]), tt.bfloat16, tt.TILE_LAYOUT, ex.device,
                                         tt.DRAM_MEMORY_CONFIG)
    pt, pos = rec.tensor([np.array([[0, 1]], np.int32)]), rec.tensor([np.array([0], np.int32)])
    row = rec.tensor([np.ones((1, 1, 1, 8), np.float32)])
    tt.experimental.paged_update_cache(cache, row, update_idxs_tensor=pos, page_table=pt)
    assert cache.known and np.isnan(cache.arrays()[0][0, 0, 1]).all() and (cache.arrays()[0][0, 0, 0] == 1).all()
    tt.experimental.paged_update_cache(cache, tt.experimental.unmodeled(row), update_idxs_tensor=pos, page_table=pt)
    tt.experimental.paged_update_cache(cache, row, update_idxs_tensor=pos, page_table=pt)
    assert not cache.known and "unmodeled is not computed" in cache.why


def random_package(b, mesh: str, tmp: Path) -> Path:
    """``b`` with random weights (``reference.save_random``) built for ``mesh`` with the ttnn backend."""
    import dataclasses

    from ttbundle import build as buildmod, reference
    ck = reference.save_random(b, tmp / "ckpt", seed=3)
    w = b.spec.weights.model_copy(update={"source": str(ck)})
    b = dataclasses.replace(b, spec=b.spec.model_copy(update={"weights": w, "tokenizer": False}))
    return Path(buildmod.build(b, mesh, tmp / "out", backend="ttnn", warmup=False).package)


@pytest.mark.parametrize("mesh", ["N300", "T3K", "TG"])
def test_padded_heads_forward_equals_the_emulated_backend(mesh, tmp_path):
    """SmolLM2's ratios (9 query / 3 KV heads) with the padding ``init`` chooses: the ttnn
    lowering of the padded per-device heads, on the double, gives the emulated backend's numbers."""
    from test_check_package import smol
    b, _ = smol(mesh)
    assert forward_differences(random_package(b, mesh, tmp_path), [5, 17, 99, 3, 250, 42, 7], 3) == []


@pytest.mark.parametrize("family,storage,rel", [("qwen3", "bfp8", 0.03), ("llama", "bfp4", 0.03),
                                                ("gpt_oss", "bfp8", 0.03), ("deepseek_v3", "bfp8", 0.06),
                                                ("qwen3_moe", "bfp8", 0.03), ("qwen2_moe", "bfp8", 0.06)])
def test_block_float_forward_equals_the_emulated_backend(family, storage, rel, tmp_path):
    """Block-float weights and a bfp8 KV cache: the double decodes the package's tensorbin tiles
    and rounds the cache writes to bfp8 as the emulated backend does (T3K). GPT-OSS adds MoE
    routing (topk, scatter), clamped SwiGLU, attention sinks and sliding windows (it found the
    routing constants of two buckets sharing one name, so one shape); DeepSeek-V3 adds MLA and
    interleaved rope (it found the rope tables of ``rotary_embedding_llama`` in rotate-half
    order). DeepSeek's group routing runs in bf16 on device (the lowering says why), so a near
    tie may pick another expert than the fp32 reference: a wider bound there. Qwen3 MoE adds
    the softmax top-k routing (renormalized), q/k norm and a dense first layer; Qwen2 MoE the
    sigmoid-gated shared expert (a width-1 gate projection), its routing in bf16 on device too
    (one decode position measured 3.2% off at seed 3; with every expert chosen, top-8 of 8, the
    same model is within 3% everywhere: a selection near-tie, so DeepSeek's wider bound)."""
    from test_check_package import stored
    pkg = random_package(stored(family, storage), "T3K", tmp_path)
    assert forward_differences(pkg, [5, 17, 99, 3, 250, 42, 7], 3, rel=rel) == []


def test_softcapped_attention_reads_a_defined_kv_cache(tmp_path):
    """Gemma 2's softcapped attention gathers every block of the page table from the paged KV
    cache (``gather`` by page id), most of them never written; the additive mask cannot undo a
    NaN / Inf there (``-1e30 + NaN``), and ``p @ v`` multiplies 0 by it. The double holds
    never-written device memory as NaN, as a device's DRAM holds whatever it held: the forward
    equals the emulated backend only because ``device.allocate_kv`` fills the cache with zeros
    (with ``allocate_tensor_on_device`` instead, this differs by nan)."""
    from test_check_package import stored
    bad = forward_differences(random_package(stored("gemma2", "bfp8"), "N300", tmp_path), [5, 17, 99], 1)
    assert bad == []
