"""The one model protocol (``ttbundle.runtime.interface.MeshModel``, docs/runtime.md): the emulated
``BundleModel`` and the device's ``TTDeviceModel`` both declare it and define every member with the
protocol's parameters (names, kinds, defaults); the model runner calls nothing else on the model
and probes it with no ``getattr``/``hasattr``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from ttbundle.runtime import interface
from ttbundle.runtime.adapter import BundleModel
from ttbundle.runtime.interface import MeshModel
from ttbundle.runtime.ttdevice import TTDeviceModel

ROOT = Path(__file__).resolve().parents[1]
MODELS = [BundleModel, TTDeviceModel]
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def members(proto) -> list[str]:
    """The protocol's members as its class body declares them: annotated attributes, methods,
    properties (in order)."""
    body = [n for n in vars(proto) if not n.startswith("_") and n not in ("__annotations__",)]
    return list(getattr(proto, "__annotations__", {})) + [n for n in body if n not in proto.__annotations__]


def mismatches(proto, cls) -> list[str]:
    """Where ``cls`` does not implement ``proto``: a member missing or only inherited from the
    protocol itself, a method whose parameters differ (the protocol's positional parameters in
    order, each keyword with its default, ``**kwargs`` where the protocol passes others through),
    or an extra parameter a caller of the protocol could not supply."""
    out = []
    own = [c for c in cls.__mro__ if c not in proto.__mro__]  # not the protocol's stubs
    for name in members(proto):
        if not any(name in vars(c) or name in getattr(c, "__annotations__", {}) for c in own):
            out.append(f"{cls.__name__}.{name}: not defined")
            continue
        if name in proto.__annotations__:  # an attribute: defined is all it takes
            continue
        if isinstance(inspect.getattr_static(proto, name), property):
            if not isinstance(inspect.getattr_static(cls, name), property):
                out.append(f"{cls.__name__}.{name}: not a property")
            continue
        p, i = inspect.signature(getattr(proto, name)), inspect.signature(getattr(cls, name))
        pp, ip = list(p.parameters.values()), list(i.parameters.values())
        ppos, ipos = [x for x in pp if x.kind in POSITIONAL], [x for x in ip if x.kind in POSITIONAL]
        for a, b in zip(ppos, ipos):
            if (a.name, a.default) != (b.name, b.default):
                out.append(f"{cls.__name__}.{name}: positional {b.name}={b.default!r}, the protocol's "
                           f"{a.name}={a.default!r}")
        if len(ipos) < len(ppos):
            out.append(f"{cls.__name__}.{name}: misses {[x.name for x in ppos[len(ipos):]]}")
        by_name = {x.name: x for x in ip}
        for a in pp:
            if a.kind is inspect.Parameter.KEYWORD_ONLY and (a.name not in by_name or by_name[a.name].default != a.default):
                out.append(f"{cls.__name__}.{name}: keyword {a.name}={a.default!r} missing or another default")
        var_kw = any(x.kind is inspect.Parameter.VAR_KEYWORD for x in pp)
        if var_kw and not any(x.kind is inspect.Parameter.VAR_KEYWORD for x in ip):
            out.append(f"{cls.__name__}.{name}: takes no **kwargs (the protocol passes other keywords through)")
        names = {x.name for x in pp}
        for b in ip:
            if b.name in names or b.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                continue
            if b.default is inspect.Parameter.empty and not (var_kw and b.kind is inspect.Parameter.KEYWORD_ONLY):
                out.append(f"{cls.__name__}.{name}: requires {b.name}, which the protocol does not pass")
    return out


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_each_model_declares_and_implements_the_protocol(cls):
    assert MeshModel in cls.__mro__  # declared, not only shaped alike
    assert mismatches(MeshModel, cls) == []
    assert not getattr(cls, "__abstractmethods__", None)  # instantiable: nothing left abstract


def test_the_protocol_lists_what_the_runner_needs():
    assert members(MeshModel) == [
        "model_capabilities", "seeded_on_device", "initialize_vllm_model", "allocate_kv_cache",
        "prefill_forward", "read_prefill_output", "decode_forward", "verify_forward", "read_decode_output",
        "process_decode_output_host",
        "vision_buckets", "encode_images", "warmup_model_prefill", "warmup_model_decode", "seal",
        "release"]
    assert BundleModel.seeded_on_device is True and TTDeviceModel.seeded_on_device is False


def test_the_check_finds_a_model_that_does_not_conform():
    class Renamed(BundleModel):  # a renamed parameter, a dropped default, no **kwargs
        def prefill_forward(self, tokens, table, kv_cache, prompt_lens, start_pos, sampling_params=None):
            ...

    class Extra(TTDeviceModel):  # a required parameter no caller passes
        def seal(self, now):
            ...

    got = mismatches(MeshModel, Renamed)
    assert "Renamed.prefill_forward: positional table=<class 'inspect._empty'>, the protocol's " \
           "page_table=<class 'inspect._empty'>" in got
    assert "Renamed.prefill_forward: positional start_pos=<class 'inspect._empty'>, the protocol's " \
           "start_pos=None" in got
    assert "Renamed.prefill_forward: takes no **kwargs (the protocol passes other keywords through)" in got
    assert mismatches(MeshModel, Extra) == ["Extra.seal: requires now, which the protocol does not pass"]

    class Partial(MeshModel):  # leaves every method out: the protocol's stubs are abstract
        model_capabilities: dict = {}
        seeded_on_device = True
    with pytest.raises(TypeError, match="abstract"):
        Partial()
    assert "Partial.seal: not defined" in mismatches(MeshModel, Partial)


def test_the_runner_calls_the_protocol_only():
    """Every ``self.mesh_model.<name>`` the model runner uses is a protocol member, and nothing
    asks whether the model has one (``getattr``/``hasattr`` on it). ``model`` is the emulated
    model's ``EmulatedModel``, which only the emulated mesh's warm-up check reads."""
    tree = ast.Module([n for f in ("model_runner.py", "runner_async.py")  # the runner and its async decode part
                       for n in ast.parse((ROOT / "ttbundle/runtime" / f).read_text(encoding="utf-8")).body], [])

    def is_mesh_model(n) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "mesh_model" and isinstance(n.value, ast.Name) \
            and n.value.id == "self"
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and is_mesh_model(n.value)}
    probes = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "hasattr") and n.args and is_mesh_model(n.args[0])]
    assert probes == []
    assert used - set(members(MeshModel)) == {"model"}
    assert {"prefill_forward", "decode_forward", "allocate_kv_cache", "seal"} <= used
    assert [n.name for n in ast.parse(inspect.getsource(interface)).body if isinstance(n, ast.ClassDef)] == \
        ["MeshModel"]  # one protocol
