"""`ttbundle serve`: vLLM's own OpenAI server on a package, with arguments from the package.

``vllm serve PACKAGE`` runs in a child process (its own process group) on ``--device``: ``tt``
(the default where a Tenstorrent device is present, ``activation.tt_hardware_missing``: the TT
platform, the package's ttnn programs and tensorbin weights) or ``emulated`` (the default
elsewhere: ``TTBUNDLE_EMULATED=1``), with ``MESH_DEVICE`` set to the package's mesh, and:

* ``--max-model-len``, ``--max-num-seqs``, ``--block-size`` from the spec's ``runtime``;
* ``--dtype float32`` on the emulated mesh (it then matches transformers token for token),
  ``bfloat16`` on a device (the host side of a bf16 device model);
* ``--served-model-name`` the bundle name;
* ``--speculative-config`` from the spec's ``speculative:`` (a disagreeing one among the extra
  arguments is refused, naming both);
* ``--additional-config '{"tt": {...}}'`` with ``trace_region_size`` from the package and the
  spec's ``trace_mode`` / ``sample_on_device_mode``; a ``--additional-config`` among the extra
  arguments is merged over it.

Ctrl-C (or SIGTERM, or SIGHUP from a closed terminal) is forwarded to vLLM as SIGINT, which shuts
the engine down cleanly; after a grace period the group is killed. If ``ttbundle serve`` dies
without that (SIGKILL, a crash), the kernel sends vLLM SIGTERM (``PR_SET_PDEATHSIG``) and vLLM stops
its engine; vLLM defers that SIGTERM while it starts, so a watchdog (:data:`WATCHDOG`) kills the
group then: no server outlives it. A stop before vLLM is healthy kills the group (it never
served). The address is checked before anything starts
(:func:`check_address`). While serving, vLLM is watched: if it exits by itself (vLLM's
API server shuts down with code 0 when its engine process dies) or stops answering ``/health``
(503 once the engine is dead), the server is stopped and :class:`ServeFailed` says why.
"""

from __future__ import annotations

import ast
import copy
import ctypes
import dataclasses
import difflib
import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import spec as specmod, tracebudget
from ..build import build
from ..check.record import passing, records
from ..embed import serve_args
from ..errors import DoesNotFit, InvalidInput, TTBundleError
from ..kvpool import gib, pool_tokens
from ..mesh import spec_target
from ..package.names import DRAFT_DIR, has_tokenizer
from ..runtime.activation import CHILD_SIGNALS, ENV_EMULATED, tt_hardware_missing
from ..runtime.cause import ENV as CAUSE_ENV, read
from ..runtime.lanes import LaneError, plan_lanes
from ..runtime.packages import is_package, open_package
from ..runtime.registry import find
from ..speculative import disagreements, recorded_config
from . import precompiled

GRACE_S = 30
HEALTH_EVERY_S = 5.0  # while serving: how often /health is asked
HEALTH_TIMEOUT_S = 10.0  # a busy engine answers late: only a refusal or a long silence counts
HEALTH_FAILURES = 3  # consecutive failed checks before vLLM is declared dead


class ServeFailed(TTBundleError):
    """vLLM (or its engine) died while serving; ``exit_code`` is vLLM's own when it had one."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.exit_code = code


@dataclass
class ServePlan:
    package: Path
    name: str
    mesh: str
    argv: list[str]
    env: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    memory: object = None  # the emulated mesh on this host (``kvpool.HostPlan``); None on a device
    notes: list = field(default_factory=list)  # one-line warnings printed before vLLM starts

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _split_additional_config(extra: list[str]) -> tuple[list[str], dict]:
    """Extra vLLM args without ``--additional-config``, and its parsed value ({} if absent)."""
    rest, cfg = [], {}
    it = iter(range(len(extra)))
    for i in it:
        a = extra[i]
        value = None
        if a == "--additional-config":
            if i + 1 >= len(extra):
                raise InvalidInput("--additional-config needs a JSON value")
            value = extra[i + 1]
            next(it, None)
        elif a.startswith("--additional-config="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
            continue
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise InvalidInput(f"--additional-config is not JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise InvalidInput("--additional-config must be a JSON object")
        cfg = _merge(cfg, parsed)
    return rest, cfg


REMOTE_CODE = "--trust-remote-code"


def _trusts_remote_code(arg: str) -> bool:
    """``arg`` turns on vLLM's ``--trust-remote-code`` as vLLM's parser reads it: underscores
    for dashes (``--trust_remote_code``), ``=VALUE``, or any abbreviation argparse accepts
    (``--trust-remote``; vLLM's parser allows them)."""
    if not arg.startswith("--"):
        return False
    name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    return len(name) >= len("--tr") and REMOTE_CODE.startswith(name)


def _config_file_trusts(extra: list[str]) -> str | None:
    """The ``--config FILE`` (vLLM's YAML of arguments) among ``extra`` that turns
    trust-remote-code on, else None (an unreadable file is left to vLLM)."""
    for i, a in enumerate(extra):
        path = extra[i + 1] if a == "--config" and i + 1 < len(extra) else \
            a.split("=", 1)[1] if a.startswith("--config=") else None
        if path is None:
            continue
        try:
            doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):
            continue
        if isinstance(doc, dict) and any(isinstance(k, str) and v and _trusts_remote_code("--" + k)
                                         for k, v in doc.items()):
            return path
    return None


