"""Collective program steps as ttnn CCL calls (one call per mesh axis, gathers innermost axis
first) and the ``mesh_partition`` calls that leave each device its part of a replicated tensor;
the emulated ``meshops`` counterpart."""

from __future__ import annotations

from ... import layout
from ...mesh import AXES, Mesh
from ...program import Op, Step
from .calls import Call, T
from .emitter import DRAM, Emitter, tt_dim, tt_shape


def _collective(lw: Emitter, st: Step) -> None:
    """One collective step: an all_reduce or all_gather of ``st.act`` over ``st.axes``,
    one ttnn call per mesh axis. A gather over several axes runs in ``layout.gather_sequence``
    order (innermost axis first), so every device ends with its group in group order; where the
    gathered dim (``st.feature``) is padded, ``layout.gather_index`` says where its elements
    are, and the padding (at the end) is sliced off."""
    x = st.act
    shp = tt_shape(st.ins[0].shape)
    lw.shapes.setdefault(x, shp)
    axes = tuple(st.axes)
    if st.op is Op.ALL_REDUCE:
        for ax in axes:  # a sum: any axis order gives it
            lw.call("all_reduce", T(x), out=x, shape=shp, cluster_axis=AXES.index(ax),
                    topology=lw.topology((ax,)), num_links=1, memory_config=DRAM)
        return
    dim = tt_dim(st.ins[0].shape, st.dim)
    for ax in layout.gather_sequence(axes):
        nxt = list(lw.shapes[x])
        nxt[dim] *= lw.mesh.axis_size(ax)
        lw.call("all_gather", T(x), dim, out=x, shape=nxt, cluster_axis=AXES.index(ax),
                topology=lw.topology((ax,)), num_links=1, memory_config=DRAM)
    f = st.feature
    inv = f and layout.gather_index(f, axes, lw.mesh, lw.policy)
    if inv:
        if inv != list(range(len(inv))):  # padding inside the group, or replicas: no plan gathers one yet
            raise NotImplementedError(f"all_gather of {x} over {axes}: {f.name} comes back out of order "
                                      f"(padding or replicas inside the group); the ttnn lowering only drops "
                                      f"padding at the end")
        end = list(lw.shapes[x])
        end[dim] = len(inv)
        lw.call("slice", T(x), [0, 0, 0, 0], end, [1, 1, 1, 1], out=x, shape=end)


def collective_calls(mesh: Mesh, st: Step, policy=None) -> list[Call]:
    """The ttnn calls ``lower_forward`` emits for collective program step ``st`` on ``mesh``
    (``policy``: the program's, :func:`program_policy`)."""
    em = Emitter(mesh, policy or layout.Policy())
    em.op = st.op.value
    _collective(em, st)
    return em.calls


def partition_calls(mesh: Mesh, x: str, shape, dim: int, axes, out: str) -> list[Call]:
    """The ``mesh_partition`` calls that leave each device its part of replicated ``x`` (4-D
    ``shape``) along ``dim`` split over ``axes`` (what the matmul and combine lowerings emit)."""
    em = Emitter(mesh)
    em.shapes[x] = tuple(shape)
    em.partition(x, dim, axes, out)
    return em.calls


OPS = {"all_reduce": _collective, "all_gather": _collective}  # program steps with "collective"
