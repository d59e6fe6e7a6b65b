"""The schema of a package's ``manifest.json``: one pydantic model, read strictly.

``package.verify.read_manifest`` parses the file with :func:`ttbundle.fsutil.strict_json` (a duplicate
key, ``NaN``, broken syntax refused) after checking its size (:data:`MAX_BYTES`), then validates
it here: every key known (an unknown one is refused, naming it), every value of its type in
pydantic's strict mode (a size written as the string ``"12133"`` or as ``true`` is refused, not
coerced). Errors are ``PackageError`` naming the file and the field.

A key the build writes is one line here (``artifacts.PackageWriter._manifest`` writes the file);
records whose fields belong to other modules (an artifact record, a source file record, the key
fields) are typed as JSON objects of the right shape and checked by their readers.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: a manifest larger than this is refused before it is read (a TG package with ttnn caches and
#: a kernel cache lists tens of thousands of files at ~150 B each: a few MiB)
MANIFEST = "manifest.json"  # the package file this schema describes
METADATA = "vllm_metadata.json"  # the TT plugin's entry: arch and main_class
MAX_BYTES = 64 << 20

SHA256 = r"^[0-9a-f]{64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FileRecord(_Strict):
    size: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256)


class MeshRecord(_Strict):
    name: str
    shape: list[int]
    arch: Optional[str] = None
    devices: Optional[int] = Field(default=None, ge=1)


class BucketsRecord(_Strict):
    prefill: list[int]
    decode: list[int]
    prefill_chunk: Optional[int] = None
    vision: Optional[list[int]] = None
    verify: Optional[list[int]] = None  # speculative decoding: a verify program per decode bucket


class HostRecord(_Strict):
    """The emulated mesh of the package on a host, per engine, as the build's plan counts it
    (``plan.host.host_facts``, ``kvpool.HOST_RECORD``): what ``kvpool.host_pool`` sizes the
    emulated KV pool for a host's memory from, beside the serving settings, the programs' dims
    and KV pool; the vLLM plugin reads it and never plans."""
    max_tokens_all_users: Optional[int] = Field(ge=1)  # the spec's pool; null: auto
    weights: int = Field(ge=0)  # float32 bytes: every distinct shard once, the draft's
    activations: int = Field(ge=0)  # float32 bytes: one layer's, K and V context, scratch
    kv_bytes_per_block: int = Field(ge=1)  # float32 bytes of one KV block, every device and layer


class ServingRecord(_Strict):
    """The serving facts the runtime and the backends read (``LoadedPackage.serving``), written at
    build from the resolved spec (:func:`ttbundle.package.facts.serving_record`, the one place
    they are derived) and never re-derived from bundle.yaml after lowering. ``package.verify``
    (``ttbundle verify``, ``check``) refuses a package whose record disagrees with its spec."""
    task: str  # "generate" or "embed"
    max_num_seqs: int = Field(ge=1)  # sequences one replica decodes at once
    kv_block_size: int = Field(ge=1)  # tokens per KV block (vLLM's --block-size)
    output_tokens_per_step: int = Field(ge=1)  # decode tokens a host step may feed on the device
    sample_on_device_mode: str  # where sampling runs by default: off, decode_only, all
    trace_mode: str  # which programs are traced: none, decode_only, all
    rows_per_seq: int = Field(ge=0)  # rows of one sequence in a verify program: k + 1 (0: no speculative)
    speculative: Optional[dict[str, Any]] = None  # vLLM's --speculative-config (``speculative.vllm_config``)
    draft_kv_blocks: Optional[int] = Field(default=None, ge=1)  # method draft: the draft's KV blocks
    host: Optional[HostRecord] = None  # the emulated mesh on a host (absent: built before; load refuses it)


class ReplicasRecord(_Strict):
    count: int = Field(ge=1)
    submesh: list[int]
    target_shape: list[int]
    devices_per_replica: int
    devices: int
    origins: list[list[int]]
    max_num_seqs_per_replica: int
    max_num_seqs_total: int


class BuildRecord(_Strict):
    spec_file: str
    finished: str
    changed_fields: list[str] = []
    rebuilt: list[str] = []
    reused: list[str] = []


class SourcesRecord(_Strict):
    weights: list[dict[str, Any]] = []
    tokenizer: list[dict[str, Any]] = []


class PrecompiledRecord(_Strict):
    """What the package brings compiled (``serve --require-precompiled``): the programs lowered at
    build; on ttnn builds the programs whose kernels its kernel cache holds, or why none."""
    programs: list[str]
    kernels: Optional[list[str]] = None
    kernels_missing_reason: Optional[str] = None


class TraceRegionRecord(_Strict):
    """ttnn builds: the region the mesh is opened with (``size``, also ``trace_region_size``),
    where it came from (``need + headroom`` or ``spec``), and the shipped programs' traces' need
    under the named serving options (``tracebudget.record``)."""
    size: int = Field(ge=0)
    source: str
    need: int = Field(ge=0)
    headroom: float
    traces: int = Field(ge=0)
    captured_calls: int = Field(ge=0)
    sample_on_device_mode: str
    trace_mode: str
    semantics: str


class Manifest(_Strict):
    """``manifest.json``. Required: what verification and loading read; the rest is optional so
    that a package built before a key existed still reads (its readers default it)."""

    format: str
    bundle: str
    arch: str
    tt_arch: Optional[str] = None
    main_class: str
    mesh: MeshRecord
    replicas: Optional[ReplicasRecord] = None
    buckets: BucketsRecord
    serving: Optional[ServingRecord] = None  # absent: built before it was recorded (load refuses it)
    trace_region_bytes: Optional[int] = Field(default=None, ge=0)
    trace_region_size: Optional[int] = Field(default=None, ge=0)
    trace_region: Optional[TraceRegionRecord] = None
    versions: dict[str, Optional[str]]
    spec_sha256: Optional[str] = Field(default=None, pattern=SHA256)
    key: Optional[str] = None
    key_fields: dict[str, Any] = {}
    artifacts: dict[str, dict[str, Any]] = {}
    precompiled: Optional[PrecompiledRecord] = None
    sources: Optional[SourcesRecord] = None
    build: Optional[BuildRecord] = None
    files: dict[str, FileRecord]


def problem(data, where: str) -> str | None:
    """None when ``data`` (the parsed JSON) is a valid manifest, else one line naming the field
    (``files."config.json".size``), what is wrong and the value found."""
    try:
        Manifest.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(f'"{x}"' if isinstance(x, str) and not x.isidentifier() else str(x)
                         for x in err["loc"]) or "(top level)"
        kind = err["type"]
        if kind == "extra_forbidden":
            what = "unknown key (this ttbundle does not write it)"
        elif kind == "missing":
            what = "missing"
        else:
            got = repr(err.get("input"))
            what = f"{err['msg'].lower()}, got {got[:60]}{'...' if len(got) > 60 else ''}"
        return f"{where}: field {field}: {what}"
    return None
