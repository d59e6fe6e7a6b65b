"""Phase-constrained scheduling on top of vLLM's own scheduler.

Every step is **prefill-only**, **decode-only** or **empty**: a device runs one traced program
per step, and prefill and decode are different programs. Per step:

1. *Phase.* Prefill when some request has prompt left (a partial prefill in ``running``, or an
   admissible request in ``waiting``), unless decodes are waiting and ``K`` prefill steps
   have already run in a row; then decode. ``K`` is ``max_prefill_steps_between_decodes``
   (``--additional-config '{"tt": {"max_prefill_steps_between_decodes": K}}'``, default 1).
   A prefill step that cannot schedule anything (no KV blocks) falls back to decode.
2. *Prefill step.* Requests in FCFS order (partial prefills first, then ``waiting``) each
   get ``min(remaining, prefill_chunk)`` tokens, so a long prompt is split into chunks of
   exactly ``prefill_chunk`` tokens (only the last is shorter) and a chunk always starts at a
   multiple of ``prefill_chunk``. Requests join the step while the rows of the program calls
   that run its chunks (``phases.pack_prefill``: on the emulated mesh several short chunks share
   one call of a bucket, each padded to a tile-aligned slice of it; on a device one call per
   chunk, padded to its bucket) stay within the largest prefill bucket (the first always
   joins), and never past ``max_num_seqs`` running requests.
3. *Decode step.* Every running request whose prompt is computed decodes one token (with
   speculative decoding: its last token and its proposals, verified in one call); nothing
   is admitted. The runner pads the batch to the smallest decode bucket that holds it
   (``max_num_seqs`` <= the largest decode bucket, checked by the spec).

**Waiting bound.** A running request that is ready to decode waits at most ``K`` consecutive
prefill steps before a decode step includes it (preemption for lack of KV blocks aside; the
KV cache is sized so every sequence fits at max_model_len, so that does not happen at the
bundle's limits).

Everything else (KV block allocation, preemption, stop conditions, structured output, stats)
is vLLM's ``Scheduler``: each step restricts what it sees (the running requests of the phase,
how many waiting requests it may admit, the token budget) and calls ``super().schedule()``.
vLLM warns that the scheduler interface is not public: this module is pinned to vLLM 0.33.0.

**Async scheduling.** With vLLM's async scheduling on (the platform turns it on when the model
supports async decode, ``model_runner.async_decode_supported``), :class:`AsyncPhaseScheduler`
is used: the same rules on top of vLLM's ``AsyncScheduler``, which schedules step N+1 while
step N's sampled tokens are still on the device (a request then carries
``num_output_placeholders``: tokens scheduled whose values are not back yet). A request with a
placeholder is still *ready to decode*; the phase rules above count placeholders as tokens.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

from . import packages
from .activation import HARDWARE, active_platform
from .capabilities import device_top_k, model_capabilities, packed_prefill, serving_tokens_per_step
from .options import parse
from .phases import decode_shaped, is_decode, prefill_rows
from .sampling import host_sampled

logger = logging.getLogger("vllm.ttbundle.scheduler")


@dataclass
class StepRecord:
    """One scheduled step, for tests and the step log."""

    phase: str  # "prefill" | "decode" | "empty"
    tokens: dict  # req_id -> tokens scheduled
    starts: dict  # req_id -> first position scheduled
    decode_ready: list = field(default_factory=list)  # requests that could decode at step start
    seconds: float = 0.0  # host time of the schedule() call


class PhaseScheduler(Scheduler):
    """vLLM's scheduler, one phase per step (see the module docstring for the rules)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        pkg = packages.open_package(self.vllm_config.model_config.model, check_hashes=False)
        b = pkg.buckets
        opts = parse(self.vllm_config.additional_config)
        device = active_platform() == HARDWARE
        self.configure(list(b.prefill), b.prefill_chunk or max(b.prefill), list(b.decode),
                       opts.max_prefill_steps_between_decodes, packed=packed_prefill(device=device))
        k = serving_tokens_per_step(pkg, opts, device, self.vllm_config)
        caps = model_capabilities(pkg, device=device, vocab_size=pkg.dims.vocab_size)
        self.configure_tokens_per_step(k, device_top_k(caps, pkg.dims.vocab_size), caps["supports_device_seeds"])

    def configure_tokens_per_step(self, k: int, max_device_top_k: int | None = None,
                                  seeded_on_device: bool = True) -> None:
        """Decode steps of ``k`` tokens (``capabilities.tokens_per_step``): each decoding request
        gets ``k - 1`` placeholder proposals, so vLLM allocates and schedules ``k`` tokens and
        takes the ``k`` the runner returns as proposals all accepted. A step whose batch holds a
        row sampled on the host (``sampling.host_sampled``) schedules one token a request."""
        self.tokens_per_step = k
        self._device_sampling_rule = (max_device_top_k, seeded_on_device)
        self._host_rows: dict = {}  # req_id -> samples on the host (decided once per request)
        if k > 1:
            self.num_spec_tokens = k - 1
            self._k_placeholders = [-1] * (k - 1)

    def configure(self, prefill_buckets: list[int], chunk: int, decode_buckets: list[int],
                  max_prefill_run: int, packed: bool = False) -> None:
        self.prefill_buckets = sorted(prefill_buckets)
        self.chunk = chunk
        self.decode_buckets = sorted(decode_buckets)
        self.max_prefill_run = max_prefill_run
        self.packed = packed
        self.prefill_budget = max(self.prefill_buckets)  # padded tokens per prefill step
        self.prefill_run = 0
        self.records: deque[StepRecord] = deque(maxlen=10_000)
        self.adaptive_long_prefill_threshold = False
        self.local_prefill_interval = 1
        if self.scheduler_config.max_num_batched_tokens < self.prefill_budget:
            raise ValueError(f"max_num_batched_tokens={self.scheduler_config.max_num_batched_tokens} "
                             f"is below the largest prefill bucket {self.prefill_budget}")

    # -- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _decodes(r) -> bool:
        # placeholders (async scheduling): sampled tokens still on the device count as tokens;
        # proposals (speculative decoding) ride along with a decode, they are not prompt
        return is_decode(r.num_computed_tokens, r.num_prompt_tokens,
                         r.num_tokens + r.num_output_placeholders)

    @staticmethod
    def _last_in_flight(r) -> bool:
        """Async scheduling: the step in flight samples this request's last token (max_tokens),
        so nothing more is scheduled for it (vLLM's ``Scheduler.schedule`` has the condition for
        one token a step; its tokens in flight are its placeholders, several a step)."""
        return (r.num_output_placeholders > 0
                and r.num_output_tokens + r.num_output_placeholders >= r.max_tokens)

    def _waiting_in_order(self):
        yield from self.kv_holding_waiting
        yield from self.waiting

    def _plan_prefill(self, candidates: list | None = None) -> tuple[list, list, dict]:
        """(running partial prefills to schedule, waiting requests to admit, tokens per req).
        ``candidates``: the running requests that do not decode (``schedule`` sorted them out
        already), in ``running`` order; None: every running request."""
        planned_running, planned_waiting, tokens = [], [], {}
        free_slots = self.max_num_running_reqs - len(self.running)

        def take(r) -> bool:
            n = min(r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens, self.chunk)
            if n <= 0:  # nothing left to compute (its last step is still in flight)
                return True
            # the step's program calls as the runner will run them (packed or one per chunk)
            if tokens and prefill_rows(list(tokens.values()) + [n], self.prefill_buckets,
                                       self.packed) > self.prefill_budget:
                return False
            tokens[r.request_id] = n
            return True

        for r in (self.running if candidates is None else candidates):
            if self._decodes(r) or r.num_tokens_with_spec + r.num_output_placeholders <= r.num_computed_tokens:
                continue
            if not take(r):
                return planned_running, planned_waiting, tokens
            planned_running.append(r)
        if self._pause_state != PauseState.UNPAUSED:
            return planned_running, planned_waiting, tokens
        for r in self._waiting_in_order():
            if len(planned_waiting) >= free_slots:
                break
            # a blocked request (grammar compiling, ...) ends the plan: vLLM would skip it and
            # admit the next one with whatever budget is left, breaking chunk alignment
            if not self._handle_blocked_waiting_request(r):
                break
            if not take(r):
                break
            planned_waiting.append(r)
        return planned_running, planned_waiting, tokens

    def _run_restricted(self, visible: list, admit: int, budget: int, decode: bool = False):
        """``super().schedule()`` seeing only ``visible`` running requests, admitting at most
        ``admit`` waiting requests, with a token budget of ``budget``. Several tokens a step
        (``tokens_per_step``): vLLM's scheduler knows of the placeholder proposals in decode steps
        only; in a prefill step it would pad a request with one token left (a prompt found whole in
        the prefix cache) to a decode of ``tokens_per_step`` and, over the step's budget, never
        schedule it."""
        orig = list(self.running)
        saved = (self.max_num_active_reqs, self.max_num_scheduled_tokens,
                 self.scheduler_config.long_prefill_token_threshold, self.num_spec_tokens)
        visible_ids = {id(r) for r in visible}
        self.running = list(visible)
        self.max_num_active_reqs = len(visible) + admit
        self.max_num_scheduled_tokens = budget
        self.scheduler_config.long_prefill_token_threshold = self.chunk
        if self.tokens_per_step > 1 and not decode:
            self.num_spec_tokens = 0
        try:
            out = super().schedule()
        finally:
            after = self.running
            after_ids = {id(r) for r in after}
            orig_ids = {id(r) for r in orig}
            self.running = ([r for r in orig if id(r) not in visible_ids or id(r) in after_ids]
                            + [r for r in after if id(r) not in orig_ids])
            (self.max_num_active_reqs, self.max_num_scheduled_tokens,
             self.scheduler_config.long_prefill_token_threshold, self.num_spec_tokens) = saved
        return out

    def _host_sampled(self, r) -> bool:
        host = self._host_rows.get(r.request_id)
        if host is None:
            host = self._host_rows[r.request_id] = host_sampled(r.sampling_params, *self._device_sampling_rule)
        return host

    def _set_tokens_per_step(self, decodes: list, one: bool = False) -> None:
        """This step's decodes each run ``tokens_per_step`` tokens (placeholder proposals), or
        all one when a row samples on the host (its logits must come back every token) or when
        ``one`` (a prompt waits to prefill: a decode step of K tokens would hold it K device
        steps instead of one)."""
        if one or any(self._host_sampled(r) for r in decodes):
            for r in decodes:
                r.spec_token_ids = []
        else:
            for r in decodes:
                if len(r.spec_token_ids) != self.tokens_per_step - 1:
                    r.spec_token_ids = self._k_placeholders

    def make_spec_decoding_stats(self, spec_decoding_stats, *args, **kwargs):
        # several tokens per step is not speculation: nothing proposed, nothing to report
        if self.tokens_per_step > 1:
            return spec_decoding_stats
        return super().make_spec_decoding_stats(spec_decoding_stats, *args, **kwargs)

    def _free_request(self, request, *args, **kwargs):
        self._host_rows.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)

    # -- the step -------------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False):
        t0 = time.perf_counter()
        decodes, others = [], []  # one pass over running: ready to decode, or maybe prefilling
        for r in self.running:
            if self._decodes(r):
                if not self._last_in_flight(r):
                    decodes.append(r)
            else:
                others.append(r)
        planned_running, planned_waiting, tokens = self._plan_prefill(others)
        want_prefill = bool(tokens)
        if self.tokens_per_step > 1 and decodes:  # while a prompt waits, one token a step
            self._set_tokens_per_step(decodes, one=want_prefill)
        prefill_first = want_prefill and (not decodes or self.prefill_run < self.max_prefill_run)
        out = None
        if prefill_first:
            out = self._run_restricted(planned_running, len(planned_waiting), sum(tokens.values()))
            # (a prompt found in the prefix cache schedules fewer tokens than planned: not a deviation)
            bad = {r: n for r, n in out.num_scheduled_tokens.items() if tokens.get(r, 0) < n}
            if bad:  # vLLM deviated from the plan (should not happen): say so, keep serving
                logger.warning("ttbundle scheduler: prefill chunks %s differ from the plan %s", bad, tokens)
            if out.total_num_scheduled_tokens == 0 and decodes:
                first = out  # no progress (e.g. no free KV blocks): decode instead
                out = self._run_restricted(decodes, 0, sum(1 + len(r.spec_token_ids) for r in decodes), decode=True)
                out.finished_req_ids = set(first.finished_req_ids) | set(out.finished_req_ids)
                out.preempted_req_ids = set(first.preempted_req_ids or ()) | set(out.preempted_req_ids or ())
        elif decodes:  # each decode its last token and its proposals (speculative decoding)
            out = self._run_restricted(decodes, 0, sum(1 + len(r.spec_token_ids) for r in decodes), decode=True)
        else:
            out = self._run_restricted([], 0, 0)
        if not prefill_first and not out.scheduled_new_reqs and \
                decode_shaped(out.num_scheduled_tokens, out.scheduled_spec_decode_tokens):
            phase = "decode"  # only decode-ready requests were visible, nothing admitted, one token each
            # (and its proposals, or placeholders for several tokens a step)
        else:
            phase = self._phase_of(out)
        if phase == "prefill" and decodes:
            self.prefill_run += 1
        elif phase == "decode":
            self.prefill_run = 0
        starts = {}
        for r in out.scheduled_new_reqs:
            starts[r.req_id] = r.num_computed_tokens
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            starts[rid] = c.num_computed_tokens[i]
        self.records.append(StepRecord(phase, dict(out.num_scheduled_tokens), starts,
                                       [r.request_id for r in decodes], time.perf_counter() - t0))
        return out

    def _phase_of(self, out) -> str:
        if not out.total_num_scheduled_tokens:
            return "empty"
        kinds = set()
        for rid, n in out.num_scheduled_tokens.items():
            r = self.requests[rid]
            start = r.num_computed_tokens - n  # already advanced by _update_after_schedule
            # async scheduling: the placeholder this step added (a step that samples) is not a token yet
            added = 1 if isinstance(self, AsyncScheduler) and not r.is_prefill_chunk else 0
            total = r.num_tokens_with_spec + r.num_output_placeholders - added
            spec = len(out.scheduled_spec_decode_tokens.get(rid, ()))  # proposals verified with it
            kinds.add(n == 1 + spec and is_decode(start, r.num_prompt_tokens, total))
        if len(kinds) > 1:
            raise RuntimeError(f"ttbundle scheduler: a step mixes prefill and decode: "
                               f"{out.num_scheduled_tokens}")
        return "decode" if kinds.pop() else "prefill"


class AsyncPhaseScheduler(PhaseScheduler, AsyncScheduler):
    """:class:`PhaseScheduler`'s rules over vLLM's ``AsyncScheduler`` (async scheduling on): the
    phase rules are the same; ``AsyncScheduler`` adds the output placeholders."""
