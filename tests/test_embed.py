"""``task: embed`` bundles (``ttbundle/embed.py``): ``init`` detects a sentence-transformers
checkpoint (``modules.json`` + ``1_Pooling/config.json``) or takes ``--task embed``; the spec
refuses what cannot work (a family without pooling, decode buckets, ``embedding:`` without the
task) at the key's line; the plan keeps prefill programs only and a KV pool of one prefill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ttbundle import lower, spec as specmod
from ttbundle.plan.make import make_plan
from ttbundle.cli import app
from ttbundle.errors import InvalidInput

DIMS = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)


def qwen3_dir(d: Path, pooling: str | None = "lasttoken", normalize: bool = True) -> Path:
    """A tiny Qwen3 config.json, and (``pooling``) sentence-transformers' module files as
    Qwen3-Embedding publishes them."""
    from transformers import Qwen3Config
    Qwen3Config(architectures=["Qwen3ForCausalLM"], head_dim=16, **DIMS).save_pretrained(d)
    if pooling is not None:
        mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            mods.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (d / "modules.json").write_text(json.dumps(mods))
        (d / "1_Pooling").mkdir()
        flags = {k: False for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                                    "pooling_mode_lasttoken")}
        flags[f"pooling_mode_{pooling}"] = True
        (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 128, **flags}))
    return d


@pytest.fixture
def runner():
    from ttbundle import cli
    for console in (cli.out, cli.err):
        console.width = 200
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def init(runner, *args):
    return runner.invoke(app, ["init", *map(str, args)])


@pytest.mark.parametrize("mode,normalize,want", [("lasttoken", True, "last"), ("mean_tokens", False, "mean"),
                                                 ("cls_token", True, "cls")])
def test_init_detects_a_sentence_transformers_checkpoint(tmp_path, runner, mode, normalize, want):
    hf = qwen3_dir(tmp_path / "model", mode, normalize)
    out = tmp_path / "spec.yaml"
    r = init(runner, "--from-hf", hf, "-o", out, "-m", "N150", "-m", "N300")
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(out.read_text())
    assert data["task"] == "embed"
    assert data["embedding"] == {"pooling": want, "normalize": normalize}
    assert data["buckets"]["decode"] == []
    assert "modules.json" in out.read_text()  # the comment says where it came from
    b = specmod.load(out)
    assert b.embedding.pooling == want and b.buckets.decode == []
    for mesh in ("N150", "N300"):
        p = make_plan(b, mesh)
        assert p.kv["max_tokens_all_users"] == b.spec.runtime.max_model_len  # one prefill's KV
        assert p.kv["pool_chosen"] == "embed"
    assert {ph for ph, _ in lower.trace_set(b)} == {"prefill"}


def test_init_task_option(tmp_path, runner):
    plain = qwen3_dir(tmp_path / "plain", pooling=None)
    out = tmp_path / "a.yaml"
    assert init(runner, "--from-hf", plain, "-o", out).exit_code == 0
    assert "task" not in yaml.safe_load(out.read_text())  # a language model: nothing added
    r = init(runner, "--from-hf", plain, "-o", out, "--task", "embed", "--force")
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(out.read_text())
    assert data["task"] == "embed" and data["embedding"] == {"pooling": "last", "normalize": True}
    st = qwen3_dir(tmp_path / "st")
    r = init(runner, "--from-hf", st, "-o", out, "--task", "generate", "--force")
    assert r.exit_code == 0, r.output
    assert "task" not in yaml.safe_load(out.read_text())
    r = init(runner, "--from-hf", st, "-o", out, "--task", "rerank", "--force")
    assert r.exit_code == 2 and "--task 'rerank': one of generate, embed" in r.output


def test_init_task_embed_refuses_a_family_without_pooling(tmp_path, runner):
    from transformers import LlamaConfig
    d = tmp_path / "llama"
    LlamaConfig(architectures=["LlamaForCausalLM"], **DIMS).save_pretrained(d)
    r = init(runner, "--from-hf", d, "-o", tmp_path / "s.yaml", "--task", "embed")
    assert r.exit_code == 2
    assert "--task embed: family llama has no pooling support" in r.output
    assert not (tmp_path / "s.yaml").exists()


def test_init_refuses_an_unsupported_pooling_mode(tmp_path, runner):
    hf = qwen3_dir(tmp_path / "model", "max_tokens")
    r = init(runner, "--from-hf", hf, "-o", tmp_path / "s.yaml")
    assert r.exit_code == 2 and "pooling_mode_max_tokens" in r.output


def spec(**over) -> str:
    d = {"name": "e", "model": dict(DIMS, family="qwen3", head_dim=16), "targets": ["N150"], "task": "embed",
         "runtime": {"max_model_len": 128, "max_num_seqs": 8}, "buckets": {"prefill": [32, 128]}}
    d.update(over)
    return yaml.safe_dump(d, sort_keys=False)


def errors(text: str) -> list:
    with pytest.raises(InvalidInput) as e:
        specmod.loads(text, "e.yaml")
    return e.value.diagnostics


def line_of(text: str, key: str) -> int:
    return next(i for i, l in enumerate(text.splitlines(), 1) if l.lstrip().startswith(key + ":"))


def test_spec_defaults_and_dump():
    b = specmod.loads(spec())
    assert b.embedding == specmod.Embedding(pooling="last", normalize=True)
    assert b.buckets.decode == []
    assert specmod.loads(spec(task="generate")).embedding is None


def test_decode_buckets_are_refused_at_their_line():
    text = spec(buckets={"prefill": [32, 128], "decode": [1, 8]})
    (d,) = errors(text)
    assert d.path == "buckets.decode" and d.line == line_of(text, "decode") and d.file == "e.yaml"
    assert "meaningless for `task: embed`" in d.message
    specmod.loads(spec(buckets={"prefill": [32, 128], "decode": []}))  # an empty list is fine


def test_a_family_without_pooling_is_refused():
    text = spec(model=dict(DIMS, family="llama"))
    (d,) = errors(text)
    assert d.path == "task" and d.line == line_of(text, "task")
    assert "family llama has no pooling support" in d.message


def test_embedding_without_task_embed_and_bad_pooling():
    text = spec(task="generate", embedding={"pooling": "last"}, buckets={"prefill": [32, 128], "decode": [8]})
    (d,) = errors(text)
    assert d.path == "embedding" and "applies to `task: embed` only" in d.message
    (d,) = errors(spec(embedding={"pooling": "max"}))
    assert d.path == "embedding.pooling" and "'max'" in d.message


def test_serve_arguments_and_pooler_config():
    from ttbundle.embed import serve_args
    from ttbundle.runtime.pooling import pool
    import torch

    b = specmod.loads(spec(embedding={"pooling": "mean", "normalize": False}))
    args = serve_args(b, [])
    assert args[:2] == ["--runner", "pooling"]
    assert json.loads(args[3]) == {"seq_pooling_type": "MEAN", "use_activation": False}
    assert serve_args(b, ["--runner", "pooling", "--pooler-config", "{}"]) == []
    assert serve_args(specmod.loads(spec(task="generate", buckets={"prefill": [32, 128], "decode": [8]})), []) == []
    rows = torch.arange(6.0).reshape(3, 2)
    assert pool(rows, "last").tolist() == [4.0, 5.0]
    assert pool(rows, "cls").tolist() == [0.0, 1.0]
    assert pool(rows, "mean").tolist() == [2.0, 3.0]