def check_extra(extra: list[str]) -> None:
    """Refuse what the mesh replaces before vLLM starts (vLLM would refuse it too, later), and
    remote code: a ttbundle package never needs it (its verification refuses ``auto_map`` and
    any Python file but its adapter), so ``--trust-remote-code`` could only run code from
    somewhere else."""
    for i, a in enumerate(extra):
        if _trusts_remote_code(a):
            raise InvalidInput(f"{a}: ttbundle packages never need remote code (the package runs "
                               "ttbundle's own adapter, nothing from the Hugging Face hub); drop it")
    cfg = _config_file_trusts(extra)
    if cfg is not None:
        raise InvalidInput(f"--config {cfg}: turns trust-remote-code on; ttbundle packages never need "
                           "remote code (the package runs ttbundle's own adapter); drop it from the file")
    for i, a in enumerate(extra):
        for flag in ("-tp", "--tensor-parallel-size", "-pp", "--pipeline-parallel-size"):
            if a == flag or a.startswith(flag + "="):
                v = a.split("=", 1)[1] if "=" in a else (extra[i + 1] if i + 1 < len(extra) else "")
                if v.strip() not in ("1", ""):
                    raise InvalidInput(f"{flag} {v}: the mesh replaces tensor/pipeline parallelism; the "
                                       "package is already split over its mesh's chips. Serve a package "
                                       "built for a bigger mesh instead")


#: vLLM's registries of parser names (module, dict of name -> (file, class)), read from its source
PARSER_REGISTRIES = {"--tool-call-parser": ("tool_parsers", "_TOOL_PARSERS_TO_REGISTER", "--tool-parser-plugin"),
                     "--reasoning-parser": ("reasoning", "_REASONING_PARSERS_TO_REGISTER",
                                            "--reasoning-parser-plugin")}


