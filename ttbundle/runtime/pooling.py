"""Embedding packages (``task: embed``, ``ttbundle/embed.py``) under vLLM's pooling runner.

vLLM 0.33 serves ``/v1/embeddings`` when the model config's ``runner_type`` is ``pooling``
(``--runner pooling``; ``ttbundle serve`` passes it with ``--pooler-config`` from the spec) and the
worker's ``get_supported_tasks`` says ``embed``. Its own GPU runner applies the model's
``pooler`` to the step's hidden states and returns ``ModelRunnerOutput.pooler_output``: one
tensor per request whose prompt is complete (None for a partial prefill chunk), after which
vLLM's scheduler finishes the request. ttbundle's worker has no vLLM model, so
:class:`EmbedRunner` does the same with the package's prefill programs: each chunk runs its
prefill program (KV written as for generation, so a chunked prompt attends to its earlier
chunks), the last decoder layer's hidden states are normalized with the head's final norm (the
weight the program's head names), pooled per the spec's ``embedding.pooling`` and L2-normalized
unless the request's ``use_activation`` says otherwise. Nothing is sampled or decoded.

Emulated mesh only for now: the device path's prefill programs end in the LM head on device and
do not read back hidden states (refused at start-up, :func:`configure`).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..tiles import pick
from .model_runner import TTModelRunner
from .runner_state import Step


def is_embed(package) -> bool:
    """A ``task: embed`` package (its manifest's ``serving.task``)."""
    return package.serving.task == "embed"


def supported_tasks(package) -> tuple[str, ...]:
    """What the worker tells vLLM it serves."""
    return ("embed",) if is_embed(package) else ("generate",)


def runner_class(package):
    return EmbedRunner if is_embed(package) else TTModelRunner


def configure(pkg, vllm_config, emulated: bool, fail, scheduler: str) -> None:
    """The platform's checks for a package's task against vLLM's runner (``platform.configure``;
    ``scheduler``: its synchronous scheduler class, given so this module does not import it)."""
    mc, sc, cc = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
    runner = getattr(mc, "runner_type", "generate")
    if not is_embed(pkg):
        if runner == "pooling":
            fail(f"package {pkg.name} is a generative model (task: generate); --runner pooling needs a "
                 "package built with `task: embed`")
        return
    if runner != "pooling":
        fail(f"package {pkg.name} is an embedding model (task: embed): serve it with `--runner pooling` "
             "(`ttbundle serve` passes it), not --runner " + str(runner))
    if not emulated:
        fail(f"package {pkg.name}: embeddings run on the emulated mesh only for now (the device path's "
             "prefill programs do not read back hidden states); serve it with --device emulated")
    # one prefill per request, no decode: the synchronous scheduler; no prefix caching (a cached
    # prefix would leave its rows out of a mean or cls pooling)
    sc.async_scheduling = False
    sc.scheduler_cls = scheduler
    cc.enable_prefix_caching = False


def pool(rows: torch.Tensor, how: str) -> torch.Tensor:
    """One vector of a prompt's final hidden states ``rows`` [tokens, hidden]."""
    if how == "last":
        return rows[-1]
    if how == "cls":
        return rows[0]
    if how == "mean":
        return rows.mean(dim=0)
    raise ValueError(f"pooling {how!r}: one of last, mean, cls")


class EmbedRunner(TTModelRunner):
    """:class:`TTModelRunner` for ``task: embed``: prefill steps return pooled hidden states."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.embedding = self.bundle.embedding
        self._rows: dict[str, list[torch.Tensor]] = {}  # req_id -> final hidden rows kept so far
        self._pooling: dict[str, object] = {}  # req_id -> vLLM PoolingParams

    def _update_states(self, so) -> None:
        from vllm import SamplingParams

        for rid in so.finished_req_ids:
            self._rows.pop(rid, None)
            self._pooling.pop(rid, None)
        news = []
        for nr in so.scheduled_new_reqs:  # pooling requests have no sampling params
            self._pooling[nr.req_id] = nr.pooling_params
            news.append(nr if nr.sampling_params is not None else
                        dataclasses.replace(nr, sampling_params=SamplingParams(max_tokens=1)))
        super()._update_states(dataclasses.replace(so, scheduled_new_reqs=news))

    def execute_model(self, so):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        self._update_states(so)
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        t0 = time.perf_counter()
        rows = [(self.requests[rid], n) for rid, n in so.num_scheduled_tokens.items()]
        order, pooled, buckets = [], [], []
        for st, n in rows:
            if st.num_computed + n > len(st.prompt):
                raise RuntimeError(f"request {st.req_id}: an embedding request is one prefill, but "
                                   f"{st.num_computed + n} tokens were scheduled for a {len(st.prompt)}-token prompt")
            bucket, hidden = self._hidden(st, n)
            buckets.append(bucket)
            self._keep(st, hidden)
            order.append(st.req_id)
            pooled.append(self._finish(st) if st.num_computed + n == len(st.prompt) else None)
        step = Step("prefill", [(st.req_id, st.num_computed, n) for st, n in rows], buckets, "none",
                    calls=[[b, b, 1] for b in buckets])
        step.seconds, step.at = time.perf_counter() - t0, t0
        self._log(step)
        return ModelRunnerOutput(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                                 sampled_token_ids=[[] for _ in order], pooler_output=pooled)

    def sample_tokens(self, grammar_output):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
        return EMPTY_MODEL_RUNNER_OUTPUT

    # -- hidden states --------------------------------------------------------------------------
    @torch.no_grad()
    def _hidden(self, st, n: int) -> tuple[int, torch.Tensor]:
        """(bucket, the chunk's final hidden states [n, hidden] after the final norm): its
        prefill program run as for generation (KV written; ``BundleModel.prefill_hidden``)."""
        bucket = pick(self.prefill_buckets, n)
        tokens = torch.zeros(1, bucket, dtype=torch.long)
        tokens[0, :n] = torch.tensor(st.tokens(st.num_computed, n))
        # runtime.adapter.BundleModel (``configure`` refuses embeddings on a device)
        h = self.mesh_model.prefill_hidden(tokens, self._page_table([st], 1), self.kv, n, st.num_computed)
        return bucket, h

    def _keep(self, st, hidden: torch.Tensor) -> None:
        """Keep what the pooling needs of a chunk: its last row (last), the prompt's first row
        (cls), or every row (mean)."""
        how = self.embedding.pooling
        kept = self._rows.setdefault(st.req_id, [])
        if how == "last":
            kept[:] = [hidden[-1:]]
        elif how == "cls":
            if st.num_computed == 0:
                kept[:] = [hidden[:1]]
        else:
            kept.append(hidden)

    def _finish(self, st) -> torch.Tensor:
        v = pool(torch.cat(self._rows.pop(st.req_id)), self.embedding.pooling)
        params = self._pooling.get(st.req_id)
        dims = getattr(params, "dimensions", None)
        if dims is not None:
            v = v[:dims]
        act = getattr(params, "use_activation", None)
        if self.embedding.normalize if act is None else act:
            v = torch.nn.functional.normalize(v, p=2, dim=-1)
        return v.to(torch.float32)
