"""The family's traits recorded in the program (``ttbundle/traits.py``, issue 22): every published
bundle's programs carry what its family says (the family is checked against HF's modules in
``test_families_decl``), serialized and read back typed, refused at load when malformed, and the
backends run from the program's traits, not the family's."""

from __future__ import annotations

import glob
import json

import pytest
import torch

from ttbundle import spec as specmod
from ttbundle.lower import lower
from ttbundle.plan.make import make_plan
from ttbundle.plan.sharding import target_mesh
from ttbundle.program import Program, ProgramError
from ttbundle.traits import Act, LayerTraits, Traits

from test_emulated import COMMON, TINY


def _plain(x):
    """JSON-normal form (tuples as lists, pydantic models as dicts without None)."""
    if hasattr(x, "model_dump"):
        return x.model_dump(exclude_none=True)
    if isinstance(x, dict) or hasattr(x, "keys"):
        return {k: _plain(x[k]) for k in x if x[k] is not None}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


@pytest.mark.parametrize("spec_file", sorted(glob.glob("bundles/*.yaml")))
def test_programs_record_the_family_traits(spec_file):
    b = specmod.load(spec_file)
    fam, a = b.family, b.arch
    plan = make_plan(b, target_mesh(b, b.spec.targets[0]))
    prog = lower(b, plan, "decode", b.buckets.decode[0])
    want = {"act": a.hidden_act, **fam.traits(a)}
    assert _plain(prog.traits) == _plain(want)
    assert prog.traits.act is Act(a.hidden_act)
    assert len(prog.layer_traits) == a.num_hidden_layers
    for i, lt in enumerate(prog.layer_traits):
        fl = fam.layer_traits(a, i)
        assert lt.rope_theta == fl.get("rope_theta", a.rope_theta)
        assert lt["rope_scaling"] == fl.get("rope_scaling", a.rope_scaling)  # None kept: no scaling
        assert _plain({k: v for k, v in lt.items() if k not in ("rope_theta", "rope_scaling")}) == \
            _plain({k: v for k, v in fl.items() if k not in ("rope_theta", "rope_scaling")})
    back = Program.from_json(json.loads(json.dumps(prog.to_json())))
    assert back.traits == prog.traits and back.layer_traits == prog.layer_traits


def test_gemma3_local_layers_record_no_scaling_where_the_arch_scales():
    b = specmod.load("bundles/gemma-3-27b.yaml")
    assert b.arch.rope_scaling is not None
    prog = lower(b, make_plan(b, target_mesh(b, b.spec.targets[0])), "decode", b.buckets.decode[0])
    local = [lt for lt, k in zip(prog.layer_traits, b.arch.kinds) if k == "sliding_attention"]
    assert local and all(lt.get("rope_scaling", "arch") is None and lt["window"] for lt in local)


def _tiny_program(family="llama"):
    b = specmod.loads(TINY[family] + COMMON, "<spec>")
    return b, make_plan(b, target_mesh(b, "N300"))


