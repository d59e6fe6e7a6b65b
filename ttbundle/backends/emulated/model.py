"""The emulated mesh backend: executes a package's per-device programs on its weight shards.

The model is the programs ``lower`` produced (``program.Program``, one per (phase, bucket), read
from the package) and each device's weight shards ``[D, *local]``, as the package's device files
hold them; nothing is re-planned here. Each step of the program that a call's bucket selects runs
as written: ops on device-batched activations ``[D, T, features]``, and the collectives the
sharding requires (``meshops``), so a program with a step missing computes wrong numbers.
Prefill runs one sequence padded to a prefill bucket (chunks of ``prefill_chunk``), decode a
batch padded to a decode bucket. The KV cache is paged (a block table maps each sequence's
positions to cache slots, as on the device) and holds values in its declared dtype (``bf16`` or
``bfp8``: each new row is rounded as the device's storage rounds it), in tensors of the compute
dtype where that is wider (``state.kv_store``: attention reads them without converting).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ... import layout
from ...package.shards import stack_shards
from ...program import Op, Program
from ...vision import vision_bucket
from . import gemm
from .kernel_table import KERNELS
from .expert_major import ExpertWork, Rendezvous, submit
from .kernels import Ctx, _writes, rms_norm, softcap
from .lazy import LazyWeights, _packed_names
from .meshops import MeshOps
from .moe_kernels import ROUTE
from .replication import Classes, Replication, Varies, drops
from .state import KVCache, Stages, kv_store


#: bytes of one routed-expert activation ``[D, T, E_local, N]`` (float32) above which a call's
#: experts run a band of tokens at a time (``EmulatedModel._moe_segment``): a 1,024-token prefill
#: of gpt-oss-120b's 128 experts would otherwise hold 3 GB per activation
MOE_ACT_BYTES = 256 << 20


class ProgramMismatch(RuntimeError):
    """A program step met tensors of other shapes than the program declares."""


class EmulatedModel:
    """A package's model on an emulated mesh: its programs and per-device weight shards.

    ``weights``: per tensor ``[D, *local]`` (a list of them, one per layer, for layered tensors).
    Build one from a package with :meth:`from_package`, or from global tensors with
    :meth:`from_canonical` (cut per ``layout``, as ``build`` cuts them)."""

    def __init__(self, bundle, mesh, programs: dict, weights: dict, dtype=torch.float32, device="cpu",
                 kernels: dict | None = None):
        if not programs:
            raise ValueError("an emulated model needs at least one program")
        self.bundle, self.arch, self.family = bundle, bundle.arch, bundle.family
        self.mesh = mesh
        self.dtype = dtype
        self.ops = MeshOps(mesh, device)
        self.device = self.ops.device
        self.rep = Replication(self.ops.R, self.ops.C)
        self._drops: dict = {}
        self._varies_of: dict = {}  # (weight, layer) -> the mesh axes it varies over (_varies)
        #: called as ``observe(kind, step index, acts)`` after every step (tests: what is live)
        self.observe = None
        self.programs: dict[tuple[str, int], Program] = dict(programs)
        first = next(iter(self.programs.values()))
        self.refs = first.weights
        self.kv_layout = first.kv_cache
        self.policy = layout.Policy.from_json(first.policy, bundle.spec.sharding)
        self.decls = {t.name: t for t in self.family.tensors(self.arch)}
        self.kernels = dict(KERNELS, **(kernels or {}))
        #: the family's traits as the program records them (typed; read as a mapping by the kernels)
        self.traits = first.traits
        packed = _packed_names(self.traits, self.programs.values())
        self.lazy: LazyWeights | None = None
        if isinstance(weights, LazyWeights):
            self.lazy = weights.bind(packed, dtype, self.device)
            weights = weights.names()
        missing = sorted(set(self.refs) - set(weights))
        if missing:
            raise ValueError(f"weights missing for {missing}")
        self.w = weights if self.lazy is not None else gemm.hold(weights, packed, dtype, self.device)
        self.layer_traits = list(first.layer_traits)
        #: the model's sizes as the program records them (hidden, vocab, layers, eps, max_model_len)
        self.dims = first.dims
        self.kv_dtype, self._store = kv_store(self.kv_layout["dtype"], dtype)
        self._embed_rows = None
        self._splits: dict = {}
        self.vision_part = self.family.vision_part(self.arch)
        # whether one image's soft tokens attend to each other bidirectionally (Gemma 3) or
        # causally like text (Qwen2.5-VL): the family's vision part says
        self._image_blocks = self.vision_part is not None and self.vision_part.BIDIRECTIONAL_IMAGES

    @classmethod
    def from_canonical(cls, bundle, plan, canonical: dict, programs: dict, dtype=torch.float32,
                       device="cpu", kernels: dict | None = None):
        """Global tensors cut into per-device shards by ``layout`` (as ``build`` cuts them);
        ``programs``: (phase, bucket) -> ``Program``, lowered by the caller (``lower.lower_all``:
        no backend lowers)."""
        ops = MeshOps(plan.mesh, device)
        policy, D = bundle.spec.sharding, plan.mesh.num_devices
        w = {}
        for t in bundle.family.tensors(bundle.arch):
            spec = plan.specs[t.name]
            src = canonical[t.name]
            # one copy per distinct shard, shared by the devices holding it (as a package loads)
            owner = layout.holders(layout.tensor_units(t.dims, spec, plan.mesh, policy), D)
            firsts = sorted(set(owner))

            def shard(x, t=t, spec=spec, owner=owner, firsts=firsts):
                parts = dict(zip(firsts, ops.shard(x.to(dtype), t.dims, spec, policy, firsts).unbind(0)))
                return stack_shards([parts[owner[d]] for d in range(D)], device)
            w[t.name] = shard(src) if t.layers is None else [shard(x) for x in src]
        return cls(bundle, plan.mesh, programs, w, dtype=dtype, device=device, kernels=kernels)

    @classmethod
    def from_package(cls, pkg, dtype=torch.float32, device="cpu", kernels: dict | None = None,
                     lazy: bool = False, programs: list | None = None):
        """A loaded package (``package.load.load_package``): its programs (all, or the (phase,
        bucket) pairs in ``programs``) and its weight files' shards, decoded as the device
        decodes them (bf16; bfp8/bfp4 tiles). ``lazy``: no weight is read here; a tensor is
        read from the (memory-mapped) files when a step first needs it and dropped by
        :meth:`release`, so a layer-by-layer caller (:meth:`run_layer_major`) holds one layer."""
        programs = {k: pkg.program_ir(*k) for k in (programs or pkg.programs)}
        if lazy:
            w = LazyWeights(pkg.weights)
        else:  # each weight packed as it is read: never every weight twice
            traits = next(iter(programs.values())).traits
            lw = LazyWeights(pkg.weights).bind(_packed_names(traits, programs.values()), dtype, device)
            w = {name: [lw.get(name, layer) for layer in pkg.weights.layers_of(name)]
                 if t.layers is not None else lw.get(name, None) for name, t in pkg.weights.decls.items()}
        return cls(pkg.bundle, pkg.mesh, programs, w, dtype=dtype, device=device, kernels=kernels)

    # -- weights ------------------------------------------------------------------------------
    def weight(self, name: str, layer: int | None = None):
        """Weight ``name`` (of ``layer``) as ``[D, *local]``, or None where the layer has none."""
        W = self._held(name, layer)
        return None if W is None else gemm.dense(W)

    def _held(self, name: str, layer: int | None = None):
        """The weight as held: a dense matmul weight may be :class:`gemm.Packed`, a weight some
        devices share a :class:`package.shards.SharedStack` (see :meth:`weight` for a plain tensor)."""
        t = self.decls.get(name)
        if t is None:
            return None
        if t.layers is not None and (layer is None or not (t.layers[0] <= layer < t.layers[1])):
            return None
        if self.lazy is not None:
            return self.lazy.get(name, None if t.layers is None else layer)
        if t.layers is None:
            return self.w[name]
        return self.w[name][layer - t.layers[0]]

    def release(self) -> None:
        """Drop every weight a lazy model has read (the next step reads what it needs again)."""
        if self.lazy is not None:
            self.lazy.release()

    def run_layer_major(self, calls: list, after_stage=None) -> list:
        """Run several program calls (:meth:`stages`) stage by stage: every call through the
        embedding, then every call through layer 0, ..., then every call through the head, in the
        order given within a stage (so a later call sees the KV cache rows an earlier one wrote
        in that layer). A lazy model reads each stage's weights once and drops them after it, so
        it holds one layer of weights at a time, and decodes each routed expert once per stage
        for all the calls (:mod:`.expert_major`). ``after_stage((kind, layer))`` runs after each
        stage (a comparison layer by layer). Returns each call's logits."""
        current = [next(c, None) for c in calls]
        # a lazy model decodes each routed expert where a call needs it: several calls' experts
        # run together, each expert decoded once per stage (expert_major)
        expert_major = (self.lazy is not None and len(calls) > 1
                        and any(self._is_experts(n) for n in self.refs))
        while current and current[0] is not None:
            stage = current[0]
            if any(st != stage for st in current):
                raise ProgramMismatch(f"calls run layer by layer must have the same stages; at {stage} "
                                      f"the calls are at {sorted(set(map(str, current)))}")
            current = (Rendezvous(calls).step() if expert_major else [next(c, None) for c in calls])
            if after_stage is not None:
                after_stage(stage)
            self.release()
        return [c.logits for c in calls]

    # -- KV cache -----------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """One cache per KV entry of the family (k and v, or MLA's latent) per layer, laid out
        [D, heads on this device, num_blocks * block_size, head_dim]; slot = block * size + offset.
        Heads outermost: a batch's context gathered along the slot dim is already laid out for
        one batched matmul per (device, head), with no copy to permute it."""
        layers = []
        for _ in range(self.dims.num_hidden_layers):
            layers.append({e["name"]: torch.zeros(self.ops.D, e["device_shape"][1], num_blocks * block_size,
                                                  e["device_shape"][3], dtype=self.kv_dtype, device=self.device)
                           for e in self.kv_layout["entries"]})
        return KVCache(layers, num_blocks, block_size)

    def program(self, phase: str, bucket: int) -> Program:
        try:
            return self.programs[(phase, bucket)]
        except KeyError:
            raise ValueError(f"no {phase} program for bucket {bucket}; the package has "
                             f"{sorted(self.programs)}") from None

    # -- forward ------------------------------------------------------------------------------
    def forward(self, program: Program, tokens, positions, valid, page_table, kv: KVCache,
                capture: list | None = None, mm: dict | None = None, rope_positions=None, last=None):
        """Run ``program`` on tokens/positions/valid [N, Tq]; page_table [N, blocks]. Returns
        logits [N, Tq, vocab] (device 0's copy; every device holds the same after the gather).
        ``last`` [N] (prefill): the one row of each sequence whose logits are wanted (the token
        sampled next); the head then runs on those N rows only, as a prefill program's head
        runs on one tile row (``lower``: at most ``TILE`` rows), and logits are [N, 1, vocab].
        One sequence (N = 1) may name several rows: logits [1, k, vocab] (``check``'s compared
        positions).
        ``mm``: image soft tokens merged after the embedding: ``mask`` [N*Tq] (the placeholder
        tokens), ``embeds`` [mask.sum(), hidden] (the vision program's output), ``blocks``
        [N, S] the image block of every context position (-1: text). ``rope_positions``
        [3, N, Tq]: M-RoPE positions (temporal, height, width) of a family with
        ``mrope_section`` (Qwen2.5-VL; ``patch_grid.mrope_positions`` makes a prompt's);
        None: ``positions`` in all three rows. Cache slots always come from ``positions``."""
        stages = self.stages(program, tokens, positions, valid, page_table, kv, capture, mm, rope_positions, last)
        for _ in stages:
            pass
        return stages.logits

    def final_hidden(self, program: Program, tokens, positions, valid, page_table, kv: KVCache,
                     last: int) -> torch.Tensor:
        """One sequence's final hidden states [Tq, hidden] (what the head reads: the last
        decoder layer's output, device 0's copy, as the residual stream is whole on every
        device, normalized with the weight the program's head reads first, its final norm):
        :meth:`forward` run as for generation (KV written; ``last``: the row whose logits the
        head computes)."""
        capture: list = []
        self.forward(program, tokens, positions, valid, page_table, kv, capture=capture, last=[last])
        h = capture[-1][0]
        head = next(lp for lp in program.layers if lp.kind == "head")
        norm = next((s for s in head.steps if s.op is Op.RMS_NORM), None)
        return h if norm is None else self._norm(h[None], norm.w, None)[0]

    def stages(self, program: Program, tokens, positions, valid, page_table, kv: KVCache,
               capture: list | None = None, mm: dict | None = None, rope_positions=None, last=None) -> "Stages":
        """:meth:`forward` one stage at a time: an iterator that yields ``(kind, layer)`` (layer
        None for the embedding and the head) before running that stage; the logits are its
        ``logits`` once exhausted. :meth:`run_layer_major` drives several in step."""
        return Stages(self._stages(program, tokens, positions, valid, page_table, kv, capture, mm,
                                   rope_positions, last), capture)

    def _stages(self, program, tokens, positions, valid, page_table, kv, capture, mm, rope_positions, last):
        N, Tq = tokens.shape
        if rope_positions is not None and tuple(rope_positions.shape) != (3, N, Tq):
            raise ValueError(f"rope_positions must be [3, {N}, {Tq}] (temporal, height, width per token), "
                             f"got {list(rope_positions.shape)}")
        dev = self.device
        tokens, positions, valid = tokens.to(dev), positions.to(dev), valid.to(dev)
        page_table = page_table.to(dev)
        bs = kv.block_size
        slot = page_table.gather(1, (positions // bs).clamp(max=page_table.shape[1] - 1)) * bs + positions % bs
        slots = torch.where(valid, slot, torch.full_like(slot, -1)).reshape(-1)
        S = int(positions[valid].max().item()) + 1 if bool(valid.any()) else 1
        nblk = -(-S // bs)
        # the context in whole blocks (positions past S are masked as later than every query):
        # a block is bs contiguous slots, so attention gathers blocks, not slots
        ctx_blocks = page_table[:, :nblk]
        ctx_slots = (ctx_blocks[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(N, -1)
        blocks = None
        if mm is not None and self._image_blocks:
            blocks = mm["blocks"].to(dev)
            if blocks.shape[1] < nblk * bs:
                blocks = torch.nn.functional.pad(blocks, (0, nblk * bs - blocks.shape[1]), value=-1)
        H = self.dims.hidden_size
        deep = None  # DeepStack (Qwen3-VL): the images' feature sets beside their soft tokens
        if mm is not None and mm["embeds"].shape[-1] > H:
            deep = {"mask": mm["mask"].to(dev), "deepstack": mm["embeds"][:, H:].to(dev)}
        ctx = Ctx(self.arch, self.traits, self.layer_traits, self.weight, positions, valid, slots,
                  ctx_slots, kv.layers, self.dtype, units=self.units, store=self._store, blocks=blocks,
                  rope_positions=None if rope_positions is None else rope_positions.to(dev),
                  context_blocks=ctx_blocks, block_size=bs, vision=deep, dims=self.dims,
                  invariant=gemm.batch_invariant())
        flat = tokens.reshape(-1)
        h = hv = None
        layer = 0
        logits = None
        for lp in program.layers:
            kind, count, steps = lp.kind, lp.count, lp.steps
            for _ in range(count):
                li = None if kind in ("embedding", "head") else layer
                yield kind, li  # the stage about to run (a layer-by-layer caller loads its weights)
                if kind == "head" and last is not None:
                    rows = torch.arange(N, device=dev) * Tq + torch.as_tensor(last, device=dev)
                    h = self.rep.share(h.index_select(1, rows), self.rep.all if hv is None else hv)
                acts, var = {"h": h, "tokens": flat}, ({} if hv is None else {"h": hv})
                h = None  # the layer's acts hold it (and drop what it no longer needs)
                out = self._run(program, kind, steps, acts, li, ctx, var)
                h, hv = acts["h"], var.get("h")
                if kind == "embedding":
                    if mm is not None:
                        h = self._merge_images(program, h, mm)
                    if capture is not None:  # the embedding's output too (None: left split)
                        capture.append(_device0(h).reshape(N, Tq, -1) if h.shape[-1] == self.dims.hidden_size
                                       else None)
                elif kind == "head":
                    logits = out
                else:
                    if capture is not None:
                        capture.append(_device0(h).reshape(N, Tq, -1))
                    layer += 1
                # the stage's activations go now, not when the next stage replaces them: a
                # layer-by-layer caller runs other work (the reference's layer) in between
                del acts, out
        vocab = self.dims.vocab_size
        return logits[0, :, :vocab].reshape(N, -1, vocab)

    def _merge_images(self, program: Program, h, mm: dict):
        """Image soft tokens in place of their placeholders; the embedding leaves ``h``
        replicated (its program gathers it), so every device takes the whole rows."""
        if h.shape[-1] != self.dims.hidden_size:
            raise ProgramMismatch(f"{program.name}: embedding leaves h split ({list(h.shape[2:])} of "
                                  f"{self.dims.hidden_size} features per device); image tokens need it whole")
        mask = mm["mask"].to(self.device)
        one = h.shape[0] > 1 and h.stride(0) == 0  # one copy viewed D times: edit that copy
        h = (h[:1] if one else h).clone()
        h[:, mask] = mm["embeds"][:, :self.dims.hidden_size].to(device=self.device, dtype=h.dtype)[None]
        return h.expand(self.ops.D, *h.shape[1:]) if one else h

    def encode_images(self, pixel_values, image_grid_thw=None):
        """The vision program of the smallest vision bucket holding the images (padding fills
        it) -> their soft tokens [soft tokens, hidden] in prompt order. ``pixel_values`` as the
        family's HF image processor makes them (Gemma 3: [n, C, S, S]; Qwen2.5-VL: [patches,
        C x temporal x patch^2] with ``image_grid_thw`` [n, 3]); what a bucket counts and the
        program's inputs are the family's vision part's (``program_inputs``)."""
        part = self.vision_part
        buckets = sorted(b for (ph, b) in self.programs if ph == "vision")
        if part is None or not buckets:
            raise ValueError("the package has no vision program (a text-only model)")
        bucket, inputs = vision_bucket(part, buckets, pixel_values, image_grid_thw)
        prog = self.program("vision", bucket)
        patches, meta, finish = part.program_inputs(inputs, bucket, self.dtype)
        T = patches.shape[0]
        patches = patches[None].to(self.device).expand(self.ops.D, -1, -1)
        zeros = torch.zeros(1, T, dtype=torch.long, device=self.device)
        ctx = Ctx(self.arch, self.traits, self.layer_traits, self.weight, zeros, zeros >= 0, zeros[0],
                  zeros, [], self.dtype, units=self.units, vision=meta, dims=self.dims,
                  invariant=gemm.batch_invariant())
        h, layer, out, var, deep = None, 0, None, {}, []
        for lp in prog.layers:
            layered = lp.kind.endswith("_layer")  # encoder layers (the others: embedding, projector)
            for _ in range(lp.count):
                acts = {"h": h, "patches": patches}
                var["patches"] = frozenset()  # the same pixels on every device
                self._run(prog, lp.kind, lp.steps, acts, layer if layered else None, ctx, var,
                          keep=("h", "image", "deep"))
                h = acts["h"]
                if layered:
                    layer += 1
                else:
                    out = acts
                    if "deep" in acts:  # a DeepStack merger's features (Qwen3-VL): beside the soft tokens
                        deep.append(acts["deep"][0])
        return finish(torch.cat([out["image"][0], *deep], dim=-1))

    def _run(self, program: Program, kind: str, steps, acts: dict, layer, ctx: Ctx, var: dict | None = None,
             keep=("h",)):
        """Run one layer program's ``steps`` on ``acts`` (name -> ``[D, ...]``), in place.

        ``var``: per activation, the mesh axes it varies over (:mod:`.replication`), updated as
        the steps run (a name missing from it varies over every axis): a norm, a kernel or a
        residual add whose inputs and weights are alike on several devices runs on one device of
        each class and shares the result; collectives run as written. Each activation is dropped
        right after its last read (``replication.drops``), except ``keep``."""
        var = {} if var is None else var
        dead = self._dead(steps, keep)
        result = None
        i = 0
        while i < len(steps):
            seg = self._moe_segment(steps, i, acts)
            if seg is None:
                r = self._step(program, kind, i, steps[i], acts, layer, ctx, var, dead)
                result = r if r is not None else result
                i += 1
                continue
            # the routed experts over a long call: the steps from the first expert matmul to the
            # Combine run on a band of tokens at a time (each token's experts are its own), so
            # their [D, T, E_local, ...] activations stay under MOE_ACT_BYTES
            end, band = seg
            T = _full(acts[steps[i].ins[0].name]).shape[1]
            outs = []
            for t0 in range(0, T, band):
                sub, sv = dict(acts), dict(var)
                for name in (steps[i].ins[0].name, ROUTE):
                    sub[name] = _full(acts[name])[:, t0:t0 + band]
                for j in range(i, end + 1):
                    self._step(program, kind, j, steps[j], sub, layer, ctx, sv, dead)
                outs.append(_full(sub[steps[end].out.name]))
                var[steps[end].out.name] = sv[steps[end].out.name]
            acts[steps[end].out.name] = torch.cat(outs, dim=1)
            for j in range(i, end + 1):
                for name in dead[j]:
                    acts.pop(name, None)
                    var.pop(name, None)
            i = end + 1
        for name in keep:  # what the caller reads: every device's copy
            if isinstance(acts.get(name), Classes):
                acts[name] = acts[name].full()
        return result

    def _moe_segment(self, steps, i: int, acts: dict):
        """Where step ``i`` is a routed-expert matmul on the tokens (``[D, T, K]``) whose expert
        activations ``[D, T, E_local, N]`` would exceed :data:`MOE_ACT_BYTES`: (the index of the
        Combine that ends its experts' steps, the tokens per band); else None."""
        st = steps[i]
        if st.op is not Op.MATMUL or not self._is_experts(st.w) or ROUTE not in acts:
            return None
        x = acts.get(st.ins[0].name)
        if x is None or len(x.shape) != 3:
            return None
        end = next((j for j in range(i + 1, len(steps)) if steps[j].op is Op.COMBINE), None)
        if end is None:
            return None
        D, T = x.shape[0], x.shape[1]
        widest = max(math.prod(self.refs[s.w].device_shape[::2]) for s in steps[i:end]
                     if s.op is Op.MATMUL and self._is_experts(s.w))  # E_local * N
        per_token = D * widest * 4
        if T * per_token <= MOE_ACT_BYTES or T < 2:
            return None
        return end, max(1, MOE_ACT_BYTES // per_token)

    def _step(self, program: Program, kind: str, i: int, st, acts: dict, layer, ctx: Ctx, var: dict, dead):
        """Step ``i`` of a layer program on ``acts`` (:meth:`_run`); the logits of a LOGITS step,
        else None."""
        ops, rep = self.ops, self.rep

        def v(name):
            return var.get(name, rep.all)

        result = None
        op = st.op
        out = st.out.name if st.out is not None else None
        if op is Op.ALL_REDUCE or op is Op.ALL_GATHER:
            x = _full(acts[st.act])
            out, y_v = st.act, rep.after_collective(v(st.act), st.axes)
            # only the representatives' results of what the collective leaves alike (rep.spread)
            sl = rep.reps(y_v)
            y = (ops.all_reduce(x, st.axes, sl) if op is Op.ALL_REDUCE
                 else ops.all_gather(x, st.axes, st.dim + 1, st.feature, self.policy, sl))
            x = None
            y = rep.spread(y, y_v)
        elif op is Op.EMBEDDING:
            y, y_v = self._embed(acts["tokens"], st.w), self._varies(st.w, None)
            if st.out.name == "h" and self.traits.get("embed_scale"):
                # HF casts the normalizer to the compute dtype first
                scale = torch.tensor(self.traits["embed_scale"], dtype=self.dtype)
                y, y_v = self._once(lambda w, c, e: e * scale, [y], y_v, ctx, layer)
        elif op is Op.RMS_NORM:
            y, y_v = self._once(lambda w, c, x: self._norm(x, st.w, layer, w), [acts[st.ins[0].name]],
                                v(st.ins[0].name), ctx, layer)
        elif op is Op.MATMUL:  # each device's own rows: a Classes input as every device's copy
            if self._is_experts(st.w) and ROUTE in acts:  # only the routed (token, expert) pairs
                y = self._experts(_full(acts[st.ins[0].name]), st, layer, _full(acts[ROUTE]))
            else:
                y = self._linear(_full(acts[st.ins[0].name]), st, layer, ctx.invariant)
            y_v = v(st.ins[0].name) | self._varies(st.w, layer)
        elif op is Op.LOCAL:
            fn = self.kernels.get(st.kernel)
            if fn is None:
                raise ProgramMismatch(f"{program.name}: {kind} step {i}: no emulated kernel {st.kernel!r}")
            names = [a.name for a in st.ins]
            y, y_v = self._once(lambda w, c, *xs: fn(c, layer, *xs), [acts[n] for n in names],
                                frozenset().union(*(v(n) for n in names)), ctx, layer)
        elif op is Op.RESIDUAL_ADD:
            n = st.ins[0].name
            out = "h"
            y, y_v = self._once(lambda w, c, h, r: h + r, [acts["h"], acts[n]], v("h") | v(n), ctx, layer)
        elif op is Op.LOGITS:
            # what forward returns is device 0's: the others' copies are never read
            x = rep.pick(acts[st.ins[0].name], slice(0, 1))
            result = softcap(x.float(), self.traits.get("final_softcap")).to(self.dtype)
            out = None
        elif op is Op.COMBINE:
            acts.update({n: _full(x) for n, x in acts.items() if isinstance(x, Classes)})
            y, y_v = self.kernels["combine"](ctx, layer, acts[st.ins[0].name], acts), rep.all
        else:  # pragma: no cover
            raise ProgramMismatch(f"{program.name}: {kind} step {i}: unknown op {op}")
        if out is not None:
            if st.out is not None and not op.collective:
                want = tuple(st.out.shape[1:])
                if tuple(y.shape[2:]) != want:
                    raise ProgramMismatch(f"{program.name}: {kind} step {i} ({st.kernel or op.value} -> "
                                          f"{st.out.name}): computed per-device features {list(y.shape[2:])}, "
                                          f"the program declares {list(want)}")
            acts[out], var[out] = rep.share(y, y_v), y_v
            y = None
        for name in dead[i]:
            acts.pop(name, None)
            var.pop(name, None)
        if self.observe is not None:
            self.observe(kind, i, acts)
        return result

    def _dead(self, steps, keep) -> list:
        """``replication.drops`` of a layer program, worked out once per program."""
        key = (id(steps), tuple(keep))
        hit = self._drops.get(key)
        if hit is None or hit[0] is not steps:
            hit = self._drops[key] = (steps, drops(steps, keep))
        return hit[1]

    def _varies(self, name: str, layer) -> frozenset:
        """The mesh axes weight ``name`` varies over: where its held shards differ, or its spec
        splits it (a matmul's device takes its slice of the input along those). Worked out once
        per (weight, layer): which devices share a shard is the package's, not the step's."""
        key = (name, layer)
        got = self._varies_of.get(key)
        if got is None:
            if self.lazy is not None and self._is_experts(name):  # an expert stack is never read whole
                group = self.lazy.group(name, None if self.decls[name].layers is None else layer)
            else:
                W = self._held(name, layer)
                group = W.group if isinstance(W, gemm.Packed) else gemm.shards_of(W)[1]
            split = frozenset(a for dim in range(len(self.refs[name].spec)) for a in self._split(name, dim))
            got = self._varies_of[key] = self.rep.of_group(group) | split
        return got

    def _once(self, fn, xs: list, varies: frozenset, ctx: Ctx, layer):
        """``fn(weight, ctx, *xs)`` (a per-device computation on ``[n, ...]`` inputs, reading
        weights through ``weight(name, layer)`` and ``ctx``) -> (its ``[D, ...]`` result, the
        axes that result varies over). Where the inputs vary over fewer axes than the mesh has,
        it runs on one device per class (``Replication.reps``) and the result is shared, unless
        a weight (or index table) it reads differs within a class (:class:`Varies`): then, as
        for inputs that differ everywhere, on every device. KV cache rows such a step writes go
        to the representatives' caches (views) and are then copied to their classes' devices,
        so every device's cache holds what it would have computed."""
        rep = self.rep
        sl = rep.reps(varies)
        if sl is not None:
            sub, held = self._on(sl, varies, ctx, layer)
            before = {k: c._version for k, c in held.items()}
            try:
                y = fn(sub.weights, sub, *(rep.pick(x, sl) for x in xs))
            except Varies:
                pass
            else:
                written = [k for k, c in held.items() if c._version != before[k]]
                if written:
                    _, wslots = _writes(ctx)
                    for k in written:
                        c = held[k]
                        c[:, :, wslots] = _full(rep.spread(c[sl][:, :, wslots], varies))
                return rep.spread(y, varies), varies
        return fn(self.weight, ctx, *(_full(x) for x in xs)), rep.all

    def _on(self, sl: slice, varies: frozenset, ctx: Ctx, layer):
        """``ctx`` restricted to the devices ``sl`` (each standing for its class of a value
        varying over ``varies``): weights, per-device index tables and this layer's KV cache
        (views: writes reach those devices' caches); a weight or table that differs within a
        class raises :class:`Varies`. Returns (that context, this layer's full caches)."""
        rep = self.rep

        def weight(name, lyr=None):
            W = self._held(name, lyr)
            if W is None:
                return None
            distinct, group = gemm.shards_of(gemm.dense(W) if isinstance(W, gemm.Packed) else W)
            if not rep.of_group(group) <= varies:
                raise Varies(name)
            idx = group[sl]
            if len(set(idx)) == 1:
                return distinct[idx[0]:idx[0] + 1].expand(len(idx), *distinct.shape[1:])
            return distinct.index_select(0, torch.tensor(idx, device=distinct.device))

        def units(name, dim):
            u = self.units(name, dim)
            if not rep.of_rows(u) <= varies:
                raise Varies(name)
            return u[sl]

        held, kv = {}, ctx.kv
        if layer is not None and layer < len(ctx.kv or ()):
            held = ctx.kv[layer]
            kv = list(ctx.kv)
            kv[layer] = {k: c[sl] for k, c in held.items()}
        return replace(ctx, weights=weight, units=units, kv=kv), held

    def _embed(self, tokens, name: str):
        """Each device's rows of its embedding shard, looked up once per distinct shard (devices
        holding one shard take the same rows of it)."""
        W, group = gemm.shards_of(self._held(name))  # [G, V_local, H_local]
        D = self.ops.D
        if W.shape[0] == D:
            return self._embed_rows_of(W, tokens, name, torch.arange(D, device=self.device))
        first = {}
        for d, g in enumerate(group):
            first.setdefault(g, d)
        reps = torch.tensor([first[g] for g in range(W.shape[0])], device=self.device)
        out = self._embed_rows_of(W, tokens, name, reps)  # [G, T, H_local]
        if W.shape[0] == 1:
            return out.expand(D, *out.shape[1:])
        return out.index_select(0, torch.tensor(group, device=self.device))

    def _embed_rows_of(self, W, tokens, name: str, devices):
        """``W [n, V_local, H_local]`` (the shards of ``devices``): the rows of ``tokens``."""
        t = self.decls[name]
        ax = self.refs[name].spec[0]
        if not ax:
            return W[:, tokens]
        if self._embed_rows is None:
            pos = self.ops.shard_positions(t.dims[0], ax, self.policy)  # [D, Vl]
            inv = torch.full((self.ops.D, t.shape[0] + 1), -1, dtype=torch.long, device=self.device)
            valid = pos >= 0
            rows = torch.arange(pos.shape[1], device=self.device).expand_as(pos)
            inv[torch.arange(self.ops.D, device=self.device)[:, None].expand_as(pos)[valid], pos[valid]] = rows[valid]
            self._embed_rows = inv
        rows = self._embed_rows.index_select(0, devices)[:, tokens]  # [n, T]
        out = torch.gather(W, 1, rows.clamp(min=0)[:, :, None].expand(-1, -1, W.shape[2]))
        return out * (rows >= 0)[:, :, None].to(out.dtype)

    def _split(self, name: str, dim: int):
        """Axes that split dim ``dim`` of weight ``name`` over more than one device, or ()."""
        key = (name, dim)
        if key not in self._splits:
            ax = self.refs[name].spec[dim]
            self._splits[key] = ax if math.prod(self.ops.mesh.axis_size(a) for a in ax) > 1 else ()
        return self._splits[key]

    def units(self, name: str, dim: int):
        """[D, L]: the global indices along dim ``dim`` of weight ``name``, in units, that each
        device holds (-1 = padding); for kernels that need global positions (expert ids)."""
        d = self.decls[name].dims[dim]
        return self.ops.shard_positions(replace(d, unit=1), self.refs[name].spec[dim], self.policy)

    def _norm(self, x, name: str, layer, weight=None):
        """RMSNorm with weight ``name`` (read through ``weight(name, layer)``: the devices of ``x``;
        default :meth:`weight`, every device). The family's ``traits["norms"][name]`` may give its
        ``eps`` and ``features``: normalize only the first ``features``, the rest pass (MLA's rope
        key)."""
        weight = weight or self.weight
        w = weight(name, layer)[:, None, :]
        how = self.traits.get("norms", {}).get(name, {})
        eps, n = how.get("eps", self.dims.rms_norm_eps), how.get("features")
        if how.get("layer_norm"):  # LayerNorm with a bias (vision towers)
            y = torch.nn.functional.layer_norm(x, x.shape[-1:], eps=eps)
            return y * w + weight(how["bias"], layer)[:, None, :]
        y = rms_norm(x if n is None else x[..., :n], w, eps, self.traits.get("norm_offset", 0.0),
                     self.traits.get("norm_weight_fp32", False))
        return y if n is None else torch.cat([y, x[..., n:]], dim=-1)

    def _is_experts(self, name: str) -> bool:
        """Whether matmul weight ``name`` is an expert stack (per device ``[E_local, K, N]``)."""
        ref = self.refs.get(name)
        return ref is not None and len(ref.device_shape) == 3

    def _experts(self, x, st, layer, route):
        """An expert stack's matmul on the (token, expert) pairs the router chose, as transformers'
        experts loop over the experts hit: ``x`` [D, T, K] (every expert reads the token) or
        [D, T, E_local, K] (each expert its own row) -> [D, T, E_local, N], zeros where ``route``
        [D, T, E] (each device's routing weights, nonzero = chosen) leaves a pair out (the
        Combine weights those by 0). Each local expert's matrix is taken from its distinct shard
        once per call and dropped after its product: a lazy model reads and decodes that one
        expert from the package (``LazyWeights.expert``), so a MoE layer holds one expert's
        matrix at a time, never the layer's stack (issue 37); several calls run layer by layer
        decode it once for all of them (:mod:`.expert_major`)."""
        name = st.w
        t = self.decls[name]
        lyr = None if t.layers is None else layer
        x_spec = st.ins[0].spec
        k_axes = self._split(name, len(t.dims) - 2)
        if k_axes and not x_spec[-1]:  # a replicated contraction dim meets a split weight
            x = self.ops.take(x, x.dim() - 1, self.ops.shard_positions(t.dims[-2], k_axes, self.policy))
        if x.dim() == 4:
            e_axes = self._split(name, 0)
            if e_axes and not x_spec[0]:
                x = self.ops.take(x, 2, self.ops.shard_positions(t.dims[0], e_axes, self.policy))
        mine = self.units(name, 0).tolist()  # [D][E_local] global expert ids (-1: padding)
        D, T = x.shape[:2]
        n_local, N = self.refs[name].device_shape[0], self.refs[name].device_shape[-1]
        if self.lazy is not None:
            group = self.lazy.group(name, lyr)

            def matrix(g, j):
                return self.lazy.expert(name, lyr, g, j)
        else:
            distinct, group = gemm.shards_of(self._held(name, layer))

            def matrix(g, j):
                return distinct[g, j]
        chosen = route != 0
        work = ExpertWork((name, lyr), matrix, x, x.new_zeros(D, T, n_local, N))
        for d, g in enumerate(group):
            for j in range(n_local):
                e = mine[d][j]
                if e < 0:
                    continue
                rows = chosen[d, :, e].nonzero().flatten()
                if rows.numel():
                    work.pairs.setdefault((g, j), []).append((d, rows))
        submit(work)  # now, or with the other calls of a layer-major stage (expert_major)
        return work.out

    def _linear(self, x, st, layer, invariant: bool | None = None):
        name = st.w
        W = self._held(name, layer)
        if name in self.traits.get("linear_fp32", ()):  # HF computes these in float32 (a router)
            x, W = x.float(), gemm.dense(W).float()
        t = self.decls[name]
        x_spec = st.ins[0].spec
        # a replicated contraction dim meets a split weight: each device takes its slice
        k_axes = self._split(name, len(t.dims) - 2)
        if k_axes and not x_spec[-1]:
            pos = self.ops.shard_positions(t.dims[-2], k_axes, self.policy)
            x = self.ops.take(x, x.dim() - 1, pos)
        if W.dim() == 3:  # [D, K, N]
            return gemm.matmul(x, W, invariant)
        # experts [D, E, K, N]
        W = gemm.dense(W)
        if x.dim() == 3:
            return torch.einsum("dtk,dekn->dten", x, W)
        e_axes = self._split(name, 0)
        if e_axes and not x_spec[0]:
            pos = self.ops.shard_positions(t.dims[0], e_axes, self.policy)
            x = self.ops.take(x, 2, pos)
        return torch.einsum("dtek,dekn->dten", x, W)


def _full(x):
    """An activation as every device's copy ``[D, ...]`` (:class:`~.replication.Classes`: a copy)."""
    return x.full() if isinstance(x, Classes) else x


def _device0(h: torch.Tensor) -> torch.Tensor:
    """Device 0's copy of ``h`` [D, ...] holding its own memory alone: a view of ``h[0]`` would
    keep all D devices' storage alive (a stride-0 view of one copy is kept as it is)."""
    v = h[0]
    return v if v.untyped_storage().nbytes() <= v.numel() * v.element_size() else v.clone()
