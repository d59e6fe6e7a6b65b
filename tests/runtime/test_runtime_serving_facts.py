"""The serving facts go spec -> lower -> package -> runtime (issue 40): a bucket size and
``num_speculative_tokens`` reach vLLM's engine from the package's manifest and programs, never from
bundle.yaml after lowering; a package that disagrees with its spec is refused by the checks
(``package.speccheck.load_checked``), and one built before the facts were recorded is refused
with a rebuild hint."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import yaml

from runtime_helpers import greedy, run_engine, spec_text

K = 2  # not the tests' usual 3: the engine must get it from the package
DECODE = [2, 8]  # not the tests' usual buckets
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PATTERN = [10, 11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def facts_package(packages_dir):
    from ttbundle.serving.demo import build_package

    d = yaml.safe_load(spec_text("llama"))
    d["name"] = "tiny-llama-facts"
    d["buckets"]["decode"] = list(DECODE)
    d["runtime"]["max_num_seqs"] = max(DECODE)
    d["speculative"] = dict(NGRAM)
    return build_package(yaml.safe_dump(d, sort_keys=False), packages_dir, "N150")


class _Guard:
    """``obj`` with the attributes in ``banned`` refused (recorded in ``reads``, then raised)."""

    def __init__(self, obj, banned: dict, reads: list, where: str):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_banned", banned)
        object.__setattr__(self, "_reads", reads)
        object.__setattr__(self, "_where", where)

    def __getattr__(self, name):
        banned = object.__getattribute__(self, "_banned")
        where = object.__getattribute__(self, "_where")
        reads = object.__getattribute__(self, "_reads")
        obj = object.__getattribute__(self, "_obj")
        if name in banned:
            if banned[name] is None:
                reads.append(f"{where}.{name}")
                raise AssertionError(f"{where}.{name} read after lowering")
            return _Guard(getattr(obj, name), banned[name], reads, f"{where}.{name}")
        return getattr(obj, name)


def _guarded(bundle, reads: list):
    """The bundle with its serving facts (``buckets``, ``spec.runtime``, ``spec.speculative``)
    refused: the runtime must read them from the package."""
    return _Guard(bundle, {"buckets": None, "spec": {"runtime": None, "speculative": None}}, reads, "bundle")


def test_bucket_and_k_reach_the_engine_from_the_package_not_the_spec(facts_package, monkeypatch):
    """vLLM's engine on the package with every spec read of a serving fact refused once the
    package is open: the verify steps run K + 1 rows per sequence in the package's decode
    buckets (on today's main the runtime re-read both from bundle.yaml and this fails)."""
    from ttbundle import speculative
    from ttbundle.runtime import packages

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    reads: list[str] = []
    real = packages.open_package

    def open_guarded(*a, **k):
        pkg = real(*a, **k)
        pkg.loaded.bundle = _guarded(pkg.loaded.bundle, reads)
        return dataclasses.replace(pkg, bundle=_guarded(pkg.bundle, reads))

    def refused(*a, **k):
        reads.append("speculative spec reader")
        raise AssertionError("a speculative spec reader called after lowering")

    monkeypatch.setattr(packages, "open_package", open_guarded)
    for name in ("rows_per_seq", "vllm_config", "verify_buckets", "draft_kv_blocks"):
        monkeypatch.setattr(speculative, name, refused)

    # the KV pool as `ttbundle serve` passes it: the package's own blocks (on the emulated mesh
    # without an override the worker sizes the pool for this host with ``Package.host_plan``,
    # which plans the package from its spec: the one runtime path that still does, docs/runtime.md)
    from ttbundle.package.load import load_package
    blocks = int(load_package(facts_package).kv_cache["num_blocks"])
    prompts = [{"prompt_token_ids": PATTERN * 6}, {"prompt_token_ids": [(7 * i + 3) % 500 + 8 for i in range(40)]}]
    outs, metrics, steps, runner = run_engine(facts_package, dict(NGRAM), [(prompts, greedy(24))],
                                              num_gpu_blocks_override=blocks)
    assert reads == []
    assert all(len(o) == 24 for o in outs[0])
    verify = [s for s in steps if s.phase == "verify"]
    assert verify, "no verify step ran"
    assert {b for s in verify for b in s.buckets} <= set(DECODE)
    assert all(1 <= n <= K + 1 for s in verify for _, _, n in s.rows)
    assert any(n == K + 1 for s in verify for _, _, n in s.rows)  # a whole proposal verified
    assert runner.decode_buckets == DECODE and runner.package.serving.rows_per_seq == K + 1


def test_the_package_records_what_the_spec_says(facts_package):
    """The manifest's serving record and the verify programs' rows per sequence are the spec's
    (read independently from the spec file the build kept)."""
    from ttbundle.package.speccheck import load_checked

    spec = yaml.safe_load((facts_package / "bundle.yaml").read_text())
    m = json.loads((facts_package / "manifest.json").read_text())
    s = m["serving"]
    assert s["rows_per_seq"] == spec["speculative"]["num_speculative_tokens"] + 1 == K + 1
    assert s["speculative"]["num_speculative_tokens"] == K and s["speculative"]["method"] == "ngram"
    assert s["max_num_seqs"] == spec["runtime"]["max_num_seqs"] == max(DECODE)
    assert m["buckets"]["decode"] == spec["buckets"]["decode"] == DECODE
    assert m["buckets"]["verify"] == DECODE
    for b in DECODE:
        prog = json.loads((facts_package / "programs" / f"verify-{b}.json").read_text())
        assert prog["rows_per_seq"] == K + 1
    loaded = load_checked(facts_package)
    assert loaded.serving.rows_per_seq == K + 1 and loaded.buckets.decode == DECODE


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    p = dst / "manifest.json"
    m = json.loads(p.read_text())
    edit(m)
    p.write_text(json.dumps(m, indent=1))
    return dst


def test_a_package_built_before_the_serving_record_is_refused_with_a_rebuild_hint(facts_package, tmp_path):
    from ttbundle.package.load import load_package
    from ttbundle.package.names import PackageError

    old = _edited(facts_package, tmp_path / "old", lambda m: m.pop("serving"))
    with pytest.raises(PackageError, match=r"manifest.json has no serving record .*rebuild the package"):
        load_package(old)


def test_a_manifest_that_disagrees_with_its_spec_is_refused_by_the_checks(facts_package, tmp_path):
    """The check that ran at every load now runs in the build, ``check`` and ``cache verify``
    (``speccheck.load_checked``); serving trusts the package (the serving record is what runs)."""
    from ttbundle.package.load import load_package
    from ttbundle.package.names import PackageError
    from ttbundle.package.speccheck import load_checked

    def edit(m):
        m["serving"]["rows_per_seq"] = K + 2
        m["serving"]["speculative"]["num_speculative_tokens"] = K + 1

    bad = _edited(facts_package, tmp_path / "bad", edit)
    with pytest.raises(PackageError, match=r"serving facts disagree with bundle.yaml: rows_per_seq 4 "
                                           r"\(bundle.yaml: 3\); speculative .*rebuild the package from its spec"):
        load_checked(bad)
    assert load_package(bad).serving.rows_per_seq == K + 2  # serving reads the record, as built
