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

    def _submit_decode(self, states: list[ReqState], counts: list[int] | None = None) -> InFlight:
        """Enqueue a device-sampled decode of ``states`` without reading it back. A row whose
        input token is the in-flight step's unread output takes it on the device. The batch's
        page table and sampling parameters persist while its rows and their blocks stay
        (:class:`DecodeBatch`); per step only the positions (and any host-known tokens) are new.
        With lanes, every lane's batch is enqueued (each on its own KV region, or submesh) before
        the step returns: one part per lane, each fed from its own lane's previous part (a
        request never changes lane). ``counts``: each row's tokens this step (several tokens a
        step, ``capabilities.tokens_per_step``): the decode is replayed ``max(counts)`` times,
        each replay fed the previous one's sampled ids on the device, a row at ``-1`` (padding)
        once it has its tokens."""
        counts = counts if counts and max(counts) > 1 else None
        t0 = time.perf_counter()
        prev = self._inflight
        if prev is not None and prev.output is not None:
            prev = None
        rows = [(st.req_id, st.num_computed, n) for st, n in zip(states, counts or [1] * len(states))]
        if self.lanes is None:
            flight, chained = self._submit_part(states, None, self.kv, prev, counts)
            flight.step = Step("decode", rows, [flight.batch.bucket],
                               "device", mode="async", inputs=time.perf_counter() - t0, at=t0)
            flight.t0, flight.prev = t0, (prev if chained else None)
            self._inflight = flight
            return flight
        by_lane: dict = {}
        for i, st in enumerate(states):
            by_lane.setdefault(self.lanes.of[st.req_id].index, []).append(i)
        prev_parts = {p.lane: p for p in prev.parts} if prev is not None and prev.parts else {}
        parts, chained_any = [], False
        for idx in sorted(by_lane):
            lane_states = [states[i] for i in by_lane[idx]]
            part, chained = self._submit_part(lane_states, idx, self.lanes.of[lane_states[0].req_id].kv,
                                              prev_parts.get(idx), counts and [counts[i] for i in by_lane[idx]])
            part.lane = idx
            parts.append(part)
            chained_any |= chained
        step = Step("decode", rows, [p.batch.bucket for p in parts],
                    "device", mode="async", inputs=time.perf_counter() - t0, at=t0)
        self._inflight = InFlight(list(states), None, step, t0, prev if chained_any else None, parts=parts)
        return self._inflight

    def _submit_part(self, states: list[ReqState], lane, kv, prev: InFlight | None,
                     counts: list[int] | None = None) -> tuple[InFlight, bool]:
        """One batch's decode enqueued (the engine's, or lane ``lane``'s on ``kv``), fed from
        ``prev`` (the same batch's in-flight step) where its input tokens are still on the
        device: (its flight, without step, and whether it was fed). ``counts``: each row's
        tokens, the decode replayed for them (:meth:`_submit_decode`)."""
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
                all(len(st.prompt) + len(st.output) + m - 1 == c
                    for st, c, m in zip(states, positions, prev.counts or [1] * B)):
            tokens, src, chained = batch.zero_tokens, batch.chained_src, True  # the steady state
        else:
            tokens, src, chained = self._decode_inputs(states, bucket, prev)
        mm = self.mesh_model
        handle = mm.decode_forward(
            tokens, pos, batch.page_table, kv, batch.sampling, read_from_device=False,
            **({"prev_output": prev.handle, "prev_rows": src} if chained else {}),
            **({} if batch.plain else self._decode_rope(states, pos)))
        if counts is None:
            return InFlight(list(states), handle, None, 0.0, batch=batch), chained
        # several tokens: replay j at each row's position + j (padding once the row has its
        # tokens), its input the previous replay's sampled id of the same row, on the device
        c = np.array(positions, dtype=np.int64)[:, None] + np.arange(max(counts), dtype=np.int64)[None, :]
        c[np.arange(max(counts))[None, :] >= np.array(counts)[:, None]] = -1
        c = np.concatenate([c, np.full((bucket - B, c.shape[1]), -1, dtype=np.int64)]).T.copy()
        handles = [handle]
        for j in range(1, c.shape[0]):
            pos = torch.from_numpy(c[j])
            handles.append(mm.decode_forward(
                batch.zero_tokens, pos, batch.page_table, kv, batch.sampling, read_from_device=False,
                prev_output=handles[-1], prev_rows=batch.chained_src,
                **({} if batch.plain else self._decode_rope(states, pos))))
        return InFlight(list(states), handles[-1], None, 0.0, batch=batch, handles=handles,
                        counts=list(counts)), chained

    @staticmethod
    def _decode_inputs(states: list[ReqState], bucket: int, prev: InFlight | None):
        """(tokens [bucket, 1], prev_rows [bucket], chained) of a decode whose rows are not all
        the previous step's rows in the same order: a token the host knows is written; one that
        is the in-flight step's unread output is taken from its row on the device (the row's
        last token of that step: its last replay's output, when every row ran every replay)."""
        tok, src = [0] * bucket, [-1] * bucket
        prev_row = {id(st): i for i, st in enumerate(prev.states)} if prev is not None else {}
        last = max(prev.counts) if prev is not None and prev.counts else 1
        for i, st in enumerate(states):
            c, n_prompt = st.num_computed, len(st.prompt)
            if c < st.num_tokens:
                tok[i] = st.prompt[c] if c < n_prompt else st.output[c - n_prompt]
            elif id(st) in prev_row and c == st.num_tokens + last - 1 and \
                    (prev.counts is None or prev.counts[prev_row[id(st)]] == last):
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
        states = flight.states
        if flight.parts is None:
            tokens = self._read_part(flight)
        else:  # lanes: every lane's part (enqueued together) read back in lane order
            got = {}
            for part in flight.parts:
                got.update(zip((st.req_id for st in part.states), self._read_part(part)))
            tokens = [got[st.req_id] for st in states]
        flight.step.wait = time.perf_counter() - t
        flight.step.seconds = time.perf_counter() - flight.t0
        for st, toks in zip(states, tokens):
            st.output += toks
        order = [st.req_id for st in states]
        flight.output = ModelRunnerOutput(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                                          sampled_token_ids=tokens, logprobs=None)
        flight.prev = None
        if self._inflight is flight:
            self._inflight = None
        self._log(flight.step)
        return flight.output

    def _read_part(self, part: InFlight) -> list[list[int]]:
        """Each row's sampled ids of one submitted batch (several per row when it replayed)."""
        mm = self.mesh_model
        n = len(part.states)
        if part.handles is None:  # plain ints, one conversion for the batch
            return [[t] for t in mm.process_decode_output_host(mm.read_decode_output(part.handle),
                                                               is_tokens=True)[:n].tolist()]
        cols = [mm.process_decode_output_host(mm.read_decode_output(h), is_tokens=True)[:n].tolist()
                for h in part.handles]
        return [[cols[j][i] for j in range(m)] for i, m in enumerate(part.counts)]
