"""The model's sizes recorded in the program (``traits.Dims``, ``ttbundle.program/4``, issue 22):
hidden, vocab, decoder layers, KV heads, head width, RMSNorm eps and ``runtime.max_model_len``.
They are transformers' config values for the spec, a package whose programs and bundle.yaml
disagree on them is refused at load, and both backends and the runtime's model read them from
the program: bundle.yaml's arch and ``max_model_len`` are unreachable from those modules here."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from ttbundle import spec as specmod
from ttbundle.lower import lower, lower_all
from ttbundle.plan.make import make_plan
from ttbundle.plan.sharding import target_mesh
from ttbundle.program import Program, ProgramError
from ttbundle.traits import Dims

from pkg_mutations import rehash
from test_emulated import COMMON, TINY

#: what a backend or the runtime sizes things by: the program's ``dims`` (and ``layer_traits``)
ARCH_DIMS = ("hidden_size", "vocab_size", "num_hidden_layers", "kv_heads", "hd", "head_dim",
             "num_key_value_heads", "rms_norm_eps", "rope_theta", "rope_scaling", "hidden_act")
EXECUTORS = ("ttbundle.backends.", "ttbundle.runtime.")


class _Unreachable:
    """``obj`` whose ``names`` raise when a backend or runtime module reads them (a family's own
    code, declaring the weights from the arch, still may)."""

    def __init__(self, obj, names):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_names", names)

    def __getattr__(self, name):
        if name in self._names:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(EXECUTORS):
                raise AssertionError(f"{caller} read {name} from bundle.yaml, not from the program")
        return getattr(self._obj, name)


def _guard(monkeypatch, b) -> None:
    monkeypatch.setattr(b, "arch", _Unreachable(b.arch, ARCH_DIMS))
    monkeypatch.setattr(b.spec, "runtime", _Unreachable(b.spec.runtime, ("max_model_len",)))


@pytest.mark.parametrize("family", sorted(TINY))
def test_programs_record_transformers_sizes(family):
    from ttbundle.reference import hf_config

    b = specmod.loads(TINY[family] + COMMON, f"tiny-{family}.yaml")
    prog = lower(b, make_plan(b, target_mesh(b, "N300")), "decode", 8)
    cfg = hf_config(b).get_text_config()
    want = Dims(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_hidden_layers=cfg.num_hidden_layers,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                rms_norm_eps=cfg.rms_norm_eps, max_model_len=256)  # COMMON's runtime.max_model_len
    assert prog.dims == want
    assert Program.from_json(json.loads(json.dumps(prog.to_json()))).dims == want


@pytest.mark.parametrize("edit, named", [
    (lambda d: d.pop("dims"), "KeyError: 'dims'"),
    (lambda d: d["dims"].update(vocab_size="many"), "dims.vocab_size: expected an integer"),
    (lambda d: d["dims"].update(heads=4), "dims: unknown trait(s) 'heads'"),
])
def test_malformed_dims_are_refused_naming_the_field(edit, named):
    b = specmod.loads(TINY["llama"] + COMMON, "<spec>")
    d = lower(b, make_plan(b, target_mesh(b, "N300")), "decode", 1).to_json()
    edit(d)
    with pytest.raises(ProgramError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Program.from_json(d, "decode-1")


def test_verify_wants_the_dims_layer_count_to_be_the_programs():
    b = specmod.loads(TINY["llama"] + COMMON, "<spec>")
    p = lower(b, make_plan(b, target_mesh(b, "N300")), "decode", 1)
    with pytest.raises(ProgramError, match="its dims say 3 decoder layers, but its layer programs run 2"):
        dataclasses.replace(p, dims=dataclasses.replace(p.dims, num_hidden_layers=3)).verify()


def test_a_package_whose_programs_and_bundle_yaml_disagree_on_a_size_is_refused(tmp_path):
    from ttbundle.package.load import load_package
    from ttbundle.package.names import PackageError
    from ttbundle.serving.demo import build_package

    pkg = build_package(TINY["llama"] + COMMON, tmp_path, "N150", warmup=False)
    assert load_package(pkg).dims.max_model_len == 256
    for p in sorted((pkg / "programs").glob("*.json")):
        d = json.loads(p.read_text())
        d["dims"]["max_model_len"] = 512
        p.write_text(json.dumps(d))
        rehash(pkg, f"programs/{p.name}")
    from ttbundle.package.speccheck import load_checked
    with pytest.raises(PackageError, match=r"dims disagree with bundle.yaml: max_model_len 512 \(bundle.yaml: 256\)"):
        load_checked(pkg)  # the build, check and cache verify; serving reads the programs' dims


def test_the_backends_read_the_programs_sizes_not_bundle_yamls(monkeypatch, tmp_path):
    """The emulated mesh runs a prefill and a decode, and the ttnn lowering lowers both, with
    bundle.yaml's arch sizes and max_model_len unreachable; sizes changed in the program change
    what they do (the RMSNorm eps the logits; max_model_len the page-table width)."""
    from ttbundle.backends.emulated import Runner
    from ttbundle.backends.emulated.model import EmulatedModel
    from ttbundle.backends.ttnn import lowering
    from ttbundle.serving.demo import make_source
    from ttbundle.weights import load_canonical

    b = specmod.loads(TINY["qwen3"] + COMMON, "<spec>")  # q/k norms: the eps inside attention too
    plan = make_plan(b, target_mesh(b, "N300"))
    canonical = load_canonical(b.family, b.arch, make_source(b, tmp_path / "src", seed=0))
    progs = lower_all(b, plan)
    _guard(monkeypatch, b)

    def changed(**kw):
        return {k: dataclasses.replace(p, dims=dataclasses.replace(p.dims, **kw)) for k, p in progs.items()}

    tokens = [5, 9, 17, 3]
    outs = []
    for ps in (progs, changed(rms_norm_eps=0.5)):
        r = Runner(EmulatedModel.from_canonical(b, plan, canonical, ps))
        first = r.prefill(tokens, [0])
        outs.append((first, r.decode([int(first.argmax())], [len(tokens)], [[0]])))
    assert torch.isfinite(outs[0][1]).all()
    assert not torch.allclose(outs[0][0], outs[1][0])
    longer = changed(max_model_len=512)
    assert Runner(EmulatedModel.from_canonical(b, plan, canonical, longer)).max_blocks == 2 * \
        Runner(EmulatedModel.from_canonical(b, plan, canonical, progs)).max_blocks

    for key in (("prefill", 64), ("decode", 8)):
        fw = lowering.lower_forward(b, plan.mesh, progs[key])
        assert fw.gaps == []
        fw2 = lowering.lower_forward(b, plan.mesh, longer[key])
        block = progs[key].kv_cache["block_size"]
        assert fw.inputs["page_table"][0][1] == 256 // block and fw2.inputs["page_table"][0][1] == 512 // block


def test_the_runtime_model_reads_the_packages_sizes_not_bundle_yamls(monkeypatch, tmp_path):
    """The emulated model vLLM's runner calls (``BundleModel``) opens, prefills and decodes a
    package with bundle.yaml's arch sizes and max_model_len unreachable."""
    from ttbundle.runtime.adapter import BundleModel
    from ttbundle.runtime.packages import open_package
    from ttbundle.serving.demo import build_package

    pkg = open_package(build_package(TINY["llama"] + COMMON, tmp_path, "N150", warmup=False))
    _guard(monkeypatch, pkg.bundle)
    assert pkg.dims == Dims.of_arch(pkg.bundle.arch._obj, 256)
    with pytest.raises(ValueError, match="max_model_len=256"):
        BundleModel.initialize_vllm_model(None, None, 8, 512, package=pkg)
    model = BundleModel.initialize_vllm_model(None, None, 8, 256, package=pkg)
    assert model.vocab_size == pkg.dims.vocab_size


