"""Speculative decoding's proposer on the host: n-gram prompt lookup (vLLM's ``ngram`` method);
:func:`proposer_for` picks it or the draft model's (``runtime.draft``).

vLLM 0.33's own ``NgramProposer`` (``vllm/v1/spec_decode/ngram_proposer.py``) is compiled with
numba, which CPU vLLM does not install (and its rejection sampler's kernels are Triton), so the
same definition is written here in numpy; ``tests/runtime/test_runtime_speculative.py`` checks it
against vLLM's function itself (its Python body, run without numba). The acceptance side is
``sampling.accept``; the verify program's shape is ``ttbundle.speculative``'s.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from .draft import DraftProposer


def propose_ngram(tokens, min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """Up to ``k`` proposed tokens after ``tokens`` (a sequence's prompt and outputs): find the
    longest n-gram, ``min_n <= n <= max_n``, ending the sequence that also occurs earlier in it
    (the earliest such occurrence), and propose the tokens that followed it there (fewer when the
    sequence ends first; none past ``max_model_len``)."""
    t = np.asarray(tokens, dtype=np.int64)
    total = t.shape[0]
    if total < min_n:
        return []
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        if n <= 0:
            break
        # every window that starts and ends before the last token (the suffix itself excluded)
        windows = sliding_window_view(t[:total - 1], n)
        hits = np.flatnonzero((windows == t[total - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return t[start:start + min(k, total - start)].tolist()
    return []


class NgramProposer:
    """Per request, the proposals for its next step (``vllm_config.speculative_config``'s
    ``num_speculative_tokens``, ``prompt_lookup_min`` / ``max``)."""

    def __init__(self, speculative_config, max_model_len: int):
        sc = speculative_config
        self.k = int(sc.num_speculative_tokens)
        self.min_n, self.max_n = int(sc.prompt_lookup_min), int(sc.prompt_lookup_max)
        self.max_model_len = max_model_len

    def propose(self, tokens) -> list[int]:
        return propose_ngram(tokens, self.min_n, self.max_n, self.k, self.max_model_len)

    def propose_batch(self, reqs: list[tuple[str, list[int]]], lanes=None) -> list[list[int]]:
        """Proposals per ``(req_id, tokens)``: the proposers' one interface (``draft.DraftProposer``;
        ``lanes``, each request's lane, matters to a draft's KV only)."""
        return [self.propose(t) for _, t in reqs]

    def release(self, req_id: str) -> None:
        """Nothing kept per request."""

    def check_references(self, log=None) -> dict:
        return {}


def proposer_for(vllm_config, package=None, dtype=None, lanes: int = 1):
    """The proposer of a vLLM config's ``--speculative-config`` (None: no speculation): n-gram
    lookup, or the package's draft (``draft_model``, ``runtime.draft``: a KV region per lane of
    the engine, ``lanes``); the platform has refused every other method."""
    sc = vllm_config.speculative_config
    if sc is None:
        return None
    if sc.method == "draft_model":
        return DraftProposer(package, int(sc.num_speculative_tokens), vllm_config.model_config.max_model_len,
                             dtype, lanes)
    return NgramProposer(sc, vllm_config.model_config.max_model_len)


def verify_batch(rows_per_seq: int, decode_buckets, tokens, start_pos, num_tokens):
    """A verify step's rows (``MeshModel.verify_forward``'s arguments) as both meshes run them:
    ``(valid [B, k + 1], positions [B, k + 1], n [B])``, row ``j`` of sequence ``i`` at
    ``start_pos[i] + j`` while ``j < num_tokens[i]`` (else invalid, at 0; a sequence at -1 is a
    padding row). A batch not padded to a decode bucket of ``k + 1`` rows per sequence
    (``rows_per_seq``, the package's ``serving.rows_per_seq``) is refused."""
    B, K1 = tokens.shape
    if B not in decode_buckets or K1 != rows_per_seq:
        raise ValueError(f"verify runs a batch padded to a decode bucket {list(decode_buckets)} of "
                         f"{rows_per_seq} rows per sequence (speculative.num_speculative_tokens"
                         f" + 1), got tokens {list(tokens.shape)}")
    ar = torch.arange(K1)[None, :]
    n = torch.as_tensor(num_tokens, dtype=torch.long).reshape(-1)
    start_pos = torch.as_tensor(start_pos, dtype=torch.long).reshape(-1)
    valid = (ar < n[:, None]) & (start_pos >= 0)[:, None]
    positions = torch.where(valid, start_pos.clamp(min=0)[:, None] + ar, torch.zeros(B, K1, dtype=torch.long))
    return valid, positions, n
