"""Sampling: on the device (token ids back) or on the host (logits back, vLLM's sampler).

The device path is the end of the traced program: temperature, top-k, top-p and a seeded
per-request generator, returning one token id per row. Anything else a request asks for
(logprobs, min_p, logit_bias, allowed/bad words, min_tokens, penalties, structured output, ...)
needs the logits on the host; :func:`host_reasons` names why, and the model runner sends the
*whole batch* to the host when any row has a reason (a batch runs one program).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tiles import blocks_per_seq

_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy


def host_sampled(params, max_device_top_k: int | None, seeded_on_device: bool) -> bool:
    """Whether a request's rows sample on the host: :func:`host_reasons`, or a seed the device
    cannot honour (``seeded_on_device`` False: one seed per device batch). Decided once per
    request (its parameters never change), by the runner (per batch) and the scheduler (tokens
    per decode step) alike."""
    return bool(host_reasons(params, max_device_top_k) or (params.seed is not None and not seeded_on_device))


def host_reasons(params, max_device_top_k: int | None = None) -> list[str]:
    """Why a request's sampling cannot run on the device (empty: it can). ``max_device_top_k``:
    the most candidates the device samples from (``model_capabilities``; None: the whole
    vocabulary, as the emulated mesh). A stochastic row with top_k above it, or with no top_k
    (top_k < 1: the whole vocabulary), samples on the host rather than from a truncated set."""
    p = params
    r = []
    if p.logprobs is not None or getattr(p, "logprob_token_ids", None):
        r.append("logprobs")
    if getattr(p, "prompt_logprobs", None) is not None:
        r.append("prompt_logprobs")
    if max_device_top_k is not None and p.temperature >= _EPS and (p.top_k < 1 or p.top_k > max_device_top_k):
        r.append(f"top_k {p.top_k} beyond the device's {max_device_top_k} candidates")
    if p.min_p and p.min_p > 0:
        r.append("min_p")
    if p.logit_bias:
        r.append("logit_bias")
    if p.allowed_token_ids:
        r.append("allowed_token_ids")
    if p.bad_words or getattr(p, "_bad_words_token_ids", None):
        r.append("bad_words")
    if p.min_tokens:
        r.append("min_tokens")
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        r.append("penalties")
    if p.structured_outputs is not None:
        r.append("structured_outputs")
    if getattr(p, "thinking_token_budget", None) is not None:
        r.append("thinking_token_budget")
    if getattr(p, "watermarking", None):
        r.append("watermarking")
    return r


@dataclass
class DeviceSampling:
    """Per-row sampling parameters of one device batch (rows = the padded batch)."""

    temperature: torch.Tensor  # [B] float32; < 1e-5 means greedy
    top_k: torch.Tensor  # [B] int64; 0 or >= vocab means off
    top_p: torch.Tensor  # [B] float32; 1 means off
    generators: list  # [B] torch.Generator or None (None: the device's default stream)

    @classmethod
    def from_params(cls, params: list, generators: list, rows: int) -> "DeviceSampling":
        """From vLLM SamplingParams of the real rows; padding rows are greedy."""
        pad = rows - len(params)  # one tensor per field (per-element writes cost microseconds each)
        t = torch.tensor([sp.temperature if sp.temperature >= _EPS else 0.0 for sp in params] + [0.0] * pad)
        k = torch.tensor([max(sp.top_k, 0) for sp in params] + [0] * pad, dtype=torch.long)
        p = torch.tensor([float(sp.top_p) for sp in params] + [1.0] * pad)
        return cls(t, k, p, list(generators) + [None] * (rows - len(generators)))


def sample_on_device(logits: torch.Tensor, s: DeviceSampling) -> torch.Tensor:
    """Token ids [B] from logits [B, V]: greedy rows take the argmax; the others are sampled
    from softmax(logits / T) restricted to the top-k and the top-p mass, by the exponential-race
    trick (argmax of p / q, q ~ Exp(1)) with each seeded row drawing q from its own generator,
    so a seeded request's tokens do not depend on what else is in the batch."""
    logits = logits.float()
    greedy = s.temperature < _EPS
    out = logits.argmax(-1)
    if bool(greedy.all()):
        return out
    probs = target_probs(logits, s)
    sampled = (probs / _exponential(probs, s.generators)).argmax(-1)
    return torch.where(greedy, out, sampled)


