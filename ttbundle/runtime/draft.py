"""Speculative decoding's draft proposer (``speculative: {method: draft}``, vLLM's
``draft_model``): the draft package built into the target's (``package.names.DRAFT_DIR``) runs
on the emulated mesh through the model protocol (``runtime.interface.MeshModel``: its own
generated adapter, ``prefill_forward`` / ``decode_forward``) with a KV region of its own.

Per step, for the requests that got tokens: each request's tokens the draft has not seen yet
are computed, which gives the first proposal (a prompt: prefilled in the draft's chunks, several
requests packed into one program call where ``phases.pack_prefill`` allows; the one or two
tokens a step adds past the accepted proposals: one call of the draft's verify program, built
into the draft for this (``speculative.draft_spec_text``), when any request is two or more
behind, else one decode step), and ``k - 1`` decode steps of the batch give the rest.
With lanes (``runtime.lanes``) the draft has a KV region per lane and each lane's requests run
as a batch of their own on it. Proposals are greedy (the argmax), as vLLM 0.33's ``DraftModelProposer``
with its default ``draft_sample_method: greedy``: it hands the rejection sampler no draft
probabilities, so acceptance is the rule ``sampling.accept`` applies to n-gram proposals (the
draft distribution one-hot on the proposal) and the target distribution is kept.

The draft's KV stays consistent under rejection by position: a request's draft cache is valid
up to ``_Slot.computed``; the proposals fed to the draft (all but the last) keep their entries
when the target accepted them (the same token at the same position after the same prefix) and
the rest are rewritten by the next step's tokens, the position rolled back to the accepted
length (attention reads no position past the row it computes). A request holds one slot of ``max_num_seqs`` full-length
sequences (``speculative.draft_kv_blocks``); with every slot taken, a request outside the
current batch gives its slot up and is prefilled again when it next proposes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import warmref
from ..package.names import DRAFT_DIR
from ..package.verify import load_adapter
from ..tiles import blocks_per_seq, pick
from . import packages
from .phases import pack_prefill

logger = logging.getLogger("vllm.ttbundle.draft")


@dataclass
class _Slot:
    index: int
    lane: int = 0  # the lane whose KV region holds it (``runtime.lanes``)
    computed: int = 0  # leading tokens of the request whose draft KV is valid
    fed: tuple = ()  # proposals fed to the draft after them (at positions computed, computed + 1, ...)


class DraftProposer:
    """Greedy proposals from the draft package inside ``package`` (a ``runtime.packages.Package``
    whose spec says ``speculative: {method: draft}``), ``k`` per request and step."""

    def __init__(self, package, k: int, max_model_len: int, dtype=torch.float32, lanes: int = 1):
        # verified with the target (package.verify checks the draft's files as the target's)
        self.package = packages.open_package(package.path / DRAFT_DIR, check_hashes=False)
        self.k, self.max_model_len, self.dtype = k, max_model_len, dtype
        rt = package.serving  # the target's recorded facts
        cls = load_adapter(self.package.path, self.package.manifest, self.package.metadata)
        self.model = cls.initialize_vllm_model(None, self.package.loaded.mesh, max(self.package.buckets.decode),
                                               max_model_len, 1, None, package=self.package, dtype=dtype,
                                               trace_mode="none")
        a = self.package.dims  # the draft's programs' sizes
        self.block_size = int(self.package.loaded.kv_cache["block_size"])  # the draft programs' KV layout
        self.blocks_per_seq = blocks_per_seq(max_model_len, self.block_size)
        self.num_slots = rt.max_num_seqs
        blocks = rt.draft_kv_blocks  # the plan's count (``speculative.draft_kv_blocks``), recorded at build
        if blocks is None:
            raise ValueError(f"{package.path}: the manifest records no draft KV blocks (serving.draft_kv_blocks) "
                             "for its draft; rebuild the package")
        # one KV region per lane (``runtime.lanes``: each lane is a replica of its own, the draft
        # beside the target on its submesh): a request's draft KV lives in its lane's
        self.kvs = [self.model.allocate_kv_cache((blocks, a.num_kv_heads, self.block_size, a.head_dim), dtype,
                                                 a.num_hidden_layers) for _ in range(lanes)]
        bk = self.package.buckets
        self.prefill_buckets, self.decode_buckets = list(bk.prefill), list(bk.decode)
        self.chunk = bk.prefill_chunk or max(bk.prefill)
        # its verify programs' rows per sequence (k + 1: ``speculative.draft_spec_text``); 0: a
        # draft built without them catches up with decode steps
        rows = self.package.serving.rows_per_seq
        self.catch_up_rows = rows if rows == k + 1 else 0
        self.slots: dict[str, _Slot] = {}
        self.proposed = 0  # proposals made (for logs and benches)
        logger.info("ttbundle: draft %s proposes %d tokens per step (KV of %d blocks x %d tokens%s)",
                    self.package.name, k, blocks, self.block_size, f" per lane, {lanes} lanes" if lanes > 1 else "")

    # -- vLLM's engine asks for proposals after every step -----------------------------------------
    def check_references(self, log=None) -> dict:
        """The draft's programs against the references its build recorded (``warmref``)."""
        pkg = self.package
        dt = str(self.dtype).removeprefix("torch.")
        return warmref.check_model(self.model.model, pkg.bundle, pkg.path, pkg.manifest, dt, log=log)

    def release(self, req_id: str) -> None:
        """A finished request gives its slot back."""
        self.slots.pop(req_id, None)

    def propose_batch(self, reqs: list[tuple[str, list[int]]], lanes: list[int] | None = None) -> list[list[int]]:
        """Up to ``k`` greedy proposals after each request's tokens (prompt and outputs), none
        past ``max_model_len``; ``reqs`` is [(req_id, tokens)], ``lanes`` each request's lane
        (0 .. lanes - 1, ``runtime.lanes``; None: lane 0). Each lane's requests run as a batch
        of their own on the lane's KV region (one program call per lane and step)."""
        out: list[list[int]] = [[] for _ in reqs]
        by_lane: dict[int, list[int]] = {}
        for i, lane in enumerate(lanes if lanes is not None else [0] * len(reqs)):
            by_lane.setdefault(lane, []).append(i)
        for lane in sorted(by_lane):
            for i, props in zip(by_lane[lane], self._propose_lane(lane, [reqs[i] for i in by_lane[lane]])):
                out[i] = props
        self.proposed += sum(len(o) for o in out)
        return out

    def _propose_lane(self, lane: int, reqs: list[tuple[str, list[int]]]) -> list[list[int]]:
        want = [min(self.k, self.max_model_len - len(t)) for _, t in reqs]
        live = [i for i, n in enumerate(want) if n > 0]
        out: list[list[int]] = [[] for _ in reqs]
        if not live:
            return out
        kv = self.kvs[lane]
        batch = {reqs[i][0] for i in live}
        slots = [self._slot(reqs[i][0], batch, lane) for i in live]
        first = self._catch_up([(slots[j], reqs[i][1]) for j, i in enumerate(live)], kv)
        for j, i in enumerate(live):
            out[i].append(first[j])
            slots[j].fed = ()
        # the rest: decode steps of the batch, each row fed its last proposal
        for step in range(1, max(want[i] for i in live)):
            rows = [(j, i) for j, i in enumerate(live) if want[i] > step]
            B = len(rows)
            bucket = pick(self.decode_buckets, B)
            tokens = torch.zeros(bucket, 1, dtype=torch.long)
            pos = torch.full((bucket,), -1, dtype=torch.long)
            for r, (j, i) in enumerate(rows):
                tokens[r, 0] = out[i][-1]
                pos[r] = len(reqs[i][1]) + step - 1
            logits = self.model.decode_forward(tokens, pos, self._table([slots[j] for j, _ in rows], bucket), kv)
            ids = logits[:B].argmax(-1).tolist()
            for r, (j, i) in enumerate(rows):
                out[i].append(int(ids[r]))
        for j, i in enumerate(live):  # proposals 1 .. n-1 were fed: their KV holds if they are accepted
            slots[j].fed = tuple(out[i][:-1])
        return out

    # -- internals ----------------------------------------------------------------------------
    def _slot(self, req_id: str, batch: set, lane: int = 0) -> _Slot:
        """The request's slot in its lane's KV region (a request keeps its lane: ``runtime.lanes``)."""
        s = self.slots.get(req_id)
        if s is not None:
            return s
        mine = {r: s for r, s in self.slots.items() if s.lane == lane}
        used = {s.index for s in mine.values()}
        free = [i for i in range(self.num_slots) if i not in used]
        if not free:  # a request outside this batch gives its slot up (prefilled again later)
            victim = next(r for r in mine if r not in batch)
            free = [self.slots.pop(victim).index]
        s = self.slots[req_id] = _Slot(free[0], lane)
        return s

    def _table(self, slots: list[_Slot], rows: int) -> torch.Tensor:
        """Page table rows of ``slots`` (block 0 is the null block; slot i owns a contiguous run)."""
        t = torch.zeros(rows, self.blocks_per_seq, dtype=torch.long)
        for r, s in enumerate(slots):
            t[r] = 1 + s.index * self.blocks_per_seq + torch.arange(self.blocks_per_seq)
        return t

    def _catch_up(self, work: list[tuple[_Slot, list[int]]], kv) -> list[int]:
        """Bring each request's draft KV up to its tokens and return the argmax after its last
        token. The proposals fed last step that the target accepted keep their KV (same tokens
        at the same positions); the rest is computed: a few tokens (what one step accepts) in one
        call of the draft's verify program when any request is 2 or more behind (else one decode
        step; a draft without verify programs: decode steps, one per token), a prompt as prefill
        chunks."""
        for s, toks in work:
            for t in s.fed:  # accepted proposals: their KV is the tokens'
                if s.computed < len(toks) - 1 and toks[s.computed] == t:
                    s.computed += 1
                else:
                    break
            s.fed = ()
            s.computed = min(s.computed, len(toks) - 1)  # at least the last token: its logits
        near = [len(toks) - s.computed <= self.k + 1 for s, toks in work]  # a few tokens behind
        which = [w for w, n in enumerate(near) if n]
        if self.catch_up_rows and any(len(work[w][1]) - work[w][0].computed > 1 for w in which):
            first = self._catch_up_call(work, which, kv)  # some 2 or more behind: one call for all
        else:
            first = self._decode_rounds(work, which, kv)  # each 1 behind (or an older draft): decode
        first.update(self._prefill(work, [w for w, n in enumerate(near) if not n], kv))
        return [first[w] for w in range(len(work))]

    def _catch_up_call(self, work, which: list[int], kv) -> dict[int, int]:
        """One call of the draft's verify program for the requests ``which`` (each at most
        ``k + 1`` tokens behind): each row its tokens from ``computed`` on, every row's logits
        back; the argmax after its last token is its first proposal."""
        B = len(which)
        bucket = pick(self.decode_buckets, B)
        tokens = torch.zeros(bucket, self.catch_up_rows, dtype=torch.long)
        pos = torch.full((bucket,), -1, dtype=torch.long)
        n = torch.zeros(bucket, dtype=torch.long)
        for r, w in enumerate(which):
            s, toks = work[w]
            tokens[r, :len(toks) - s.computed] = torch.tensor(toks[s.computed:])
            pos[r], n[r] = s.computed, len(toks) - s.computed
        logits = self.model.verify_forward(tokens, pos, n, self._table([work[w][0] for w in which], bucket), kv)
        first = {}
        for r, w in enumerate(which):
            first[w] = int(logits[r, int(n[r]) - 1].argmax())
            work[w][0].computed = len(work[w][1])
        return first

    def _decode_rounds(self, work, which: list[int], kv) -> dict[int, int]:
        """Decode steps of the requests ``which``, each fed its next token until its last."""
        first: dict[int, int] = {}
        while which:
            B = len(which)
            bucket = pick(self.decode_buckets, B)
            tokens = torch.zeros(bucket, 1, dtype=torch.long)
            pos = torch.full((bucket,), -1, dtype=torch.long)
            for r, w in enumerate(which):
                s, toks = work[w]
                tokens[r, 0], pos[r] = toks[s.computed], s.computed
            logits = self.model.decode_forward(tokens, pos, self._table([work[w][0] for w in which], bucket), kv)
            ids = logits[:B].argmax(-1).tolist()
            for r, w in enumerate(which):
                work[w][0].computed += 1
                if work[w][0].computed == len(work[w][1]):
                    first[w] = int(ids[r])
            which = [w for w in which if w not in first]
        return first

    def _prefill(self, work, which: list[int], kv) -> dict[int, int]:
        """Prefill the requests ``which`` from their ``computed`` to their end, in chunks of the
        draft's ``prefill_chunk`` (packed several to a call, ``phases.pack_prefill``)."""
        first: dict[int, int] = {}
        todo = list(which)
        while todo:
            chunks = []
            for w in todo:
                s, toks = work[w]
                chunks.append((w, s.computed, min(self.chunk, len(toks) - s.computed)))
            for S, R, idx in pack_prefill([n for _, _, n in chunks], self.prefill_buckets):
                members = [chunks[i] for i in idx]
                N = S // R
                tokens = torch.zeros(N, R, dtype=torch.long)
                for m, (w, c, n) in enumerate(members):
                    tokens[m, :n] = torch.tensor(work[w][1][c:c + n])
                logits = self.model.prefill_forward(tokens, self._table([work[w][0] for w, _, _ in members], N),
                                                    kv, [n for _, _, n in members], [c for _, c, _ in members])
                ids = logits.argmax(-1).tolist()
                for m, (w, c, n) in enumerate(members):
                    work[w][0].computed = c + n
                    if c + n == len(work[w][1]):
                        first[w] = int(ids[m])
            todo = [w for w in todo if work[w][0].computed < len(work[w][1])]
        return first
