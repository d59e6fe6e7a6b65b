"""The model runner's records: a request's state (:class:`ReqState`), what one step ran
(:class:`Step`, the step log's lines), an async decode in flight (:class:`InFlight`) and the
persistent batch it runs (:class:`DecodeBatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..families.vision_part import PLAIN, PromptPositions
from .sampling import DeviceSampling


@dataclass
class ReqState:
    req_id: str
    prompt: list[int]
    params: object  # vllm SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed: int
    output: list[int] = field(default_factory=list)
    images: object = None  # runtime.images.RequestImages of a request with images
    positions: PromptPositions = PLAIN  # the prompt's rope positions (the family's vision part's)
    host_sampling: bool = False  # its sampling needs the host (host_reasons; seeded without device seeds)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, n: int) -> list[int]:
        return (self.prompt + self.output)[start:start + n]


@dataclass
class Step:
    """What one step ran (kept in ``TTModelRunner.step_log``; JSON lines to the file named by
    ``TTBUNDLE_STEP_LOG`` when set)."""

    phase: str  # "prefill" | "decode" | "verify" (a decode with proposals: rows of 1 + proposals tokens)
    rows: list  # [(req_id, start position, tokens)]
    buckets: list  # prefill: bucket per row; decode: [batch bucket] (with lanes: one per lane run)
    sampling: str  # "device" | "host" | "none" (partial chunks only)
    seconds: float = 0.0
    lanes: list | None = None  # with lanes: the lane (replica) of each row
    lane_seconds: list | None = None  # with lanes, decode: seconds of each lane's program
    mode: str = "sync"  # "async": submitted, read back later (the collect's wait in ``wait``)
    inputs: float = 0.0  # seconds building inputs and submitting
    wait: float = 0.0  # seconds blocked reading the output back
    at: float = 0.0  # time.perf_counter() when the step started (async: its submit)
    calls: list | None = None  # prefill: [bucket, rows per sequence, sequences] per program call


@dataclass
class InFlight:
    """A device-sampled decode submitted and not read back yet."""

    states: list  # ReqState per row, in row order
    handle: object  # the mesh model's output (``read_decode_output`` reads it)
    step: Step
    t0: float
    prev: "InFlight | None" = None  # the step whose output this one's inputs take on the device
    output: object = None  # the ModelRunnerOutput, once collected
    batch: "DecodeBatch | None" = None  # the persistent batch it ran
    parts: "list[InFlight] | None" = None  # with lanes: one per lane (its rows, handle and batch)
    lane: int | None = None  # a lane's part: its lane (replica) index
    handles: list | None = None  # several tokens a step: each replay's output, in order (handle: the last)
    counts: list | None = None  # several tokens a step: each row's tokens (replays it takes part in)


@dataclass
class DecodeBatch:
    """The persistent state of an async decode batch (the same rows step after step): what the
    host builds once per batch instead of once per step. It is rebuilt when the rows change; its
    page table is rebuilt when a row's block list may have changed (``TTModelRunner._block_epoch``
    of its lane, or of the engine without lanes: another lane's new block leaves it as it is); a
    step whose rows all take their input token from the previous step of the same batch feeds row
    i from row i."""

    rids: tuple  # the rows' request ids, in row order
    epoch: int  # ``TTModelRunner._block_epoch`` of its lane (None: no lanes) when built
    bucket: int
    page_table: torch.Tensor  # [bucket, max blocks]
    sampling: DeviceSampling
    chained_src: torch.Tensor  # [bucket]: row i takes the previous step's row i (padding: -1)
    zero_tokens: torch.Tensor  # [bucket, 1] zeros (every row fed on the device)
    plain: bool = True  # every row's rope positions are its cache positions (no M-RoPE input)
