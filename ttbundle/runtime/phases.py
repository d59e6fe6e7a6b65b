"""The one definition of a request's phase, shared by the scheduler and the model runner.

A request *decodes* when its prompt is fully in the KV cache and exactly one token (the last
sampled one) is left to compute; otherwise it *prefills* (a new prompt, the rest of a chunked
prompt, or a preempted request recomputing prompt + outputs).
"""

from __future__ import annotations

from ..tiles import TILE, pick, round_up  # rows of one sequence in a packed prefill are whole tiles


def is_decode(num_computed: int, num_prompt: int, num_tokens: int) -> bool:
    return num_computed >= num_prompt and num_tokens - num_computed == 1


def decode_shaped(num_scheduled: dict, proposals: dict) -> bool:
    """Whether a step (vLLM's ``num_scheduled_tokens`` and ``scheduled_spec_decode_tokens``)
    schedules every request its one token and its proposals (speculative decoding), or
    placeholders (several tokens a step): a decode step's shape, not yet its requests' phase."""
    return bool(num_scheduled) and all(n == 1 + len(proposals.get(r, ())) for r, n in num_scheduled.items())


def pack_prefill(lengths: list[int], buckets: list[int], packed: bool = True) -> list[tuple[int, int, list[int]]]:
    """How one prefill step's chunks (``lengths``, in step order) run: a list of program calls
    ``(bucket, rows per sequence, [indices into lengths])``.

    A call of a prefill bucket ``S`` holds ``S // R`` sequences of ``R`` rows each (``R`` a
    multiple of the tile height dividing ``S``, at most ``TILE`` sequences: the head's rows);
    each chunk is padded to ``R`` and the call's remaining sequences are empty. ``R == S`` is
    today's one sequence padded to its bucket. The plan with the fewest padded rows wins (ties:
    the fewest calls; then one sequence per call). ``packed=False`` (a backend that runs one
    sequence per prefill call): every chunk alone, padded to the smallest bucket holding it.
    The scheduler sizes a step with it (:func:`prefill_rows`) and the runner runs it."""
    buckets = sorted(buckets)
    solo = [(pick(buckets, n), pick(buckets, n), [i]) for i, n in enumerate(lengths)]
    if not packed or len(lengths) < 2:
        return solo
    best, best_key = solo, (sum(c[0] for c in solo), len(solo), 1)
    top = max(lengths)
    for R in range(round_up(top, TILE), buckets[-1] + 1, TILE):
        caps = {S: min(S // R, TILE) for S in buckets if S % R == 0}
        caps = {S: c for S, c in caps.items() if c >= 2}
        if not caps:
            continue
        k = len(lengths)
        # f[j]: (rows, calls, plan) holding j sequences; plan = [(bucket, count)]
        f = [(0, 0, [])] + [None] * k
        for j in range(1, k + 1):
            for S, c in caps.items():
                prev = f[max(0, j - c)]
                cand = (prev[0] + S, prev[1] + 1, prev[2] + [(S, min(c, j))])
                if f[j] is None or cand[:2] < f[j][:2]:
                    f[j] = cand
        rows, calls, plan = f[k]
        if (rows, calls, 0) < best_key:
            out, i = [], 0
            for S, count in plan:
                take = list(range(i, min(k, i + count)))
                i += len(take)
                out.append((S, S if len(take) == 1 else R, take))
            best, best_key = out, (rows, calls, 0)
    return best


def prefill_rows(lengths: list[int], buckets: list[int], packed: bool = True) -> int:
    """The rows a prefill step of these chunks runs (:func:`pack_prefill`'s calls' buckets)."""
    return sum(S for S, _, _ in pack_prefill(lengths, buckets, packed))
