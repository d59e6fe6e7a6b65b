"""`ttbundle serve --print-launch`: the launch plan of a target's replicas, on paper.

For a (multi-host) target split into replicas, which host runs which vLLM data-parallel rank,
which chips each rank's submesh holds, the TT-Metal distributed runtime's rank bindings
(``tt-run --rank-binding``) and each host's ``vllm serve`` with vLLM's multi-node data-parallel
arguments. It builds and starts nothing: a SPEC is read (not built), a package only opened.
docs/scale-out.md walks through the arithmetic.

Conventions (``ttbundle.mesh``): hosts split the cols axis into equal blocks (each Galaxy of a
DUAL/QUAD_GALAXY is an (8,4) block); replicas are numbered host by host, row-major within a
host (``mesh.submesh_origins``); DP rank ``k`` drives replicas ``k*lanes .. (k+1)*lanes-1`` and
runs on the host of its first chip. A chip is named by its index within its host's block,
row-major (``TT_VISIBLE_DEVICES`` lists those; on hardware tt-metal's tray mapping turns them
into PCIe ids).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .. import mesh as meshmod, spec as specmod
from ..errors import InvalidInput
from ..package.names import package_path
from ..plan.sharding import target_mesh
from ..runtime.lanes import LaneError, plan_lanes
from ..runtime.packages import open_package
from .serve import resolve


@dataclass
class Rank:
    rank: int  # vLLM data-parallel rank
    replicas: list  # replica numbers it drives (its lanes)
    chips: dict  # host -> [chip index within the host], the chips of its replicas
    host: int  # where its engine runs (the host of its first chip)


@dataclass
class LaunchPlan:
    package: str  # what each host serves (a package path or the SPEC's package to build)
    bundle: str
    target: object  # mesh.Mesh (whole)
    replica: object  # mesh.Mesh (one replica's)
    hosts: list
    dp: int
    lanes: int
    per_lane_seqs: int
    ranks: list = field(default_factory=list)
    port: int = 8000
    rpc_port: int = 13345
    extra: list = field(default_factory=list)

    @property
    def replicas(self) -> int:
        return self.replica.replicas

    def local_ranks(self, h: int) -> list[Rank]:
        return [r for r in self.ranks if r.host == h]

    def rank_bindings(self) -> list[dict]:
        """tt-run ranks: one per (DP rank, host its chips are on); a rank's mesh is its own
        ``mesh_id``, its part on each host a ``mesh_host_rank``."""
        out, n = [], 0
        for r in self.ranks:
            for j, h in enumerate(sorted(r.chips)):
                out.append({"rank": n, "mesh_id": r.rank, "mesh_host_rank": j, "host": self.hosts[h],
                            "env_overrides": {"TT_VISIBLE_DEVICES": ",".join(map(str, r.chips[h]))}})
                n += 1
        return out

    def vllm_commands(self) -> list[tuple[str, list[str]]]:
        """(host, argv) of each host that runs engine ranks; the head (first host) also serves the API."""
        out = []
        head = self.hosts[0]
        for h, name in enumerate(self.hosts):
            local = self.local_ranks(h)
            if not local:
                continue
            argv = ["vllm", "serve", self.package]
            if h == 0:
                argv += ["--host", "0.0.0.0", "--port", str(self.port)]
            else:
                argv += ["--headless"]
            argv += ["--data-parallel-size", str(self.dp), "--data-parallel-size-local", str(len(local)),
                     "--data-parallel-start-rank", str(local[0].rank),
                     "--data-parallel-address", head, "--data-parallel-rpc-port", str(self.rpc_port),
                     "--max-num-seqs", str(self.lanes * self.per_lane_seqs)]
            if self.lanes > 1:
                argv += ["--additional-config", json.dumps({"tt": {"tt_data_parallel_size": self.lanes}},
                                                           separators=(",", ":"))]
            out.append((name, argv + list(self.extra)))
        return out

    def to_json(self) -> dict:
        t, r = self.target, self.replica
        return {"bundle": self.bundle, "package": self.package, "target": t.name, "shape": list(t.shape),
                "hosts": self.hosts, "chips": t.num_devices, "submesh": list(r.shape),
                "replicas": self.replicas, "data_parallel_size": self.dp, "lanes_per_rank": self.lanes,
                "max_num_seqs_per_lane": self.per_lane_seqs,
                "concurrency": self.replicas * self.per_lane_seqs,
                "ranks": [{"rank": k.rank, "host": self.hosts[k.host], "replicas": k.replicas,
                           "chips": {self.hosts[h]: c for h, c in k.chips.items()}} for k in self.ranks],
                "rank_bindings": self.rank_bindings(),
                "vllm": [{"host": h, "argv": a} for h, a in self.vllm_commands()]}


def _open(target: str, mesh: str | None, output: Path = Path("packages")):
    """(bundle, target Mesh, replica Mesh, package path to serve) without building anything."""
    p = Path(target)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        bundle = specmod.load(p)
        m = mesh or bundle.spec.targets[0]
        rep = target_mesh(bundle, meshmod.spec_target(p, bundle.spec.targets, m))
        pkg = package_path(output, bundle.spec.name, rep.name)  # where `build -o OUTPUT` puts it
        return bundle, rep.whole(), rep, str(pkg)
    pkg_dir = resolve(target, mesh)
    pkg = open_package(pkg_dir, check_hashes=False)
    rep = pkg.loaded.mesh
    return pkg.bundle, rep.whole(), rep, str(pkg_dir)


def launch_plan(target: str, mesh: str | None = None, dp: int | None = None, hosts: list | None = None,
                port: int = 8000, rpc_port: int = 13345, extra: list | None = None,
                output: Path = Path("packages")) -> LaunchPlan:
    bundle, whole, rep, pkg = _open(target, mesh, output)
    H = whole.hosts
    names = list(hosts) if hosts else [f"host{i}" for i in range(H)]
    if len(names) != H:
        raise InvalidInput(f"--hosts names {len(names)} host(s); {whole.describe()} spans {H}")
    R = rep.replicas
    dp = dp or (R if H > 1 else 1)  # multi-host: one engine per replica (Tenstorrent's DP 8 / 16)
    try:
        lp = plan_lanes(rep, bundle.spec.runtime.max_num_seqs, dp, name=f"{bundle.spec.name}-{whole.name}")
    except LaneError as e:
        raise InvalidInput(str(e)) from None
    shape = whole.shape
    hblock = meshmod.host_shape(shape, H)
    origins = meshmod.submesh_origins(shape, rep.shape, H)
    plan = LaunchPlan(pkg, bundle.spec.name, whole, rep, names, dp, lp.lanes, lp.per_lane_seqs,
                      port=port, rpc_port=rpc_port, extra=list(extra or []))
    for k in range(dp):
        reps = list(range(k * lp.lanes, (k + 1) * lp.lanes))
        chips: dict = {}
        for i in reps:
            r0, c0 = origins[i]
            for r in range(r0, r0 + rep.rows):
                for c in range(c0, c0 + rep.cols):
                    h = meshmod.host_of(shape, H, (r, c))
                    chips.setdefault(h, []).append(r * hblock[1] + (c - h * hblock[1]))
        chips = {h: sorted(v) for h, v in sorted(chips.items())}
        plan.ranks.append(Rank(k, reps, chips, min(chips)))
    return plan


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def rank_bindings_yaml(plan: LaunchPlan) -> str:
    lines = ["# tt-run --rank-binding: one entry per tt-run rank (a DP rank's mesh on one host)",
             "rank_bindings:"]
    for b in plan.rank_bindings():
        lines += [f"  - rank: {b['rank']}  # on {b['host']}", f"    mesh_id: {b['mesh_id']}",
                  f"    mesh_host_rank: {b['mesh_host_rank']}", "    env_overrides:",
                  f"      TT_VISIBLE_DEVICES: \"{b['env_overrides']['TT_VISIBLE_DEVICES']}\""]
    return "\n".join(lines) + "\n"


def render(plan: LaunchPlan) -> str:
    t, r = plan.target, plan.replica
    per_host = t.num_devices // max(1, t.hosts)
    out = [f"# launch plan: {plan.bundle} on {t.name} {t.rows}x{t.cols} ({t.num_devices} chips, "
           f"{t.hosts} host(s) of {per_host} chips)",
           f"#   {plan.replicas} replicas of {r.rows}x{r.cols} ({r.num_devices} chips each): "
           f"{plan.replicas} x {r.num_devices} = {plan.replicas * r.num_devices} chips",
           f"#   vLLM data parallel {plan.dp} rank(s) x {plan.lanes} lane(s) = {plan.replicas} replicas; "
           f"{plan.lanes} x {plan.per_lane_seqs} = {plan.lanes * plan.per_lane_seqs} sequences per rank, "
           f"{plan.replicas} x {plan.per_lane_seqs} = {plan.replicas * plan.per_lane_seqs} in all", ""]
    out.append("# ranks")
    for k in plan.ranks:
        where = "; ".join(f"{plan.hosts[h]} chips {_ranges(c)}" for h, c in k.chips.items())
        out.append(f"#   DP rank {k.rank} on {plan.hosts[k.host]}: replicas {k.replicas} ({where})")
    out += ["", "# --- rank_bindings.yaml (TT-Metal distributed runtime) ---", rank_bindings_yaml(plan).rstrip(),
            "", "# tt-run starts one process per rank above, on the hosts given to MPI:",
            "tt-run --rank-binding rank_bindings.yaml --mpi-args "
            + shlex.quote("--host " + ",".join(f"{h}:{sum(1 for b in plan.rank_bindings() if b['host'] == h)}"
                                                for h in plan.hosts)) + " <command>", "",
            "# --- vLLM multi-node data parallel: run on each host ---"]
    for host, argv in plan.vllm_commands():
        out.append(f"# {host}")
        out.append(shlex.join(argv))
    return "\n".join(out) + "\n"
