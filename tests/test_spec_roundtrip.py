"""What ``validate`` accepts, ``build`` writes back (the package's ``bundle.yaml``) and ``serve``
reads must be the same spec: for every published bundle and the tiny vision specs, on every
target, the resolved spec the build writes (``package.templates.resolved_spec`` rendered by
``render_bundle_yaml``, the text ``build`` puts in the package) loads, and its every field means
what the validated spec meant: the same arch, buckets, image settings (family defaults filled in
the same way), runtime, pooling, quality targets, and, planned again on the same mesh, the same
per-tensor split and dtype. One real build of the spec from issue 39 (``vision: {images_per_prompt:
1, min_pixels: 65536}`` on a Qwen3-VL, whose written ``bundle.yaml`` used to say ``buckets: [1]``,
``max_pixels: null`` and did not load) is loaded the way ``serve`` loads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from spec_helpers import TINY_MISTRAL3, TINY_Q3VL, TINY_QVL

from ttbundle import spec as specmod
from ttbundle.package.templates import render_bundle_yaml, resolved_spec
from ttbundle.plan.make import make_plan
from ttbundle.spec.schema import BundleSpec

BUNDLES = Path(__file__).resolve().parent.parent / "bundles"
PUBLISHED = sorted(p.name for p in BUNDLES.glob("*.yaml"))

#: every top-level field of the spec, and how the round trip compares it: "same" equal as
#: written, "effective" equal once the loaded bundle's defaults apply (``Bundle`` properties),
#: "written" changed by design (this mesh only, paths dropped: the package holds the weights and
#: tokenizer; the plan resolved), compared through the plan made again on the mesh
FIELDS = {"name": "same", "description": "same", "hf_model": "same", "task": "same", "quality": "same",
          "runtime": "same", "speculative": "same", "model": "effective", "buckets": "effective",
          "vision": "effective", "embedding": "effective", "from_hf": "written", "tokenizer": "written",
          "weights": "written", "targets": "written", "sharding": "written", "replicas": "written"}


def test_every_spec_field_has_a_round_trip_rule():
    """A field added to the spec fails here until this test says how it survives the build."""
    assert set(FIELDS) == set(BundleSpec.model_fields)


def written_back(bundle, mesh: str):
    """(the bundle ``build`` writes for ``mesh``, loaded as ``serve`` loads it, both plans)."""
    plan = make_plan(bundle, mesh)
    text = render_bundle_yaml(resolved_spec(bundle, plan), "test")
    back = specmod.loads(text, "bundle.yaml")
    return back, plan, make_plan(back, plan.mesh.name), text


def norm(specs: dict) -> dict:
    """PartitionSpecs with each multi-axis entry a tuple (a spec's YAML list and the family's
    tuple mean the same split)."""
    return {n: tuple(tuple(e) if isinstance(e, list) else e for e in sp) for n, sp in specs.items()}


def assert_round_trip(bundle, mesh: str) -> None:
    back, plan, plan2, text = written_back(bundle, mesh)
    s, t = bundle.spec, back.spec
    for f, rule in FIELDS.items():
        if rule == "same":
            assert getattr(t, f) == getattr(s, f), f"{f}: {getattr(s, f)!r} became {getattr(t, f)!r}"
    assert back.arch == bundle.arch
    assert back.buckets == bundle.buckets
    assert back.vision == bundle.vision, f"vision: {bundle.vision!r} became {back.vision!r}"
    assert back.embedding == bundle.embedding
    assert t.targets == [plan.mesh.name] and t.weights.source is None and t.from_hf is None
    assert (t.tokenizer is False) == (s.tokenizer is False)
    assert norm(plan2.specs) == norm(plan.specs)
    assert {x.name: x.dtype for x in plan2.tensors} == {x.name: x.dtype for x in plan.tensors}
    assert plan2.memory == plan.memory
    # and writing it again changes nothing (a fixed point)
    assert render_bundle_yaml(resolved_spec(back, plan2), "test") == text


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_bundle_survives_its_build(name):
    bundle = specmod.load(BUNDLES / name)
    for mesh in bundle.spec.targets:
        assert_round_trip(bundle, mesh)


#: the tiny Qwen3-VL with room for an image of the default max_pixels (256 soft tokens) in a chunk
_ROOMY_Q3VL = TINY_Q3VL.split("vision: {")[0].replace("prefill: [64, 128]", "prefill: [64, 512]").replace(
    "prefill_chunk: 128", "prefill_chunk: 512")
ISSUE_39 = _ROOMY_Q3VL + "vision: {images_per_prompt: 1, min_pixels: 1024}\n"


@pytest.mark.parametrize("text", [TINY_QVL, TINY_Q3VL, TINY_MISTRAL3, ISSUE_39,
                                  _ROOMY_Q3VL,
                                  TINY_MISTRAL3.split("vision: {")[0] + "vision: {images_per_prompt: 2}\n"],
                         ids=["qwen25-vl", "qwen3-vl", "mistral3", "only-min-pixels", "no-vision-key",
                              "mistral3-defaults"])
def test_tiny_vision_specs_survive_their_build(text):
    bundle = specmod.loads(text, "spec.yaml")
    assert_round_trip(bundle, "N150")


def test_a_built_package_holds_the_spec_it_was_validated_as(tmp_path):
    """The issue's spec (only ``images_per_prompt`` and ``min_pixels`` given) built for real: the
    package's bundle.yaml loads (as ``serve`` loads it) to the same image settings, its vision
    programs are the buckets those settings give, and its preprocessor_config.json carries them."""
    import json

    from ttbundle.package.load import load_package
    from ttbundle.serving.demo import build_package

    bundle = specmod.loads(ISSUE_39, "spec.yaml")
    pkg = build_package(ISSUE_39, tmp_path, "N150", warmup=False)
    back = load_package(pkg, verify=True).bundle
    assert back.vision == bundle.vision
    assert back.vision.min_pixels == 1024 and back.vision.max_pixels is not None
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["buckets"]["vision"] == bundle.vision.buckets
    pre = json.loads((pkg / "preprocessor_config.json").read_text())
    assert (pre["min_pixels"], pre["max_pixels"]) == (back.vision.min_pixels, back.vision.max_pixels)
