"""The one definition of a request's phase, shared by the scheduler and the model runner.

A request *decodes* when its prompt is fully in the KV cache and exactly one token (the last
sampled one) is left to compute; otherwise it *prefills* (a new prompt, the rest of a chunked
prompt, or a preempted request recomputing prompt + outputs).
"""

from __future__ import annotations


def is_decode(num_computed: int, num_prompt: int, num_tokens: int) -> bool:
    return num_computed >= num_prompt and num_tokens - num_computed == 1


def pick(buckets: list[int], n: int) -> int:
    """Smallest bucket >= n (buckets sorted); ValueError if none."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
