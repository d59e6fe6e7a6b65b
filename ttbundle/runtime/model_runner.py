"""The model runner: vLLM's scheduler output in, one padded program per sequence or batch out.

Per step (the scheduler guarantees one phase per step):

* prefill: each scheduled sequence's chunk (at most ``prefill_chunk`` tokens) runs alone,
  padded to the smallest prefill bucket that holds it; a sequence whose chunk ends its prompt
  samples its first token, a partial chunk returns ``[]``.
* decode: the batch runs padded to the smallest decode bucket that holds it.
* verify (speculative decoding, vLLM's ``--speculative-config``): a decode whose rows carry
  vLLM's scheduled proposals runs the package's verify program of that bucket (each row its last
  token and its proposals) and returns each row's accepted tokens (``sampling.accept``); after
  every step the runner proposes the next ones (``speculation.py``, ``take_draft_token_ids``).

Sampling is decided per batch: on the device (the program returns token ids) unless a row
needs the host (``sampling.host_reasons``) or ``sample_on_device_mode`` excludes the phase;
then the program returns logits and vLLM's sampler runs in :meth:`sample_tokens`.

The runner keeps each request's tokens itself (vLLM sends the sampled tokens of cached
requests only with pipeline parallelism); a resumed request's block list replaces the old one.

**Async decode** (vLLM's async scheduling on; :func:`async_decode_supported`): a decode step
sampled on the device is *submitted* (``decode_forward(read_from_device=False)``: on a device
the trace is enqueued and the call returns at once) and ``sample_tokens`` hands vLLM an
:class:`AsyncDecodeOutput` whose ``get_output`` *collects* it (``read_decode_output``: waits
for the device, reads the token ids back). vLLM schedules step N+1 before it asks for step N's
tokens, so decode N+1 is submitted before N is read back: its rows whose input token is N's
still-unread output take it on the device (``prev_output``/``prev_rows``). Every other step
(prefill, host-sampled decode) is synchronous, and first collects the step in flight when one of
its rows needs a token that step produces (host sampling needs the output tokens on the host).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections import deque

import numpy as np
import torch

from .. import warmref
from ..families.vision_part import decode_rope
from ..package.verify import load_adapter
from ..tiles import blocks_per_seq
from .capabilities import async_decode, device_top_k, packed_prefill, serving_tokens_per_step
from .images import chunk_inputs, request_state
from .interface import MeshModel
from .lanes import Lanes, plan_lanes_for
from .phases import is_decode, pack_prefill, pick
from .runner_async import AsyncDecode, AsyncDecodeOutput
from .runner_lanes import LaneDecode
from .runner_state import DecodeBatch, InFlight, ReqState, Step
from .sampling import DeviceSampling, HostSampler, PromptLogprobs, host_reasons, host_sampled
from .speculation import proposer_for
from .ttdevice import TTDeviceModel

logger = logging.getLogger("vllm.ttbundle.model_runner")


def async_decode_supported(emulated: bool) -> bool:
    """Whether decode steps may be submitted before the previous one is read back, so vLLM's
    async scheduling can stay on (``capabilities.async_decode``: the one flag the models'
    ``model_capabilities["supports_async_decode"]`` report too)."""
    return async_decode(device=not emulated)



def model_class(package):
    """The class ``vllm_metadata.json`` names (``module:Class``), which must be the package's own
    adapter: imported from its verified file by path (``package.verify.load_adapter``), never through
    ``sys.path``, no bytecode read or written."""
    try:
        return load_adapter(package.path, package.manifest, package.metadata)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"{package.path}/vllm_metadata.json: main_class {package.metadata['main_class']!r} "
                           f"cannot be loaded: {e}") from None


class TTModelRunner(AsyncDecode, LaneDecode):
    def __init__(self, vllm_config, package, options, device: torch.device, tt=None):
        self.tt = tt  # (ttnn, mesh device) on the TT platform; None: the emulated mesh
        self.vllm_config = vllm_config
        self.package = package
        self.bundle = package.bundle
        self.options = options
        self.device = device
        mc = vllm_config.model_config
        self.dtype = mc.dtype if mc.dtype in (torch.float32, torch.bfloat16) else torch.float32
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        self.max_blocks = blocks_per_seq(self.max_model_len, self.block_size)
        self.dims = package.dims  # the programs' sizes (KV spec, logits), not bundle.yaml's arch
        self.vocab_size = self.dims.vocab_size
        b = package.buckets  # the manifest's (what the programs were lowered for)
        self.prefill_buckets, self.decode_buckets = list(b.prefill), list(b.decode)
        self.chunk = b.prefill_chunk or max(b.prefill)
        self.sample_mode = options.sample_mode(package.serving.sample_on_device_mode)
        self.requests: dict[str, ReqState] = {}
        self.mesh_model: MeshModel | None = None  # the package's model (runtime.interface: the one protocol)
        self.model = None  # an nn.Module for vLLM's hooks (it walks .modules()); holds mesh_model
        self.kv = None
        self.host: HostSampler | None = None
        self.prompt_lp: PromptLogprobs | None = None
        self._prompt_lp_out: dict = {}  # req_id -> LogprobsTensors, emitted with this step's output
        self._pending = None
        self._inflight: InFlight | None = None  # the last submitted decode, until collected
        self._batch: DecodeBatch | None = None  # the last async decode's persistent batch
        # per lane (None without lanes): bumped whenever a request of that lane starts or its block
        # list changes, so one lane's new block leaves the other lanes' page tables as they are
        self._block_epoch: collections.Counter = collections.Counter()
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self.step_log: deque[Step] = deque(maxlen=10_000)
        self._log_path = os.environ.get("TTBUNDLE_STEP_LOG")
        # opened once, when the runner starts (an empty log: no step yet), line-buffered: each
        # step's line is written whole
        self._log_file = open(self._log_path, "a", buffering=1) if self._log_path else None
        self.lane_plan = plan_lanes_for(vllm_config, package, options)  # replicas / DP / lanes
        self.lanes = None  # runtime.lanes.Lanes when this engine drives more than one replica
        self._lane_batches: dict[int, DecodeBatch] = {}  # lane -> its persistent decode batch
        self.packed_prefill = packed_prefill(device=tt is not None)  # several prompts per prefill call
        self.proposer = proposer_for(vllm_config, package, self.dtype, self.lane_plan.lanes)  # or None
        self._spec: dict = {}  # this step's scheduled proposals, req_id -> [token ids]
        self._drafts = None  # DraftTokenIds for the next step (take_draft_token_ids)
        self.tokens_per_step = serving_tokens_per_step(package, options, tt is not None, vllm_config)

    # -- set-up ---------------------------------------------------------------------------------
    def load_model(self):
        t0 = time.perf_counter()
        if self.tt is not None:
            ttnn, mesh_device = self.tt
            self.mesh_model = TTDeviceModel.initialize_vllm_model(
                self.vllm_config.model_config.hf_config, mesh_device,
                self.vllm_config.scheduler_config.max_num_seqs, self.max_model_len, self.lane_plan.lanes,
                self.options.optimizations, package=self.package, options=self.options,
                sample_mode=self.sample_mode, ttnn=ttnn)
        else:
            cls = model_class(self.package)
            self.mesh_model = cls.initialize_vllm_model(
                self.vllm_config.model_config.hf_config, self.package.loaded.mesh,
                self.lane_plan.per_lane_seqs, self.max_model_len, self.lane_plan.lanes,
                self.options.optimizations, package=self.package, dtype=self.dtype,
                trace_mode=self.options.trace_mode)
        self.model = torch.nn.Module()
        object.__setattr__(self.model, "mesh_model", self.mesh_model)
        self.host = HostSampler(self.vllm_config, self.vllm_config.scheduler_config.max_num_seqs,
                                self.max_model_len, self.block_size, self.vocab_size, self.device)
        self.prompt_lp = PromptLogprobs(self.host.sampler, self.vllm_config.model_config.logprobs_mode)
        self.max_device_top_k = device_top_k(self.mesh_model.model_capabilities, self.vocab_size)
        logger.info("ttbundle: loaded %s on %s %s (%s) in %.1f s", self.package.name,
                    "a Tenstorrent" if self.tt is not None else "an emulated", self.package.mesh_name,
                    str(self.dtype).removeprefix("torch."), time.perf_counter() - t0)

    def kv_cache_spec(self) -> dict:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        a = self.dims
        spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=a.num_kv_heads,
                                 head_size=a.head_dim, dtype=self.dtype)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(a.num_hidden_layers)}

    def kv_bytes_per_block(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_spec().values())

    def initialize_kv_cache(self, num_blocks: int):
        a = self.dims
        lp = self.lane_plan
        if lp.lanes > 1:  # one region per lane: vLLM's pool is lanes x the per-lane formula
            per = num_blocks // lp.lanes
            kvs = [self.mesh_model.allocate_kv_cache((per, a.num_kv_heads, self.block_size, a.head_dim),
                                                     self.dtype, a.num_hidden_layers) for _ in range(lp.lanes)]
            self.lanes = Lanes(lp.first_replica, kvs, per)
            self.kv = kvs[0]  # warm-up runs the (shared) programs once
            logger.info("ttbundle: %s; KV cache of %d blocks x %d tokens per lane", lp.describe(), per,
                        self.block_size)
            return
        self.kv = self.mesh_model.allocate_kv_cache((num_blocks, a.num_kv_heads, self.block_size, a.head_dim),
                                                    self.dtype, a.num_hidden_layers)
        logger.info("ttbundle: KV cache of %d blocks x %d tokens", num_blocks, self.block_size)

    def warm_up(self):
        """Every bucket once (compile; on hardware also trace capture), then seal: no shape
        outside the warmed set runs while serving."""
        if not self.options.enable_model_warmup:
            logger.warning("ttbundle: enable_model_warmup=false: the first request of each shape "
                           "compiles during serving")
            return
        t0 = time.perf_counter()
        if self.tt is None:
            self._check_references()
            if self.proposer is not None:  # the draft's programs (method: draft) against its build's
                self.proposer.check_references(log=logger.info)
        dev = self.sample_mode != "off"
        self.mesh_model.warmup_model_prefill(self.kv, self.options.trace_mode == "all",
                                             dev and self.sample_mode == "all")
        self.mesh_model.warmup_model_decode(self.kv, self.options.trace_mode != "none",
                                            max(self.decode_buckets, default=0), self.kv.num_blocks, dev)
        self.mesh_model.seal()
        logger.info("ttbundle: warmed up %d prefill and %d decode buckets in %.1f s",
                    len(self.prefill_buckets), len(self.decode_buckets), time.perf_counter() - t0)

    def _check_references(self):
        """Each program on its fixed input against the reference the build recorded
        (``ttbundle.warmref``): a package whose weights or programs are not what was built fails
        here, naming the program and row, before the server reports healthy."""
        pkg = self.package
        dt = str(self.dtype).removeprefix("torch.")
        done = warmref.check_model(self.mesh_model.model, pkg.bundle, pkg.path, pkg.manifest, dt,
                                  log=logger.info)
        missing = warmref.unchecked(pkg.manifest)
        if missing:
            logger.warning("ttbundle: no warm-up reference for %s (built with --no-warmup): not checked",
                           ", ".join(missing))
        logger.info("ttbundle: %d programs match the build's warm-up references (%s)", len(done), dt)

    # -- per step -------------------------------------------------------------------------------
    def _update_states(self, so) -> None:
        if self.lanes is not None:
            self._update_lanes(so)
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            if self.proposer is not None:
                self.proposer.release(rid)
            self.host.remove(rid)
            self.prompt_lp.remove(rid)
        for nr in so.scheduled_new_reqs:
            sp = nr.sampling_params
            gen = None
            if sp.seed is not None:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(sp.seed)
            st = self.requests[nr.req_id] = ReqState(nr.req_id, list(nr.prompt_token_ids), sp, gen,
                                                     list(nr.block_ids[0]), nr.num_computed_tokens)
            st.host_sampling = self._needs_host(sp)
            self._blocks_changed(nr.req_id)
            if getattr(nr, "mm_features", None):
                self._request_images(self.requests[nr.req_id], nr.mm_features)
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            st = self.requests[rid]
            new = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                if self.lanes is not None:
                    self.lanes.free_blocks(self.lanes.of[rid], st.block_ids)
                st.block_ids = list(new[0]) if new is not None else []
                self._blocks_changed(rid)
            elif new is not None and new[0]:
                st.block_ids += new[0]
                self._blocks_changed(rid)
            st.num_computed = c.num_computed_tokens[i]
            full = c.all_token_ids.get(rid)
            if full is not None and len(full) > st.num_tokens:  # tokens we never saw
                st.output += full[st.num_tokens:]

    def _lane_key(self, rid: str):
        """The key of ``rid``'s persistent decode batch: its lane's index, None without lanes."""
        return None if self.lanes is None else self.lanes.of[rid].index

    def _blocks_changed(self, rid: str) -> None:
        self._block_epoch[self._lane_key(rid)] += 1

    def _needs_host(self, params) -> bool:
        """Whether a request's rows sample on the host (``sampling.host_reasons``, or a seed the
        device cannot honour): decided once per request (its parameters never change)."""
        return host_sampled(params, getattr(self, "max_device_top_k", None), self.mesh_model.seeded_on_device)

    def _request_images(self, st: ReqState, features) -> None:
        """A new request's images and its prompt's positions, as the family's vision part lays
        them out (``runtime.images.request_state``)."""
        st.images, st.positions = request_state(self.bundle.family.vision_part(self.bundle.arch), features,
                                                st.prompt)

    def _decode_rope(self, states: list[ReqState], pos: torch.Tensor) -> dict:
        """``rope_positions`` for a decode batch holding a request with M-RoPE positions ({}
        otherwise): each row at its cache position plus its prompt's delta."""
        if all(st.positions.plain for st in states):
            return {}
        deltas = torch.zeros_like(pos)
        deltas[:len(states)] = torch.tensor([st.positions.delta for st in states], dtype=torch.long)
        return {"rope_positions": decode_rope(pos, deltas)}

    def execute_model(self, so):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        self._update_states(so)
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        rows = [(self.requests[rid], n) for rid, n in so.num_scheduled_tokens.items()]
        self._spec = dict(getattr(so, "scheduled_spec_decode_tokens", None) or {})  # speculative decoding
        phases = {is_decode(st.num_computed, len(st.prompt), max(st.num_tokens, st.num_computed + 1))
                  and n == 1 + len(self._spec.get(st.req_id, ()))
                  for st, n in rows}  # (async: a decode's input token may still be on the device)
        if len(phases) != 1:
            raise RuntimeError("a step mixes prefill and decode; the ttbundle scheduler must be "
                               "in use (scheduler_cls)")
        decode = phases.pop()
        sampled_rows = [st for st, n in rows if st.num_computed + n >= st.num_tokens]
        allowed = self.sample_mode == "all" or (self.sample_mode == "decode_only" and decode)
        on_device = allowed and not any(st.host_sampling for st in sampled_rows)
        # several tokens a step (capabilities.tokens_per_step): the scheduler's placeholder
        # proposals are the step's extra tokens, every one produced on the device
        counts = [n for _, n in rows] if decode and self.tokens_per_step > 1 and self._spec else None
        if counts is not None and not on_device:
            raise RuntimeError("a decode step of several tokens a row has a row sampled on the host; "
                               "the ttbundle scheduler schedules one token a row then")
        if self.async_scheduling and decode and on_device:
            self._pending = ("async", self._submit_decode([st for st, _ in rows], counts))
            return None  # vLLM asks sample_tokens for the output
        if counts is not None:  # synchronous: submitted and read back at once
            flight = self._submit_decode([st for st, _ in rows], counts)
            flight.step.mode = "sync"
            return self._collect(flight)
        # a synchronous step: the tokens its rows need must be on the host first
        if self._inflight is not None and any(st.num_computed + n > st.num_tokens for st, n in rows):
            self._collect(self._inflight)
        sampled_rows = [st for st, n in rows if st.num_computed + n >= st.num_tokens]
        t0 = time.perf_counter()
        if decode and self.lanes is not None:
            result, step = self._decode_lanes([st for st, _ in rows], on_device)
        elif decode:
            result, step = self._decode([st for st, _ in rows], on_device)
        else:
            result, step = self._prefill(rows, on_device)
        step.seconds, step.at = time.perf_counter() - t0, t0
        step.sampling = ("none" if not sampled_rows else "device" if on_device else "host")
        self._log(step)
        if not sampled_rows or on_device:
            out = self._output(rows, result if on_device else {}, None)
            if self.async_scheduling:  # vLLM calls sample_tokens for every step that ran
                self._pending = ("done", out)
                return None
            return out
        self._pending = (so, rows, sampled_rows, result)
        return None

    def sample_tokens(self, grammar_output):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if self._pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        pending, self._pending = self._pending, None
        if pending[0] == "async":
            return AsyncDecodeOutput(self, pending[1])
        if pending[0] == "done":
            return pending[1]
        so, rows, sampled_rows, logits = pending
        order, ids, lp = self.host.sample(sampled_rows, logits, so, grammar_output)
        return self._output(rows, dict(zip(order, ids)), (order, lp))

    # -- async decode: submit now, collect when vLLM asks for the tokens --------------------------
    def _output(self, rows, sampled: dict, host):
        from vllm.v1.outputs import ModelRunnerOutput

        # host-sampled rows first, in the sampler's order, so logprobs rows line up
        order = list(host[0]) if host else []
        order += [st.req_id for st, _ in rows if st.req_id not in set(order)]
        tokens = []
        for rid in order:
            st = self.requests[rid]
            tok = sampled.get(rid)
            if tok is None:
                tokens.append([])
            else:  # one token, or a verify step's accepted proposals and the model's own token
                toks = [int(t) for t in tok] if isinstance(tok, list) else [int(tok)]
                st.output += toks
                tokens.append(toks)
        if self.proposer is not None:
            self._propose(order, tokens)
        prompt_lp, self._prompt_lp_out = self._prompt_lp_out, {}
        return ModelRunnerOutput(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                                 sampled_token_ids=tokens, logprobs=host[1] if host else None,
                                 prompt_logprobs_dict=prompt_lp)

    # -- speculative decoding (vLLM's --speculative-config: ngram or a draft model) --------------
    def _propose(self, order: list, tokens: list) -> None:
        """Proposals for the next step of every request that got tokens this step (vLLM's
        scheduler takes them with ``take_draft_token_ids`` and schedules them with the request's
        next decode). A request that samples on the host proposes nothing: its steps run the
        plain decode program (host fallback)."""
        from vllm.v1.outputs import DraftTokenIds

        ids, asks = [], []
        for rid, toks in zip(order, tokens):
            st = self.requests.get(rid)
            if not toks or st is None:
                continue
            ids.append(rid)
            if not (host_reasons(st.params, self.max_device_top_k) or self.sample_mode == "off"):
                asks.append((rid, st.prompt + st.output))
        lanes = None if self.lanes is None else \
            [self.lanes.of[r].index - self.lane_plan.first_replica for r, _ in asks]  # a draft's KV per lane
        got = dict(zip((r for r, _ in asks), self.proposer.propose_batch(asks, lanes))) if asks else {}
        self._drafts = DraftTokenIds(ids, [got.get(rid, []) for rid in ids]) if ids else None

    def take_draft_token_ids(self):
        drafts, self._drafts = self._drafts, None
        return drafts

    def _verify(self, states: list[ReqState], on_device: bool):
        """A decode step with proposals: the verify program of the batch's decode bucket (each
        row its last token and its proposals), acceptance on the device path
        (``sampling.accept``). Host sampling (a row needs the logits, or the phase samples on
        the host) never comes here: :meth:`_decode` runs the plain decode program, every
        proposal is rejected and vLLM's sampler draws one token per row, as without speculation."""
        B = len(states)
        bucket = pick(self.decode_buckets, B)
        K1 = self.package.serving.rows_per_seq
        tokens = torch.zeros(bucket, K1, dtype=torch.long)
        pos = torch.full((bucket,), -1, dtype=torch.long)
        n = torch.zeros(bucket, dtype=torch.long)
        for i, st in enumerate(states):
            d = list(self._spec.get(st.req_id, ()))[:K1 - 1]
            tokens[i, 0] = st.tokens(st.num_computed, 1)[0]
            tokens[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
            pos[i], n[i] = st.num_computed, 1 + len(d)
        res = self.mesh_model.verify_forward(tokens, pos, n, self._page_table(states, bucket), self._kv_of(states[0]),
                                             self._device_sampling(states, bucket))
        out = {st.req_id: [int(t) for t in res[i] if int(t) >= 0] for i, st in enumerate(states)}
        return out, Step("verify", [(st.req_id, st.num_computed, int(n[i])) for i, st in enumerate(states)],
                         [bucket], "")

    def _page_table(self, states: list[ReqState], rows: int) -> torch.Tensor:
        pt = np.zeros((rows, self.max_blocks), dtype=np.int64)  # block 0: vLLM's null block
        for i, st in enumerate(states):
            b = st.block_ids[:self.max_blocks]
            if self.lanes is not None:  # the lane's own blocks (its region's 0 is its null block)
                b = self.lanes.local(self.lanes.of[st.req_id], b)
            pt[i, :len(b)] = b
        return torch.from_numpy(pt)

    def _kv_of(self, st: ReqState):
        return self.kv if self.lanes is None else self.lanes.of[st.req_id].kv

    def _device_sampling(self, states: list[ReqState], rows: int) -> DeviceSampling:
        return DeviceSampling.from_params([s.params for s in states], [s.generator for s in states], rows)

    def _packable(self, st, n) -> bool:
        """Whether a prefill chunk may share a program call with others (``_prefill_packs``):
        text only (a request with images prefills alone: its chunk merges soft tokens and takes
        its own M-RoPE positions, ``st.positions``) and no prompt logprobs (those need every row's
        logits). A text-only request of an M-RoPE model packs: its rope positions are its cache
        positions in all three rows, the forward's default."""
        return (self.packed_prefill and st.images is None and st.positions.plain
                and self.prompt_lp.wanted(st.req_id, st.params, self.vocab_size) is None)

    def _prefill_packs(self, rows, on_device):
        """The packable chunks of a prefill step as ``phases.pack_prefill`` plans them (the plan
        the scheduler sized the step with), per KV cache (lanes): each call runs one prefill
        program on several sequences (``prefill_forward`` with tokens [N, R]); a call of one
        sequence is the plain per-prompt call. Returns (sampled per request, bucket per row)."""
        out, bucket_of, calls = {}, {}, []
        groups: dict = {}
        for st, n in rows:
            groups.setdefault(id(self._kv_of(st)), []).append((st, n))
        for group in groups.values():
            for S, R, idx in pack_prefill([n for _, n in group], self.prefill_buckets):
                members = [group[i] for i in idx]
                N = S // R
                calls.append([S, R, len(members)])
                tokens = torch.zeros(N, R, dtype=torch.long)
                lens, starts = [0] * N, [0] * N
                for j, (st, n) in enumerate(members):
                    tokens[j, :n] = torch.tensor(st.tokens(st.num_computed, n))
                    lens[j], starts[j] = n, st.num_computed
                    bucket_of[st.req_id] = S
                states = [st for st, _ in members]
                sampled = [st for st, n in members if st.num_computed + n >= st.num_tokens]
                res = self.mesh_model.prefill_forward(
                    tokens, self._page_table(states, N), self._kv_of(states[0]), lens, starts,
                    self._device_sampling(states, N) if (sampled and on_device) else None)
                for j, (st, n) in enumerate(members):
                    if st.num_computed + n >= st.num_tokens:
                        out[st.req_id] = int(res[j]) if on_device else res[j]
        return out, bucket_of, calls

    def _prefill(self, rows, on_device):
        out, buckets = {}, []
        packed = [(st, n) for st, n in rows if self._packable(st, n)]
        if len(packed) > 1:
            out, bucket_of, calls = self._prefill_packs(packed, on_device)
            alone = [(st, n) for st, n in rows if st.req_id not in bucket_of]
            res, step = self._prefill(alone, on_device) if alone else ({}, None)
            out.update(res)
            solo = dict(zip((st.req_id for st, _ in alone), step.buckets)) if step else {}
            buckets = [bucket_of.get(st.req_id) or solo[st.req_id] for st, _ in rows]
            calls += step.calls if step else []
            return out, Step("prefill", [(st.req_id, st.num_computed, n) for st, n in rows], buckets, "",
                             calls=calls)
        # every chunk enqueued before any is read back: on a device, chunks of different lanes
        # (each lane its own submesh) run side by side instead of one after another
        submitted = []
        for st, n in rows:
            bucket = pick(self.prefill_buckets, n)
            buckets.append(bucket)
            tokens = torch.zeros(1, bucket, dtype=torch.long)
            tokens[0, :n] = torch.tensor(st.tokens(st.num_computed, n))
            samples = st.num_computed + n >= st.num_tokens
            k = self.prompt_lp.wanted(st.req_id, st.params, self.vocab_size)  # host path (host_reasons)
            kw = {"return_prompt_logits": True} if k is not None else {}
            if st.images is not None:
                mm = chunk_inputs(st.images, self.mesh_model.encode_images, st.num_computed, n, bucket)
                if mm is not None:
                    kw["mm"] = mm
            kw.update(st.positions.chunk(st.num_computed, n, bucket))
            submitted.append((st, n, samples, k, self.mesh_model.prefill_forward(
                tokens, self._page_table([st], 1), self._kv_of(st), [n], [st.num_computed],
                self._device_sampling([st], 1) if (samples and on_device) else None, read_from_device=False, **kw)))
        for st, n, samples, k, handle in submitted:
            res = self.mesh_model.read_prefill_output(handle)
            if k is not None:  # every position's logits [n, V]: the prompt's, then the last one's
                done = self.prompt_lp.add(st.req_id, st.prompt, k, st.num_computed, res)
                if done is not None:
                    self._prompt_lp_out[st.req_id] = done
                res = res[n - 1:n]
            if samples:
                out[st.req_id] = int(res[0]) if on_device else res[0]
        return out, Step("prefill", [(st.req_id, st.num_computed, n) for st, n in rows], buckets, "",
                         calls=[[b, b, 1] for b in buckets])

    def _decode(self, states, on_device):
        if on_device and any(self._spec.get(st.req_id) for st in states):
            return self._verify(states, on_device)
        B = len(states)
        bucket = pick(self.decode_buckets, B)
        tokens = torch.zeros(bucket, 1, dtype=torch.long)
        pos = torch.full((bucket,), -1, dtype=torch.long)
        for i, st in enumerate(states):
            tokens[i, 0] = st.tokens(st.num_computed, 1)[0]
            pos[i] = st.num_computed
        res = self.mesh_model.decode_forward(tokens, pos, self._page_table(states, bucket), self._kv_of(states[0]),
                                             self._device_sampling(states, bucket) if on_device else None,
                                             **self._decode_rope(states, pos))
        out = {st.req_id: (int(res[i]) if on_device else res[i]) for i, st in enumerate(states)}
        return out, Step("decode", [(st.req_id, st.num_computed, 1) for st in states], [bucket], "")

    def _log(self, step: Step):
        if self.lanes is not None:
            # (a request that finished while its step was in flight has left its lane: None)
            step.lanes = [getattr(self.lanes.of.get(rid), "index", None) for rid, _, _ in step.rows]
        elif self.lane_plan.replicas > 1:  # one replica per engine: this DP rank's
            step.lanes = [self.lane_plan.first_replica] * len(step.rows)
        self.step_log.append(step)
        if self._log_file is not None:
            self._log_file.write(json.dumps(step.__dict__) + "\n")
