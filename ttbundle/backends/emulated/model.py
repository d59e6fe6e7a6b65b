"""The emulated mesh backend: executes a plan's per-device programs on sharded weights.

Weights are held as ``[D, *local]`` shards exactly as the plan's PartitionSpecs say; each
layer runs the plan's steps (ops and the collectives the sharding requires) on device-batched
activations ``[D, T, features]``. Prefill and decode are separate entry points with static
shapes: prefill runs one sequence padded to a prefill bucket (chunks of ``prefill_chunk``),
decode runs a batch padded to a decode bucket. The KV cache is paged: a block table maps each
sequence's positions to cache slots, as on the device.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from ...families.base import Combine, Dim, Embed, Linear, Local, Logits, Norm, Residual
from ...plan import Plan, axes_of
from .kernels import KERNELS, Ctx, rms_norm, softcap
from .meshops import MeshOps


@dataclass
class KVCache:
    layers: list  # per layer {"k": [D, kvh, num_blocks * block, hd], "v": ...}
    num_blocks: int
    block_size: int


class EmulatedModel:
    """A bundle's model on an emulated mesh. ``canonical`` comes from ``weights.canonical``."""

    def __init__(self, bundle, plan: Plan, canonical: dict, dtype=torch.float32, device="cpu",
                 kernels: dict | None = None):
        self.bundle, self.plan, self.arch, self.family = bundle, plan, bundle.arch, bundle.family
        self.dtype = dtype
        self.ops = MeshOps(plan.mesh, device)
        self.device = self.ops.device
        self.decls = {t.name: t for t in self.family.tensors(self.arch)}
        policy = bundle.spec.sharding
        self.w: dict = {}
        for name, t in self.decls.items():
            spec = plan.specs[name]
            src = canonical[name]
            shard = lambda x: self.ops.shard(x.to(dtype), t.dims, spec, policy)  # noqa: E731
            self.w[name] = shard(src) if t.layers is None else [shard(x) for x in src]
        self.kernels = dict(KERNELS, **(kernels or {}))
        self.traits = self.family.traits(self.arch)
        self.layer_traits = [self.family.layer_traits(self.arch, i)
                             for i in range(self.arch.num_hidden_layers)]
        # programs: embedding, layer kinds in order, head
        self.programs = plan.programs
        # vocab positions of each device's embedding rows (for sharded-vocab lookups)
        self._embed_rows = None
        self._splits: dict = {}

    # -- weights ------------------------------------------------------------------------------
    def weight(self, name: str, layer: int | None = None):
        t = self.decls.get(name)
        if t is None:
            return None
        if t.layers is None:
            return self.w[name]
        if layer is None or not (t.layers[0] <= layer < t.layers[1]):
            return None
        return self.w[name][layer - t.layers[0]]

    # -- KV cache -----------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """One cache per KV entry of the family (k and v, or MLA's latent) per layer, laid out
        [D, heads on this device, num_blocks * block_size, head_dim]; slot = block * size + offset.
        Heads outermost: a batch's context gathered along the slot dim is already laid out for
        one batched matmul per (device, head), with no copy to permute it."""
        layers = []
        for _ in range(self.arch.num_hidden_layers):
            layers.append({e["name"]: torch.zeros(self.ops.D, e["device_shape"][1], num_blocks * block_size,
                                                  e["device_shape"][3], dtype=self.dtype, device=self.device)
                           for e in self.plan.kv["entries"]})
        return KVCache(layers, num_blocks, block_size)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, tokens, positions, valid, page_table, kv: KVCache, capture: list | None = None):
        """tokens/positions/valid [N, Tq]; page_table [N, blocks]. Returns logits [N, Tq, vocab]
        (device 0's copy; every device holds the same after the gather)."""
        N, Tq = tokens.shape
        dev = self.device
        tokens, positions, valid = tokens.to(dev), positions.to(dev), valid.to(dev)
        page_table = page_table.to(dev)
        bs = kv.block_size
        slot = page_table.gather(1, (positions // bs).clamp(max=page_table.shape[1] - 1)) * bs + positions % bs
        slots = torch.where(valid, slot, torch.full_like(slot, -1)).reshape(-1)
        S = int(positions[valid].max().item()) + 1 if bool(valid.any()) else 1
        nblk = -(-S // bs)
        ctx_slots = (page_table[:, :nblk, None] * bs + torch.arange(bs, device=dev)).reshape(N, -1)[:, :S]
        ctx = Ctx(self.arch, self.traits, self.layer_traits, self.weight, positions, valid, slots,
                  ctx_slots, kv.layers, self.dtype, units=self.units)
        flat = tokens.reshape(-1)
        h = None
        layer = 0
        logits = None
        for kind, count, steps in self.programs:
            for _ in range(count):
                li = None if kind in ("embedding", "head") else layer
                acts = {"h": h, "tokens": flat}
                out = self._run(steps, acts, li, ctx)
                h = acts["h"]
                if kind == "embedding":
                    h = acts["h"]
                elif kind == "head":
                    logits = out
                else:
                    if capture is not None:
                        capture.append(h[0].reshape(N, Tq, -1))
                    layer += 1
        vocab = self.arch.vocab_size
        return logits[0, :, :vocab].reshape(N, Tq, vocab)

    def _run(self, steps, acts: dict, layer, ctx: Ctx):
        ops = self.ops
        result = None
        for st in steps:
            if st.kind == "all_reduce":
                acts[st.act] = ops.all_reduce(acts[st.act], st.axes)
                continue
            if st.kind == "all_gather":
                acts[st.act] = ops.all_gather(acts[st.act], st.axes, st.dim + 2, st.feature,
                                              self.bundle.spec.sharding)
                continue
            op = st.op
            if isinstance(op, Embed):
                acts[op.out] = self._embed(acts["tokens"], op.w)
                if op.out == "h" and self.traits.get("embed_scale"):
                    # HF casts the normalizer to the compute dtype first
                    acts[op.out] = acts[op.out] * torch.tensor(self.traits["embed_scale"], dtype=self.dtype)
            elif isinstance(op, Norm):
                acts[op.out] = self._norm(acts[op.x], op.w, layer)
            elif isinstance(op, Linear):
                acts[op.out] = self._linear(acts[op.x], op, st, layer)
            elif isinstance(op, Local):
                fn = self.kernels[op.kernel]
                acts[op.out] = fn(ctx, layer, *(acts[i] for i in op.ins))
            elif isinstance(op, Residual):
                acts["h"] = acts["h"] + acts[op.x]
            elif isinstance(op, Logits):
                result = softcap(acts[op.x].float(), self.traits.get("final_softcap")).to(self.dtype)
            elif isinstance(op, Combine):
                fn = self.kernels["combine"]
                acts[op.out] = fn(ctx, layer, acts[op.x], acts)
            else:  # pragma: no cover
                raise TypeError(op)
        return result

    def _embed(self, tokens, name: str):
        W = self.weight(name)  # [D, V_local, H_local]
        t = self.decls[name]
        ax = axes_of(self.plan.specs[name][0])
        if not ax:
            return W[:, tokens]
        if self._embed_rows is None:
            pos = self.ops.shard_positions(t.dims[0], ax, self.bundle.spec.sharding)  # [D, Vl]
            inv = torch.full((self.ops.D, t.shape[0] + 1), -1, dtype=torch.long, device=self.device)
            valid = pos >= 0
            rows = torch.arange(pos.shape[1], device=self.device).expand_as(pos)
            inv[torch.arange(self.ops.D, device=self.device)[:, None].expand_as(pos)[valid], pos[valid]] = rows[valid]
            self._embed_rows = inv
        rows = self._embed_rows[:, tokens]  # [D, T]
        out = torch.gather(W, 1, rows.clamp(min=0)[:, :, None].expand(-1, -1, W.shape[2]))
        return out * (rows >= 0)[:, :, None].to(out.dtype)

    def _split(self, name: str, dim: int):
        """Axes that split dim ``dim`` of weight ``name`` over more than one device, or ()."""
        key = (name, dim)
        if key not in self._splits:
            ax = axes_of(self.plan.specs[name][dim])
            self._splits[key] = ax if math.prod(self.ops.mesh.axis_size(a) for a in ax) > 1 else ()
        return self._splits[key]

    def units(self, name: str, dim: int):
        """[D, L]: the global indices along dim ``dim`` of weight ``name``, in units, that each
        device holds (-1 = padding); for kernels that need global positions (expert ids)."""
        d = self.decls[name].dims[dim]
        return self.ops.shard_positions(Dim(d.name, d.size), axes_of(self.plan.specs[name][dim]),
                                        self.bundle.spec.sharding)

    def _norm(self, x, name: str, layer):
        """RMSNorm with weight ``name``. The family's ``traits["norms"][name]`` may give its ``eps``
        and ``features``: normalize only the first ``features``, the rest pass (MLA's rope key)."""
        w = self.weight(name, layer)[:, None, :]
        how = self.traits.get("norms", {}).get(name, {})
        eps, n = how.get("eps", self.arch.rms_norm_eps), how.get("features")
        y = rms_norm(x if n is None else x[..., :n], w, eps, self.traits.get("norm_offset", 0.0),
                     self.traits.get("norm_weight_fp32", False))
        return y if n is None else torch.cat([y, x[..., n:]], dim=-1)

    def _linear(self, x, op: Linear, st, layer):
        W = self.weight(op.w, layer)
        if op.w in self.traits.get("linear_fp32", ()):  # HF computes these in float32 (a router)
            x, W = x.float(), W.float()
        t = self.decls[op.w]
        x_spec = st.specs[0][1]
        # a replicated contraction dim meets a split weight: each device takes its slice
        k_axes = self._split(op.w, len(t.dims) - 2)
        if k_axes and not x_spec[-1]:
            pos = self.ops.shard_positions(t.dims[-2], k_axes, self.bundle.spec.sharding)
            x = self.ops.take(x, x.dim() - 1, pos)
        if W.dim() == 3:  # [D, K, N]
            return torch.bmm(x, W) if x.dim() == 3 else torch.einsum("dtek,dkn->dten", x, W)
        # experts [D, E, K, N]
        if x.dim() == 3:
            return torch.einsum("dtk,dekn->dten", x, W)
        e_axes = self._split(op.w, 0)
        if e_axes and not x_spec[0]:
            pos = self.ops.shard_positions(t.dims[0], e_axes, self.bundle.spec.sharding)
            x = self.ops.take(x, 2, pos)
        return torch.einsum("dtek,dekn->dten", x, W)


# ---- static-shape entry points --------------------------------------------------------------------
def pick(buckets: list[int], n: int) -> int:
    """Smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class Runner:
    """Prefill / decode with padding to the bundle's buckets, on one KV cache."""

    def __init__(self, model: EmulatedModel, num_blocks: int | None = None):
        self.model = model
        b = model.bundle.buckets
        rt = model.bundle.spec.runtime
        self.prefill_buckets, self.decode_buckets = list(b.prefill), list(b.decode)
        self.chunk = b.prefill_chunk or max(b.prefill)
        self.block = rt.kv_block_size
        self.max_blocks = -(-rt.max_model_len // self.block)
        self.kv = model.allocate_kv_cache(num_blocks or model.plan.kv["num_blocks"], self.block)
        self.shapes_run: set = set()  # (phase, bucket) pairs executed

    def prefill(self, tokens: list[int], page_table: list[int], start: int = 0, capture=None):
        """Prefill ``tokens`` at positions start.. in chunks; returns last-token logits [vocab]."""
        logits = None
        pos = start
        for i in range(0, len(tokens), self.chunk):
            chunk = tokens[i:i + self.chunk]
            bucket = pick(self.prefill_buckets, len(chunk))
            self.shapes_run.add(("prefill", bucket))
            t = torch.zeros(1, bucket, dtype=torch.long)
            t[0, :len(chunk)] = torch.tensor(chunk)
            p = torch.arange(pos, pos + bucket)[None, :]
            valid = torch.zeros(1, bucket, dtype=torch.bool)
            valid[0, :len(chunk)] = True
            pt = self._table([page_table])
            cap = [] if capture is not None else None
            out = self.model.forward(t, torch.where(valid, p, torch.zeros_like(p)), valid, pt, self.kv, cap)
            if capture is not None:
                capture.append([c[0, :len(chunk)] for c in cap])
            logits = out[0, len(chunk) - 1]
            pos += len(chunk)
        return logits

    def decode(self, tokens: list[int], positions: list[int], page_tables: list[list[int]], capture=None):
        """One decode step for a batch; returns logits [B, vocab]."""
        B = len(tokens)
        bucket = pick(self.decode_buckets, B)
        self.shapes_run.add(("decode", bucket))
        t = torch.zeros(bucket, 1, dtype=torch.long)
        t[:B, 0] = torch.tensor(tokens)
        p = torch.zeros(bucket, 1, dtype=torch.long)
        p[:B, 0] = torch.tensor(positions)
        valid = torch.zeros(bucket, 1, dtype=torch.bool)
        valid[:B] = True
        pt = self._table(page_tables + [[0]] * (bucket - B))
        cap = [] if capture is not None else None
        out = self.model.forward(t, p, valid, pt, self.kv, cap)
        if capture is not None:
            capture.append([c[:B, 0] for c in cap])
        return out[:B, 0]

    def _table(self, rows: list[list[int]]) -> torch.Tensor:
        pt = torch.zeros(len(rows), self.max_blocks, dtype=torch.long)
        for i, r in enumerate(rows):
            pt[i, :len(r)] = torch.tensor(r[:self.max_blocks])
        return pt
