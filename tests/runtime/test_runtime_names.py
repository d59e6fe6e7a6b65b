"""Name resolution: a registered package served by its bundle name or the HF model id it was
made from, through vLLM's own argument handling (``EngineArgs`` / ``LLM``, HF_HUB_OFFLINE=1 as
the runtime conftest sets), ``ttbundle serve NAME``, and an unknown name listing what is
registered."""

from __future__ import annotations

import os
import shutil

import pytest

from runtime_helpers import hf_greedy, hf_id
from ttbundle.runtime import registry


@pytest.fixture
def repo(tmp_path, make_package, xdg):
    """A registered directory OUT/<mesh>/<bundle> with tiny-llama for N150 and T3K, and
    tiny-qwen3 for N150 in EXTRA_MODELS_DIR."""
    out = tmp_path / "out"
    for fam, mesh in (("llama", "N150"), ("llama", "T3K")):
        pkg, _ = make_package(fam, mesh)
        shutil.copytree(pkg, out / mesh / pkg.name)
    extra = tmp_path / "extra"
    pkg, _ = make_package("qwen3", "N150")
    shutil.copytree(pkg, extra / pkg.name)
    registry.register_dir(out)
    os.environ["EXTRA_MODELS_DIR"] = str(extra)  # xdg's monkeypatch restores it
    return out, extra


def test_find_by_hf_id_and_mesh(repo, monkeypatch):
    out, extra = repo
    assert registry.find(hf_id("llama"), "N150").path == out / "N150" / "tiny-llama"
    assert registry.find(hf_id("qwen3")).path == extra / "tiny-qwen3"  # EXTRA_MODELS_DIR
    with pytest.raises(Exception, match="names 2 packages"):
        registry.find(hf_id("llama"))
    monkeypatch.setenv("MESH_DEVICE", "(1,8)")
    assert registry.find(hf_id("llama")).mesh == "T3K"


def test_unknown_name_lists_what_is_registered(repo):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception) as e:
        EngineArgs(model="someone/Unknown-7B", dtype="float32").create_engine_config()
    msg = str(e.value)
    assert "'someone/Unknown-7B' is not a package directory and no registered package named" in msg
    for known in ("tiny-llama-N150 (test-org/Tiny-Llama)", "tiny-llama-T3K (test-org/Tiny-Llama)",
                  "tiny-qwen3-N150 (test-org/Tiny-Qwen3)"):
        assert known in msg, msg


@pytest.mark.parametrize("name, mesh, want", [
    ("tiny-llama", "N150", "N150/tiny-llama"),
    ("tiny-llama-T3K", None, "T3K/tiny-llama"),
    (hf_id("llama"), "(1,8)", "T3K/tiny-llama"),
    (hf_id("qwen3"), None, "tiny-qwen3"),
])
def test_vllm_engine_args_resolve_names_before_the_hub(repo, monkeypatch, name, mesh, want):
    """vLLM's own config path: the model becomes the package directory, the served model name
    stays the name given, the platform validated the package (TT<arch>, its worker)."""
    from vllm.engine.arg_utils import EngineArgs

    if mesh:
        monkeypatch.setenv("MESH_DEVICE", mesh)
    cfg = EngineArgs(model=name, dtype="float32").create_engine_config()
    root = repo[0] if "llama" in want else repo[1]
    assert cfg.model_config.model == str(root / want)
    assert cfg.model_config.served_model_name == name
    assert cfg.parallel_config.worker_cls == "ttbundle.runtime.worker.TTWorker"


def test_ls_shows_the_hf_ids(repo, runner):
    import json

    from ttbundle.cli import app
    r = runner.invoke(app, ["ls", "--json"])
    assert r.exit_code == 0, r.output
    got = {(p["name"], p["mesh"]): p["hf_model"] for p in json.loads(r.output)["packages"]}
    assert got == {("tiny-llama", "N150"): hf_id("llama"), ("tiny-llama", "T3K"): hf_id("llama"),
                   ("tiny-qwen3", "N150"): hf_id("qwen3")}


def test_ttbundle_serve_resolves_hf_ids(repo):
    from ttbundle.serving import serve

    out, extra = repo
    assert serve.resolve(hf_id("llama"), "T3K") == out / "T3K" / "tiny-llama"
    plan = serve.plan_serve(serve.resolve(hf_id("qwen3")))
    assert plan.package == extra / "tiny-qwen3" and plan.name == "tiny-qwen3"


@pytest.mark.slow
def test_llm_by_hf_id_generates_the_transformers_tokens(repo, make_package, monkeypatch):
    """``LLM(model=<HF id>)`` under HF_HUB_OFFLINE=1 serves the registered package: greedy tokens
    equal transformers' on the checkpoint it was built from."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    _, src = make_package("qwen3", "N150")
    # with Tenstorrent's always_compat_sampling: every batch samples on the host
    llm = LLM(model=hf_id("qwen3"), dtype="float32", seed=0, additional_config={"tt": {"always_compat_sampling": True}})
    try:
        assert llm.llm_engine.model_config.served_model_name == hf_id("qwen3")
        prompt = [11, 200, 37, 5, 99, 140, 8]
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == hf_greedy(src, prompt, 8)
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        assert {s.sampling for s in runner.step_log} == {"host"}
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_vllm_serve_by_bundle_name(repo, monkeypatch, tmp_path):
    """``vllm serve tiny-llama`` (HF_HUB_OFFLINE=1, MESH_DEVICE=T3K picks the mesh) serves the
    registered package, under the name given; the openai client lists and queries it."""
    import socket

    import openai

    from ttbundle.serving.serve import plan_serve, start, stop, wait_healthy

    out, _ = repo
    monkeypatch.setenv("MESH_DEVICE", "T3K")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = plan_serve(out / "T3K" / "tiny-llama", "127.0.0.1", port)
    argv = list(plan.argv)
    argv[argv.index(str(plan.package))] = "tiny-llama"  # the bare name, as a user types it
    i = argv.index("--served-model-name")
    del argv[i:i + 2]
    plan.argv, plan.env["MESH_DEVICE"] = argv, "T3K"
    log = tmp_path / "vllm.log"
    with open(log, "wb") as f:
        proc = start(plan, log=f)
    try:
        wait_healthy(proc, plan.host, plan.port, timeout=600)
        c = openai.OpenAI(base_url=plan.url, api_key="none", timeout=300, max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny-llama"]
        r = c.completions.create(model="tiny-llama", prompt=[5, 17, 99], max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        assert "serving tiny-llama-T3K" in log.read_text()
    finally:
        stop(proc)
