"""The plan: :func:`make_plan` puts sharding resolution, propagation, memory and the KV pool
together into a :class:`Plan` (pure data; nothing here touches a weight); :func:`kv_blocks` is
the one owner of a package's KV block count."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .. import layout as layoutmod, mesh as meshmod
from ..errors import Diagnostic, InvalidInput
from ..layout import axes_of
from ..mesh import Mesh
from ..speculative import draft_kv_blocks, draft_path, rows_per_seq, verify_buckets, verify_rows
from ..tiles import TILE, round_up as _round_up
from .memory import TRACE_BYTES_PER_OP, Memory, tensor_bytes, trace_region_dram
from ..kvpool import choose_pool
from .propagate import Collective, _Tracer, _seen_by_attention, vision_steps
from .sharding import TensorPlan, _shard_tensors, target_mesh
from ..spec import load

@dataclass
class Plan:
    bundle_name: str
    family: str
    mesh: Mesh
    tensors: list[TensorPlan]
    memory: Memory
    collectives: list[Collective]
    kv: dict
    activation_tokens: int
    num_traces: int
    diagnostics: list[Diagnostic]
    specs: dict = field(default_factory=dict)  # resolved PartitionSpec per tensor
    programs: list = field(default_factory=list)  # [(layer kind, count, [Step])], embedding first, head last
    trace_region_size: int = 0  # bytes requested (open_mesh_device); memory.trace_region is what DRAM gives up
    activation_buffers: list = field(default_factory=list)  # [(name, [rows, features])], bf16 TILE each
    max_num_seqs: int = 0  # runtime.max_num_seqs: per replica
    vision: list = field(default_factory=list)  # the vision encoder's [(layer kind, count, [Step])], if any
    draft: dict = field(default_factory=lambda: {"bytes": 0})  # speculative decoding's draft (draft_memory)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory.dram

    @property
    def decode_traffic_bytes_per_token(self) -> int:
        return sum(c.traffic_bytes_per_token * c.count for c in self.collectives)

    def consumers(self) -> list[tuple[str, int]]:
        """Largest memory consumers per chip, biggest first."""
        items = [(f"{t.name} ({t.dtype}, x{t.count})", t.bytes) for t in self.tensors]
        items += [(f"KV cache ({self.kv['dtype']})", self.memory.kv_cache),
                  ("activations", self.memory.activations), ("trace region", self.memory.trace_region)]
        if self.memory.draft:
            items.append((self.draft_line(), self.memory.draft))
        return sorted(items, key=lambda x: -x[1])

    def draft_line(self) -> str:
        """The draft model's memory line (speculative decoding, ``draft_memory``): the one wording
        of the text plan's row, the SVG's legend and :meth:`consumers`."""
        return f"draft model {self.draft['bundle']} (weights + KV {self.draft['kv_blocks']:,} blocks)"

    @property
    def replicas(self) -> int:
        return self.mesh.replicas

    def concurrency(self, max_num_seqs: int) -> int:
        """Sequences the whole target serves at once: replicas x per-replica max_num_seqs."""
        return self.mesh.replicas * max_num_seqs

    def to_json(self) -> dict:
        m = self.mesh
        mem = asdict(self.memory)
        mem["free"] = self.memory.free
        mem["trace_region_size"] = self.trace_region_size
        out = {
            "bundle": self.bundle_name,
            "family": self.family,
            "mesh": {"name": m.name, "shape": list(m.shape), "arch": m.chip.arch,
                     "devices": m.num_devices, "topology": m.topology,
                     "dram_bytes_per_chip": m.chip.dram_bytes, "l1_bytes_per_chip": m.chip.l1_bytes},
            "fits": self.fits,
            "memory": mem,
            "per_chip": [{"device": [r, c], "bytes": self.memory.total}
                         for r in range(m.rows) for c in range(m.cols)],
            "tensors": [{"name": t.name, "group": t.group, "dtype": t.dtype, "layout": t.layout,
                         "shape": t.shape, "spec": [list(axes_of(e)) or None for e in t.spec],
                         "device_shape": t.device_shape, "count": t.count,
                         "bytes_per_copy": t.bytes_per_copy, "bytes": t.bytes,
                         "notation": t.notation(), "notes": t.notes} for t in self.tensors],
            "kv_cache": self.kv,
            "collectives": [{**asdict(c), "axes": list(c.axes)} for c in self.collectives],
            "decode_traffic_bytes_per_token": self.decode_traffic_bytes_per_token,
            "activation_tokens": self.activation_tokens,
            "num_traces": self.num_traces,
            "diagnostics": [d.to_json() for d in self.diagnostics],
        }
        if self.draft.get("bundle"):
            out["draft"] = dict(self.draft)
        if m.target_shape is not None:
            out["replicas"] = replica_json(m, self.max_num_seqs)
        return out


def kv_blocks(bundle, mesh: Mesh | str) -> int:
    """KV cache blocks of ``bundle`` on ``mesh``: the plan's pool (the one owner of this number;
    the worker asks vLLM for it, the ttnn backend allocates it, packages record it)."""
    return make_plan(bundle, mesh).kv["num_blocks"]


def make_plan(bundle, mesh: Mesh | str, draft_bundle=None, trace_region_size: int | None = None) -> Plan:
    """The plan of ``bundle`` on ``mesh`` (a target name: on one replica's submesh when the spec
    splits it, ``target_mesh``). Raises InvalidInput listing every divisibility error.
    ``draft_bundle``: speculative decoding's draft, already loaded (a package's, from the draft
    package inside it), instead of the spec file ``speculative.model`` names.
    ``trace_region_size``: the region to reserve, as the ttnn lowering counts the traces' need
    (``build.device_plan``, ``tracebudget``); else the spec's ``runtime.trace_region_size``, else
    an estimate from the programs' op counts (:data:`~.memory.TRACE_BYTES_PER_OP` per op: below
    what the lowered traces capture, so a ttnn build replaces it)."""
    if isinstance(mesh, str):
        mesh = target_mesh(bundle, mesh)
    fam, a, s = bundle.family, bundle.arch, bundle.spec
    specs, decls, tensors, diags = _shard_tensors(bundle, mesh)
    if diags:
        raise InvalidInput(f"{bundle.file}: sharding plan does not fit {mesh.describe()}", diags)

    # collectives and op counts per layer kind
    # activations: every named activation of one layer live at once for the largest prefill shape
    # (an upper bound; ttnn frees them as it goes), each its own interleaved bf16 TILE buffer
    # [tokens, features] (so each is rounded to whole pages per bank, like any buffer), plus the
    # last-token logits of the largest decode batch (rows padded to a tile) over the vocabulary,
    # gathered on every device
    bk = bundle.buckets
    act_tokens = min(max(bk.prefill), bk.prefill_chunk or max(bk.prefill))
    lm = next(t for t in tensors if t.name == "lm_head")
    vocab_gathered = lm.device_shape[-1] * math.prod(mesh.axis_size(x) for x in axes_of(lm.spec[-1]))
    act_layer, act_layer_bytes = [], 0

    collectives: list[Collective] = []
    ops_per_forward = 0
    programs = []
    kinds = [("embedding", 1, fam.embed_ops(a))] + [(k.name, k.count, k.ops) for k in fam.layers(a)] \
        + [("head", 1, fam.head_ops(a))]
    for name, count, ops in kinds:
        tr = _Tracer(mesh, specs, decls, name, count, s.sharding)
        for op in ops:
            tr.run(op)
        collectives += tr.out
        ops_per_forward += tr.ops * count
        programs.append((name, count, tr.steps))
        if name not in ("embedding", "head"):
            bufs = [(n, [act_tokens, x.local_elems(mesh, s.sharding)]) for n, x in tr.acts.items()]
            nbytes = sum(tensor_bytes(shape, "bf16", "TILE", mesh) for _, shape in bufs)
            if nbytes > act_layer_bytes:
                act_layer, act_layer_bytes = bufs, nbytes

    # speculative decoding: a verify program's logits cover every row (k + 1 per sequence)
    logit_rows = max([_round_up(max(bk.decode, default=1), TILE)]
                     + [verify_rows(n, rows_per_seq(bundle) - 1) for n in verify_buckets(bundle)])
    act_bufs = act_layer + [("logits", [logit_rows, vocab_gathered])]
    act_bytes = sum(tensor_bytes(shape, "bf16", "TILE", mesh) for _, shape in act_bufs)
    vision, vision_bufs = vision_steps(bundle, mesh, specs, decls)
    vision_bytes = sum(tensor_bytes(shape, "bf16", "TILE", mesh) for _, shape in vision_bufs)
    if vision_bytes > act_bytes:  # the vision encoder runs alone: its largest layer is the peak
        act_bufs, act_bytes = vision_bufs, vision_bytes

    rt = s.runtime
    traced_prefill = len(bk.prefill) if rt.trace_mode == "all" else 0
    traced_decode = len(bk.decode) if rt.trace_mode in ("all", "decode_only") else 0
    num_traces = traced_prefill + traced_decode * (2 if verify_buckets(bundle) else 1)  # + verify
    # the vision forwards are traced with the prefills (one per vision bucket, its own op count)
    vision_trace_ops = sum(len(steps) * count for _, count, steps in vision) * len(bundle.vision.buckets) \
        if vision and rt.trace_mode == "all" else 0
    trace_size = trace_region_size if trace_region_size is not None else \
        rt.trace_region_size if rt.trace_region_size is not None else \
        _round_up((num_traces * ops_per_forward + vision_trace_ops) * TRACE_BYTES_PER_OP, 1 << 20)
    trace = trace_region_dram(trace_size, mesh) if trace_size else 0

    # KV cache: (num_blocks, kv_heads/device, block_size, head_dim) per layer, K and V separately,
    # as one pool of blocks shared by all sequences (choose_pool: the spec's, or what fits)
    kv_units = []
    for e in fam.kv_cache(a):
        if e.follows:
            tname, di = e.follows
            # the cache is split like the activation the attention op sees (after any gather)
            ax = _seen_by_attention(programs, tname)
            ax = axes_of(specs[tname][di]) if ax is None else ax
            units = layoutmod.split(e.heads, ax, mesh, s.sharding).per_device
        else:
            units = e.heads.size
        kv_units.append((e, units))

    def kv_layout(nblocks: int):
        total, entries = 0, []
        for e, units in kv_units:
            shape = [nblocks, units, rt.kv_block_size, e.head_dim]
            per_layer = tensor_bytes(shape, rt.kv_cache_dtype, "TILE", mesh)
            total += per_layer * e.count
            entries.append({"name": e.name, "device_shape": shape, "layers": e.count,
                            "bytes_per_layer": per_layer})
        return total, entries

    by_dtype: dict[str, int] = {}
    for t in tensors:
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.bytes
    weights = sum(by_dtype.values())
    draft = draft_memory(bundle, mesh, draft_bundle)
    free = mesh.chip.dram_bytes - weights - act_bytes - trace - draft["bytes"]
    pool = choose_pool(rt, lambda n: kv_layout(n)[0], free, one_prefill=s.task == "embed")
    blocks = pool.blocks
    kv_total, kv_entries = kv_layout(blocks)
    kv = {"dtype": rt.kv_cache_dtype, "num_blocks": blocks, "block_size": rt.kv_block_size,
          "entries": kv_entries, "bytes": kv_total, "max_tokens_all_users": pool.tokens,
          "pool_chosen": pool.chosen, "pool_why": pool.why,
          "max_num_seqs": rt.max_num_seqs, "full_length_tokens": rt.max_num_seqs * rt.max_model_len}

    total = weights + kv_total + act_bytes + trace + draft["bytes"]
    mem = Memory(by_dtype, weights, kv_total, act_bytes, trace, total, mesh.chip.dram_bytes, draft["bytes"])
    return Plan(s.name, a.family, mesh, tensors, mem, collectives, kv, act_tokens, num_traces,
                list(bundle.warnings), dict(specs), programs, trace_size, act_bufs, rt.max_num_seqs, vision,
                draft)


def draft_memory(bundle, mesh: Mesh, draft=None) -> dict:
    """Per chip, what speculative decoding's draft model (``speculative: {method: draft}``) holds
    on ``mesh`` beside the target: its weights (its own plan on the same mesh) and its KV region
    (``speculative.draft_kv_blocks`` blocks, laid out as its plan lays out its pool). Its
    activations and programs' traces are not counted apart: it runs between the target's steps.
    ``{"bytes": 0}`` without a draft. ``draft``: the draft's bundle, when already loaded."""
    path = draft_path(bundle)
    if path is None:
        return {"bytes": 0}
    if draft is None:

        draft = load(path)
    dp = make_plan(draft, mesh)
    blocks = draft_kv_blocks(bundle, draft)
    kv = sum(tensor_bytes([blocks] + e["device_shape"][1:], dp.kv["dtype"], "TILE", mesh) * e["layers"]
             for e in dp.kv["entries"])
    return {"bundle": draft.spec.name, "spec": str(path), "weights": dp.memory.weights, "kv_blocks": blocks,
            "kv_bytes": kv, "bytes": dp.memory.weights + kv}


def replica_json(mesh: Mesh, max_num_seqs: int) -> dict:
    """The replica split of a target (plan JSON and the package manifest)."""
    return {"count": mesh.replicas, "submesh": list(mesh.shape), "target_shape": list(mesh.target_shape),
            "devices_per_replica": mesh.num_devices, "devices": mesh.total_devices,
            "origins": [list(o) for o in meshmod.submesh_origins(mesh.target_shape, mesh.shape,
                                                                   mesh.whole().hosts)],
            "max_num_seqs_per_replica": max_num_seqs, "max_num_seqs_total": mesh.replicas * max_num_seqs}


def check_mesh(bundle, mesh_name: str) -> list[Diagnostic]:
    """Mesh-dependent diagnostics for one target (empty when the plan resolves)."""
    try:
        make_plan(bundle, mesh_name)
    except InvalidInput as e:
        return e.diagnostics or [Diagnostic(e.message, "", bundle.file)]
    return []
