"""Replicas at run time: lanes in one engine and vLLM data-parallel ranks.

A package built for a target split into replicas (``replicas:`` in the spec, ``mesh.split``)
holds one replica's programs and weights; the target runs ``R`` replicas of it. vLLM serves
them two ways, as Tenstorrent's plugin does, and both at once:

* **vLLM data parallel** (``--data-parallel-size DP``): DP engine processes, rank ``r`` owning
  replicas ``r * lanes .. (r + 1) * lanes - 1`` (on the emulated mesh: its own emulated submeshes).
* **lanes** (Tenstorrent's ``tt_data_parallel_size``): one engine drives ``lanes`` replicas.
  Each lane has its own KV cache region and block numbering; a request is assigned to the
  least-loaded lane when the engine first sees it and never moves; every step stays one phase
  across all lanes (the scheduler decides the phase for the whole engine); ``max_num_seqs`` is
  per lane, so an engine serves ``lanes x max_num_seqs`` sequences.

``lanes x DP = R`` always: ``lanes x DP x chips per replica`` is the target's chip count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import kvpool

#: top-level ``additional_config`` key (outside the user's ``"tt"`` section) where the platform
#: records vLLM's data-parallel size for the engine processes (vLLM resets it to 1 in each
#: independent rank; ``parallel_config.data_parallel_index`` keeps the rank)
DP_KEY = "_ttbundle_data_parallel_size"


class LaneError(ValueError):
    """An impossible lanes / data-parallel combination (the message names the numbers)."""


@dataclass(frozen=True)
class LanePlan:
    replicas: int  # R: replicas of the target (1: not split)
    dp: int  # vLLM data-parallel ranks
    lanes: int  # replicas per engine
    rank: int  # this engine's DP rank
    per_lane_seqs: int  # runtime.max_num_seqs
    chips_per_replica: int
    target_chips: int

    @property
    def first_replica(self) -> int:
        return self.rank * self.lanes

    @property
    def engine_seqs(self) -> int:
        return self.lanes * self.per_lane_seqs

    def describe(self) -> str:
        reps = list(range(self.first_replica, self.first_replica + self.lanes))
        return (f"{self.replicas} replica(s) of {self.chips_per_replica} chip(s): DP rank {self.rank} of "
                f"{self.dp}, {self.lanes} lane(s) (replicas {reps}), {self.per_lane_seqs} sequences "
                f"per lane, {self.engine_seqs} per engine, {self.replicas * self.per_lane_seqs} in all")


def plan_lanes(mesh, per_lane_seqs: int, dp: int = 1, tt_lanes: int | None = None, rank: int = 0,
               name: str = "package") -> LanePlan:
    """Lanes per engine for a package whose replica mesh is ``mesh`` served with ``dp`` vLLM
    ranks; ``tt_lanes``: Tenstorrent's ``tt_data_parallel_size`` if given. Raises
    :class:`LaneError` naming the numbers when they do not multiply to the target."""
    R, chips = mesh.replicas, mesh.num_devices
    total = mesh.total_devices
    where = f"{name} ({mesh.describe()}, {total} chips)"
    if dp < 1:
        raise LaneError(f"--data-parallel-size {dp} must be >= 1")
    if R % dp:
        raise LaneError(f"--data-parallel-size {dp} does not divide the {R} replica(s) of {where}: "
                        f"each rank owns whole replicas (lanes x DP x chips per replica = chips: "
                        f"? x {dp} x {chips} = {total}); use a DP size dividing {R}"
                        + ("" if R > 1 else "; to serve replicas, split the target in the spec "
                           "(replicas: {<target>: {submesh: [R, C]}}) and rebuild"))
    lanes = R // dp
    if tt_lanes is not None and tt_lanes != lanes:
        raise LaneError(f"tt_data_parallel_size={tt_lanes} with --data-parallel-size {dp} on {where}: "
                        f"lanes x DP x chips per replica must equal the chips: {tt_lanes} x {dp} x "
                        f"{chips} = {tt_lanes * dp * chips}, not {total}; use tt_data_parallel_size="
                        f"{lanes} (or leave it out)")
    if not 0 <= rank < dp:
        raise LaneError(f"data-parallel rank {rank} outside 0..{dp - 1}")
    return LanePlan(R, dp, lanes, rank, per_lane_seqs, chips, total)


# ---- one engine's lanes -----------------------------------------------------------------------
@dataclass
class Lane:
    index: int  # replica number within the target
    kv: object  # this lane's KV cache (its own region)
    num_blocks: int
    free: list = field(default_factory=list)  # local block ids (0 is the lane's null block)
    blocks: dict = field(default_factory=dict)  # vLLM block id -> local block id
    requests: set = field(default_factory=set)


class Lanes:
    """The lanes of one engine: which request runs where, and each lane's block numbering.

    vLLM hands out block ids from one pool of ``lanes x blocks per lane``; each lane maps the
    ids its requests hold to its own region's blocks (``1 .. blocks - 1``; local 0 is the
    region's null block, which padding rows read). Prefix caching is off with lanes (a cached
    block lives in one lane's region), so a vLLM block belongs to one request at a time."""

    def __init__(self, first: int, kvs: list, num_blocks: int):
        self.lanes = [Lane(first + i, kv, num_blocks, list(range(num_blocks - 1, 0, -1)))
                      for i, kv in enumerate(kvs)]
        self.of: dict[str, Lane] = {}

    def __len__(self) -> int:
        return len(self.lanes)

    def assign(self, req_id: str) -> Lane:
        """The least-loaded lane (fewest requests; the lowest index on a tie), kept for good."""
        lane = self.of.get(req_id)
        if lane is None:
            lane = min(self.lanes, key=lambda ln: (len(ln.requests), ln.index))
            lane.requests.add(req_id)
            self.of[req_id] = lane
        return lane

    def release(self, req_id: str, block_ids=()) -> None:
        lane = self.of.pop(req_id, None)
        if lane is not None:
            lane.requests.discard(req_id)
            self.free_blocks(lane, block_ids)

    def free_blocks(self, lane: Lane, block_ids) -> None:
        for b in block_ids:
            local = lane.blocks.pop(b, None)
            if local is not None:
                lane.free.append(local)

    def local(self, lane: Lane, block_ids) -> list[int]:
        """``block_ids`` (vLLM's) as ``lane``'s own blocks, mapping new ones as they appear."""
        out = []
        for b in block_ids:
            loc = lane.blocks.get(b)
            if loc is None:
                if not lane.free:
                    raise RuntimeError(
                        f"lane {lane.index}: KV region full ({lane.num_blocks - 1} blocks for "
                        f"{len(lane.requests)} requests): the package's KV formula sizes each lane for "
                        "max_num_seqs sequences at max_model_len; lower --max-num-seqs")
                loc = lane.free.pop()
                lane.blocks[b] = loc
            out.append(loc)
        return out