def test_a_ttnn_rope_table_uses_its_layers_scaling_not_the_archs():
    """Gemma 3 scales the global layers' rope (linear, factor 8) and not the local ones: each
    layer's host-made table is ``tables.rope_cos_sin`` with that layer's own scaling."""
    from ttbundle.backends.ttnn import device, lowering
    from ttbundle.tables import rope_cos_sin

    b = specmod.loads(TINY["gemma3"].replace("model:\n", "model:\n  rope_scaling: {rope_type: linear, factor: 8.0}\n"
                                             "  sliding_window_pattern: 2\n")
                      + COMMON, "<spec>")
    assert b.arch.rope_scaling is not None
    plan = make_plan(b, target_mesh(b, "N150"))
    prog = lower(b, plan, "decode", 8)
    fw = lowering.lower_forward(b, plan.mesh, prog)
    tables = {c.name: c for c in fw.consts if c.kind == "rope_cos"}
    scaled = next(lt["rope_scaling"] for lt in prog.layer_traits if lt["rope_scaling"] is not None)
    assert any(lt["rope_scaling"] is None for lt in prog.layer_traits)
    assert len(tables) == 2  # one table per rope variant: the local layers' and the global ones'
    for c in tables.values():
        p = dict(c.params)
        scaling = scaled if p["scaling"] else None
        want, _ = rope_cos_sin(torch.arange(c.shape[0]), p["head_dim"], p["theta"], scaling, torch.float32)
        torch.testing.assert_close(torch.from_numpy(device._rope_table(c)).reshape(want.shape), want)
