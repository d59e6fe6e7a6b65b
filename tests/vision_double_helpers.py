"""A package's TT device model on the recording double, computing on its tensorbin weights
(warmed and sealed as the model runner does it), and the same package on the emulated mesh: the
two sides of the image tests on the TT device path (``test_ttnn_vision_double.py``: Gemma 3;
``test_ttnn_qwen_vl_double.py``: Qwen2.5-VL)."""

from __future__ import annotations


def device_model(pkg_dir, max_seq_len: int = 256):
    """(package, ``TTDeviceModel``, its KV handle, the ``Recorder``): the package on a mesh of the
    double (no fake weights), every forward warmed and each traced one captured."""
    from ttbundle.backends.ttnn import recording
    from ttbundle.runtime import ttdevice
    from ttbundle.runtime.options import TTOptions
    from ttbundle.runtime.packages import open_package

    pkg = open_package(pkg_dir)
    rec = recording.Recorder()
    tt = rec.module()
    md = tt.open_mesh_device(tt.MeshShape(*pkg.loaded.mesh.shape), trace_region_size=pkg.trace_region_size)
    dev = ttdevice.TTDeviceModel.initialize_vllm_model(None, md, 8, max_seq_len, 1, None, package=pkg,
                                                       options=TTOptions(trace_mode="all"), sample_mode="all",
                                                       ttnn=tt)
    dev.runner.ex.on_call = rec.on_call  # each op checked against the shape the lowering says
    a = pkg.bundle.arch
    kv = dev.allocate_kv_cache((pkg.kv_blocks, a.kv_heads, 32, a.hd))
    dev.warmup_model_prefill(kv, True, True)
    dev.warmup_model_decode(kv, True, 8, pkg.kv_blocks, True)
    dev.seal()
    return pkg, dev, kv, rec


def emulated(pkg, max_seq_len: int = 256):
    """(the emulated mesh's model of ``pkg``, its KV cache)."""
    from ttbundle.runtime.model_runner import model_class
    model = model_class(pkg).initialize_vllm_model(None, None, 8, max_seq_len, 1, None, package=pkg)
    a = pkg.bundle.arch
    return model, model.allocate_kv_cache((pkg.kv_blocks, a.kv_heads, 32, a.hd))
