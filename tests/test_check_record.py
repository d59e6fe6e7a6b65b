"""Check records (docs/check.md, "Records"): `check PACKAGE` keeps its verdict in the package
without changing a hash, `ls` shows it, `serve --require-checked` refuses a package without a
passing record for its mesh and current manifest."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from pkg_mutations import edit_tensor
from test_emulated import tiny

from ttbundle import reference
from ttbundle.build import build
from ttbundle.check import record
from ttbundle.package.verify import verify_package


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("rec")
    b = tiny("llama")
    ckpt = reference.save_random(b, root / "ckpt", seed=3)
    w = b.spec.weights.model_copy(update={"source": str(ckpt)})
    b = dataclasses.replace(b, spec=b.spec.model_copy(update={"weights": w, "tokenizer": False}))
    return build(b, "N300", root / "out", warmup=False).package


def test_a_record_is_kept_shown_and_required(pkg, tmp_path, runner, xdg, monkeypatch):
    from ttbundle.serving import serve as servemod
    monkeypatch.setattr(servemod, "start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("vLLM started")))
    good = tmp_path / "packages" / "N300" / "tiny-llama"
    shutil.copytree(pkg, good)
    before = json.loads((good / "manifest.json").read_text())

    from ttbundle.cli import app
    # no record yet: --require-checked refuses (exit 1) and says what to run
    r = runner.invoke(app, ["serve", str(good), "--require-checked", "--print-command", "--device", "emulated"])
    assert r.exit_code == 1 and "no passing check record for N300" in r.output and "ttbundle check" in r.output

    r = runner.invoke(app, ["check", str(good), "--steps", "2", "--prompt-len", "40"])
    assert r.exit_code == 0, r.output
    rec_file = good / "checks" / "fp32.json"
    rec = json.loads(rec_file.read_text())
    # bound to this manifest, support.json's field names, both verdicts' figures
    assert rec["manifest_sha256"] == record.manifest_digest(good) and rec["passed"] is True
    assert rec["hardware"] == [{"sku": "N300", "mesh": [1, 2], "tp": 2, "dp": 1}]
    assert set(rec["validation"]) == {"date", "git_sha", "evidence"}
    assert rec["validation"]["evidence"]["executor"]["passed"] is True
    assert len(rec["model"]["checkpoint"]["content_key"]) == 64
    # no hash changed: the package verifies as it did, and its manifest is the same bytes
    verify_package(good, full=True)
    assert json.loads((good / "manifest.json").read_text()) == before

    r = runner.invoke(app, ["serve", str(good), "--require-checked", "--print-command", "--device", "emulated"])
    assert r.exit_code == 0, r.output
    assert "check record: passed" in r.output

    r = runner.invoke(app, ["register", "--dir", str(tmp_path / "packages" / "N300")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["ls", "--json"])
    listed = json.loads(r.stdout)["packages"]
    assert [p["checks"][0]["passed"] for p in listed] == [True]
    r = runner.invoke(app, ["ls"])
    assert "passed (fp32" in r.output

    # anything but .json records in checks/ is refused like any unlisted file
    (good / "checks" / "x.py").write_text("print(1)\n")
    with pytest.raises(Exception, match="json files only"):
        verify_package(good, full=True)
    (good / "checks" / "x.py").unlink()


def test_a_failed_or_stale_record_does_not_count(pkg, tmp_path, runner, xdg, monkeypatch):
    from ttbundle.cli import app
    from ttbundle.serving import serve as servemod
    monkeypatch.setattr(servemod, "start", lambda *a, **k: (_ for _ in ()).throw(AssertionError("vLLM started")))
    bad = tmp_path / "bad"
    shutil.copytree(pkg, bad)
    assert edit_tensor(bad, "wo.1", lambda t, d: torch.zeros_like(t))
    r = runner.invoke(app, ["check", str(bad), "--steps", "2", "--prompt-len", "40"])
    assert r.exit_code == 1 and "executor: layer 1 at prefill" in r.output
    assert json.loads((bad / "checks" / "fp32.json").read_text())["passed"] is False
    r = runner.invoke(app, ["serve", str(bad), "--require-checked", "--print-command", "--device", "emulated"])
    assert r.exit_code == 1 and "latest check for N300 failed: executor: layer 1" in r.output

    # a passing record of an earlier manifest (the package rebuilt since) does not count
    good = tmp_path / "good"
    shutil.copytree(pkg, good)
    r = runner.invoke(app, ["check", str(good), "--steps", "2", "--prompt-len", "40"])
    assert r.exit_code == 0, r.output
    m = json.loads((good / "manifest.json").read_text())
    m["created"] = "rebuilt"
    (good / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    assert record.records(good) == [] and record.passing(good, "N300") is None
