"""Static-shape entry points on the emulated mesh: prefill in chunks padded to a prefill bucket,
decode batches padded to a decode bucket, on one paged KV cache (:class:`Runner`)."""

from __future__ import annotations

import torch

from ...tiles import blocks_per_seq, pick
from .model import EmulatedModel
from .state import Stages

class Runner:
    """Prefill / decode with padding to the bundle's buckets, on one KV cache."""

    def __init__(self, model: EmulatedModel, num_blocks: int | None = None):
        self.model = model
        b = model.bundle.buckets
        self.prefill_buckets, self.decode_buckets = list(b.prefill), list(b.decode)
        self.chunk = b.prefill_chunk or max(b.prefill)
        self.block = int(model.kv_layout["block_size"])
        self.max_blocks = blocks_per_seq(model.dims.max_model_len, self.block)
        self.kv = model.allocate_kv_cache(num_blocks or model.kv_layout["num_blocks"], self.block)
        self.shapes_run: set = set()  # (phase, bucket) pairs executed

    def prefill(self, tokens: list[int], page_table: list[int], start: int = 0, capture=None,
                mm: dict | None = None, rope_positions=None):
        """Prefill ``tokens`` at positions start.. in chunks; returns last-token logits [vocab].
        ``mm``: images in the prompt: ``embeds`` [M, hidden] (soft tokens in prompt order),
        ``positions`` (the M prompt indices they take) and ``blocks`` (per prompt token its image
        block, -1 for text); an image's block must lie within one chunk. ``rope_positions``
        [3, len(tokens)]: the tokens' M-RoPE positions (None: their positions)."""
        calls = self.prefill_calls(tokens, page_table, start, capture is not None, mm, rope_positions)
        for c in calls:
            c.drain()
            if capture is not None:
                capture.append([None if x is None else x[0, :c.rows] for x in c.capture])
        return calls[-1].logits[0, 0]

    def prefill_calls(self, tokens: list[int], page_table: list[int], start: int = 0, capture: bool = False,
                      mm: dict | None = None, rope_positions=None, head_rows: list[int] | None = None) -> list:
        """:meth:`prefill` as its program calls, one per chunk, not yet run (:class:`Stages`;
        run them in order, or layer by layer with ``EmulatedModel.run_layer_major``); a call's
        ``logits`` [1, 1, vocab] are its chunk's last token's. ``head_rows`` (indices into
        ``tokens``): the head also runs on these rows (as it runs on the last), and a call's
        logits are [1, k, vocab] for its ``head_rows`` (the chunk's rows among them, then its
        last row if not among them), in that order."""
        calls = []
        rank = {} if mm is None else {j: r for r, j in enumerate(mm["positions"])}
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
            mmc = None
            if mm is not None:
                sel = [j for j in mm["positions"] if i <= j < i + len(chunk)]
                mask = torch.zeros(bucket, dtype=torch.bool)
                mask[[j - i for j in sel]] = True
                blocks = torch.full((1, max(pos + bucket, start + len(tokens))), -1, dtype=torch.long)
                blocks[0, start:start + len(tokens)] = torch.tensor(mm["blocks"], dtype=torch.long)
                mmc = {"mask": mask, "embeds": mm["embeds"][[rank[j] for j in sel]], "blocks": blocks}
            rp = None
            if rope_positions is not None:
                rp = torch.zeros(3, 1, bucket, dtype=torch.long)
                rp[:, 0, :len(chunk)] = rope_positions[:, i:i + len(chunk)]
            want = sorted(j - i for j in (head_rows or ()) if i <= j < i + len(chunk))
            last = want + ([len(chunk) - 1] if len(chunk) - 1 not in want else [])
            c = self.model.stages(self.model.program("prefill", bucket), t,
                                  torch.where(valid, p, torch.zeros_like(p)), valid, pt, self.kv,
                                  [] if capture else None, mm=mmc, rope_positions=rp, last=last)
            c.rows = len(chunk)
            c.head_rows = [i + r for r in last]
            calls.append(c)
            pos += len(chunk)
        return calls

    def decode(self, tokens: list[int], positions: list[int], page_tables: list[list[int]], capture=None,
               rope_deltas: list[int] | None = None):
        """One decode step for a batch; returns logits [B, vocab]. ``rope_deltas``: per row the
        M-RoPE delta of its prompt (rope position = position + delta in all three rows)."""
        c = self.decode_call(tokens, positions, page_tables, capture is not None, rope_deltas).drain()
        if capture is not None:
            capture.append([None if x is None else x[:c.rows, 0] for x in c.capture])
        return c.logits[:c.rows, 0]

    def decode_call(self, tokens: list[int], positions: list[int], page_tables: list[list[int]],
                    capture: bool = False, rope_deltas: list[int] | None = None) -> Stages:
        """:meth:`decode` as its program call, not yet run (:class:`Stages`); its ``logits`` are
        [bucket, 1, vocab], the first ``rows`` real."""
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
        rp = None
        if rope_deltas is not None:
            d = torch.zeros(bucket, 1, dtype=torch.long)
            d[:B, 0] = torch.tensor(rope_deltas)
            rp = (p + d)[None].expand(3, -1, -1)
        c = self.model.stages(self.model.program("decode", bucket), t, p, valid, pt, self.kv,
                              [] if capture else None, rope_positions=rp)
        c.rows = B
        return c

    def _table(self, rows: list[list[int]]) -> torch.Tensor:
        pt = torch.zeros(len(rows), self.max_blocks, dtype=torch.long)
        for i, r in enumerate(rows):
            pt[i, :len(r)] = torch.tensor(r[:self.max_blocks])
        return pt
