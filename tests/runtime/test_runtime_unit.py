"""Runtime pieces without an engine: activation, plugin options, device sampling, the vLLM
command line `ttbundle serve` derives from a package."""

from __future__ import annotations

import json

import pytest
import torch

from ttbundle.errors import InvalidInput
from ttbundle.runtime import activation
from ttbundle.runtime.options import parse
from ttbundle.runtime.phases import is_decode, pick
from ttbundle.runtime.sampling import DeviceSampling, host_reasons, sample_on_device


# ---- activation -----------------------------------------------------------------------------------
def test_platform_activates_only_when_asked(monkeypatch):
    from vllm.platforms import resolve_current_platform_cls_qualname

    monkeypatch.delenv(activation.ENV_EMULATED, raising=False)
    assert activation.platform_plugin() is None
    assert resolve_current_platform_cls_qualname() != activation.EMULATED  # vLLM never sees us
    activation.general_plugin()  # inactive: registers nothing, raises nothing

    monkeypatch.setenv(activation.ENV_EMULATED, "1")
    assert activation.platform_plugin() == activation.EMULATED
    assert resolve_current_platform_cls_qualname() == activation.EMULATED
    monkeypatch.setenv(activation.ENV_EMULATED, "0")
    assert activation.platform_plugin() is None


def test_tt_platform_needs_a_device_node(monkeypatch):
    monkeypatch.delenv(activation.ENV_EMULATED, raising=False)
    # no /dev/tenstorrent on this machine: ttnn being importable or not, the TT path stays off
    assert activation.tt_hardware_present() is False


# ---- options ---------------------------------------------------------------------------------------
def test_tt_options_use_tenstorrent_names():
    o = parse({"tt": {"trace_mode": "decode_only", "sample_on_device_mode": "decode_only",
                      "trace_region_size": 50_000_000, "enable_model_warmup": False,
                      "fabric_config": "FABRIC_1D_RING", "dispatch_core_axis": "col",
                      "worker_l1_size": 1344544, "l1_small_size": 79104,
                      "fabric_reliability_mode": "RELAXED_INIT"}, "gdn_prefill_backend": "x"})
    assert (o.fabric_config, o.fabric_reliability_mode) == ("FABRIC_1D_RING", "RELAXED_INIT")
    assert (o.trace_mode, o.sample_on_device_mode, o.trace_region_size, o.enable_model_warmup) == \
        ("decode_only", "decode_only", 50_000_000, False)
    assert parse(None).trace_mode == "all" and parse({}).enable_model_warmup is True


@pytest.mark.parametrize("cfg, needle", [
    ({"tt": {"trace_mod": "all"}}, "tt.trace_mod: unknown option; did you mean `trace_mode`?"),
    ({"tt": {"bogus": 1}}, "tt.bogus: unknown option; valid keys: trace_mode"),
    ({"tt": {"trace_mode": "sometimes"}}, "tt.trace_mode: Input should be 'all', 'decode_only' or 'none'"),
    ({"tt": {"trace_region_size": -5}}, "tt.trace_region_size: Input should be greater than 0"),
    ({"tt": ["all"]}, '"tt" must be a JSON object'),
    # an invalid fabric name fails here with the choices, not later inside ttnn.set_fabric_config
    ({"tt": {"fabric_config": "FABRIC_3D"}}, "tt.fabric_config: Input should be 'DISABLED', 'FABRIC_1D'"),
    ({"tt": {"fabric_reliability_mode": "LOOSE"}},
     "tt.fabric_reliability_mode: Input should be 'STRICT_INIT', 'RELAXED_INIT' or 'DYNAMIC_RECONFIG'"),
])
def test_tt_options_refuse_unknown_and_invalid(cfg, needle):
    with pytest.raises(InvalidInput) as e:
        parse(cfg)
    assert needle in str(e.value)


