"""Lanes in the model runner (``runtime/lanes.py`` owns the plan: which lane a request runs in,
each lane's KV region): :class:`LaneDecode` is the model runner's part that keeps requests in
their lanes and runs a decode step over every lane (``TTModelRunner`` derives from it)."""

from __future__ import annotations

import time

import torch

from .phases import pick
from .runner_state import DecodeBatch, ReqState, Step


def _input_token(st: ReqState) -> int:
    """A decode row's input token (the one at ``num_computed``), without joining the lists."""
    c, n = st.num_computed, len(st.prompt)
    return st.prompt[c] if c < n else st.output[c - n]


class LaneDecode:
    """The model runner's lanes: requests join, leave and give back blocks in their lane
    (:meth:`_update_lanes`); a decode step runs every lane's batch (:meth:`_decode_lanes`). Uses
    the runner's ``lanes``, ``_lane_batches``, ``mesh_model``, ``requests``, ``_spec``,
    ``decode_buckets``, ``_block_epoch``, ``_page_table``, ``_device_sampling``, ``_decode_rope``
    and ``_decode``."""

    def _update_lanes(self, so) -> None:
        """Requests leave their lane when they finish (their blocks with them), give their
        blocks back when preempted, and join the least-loaded lane when first scheduled."""
        for rid in list(so.finished_req_ids) + list(getattr(so, "preempted_req_ids", None) or ()):
            st = self.requests.get(rid)
            if rid in so.finished_req_ids:
                self.lanes.release(rid, st.block_ids if st else ())
            elif st is not None and rid in self.lanes.of:
                self.lanes.free_blocks(self.lanes.of[rid], st.block_ids)
                st.block_ids = []
        for nr in so.scheduled_new_reqs:
            self.lanes.assign(nr.req_id)

    def _decode_lanes(self, states, on_device):
        """One decode step over every lane: each lane's rows run as that lane's batch, padded to
        its own decode bucket, on its own KV region (on a device: its own submesh). Every lane's
        program is enqueued before any is read back (``read_from_device=False``, lane order), so
        on a device the lanes run at the same time: the step waits for the slowest lane, not for
        their sum. Each lane's page table and sampling inputs persist while its rows and their
        blocks stay (:class:`DecodeBatch`, one per lane). A step with proposals (speculative
        decoding, emulated mesh) runs each lane's verify program in turn."""
        by_lane: dict = {}
        for st in states:
            by_lane.setdefault(self.lanes.of[st.req_id].index, []).append(st)
        if on_device and any(self._spec.get(st.req_id) for st in states):
            return self._verify_lanes(states, by_lane, on_device)
        mm = self.mesh_model
        t0 = time.perf_counter()
        submitted = []
        for idx in sorted(by_lane):
            t = time.perf_counter()
            lane_states = by_lane[idx]
            batch = self._lane_batch(idx, lane_states, on_device)
            B, bucket = len(lane_states), batch.bucket
            tokens = torch.zeros(bucket, 1, dtype=torch.long)
            pos = torch.full((bucket,), -1, dtype=torch.long)
            tokens[:B, 0] = torch.tensor([_input_token(st) for st in lane_states], dtype=torch.long)
            pos[:B] = torch.tensor([st.num_computed for st in lane_states], dtype=torch.long)
            handle = mm.decode_forward(tokens, pos, batch.page_table, self.lanes.of[lane_states[0].req_id].kv,
                                       batch.sampling if on_device else None, read_from_device=False,
                                       **self._decode_rope(lane_states, pos))
            submitted.append((lane_states, handle, bucket, time.perf_counter() - t))
        t_read = time.perf_counter()
        out, buckets, secs = {}, [], []
        for lane_states, handle, bucket, submit in submitted:
            t = time.perf_counter()
            res = mm.process_decode_output_host(mm.read_decode_output(handle), is_tokens=on_device)
            if on_device:
                out.update(zip((st.req_id for st in lane_states), res[:len(lane_states)].tolist()))
            else:
                out.update((st.req_id, res[i]) for i, st in enumerate(lane_states))
            buckets.append(bucket)
            secs.append(submit + time.perf_counter() - t)
        return out, Step("decode", [(st.req_id, st.num_computed, 1) for st in states], buckets, "",
                         lane_seconds=secs, inputs=t_read - t0, wait=time.perf_counter() - t_read)

    def _lane_batch(self, idx: int, states, on_device: bool) -> DecodeBatch:
        """Lane ``idx``'s persistent batch: rebuilt when its rows change, its page table when a
        row's blocks changed (``_block_epoch[idx]``), its sampling inputs when the sampling side
        changes; the same tensors otherwise (the device model then skips their copies)."""
        rids = tuple([st.req_id for st in states])
        batch = self._lane_batches.get(idx)
        epoch = self._block_epoch[idx]
        if batch is None or batch.rids != rids or (batch.sampling is None) == on_device:
            bucket = pick(self.decode_buckets, len(states))
            batch = self._lane_batches[idx] = DecodeBatch(
                rids, epoch, bucket, self._page_table(states, bucket),
                self._device_sampling(states, bucket) if on_device else None, None, None)
        elif batch.epoch != epoch:  # a new table (never changed in place)
            batch.page_table, batch.epoch = self._page_table(states, batch.bucket), epoch
        return batch

    def _verify_lanes(self, states, by_lane: dict, on_device: bool):
        out, buckets, secs, rows, phase = {}, [], [], {}, "decode"
        for idx in sorted(by_lane):
            t0 = time.perf_counter()
            res, step = self._decode(by_lane[idx], on_device)
            secs.append(time.perf_counter() - t0)
            out.update(res)
            buckets += step.buckets
            rows.update((r[0], r) for r in step.rows)
            phase = "verify" if step.phase == "verify" else phase
        return out, Step(phase, [rows[st.req_id] for st in states], buckets, "", lane_seconds=secs)