def vllm_parser_names(flag: str) -> list[str] | None:
    """The names vLLM 0.33 accepts for ``--tool-call-parser`` / ``--reasoning-parser`` (what its
    ``ToolParserManager`` / ``ReasoningParserManager.list_registered()`` give), read from the
    registering dict in vLLM's source: importing vLLM takes seconds, this well under one. None
    when that dict is not found (another vLLM layout): vLLM then checks the name itself."""
    module, name, _ = PARSER_REGISTRIES[flag]
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / module / "__init__.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets) \
                and isinstance(node.value, ast.Dict):
            return sorted(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return None


def check_parsers(extra: list[str]) -> None:
    """``--enable-auto-tool-choice`` needs ``--tool-call-parser``; a ``--tool-call-parser`` or
    ``--reasoning-parser`` must be one vLLM has (unless a ``--*-parser-plugin`` may register it):
    refused here, naming the closest names, rather than by vLLM's API server after its start-up."""
    args = [a.split("=", 1)[0].replace("_", "-") + a[len(a.split("=", 1)[0]):] if a.startswith("--") else a
            for a in extra]  # vLLM reads --tool_call_parser as --tool-call-parser
    tool = _flag_value(args, "--tool-call-parser")
    if "--enable-auto-tool-choice" in args and not tool:
        raise InvalidInput("--enable-auto-tool-choice needs --tool-call-parser NAME (the parser that reads "
                           "the model's tool calls, e.g. hermes for Qwen-style <tool_call> JSON)")
    for flag, (_, _, plugin) in PARSER_REGISTRIES.items():
        value = _flag_value(args, flag)
        if not value or value.lower() == "none" or _flag_value(args, plugin) is not None:
            continue
        names = vllm_parser_names(flag)
        if names is not None and value not in names:
            close = difflib.get_close_matches(value, names, n=3)
            raise InvalidInput(f"{flag} {value}: vLLM has no such parser"
                               + (f"; did you mean {', '.join(close)}?" if close else "")
                               + f" (vLLM's: {', '.join(names)})")


def _flag_value(extra: list[str], *flags: str) -> str | None:
    """The value of the last of ``flags`` among the extra vLLM args (``--f V`` or ``--f=V``)."""
    found = None
    for i, a in enumerate(extra):
        for f in flags:
            if a == f and i + 1 < len(extra):
                found = extra[i + 1]
            elif a.startswith(f + "="):
                found = a.split("=", 1)[1]
    return found


def _int_flag(extra, *flags) -> int | None:
    v = _flag_value(extra, *flags)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise InvalidInput(f"{flags[0]} {v}: expected a whole number") from None


def speculative_args(pkg, extra: list[str]) -> list[str]:
    """vLLM's ``--speculative-config`` from the package's ``speculative:`` (none without one). A
    ``--speculative-config`` / ``-sc`` among the extra arguments must agree with the package (its
    verify programs are built for one method and k): one that disagrees is refused naming both;
    one that agrees is passed as given. A draft (``speculative: {method: draft}``) is vLLM's
    ``draft_model`` with ``model`` the draft package inside this one."""
    pc = recorded_config(pkg.serving, Path(pkg.path) / DRAFT_DIR)
    given = _flag_value(extra, "--speculative-config", "-sc")
    if given is None:
        return [] if pc is None else ["--speculative-config", json.dumps(pc, separators=(",", ":"))]
    try:
        g = json.loads(given)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(g, dict):
        raise InvalidInput("--speculative-config must be a JSON object")
    if pc is not None and "model" in pc and g.get("model"):
        g = dict(g, model=str(Path(g["model"]).absolute()))
    bad = disagreements(pc, g)
    if bad:
        raise InvalidInput(f"--speculative-config {given} disagrees with package {pkg.name}-{pkg.mesh_name}'s "
                           f"speculative: {json.dumps(pc) if pc else 'none'}: " + "; ".join(bad)
                           + "; leave the flag out (serve passes the package's) or rebuild with the spec's "
                           "`speculative:` changed")
    return []


def vllm_command() -> list[str]:
    exe = Path(sys.executable).with_name("vllm")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("vllm")
    return [found] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def resolve(target: str, mesh: str | None = None, output: Path = Path("packages"),
            progress=None, backend: str = "emulated") -> Path:
    """The package directory for NAME (registered; ``mesh`` picks among its packages), PACKAGE
    (a directory) or SPEC (a YAML file: built for ``mesh`` into ``output`` with ``backend``
    unless its package is up to date; ``ttnn`` for a device)."""
    p = Path(target)
    if p.suffix in (".yaml", ".yml") and os.path.isfile(p):  # os.path: False on any OSError

        bundle = specmod.load(p)
        m = mesh or os.environ.get("MESH_DEVICE") or bundle.spec.targets[0]
        m = spec_target(p, bundle.spec.targets, m)
        res = build(bundle, m, output, progress=progress, backend=backend)
        return Path(res.package)
    if os.path.isdir(p):
        if not is_package(p):
            raise InvalidInput(f"{p}: not a package (no manifest.json); give a package, a spec or a "
                               "registered name")
        return p.absolute()
    return find(target, mesh).path


DEVICES = ("tt", "emulated")


def pick_device(device: str | None) -> str:
    """``--device``: ``tt`` or ``emulated``; None: ``tt`` where a device is present. ``tt`` on a
    host without one is an InvalidInput saying why (exit 2)."""
    if device is None:
        return "tt" if tt_hardware_missing() is None else "emulated"
    if device not in DEVICES:
        raise InvalidInput(f"--device {device}: choose one of {', '.join(DEVICES)}")
    why = tt_hardware_missing() if device == "tt" else None
    if why:
        raise InvalidInput(f"--device tt: {why}; serve on the emulated mesh with --device emulated "
                           "(the default on a host without a device)")
    return device


def plan_serve(package: Path, host: str = "127.0.0.1", port: int = 8000,
               extra: list[str] | None = None, device: str = "emulated",
               data_parallel_size: int | None = None, require_precompiled: bool = False) -> ServePlan:
    """The vLLM command line and environment for ``package`` on ``device`` (``pick_device``);
    ``data_parallel_size``: vLLM engine ranks over the package's replicas (also read from
    ``--data-parallel-size`` in ``extra``); ``--max-num-seqs`` is then each engine's lanes x the
    per-replica max_num_seqs. ``require_precompiled``: refuse (InvalidInput) a start that would
    compile anything (``precompiled.require``)."""
    pkg = open_package(package)
    if device == "tt" and not pkg.built_for_device:
        raise InvalidInput(f"{pkg.path}: built for the emulated mesh only (no tensorbin/ weight caches); "
                           f"for --device tt build it with `ttbundle build --backend ttnn`, or serve it "
                           "with --device emulated")
    rt = pkg.serving  # what the build recorded (manifest ``serving``), not bundle.yaml
    extra = list(extra or [])
    token_ids_only = _tokenizer_mode(pkg, extra)
    check_extra(extra)
    check_parsers(extra)
    extra, user_cfg = _split_additional_config(extra)
    dp_extra = _int_flag(extra, "--data-parallel-size", "-dp")
    if data_parallel_size and dp_extra and data_parallel_size != dp_extra:
        raise InvalidInput(f"--data-parallel-size {data_parallel_size} and, after --, {dp_extra}: give it once")
    dp = data_parallel_size or dp_extra or 1
    try:
        lanes = plan_lanes(pkg.loaded.mesh, rt.max_num_seqs, dp,
                           (user_cfg.get("tt") or {}).get("tt_data_parallel_size"),
                           name=f"{pkg.name}-{pkg.mesh_name}")
    except LaneError as e:
        raise InvalidInput(str(e)) from None
    if dp > 1 and dp_extra is None:
        extra += ["--data-parallel-size", str(dp)]
    tt = {"trace_mode": rt.trace_mode, "sample_on_device_mode": rt.sample_on_device_mode}
    if pkg.trace_region_size:
        tt["trace_region_size"] = int(pkg.trace_region_size)
    cfg = _merge({"tt": tt}, user_cfg)
    notes = []
    if device == "tt" and pkg.built_for_device:
        note = check_trace_region(pkg, cfg.get("tt") or {}, (user_cfg.get("tt") or {}).get("trace_region_size"))
        notes += [note] if note else []
    if require_precompiled:
        precompiled.require(pkg, device, cfg.get("tt") or {}, dict(os.environ))
    memory = emulated_memory(pkg, extra, lanes.lanes, dp) if device == "emulated" else None
    pool = ["--num-gpu-blocks-override", str(memory.blocks)] \
        if memory is not None and memory.chosen != "override" else []
    argv = vllm_command() + [
        "serve", str(pkg.path),
        "--host", host, "--port", str(port),
        "--served-model-name", pkg.name,
        "--max-model-len", str(pkg.dims.max_model_len),
        "--max-num-seqs", str(lanes.engine_seqs),
        "--block-size", str(rt.kv_block_size),
        "--dtype", "float32" if device == "emulated" else "bfloat16",
        "--additional-config", json.dumps(cfg, separators=(",", ":")),
    ] + pool + (["--skip-tokenizer-init"] if token_ids_only else []) + speculative_args(pkg, extra) \
        + serve_args(pkg.bundle, extra) + extra
    env = {ENV_EMULATED: "1" if device == "emulated" else "0", "MESH_DEVICE": pkg.mesh_name, "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    # OpenMP's spin at a barrier stays libgomp's default (a GOMP_SPINCOUNT of the caller's
    # environment is inherited): with the oneDNN-packed GEMMs a step is ~60 short parallel
    # regions, and shortening the spin to 10,000 cost ~12% of the 16-stream throughput on a
    # quiet host (5 runs) (docs/benchmarks.md); on a host busy with other jobs a short spin helps
    return ServePlan(pkg.path, pkg.name, pkg.mesh_name, argv, env, host, port, memory, notes)


def check_trace_region(pkg, tt: dict, override: int | None) -> str | None:
    """The trace region the device is opened with against what the package's traces need there
    (``tracebudget``): the need the build recorded (manifest ``trace_region``), recounted only
    when the serving options trace other forwards (``tt.sample_on_device_mode``,
    ``tt.trace_mode``) or the package predates the record. One the user chose
    (``--additional-config``'s ``tt.trace_region_size``, or the spec's
    ``runtime.trace_region_size`` the package was built with) below the need is
    :class:`DoesNotFit` (exit 3) before vLLM starts, with the arithmetic: ttnn would refuse the
    first capture that overflows it. The package's own size below the need (options that trace
    more) is returned as a warning with the size to pass."""
    rec = pkg.loaded.manifest.get("trace_region")
    if override is not None:
        size, where = int(override), "--additional-config tt.trace_region_size"
    elif (rec or {}).get("source") == "spec":
        size, where = int(pkg.trace_region_size), "the spec's runtime.trace_region_size"
    else:
        size, where = int(pkg.trace_region_size), "the package's"
    modes = (tt.get("sample_on_device_mode") or (rec or {}).get("sample_on_device_mode"),
             tt.get("trace_mode") or (rec or {}).get("trace_mode"))
    if rec is not None and modes == (rec.get("sample_on_device_mode"), rec.get("trace_mode")):
        need, arithmetic, suggested = int(rec["need"]), None, None
    else:
        tn = tracebudget.package_need(pkg.loaded, tt.get("sample_on_device_mode"), tt.get("trace_mode"))
        need, arithmetic, suggested = tn.need, tn.arithmetic(), tn.suggested
    if size >= need:
        return None
    if arithmetic is None:
        tn = tracebudget.package_need(pkg.loaded, *modes)
        arithmetic, suggested = tn.arithmetic(), tn.suggested
    what = (f"{pkg.name}-{pkg.mesh_name}: trace_region_size {size:,} B ({where}) is below what the package's "
            f"traces need on the device: {arithmetic}; {need - size:,} B short")
    fix = f"trace_region_size {suggested:,} (the need + {tracebudget.HEADROOM:.0%} headroom) or more"
    if where == "the package's":
        cfg = json.dumps({"tt": {"trace_region_size": suggested}})
        return f"warning: {what}; if a capture runs out of it, add -- --additional-config '{cfg}'"
    raise DoesNotFit(f"{what}; fix: {fix}, or leave it out")


def emulated_memory(pkg, extra: list[str], lanes: int = 1, engines: int = 1):
    """The emulated mesh of ``pkg`` on this host (``Package.host_plan``: its KV pool, ``auto``
    sized for the host, and the expected peak of serve's processes); a pool that cannot fit what
    the host has available (the spec's ``max_tokens_all_users``, ``--num-gpu-blocks-override``
    among the extra arguments, or ``auto``'s least: one ``max_model_len`` sequence) is
    :class:`DoesNotFit` (exit 3) with the arithmetic and what would fit."""
    override = _int_flag(extra, "--num-gpu-blocks-override")
    m = pkg.host_plan(lanes=lanes, engines=engines, override_blocks=override)
    if m.fits:
        return m
    rt = pkg.bundle.spec.runtime
    best = m.largest_blocks()
    if m.chosen == "override":
        fix = f"--num-gpu-blocks-override {best} or less (or leave it out: auto sizes the pool for this host)"
    elif m.chosen == "spec" and pool_tokens(rt, best // lanes) >= rt.max_model_len:
        fix = (f"runtime.max_tokens_all_users: {pool_tokens(rt, best // lanes):,} or less, or `auto` "
               "(sizes the pool for this host)")
    else:
        fix = ("free memory on this host, lower runtime.max_model_len or max_num_seqs, or serve on a "
               "Tenstorrent device (--device tt)")
    raise DoesNotFit(f"{pkg.name}-{pkg.mesh_name} on the emulated mesh does not fit this host: KV pool "
                     f"{m.tokens:,} tokens ({m.why}) needs a peak of {m.arithmetic()}, and this host has "
                     f"{gib(m.available)} available; fix: {fix}")


def _tokenizer_mode(pkg, extra: list[str]) -> bool:
    """True when the package serves token ids only (built with ``tokenizer: false``: vLLM gets
    ``--skip-tokenizer-init``); a package without a tokenizer that did not opt out is refused
    here, before vLLM starts (vLLM would fail half a minute later instead), unless the extra
    arguments give vLLM a ``--tokenizer`` or ``--skip-tokenizer-init`` themselves."""
    if pkg.bundle.spec.tokenizer is False:
        return "--skip-tokenizer-init" not in extra
    if has_tokenizer(pkg.manifest["files"]) or _flag_value(extra, "--tokenizer") is not None \
            or "--skip-tokenizer-init" in extra:
        return False
    raise InvalidInput(f"{pkg.path}: no tokenizer in the package (none of tokenizer.json, tokenizer.model, "
                       "vocab.json); rebuild it with `tokenizer:` naming the directory that has them, or "
                       "with `tokenizer: false` to serve token ids only")


def check_address(host: str, port: int) -> None:
    """The address vLLM will listen on, checked before anything is built or started (exit 2 in
    well under a second instead of vLLM's traceback half a minute later): a port in 1..65535, a
    host that resolves to an address of this machine, and nothing listening there already (a bind
    with SO_REUSEADDR, as uvicorn binds, then closed)."""
    if not 1 <= port <= 65535:
        raise InvalidInput(f"--port {port}: a TCP port is 1..65535 (the default is 8000)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as e:
        raise InvalidInput(f"--host {host}: not an address or a name this machine resolves ({e}); "
                           "give an address of this machine (127.0.0.1 for local only, 0.0.0.0 for all)") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            why = {errno.EADDRINUSE: "already in use (another server listens there; stop it or give "
                                     "another --port)",
                   errno.EADDRNOTAVAIL: "not an address of this machine (give one of its addresses, "
                                        "127.0.0.1 or 0.0.0.0)",
                   errno.EACCES: "needs privileges (ports below 1024); give a port >= 1024"}
            raise InvalidInput(f"--host {host} --port {port}: "
                               f"{why.get(e.errno, e.strerror or str(e))}") from None


def healthy(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _child_setup() -> None:
    """In vLLM's process, before it runs: SIGINT back to its default, and SIGTERM when the
    process that started it dies, however it dies (SIGKILL included): vLLM's API server stops
    its engine on SIGTERM, so nothing outlives ``ttbundle serve`` (Linux; elsewhere only the
    signal handlers of :func:`run` stop it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


def quiet_logging_config(directory: Path) -> Path | None:
    """vLLM's own default logging configuration (``vllm.logger.DEFAULT_LOGGING_CONFIG``, as this
    environment makes it) with :class:`~ttbundle.runtime.activation.QuietStop` on its handler,
    written to ``directory``, for ``VLLM_LOGGING_CONFIG_PATH``: a clean stop then prints what
    stopped and no step-by-step log. None where the user configures vLLM's logging themselves."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return None

    try:
        from vllm.logger import DEFAULT_LOGGING_CONFIG
    except ImportError:  # no vLLM here (a stand-in in tests): nothing to configure
        return None
    cfg = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    cfg.setdefault("filters", {})["ttbundle_quiet_stop"] = {"()": "ttbundle.runtime.activation.QuietStop"}
    for h in cfg.get("handlers", {}).values():
        h.setdefault("filters", []).append("ttbundle_quiet_stop")
    # torch says "Triton not available" once per process: Triton is left out on purpose on a
    # CPU host (scripts/setup.sh), nothing here compiles Triton kernels
    cfg.setdefault("loggers", {})["torch._library.triton"] = {"level": "ERROR"}
    path = Path(directory) / "vllm-logging.json"
    path.write_text(json.dumps(cfg))
    return path


#: The watchdog (:func:`start`): its own session, so a terminal's signals do not reach it; it
#: reads this process's pipe until EOF, which comes however this process ends (SIGKILL included).
#: "healthy" said before: vLLM stops itself on its parent-death SIGTERM, the group is killed only
#: if it is still there after the grace; never healthy (vLLM's start-up ignores or defers SIGTERM):
#: the group is killed at once. "done": stopped cleanly, nothing to do.
WATCHDOG = """
import os, signal, sys, time
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
healthy = False
for line in sys.stdin.buffer:
    if line.strip() == b"done":
        sys.exit(0)
    healthy = healthy or line.strip() == b"healthy"
def there():
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False
t0 = time.monotonic()
while healthy and there() and time.monotonic() - t0 < grace:
    time.sleep(0.2)
try:
    os.killpg(pgid, signal.SIGKILL)
except OSError:
    pass
"""
WATCHDOG_GRACE_S = 30


def _watchdog(pgid: int) -> subprocess.Popen | None:
    """A process that kills vLLM's process group ``pgid`` when this one dies (:data:`WATCHDOG`);
    None where it cannot start (the parent-death SIGTERM still applies)."""
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHDOG, str(pgid), str(WATCHDOG_GRACE_S)],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:
        return None


def _tell_watchdog(proc: subprocess.Popen, word: str, close: bool = False) -> None:
    dog = getattr(proc, "ttbundle_watchdog", None)
    if dog is None or dog.stdin is None or dog.stdin.closed:
        return
    try:
        dog.stdin.write(word.encode() + b"\n")
        dog.stdin.flush()
        if close:
            dog.stdin.close()
            dog.wait(5)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass


def mark_healthy(proc: subprocess.Popen) -> None:
    """vLLM answers /health: from now on, this process dying leaves vLLM its clean stop first."""
    _tell_watchdog(proc, "healthy")
class Output:
    """vLLM's output passed through to this process's stdout and stderr as it comes (the same
    bytes, unbuffered), its last :data:`KEEP` bytes of each kept: what a failure is read from
    (:func:`engine_signal`). With ``log`` (a file vLLM writes to), the file's tail instead."""

    KEEP = 1 << 16

    def __init__(self, proc: subprocess.Popen | None = None, log: Path | None = None):
        self.log, self._tail, self._threads = log, {1: b"", 2: b""}, []
        if proc is not None:
            for src, fd in ((proc.stdout, 1), (proc.stderr, 2)):
                if src is not None:
                    t = threading.Thread(target=self._pump, args=(src, fd), daemon=True)
                    t.start()
                    self._threads.append(t)

    def _pump(self, src, fd: int) -> None:
        try:
            while True:
                chunk = os.read(src.fileno(), 1 << 16)
                if not chunk:
                    break
                self._tail[fd] = (self._tail[fd] + chunk)[-self.KEEP:]
                try:
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
                except OSError:  # our own output closed: keep reading (vLLM must not block)
                    pass
        except (OSError, ValueError):
            pass
        finally:
            try:
                src.close()
            except OSError:
                pass

    def join(self, timeout: float = 5.0) -> None:
        for t in self._threads:
            t.join(timeout)

    def text(self) -> str:
        """The last output (both streams), as text."""
        if self.log is not None:
            try:
                with open(self.log, "rb") as f:
                    f.seek(max(os.path.getsize(self.log) - self.KEEP, 0))
                    return f.read().decode(errors="replace")
            except OSError:
                return ""
        return (self._tail[1] + b"\n" + self._tail[2]).decode(errors="replace")


def start(plan: ServePlan, log=None) -> subprocess.Popen:
    """Start vLLM in its own process group (``log``: a file for its output, else passed through
    to ours, :class:`Output`); it gets SIGTERM if this process dies (:func:`_child_setup`), and a
    watchdog process kills its group if this process dies before vLLM was healthy, or if it is
    still there 30 s after (:data:`WATCHDOG`): vLLM defers SIGTERM while it starts
    (:func:`mark_healthy` tells it). The process carries ``output`` (its :class:`Output`) and ``peak_rss`` (the most its process group
    was seen holding, :func:`group_rss`, sampled while it is waited on)."""
    env = dict(os.environ, **plan.env)
    fd, signals = tempfile.mkstemp(prefix="ttbundle-serve-", suffix=".signals")
    os.close(fd)
    env[CHILD_SIGNALS] = signals  # vLLM's engine processes a signal ended (activation.note_child_signals)
    _become_subreaper()
    if log is None:
        env.setdefault("PYTHONUNBUFFERED", "1")  # its lines as they come, through the pipe
        if os.isatty(1):  # vLLM colours its log only on a terminal; it writes to ours
            env.setdefault("VLLM_LOGGING_COLOR", "1")
    pipe = subprocess.PIPE if log is None else None
    proc = subprocess.Popen(plan.argv, env=env, start_new_session=True, preexec_fn=_child_setup,
                            stdout=log if log is not None else pipe,
                            stderr=subprocess.STDOUT if log is not None else pipe)
    name = getattr(log, "name", None)
    proc.output = Output(proc) if log is None else Output(log=Path(name) if isinstance(name, str) else None)
    proc.peak_rss, proc.names, proc.signals = 0, {}, Path(signals)
    proc.ttbundle_watchdog = _watchdog(proc.pid)
    return proc


def _group_stats(pgid: int):
    """``(pid, /proc/PID/stat fields after the name)`` of each process of process group ``pgid``
    now (Linux ``/proc``; fields[0] is the state, [1] the parent, [2] the group)."""
    try:
        entries = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return
    for d in entries:
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if len(fields) > 21 and int(fields[2]) == pgid:
                yield int(d), fields
        except (OSError, IndexError, ValueError):
            continue


def group_processes(pgid: int) -> dict[int, tuple[str, int]]:
    """The processes of process group ``pgid`` now: pid -> (name, resident bytes) (Linux
    ``/proc``; the name is the command line's first word, which vLLM sets to ``VLLM::EngineCore``
    for its engine; empty elsewhere)."""
    out = {}
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    for pid, fields in _group_stats(pgid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
        except OSError:
            continue
        name = words[0].decode(errors="replace").strip() if words else ""
        out[pid] = (Path(name.split()[0]).name if name else "", int(fields[21]) * page)
    return out


def _sample(proc: subprocess.Popen) -> None:
    """The most vLLM's processes were seen holding (``peak_rss``) and their names by pid."""
    if not hasattr(proc, "peak_rss"):
        return
    procs = group_processes(proc.pid)
    proc.peak_rss = max(proc.peak_rss, sum(rss for _, rss in procs.values()))
    proc.names.update({pid: name for pid, (name, _) in procs.items() if name})


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _become_subreaper() -> None:
    """Orphans of vLLM (its engine, when the API server exits without reaping it) become this
    process's children, so :func:`noted_signal` can read how they ended (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _orphans(pgid: int) -> list[int]:
    """Ended processes of vLLM's process group ``pgid`` that are now this process's children
    (zombies: :func:`_become_subreaper`), whether or not a sample saw them alive (an engine
    killed within its first half second)."""
    me = os.getpid()
    return [pid for pid, fields in _group_stats(pgid) if fields[0] == b"Z" and int(fields[1]) == me]


def noted_signal(proc: subprocess.Popen) -> tuple[str, int] | None:
    """``(process, signal)`` of the first of vLLM's child processes a signal ended: as vLLM's
    process noted it when it read the child's exit code (``activation.note_child_signals``), or
    as this process reaps it (vLLM's API server exited without reaping its engine, which then
    became ours: :func:`_become_subreaper`). None when neither says."""
    try:
        lines = proc.signals.read_text().split("\n")
    except (AttributeError, OSError):
        lines = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            pid = int(parts[0])
            return f"{proc.names.get(pid, '')} (pid {pid})".lstrip(), int(parts[1])
    names = dict(getattr(proc, "names", {}))  # the processes seen with their names, and
    names.update({pid: "" for pid in _orphans(proc.pid) if pid not in names})  # ones never seen
    for pid, name in sorted(names.items()):
        if pid == proc.pid:
            continue
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):  # not ours (still vLLM's, or reaped)
            continue
        if got == pid and os.WIFSIGNALED(status):
            return f"{name} (pid {pid})", os.WTERMSIG(status)
    return None


_FAILED_CORES = re.compile(r"Failed core proc\(s\): \{([^}]*)\}")
_CORE_CODE = re.compile(r"'([^']+)': (-?\d+)")
_DIED = re.compile(r"Process (\S+) \(PID: \d+\) died with exit code (-?\d+)")


def engine_signal(text: str) -> tuple[str, int] | None:
    """``(process name, signal number)`` of a vLLM engine process that a signal ended, from
    vLLM's own output (``text``): vLLM 0.33's API server writes the exit codes of the engine
    core processes that failed its start-up (``Failed core proc(s): {'EngineCore_DP0': -9}``)
    or died under an API server process (``... died with exit code -9``); a negative exit code
    is the signal (Python's ``multiprocessing``). None when it names none."""
    found = None
    for m in _FAILED_CORES.finditer(text):
        for name, code in _CORE_CODE.findall(m.group(1)):
            if int(code) < 0:
                found = (name, -int(code))
    for name, code in _DIED.findall(text):
        if int(code) < 0:
            found = (name, -int(code))
    return found


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def killed_note(signum: int, proc: subprocess.Popen, memory=None) -> str:
    """For SIGKILL (what the kernel's OOM killer sends): the memory arithmetic (the expected
    peak, ``memory``: ``kvpool.HostPlan``) and what vLLM's processes were seen holding."""
    if signum != signal.SIGKILL:
        return ""

    note = "; SIGKILL is what the kernel's OOM killer sends when memory runs out (`dmesg` says whether it did)"
    if memory is not None:
        note += (f": this serve expected a peak of {memory.arithmetic()}, with {gib(memory.available)} "
                 "available when it started")
    seen = getattr(proc, "peak_rss", 0)
    if seen:
        note += f"; vLLM's processes were seen holding {gib(seen)} at most"
    if memory is not None:
        note += ("; fix: a smaller pool (runtime.max_tokens_all_users, --num-gpu-blocks-override) or more "
                 "free memory")
    return note


def died(proc: subprocess.Popen, when: str, memory=None) -> str:
    """Why vLLM ended, in one line: the signal that ended vLLM or its engine (from its exit status
    or its output, :func:`engine_signal`) and, for SIGKILL, the memory arithmetic; else its exit
    code."""
    code = proc.returncode
    if code is not None and code < 0:
        return f"vLLM was killed by signal {-code} ({signal_name(-code)}) {when}" + killed_note(-code, proc, memory)
    out = getattr(proc, "output", None)
    if out is not None:
        out.join(2.0)
    eng = noted_signal(proc) or (engine_signal(out.text()) if out is not None else None)
    if eng is not None:
        name, sig = eng
        return (f"vLLM's engine process {name} was killed by signal {sig} ({signal_name(sig)}) {when} "
                f"(vLLM exit code {code})" + killed_note(sig, proc, memory))
    return f"vLLM exited with exit code {code} {when}"


REAP_S = 10.0  # how long stop waits for a SIGKILLed vLLM to be reaped


def _ended(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` ended within ``timeout`` seconds (reaped here: its ``returncode`` set).
    Not ``Popen.wait``/``poll``: CPython's timed wait takes the Popen's wait lock before its
    ``try``, so a Ctrl-C landing there (a timed wait is where `serve` spent its serving before)
    leaves the lock held, and every later wait blocks for ever or never sees the exit: seen once,
    `serve` hung after Ctrl-C with vLLM a zombie. So serve waits for vLLM here only, from start
    to stop (``wait_healthy``, ``watch``, ``stop``)."""
    end = time.monotonic() + timeout
    while proc.returncode is None:
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (elsewhere): it has ended
            return True
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)
    return True


def stop(proc: subprocess.Popen, grace: float = GRACE_S) -> int:
    """SIGINT to vLLM's API server (its clean shutdown: it stops its engine itself; a SIGINT to
    the whole group would kill the engine under it and log an EngineDeadError), then SIGKILL to
    the group after ``grace``; then removes the signals file :func:`start` made."""
    if not _ended(proc, 0):
        try:
            os.kill(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            ended = _ended(proc, grace)
        except KeyboardInterrupt:  # a second Ctrl-C: do not wait
            ended = False
        if not ended:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _ended(proc, REAP_S)
    try:  # children vLLM left behind (its engine core) go with the group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _tell_watchdog(proc, "done", close=True)
    out = getattr(proc, "output", None)
    if out is not None:  # the rest of its output passed through
        out.join()
    try:  # the signals file start made (read by then: died)
        proc.signals.unlink()
    except (AttributeError, OSError):
        pass
    return proc.returncode


_PREFIX = r"(?:\(\S+ pid=\d+\) )?"  # vLLM's prefix on its child processes' lines
_TRACEBACK = re.compile(_PREFIX + r"Traceback \(most recent call last\):$")
_EXCEPTION = re.compile(_PREFIX + r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Mismatch))"
                        r"(?:: (.*))?$")
_PYDANTIC_DETAIL = re.compile(_PREFIX + r"  (?:Value error, |Assertion failed, )?(.+?)(?: \[type=.*)?$")
_PYDANTIC_LOC = re.compile(_PREFIX + r"(\S.*)$")


def first_exception(text: str) -> str | None:
    """``Type: message`` of the first traceback in vLLM's output ``text`` (the root cause: what
    follows is its processes reporting each other's failure) for an error the plugin did not
    record (vLLM's own: ``-- --gpu-memory-utilization 2``); a pydantic ``ValidationError`` with
    its first error (``field: message``). None when the output has no traceback."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not _TRACEBACK.match(line):
            continue
        for j in range(i + 1, len(lines)):
            m = _EXCEPTION.match(lines[j])
            if m is None:
                continue
            name, msg = m.group(1).rsplit(".", 1)[-1], (m.group(2) or "").strip()
            if name == "ValidationError":
                loc = None
                for k in range(j + 1, min(j + 8, len(lines))):
                    d = _PYDANTIC_DETAIL.match(lines[k])
                    if d and not lines[k].lstrip().startswith("For further information"):
                        msg += ": " + (f"{loc}: " if loc else "") + d.group(1).strip()
                        break
                    loc_m = _PYDANTIC_LOC.match(lines[k])
                    loc = loc_m.group(1).strip() if loc_m else loc
            return f"{name}: {msg}" if msg else name
    return None


def wait_healthy(proc: subprocess.Popen, host: str, port: int, timeout: float, memory=None,
                 cause_file=None) -> None:
    """Return once vLLM answers /health; raise why when it exits first: the cause the plugin
    recorded in ``cause_file`` (``runtime.cause``: an option refused, a warm-up mismatch), else
    :func:`died` (``memory``: the emulated mesh's :class:`~ttbundle.kvpool.HostPlan` for a
    SIGKILL's arithmetic)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        raise_swallowed()
        _sample(proc)
        if _ended(proc, 0):  # not proc.poll(): see _ended
            cause = read(cause_file) if cause_file else None
            if cause:
                raise TTBundleError(f"vLLM exited with code {proc.returncode} before it was healthy: {cause}")
            why = died(proc, "before it was healthy", memory)
            if why.startswith("vLLM exited with"):
                out = getattr(proc, "output", None)
                first = first_exception(out.text()) if out is not None else None
                why = f"vLLM exited with code {proc.returncode} before it was healthy" + \
                    (f"; the first exception in its output: {first}" if first else " (its output above says why)")
            raise TTBundleError(why)
        if healthy(host, port):
            return
        time.sleep(0.5)
    raise TTBundleError(f"vLLM was not healthy after {timeout:.0f} s")


def watch(proc: subprocess.Popen, host: str, port: int, every: float = HEALTH_EVERY_S,
          failures: int = HEALTH_FAILURES, timeout: float = HEALTH_TIMEOUT_S, memory=None) -> None:
    """Return never while vLLM serves: raise :class:`ServeFailed` when it exits by itself or
    fails ``failures`` health checks in a row (its engine died, it hangs)."""
    missed = 0
    while True:
        _sample(proc)
        if not _ended(proc, every):  # not proc.wait(every): see _ended
            missed = 0 if healthy(host, port, timeout) else missed + 1
            if missed >= failures:
                eng = noted_signal(proc)
                if eng is not None:  # its engine was ended by a signal (vLLM noted it)
                    raise ServeFailed(f"vLLM stopped answering http://{host}:{port}/health: its engine process "
                                      f"{eng[0]} was killed by signal {eng[1]} ({signal_name(eng[1])}) while "
                                      f"serving" + killed_note(eng[1], proc, memory) + "; stopped it")
                raise ServeFailed(f"vLLM stopped answering http://{host}:{port}/health ({missed} checks "
                                  f"{every:g} s apart): its engine died or hangs (its log above says "
                                  "why); stopped it")
            continue
        code = proc.returncode
        why = died(proc, "while serving", memory)
        if why.startswith("vLLM's engine"):  # a signal ended its engine: which, and for SIGKILL the memory
            raise ServeFailed(why, code if code > 0 else 1)
        how = f"killed by signal {-code} ({signal_name(-code)})" if code < 0 else f"exit code {code}"
        note = killed_note(-code, proc, memory) if code < 0 else ""
        raise ServeFailed(f"vLLM exited while serving ({how}){note}: its engine died or it was "
                          "stopped from outside (its log above says why)", code if code > 0 else 1)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, as Ctrl-C's KeyboardInterrupt is."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_name(e: BaseException) -> str:
    """How a stop was asked for: ``SIGTERM``, ``SIGHUP``, or ``SIGINT (Ctrl-C)``."""
    return signal.Signals(e.signum).name if isinstance(e, Stopped) else "SIGINT (Ctrl-C)"


#: stops whose exception Python swallowed (:func:`stop_on_signals`), for :func:`raise_swallowed`
_SWALLOWED: list[BaseException] = []


def stop_on_signals():
    """Ctrl-C, SIGTERM and SIGHUP (a closed terminal or ssh session) raise KeyboardInterrupt
    (:class:`Stopped` for the last two) wherever the program is: the build, vLLM's start-up, serving;
    Ctrl-C too when the process started with SIGINT ignored (``cmd &`` in a script). A signal that
    lands where Python ignores exceptions (a weakref callback or ``__del__``, e.g. an import's
    module lock: "Exception ignored in ...") would be lost: it is kept, unprinted, for
    :func:`raise_swallowed`, which the build's progress and the wait for vLLM call. Returns a
    function that puts the previous handlers back."""
    def on_term(signum, frame):
        raise Stopped(signum)

    def unraisable(u):
        if isinstance(u.exc_value, KeyboardInterrupt):
            _SWALLOWED.append(u.exc_value)
        else:
            hook(u)

    old = {sig: signal.signal(sig, h) for sig, h in ((signal.SIGINT, signal.default_int_handler),
                                                      (signal.SIGTERM, on_term), (signal.SIGHUP, on_term))}
    hook, sys.unraisablehook = sys.unraisablehook, unraisable

    def restore():
        for sig, h in old.items():
            signal.signal(sig, h)
        sys.unraisablehook = hook
    return restore


def raise_swallowed() -> None:
    """Raise, in the main thread, a stop signal's exception that Python swallowed since
    :func:`stop_on_signals` (once)."""
    if _SWALLOWED and threading.current_thread() is threading.main_thread():
        e = _SWALLOWED[0]
        _SWALLOWED.clear()
        raise e


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _ended(proc, REAP_S)  # not proc.wait(): see _ended


def run(plan: ServePlan, on_ready=None, startup_timeout: float = 900, health_every: float = HEALTH_EVERY_S) -> int:
    """Serve until Ctrl-C / SIGTERM / SIGHUP (a closed terminal or ssh session) (returns 0);
    raises :class:`ServeFailed` when vLLM or its engine dies first (:func:`watch`). A stop before
    vLLM was healthy kills its process group: it never served, and vLLM's start-up answers SIGINT
    with a KeyboardInterrupt traceback per process and defers SIGTERM."""
    restore = stop_on_signals()
    proc, tmp, served = None, None, False
    try:  # a stop while vLLM is being set up (its logging configuration imports vLLM: seconds) too
        tmp = tempfile.TemporaryDirectory(prefix="ttbundle-serve-")
        quiet = quiet_logging_config(Path(tmp.name))
        cause_file = Path(tmp.name) / "cause"
        env = {**plan.env, CAUSE_ENV: str(cause_file)}
        if quiet is not None:
            env["VLLM_LOGGING_CONFIG_PATH"] = str(quiet)
        proc = start(dataclasses.replace(plan, env=env))
        wait_healthy(proc, plan.host, plan.port, startup_timeout, plan.memory, cause_file)
        served = True
        mark_healthy(proc)
        if on_ready:
            on_ready(plan)
        watch(proc, plan.host, plan.port, health_every, memory=plan.memory)
        return 0  # pragma: no cover - watch only returns by raising
    except KeyboardInterrupt:
        if proc is not None and not served:
            _kill_group(proc)
        return 0
    finally:
        if proc is not None:
            stop(proc)
        if tmp is not None:
            tmp.cleanup()
        restore()


def require_checked(plan: ServePlan) -> dict:
    """``serve --require-checked``: the package's newest passing check record for its mesh
    (``check.record``: bound to its current manifest), else TTBundleError (exit 1) saying what
    it has and the command that makes one."""
    rec = passing(plan.package, plan.mesh)
    if rec is not None:
        return rec
    rs = records(plan.package)
    mine = [r for r in rs if any(h.get("sku") == plan.mesh for h in r.get("hardware", []))]
    why = ("it has no check record for its manifest (never checked, or rebuilt since)" if not mine else
           f"its latest check for {plan.mesh} failed: {mine[0].get('failure')}")
    raise TTBundleError(f"{plan.package}: --require-checked: no passing check record for {plan.mesh}; {why}. "
                        f"Run `ttbundle check {plan.package}` (docs/check.md)")