def dp_size_of(vllm_config) -> int:
    """vLLM's data-parallel size as the user gave it (the platform records it under
    :data:`DP_KEY`: vLLM sets it to 1 inside each independent DP engine)."""
    pc = vllm_config.parallel_config
    recorded = (vllm_config.additional_config or {}).get(DP_KEY)
    return int(recorded) if recorded else int(pc.data_parallel_size)


def dp_rank_of(vllm_config) -> int:
    pc = vllm_config.parallel_config
    idx = getattr(pc, "data_parallel_index", None)
    return int(idx if idx is not None else pc.data_parallel_rank)


def plan_lanes_for(vllm_config, package, options) -> LanePlan:
    """The lanes of this engine from vLLM's config, the package and the ``tt`` options."""
    return plan_lanes(package.loaded.mesh, package.serving.max_num_seqs,
                      dp_size_of(vllm_config), getattr(options, "tt_data_parallel_size", None),
                      dp_rank_of(vllm_config), f"{package.name}-{package.mesh_name}")


def check_pool(package, have: int, lanes: int, name: str = "package") -> None:
    """With lanes, each lane's KV region is the plan's pool, but vLLM accounts (and preempts) over
    the engine's whole pool: a lane could run out while another has room. Until the scheduler
    accounts per lane, a pool smaller than every sequence at full length is refused with lanes.
    ``have``: the package's recorded pool, in blocks per lane (``Package.kv_blocks``)."""
    if lanes <= 1:
        return
    rt, max_model_len = package.serving, package.dims.max_model_len  # what the build recorded
    full = rt.max_num_seqs * max_model_len
    need = kvpool.pool_blocks(rt, full)
    if have < need:
        raise LaneError(f"{name}: {lanes} lanes need each lane's KV pool to hold every sequence at full "
                        f"length (max_num_seqs={rt.max_num_seqs} x max_model_len={max_model_len} = "
                        f"{full} tokens, {need} blocks); the plan's pool is {have} blocks: vLLM's "
                        "preemption does not see lanes yet. Set runtime.max_tokens_all_users to "
                        f"{full} (if it fits), or lower max_num_seqs or max_model_len, or serve with "
                        "--data-parallel-size equal to the replicas (one lane per engine)")
