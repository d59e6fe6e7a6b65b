"""A package's model on a ttnn mesh: :func:`open_model` is the hardware path end to end: open the
package's mesh with its trace region, load the tensorbin weight caches, allocate the KV cache and
every bucket's inputs, make the constants, run the setup calls, and hand back a
:class:`~.trace.TraceRunner` ready for warm-up. Real-device tests (``tt_hardware``) drive it;
nothing here has run on hardware yet (docs/hardware.md).

Its own module because it joins :mod:`.device` (the executor) and :mod:`.trace` (which runs on
that executor): neither imports the other's user.
"""

from __future__ import annotations

from . import cache as ttcache
from .device import Executor, allocate_kv, make_const
from .lowering import chunk_starts, lower_forward
from .trace import TraceRunner


def forward_keys(package, programs: dict, sample_on_device_mode: str = "all", host_fallback: bool = False,
                 trace_mode: str | None = None) -> tuple[list[tuple], set]:
    """Every forward a model needs, keyed ``(phase, bucket, sampling, start)``, and the traced ones,
    for the package's ``programs`` ((phase, bucket) -> its typed program, ``LoadedPackage.program_ir``;
    ``package``: the ``LoadedPackage``, whose manifest's ``serving`` and ``buckets`` it reads).
    ``sampling`` is "device" where ``sample_on_device_mode`` allows it, "host" otherwise, and also
    "host" everywhere with ``host_fallback`` (batches whose requests need logits); ``start`` is
    the static chunk start of an MLA prefill (``inputs.chunk_starts``), else 0. ``trace_mode``:
    the serving option (default: the package's ``serving.trace_mode``). A verify program (speculative
    decoding) has one forward, host-sampled (``lowering.samplings``), traced as decode is."""
    mode = trace_mode or package.serving.trace_mode
    keys, traced = [], set()
    for phase, b in programs:
        if phase == "verify":  # speculative decoding: every row's logits back (acceptance on the
            keys.append((phase, b, "host", 0))  # host, as the emulated mesh); traced like decode
            if mode in ("all", "decode_only"):
                traced.add(keys[-1])
            continue
        if phase == "vision":  # one forward per vision bucket (its soft tokens come back); traced
            keys.append((phase, b, "host", 0))  # with the prefills (fixed shapes, as lower.traced)
            if mode == "all":
                traced.add(keys[-1])
            continue
        on_device = sample_on_device_mode == "all" or (sample_on_device_mode == "decode_only" and phase == "decode")
        modes = (["device"] if on_device else []) + (["host"] if host_fallback or not on_device else [])
        for sampling in modes:
            for start in chunk_starts(package, programs[phase, b]):
                keys.append((phase, b, sampling, start))
                if mode == "all" or (mode == "decode_only" and phase == "decode"):
                    traced.add(keys[-1])
    return keys, traced


def open_model(ttnn, package, sample_on_device_mode: str = "all", mesh_device=None, *,
               host_fallback: bool = False, trace_mode: str | None = None):
    """The package's model on a mesh, ready for ``warmup()`` (hardware; see module docstring).
    ``package``: the ``package.load.LoadedPackage`` its caller loaded (the backend loads no
    package: the loader reads bundle.yaml, which no backend imports). Everything comes from the
    package as built, nothing is re-planned: its mesh and trace region (manifest), its
    ``tensorbin/`` weights, its KV cache record and its programs, each lowered as it is (the
    weights' PartitionSpecs and shapes it records). Forwards are keyed as :func:`forward_keys`
    says."""
    if not hasattr(package, "program_ir"):
        raise TypeError(f"open_model takes a loaded package (package.load.load_package), not {package!r}")
    pkg = package
    bundle = pkg.bundle
    idx = ttcache.read_index(pkg.dir)  # checked whole (identity, every file) before anything loads
    ttcache.check_index(pkg.dir, idx, pkg.weight_refs, pkg.mesh.shape, pkg.weights.stored_in,
                        expect=ttcache.expected_identity(pkg.manifest),
                        verified_files=pkg.manifest["files"] if pkg.verified else None)
    ttcache.check_installed_ttnn(ttnn, idx)
    if mesh_device is None:
        mesh_device = ttnn.open_mesh_device(ttnn.MeshShape(*pkg.mesh.shape), trace_region_size=pkg.trace_region_size)
    ttcache.check_device_arch(mesh_device, idx, pkg.dir)
    ex = Executor(ttnn, mesh_device)
    ex.env["weights"].update(ttcache.load_mesh_weights(ttnn, mesh_device, pkg.dir))
    ex.env["kv"] = allocate_kv(ttnn, mesh_device, pkg.kv_cache)
    keys, trace_keys = forward_keys(pkg, {k: pkg.program_ir(*k) for k in pkg.programs},
                                    sample_on_device_mode, host_fallback, trace_mode)
    forwards = {}
    for key in keys:
        phase, b, sampling, start = key
        forwards[key] = lower_forward(bundle, pkg.mesh, pkg.program_ir(phase, b), sampling, chunk_start=start)
    consts = {c.name: c for fw in forwards.values() for c in fw.consts}
    for c in consts.values():
        ex.env[c.name] = make_const(ttnn, mesh_device, c)
    return TraceRunner(ex, forwards, trace_keys)
