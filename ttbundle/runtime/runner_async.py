"""Async decode (vLLM's async scheduling; ``model_runner.async_decode_supported``): a decode
step sampled on the device is *submitted* and read back only when vLLM asks for its tokens
(:class:`AsyncDecodeOutput`). :class:`AsyncDecode` is the model runner's part that does it
(``TTModelRunner`` derives from it; the module docstring of ``model_runner`` tells the whole
story)."""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.outputs import AsyncModelRunnerOutput

from .phases import pick
from .runner_state import DecodeBatch, InFlight, ReqState, Step


class AsyncDecodeOutput(AsyncModelRunnerOutput):
    """vLLM's ``AsyncModelRunnerOutput`` for a submitted decode: ``get_output`` collects it."""

    def __init__(self, runner: "AsyncDecode", flight: InFlight):
        self.runner, self.flight = runner, flight

    def get_output(self):
        return self.runner._collect(self.flight)

    def get_kv_connector_output(self):
        return None



class AsyncDecode:
    """The model runner's async decode: submit a device-sampled decode (:meth:`_submit_decode`),
    collect it when its tokens are wanted (:meth:`_collect`). Uses the runner's ``mesh_model``,
    ``kv``, ``lanes``, ``decode_buckets``, ``_inflight``, ``_batch``, ``_lane_batches``,
    ``_block_epoch``, ``_page_table``, ``_device_sampling``, ``_decode_rope`` and ``_log``."""

    def _submit_decode(self, states: list[ReqState]) -> InFlight:
        """Enqueue a device-sampled decode of ``states`` without reading it back. A row whose
        input token is the in-flight step's unread output takes it on the device. The batch's
        page table and sampling parameters persist while its rows and their blocks stay
        (:class:`DecodeBatch`); per step only the positions (and any host-known tokens) are new.
        With lanes, every lane's batch is enqueued (each on its own KV region, or submesh) before
        the step returns: one part per lane, each fed from its own lane's previous part (a
        request never changes lane)."""
        t0 = time.perf_counter()
        prev = self._inflight
        if prev is not None and prev.output is not None:
            prev = None
        if self.lanes is None:
            flight, chained = self._submit_part(states, None, self.kv, prev)
            flight.step = Step("decode", [(st.req_id, st.num_computed, 1) for st in states], [flight.batch.bucket],
                               "device", mode="async", inputs=time.perf_counter() - t0, at=t0)
            flight.t0, flight.prev = t0, (prev if chained else None)
            self._inflight = flight
            return flight
        by_lane: dict = {}
        for st in states:
            by_lane.setdefault(self.lanes.of[st.req_id].index, []).append(st)
        prev_parts = {p.lane: p for p in prev.parts} if prev is not None and prev.parts else {}
        parts, chained_any = [], False
        for idx in sorted(by_lane):
            lane_states = by_lane[idx]
            part, chained = self._submit_part(lane_states, idx, self.lanes.of[lane_states[0].req_id].kv,
                                              prev_parts.get(idx))
            part.lane = idx
            parts.append(part)
            chained_any |= chained
        step = Step("decode", [(st.req_id, st.num_computed, 1) for st in states], [p.batch.bucket for p in parts],
                    "device", mode="async", inputs=time.perf_counter() - t0, at=t0)
        self._inflight = InFlight(list(states), None, step, t0, prev if chained_any else None, parts=parts)
        return self._inflight

    def _submit_part(self, states: list[ReqState], lane, kv, prev: InFlight | None) -> tuple[InFlight, bool]:
        """One batch's decode enqueued (the engine's, or lane ``lane``'s on ``kv``), fed from
        ``prev`` (the same batch's in-flight step) where its input tokens are still on the
        device: (its flight, without step, and whether it was fed)."""
        B = len(states)
        rids = tuple([st.req_id for st in states])
        batch = self._batch if lane is None else self._lane_batches.get(lane)
        epoch = self._block_epoch[lane]
        if batch is None or batch.rids != rids or batch.chained_src is None:
            bucket = pick(self.decode_buckets, B)
            src = torch.full((bucket,), -1, dtype=torch.long)
            src[:B] = torch.arange(B)
            batch = DecodeBatch(rids, epoch, bucket, self._page_table(states, bucket),
                                self._device_sampling(states, bucket), src, torch.zeros(bucket, 1, dtype=torch.long),
                                all(st.positions.plain for st in states))
            if lane is None:
                self._batch = batch
            else:
                self._lane_batches[lane] = batch
        elif batch.epoch != epoch:  # a row of this batch got a block: a new table (never changed in place)
            batch.page_table, batch.epoch = self._page_table(states, batch.bucket), epoch
        bucket = batch.bucket
        positions = [st.num_computed for st in states]
        # (through numpy: torch.tensor of a list took several times as long, per lane per step)
        pos = torch.from_numpy(np.array(positions + [-1] * (bucket - B), dtype=np.int64))
        if prev is not None and prev.batch is batch and \
                all(len(st.prompt) + len(st.output) == c for st, c in zip(states, positions)):
            tokens, src, chained = batch.zero_tokens, batch.chained_src, True  # the steady state
        else:
            tokens, src, chained = self._decode_inputs(states, bucket, prev)
        handle = self.mesh_model.decode_forward(
            tokens, pos, batch.page_table, kv, batch.sampling, read_from_device=False,
            **({"prev_output": prev.handle, "prev_rows": src} if chained else {}),
            **({} if batch.plain else self._decode_rope(states, pos)))
        return InFlight(list(states), handle, None, 0.0, batch=batch), chained

    @staticmethod
    def _decode_inputs(states: list[ReqState], bucket: int, prev: InFlight | None):
        """(tokens [bucket, 1], prev_rows [bucket], chained) of a decode whose rows are not all
        the previous step's rows in the same order: a token the host knows is written; one that
        is the in-flight step's unread output is taken from its row on the device."""
        tok, src = [0] * bucket, [-1] * bucket
        prev_row = {id(st): i for i, st in enumerate(prev.states)} if prev is not None else {}
        for i, st in enumerate(states):
            c, n_prompt = st.num_computed, len(st.prompt)
            if c < st.num_tokens:
                tok[i] = st.prompt[c] if c < n_prompt else st.output[c - n_prompt]
            elif id(st) in prev_row:
                src[i] = prev_row[id(st)]
            else:  # pragma: no cover - a pending token only ever comes from the step in flight
                raise RuntimeError(f"request {st.req_id}: input token at {st.num_computed} is not known")
        src_t = torch.tensor(src, dtype=torch.long)
        return torch.tensor(tok, dtype=torch.long)[:, None], src_t, any(r >= 0 for r in src)

    def _collect(self, flight: InFlight):
        """Read ``flight``'s tokens back (after the step it took tokens from), once."""
        from vllm.v1.outputs import ModelRunnerOutput

        if flight.output is not None:
            return flight.output
        if flight.prev is not None:
            self._collect(flight.prev)
        t = time.perf_counter()
        mm = self.mesh_model
        states = flight.states
        if flight.parts is None:
            ids = mm.process_decode_output_host(mm.read_decode_output(flight.handle), is_tokens=True)
            ids = ids[:len(states)].tolist()  # plain ints, one conversion for the batch
        else:  # lanes: every lane's part (enqueued together) read back in lane order
            got = {}
            for part in flight.parts:
                out = mm.process_decode_output_host(mm.read_decode_output(part.handle), is_tokens=True)
                got.update(zip((st.req_id for st in part.states), out[:len(part.states)].tolist()))
            ids = [got[st.req_id] for st in states]
        flight.step.wait = time.perf_counter() - t
        flight.step.seconds = time.perf_counter() - flight.t0
        for st, tok in zip(states, ids):
            st.output.append(tok)
        order = [st.req_id for st in states]
        tokens = [[tok] for tok in ids]
        flight.output = ModelRunnerOutput(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                                          sampled_token_ids=tokens, logprobs=None)
        flight.prev = None
        if self._inflight is flight:
            self._inflight = None
        self._log(flight.step)
        return flight.output
