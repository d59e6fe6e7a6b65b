"""``model_capabilities``: what a package's model tells a plugin it supports, derived from the
serving facts its manifest records (``LoadedPackage.serving``, ``.buckets``). Tenstorrent's plugin reads this dict on the model class before building the model (to
decide sampling, async scheduling, prefix caching and chunked prefill, and to refuse launches
that ask for more); ttbundle's own runner reads the same dict (``max_device_top_k``) from the
model it built, so one function decides both.
"""

from __future__ import annotations

from ..backends.ttnn.lowering import TOPK

#: split decode submit / readback (vLLM's async scheduling): ``decode_forward(read_from_device=False,
#: prev_output=, prev_rows=)`` and ``read_decode_output`` (model_runner's submit / collect)
ASYNC_DECODE = True


def async_decode(device: bool) -> bool:
    """Whether decode N+1 may be submitted before step N is read back: where a decode's sampled
    ids feed the next decode's token input on the device. The emulated mesh gathers them on its
    tensors; the ttnn lowering does it inside every device-sampled decode trace
    (``backends/ttnn/feed``: a gather into the token input, a copy of the sampled ids); the
    timing device models it (``feed_rows``). So yes on both (``device`` is kept for the callers
    that ask per platform)."""
    return ASYNC_DECODE


def device_seeds(device: bool) -> bool:
    """Whether a seeded request samples on the device: the emulated mesh draws each row with its
    own generator; a device's ``ttnn.sampling`` takes one seed for the batch, so seeded rows go
    to the host (the models' ``seeded_on_device``; ``supports_device_seeds``)."""
    return not device


def packed_prefill(device: bool) -> bool:
    """Whether one prefill call may carry several sequences' chunks (``prefill_forward`` with
    tokens [N, R], ``phases.pack_prefill``): the emulated mesh, yes (one program of the bucket's
    rows; its attention takes each sequence's own paged context, as decode does). A device: no:
    the ttnn lowering's prefill attention (paged SDPA over one page-table row) and its traces
    take one sequence per program call, so there a step's prompts run one call each."""
    return not device


def tokens_per_step(facts, device: bool, requested: int | None = None, sample_mode: str = "all",
                    speculative: bool = False) -> int:
    """Tokens a decode step produces per host round trip (the one rule the platform, the
    scheduler and the runner use): the spec's ``runtime.output_tokens_per_step``, or fewer when
    asked (``requested``, the ``tt`` option ``output_tokens_per_step``); 1 where the device cannot
    feed a step's sampled ids into the next (``async_decode``), where sampling is on the host
    (``sample_mode`` off) or with vLLM's speculative decoding (both schedule several tokens a
    step). Asking for more than the package declares is refused (``ValueError``)."""
    declared = facts.serving.output_tokens_per_step
    if requested is not None and requested > declared:
        raise ValueError(f"output_tokens_per_step={requested} exceeds the package's "
                         f"runtime.output_tokens_per_step={declared}; ask for at most {declared} "
                         "(or rebuild the package with more)")
    k = declared if requested is None else requested
    if k > 1 and (not async_decode(device) or sample_mode == "off" or speculative):
        return 1
    return k


def serving_tokens_per_step(facts, options, device: bool, vllm_config) -> int:
    """:func:`tokens_per_step` of an engine: the ``tt`` options (``output_tokens_per_step``, the
    sampling mode) and vLLM's config (speculative decoding) it was started with."""
    return tokens_per_step(facts, device, options.output_tokens_per_step,
                           options.sample_mode(facts.serving.sample_on_device_mode),
                           vllm_config.speculative_config is not None)


def model_capabilities(facts, device: bool = True, vocab_size: int | None = None) -> dict:
    """The capabilities of a package's model (``facts``: its ``serving`` and ``buckets`` records, a
    runtime ``Package``, a ``LoadedPackage`` or ``package.facts.of_bundle``) on a Tenstorrent device (``device``: the ttnn
    lowering's programs) or on the emulated mesh. ``vocab_size``: the package's
    (``Package.dims``, as its programs record it; None: no bound on the emulated mesh).

    * sampling on device unless the spec's ``runtime.sample_on_device_mode`` is ``off``; the
      device draws from the top ``max_device_top_k`` candidates (``ttnn.sampling`` in the
      lowering: 32; the emulated mesh: the whole vocabulary). Penalties and grammars run on
      the host.
    * prefix caching: the emulated mesh only (a device prefill starting on a cached block is
      not exercised); chunked prefill when the buckets set ``prefill_chunk``.
    * ``output_tokens_per_step`` tokens a decode step (``tokens_per_step``); speculative
      decoding (the spec's ``speculative:``), where a verify step returns up to k + 1 tokens:
      ``ngram`` on both (a device runs the lowered verify forwards, every row's logits back,
      acceptance on the host), a draft model (``method: draft``) on the emulated mesh only.
    """
    rt, bk = facts.serving, facts.buckets
    spec = rt.speculative
    speculates = spec is not None and (not device or spec["method"] == "ngram")
    return {
        "supports_sample_on_device": rt.sample_on_device_mode != "off",
        "max_device_top_k": TOPK if device else vocab_size,
        "supports_device_penalties": False,
        "supports_device_grammar": False,
        "supports_prefix_caching": not device,
        "supports_chunked_prefill": bk.prefill_chunk is not None,
        "supports_async_decode": async_decode(device),
        "supports_packed_prefill": packed_prefill(device),
        # decode tokens per host step: the decode program replayed, sampled ids fed on the device
        "output_tokens_per_step": tokens_per_step(facts, device, sample_mode=rt.sample_on_device_mode),
        "supports_device_seeds": device_seeds(device),
        # speculative decoding (the spec's ``speculative:``): both run the verify programs; a
        # device proposes with n-grams only (the draft model runs beside the emulated mesh)
        "supports_spec_decode": speculates,
        "spec_requirements": ({"methods": ["ngram"], **spec} if speculates else {}),
    }


def device_top_k(caps: dict, vocab_size: int) -> int | None:
    """The bound a stochastic row's top_k must keep to for device sampling (None: unbounded)."""
    k = caps.get("max_device_top_k")
    return None if k is None or k >= vocab_size else int(k)