@pytest.mark.parametrize("edit, named", [
    (lambda d: d["traits"].update(act="relu"), "traits.act: activation 'relu'"),
    (lambda d: d["traits"].update(softcap=3.0), "traits: unknown trait(s) 'softcap'"),
    (lambda d: d["layer_traits"][1].update(rope_scaling={"rope_type": "ntk"}), "layer_traits[1].rope_scaling.rope_type"),
    (lambda d: d["layer_traits"][0].update(window="wide"), "layer_traits[0].window: expected an integer"),
])
def test_malformed_traits_are_refused_naming_the_field(edit, named):
    b, plan = _tiny_program()
    d = lower(b, plan, "decode", 1).to_json()
    edit(d)
    with pytest.raises(ProgramError, match=named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        Program.from_json(d, "decode-1")


def test_verify_wants_one_layer_traits_per_decoder_layer():
    b, plan = _tiny_program()
    d = lower(b, plan, "decode", 1).to_json()
    d["layer_traits"].pop()
    with pytest.raises(ProgramError, match="records traits for 1 decoder layers, but its layer programs run 2"):
        Program.from_json(d, "decode-1").verify()


def test_traits_read_as_the_mappings_the_op_code_uses():
    t = Traits.of({"act": "gelu", "norm_offset": 1.0, "moe": {"top_k": 2, "swiglu_limit": 7.0},
                   "norms": {"kv_a_norm": {"eps": 1e-6, "features": 64}}}, "t")
    assert t.get("act") == "gelu" and t["moe"]["top_k"] == 2 and t["moe"].get("n_group", 1) == 1
    assert t.get("norms", {}).get("kv_a_norm", {}).get("features") == 64 and t.get("mla") is None
    assert "final_softcap" not in t and t.get("linear_fp32", ()) == ()
    lt = LayerTraits.of({"rope_theta": 1e4, "rope_scaling": None}, "lt")
    assert lt.get("rope_scaling", "arch") is None and lt.get("window") is None


def test_the_emulated_model_runs_the_programs_traits_not_the_familys(monkeypatch, tmp_path):
    """A soft-cap written into the program's traits caps the logits as HF's final_logit_softcapping
    does (``c * tanh(x / c)``); the family is not asked."""
    from ttbundle.backends.emulated import Runner
    from ttbundle.backends.emulated.model import EmulatedModel
    from ttbundle.lower import lower_all
    import dataclasses

    from ttbundle.serving.demo import make_source
    from ttbundle.weights import load_canonical

    b, plan = _tiny_program()
    canonical = load_canonical(b.family, b.arch, make_source(b, tmp_path / "src", seed=0))
    progs = lower_all(b, plan)
    fam = type(b.family)

    def asked(*_):
        raise AssertionError("the family was asked for its traits")
    monkeypatch.setattr(fam, "traits", asked)
    monkeypatch.setattr(fam, "layer_traits", asked)
    cap = 0.5
    capped = {k: dataclasses.replace(p, traits=dataclasses.replace(p.traits, final_softcap=cap))
              for k, p in progs.items()}
    tokens = [5, 9, 17, 3]
    out = [Runner(EmulatedModel.from_canonical(b, plan, canonical, ps)).prefill(tokens, [0])
           for ps in (progs, capped)]
    assert not torch.allclose(out[0], out[1])
    torch.testing.assert_close(out[1].float(), cap * torch.tanh(out[0].float() / cap), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("spec_file", ["bundles/gemma-2-9b.yaml", "bundles/deepseek-v3.yaml"])
def test_the_ttnn_lowering_reads_the_programs_traits_not_the_familys(monkeypatch, spec_file):
    """Gemma 2's window, soft-caps and norm offset, DeepSeek's MLA and MoE: lowered with the
    family's traits unreachable, and a window changed in the program changes the call."""
    import dataclasses

    from ttbundle.backends.ttnn import lowering

    b = specmod.load(spec_file)
    plan = make_plan(b, target_mesh(b, b.spec.targets[0]))
    prog = lower(b, plan, "decode", b.buckets.decode[0])

    def asked(*_):
        raise AssertionError("the family was asked for its traits")
    monkeypatch.setattr(type(b.family), "traits", asked)
    monkeypatch.setattr(type(b.family), "layer_traits", asked)
    fw = lowering.lower_forward(b, plan.mesh, prog)
    assert fw.gaps == []
    if b.family.name == "gemma2":
        w = b.arch.sliding_window  # soft-capped attention: the window is a mask input of its own
        lts = tuple(dataclasses.replace(lt, window=lt.window + 32) if lt.window else lt for lt in prog.layer_traits)
        fw2 = lowering.lower_forward(b, plan.mesh, dataclasses.replace(prog, layer_traits=lts))
        assert lowering.mask_input(w) in fw.inputs and lowering.mask_input(w) not in fw2.inputs
        assert lowering.mask_input(w + 32) in fw2.inputs