@pytest.mark.parametrize("mesh, tt, want", [
    ("T3K", {"fabric_config": "FABRIC_1D_RING", "fabric_reliability_mode": "RELAXED_INIT"},
     ["ttnn.FabricConfig.FABRIC_1D_RING", "ttnn.FabricReliabilityMode.RELAXED_INIT"]),
    ("T3K", {}, ["ttnn.FabricConfig.FABRIC_1D"]),  # multi-chip default, as Tenstorrent's plugin
    ("N150", {}, None),  # one chip: no fabric
])
def test_open_mesh_passes_the_fabric_options_to_ttnn(mesh, tt, want):
    """On the recording double: the fabric options reach ``ttnn.set_fabric_config`` as its
    FabricConfig and FabricReliabilityMode members, before the mesh opens."""
    from types import SimpleNamespace

    from ttbundle import mesh as meshmod
    from ttbundle.backends.ttnn.recording import Recorder
    from ttbundle.runtime.ttdevice import open_mesh
    rec = Recorder()
    pkg = SimpleNamespace(loaded=SimpleNamespace(mesh=meshmod.resolve(mesh)), trace_region_size=1 << 20)
    open_mesh(rec.module(), pkg, parse({"tt": tt}))
    calls = [e.fn for e in rec.events]
    fabric = [e for e in rec.events if e.fn == "set_fabric_config"]
    if want is None:
        assert not fabric
    else:
        assert [repr(a) for a in fabric[0].args] == want
        assert calls.index("set_fabric_config") < calls.index("open_mesh_device")


# ---- phases and buckets --------------------------------------------------------------------------
def test_phase_and_bucket_rules():
    assert is_decode(10, 10, 11) and not is_decode(9, 10, 11) and not is_decode(0, 10, 10)
    assert is_decode(128, 100, 129)  # a resumed request's last recompute token is a decode
    assert [pick([32, 64, 128], n) for n in (1, 32, 33, 128)] == [32, 32, 64, 128]
    with pytest.raises(ValueError):
        pick([1, 8], 9)


# ---- device sampling ------------------------------------------------------------------------------
def _params(**kw):
    from vllm import SamplingParams
    return SamplingParams(**kw)


def test_device_sampling_greedy_topk1_tiny_topp_are_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    rows = [_params(temperature=0), _params(temperature=1.0, top_k=1), _params(temperature=0.7, top_p=1e-6)]
    s = DeviceSampling.from_params(rows, [None] * 3, 6)
    ids = sample_on_device(logits, s)
    assert ids.tolist() == logits.argmax(-1).tolist()  # padding rows are greedy too


def test_device_sampling_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))

    def run(row, batch):
        gens = [torch.Generator().manual_seed(7) if i == row else None for i in range(batch)]
        params = [_params(temperature=0.9, seed=7 if i == row else None, top_k=20, top_p=0.9)
                  for i in range(batch)]
        x = torch.cat([logits[1:2]] * batch) if batch > 1 else logits[1:2]
        return [int(sample_on_device(x, DeviceSampling.from_params(params, gens, batch))[row])
                for _ in range(1)] + [int(sample_on_device(x, DeviceSampling.from_params(params, gens, batch))[row])]

    assert run(0, 1) == run(2, 4) == run(3, 4)


def test_device_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = DeviceSampling.from_params([_params(temperature=1.0)], [torch.Generator().manual_seed(3)], 1)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[int(sample_on_device(logits, s)[0])] += 1
    assert torch.allclose(counts / 4000, logits.softmax(-1)[0], atol=0.03)
    s = DeviceSampling.from_params([_params(temperature=1.0, top_k=2)], [torch.Generator().manual_seed(3)], 1)
    seen = {int(sample_on_device(logits, s)[0]) for _ in range(300)}
    assert seen == {0, 1}


