"""`check`'s quality verdict (docs/check.md): the package against the original checkpoint,
teacher-forced on natural text, against the spec's targets per storage; reported apart from
the executor verdict. The demo model (trained on the King James Bible, with its tokenizer) is
the real model here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from ttbundle import spec as specmod
from ttbundle.check import run_check
from ttbundle.check.quality import measure

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "bundles" / "demo.yaml"


def test_the_figures_match_an_independent_computation():
    g = torch.Generator().manual_seed(0)
    orig = torch.randn(50, 300, generator=g) * 3
    pkg = orig + 0.3 * torch.randn(50, 300, generator=g)
    nxt = torch.randint(0, 300, (50,), generator=g).tolist()
    nxt[-1] = -1  # the last position has no next token
    f = measure(orig, pkg, nxt)
    lo, lp = orig.double().log_softmax(-1), pkg.double().log_softmax(-1)
    kl = torch.nn.functional.kl_div(lp, lo, log_target=True, reduction="none").sum(-1)  # KL(orig || pkg)
    assert f["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-9)
    assert f["kl_p99"] == pytest.approx(float(kl.double().quantile(0.99)), rel=1e-9)
    assert f["top1"] == pytest.approx(float((orig.argmax(-1) == pkg.argmax(-1)).double().mean()))
    ce = torch.nn.functional.cross_entropy
    assert f["ppl_original"] == pytest.approx(float(ce(orig[:-1].double(), torch.tensor(nxt[:-1])).exp()), rel=1e-9)
    assert f["ppl_package"] == pytest.approx(float(ce(pkg[:-1].double(), torch.tensor(nxt[:-1])).exp()), rel=1e-9)
    same = measure(orig, orig.clone(), nxt)
    assert same["top1"] == same["top5"] == 1.0 and same["kl_mean"] == 0.0


def _demo(dtypes: dict, kv: str = "bf16", quality: dict | None = None):
    b = specmod.load(DEMO)
    s = b.spec
    w = s.weights.model_copy(update={"dtypes": specmod.DtypePolicy(**dtypes)})
    upd = {"weights": w, "runtime": s.runtime.model_copy(update={"kv_cache_dtype": kv})}
    if quality is not None:
        upd["quality"] = specmod.Quality.model_validate(quality)
    return dataclasses.replace(b, spec=s.model_copy(update=upd))


def test_a_bfp8_demo_package_reports_its_quality_on_natural_text():
    r = run_check(_demo({"default": "bfp8"}, "bfp8"), "N150", steps=4, prompt_len=128)
    q = r.quality
    assert r.executor.passed, r.executor.failure(r.step_of)
    assert q.judged and q.natural_text and "quality.txt" in q.text and q.storage == "bfp8"
    assert q.targets == specmod.DEFAULT_QUALITY["bfp8"] and q.passed, q.misses()
    # quantized: measurably not the original's distributions, but close
    assert 0 < q.kl_mean < 0.03 and q.top1 >= 0.9 and q.positions == 128 + 3
    # the text's own next tokens: the continuation is the text after the prompt, not a repeat
    assert r.continuation != r.continuation[:0] and len(r.continuation) == 3


def test_a_missed_quality_target_is_exit_1_apart_from_the_executor(tmp_path, runner):
    from ttbundle.cli import app
    b = _demo({"default": "bfp8", "mlp": "bfp4"}, "bfp8", {"bfp4": {"top1": 0.999, "kl_mean": 1e-6}})
    spec = tmp_path / "demo-q.yaml"
    d = b.spec.model_dump(mode="json", exclude_none=True)
    d["weights"]["source"] = str(ROOT / "bundles" / "demo")
    d["tokenizer"] = str(ROOT / "bundles" / "demo")
    spec.write_text(yaml.safe_dump(d))
    r = runner.invoke(app, ["check", str(spec), "--mesh", "N150", "--steps", "4", "--prompt-len", "128", "--json"])
    assert r.exit_code == 1, r.output
    rep = json.loads(r.stdout)
    assert rep["executor"]["passed"] is True and rep["quality"]["passed"] is False
    assert rep["quality"]["storage"] == "bfp4" and rep["quality"]["targets"] == {"top1": 0.999, "kl_mean": 1e-6}
    assert rep["failure"].startswith("quality (bfp4 storage") and "top1" in rep["failure"] and "kl_mean" in rep["failure"]
    # a text of the user's own
    text = tmp_path / "t.txt"
    text.write_text("And God said, Let there be light: and there was light. " * 40)
    r = runner.invoke(app, ["check", str(spec), "--mesh", "N150", "--steps", "4", "--prompt-len", "64",
                            "--text", str(text), "--json"])
    rep = json.loads(r.stdout)
    assert rep["quality"]["text"] == "--text" and rep["prompt_len"] == 64
    r = runner.invoke(app, ["check", str(spec), "--mesh", "N150", "--text", str(tmp_path / "none.txt")])
    assert r.exit_code == 2 and "none.txt" in r.output
