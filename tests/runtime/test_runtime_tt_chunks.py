"""Prompts past the first chunks on the TT device path: a 130-token prompt prefilled as vLLM's
scheduler chunks it (64 at 0, 64 at 64, 2 at 128 padded to bucket 32) and then decoded, on
``TTDeviceModel`` (the computing recording double on the package's tensorbin weights, every
step a replay of a trace captured at warm-up) against two independent references: the emulated
mesh on the same package and calls, and transformers' greedy ``generate`` on the checkpoint.

Reported as "a 130-token prompt gives other tokens than transformers on the TT path". Measured:
the device's logits stay within bf16 error of the emulated mesh's at every chunk start and every
decode position up to max_model_len (no error growth past position 128); the differing tokens
were near ties of the tiny random model (top-2 gap 0.003 against a device-vs-fp32 difference of
0.025), which bf16 may flip at any position. So the checks here are: logits within REL of the
emulated mesh chunk by chunk, greedy tokens equal up to such near ties, and exact token equality
on a prompt whose transformers margins (checked here, on the reference) exceed that error.

Also: ``TTDeviceModel.replays`` keeps a bounded window (a server runs for days)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime_helpers import CHUNK, PREFILL, hf_greedy, hf_model, pick, spec_text

REL = 0.03  # bf16 weights and activations on the device against the emulated mesh's fp32
PROMPT_LEN = 130  # a third chunk at position 128 (past 4 KV blocks of 32)
TOKENS = 5
MARGIN = 0.1  # transformers' top-1 over top-2 logit, well above the device's ~0.03 difference


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from ttbundle import mesh as meshmod
    from ttbundle.backends.ttnn import recording
    from ttbundle.plan.make import kv_blocks
    from ttbundle.runtime import ttdevice
    from ttbundle.runtime.model_runner import model_class
    from ttbundle.runtime.packages import open_package
    from ttbundle.serving.demo import build_package

    d = tmp_path_factory.mktemp("ttchunks")
    pkg = open_package(build_package(spec_text("llama"), d, "T3K", backend="ttnn", warmup=False))
    cls = model_class(pkg)
    mp = pytest.MonkeyPatch()
    mp.setenv(ttdevice.TEST_TTNN_ENV, "recording")
    rec = recording.Recorder()
    mp.setattr(ttdevice, "RECORDER", rec)
    mp.setattr(ttdevice.TTDeviceModel, "replays_kept", 8)  # small, so a handful of steps pass it
    ttnn = ttdevice.import_ttnn()
    md = ttnn.open_mesh_device(ttnn.MeshShape(1, 8), trace_region_size=pkg.trace_region_size)
    hf = SimpleNamespace(_name_or_path=str(pkg.path))
    dev = cls.initialize_vllm_model(hf, md, 32, 256, 1, None)
    emu = cls.initialize_vllm_model(hf, meshmod.resolve("T3K"), 32, 256, 1, None, package=pkg)
    mp.undo()
    a = pkg.bundle.arch
    shape = (kv_blocks(pkg.bundle, "T3K"), a.kv_heads // 8 or 1, 32, a.hd)
    kvs = {}
    for name, m in (("dev", dev), ("emu", emu)):
        kvs[name] = kv = m.allocate_kv_cache(shape, torch.bfloat16, 2)
        m.warmup_model_prefill(kv_cache=kv, enable_trace=True, can_sample_on_device=True)
        m.warmup_model_decode(kv_cache=kv, enable_trace=True, max_batch_size=32, num_blocks=shape[0],
                              can_sample_on_device=True)
    assert dev.sealed and dev.runner.stage == "captured"
    return SimpleNamespace(pkg=pkg, dev=dev, emu=emu, kv=kvs, rec=rec, src=d / "src-tiny-llama")


def _chunks(n: int) -> list[tuple[int, int, int]]:
    """(start, tokens, bucket) of each prefill chunk of an ``n``-token prompt, as vLLM's
    scheduler cuts it at the package's prefill_chunk and the runner pads it (a bucket)."""
    return [(s, min(CHUNK, n - s), pick(PREFILL, min(CHUNK, n - s))) for s in range(0, n, CHUNK)]


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 512, (PROMPT_LEN,), generator=g).tolist()


def _page_table(first: int) -> torch.Tensor:
    """The sequence's KV blocks, not from block 1 (vLLM hands out freed blocks in any order)."""
    return (torch.arange(8) * 3 + first)[None, :]


def _run(m, kv, prompt, pt, forced=None, sample=False):
    """Prefill ``prompt`` chunk by chunk, then decode TOKENS - 1 steps (row 1 of bucket 2 idle);
    each step's input the ``forced`` token, else the step's own greedy one. Returns each call's
    logits (``sample``: the device-sampled token ids instead)."""
    from ttbundle.runtime.sampling import DeviceSampling

    outs, chunks = [], _chunks(len(prompt))
    for i, (start, n, bucket) in enumerate(chunks):
        t = torch.zeros(1, bucket, dtype=torch.long)
        t[0, :n] = torch.tensor(prompt[start:start + n])
        last = i == len(chunks) - 1
        s = DeviceSampling.from_params([], [], 1) if (sample and last) else None
        r = m.prefill_forward(tokens=t, page_table=pt, kv_cache=kv, prompt_lens=[n], start_pos=[start],
                              sampling_params=s)
        outs.append(int(r[0]) if s is not None else r[0])
    tok = forced[0] if forced else (outs[-1] if sample else int(outs[-1].argmax()))
    for j in range(TOKENS - 1):
        t = torch.tensor([[tok], [0]])
        pos = torch.tensor([len(prompt) + j, -1])
        s = DeviceSampling.from_params([], [], 2) if sample else None
        r = m.decode_forward(tokens=t, start_pos=pos, page_table=pt.expand(2, -1).contiguous(), kv_cache=kv,
                             sampling_params=s)
        outs.append(int(r[0]) if sample else r[0])
        tok = forced[j + 1] if forced else (outs[-1] if sample else int(outs[-1].argmax()))
    return outs


def _hf_margins(src, prompt, tokens) -> list[float]:
    """transformers' top-1 minus top-2 logit at each greedy step of ``prompt`` + ``tokens``."""
    m = hf_model(str(src))
    with torch.no_grad():
        logits = m(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def test_a_prompt_past_position_128_keeps_the_devices_logits_on_the_emulated_meshs(models):
    """Every chunk (starts 0, 64, 128) and every decode after it, fed the same tokens: the
    device's logits within REL of the emulated mesh's; the greedy token the same up to a near tie
    (the emulated mesh's gap to the device's choice no more than the difference)."""
    prompt = _prompt(1)
    assert [c[:2] for c in _chunks(len(prompt))] == [(0, 64), (64, 64), (128, 2)]
    forced = hf_greedy(models.src, prompt, TOKENS)
    got = _run(models.dev, models.kv["dev"], prompt, _page_table(5), forced)
    want = _run(models.emu, models.kv["emu"], prompt, _page_table(5), forced)
    assert len(got) == len(_chunks(len(prompt))) + TOKENS - 1
    for i, (g, w) in enumerate(zip(got, want)):
        diff, top = float((g - w).abs().max()), float(w.abs().max())
        assert diff <= REL * top, f"call {i}: logits differ by {diff:.3g} (largest {top:.3g})"
        assert float(w.max() - w[int(g.argmax())]) <= 2 * diff, (i, int(g.argmax()), int(w.argmax()))


def test_a_prompt_past_position_128_gives_transformers_greedy_tokens(models):
    """Device sampling as the engine runs it (greedy on the device at the last chunk and each
    decode): the tokens of transformers' greedy generate and of the emulated mesh, for a prompt
    whose transformers margins exceed bf16's error (else a tie may flip: not this test's matter)."""
    for seed in range(20):  # the first prompt without a near tie in transformers' own logits
        prompt = _prompt(seed)
        want = hf_greedy(models.src, prompt, TOKENS)
        if min(_hf_margins(models.src, prompt, want)) > MARGIN:
            break
    else:
        pytest.fail("no prompt of 20 without a near tie")
    got = _run(models.dev, models.kv["dev"], prompt, _page_table(2), sample=True)
    emu = _run(models.emu, models.kv["emu"], prompt, _page_table(2), sample=True)
    assert got[len(_chunks(len(prompt))) - 1:] == want
    assert emu[len(_chunks(len(prompt))) - 1:] == want
    assert models.rec.op_errors == [] and models.rec.violations == []


def test_replays_keep_a_bounded_window_of_the_latest_runs(models):
    """Each step appends its forward key; a long-running server must not grow: the window holds
    the last ``replays_kept`` keys (8 here), ``replay_count`` counts them all."""
    dev = models.dev
    before = dev.replay_count
    _run(dev, models.kv["dev"], _prompt(2), _page_table(3), sample=True)  # 3 prefills + 4 decodes
    _run(dev, models.kv["dev"], _prompt(2), _page_table(3), sample=True)
    assert dev.replay_count - before == 2 * (len(_chunks(PROMPT_LEN)) + TOKENS - 1)
    assert len(dev.replays) == 8
    assert dev.replays_since(dev.replay_count - 4) == [("decode", 2, "device", 0)] * 4
    assert dev.replays_since(dev.replay_count - 5)[0] == ("prefill", 32, "device", 0)
    with pytest.raises(ValueError, match="kept"):
        dev.replays_since(dev.replay_count - 9)
