"""Shared by the runtime tests: tiny specs per family, the transformers reference, and the
checks every recorded step sequence must pass."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

# (family, mesh) pairs served end to end. Families join by adding a TINY_ARCH entry.
CASES = [("llama", "N150"), ("llama", "T3K"), ("qwen3", "N150"), ("gemma3", "T3K")]

_DIMS = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
TINY_ARCH = {
    "llama": dict(_DIMS, family="llama"),
    "qwen3": dict(_DIMS, family="qwen3", head_dim=16),
    # served alone (test_runtime_qwen3_moe), not in CASES: 8 experts, top-2, one per T3K chip (Qwen2
    # MoE: q/k/v biases, not renormalized, a gated shared expert)
    "qwen3_moe": dict(_DIMS, family="qwen3_moe", head_dim=16, moe_intermediate_size=64, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(_DIMS, family="qwen2_moe", moe_intermediate_size=64, shared_expert_intermediate_size=128,
                      num_experts=8, num_experts_per_tok=2),
    "gemma3": dict(_DIMS, family="gemma3", num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=16, sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4),
}
PREFILL = [32, 64, 128]
DECODE = [1, 2, 4, 8, 16, 32]
CHUNK = 64
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 32


def hf_id(family: str) -> str:
    """The HF model id a tiny package says it was made from (``hf_model``)."""
    return f"test-org/Tiny-{family.capitalize()}"


def spec_text(family: str) -> str:
    return yaml.safe_dump({
        "name": f"tiny-{family}",
        "description": f"tiny random {family} for runtime tests",
        "hf_model": hf_id(family),
        "model": TINY_ARCH[family],
        "targets": ["N150", "T3K"],
        "buckets": {"prefill": PREFILL, "decode": DECODE, "prefill_chunk": CHUNK},
        "runtime": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS},
    }, sort_keys=False)


@functools.cache
def hf_model(src: str):
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def hf_greedy(src, prompt_ids: list[int], n: int) -> list[int]:
    """transformers ``generate`` (greedy) on the checkpoint the package was built from, its KV
    cache stored in bf16 as the package's (``runtime.kv_cache_dtype: bf16``) is."""
    import torch

    from ttbundle import reference
    m = hf_model(str(src))
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                         past_key_values=reference.kv_cache(m, "bf16"))
    return out[0, len(prompt_ids):].tolist()


def pick(buckets, n):
    return min(b for b in buckets if b >= n)


