"""Checkpoint formats (``ttbundle.formats``): each quantized layout decoded against an independent
decoder (transformers', vLLM's or compressed-tensors' own), the tensors packed by the producers'
own packing code where it installs here (vLLM's ``awq_pack`` / ``gptq_pack``, compressed-tensors'
compressors), detection from ``quantization_config`` as vLLM detects it, and the bad inputs."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from ttbundle import formats, weights  # noqa: E402
from ttbundle.errors import InvalidInput  # noqa: E402
from ttbundle.formats import fp  # noqa: E402


def stored_of(sd: dict) -> dict:
    st = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
          torch.int8: "I8", torch.uint8: "U8", torch.int64: "I64", torch.float8_e4m3fn: "F8_E4M3"}
    return {k: (st[t.dtype], tuple(t.shape)) for k, t in sd.items()}


def decode(scheme, sd: dict) -> dict:
    """The decoded view of the in-memory checkpoint ``sd``."""
    v = scheme.view(stored_of(sd), "test")
    out = {}
    for k in v.keys(list(sd)):
        e = v.decoded.get(k)
        out[k] = sd[k] if e is None else e.decode([sd[s] for s in e.sources])
    return out


# ---- MXFP4 (GPT-OSS) ----------------------------------------------------------------------------------
def test_mxfp4_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8)  # [E, N, K/32, 16]
    scales = torch.randint(120, 134, (2, 6, 3), dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales)  # HF's [E, K, N]
    out = decode(fp.Mxfp4(), {"m.experts.down_proj_blocks": blocks, "m.experts.down_proj_scales": scales,
                              "m.experts.down_proj_bias": torch.zeros(2, 6)})
    assert set(out) == {"m.experts.down_proj", "m.experts.down_proj_bias"}
    torch.testing.assert_close(out["m.experts.down_proj"], ref.to(torch.bfloat16), rtol=0, atol=0)



def test_mxfp4_every_byte_and_scale_decodes_as_the_format_says():
    """The table lookup (``fp._mxfp4_table``) against the formula (``mxfp4_dequant``, rounded to
    bf16) and transformers' own conversion: every byte under every finite e8m0 scale, bands cut
    mid-matrix (N not a multiple of ``fp.BAND``)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    n = fp.BAND + 7
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, n, 4, 16), dtype=torch.uint8, generator=g)
    blocks[0, :16, 0] = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    scales = torch.randint(0, 255, (2, n, 4), dtype=torch.uint8, generator=g)  # 255 is e8m0's NaN
    scales[1, :255, 0] = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    out = fp.mxfp4_dense(blocks, scales)
    formula = fp.mxfp4_dequant(blocks, scales).transpose(-1, -2).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), formula.view(torch.int16))
    ref = convert_moe_packed_tensors(blocks, scales).to(torch.bfloat16)
    fin = ref.isfinite()
    assert torch.equal(out[fin].view(torch.int16), ref[fin].view(torch.int16))
    assert torch.equal(out.isfinite(), fin)


# ---- FP8 ------------------------------------------------------------------------------------------------
def test_fp8_blocks_match_transformers_dequant():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    w = (torch.randn(256, 384) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3) + 0.5
    ref = Fp8Dequantize(None)._dequantize_one(w, s, torch.float32)
    out = decode(fp.Fp8((128, 128)), {"a.weight": w, "a.weight_scale_inv": s})
    assert set(out) == {"a.weight"}
    torch.testing.assert_close(out["a.weight"], ref.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8])
