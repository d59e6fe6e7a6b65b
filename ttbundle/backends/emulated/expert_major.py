"""Routed experts run expert-major across several program calls (issue 37).

A lazy model (``LazyWeights``: the warm-up, ``check``, ``cache verify``) reads and decodes each
routed expert from the package where a call's expert matmul needs it, and drops it after its
product: a MoE layer holds one expert's matrix, never the layer's stack. Run layer by layer
(``EmulatedModel.run_layer_major``), several calls go through the same layer one after another,
and each decoded the experts it routes to itself: the build's warm-up (five programs) decoded a
layer's popular experts up to five times, block-float decoding being most of its time.

:class:`Rendezvous` runs one stage of several calls so that each expert is decoded once for all
of them: each call runs in its own thread, **one thread at a time, in the calls' order**, until
it reaches an expert matmul (:func:`submit` parks it with its :class:`ExpertWork`) or the end of
the stage; once every call of a group is parked or done, the parked works run together
(:func:`run_works`: each expert matrix decoded once, then its products for every work that
routes a token to it), and the calls resume, again one at a time and in order. Calls join a
group only while their parked activations stay under :data:`GROUP_BYTES`; a group finishes the
stage before the next starts. A call's steps run in the same order as before and see the same
inputs (a later call still sees the KV rows an earlier call wrote in
the layer: attention runs before the experts), and each product is the same ``xs @ W`` on the
same values, so results are bit for bit those of running the calls one after another.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

_local = threading.local()
#: the expert activations (input and output) that parked calls may hold together: calls join a
#: group until theirs reach this (a group of one call over it: a long prefill runs alone as
#: before), so running calls together never holds more than this beyond one call's own
GROUP_BYTES = 256 << 20


@dataclass
class ExpertWork:
    """One expert stack's matmul on one call's routed (token, expert) pairs: ``out[d, rows, j] =
    x[d, rows] (@ its expert j's input row when ``x`` is per expert) @ matrix(g, j)`` for every
    ``(d, rows, j)`` listed under ``(g, j)`` in ``pairs``; ``key`` (weight name, layer) says
    which works read the same matrices."""

    key: tuple
    matrix: object  # (g, j) -> the decoded expert matrix [K, N]
    x: torch.Tensor  # [D, T, K] or [D, T, E_local, K]
    out: torch.Tensor  # [D, T, E_local, N]
    pairs: dict = field(default_factory=dict)  # (g, j) -> [(d, rows)]

    @property
    def nbytes(self) -> int:
        """What the parked call holds for this work: its input and output activations."""
        return self.x.numel() * self.x.element_size() + self.out.numel() * self.out.element_size()

    def product(self, g: int, j: int, W: torch.Tensor) -> None:
        W = W.to(self.x.dtype)
        for d, rows in self.pairs[(g, j)]:
            xs = self.x[d].index_select(0, rows)
            if self.x.dim() == 4:
                xs = xs[:, j]
            self.out[d, rows, j] = xs @ W


def run_works(works: list) -> None:
    """Run ``works``: each distinct expert matrix (per ``key``) decoded once, used by every work
    that needs it, and dropped before the next is decoded."""
    by_key: dict = {}
    for w in works:
        by_key.setdefault(w.key, []).append(w)
    for group in by_key.values():
        wanted = sorted({gj for w in group for gj in w.pairs}, key=lambda gj: (gj[1], gj[0]))
        for g, j in wanted:
            W = group[0].matrix(g, j)
            for w in group:
                if (g, j) in w.pairs:
                    w.product(g, j, W)
            W = None


def submit(work: ExpertWork) -> None:
    """Run ``work`` now, or, in a call that a :class:`Rendezvous` runs, park the call until the
    rendezvous has run it with the other calls' works."""
    rv = getattr(_local, "rendezvous", None)
    if rv is None:
        run_works([work])
    else:
        rv.park(_local.index, work)


class _Aborted(BaseException):
    """Unwinds a parked call when another call of its stage failed."""


class Rendezvous:
    """One stage of several calls (iterators: ``next`` runs a call's next stage), their expert
    matmuls run together (module docstring). :meth:`step` returns what each ``next`` returned."""

    def __init__(self, calls: list):
        self.calls = calls
        n = len(calls)
        self._turn = [threading.Semaphore(0) for _ in range(n)]
        self._back = threading.Semaphore(0)
        self._parked: dict = {}
        self._abort = False

    def park(self, i: int, work: ExpertWork) -> None:
        self._parked[i] = work
        self._back.release()
        self._turn[i].acquire()
        if self._abort:
            raise _Aborted

    def step(self) -> list:
        n = len(self.calls)
        results: list = [None] * n
        errors: list = [None] * n
        done = [False] * n
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def worker(i):
            self._turn[i].acquire()
            try:
                if not self._abort:
                    _local.rendezvous, _local.index = self, i
                    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                        results[i] = next(self.calls[i], None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                errors[i] = e
            finally:
                _local.rendezvous = None
                done[i] = True
                self._back.release()

        def turn(i):  # call i runs alone to its next expert matmul or the end of the stage
            self._turn[i].release()
            self._back.acquire()
            if errors[i] is not None:
                raise errors[i]

        threads = [threading.Thread(target=worker, args=(i,), daemon=True, name=f"ttbundle-call-{i}")
                   for i in range(n)]
        for t in threads:
            t.start()
        try:
            waiting = list(range(n))
            while waiting:
                # a group: calls started in order until their parked works hold GROUP_BYTES (a
                # long prefill's experts: a group of one, as before); it ends the stage before
                # the next group starts, so the calls' order is kept
                group, held = [], 0
                while waiting and held < GROUP_BYTES:
                    i = waiting.pop(0)
                    group.append(i)
                    turn(i)
                    if not done[i]:
                        held += self._parked[i].nbytes
                active = [i for i in group if not done[i]]
                while active:
                    run_works([self._parked.pop(i) for i in active])
                    for i in active:
                        turn(i)
                    active = [i for i in active if not done[i]]
        finally:
            self._abort = True  # a no-op once every call is done
            for i in range(n):
                if not done[i]:
                    self._turn[i].release()
            for t in threads:
                t.join()
        return results