def target_probs(logits: torch.Tensor, s: DeviceSampling) -> torch.Tensor:
    """The distribution a row samples from [B, V]: softmax(logits / T) restricted to the top-k
    and the top-p mass (greedy rows: T = 1, unrestricted)."""
    greedy = s.temperature < _EPS
    V = logits.shape[-1]
    x = logits.float() / torch.where(greedy, torch.ones_like(s.temperature), s.temperature)[:, None]
    k = torch.where((s.top_k <= 0) | (s.top_k >= V), torch.full_like(s.top_k, V), s.top_k)
    if bool((k < V).any()):
        kth = x.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if bool((s.top_p < 1).any()):
        sx, idx = x.sort(-1, descending=True)
        probs = sx.softmax(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = (probs.cumsum(-1) - probs) >= s.top_p[:, None]
        x = x.scatter(1, idx, sx.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def _exponential(like: torch.Tensor, generators: list) -> torch.Tensor:
    """Exp(1) noise shaped like ``like`` [B, V], row ``i`` from ``generators[i]`` (None: the
    default stream): the exponential race (argmax of p / q) draws from p."""
    q = torch.empty_like(like)
    for i in range(like.shape[0]):
        g = generators[i]
        q[i].exponential_(generator=g) if g is not None else q[i].exponential_()
    return q


def accept(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, s: DeviceSampling) -> torch.Tensor:
    """Speculative decoding's acceptance, as vLLM's rejection sampler defines it for a drafter
    without probabilities (``ngram``: the draft distribution is one-hot on the proposal).

    ``logits`` [B, k + 1, V]: row ``j`` of a sequence is the model's next-token logits after its
    last token and proposals ``0 .. j - 1``; ``drafts`` [B, k] the proposals (a negative id is
    never accepted), ``num_drafts`` [B] how many are real. Per sequence, proposal ``j`` is
    accepted while ``p_j(d_j) >= u_j`` (u uniform; greedy rows: while it is the argmax); the
    first rejected one is replaced by a draw from ``p_j`` with ``d_j`` removed (renormalized:
    vLLM's recovered token; greedy: the argmax); when all are accepted a bonus token is drawn
    from ``p_n``. The marginal of every emitted token is the target distribution ``p`` (the
    speculative sampling theorem), so speculation changes speed, never the distribution.
    Returns [B, k + 1] token ids, -1 past each sequence's last (vLLM's
    ``PLACEHOLDER_TOKEN_ID``)."""
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, generate_uniform_probs

    B, K1, V = logits.shape
    logits = logits.float()
    ar = torch.arange(K1 - 1)
    real = (ar[None, :] < num_drafts[:, None]) & (drafts >= 0)
    greedy = s.temperature < _EPS
    argmax = logits.argmax(-1)  # [B, K1]
    # ok[b, j]: proposal j accepted (given the ones before it)
    ok = real & (drafts == argmax[:, :-1])
    if not bool(greedy.all()):
        flat = DeviceSampling(s.temperature.repeat_interleave(K1), s.top_k.repeat_interleave(K1),
                              s.top_p.repeat_interleave(K1), [None] * (B * K1))
        probs = target_probs(logits.reshape(B * K1, V), flat).reshape(B, K1, V)
        nd = [int(n) for n in num_drafts]
        gens = {i: g for i, g in enumerate(s.generators[:B]) if g is not None}
        u = torch.zeros(B, K1 - 1, dtype=torch.float64)
        if sum(nd):
            flat_u = generate_uniform_probs(sum(nd), nd, gens, torch.device("cpu"))
            u[ar[None, :] < num_drafts[:, None]] = flat_u
        p_d = probs[:, :-1].gather(2, drafts.clamp(min=0)[:, :, None])[:, :, 0].double()
        ok = torch.where(greedy[:, None], ok, real & (p_d >= u))
    n_acc = torch.cumprod(ok.long(), dim=1).sum(1)  # accepted proposals per sequence
    out = torch.full((B, K1), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
    for b in range(B):
        a = int(n_acc[b])
        out[b, :a] = drafts[b, :a]
        if bool(greedy[b]):
            out[b, a] = argmax[b, a]
            continue
        p = probs[b, a].clone()
        if a < int(num_drafts[b]) and int(drafts[b, a]) >= 0:  # rejected: p without the proposal
            p[int(drafts[b, a])] = 0
            if float(p.sum()) <= 0:  # pragma: no cover - p was one-hot on the proposal
                p = probs[b, a].clone()
        out[b, a] = int((p[None, :] / _exponential(p[None, :], [s.generators[b]])).argmax(-1))
    return out


class PromptLogprobs:
    """``prompt_logprobs`` on the host path, as vLLM's GPU model runner computes them: for each
    prompt position but the last, the log-softmax of its logits (vLLM's ``Sampler``), the
    next prompt token's logprob and rank and the top ``k``; chunk by chunk, returned whole
    (``LogprobsTensors`` [prompt_len - 1, k + 1]) with the chunk that ends the prompt."""

    def __init__(self, sampler, logprobs_mode: str = "raw_logprobs"):
        self.sampler, self.mode = sampler, logprobs_mode
        self.partial: dict = {}  # req_id -> LogprobsTensors being filled
        self.done: set = set()  # returned once: a preempted request's re-prefill computes none

    def wanted(self, req_id: str, params, vocab_size: int) -> int | None:
        """How many top logprobs per prompt position (-1: the vocabulary); None: not asked, or
        already returned."""
        k = getattr(params, "prompt_logprobs", None)
        if k is None or req_id in self.done:
            return None
        return vocab_size if k == -1 else int(k)

    def add(self, req_id: str, prompt: list[int], k: int, start: int, logits: torch.Tensor):
        """``logits`` [n, V]: positions ``start .. start + n - 1`` of the prompt. Returns the
        request's LogprobsTensors when this chunk ends the prompt, else None."""
        from vllm.v1.outputs import LogprobsTensors

        P = len(prompt)
        lt = self.partial.get(req_id)
        if lt is None:
            lt = self.partial[req_id] = LogprobsTensors.empty_cpu(P - 1, k + 1)
        m = min(logits.shape[0], P - 1 - start)  # the last prompt position has no next token
        if m > 0:
            x = logits[:m].float()
            scores = x if self.mode in ("raw_logits", "processed_logits") else self.sampler.compute_logprobs(x)
            ids, lps, ranks, *_ = self.sampler.gather_logprobs(scores, k, torch.tensor(prompt[start + 1:start + 1 + m]))
            lt.logprob_token_ids[start:start + m] = ids
            lt.logprobs[start:start + m] = lps
            lt.selected_token_ranks[start:start + m] = ranks
        if start + logits.shape[0] >= P:
            self.done.add(req_id)
            return self.partial.pop(req_id)
        return None

    def remove(self, req_id: str) -> None:
        self.partial.pop(req_id, None)
        self.done.discard(req_id)


class HostSampler:
    """vLLM's own sampler on the host, over a persistent ``InputBatch`` holding exactly the
    rows sampled this step (the same state the GPU model runner keeps)."""

    def __init__(self, vllm_config, max_num_reqs: int, max_model_len: int, block_size: int,
                 vocab_size: int, device: torch.device):
        from vllm.v1.sample.logits_processor import build_logitsprocs
        from vllm.v1.sample.sampler import Sampler
        from vllm.v1.worker.gpu_input_batch import InputBatch

        custom = vllm_config.model_config.logits_processors or ()
        self.batch = InputBatch(
            max_num_reqs=max_num_reqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_model_len, device=device, vocab_size=vocab_size,
            block_sizes=[block_size], max_num_blocks_per_req=[blocks_per_seq(max_model_len, block_size)],
            logitsprocs=build_logitsprocs(vllm_config, device, False, False, custom),
            logitsprocs_need_output_token_ids=bool(custom), is_pooling_model=False,
            reasoning_config=vllm_config.reasoning_config)
        self.sampler = Sampler(logprobs_mode=vllm_config.model_config.logprobs_mode)

    def _sync(self, states: list) -> None:
        """Make the batch hold exactly ``states`` (order is the batch's own)."""
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        want = {s.req_id for s in states}
        for rid in list(self.batch.req_id_to_index):
            if rid not in want:
                self.batch.remove_request(rid)
        for s in states:
            if s.req_id not in self.batch.req_id_to_index:
                self.batch.add_request(CachedRequestState(
                    req_id=s.req_id, prompt_token_ids=s.prompt, mm_features=[],
                    sampling_params=s.params, generator=s.generator, block_ids=(list(s.block_ids),),
                    num_computed_tokens=s.num_computed, output_token_ids=s.output))
        self.batch.condense()
        self.batch.refresh_metadata()

    def remove(self, req_id: str) -> None:
        if self.batch.remove_request(req_id) is not None:
            self.batch.condense()
            self.batch.refresh_metadata()

    def sample(self, states: list, logits: dict, scheduler_output, grammar_output):
        """Sample one token for each of ``states`` from ``logits`` (req_id -> [V]).
        Returns (req_ids in batch order, token ids, LogprobsLists or None)."""
        from vllm.v1.structured_output.utils import apply_grammar_bitmask

        self._sync(states)
        order = list(self.batch.req_ids)
        x = torch.stack([logits[r] for r in order]).float()
        if grammar_output is not None:
            apply_grammar_bitmask(scheduler_output, grammar_output, self.batch, x)
        out = self.sampler(x, self.batch.sampling_metadata)
        ids = out.sampled_token_ids[:, 0].tolist()
        lp = out.logprobs_tensors.tolists() if out.logprobs_tensors is not None else None
        return order, ids, lp