def test_every_byte_decodes_as_torch_converts_it(dtype):
    """``fp.byte_values`` (one table lookup per byte, the FP8 and integer formats' decode) against
    torch's own conversion, every bit pattern of the dtype, NaN payloads included (bitwise), with
    and without reused scratch buffers."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).reshape(16, 16)
    ref = every.float()
    assert torch.equal(fp.byte_values(every).view(torch.int32), ref.view(torch.int32))
    out, index = torch.full((300,), 7.0), torch.zeros(300, dtype=torch.int32)
    assert torch.equal(fp.byte_values(every, out=out, index=index).view(torch.int32), ref.view(torch.int32))
    # a strided view takes torch's own conversion
    assert torch.equal(fp.byte_values(every.t()).view(torch.int32), ref.t().view(torch.int32))


def test_fp8_every_byte_under_block_scales_matches_transformers():
    """Every e4m3 byte in every 128 x 128 block, several blocks of rows per ``fp.ROWS`` chunk and
    a chunk cut mid-matrix, against transformers' FP8 dequantization (NaN where it gives NaN)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(2)
    rows = fp.ROWS + 256
    w = torch.randint(0, 256, (rows, 384), dtype=torch.uint8, generator=g)
    w[:16, :16] = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    w = w.view(torch.float8_e4m3fn)
    s = torch.rand(rows // 128, 3, generator=g) * 4 + 1e-3
    ref = Fp8Dequantize(None)._dequantize_one(w, s, torch.float32).to(torch.bfloat16)
    out = fp.dequant_scaled(w, s, 128, 128)
    fin = ref.isfinite()
    assert torch.equal(out.isfinite(), fin) and not bool(fin.all())
    assert torch.equal(out[fin].view(torch.int16), ref[fin].view(torch.int16))


def test_fp8_blocks_that_do_not_divide():
    torch.manual_seed(0)
    w = torch.randn(2, 200, 130).to(torch.float8_e4m3fn)  # [E, out, in]: blocks of 128 do not divide
    s = torch.rand(2, 2, 2) + 0.5  # ceil(200/128) x ceil(130/128) scales
    ref = w.float().clone()
    for bi in range(2):
        for bj in range(2):
            ref[:, bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128] *= s[:, bi, bj, None, None]
    out = decode(fp.Fp8((128, 128)), {"e.weight": w, "e.weight_scale_inv": s})
    torch.testing.assert_close(out["e.weight"], ref.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_compressed_tensors_fp8_matches_its_own_dequantize(strategy):
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    torch.manual_seed(0)
    w = (torch.randn(96, 64) * 8).to(torch.float8_e4m3fn)
    s = {"tensor": torch.tensor([0.01]), "channel": torch.rand(96, 1) / 50,
         "block": torch.rand(3, 2) / 50}[strategy]
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                           **({"block_structure": [32, 32]} if strategy == "block" else {})},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    scheme = formats.scheme_of(qc)
    out = decode(scheme, {"l.weight": w, "l.weight_scale": s, "l.input_scale": torch.ones(1)})
    assert set(out) == {"l.weight"}  # the activation scale is dropped
    if strategy == "block":
        ref = w.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)
    else:
        ref = dequantize(w, s.float(), dtype=torch.float32)
    torch.testing.assert_close(out["l.weight"], ref.to(torch.bfloat16), rtol=0, atol=0)


# ---- AWQ, GPTQ: packed by vLLM's own packers, checked against their dequantized reference --------------
def vllm_quant():
    return pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")


