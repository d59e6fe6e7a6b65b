"""One module per vision encoder in each backend (docs/architecture.md, "adding a family").

Each multimodal family's encoder-specific kernels (the emulated ones) and op lowerings (ttnn)
live in one module per backend, ``backends/<backend>/vision/<family name>.py``, registered in
the backend's table (``kernel_table.ENCODERS``, ``lowering.ENCODERS``); ``vision/_common.py``
holds only what several encoders' programs name. The names a family's programs use are read
from the family's own program declarations (``Family.vision_programs``, ``Family.layers``),
not from the backends, so a kernel left in a shared module, or put in another encoder's, fails
here.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ttbundle import families, spec as specmod
from ttbundle.backends.emulated import kernel_table, kernels, moe_kernels
from ttbundle.backends.emulated.vision import _common as emu_common
from ttbundle.backends.ttnn import lowering, mesh_ops, moe_ops, text_ops
from ttbundle.backends.ttnn.vision import _common as tt_common
from ttbundle.families.base import Local

ROOT = Path(__file__).resolve().parent.parent
BUNDLES = ROOT / "bundles"
VISION = {n: f for n, f in families.all_families().items() if f.vision_class is not None}
# per backend: its encoder registry, the name of an encoder module's table, the shared
# (non-encoder) tables, the vision package's _common table
BACKENDS = {
    "emulated": (kernel_table.ENCODERS, "KERNELS", {**kernels.KERNELS, **moe_kernels.MOE_KERNELS}, emu_common.KERNELS),
    "ttnn": (lowering.ENCODERS, "OPS", {**text_ops.OPS, **moe_ops.OPS, **mesh_ops.OPS}, tt_common.OPS),
}


def _arch(name: str):
    for path in sorted(BUNDLES.glob("*.yaml")):
        bundle = specmod.load(path)
        if bundle.family.name == name and bundle.family.vision_programs(bundle.arch) is not None:
            return bundle.arch
    pytest.fail(f"no example bundle in bundles/ with a vision part for the family {name!r}")


def _locals(ops) -> set[str]:
    return {op.kernel for op in ops if isinstance(op, Local)}


def _used() -> dict[str, set[str]]:
    """Family name -> the local kernel names its programs (vision and text layers) use."""
    out = {}
    for name, fam in VISION.items():
        a = _arch(name)
        used = set()
        for _, _, ops in fam.vision_programs(a):
            used |= _locals(ops)
        for lk in fam.layers(a):
            used |= _locals(lk.ops)
        out[name] = used
    return out


USED = _used()


def _lineage(name: str) -> list[str]:
    """The vision families whose vision part this family's extends (itself first)."""
    own = VISION[name].vision_class
    return [n for n, f in VISION.items() if issubclass(own, f.vision_class)]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_vision_family_has_its_encoder_module_and_no_other(backend):
    registry, _, _, _ = BACKENDS[backend]
    assert set(registry) == set(VISION), f"{backend}: encoder modules {sorted(registry)}, vision families {sorted(VISION)}"
    folder = ROOT / "ttbundle" / "backends" / backend / "vision"
    files = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    assert files == set(registry), f"{backend}/vision/: modules {sorted(files)} not all registered"
    for name, mod in registry.items():
        assert Path(inspect.getfile(mod)) == folder / f"{name}.py"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_each_familys_encoder_names_live_in_its_own_module(backend):
    """Every name a vision family's programs use that no text/MoE/mesh table has is in its own
    encoder module, one it extends (Qwen3-VL's vision part extends Qwen2.5-VL's) or ``_common``;
    every name ``_common`` holds is used by at least two encoders' programs (else it belongs in
    one encoder's module); no encoder module holds a name its family's programs do not use."""
    registry, table, shared, common = BACKENDS[backend]
    for name in VISION:
        own = set().union(*(getattr(registry[n], table) for n in _lineage(name)))
        specific = USED[name] - set(shared)
        assert specific, f"{name}: its programs name no encoder-specific kernel"
        assert not specific - own - set(common), (
            f"{backend}: {name}'s {sorted(specific - own - set(common))} are not in vision/{name}.py "
            f"(nor a module its vision part extends, nor _common)")
        mine = set(getattr(registry[name], table))
        users = {n for n in VISION if name in _lineage(n)}
        unused = {k for k in mine if not any(k in USED[u] for u in users)
                  and not k.startswith("qwen3_deepstack")}  # mergers for every DeepStack count a config may set
        assert not unused, f"{backend}: vision/{name}.py holds {sorted(unused)}, which no program of {sorted(users)} names"
    for k in common:
        n = sum(k in USED[name] for name in VISION)
        assert n >= 2, f"{backend}: vision/_common's {k!r} is named by {n} encoder(s); it belongs in that encoder's module"


def test_the_two_backends_register_the_same_names_per_encoder():
    emu, tt = kernel_table.ENCODERS, lowering.ENCODERS
    for name in VISION:
        assert set(emu[name].KERNELS) == set(tt[name].OPS), name
    assert set(emu_common.KERNELS) == set(tt_common.OPS)
