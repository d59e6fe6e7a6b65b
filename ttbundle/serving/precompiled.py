"""`ttbundle serve --require-precompiled`: refuse (exit 2, before vLLM starts) a start that would
compile anything, naming what (as IBM's Spyre plugin's ``VLLM_SPYRE_REQUIRE_PRECOMPILED_DECODERS``;
a cold Galaxy start compiles for > 20 minutes, tt-inference-server #3657).

What would compile, per device:

* **both**: a program (phase, bucket) the served configuration runs that the package does not list
  as lowered at build (manifest ``precompiled.programs``): nothing is lowered at start, so this
  only refuses a package whose listing is incomplete (hand-edited, or cut short);
* **tt**: each forward the model opens (``backends/ttnn/model.forward_keys``: every bucket, the
  sampling variants the options select plus the host fallback, one per MLA chunk start) whose
  program's kernels are not in the package's kernel cache (``precompiled.kernels``; empty where
  the build had no SFPI compiler, with the reason); its trace, captured at every start from those
  kernels, is named with it. A ``TT_METAL_CACHE`` already set in the environment takes the place
  of the package's cache (the worker leaves it), so it is refused too;
* **emulated**: nothing else: vLLM's compilation is off there (``CompilationMode.NONE``, eager,
  ``runtime/platform.py``), and the programs run as the package holds them.

A package built before manifests listed ``precompiled`` is read from its ``artifacts`` (the same
facts).
"""

from __future__ import annotations

from ..backends.ttnn.model import forward_keys
from ..errors import InvalidInput
from ..program import program_name


def listed(manifest: dict) -> dict:
    """The manifest's ``precompiled`` record, or the same facts read from its ``artifacts``."""
    if "precompiled" in manifest:
        return manifest["precompiled"]
    art = manifest.get("artifacts", {})
    out = {"programs": sorted(a.split(":", 1)[1] for a in art if a.startswith("program:"))}
    kc = art.get("kernel_cache", {})
    out["kernels"] = sorted(kc.get("programs", [])) if kc.get("filled") else []
    if not kc.get("filled"):
        out["kernels_missing_reason"] = kc.get("reason", "no kernel cache")
    return out


def would_compile(pkg, device: str, tt_options: dict, env: dict) -> list[str]:
    """What a start of ``pkg`` (``runtime.packages.Package``) on ``device`` with the plugin options
    ``tt_options`` (``--additional-config``'s ``tt``) would compile; [] when nothing."""
    pre = listed(pkg.manifest)
    programs = {k: pkg.loaded.program_ir(*k) for k in pkg.loaded.programs}
    out = [f"program {program_name(p, b)}: not lowered at build (not in the manifest's precompiled.programs)"
           for p, b in programs if program_name(p, b) not in set(pre.get("programs", []))]
    if device != "tt":
        return out

    rt = pkg.serving
    keys, traced = forward_keys(pkg.loaded, programs, tt_options.get("sample_on_device_mode") or
                                rt.sample_on_device_mode, host_fallback=True,
                                trace_mode=tt_options.get("trace_mode") or rt.trace_mode)
    have = set(pre.get("kernels", []))
    why = pre.get("kernels_missing_reason")
    missing = []
    for phase, b in programs:
        name = program_name(phase, b)
        if name in have:
            continue
        forwards = [k for k in keys if k[:2] == (phase, b)]
        traces = sum(k in traced for k in forwards)
        missing.append(f"{name} ({'/'.join(sorted({k[2] for k in forwards}))} sampling"
                       + (f", {traces} trace{'s' if traces > 1 else ''} captured from them" if traces else "") + ")")
    if missing:
        out.append(f"the kernels of {len(missing)} program{'s' if len(missing) > 1 else ''}, not in the package's "
                   f"kernel cache{f' ({why})' if why else ''}: " + ", ".join(missing))
    if env.get("TT_METAL_CACHE") and have:
        out.append(f"every kernel: TT_METAL_CACHE={env['TT_METAL_CACHE']} is set, so the package's kernel cache "
                   "is not used (unset it)")
    return out


def require(pkg, device: str, tt_options: dict, env: dict) -> None:
    """InvalidInput (exit 2) naming what would compile, if anything would."""
    todo = would_compile(pkg, device, tt_options, env)
    if not todo:
        return
    shown = "; ".join(todo)
    fix = ("build the package on a host with the SFPI compiler (`ttbundle build --backend ttnn` fills "
           "kernel_cache/), or serve without --require-precompiled" if device == "tt"
           else "rebuild the package, or serve without --require-precompiled")
    raise InvalidInput(f"--require-precompiled: {pkg.name}-{pkg.mesh_name} on the {device} device would compile "
                       f"before serving: {shown}; fix: {fix}")