def test_awq_gemm_matches_vllm():
    q = vllm_quant()
    from vllm.scalar_type import scalar_types

    torch.manual_seed(0)
    K, N, g = 128, 64, 32  # in, out, group
    w = torch.randn(K, N, dtype=torch.float16)  # vLLM's [in, out]
    w_ref, w_q, w_s, w_zp = q.quantize_weights(w, scalar_types.uint4, g, zero_points=True)
    sd = {"p.qweight": q.awq_pack(w_q, 4, K, N), "p.qzeros": q.awq_pack(w_zp, 4, K // g, N),
          "p.scales": w_s, "p.bias": torch.zeros(N, dtype=torch.float16)}
    scheme = formats.scheme_of({"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
                                "version": "gemm"})
    out = decode(scheme, sd)
    assert set(out) == {"p.weight", "p.bias"}
    # vLLM's own values before packing, in float32 (its w_ref rounds the product to fp16 first)
    ref = (w_q - w_zp.repeat_interleave(g, 0)).float() * w_s.float().repeat_interleave(g, 0)
    torch.testing.assert_close(ref.half(), w_ref, rtol=0, atol=0)  # the same numbers, as vLLM rounds them
    torch.testing.assert_close(out["p.weight"], ref.t().to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_matches_vllm(act_order):
    q = vllm_quant()
    from vllm.scalar_type import scalar_types

    torch.manual_seed(0)
    K, N, g = 128, 64, 32
    w = torch.randn(K, N, dtype=torch.float16)
    # act-order: groups formed over the input rows in another order, rows stored in their own
    perm = torch.randperm(K) if act_order else torch.arange(K)
    w_ref, w_q, w_s = q.gptq_quantize_weights(w[perm], scalar_types.uint4b8, g)  # w_q biased by 8
    # vLLM's own values before packing, in float32 (its w_ref rounds the product to fp16 first)
    ref = (w_q - 8).float() * w_s.float().repeat_interleave(g, 0)
    torch.testing.assert_close(ref.half(), w_ref, rtol=0, atol=0)
    inv = torch.argsort(perm)
    ref, w_q, g_idx = ref[inv], w_q[inv], (inv // g).to(torch.int32)
    assert float((ref - w).norm() / w.norm()) < 0.12  # the matrix that was quantized, in its order
    zeros = torch.full((K // g, N), 7, dtype=torch.int32)  # AutoGPTQ's symmetric zero, stored minus 1
    sd = {"p.qweight": q.gptq_pack(w_q, 4, K, N), "p.qzeros": q.pack_cols(zeros, 4, K // g, N),
          "p.scales": w_s, "p.g_idx": g_idx}
    scheme = formats.scheme_of({"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": act_order,
                                "sym": True})
    out = decode(scheme, sd)
    assert set(out) == {"p.weight"}
    torch.testing.assert_close(out["p.weight"], ref.t().to(torch.bfloat16), rtol=0, atol=0)


# ---- compressed-tensors pack-quantized / int-quantized, by its own compressors ----------------------
def ct_scheme(bits: int, strategy: str, symmetric: bool, fmt: str, group: int | None = 32):
    from compressed_tensors.quantization import QuantizationScheme
    args = {"num_bits": bits, "type": "int", "strategy": strategy, "symmetric": symmetric}
    if strategy == "group":
        args["group_size"] = group
    qc = {"quant_method": "compressed-tensors", "format": fmt,
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}
    return QuantizationScheme(targets=["Linear"], weights=args), qc


def ct_compress(w, scheme, fmt: str, g_idx=None):
    """``w`` [out, in] quantized and compressed as compressed-tensors writes a module: its
    observer's scale and zero point, its compressor's tensors."""
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.compressors import BaseCompressor

    args = scheme.weights
    out, inp = w.shape
    if args.strategy == "group":
        x = w.reshape(out, inp // args.group_size, args.group_size)
        lo, hi = x.amin(-1), x.amax(-1)
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, args)
    sd = {"weight": w, "weight_scale": scale}
    if not args.symmetric:
        sd["weight_zero_point"] = zp
    if g_idx is not None:
        sd["weight_g_idx"] = g_idx
    comp = BaseCompressor.load_from_registry(fmt)
    packed = comp.compress(sd, scheme)
    return packed, comp


@pytest.mark.parametrize("bits,strategy,symmetric,fmt", [
    (4, "group", True, "pack-quantized"), (4, "group", False, "pack-quantized"),
    (4, "channel", True, "pack-quantized"), (8, "channel", True, "pack-quantized"),
    (8, "channel", True, "int-quantized")])
def test_compressed_tensors_ints_match_its_decompressor(bits, strategy, symmetric, fmt):
    torch.manual_seed(0)
    scheme, qc = ct_scheme(bits, strategy, symmetric, fmt)
    w = torch.randn(48, 128, dtype=torch.bfloat16)
    packed, comp = ct_compress(w, scheme, fmt)
    ref = comp.decompress(dict(packed), scheme)["weight"]
    out = decode(formats.scheme_of(qc), {f"l.{k}": v for k, v in packed.items()})
    assert set(out) == {"l.weight"}
    torch.testing.assert_close(out["l.weight"], ref.float().to(torch.bfloat16), rtol=0, atol=0)


# ---- detection and bad input -------------------------------------------------------------------------
@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128}, "version='gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16}}}}, "strategy='tensor_group'"),
])
def test_unsupported_schemes_are_named_with_what_is_supported(qc, named):
    with pytest.raises(InvalidInput) as e:
        formats.scheme_of(qc, "ck/config.json")
    assert e.value.message.startswith("ck/config.json: quantization_config.") and named in e.value.message
    assert "awq (GEMM packing" in e.value.message and "mxfp4" in e.value.message


def test_fp8_scales_that_disagree_with_the_block_size_are_named():
    w = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    with pytest.raises(InvalidInput, match=r"a.weight_scale_inv has shape \[4, 4\].*weight_block_size \[128, 128\]"):
        decode(fp.Fp8((128, 128)), {"a.weight": w, "a.weight_scale_inv": torch.ones(4, 4)})
    with pytest.raises(InvalidInput, match="a.weight is fp8 .* the checkpoint misses its scales"):
        decode(fp.Fp8((128, 128)), {"a.weight": w})


def test_checkpoint_reads_the_format_from_config_json(tmp_path):
    """``weights.Checkpoint``: the decoded view from the directory's config.json; a scheme that
    cannot be represented is exit 2 naming the file."""
    torch.manual_seed(0)
    w = (torch.randn(256, 128) * 10).to(torch.float8_e4m3fn)
    save_file({"a.weight": w, "a.weight_scale_inv": torch.rand(2, 1) + 0.5, "n.weight": torch.ones(4)},
              str(tmp_path / "model.safetensors"))
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                   "activation_scheme": "dynamic"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ck = weights.Checkpoint(tmp_path)
    assert ck.keys() == {"a.weight", "n.weight"} and ck.dtypes["a.weight"] == "BF16"
    assert ck.get("a.weight").dtype == torch.bfloat16 and ck.get("n.weight").dtype == torch.float32
    cfg["quantization_config"] = {"quant_method": "hqq"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidInput, match=f"{tmp_path}/config.json: quantization_config.quant_method='hqq'"):
        weights.Checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()  # no config.json: the spec's record decides; none: as stored
    assert weights.Checkpoint(tmp_path).dtypes["a.weight"] == "F8_E4M3"
    assert weights.Checkpoint(tmp_path, cfg["quantization_config"] | {"quant_method": "fp8",
                                                                      "weight_block_size": [128, 128]}
                              ).dtypes["a.weight"] == "BF16"