@pytest.mark.parametrize("kw, reason", [
    ({}, None), ({"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 1}, None),
    ({"logprobs": 2}, "logprobs"), ({"min_p": 0.1}, "min_p"), ({"logit_bias": {3: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"), ({"min_tokens": 3}, "min_tokens"),
    ({"presence_penalty": 0.5}, "penalties"), ({"repetition_penalty": 1.2}, "penalties"),
])
def test_host_fallback_reasons(kw, reason):
    r = host_reasons(_params(**kw))
    assert (r == []) if reason is None else (reason in r)


def test_structured_output_needs_the_host():
    from vllm.sampling_params import StructuredOutputsParams
    assert "structured_outputs" in host_reasons(_params(structured_outputs=StructuredOutputsParams(choice=["a"])))


# ---- `ttbundle serve` arguments ------------------------------------------------------------------
def test_serve_derives_vllm_arguments_from_the_package(make_package):
    from ttbundle.serving.serve import plan_serve

    pkg, _ = make_package("llama", "T3K")
    p = plan_serve(pkg, "127.0.0.1", 18123, ["--seed", "3", "--additional-config",
                                              '{"tt": {"trace_mode": "decode_only"}}'])
    a = p.argv
    arg = lambda k: a[a.index(k) + 1]  # noqa: E731
    assert a[a.index("serve") + 1] == str(pkg)
    assert (arg("--max-model-len"), arg("--max-num-seqs"), arg("--block-size"), arg("--dtype")) == \
        ("256", "32", "32", "float32")
    assert arg("--served-model-name") == "tiny-llama" and arg("--port") == "18123"
    assert a.count("--additional-config") == 1 and a[-2:] == ["--seed", "3"]
    tt = json.loads(arg("--additional-config"))["tt"]
    assert tt["trace_mode"] == "decode_only"  # the user's value wins
    assert tt["sample_on_device_mode"] == "all" and tt["trace_region_size"] > 0
    assert p.env["TTBUNDLE_EMULATED"] == "1" and p.env["MESH_DEVICE"] == "T3K"


@pytest.mark.parametrize("extra", [["-tp", "2"], ["--tensor-parallel-size=8"], ["-pp", "2"]])
def test_serve_refuses_parallelism_flags(make_package, extra):
    from ttbundle.serving.serve import plan_serve

    pkg, _ = make_package("llama", "N150")
    with pytest.raises(InvalidInput, match="the mesh replaces tensor/pipeline parallelism"):
        plan_serve(pkg, extra=extra)


@pytest.mark.parametrize("extra, needle, listed", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser NAME", False),
    (["--enable-auto-tool-choice", "--tool-call-parser", "herms"],
     "--tool-call-parser herms: vLLM has no such parser; did you mean hermes?", True),
    (["--reasoning_parser=qwen"], "--reasoning-parser qwen: vLLM has no such parser; did you mean qwen3", True),
])
def test_serve_refuses_unknown_parsers(make_package, extra, needle, listed):
    """Refused before vLLM starts (vLLM's API server would refuse them after its start-up)."""
    from ttbundle.serving.serve import plan_serve

    pkg, _ = make_package("llama", "N150")
    with pytest.raises(InvalidInput) as e:
        plan_serve(pkg, extra=extra)
    assert str(e.value).startswith(needle)
    assert ("(vLLM's: " in str(e.value)) == listed  # an unknown name: every valid one listed


def test_serve_passes_tool_and_reasoning_parsers_through(make_package):
    from ttbundle.serving.serve import plan_serve

    pkg, _ = make_package("llama", "N150")
    for extra in (["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"],
                  ["--tool-call-parser=mine", "--tool-parser-plugin", "my_parsers.py"],  # the plugin may register it
                  ["--reasoning-parser", "none"]):
        assert plan_serve(pkg, extra=extra).argv[-len(extra):] == extra


def test_parser_names_are_what_vllm_registers():
    """serve reads the names from vLLM's source (no import): the same lists vLLM's managers give."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    from ttbundle.serving.serve import vllm_parser_names

    assert vllm_parser_names("--tool-call-parser") == sorted(ToolParserManager.list_registered())
    assert vllm_parser_names("--reasoning-parser") == sorted(ReasoningParserManager.list_registered())


def test_serve_builds_the_target_a_mesh_shape_names(tmp_path, monkeypatch):
    """`MESH_DEVICE="(1,8)" ttbundle serve SPEC` builds the spec's T3K target, not a "(1,8)" one;
    a shape no target has is refused, naming the targets."""
    import pytest

    from ttbundle import spec as specmod
    from ttbundle.errors import InvalidInput
    from ttbundle.serving import demo, serve
    from runtime_helpers import spec_text

    src = demo.make_source(specmod.loads(spec_text("llama"), "s.yaml"), tmp_path / "src")
    text = demo.spec_with_source(spec_text("llama"), src)
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    monkeypatch.setenv("MESH_DEVICE", "(1,8)")
    pkg = serve.resolve(str(spec), output=tmp_path / "out")
    assert pkg.parent.name == "T3K"
    monkeypatch.setenv("MESH_DEVICE", "(2,4)")
    with pytest.raises(InvalidInput, match=r"mesh \(2,4\) is not one of its targets \(N150, T3K\)"):
        serve.resolve(str(spec), output=tmp_path / "out")


# ---- Tenstorrent's remaining option and environment names (issue 14) -----------------------------
def test_tt_options_multi_host_and_compat_keys():
    """Accepted with Tenstorrent's names: always_compat_sampling moves every batch to the host;
    register_test_models and the multi-host keys are accepted and reported as having no effect."""
    o = parse({"tt": {"always_compat_sampling": True, "register_test_models": True,
                      "rank_binding": "rb.yaml", "mpi_args": "--np 2", "extra_ttrun_args": "-v",
                      "config_pkl_dir": "/tmp/x", "env_passthrough": ["HF_TOKEN", "TT_CACHE_PATH"],
                      "sample_on_device_mode": "all"}})
    assert o.sample_mode("all") == "off"
    assert o.no_effect() == ["rank_binding", "mpi_args", "extra_ttrun_args", "config_pkl_dir",
                             "env_passthrough", "register_test_models"]
    assert parse({"tt": {"sample_on_device_mode": "decode_only"}}).sample_mode("all") == "decode_only"
    assert parse({}).sample_mode("decode_only") == "decode_only" and parse({}).no_effect() == []


@pytest.mark.parametrize("cfg, needle", [
    ({"tt": {"always_compat_sampling": "sometimes"}}, "tt.always_compat_sampling: Input should be a valid boolean"),
    ({"tt": {"env_passthrough": ["OK", "1BAD"]}}, "tt.env_passthrough.1: String should match pattern"),
    ({"tt": {"env_passthrough": "HF_TOKEN"}}, "tt.env_passthrough: Input should be a valid list"),
    ({"tt": {"rank_bindings": "x"}}, "did you mean `rank_binding`?"),
    # strict types (issue 43): JSON's "5" or true is not a number, "yes" or 1 not a boolean
    ({"tt": {"output_tokens_per_step": "4"}}, "tt.output_tokens_per_step: Input should be a valid integer, got '4'"),
    ({"tt": {"output_tokens_per_step": True}}, "tt.output_tokens_per_step: Input should be a valid integer, got True"),
    ({"tt": {"trace_region_size": "50000000"}}, "tt.trace_region_size: Input should be a valid integer"),
    ({"tt": {"max_prefill_steps_between_decodes": 2.0}}, "tt.max_prefill_steps_between_decodes: Input should be a valid integer"),
    ({"tt": {"enable_model_warmup": "false"}}, "tt.enable_model_warmup: Input should be a valid boolean, got 'false'"),
    ({"tt": {"always_compat_sampling": 1}}, "tt.always_compat_sampling: Input should be a valid boolean, got 1"),
    ({"tt": {"tt_data_parallel_size": True}}, "tt.tt_data_parallel_size: Input should be a valid integer, got True"),
])
def test_tt_options_new_keys_validated(cfg, needle):
    with pytest.raises(InvalidInput) as e:
        parse(cfg)
    assert needle in str(e.value)


def test_tt_environment_names_validated():
    from ttbundle.runtime.options import env
    e = env({"TT_VISIBLE_DEVICES": "0, 2,3", "EXTRA_MODELS_DIR": "/a:/b", "HF_MODEL": "org/M",
             "TT_LLAMA_TEXT_VER": "llama3_70b_galaxy", "TT_VLLM_BUILTIN_MODELS": "0", "UNRELATED": "x"})
    assert e.TT_VISIBLE_DEVICES == [0, 2, 3] and e.EXTRA_MODELS_DIR == ["/a", "/b"]
    assert (e.HF_MODEL, e.TT_LLAMA_TEXT_VER, e.TT_VLLM_BUILTIN_MODELS) == ("org/M", "llama3_70b_galaxy", "0")
    assert env({}).TT_VISIBLE_DEVICES is None
    for bad, needle in [({"TT_VISIBLE_DEVICES": "0;1"}, "TT_VISIBLE_DEVICES='0;1': must be comma-separated"),
                        ({"TT_VISIBLE_DEVICES": "1,1"}, "listed twice"),
                        ({"TT_VLLM_BUILTIN_MODELS": "yes"}, "TT_VLLM_BUILTIN_MODELS='yes': Input should be '0' or '1'")]:
        with pytest.raises(InvalidInput, match=needle):
            env(bad)


def test_host_reasons_route_rows_beyond_the_device_top_k():
    """With a device bound (Tenstorrent's max_device_top_k), stochastic rows with no top_k, top_k
    < 1 or above the bound need the host; greedy rows and rows within the bound do not; without
    a bound (the emulated mesh samples the whole vocabulary) nothing changes. prompt_logprobs
    always need the host (every prompt position's logits)."""
    beyond = "beyond the device's 32 candidates"
    assert any(beyond in r for r in host_reasons(_params(temperature=0.8), 32))
    assert any(beyond in r for r in host_reasons(_params(temperature=0.8, top_k=-1), 32))
    assert any(beyond in r for r in host_reasons(_params(temperature=0.8, top_k=33), 32))
    assert host_reasons(_params(temperature=0.8, top_k=32), 32) == []
    assert host_reasons(_params(temperature=0), 32) == []  # greedy: the argmax, no candidates
    assert host_reasons(_params(temperature=0.8), None) == []
    assert host_reasons(_params(temperature=0, prompt_logprobs=2)) == ["prompt_logprobs"]


def test_model_capabilities_follow_the_spec():
    """Derived from the spec: device sampling unless sample_on_device_mode is off, the lowering's
    top-k bound (ttnn.sampling's 32) on a device and the vocabulary on the emulated mesh,
    prefix caching only emulated, chunked prefill with prefill_chunk, async decode emulated (and on
    the timing device) only."""
    from ttbundle import spec as specmod
    from ttbundle.backends.ttnn.lowering import TOPK
    from ttbundle.runtime.capabilities import device_top_k, model_capabilities
    from runtime_helpers import spec_text
    import yaml

    doc = yaml.safe_load(spec_text("llama"))
    from ttbundle.package.facts import of_bundle
    b = of_bundle(specmod.loads(yaml.safe_dump(doc), "spec.yaml"))
    dev, emu = model_capabilities(b, device=True), model_capabilities(b, device=False, vocab_size=512)
    assert TOPK == 32 and dev["max_device_top_k"] == 32 and emu["max_device_top_k"] == 512
    assert device_top_k(dev, 512) == 32 and device_top_k(emu, 512) is None
    assert (dev["supports_prefix_caching"], emu["supports_prefix_caching"]) == (False, True)
    assert (dev["supports_packed_prefill"], emu["supports_packed_prefill"]) == (False, True)
    assert dev["supports_chunked_prefill"] and dev["supports_sample_on_device"]
    # async decode on both: the ttnn lowering feeds a decode's sampled ids into the next decode's
    # tokens inside its trace (backends/ttnn/feed), the emulated mesh on its tensors
    assert dev["supports_async_decode"] is True and emu["supports_async_decode"] is True
    assert dev["output_tokens_per_step"] == 1  # what this spec declares
    doc["runtime"]["sample_on_device_mode"] = "off"
    doc["buckets"].pop("prefill_chunk")
    doc["runtime"]["max_model_len"] = 128
    b = of_bundle(specmod.loads(yaml.safe_dump(doc), "spec.yaml"))
    caps = model_capabilities(b)
    assert not caps["supports_sample_on_device"] and not caps["supports_chunked_prefill"]


def test_prompt_logprobs_chunks_join_and_are_returned_once():
    """Three chunks of a 10-token prompt (4, 4, 2 positions): each position's logprob of the next
    prompt token, its rank and the top 2, against torch's log_softmax and ranks counted here; the
    tensors come back with the chunk that ends the prompt, once (a preempted request's re-prefill
    asks for none), and again after the request is removed."""
    from vllm.v1.sample.sampler import Sampler

    from ttbundle.runtime.sampling import PromptLogprobs

    g = torch.Generator().manual_seed(5)
    prompt = [int(x) for x in torch.randint(0, 50, (10,), generator=g)]
    logits = torch.randn(10, 50, generator=g)
    lp = PromptLogprobs(Sampler())
    sp = _params(prompt_logprobs=2)
    assert lp.wanted("r", sp, 50) == 2 and lp.wanted("r", _params(), 50) is None
    assert lp.wanted("r", _params(prompt_logprobs=-1), 50) == 50
    assert lp.add("r", prompt, 2, 0, logits[0:4]) is None
    assert lp.add("r", prompt, 2, 4, logits[4:8]) is None
    out = lp.add("r", prompt, 2, 8, logits[8:10])
    assert out is not None and lp.wanted("r", sp, 50) is None
    ref = logits.log_softmax(-1)
    for i in range(9):
        tok = prompt[i + 1]
        assert int(out.logprob_token_ids[i, 0]) == tok
        assert abs(float(out.logprobs[i, 0]) - float(ref[i, tok])) < 1e-5
        assert int(out.selected_token_ranks[i]) == int((ref[i] > ref[i, tok]).sum()) + 1
        assert out.logprob_token_ids[i, 1:].tolist() == ref[i].topk(2).indices.tolist()
    lp.remove("r")
    assert lp.wanted("r", sp, 50) == 2


def test_prompt_logprobs_refused_on_a_device_only():
    from vllm.exceptions import VLLMValidationError

    from ttbundle.runtime.platform import EmulatedMeshPlatform, TTMeshPlatform
    EmulatedMeshPlatform.validate_request(None, _params(prompt_logprobs=1))  # the host path has them
    with pytest.raises(VLLMValidationError, match="prompt_logprobs are not supported on a Tenstorrent device"):
        TTMeshPlatform.validate_request(None, _params(prompt_logprobs=1))
    TTMeshPlatform.validate_request(None, _params())


# ---- a JSON schema no value satisfies (issue 43) ---------------------------------------------------
def test_ref_loop_finds_a_root_no_value_satisfies_and_nothing_else():
    from ttbundle.runtime.structured import ref_loop

    loops = {
        json.dumps({"$ref": "#"}): ["'#'"],
        json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}):
            ["'#/$defs/a' -> '#/$defs/b' -> '#/$defs/a'"],
        json.dumps({"anyOf": [{"$ref": "#"}], "title": "t"}): ["'#'"],
        json.dumps({"allOf": [{"$ref": "#"}, {"type": "object"}]}): ["'#'"],
        json.dumps({"definitions": {"a~b": {"$ref": "#/definitions/a~0b"}}, "$ref": "#/definitions/a~0b"}):
            ["'#/definitions/a~0b' -> '#/definitions/a~0b'"],
    }
    for text, says in loops.items():
        why = ref_loop(text)
        assert why and all(s in why for s in says), (text, why)
    fine = [
        {"type": "object", "properties": {"x": {"$ref": "#"}}},  # recursion below a property
        {"anyOf": [{"$ref": "#"}, {"type": "null"}]},  # a base case
        {"$defs": {"a": {"$ref": "#/$defs/a"}}, "type": "string"},  # an unused definition
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"},  # a chain
        {"$ref": "https://example.com/s.json"}, {"$ref": "#/nowhere"}, {"$ref": 5}, [], "not json {",
    ]
    for schema in fine:
        assert ref_loop(schema if isinstance(schema, str) else json.dumps(schema)) is None, schema
        if isinstance(schema, (dict, list)):
            assert ref_loop(schema) is None


def test_vllm_request_validation_refuses_the_loop_with_its_own_400_error():
    from vllm.config import StructuredOutputsConfig
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from ttbundle.runtime.structured import hook_schema_check

    hook_schema_check()
    hook_schema_check()  # idempotent
    p = SamplingParams(structured_outputs=StructuredOutputsParams(json={"$ref": "#"}))
    with pytest.raises(VLLMValidationError, match="is a loop of references") as ei:
        p._validate_structured_outputs(None, StructuredOutputsConfig(), None)
    assert ei.value.parameter == "response_format"