def assert_prefill_plan(lens: list[int], buckets: list[int], where: str = "") -> None:
    """The program calls the runner makes of a prefill step's chunks (``phases.pack_prefill``,
    the emulated mesh's packing) are valid calls that fit the largest bucket: each call one
    bucket's rows, one chunk padded to a bucket holding it or k chunks of R rows (R a multiple of
    32 dividing the bucket, each chunk <= R, k <= bucket / R <= 32); every chunk in exactly one
    call; never more rows than one call per chunk."""
    from ttbundle.runtime.phases import pack_prefill

    calls = pack_prefill(lens, buckets)
    assert sorted(i for _, _, idx in calls for i in idx) == list(range(len(lens))), (where, calls)
    for S, R, idx in calls:
        assert S in buckets and all(lens[i] <= R for i in idx), (where, calls, lens)
        assert R == S and len(idx) == 1 or (R % 32 == 0 and S % R == 0 and len(idx) <= S // R <= 32), (where, calls)
    rows = sum(S for S, _, _ in calls)
    assert rows <= max(buckets), f"{where}: prefill calls of {rows} rows ({calls}, chunks {lens})"
    assert rows <= sum(pick(buckets, n) for n in lens), (where, calls, lens)


def check_steps(records, prompt_lens: dict, chunk: int, prefill_buckets: list[int],
                max_prefill_run: int) -> dict:
    """Invariants of a scheduler's recorded steps (``PhaseScheduler.records``):

    * each step is prefill-only, decode-only or empty, and its phase is what its rows are;
    * a prefill step's program calls (one per chunk padded to its bucket, or several chunks
      packed into one call: ``assert_prefill_plan``) fit the largest bucket; every chunk starts at a
      multiple of ``chunk`` and is ``chunk`` long unless it ends the prompt;
    * a decode step holds every request that was ready to decode at its start;
    * a request ready to decode waits at most ``max_prefill_run`` prefill steps in a row.

    Returns per-request prefill chunks (for further checks)."""
    chunks: dict = {}
    waited: dict = {}
    for i, r in enumerate(records):
        rows = r.tokens
        if r.phase == "empty":
            assert not rows
            continue
        if r.phase == "decode":
            assert all(n == 1 for n in rows.values()), f"step {i}: decode rows {rows}"
            missing = set(r.decode_ready) - set(rows)
            assert not missing, f"step {i}: ready to decode but not in the decode step: {missing}"
            for rid in rows:
                waited[rid] = 0
            continue
        assert r.phase == "prefill", r.phase
        assert not set(rows) & set(r.decode_ready), f"step {i}: a decode row in a prefill step"
        assert_prefill_plan(list(rows.values()), prefill_buckets, f"step {i}")
        for rid, n in rows.items():
            start = r.starts[rid]
            chunks.setdefault(rid, []).append((start, n))
        for rid in r.decode_ready:
            waited[rid] = waited.get(rid, 0) + 1
            assert waited[rid] <= max_prefill_run, \
                f"step {i}: {rid} waited {waited[rid]} prefill steps (bound {max_prefill_run})"
    for rid, cs in chunks.items():
        plen = prompt_lens.get(rid)
        first = [c for c in cs if c[0] == 0]
        for start, n in cs:
            assert start % chunk == 0, f"{rid}: chunk at {start} is not at a multiple of {chunk}"
            assert n <= chunk
        if plen is not None and first:
            # the first prefill of the prompt: chunks of `chunk` tokens, the last one shorter
            run = cs[cs.index(first[0]):]
            total = 0
            for start, n in run:
                assert start == total, f"{rid}: chunks {run} are not contiguous"
                total += n
                if total >= plen:
                    break
                assert n == chunk, f"{rid}: chunk of {n} tokens in the middle of the prompt"
            assert total == plen, f"{rid}: chunks {run} cover {total} of {plen} tokens"
    return chunks


# ---- vLLM's server on a package (the OpenAI tests) -------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(pkg, d: Path, timeout: float = 600, extra: list[str] | None = None):
    """vLLM's OpenAI server on package ``pkg`` as ``ttbundle serve`` starts it (``extra``: vLLM
    arguments after ``--``), with the step log
    at ``d/steps.jsonl`` and its output in ``d/vllm.log``; yields the serve plan once /health
    answers, prints the log's tail when start-up or the body fails, stops the server at exit."""
    from ttbundle.serving.serve import plan_serve, start, stop, wait_healthy

    plan = plan_serve(pkg, "127.0.0.1", free_port(), extra=extra)
    plan.env["TTBUNDLE_STEP_LOG"] = str(d / "steps.jsonl")
    log = d / "vllm.log"
    with open(log, "wb") as f:
        proc = start(plan, log=f)
    try:
        wait_healthy(proc, plan.host, plan.port, timeout=timeout)
        yield plan
    except Exception:
        print(log.read_text()[-5000:])
        raise
    finally:
        stop(proc)


@dataclasses.dataclass
class Server:
    """A running server of a test package: its URL, served name, source checkpoint, package, and
    the vLLM log and step log (``serving``'s files)."""
    url: str
    name: str
    src: Path
    pkg: Path
    log: Path
    step_log: Path

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.url, api_key="none", timeout=180, max_retries=0)


@contextlib.contextmanager
def served_package(spec: str, packages_dir: Path, mesh: str, d: Path):
    """``spec`` built for ``mesh`` into ``packages_dir`` (random weights) and served from ``d``."""
    from ttbundle import spec as specmod
    from ttbundle.serving.demo import build_package

    pkg = build_package(spec, packages_dir, mesh)
    name = specmod.loads(spec, "<spec>").spec.name
    with serving(pkg, d) as plan:
        yield Server(plan.url, plan.name, packages_dir / f"src-{name}", pkg, d / "vllm.log", d / "steps.jsonl")


# ---- vLLM's engine in its own process (tt_engine_run.py, timing_engine_run.py) ----------------------
RESULT = "RESULT "


def use_recording_double() -> None:
    """An engine script's process: the TT platform with the recording double standing in for ttnn
    (``TTBUNDLE_TEST_TTNN=recording``) and vLLM's engine in this process; called before vLLM or
    ttbundle is imported. This checkout's ttbundle goes first on the path (not whichever the venv
    installed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ["TTBUNDLE_TEST_TTNN"] = "recording"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("TTBUNDLE_EMULATED", None)


def computing_recorder():
    """The recording double **computing** on the package's tensorbin weights: a ``Recorder()`` in
    place of the hook's fake-weight one (``ttdevice.RECORDER``); returns it."""
    from ttbundle.backends.ttnn import recording
    from ttbundle.runtime import ttdevice

    ttdevice.RECORDER = recording.Recorder()
    return ttdevice.RECORDER


def engine_main(run_case) -> int:
    """An engine script's entry: ``SCRIPT PACKAGE CASES_JSON``; prints one ``RESULT {json}`` line
    of ``{case name: run_case(package, case)}``."""
    pkg, cases = sys.argv[1], json.loads(sys.argv[2])
    results = {name: run_case(pkg, case) for name, case in cases.items()}
    print(RESULT + json.dumps(results), flush=True)
    return 0


