"""Tiny quantized checkpoints in the producers' layouts, for the build and check tests: a random
instance of a bundle's architecture (``reference.random_model``) whose Linear weights are
quantized and written as each format stores them (config.json with its ``quantization_config``).
Packing by the producers' own code where it installs here: vLLM's ``awq_pack`` / ``gptq_pack`` /
``quantize_weights``, compressed-tensors' compressors; the FP8 and MXFP4 layouts are plain
(value, scale) pairs whose decoding ``tests/test_formats.py`` checks against transformers'."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from ttbundle import reference

#: the decoder's Linear weights (dense and per-expert), not the router, embeddings or head
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(.*\.)?[a-z_]+_proj(_with_mqa)?\.weight$")
GPT_OSS_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _fp8_blocks(w, bm: int, bn: int):
    out, inp = w.shape
    s = torch.zeros(-(-out // bm), -(-inp // bn))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].abs().max().clamp(min=1e-8) / 448
    full = s.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:out, :inp]
    return (w / full).to(torch.float8_e4m3fn), s


def _mxfp4(w):
    """``w`` [E, in, out] (GPT-OSS's layout) as MXFP4 blocks [E, out, in/32, 16] and e8m0 scales:
    random nibbles at a scale of w's magnitude (any bytes are a valid checkpoint; decoding is
    checked against transformers' in test_formats)."""
    E, K, N = w.shape
    g = torch.Generator().manual_seed(K * N)
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, generator=g)
    exp = int(torch.log2(w.abs().mean() / 2).round())
    return blocks, torch.full((E, N, K // 32), 127 + exp, dtype=torch.uint8)


def _vllm():
    from vllm.model_executor.layers.quantization.utils import quant_utils as q
    from vllm.scalar_type import scalar_types
    return q, scalar_types


def quantize(sd: dict, scheme: str, group: int = 32, seed: int = 0) -> tuple[dict, dict]:
    """``sd`` (the checkpoint's float tensors) stored as ``scheme`` writes them; returns (tensors,
    quantization_config)."""
    out, qc = {}, None
    g = torch.Generator().manual_seed(seed)
    for k, w in sd.items():
        w = w.float()
        if scheme == "mxfp4" and GPT_OSS_EXPERTS.search(k):
            out[k + "_blocks"], out[k + "_scales"] = _mxfp4(w)
            qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                      "model.layers.*.mlp.router",
                                                                      "model.embed_tokens", "lm_head"]}
            continue
        if not LINEAR.search(k) or scheme == "mxfp4":
            out[k] = w.to(torch.bfloat16)
            continue
        p = k[:-len("weight")]
        if scheme == "fp8-block":
            out[k], out[p + "weight_scale_inv"] = _fp8_blocks(w, 32, 32)
            qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
        elif scheme in ("ct-fp8-tensor", "ct-fp8-channel"):
            strat = scheme.rsplit("-", 1)[1]
            s = (w.abs().amax() if strat == "tensor" else w.abs().amax(1, keepdim=True)) / 448
            out[k], out[p + "weight_scale"] = (w / s).to(torch.float8_e4m3fn), s.reshape(-1, 1) if strat == "channel" \
                else s.reshape(1)
            out[p + "input_scale"] = torch.ones(1)  # static activation scale: dropped on read
            qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "float", "strategy": strat, "symmetric": True, "dynamic": False},
                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
                  "ignore": ["lm_head"]}
        elif scheme == "awq":
            q, st = _vllm()
            K, N = w.shape[1], w.shape[0]
            _, w_q, w_s, w_zp = q.quantize_weights(w.t().half(), st.uint4, group, zero_points=True)
            out[p + "qweight"], out[p + "qzeros"] = q.awq_pack(w_q, 4, K, N), q.awq_pack(w_zp, 4, K // group, N)
            out[p + "scales"] = w_s.half()
            qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": None}
        elif scheme in ("gptq", "gptq-act-order"):
            q, st = _vllm()
            K, N = w.shape[1], w.shape[0]
            # act-order: groups formed over the input rows in another order (GPTQ's by activation
            # size), rows stored in their own order, g_idx naming each row's group
            perm = torch.randperm(K, generator=g) if scheme == "gptq-act-order" else torch.arange(K)
            _, w_q, w_s = q.gptq_quantize_weights(w.t()[perm].half(), st.uint4b8, group)
            inv = torch.argsort(perm)
            w_q, g_idx = w_q[inv], (inv // group).to(torch.int32)
            out[p + "qweight"] = q.gptq_pack(w_q, 4, K, N)
            out[p + "qzeros"] = q.pack_cols(torch.full((K // group, N), 7, dtype=torch.int32), 4, K // group, N)
            out[p + "scales"], out[p + "g_idx"] = w_s.half(), g_idx
            qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": scheme == "gptq-act-order",
                  "sym": True, "checkpoint_format": "gptq"}
        elif scheme in ("ct-int4", "ct-int4-asym"):
            from compressed_tensors.compressors import BaseCompressor
            from compressed_tensors.quantization import QuantizationScheme
            from compressed_tensors.quantization.utils import calculate_qparams
            args = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group,
                    "symmetric": scheme == "ct-int4"}
            qs = QuantizationScheme(targets=["Linear"], weights=args)
            x = w.reshape(w.shape[0], -1, group)
            scale, zp = calculate_qparams(x.amin(-1), x.amax(-1), qs.weights)
            m = {"weight": w.to(torch.bfloat16), "weight_scale": scale.to(torch.bfloat16)}
            if scheme == "ct-int4-asym":
                m["weight_zero_point"] = zp
            for n, t in BaseCompressor.load_from_registry("pack-quantized").compress(m, qs).items():
                out[p + n] = t
            qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                  "quantization_status": "compressed", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}
        else:
            raise ValueError(scheme)
    return out, qc


def write_quantized(bundle, directory: Path, scheme: str, seed: int = 0, originals: dict | None = None) -> Path:
    """A random model of ``bundle``'s architecture saved as a ``scheme`` checkpoint (``originals``,
    if given, receives its float tensors before quantization)."""
    reference._quiet()
    model = reference.random_model(bundle, seed)
    sd = {k: v.detach().contiguous() for k, v in reference.checkpoint_state_dict(model).items()}
    if originals is not None:
        originals.update(sd)
    tensors, qc = quantize(sd, scheme, seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qc
    cfg["torch_dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory
