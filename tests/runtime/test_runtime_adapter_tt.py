"""The generated adapter (a package's ``main_class``) as Tenstorrent's own plugin drives it on a
device: ``model_capabilities`` read on the class, then ``initialize_vllm_model`` handed a ttnn
mesh device, ``allocate_kv_cache``, ``warmup_model_prefill`` / ``warmup_model_decode``,
``prefill_forward``, ``decode_forward(read_from_device=False)`` + ``read_decode_output`` +
``process_decode_output_host``, all by keyword as that plugin's runner passes them. The device is
the computing recording double (its weights: the package's tensorbin caches); the reference is
the emulated mesh on the same package (tests/test_ttnn_double.py checks the two agree op by op;
the emulated mesh is checked against transformers in test_runtime_engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from runtime_helpers import spec_text
from ttbundle.package.facts import of_bundle

PROMPT = [5, 17, 99, 3, 250, 42, 7]
STEPS = 3
REL = 0.03  # bf16 weights and activations on the device against the emulated mesh's fp32


@pytest.fixture(scope="module")
def ttnn_package(tmp_path_factory):
    from ttbundle.serving.demo import build_package
    return build_package(spec_text("llama"), tmp_path_factory.mktemp("adapter"), "T3K", backend="ttnn",
                         warmup=False)


def _drive(model, kv_shape, bucket, rows):
    """Tenstorrent's call sequence on ``model``: prefill of PROMPT, then STEPS greedy decodes;
    the host-fallback logits and the device-sampled token of every forward."""
    from ttbundle.runtime.sampling import DeviceSampling

    kv = model.allocate_kv_cache(kv_shape, torch.bfloat16, 2)
    model.warmup_model_prefill(kv_cache=kv, enable_trace=True, can_sample_on_device=True)
    model.warmup_model_decode(kv_cache=kv, enable_trace=True, max_batch_size=32, num_blocks=kv_shape[0],
                              can_sample_on_device=True)
    bs = 32
    page_table = torch.arange(1, 1 + 256 // bs)[None, :]  # block 0: the null block
    tokens = torch.zeros(1, bucket, dtype=torch.long)
    tokens[0, :len(PROMPT)] = torch.tensor(PROMPT)
    greedy = DeviceSampling.from_params([], [], 1)
    logits = [model.prefill_forward(tokens=tokens, page_table=page_table, kv_cache=kv, prompt_lens=[len(PROMPT)],
                                    start_pos=[0], enable_trace=True)[0]]
    sampled = [int(model.prefill_forward(tokens=tokens, page_table=page_table, kv_cache=kv,
                                         prompt_lens=[len(PROMPT)], start_pos=[0], enable_trace=True,
                                         sampling_params=greedy)[0])]
    tok, pos = int(logits[0].argmax()), len(PROMPT)
    for _ in range(STEPS):
        t = torch.zeros(rows, 1, dtype=torch.long)
        t[0, 0] = tok
        p = torch.full((rows,), -1, dtype=torch.long)
        p[0] = pos
        pt = page_table.expand(rows, -1).contiguous()
        out = model.decode_forward(tokens=t, page_table=pt, kv_cache=kv, start_pos=p, enable_trace=True,
                                   read_from_device=False)
        logits.append(model.process_decode_output_host(model.read_decode_output(out, async_read=True),
                                                       is_tokens=False)[0])
        out = model.decode_forward(tokens=t, page_table=pt, kv_cache=kv, start_pos=p, enable_trace=True,
                                   sampling_params=DeviceSampling.from_params([], [], rows), read_from_device=False)
        sampled.append(int(model.process_decode_output_host(model.read_decode_output(out), is_tokens=True)[0]))
        tok, pos = int(logits[-1].argmax()), pos + 1
    return logits, sampled


def test_adapter_runs_the_ttnn_path_on_a_mesh_device(ttnn_package, monkeypatch):
    from ttbundle import mesh as meshmod
    from ttbundle.backends.ttnn import recording
    from ttbundle.plan.make import kv_blocks
    from ttbundle.runtime import ttdevice
    from ttbundle.runtime.adapter import BundleModel
    from ttbundle.runtime.model_runner import model_class
    from ttbundle.runtime.packages import open_package

    pkg = open_package(ttnn_package)
    cls = model_class(pkg)  # the package's generated adapter, as vllm_metadata.json names it
    assert issubclass(cls, BundleModel) and cls.__module__ != BundleModel.__module__

    # read on the class, before any model exists (Tenstorrent's plugin decides sampling, async,
    # prefix caching and chunked prefill from it): the spec's values, ttnn.sampling's 32 candidates
    caps = cls.model_capabilities
    assert caps["supports_sample_on_device"] is True and caps["max_device_top_k"] == 32
    assert caps["supports_prefix_caching"] is False and caps["supports_async_decode"] is True  # the feed is lowered
    assert caps["supports_chunked_prefill"] is (pkg.bundle.buckets.prefill_chunk is not None)

    monkeypatch.setenv(ttdevice.TEST_TTNN_ENV, "recording")
    rec = recording.Recorder()  # computing: weights from the package's tensorbin caches
    monkeypatch.setattr(ttdevice, "RECORDER", rec)
    ttnn = ttdevice.import_ttnn()
    mesh_device = ttnn.open_mesh_device(ttnn.MeshShape(1, 8), trace_region_size=pkg.trace_region_size)
    hf = SimpleNamespace(_name_or_path=str(pkg.path))
    dev = cls.initialize_vllm_model(hf, mesh_device, 32, 256, 1, None)
    assert isinstance(dev, ttdevice.TTDeviceModel) and dev.model_capabilities == caps

    a = pkg.bundle.arch
    # Tenstorrent's plugin sizes the cache from the class's pool: ceil((tokens + block x seqs) / block)
    bs = pkg.bundle.spec.runtime.kv_block_size
    tokens = cls.get_max_tokens_all_users(model_name=pkg.name, num_devices=8, tt_data_parallel=1,
                                          max_model_len=256, max_num_seqs=32)
    blocks = -(-(tokens + bs * 32) // bs)
    assert blocks == kv_blocks(pkg.bundle, "T3K")
    shape = (blocks, a.kv_heads // 8 or 1, 32, a.hd)
    got_logits, got_sampled = _drive(dev, shape, 32, 2)  # decode bucket 2: row 1 idle
    # every forward ran as a replay of a trace captured at warm-up, none compiled while serving
    assert dev.sealed and dev.runner.stage == "captured"
    assert rec.op_errors == [] and rec.violations == []

    emu = cls.initialize_vllm_model(hf, meshmod.resolve("T3K"), 32, 256, 1, None, package=pkg)
    assert isinstance(emu, BundleModel) and emu.model_capabilities["max_device_top_k"] == a.vocab_size
    want_logits, want_sampled = _drive(emu, shape, 32, 2)
    for i, (g, w) in enumerate(zip(got_logits, want_logits)):
        diff, top = float((g - w).abs().max()), float(w.abs().max())
        assert diff <= REL * top, f"forward {i}: logits differ by {diff:.3g} (largest {top:.3g})"
        for tok in (int(g.argmax()), got_sampled[i]):  # greedy, up to a near tie bf16 may flip
            assert float(w.max() - w[tok]) <= 2 * diff, (i, tok, int(w.argmax()))
    assert want_sampled == [int(w.argmax()) for w in want_logits]


def test_adapter_refuses_a_mesh_device_of_another_shape(ttnn_package, monkeypatch):
    from ttbundle.backends.ttnn import recording
    from ttbundle.runtime import ttdevice
    from ttbundle.runtime.model_runner import model_class
    from ttbundle.runtime.packages import open_package

    pkg = open_package(ttnn_package)
    monkeypatch.setattr(ttdevice, "RECORDER", recording.Recorder())
    monkeypatch.setenv(ttdevice.TEST_TTNN_ENV, "recording")
    ttnn = ttdevice.import_ttnn()
    n300 = ttnn.open_mesh_device(ttnn.MeshShape(1, 2))
    with pytest.raises(ValueError, match=r"built for .*handed a 1x2 mesh device"):
        model_class(pkg).initialize_vllm_model(SimpleNamespace(), n300, 32, 256)
    assert np.prod(n300.shape) == 2


def test_the_adapter_class_opens_its_package_once_per_build(ttnn_package, tmp_path, monkeypatch):
    """The generated class's ``model_capabilities`` and ``get_max_tokens_all_users`` read one
    opened package (one cache, ``adapter._opened``): opened once for both, opened again when the
    package is rebuilt in place (a new manifest.json). The capabilities are computed at each read
    (the async decode bit follows the environment: a timing device turns it on), equal to
    ``model_capabilities`` of the package's bundle.yaml, and the pool is Tenstorrent's formula
    solved for the package's blocks."""
    import os
    import shutil

    from ttbundle import spec as specmod
    from ttbundle.runtime import packages, timing
    from ttbundle.runtime.capabilities import model_capabilities
    from ttbundle.runtime.model_runner import model_class

    monkeypatch.delenv(timing.ENV, raising=False)
    pkg_dir = tmp_path / ttnn_package.name
    shutil.copytree(ttnn_package, pkg_dir)
    opened, real = [], packages.open_package
    monkeypatch.setattr(packages, "open_package", lambda p, *a, **k: opened.append(p) or real(p, *a, **k))
    cls = model_class(real(pkg_dir))
    bundle = specmod.load(pkg_dir / "bundle.yaml")
    rt = bundle.spec.runtime
    caps = cls.model_capabilities
    assert caps == model_capabilities(of_bundle(bundle), device=True) and caps["supports_async_decode"] is True
    tokens = cls.get_max_tokens_all_users(max_num_seqs=rt.max_num_seqs)
    blocks = real(pkg_dir).kv_blocks
    assert -(-(tokens + rt.kv_block_size * rt.max_num_seqs) // rt.kv_block_size) == blocks
    assert len(opened) == 1
    monkeypatch.setenv(timing.ENV, "timing:14ms")
    assert cls.model_capabilities["supports_async_decode"] is True and len(opened) == 1
    m = pkg_dir / "manifest.json"  # rebuilt in place: the build renames a new manifest over it
    tmp = pkg_dir.parent / "manifest.json.new"
    shutil.copyfile(m, tmp)
    os.replace(tmp, m)
    cls.get_max_tokens_all_users()
    assert len(opened) == 2