def run_engine_script(script: Path, pkg, cases: dict, env: dict, timeout: float = 900) -> dict:
    """``script`` (an :func:`engine_main` script) on ``pkg`` and ``cases`` in a fresh process (vLLM
    resolves its platform once per process); its RESULT, or the failure with stderr's tail."""
    r = subprocess.run([sys.executable, str(script), str(pkg), json.dumps(cases)], capture_output=True, text=True,
                       env=env, cwd=script.parent, timeout=timeout)
    line = [x for x in r.stdout.splitlines() if x.startswith(RESULT)]
    assert r.returncode == 0 and line, r.stderr[-4000:]
    return json.loads(line[-1][len(RESULT):])


def step_lines(server) -> list[str]:
    """The served engine's step log so far (``TTBUNDLE_STEP_LOG``), one JSON line per step."""
    return server.step_log.read_text().splitlines() if server.step_log.exists() else []


def prefill_starts(server, since: int) -> list[int]:
    """First position of every prefill row logged after the first ``since`` steps."""
    import json
    return [row[1] for s in map(json.loads, step_lines(server)[since:]) if s["phase"] == "prefill"
            for row in s["rows"]]


#: image sizes (height, width) of the 8 concurrent image chats (different grids, so different
#: soft-token counts in one batch)
CONCURRENT_SIZES = [(24, 24), (40, 56), (64, 32), (32, 64), (56, 40), (48, 48), (16, 64), (64, 64)]


def concurrent_chats(server, messages: list, max_tokens: int) -> list:
    """The chats sent at once through the `openai` client's async API (greedy, token ids back)."""
    import asyncio

    import openai
    c = openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=300, max_retries=0)

    async def one(m):
        return await c.chat.completions.create(
            model=server.name, messages=m, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})

    async def main():
        return await asyncio.gather(*(one(m) for m in messages))
    return asyncio.run(main())


def assert_concurrent_image_chats(server, image, message, hf_greedy, image_token: int) -> None:
    """8 image chats at once (one image each of :data:`CONCURRENT_SIZES`: different soft-token
    counts in one batch), each greedy-identical to transformers' generate of its own prompt
    (``hf_greedy(server, text, images, n)`` -> HF's prompt ids and tokens)."""
    texts = [f"ba {'be ' * i}" for i in range(8)]
    ims = [image(i, *CONCURRENT_SIZES[i]) for i in range(8)]
    rs = concurrent_chats(server, [message(texts[i], ims[i]) for i in range(8)], 4)
    assert len({r.prompt_token_ids.count(image_token) for r in rs}) >= 5  # different grids
    for i, r in enumerate(rs):
        ids, want = hf_greedy(server, texts[i], [ims[i]], 4)
        assert r.prompt_token_ids == ids, i
        assert r.choices[0].token_ids == want, i


def random_image(seed: int, h: int = 40, w: int = 56):
    """A seeded random RGB image of h x w pixels (PIL)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def data_url(im) -> str:
    """An image as an `image_url` base64 PNG data URL."""
    import base64
    import io
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(text: str, *images) -> list:
    """A user chat message: the images (as data URLs), then the text."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def run_engine(pkg, speculative_config, requests, **kw):
    """One in-process vLLM engine on ``pkg`` (with ``speculative_config``, or None): each
    (prompts, params) batch generated in turn (``params`` one SamplingParams dict, or one per
    prompt); returns (token lists per batch, the spec_decode metrics, the runner's step log, the
    runner). The n-gram and draft tests' engine."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(pkg), dtype="float32", seed=0, disable_log_stats=False,
              speculative_config=speculative_config, **kw)
    try:
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        outs = []
        for prompts, params in requests:
            ps = params if isinstance(params, list) else [params] * len(prompts)
            res = llm.generate(prompts, [SamplingParams(**p) for p in ps], use_tqdm=False)
            outs.append([list(o.outputs[0].token_ids) for o in res])
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
        return outs, metrics, list(runner.step_log), runner
    finally:
        llm.llm_engine.engine_core.shutdown()


def greedy(n: int) -> dict:
    """SamplingParams of ``n`` greedy tokens, EOS ignored."""
    return dict(max_tokens=n, temperature=0, ignore_eos=True)


def processor_model_dir(bundle, d: Path) -> Path:
    """What a package carries for vLLM's multimodal processor, in ``d``: the checkpoint's
    config.json with the TT architecture, the demo tokenizer and the package's processor files
    (``vision.package_files``)."""
    from ttbundle import vision
    from ttbundle.serving.demo import make_source

    d = make_source(bundle, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["TT" + a for a in cfg["architectures"]]
    (d / "config.json").write_text(json.dumps(cfg))
    for name, data in vision.package_files(bundle).items():
        (d / name).write_bytes(data)
    return d


def vllm_processor(model_dir: Path, hf_arch: str, limits: dict):
    """vLLM's own multimodal processor for ``model_dir`` through ttbundle's ``TT`` + ``hf_arch``
    registration (``limit_mm_per_prompt=limits``, max_model_len 512)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from ttbundle.runtime.registry import register_arch
    register_arch(hf_arch)
    mc = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="float32", max_model_len=512,
                     limit_mm_per_prompt=limits)
    return MULTIMODAL_REGISTRY.create_processor(mc)
