"""The serving facts a package carries (manifest ``serving``, ``manifest.ServingRecord``): the one
place they are derived from the resolved spec. The build writes :func:`serving_record`;
``package.verify.check_serving`` (``ttbundle verify``, ``check``) refuses a package whose record
disagrees with its bundle.yaml; the runtime and the backends read ``LoadedPackage.serving`` and
``LoadedPackage.buckets``, never bundle.yaml's ``runtime:``, ``buckets:`` or ``speculative:``."""

from __future__ import annotations

from dataclasses import dataclass

from .. import speculative
from ..manifest import BucketsRecord, ServingRecord


def serving_record(bundle, draft_kv_blocks: int | None = None, host: dict | None = None) -> dict:
    """``manifest.json``'s ``serving`` for ``bundle`` (a resolved ``spec.Bundle``);
    ``draft_kv_blocks``: the plan's count of the draft's KV blocks (``speculative.draft_kv_blocks``)
    where the spec says ``speculative: {method: draft}``; ``host``: the emulated mesh's facts the
    plan counts (``plan.host.host_facts(bundle, plan).record()``; a package always has them)."""
    rt = bundle.spec.runtime
    spec_cfg = speculative.vllm_config(bundle)  # without the draft's path: the runtime adds it
    return {
        "task": getattr(bundle.spec, "task", "generate"),
        "max_num_seqs": rt.max_num_seqs,
        "kv_block_size": rt.kv_block_size,
        "output_tokens_per_step": rt.output_tokens_per_step,
        "sample_on_device_mode": rt.sample_on_device_mode,
        "trace_mode": rt.trace_mode,
        "rows_per_seq": speculative.rows_per_seq(bundle),
        **({"speculative": spec_cfg} if spec_cfg is not None else {}),
        **({"draft_kv_blocks": draft_kv_blocks} if draft_kv_blocks else {}),
        **({"host": host} if host is not None else {}),
    }


def buckets_record(bundle) -> dict:
    """``manifest.json``'s ``buckets``: the programs' buckets (prefill, decode, the prefill chunk,
    vision, verify)."""
    bk = bundle.buckets
    verify = speculative.verify_buckets(bundle)
    return {"prefill": list(bk.prefill), "decode": list(bk.decode), "prefill_chunk": bk.prefill_chunk,
            **({"vision": list(bundle.vision.buckets)} if bundle.vision is not None else {}),
            **({"verify": verify} if verify else {})}


@dataclass(frozen=True)
class Facts:
    """What a package tells its runtime, typed: ``serving`` (``manifest.ServingRecord``) and
    ``buckets`` (``manifest.BucketsRecord``), as ``LoadedPackage`` and the runtime's ``Package``
    carry them. :func:`of_bundle` gives the same for a spec not yet built (tests, ``plan``)."""
    serving: ServingRecord
    buckets: BucketsRecord


def of_bundle(bundle, draft_kv_blocks: int | None = None) -> Facts:
    """The facts a package built from ``bundle`` records (what its manifest will say)."""
    return Facts(ServingRecord.model_validate(serving_record(bundle, draft_kv_blocks)),
                 BucketsRecord.model_validate(buckets_record(bundle)))
